"""Checkpointing a TieredStorage: ``rb.dumps``/``rb.loads``, ``state_dict``, TorchRL's checkpointers.

* :class:`TieredStorageCheckpointer` (the default) writes a tiered store directory plus
  ``tiered_storage.json`` (length, cursor, the data's form and ndim grid) and ``side_columns.pt``
  (fields added after the first write). Its ``loads`` also reads a ``LazyTensorStorage`` /
  ``LazyMemmapStorage`` checkpoint (TorchRL's memmap format).
* TorchRL's own checkpointers (``TensorStorageCheckpointer``, ``FlatStorageCheckpointer``,
  ``NestedStorageCheckpointer``, ``H5StorageCheckpointer``) read ``storage._storage``, a dense
  TensorDict of every row. :func:`dumps_with`/:func:`loads_with` run them on a
  ``LazyTensorStorage`` holding a decoded copy of the rows, so their files are exactly TorchRL's
  (the whole buffer is decoded in memory while they run).
* ``state_dict()`` holds the bytes of a store directory; ``load_state_dict`` also takes the state
  dict of a ``LazyTensorStorage``/``LazyMemmapStorage``, and ``torchrl_state_dict()`` gives one.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import LazyTensorStorage
    >>> from tiered.torchrl import TieredStorage
    >>> lazy = LazyTensorStorage(10)
    >>> lazy.set(range(3), TensorDict(a=torch.arange(3), batch_size=[3]))
    >>> ours = TieredStorage(10)
    >>> ours.load_state_dict(lazy.state_dict())
    >>> ours[:]["a"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
from torchrl.data.replay_buffers.storages import LazyTensorStorage

from ..errors import FormatVersionError, PickledDataError, ReadOnlyStoreError, SchemaMismatchError
from ..formats.torchrl_memmap import load_tensordict_memmap
from ..store import TieredStore
from .forms import DataForm

if TYPE_CHECKING:  # pragma: no cover
    from .storage import TieredStorage

__all__ = ["TieredStorageCheckpointer", "dumps_with", "loads_with", "storage_state_dict",
           "load_storage_state_dict", "as_lazy_tensor_storage"]

# Name of the adapter's own metadata file inside a dumps() directory, and of the store in it.
_META_FILE = "tiered_storage.json"
_SIDE_FILE = "side_columns.pt"
_STORE_DIR = "store"
_CKPT_FORMAT = "tiered.torchrl.TieredStorage"
_CKPT_VERSION = 2
# Decoded bytes per chunk when rows are copied between stores (dumps/loads of in-memory stores):
# bounds the temporary memory while keeping each get/set call batched.
_COPY_CHUNK_BYTES = 256 * 2**20


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
        >>> from tiered.torchrl import TieredStorage
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


def _row_nbytes(schema) -> int:
    return sum(f.cell_nbytes for f in schema.values()) if schema is not None else 1


def _copy_rows(get, dst: TieredStore, n: int, row_nbytes: int) -> None:
    """Copy rows ``0..n-1`` from ``get(lo, hi)`` into ``dst`` in batched chunks."""
    step = max(1, _COPY_CHUNK_BYTES // max(1, row_nbytes))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        dst.set(np.arange(lo, hi, dtype=np.int64), get(lo, hi))


def _ignore_locks(directory: str, names: list[str]) -> list[str]:
    # a copied lock file would make the copy look held by this process's writer
    return [n for n in names if n.endswith(".lock") or n == "lock"]


def _write_checkpoint(storage: TieredStorage, path: Path, source: TensorDictBase | None = None) -> dict:
    """Write ``path/store``, ``path/side_columns.pt`` and ``path/tiered_storage.json``."""
    store = storage.store
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
                    keys = list(store.schema) if store.schema is not None else None
                    _copy_rows(lambda lo, hi: source[lo:hi].select(*keys) if keys else source[lo:hi], dst, n,
                               _row_nbytes(store.schema))
                else:
                    _copy_rows(lambda lo, hi: store.get(range(lo, hi)), dst, n, _row_nbytes(store.schema))
                dst.cursor = store.cursor
                dst.flush()
            finally:
                dst.close()
    elif dst_dir.exists():
        shutil.rmtree(dst_dir)
    side = storage.side_columns
    if len(side):
        torch.save(side.state(), path / _SIDE_FILE)
    elif (path / _SIDE_FILE).exists():
        (path / _SIDE_FILE).unlink()
    form = storage.form
    meta = {
        "format": _CKPT_FORMAT,
        "version": _CKPT_VERSION,
        "len": n,
        "max_size": storage.max_size,
        "cursor": store.cursor,
        "initialized": storage.initialized or source is not None,
        "form": form.to_json() if form is not None else None,
        "grid": list(storage.grid_shape) if storage.grid_shape is not None else None,
        "side_columns": len(side) > 0,
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
        raise FormatVersionError(
            f"{meta_file}: checkpoint format {meta.get('format')!r} version {meta.get('version')!r}; this "
            f"tiered reads {_CKPT_FORMAT!r} version {_CKPT_VERSION} only. Load it with the tiered that wrote "
            "it and dump it again with this one.")
    n = int(meta["len"])
    if n > storage.max_size and meta.get("grid") is None:
        raise ValueError(f"the checkpoint at {path} holds {n} rows but the storage's max_size is "
                         f"{storage.max_size}; create TieredStorage({meta['max_size']}) to load it")
    form = DataForm.from_json(meta["form"]) if meta.get("form") else None
    storage.restore_layout(form, meta.get("grid"))
    if meta["initialized"] and n:
        src = TieredStore.open(path / meta["store"], mode="r", warm_bytes=0, hot_bytes=0)
        try:
            _load_rows(storage, lambda lo, hi: src.get(range(lo, hi)), n, _row_nbytes(src.schema), load_hooks)
        finally:
            src.close()
    if meta.get("side_columns"):
        storage.side_columns.load(torch.load(path / _SIDE_FILE, weights_only=True))
    # TorchRL's storages leave _last_cursor as it was on loads; so does this one
    _set_length(storage, n, int(meta["cursor"]))


def _load_rows(storage: TieredStorage, get, n: int, row_nbytes: int, load_hooks: list | None) -> None:
    dst = storage.store
    if load_hooks:
        data = get(0, n)
        for hook in load_hooks:
            data = hook(data, out=None)
        get = lambda lo, hi: data[lo:hi]  # noqa: E731
    _copy_rows(get, dst, n, row_nbytes)


def _read_torchrl_memmap(storage: TieredStorage, path: Path, load_hooks: list | None) -> None:
    """Import a ``TensorStorageCheckpointer`` directory (LazyTensorStorage/LazyMemmapStorage dumps)."""
    meta = json.loads((path / "storage_metadata.json").read_text())
    _refuse_pickles(path)  # before any loader sees the directory, TorchRL's own included
    if meta.get("is_pytree") or storage.ndim > 1:
        # TorchRL's own loader knows its pytree layout and ndim grids
        from torchrl.data.replay_buffers.checkpointers import TensorStorageCheckpointer
        checkpointer = TensorStorageCheckpointer()
        checkpointer._load_hooks = list(load_hooks or [])
        return loads_with(checkpointer, storage, path)
    n = int(meta["len"])
    if n > storage.max_size:
        raise ValueError(f"the checkpoint at {path} holds {n} rows but max_size is {storage.max_size}")
    td = load_tensordict_memmap(path)  # never unpickles: a pickled field runs code when loaded
    storage.restore_layout(storage.form or DataForm("tensordict"), None)
    row_nbytes = sum(v[0].numel() * v.element_size() for v in td.values(True, True)) if td.numel() else 1
    _load_rows(storage, lambda lo, hi: td[lo:hi], n, row_nbytes, load_hooks)
    _set_length(storage, n, n)


def _set_length(storage: TieredStorage, n: int, cursor: int) -> None:
    """After loading ``n`` rows: the storage's length and its store's cursor, committed (a store
    with a path)."""
    store = storage.store
    with store.locked():
        storage._len = n  # the store's length counter
        store.cursor = cursor % storage.max_size
    if store.path is not None and n:
        store.flush()


# ----------------------------------------------------------------------------------------
# TorchRL's checkpointers and state dicts, through a LazyTensorStorage copy
# ----------------------------------------------------------------------------------------
def as_lazy_tensor_storage(storage: TieredStorage) -> LazyTensorStorage:
    """A ``LazyTensorStorage`` holding a decoded copy of ``storage``'s rows (same length, ndim and
    last cursor)."""
    lazy = LazyTensorStorage(storage.max_size, ndim=storage.ndim)
    if storage.initialized:
        n = len(storage)
        if n == 0:
            raise RuntimeError("Cannot save a storage whose rows were emptied; write rows first")
        if storage.ndim == 1:
            lazy.set(range(n), storage.get(np.arange(n)), set_cursor=False)
        else:
            d0 = storage._len_along_dim0
            lazy.set(range(d0), storage.get(tuple(slice(None) for _ in range(storage.ndim))), set_cursor=False)
        lazy._len = n
    lazy._set_last_cursor(storage._last_cursor)
    return lazy


def copy_from_lazy(storage: TieredStorage, lazy: LazyTensorStorage) -> None:
    """Replace ``storage``'s rows with those of a loaded TorchRL storage."""
    n = int(lazy._len)
    if n and lazy.initialized:
        # every written row (grid row, for ndim>1), as LazyTensorStorage.get reads a slice per dim
        data = lazy.get(tuple(slice(None) for _ in range(storage.ndim)))
        storage.set(range(lazy._len_along_dim0), data, set_cursor=False)
    _set_length(storage, n, n)


