"""Fault injection for tests: a full disk, an I/O error, a crash point, a power cut.

The file functions of :mod:`tiered.util.fileio` call a hook before each change when one is
installed (:func:`tiered.util.fileio.set_fault_hook`); :func:`inject_faults` installs a
:class:`FaultInjector` for the duration of a ``with`` block. It can fail the N-th write with
``ENOSPC`` or ``EIO``, apply a byte quota, SIGKILL the process at the N-th event, and keep an
*undo log* from which :func:`apply_power_loss` rolls the files back to what a power cut would have
left.

A full disk at the first write, as tests use it: the example of :func:`inject_faults`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..util import fileio

__all__ = ["FaultInjector", "inject_faults", "apply_power_loss"]

# Undo-log records: kind (1 byte), path length (u32), a (i64), b (i64), payload length (u64),
# then the path and the payload. Kinds:
#   W  a write or resize of `path` not yet fsynced: a = offset, b = old file size (-1: absent),
#      payload = the bytes the write overwrote (inside the old size)
#   F  fsync of `path`
#   C  creation of `path` (the file did not exist)
#   R  rename of a temp file over `path`: a = 1 if `path` existed, payload = its old content
#   D  fsync of the directory `path`
_REC = struct.Struct("<cIqqQ")

class FaultInjector:
    """Faults for tests, installed with :func:`inject_faults`.

    Args:
        enospc_on: the N-th (1-based) write-like call (``pwrite`` or ``fallocate``) raises
            :class:`~tiered.errors.StorageFullError`, and so does every later one.
        quota_bytes: once this many bytes were written or reserved (``pwrite`` bytes plus
            file growth by ``fallocate``/``truncate``), the call that would exceed it raises
            :class:`~tiered.errors.StorageFullError`.
        eio_on: the N-th (1-based) ``pwrite`` raises ``OSError(EIO)`` (once).
        undo_log: path of an undo log; see :func:`apply_power_loss`.
        kill_on: at the N-th (1-based) event (any write, fallocate, truncate, fsync, directory
            fsync, creation or rename), SIGKILL this process before the event takes effect
            (crash points, as RocksDB's kill points; use it in a child process with
            ``undo_log`` and :func:`apply_power_loss` in the parent).
        on_replace: called with the destination path before each rename of a temp file over it
            takes effect (a reader run at that point of a commit: its manifest's rename is the
            last step before the commit is published).
        on_open_read: called with the path before each open of a file to read
            (:func:`~tiered.util.fileio.open_for_read`; not a file event): a writer in another
            process moved on at that point of a read (its opens, a page's rebuild).

    Attributes:
        writes: ``pwrite`` calls seen. ``ops``: write-like calls seen. ``bytes``: bytes counted
        against the quota.

    Simulated power loss (what the undo log models):

    * data: every ``pwrite``, ``fallocate`` and ``truncate`` of a file that is not followed by
      an :func:`fsync` of that file is undone (bytes and file size restored);
    * names: a file created, or renamed over another by :func:`write_file_atomic`, and not
      followed by an :func:`fsync_dir` of its directory, disappears (or gets its old content
      back). Removals are not undone (treated as durable at once), and writes are never
      partially applied (no torn sectors): both are simplifications.

    The log is appended synchronously *before* each change, so a process SIGKILLed at any
    point leaves a log that covers everything it changed.
    """

    def __init__(
        self,
        *,
        enospc_on: int | None = None,
        quota_bytes: int | None = None,
        eio_on: int | None = None,
        undo_log: str | os.PathLike[str] | None = None,
        kill_on: int | None = None,
        on_replace: Callable[[str], None] | None = None,
        on_open_read: Callable[[str], None] | None = None,
    ) -> None:
        self.kill_on = kill_on
        self.on_replace = on_replace
        self.on_open_read = on_open_read
        self.events = 0
        self.enospc_on = enospc_on
        self.quota_bytes = quota_bytes
        self.eio_on = eio_on
        self.writes = 0
        self.ops = 0
        self.bytes = 0
        # re-entrant: garbage collection inside a hook can close a leaked h5py file, whose
        # final writes come back through these hooks on the same thread
        self._lock = threading.RLock()
        self._log_fd: int | None = None
        if undo_log is not None:
            self._log_fd = os.open(
                os.fspath(undo_log), os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0),
                0o644,
            )

    def close(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    # -- hooks called by the functions above (under no lock of theirs) --

    def _event(self) -> None:
        self.events += 1
        if self.kill_on is not None and self.events >= self.kill_on:
            os.kill(os.getpid(), signal.SIGKILL)

    def _count(self, path: str, nbytes: int, grow: int) -> None:
        self.ops += 1
        if self.enospc_on is not None and self.ops >= self.enospc_on:
            raise fileio.storage_full_error(path, nbytes, f"injected: write call {self.ops} >= {self.enospc_on}")
        if self.quota_bytes is not None and self.bytes + grow > self.quota_bytes:
            raise fileio.storage_full_error(path, nbytes, f"injected: quota of {self.quota_bytes} bytes")
        self.bytes += grow

    def _log(self, kind: bytes, path: str, a: int, b: int, payload: bytes = b"") -> None:
        if self._log_fd is None:
            return
        p = path.encode()
        os.write(self._log_fd, _REC.pack(kind, len(p), a, b, len(payload)) + p + payload)

    def _log_undo(self, fd: int, path: str, offset: int, length: int) -> None:
        if self._log_fd is None:
            return
        size = os.fstat(fd).st_size
        keep = max(0, min(length, size - offset))
        old = os.pread(fd, keep, offset) if keep else b""
        self._log(b"W", path, offset, size, old)

    def before_write(self, fd: int, view: memoryview, offset: int) -> None:
        path = fileio.path_of(fd)
        with self._lock:
            self._event()
            self.writes += 1
            if self.eio_on is not None and self.writes == self.eio_on:
                raise OSError(errno.EIO, f"injected I/O error on write {self.writes}", path)
            self._count(path, view.nbytes, view.nbytes)
            self._log_undo(fd, path, offset, view.nbytes)

    def before_fallocate(self, fd: int, offset: int, length: int) -> None:
        path = fileio.path_of(fd)
        with self._lock:
            self._event()
            grow = max(0, offset + length - os.fstat(fd).st_size)
            self._count(path, length, grow)
            self._log_undo(fd, path, offset, 0)

    def before_truncate(self, fd: int, size: int) -> None:
        path = fileio.path_of(fd)
        with self._lock:
            self._event()
            old = os.fstat(fd).st_size
            if size > old:
                self._count(path, size - old, size - old)
            self._log_undo(fd, path, size, max(0, old - size))

    # A kill right after an fsync but before its record is logged counts as a crash just
    # before the fsync: the simulation stays consistent.
    def after_fsync(self, path: str) -> None:
        with self._lock:
            self._event()
            self._log(b"F", path, 0, 0)

    def after_fsync_dir(self, path: str) -> None:
        with self._lock:
            self._event()
            self._log(b"D", path, 0, 0)

    def before_create(self, path: str) -> None:
        with self._lock:
            self._event()
            self._log(b"C", path, 0, 0)

    def before_open_read(self, path: str) -> None:
        if self.on_open_read is not None:
            self.on_open_read(path)

    def before_replace(self, src: str, dst: str) -> None:
        if self.on_replace is not None:
            self.on_replace(dst)
        with self._lock:
            self._event()
            if self._log_fd is None:
                return
            try:
                with open(dst, "rb") as f:
                    old, existed = f.read(), 1
            except FileNotFoundError:
                old, existed = b"", 0
            self._log(b"R", dst, existed, 0, old)


@contextlib.contextmanager
def inject_faults(**kwargs: Any) -> Iterator[FaultInjector]:
    """Install a :class:`FaultInjector` for the ``with`` block (tests only; not thread-scoped).

    Example:
        >>> import tempfile, os
        >>> from tiered.errors import StorageFullError
        >>> fd = fileio.open_for_write(os.path.join(tempfile.mkdtemp(), "f"))
        >>> with inject_faults(enospc_on=1):
        ...     try:
        ...         fileio.pwrite(fd, b"x", 0)
        ...     except StorageFullError:
        ...         print("full")
        full
        >>> fileio.close(fd)
    """
    inj = FaultInjector(**kwargs)
    if fileio.set_fault_hook(inj) is not None:
        fileio.set_fault_hook(None)
        inj.close()
        raise RuntimeError("a FaultInjector is already installed")
    try:
        yield inj
    finally:
        fileio.set_fault_hook(None)
        inj.close()


def _read_log(path: str | os.PathLike[str]) -> list[tuple[bytes, str, int, int, bytes]]:
    with open(path, "rb") as f:
        raw = f.read()
    records = []
    pos = 0
    while pos + _REC.size <= len(raw):
        kind, plen, a, b, n = _REC.unpack_from(raw, pos)
        pos += _REC.size
        if pos + plen + n > len(raw):  # a record cut by the kill: its change never started
            break
        p = raw[pos:pos + plen].decode()
        pos += plen
        records.append((kind, p, a, b, raw[pos:pos + n]))
        pos += n
    return records


def apply_power_loss(undo_log: str | os.PathLike[str]) -> int:
    """Roll files back to what a power cut would have left, using an undo log.

    Run by a test's parent process after the child that wrote the log was killed. See
    :class:`FaultInjector` for what is simulated. Returns the number of changes undone.

    Example:
        >>> # in the child:  with inject_faults(undo_log=log): ...; os.kill(os.getpid(), 9)
        >>> # in the parent: apply_power_loss(log)
    """
    records = _read_log(undo_log)
    # Which records are made durable by a later fsync (file) or fsync_dir (directory)?
    durable = [False] * len(records)
    synced: set[str] = set()
    synced_dirs: set[str] = set()
    for i in range(len(records) - 1, -1, -1):
        kind, p, *_ = records[i]
        if kind == b"F":
            synced.add(p)
        elif kind == b"D":
            synced_dirs.add(p)
        elif kind == b"W":
            durable[i] = p in synced
        elif kind in (b"C", b"R"):
            durable[i] = os.path.dirname(p) in synced_dirs
    undone = 0
    for i in range(len(records) - 1, -1, -1):
        kind, p, a, b, payload = records[i]
        if durable[i] or kind in (b"F", b"D"):
            continue
        undone += 1
        if kind == b"W":
            if b < 0 or not os.path.exists(p):
                continue
            fd = os.open(p, os.O_RDWR)
            try:
                if payload:
                    os.pwrite(fd, payload, a)
                os.ftruncate(fd, b)
            finally:
                os.close(fd)
        elif kind == b"C":
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
        elif kind == b"R":
            if a:
                with open(p, "wb") as f:
                    f.write(payload)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
    return undone
