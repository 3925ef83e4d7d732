"""The one module through which every file write of :mod:`tiered` goes.

Tiers, the index and the manifest never call ``os.write``, ``os.fsync``, ``os.replace`` or
``os.posix_fallocate`` themselves: they call the functions here. That gives the package one
seam where faults a CI machine cannot produce for real (a full disk, an I/O error, a power
cut) are injected in tests, without replacing any component under test.

Functions:

* :func:`open_for_write`, :func:`close`: raw file descriptors (``O_RDWR | O_CREAT``);
  :func:`open_for_read`: read-only, regular files only (never blocks on a FIFO).
* :func:`pwrite`: positional write that loops on short writes.
* :func:`fallocate`: reserve blocks (``posix_fallocate``) so that a full disk raises
  :class:`~tiered.errors.StorageFullError` at allocation time, never ``SIGBUS`` later.
* :func:`truncate`, :func:`fsync`, :func:`fsync_dir`, :func:`makedirs`, :func:`remove`.
* :func:`write_file_atomic`: temp file, write, fsync, rename, fsync of the directory.
* :class:`WritableFile`: a small file object (``read/write/seek/tell/truncate/flush``)
  whose writes go through :func:`pwrite`; h5py writes HDF5 files through it (its
  ``fileobj`` driver), so HDF5 metadata writes are covered by the seam too.

Fault injection (tests only): :func:`inject_faults` installs a :class:`FaultInjector` for the
duration of a ``with`` block. It can fail the N-th write with ``ENOSPC`` or ``EIO``, apply a
byte quota, and keep an *undo log* from which :func:`apply_power_loss` rolls the files back to
what a power cut would have left.

Example:
    >>> import os, tempfile
    >>> from tiered import fileio
    >>> d = tempfile.mkdtemp()
    >>> fileio.write_file_atomic(os.path.join(d, "manifest.json"), b"{}")
    >>> open(os.path.join(d, "manifest.json"), "rb").read()
    b'{}'
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import struct
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import CorruptionError, StorageFullError

__all__ = [
    "open_for_write",
    "open_for_read",
    "close",
    "pwrite",
    "fallocate",
    "truncate",
    "fsync",
    "fsync_dir",
    "makedirs",
    "remove",
    "write_file_atomic",
    "WritableFile",
    "FaultInjector",
    "inject_faults",
    "apply_power_loss",
]

_ZERO_CHUNK = 1 << 20

# fd -> absolute path, for error messages and the undo log. Filled by open_for_write.
_paths: dict[int, str] = {}
_paths_lock = threading.Lock()


def _path_of(fd: int) -> str:
    path = _paths.get(fd)
    if path is not None:
        return path
    try:  # an fd this module did not open (Linux only); good enough for messages
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


def _full(path: str, nbytes: int, cause: str) -> StorageFullError:
    return StorageFullError(
        errno.ENOSPC,
        f"no space left on the device for {nbytes} more bytes ({cause}); free disk space or "
        f"move the store to a larger file system, then retry",
        path,
    )


def _translate(exc: OSError, path: str, nbytes: int) -> OSError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        err = _full(path, nbytes, os.strerror(exc.errno))
        err.__cause__ = exc
        return err
    return exc


def open_for_write(path: str | os.PathLike[str], *, exclusive: bool = False) -> int:
    """Open ``path`` for reading and writing, creating it if needed; return the fd.

    Args:
        path: the file.
        exclusive: fail with :class:`FileExistsError` if the file exists.

    Example:
        >>> import tempfile, os
        >>> fd = open_for_write(os.path.join(tempfile.mkdtemp(), "seg.bin"))
        >>> close(fd)
    """
    path = os.path.abspath(os.fspath(path))
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    if exclusive:
        flags |= os.O_EXCL
    inj = _injector
    if inj is not None and not os.path.exists(path):
        inj._before_create(path)
    fd = os.open(path, flags, 0o644)
    with _paths_lock:
        _paths[fd] = path
    return fd


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def open_for_read(path: str | os.PathLike[str]) -> int:
    """Open a *regular file* read-only and return the fd.

    Store files are only ever regular files: a FIFO must not block the open (``O_NONBLOCK``), a
    symlink to ``/dev/zero`` must not be read forever, a directory is not a file. Anything else
    raises :class:`~tiered.errors.CorruptionError` naming the file and what it is.

    Raises:
        FileNotFoundError: nothing at ``path`` (callers say what it means).
        CorruptionError: ``path`` is not a regular file, or a symlink loop.

    Example:
        >>> import tempfile
        >>> from tiered.errors import CorruptionError
        >>> d = tempfile.mkdtemp(); os.mkfifo(os.path.join(d, "pipe"))
        >>> try:
        ...     open_for_read(os.path.join(d, "pipe"))
        ... except CorruptionError as e:
        ...     print("FIFO" in str(e))
        True
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptionError(f"{path} is a symlink loop, not a file; the store is damaged") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(e.errno, os.strerror(e.errno), path) from None
        raise CorruptionError(f"{path} cannot be opened ({os.strerror(e.errno or 0)})") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CorruptionError(f"{path} is {kind}, not a regular file: a store holds only regular files; "
                              "the store is damaged or was tampered with")
    return fd


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` (``preadv`` may return less than asked); returns
    the bytes read, fewer than ``view.nbytes`` only at the end of the file. Callers raise their
    own error for a short read: what a truncated file means differs (damage, a bad source).

    Example:
        >>> import tempfile, numpy as np
        >>> p = os.path.join(tempfile.mkdtemp(), "f")
        >>> with open(p, "wb") as f:
        ...     _ = f.write(b"abcdef")
        >>> fd = open_for_read(p); buf = np.zeros(4, np.uint8)
        >>> read_into(fd, memoryview(buf), 3), bytes(buf[:3])
        (3, b'def')
        >>> close(fd)
    """
    done, n = 0, view.nbytes
    while done < n:
        k = os.preadv(fd, [view[done:]], offset + done)
        if k == 0:
            break
        done += k
    return done


def close(fd: int) -> None:
    """Close an fd opened by :func:`open_for_write` or :func:`open_for_read`."""
    with _paths_lock:
        _paths.pop(fd, None)
    os.close(fd)


def pwrite(fd: int, data: bytes | bytearray | memoryview | np.ndarray, offset: int) -> None:
    """Write all of ``data`` at ``offset``, looping on short writes.

    A full disk raises :class:`~tiered.errors.StorageFullError` naming the file.

    Example:
        >>> import tempfile, os
        >>> fd = open_for_write(os.path.join(tempfile.mkdtemp(), "f"))
        >>> pwrite(fd, b"abc", 10); os.fstat(fd).st_size
        13
        >>> close(fd)
    """
    view = memoryview(data).cast("B")
    n = view.nbytes
    inj = _injector
    if inj is not None:
        inj._before_write(fd, view, offset)
    done = 0
    while done < n:
        try:
            k = os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise _translate(e, _path_of(fd), n - done) from e
        if k == 0:  # a regular file never does this; avoid spinning forever if it does
            raise OSError(errno.EIO, f"pwrite wrote 0 bytes at offset {offset + done}", _path_of(fd))
        done += k


def fallocate(fd: int, offset: int, length: int) -> None:
    """Reserve disk blocks for ``[offset, offset + length)``, growing the file if needed.

    A full disk (``ENOSPC``/``EDQUOT``) raises :class:`~tiered.errors.StorageFullError` with the
    path and the bytes asked. Where the file system does not support ``posix_fallocate``
    (``EOPNOTSUPP``/``EINVAL``), the range beyond the current end of file is written with
    zeros instead, which also reserves the blocks.

    Example:
        >>> import tempfile, os
        >>> fd = open_for_write(os.path.join(tempfile.mkdtemp(), "f"))
        >>> fallocate(fd, 0, 4096); os.fstat(fd).st_size
        4096
        >>> close(fd)
    """
    if length <= 0:
        return
    inj = _injector
    if inj is not None:
        inj._before_fallocate(fd, offset, length)
    try:
        os.posix_fallocate(fd, offset, length)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise _translate(e, _path_of(fd), length) from e
    size = os.fstat(fd).st_size
    start = max(size, offset)
    end = offset + length
    zeros = bytes(min(_ZERO_CHUNK, max(0, end - start)))
    pos = start
    while pos < end:
        k = min(len(zeros), end - pos)
        pwrite(fd, zeros[:k], pos)
        pos += k


def truncate(fd: int, size: int) -> None:
    """Set the file's size to ``size`` bytes (``ftruncate``)."""
    inj = _injector
    if inj is not None:
        inj._before_truncate(fd, size)
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        raise _translate(e, _path_of(fd), size) from e


def fsync(fd: int) -> None:
    """Make the file's data and size durable."""
    os.fsync(fd)
    inj = _injector
    if inj is not None:
        inj._after_fsync(_path_of(fd))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (creations, renames, removals) durable."""
    path = os.path.abspath(os.fspath(path))
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    inj = _injector
    if inj is not None:
        inj._after_fsync_dir(path)


def makedirs(path: str | os.PathLike[str]) -> None:
    """Create a directory and its missing parents, durably (each new entry's parent is fsynced).

    New directories are durable when this returns, so the power-loss simulation never has to
    undo one.

    Example:
        >>> import tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "a", "b"); makedirs(d); os.path.isdir(d)
        True
    """
    path = os.path.abspath(os.fspath(path))
    missing = []
    p = path
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    for p in reversed(missing):
        fsync_dir(os.path.dirname(p))


def remove(path: str | os.PathLike[str], *, missing_ok: bool = True) -> None:
    """Delete a file (the directory is not fsynced; call :func:`fsync_dir` for that)."""
    try:
        os.remove(os.fspath(path))
    except FileNotFoundError:
        if not missing_ok:
            raise


def write_file_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``, atomically and durably.

    Writes a temp file in the same directory, fsyncs it, renames it over ``path`` and fsyncs
    the directory. A crash at any point leaves either the old or the new content.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.json")
        >>> write_file_atomic(p, b"1"); write_file_atomic(p, b"2"); open(p, "rb").read()
        b'2'
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = open_for_write(tmp, exclusive=True)
    try:
        try:
            pwrite(fd, data, 0)
            fsync(fd)
        finally:
            close(fd)
        inj = _injector
        if inj is not None:
            inj._before_replace(tmp, path)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    fsync_dir(directory)


def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename the (written and fsynced) file ``src`` over ``dst``; the directory is not fsynced
    (call :func:`fsync_dir` for that). A process that maps the old ``dst`` keeps its bytes.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> write_file_atomic(os.path.join(d, "a"), b"1"); write_file_atomic(os.path.join(d, "b"), b"2")
        >>> replace(os.path.join(d, "b"), os.path.join(d, "a")); open(os.path.join(d, "a"), "rb").read()
        b'2'
    """
    inj = _injector
    if inj is not None:
        inj._before_replace(os.fspath(src), os.fspath(dst))
    os.replace(src, dst)


class WritableFile:
    """A binary file object whose writes go through :func:`pwrite`.

    It exists so that h5py (``h5py.File(WritableFile(path), "w")``, the ``fileobj`` driver)
    writes HDF5 files through this module. Only what h5py needs is implemented.

    Example:
        >>> import tempfile, os
        >>> with WritableFile(os.path.join(tempfile.mkdtemp(), "f")) as f:
        ...     _ = f.write(b"hello"); _ = f.seek(0); f.read(5)
        b'hello'
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.name = os.path.abspath(os.fspath(path))
        self.fd = open_for_write(self.name)
        self._pos = 0
        #: The first exception a write raised. Libraries that call back into this object
        #: (h5py's fileobj driver) turn it into their own error; this keeps the original.
        self.error: BaseException | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        self._check_open()
        if n is None or n < 0:
            n = max(0, os.fstat(self.fd).st_size - self._pos)
        data = os.pread(self.fd, n, self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        self._check_open()
        view = memoryview(buf).cast("B")
        k = os.preadv(self.fd, [view], self._pos)
        self._pos += k
        return k

    def _check_open(self) -> None:
        if self.fd < 0:
            raise ValueError(f"I/O operation on closed file {self.name}")

    def write(self, data: Any) -> int:
        self._check_open()
        view = memoryview(data).cast("B")
        try:
            pwrite(self.fd, view, self._pos)
        except BaseException as e:
            self.error = self.error or e
            raise
        self._pos += view.nbytes
        return view.nbytes

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self._pos = pos
        elif whence == os.SEEK_CUR:
            self._pos += pos
        else:
            self._pos = os.fstat(self.fd).st_size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        self._check_open()
        size = self._pos if size is None else size
        try:
            truncate(self.fd, size)
        except BaseException as e:
            self.error = self.error or e
            raise
        return size

    def flush(self) -> None:
        """Nothing is buffered here; durability is :func:`fsync`'s job."""

    def fsync(self) -> None:
        fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            close(self.fd)
            self.fd = -1

    def detach(self) -> int:
        """Give up the fd without closing it; return it (the caller closes it with :func:`close`)."""
        fd, self.fd = self.fd, -1
        return fd

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def __enter__(self) -> WritableFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Fault injection
# ---------------------------------------------------------------------------------------------

# Undo-log records: kind (1 byte), path length (u32), a (i64), b (i64), payload length (u64),
# then the path and the payload. Kinds:
#   W  a write or resize of `path` not yet fsynced: a = offset, b = old file size (-1: absent),
#      payload = the bytes the write overwrote (inside the old size)
#   F  fsync of `path`
#   C  creation of `path` (the file did not exist)
#   R  rename of a temp file over `path`: a = 1 if `path` existed, payload = its old content
#   D  fsync of the directory `path`
_REC = struct.Struct("<cIqqQ")

_injector: FaultInjector | None = None


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
    ) -> None:
        self.kill_on = kill_on
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
            raise _full(path, nbytes, f"injected: write call {self.ops} >= {self.enospc_on}")
        if self.quota_bytes is not None and self.bytes + grow > self.quota_bytes:
            raise _full(path, nbytes, f"injected: quota of {self.quota_bytes} bytes")
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

    def _before_write(self, fd: int, view: memoryview, offset: int) -> None:
        path = _path_of(fd)
        with self._lock:
            self._event()
            self.writes += 1
            if self.eio_on is not None and self.writes == self.eio_on:
                raise OSError(errno.EIO, f"injected I/O error on write {self.writes}", path)
            self._count(path, view.nbytes, view.nbytes)
            self._log_undo(fd, path, offset, view.nbytes)

    def _before_fallocate(self, fd: int, offset: int, length: int) -> None:
        path = _path_of(fd)
        with self._lock:
            self._event()
            grow = max(0, offset + length - os.fstat(fd).st_size)
            self._count(path, length, grow)
            self._log_undo(fd, path, offset, 0)

    def _before_truncate(self, fd: int, size: int) -> None:
        path = _path_of(fd)
        with self._lock:
            self._event()
            old = os.fstat(fd).st_size
            if size > old:
                self._count(path, size - old, size - old)
            self._log_undo(fd, path, size, max(0, old - size))

    # A kill right after an fsync but before its record is logged counts as a crash just
    # before the fsync: the simulation stays consistent.
    def _after_fsync(self, path: str) -> None:
        with self._lock:
            self._event()
            self._log(b"F", path, 0, 0)

    def _after_fsync_dir(self, path: str) -> None:
        with self._lock:
            self._event()
            self._log(b"D", path, 0, 0)

    def _before_create(self, path: str) -> None:
        with self._lock:
            self._event()
            self._log(b"C", path, 0, 0)

    def _before_replace(self, src: str, dst: str) -> None:
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
        >>> fd = open_for_write(os.path.join(tempfile.mkdtemp(), "f"))
        >>> with inject_faults(enospc_on=1):
        ...     try:
        ...         pwrite(fd, b"x", 0)
        ...     except StorageFullError:
        ...         print("full")
        full
        >>> close(fd)
    """
    global _injector
    if _injector is not None:
        raise RuntimeError("a FaultInjector is already installed")
    inj = FaultInjector(**kwargs)
    _injector = inj
    try:
        yield inj
    finally:
        _injector = None
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