def dumps_with(checkpointer: StorageCheckpointerBase, storage: TieredStorage, path: str | os.PathLike) -> None:
    """``storage.dumps(path)`` with the storage's checkpointer (TorchRL's run on a decoded copy)."""
    if isinstance(checkpointer, TieredStorageCheckpointer):
        return checkpointer.dumps(storage, path)
    if not storage.initialized:
        raise RuntimeError("Cannot save a non-initialized storage.")
    checkpointer.dumps(as_lazy_tensor_storage(storage), path)


def loads_with(checkpointer: StorageCheckpointerBase, storage: TieredStorage, path: str | os.PathLike) -> None:
    """``storage.loads(path)`` with the storage's checkpointer (TorchRL's load into a copy first)."""
    if isinstance(checkpointer, TieredStorageCheckpointer):
        return checkpointer.loads(storage, path)
    lazy = LazyTensorStorage(storage.max_size, ndim=storage.ndim)
    if storage.initialized and len(storage):
        lazy = as_lazy_tensor_storage(storage)  # pytree checkpoints load into an initialized storage
    checkpointer.loads(lazy, Path(path))
    copy_from_lazy(storage, lazy)


def storage_state_dict(storage: TieredStorage) -> dict[str, Any]:
    """``storage.state_dict()``: the bytes of a checkpoint directory as uint8 tensors."""
    with tempfile.TemporaryDirectory(prefix="tiered-sd-") as tmp:
        meta = _write_checkpoint(storage, Path(tmp))
        files = {}
        for root, _, names in os.walk(tmp):
            for name in names:
                full = os.path.join(root, name)
                rel = os.path.relpath(full, tmp)
                files[rel] = torch.from_numpy(np.fromfile(full, dtype=np.uint8))
    return {"format": _CKPT_FORMAT, "meta": meta, "files": files}


