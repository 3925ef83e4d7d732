"""Batch index arithmetic: offsets, ranges, overlaps, membership and balanced splits, without Python loops.

Every helper is a fixed number of numpy calls whatever the batch size, so the number of Python
calls made by ``extend`` and ``get`` does not grow with the batch.

Example:
    >>> import numpy as np
    >>> from tiered.util.batch import exclusive_cumsum, ranges
    >>> exclusive_cumsum(np.array([3, 0, 2])).tolist()
    [0, 3, 3]
    >>> ranges(np.array([10, 20]), np.array([2, 3])).tolist()
    [10, 11, 20, 21, 22]
"""

from __future__ import annotations

import numpy as np

__all__ = ["exclusive_cumsum", "extents_overlap", "is_packed", "isin", "ranges", "split_balanced"]


def exclusive_cumsum(sizes: np.ndarray) -> np.ndarray:
    """Offsets of blobs of ``sizes`` laid out back to back from 0.

    Example:
        >>> exclusive_cumsum(np.array([3, 0, 2])).tolist()
        [0, 3, 3]
    """
    out = np.zeros(sizes.size, dtype=np.int64)
    # no branch on the size: callers count on a call count that does not depend on the batch
    sizes[:-1].cumsum(out=out[1:])  # the method: np.cumsum adds Python-level wrapper calls
    return out


def extents_overlap(offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether any two of the byte ranges ``[offset, offset + length)`` overlap (empty ones
    never do). Two sorts, no argsort: non-empty ranges are disjoint exactly when, with their
    starts and their ends each sorted, every end is at most the next start (the i-th end need
    not belong to the i-th start).

    Example:
        >>> extents_overlap(np.array([0, 64, 32]), np.array([32, 16, 32]))
        False
        >>> extents_overlap(np.array([0, 64, 16]), np.array([32, 16, 16]))
        True
    """
    offsets, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    keep = lengths > 0
    start, end = np.sort(offsets[keep]), np.sort(offsets[keep] + lengths[keep])
    return bool((start[1:] < end[:-1]).any())


def is_packed(offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """True when every blob starts where the previous one ends (``offsets[i+1] == offsets[i] + sizes[i]``).

    Example:
        >>> is_packed(np.array([4, 7, 7]), np.array([3, 0, 5]))
        True
    """
    return bool(np.array_equal(offsets[1:], offsets[:-1] + sizes[:-1]))


def isin(values: np.ndarray, members: np.ndarray) -> np.ndarray:
    """``np.isin`` for int64 ids with one code path (numpy's switches to a Python loop over
    ``members`` when it is small, which makes the call count depend on the data)."""
    sorted_members = np.append(np.sort(members), np.iinfo(np.int64).max)
    pos = np.searchsorted(sorted_members, values)
    return sorted_members[pos] == values


def ranges(base: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([base[i] + arange(counts[i]) for i])``, without the loop.

    Example:
        >>> ranges(np.array([10, 20]), np.array([2, 3])).tolist()
        [10, 11, 20, 21, 22]
    """
    counts = counts.astype(np.int64)
    return np.repeat(base.astype(np.int64) - exclusive_cumsum(counts), counts) + np.arange(int(counts.sum()))


def split_balanced(weights: np.ndarray, parts: int) -> np.ndarray:
    """Cut points splitting ``len(weights)`` items into ``parts`` contiguous slices of similar total weight.

    Returns:
        int64 array ``b`` of ``parts + 1`` non-decreasing bounds: slice ``j`` is ``b[j]:b[j+1]``.

    Example:
        >>> split_balanced(np.array([5, 1, 1, 1, 1, 1]), 2).tolist()
        [0, 1, 6]
    """
    n = weights.size
    cum = weights.cumsum(dtype=np.int64)
    total = int(cum[-1]) if n else 0
    if total == 0:
        bounds = (np.arange(parts + 1, dtype=np.int64) * n) // parts
    else:
        # Slice j ends after the item where the running weight first reaches j/parts of the total.
        targets = (np.arange(1, parts, dtype=np.int64) * total) // parts
        bounds = np.concatenate([[0], cum.searchsorted(targets, side="left") + 1, [n]])
    return np.maximum.accumulate(np.minimum(bounds, n)).astype(np.int64)
