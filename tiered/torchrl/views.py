"""Lazy views of stored rows: what ``storage[:]`` and SliceSampler's ``storage[index]`` hand out.

A :class:`RowsView` holds the dense columns (trajectory ids, done flags, rewards) as they are and
the blob columns (frames) as :class:`LazyColumn` tensors whose bytes are decoded, for all blob
fields at once, the first time one of them is used. SliceSampler reads ``storage[:]`` and
``storage[index]`` on every sample for trajectory keys and done flags only, so no frame is decoded
for them.

The in-place writers TorchRL routes through ``storage[:]`` (``rb.set_at_``, ``rb.set_``,
``rb.update_``) write through a view to its storage: the view knows which stored rows it shows and
hands the new values to a ``write`` callback (``TieredStorage.write_fields``).

Example:
    >>> import numpy as np, torch
    >>> loader = BlobLoader(lambda: {("x",): torch.arange(6).view(2, 3)}, (2,))
    >>> col = LazyColumn(loader, ("x",), torch.Size([2, 3]), torch.int64, torch.device("cpu"))
    >>> col.shape, loader.decoded
    (torch.Size([2, 3]), False)
    >>> (col + 1)[1].tolist(), loader.decoded
    ([4, 5, 6], True)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils._pytree import tree_map

from ..schema import Key, normalize_key

__all__ = ["BlobLoader", "LazyColumn", "RowsView", "as_torch_index"]


class BlobLoader:
    """Decodes the blob fields of a fixed set of rows once, on the first access to any of them.

    Args:
        decode: returns ``{key: tensor of the rows}`` (one batched call for every blob field).
        batch_shape: the shape the rows have in the view (``[n]``, or ``[n, T]`` for ``ndim=2``).
    """

    def __init__(self, decode: Callable[[], dict[Key, torch.Tensor]], batch_shape: tuple[int, ...]):
        self._decode = decode
        self._batch_shape = tuple(batch_shape)
        self._lock = threading.Lock()
        self._value: dict[Key, torch.Tensor] | None = None

    @property
    def decoded(self) -> bool:
        """Whether the rows have been decoded."""
        return self._value is not None

    def column(self, key: Key) -> torch.Tensor:
        with self._lock:
            if self._value is None:
                self._value = self._decode()
            value = self._value[key]
            return value.reshape(*self._batch_shape, *value.shape[1:]) if value.ndim else value


# Tensor attributes answered from the wrapper's metadata; everything else decodes first.
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel,
    torch.Tensor.__len__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__,
    torch.Tensor.grad_fn.__get__, torch.Tensor.grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_sparse.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_nested.__get__, torch.Tensor.is_quantized.__get__, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.get_device,
}
_NOT_SHARED = {torch.Tensor.is_shared, torch.Tensor.is_pinned}


class LazyColumn(torch.Tensor):
    """A blob column whose shape, dtype and device are known and whose bytes are decoded on use.

    Any tensor operation (indexing, comparison, arithmetic, ``.numpy()``, ...) decodes the column
    and runs on the real tensor, returning plain tensors. Metadata reads do not decode,
    so a TensorDict of such columns can be built, inspected and indexed by key for free.
    """

    _loader: BlobLoader
    _key: Key

    @staticmethod
    def __new__(cls, loader: BlobLoader, key: Key, shape: torch.Size, dtype: torch.dtype,
                device: torch.device) -> LazyColumn:
        col = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        col._loader = loader
        col._key = key
        return col

    def materialize(self) -> torch.Tensor:
        """The decoded column (a plain tensor)."""
        return self._loader.column(self._key)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _NOT_SHARED:
            return False
        args, kwargs = tree_map(_unwrap, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return self.materialize().__reduce_ex__(protocol)


def _unwrap(x: Any) -> Any:
    return x.materialize() if isinstance(x, LazyColumn) else x


class RowsView(TensorDict):
    """What ``storage[:]`` returns: the rows in physical order, blob columns lazy.

    ``set_at_``, ``set_`` and ``update_`` on the view write through to the storage (this is how
    ``rb.set_at_``, ``rb.set_`` and ``rb.update_`` reach it) and update the view. Every other
    in-place change stays in the view. Copies made from it (``clone()``, indexing, ...) are
    ordinary TensorDicts.
    """

    def bind(self, rows: np.ndarray, write: Callable[[np.ndarray, dict[Key, torch.Tensor]], None]) -> RowsView:
        """Make writes through the view reach ``write(stored rows, {key: values})``; ``rows`` has the
        view's batch shape and holds the stored row of each element."""
        self._tiered_rows = rows
        self._tiered_write = write
        return self

    def _write_through(self, index: Any, values: dict[Key, torch.Tensor]) -> None:
        write = getattr(self, "_tiered_write", None)
        if write is None:
            return
        rows = self._tiered_rows if index is None else self._tiered_rows[_as_np_index(index)]
        nd = rows.ndim
        write(np.asarray(rows).reshape(-1), {k: v.reshape(-1, *v.shape[nd:]) for k, v in values.items()})

    def transpose(self, dim0, dim1):
        """The transposed view; writes through it still reach the storage (``ReplayBuffer`` with
        ``dim_extend`` hands out transposed views of ``ndim>1`` storages)."""
        out = super().transpose(dim0, dim1)
        rows = getattr(self, "_tiered_rows", None)
        if isinstance(out, RowsView) and rows is not None and rows.ndim >= self.batch_dims:
            d0, d1 = (d % self.batch_dims for d in (dim0, dim1))
            out.bind(np.swapaxes(rows, d0, d1), self._tiered_write)
        return out

    def __setitem__(self, index, value):
        """``view[index] = rows`` writes the rows' fields through to the storage, then into the view
        (``rb[i, j] = td`` on an ``ndim>1`` buffer routes through ``rb[:][i, j] = td``)."""
        if getattr(self, "_tiered_write", None) is None or isinstance(index, str) or (
                isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            return super().__setitem__(index, value)
        sub_shape = torch.empty(0).new_zeros(self.batch_size, dtype=torch.bool)[as_torch_index(index)].shape
        if not isinstance(value, TensorDictBase):
            value = TensorDict(value, batch_size=[])
        nd = value.batch_dims
        values = {}
        for key, leaf in value.items(include_nested=True, leaves_only=True):
            cell = self.get(key, None)
            dtype = cell.dtype if cell is not None else leaf.dtype
            values[normalize_key(key)] = torch.as_tensor(leaf, dtype=dtype).expand(*sub_shape, *leaf.shape[nd:])
        self._write_through(index, values)
        for key, v in values.items():
            cell = self.get(key, None)
            if cell is None:
                cell = v.new_zeros((*self.batch_size, *v.shape[len(sub_shape):]))
            self._replace_column(key, cell, index, v)

    def set_at_(self, key, value, index, **kwargs):
        cell = self.get(key)
        value = torch.as_tensor(value, dtype=cell.dtype)
        sub = torch.empty(0).new_zeros(self.batch_size, dtype=torch.bool)
        sub_shape = sub[as_torch_index(index)].shape
        self._write_through(index, {normalize_key(key): value.expand(*sub_shape, *cell.shape[self.batch_dims:])})
        return self._replace_column(key, cell, index, value)

    def set_(self, key, value, **kwargs):
        cell = self.get(key)
        value = torch.as_tensor(value, dtype=cell.dtype).expand(cell.shape)
        self._write_through(None, {normalize_key(key): value})
        return self._replace_column(key, cell, None, value)

    def update_(self, input_dict_or_td, clone: bool = False, *, keys_to_update=None, **kwargs):
        source = input_dict_or_td
        if not isinstance(source, TensorDictBase):
            source = TensorDict(source, batch_size=self.batch_size)
        items = dict(source.items(include_nested=True, leaves_only=True))
        if keys_to_update is not None:
            wanted = {normalize_key(k) for k in keys_to_update}
            items = {k: v for k, v in items.items() if normalize_key(k) in wanted}
        values = {}
        for key, value in items.items():
            cell = self.get(key)
            values[normalize_key(key)] = torch.as_tensor(value, dtype=cell.dtype).expand(cell.shape)
        self._write_through(None, values)
        for key, value in values.items():
            self._replace_column(key, self.get(key), None, value)
        return self

    def _replace_column(self, key, cell: torch.Tensor, index: Any, value: torch.Tensor) -> RowsView:
        new = cell.materialize().clone() if isinstance(cell, LazyColumn) else cell
        if index is None:
            new.copy_(value)
        else:
            new[as_torch_index(index)] = value
        if new is not cell:
            TensorDict.set(self, key, new)
        return self


def _as_np_index(index: Any) -> Any:
    if isinstance(index, torch.Tensor):
        return index.cpu().numpy()
    if isinstance(index, tuple):
        return tuple(_as_np_index(i) for i in index)
    return index


def as_torch_index(index: Any) -> Any:
    """``index`` with its arrays, lists and ranges as tensors on the CPU (where row numbers and
    the ``ndim>1`` grid are); a list of bools stays a mask, as torch reads it.

    Example:
        >>> as_torch_index((np.array([2, 0]), [True, False], range(2)))
        (tensor([2, 0]), tensor([ True, False]), tensor([0, 1]))
    """
    if isinstance(index, torch.Tensor):
        return index.cpu()
    if isinstance(index, np.ndarray):
        return torch.from_numpy(index)
    if isinstance(index, tuple):
        return tuple(as_torch_index(i) for i in index)
    if isinstance(index, (list, range)):
        array = np.asarray(index)
        return torch.from_numpy(array if array.dtype == bool else array.astype(np.int64))
    return index
