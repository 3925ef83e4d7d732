"""The cold tier on plain files: append-only segment files read with coalesced ``pread``.

Blobs live in segment files ``seg-000000.bin``, ``seg-000001.bin``, ... of ``segment_bytes``
each at most; a blob never straddles two segments. Offsets are global:
``segment index * segment_bytes + offset in the segment``.

Writes: files grow by ``posix_fallocate`` at :meth:`allocate` (:func:`grown_size`: a new file
starts at 64 KiB and at least doubles up to steps of 16 MiB, so a small store stays small), so a full disk raises :class:`~tiered.errors.StorageFullError` there and
never ``SIGBUS`` later; bytes go in with ``pwrite`` (one call per contiguous run), never
through a memory map. Every write goes through :mod:`tiered.util.fileio`.

Reads: the requested blobs are sorted by offset, ranges closer than 4 KiB are coalesced, and
explicit ``preadv`` calls (from a thread pool when there are many) land single-blob runs
straight in the output buffer and multi-blob runs in a per-thread staging buffer
(:attr:`MemmapTier.staging`), from which one batched copy scatters them (:func:`read_blobs`,
shared with :class:`~tiered.tiers.hdf5.HDF5Tier`).

Durability: :meth:`MemmapTier.flush` fsyncs the segments written since the last flush (and
the directory when a segment was created). Frees are deferred by default: space freed by
overwritten rows is reused only after :meth:`MemmapTier.release_deferred`, which the store
calls once the commit that freed it is durable, with ``hold_last=True``: space freed before
commit ``g + 1`` is reused only after commit ``g + 2``, because a read-only open of commit ``g``
may read it until then. A reopened tier holds the deferred frees of the commit it opened the
same way.

Read-only opens are cheap to pickle (no fds, no threads travel) and open their files lazily,
so DataLoader workers under fork or spawn each get their own descriptors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CorruptionError, ReadOnlyStoreError
from ..util import fileio
from ..util.batch import exclusive_cumsum, split_balanced
from ..util.buffers import as_int64, check_bounds, check_buffer, host_view
from ..util.copy import copy_blobs
from ..util.pool import run_parallel
from ..util.scratch import ScratchBuffers
from ..util.segments import segment_name, segment_problem
from ..util.units import align, format_bytes, parse_bytes
from .arena import cuda_usable
from .base import Tier
from .extents import ExtentAllocator

__all__ = ["MemmapTier", "read_blobs", "grown_size"]

#: Default size of one segment file.
SEGMENT_BYTES = 256 << 20
#: Files grow by at most this much at a time (unless one batch needs more) ...
GROW_STEP = 16 << 20
#: ... and start this small: each growth at least doubles a file until its steps reach GROW_STEP.
GROW_MIN = 64 << 10
#: Blobs closer than this in a file are read with one call (the gap is read and dropped).
COALESCE_GAP = 4096
# Below this many bytes or runs a read is done on the calling thread (a thread hop costs more).
_THREADED_MIN_BYTES = 1 << 20
_THREADED_MIN_RUNS = 64


#: Staging buffers kept per thread stay under this; larger reads and writes stage through a
#: temporary (the kept buffer lives as long as the thread, pinned on a CUDA host).
STAGING_KEEP_MAX = 16 << 20
# The name of the staging buffer in :attr:`MemmapTier.staging` (reads and writes share it).
_STAGING = "staging"


def grown_size(have: int, need: int, limit: int) -> int:
    """The new size of a segment file of ``have`` bytes that must hold ``need``, at most ``limit``.

    Geometric growth: reserved space stays proportional to the data (a 30 KiB store reserves
    64 KiB, not a 16 MiB step), and a growing store makes O(log) ``fallocate`` calls until its
    steps reach :data:`GROW_STEP`.

    Example:
        >>> [grown_size(have, have + 1, 1 << 30) >> 10 for have in (0, 64 << 10, 1 << 20, 64 << 20)]
        [64, 128, 2048, 81920]
    """
    step = min(GROW_STEP, max(GROW_MIN, have))
    return min(limit, max(need, have + step))


def _preadv_all(fd: int, view: memoryview, offset: int, path: Callable[[], str]) -> None:
    n = view.nbytes
    done = fileio.read_into(fd, view, offset)
    if done < n:
        raise CorruptionError(
            f"{path()} is truncated: reading {n} bytes at offset {offset} hit the end of the "
            f"file after {done} bytes (file size {os.fstat(fd).st_size}); the store's segment "
            f"files are damaged, restore them from a backup"
        )


def _advise_random(fd: int) -> None:
    """Sampling reads are random: without this the kernel's read-ahead reads megabytes around
    each small blob (measured 2.8 MB per 0.5 MB batch without it, 1.1 MB with it). The advice
    belongs to the open file description, so every descriptor the tier reads through needs it."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def read_blobs(
    fd_of: Callable[[int], int],
    path_of: Callable[[int], str],
    data_offsets: np.ndarray,
    segment_bytes: int,
    offsets: np.ndarray,
    sizes: np.ndarray,
    out: np.ndarray | torch.Tensor,
    out_offsets: np.ndarray,
    workers: int,
    staging: ScratchBuffers,
    gap: int = COALESCE_GAP,
) -> None:
    """Read blobs from segment files into ``out``, coalescing nearby ranges.

    Args:
        fd_of: segment index -> readable fd.
        path_of: segment index -> file path (for error messages).
        data_offsets: per segment, the file offset where the segment's bytes start
            (0 for plain files, the dataset's offset in an HDF5 file).
        segment_bytes: size of a segment's byte space.
        offsets, sizes: the blobs (global offsets).
        out, out_offsets: destination buffer (host or device) and where each blob goes.
        workers: threads for large reads (on the package's shared pool, ``run_parallel``).
        staging: the per-thread scratch buffers that multi-blob runs are staged in.
        gap: ranges closer than this are read with one call.
    """
    o, n, oo = as_int64(offsets), as_int64(sizes), as_int64(out_offsets)
    if not (o.size == n.size == oo.size):
        raise ValueError(f"offsets and sizes differ in length: {o.size}, {n.size}, {oo.size}")
    check_buffer(out, "out")
    keep = n > 0
    if not keep.all():
        o, n, oo = o[keep], n[keep], oo[keep]
    if o.size == 0:
        return
    check_bounds(oo, n, int(out.shape[0]), "out")
    order = np.argsort(o, kind="stable")
    o, n, oo = o[order], n[order], oo[order]
    seg = o // segment_bytes
    end = o + n
    if bool(((end - 1) // segment_bytes != seg).any()):
        raise ValueError("a blob range straddles a segment boundary; offsets or sizes are wrong")
    reach = np.maximum.accumulate(end)
    brk = np.empty(o.size, dtype=bool)
    brk[0] = True
    brk[1:] = (seg[1:] != seg[:-1]) | (o[1:] > reach[:-1] + gap)
    first = np.flatnonzero(brk)
    r_start = o[first]
    r_len = np.maximum.reduceat(end, first) - r_start
    r_seg = seg[first]
    r_count = np.diff(np.append(first, o.size))
    r_file = np.asarray(data_offsets, dtype=np.int64)[r_seg] + (r_start - r_seg * segment_bytes)
    run_of = np.repeat(np.arange(first.size), r_count)

    host = host_view(out)
    direct = r_count == 1 if host is not None else np.zeros(first.size, dtype=bool)
    stage_len = np.where(direct, 0, r_len)
    stage_base = exclusive_cumsum(stage_len)
    buf = staging.get(_STAGING, int(stage_len.sum())) if not direct.all() else None

    # One (fd, file offset, target view) per run: a syscall per run is the unit of work here.
    fds = {sg: fd_of(sg) for sg in np.unique(r_seg).tolist()}
    mv_host = memoryview(host) if host is not None else None
    mv_buf = memoryview(buf) if buf is not None else None
    tgt = np.where(direct, oo[first], stage_base)
    tasks = [
        (fds[sg], fo, (mv_host if dr else mv_buf)[b:b + ln])  # type: ignore[index]
        for sg, fo, ln, dr, b in zip(r_seg.tolist(), r_file.tolist(), r_len.tolist(), direct.tolist(),
                                     tgt.tolist(), strict=True)
    ]

    def work(chunk: list[tuple[int, int, memoryview]]) -> None:
        for fd, fo, view in chunk:
            if os.preadv(fd, [view], fo) != view.nbytes:  # short read: retry, or name the file
                seg_of_fd = {v: k for k, v in fds.items()}[fd]
                _preadv_all(fd, view, fo, lambda s=seg_of_fd: path_of(s))

    total = int(r_len.sum())
    if workers > 1 and len(tasks) > 1 and (len(tasks) >= _THREADED_MIN_RUNS or total >= _THREADED_MIN_BYTES):
        # contiguous chunks of runs of about equal bytes, one per worker, on the shared pool
        b = split_balanced(r_len, workers).tolist()
        run_parallel(work, [(tasks[x:y],) for x, y in zip(b[:-1], b[1:], strict=True) if y > x], workers)
    else:
        work(tasks)

    if buf is not None:
        staged = ~direct[run_of]
        src = stage_base[run_of[staged]] + (o[staged] - r_start[run_of[staged]])
        copy_blobs(buf, src, out, oo[staged], n[staged])


class MemmapTier(Tier):
    """The ``cold`` tier: blobs appended to segment files, read with coalesced ``pread``.

    Args:
        directory: where the segment files live (created if missing; must hold no segments).
        segment_bytes: size of one segment file (a blob must fit in one).
        threads: threads for large reads (0 or 1: read on the calling thread).
        budget: optional cap on the bytes of live blobs (``None``: as much as the disk holds).

    Example:
        >>> import tempfile
        >>> import numpy as np
        >>> t = MemmapTier(tempfile.mkdtemp(), segment_bytes=1 << 20)
        >>> data = np.frombuffer(b"hello world!", dtype=np.uint8)
        >>> off = t.allocate(np.array([5, 7]))
        >>> t.write(off, data, np.array([0, 5]), np.array([5, 7])); t.flush()
        >>> out = np.zeros(12, dtype=np.uint8)
        >>> t.read(off, np.array([5, 7]), out, np.array([0, 5])); out.tobytes()
        b'hello world!'
        >>> state = t.state(); t.close()
        >>> r = MemmapTier.open(t.directory, state, mode="r")
        >>> r.read(off[:1], np.array([5]), out, np.array([0])); out[:5].tobytes()
        b'hello'
    """

    name = "cold"
    format = "memmap"

    def __init__(self, directory: str | os.PathLike[str], segment_bytes: int | str = SEGMENT_BYTES,
                 threads: int = 8, *, budget: int | str | None = None) -> None:
        seg = parse_bytes(segment_bytes)
        if seg <= 0 or seg % 16:
            raise ValueError(f"segment_bytes must be a positive multiple of 16, got {seg}")
        directory = os.path.abspath(os.fspath(directory))
        fileio.makedirs(directory)
        first = os.path.join(directory, segment_name(self.format, 0))
        if os.path.exists(first):
            raise FileExistsError(
                f"{directory} already holds cold segments ({first}); reopen them with "
                f"{type(self).__name__}.open(directory, state, mode) or choose an empty directory"
            )
        self._setup(directory, seg, threads, None if budget is None else parse_bytes(budget), "r+")
        self._alloc = ExtentAllocator(self.budget, boundary=seg)

    def _setup(self, directory: str, segment_bytes: int, threads: int, budget: int | None, mode: str) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.threads = int(threads)
        self.budget = budget
        self.device = torch.device("cpu")
        self.mode = mode
        self._sizes: list[int] = []  # bytes reserved (fallocated) per segment
        self._data_offsets: list[int] = []  # file offset of each segment's byte space
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # pinned when this process already uses CUDA (the H2D copy of a CUDA `out` staged here is then
        # async-capable); never the reason CUDA starts: CPU-only stores must work in forked workers
        self.staging = ScratchBuffers(keep_max=STAGING_KEEP_MAX,
                                      pinned=cuda_usable() and torch.cuda.is_initialized())
        self._dirty: set[int] = set()
        self._dir_dirty = False
        self._checked: set[int] = set()

    # ------------------------------------------------------------------ files

    def segment_path(self, i: int) -> str:
        """Path of segment ``i``."""
        return os.path.join(self.directory, segment_name(self.format, i))

    @property
    def segments(self) -> list[str]:
        """Paths of the segment files in use."""
        return [self.segment_path(i) for i in range(len(self._sizes))]

    @property
    def data_offsets(self) -> np.ndarray:
        """Per segment, the file offset where its byte space starts (0, or an HDF5 dataset's offset)."""
        return np.asarray(self._data_offsets, dtype=np.int64)

    def segment_fd(self, i: int) -> int:
        """The tier's file descriptor of segment ``i`` (opened on first use; the tier closes it)."""
        if self._pid != os.getpid():
            self._after_fork()
        fd = self._fds.get(i)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(i)
            if fd is None:
                self._check_segment(i)
                path = self.segment_path(i)
                fd = fileio.open_for_write(path) if self.mode != "r" else fileio.open_for_read(path)
                _advise_random(fd)
                self._fds[i] = fd
        return fd

    def _check_segment(self, i: int) -> None:
        """Hook: validate a segment's format on first use in this process (HDF5)."""

    def _after_fork(self) -> None:
        # Inherited fds would work for pread, but the parent's thread pool is dead here and a
        # forked writer must not write: start over with fresh handles.
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._init_runtime()

    def _create_segment(self, i: int) -> tuple[int, int]:
        """Create segment ``i``; return (fd, data offset)."""
        fd = fileio.open_for_write(self.segment_path(i), exclusive=False)
        if os.fstat(fd).st_size:  # left over by a crash after the last commit: start clean
            fileio.truncate(fd, 0)
        return fd, 0

    def check_writable(self) -> None:
        """Refuse a write to a tier opened read-only (:class:`ReadOnlyStoreError`)."""
        if self.mode == "r":
            raise ReadOnlyStoreError(
                f"the cold tier in {self.directory} was opened read-only; reopen it with mode='r+' to write"
            )

    def _reserve(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Grow the segment files so that every new blob's bytes are allocated on disk."""
        keep = sizes > 0
        offsets, sizes = offsets[keep], sizes[keep]
        if offsets.size == 0:
            return
        seg = offsets // self.segment_bytes
        ends = offsets + sizes - seg * self.segment_bytes
        order = np.argsort(seg, kind="stable")
        seg, ends = seg[order], ends[order]
        first = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
        for s, need in zip(seg[first].tolist(), np.maximum.reduceat(ends, first).tolist(), strict=True):
            while len(self._sizes) <= s:
                i = len(self._sizes)
                fd, data_off = self._create_segment(i)
                _advise_random(fd)  # the writer samples through this same descriptor
                self._fds[i] = fd
                self._sizes.append(0)
                self._data_offsets.append(data_off)
                self._dirty.add(i)
                self._dir_dirty = True
            have = self._sizes[s]
            if need <= have:
                continue
            new = grown_size(have, need, self.segment_bytes)
            fileio.fallocate(self.segment_fd(s), self._data_offsets[s] + have, new - have)
            self._sizes[s] = new
            self._dirty.add(s)

    # ------------------------------------------------------------------ Tier API

    @property
    def bytes_used(self) -> int:
        return self._alloc.bytes_used

    @property
    def fragmentation(self) -> float:
        return self._alloc.fragmentation

    @property
    def allocator(self) -> ExtentAllocator:
        """The tier's extent allocator (read it, do not change it)."""
        return self._alloc

    def allocate(self, sizes: np.ndarray) -> np.ndarray:
        """Reserve space, growing segment files on disk. See :meth:`Tier.allocate`.

        Raises:
            ValueError: a blob larger than a segment (or than the budget).
            StorageFullError: over the budget, or the disk is full; nothing changes.
            ReadOnlyStoreError: the tier was opened with ``mode="r"``.
        """
        self.check_writable()
        sizes = as_int64(sizes)
        snapshot = self._alloc.snapshot()
        reserved = list(self._sizes)
        offsets = self._alloc.allocate(sizes)
        try:
            self._reserve(offsets, align(sizes))
        except BaseException:
            # all or nothing: forget the allocation and the segments made for it; blocks
            # already reserved in older segments stay reserved on disk, which is harmless
            self._alloc.restore(snapshot)
            for i in range(len(reserved), len(self._sizes)):
                fd = self._fds.pop(i, None)
                if fd is not None:
                    fileio.close(fd)
                fileio.remove(self.segment_path(i))
                self._dirty.discard(i)
            self._sizes = reserved
            del self._data_offsets[len(reserved):]
            raise
        return offsets

    def write(self, offsets: np.ndarray, data: np.ndarray | torch.Tensor, src_offsets: np.ndarray,
              sizes: np.ndarray) -> None:
        self.check_writable()
        o, so, n = as_int64(offsets), as_int64(src_offsets), as_int64(sizes)
        check_buffer(data, "data")
        keep = n > 0
        if not keep.all():
            o, so, n = o[keep], so[keep], n[keep]
        if o.size == 0:
            return
        host = host_view(data)
        if host is None:  # device data: gather the blobs there, one copy to the host
            packed = torch.empty(int(n.sum()), dtype=torch.uint8, device=data.device)
            excl = exclusive_cumsum(n)
            copy_blobs(data, so, packed, excl, n)
            host, so = packed.cpu().numpy(), excl
        order = np.argsort(o, kind="stable")
        o, so, n = o[order], so[order], n[order]
        seg = o // self.segment_bytes
        if int((o + n).max()) > self._alloc.high_water or bool((o - seg * self.segment_bytes + n >
                                                                  np.asarray(self._sizes)[seg]).any()):
            raise ValueError("blob ranges fall outside the space allocated in the cold tier")
        # Runs: blobs packed back to back (aligned) in one segment go out in one pwrite.
        brk = np.r_[True, (o[1:] != o[:-1] + align(n[:-1])) | (seg[1:] != seg[:-1])]
        first = np.flatnonzero(brk)
        r_start = o[first]
        last = np.append(first[1:], o.size) - 1
        r_len = o[last] + n[last] - r_start
        if first.size == 1 and bool(np.array_equal(so - so[0], o - o[0])):
            # the source already has the file's layout (alignment padding included)
            stage, s_base = host, np.array([so[0]])
        else:
            s_base = exclusive_cumsum(r_len)
            run_of = np.repeat(np.arange(first.size), np.diff(np.append(first, o.size)))
            total = int(r_len.sum())
            stage = self.staging.get(_STAGING, total)  # the per-thread buffer reads use too
            stage.fill(0)  # zeroed: alignment padding never leaks old memory into the file
            copy_blobs(host, so, stage, s_base[run_of] + (o - r_start[run_of]), n)
        mv = memoryview(stage)
        for start, ln, sb in zip(r_start.tolist(), r_len.tolist(), s_base.tolist(), strict=True):
            s = start // self.segment_bytes
            fileio.pwrite(self.segment_fd(s), mv[sb:sb + ln], self._data_offsets[s] + start - s * self.segment_bytes)
            self._dirty.add(s)

    def read(self, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray | torch.Tensor,
             out_offsets: np.ndarray) -> None:
        o, n = as_int64(offsets), as_int64(sizes)
        if o.size and int((o + n).max()) > self._alloc.high_water:
            raise ValueError(
                f"blob ranges reach byte {int((o + n).max())}, past the cold tier's allocated "
                f"region ({self._alloc.high_water} bytes)"
            )
        read_blobs(self.segment_fd, self.segment_path, self.data_offsets, self.segment_bytes, o, n, out,
                   out_offsets, self.threads, self.staging)

    def free(self, offsets: np.ndarray, sizes: np.ndarray, *, defer: bool = True) -> None:
        """Release blobs. By default the space is reused only after :meth:`release_deferred`.

        Args:
            offsets, sizes: the blobs.
            defer: ``False`` only for space that no durable commit references (e.g. a batch
                whose write failed).
        """
        self.check_writable()
        self._alloc.free(offsets, sizes, defer=defer)

    def release_deferred(self, *, hold_last: bool = False) -> int:
        """Make space freed since the last durable commit reusable; return its bytes.

        Args:
            hold_last: keep the space freed since the previous call deferred until the next
                call (two commits of delay, for readers of the previous commit).
        """
        return self._alloc.release_deferred(hold_last=hold_last)

    def flush(self) -> None:
        """fsync every segment written since the last flush, and the directory if it changed."""
        if self.mode == "r":
            return
        for i in sorted(self._dirty):
            fileio.fsync(self.segment_fd(i))
        self._dirty.clear()
        if self._dir_dirty:
            fileio.fsync_dir(self.directory)
            self._dir_dirty = False

    def close(self) -> None:
        if self._pid != os.getpid():  # a forked copy: the fds are the parent's
            self._fds = {}
            return
        for fd in self._fds.values():
            fileio.close(fd)
        self._fds = {}

    def stats(self) -> dict[str, Any]:
        return {
            "bytes_used": self.bytes_used,
            "budget": self.budget,
            "fragmentation": self.fragmentation,
            "segments": len(self._sizes),
            "bytes_reserved": int(sum(self._sizes)),
            "bytes_pending_free": self._alloc.bytes_pending,
        }

    def drop_cache(self) -> None:
        """Ask the kernel to drop this tier's pages from the page cache (benchmarks).

        Dirty pages are not dropped: call :meth:`flush` first.
        """
        for i in range(len(self._sizes)):
            fd = os.open(self.segment_path(i), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ persistence

    def state(self) -> dict[str, Any]:
        """The tier's durable state: JSON-able values and int64 numpy arrays (flat dict).

        Call it after :meth:`flush`; give it back to :meth:`open`.
        """
        return {
            "format": self.format,
            "segment_bytes": self.segment_bytes,
            "budget": self.budget,
            "segment_sizes": list(self._sizes),
            "data_offsets": list(self._data_offsets),
            # the allocator's state but what the tier's own fields give (its budget, segment size)
            **{k: v for k, v in self._alloc.state().items() if k not in ("capacity", "boundary")},
        }

    @classmethod
    def open(cls, directory: str | os.PathLike[str], state: dict[str, Any], mode: str = "r",
             threads: int = 8) -> MemmapTier:
        """Reopen a tier saved by :meth:`state` read-only (``"r"``) or read-write (``"r+"``).

        The state is that of a durable commit; its deferred frees stay held until the next
        :meth:`release_deferred` (a reader of the commit before it may still read them).

        Raises:
            CorruptionError: a segment file is missing or shorter than the state says.
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        if state.get("format", cls.format) != cls.format:
            raise CorruptionError(
                f"the cold tier in {directory} was written by the {state.get('format')!r} backend, "
                f"not {cls.format!r}; open the store with backend={state.get('format')!r}"
            )
        self = cls.__new__(cls)
        budget = state.get("budget")
        self._setup(os.path.abspath(os.fspath(directory)), int(state["segment_bytes"]), threads,
                    None if budget is None else int(budget), mode)
        self._sizes = [int(x) for x in state["segment_sizes"]]
        self._data_offsets = [int(x) for x in state.get("data_offsets", [0] * len(self._sizes))]
        self._alloc = ExtentAllocator.from_state({**state, "capacity": self.budget, "boundary": self.segment_bytes})
        self._alloc.hold_deferred()
        need = -(-self._alloc.high_water // self.segment_bytes)
        if need > len(self._sizes):
            raise CorruptionError(
                f"inconsistent cold-tier state in {directory}: blobs reach byte "
                f"{self._alloc.high_water}, which needs {need} segments, but {len(self._sizes)} are listed"
            )
        for i, size in enumerate(self._sizes):
            problem = segment_problem(self.segment_path(i), self._data_offsets[i] + size)
            if problem is not None:
                raise CorruptionError(f"cold segment {self.segment_path(i)} {problem[1]}; the store is damaged: "
                                      "restore it from a backup")
        return self

    def __getstate__(self) -> dict[str, Any]:
        if self.mode != "r":
            raise TypeError(
                f"a writable {type(self).__name__} cannot be pickled (a copy would be a second "
                f"writer); pickle one opened with {type(self).__name__}.open(directory, state, mode='r')"
            )
        return {
            "directory": self.directory,
            "segment_bytes": self.segment_bytes,
            "threads": self.threads,
            "budget": self.budget,
            "sizes": self._sizes,
            "data_offsets": self._data_offsets,
            "alloc": self._alloc.state(),
        }

    def __setstate__(self, st: dict[str, Any]) -> None:
        self._setup(st["directory"], st["segment_bytes"], st["threads"], st["budget"], "r")
        self._sizes = list(st["sizes"])
        self._data_offsets = list(st["data_offsets"])
        self._alloc = ExtentAllocator.from_state(st["alloc"])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.directory!r}, segments={len(self._sizes)}, "
            f"segment_bytes={format_bytes(self.segment_bytes)}, used={format_bytes(self.bytes_used)}, "
            f"mode={self.mode!r})"
        )
