"""The forms TorchRL data comes in, and the flat TensorDict rows a store holds.

TorchRL's ``TensorStorage`` keeps whatever it is given: a TensorDict, a plain tensor, a
``@tensorclass`` or a pytree (dicts, lists and tuples of tensors), and hands back the same form.
A :class:`DataForm` remembers which form the first write had, turns every write into a
TensorDict of rows (``to_rows``) and turns rows read back into that form (``from_rows``):

* TensorDict: as is;
* plain tensor: the single field ``_tiered_tensor_``;
* tensorclass: its TensorDict, rebuilt into the class on the way out;
* pytree: one field per leaf, named after the leaf's path (``{"b": {"c": [x, y]}}`` gives
  ``("b", "c", "0")`` and ``("b", "c", "1")``), rebuilt with the tree's spec.

Rows may carry batch dimensions of their own (``[n, k]`` data in a 1-D storage: one trajectory
per row): the form records ``row_batch = [k]`` and restores it on reads.

Example:
    >>> import torch
    >>> form = DataForm.infer({"a": torch.zeros(3, 2), "b": [torch.ones(3)]})
    >>> rows = form.to_rows({"a": torch.zeros(3, 2), "b": [torch.ones(3)]})
    >>> sorted(str(k) for k in rows.keys(include_nested=True, leaves_only=True))
    ["('b', '0')", 'a']
    >>> out = form.from_rows(rows)
    >>> sorted(out), out["b"][0].shape
    (['a', 'b'], torch.Size([3]))
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass
from torch.utils._pytree import (
    MappingKey,
    SequenceKey,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)

from ..errors import RaggedDataError, SchemaMismatchError

__all__ = ["DataForm", "TENSOR_KEY", "flip_list", "is_key"]

#: Plain tensors (``ReplayBuffer.extend(tensor)``) are stored as the single field of this name.
TENSOR_KEY = "_tiered_tensor_"


def is_key(index: Any) -> bool:
    """Whether a ``get``/``[]`` index names a field (``"done"``, ``("next", "done")``), not rows."""
    if isinstance(index, str):
        return True
    return isinstance(index, tuple) and len(index) > 0 and all(isinstance(k, str) for k in index)


def flip_list(data: list) -> Any:
    """One element per row (``ReplayBuffer.extend(list)``) -> one batch, as TorchRL's ``_flip_list``."""
    if not data:
        raise SchemaMismatchError("an empty list holds no rows; extend with at least one element")
    first = data[0]
    try:
        if is_tensor_collection(first) or isinstance(first, torch.Tensor):
            return torch.stack(list(data))
        if isinstance(first, (int, float, bool)):
            return torch.as_tensor(data)
        return tree_map(lambda *leaves: torch.stack([torch.as_tensor(x) for x in leaves]), *data)
    except (RuntimeError, ValueError, TypeError) as e:
        raise RaggedDataError(
            f"Stacking the elements of the list resulted in an error ({e}): every element of a list "
            "passed to extend is one row, and all rows need the same tree structure and leaf shapes. "
            "Pad them, pass a compact batch as a tuple, or use ListStorage for ragged rows") from e


def _path_name(entry: Any) -> str:
    if isinstance(entry, MappingKey):
        return str(entry.key)
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    return str(entry)


