"""Memory tiers: a growable uint8 arena on a torch device, and the batched byte copies.

:class:`ArenaTier` keeps blobs in one uint8 tensor that grows geometrically (x2, capped at the
budget) as allocations need it, so a large budget costs nothing until it is used.
:class:`HostTier` (``warm``) is an arena in pinned host memory when CUDA is available;
:class:`DeviceTier` (``hot``) is an arena on the store's ``hot_device``.

:func:`copy_blobs` is the one batched copy every tier uses: blob ``i`` goes from
``src[src_offsets[i]:+sizes[i]]`` to ``dst[dst_offsets[i]:]``, for numpy arrays and torch
tensors on any device, with a number of Python-level calls that does not grow with the
number of blobs:

* adjacent blobs (contiguous in both buffers) are merged into runs first; a single run is
  one slice copy;
* otherwise, on the host, a blob of ``n`` bytes is copied as rows of ``c`` bytes (1-byte rows
  under 128 B, else 128-byte rows), its last row shifted back so it ends at byte ``n``; each
  row size is one numpy fancy-index copy between overlapping strided windows (one ``memcpy``
  per row, no per-byte index, no Python loop over blobs);
* on a GPU, one ``index_select``/``index_copy_`` over a flat index of 8-byte words (when
  every offset is 8-aligned) plus the byte tails: GPU gathers are bandwidth-bound;
* across devices: pack on the source device, one transfer, unpack on the destination.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import torch
from numpy.lib.stride_tricks import as_strided

from ..errors import StorageFullError
from ..util.batch import exclusive_cumsum
from ..util.units import format_bytes, parse_bytes
from .base import Tier
from .extents import ExtentAllocator

__all__ = ["ArenaTier", "HostTier", "DeviceTier", "copy_blobs", "default_budgets", "inject_oom"]

Buffer = np.ndarray | torch.Tensor

_I64 = np.int64
# Smallest arena buffer: growing 64 KiB -> budget takes ~log2(budget / 64 KiB) copies.
_MIN_ARENA = 1 << 16
# Row sizes of the host copy. Every class costs about a dozen numpy calls per copy, whatever
# its size, and sampled blobs are small (compressed Atari chunks: median ~320 B), so two
# classes: bytes for blobs under 128 B, 128-byte rows for the rest (faster than the former
# [1, 16, 256, 4096] on sampled warm reads of 2 to 500 blobs, in a one-off timing).
_ROW_BYTES = np.array([1, 128], dtype=_I64)


def default_budgets() -> dict[str, int]:
    """Default tier budgets in bytes, from the memory free right now.

    * ``hot``: 50% of the free memory of the current CUDA device
      (``torch.cuda.mem_get_info()``), 0 without CUDA;
    * ``warm``: 25% of the available host memory (``psutil.virtual_memory().available``).

    Example:
        >>> b = default_budgets()
        >>> sorted(b), b["warm"] > 0
        (['hot', 'warm'], True)
    """
    hot = 0
    if torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        hot = int(free * 0.5)
    warm = int(psutil.virtual_memory().available * 0.25)
    return {"hot": hot, "warm": warm}


# ---------------------------------------------------------------------------------------------
# Batched copies
# ---------------------------------------------------------------------------------------------


def _i64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=_I64).reshape(-1)


def _host_view(buf: Buffer) -> np.ndarray | None:
    """A numpy view of ``buf`` if it lives in host memory, else ``None``."""
    if isinstance(buf, np.ndarray):
        return buf
    if buf.device.type == "cpu":
        return buf.detach().numpy()
    return None


def _as_tensor(buf: Buffer) -> torch.Tensor:
    if not isinstance(buf, np.ndarray):
        return buf
    with warnings.catch_warnings():  # a read-only source array is only ever read from
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(buf)


def _check_buffer(buf: Buffer, what: str) -> None:
    if isinstance(buf, np.ndarray):
        ok = buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous
    else:
        ok = buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    if not ok:
        raise TypeError(
            f"{what} must be a contiguous 1-D uint8 numpy array or torch tensor, got "
            f"{type(buf).__name__} of dtype {buf.dtype} and shape {tuple(buf.shape)}"
        )


def _check_bounds(offsets: np.ndarray, sizes: np.ndarray, length: int, what: str) -> None:
    if offsets.size and (int(offsets.min()) < 0 or int((offsets + sizes).max()) > length):
        raise ValueError(
            f"{what} ranges [{int(offsets.min())}, {int((offsets + sizes).max())}) fall outside "
            f"its {length} bytes"
        )


def _runs(s: np.ndarray, d: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge blobs that are adjacent in both buffers into runs (``s`` is not empty)."""
    brk = np.empty(s.size, dtype=bool)
    brk[0] = True
    np.not_equal(s[1:], s[:-1] + n[:-1], out=brk[1:])
    brk[1:] |= d[1:] != d[:-1] + n[:-1]
    first = np.flatnonzero(brk)
    return s[first], d[first], np.add.reduceat(n, first)


