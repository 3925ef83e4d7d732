"""TorchRL: a TensorDict memory-mapped directory (what ``TensorDict.memmap_`` writes).

This is the layout every TorchRL offline dataset caches (``TensorStorage(TensorDict.load_memmap
(path))``) and what ``LazyMemmapStorage`` holds::

    DIR/meta.json                     batch size, and per leaf: shape, dtype, device
    DIR/<key>.memmap                  raw C-order bytes of one leaf, all rows
    DIR/<sub>/meta.json, ...          nested keys are sub-directories

Import also accepts a replay-buffer checkpoint directory (``rb.dumps(DIR)`` of a
``LazyMemmapStorage`` / ``LazyTensorStorage``): its ``storage/`` is read, only the first
``len`` rows (``storage/storage_metadata.json``), without TorchRL's ``index`` bookkeeping column.

Keys are kept exactly (the store's layout *is* TorchRL's). Leaves are read with ``pread`` in
slices of rows (not through the memory map, so the importer's resident memory does not grow with
the file) and written with ``pwrite`` through :mod:`tiered.util.fileio` (a full disk is an error, never
a ``SIGBUS``).

Example:
    >>> import torch, tempfile, os
    >>> from tensordict import TensorDict
    >>> from tiered.formats.torchrl_memmap import TorchRLSource
    >>> d = os.path.join(tempfile.mkdtemp(), "td")
    >>> _ = TensorDict({"observation": torch.arange(6.).reshape(3, 2)}, [3]).memmap(d)
    >>> src = TorchRLSource(d)
    >>> next(src.chunks())["observation"].tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ..errors import PickledDataError, UnsupportedFormatError
from ..schema import normalize_key
from ..util import fileio
from .common import chunk_rows_for, iter_store
from .keymap import Key, key_str

__all__ = ["TorchRLSource", "write_torchrl", "load_tensordict_memmap"]

_INDEX_KEY = ("index",)


def load_tensordict_memmap(path: str | os.PathLike) -> TensorDict:
    """``TensorDict.load_memmap`` that never unpickles: pickled fields run code when loaded.

    Raises:
        PickledDataError: the directory holds pickled fields.
        UnsupportedFormatError: it is not a TensorDict memmap directory.
    """
    try:
        return TensorDict.load_memmap(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - tensordict raises many kinds for a bad directory
        if "pickle" in str(e).lower():
            raise PickledDataError(
                f"{path} holds pickled Python objects (non-tensor fields saved with pickle); tiered never "
                "unpickles data, since unpickling can run arbitrary code. Remove those fields from the "
                "source (td.exclude(...)) or convert them to tensors, or load it with TorchRL's own storage "
                "if you trust it") from None
        raise UnsupportedFormatError(
            f"{path} is not a TensorDict memmap directory ({type(e).__name__}: {e})"
        ) from None


class TorchRLSource:
    """A TensorDict memmap directory (or a replay-buffer checkpoint) as a source of rows.

    Args:
        path: the directory holding ``meta.json`` (or ``storage/meta.json``).
    """

    fmt = "torchrl"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such directory")
        self.origin = path
        self.layout = "memmap"
        length = None
        drop: set[Key] = set()
        td_dir = path
        if not os.path.isfile(os.path.join(path, "meta.json")) and os.path.isfile(
            os.path.join(path, "storage", "meta.json")
        ):
            td_dir = os.path.join(path, "storage")
            self.layout = "replay_buffer"
            drop.add(_INDEX_KEY)
            meta_file = os.path.join(td_dir, "storage_metadata.json")
            if os.path.isfile(meta_file):
                with open(meta_file) as f:
                    length = json.load(f).get("len")
        if not os.path.isfile(os.path.join(td_dir, "meta.json")):
            raise UnsupportedFormatError(
                f"{path} is not a TensorDict memmap directory (no meta.json); expected what "
                "TensorDict.memmap(path) or a TorchRL dataset cache writes"
            )
        td = load_tensordict_memmap(td_dir)
        if td.batch_dims != 1:
            raise UnsupportedFormatError(
                f"{path}: batch size {list(td.batch_size)}; a store holds rows, so the TensorDict must have "
                "one batch dimension (flatten split trajectories first: td.reshape(-1))"
            )
        self.num_rows = int(td.batch_size[0]) if length is None else int(length)
        self.leaves: dict[Key, Any] = {}
        self.dropped: list[str] = []
        for key in td.keys(include_nested=True, leaves_only=True):
            key = normalize_key(key)
            if key in drop:
                continue
            v = td.get(key)
            if not isinstance(v, torch.Tensor):
                self.dropped.append(key_str(key))  # non-tensor data has no rows to store
                continue
            self.leaves[key] = v
        if not self.leaves:
            raise UnsupportedFormatError(f"{path}: no tensor leaves to import")

    @property
    def row_bytes(self) -> int:
        return sum(math.prod(v.shape[1:]) * v.element_size() for v in self.leaves.values())

    def attrs(self) -> dict[str, Any]:
        return {
            "format": "torchrl",
            "origin": self.origin,
            "layout": self.layout,
            "rows": self.num_rows,
            "dropped": self.dropped,
            "derived": [],
        }

    def _read(self, t: Any, lo: int, hi: int) -> torch.Tensor:
        filename = getattr(t, "filename", None)
        row = math.prod(t.shape[1:]) * t.element_size()
        if filename and os.path.isfile(filename) and t.is_contiguous():
            buf = np.empty((hi - lo) * row, dtype=np.uint8)
            with open(filename, "rb", buffering=0) as f:
                done = fileio.read_into(f.fileno(), memoryview(buf), lo * row)
            if done < buf.size:
                raise UnsupportedFormatError(
                    f"{filename} is shorter than its meta.json says ({lo * row + done} bytes)"
                )
            return torch.from_numpy(buf).view(t.dtype).reshape(hi - lo, *t.shape[1:])
        return torch.as_tensor(t[lo:hi]).clone()

    def chunks(self, chunk_rows: int | None = None) -> Iterator[TensorDict]:
        """Yield rows as TensorDicts (keys unchanged), ``chunk_rows`` at a time."""
        step = chunk_rows_for(self.row_bytes, chunk_rows)
        for lo in range(0, self.num_rows, step):
            hi = min(self.num_rows, lo + step)
            yield TensorDict({key: self._read(t, lo, hi) for key, t in self.leaves.items()}, batch_size=[hi - lo])

    def close(self) -> None:
        self.leaves = {}


def write_torchrl(
    store: Any,
    rows: np.ndarray,
    tmp: str,
    source: dict[str, Any] | None,
    chunk_rows: int | None,
    progress: Any,
) -> dict[str, Any]:
    """Write a store's rows as a TensorDict memmap directory at ``tmp``.

    ``TensorDict.load_memmap(dst, allow_pickle=False)`` reads it back (or :func:`load_tensordict_memmap`);
    ``TensorStorage(...)`` of that serves it in a TorchRL replay buffer. tensordict writes ``meta.json`` (and creates empty
    files), the rows go in with ``pwrite`` through :mod:`tiered.util.fileio`.

    Returns:
        ``{"keys": [...], "rows": n}``.
    """
    schema = store.schema
    fields = list(schema.values()) if schema is not None else []
    unreadable = [f"{key_str(f.key)} ({f.dtype})" for f in fields if str(f.dtype).startswith("torch.float8")]
    if unreadable:
        # tensordict writes float8 memmaps but its load_memmap cannot read them back
        raise UnsupportedFormatError(
            f"fields {unreadable} have a float8 dtype, which TensorDict.load_memmap cannot read back; "
            "cast them in a copy of the store first (e.g. to float16); nothing was written")
    n = int(rows.size)
    # a TensorDict of zero-strided views: tensordict lays out the directory and meta.json
    # without allocating the rows
    template = TensorDict({f.key: torch.zeros((1, *f.shape), dtype=f.dtype).expand(n, *f.shape) for f in fields},
                          batch_size=[n])
    mm = template.memmap_like(tmp)
    files = {f.key: mm.get(f.key).filename for f in fields}
    row_bytes = {f.key: f.cell_nbytes for f in fields}
    del mm, template
    fds = {k: fileio.open_for_write(p) for k, p in files.items()}
    try:
        for k, fd in fds.items():
            fileio.fallocate(fd, 0, n * row_bytes[k])
        step = chunk_rows_for(sum(row_bytes.values()), chunk_rows)
        for lo, hi, td in iter_store(store, rows, step):
            for f in fields:
                v = td.get(f.key).contiguous()
                data = v.view(torch.uint8) if v.dtype != torch.uint8 and v.dim() else v
                fileio.pwrite(fds[f.key], memoryview(data.numpy()).cast("B"), lo * row_bytes[f.key])
            progress.update(hi - lo)
        for fd in fds.values():
            fileio.fsync(fd)
    finally:
        for fd in fds.values():
            fileio.close(fd)
    for root, _dirs, _files in os.walk(tmp):
        for name in _files:
            if name == "meta.json":  # written by tensordict, outside the seam: make it durable too
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    fileio.fsync(fd)
                finally:
                    os.close(fd)
        fileio.fsync_dir(root)
    return {"keys": [key_str(f.key) for f in fields], "rows": n}
