"""Batched, position-sensitive checksums of blobs, on numpy arrays or torch tensors (CPU or GPU).

Every blob stored by tiered carries the checksum of its *compressed* bytes, computed at encode
time and checked before decode (always before a GPU decode: nvCOMP's decoders have undefined
behaviour on corrupt input). The checksum is a Fletcher/Adler-style pair of sums, chosen because
it vectorizes as prefix sums over one buffer, so a whole batch is checked without a Python loop
per blob, and the same integers come out of numpy and of torch on any device.

Format (this definition is part of the on-disk format, docs/format.md)::

    For a blob of n bytes b[0], ..., b[n-1] (unsigned, 0..255):

        s1 = (b[0] + b[1] + ... + b[n-1])                       mod 2**32
        s2 = (1*b[0] + 2*b[1] + ... + n*b[n-1])                 mod 2**32
        checksum = (s2 << 32) | s1      as a 64-bit word, stored as a signed int64
                                        (two's complement: values with s2 >= 2**31 are negative)

    A 0-byte blob has checksum 0. The weight of a byte is its 1-based position *inside its
    blob*, so swapping, shifting or moving bytes changes s2 even when s1 does not change.

How it is computed: with ``g`` the position of a byte in the enclosing buffer and ``start`` the
position of the blob's first byte, ``i + 1 = g - start + 1``, so

    s2 = sum(b[g] * g) - (start - 1) * s1

Both sums over ``[start, start + n)`` are differences of two prefix sums over the buffer, which
numpy and torch compute for every blob at once. The identity is exact in any modulus that is a
multiple of 2**32, so the implementation is free to wrap: numpy accumulates in uint32 (exact for
the low 32 bits, half the memory traffic of uint64) with ``np.add.reduceat`` between blob
boundaries, torch in int64 prefix sums on chunks small enough never to overflow, masked to 32
bits.

Example:
    >>> import numpy as np
    >>> from tiered.codecs.checksum import segment_checksums
    >>> data = np.frombuffer(b"abcab", dtype=np.uint8)
    >>> segment_checksums(data, np.array([0, 3, 5]), np.array([3, 2, 0])).tolist()
    [2534030704934, 1258425417923, 0]
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["segment_checksums", "segment_checksums_torch", "verify", "checksum_reference", "check_layout"]

_MASK32 = 0xFFFFFFFF
# Bytes per pass. numpy: 4 MiB, so one pass covers any realistic sampled batch of compressed blobs
# and the number of Python calls of a `get` does not depend on its size; the chunking only bounds
# the uint32 temporaries (4 bytes per data byte; the shared weights cost 16 MiB once) for huge
# inputs such as a whole-store verify. torch: keeps its int64 prefix sums below 2**63
# (255 * n**2 / 2 < 2**63 for n = 2**26). The loops over chunks run once per chunk of data,
# never once per blob.
_NP_CHUNK = 1 << 22
_TRUE = np.ones(1, dtype=bool)
_SHIFT32 = np.uint64(32)
# the small path writes each checksum's two 32-bit halves in place, which is byte-order dependent
_LITTLE_ENDIAN = sys.byteorder == "little"
# Blobs of at least this many bytes on average are summed by blocks (:func:`_block_prefix`):
# block reductions beat numpy's casting reduceat there; smaller blobs (hundreds of bytes: Atari
# frames) have too many block edges for it to pay.
_BLOCK_MIN_MEAN_BYTES = 2048
# Block length: a block's weighted sum is at most 255 * (0 + 1 + ... + 255) = 8,323,200 < 2**24.
# The blocks are summed in float32, which holds every integer below 2**24 exactly: every partial
# sum of a block's non-negative integer terms is at most its total, so the sums are exact in any
# order of addition (numpy's SIMD loops add in lanes). float32 because numpy converts uint8 to it
# and sums it several times faster than it sums uint8 into integers (0.09 + 0.06 + 0.13 ms against
# 0.17 + 0.22 ms for the two sums of 0.9 MB, thread CPU on a 2-core VM).
_BLOCK = 256
_BLOCK_WEIGHTS_F32 = np.arange(_BLOCK, dtype=np.float32)
_TORCH_CHUNK = 1 << 26
# Batches that fit one pass skip the pass loop's bookkeeping (~20 numpy calls: ~18 us of thread
# CPU for 2 blobs); blobs smaller than this on average (compressed Atari chunks: ~1 KB) are summed
# there with reduceat, larger ones (compressed float stacks: ~14 KB) by blocks.
_ONE_PASS_MAX_MEAN_BYTES = 2048


def _as_index(a: np.ndarray, name: str) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1:  # (as a read builds them: no calls)
        return a
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D integer array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def check_layout(nbytes: int, offsets: np.ndarray, sizes: np.ndarray) -> None:
    """Raise ValueError unless int64 ``offsets`` and ``sizes`` describe blobs inside ``nbytes`` bytes.

    Example:
        >>> check_layout(4, np.array([0, 2]), np.array([2, 3]))
        Traceback (most recent call last):
        ...
        ValueError: blob (offset, size) pairs must lie inside the buffer of 4 bytes with ...
    """
    if offsets.shape != sizes.shape:
        raise ValueError(
            f"offsets and sizes must have the same length, got {offsets.shape} and {sizes.shape}"
        )
    if offsets.size and (
        # ufunc reductions, not .min()/.max(): those add Python-level wrapper calls per batch
        int(np.minimum.reduce(sizes)) < 0 or int(np.minimum.reduce(offsets)) < 0
        or int(np.maximum.reduce(offsets + sizes)) > nbytes
    ):
        raise ValueError(
            f"blob (offset, size) pairs must lie inside the buffer of {nbytes} bytes "
            "with non-negative sizes; the offsets/sizes do not describe this buffer (read from a store: "
            "its blob index is inconsistent with the data, run `tiered verify`)"
        )


def segment_checksums(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Checksum of every blob ``data[offsets[i] : offsets[i] + sizes[i]]``, in one vectorized pass.

    Blobs may appear in any order, overlap, or leave gaps; the work is proportional to the span
    from the first blob byte to the last one, and the number of Python-level operations does not
    depend on the number of blobs.

    Args:
        data: 1-D uint8 array (any 1-D buffer of bytes is viewed as uint8).
        offsets: Start of each blob in ``data``.
        sizes: Length of each blob in bytes (0 allowed).

    Returns:
        int64 array of ``len(sizes)`` checksums, as defined in the module docstring.

    Raises:
        ValueError: a blob lies outside ``data`` or has a negative size.

    Example:
        >>> import numpy as np
        >>> segment_checksums(np.arange(4, dtype=np.uint8), np.array([0, 1]), np.array([4, 0])).tolist()
        [85899345926, 0]
    """
    if not (type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1):
        data = np.asarray(data)
        if data.dtype != np.uint8:
            data = data.reshape(-1).view(np.uint8)
        data = data.reshape(-1)
    if type(offsets) is np.ndarray and type(sizes) is np.ndarray and offsets.dtype == sizes.dtype == np.int64 \
            and offsets.ndim == 1 and sizes.shape == offsets.shape and sizes.size:
        small = _small_packed_checksums(data, offsets, sizes)
        if small is not None:
            return small
    offsets = _as_index(offsets, "offsets")
    sizes = _as_index(sizes, "sizes")
    check_layout(data.size, offsets, sizes)
    n = sizes.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    packed = _packed_checksums(data, offsets, sizes)
    if packed is not None:
        return packed
    ends = offsets + sizes
    # General layout (any order, overlaps, gaps). Sums are needed between consecutive "points"
    # (every blob start and end, plus a cut every _NP_CHUNK bytes so temporaries stay small and
    # in cache). np.add.reduceat sums all those segments in one call per chunk; prefix sums over
    # the (few) segment sums then give F1(x) = sum(b[g], g < x) and F2(x) = sum(b[g] * g, g < x)
    # at every point.
    points = np.unique(np.concatenate([offsets, ends]))
    lo, hi = int(points[0]), int(points[-1])
    cuts = np.arange(lo, hi, _NP_CHUNK, dtype=np.int64)
    points = np.union1d(points, cuts)
    nseg = points.size - 1
    seg1 = np.zeros(nseg, dtype=np.uint32)
    seg2 = np.zeros(nseg, dtype=np.uint32)
    first = np.append(np.searchsorted(points, cuts), nseg)
    weights = _arange32(min(_NP_CHUNK, hi - lo))
    buf = np.empty(min(_NP_CHUNK, hi - lo), dtype=np.uint32)
    with np.errstate(over="ignore"):
        for k, c0 in enumerate(cuts.tolist()):
            c1 = min(c0 + _NP_CHUNK, hi)
            a, b = int(first[k]), int(first[k + 1])
            local = points[a:b] - c0
            chunk = data[c0:c1]
            s1 = np.add.reduceat(chunk, local, dtype=np.uint32)
            # Weights relative to c0 fit in uint32; c0 * s1 restores the global position g.
            prod = np.multiply(chunk, weights[: c1 - c0], out=buf[: c1 - c0])
            seg1[a:b] = s1
            seg2[a:b] = np.add.reduceat(prod, local) + np.uint32(c0 & _MASK32) * s1
        f1 = np.zeros(nseg + 1, dtype=np.uint32)
        f2 = np.zeros(nseg + 1, dtype=np.uint32)
        np.cumsum(seg1, out=f1[1:])
        np.cumsum(seg2, out=f2[1:])
        i_start = np.searchsorted(points, offsets)
        i_end = np.searchsorted(points, ends)
        s1 = f1[i_end] - f1[i_start]
        s2 = (f2[i_end] - f2[i_start]) - (offsets - 1).astype(np.uint32) * s1
    return ((s2.astype(np.uint64) << np.uint64(32)) | s1.astype(np.uint64)).view(np.int64)


