"""The identity codec, and the batch layout helpers every codec shares.

``RawCodec`` stores cells unchanged (format ``"raw"``, format_id 0): encode packs the batch into
one compact buffer, decode copies it into the caller's output. It is the baseline the other
codecs are measured against and the codec for data that does not compress.

The helpers below move many blobs between buffers without a Python frame per blob:

* a batch whose blobs are back to back is one slice copy;
* a batch of equal-sized blobs at a constant stride (rows of a larger array) is one strided 2-D
  copy;
* anything else is one vectorized gather with ``np.repeat``-based byte indices when blobs are
  small (index arrays are cheap there), and otherwise one C-level ``map`` of memoryview slice
  assignments: ``map``, ``slice`` and ``operator.setitem`` are C callables, so the loop runs
  inside the interpreter's C code (one memcpy per blob, no Python frame, no per-byte index
  array) and the number of Python-level calls stays constant as the batch grows.

Example:
    >>> import numpy as np
    >>> from tiered.codecs.raw import RawCodec
    >>> codec = RawCodec()
    >>> cells = np.frombuffer(b"abcdefg", dtype=np.uint8)
    >>> enc = codec.encode(cells, np.array([0, 3]), np.array([3, 4]))
    >>> out = np.zeros(9, dtype=np.uint8)
    >>> codec.decode(enc.data, enc.offsets, enc.sizes, out, np.array([5, 0]), np.array([3, 4]))
    >>> out.tobytes()
    b'defg\\x00abc\\x00'
"""

from __future__ import annotations

import operator
from collections import deque
from itertools import repeat

import numpy as np

from ..errors import CorruptionError
from ..util.batch import exclusive_cumsum, is_packed
from .base import Codec, EncodedBatch
from .checksum import segment_checksums

__all__ = [
    "RawCodec",
    "as_batch",
    "check_out",
    "copy_segments",
    "gather_segments",
]

# Average blob size below which byte-index gathers beat per-blob memcpy through map(): a slice
# assignment costs a fixed Python-level step per blob, a gathered byte a few ns (a one-off
# timing on the 2-core VM put the crossing near 64 bytes).
_GATHER_MAX_AVG_BYTES = 64