class DataForm:
    """How a storage's data came in: ``kind`` plus what rebuilds it.

    Args:
        kind: ``"tensordict"``, ``"tensor"``, ``"tensorclass"`` or ``"pytree"``.
        row_batch: batch dimensions each row carries beyond the storage's own.
        cls: the tensorclass (kind ``"tensorclass"``).
        spec: the tree spec and leaf keys (kind ``"pytree"``).
    """

    def __init__(self, kind: str, row_batch: tuple[int, ...] = (), cls: type | None = None,
                 spec: Any = None, leaf_keys: list[tuple[str, ...]] | None = None):
        self.kind = kind
        self.row_batch = tuple(row_batch)
        self.cls = cls
        self.spec = spec
        self.leaf_keys = leaf_keys or []

    @classmethod
    def infer(cls, data: Any) -> DataForm:
        """The form of ``data`` (the first write)."""
        if is_tensorclass(data):
            return cls("tensorclass", cls=type(data))
        if isinstance(data, TensorDictBase):
            return cls("tensordict")
        if isinstance(data, torch.Tensor):
            return cls("tensor")
        leaves, spec = tree_flatten_with_path(data)
        if not leaves:
            raise SchemaMismatchError(f"{type(data).__name__} holds no tensor to store")
        keys = [tuple(_path_name(p) for p in path) for path, _ in leaves]
        return cls("pytree", spec=spec, leaf_keys=keys)

    # -- writes ----------------------------------------------------------------------------
    def to_rows(self, data: Any) -> TensorDictBase:
        """``data`` (this form) as a TensorDict whose batch holds the storage and row dimensions."""
        if self.kind == "tensordict":
            if not isinstance(data, TensorDictBase) or is_tensorclass(data):
                raise SchemaMismatchError(
                    f"this storage holds TensorDicts; got a {type(data).__name__}. Write the same form "
                    "every time (or empty the buffer first)")
            if isinstance(data, LazyStackedTensorDict):
                try:
                    data = data.contiguous()  # rows of a lazy stack are stored like any other rows
                except RuntimeError as e:
                    raise RaggedDataError(
                        f"a lazy stack whose tensordicts have different shapes cannot be stored as rows of "
                        f"one schema ({e}); pad them to one shape, or use TorchRL's LazyStackStorage") from e
            return data
        if self.kind == "tensorclass":
            if not is_tensorclass(data):
                raise SchemaMismatchError(
                    f"this storage holds {self.cls.__name__} tensorclasses; got a {type(data).__name__}")
            return data.to_tensordict()
        if self.kind == "tensor":
            if not isinstance(data, torch.Tensor):
                raise SchemaMismatchError(f"this storage holds plain tensors; got a {type(data).__name__}")
            return TensorDict({TENSOR_KEY: data}, batch_size=data.shape)
        leaves, spec = tree_flatten(data)
        if spec != self.spec:
            raise SchemaMismatchError(
                f"this storage holds pytrees of structure {self.spec}; got {spec}. Every write must have "
                "the same tree structure")
        leaves = [torch.as_tensor(x) for x in leaves]
        batch = _common_batch(leaves)
        return TensorDict(dict(zip(self.leaf_keys, leaves, strict=True)), batch_size=batch)

    # -- reads -----------------------------------------------------------------------------
    def from_rows(self, rows: TensorDictBase) -> Any:
        """Rows read back (a TensorDict) in this form."""
        if self.kind == "tensordict":
            return rows
        if self.kind == "tensor":
            return rows.get(TENSOR_KEY)
        if self.kind == "tensorclass":
            return self.cls.from_tensordict(rows)
        return tree_unflatten([rows.get(k) for k in self.leaf_keys], self.spec)

    # -- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "row_batch": list(self.row_batch)}
        if self.kind == "tensorclass":
            out["cls"] = f"{self.cls.__module__}:{self.cls.__qualname__}"
        if self.kind == "pytree":
            out["spec"] = treespec_dumps(self.spec)
            out["leaf_keys"] = [list(k) for k in self.leaf_keys]
        return out

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> DataForm:
        """Rebuild a form; a tensorclass is looked up among the modules already imported (a
        checkpoint never makes Python import anything)."""
        kind = o["kind"]
        tc = spec = None
        if kind == "tensorclass":
            module, _, qualname = str(o["cls"]).partition(":")
            tc = sys.modules.get(module)
            for part in qualname.split("."):
                tc = getattr(tc, part, None)
            if tc is None or not is_tensorclass(tc):
                raise SchemaMismatchError(
                    f"the checkpoint holds {o['cls']} tensorclasses; import {module} before loading it")
        if kind == "pytree":
            spec = treespec_loads(o["spec"])
        return cls(kind, tuple(o.get("row_batch", ())), tc, spec, [tuple(k) for k in o.get("leaf_keys", [])])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.spec is not None:
            state["spec"] = treespec_dumps(self.spec)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if isinstance(self.spec, str):
            self.spec = treespec_loads(self.spec)


def _common_batch(leaves: list[torch.Tensor]) -> torch.Size:
    """The longest leading shape all leaves share (a pytree's batch)."""
    shape = list(leaves[0].shape)
    for leaf in leaves[1:]:
        n = 0
        while n < min(len(shape), leaf.ndim) and shape[n] == leaf.shape[n]:
            n += 1
        shape = shape[:n]
    return torch.Size(shape)