def load_storage_state_dict(storage: TieredStorage, state_dict: dict[str, Any]) -> None:
    """``storage.load_state_dict``: this class's state dicts, or ``LazyTensorStorage``'s."""
    fmt = state_dict.get("format")
    if fmt is None and "_storage" in state_dict and "_len" in state_dict:
        lazy = LazyTensorStorage(storage.max_size, ndim=storage.ndim)
        lazy.load_state_dict(state_dict)
        copy_from_lazy(storage, lazy)
        return
    if fmt != _CKPT_FORMAT:
        raise SchemaMismatchError(
            f"not a TieredStorage or LazyTensorStorage state dict (format {fmt!r}, keys "
            f"{sorted(map(str, state_dict))[:6]}); expected {_CKPT_FORMAT!r} or TorchRL's "
            "{'_storage', 'initialized', '_len'}")
    with tempfile.TemporaryDirectory(prefix="tiered-sd-") as tmp:
        for rel, tensor in state_dict["files"].items():
            dest = os.path.normpath(os.path.join(tmp, rel))
            if not dest.startswith(os.path.abspath(tmp) + os.sep):
                raise SchemaMismatchError(f"state dict file {rel!r} points outside its directory")
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tensor.detach().cpu().contiguous().numpy().tofile(dest)
        _read_checkpoint(storage, Path(tmp))


def _refuse_pickles(path: Path) -> None:
    """Raise :class:`PickledDataError` if the checkpoint directory holds a pickle file anywhere
    (tensordict saves non-tensor fields as ``*.pickle``; loading one runs code)."""
    found = next((p for p in path.rglob("*") if p.suffix in (".pickle", ".pkl") and p.is_file()), None)
    if found is not None:
        raise PickledDataError(
            f"{path} holds a pickled file ({found.relative_to(path)}); tiered never unpickles data, since "
            "unpickling can run arbitrary code. Load it with TorchRL's own storage if you trust it, or "
            "remove those fields")
