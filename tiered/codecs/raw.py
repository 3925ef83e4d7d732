"""The identity codec, and the batch checks every codec shares.

``RawCodec`` stores cells unchanged (format ``"raw"``, format_id 0): encode packs the batch into
one compact buffer, decode copies it into the caller's output. It is the baseline the other
codecs are measured against and the codec for data that does not compress. Both move the blobs
with the package's batched host copy (:mod:`tiered.util.hostcopy`): no Python frame per blob.

:func:`as_batch` and :func:`check_out` normalize and check a batch and a decode destination
once, so that the codecs copy with the unchecked :func:`~tiered.util.hostcopy.copy_host_blobs`.

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

import numpy as np

from ..errors import CorruptionError
from ..util.hostcopy import copy_host_blobs, pack_blobs
from .base import Codec, EncodedBatch
from .checksum import check_layout, segment_checksums

__all__ = ["RawCodec", "as_batch", "check_out"]


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
    if not (type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1
            and type(offsets) is np.ndarray and offsets.dtype == np.int64 and offsets.ndim == 1
            and type(sizes) is np.ndarray and sizes.dtype == np.int64 and sizes.shape == offsets.shape):
        # anything but the arrays a store's read path builds (those skip the ~14 calls of this)
        data, offsets, sizes = _normalized(data, offsets, sizes)
    check_layout(data.size, offsets, sizes)
    return data, offsets, sizes


def _normalized(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    return data, offsets.astype(np.int64, copy=False), sizes.astype(np.int64, copy=False)


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
        packed, packed_offsets = pack_blobs(data, offsets, sizes)
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
        copy_host_blobs(data, offsets, out, out_offsets, sizes)
