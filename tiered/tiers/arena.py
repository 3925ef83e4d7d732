"""Memory tiers: a growable uint8 arena on a torch device.

:class:`ArenaTier` keeps blobs in one uint8 tensor that grows geometrically (x2, capped at the
budget) as allocations need it, so a large budget costs nothing until it is used.
:class:`HostTier` (``warm``) is an arena in pinned host memory when CUDA is available;
:class:`DeviceTier` (``hot``) is an arena on the store's ``hot_device``.

Blobs move in and out with the package's batched copy, :func:`tiered.util.copy.copy_blobs`
(numpy arrays and torch tensors on any device, a number of calls that does not grow with the
number of blobs). :func:`new_buffer` is the arenas' one allocation, with the allocation-failure
seam :func:`inject_oom` for tests; the GPU decoder allocates through it too.

A CUDA arena is written from more than one CUDA stream: the thread that extends the store
writes on its current stream, a prefetch thread's GPU decoder promotes blobs on its own. Each
arena keeps a :class:`StreamOrder`: every operation on the arena (write, read, growth,
compaction) first makes the current stream wait for the last work other streams queued on it,
and writes mark their stream afterwards. No host synchronization is added. A pinned host arena
is page-locked with ``cudaHostRegister`` on memory of its own (:func:`new_buffer`), not taken
from PyTorch's caching host allocator, which rounds every block up to a power of two and keeps
freed blocks: an arena grown by doubling would pin about twice its budget, and keep it.

Example:
    >>> import numpy as np
    >>> t = HostTier("1MiB")
    >>> off = t.allocate(np.array([3, 2]))
    >>> t.write(off, np.frombuffer(b"abcde", np.uint8), np.array([0, 3]), np.array([3, 2]))
    >>> out = np.zeros(5, np.uint8); t.read(off[::-1], np.array([2, 3]), out, np.array([0, 2]))
    >>> out.tobytes()
    b'deabc'
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import torch

from ..errors import StorageFullError
from ..util.batch import exclusive_cumsum
from ..util.buffers import as_int64, check_bounds, is_out_of_memory
from ..util.copy import copy_blobs
from ..util.hostcopy import copy_host_blobs
from ..util.units import align, format_bytes, parse_bytes
from .base import Tier
from .extents import ExtentAllocator

__all__ = ["ArenaTier", "HostTier", "DeviceTier", "default_budgets", "inject_oom", "new_buffer", "cuda_usable",
           "StreamOrder", "ALLOCATION_KINDS"]

# Smallest arena buffer: growing 64 KiB -> budget takes ~log2(budget / 64 KiB) copies.
_MIN_ARENA = 1 << 16
# Private anonymous maps (POSIX); 0 where the platform has none (then torch.empty).
_ANON_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) \
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS") else 0

#: Bytes an arena compaction moves per step (its staging buffer; a larger blob moves alone).
COMPACT_STEP = 4 << 20


def cuda_usable() -> bool:
    """Whether CUDA is present and this process may start it.

    False without a GPU, and in a child forked after its parent started CUDA (a DataLoader
    worker): CUDA cannot start there, so stores made there use no CUDA memory at all.

    Example:
        >>> cuda_usable() == (torch.cuda.is_available() and not torch.cuda._is_in_bad_fork())
        True
    """
    if not torch.cuda.is_available():
        return False
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    return not (in_bad_fork is not None and in_bad_fork())


def default_budgets(hot: bool = True) -> dict[str, int]:
    """Default tier budgets in bytes, from the memory free right now.

    * ``hot``: 50% of the free memory of the current CUDA device
      (``torch.cuda.mem_get_info()``, which starts CUDA), 0 without CUDA or with ``hot=False``;
    * ``warm``: 25% of the available host memory (``psutil.virtual_memory().available``).

    Args:
        hot: ask the CUDA device; False when no CUDA hot tier is wanted (CUDA is not started).

    Example:
        >>> b = default_budgets(hot=False)
        >>> sorted(b), b["hot"], b["warm"] > 0
        (['hot', 'warm'], 0, True)
    """
    hot_bytes = 0
    if hot and cuda_usable():
        free, _total = torch.cuda.mem_get_info()
        hot_bytes = int(free * 0.5)
    warm = int(psutil.virtual_memory().available * 0.25)
    return {"hot": hot_bytes, "warm": warm}


# ---------------------------------------------------------------------------------------------
# Allocation, and its failure seam for tests: every arena growth and every GPU decoder buffer
# is allocated by new_buffer, so inject_oom can make any of them fail
# ---------------------------------------------------------------------------------------------

#: What new_buffer allocates: arena growth; the GPU decoder's decoded batch, its per-attempt block
#: (tables and compressed bytes), nvCOMP's scratch, the frame indices re-uploaded after a split.
ALLOCATION_KINDS = ("arena", "output", "batch", "scratch", "index")
_limits: list[tuple[int, frozenset[str] | None, str | None]] = []  # set by inject_oom


@contextlib.contextmanager
def inject_oom(max_bytes: int = 0, only: str | tuple[str, ...] | None = None, *,
               error: str | None = None) -> Iterator[None]:
    """Make allocations larger than ``max_bytes`` raise ``torch.OutOfMemoryError`` (tests).

    Covers arena growth, the GPU decoder's own buffers and nvCOMP's scratch (routed through
    PyTorch's allocator): GPU out-of-memory cannot be produced on demand. ``max_bytes=0`` fails
    every allocation (a full arena; the decoder's CPU fallback); restricting ``only`` to
    ``"batch"``/``"scratch"`` with a size between a whole batch and its halves forces the decoder
    to split it. With ``error``, the allocation raises ``RuntimeError(error)`` instead: with
    ``only="scratch"`` that is a failure inside nvCOMP's call that is not a lack of memory (a
    CUDA runtime error, say), which the decoder answers by decoding the batch on the CPU.

    Args:
        max_bytes: allocations above this size fail.
        only: fail only these kinds (see :data:`ALLOCATION_KINDS`); default all.
        error: raise ``RuntimeError(error)`` rather than out-of-memory.

    Example:
        >>> t = HostTier(1 << 20)
        >>> with inject_oom():
        ...     try:
        ...         t.allocate(np.array([100]))
        ...     except StorageFullError:
        ...         print("full")
        full
    """
    kinds = None if only is None else frozenset([only] if isinstance(only, str) else only)
    if kinds is not None and not kinds <= set(ALLOCATION_KINDS):
        raise ValueError(f"only must name kinds among {ALLOCATION_KINDS}, got {only!r}")
    _limits.append((int(max_bytes), kinds, error))
    try:
        yield
    finally:
        _limits.pop()


def new_buffer(nbytes: int, device: str | torch.device, pinned: bool = False, kind: str = "arena") -> torch.Tensor:
    """An uninitialized uint8 tensor of ``nbytes`` on ``device`` (page-locked host memory if ``pinned``).

    Plain host memory of 64 KiB or more is an anonymous memory map of its own, so
    the pages that are never written (an arena's room to grow) are never held: from the heap,
    they could be pages an earlier, freed allocation had written, held from the start.
    Pinned memory is such a map too, page-locked with ``cudaHostRegister`` and unregistered
    when the tensor goes (PyTorch's caching host allocator would round it up to a power of two
    and keep it after it is freed); where registration fails it comes from that allocator.
    Inside :func:`inject_oom` it raises ``torch.OutOfMemoryError`` for allocations of ``kind``
    (one of :data:`ALLOCATION_KINDS`) above the limit, as a real allocation would.

    Example:
        >>> new_buffer(64, "cpu").shape
        torch.Size([64])
    """
    if _limits:
        limit, kinds, error = _limits[-1]
        if nbytes > limit and (kinds is None or kind in kinds):
            if error is not None:
                raise RuntimeError(f"injected: {error} ({kind}, {nbytes} bytes on {device})")
            raise torch.OutOfMemoryError(
                f"injected: cannot allocate {nbytes} bytes ({kind}) on {device} (limit {limit})")
    if pinned:
        return _registered(nbytes)
    if _ANON_PRIVATE and nbytes >= _MIN_ARENA and torch.device(device).type == "cpu":
        try:
            # private: counted as the process's own (anonymous) memory, like any heap allocation
            region = mmap.mmap(-1, nbytes, flags=_ANON_PRIVATE)
        except OSError as e:  # ENOMEM: the arena turns this into StorageFullError
            raise MemoryError(f"cannot map {nbytes} bytes of host memory: {e}") from e
        # the tensor holds a reference to the map: unmapped when the tensor goes
        return torch.frombuffer(region, dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class _PinnedMap(mmap.mmap):
    """Anonymous memory page-locked for CUDA; unregistered before it is unmapped."""

    ptr = 0

    def __del__(self) -> None:
        if self.ptr:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
                torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.ptr = 0


def _registered(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory that is returned to the system when the tensor goes."""
    if _ANON_PRIVATE and nbytes > 0:
        try:
            region = _PinnedMap(-1, nbytes, flags=_ANON_PRIVATE)
        except OSError as e:
            raise MemoryError(f"cannot map {nbytes} bytes of host memory: {e}") from e
        t = torch.frombuffer(region, dtype=torch.uint8)
        ptr = t.data_ptr()
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(getattr(rc, "value", rc)) == 0:
            region.ptr = ptr
            return t
        del t, region  # not page-locked here (a locked-memory limit, say): torch's allocator may do it
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class StreamOrder:
    """Orders the work several CUDA streams queue on one buffer, without host synchronization.

    :meth:`wait` makes a stream wait for the last work every *other* stream marked;
    :meth:`mark` records the current stream's work so far. On a CPU device the work is done when the call returns, so nothing waits, but the streams
    are still told apart (by thread) and the waits that would be needed are counted: CPU tests
    check the ordering logic.

    Example:
        >>> order = StreamOrder("cpu")
        >>> order.mark(); order.wait(); order.stats()      # only this thread marked: no wait
        {'marks': 1, 'waits': 0}
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._last: dict[int, Any] = {}  # stream (CUDA) or thread (CPU) -> event of its last work
        self._counts = {"marks": 0, "waits": 0}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_last"] = {}  # CUDA events and thread ids mean nothing in another process
        return state

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait for the last work of every other stream."""
        if stream is None and self._cuda:
            stream = torch.cuda.current_stream(self.device)
        key = int(stream.cuda_stream) if stream is not None else threading.get_ident()
        for k, ev in list(self._last.items()):  # one per stream that ever marked: a handful
            if k != key:
                if stream is not None:
                    stream.wait_event(ev)
                self._counts["waits"] += 1

    def mark(self) -> None:
        """Record the current stream's work on the buffer so far (others wait for it)."""
        if self._cuda:
            cur = torch.cuda.current_stream(self.device)
            key, ev = int(cur.cuda_stream), torch.cuda.Event()
            ev.record(cur)
        else:
            key, ev = threading.get_ident(), None
        self._last[key] = ev
        self._counts["marks"] += 1

    def stats(self) -> dict[str, int]:
        """``marks`` and ``waits`` so far (a wait counts one other stream waited for)."""
        return dict(self._counts)


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
        #: the order of the streams that use the arena (see the module docstring)
        self.order = StreamOrder(self.device)
        self._cuda = self.device.type == "cuda"

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
        new = new_buffer(size, self.device, self.pinned)
        if have:
            if self._cuda:  # another stream's pending write must land before the copy reads it
                self.order.wait()
            new[:have].copy_(self._buf)
            if self._cuda:  # and the others' next use waits for the copy (on a CPU both are done)
                self.order.mark()
        self._buf = new

    def allocate(self, sizes: np.ndarray) -> np.ndarray:
        """Reserve aligned space; grow the arena if needed. See :meth:`Tier.allocate`.

        Raises:
            ValueError: a blob larger than the whole budget.
            StorageFullError: the batch does not fit now, or the arena cannot grow (out of
                memory); the tier is unchanged.
        """
        return self._allocated(sizes, partial=False)

    def allocate_fitting(self, sizes: np.ndarray) -> np.ndarray:
        """Best effort: space for the blobs of ``sizes`` that fit now (in the holes, or under the
        budget past the used region), the offset -1 for the others (a cache skips those).

        Raises:
            ValueError: a blob larger than the whole budget.
            StorageFullError: the arena cannot grow (out of memory); the tier is unchanged.

        Example:
            >>> t = HostTier(96, pinned=False)
            >>> t.allocate_fitting(np.array([32, 48, 32])).tolist()  # the third does not fit
            [0, 32, -1]
        """
        return self._allocated(sizes, partial=True)

    def _allocated(self, sizes: np.ndarray, partial: bool) -> np.ndarray:
        snapshot = self._alloc.snapshot()
        offsets = self._alloc.allocate(sizes, partial=partial)
        need = self._alloc.high_water
        try:
            self._grow(need)
        except BaseException as e:
            self._alloc.restore(snapshot)
            if not is_out_of_memory(e):
                raise
            raise StorageFullError(
                f"the {self.name} arena on {self.device} could not grow from "
                f"{format_bytes(self.capacity)} to hold {need} bytes (budget "
                f"{format_bytes(self.budget)}): {e}. Lower the {self.name} budget or free memory"
            ) from e
        return offsets

    @property
    def compact_bytes(self) -> int:
        """The bytes :meth:`compact` would move now: the live bytes past the first hole.

        Example:
            >>> t = HostTier(1 << 10, pinned=False)
            >>> off = t.allocate(np.array([16, 32, 48]))
            >>> t.compact_bytes, t.free(off[:1], np.array([16])), t.compact_bytes
            (0, None, 80)
        """
        free_off, free_len = self._alloc.extents
        if free_off.size == 0:
            return 0
        return self._alloc.high_water - int(free_off[0]) - int(free_len.sum())

    def compact(self, offsets: np.ndarray, sizes: np.ndarray, *, step: int = COMPACT_STEP) -> np.ndarray:
        """Move every blob of the arena to its start, in place; return their new offsets.

        ``offsets`` and ``sizes`` must name every live blob (their aligned sizes add up to
        :attr:`bytes_used`): afterwards they lie back to back from byte 0 in the order of their
        offsets, and the free space is one range at the end. Blobs move toward the start in
        address order, the blobs that start in one ``step`` of the packed layout (default
        :data:`COMPACT_STEP`; at least the largest blob) at a time, through a staging buffer of
        about that size: a group's destinations end before the next group's sources begin, so
        no byte is overwritten before it has moved, and no second arena-sized buffer is needed.
        The packed prefix (blobs already in place) is not copied. One batched copy in and one
        out per step, never a loop over blobs.

        Raises:
            ValueError: the blobs are not every live blob of the arena.

        Example:
            >>> t = HostTier(1 << 10, pinned=False)
            >>> off = t.allocate(np.array([16, 16, 16]))
            >>> t.write(off, np.frombuffer(b"a" * 16 + b"b" * 16 + b"c" * 16, np.uint8),
            ...         np.array([0, 16, 32]), np.array([16, 16, 16]))
            >>> t.free(off[:1], np.array([16]))
            >>> new = t.compact(off[1:], np.array([16, 16])); new.tolist()
            [0, 16]
            >>> out = np.zeros(32, np.uint8); t.read(new, np.array([16, 16]), out, np.array([0, 16]))
            >>> out.tobytes() == b"b" * 16 + b"c" * 16, t.fragmentation, t.stats()["high_water"]
            (True, 0.0, 32)
        """
        offsets = as_int64(offsets).reshape(-1)
        sizes = align(as_int64(sizes).reshape(-1))
        if offsets.shape != sizes.shape:
            raise ValueError(f"offsets and sizes differ in length: {offsets.size} != {sizes.size}")
        if int(sizes.sum()) != self.bytes_used:
            raise ValueError(
                f"compact needs every live blob of the {self.name} arena: got {int(sizes.sum())} bytes in "
                f"{sizes.size} blobs, the arena holds {self.bytes_used}")
        order = np.argsort(offsets, kind="stable")
        src, size = offsets[order], sizes[order]
        dst = exclusive_cumsum(size)
        self._check_live(src, size)
        if src.size > 1 and bool((src[1:] < src[:-1] + size[:-1]).any()):
            raise ValueError(f"compact was given overlapping blobs of the {self.name} arena")
        moving = np.flatnonzero(dst != src)
        if moving.size:
            src, size, dst_m = src[moving[0]:], size[moving[0]:], dst[moving[0]:]
            rel = dst_m - dst_m[0]
            step = max(int(step), int(size.max()), 1)
            group = rel // step  # a group: the blobs that start in one step of the packed layout
            bounds = np.flatnonzero(np.diff(group)) + 1
            starts = np.concatenate([[0], bounds]).tolist()
            stops = np.concatenate([bounds, [size.size]]).tolist()
            stage = torch.empty(min(step + int(size.max()), int(rel[-1] + size[-1])), dtype=torch.uint8,
                                device=self.device)
            self.order.wait()
            for a, b in zip(starts, stops, strict=True):  # one iteration per step of bytes, not per blob
                stage_off = rel[a:b] - rel[a]
                copy_blobs(self.buffer, src[a:b], stage, stage_off, size[a:b])
                copy_blobs(stage, stage_off, self.buffer, dst_m[a:b], size[a:b])
            self.order.mark()
        self._alloc = ExtentAllocator(self.budget)
        if sizes.size:
            self._alloc.allocate(sizes[order])  # an empty allocator bumps: back to back from 0, in order
        new = np.empty_like(offsets)
        new[order] = dst
        return new

    def _check_live(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        if offsets.size and int(np.maximum.reduce(offsets + sizes)) > self._alloc.high_water:
            raise ValueError(
                f"blob ranges reach byte {int((offsets + sizes).max())}, past the allocated "
                f"region of the {self.name} arena ({self._alloc.high_water} bytes)"
            )

    def write(self, offsets: np.ndarray, data: np.ndarray | torch.Tensor, src_offsets: np.ndarray,
              sizes: np.ndarray) -> None:
        offsets, sizes = as_int64(offsets), as_int64(sizes)
        self._check_live(offsets, sizes)
        # an extent freed and reused here may still be written by another stream's promotion
        self.order.wait()
        copy_blobs(data, src_offsets, self.buffer, offsets, sizes)
        self.order.mark()

    def read(self, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray | torch.Tensor,
             out_offsets: np.ndarray) -> None:
        offsets, sizes = as_int64(offsets), as_int64(sizes)
        if not self._cuda and isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1 \
                and out.flags.c_contiguous:
            # a host arena into a host buffer (every CPU read): copy_blobs' checks of an arbitrary
            # pair of buffers reduced to what these can get wrong, every bound in one test (a read
            # of a few blobs: each numpy call costs more than its work), then the copy
            out_offsets = as_int64(out_offsets)
            if offsets.size and (
                    int(np.minimum.reduce(np.minimum(np.minimum(offsets, sizes), out_offsets))) < 0
                    or int(np.maximum.reduce(offsets + sizes)) > self._alloc.high_water
                    or int(np.maximum.reduce(out_offsets + sizes)) > out.shape[0]):
                self._refuse_read(offsets, sizes, out, out_offsets)
            self.order.wait()
            copy_host_blobs(self.buffer.numpy(), offsets, out, out_offsets, sizes)
            return
        self._check_live(offsets, sizes)
        self.order.wait()
        copy_blobs(self.buffer, offsets, out, out_offsets, sizes)

    def _refuse_read(self, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray, out_offsets: np.ndarray) -> None:
        """Raise the error that names what is wrong with a host read's ranges (one is)."""
        self._check_live(offsets, sizes)
        if int(np.minimum.reduce(offsets)) < 0 or int(np.minimum.reduce(sizes)) < 0:
            raise ValueError(f"negative blob offsets or sizes read from the {self.name} arena")
        check_bounds(out_offsets, sizes, int(out.shape[0]), "the destination buffer's")
        raise AssertionError("a host read's ranges failed their test but none of its checks")

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
            "stream_order": self.order.stats(),
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
    """The ``warm`` tier: host memory, pinned for fast async H2D copies.

    Args:
        budget: the most bytes the arena may hold.
        pinned: page-locked memory (which starts CUDA); default: when CUDA is usable
            (:func:`cuda_usable`). Stores pin only when they move data to a CUDA device.

    Example:
        >>> t = HostTier("64MiB", pinned=False)
        >>> t.name, t.pinned
        ('warm', False)
    """

    def __init__(self, budget: int | str, pinned: bool | None = None) -> None:
        super().__init__("warm", budget, "cpu", pinned=cuda_usable() if pinned is None else bool(pinned))


class DeviceTier(ArenaTier):
    """The ``hot`` tier: an arena on the store's ``hot_device`` (CUDA; ``"cpu"`` in CPU tests).

    Example:
        >>> DeviceTier("64MiB", device="cpu").name
        'hot'
    """

    def __init__(self, budget: int | str, device: str | torch.device | None = None) -> None:
        super().__init__("hot", budget, "cuda" if device is None else device)
