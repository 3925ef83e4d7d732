"""The columnar blob index: one entry per stored blob.

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

The row -> blob tables that point at the blobs are in :mod:`tiered.engine.row_tables`.

Example:
    >>> import numpy as np
    >>> from tiered.engine.blob_index import BlobIndex
    >>> index = BlobIndex()
    >>> ids = index.allocate(3)
    >>> index.incref(ids)
    >>> index.decref(ids[:1]).tolist()  # ids whose count dropped to zero
    [0]
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import StorageFullError
from ..util.dirty import DirtyBlocks

__all__ = ["BlobIndex", "FREE", "OPEN", "STORED", "HOT", "WARM", "COLD", "MAX_BLOB_IDS", "BLOB_DTYPE", "SLOT_DTYPE",
           "check_blob_ids", "free_pool_problem", "impossible_raw_sizes"]

#: dtype of the blob ids in row tables (-1: no blob)
BLOB_DTYPE = np.dtype(np.int32)
#: dtype of the frame slots in row tables (a chunk holds at most ``1 << 16`` frames)
SLOT_DTYPE = np.dtype(np.uint16)
#: The most blob ids an index hands out: row tables store them as int32.
MAX_BLOB_IDS = int(np.iinfo(BLOB_DTYPE).max)

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
# File names (docs/format.md) of the columns whose attribute names differ.
_FILE_NAMES = {"open_slot": "aux"}


def check_blob_ids(size: int, more: int) -> None:
    """Refuse to hand out ids beyond :data:`MAX_BLOB_IDS` (``size`` ids exist, ``more`` are asked for).

    Raises:
        StorageFullError: saying how many blob ids the store holds and what to change.

    Example:
        >>> check_blob_ids(10, 5)
        >>> check_blob_ids(MAX_BLOB_IDS, 1)
        Traceback (most recent call last):
        ...
        tiered.errors.StorageFullError: ...
    """
    if size + more > MAX_BLOB_IDS:
        raise StorageFullError(
            f"this write needs {more:,} new blob ids but the store already holds {size:,}; a store holds at "
            f"most {MAX_BLOB_IDS:,} blobs (its row tables name them with 32-bit ids). Raise chunk_frames "
            "(fewer, larger blobs), lower the capacity, or split the data over several stores; nothing was written")


def free_pool_problem(free: np.ndarray, is_free: np.ndarray) -> str | None:
    """How the free-id pool ``free`` fails to list exactly the ids that ``is_free`` (one bool per
    id) marks free: ``"range"`` (not a list of ids in ``[0, n)``), ``"listing"`` (an id listed twice
    or an id that is not free), ``"count"`` (a free id missing); ``None`` when it lists exactly them.
    The open check and ``tiered verify`` each word the answer for their reader.

    Example:
        >>> is_free = np.array([True, False, True])
        >>> [free_pool_problem(np.array(f), is_free) for f in ([0, 2], [0, 3], [0, 0], [2])]
        [None, 'range', 'listing', 'count']
    """
    n = is_free.shape[0]
    if free.ndim != 1 or (free.size and (int(free.min()) < 0 or int(free.max()) >= n)):
        return "range"
    if free.size and (np.unique(free).size != free.size or not is_free[free].all()):
        return "listing"
    if int(np.count_nonzero(is_free)) != free.size:
        return "count"
    return None


def impossible_raw_sizes(family: np.ndarray, raw_nbytes: np.ndarray, families: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per blob (its ``family`` and ``raw_nbytes`` entries), whether its family is unknown or its raw
    size is not 1..chunk_frames whole frames of that family: a size lie would make a decoder
    allocate or write past its output. ``families`` gives ``(frame_nbytes, chunk_frames)`` per family.

    Example:
        >>> impossible_raw_sizes(np.array([0, 0, 0, 1]), np.array([64, 80, 512, 64]), [(32, 4)]).tolist()
        [False, True, True, True]
    """
    if len(families) == 1:  # the usual case: scalar bounds
        frame_nbytes, chunk = int(families[0][0]), int(families[0][1])
        bad = (family != 0) | (frame_nbytes <= 0)
        frame = max(frame_nbytes, 1)
    else:
        table = np.array([*families, (0, 0)], dtype=np.int64).reshape(-1, 2)
        pick = np.where((family >= 0) & (family < len(families)), family, -1)
        frame_nbytes, chunk = table[pick, 0], table[pick, 1]
        bad = (pick < 0) | (frame_nbytes <= 0)
        frame = np.maximum(frame_nbytes, 1)
    bad |= raw_nbytes <= 0
    bad |= raw_nbytes > frame * chunk
    bad |= raw_nbytes % frame != 0
    return bad


