"""Byte copies between host buffers (numpy only): the host half of :mod:`tiered.util.copy`.

Kept apart from the torch half so that the CPU codecs, and through them ``tiered verify
--decode``, load without torch.

The number of Python-level calls of a copy does not grow with the number of blobs nor with their
sizes: every branch below is taken on the layout (and, for the runs, on whether there are more
than 64 of them), and the size classes are all visited, empty or not.

Host buffers (numpy arrays, CPU tensors viewed as numpy) are copied by :func:`copy_host_blobs`,
one of these ways, in this order (:data:`HOST_COPY_PATHS`):

- ``"slice"``: a batch packed back to back in both buffers is one slice copy;
- ``"strided"``: equal-sized blobs at a constant stride in both buffers (rows of a larger
  array) are one strided 2-D copy;
- ``"runs"``: anything else. Blobs adjacent in both buffers are merged into runs (a single
  run is one slice copy), and each run goes by its size:

  * under 128 bytes, its bytes: one fancy-index copy of every such byte, the indices built
    with ``np.repeat``;
  * under 2 KiB, rows of 128 bytes, its last row shifted back to end at its last byte: one
    fancy-index copy between overlapping 128-byte windows of the buffers (a ``memcpy`` per
    row, no per-byte index);
  * from 2 KiB, one ``memcpy``: a C-level ``map`` of memoryview slice assignments (``map``,
    ``slice`` and ``operator.setitem`` are C callables, so the loop runs in the
    interpreter's C code, no Python frame per run).

  A memoryview assignment costs about a microsecond whatever its size, a 128-byte row 50-80 ns
  and a gathered byte a few ns, so each size goes where it is cheapest; the classes cost about
  40 numpy calls per copy in all (timed with ``benchmarks/bench_copy.py``). Up to 64 blobs
  (a small sampled batch), every blob is one memcpy instead, unmerged; up to 64 runs, every run:
  those 40 calls would cost more than the copies (a constant number of calls on each side of
  each cut).

Destination ranges must not overlap each other (sources may), nor the sources when both are one buffer.

Example:
    >>> import numpy as np
    >>> from tiered.util.hostcopy import pack_blobs
    >>> packed, offsets = pack_blobs(np.arange(10, dtype=np.uint8), np.array([7, 0]), np.array([3, 2]))
    >>> packed.tolist(), offsets.tolist()
    ([7, 8, 9, 0, 1], [0, 3])
"""

from __future__ import annotations

import operator
from collections import deque
from itertools import repeat

import numpy as np

from .batch import exclusive_cumsum

__all__ = ["HOST_COPY_PATHS", "copy_host_blobs", "host_copy_path", "merge_runs", "pack_blobs"]

#: The ways :func:`copy_host_blobs` copies a batch (``"none"``: nothing to copy).
HOST_COPY_PATHS = ("none", "slice", "strided", "runs")

# The "runs" path copies a run under _ROW bytes byte by byte, one under _MEMCPY_MIN_BYTES as rows
# of _ROW bytes, and a larger one with one memcpy: 16 rows cost about the microsecond of one
# memoryview assignment. Sampled blobs are small (compressed Atari chunks: median ~320 B).
_ROW = 128
_MEMCPY_MIN_BYTES = 2048
_CLASS_EDGES = np.array([_ROW, _MEMCPY_MIN_BYTES], dtype=np.int64)
_CLASS_STARTS = np.array([1, 2], dtype=np.int64)
_TRUE = np.ones(1, dtype=bool)
# Up to this many runs, every run is one memcpy whatever its size: the size classes' ~40 numpy
# calls (~50 us) cost more than ~0.5 us of memoryview assignment per run (a sampled batch of
# 32 Atari stacks reads ~45 blobs: ~20 us against ~55 us). The calls are fixed on either side.
_FEW_RUNS = 64