def as_batch(
    data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalize a batch to (1-D uint8 data, int64 offsets, int64 sizes) and check its layout.

    Args:
        data: Contiguous buffer holding the blobs (viewed as bytes).
        offsets: Start of each blob.
        sizes: Length of each blob.

    Returns:
        The normalized ``(data, offsets, sizes)``; ``data`` is a view, never a copy.

    Raises:
        ValueError: shapes disagree, or a blob lies outside ``data`` or has a negative size.

    Example:
        >>> d, o, s = as_batch(np.zeros(4, np.uint8), [0, 2], [2, 2])
        >>> o.dtype, s.tolist()
        (dtype('int64'), [2, 2])
    """
    data = np.asarray(data)
    if data.dtype != np.uint8:
        if not data.flags.c_contiguous:
            raise ValueError("data must be a C-contiguous buffer; pass np.ascontiguousarray(data)")
        data = data.reshape(-1).view(np.uint8)
    data = data.reshape(-1)
    offsets = np.asarray(offsets)
    sizes = np.asarray(sizes)
    if offsets.ndim != 1 or sizes.ndim != 1 or offsets.shape != sizes.shape:
        raise ValueError(
            "offsets and sizes must be 1-D arrays of the same length, "
            f"got shapes {offsets.shape} and {sizes.shape}"
        )
    offsets = offsets.astype(np.int64, copy=False)
    sizes = sizes.astype(np.int64, copy=False)
    if sizes.size and (
        int(sizes.min()) < 0 or int(offsets.min()) < 0 or int((offsets + sizes).max()) > data.size
    ):
        raise ValueError(
            f"every blob must lie inside the buffer of {data.size} bytes with a non-negative size; "
            "the offsets/sizes do not describe this buffer"
        )
    return data, offsets, sizes


def _uniform_stride(offsets: np.ndarray, sizes: np.ndarray) -> int | None:
    """The constant stride between blobs of one size, or None when the layout is irregular."""
    if offsets.size < 2 or not (sizes == sizes[0]).all():
        return None
    steps = np.diff(offsets)
    stride = int(steps[0])
    if stride < int(sizes[0]) or not (steps == stride).all():
        return None
    return stride


def _strided(buf: np.ndarray, first: int, count: int, stride: int, size: int) -> np.ndarray:
    # A strided window over `buf` (writable: copy_segments writes through the destination's).
    return np.lib.stride_tricks.as_strided(buf[first:], shape=(count, size), strides=(stride, 1))


def copy_segments(
    src: np.ndarray,
    src_offsets: np.ndarray,
    sizes: np.ndarray,
    out: np.ndarray,
    out_offsets: np.ndarray,
) -> None:
    """Copy blob ``i`` from ``src[src_offsets[i]:...]`` to ``out[out_offsets[i]:...]`` for every ``i``.

    Arguments must already be normalized (uint8 1-D buffers, int64 arrays, bounds checked).
    Destination blobs must not overlap each other.

    Example:
        >>> out = np.zeros(4, np.uint8)
        >>> src, two = np.arange(4, dtype=np.uint8), np.array([2, 2])
        >>> copy_segments(src, np.array([0, 2]), two, out, np.array([2, 0]))
        >>> out.tolist()
        [2, 3, 0, 1]
    """
    n = sizes.size
    if n == 0:
        return
    total = int(sizes.sum())
    if total == 0:
        return
    if is_packed(src_offsets, sizes) and is_packed(out_offsets, sizes):
        s0, o0 = int(src_offsets[0]), int(out_offsets[0])
        out[o0 : o0 + total] = src[s0 : s0 + total]
        return
    src_stride = _uniform_stride(src_offsets, sizes)
    out_stride = _uniform_stride(out_offsets, sizes) if src_stride is not None else None
    if src_stride is not None and out_stride is not None:
        size = int(sizes[0])
        dst = _strided(out, int(out_offsets[0]), n, out_stride, size)
        np.copyto(dst, _strided(src, int(src_offsets[0]), n, src_stride, size))
        return
    if total <= _GATHER_MAX_AVG_BYTES * n:
        # Small blobs: per-byte index arithmetic, one fancy-index copy.
        within = np.arange(total, dtype=np.int64) - np.repeat(exclusive_cumsum(sizes), sizes)
        out[np.repeat(out_offsets, sizes) + within] = src[np.repeat(src_offsets, sizes) + within]
        return
    # Larger blobs: one memcpy per blob, driven by a C-level map (no Python frame per blob).
    src_mv = memoryview(src)
    out_mv = memoryview(out)
    src_end = src_offsets + sizes
    out_end = out_offsets + sizes
    parts = map(operator.getitem, repeat(src_mv), map(slice, src_offsets.tolist(), src_end.tolist()))
    deque(
        map(operator.setitem, repeat(out_mv), map(slice, out_offsets.tolist(), out_end.tolist()), parts),
        maxlen=0,
    )


def gather_segments(
    data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pack the blobs of a normalized batch back to back into a new buffer.

    Returns:
        ``(packed, packed_offsets)`` where blob ``i`` is ``packed[packed_offsets[i]:...]``.

    Example:
        >>> p, o = gather_segments(np.arange(6, dtype=np.uint8), np.array([4, 0]), np.array([2, 1]))
        >>> p.tolist(), o.tolist()
        ([4, 5, 0], [0, 2])
    """
    packed_offsets = exclusive_cumsum(sizes)
    packed = np.empty(int(sizes.sum()), dtype=np.uint8)
    copy_segments(data, offsets, sizes, packed, packed_offsets)
    return packed, packed_offsets


def check_out(
    out: np.ndarray, out_offsets: np.ndarray, out_sizes: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a decode destination and return it normalized (``out`` as a writable 1-D uint8 view).

    Raises:
        ValueError: ``out`` is not a writable contiguous buffer, the arrays do not hold one entry
            per blob, or a destination lies outside ``out``.
    """
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            "out must be a writable, C-contiguous numpy array (preallocate it once, e.g. "
            "np.empty(total, np.uint8), and reuse it)"
        )
    out_u8, out_offsets, out_sizes = as_batch(out, out_offsets, out_sizes)
    if out_sizes.size != n:
        raise ValueError(f"expected {n} out_offsets/out_sizes (one per blob), got {out_sizes.size}")
    return out_u8, out_offsets, out_sizes


class RawCodec(Codec):
    """Stores cells unchanged: the baseline codec and the one for incompressible data.

    Example:
        >>> import numpy as np
        >>> codec = RawCodec()
        >>> enc = codec.encode(np.arange(5, dtype=np.uint8), np.array([1]), np.array([3]))
        >>> enc.data.tolist(), codec.name
        ([1, 2, 3], 'raw')
    """

    name = "raw"
    format = "raw"
    format_id = 0

    def encode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> EncodedBatch:
        """Copy the batch into one compact buffer (always a copy: callers may reuse their buffers)."""
        data, offsets, sizes = as_batch(data, offsets, sizes)
        packed, packed_offsets = gather_segments(data, offsets, sizes)
        return EncodedBatch(
            packed, packed_offsets, sizes.copy(), segment_checksums(packed, packed_offsets, sizes)
        )

    def decode(
        self,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        out: np.ndarray,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
    ) -> None:
        """Copy every blob into ``out``; a blob whose size differs from ``out_sizes`` is corrupt."""
        data, offsets, sizes = as_batch(data, offsets, sizes)
        out, out_offsets, out_sizes = check_out(out, out_offsets, out_sizes, sizes.size)
        bad = np.flatnonzero(sizes != out_sizes)
        if bad.size:
            i = int(bad[0])
            raise CorruptionError(
                f"raw blob {i} holds {int(sizes[i])} bytes but {int(out_sizes[i])} were expected "
                f"({bad.size} blob(s) disagree); the blob index does not match the data: run "
                "`tiered verify` on the store"
            )
        copy_segments(data, offsets, sizes, out, out_offsets)