def _unused_ids(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Column entries of ids not handed out yet: zero pages that cost no memory until an id is
    (a doubled column is mostly such pages). Nothing reads them: every reader stops at ``size``,
    and :meth:`BlobIndex.allocate` sets the entries whose fill is not zero (``loc``, ``open_slot``)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    # private: a forked process's writes stay its own
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(pages, dtype=dtype).reshape(shape)


class BlobIndex:
    """Columns of blob attributes plus a free-id pool. See the module docstring."""

    def __init__(self, initial: int = 1024):
        self.size = 0  # ids [0, size) have been handed out at least once
        self._free_ids = np.empty(0, dtype=np.int64)
        #: ids whose entries changed since the last commit (a commit rewrites only their pages)
        self.dirty = DirtyBlocks()
        #: what makes the entries of some ids (None: all) safe to use: a read-only open of a store
        #: maps its columns from files its writer changes in place, and checks their pages at
        #: first use (:class:`~tiered.durable.checked_maps.IdCheck`); None where no one else
        #: writes them
        self.guard: Callable[[np.ndarray | None], None] | None = None
        for name, (dtype, extra, _) in _COLUMNS.items():
            setattr(self, name, _unused_ids((initial, *extra), dtype))

    @property
    def capacity(self) -> int:
        return int(self.state.shape[0])

    def _grow(self, need: int) -> None:
        cap = self.capacity
        if need <= cap:
            return
        new_cap = max(need, cap * 2)
        for name, (dtype, extra, _) in _COLUMNS.items():
            old = getattr(self, name)
            new = _unused_ids((new_cap, *extra), dtype)
            new[:cap] = old
            setattr(self, name, new)

    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` unused blob ids (reusing freed ones first), marked STORED, refcount 0."""
        n = int(n)
        take = min(n, self._free_ids.shape[0])
        reused = self._free_ids[:take]
        self._free_ids = self._free_ids[take:]
        check_blob_ids(self.size, n - take)
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

    def check_ids(self, ids: np.ndarray | None = None) -> None:
        """Before the entries of blob ``ids`` (valid ids, any shape; None: every id) are read or
        written: run :attr:`guard` over them (nothing to do for most indexes).

        Raises:
            CorruptionError: from the guard, a page holding them is damaged.
            StaleReadError: from the guard, a read-only open's writer moved too far ahead.
        """
        if self.guard is not None:
            self.guard(ids)

    def live_ids(self) -> np.ndarray:
        return np.flatnonzero(self.state[: self.size] != FREE)

    @property
    def free_ids(self) -> np.ndarray:
        """Released ids waiting for reuse (a copy)."""
        return self._free_ids.copy()

    @property
    def nbytes_held(self) -> int:
        """Bytes the index columns take as allocated (the pages of ids not handed out yet cost no
        memory until they are: :meth:`arrays_held` gives the arrays to measure)."""
        return sum(getattr(self, name).nbytes for name in _COLUMNS) + self._free_ids.nbytes

    def arrays_held(self) -> list[np.ndarray]:
        """The index's arrays as allocated: its columns and the free ids (what
        :func:`~tiered.util.resident.resident_nbytes` measures)."""
        return [*(getattr(self, name) for name in _COLUMNS), self._free_ids]

    # Persistence -------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {_FILE_NAMES.get(name, name): getattr(self, name)[: self.size] for name in _COLUMNS}
        out["free_ids"] = self._free_ids
        # [size, 0]: the second entry is not used (always 0)
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
