"""The byte-copy engine: move a batch of blobs between buffers in a fixed number of calls.

Blob ``i`` goes from ``src[src_offsets[i]:src_offsets[i] + sizes[i]]`` to
``dst[dst_offsets[i]:dst_offsets[i] + sizes[i]]``. Tiers use it to write and read their arenas
and staging buffers, codecs to pack and unpack batches; buffers are 1-D uint8 numpy arrays or
torch tensors (:mod:`tiered.util.buffers`), on any device.

The number of Python-level calls of a copy does not depend on the number of blobs nor on
their sizes, only on the kind of layout (the store's "no per-item Python loop" tests count
them): every branch below is taken on the layout, and the size classes are all visited, empty
or not.

* Host memory (numpy arrays, CPU tensors viewed as numpy): :func:`tiered.util.hostcopy.copy_host_blobs`
  (slices, strided rows and size-classed runs; numpy only).
* Torch tensors on one device (CUDA), :func:`copy_tensor_blobs`: runs, then one
  ``index_select``/``index_copy_`` over 8-byte words when every offset is 8-aligned, plus one
  over the remaining bytes (GPU gathers are bandwidth-bound; a flat index is cheap there).
* Across devices, :func:`copy_blobs`: pack on the source device, one transfer, unpack. Host to
  CUDA packs into pinned memory and uploads without making the host wait for the stream.

Destination ranges must not overlap each other (sources may).

Example:
    >>> import numpy as np
    >>> from tiered.util.copy import copy_blobs
    >>> src = np.arange(10, dtype=np.uint8); dst = np.zeros(6, dtype=np.uint8)
    >>> copy_blobs(src, np.array([7, 0]), dst, np.array([0, 3]), np.array([3, 2]))
    >>> dst.tolist()
    [7, 8, 9, 0, 1, 0]
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import exclusive_cumsum, is_packed
from .buffers import Buffer, as_int64, as_tensor, check_bounds, check_buffer, host_view
from .hostcopy import copy_host_blobs, merge_runs

__all__ = ["copy_blobs", "copy_tensor_blobs"]


def _gather_scatter(src: torch.Tensor, s: np.ndarray, dst: torch.Tensor, d: np.ndarray,
                    n: np.ndarray) -> None:
    """Element-level batched copy on one torch device (a flat index of every element)."""
    total = int(n.sum())
    if total == 0:
        return
    dev = src.device
    first = exclusive_cumsum(n)
    k = n.size
    # the three tables in one upload; on CUDA from pinned memory, so it does not make the host
    # wait for the stream's earlier work (a pageable copy would)
    host = torch.empty(3 * k, dtype=torch.int64, pin_memory=dev.type == "cuda")
    tab = host.numpy()
    tab[:k], tab[k:2 * k], tab[2 * k:] = n, s - first, d - first
    tab_d = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
    counts = tab_d[:k]
    base = torch.arange(total, device=dev, dtype=torch.int64)
    src_index = base + torch.repeat_interleave(tab_d[k:2 * k], counts, output_size=total)
    dst_index = base + torch.repeat_interleave(tab_d[2 * k:], counts, output_size=total)
    dst.index_copy_(0, dst_index, src.index_select(0, src_index))


def _words(t: torch.Tensor, width: int) -> torch.Tensor | None:
    """``t`` viewed as int64 words (its bytes past the last whole word dropped), or None if misaligned."""
    if t.storage_offset() % width:
        return None
    return t[: t.numel() // width * width].view(torch.int64)


def copy_tensor_blobs(src: torch.Tensor, src_offsets: np.ndarray, dst: torch.Tensor, dst_offsets: np.ndarray,
                      sizes: np.ndarray) -> None:
    """:func:`copy_blobs` between uint8 tensors of one device, for arguments already checked.

    A few kernels whatever the number of blobs: runs are merged, 8-byte words move with one
    ``index_select``/``index_copy_`` when every offset is a multiple of 8, and the remaining
    bytes with one more. Made for CUDA (bandwidth-bound gathers); it also runs on CPU tensors,
    where :func:`copy_host_blobs` is faster.

    Example:
        >>> src = torch.arange(20, dtype=torch.uint8); dst = torch.zeros(16, dtype=torch.uint8)
        >>> copy_tensor_blobs(src, np.array([8, 0]), dst, np.array([0, 8]), np.array([8, 3]))
        >>> dst[:11].tolist()
        [8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2]
    """
    keep = sizes > 0
    s, d, n = merge_runs(src_offsets[keep], dst_offsets[keep], sizes[keep])
    if n.size == 0:
        return
    if n.size == 1:
        a, b, k = int(s[0]), int(d[0]), int(n[0])
        dst[b:b + k].copy_(src[a:a + k])
        return
    width = 8
    if not int(np.bitwise_or.reduce(s | d)) % width:
        src_words, dst_words = _words(src, width), _words(dst, width)
        if src_words is not None and dst_words is not None:
            whole = n // width
            _gather_scatter(src_words, s // width, dst_words, d // width, whole)
            done = whole * width
            s, d, n = s + done, d + done, n - done
    _gather_scatter(src, s, dst, d, n)


def copy_blobs(src: Buffer, src_offsets: np.ndarray, dst: Buffer, dst_offsets: np.ndarray,
               sizes: np.ndarray) -> None:
    """Copy blob ``i`` from ``src[src_offsets[i]:+sizes[i]]`` to ``dst[dst_offsets[i]:]``, for every ``i``.

    ``src`` and ``dst`` are contiguous 1-D uint8 numpy arrays or torch tensors, on any
    devices. Destination ranges must not overlap each other.

    Raises:
        TypeError: a buffer is not a contiguous 1-D uint8 array or tensor.
        ValueError: the offsets and sizes differ in length, a size is negative, or a range
            falls outside its buffer.

    Example:
        >>> src = np.arange(10, dtype=np.uint8); dst = np.zeros(6, dtype=np.uint8)
        >>> copy_blobs(src, np.array([7, 0]), dst, np.array([0, 3]), np.array([3, 2]))
        >>> dst
        array([7, 8, 9, 0, 1, 0], dtype=uint8)
    """
    s, d, n = as_int64(src_offsets), as_int64(dst_offsets), as_int64(sizes)
    if not (s.size == d.size == n.size):
        raise ValueError(f"offsets and sizes differ in length: {s.size}, {d.size}, {n.size}")
    check_buffer(src, "the source buffer")
    check_buffer(dst, "the destination buffer")
    if n.size and int(n.min()) < 0:
        raise ValueError(f"blob sizes must be >= 0, got {int(n.min())}")
    check_bounds(s, n, int(src.shape[0]), "the source buffer's")
    check_bounds(d, n, int(dst.shape[0]), "the destination buffer's")
    host_src, host_dst = host_view(src), host_view(dst)
    if host_src is not None and host_dst is not None:
        copy_host_blobs(host_src, s, host_dst, d, n)
        return
    src_t, dst_t = as_tensor(src), as_tensor(dst)
    if src_t.device == dst_t.device:
        copy_tensor_blobs(src_t, s, dst_t, d, n)
        return
    # Different devices: pack on the source device, one transfer, unpack at the destination.
    keep = n > 0
    s, d, n = s[keep], d[keep], n[keep]
    if n.size == 0:
        return
    packed_offsets = exclusive_cumsum(n)
    total = int(n.sum())
    if src_t.device.type == "cpu" and dst_t.device.type == "cuda":
        # Packed into pinned memory from torch's caching host allocator, then uploaded without
        # waiting: a pageable upload makes the host wait for all earlier work of the stream (a GPU
        # decode, say). The allocator keeps the block until the copy is done; the source may be
        # reused as soon as this returns.
        staged = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        copy_host_blobs(host_view(src_t), s, staged.numpy(), packed_offsets, n)
        copy_blobs(staged.to(dst_t.device, non_blocking=True), packed_offsets, dst_t, d, n)
        return
    if is_packed(s, n):
        packed = src_t[int(s[0]):int(s[0]) + total]
    else:
        packed = torch.empty(total, dtype=torch.uint8, device=src_t.device)
        copy_blobs(src_t, s, packed, packed_offsets, n)
    copy_blobs(packed.to(dst_t.device), packed_offsets, dst_t, d, n)
