"""TieredStorage: a TorchRL replay-buffer storage backed by a :class:`~tiered.TieredStore`.

A drop-in for ``LazyTensorStorage``, ``LazyMemmapStorage`` and ``CompressedListStorage``:
frames are stored compressed (and deduplicated) by the store, everything else about the
replay buffer (samplers, writers, priorities, ``dumps``/``loads``) is TorchRL's own. The
adapter is thin: all work happens in :class:`~tiered.TieredStore`, whose ``get(index, keys=...)``
it calls and whose length counter it shares.

``torchrl`` is an optional extra (``pip install 'tiered[torchrl]'``); this module imports it.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import TensorDictReplayBuffer
    >>> from tiered.torchrl import TieredStorage
    >>> rb = TensorDictReplayBuffer(storage=TieredStorage(1000, frames={"observation": 0}), batch_size=8)
    >>> td = TensorDict({
    ...     "observation": torch.randint(0, 4, (64, 4, 84, 84), dtype=torch.uint8),
    ...     "action": torch.arange(64),
    ... }, batch_size=[64])
    >>> _ = rb.extend(td)
    >>> rb.sample()["observation"].shape
    torch.Size([8, 4, 84, 84])
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from torch.utils._pytree import tree_map

try:
    from torchrl._utils import _make_ordinal_device
    from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
    from torchrl.data.replay_buffers.storages import Storage, TensorStorage
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tiered.torchrl needs TorchRL: pip install 'tiered[torchrl]' (torchrl>=0.9)") from e

from .engine.manifest import MANIFEST
from .errors import InvalidArgumentError, ReadOnlyStoreError
from .schema import Key
from .store import TieredStore, as_row_array

__all__ = ["TieredStorage", "TieredStorageCheckpointer"]

# TorchRL's per-row bookkeeping entry: the row's own position (see TieredStorage._to_rows).
_INDEX_KEY = "index"
# Plain tensors (ReplayBuffer.extend(tensor)) are stored as the single field of this name.
_TENSOR_KEY = "_tiered_tensor_"
# Name of the adapter's own metadata file inside a dumps() directory, and of the store in it.
_META_FILE = "tiered_storage.json"
_STORE_DIR = "store"
_CKPT_FORMAT = "tiered.torchrl.TieredStorage"
_CKPT_VERSION = 1
# Decoded bytes per chunk when rows are copied between stores (dumps/loads of in-memory stores):
# bounds the temporary memory while keeping each get/set call batched.
_COPY_CHUNK_BYTES = 256 * 2**20


# ----------------------------------------------------------------------------------------
# Lazy blob columns: what storage[:] and SliceSampler's storage[index] hand out
# ----------------------------------------------------------------------------------------
class _BlobLoader:
    """Decodes the blob fields of a fixed set of rows once, on the first access to any of them."""

    def __init__(self, store: TieredStore, rows: np.ndarray, keys: list[Key]):
        self._store = store
        self._rows = rows
        self._keys = keys
        self._lock = threading.Lock()
        self._value: TensorDictBase | None = None

    def column(self, key: Key) -> torch.Tensor:
        with self._lock:
            if self._value is None:
                # one batched decode for every blob field (they usually share frames)
                self._value = self._store.get(self._rows, keys=self._keys)
            return self._value.get(key)


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


class _LazyColumn(torch.Tensor):
    """A blob column whose shape, dtype and device are known and whose bytes are decoded on use.

    Any tensor operation (indexing, comparison, arithmetic, ``.numpy()``, ...) decodes the column
    and runs on the real tensor, returning plain tensors. Metadata reads do not decode,
    so a TensorDict of such columns can be built, inspected and indexed by key for free.
    """

    _loader: _BlobLoader
    _key: Key

    @staticmethod
    def __new__(cls, loader: _BlobLoader, key: Key, shape: torch.Size, dtype: torch.dtype,
                device: torch.device) -> _LazyColumn:
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
    return x.materialize() if isinstance(x, _LazyColumn) else x


class _RowsView(TensorDict):
    """What ``storage[:]`` returns: the rows in physical order, blob columns lazy.

    Its blob columns are lazy decodes (writes into them never reach the storage), while its
    dense columns may be views of the store's columns; an in-place write through it would
    change part of a row only, or nothing. So the in-place writers TorchRL routes through
    ``storage[:]`` (``rb.set_at_``, ``rb.set_``, ``rb.update_``) raise instead. Copies made from it (``clone()``,
    indexing, ...) are ordinary TensorDicts in behaviour.
    """

    _tiered_view = False

    def _refuse(self, name: str) -> None:
        raise NotImplementedError(
            f"TieredStorage: rb[:] / storage[:] is a read view of compressed rows, so {name}() on it "
            "cannot write through to the storage (rb.set_at_, rb.set_ and rb.update_ are not supported). "
            "Write whole rows instead: rb[index] = td (or storage.set(index, td, set_cursor=False)).")

    def set_at_(self, *args: Any, **kwargs: Any):
        if self._tiered_view:
            self._refuse("set_at_")
        return super().set_at_(*args, **kwargs)

    def set_(self, *args: Any, **kwargs: Any):
        if self._tiered_view:
            self._refuse("set_")
        return super().set_(*args, **kwargs)

    def update_(self, *args: Any, **kwargs: Any):
        if self._tiered_view:
            self._refuse("update_")
        return super().update_(*args, **kwargs)


# ----------------------------------------------------------------------------------------
# Index helpers
# ----------------------------------------------------------------------------------------
def _wrap_negative(rows: np.ndarray, n: int, what: str) -> np.ndarray:
    bad = (rows < -n) | (rows >= n)
    if bad.any():
        raise IndexError(f"index {int(rows[bad][0])} is out of range for a storage of {what} {n}")
    return np.where(rows < 0, rows + n, rows)


# ----------------------------------------------------------------------------------------
# The storage
# ----------------------------------------------------------------------------------------
# Keywords of TorchRL's storages that TieredStorage does not take, and what to write instead
# (users swap LazyMemmapStorage(n, scratch_dir=...) for TieredStorage(n, ...) and keep the rest).
_TORCHRL_ONLY_KEYWORDS = {
    "scratch_dir": "pass the directory as path=DIR (TieredStorage(max_size, path=DIR)): the store "
    "lives there and survives the process",
    "existsok": "path= opens the store already in that directory (mode='r+') and creates one otherwise",
    "auto_cleanup": "a store at path= is kept: remove its directory when done, or leave path=None "
    "to keep the store in memory",
    "cleanup_memmap": "a store at path= is kept: remove its directory when done, or leave path=None "
    "to keep the store in memory",
    "shared_init": "other processes read the store by path (tiered.open(path, mode='r')) or by pickling "
    "the storage",
    "consolidated": "rows are stored compressed per field; there is nothing to consolidate",
    "compression_fn": "choose the codec with codec= (e.g. codec='zstd:9' or 'lz4')",
    "decompression_fn": "choose the codec with codec= (e.g. codec='zstd:9' or 'lz4')",
    "compression_level": "choose the codec with codec= (e.g. codec='zstd:9' or 'lz4')",
}


def _check_storage_keywords(store_options: dict[str, Any]) -> None:
    """Refuse TorchRL storage keywords TieredStorage does not take, saying what to use instead."""
    for name in store_options.keys() & _TORCHRL_ONLY_KEYWORDS.keys():
        raise InvalidArgumentError(
            f"TieredStorage does not take {name}= (a keyword of TorchRL's "
            f"{'CompressedListStorage' if 'compress' in name else 'LazyMemmapStorage/LazyTensorStorage'}): "
            f"{_TORCHRL_ONLY_KEYWORDS[name]}")
    unknown = store_options.keys() - inspect.signature(TieredStore).parameters.keys()
    if unknown:
        raise InvalidArgumentError(
            f"TieredStorage got unknown keyword(s) {', '.join(sorted(unknown))}; it takes max_size, path, "
            "device, mode, checkpointer and TieredStore's options "
            f"({', '.join(p for p in inspect.signature(TieredStore).parameters if p not in ('capacity', 'path', 'device'))})")


class TieredStorage(TensorStorage):
    """A TorchRL storage whose rows live in a compressed, tiered :class:`~tiered.TieredStore`.

    It is a ``TensorStorage`` (so TorchRL picks the identity collate function, and SliceSampler's
    ``end_key`` fallback, ``Sequence`` sample units and sample consumption accept it), 1-D, and
    works with ``ReplayBuffer``, ``TensorDictReplayBuffer`` and
    ``TensorDictPrioritizedReplayBuffer`` and every sampler and writer of TorchRL.

    Args:
        max_size: number of rows (the store's capacity). May be ``None`` when ``path`` holds an
            existing store, whose capacity is then used.
        path: a directory for the store. A new directory (or one without a store) creates a
            durable store there; a directory holding a store opens it (see ``mode``). ``None``
            keeps everything in memory.

    Keyword Args:
        device: where sampled data is returned (the store's ``device``). Default ``"cpu"``.
        mode: for an existing store at ``path``: ``"r+"`` (default; read and write) or ``"r"``
            (read-only, e.g. an offline dataset; any number of readers).
        checkpointer: TorchRL checkpointer; default :class:`TieredStorageCheckpointer`, which writes
            the tiered store format.
        **store_options: passed to :class:`~tiered.TieredStore` unchanged (``frames``,
            ``chunk_frames``, ``codec``, ``warm_bytes``, ``hot_bytes``, ``dedup``, ...).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import ReplayBuffer, SliceSampler
        >>> from tiered.torchrl import TieredStorage
        >>> rb = ReplayBuffer(storage=TieredStorage(100), sampler=SliceSampler(slice_len=4), batch_size=8)
        >>> td = TensorDict({"observation": torch.zeros(20, 64, 64, dtype=torch.uint8),
        ...                  "episode": torch.arange(20) // 10}, batch_size=[20])
        >>> _ = rb.extend(td)
        >>> rb.sample()["episode"].shape
        torch.Size([8])
    """

    _default_checkpointer = None  # set below, after TieredStorageCheckpointer is defined
    # TorchRL's update_if_present patches leaves of `_storage` in place; rows here are compressed.
    supports_conditional_update = False
    _storage = None

    def __init__(
        self,
        max_size: int | None = None,
        path: str | os.PathLike | None = None,
        *,
        device: str | torch.device = "cpu",
        mode: str | None = None,
        checkpointer: StorageCheckpointerBase | None = None,
        ndim: int = 1,
        compilable: bool = False,
        **store_options: Any,
    ):
        _check_storage_keywords(store_options)
        if ndim != 1:
            raise ValueError(f"TieredStorage is 1-D (one row per transition); got ndim={ndim}")
        if compilable:
            raise ValueError("TieredStorage cannot be compiled (Python decodes rows); use compilable=False")
        if device == "auto":
            raise ValueError("TieredStorage needs an explicit device (e.g. 'cpu' or 'cuda'), not 'auto'")
        existing = path is not None and os.path.exists(os.path.join(os.fspath(path), MANIFEST))
        if existing:
            store = TieredStore.open(path, mode=mode or "r+", device=device, **store_options)
            if max_size is not None and int(max_size) != store.capacity:
                cap = store.capacity
                store.close()
                raise ValueError(
                    f"the store at {os.fspath(path)!r} has capacity {cap} but max_size={max_size}; "
                    f"pass max_size={cap} (or None) to open it")
        else:
            if mode == "r":
                raise FileNotFoundError(f"mode='r' opens an existing store; {os.fspath(path)!r} holds none")
            if max_size is None:
                raise ValueError("max_size is needed to create a new store")
            store = TieredStore(int(max_size), path, device=device, **store_options)
        self._setup(store, checkpointer)

    @classmethod
    def from_store(
        cls,
        store: TieredStore,
        *,
        checkpointer: StorageCheckpointerBase | None = None,
    ) -> TieredStorage:
        """Wrap an existing store (e.g. an offline dataset opened with ``tiered.open(path)``).

        The storage shares the store's rows and length; a read-only store gives a read-only
        storage (writes raise :class:`~tiered.errors.ReadOnlyStoreError`).

        Example:
            >>> import tiered
            >>> from torchrl.data import TensorDictReplayBuffer, SliceSampler
            >>> store = tiered.open("pong.tiered", mode="r")  # doctest: +SKIP
            >>> rb = TensorDictReplayBuffer(storage=TieredStorage.from_store(store),
            ...     sampler=SliceSampler(slice_len=8), batch_size=64)  # doctest: +SKIP
            >>> rb.sample()["observation"].shape  # doctest: +SKIP
            torch.Size([64, 4, 84, 84])
        """
        self = cls.__new__(cls)
        self._setup(store, checkpointer)
        return self

    def _setup(self, store: TieredStore, checkpointer: StorageCheckpointerBase | None) -> None:
        self._store = store
        Storage.__init__(self, store.capacity, checkpointer=checkpointer, compilable=False)
        self.ndim = 1
        self.device = _make_ordinal_device(torch.device(store.device))
        self._last_cursor = None
        self.__dict__["_storage_keys"] = None
        # Whether a writer has written TorchRL's "index" entry (see _to_rows).
        self._has_index = False
        if len(store):
            # an opened store: the last row written precedes the store's cursor (SliceSampler uses
            # it to cut trajectories at the ring seam)
            self._set_last_cursor(int((store.cursor - 1) % store.capacity))

    # -- the store -----------------------------------------------------------------------------
    @property
    def store(self) -> TieredStore:
        """The :class:`~tiered.TieredStore` holding the rows."""
        return self._store

    def stats(self) -> dict[str, Any]:
        """The store's :meth:`~tiered.TieredStore.stats`."""
        return self._store.stats()

    def flush(self) -> None:
        """Compress pending frames and, with a path, commit durably (:meth:`TieredStore.flush`)."""
        self._store.flush()

    def close(self) -> None:
        """Close the store (flushing a store with a path)."""
        self._store.close()

    # -- length, shape, state that TorchRL reads -------------------------------------------------
    @property
    def _len(self) -> int:
        # TorchRL writes `_len` directly (writers' write_at, checkpointers); the store's counter
        # is the only one, so both always agree.
        return len(self._store)

    @_len.setter
    def _len(self, value: int) -> None:
        self._store.set_length(int(value))

    @property
    def initialized(self) -> bool:
        """Whether the first write has fixed the store's schema."""
        return self._store.schema is not None

    @initialized.setter
    def initialized(self, value: bool) -> None:
        # TorchRL's TensorStorage assigns this; here it is derived from the store's schema.
        pass

    @property
    def _tensor_mode(self) -> bool:
        schema = self._store.schema
        return schema is not None and len(schema) == 1 and next(iter(schema)) == (_TENSOR_KEY,)

    @property
    def _total_shape(self) -> torch.Size | None:
        return torch.Size([self.max_size]) if self.initialized else None

    @property
    def shape(self) -> torch.Size:
        """``[len]`` until the storage is full, then ``[max_size]``."""
        return torch.Size([len(self)])

    def __len__(self) -> int:
        return len(self._store)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(max_size={self.max_size}, len={len(self)}, device={self.device}, "
                f"store={self._store!r})")

    # -- writing ---------------------------------------------------------------------------------
    def _to_rows(self, data: Any, scalar: bool, n_rows: int) -> TensorDictBase:
        """Bring TorchRL's data forms to a TensorDict of batch ``[n_rows]`` (``[]`` stays ``[]``
        for one row at a scalar index: the store stages it without a copy of the whole row)."""
        if isinstance(data, list):
            # ReplayBuffer.extend(list) hands over one element per row
            data = torch.stack([d if isinstance(d, torch.Tensor) or is_tensor_collection(d)
                                else torch.as_tensor(d) for d in data])
        if isinstance(data, torch.Tensor):
            if self.initialized and not self._tensor_mode:
                raise TypeError("this TieredStorage holds TensorDicts; got a plain tensor")
            td = TensorDict({_TENSOR_KEY: data}, batch_size=data.shape[:0 if scalar else 1])
        elif isinstance(data, TensorDictBase):
            td = data
        elif is_tensor_collection(data):
            raise TypeError(
                f"TieredStorage stores TensorDicts and tensors; got a {type(data).__name__} "
                "(tensorclass): write data.to_tensordict() and rebuild the class from samples")
        else:
            raise TypeError(
                f"TieredStorage stores TensorDicts and tensors; got a {type(data).__name__}. Pack pytrees "
                "into a TensorDict (TensorDict(dict, batch_size=[n])) first")
        if _INDEX_KEY in td.keys():
            # TorchRL's writers (TensorDictRoundRobinWriter, MaxValueWriter.add, write_at) store each
            # row's own position under "index", and only some writes carry it. It is not stored:
            # reads reproduce it from the row positions once a write has carried it.
            td = td.exclude(_INDEX_KEY)
            self._has_index = True
        if scalar and td.batch_dims == 0:
            return td
        if td.batch_dims != 1:
            raise ValueError(f"expected data with batch_size [n] ([] for one row), got {list(td.batch_size)}")
        if td.batch_size[0] != n_rows:
            if td.batch_size[0] != 1:
                raise ValueError(f"the index names {n_rows} rows but the data has {td.batch_size[0]}")
            td = td.expand(n_rows).clone()  # broadcast one row, as TensorDict assignment does
        return td

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write rows at ``cursor`` (int, 0-d/1-D tensor on any device, slice, range, list, 1-tuple).

        With ``set_cursor=True`` (writers' ``add``/``extend``) the last cursor is recorded and the
        length grows as TorchRL's ``TensorStorage`` grows it; with ``set_cursor=False``
        (``rb[i] = ...``, ``write_at``) the length does not change. The mutation revision goes up
        once per call.
        """
        if set_cursor:
            self._set_last_cursor(cursor)
        if isinstance(cursor, slice):
            rows, scalar = np.arange(*cursor.indices(self.max_size), dtype=np.int64), False
        else:
            rows, scalar = as_row_array(cursor)
        rows = _wrap_negative(rows, self.max_size, "max_size")
        td = self._to_rows(data, scalar, rows.size)
        store = self._store
        with store.locked():  # readers never see the length between the write and TorchRL's rule
            # TorchRL's TensorStorage._get_new_len: with set_cursor the length grows by the rows
            # written; without it (rb[i] = ..., write_at) it does not change
            old_len = len(store)
            new_len = min(old_len + (1 if scalar else rows.size), self.max_size) if set_cursor else old_len
            store.set(int(rows[0]) if td.batch_dims == 0 else rows, td, length=new_len)
            if set_cursor and rows.size:
                store.cursor = int((rows[-1] + 1) % self.max_size)
        self._bump_mutation_revision()

    def _empty(self) -> None:
        self._store.clear()
        self._set_last_cursor(None)
        self._bump_mutation_revision()

    # -- reading ---------------------------------------------------------------------------------
    def _check_initialized(self) -> None:
        if not self.initialized:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")

    def get(self, index: Any) -> TensorDictBase | torch.Tensor:
        """Read rows, decoded in one batched call (a slice returns a lazy view, see ``__getitem__``).

        Args:
            index: an int (no batch dimension), a 1-D tensor/array/list, a 1-tuple of one (as
                TorchRL's slice samplers produce), a range or a slice (physical row order).

        Returns:
            A TensorDict of batch size ``[n]`` (a tensor for tensor data) on ``device``.
        """
        self._check_initialized()
        if isinstance(index, slice):
            return self._lazy_rows(index)
        if self._tensor_mode:
            return self._store.get(index).get(_TENSOR_KEY)
        # the store adds the row positions it resolved: no second pass over the index here
        return self._store.get(index, index_key=_INDEX_KEY if self._has_index else None)

    def __getitem__(self, index: Any) -> TensorDictBase | torch.Tensor:
        """Like :meth:`get`, but slices and 1-tuples (how TorchRL's samplers read) return lazy views.

        A lazy view holds the dense columns (trajectory ids, done flags, rewards, ...) and decodes
        its blob columns (frames) only when one of them is used, in one batched call. SliceSampler
        reads ``storage[:]`` and ``storage[index]`` on every sample for trajectory keys and done
        flags only, so no frame is decoded for them. The blob columns of a view read the rows'
        contents when first used, like the views ``LazyTensorStorage`` returns for slices.
        """
        if isinstance(index, (slice, tuple)):
            self._check_initialized()
            return self._lazy_rows(index)
        return self.get(index)

    def _lazy_rows(self, index: slice | tuple) -> TensorDictBase | torch.Tensor:
        store = self._store
        rows = store.rows_of(index)  # the store resolves and checks the index, as for get
        if self._tensor_mode:
            return store.get(rows).get(_TENSOR_KEY)
        schema = store.schema
        # a slice reads dense columns as views (no per-sample copy that grows with the buffer);
        # the store adds TorchRL's "index" column from the same rows
        dense = store.get(index if isinstance(index, slice) else rows, keys=[f.key for f in schema.dense_fields],
                          index_key=_INDEX_KEY if self._has_index else None, copy=False)
        columns: dict[Key | str, torch.Tensor] = {}
        blob = schema.blob_fields
        loader = _BlobLoader(store, rows, [f.key for f in blob]) if blob else None
        for f in schema.values():  # the schema's key order, as a decoded get has
            if f.kind == "dense":
                columns[f.key] = dense.get(f.key)
            else:
                columns[f.key] = _LazyColumn(loader, f.key, torch.Size([rows.size, *f.shape]), f.dtype,
                                             store.device)
        if self._has_index:
            columns[_INDEX_KEY] = dense.get(_INDEX_KEY)
        view = _RowsView(batch_size=[rows.size], device=dense.device)
        for key, value in columns.items():
            view.set(key, value)
        view._tiered_view = True
        return view

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The storage as the bytes of a tiered store directory (compressed; fresh copies).

        Returns:
            ``{"format", "meta", "files": {relative path: uint8 tensor}}``; ``torch.save``-able.
        """
        with tempfile.TemporaryDirectory(prefix="tiered-sd-") as tmp:
            meta = _write_checkpoint(self, Path(tmp))
            files = {}
            for root, _, names in os.walk(tmp):
                for name in names:
                    full = os.path.join(root, name)
                    rel = os.path.relpath(full, tmp)
                    files[rel] = torch.from_numpy(np.fromfile(full, dtype=np.uint8))
        return {"format": _CKPT_FORMAT, "meta": meta, "files": files}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the rows with those of :meth:`state_dict` (copied; nothing is aliased)."""
        if state_dict.get("format") != _CKPT_FORMAT:
            raise ValueError(
                f"not a TieredStorage state dict (format {state_dict.get('format')!r}, expected "
                f"{_CKPT_FORMAT!r}); state dicts of TorchRL's storages cannot be loaded into a TieredStorage")
        with tempfile.TemporaryDirectory(prefix="tiered-sd-") as tmp:
            for rel, tensor in state_dict["files"].items():
                dest = os.path.join(tmp, rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                tensor.detach().cpu().contiguous().numpy().tofile(dest)
            _read_checkpoint(self, Path(tmp))
        self._bump_mutation_revision()

    def __getstate__(self) -> dict[str, Any]:
        # Storage's version handles the shared counters; the store pickles itself (a store with a
        # path is flushed and travels as "reopen read-only"; file handles are not pickled).
        return Storage.__getstate__(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        Storage.__setstate__(self, state)


# ----------------------------------------------------------------------------------------
# Checkpointing (rb.dumps / rb.loads, state_dict)
# ----------------------------------------------------------------------------------------
class TieredStorageCheckpointer(StorageCheckpointerBase):
    """Writes a :class:`TieredStorage` as a tiered store directory (docs/format.md).

    ``dumps(storage, path)`` writes ``path/store/`` (a store any ``tiered.open`` reads) and
    ``path/tiered_storage.json`` (length, last cursor). A store with a path is flushed and its
    directory copied; an in-memory store is copied into a new store directory in batches of rows.
    ``loads`` accepts such a directory, and also a ``LazyTensorStorage``/``LazyMemmapStorage``
    checkpoint (TorchRL's memmap format), so buffers can migrate.

    Save hooks get the rows (a lazy view in physical order) with ``shift`` and ``is_full`` set
    and must return them, or a TensorDict of the same length to write instead. Load hooks get the
    loaded rows and return the rows to write.

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import TensorDictReplayBuffer
        >>> rb = TensorDictReplayBuffer(storage=TieredStorage(100))
        >>> _ = rb.extend(TensorDict({"pixels": torch.ones(10, 64, 64, dtype=torch.uint8)}, batch_size=[10]))
        >>> with tempfile.TemporaryDirectory() as ckpt:
        ...     rb.dumps(ckpt)
        ...     rb2 = TensorDictReplayBuffer(storage=TieredStorage(100))
        ...     rb2.loads(ckpt)
        >>> len(rb2), bool((rb2[:]["pixels"] == 1).all())
        (10, True)
    """

    def _set_hooks_shift_is_full(self, storage: TieredStorage) -> None:
        # TorchRL's version fails on list/tuple cursors and counts one past a slice's stop; the
        # shared last-cursor index is exact for every cursor form.
        last = storage._last_cursor_index
        shift = 0 if last is None else int(last) + 1
        for hook in self._save_hooks:
            if hasattr(hook, "is_full"):
                hook.is_full = storage._is_full
            if hasattr(hook, "shift"):
                hook.shift = shift

    def dumps(self, storage: TieredStorage, path: str | os.PathLike) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        source = None
        if self._save_hooks:
            self._set_hooks_shift_is_full(storage)
            data = storage[:] if storage.initialized else None
            out = data
            for hook in self._save_hooks:
                out = hook(out, path=path)
            if out is not data:
                if not isinstance(out, TensorDictBase) or out.batch_size[:1] != torch.Size([len(storage)]):
                    raise TypeError(
                        "a save hook of TieredStorage must return the rows it was given, or a TensorDict "
                        f"of {len(storage)} rows to write instead; got {type(out).__name__}. Format-changing "
                        "hooks (TED2Flat, H5Split) need TorchRL's own checkpointers and storages")
                source = out
        _write_checkpoint(storage, path, source)

    def loads(self, storage: TieredStorage, path: str | os.PathLike) -> None:
        _read_checkpoint(storage, Path(path), self._load_hooks)


TieredStorage._default_checkpointer = TieredStorageCheckpointer


def _row_nbytes(schema) -> int:
    return sum(f.cell_nbytes for f in schema.values()) if schema is not None else 1


def _copy_rows(get, dst: TieredStore, n: int, row_nbytes: int) -> None:
    """Copy rows ``0..n-1`` from ``get(lo, hi)`` into ``dst`` in batched chunks."""
    step = max(1, _COPY_CHUNK_BYTES // max(1, row_nbytes))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        td = get(lo, hi)
        if _INDEX_KEY in td.keys():
            td = td.exclude(_INDEX_KEY)  # reproduced from row positions, never stored
        dst.set(np.arange(lo, hi, dtype=np.int64), td)


def _ignore_locks(directory: str, names: list[str]) -> list[str]:
    # a copied lock file would make the copy look held by this process's writer
    return [n for n in names if n.endswith(".lock") or n == "lock"]


def _write_checkpoint(storage: TieredStorage, path: Path, source: TensorDictBase | None = None) -> dict:
    """Write ``path/store`` and ``path/tiered_storage.json``; return the metadata written."""
    store = storage._store
    meta_file = path / _META_FILE
    if meta_file.exists():
        meta_file.unlink()  # a directory without it is never mistaken for a complete checkpoint
    dst_dir = path / _STORE_DIR
    n = len(storage)
    own = store.path is not None and os.path.abspath(store.path) == os.path.abspath(dst_dir)
    if own:
        store.flush()
    elif storage.initialized or source is not None:
        if dst_dir.exists():
            shutil.rmtree(dst_dir)
        if source is None and store.path is not None:
            try:
                store.flush()
            except ReadOnlyStoreError:
                pass  # a read-only store has nothing unflushed
            shutil.copytree(store.path, dst_dir, ignore=_ignore_locks)
        else:
            # TODO(store): `store.save(path)` writing the compressed blobs as they are would replace
            # this decode/re-encode of every row.
            # budgets 0: the copy goes straight to its cold tier, without caching blobs in memory
            dst = TieredStore(store.capacity, dst_dir, warm_bytes=0, hot_bytes=0, **store.options)
            try:
                if source is not None:
                    _copy_rows(lambda lo, hi: source[lo:hi], dst, n, _row_nbytes(store.schema))
                else:
                    _copy_rows(lambda lo, hi: store.get(range(lo, hi)), dst, n, _row_nbytes(store.schema))
                dst.cursor = store.cursor
                dst.flush()
            finally:
                dst.close()
    elif dst_dir.exists():
        shutil.rmtree(dst_dir)
    meta = {
        "format": _CKPT_FORMAT,
        "version": _CKPT_VERSION,
        "len": n,
        "max_size": storage.max_size,
        "cursor": store.cursor,
        "last_cursor": storage._last_cursor_index,
        "initialized": storage.initialized or source is not None,
        "tensor_mode": storage._tensor_mode,
        "has_index": storage._has_index or (source is not None and _INDEX_KEY in source.keys()),
        "store": _STORE_DIR,
    }
    tmp = meta_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, meta_file)
    return meta


def _read_checkpoint(storage: TieredStorage, path: Path, load_hooks: list | None = None) -> None:
    """Load the rows of a checkpoint directory into ``storage`` (copying them into its store)."""
    meta_file = path / _META_FILE
    if not meta_file.exists():
        if (path / "storage_metadata.json").exists():
            return _read_torchrl_memmap(storage, path, load_hooks)
        raise FileNotFoundError(
            f"{path} is not a TieredStorage checkpoint: {_META_FILE} is missing (was the dump interrupted, "
            "or written by another storage?)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != _CKPT_FORMAT or meta.get("version") != _CKPT_VERSION:
        raise ValueError(f"{meta_file}: unknown checkpoint format {meta.get('format')!r} "
                         f"version {meta.get('version')!r}; this tiered reads version {_CKPT_VERSION}")
    n = int(meta["len"])
    if n > storage.max_size:
        raise ValueError(f"the checkpoint at {path} holds {n} rows but the storage's max_size is "
                         f"{storage.max_size}; create TieredStorage({meta['max_size']}) to load it")
    dst = storage._store
    if meta["initialized"] and n:


        src = TieredStore.open(path / meta["store"], mode="r", warm_bytes=0, hot_bytes=0)
        try:
            _load_rows(storage, lambda lo, hi: src.get(range(lo, hi)), n, _row_nbytes(src.schema), load_hooks)
        finally:
            src.close()
    with dst.locked():
        storage._len = n  # the store's length counter
        dst.cursor = int(meta["cursor"]) % storage.max_size
    storage._set_last_cursor(meta["last_cursor"])
    storage._has_index = bool(meta.get("has_index", False))
    if dst.path is not None and n:
        dst.flush()


def _load_rows(storage: TieredStorage, get, n: int, row_nbytes: int, load_hooks: list | None) -> None:
    dst = storage._store
    if load_hooks:
        data = get(0, n)
        for hook in load_hooks:
            data = hook(data, out=None)
        get = lambda lo, hi: data[lo:hi]  # noqa: E731
    _copy_rows(get, dst, n, row_nbytes)


def _read_torchrl_memmap(storage: TieredStorage, path: Path, load_hooks: list | None) -> None:
    """Import a ``TensorStorageCheckpointer`` directory (LazyTensorStorage/LazyMemmapStorage dumps)."""
    meta = json.loads((path / "storage_metadata.json").read_text())
    if meta.get("is_pytree"):
        raise ValueError(f"{path} holds a pytree TensorStorage checkpoint; only TensorDict ones are imported")
    n = int(meta["len"])
    if n > storage.max_size:
        raise ValueError(f"the checkpoint at {path} holds {n} rows but max_size is {storage.max_size}")
    td = TensorDict.load_memmap(path)
    storage._has_index = _INDEX_KEY in td.keys()
    row_nbytes = sum(v[0].numel() * v.element_size() for v in td.values(True, True)) if td.numel() else 1
    _load_rows(storage, lambda lo, hi: td[lo:hi], n, row_nbytes, load_hooks)
    with storage._store.locked():
        storage._len = n  # the store's length counter
        storage._store.cursor = n % storage.max_size
    # a full buffer's last write position is in the writer's checkpoint, not the storage's
    storage._set_last_cursor(n - 1 if 0 < n < storage.max_size else None)
    if storage._store.path is not None and n:
        storage._store.flush()