def _follows(src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per blob after the first: does it start where the previous one ends, in both buffers?"""
    ends = sizes[:-1]
    return (src_offsets[1:] == src_offsets[:-1] + ends) & (dst_offsets[1:] == dst_offsets[:-1] + ends)


def _runs(src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray,
          follows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    first = np.concatenate([_TRUE, ~follows]).nonzero()[0]
    return src_offsets[first], dst_offsets[first], np.add.reduceat(sizes, first)


def merge_runs(src_offsets: np.ndarray, dst_offsets: np.ndarray,
               sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge blobs that follow each other in both buffers into runs (one copy each).

    Args:
        src_offsets, dst_offsets, sizes: int64 arrays of one entry per blob.

    Returns:
        ``(src_offsets, dst_offsets, sizes)`` of the runs, in blob order.

    Example:
        >>> s, d, n = merge_runs(np.array([0, 4, 9]), np.array([10, 14, 30]), np.array([4, 5, 1]))
        >>> s.tolist(), d.tolist(), n.tolist()
        ([0, 9], [10, 30], [9, 1])
    """
    if sizes.size == 0:
        return src_offsets, dst_offsets, sizes
    return _runs(src_offsets, dst_offsets, sizes, _follows(src_offsets, dst_offsets, sizes))


def _uniform_stride(offsets: np.ndarray, sizes: np.ndarray) -> int | None:
    """The constant stride between blobs of one size, or None when the layout is irregular."""
    if offsets.size < 2 or not np.logical_and.reduce(sizes == sizes[0]):  # (no .all() wrapper calls)
        return None
    steps = np.diff(offsets)
    stride = int(steps[0])
    if stride < int(sizes[0]) or not (steps == stride).all():
        return None
    return stride


def _strides(s: np.ndarray, d: np.ndarray, n: np.ndarray) -> tuple[int, int] | None:
    """``(source stride, destination stride)`` when the batch is equal blobs at constant strides."""
    src_stride = _uniform_stride(s, n)
    dst_stride = _uniform_stride(d, n) if src_stride is not None else None
    return None if src_stride is None or dst_stride is None else (src_stride, dst_stride)


def host_copy_path(src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray) -> str:
    """The name of the path (:data:`HOST_COPY_PATHS`) :func:`copy_host_blobs` takes for a batch.

    For tests and benchmarks: the copy itself does not call it.

    Example:
        >>> host_copy_path(np.array([0, 8]), np.array([0, 8]), np.array([8, 8]))
        'slice'
        >>> host_copy_path(np.array([0, 100]), np.array([0, 8]), np.array([8, 8]))
        'strided'
        >>> host_copy_path(np.array([0, 100, 200]), np.array([0, 300, 8]), np.array([8, 300, 2]))
        'runs'
    """
    s, d, n = (np.asarray(v, dtype=np.int64).reshape(-1) for v in (src_offsets, dst_offsets, sizes))
    if int(n.sum()) == 0:
        return "none"
    if _follows(s, d, n).all():
        return "slice"
    return "runs" if _strides(s, d, n) is None else "strided"


def _strided(buf: np.ndarray, first: int, count: int, stride: int, size: int) -> np.ndarray:
    """``count`` rows of ``size`` bytes of ``buf``, ``stride`` apart from byte ``first`` (a view)."""
    return np.ndarray((count, size), np.uint8, buf, first, (stride, 1))


def _windows(buf: np.ndarray, width: int) -> np.ndarray:
    """Every ``width``-byte window of ``buf``: row ``i`` is ``buf[i:i + width]`` (a view, as writable as ``buf``)."""
    # the ndarray constructor: one C call (as_strided is a few Python-level ones)
    return np.ndarray((max(0, buf.size - width + 1), width), np.uint8, buf, 0, (1, 1))


def _copy_runs(src: np.ndarray, s: np.ndarray, dst: np.ndarray, d: np.ndarray, n: np.ndarray) -> None:
    """The "runs" path: bytes, 128-byte rows or a memcpy per run, by size (0-byte runs allowed)."""
    # Runs sorted by size class, so each class is one slice of the arrays; no class is skipped
    # when empty, so the calls are the same for every batch.
    cls = _CLASS_EDGES.searchsorted(n, side="right")
    order = cls.argsort(kind="stable")
    s, d, n = s[order], d[order], n[order]
    rows_from, memcpy_from = cls[order].searchsorted(_CLASS_STARTS).tolist()
    # Small runs: every byte, indexed.
    ss, dd, nn = s[:rows_from], d[:rows_from], n[:rows_from]
    # (array methods, not np.repeat: the module functions add Python-level wrapper calls)
    within = np.arange(int(nn.sum()), dtype=np.int64) - exclusive_cumsum(nn).repeat(nn)
    dst[dd.repeat(nn) + within] = src[ss.repeat(nn) + within]
    # Mid-sized runs: a run of n bytes is ceil(n / 128) rows; its last row is shifted back to end
    # exactly at byte n, so rows overlap inside the run (bytes written twice) but never leave it.
    ss, dd, nn = s[rows_from:memcpy_from], d[rows_from:memcpy_from], n[rows_from:memcpy_from]
    rows = (nn + _ROW - 1) // _ROW
    step = np.minimum((np.arange(int(rows.sum()), dtype=np.int64) - exclusive_cumsum(rows).repeat(rows)) * _ROW,
                      (nn - _ROW).repeat(rows))
    _windows(dst, _ROW)[dd.repeat(rows) + step] = _windows(src, _ROW)[ss.repeat(rows) + step]
    # Large runs: one memcpy each, from C.
    _memcpy_runs(src, s[memcpy_from:], dst, d[memcpy_from:], n[memcpy_from:])


def copy_host_blobs(src: np.ndarray, src_offsets: np.ndarray, dst: np.ndarray, dst_offsets: np.ndarray,
                    sizes: np.ndarray) -> None:
    """:func:`copy_blobs` between host buffers, for arguments already checked.

    ``src`` and ``dst`` are contiguous 1-D uint8 numpy arrays; the offsets and sizes are int64
    arrays of one entry per blob whose ranges lie inside the buffers (``copy_blobs`` checks
    all that; codecs check it once per batch with ``as_batch``). 0-byte blobs are allowed.

    Example:
        >>> out = np.zeros(4, np.uint8)
        >>> copy_host_blobs(np.arange(4, dtype=np.uint8), np.array([0, 2]), out, np.array([2, 0]),
        ...                 np.array([2, 2]))
        >>> out.tolist()
        [2, 3, 0, 1]
    """
    total = int(np.add.reduce(sizes))
    if total == 0:
        return
    src_ends, dst_ends = src_offsets + sizes, dst_offsets + sizes  # (for the test and the memcpys)
    follows = (src_offsets[1:] == src_ends[:-1]) & (dst_offsets[1:] == dst_ends[:-1])
    if np.logical_and.reduce(follows):  # packed back to back in both buffers
        a, b = int(src_offsets[0]), int(dst_offsets[0])
        dst[b:b + total] = src[a:a + total]
        return
    strides = _strides(src_offsets, dst_offsets, sizes)
    if strides is not None:
        count, size = sizes.size, int(sizes[0])
        np.copyto(_strided(dst, int(dst_offsets[0]), count, strides[1], size),
                  _strided(src, int(src_offsets[0]), count, strides[0], size))
        return
    if sizes.size <= _FEW_RUNS:
        # a sampled batch (a B=32 sample reads ~45 blobs, of which about one follows another in
        # both buffers): a memcpy per blob, without merging runs first (~7 numpy calls to save
        # about one memcpy of ~0.5 us)
        _memcpy(src, src_offsets.tolist(), src_ends.tolist(), dst, dst_offsets.tolist(), dst_ends.tolist())
        return
    # (0-byte blobs stay: they cost nothing in the byte class, and filtering them costs calls)
    s, d, n = _runs(src_offsets, dst_offsets, sizes, follows)
    if n.size == 1:
        a, b = int(s[0]), int(d[0])
        dst[b:b + total] = src[a:a + total]
        return
    if n.size <= _FEW_RUNS:
        _memcpy_runs(src, s, dst, d, n)
        return
    _copy_runs(src, s, dst, d, n)


def _memcpy_runs(src: np.ndarray, s: np.ndarray, dst: np.ndarray, d: np.ndarray, n: np.ndarray) -> None:
    """One memcpy per run."""
    _memcpy(src, s.tolist(), (s + n).tolist(), dst, d.tolist(), (d + n).tolist())


def _memcpy(src: np.ndarray, starts: list[int], ends: list[int], dst: np.ndarray, dst_starts: list[int],
            dst_ends: list[int]) -> None:
    """``dst[dst_starts[i]:dst_ends[i]] = src[starts[i]:ends[i]]`` for every ``i``, looped in C (a
    ``map`` of memoryview slice assignments)."""
    parts = map(operator.getitem, repeat(memoryview(src)), map(slice, starts, ends))
    deque(map(operator.setitem, repeat(memoryview(dst)), map(slice, dst_starts, dst_ends), parts), maxlen=0)


def pack_blobs(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Copy the blobs of a host buffer back to back into a new buffer (arguments already checked).

    Returns:
        ``(packed, packed_offsets)`` where blob ``i`` is ``packed[packed_offsets[i]:...]``.

    Example:
        >>> p, o = pack_blobs(np.arange(6, dtype=np.uint8), np.array([4, 0]), np.array([2, 1]))
        >>> p.tolist(), o.tolist()
        ([4, 5, 0], [0, 2])
    """
    packed_offsets = exclusive_cumsum(sizes)
    packed = np.empty(int(sizes.sum()), dtype=np.uint8)
    copy_host_blobs(data, offsets, packed, packed_offsets, sizes)
    return packed, packed_offsets
