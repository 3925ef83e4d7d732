"""Several processes writing one store: the lock held for the span of each call.

A store that :meth:`~tiered.TieredStore.share` made (or that was opened with ``shared=True``)
gives up the writer lock it held since it was opened, and takes it for the span of each call
instead. :class:`SharedWriting` is what the store's calls then enter (in place of its thread
lock): the outermost ``with`` takes the :class:`~tiered.durable.lock.SharedWriterLock`, has the
store rebuild its parts from the latest commit when another process committed since this one
last looked, and on the way out has the store commit what the call changed, before the lock is
given back. Nested ``with`` blocks (a method calling another) only take the thread lock.

Another process's commit replaces the manifest by a rename, so the manifest's inode, mtime and
size (:func:`manifest_stamp`) tell whether one landed.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> d = tempfile.mkdtemp() + "/s"
    >>> a = TieredStore(8, d).share()
    >>> _ = a.extend(TensorDict({"x": torch.arange(3.0)}, [3]))
    >>> b = TieredStore.open(d, mode="r+", shared=True)
    >>> _ = b.extend(TensorDict({"x": torch.ones(2)}, [2]))
    >>> len(a)   # a's next call finds b's commit and reloads it
    5
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from .lock import SharedWriterLock
from .manifest import MANIFEST

__all__ = ["SharedWriting", "manifest_stamp"]


def manifest_stamp(path: str) -> tuple[int, int, int]:
    """What changes when a commit lands in the store at ``path`` (the manifest is replaced by a
    rename each time)."""
    st = os.stat(os.path.join(path, MANIFEST))
    return st.st_ino, st.st_mtime_ns, st.st_size


class SharedWriting:
    """The lock of a store that several processes write, entered by each of its calls.

    Args:
        path: the store directory.
        lock: its :class:`~tiered.durable.lock.SharedWriterLock` (not held).
        reload: rebuilds the store's parts from the latest commit (another process made it).
        pending: whether the call changed the store since its last commit.
        commit: commits those changes.
    """

    def __init__(self, path: str, lock: SharedWriterLock, *, reload: Callable[[], None],
                 pending: Callable[[], bool], commit: Callable[[], None]) -> None:
        self.path = path
        self.lock = lock
        self.reload = reload
        self.pending = pending
        self.commit = commit
        self.rlock = threading.RLock()
        self.depth = 0
        self.seen = manifest_stamp(path)
        #: the parts may hold changes of a call that failed: reload the last commit at the next call
        self.stale = False
        #: the store closed: calls only take the thread lock (and find the store closed)
        self.closed = False

    def __enter__(self) -> SharedWriting:
        self.rlock.acquire()
        self.depth += 1  # first: the reload's own calls into the store are nested ones
        if self.depth == 1 and not self.closed:
            try:
                self.lock.acquire()
                self._catch_up()
            except BaseException:
                self.lock.release()  # a no-op where it was not taken
                self.depth -= 1
                self.rlock.release()
                raise
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        try:
            if self.depth == 1 and not self.closed:
                try:
                    self._publish(failed=exc_type is not None)
                finally:
                    self.lock.release()
        finally:
            self.depth -= 1
            self.rlock.release()

    def _catch_up(self) -> None:
        if self.stale or manifest_stamp(self.path) != self.seen:
            self.stale = True  # until the reload is whole: a failed one is tried again at the next call
            self.reload()
            self.stale = False
            self.seen = manifest_stamp(self.path)

    def _publish(self, *, failed: bool) -> None:
        if not self.pending():
            return
        if failed:
            # what the call changed before it failed is not committed: the next call starts from the last commit
            self.stale = True
            return
        try:
            self.commit()
        except BaseException:
            self.stale = True
            raise
        self.seen = manifest_stamp(self.path)

    def close(self) -> None:
        """Give the lock back for good (the store closes)."""
        self.closed = True
        self.lock.close()
