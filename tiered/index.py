"""The columnar blob index and the row -> blob tables.

Every stored frame (or time chunk of frames) is a *blob* with an integer id. The index
keeps one column per attribute (numpy arrays, grown geometrically), so every operation on a
batch of blobs is one vectorized numpy call:

========== ======= ================================================================
column     dtype   meaning
========== ======= ================================================================
state      int8    FREE (id unused), OPEN (an open time chunk, raw in memory), STORED
refcount   int32   number of row-table entries (plus tail pins) pointing at the blob
nbytes     int64   compressed size
raw_nbytes int64   decompressed size (frames in the blob x frame bytes)
checksum   int64   checksum of the compressed bytes (:mod:`tiered.codecs.checksum`)
codec      int8    codec format id
family     int16   frame family (index into the store's family list)
loc        int64   [n, 3] offset of the blob in the hot, warm, cold tier; -1 if absent
open_slot  int64   OPEN blobs: slot in the family's open-chunk buffer (file ``index.aux``)
========== ======= ================================================================

A :class:`RowTable` maps each row of a blob field to ``frames_per_row`` (blob id, slot)
pairs: the frame ``j`` of row ``r`` is frame ``slot[r, j]`` inside blob ``blob[r, j]``.

Example:
    >>> import numpy as np
    >>> from tiered.index import BlobIndex
    >>> index = BlobIndex()
    >>> ids = index.allocate(3)
    >>> index.incref(ids)
    >>> index.decref(ids[:1]).tolist()  # ids whose count dropped to zero
    [0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .util.dirty import DirtyBlocks

__all__ = ["BlobIndex", "RowTable", "FREE", "OPEN", "STORED", "HOT", "WARM", "COLD"]

FREE, OPEN, STORED = 0, 1, 2
HOT, WARM, COLD = 0, 1, 2

_COLUMNS: dict[str, tuple[Any, tuple[int, ...], int]] = {
    # name: (dtype, extra shape, fill value)
    "state": (np.int8, (), FREE),
    "refcount": (np.int32, (), 0),
    "nbytes": (np.int64, (), 0),
    "raw_nbytes": (np.int64, (), 0),
    "checksum": (np.int64, (), 0),
    "codec": (np.int8, (), 0),
    "family": (np.int16, (), 0),
    "loc": (np.int64, (3,), -1),
    "open_slot": (np.int64, (), -1),
}
# Format v1 names of the columns whose attribute names changed.
_FILE_NAMES = {"open_slot": "aux"}


class BlobIndex:
    """Columns of blob attributes plus a free-id pool. See the module docstring."""

    def __init__(self, initial: int = 1024):
        self.size = 0  # ids [0, size) have been handed out at least once
        self._free_ids = np.empty(0, dtype=np.int64)
        #: ids whose entries changed since the last commit (a commit rewrites only their pages)
        self.dirty = DirtyBlocks()
        for name, (dtype, extra, fill) in _COLUMNS.items():
            setattr(self, name, np.full((initial, *extra), fill, dtype=dtype))

    @property
    def capacity(self) -> int:
        return int(self.state.shape[0])

    def _grow(self, need: int) -> None:
        cap = self.capacity
        if need <= cap:
            return
        new_cap = max(need, cap * 2)
        for name, (dtype, extra, fill) in _COLUMNS.items():
            old = getattr(self, name)
            new = np.full((new_cap, *extra), fill, dtype=dtype)
            new[:cap] = old
            setattr(self, name, new)

    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` unused blob ids (reusing freed ones first), marked STORED, refcount 0."""
        n = int(n)
        take = min(n, self._free_ids.shape[0])
        reused = self._free_ids[:take]
        self._free_ids = self._free_ids[take:]
        fresh = np.arange(self.size, self.size + (n - take), dtype=np.int64)
        self._grow(self.size + (n - take))
        self.size += n - take
        ids = np.concatenate([reused, fresh])
        self.dirty.mark(ids)
        self.state[ids] = STORED
        self.refcount[ids] = 0
        self.loc[ids] = -1
        self.open_slot[ids] = -1
        return ids

    def release(self, ids: np.ndarray) -> None:
        """Return ids to the pool (their tier space must already be freed)."""
        self.dirty.mark(ids)
        self.state[ids] = FREE
        self.loc[ids] = -1
        self.open_slot[ids] = -1
        self.nbytes[ids] = 0
        self.raw_nbytes[ids] = 0
        self._free_ids = np.concatenate([self._free_ids, ids.astype(np.int64)])

    def incref(self, ids: np.ndarray) -> None:
        """Add one reference per occurrence of each id (duplicates count several times)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        self.dirty.mark(ids)
        np.add.at(self.refcount, ids[ids >= 0], 1)

    def decref(self, ids: np.ndarray) -> np.ndarray:
        """Drop one reference per occurrence; return the unique ids whose count reached zero."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        ids = ids[ids >= 0]
        self.dirty.mark(ids)
        np.subtract.at(self.refcount, ids, 1)
        uniq = np.unique(ids)
        if (self.refcount[uniq] < 0).any():
            raise AssertionError("blob reference count went negative: index is inconsistent")
        return uniq[self.refcount[uniq] == 0]

    def live_ids(self) -> np.ndarray:
        return np.flatnonzero(self.state[: self.size] != FREE)

    @property
    def free_ids(self) -> np.ndarray:
        """Released ids waiting for reuse (a copy)."""
        return self._free_ids.copy()

    @property
    def nbytes_held(self) -> int:
        """Bytes of RAM the index columns take."""
        return sum(getattr(self, name).nbytes for name in _COLUMNS) + self._free_ids.nbytes

    # Persistence -------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {_FILE_NAMES.get(name, name): getattr(self, name)[: self.size] for name in _COLUMNS}
        out["free_ids"] = self._free_ids
        # [size, 0]: format v1 kept a write sequence number in the second entry (now unused)
        out["meta"] = np.array([self.size, 0], dtype=np.int64)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> BlobIndex:
        size = int(arrays["meta"][0])
        short = [k for k in ("state", *(_FILE_NAMES.get(n, n) for n in _COLUMNS)) if arrays[k].shape[0] < size]
        if size < 0 or short:  # before allocating columns of `size` rows: a size lie fails here
            raise ValueError(f"index.meta says {size} blob ids but the index columns {short} hold fewer")
        columns = {name: arrays[_FILE_NAMES.get(name, name)] for name in _COLUMNS}
        if size and all(a.shape[0] == size and a.flags.writeable and a.dtype == np.dtype(_COLUMNS[name][0])
                        and a.shape[1:] == _COLUMNS[name][1] for name, a in columns.items()):
            # private memory maps of a store: used as they are (pages are read on use and
            # copied only when written; growing the index copies them)
            index = cls(initial=0)
            for name, a in columns.items():
                setattr(index, name, a)
        else:
            index = cls(initial=max(size, 16))
            for name in _COLUMNS:
                getattr(index, name)[:size] = columns[name][:size]
        index.size = size
        index._free_ids = np.array(arrays["free_ids"], dtype=np.int64)
        return index


class RowTable:
    """Row -> (blob id, slot) table of one blob field: ``[capacity, frames_per_row]`` each."""

    def __init__(self, capacity: int, frames_per_row: int):
        self.blob = np.full((capacity, frames_per_row), -1, dtype=np.int64)
        self.slot = np.zeros((capacity, frames_per_row), dtype=np.int32)
        #: for tables memory-mapped from a store: checks the pages of rows before their first use
        #: (``rows(rows)``, ``all()``); None for tables built in memory
        self.guard: Any = None

    @classmethod
    def from_arrays(cls, blob: np.ndarray, slot: np.ndarray) -> RowTable:
        table = cls.__new__(cls)
        table.blob = blob
        table.slot = slot
        table.guard = None
        return table
