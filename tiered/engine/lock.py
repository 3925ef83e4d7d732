"""The writer lock of a store directory: one writer at a time, any number of readers.

A store opened for writing holds an exclusive ``flock`` on the file ``lock`` in its directory
for as long as it is open, through :class:`filelock.UnixFileLock`. A second writer (another
process, or a second ``mode="r+"`` open in the same process) fails at once with
:class:`~tiered.errors.StoreLockedError` naming the holder's pid, host, start time and command,
which the holder wrote into the lock file. Read-only opens never touch the lock.

Why ``flock`` on a held file descriptor (and not a pid file, nor ``fcntl`` record locks):

* the kernel drops a ``flock`` when the last descriptor of its open file description is
  closed, which includes the death of the process (SIGKILL, OOM kill, power loss), so a crashed
  writer never blocks the next one and no "stale lock" cleanup exists (the file itself stays,
  holding the dead writer's details until the next writer overwrites them);
* unlike POSIX ``fcntl`` locks, a ``flock`` is not released when the process closes *another*
  descriptor of the same file, and it conflicts between two descriptions in one process, so a
  second writer in the same process is refused too (SQLite's and LMDB's ``fcntl`` caveats);
* the descriptor is not inheritable: a program the writer ``exec``s does not get the lock. A
  child that is only ``fork``ed does not own it either (its release is a no-op), but the lock
  lives while the child keeps the inherited descriptor (DataLoader workers forked from a writer
  keep it until they exit).

``filelock`` is told to keep the lock file (it holds the holder's details), never to fall back
to its "soft" marker-file lock where ``flock`` is missing (a marker left by a killed process
would block the next writer: the open fails instead), and to count holds per lock, not per
thread (a store may be closed by another thread than the one that opened it). What it cannot
do is written here: the holder's details (:func:`read_holder`) that the refusal names.

``flock`` is advisory and does not work across NFS on every kernel; keep stores on a local
file system (as for HDF5 and LMDB).

The holder's details are written through :mod:`tiered.fileio` like every other write of the
package.

Example:
    >>> import tempfile
    >>> from tiered.engine.lock import acquire_writer_lock, release
    >>> d = tempfile.mkdtemp()
    >>> h = acquire_writer_lock(d)
    >>> try:
    ...     acquire_writer_lock(d)
    ... except Exception as e:
    ...     print(type(e).__name__)
    StoreLockedError
    >>> release(h)
    >>> release(acquire_writer_lock(d))  # free again
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import filelock

from .. import fileio
from ..errors import StoreLockedError, TieredError

__all__ = ["LOCK_FILE", "WriterLock", "SharedWriterLock", "acquire_writer_lock", "release", "read_holder"]

#: Name of the lock file inside a store directory.
LOCK_FILE = "lock"

# The holder's details are at most this long; longer commands are cut (the file stays small).
_MAX_INFO = 4096
# How often a shared writer looks again while another process holds the lock: its holds last
# one call (a commit at most), so a short wait costs little polling.
_SHARED_POLL = 0.002


def _file_lock(path: str, *, timeout: float, poll_interval: float = 0.05,
               on_acquired: Callable[[int], None] | None = None) -> filelock.UnixFileLock:
    return filelock.UnixFileLock(path, timeout=timeout, mode=0o644, thread_local=False, is_singleton=False,
                                 poll_interval=poll_interval, fallback_to_soft=False, preserve_lock_file=True,
                                 on_acquired=on_acquired)


@dataclass
class WriterLock:
    """A held writer lock (returned by :func:`acquire_writer_lock`).

    Attributes:
        path: the lock file.
        lock: the :class:`filelock.UnixFileLock` holding the ``flock``.
        pid: the process that took it (a forked child does not own it).
        info: the holder details written into the file.
    """

    path: str
    lock: filelock.UnixFileLock
    pid: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        """Whether this handle still holds the lock."""
        # filelock refuses an instance a forked child inherited: its owner alone asks it
        return self.pid == os.getpid() and self.lock.is_locked

    def __enter__(self) -> WriterLock:
        return self

    def __del__(self) -> None:
        # a writer dropped without close() must not keep the store locked for the process's life
        try:
            release(self)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __exit__(self, *exc: object) -> None:
        release(self)


def _holder_info() -> dict[str, Any]:
    cmd = " ".join(sys.argv) if sys.argv and sys.argv[0] else sys.executable
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": cmd[:512],
    }


def read_holder(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The details the current (or last) writer wrote into ``directory/lock``, or ``None``.

    The file may name a writer that died: only a failed ``flock`` tells that it is alive.
    """
    path = os.path.join(os.fspath(directory), LOCK_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_INFO)
        info = json.loads(raw)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) else None


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        # a writer that has just taken the lock and not yet written its details
        return "another process (its details are not written yet)"
    parts = [f"pid {info.get('pid', '?')} on host {info.get('host', '?')}"]
    if info.get("time"):
        parts.append(f"since {info['time']}")
    if info.get("command"):
        parts.append(f"(command: {info['command']})")
    return " ".join(parts)


