"""TieredStorage: a TorchRL ``TensorStorage`` whose rows live in a :class:`~tiered.TieredStore`.

The adapter turns what TorchRL hands a storage (TensorDicts, tensors, tensorclasses, pytrees;
int, tensor, slice and tuple indices; ``ndim>1`` grids) into store rows and back
(:mod:`tiered.torchrl.forms`), keeps fields that appear after the first write beside the store
(:mod:`tiered.torchrl.columns`), and hands out lazy views (:mod:`tiered.torchrl.views`).
Checkpointing is in :mod:`tiered.torchrl.checkpoint`.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ReplayBuffer
    >>> storage = TieredStorage(100)
    >>> rb = ReplayBuffer(storage=storage, batch_size=4)
    >>> _ = rb.extend({"a": torch.arange(10), "b": {"c": torch.ones(10, 2)}})
    >>> sorted(rb.sample())
    ['a', 'b']
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import weakref
from functools import partial
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from torch.utils._pytree import tree_map

# (without torchrl, the package's __init__ has already refused, naming the install command)
from torchrl._utils import _make_ordinal_device
from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
from torchrl.data.replay_buffers.samplers import PrioritizedSampler
from torchrl.data.replay_buffers.storages import Storage, TensorStorage

from ..durable.manifest import MANIFEST
from ..engine.priorities import checked_row_priorities
from ..engine.rows import as_mask
from ..errors import (
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidPriorityError,
    NotSharedError,
    SchemaMismatchError,
    TieredError,
)
from ..schema import Key, normalize_key
from ..store import TieredStore, as_row_array
from .checkpoint import TieredStorageCheckpointer, dumps_with, loads_with
from .columns import SideColumns
from .forms import TENSOR_KEY, DataForm, flip_list, is_key
from .views import BlobLoader, LazyColumn, RowsView, as_torch_index

__all__ = ["TieredStorage"]


# Keywords of TorchRL's storages that TieredStorage does not take, and what to write instead
# (users swap LazyMemmapStorage(n, scratch_dir=...) for TieredStorage(n, ...) and keep the rest).
_TORCHRL_ONLY_KEYWORDS = {
    "scratch_dir": "without a path the store already spills to a temporary directory once its memory "
    "budgets are full; pass spill_dir=DIR to put that directory under DIR (removed on close and at exit), "
    "or path=DIR for a durable store that lives in DIR and survives the process",
    "existsok": "path= opens the store already in that directory (mode='r+') and creates one otherwise",
    "auto_cleanup": "a store at path= is kept: remove its directory when done, or leave path=None "
    "to keep the store in memory",
    "cleanup_memmap": "a store at path= is kept: remove its directory when done, or leave path=None "
    "to keep the store in memory",
    "shared_init": "give the storage a path (TieredStorage(max_size, path=DIR)): it is then shared with the "
    "processes it goes to, and any of them may write first",
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
            "device, mode, checkpointer, ndim, compilable and TieredStore's options "
            f"({', '.join(p for p in inspect.signature(TieredStore).parameters if p not in ('capacity', 'path', 'device'))})")


# Storages with a path whose store goes shared when the process forks (see
# TieredStorage.share_with_children)
_AUTO_SHARED: weakref.WeakSet = weakref.WeakSet()


def _share_before_fork() -> None:
    """Before a ``fork``: share the path stores of this process's storages (``shared=None``), so
    that the child's writes reach the parent and the parent's reach the child."""
    pid = os.getpid()
    for storage in list(_AUTO_SHARED):
        try:
            storage.share_with_children(pid)
        except Exception as e:  # noqa: BLE001 - a fork hook must not stop at one storage (a closed or
            # broken one); a storage left unshared refuses its child's writes with NotSharedError
            storage._share_error = f"{type(e).__name__}: {e}"


os.register_at_fork(before=_share_before_fork)


class TieredStorage(TensorStorage):
    """A TorchRL storage whose rows live in a compressed, tiered :class:`~tiered.TieredStore`.

    It is a ``TensorStorage`` (so TorchRL picks the identity collate function, and SliceSampler's
    ``end_key`` fallback, ``Sequence`` sample units and sample consumption accept it) and works with
    ``ReplayBuffer``, ``TensorDictReplayBuffer`` and ``TensorDictPrioritizedReplayBuffer`` and
    every sampler and writer of TorchRL. Data comes back in the form it was written: TensorDicts,
    tensors, tensorclasses or pytrees.

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
            the tiered store format. TorchRL's own (``Flat``/``Nested``/``H5StorageCheckpointer``)
            work too, through a decoded copy of the rows.
        ndim: storage dimensions, as ``LazyTensorStorage(ndim=...)``: with ``ndim=2`` a write of
            ``[n_envs, T]`` data through a ``ReplayBuffer`` fills a ``[max_size // n_envs, n_envs]``
            grid, indexed exactly as TorchRL's storage is.
        compilable: accepted for TorchRL's compiled buffers; it makes TorchRL keep its counters as
            plain numbers. Reads and writes still run eagerly (the decode is not traced).
        shared: several writer processes. ``None`` (default): a storage with a ``path`` shares its
            store (:meth:`TieredStore.share`) when it goes to another process (``fork``, or
            pickled to a spawned one), so every process writes and reads the same rows. ``True``:
            shared from the start. ``False``: never (the owner keeps its one-process speed; copies
            in other processes cannot write). An in-memory storage is never shared.
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

    _default_checkpointer = TieredStorageCheckpointer
    supports_conditional_update = True

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
        shared: bool | None = None,
        **store_options: Any,
    ):
        _check_storage_keywords(store_options)
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
            raise ValueError(f"ndim must be an int >= 1, got {ndim!r}")
        if device == "auto":
            raise ValueError("TieredStorage needs an explicit device (e.g. 'cpu' or 'cuda'), not 'auto'")
        existing = path is not None and os.path.exists(os.path.join(os.fspath(path), MANIFEST))
        rebuild = None
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
            # an ndim>1 storage learns its grid (and so its capacity) from the first write
            rebuild = {"path": path, "device": device, **store_options}
        self._setup(store, checkpointer, ndim=ndim, compilable=compilable, shared=shared)
        self._rebuild = rebuild

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
        self._rebuild = None
        return self

    def _setup(self, store: TieredStore, checkpointer: StorageCheckpointerBase | None, *, ndim: int = 1,
               compilable: bool = False, shared: bool | None = None) -> None:
        self._store = store
        Storage.__init__(self, store.capacity, checkpointer=checkpointer, compilable=compilable)
        self.ndim = ndim
        self.device = _make_ordinal_device(torch.device(store.device))
        self._last_cursor = None
        self.__dict__["_storage_keys"] = None
        self._side = SideColumns(store.capacity)
        self._track_sharing(shared)
        self._grid: torch.Tensor | None = None  # ndim>1: stored row of each grid cell
        self._form: DataForm | None = None
        if store.schema is not None:
            self._form = DataForm("tensor" if list(store.schema) == [(TENSOR_KEY,)] else "tensordict")
        if len(store):
            # an opened store: the last row written precedes the store's cursor (SliceSampler uses
            # it to cut trajectories at the ring seam)
            self._set_last_cursor(int((store.cursor - 1) % store.capacity))

    # -- the store -----------------------------------------------------------------------------
    @property
    def store(self) -> TieredStore:
        """The :class:`~tiered.TieredStore` holding the rows (fields present at the first write)."""
        return self._store

    @property
    def side_columns(self) -> SideColumns:
        """Fields that appeared after the first write, kept uncompressed beside the store."""
        return self._side

    @property
    def form(self) -> DataForm | None:
        """The form data came in (None before the first write)."""
        return self._form

    @property
    def grid_shape(self) -> tuple[int, ...] | None:
        """An ``ndim>1`` storage's grid (``[max_size // n_envs, n_envs]``), once the first write fixed it."""
        return tuple(self._grid.shape) if self._grid is not None else None

    @property
    def grid_cells(self) -> torch.Tensor | None:
        """An ``ndim>1`` storage's grid: the stored row of each cell (None before the first write)."""
        return self._grid

    def restore_layout(self, form: DataForm | None, grid_shape: list[int] | tuple[int, ...] | None) -> None:
        """Take the data form and ``ndim>1`` grid of a checkpoint before its rows are loaded."""
        if form is not None:
            self._form = form
        if grid_shape is not None and self.ndim > 1 and self._grid is None:
            grid = torch.Size(grid_shape)
            probe = TensorDict(batch_size=[1, *grid[1:]])
            self.max_size = max(self.max_size, grid.numel()) if len(self._store) == 0 else self.max_size
            self._make_grid(probe, scalar=False)

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
    def _total_shape(self) -> torch.Size | None:
        if not self.initialized:
            return None
        return torch.Size(self._grid.shape) if self._grid is not None else torch.Size([self.max_size])

    def __len__(self) -> int:
        return len(self._store)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(max_size={self.max_size}, len={len(self)}, ndim={self.ndim}, "
                f"device={self.device}, store={self._store!r})")

    # -- reading ---------------------------------------------------------------------------------
    @property
    def _storage(self) -> Any:
        # TorchRL's code and tests read ``storage._storage`` as "the rows": None before the first
        # write, then the written rows as a lazy view (storage[:]; frames decode only when used)
        if not self.initialized or not len(self._store):
            return None
        return self[tuple(slice(None) for _ in range(self.ndim))] if self._grid is not None else self[:]

    @_storage.setter
    def _storage(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("TieredStorage keeps its rows in its store; write them with set()")

    def _check_initialized(self) -> None:
        if not self.initialized:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        if self._form is None:  # another process wrote first (a store shared by processes)
            self._form = DataForm("tensor" if list(self._store.schema) == [(TENSOR_KEY,)] else "tensordict")

    def _one_call(self) -> Any:
        """A block whose store calls see one state: for a store written by several processes, the
        store's lock (no other process commits in between); nothing otherwise."""
        return self._store.locked() if self._store.shared else contextlib.nullcontext()

    def _read_rows(self, index: Any) -> tuple[np.ndarray, torch.Size]:
        """The stored rows an index reads (checked), and the shape of the result's batch."""
        store = self._store
        if self._grid is not None:
            grid = self._grid[: self._len_along_dim0]
            cells = grid[as_torch_index(index)]
            rows = cells.reshape(-1).numpy()
            store.rows_of(rows)  # checks that every row was written
            return rows, cells.shape
        rows = store.rows_of(index)
        if isinstance(index, slice):
            return rows, torch.Size([rows.size])
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, torch.Tensor) and index.dtype != torch.bool:
            return rows, index.shape
        if isinstance(index, np.ndarray) and index.dtype != bool:
            return rows, torch.Size(index.shape)
        return rows, torch.Size([] if as_row_array(index)[1] else [rows.size])

    @torch.compiler.disable  # decoding compressed rows cannot be traced: run eagerly
    def get(self, index: Any) -> Any:
        """Read rows, decoded in one batched call (a slice returns a lazy view, see ``__getitem__``).

        Args:
            index: an int (no batch dimension), a tensor/array/list, a 1-tuple of one (as TorchRL's
                slice samplers produce), a range or a slice (physical row order); for ``ndim>1``, any
                index of the grid. A key (``"done"``, ``("next", "done")``) reads that field of
                every row, as ``storage[:][key]``. As ``LazyTensorStorage``: ``...`` reads every
                row, ``None`` and ``True`` every row under a new leading dimension, ``False`` none,
                and a uint8 tensor is a mask (deprecated, as in torch).

        Returns:
            The rows in the form they were written (a TensorDict, tensor, tensorclass or pytree) on
            ``device``.
        """
        form = self._form
        if (type(index) is torch.Tensor and index.ndim == 1 and index.dtype not in _MASK_DTYPES and self._grid is None
                and form is not None and not len(self._side) and not self._store.shared and self.initialized):
            # a sampler's 1-D index (rb.sample): the store resolves and checks it (as rows_of would)
            # in the same call, and its batch is the index's; TensorDict rows are already in their form
            td = self._store.get(index)
            return td if form.kind == "tensordict" and not form.row_batch else form.from_rows(
                _unfold_row_batch(td, form.row_batch))
        with self._one_call():
            self._check_initialized()
            if is_key(index):
                return self._column(index)
            if isinstance(index, slice):
                return self._view(index)
            if index is None or index is Ellipsis or isinstance(index, bool):
                return _whole(self.get(torch.arange(self._len_along_dim0)), index)
            if isinstance(index, torch.Tensor) and index.dtype == torch.uint8:
                index = as_mask(index)
            rows, shape = self._read_rows(index)
            td = self._store.get(int(rows[0]) if len(shape) == 0 else rows)
        if len(self._side):
            for k, v in self._side.read(rows).items():
                td.set(k, v[0] if len(shape) == 0 else v.to(td.device))
        if len(shape) > 1:
            td = td.reshape(shape)
        return self._form.from_rows(_unfold_row_batch(td, self._form.row_batch))

    @torch.compiler.disable
    def __getitem__(self, index: Any) -> Any:
        """Like :meth:`get`, but slices and tuples (how TorchRL's samplers read) return lazy views.

        A lazy view holds the dense columns (trajectory ids, done flags, rewards, ...) and decodes
        its blob columns (frames) only when one of them is used, in one batched call.
        """
        if isinstance(index, (slice, tuple)) and not is_key(index):
            with self._one_call():
                self._check_initialized()
                return self._view(index)
        return self.get(index)

    def _column(self, key: Any) -> torch.Tensor:
        if self._form.kind != "tensordict":
            raise SchemaMismatchError(
                f"reading the field {key!r} of every row needs TensorDict data; this storage holds "
                f"{self._form.kind} data: read rows (storage[index]) instead")
        value = self._view(slice(None)).get(key)
        return value.materialize() if isinstance(value, LazyColumn) else value

    def _view(self, index: Any) -> Any:
        store = self._store
        rows, shape = self._read_rows(index)
        form = self._form
        if form.kind in ("tensor", "pytree"):
            return self.get(index if not isinstance(index, slice) else rows)
        schema = store.schema
        flat_slice = self._grid is None and isinstance(index, slice)
        # a slice reads dense columns as views (no per-sample copy that grows with the buffer)
        dense = store.get(index if flat_slice else rows, keys=[f.key for f in schema.dense_fields], copy=False)
        blob_keys = [f.key for f in schema.blob_fields]
        loader = None
        if blob_keys:
            loader = BlobLoader(lambda: {normalize_key(k): v for k, v in store.get(rows, keys=blob_keys).items(True, True)},
                                tuple(shape))
        view = RowsView(batch_size=[*shape, *form.row_batch], device=dense.device)
        for f in schema.values():  # the schema's key order, as a decoded get has
            if f.kind == "dense":
                view.set(f.key, dense.get(f.key).reshape(*shape, *f.shape))
            else:
                view.set(f.key, LazyColumn(loader, f.key, torch.Size([*shape, *f.shape]), f.dtype, store.device))
        if len(self._side):
            side = self._side.span(int(rows[0]), rows.size) if flat_slice and rows.size and index.step in (None, 1) \
                else self._side.read(rows)
            for k, v in side.items():
                view.set(k, v.reshape(*shape, *v.shape[1:]).to(view.device))
        # rb.set_at_/set_/update_ bump the revision themselves, once per call, as for TorchRL's storages
        view.bind(rows.reshape(shape) if len(shape) else rows, partial(self.write_fields, bump_revision=False))
        return form.from_rows(view)

    def _fill_missing(self, rows: np.ndarray, cells: TensorDictBase, missing: list[Key], old_len: int,
                      scalar: bool) -> TensorDictBase:
        """``cells`` plus the stored values of the fields it leaves out (zeros for rows never written)."""
        schema = self._store.schema
        cells = cells.clone(recurse=False)
        n = rows.size
        values = {k: torch.zeros((n, *schema[k].shape), dtype=schema[k].dtype) for k in missing}
        known = rows < old_len
        if known.any():
            try:
                old = self._store.get(rows[known], keys=missing)
            except IndexOutOfRangeError:
                old = None  # rows below the length that were never written (write_at) read zeros
            if old is not None:
                mask = torch.from_numpy(known)
                for k in missing:
                    values[k][mask] = old.get(k).to(values[k].device)
        for k, v in values.items():
            cells.set(k, v[0] if scalar else v.to(self._store.device))
        return cells

    # -- conditional updates (rb.update_if_present) ------------------------------------------------
    def _conditional_patch_leaf(self, key: Any) -> torch.Tensor:
        if not self.initialized:
            raise RuntimeError(
                "Conditional updates require an initialized storage. Write some "
                "data to the buffer before calling update_if_present.")
        view = self._view(slice(None))
        leaf = view.get(key, default=None) if isinstance(view, TensorDictBase) else None
        if leaf is None:
            raise KeyError(
                f"Key {key} does not exist in the storage. Conditional patches "
                "can only target existing tensor fields of a tensordict storage.")
        return leaf

    def _apply_conditional_patch(self, index: torch.Tensor, patch: dict[Any, torch.Tensor]) -> None:
        if self._grid is not None:
            coords = tuple(index.unbind(-1)) if index.ndim > 1 else (index,)
            rows = self._grid[tuple(c.cpu() for c in coords)].reshape(-1).numpy()
        else:
            rows = index.reshape(-1).cpu().numpy()
        self.write_fields(rows, {normalize_key(k): v.reshape(rows.size, *v.shape[1:]) for k, v in patch.items()})

    # -- writing ---------------------------------------------------------------------------------
    @torch.compiler.disable  # decoding and encoding compressed rows cannot be traced: run eagerly
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write rows at ``cursor`` (int, 0-d/1-D tensor on any device, slice, range, list, 1-tuple;
        for ``ndim>1``, any index of the grid's first dimension).

        With ``set_cursor=True`` (writers' ``add``/``extend``) the last cursor is recorded and the
        length grows as TorchRL's ``TensorStorage`` grows it; with ``set_cursor=False``
        (``rb[i] = ...``, ``write_at``) the length does not change. The mutation revision goes up
        once per call. A write may leave out fields (they keep their stored values) or bring new
        ones (earlier rows read zeros), as with ``LazyTensorStorage``.
        """
        self._observe_prioritized_samplers()
        if not set_cursor:
            self._set(cursor, data, set_cursor=False)
            return
        # TorchRL's storages record the cursor first, so a cursor they cannot record (a numpy array
        # of indices: TypeError) fails before any row changes; a write refused later puts it back
        previous = self._last_cursor, self._last_cursor_index
        self._set_last_cursor(cursor)
        try:
            self._set(cursor, data, set_cursor=True)
        except BaseException:
            self._last_cursor = previous[0]
            _put_back_cursor_index(self._last_cursor_index_value, previous[1])
            raise

    def _set(self, cursor: Any, data: Any, *, set_cursor: bool) -> None:
        if isinstance(data, list):
            data = flip_list(data)
        elif isinstance(data, RowsView):
            data = data.clone()  # its dense columns may be views of the columns this write changes
        form = self._form if self._form is not None else DataForm.infer(data)
        td = form.to_rows(data)
        scalar = _is_scalar_index(cursor)
        if self.ndim > 1 and self._grid is None:
            self._make_grid(td, scalar)
        rows, shape = self._write_rows(cursor)
        index_dims = len(shape)
        if td.batch_dims < index_dims:
            raise SchemaMismatchError(
                f"the index names rows of shape {list(shape)} but the data has batch size {list(td.batch_size)}")
        numel = td.batch_size[:index_dims].numel()
        td, row_batch = _fold_row_batch(td, index_dims)
        if form.kind in ("tensordict", "tensorclass"):
            if self._form is None:
                form.row_batch = row_batch
            elif form.row_batch != row_batch:
                raise SchemaMismatchError(
                    f"rows of this storage have batch dims {list(form.row_batch)} of their own; got "
                    f"{list(row_batch)}")
        if td.batch_size[:index_dims] != shape:
            if index_dims != 1 or td.batch_size[0] != 1:
                raise SchemaMismatchError(f"the index names rows of shape {list(shape)} but the data has "
                                          f"batch size {list(td.batch_size)}")
            td = td.expand(*shape).clone()  # broadcast one row, as TensorDict assignment does
        if index_dims > 1:
            td = td.reshape(-1)
        _check_insert_priorities(self._attached_entities_iter(), rows, td)
        self._write(rows, td, scalar=index_dims == 0, set_cursor=set_cursor, numel=numel)
        if self._form is None:
            self._form = form
        self._bump_mutation_revision()

    def _write_rows(self, cursor: Any) -> tuple[np.ndarray, torch.Size]:
        """The stored rows a write at ``cursor`` names, and the index's shape."""
        if self._grid is not None:
            cells = self._grid[as_torch_index(cursor)]
            return cells.reshape(-1).numpy(), cells.shape
        if isinstance(cursor, slice):
            rows = np.arange(*cursor.indices(self.max_size), dtype=np.int64)
            return rows, torch.Size([rows.size])
        if type(cursor) is int and -self.max_size <= cursor < self.max_size:  # a writer's add: one row
            return np.array([cursor % self.max_size], dtype=np.int64), torch.Size([])
        rows, scalar = as_row_array(cursor)
        bad = (rows < -self.max_size) | (rows >= self.max_size)
        if np.logical_or.reduce(bad):
            raise IndexOutOfRangeError(
                f"index {int(rows[bad][0])} is out of range for a storage of max_size {self.max_size}")
        rows = np.where(rows < 0, rows + self.max_size, rows)
        return rows, torch.Size([] if scalar else [rows.size])

    def _write(self, rows: np.ndarray, td: TensorDictBase, *, scalar: bool, set_cursor: bool, numel: int) -> None:
        """Write the rows of ``td`` (batch ``[n]``, or ``[]`` for one row): the store's fields to the
        store (fields left out keep their stored values), the others to the side columns."""
        store = self._store
        if self._snapshot or (os.getpid() != self._owner_pid and not store.shared):
            why = getattr(self, "_share_error", None)
            raise NotSharedError(
                (f"this storage's store could not be shared when it went to this process ({why}); "
                 if why is not None and store.path is not None else "") +
                "this TieredStorage is a copy that another process received: its writes would never reach "
                "the original, which keeps its rows in its own memory. To write from several processes, "
                "give the storage a directory (TieredStorage(max_size, path=DIR)): a storage with a path is "
                "shared with the processes it is passed to (not with shared=False). Or write from the "
                "process that owns the storage (e.g. collect in workers and extend in the main process)")
        with store.locked():  # readers never see the length between the write and TorchRL's rule
            old_len = len(store)
            new_len = min(old_len + numel, self.max_size) if set_cursor else old_len
            schema = store.schema
            # the common case: the stored fields and no others, of the stored dtypes and shapes;
            # the store takes the cells of this one walk of ``td``
            cells = None if schema is None else schema.match(td, 0 if scalar else 1)
            if schema is None or cells is not None:
                store.set(int(rows[0]) if scalar else rows, td, length=new_len, cells=cells)
            else:
                present = [normalize_key(k) for k in td.keys(include_nested=True, leaves_only=True)]
                side = {k: td.get(k) for k in present if k not in schema}
                side = {k: v.reshape(rows.size, *v.shape[0 if scalar else 1:]) if v.layout == torch.strided
                        and v.device.type != "meta" and not v.is_nested else v for k, v in side.items()}
                self._side.check(side)  # before the store's fields are written
                if len(side) < len(present):
                    cells = td.exclude(*side) if side else td
                    missing = [f.key for f in schema.values() if f.key not in set(present)]
                    # some dense fields of rows already written (rb.set_at_ of an advantage): their
                    # columns alone, without decoding and compressing the rows' frames again
                    if not (missing and not scalar and new_len == old_len and store.set_columns(rows, cells)):
                        if missing:
                            cells = self._fill_missing(rows, cells, missing, old_len, scalar)
                        store.set(int(rows[0]) if scalar else rows, cells, length=new_len)
                else:
                    store.set_length(new_len)
                if side:
                    self._side.write(rows, side)
            if set_cursor and rows.size:
                store.cursor = int((rows[-1] + 1) % self.max_size)

    def write_fields(self, rows: np.ndarray, values: dict[Key, torch.Tensor], *, bump_revision: bool = True) -> None:
        """Overwrite some fields of stored rows (``values[key]`` has one cell per row); the other
        fields keep their values and the length does not change. ``rb.set_at_``, ``rb.set_``,
        ``rb.update_`` and ``rb.update_if_present`` write through this. The mutation revision goes up
        once (``bump_revision=False``: not at all; the buffer methods bump it themselves).

        Example:
            >>> import numpy as np, torch
            >>> from tensordict import TensorDict
            >>> s = TieredStorage(10)
            >>> s.set(range(4), TensorDict(a=torch.zeros(4), b=torch.ones(4), batch_size=[4]))
            >>> s.write_fields(np.array([1, 3]), {("a",): torch.tensor([5.0, 7.0])})
            >>> s[:]["a"].tolist(), s[:]["b"].tolist()
            ([0.0, 5.0, 0.0, 7.0], [1.0, 1.0, 1.0, 1.0])
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        td = TensorDict({k: v for k, v in values.items()}, batch_size=[rows.size])
        self._write(rows, td, scalar=False, set_cursor=False, numel=0)
        if bump_revision:
            self._bump_mutation_revision()

    def _make_grid(self, td: TensorDictBase, scalar: bool) -> None:
        """Fix an ``ndim>1`` storage's grid from its first write, as ``LazyTensorStorage._init`` does."""
        inner = td.batch_size[: self.ndim - 1] if scalar else td.batch_size[1: self.ndim]
        if len(inner) != self.ndim - 1:
            raise SchemaMismatchError(
                f"an ndim={self.ndim} storage needs data with {self.ndim - int(scalar)} batch dims; got "
                f"{list(td.batch_size)}")
        dim0 = -(self.max_size // -inner.numel())
        capacity = dim0 * inner.numel()
        if capacity != self._store.capacity:
            if self._rebuild is None or len(self._store):
                raise SchemaMismatchError(
                    f"this store holds {self._store.capacity} rows, not a multiple of the {inner.numel()} "
                    f"cells of a {list(inner)} write; create it with max_size={capacity}")
            self._store = _rebuilt(self._store, capacity, self._rebuild)
        self.max_size = capacity
        self._side = SideColumns(capacity)
        self._grid = torch.arange(capacity).view(dim0, *inner)

    def _empty(self) -> None:
        # TorchRL's storages keep _last_cursor here; so does this one
        self._store.clear()
        self._bump_mutation_revision()

    # -- other TorchRL entry points -------------------------------------------------------------
    def flatten(self) -> TensorStorage:
        """An ``ndim=1`` TorchRL ``TensorStorage`` of the rows (decoded), as ``TensorStorage.flatten``."""
        if self.ndim == 1:
            return self
        self._check_initialized()
        data = self.get(tuple(slice(None) for _ in range(self.ndim)))
        return TensorStorage(data.reshape(-1) if is_tensor_collection(data) else data.reshape(-1, *data.shape[2:]))

    def dumps(self, path: str | os.PathLike) -> None:
        dumps_with(self.checkpointer, self, path)

    def loads(self, path: str | os.PathLike) -> None:
        loads_with(self.checkpointer, self, path)
        self._bump_mutation_revision()

    def state_dict(self) -> dict[str, Any]:
        """The storage as the bytes of a tiered store directory (compressed; fresh copies).

        Returns:
            ``{"format", "meta", "files": {relative path: uint8 tensor}}``; ``torch.save``-able.
            :meth:`torchrl_state_dict` gives the state dict ``LazyTensorStorage`` loads.
        """
        from .checkpoint import storage_state_dict
        return storage_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the rows with those of a state dict: this class's, or ``LazyTensorStorage``'s /
        ``LazyMemmapStorage``'s (copied; nothing is aliased)."""
        from .checkpoint import load_storage_state_dict
        load_storage_state_dict(self, state_dict)
        self._bump_mutation_revision()

    def torchrl_state_dict(self) -> dict[str, Any]:
        """The rows as ``LazyTensorStorage(max_size, ndim=...).state_dict()`` has them (decoded), so
        ``LazyTensorStorage.load_state_dict`` takes them."""
        from .checkpoint import as_lazy_tensor_storage
        return as_lazy_tensor_storage(self).state_dict()

    # -- other processes: sharing the store with them, refusing writes to copies, pickling --------
    def _track_sharing(self, shared: bool | None) -> None:
        store = self._store
        self._shared = shared
        self._snapshot = False  # a copy another process received (see __getstate__)
        self._owner_pid = os.getpid()
        if store.path is None or store.read_only or shared is False:
            return
        if shared:
            store.share()
        else:
            _AUTO_SHARED.add(self)

    def share_with_children(self, pid: int) -> None:
        """Share the store (:meth:`TieredStore.share`) now, as a ``fork`` or pickling to a spawned
        process does for a storage with a path (``shared=None``); nothing for other storages."""
        if self._shared is False or self._owner_pid != pid or self._store.shared:
            return
        try:
            self._store.share()
        except TieredError as e:  # closed, read-only or in memory: nothing to share
            # kept (as text: it may be pickled) for the error a child's write raises
            self._share_error = f"{type(e).__name__}: {e}"

    def __getstate__(self) -> dict[str, Any]:
        # Storage's version handles the shared counters; the store pickles itself (a store with a
        # path is flushed and travels as "reopen", for writing once shared; no file handles).
        state = Storage.__getstate__(self)
        if get_spawning_popen() is not None:
            if self._store.path is None:
                state["_snapshot"] = True  # the receiving process gets a copy: refuse its writes
            else:
                self.share_with_children(os.getpid())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        Storage.__setstate__(self, state)
        if self._store.shared and self._shared is None:
            _AUTO_SHARED.add(self)

    # -- priorities: the prioritized samplers of the attached buffers reach the store ------------
    def _observe_prioritized_samplers(self) -> None:
        """Forward the priorities of every prioritized sampler reading this storage to the store.

        TorchRL attaches each replay buffer to its storage before it builds the buffer's sampler,
        and every priority a ``PrioritizedSampler`` (or ``PrioritizedSliceSampler``) holds goes
        through its ``update_priority``: insert-time priorities (``mark_update``, called by the
        writer right after ``set``), ``rb.update_priority`` and ``update_tensordict_priority``.
        So on each write the attached buffers' samplers get a :class:`_PriorityForwarder` in
        front of ``update_priority`` (once per sampler): it checks the priorities, lets the
        sampler take them, then gives them to :meth:`TieredStore.set_priority` and the sampler's
        alpha to :attr:`TieredStore.priority_alpha`.
        """
        for buffer in self._attached_entities_iter():
            sampler = getattr(buffer, "sampler", None)
            if isinstance(sampler, PrioritizedSampler) and not isinstance(
                    vars(sampler).get("update_priority"), _PriorityForwarder):
                sampler.update_priority = _PriorityForwarder(sampler, self)



# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------
#: index dtypes that are masks (uint8: deprecated, as in torch), not row numbers
_MASK_DTYPES = (torch.bool, torch.uint8)


def _is_scalar_index(cursor: Any) -> bool:
    if isinstance(cursor, (int, np.integer)) and not isinstance(cursor, bool):
        return True
    return isinstance(cursor, (torch.Tensor, np.ndarray)) and cursor.ndim == 0


def _whole(rows: Any, index: Any) -> Any:
    """What ``LazyTensorStorage.get(index)`` gives for ``index`` ``...`` (every row), ``None`` or
    ``True`` (every row under a new leading dimension) or ``False`` (none, under one), from
    ``rows``: every row."""
    if index is Ellipsis:
        return rows
    if isinstance(rows, torch.Tensor) or is_tensor_collection(rows):
        return rows[None] if index is not False else rows[None][:0]
    return tree_map(lambda x: x[None] if index is not False else x[None][:0], rows)


def _fold_row_batch(td: TensorDictBase, dims: int) -> tuple[TensorDictBase, tuple[int, ...]]:
    """``td`` with only its first ``dims`` batch dims (the rest become part of each cell)."""
    if td.batch_dims <= dims:
        return td, ()
    row_batch = tuple(td.batch_size[dims:])
    out = td.clone(recurse=False)
    out.batch_size = td.batch_size[:dims]
    return out, row_batch


def _unfold_row_batch(td: TensorDictBase, row_batch: tuple[int, ...]) -> TensorDictBase:
    if not row_batch:
        return td
    out = TensorDict(batch_size=[*td.batch_size, *row_batch], device=td.device)
    for k, v in td.items(include_nested=True, leaves_only=True):
        out.set(k, v)
    return out


def _rebuilt(store: TieredStore, capacity: int, args: dict[str, Any]) -> TieredStore:
    """An empty store like ``store`` with another capacity (same path, device and options)."""
    args = dict(args)
    path = args.pop("path")
    store.close()
    if path is not None:
        shutil.rmtree(path)
    return TieredStore(capacity, path, **args)


def _check_insert_priorities(buffers: Any, rows: np.ndarray, td: TensorDictBase) -> None:
    """Refuse rows whose priority entry (``td_error``) a prioritized buffer of a storage (``buffers``) will
    give its sampler right after the write, when that priority is NaN, infinite or negative:
    :class:`_PriorityForwarder` would refuse it only once the rows are written. A loop over
    attached buffers (one, usually), vectorized over rows.

    Raises:
        InvalidPriorityError: naming the key, the rows and the values; nothing is written.
    """
    for buffer in buffers:
        key, sampler = getattr(buffer, "priority_key", None), getattr(buffer, "sampler", None)
        if key is None or not isinstance(sampler, PrioritizedSampler) or not isinstance(td, TensorDictBase):
            continue
        value = td.get(key, None)
        if not isinstance(value, torch.Tensor) or value.numel() == 0 or rows.size == 0:
            continue
        value = value.detach().to("cpu", torch.float64)
        try:
            if not bool(torch.isfinite(value).all()):  # NaN anywhere reaches the reduced value
                bad = ~torch.isfinite(value.reshape(rows.size, -1) if value.numel() % rows.size == 0
                                      else value.reshape(1, -1)).all(1)
                checked_row_priorities(rows[bad.numpy()] if bad.numel() == rows.size else rows[:1],
                                       np.full(int(bad.sum()), np.nan))
            if value.numel() == rows.size:  # one priority per row (several: TorchRL reduces them)
                checked_row_priorities(rows, value.reshape(-1).numpy())
        except InvalidPriorityError as e:
            raise InvalidPriorityError(
                f"{type(buffer).__name__} gives its sampler each written row's {key!r} as its priority; {e}. "
                f"The rows were not written either (with extend(..., update_priority=False), store such values "
                f"under another key than {key!r})") from None


def _put_back_cursor_index(shared: Any, index: int | None) -> None:
    """Put back the last cursor index TorchRL's ``Storage._set_last_cursor`` recorded in ``shared``
    (a tensor for compilable storages, else a shared ``mp.Value``): a refused write leaves the
    samplers' view as it was."""
    value = -1 if index is None else int(index)
    if isinstance(shared, torch.Tensor):
        shared.fill_(value)
    else:
        with shared.get_lock():
            shared.value = value


class _PriorityForwarder:
    """Stands in front of a prioritized sampler's ``update_priority`` (see
    :meth:`TieredStorage._observe_prioritized_samplers`): bad priorities raise
    :class:`~tiered.errors.InvalidPriorityError` naming the rows before the sampler or the store
    changes; good ones go to the sampler, then to the store. Picklable with the sampler."""

    def __init__(self, sampler: Any, storage: TieredStorage) -> None:
        self.sampler = sampler
        self.storage = storage

    def __call__(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        ndim = self.storage.ndim
        if ndim > 1 and isinstance(index, torch.Tensor) and index.ndim > 1 and index.shape[-1] == ndim:
            # coordinates of grid cells, one per row (what writers and samplers pass for ndim>1)
            grid = self.storage.grid_cells
            rows = grid[tuple(c.detach().to("cpu", torch.long) for c in index.unbind(-1))]
        elif ndim > 1:  # the sampler names grid cells; the store numbers them row-major
            rows = torch.from_numpy(self.storage._write_rows(index)[0])
        else:
            rows = torch.as_tensor(index).detach().to("cpu", torch.long)
        values = torch.as_tensor(priority).detach().to("cpu", torch.float64)
        if rows.ndim == 0:
            rows = rows.reshape(1)
        rows = rows.reshape(-1)
        values = values.reshape(-1).expand(rows.shape) if values.numel() == 1 else values.reshape(-1)
        if values.numel() != rows.numel():  # let the sampler explain a shape it refuses
            type(self.sampler).update_priority(self.sampler, index, priority, storage=storage)
            return
        keep = rows >= 0  # TorchRL's MaxValueWriter marks rows it did not write with -1
        rows_np, values_np = rows[keep].numpy(), values[keep].numpy()
        # both raise before anything changes: rows the store does not hold, bad values
        self.storage.store.rows_of(rows_np)
        checked = checked_row_priorities(rows_np, values_np)
        type(self.sampler).update_priority(self.sampler, index, priority, storage=storage)
        store = self.storage.store
        store.priority_alpha = float(self.sampler.alpha)
        if rows_np.size:
            store.set_priority(rows_np, checked)
