"""Which blocks of ids (rows, blob ids) changed since a commit: what an incremental commit writes.

A :class:`DirtyBlocks` is a bitmap over blocks of :data:`BLOCK` consecutive ids. Marking is one
vectorized shift and scatter per call (no per-id loop), its memory is one byte per block, and a
commit turns the blocks into the byte ranges of each array it saves (docs/format.md, "Commit
protocol").

Example:
    >>> import numpy as np
    >>> d = DirtyBlocks()
    >>> d.mark(np.array([3, 5000, -1]))
    >>> d.blocks().tolist()
    [0, 1]
    >>> d.take().nonzero()[0].tolist(), d.blocks().tolist()
    ([0, 1], [])
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "BLOCK_SHIFT", "DirtyBlocks", "union"]

#: Ids per block (a power of two).
BLOCK_SHIFT = 12
BLOCK = 1 << BLOCK_SHIFT


class DirtyBlocks:
    """A growable bitmap of the :data:`BLOCK`-id blocks that changed."""

    def __init__(self) -> None:
        self.bits = np.zeros(0, dtype=bool)

    def _grow(self, top_block: int) -> None:
        if top_block >= self.bits.shape[0]:
            new = np.zeros(max(top_block + 1, 2 * self.bits.shape[0]), dtype=bool)
            new[: self.bits.shape[0]] = self.bits
            self.bits = new

    def mark(self, ids: np.ndarray) -> None:
        """Mark the blocks of ``ids`` (any shape; negative ids are ignored)."""
        ids = np.asarray(ids).reshape(-1)
        if not ids.size:
            return
        blocks = ids[ids >= 0].astype(np.int64) >> BLOCK_SHIFT
        if blocks.size:
            self._grow(int(np.maximum.reduce(blocks)))  # (the ufunc: .max() adds wrapper calls)
            self.bits[blocks] = True

    def mark_known(self, ids: np.ndarray, top: int) -> None:
        """Mark the blocks of ``ids``: flat int64, every one >= 0, ``top`` the largest (the blob
        ids of a read, whose largest the caller has): :meth:`mark` without its normalizing calls.

        Example:
            >>> d = DirtyBlocks()
            >>> d.mark_known(np.array([3, 5000]), 5000)
            >>> d.blocks().tolist()
            [0, 1]
        """
        self._grow(top >> BLOCK_SHIFT)
        self.bits[ids >> BLOCK_SHIFT] = True

    def mark_one(self, i: int) -> None:
        """Mark the block of one id (>= 0): a one-row write's mark without the array steps.

        Example:
            >>> d = DirtyBlocks()
            >>> d.mark_one(BLOCK + 7)
            >>> d.blocks().tolist()
            [1]
        """
        block = i >> BLOCK_SHIFT
        self._grow(block)
        self.bits[block] = True

    def mark_range(self, lo: int, hi: int) -> None:
        """Mark the blocks of ids ``[lo, hi)``."""
        if hi > lo:
            self._grow((hi - 1) >> BLOCK_SHIFT)
            self.bits[lo >> BLOCK_SHIFT:((hi - 1) >> BLOCK_SHIFT) + 1] = True

    def merge(self, bits: np.ndarray) -> None:
        """Mark again the blocks of a bitmap :meth:`take` returned (a commit that failed)."""
        if bits.shape[0]:
            self._grow(bits.shape[0] - 1)
            self.bits[: bits.shape[0]] |= bits

    def blocks(self) -> np.ndarray:
        """The marked block numbers, ascending."""
        return np.flatnonzero(self.bits)

    def take(self) -> np.ndarray:
        """The bitmap so far, and start over with nothing marked."""
        out, self.bits = self.bits, np.zeros(0, dtype=bool)
        return out


def union(bitmaps: list[np.ndarray]) -> np.ndarray:
    """The union of bitmaps of any lengths.

    Example:
        >>> union([np.array([True]), np.array([False, False, True])]).tolist()
        [True, False, True]
    """
    out = np.zeros(max([b.shape[0] for b in bitmaps] + [0]), dtype=bool)
    for b in bitmaps:  # a handful: one per commit or component
        out[: b.shape[0]] |= b
    return out