def _copy_host(src: np.ndarray, s: np.ndarray, dst: np.ndarray, d: np.ndarray, n: np.ndarray) -> None:
    if s.size == 1:  # one run: one slice copy
        a, b, k = int(s[0]), int(d[0]), int(n[0])
        dst[b:b + k] = src[a:a + k]
        return
    # Size classes: a blob of n bytes is copied as ceil(n / c) rows of c bytes, c the largest
    # row size <= n; its last row is shifted back to end exactly at byte n, so rows overlap
    # inside the blob (same bytes written twice) but never leave it. Each class is one
    # fancy-index copy between overlapping strided windows of c-byte rows: one memcpy per row,
    # no per-byte index. Every class is visited even when empty, so the number of Python-level
    # calls is the same for every batch.
    cls = np.searchsorted(_ROW_BYTES, n, side="right") - 1
    for i, c in enumerate(_ROW_BYTES.tolist()):
        sel = cls == i
        ss, dd, nn = s[sel], d[sel], n[sel]
        rows = -(-nn // c)
        total = int(rows.sum())
        j = np.arange(total, dtype=_I64) - np.repeat(exclusive_cumsum(rows), rows)
        step = np.minimum(j * c, np.repeat(nn - c, rows))
        rs = np.repeat(ss, rows) + step
        rd = np.repeat(dd, rows) + step
        if c == 1:
            dst[rd] = src[rs]
        else:
            sw = as_strided(src, shape=(max(0, src.size - c + 1), c), strides=(1, 1), writeable=False)
            dw = as_strided(dst, shape=(max(0, dst.size - c + 1), c), strides=(1, 1))
            dw[rd] = sw[rs]


def _gather_scatter(src: torch.Tensor, s: np.ndarray, dst: torch.Tensor, d: np.ndarray,
                    n: np.ndarray) -> None:
    """Element-level batched copy on one torch device (a flat index of every element)."""
    total = int(n.sum())
    if total == 0:
        return
    dev = src.device
    excl = exclusive_cumsum(n)
    n_t = torch.from_numpy(n).to(dev)
    base = torch.arange(total, device=dev, dtype=torch.int64)
    sidx = base + torch.repeat_interleave(torch.from_numpy(s - excl).to(dev), n_t, output_size=total)
    didx = base + torch.repeat_interleave(torch.from_numpy(d - excl).to(dev), n_t, output_size=total)
    dst.index_copy_(0, didx, src.index_select(0, sidx))


def _words(t: torch.Tensor, w: int) -> torch.Tensor | None:
    if t.storage_offset() % w:
        return None
    return t[: t.numel() // w * w].view(torch.int64)


def _copy_torch(src: torch.Tensor, s: np.ndarray, dst: torch.Tensor, d: np.ndarray, n: np.ndarray) -> None:
    if s.size == 1:
        a, b, k = int(s[0]), int(d[0]), int(n[0])
        dst[b:b + k].copy_(src[a:a + k])
        return
    w = 8
    if not int(np.bitwise_or.reduce(s | d)) % w:
        sw, dw = _words(src, w), _words(dst, w)
        if sw is not None and dw is not None:
            k = n // w
            _gather_scatter(sw, s // w, dw, d // w, k)
            done = k * w
            s, d, n = s + done, d + done, n - done
    _gather_scatter(src, s, dst, d, n)


def _is_packed(off: np.ndarray, n: np.ndarray) -> bool:
    return off.size <= 1 or bool(np.array_equal(off[1:], off[:-1] + n[:-1]))


def copy_blobs(src: Buffer, src_offsets: np.ndarray, dst: Buffer, dst_offsets: np.ndarray,
               sizes: np.ndarray) -> None:
    """Copy blob ``i`` from ``src[src_offsets[i]:+sizes[i]]`` to ``dst[dst_offsets[i]:]``.

    ``src`` and ``dst`` are contiguous 1-D uint8 numpy arrays or torch tensors, on any
    devices. Destination ranges must not overlap each other.

    Example:
        >>> src = np.arange(10, dtype=np.uint8); dst = np.zeros(6, dtype=np.uint8)
        >>> copy_blobs(src, np.array([7, 0]), dst, np.array([0, 3]), np.array([3, 2]))
        >>> dst
        array([7, 8, 9, 0, 1, 0], dtype=uint8)
    """
    s, d, n = _i64(src_offsets), _i64(dst_offsets), _i64(sizes)
    if not (s.size == d.size == n.size):
        raise ValueError(f"offsets and sizes differ in length: {s.size}, {d.size}, {n.size}")
    _check_buffer(src, "the source buffer")
    _check_buffer(dst, "the destination buffer")
    if n.size and int(n.min()) < 0:
        raise ValueError(f"blob sizes must be >= 0, got {int(n.min())}")
    _check_bounds(s, n, int(src.shape[0]), "the source buffer's")
    _check_bounds(d, n, int(dst.shape[0]), "the destination buffer's")
    keep = n > 0
    s, d, n = s[keep], d[keep], n[keep]
    if n.size == 0:
        return
    hs, hd = _host_view(src), _host_view(dst)
    if hs is not None and hd is not None:
        s, d, n = _runs(s, d, n)
        _copy_host(hs, s, hd, d, n)
        return
    ts, td = _as_tensor(src), _as_tensor(dst)
    if ts.device == td.device:
        s, d, n = _runs(s, d, n)
        _copy_torch(ts, s, td, d, n)
        return
    # Different devices: pack on the source device, one transfer, unpack at the destination.
    excl = exclusive_cumsum(n)
    total = int(n.sum())
    if _is_packed(s, n):
        packed = ts[int(s[0]):int(s[0]) + total]
    else:
        packed = torch.empty(total, dtype=torch.uint8, device=ts.device)
        copy_blobs(ts, s, packed, excl, n)
    moved = packed.to(td.device)
    copy_blobs(moved, excl, td, d, n)


# ---------------------------------------------------------------------------------------------
# Allocation-failure seam (tests): DESIGN.md section 9
# ---------------------------------------------------------------------------------------------

_oom_after: list[int] = []  # [growths still allowed], set by inject_oom


@contextlib.contextmanager
def inject_oom(after: int = 0) -> Iterator[None]:
    """Make arena growth raise ``torch.OutOfMemoryError`` after ``after`` more growths (tests).

    Example:
        >>> t = HostTier(1 << 20)
        >>> with inject_oom():
        ...     try:
        ...         t.allocate(np.array([100]))
        ...     except StorageFullError:
        ...         print("full")
        full
    """
    _oom_after.append(after)
    try:
        yield
    finally:
        _oom_after.pop()


def _new_buffer(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
    if _oom_after:
        if _oom_after[-1] <= 0:
            raise torch.OutOfMemoryError(f"injected: cannot allocate {nbytes} bytes on {device}")
        _oom_after[-1] -= 1
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------
# Tiers
# ---------------------------------------------------------------------------------------------


class ArenaTier(Tier):
    """A memory tier: one growable uint8 tensor on ``device`` under a byte budget.

    Args:
        name: ``"hot"`` or ``"warm"``.
        budget: the most bytes the arena may hold (int or a string like ``"2GiB"``).
        device: torch device of the arena.
        pinned: use page-locked host memory (``device`` must be the CPU).

    Example:
        >>> t = ArenaTier("warm", "1MiB", "cpu")
        >>> data = np.frombuffer(b"hello world!", dtype=np.uint8)
        >>> off = t.allocate(np.array([5, 7]))
        >>> t.write(off, data, np.array([0, 5]), np.array([5, 7]))
        >>> out = np.zeros(12, dtype=np.uint8)
        >>> t.read(off, np.array([5, 7]), out, np.array([0, 5])); out.tobytes()
        b'hello world!'
    """

    def __init__(self, name: str, budget: int | str, device: str | torch.device,
                 pinned: bool = False) -> None:
        self.name = name
        self.budget = parse_bytes(budget)
        self.device = torch.device(device)
        if pinned and self.device.type != "cpu":
            raise ValueError(f"pinned memory is host memory; got pinned=True with device {self.device}")
        self.pinned = pinned
        self._alloc = ExtentAllocator(self.budget)
        self._buf: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """Bytes of the arena tensor allocated so far (grows up to the budget)."""
        return 0 if self._buf is None else int(self._buf.numel())

    @property
    def buffer(self) -> torch.Tensor:
        """The arena tensor (its first :attr:`capacity` bytes; blobs live at their offsets)."""
        if self._buf is None:
            self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)
        return self._buf

    @property
    def bytes_used(self) -> int:
        return self._alloc.bytes_used

    @property
    def fragmentation(self) -> float:
        return self._alloc.fragmentation

    def _grow(self, need: int) -> None:
        have = self.capacity
        if need <= have:
            return
        size = min(self.budget, max(need, 2 * have, _MIN_ARENA))
        new = _new_buffer(size, self.device, self.pinned)
        if have:
            new[:have].copy_(self._buf)
        self._buf = new

    def allocate(self, sizes: np.ndarray) -> np.ndarray:
        """Reserve aligned space; grow the arena if needed. See :meth:`Tier.allocate`.

        Raises:
            ValueError: a blob larger than the whole budget.
            StorageFullError: the batch does not fit now, or the arena cannot grow (out of
                memory); the tier is unchanged.
        """
        snapshot = self._alloc.snapshot()
        offsets = self._alloc.allocate(sizes)
        need = self._alloc.high_water
        try:
            self._grow(need)
        except BaseException as e:
            self._alloc.restore(snapshot)
            oom = isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
                isinstance(e, RuntimeError) and "out of memory" in str(e).lower())
            if not oom:
                raise
            raise StorageFullError(
                f"the {self.name} arena on {self.device} could not grow from "
                f"{format_bytes(self.capacity)} to hold {need} bytes (budget "
                f"{format_bytes(self.budget)}): {e}. Lower the {self.name} budget or free memory"
            ) from e
        return offsets

    def _check_live(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        if offsets.size and int((offsets + sizes).max()) > self._alloc.high_water:
            raise ValueError(
                f"blob ranges reach byte {int((offsets + sizes).max())}, past the allocated "
                f"region of the {self.name} arena ({self._alloc.high_water} bytes)"
            )

    def write(self, offsets: np.ndarray, data: np.ndarray | torch.Tensor, src_offsets: np.ndarray,
              sizes: np.ndarray) -> None:
        offsets, sizes = _i64(offsets), _i64(sizes)
        self._check_live(offsets, sizes)
        copy_blobs(data, src_offsets, self.buffer, offsets, sizes)

    def read(self, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray | torch.Tensor,
             out_offsets: np.ndarray) -> None:
        offsets, sizes = _i64(offsets), _i64(sizes)
        self._check_live(offsets, sizes)
        copy_blobs(self.buffer, offsets, out, out_offsets, sizes)

    def free(self, offsets: np.ndarray, sizes: np.ndarray, *, defer: bool = False) -> None:
        # memory does not outlive the process: nothing to defer
        self._alloc.free(offsets, sizes)

    def stats(self) -> dict[str, Any]:
        return {
            "bytes_used": self.bytes_used,
            "budget": self.budget,
            "fragmentation": self.fragmentation,
            "allocated": self.capacity,
            "high_water": self._alloc.high_water,
        }

    def close(self) -> None:
        self._buf = None
        self._alloc = ExtentAllocator(self.budget)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, budget={format_bytes(self.budget)}, "
            f"device={self.device}, used={format_bytes(self.bytes_used)})"
        )


class HostTier(ArenaTier):
    """The ``warm`` tier: host memory, pinned when CUDA is available (fast async H2D copies).

    Example:
        >>> HostTier("64MiB").name
        'warm'
    """

    def __init__(self, budget: int | str) -> None:
        super().__init__("warm", budget, "cpu", pinned=torch.cuda.is_available())


class DeviceTier(ArenaTier):
    """The ``hot`` tier: an arena on the store's ``hot_device`` (CUDA; ``"cpu"`` in CPU tests).

    Example:
        >>> DeviceTier("64MiB", device="cpu").name
        'hot'
    """

    def __init__(self, budget: int | str, device: str | torch.device | None = None) -> None:
        super().__init__("hot", budget, "cuda" if device is None else device)