def _small_packed_checksums(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
    """The checksums of a sampled batch as a store's read lays it out (int64 arrays, non-empty
    blobs back to back, small on average: compressed Atari chunks), or None for any other batch.

    The layout test is also the bounds check: packed blobs of positive sizes from ``offsets[0] >= 0``
    to ``ends[-1] <= data.size`` all lie inside ``data``. About half the numpy calls of the
    general entry's checks and :func:`_packed_checksums` (~10 us less a read of a few blobs).
    """
    ends = offsets + sizes
    lo, hi = int(offsets[0]), int(ends[-1])
    if (lo < 0 or hi > data.size or hi - lo > _NP_CHUNK or hi - lo >= _ONE_PASS_MAX_MEAN_BYTES * sizes.size
            or int(np.minimum.reduce(sizes)) <= 0 or not np.logical_and.reduce(offsets[1:] == ends[:-1])):
        return None
    span = data[lo:hi]
    local = offsets - lo
    if not _LITTLE_ENDIAN:  # the reference form (the halves below give the same words, checked on x86)
        s1 = np.add.reduceat(span, local, dtype=np.uint32)
        s2 = np.add.reduceat(np.multiply(span, _arange32(hi - lo)[:hi - lo], dtype=np.uint32), local)
        s2 -= (local - 1).astype(np.uint32) * s1  # (uint32 arrays wrap silently: exact mod 2**32)
        return ((s2.astype(np.uint64) << _SHIFT32) | s1).view(np.int64)
    # s1 and s2 summed straight into the low and high halves of each little-endian int64
    # checksum: no shift, no or, no uint64 temporaries (4 numpy calls fewer on every read)
    pair = np.empty((sizes.size, 2), np.uint32)
    s1 = np.add.reduceat(span, local, dtype=np.uint32, out=pair[:, 0])
    s2 = np.add.reduceat(np.multiply(span, _arange32(hi - lo)[:hi - lo], dtype=np.uint32), local, out=pair[:, 1])
    start = np.subtract(local, 1, dtype=np.uint32, casting="unsafe")  # (wraps: exact mod 2**32)
    start *= s1
    s2 -= start
    return pair.view(np.int64).reshape(-1)


def _packed_checksums(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
    """Fast path for the common layout: non-empty blobs back to back in order (as encode writes them).

    Each blob is then exactly one segment between consecutive starts, so one ``np.add.reduceat``
    per sum gives every blob's value directly. Returns None for other layouts.
    """
    nonempty = sizes > 0
    # ufunc reductions, not .any()/.all()/.max(): those add Python-level wrapper calls per batch
    if not np.logical_or.reduce(nonempty):
        return np.zeros(sizes.size, dtype=np.int64)
    all_nonempty = bool(np.logical_and.reduce(nonempty))
    starts = offsets if all_nonempty else offsets[nonempty]
    lens = sizes if all_nonempty else sizes[nonempty]
    lo = int(starts[0])
    hi = int(starts[-1] + lens[-1])
    if not np.logical_and.reduce(starts[1:] == starts[:-1] + lens[:-1]):
        return None
    total = int(np.add.reduce(lens))
    if hi - lo <= _NP_CHUNK:
        # one pass (a sampled batch): weights relative to lo, so with local = start - lo,
        # s2 = sum(b * (g - lo)) - (local - 1) * s1 (integer arrays wrap silently)
        span = data[lo:hi]
        local = starts - lo
        if total < _ONE_PASS_MAX_MEAN_BYTES * lens.size:  # small blobs (compressed Atari chunks)
            s1 = np.add.reduceat(span, local, dtype=np.uint32)
            bg = np.add.reduceat(np.multiply(span, _arange32(hi - lo)[:hi - lo], dtype=np.uint32), local)
        else:  # large blobs (float stacks): by blocks, without the pass loop's bookkeeping
            f1, f2 = _block_prefix(span, np.append(local, hi - lo))
            s1 = (f1[1:] - f1[:-1]).astype(np.uint32)
            bg = (f2[1:] - f2[:-1]).astype(np.uint32)
        s2 = bg - (local - 1).astype(np.uint32) * s1
        result = (s2.astype(np.uint64) << np.uint64(32)) | s1
        if all_nonempty:
            return result.view(np.int64)
        full = np.zeros(sizes.size, dtype=np.uint64)
        full[nonempty] = result
        return full.view(np.int64)
    s1 = np.empty(starts.size, dtype=np.uint32)
    bg = np.empty(starts.size, dtype=np.uint32)
    # Groups of whole blobs spanning at most _NP_CHUNK bytes keep the uint32 temporary in cache;
    # the loop runs once per chunk of data, not per blob. The marks are closer than _NP_CHUNK by
    # the largest blob, so a group fits the shared weight table (no fresh 16 MiB table for one
    # that overran it).
    step = max(_NP_CHUNK - int(np.maximum.reduce(lens)), _NP_CHUNK // 2)
    # sorted already (starts ascend): duplicates dropped without np.unique's sort
    cuts = starts.searchsorted(np.arange(lo, hi, step), side="left")
    cuts = cuts[np.concatenate([_TRUE, cuts[1:] != cuts[:-1]])]
    bounds = np.concatenate([cuts[cuts < starts.size], [starts.size]]).tolist()
    blocks = total >= _BLOCK_MIN_MEAN_BYTES * lens.size
    weights = None if blocks else _arange32(min(_NP_CHUNK, hi - lo))
    with np.errstate(over="ignore"):
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            g0 = int(starts[a])
            g1 = int(starts[b - 1] + lens[b - 1])
            span = data[g0:g1]
            local = starts[a:b] - g0
            if blocks:
                # the same two sums (local weights g - g0), as differences of exact prefix sums
                f1, f2 = _block_prefix(span, np.append(local, g1 - g0))
                s1[a:b] = (f1[1:] - f1[:-1]).astype(np.uint32)
                bg[a:b] = (f2[1:] - f2[:-1]).astype(np.uint32) + np.uint32(g0 & _MASK32) * s1[a:b]
                continue
            w = weights[: g1 - g0] if g1 - g0 <= weights.size else np.arange(g1 - g0, dtype=np.uint32)
            part1 = np.add.reduceat(span, local, dtype=np.uint32)
            # sum(b * g) with g = (g - g0) + g0; then s2 = sum(b * g) - (start - 1) * s1.
            part2 = np.add.reduceat(np.multiply(span, w, dtype=np.uint32), local)
            s1[a:b] = part1
            bg[a:b] = part2 + np.uint32(g0 & _MASK32) * part1
        s2 = bg - (starts - 1).astype(np.uint32) * s1
    result = (s2.astype(np.uint64) << np.uint64(32)) | s1.astype(np.uint64)
    if all_nonempty:
        return result.view(np.int64)
    full = np.zeros(sizes.size, dtype=np.uint64)
    full[nonempty] = result
    return full.view(np.int64)


def _block_prefix(span: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sum(b[g], g < p), sum(b[g] * g, g < p))`` modulo 2**64 (int64 arithmetic wraps; the
    caller keeps the low 32 bits) of a uint8 ``span`` at each of the sorted ``points`` in
    ``[0, span.size]``.

    The span is cut into blocks of ``_BLOCK`` bytes; two float32 ``einsum`` (exact there, see
    ``_BLOCK``) give every block's sum and weighted sum (numpy's own loops: no BLAS threads), prefix sums
    over the blocks give the values at block starts, and the few blocks holding a point add
    their part before it.
    """
    m = span.size
    q = m // _BLOCK
    t = m - q * _BLOCK
    # exact in float32 (see _BLOCK); einsum, not BLAS: no BLAS threads. Row q: the tail (maybe
    # empty, zero-padded), where a point at m lies.
    blocks = np.empty((q + 1, _BLOCK), np.float32)
    blocks[:q] = span[: q * _BLOCK].reshape(q, _BLOCK)
    blocks[q, :t] = span[q * _BLOCK:]
    blocks[q, t:] = 0
    s1 = np.einsum("rl->r", blocks).astype(np.int64)
    s2 = np.einsum("rl,l->r", blocks, _BLOCK_WEIGHTS_F32).astype(np.int64)
    starts = np.arange(q + 1, dtype=np.int64) * _BLOCK
    f1 = np.zeros(q + 2, np.int64)
    f2 = np.zeros(q + 2, np.int64)
    np.cumsum(s1, out=f1[1:])
    # a block's weighted sum with global weights: its local one + start * its sum
    np.cumsum(s2 + starts * s1, out=f2[1:])
    r = points // _BLOCK
    head = blocks[r]  # each point's block, its bytes from the point on zeroed
    head *= _BLOCK_WEIGHTS_F32 < (points - starts[r])[:, None]
    p1 = np.einsum("pl->p", head).astype(np.int64)
    p2 = np.einsum("pl,l->p", head, _BLOCK_WEIGHTS_F32).astype(np.int64) + starts[r] * p1
    return f1[r] + p1, f2[r] + p2


_ARANGE32: np.ndarray | None = None


def _arange32(n: int) -> np.ndarray:
    # Shared read-only weights 0..n-1, grown (doubling) to the largest pass seen, at most
    # _NP_CHUNK (16 MiB): a process that only checks small batches keeps a small table. A blob
    # longer than the table gets its own weights.
    global _ARANGE32
    if _ARANGE32 is None or _ARANGE32.size < n:
        size = min(_NP_CHUNK, max(n, 2 * (_ARANGE32.size if _ARANGE32 is not None else 1 << 16)))
        weights = np.arange(size, dtype=np.uint32)
        weights.flags.writeable = False
        _ARANGE32 = weights
    return _ARANGE32


def segment_checksums_torch(
    data: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor, *, check_bounds: bool = True
) -> torch.Tensor:
    """Same checksums as :func:`segment_checksums`, with torch ops on the tensors' device.

    Lets a GPU verify compressed blobs where they already are, before decoding them. Works on
    the whole ``data`` tensor (its length is known on the host, so no device synchronization is
    needed to size the work); the only synchronization is the optional bounds check.

    Args:
        data: 1-D uint8 tensor holding the blobs.
        offsets: Integer tensor (same device), start of each blob.
        sizes: Integer tensor (same device), length of each blob.
        check_bounds: Verify that every blob lies inside ``data`` (one host synchronization).
            Pass False only when the offsets come from a trusted index.

    Returns:
        int64 tensor of checksums on ``data.device``, equal to the numpy values.

    Raises:
        ValueError: a blob lies outside ``data`` or has a negative size (with ``check_bounds``).

    Example:
        >>> import torch
        >>> d = torch.arange(4, dtype=torch.uint8)
        >>> segment_checksums_torch(d, torch.tensor([0, 1]), torch.tensor([4, 0])).tolist()
        [85899345926, 0]
    """
    import torch

    if data.dtype != torch.uint8:
        raise TypeError(f"data must be a uint8 tensor, got {data.dtype}")
    data = data.reshape(-1)
    offsets = offsets.to(device=data.device, dtype=torch.int64).reshape(-1)
    sizes = sizes.to(device=data.device, dtype=torch.int64).reshape(-1)
    if offsets.shape != sizes.shape:
        raise ValueError(
            "offsets and sizes must have the same length, "
            f"got {tuple(offsets.shape)} and {tuple(sizes.shape)}"
        )
    ends = offsets + sizes
    nbytes = data.numel()
    if check_bounds and offsets.numel():
        bad = (offsets < 0) | (sizes < 0) | (ends > nbytes)
        if bool(bad.any()):
            raise ValueError(
                f"blob (offset, size) pairs must lie inside the buffer of {nbytes} bytes "
                "with non-negative sizes; the blob index is inconsistent with the data"
            )
    # Full prefix arrays with a leading 0, masked to 32 bits, built chunk by chunk so int64
    # never overflows (the chunk count depends on len(data) only, not on the blobs).
    p1 = torch.zeros(nbytes + 1, dtype=torch.int64, device=data.device)
    p2 = torch.zeros(nbytes + 1, dtype=torch.int64, device=data.device)
    carry1 = torch.zeros((), dtype=torch.int64, device=data.device)
    carry2 = torch.zeros((), dtype=torch.int64, device=data.device)
    for c0 in range(0, nbytes, _TORCH_CHUNK):
        c1 = min(c0 + _TORCH_CHUNK, nbytes)
        chunk = data[c0:c1].to(torch.int64)
        l1 = torch.cumsum(chunk, 0)
        l2 = torch.cumsum(chunk * torch.arange(c1 - c0, dtype=torch.int64, device=data.device), 0)
        # Global weight g = (g - c0) + c0, so sum(b * g) = l2 + c0 * l1 (mod 2**32).
        p1[c0 + 1 : c1 + 1] = (carry1 + l1) & _MASK32
        p2[c0 + 1 : c1 + 1] = (carry2 + (l2 & _MASK32) + _mulmod32(l1 & _MASK32, c0 & _MASK32)) & _MASK32
        carry1 = p1[c1]
        carry2 = p2[c1]
    s1 = (p1[ends] - p1[offsets]) & _MASK32
    start_term = _mulmod32(s1, (offsets - 1) & _MASK32)
    s2 = (p2[ends] - p2[offsets] - start_term) & _MASK32
    # (s2 << 32) | s1 as an int64: shifting an int64 left wraps into the sign bit as intended.
    return (s2 << 32) | s1


def _mulmod32(a: torch.Tensor, b: torch.Tensor | int) -> torch.Tensor:
    """``(a * b) mod 2**32`` for operands in ``[0, 2**32)`` without int64 overflow.

    A plain product can reach 2**64; splitting ``b`` into 16-bit halves keeps every partial
    product below 2**48 (signed overflow is undefined in C++, so we never rely on wrapping).
    """
    lo = a * (b & 0xFFFF)
    hi = (a * (b >> 16)) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def verify(
    data: np.ndarray | torch.Tensor,
    offsets: np.ndarray | torch.Tensor,
    sizes: np.ndarray | torch.Tensor,
    expected: np.ndarray | torch.Tensor,
) -> np.ndarray | torch.Tensor:
    """Indices of the blobs whose checksum differs from ``expected`` (empty when all match).

    Dispatches on the type of ``data``: numpy arrays are checked with :func:`segment_checksums`,
    torch tensors with :func:`segment_checksums_torch` on their device (the result is then an
    int64 tensor on that device).

    Args:
        data: The buffer holding the blobs (uint8).
        offsets: Start of each blob.
        sizes: Length of each blob.
        expected: int64 checksums recorded at write time.

    Returns:
        Sorted int64 indices of the mismatching blobs.

    Example:
        >>> import numpy as np
        >>> d = np.frombuffer(b"abcab", dtype=np.uint8)
        >>> o, s = np.array([0, 3]), np.array([3, 2])
        >>> verify(d, o, s, segment_checksums(d, o, s)).tolist()
        []
    """
    if not isinstance(data, np.ndarray) and type(data).__module__.startswith("torch"):
        import torch

        exp = torch.as_tensor(expected, device=data.device).to(torch.int64)  # type: ignore[union-attr]
        got = segment_checksums_torch(data, torch.as_tensor(offsets), torch.as_tensor(sizes))  # type: ignore[arg-type]
        return torch.nonzero(got != exp.reshape(-1)).reshape(-1)
    got_np = segment_checksums(data, offsets, sizes)  # type: ignore[arg-type]
    exp_np = np.asarray(expected, dtype=np.int64).reshape(-1)
    if exp_np.shape != got_np.shape:
        raise ValueError(f"expected {got_np.size} checksums (one per blob), got {exp_np.size}")
    return np.flatnonzero(got_np != exp_np).astype(np.int64)


def checksum_reference(blob: bytes) -> int:
    """Plain-Python definition of the checksum of one blob, for tests and format readers.

    Example:
        >>> checksum_reference(b"abc")
        2534030704934
    """
    s1 = sum(blob) & _MASK32
    s2 = sum((i + 1) * b for i, b in enumerate(blob)) & _MASK32
    v = (s2 << 32) | s1
    return v - (1 << 64) if v >= 1 << 63 else v
