"""The one module through which every file write of :mod:`tiered` goes.

Tiers, the index and the manifest never call ``os.write``, ``os.fsync``, ``os.replace`` or
``os.posix_fallocate`` themselves: they call the functions here. That gives the package one
seam where faults a CI machine cannot produce for real (a full disk, an I/O error, a power
cut) are injected in tests, without replacing any component under test.

h5py writes HDF5 files through :class:`WritableFile` (its ``fileobj`` driver), so HDF5's own
metadata writes go through the seam too.

Fault injection (tests only): :func:`set_fault_hook` is the seam; :mod:`tiered.testing.faults`
installs a hook that fails the N-th write with ``ENOSPC`` or ``EIO``, applies a byte quota, kills
the process at a crash point, and keeps an *undo log* from which a power cut is simulated.

Example:
    >>> import os, tempfile
    >>> from tiered.util import fileio
    >>> d = tempfile.mkdtemp()
    >>> fileio.write_file_atomic(os.path.join(d, "manifest.json"), b"{}")
    >>> open(os.path.join(d, "manifest.json"), "rb").read()
    b'{}'
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from typing import Any, Protocol

import numpy as np

from ..errors import CorruptionError, StorageFullError
from .pool import run_parallel

__all__ = [
    "open_for_write",
    "open_for_read",
    "close",
    "pwrite",
    "fallocate",
    "truncate",
    "fsync",
    "fsync_dir",
    "fsync_many",
    "makedirs",
    "remove",
    "write_file_atomic",
    "WritableFile",
    "FaultHook",
    "set_fault_hook",
    "path_of",
    "storage_full_error",
]

_ZERO_CHUNK = 1 << 20

# fd -> absolute path, for error messages and the undo log. Filled by open_for_write.
_paths: dict[int, str] = {}
_paths_lock = threading.Lock()


def path_of(fd: int) -> str:
    path = _paths.get(fd)
    if path is not None:
        return path
    try:  # an fd this module did not open (Linux only); good enough for messages
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


def storage_full_error(path: str, nbytes: int, cause: str) -> StorageFullError:
    return StorageFullError(
        errno.ENOSPC,
        f"no space left on the device for {nbytes} more bytes ({cause}); free disk space or "
        f"move the store to a larger file system, then retry",
        path,
    )


def _translate(exc: OSError, path: str, nbytes: int) -> OSError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        err = storage_full_error(path, nbytes, os.strerror(exc.errno))
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
        inj.before_create(path)
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
    inj = _injector
    if inj is not None:
        inj.before_open_read(path)
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
        inj.before_write(fd, view, offset)
    done = 0
    while done < n:
        try:
            k = os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise _translate(e, path_of(fd), n - done) from e
        if k == 0:  # a regular file never does this; avoid spinning forever if it does
            raise OSError(errno.EIO, f"pwrite wrote 0 bytes at offset {offset + done}", path_of(fd))
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
        inj.before_fallocate(fd, offset, length)
    try:
        os.posix_fallocate(fd, offset, length)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise _translate(e, path_of(fd), length) from e
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
        inj.before_truncate(fd, size)
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        raise _translate(e, path_of(fd), size) from e


def fsync(fd: int) -> None:
    """Make the file's data and size durable."""
    os.fsync(fd)
    inj = _injector
    if inj is not None:
        inj.after_fsync(path_of(fd))


def fsync_many(fds: list[int]) -> None:
    """:func:`fsync` of several files at once: the fsyncs run on a few threads, so the file system
    makes them durable in one journal commit where one after the other each waits for its own;
    the fault hook hears of them afterwards, one by one in order, on the calling thread (as if
    they had run one after the other).

    Raises:
        OSError: the first fsync that failed, once every one has finished.
    """
    run_parallel(os.fsync, [(fd,) for fd in fds], min(8, len(fds)))
    inj = _injector
    if inj is not None:
        for fd in fds:  # the files of one call: a few dozen
            inj.after_fsync(path_of(fd))


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
        inj.after_fsync_dir(path)


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


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file, if there is one (the directory is not fsynced; call :func:`fsync_dir` for that)."""
    try:
        os.remove(os.fspath(path))
    except FileNotFoundError:
        pass


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
            inj.before_replace(tmp, path)
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
        inj.before_replace(os.fspath(src), os.fspath(dst))
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
# The fault-injection seam: tiered.testing.faults installs a hook; nothing else does
# ---------------------------------------------------------------------------------------------


class FaultHook(Protocol):
    """What the file functions above call before (or after) each change, and before each open
    of a file to read (where a test runs another process's step), when a hook is set."""

    def before_write(self, fd: int, view: memoryview, offset: int) -> None: ...
    def before_fallocate(self, fd: int, offset: int, length: int) -> None: ...
    def before_truncate(self, fd: int, size: int) -> None: ...
    def after_fsync(self, path: str) -> None: ...
    def after_fsync_dir(self, path: str) -> None: ...
    def before_create(self, path: str) -> None: ...
    def before_replace(self, src: str, dst: str) -> None: ...
    def before_open_read(self, path: str) -> None: ...


_injector: FaultHook | None = None


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install ``hook`` (or remove it with ``None``); returns the one it replaces.

    Tests only: :func:`tiered.testing.faults.inject_faults` is the way to use it.
    """
    global _injector
    old, _injector = _injector, hook
    return old
