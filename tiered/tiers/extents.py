"""Vectorized extent allocator for the byte arenas of the tiers, and byte-size parsing.

The allocator hands out 16-byte-aligned ranges of a byte space ``[0, capacity)``. Free space
is a sorted list of extents (offset, length) kept in two int64 arrays, not a per-blob free
list, so freeing a million blobs is a handful of numpy calls. Allocation tries, in order:

1. the free extents, vectorized: extents and blobs are laid end to end on one virtual line
   and every blob that falls inside one extent goes there (first fit in address order, one
   ``np.searchsorted``; no Python loop over blobs or extents);
2. the rest (blobs that straddled two extents, or everything when nothing is free) bumps at
   the end of the used region (``high_water``) while under ``capacity``.

With ``boundary`` set (the cold tiers' segment size) no blob straddles a multiple of it:
free extents are never merged across a boundary and the bump region skips to the next
boundary when a blob does not fit in the rest of the current one.

Deferred frees (cold tiers): ``free(..., defer=True)`` parks ranges until
:meth:`ExtentAllocator.release_deferred`, which the store calls once the commit that freed
them is durable, so a crash never finds a committed blob overwritten. With ``hold_last=True``
the ranges freed since the previous call wait one call more: a reader that opened the commit
before the one that freed them may still read them until the writer's next commit (the
store's promise to read-only opens, docs/format.md "Concurrency").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import StorageFullError
from ..util.batch import exclusive_cumsum
from ..util.units import ALIGNMENT, align, fragmentation

__all__ = ["ExtentAllocator"]

_I64 = np.int64
_EMPTY = np.empty(0, dtype=_I64)


class ExtentAllocator:
    """Allocator of aligned byte ranges in ``[0, capacity)``.

    Args:
        capacity: bytes available (``None``: unbounded).
        boundary: if set, no allocation straddles a multiple of it (segment size).

    Example:
        >>> a = ExtentAllocator(1024)
        >>> a.allocate(np.array([10, 20, 30]))
        array([ 0, 16, 48])
        >>> a.free(np.array([16]), np.array([20])); a.bytes_used, a.fragmentation
        (48, 0.0)
        >>> a.allocate(np.array([5]))
        array([16])
    """

    def __init__(self, capacity: int | None = None, *, boundary: int | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if boundary is not None and (boundary <= 0 or boundary % ALIGNMENT):
            raise ValueError(f"boundary must be a positive multiple of {ALIGNMENT}, got {boundary}")
        self.capacity = None if capacity is None else int(capacity)
        self.boundary = None if boundary is None else int(boundary)
        self._free_off = _EMPTY
        self._free_len = _EMPTY
        self._pend_off: list[np.ndarray] = []
        self._pend_len: list[np.ndarray] = []
        # ranges parked by release_deferred(hold_last=True): released by the next call
        self._held_off = _EMPTY
        self._held_len = _EMPTY
        self._end = 0
        self._used = 0

    # ------------------------------------------------------------------ properties

    @property
    def bytes_used(self) -> int:
        """Bytes held by live allocations (aligned sizes); deferred frees are not counted."""
        return self._used

    @property
    def bytes_pending(self) -> int:
        """Bytes freed with ``defer=True`` and not yet released."""
        return int(sum(int(x.sum()) for x in self._pend_len)) + int(self._held_len.sum())

    @property
    def high_water(self) -> int:
        """End of the bump region: every allocation lies below it."""
        return self._end

    @property
    def free_bytes(self) -> int:
        """Bytes in free extents below ``high_water`` (the bump region is not counted)."""
        return int(self._free_len.sum())

    @property
    def fragmentation(self) -> float:
        """``1 - largest free extent / free bytes`` below ``high_water``; 0 with no free bytes."""
        return fragmentation(self._free_len)

    @property
    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the free extents (offsets, lengths), sorted by offset."""
        return self._free_off.copy(), self._free_len.copy()

    # ------------------------------------------------------------------ allocate

    def _describe(self) -> str:
        cap = "unbounded" if self.capacity is None else f"{self.capacity} bytes"
        return (
            f"budget {cap}, {self._used} bytes in use, {self.free_bytes} bytes free in "
            f"{self._free_len.size} extents below the high-water mark {self._end}"
        )

    def allocate(self, sizes: np.ndarray, *, partial: bool = False) -> np.ndarray:
        """Reserve ranges for blobs of ``sizes`` bytes; return their int64 offsets.

        All or nothing: if the batch does not fit, raise
        :class:`~tiered.errors.StorageFullError` and change nothing. With ``partial`` (an
        allocator without a ``boundary``: the memory arenas), best effort instead: the blobs
        that fit now get their ranges, the others the offset -1, and nothing is raised for room.

        Raises:
            ValueError: a negative size, or one blob larger than the capacity (or boundary):
                it could never fit; ``partial`` with a ``boundary``.
            StorageFullError: the batch does not fit now (not with ``partial``).

        Example:
            >>> a = ExtentAllocator(64)
            >>> a.allocate(np.array([32, 48]), partial=True).tolist()  # the 48 bytes do not fit
            [0, -1]
        """
        sizes = align(np.asarray(sizes).reshape(-1))
        if sizes.size == 0:
            return _EMPTY.copy()
        if partial:
            if self.boundary is not None:
                raise ValueError("partial allocation is for allocators without a boundary (memory arenas)")
            return self._allocate(sizes, retries=8, undo=[], partial=True)
        undo: list[tuple[Any, ...]] = []  # filled by the first pass that keeps part of the batch
        try:
            return self._allocate(sizes, retries=8, undo=undo)
        except StorageFullError:
            if undo:
                self.restore(undo[0])  # all or nothing: undo the passes that fitted part of the batch
            raise

    def _allocate(self, sizes: np.ndarray, retries: int, undo: list[tuple[Any, ...]],
                  largest_first: bool = False, partial: bool = False) -> np.ndarray:
        """One vectorized pass over the free extents, then the bump region. When a bounded tier's
        bump region cannot take the blobs that straddled two extents, the ones that fitted are
        kept and the rest, largest first, get another pass over the holes left, largest first (at
        most ``retries`` more passes, each placing at least one blob): a fragmented cache still
        takes a batch its holes hold. With ``partial`` the blobs no pass places get -1."""
        n = sizes.size
        if int(sizes.min()) < 0:
            raise ValueError(f"blob sizes must be >= 0, got {int(sizes.min())}")
        biggest = int(sizes.max())
        if self.capacity is not None and biggest > self.capacity:
            raise ValueError(
                f"a blob of {biggest} bytes (aligned to {ALIGNMENT}) is larger than the whole "
                f"budget of {self.capacity} bytes; raise the tier's budget"
            )
        if self.boundary is not None and biggest > self.boundary:
            raise ValueError(
                f"a blob of {biggest} bytes (aligned to {ALIGNMENT}) is larger than the segment "
                f"size of {self.boundary} bytes; use a larger segment size"
            )
        total = int(sizes.sum())
        room = None if self.capacity is None else self.capacity - self._end
        if partial and room is not None:  # a blob larger than every hole and the room left: out
            roomiest = max(room, int(self._free_len.max()) if self._free_len.size else 0)
            if int(sizes.max()) > roomiest:
                offsets = np.full(n, -1, dtype=_I64)
                fits = (sizes <= roomiest).ravel().nonzero()[0]
                if fits.size:
                    offsets[fits] = self._allocate(sizes[fits], retries, undo, largest_first, partial=True)
                return offsets
        if room is not None and total > self.free_bytes + room and not partial:
            raise StorageFullError(f"cannot allocate {total} bytes for {n} blobs: {self._describe()}")

        # 1. Free extents, vectorized: lay the free extents end to end on a virtual line and the
        #    blobs end to end on the same line; a blob that starts and ends inside one extent
        #    goes there. The number of Python calls does not depend on the batch or on how
        #    fragmented the free space is (no loop over blobs or extents).
        perm = (np.argsort(-self._free_len, kind="stable") if largest_first
                else np.arange(self._free_len.size))
        ext_off, ext_len = self._free_off[perm], self._free_len[perm]
        cap = np.cumsum(ext_len)
        cap0 = cap - ext_len
        excl = exclusive_cumsum(sizes)
        k = cap.searchsorted(excl, side="right")
        k_last = cap.searchsorted(excl + np.maximum(sizes, 1) - 1, side="right")
        inside = (k < ext_len.size) & (k == k_last)
        kk = np.minimum(k, max(ext_len.size - 1, 0))
        offsets = np.full(n, -1, dtype=_I64)
        if ext_len.size:
            offsets[inside] = ext_off[kk[inside]] + (excl[inside] - cap0[kk[inside]])
        # Every extent that received blobs now holds, from its start, whatever lies before its
        # last blob's end; a blob that straddled into it leaves a gap at its start, which we keep
        # free (gaps_*), so the extent's taken prefix is [its first blob's start, last end).
        used_end = np.zeros(ext_len.size, dtype=_I64)
        used_start = np.full(ext_len.size, np.iinfo(_I64).max, dtype=_I64)
        if ext_len.size:
            np.maximum.at(used_end, kk[inside], excl[inside] + sizes[inside] - cap0[kk[inside]])
            np.minimum.at(used_start, kk[inside], excl[inside] - cap0[kk[inside]])
        hit = used_end > 0
        taken = np.where(hit, used_end, 0)
        lead = np.where(hit, used_start, 0)  # free bytes left at the start of a used extent
        gaps_off = ext_off[hit & (lead > 0)]
        gaps_len = lead[hit & (lead > 0)]

        # 2. The rest (straddlers, or no free space) bump at the end of the used region.
        rest = (~inside).ravel().nonzero()[0]
        if partial:
            return self._place_rest(sizes, offsets, inside, rest, perm, taken, gaps_off, gaps_len, retries,
                                    largest_first)
        try:
            pos, bump_gaps = self._bump(sizes[rest], offsets, rest, total)
        except StorageFullError:
            if retries <= 0 or not inside.any():
                raise
            if not undo:  # only a batch that needs a second pass pays for the undo token
                undo.append(self.snapshot())
            unpermuted = np.empty_like(taken)
            unpermuted[perm] = taken
            self._commit(unpermuted, gaps_off.tolist(), gaps_len.tolist(), self._end, int(sizes[inside].sum()))
            rest = rest[np.argsort(-sizes[rest], kind="stable")]
            offsets[rest] = self._allocate(sizes[rest], retries - 1, undo, largest_first=True)
            return offsets
        gaps_off = np.concatenate([gaps_off, np.asarray([g[0] for g in bump_gaps], dtype=_I64)])
        gaps_len = np.concatenate([gaps_len, np.asarray([g[1] for g in bump_gaps], dtype=_I64)])
        # taken bytes of the extents: [lead, used_end) is consumed; [0, lead) is re-listed as a gap
        unpermuted = np.empty_like(taken)
        unpermuted[perm] = taken
        self._commit(unpermuted, gaps_off.tolist(), gaps_len.tolist(), pos, total)
        return offsets

    def _place_rest(self, sizes: np.ndarray, offsets: np.ndarray, inside: np.ndarray, rest: np.ndarray,
                    perm: np.ndarray, taken: np.ndarray, gaps_off: np.ndarray, gaps_len: np.ndarray,
                    retries: int, largest_first: bool) -> np.ndarray:
        """``partial``: keep the blobs the pass put in extents, bump the longest prefix of the rest
        that fits under the capacity (no boundary: nothing to skip), and give what is left more
        passes over the holes, largest first, while a pass places something; -1 for the others."""
        ends = self._end + np.cumsum(sizes[rest])
        k = rest.size if self.capacity is None else int(np.searchsorted(ends, self.capacity, side="right"))
        bumped, left = rest[:k], rest[k:]
        offsets[bumped] = ends[:k] - sizes[bumped]
        unpermuted = np.empty_like(taken)
        unpermuted[perm] = taken
        self._commit(unpermuted, gaps_off.tolist(), gaps_len.tolist(), int(ends[k - 1]) if k else self._end,
                     int(sizes[inside].sum()) + int(sizes[bumped].sum()))
        if left.size and retries > 0 and self._free_len.size and (inside.any() or k or not largest_first):
            left = left[np.argsort(-sizes[left], kind="stable")]
            offsets[left] = self._allocate(sizes[left], retries - 1, [], largest_first=True, partial=True)
        return offsets

    def _bump(self, sizes: np.ndarray, offsets: np.ndarray, which: np.ndarray,
              total: int) -> tuple[int, list[tuple[int, int]]]:
        """Place ``sizes`` contiguously from the end of the used region; return the new end.

        With a ``boundary`` a blob never straddles a multiple of it: the loop below runs once per
        segment boundary crossed by the batch (almost always zero times), not once per blob.
        """
        pos = self._end
        gaps: list[tuple[int, int]] = []
        excl = exclusive_cumsum(sizes)
        start = pos + excl
        while True:
            ends = start + sizes
            if self.boundary is not None and sizes.size:
                cross = np.flatnonzero(((start // self.boundary) != ((ends - 1) // self.boundary)) & (sizes > 0))
            else:
                cross = _EMPTY
            if cross.size == 0:
                break
            i = int(cross[0])
            nxt = (int(start[i]) // self.boundary + 1) * self.boundary
            gaps.append((int(start[i]), nxt - int(start[i])))
            start[i:] += nxt - int(start[i])
        new_end = int(start[-1] + sizes[-1]) if sizes.size else pos
        if self.capacity is not None and new_end > self.capacity:
            raise StorageFullError(f"cannot allocate {total} bytes for {offsets.size} blobs: {self._describe()}")
        offsets[which] = start
        return new_end, gaps

    def _commit(self, taken: np.ndarray, gaps_off: list[int], gaps_len: list[int], end: int,
                total: int) -> None:
        off = np.concatenate([self._free_off + taken, np.asarray(gaps_off, dtype=_I64)])
        ln = np.concatenate([self._free_len - taken, np.asarray(gaps_len, dtype=_I64)])
        keep = ln > 0
        off, ln = off[keep], ln[keep]
        order = np.argsort(off, kind="stable")
        self._free_off, self._free_len = off[order], ln[order]
        self._end = end
        self._used += total

    # ------------------------------------------------------------------ free

    def _check_ranges(self, offsets: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.asarray(offsets, dtype=_I64).reshape(-1)
        sizes = align(np.asarray(sizes).reshape(-1))
        if offsets.shape != sizes.shape:
            raise ValueError(f"offsets and sizes differ in length: {offsets.size} != {sizes.size}")
        keep = sizes > 0
        offsets, sizes = offsets[keep], sizes[keep]
        if offsets.size and (int(offsets.min()) < 0 or int((offsets + sizes).max()) > self._end):
            raise ValueError(
                f"cannot free ranges outside the allocated region [0, {self._end}): "
                f"offsets {int(offsets.min())}..{int((offsets + sizes).max())}"
            )
        return offsets, sizes

    def free(self, offsets: np.ndarray, sizes: np.ndarray, *, defer: bool = False) -> None:
        """Release ranges returned by :meth:`allocate` (``sizes`` as given to it).

        Args:
            offsets: start of each range.
            sizes: sizes as passed to :meth:`allocate` (aligned here).
            defer: park the ranges until :meth:`release_deferred` (cold tiers).

        Raises:
            ValueError: a range outside the allocated region, or (without ``defer``) one that
                overlaps free space (a double free). Nothing changes. Deferred ranges are
                checked for overlaps when :meth:`release_deferred` returns them.
        """
        offsets, sizes = self._check_ranges(offsets, sizes)
        if offsets.size == 0:
            return
        if defer:
            self._pend_off.append(offsets)
            self._pend_len.append(sizes)
        else:
            self._release(offsets, sizes)
        self._used -= int(sizes.sum())

    def release_deferred(self, *, hold_last: bool = False) -> int:
        """Make deferred ranges reusable; return the bytes released.

        Args:
            hold_last: release only the ranges held by the previous ``hold_last`` call, and hold
                the ranges freed since then until the next call (two commits of delay).

        Example:
            >>> a = ExtentAllocator(1024)
            >>> off = a.allocate(np.array([64, 64]))
            >>> a.free(off[:1], np.array([64]), defer=True)
            >>> a.release_deferred(hold_last=True), a.release_deferred(hold_last=True)
            (0, 64)
        """
        pend_off = np.concatenate(self._pend_off) if self._pend_off else _EMPTY
        pend_len = np.concatenate(self._pend_len) if self._pend_len else _EMPTY
        if hold_last:
            off, ln = self._held_off, self._held_len
            self._held_off, self._held_len = pend_off, pend_len
        else:
            off, ln = np.concatenate([self._held_off, pend_off]), np.concatenate([self._held_len, pend_len])
            self._held_off, self._held_len = _EMPTY, _EMPTY
        self._pend_off, self._pend_len = [], []
        if off.size:
            self._release(off, ln)
        return int(ln.sum())

    def hold_deferred(self) -> None:
        """Hold every deferred range until the next :meth:`release_deferred` (after a reopen: the
        commit just opened may be one that a reader opened before us still reads)."""
        pend_off = np.concatenate([self._held_off, *self._pend_off])
        pend_len = np.concatenate([self._held_len, *self._pend_len])
        self._held_off, self._held_len = pend_off, pend_len
        self._pend_off, self._pend_len = [], []

    def _release(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        off = np.concatenate([self._free_off, offsets])
        ln = np.concatenate([self._free_len, sizes])
        order = np.argsort(off, kind="stable")
        off, ln = off[order], ln[order]
        end = off + ln
        if off.size > 1 and bool((off[1:] < end[:-1]).any()):
            bad = int(np.flatnonzero(off[1:] < end[:-1])[0]) + 1
            raise ValueError(
                f"double free: range at offset {int(off[bad])} overlaps free space "
                f"[{int(off[bad - 1])}, {int(end[bad - 1])})"
            )
        # coalesce touching ranges into runs, never across a segment boundary
        starts = np.ones(off.size, dtype=bool)
        starts[1:] = off[1:] != end[:-1]
        if self.boundary is not None:
            starts |= off % self.boundary == 0
        first = np.flatnonzero(starts)
        last = np.append(first[1:], off.size) - 1
        new_off = off[first]
        new_len = end[last] - new_off
        # shrink the bump region while its last extent is free
        k = new_off.size
        high = self._end
        while k and int(new_off[k - 1] + new_len[k - 1]) == high:
            k -= 1
            high = int(new_off[k])
        self._free_off, self._free_len = new_off[:k].copy(), new_len[:k].copy()
        self._end = high

    def snapshot(self) -> tuple[Any, ...]:
        """A cheap token to undo later changes with :meth:`restore` (arrays are never mutated)."""
        return (self._free_off, self._free_len, list(self._pend_off), list(self._pend_len), self._held_off,
                self._held_len, self._end, self._used)

    def restore(self, snap: tuple[Any, ...]) -> None:
        """Return to the state of :meth:`snapshot` (used to undo an allocation whose I/O failed)."""
        (self._free_off, self._free_len, pend_off, pend_len, self._held_off, self._held_len, self._end,
         self._used) = snap
        self._pend_off, self._pend_len = list(pend_off), list(pend_len)

    # ------------------------------------------------------------------ persistence

    def state(self) -> dict[str, Any]:
        """Everything needed to rebuild the allocator: ints and int64 numpy arrays."""
        pend_off = np.concatenate([self._held_off, *self._pend_off])
        pend_len = np.concatenate([self._held_len, *self._pend_len])
        return {
            "capacity": self.capacity,
            "boundary": self.boundary,
            "high_water": self._end,
            "bytes_used": self._used,
            "free_offsets": self._free_off.copy(),
            "free_sizes": self._free_len.copy(),
            "pending_offsets": pend_off,
            "pending_sizes": pend_len,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ExtentAllocator:
        """Rebuild an allocator saved by :meth:`state` (deferred ranges stay deferred)."""
        a = cls(state["capacity"], boundary=state.get("boundary"))
        a._end = int(state["high_water"])
        a._used = int(state["bytes_used"])
        a._free_off = np.asarray(state["free_offsets"], dtype=_I64).copy()
        a._free_len = np.asarray(state["free_sizes"], dtype=_I64).copy()
        po = np.asarray(state.get("pending_offsets", _EMPTY), dtype=_I64)
        if po.size:
            a._pend_off = [po.copy()]
            a._pend_len = [np.asarray(state["pending_sizes"], dtype=_I64).copy()]
        if a._free_off.shape != a._free_len.shape or (
            a._free_off.size and int((a._free_off + a._free_len).max()) > a._end
        ):
            raise ValueError("inconsistent allocator state: free extents beyond the high-water mark")
        return a

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(capacity={self.capacity}, used={self._used}, "
            f"high_water={self._end}, free_extents={self._free_len.size})"
        )