def acquire_writer_lock(directory: str | os.PathLike[str]) -> WriterLock:
    """Take the writer lock of a store directory, or fail at once if another writer holds it.

    Args:
        directory: the store directory (it must exist).

    Returns:
        A :class:`WriterLock`; give it back with :func:`release` (closing the store does).

    Raises:
        StoreLockedError: another writer (another process, or another open of this process)
            holds the lock; the message names it.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> with acquire_writer_lock(d) as h:
        ...     h.held
        True
    """
    directory = os.path.abspath(os.fspath(directory))
    path = os.path.join(directory, LOCK_FILE)
    info = _holder_info()

    def write_info(fd: int) -> None:
        try:
            data = json.dumps(info).encode()[:_MAX_INFO]
            fileio.truncate(fd, 0)
            fileio.pwrite(fd, data, 0)
        except (OSError, TieredError):
            # The details are informative only: a full disk must not stop a writer that holds the
            # lock (its own writes will report the full disk where it matters).
            pass

    lock = _file_lock(path, timeout=0, on_acquired=write_info)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        raise StoreLockedError(
            f"{directory} is locked for writing by {_describe(read_holder(directory))}. Only one "
            "writer may open a store: close the other writer first, or open this one read-only "
            "with tiered.open(path, mode='r')"
        ) from None
    return WriterLock(path=path, lock=lock, pid=os.getpid(), info=info)


def release(handle: WriterLock | None) -> None:
    """Give the lock back (idempotent; a no-op in a forked child that does not own it).

    The lock file stays, holding the last writer's details; the next writer overwrites them.
    """
    if handle is not None and handle.held:
        handle.lock.release()


class SharedWriterLock:
    """The writer lock of a store that several processes write (:meth:`TieredStore.share`).

    Each process takes the same ``flock`` as :func:`acquire_writer_lock`, but only for the span
    of one operation (:meth:`acquire` ... :meth:`release`), waiting for the other processes
    instead of failing. Each hold opens the lock file anew, so a ``fork``ed child never uses
    its parent's open file description (the two would share the ``flock``, and neither would
    exclude the other). A process killed while holding the lock loses it with its descriptors,
    as for the one-writer lock.

    Args:
        directory: the store directory.
        timeout: seconds :meth:`acquire` waits before raising :class:`StoreLockedError` (a
            one-writer open of the store holds the lock until it closes).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> lock = SharedWriterLock(d)
        >>> lock.acquire(); lock.held
        True
        >>> lock.release(); lock.held
        False
    """

    def __init__(self, directory: str | os.PathLike[str], timeout: float = 600.0) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.timeout = timeout
        self._lock: filelock.UnixFileLock | None = None
        self._pid = -1

    def _file_lock(self) -> filelock.UnixFileLock:
        # A forked child uses this object too (a shared store travels by fork), but filelock
        # refuses an instance inherited across fork: each process makes its own.
        if self._pid != os.getpid():
            self._lock = _file_lock(os.path.join(self.directory, LOCK_FILE), timeout=self.timeout,
                                    poll_interval=_SHARED_POLL)
            self._pid = os.getpid()
        return self._lock

    @property
    def held(self) -> bool:
        """Whether this process holds the lock through this object."""
        return self._file_lock().is_locked

    def acquire(self) -> None:
        """Take the lock, waiting while another process holds it.

        Raises:
            StoreLockedError: it stayed held for ``timeout`` seconds (naming the holder).
        """
        try:
            self._file_lock().acquire()
        except filelock.Timeout:
            raise StoreLockedError(
                f"{self.directory} stayed locked for {self.timeout:.0f} s by "
                f"{_describe(read_holder(self.directory))}. A store written by several processes "
                "is locked for one operation at a time; a writer that opened it alone (mode='r+' "
                "without share()) holds the lock until it closes: close it, or share() it too") from None

    def release(self) -> None:
        """Give the lock back (a no-op when not held)."""
        lock = self._file_lock()
        if lock.is_locked:
            lock.release()

    def close(self) -> None:
        """Release the lock; its file is open only while it is held."""
        self.release()
