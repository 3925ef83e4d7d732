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
thread (a store may be closed by another thread than the one that opened it). Written here:
the holder's details (:func:`read_holder`) that a refusal names, which filelock does not
record, and the wait of :class:`SharedWriterLock`, whose per-call holds filelock's lock object
makes too slow (measured there); it takes the ``flock`` with filelock's descriptor primitives.

``flock`` is advisory and does not work across NFS on every kernel; keep stores on a local
file system (as for HDF5 and LMDB).

The holder's details are written through :mod:`tiered.util.fileio` like every other write of the
package.

Example:
    >>> import tempfile
    >>> from tiered.durable.lock import acquire_writer_lock, release
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
import time
from dataclasses import dataclass, field
from typing import Any

import filelock

from ..errors import StoreLockedError, TieredError
from ..util import fileio

__all__ = ["LOCK_FILE", "WriterLock", "SharedWriterLock", "acquire_writer_lock", "release", "read_holder"]

#: Name of the lock file inside a store directory.
LOCK_FILE = "lock"

# The holder's details are at most this long; longer commands are cut (the file stays small).
_MAX_INFO = 4096


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

    lock = filelock.UnixFileLock(path, timeout=0, mode=0o644, thread_local=False, is_singleton=False,
                                 fallback_to_soft=False, preserve_lock_file=True, on_acquired=write_info)
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
    instead of failing. Each process opens the lock file itself: a ``fork``ed child must not
    use its parent's descriptor (a ``flock`` belongs to the open file description, which the
    two would share, so neither would exclude the other). A process killed while holding the
    lock loses it with its descriptors, as for the one-writer lock.

    Not a :class:`filelock.UnixFileLock`: it opens and closes the lock file on every hold, and a
    shared store takes this lock on every call, reads included (a sample of a shared
    ``TieredStorage`` took twice as long: ``benchmarks/bench_lock.py``). So the descriptor is
    kept open, :func:`filelock.lock_descriptor` and :func:`filelock.unlock_descriptor` take and
    give back the ``flock``, and the wait, with its deadline and the holder named, is written here.

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
        self.fd = -1
        self.pid = -1
        self._held = False

    @property
    def held(self) -> bool:
        """Whether this process holds the lock through this object."""
        return self._held and self.pid == os.getpid()

    def _descriptor(self) -> int:
        if self.pid != os.getpid():  # first use, or a forked copy: open our own description
            self.fd, self.pid, self._held = fileio.open_for_write(os.path.join(self.directory, LOCK_FILE)), os.getpid(), False
        return self.fd

    def acquire(self) -> None:
        """Take the lock, waiting while another process holds it.

        Raises:
            StoreLockedError: it stayed held for ``timeout`` seconds (naming the holder).
        """
        fd = self._descriptor()
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while not filelock.lock_descriptor(fd, blocking=False):
            if time.monotonic() > deadline:
                raise StoreLockedError(
                    f"{self.directory} stayed locked for {self.timeout:.0f} s by "
                    f"{_describe(read_holder(self.directory))}. A store written by several processes "
                    "is locked for one operation at a time; a writer that opened it alone (mode='r+' "
                    "without share()) holds the lock until it closes: close it, or share() it too")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)  # short holds (one call) are waited for closely, long ones cheaply
        self._held = True

    def release(self) -> None:
        """Give the lock back (a no-op when not held)."""
        if self.held:
            self._held = False
            filelock.unlock_descriptor(self.fd)

    def close(self) -> None:
        """Release and close this process's descriptor."""
        self.release()
        if self.fd >= 0 and self.pid == os.getpid():
            fileio.close(self.fd)
        self.fd, self.pid = -1, -1
