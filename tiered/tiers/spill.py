"""The spill tier: where a store without a path puts blobs once its memory budgets are full.

A store without a path keeps its blobs in the hot and warm arenas. When both are full, the
policy's victims (and new blobs that fit nowhere else) move down into a :class:`SpillTier`, a
cold tier (:class:`~tiered.tiers.memmap.MemmapTier`'s segment files and coalesced reads) in a
private temporary directory, as TorchRL's ``LazyMemmapStorage`` keeps its rows in a scratch
directory under the temp dir. Nothing in it is durable: it is scratch space the store owns.

The directory's life (:class:`SpillDir`):

* it is made by ``tempfile.mkdtemp`` (mode 0700, a name no other directory has had) under the
  temp dir, or under the ``spill_dir=`` the store was given, only when the store first spills;
* its owner holds an exclusive ``flock`` on its ``owner.lock`` file for as long as it lives;
  the kernel drops that lock when the owner dies, however it dies (``SIGKILL`` included);
  it is taken with ``filelock``'s descriptor primitive (as :mod:`tiered.durable.lock` takes the
  per-call holds of a shared store), not its lock object, which opens the file itself: here the
  file is created exclusively through :mod:`tiered.util.fileio` (never another directory's
  file), and its descriptor is closed only after the directory is removed, so no cleaner
  removes a directory whose owner is still removing it;
* it is removed when the store is closed, when the store is garbage-collected, and at
  interpreter exit (``weakref.finalize``), by its owner only: a forked child that exits never
  removes its parent's directory;
* before a process makes a spill directory, it removes the ones it finds under the same root
  whose lock it can take (:func:`remove_abandoned`): their owner is dead. A directory whose
  lock is held is never touched, nor one whose owner is still creating it.

Space freed in the spill tier is reused at once (no commit will ever name it), its writes are
never fsynced, and a copy of the store in a forked process may read it but never write it: its
reads are its fork-time rows until the owner frees spill space, and raise
:class:`~tiered.errors.StaleReadError` from then on (a count of frees the owner keeps in memory
shared with its forked children, checked after each read).

Example:
    >>> import numpy as np, os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> tier = SpillTier(root, segment_bytes=1 << 20)
    >>> os.path.dirname(tier.directory) == root, os.path.basename(tier.directory).startswith(SPILL_PREFIX)
    (True, True)
    >>> off = tier.allocate(np.array([5]))
    >>> tier.write(off, np.frombuffer(b"spill", np.uint8), np.array([0]), np.array([5]))
    >>> out = np.zeros(5, np.uint8); tier.read(off, np.array([5]), out, np.array([0])); out.tobytes()
    b'spill'
    >>> tier.close(); os.path.exists(tier.directory)
    False
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
import time
import weakref
from typing import Any

import filelock
import numpy as np

from ..errors import InvalidArgumentError, NotSharedError, StaleReadError, StoreClosedError
from ..util import fileio
from .extents import ExtentAllocator
from .memmap import SEGMENT_BYTES, MemmapTier

__all__ = ["SpillDir", "SpillTier", "SPILL_PREFIX", "OWNER_LOCK", "remove_abandoned", "spill_root", "describe",
           "is_spill_dir", "spill_dirs"]

#: Name prefix of every spill directory (``tiered-spill-XXXXXXXX``).
SPILL_PREFIX = "tiered-spill-"
#: The lock file inside a spill directory: flocked by its owner, holding the owner's pid.
OWNER_LOCK = "owner.lock"
#: A spill directory without an owner pid (its creator died between ``mkdtemp`` and writing its
#: pid under the lock, a window of microseconds) is removed once it is this old.
UNOWNED_GRACE_S = 3600


def spill_root(spill_dir: str | os.PathLike[str] | None = None) -> str:
    """The directory spill directories are made in: ``spill_dir``, or the temp dir.

    Example:
        >>> import tempfile
        >>> spill_root() == tempfile.gettempdir()
        True
    """
    return os.path.abspath(os.fspath(spill_dir)) if spill_dir is not None else tempfile.gettempdir()


def _owner_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _unowned_for_long(path: str) -> bool:
    """Whether a spill directory that names no owner is older than :data:`UNOWNED_GRACE_S`."""
    try:
        return time.time() - os.lstat(path).st_mtime > UNOWNED_GRACE_S
    except OSError:
        return False


def _try_remove(path: str) -> bool:
    """Remove the spill directory ``path`` if its owner is dead; return whether it was removed."""
    try:
        st = os.lstat(path)
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
            return False
        fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # no lock file: being created now, or its creator died before the lock
        old = _unowned_for_long(path)
        if old:
            shutil.rmtree(path, ignore_errors=True)
        return old
    except OSError:  # another user's directory, or not a directory we made
        return False
    try:
        if not filelock.lock_descriptor(fd, blocking=False):
            return False  # its owner lives
        if _owner_pid(fd) is None and not _unowned_for_long(path):
            # the creator opened the file but has not taken its lock yet (it waits for ours)
            return False
        shutil.rmtree(path, ignore_errors=True)  # under the lock: no one else removes it meanwhile
        return True
    finally:
        os.close(fd)


def remove_abandoned(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the spill directories under ``root`` (default: the temp dir) whose owner is dead.

    A directory counts as abandoned only when this process can take the exclusive ``flock`` of
    its ``owner.lock`` and the file names an owner: the kernel releases that lock when the owner
    exits or is killed, so a live owner's directory is never touched.

    Returns:
        The directories removed.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> d = SpillDir(root)
        >>> remove_abandoned(root)  # d's owner (this process) lives
        []
        >>> d.remove()
    """
    root = spill_root(root)
    try:
        names = [n for n in os.listdir(root) if n.startswith(SPILL_PREFIX)]
    except OSError:
        return []
    return [path for path in (os.path.join(root, name) for name in names) if _try_remove(path)]


def is_spill_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a spill directory (its name and its ``owner.lock``).

    Example:
        >>> import tempfile
        >>> is_spill_dir(tempfile.mkdtemp())
        False
    """
    path = os.fspath(path)
    return os.path.basename(os.path.normpath(path)).startswith(SPILL_PREFIX) and os.path.isfile(
        os.path.join(path, OWNER_LOCK))


def spill_dirs(root: str | os.PathLike[str] | None = None) -> list[str]:
    """The spill directories under ``root`` (default: the temp dir), sorted.

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> d = SpillDir(root)
        >>> spill_dirs(root) == [d.path]
        True
        >>> d.remove()
    """
    root = spill_root(root)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if is_spill_dir(os.path.join(root, n))]


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``tiered info`` shows of a spill directory: ``dir``, ``owner_pid``, ``owner_alive``
    (its lock is held; a dead owner's directory goes with the next spill or
    :func:`remove_abandoned`), ``segments`` and ``bytes`` (allocated on disk).

    Example:
        >>> import tempfile
        >>> d = SpillDir(tempfile.mkdtemp())
        >>> info = describe(d.path)
        >>> info["owner_pid"] == os.getpid(), info["owner_alive"], info["segments"]
        (True, True, 0)
        >>> d.remove()
    """
    path = os.path.abspath(os.fspath(path))
    fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        pid = _owner_pid(fd)
        # flock locks of two open files conflict even in one process: this works for the owner
        # too. The probe is exclusive (filelock takes no shared flock): a cleaner or another
        # describe probing at the same instant counts as a live owner, as the owner could.
        try:
            alive = not filelock.lock_descriptor(fd, blocking=False)
        except OSError:  # no flock on this file system: say alive (a cleaner cannot lock it either)
            alive = True
    finally:
        os.close(fd)
    segments = [e for e in os.scandir(path) if e.name.startswith("seg-") and e.is_file(follow_symlinks=False)]
    return {"dir": path, "owner_pid": pid, "owner_alive": alive, "segments": len(segments),
            "bytes": sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in segments)}


def _remove_dir(path: str, fd: int, owner: int) -> None:
    """The finalizer of a :class:`SpillDir`: its owner removes it; a forked copy only lets go."""
    if os.getpid() != owner:
        return  # the parent's lock and directory stay (the descriptor is closed at exit)
    shutil.rmtree(path, ignore_errors=True)
    try:
        fileio.close(fd)  # after the removal: the lock is held until the directory is gone
    except OSError:
        pass


class SpillDir:
    """A private spill directory, owned (and locked) by this process until :meth:`remove`.

    Making one first removes the abandoned spill directories of dead processes under the same
    root (:func:`remove_abandoned`).

    Args:
        root: where to make it (created if missing); default the temp dir.

    Raises:
        InvalidArgumentError: ``root`` cannot hold a directory of this process (not a directory,
            no permission).
        StorageFullError: the disk is full.

    Example:
        >>> import os, tempfile
        >>> d = SpillDir(tempfile.mkdtemp())
        >>> sorted(os.listdir(d.path)), d.owner == os.getpid()
        (['owner.lock'], True)
        >>> d.remove(); os.path.exists(d.path)
        False
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        root = spill_root(root)
        try:
            fileio.makedirs(root)
            remove_abandoned(root)
            self.path = tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=root)
        except (NotADirectoryError, FileExistsError, PermissionError) as e:
            raise InvalidArgumentError(
                f"cannot make a spill directory in {root!r} ({e}); pass spill_dir= a directory this "
                "process may write, or give the store a path") from None
        self.owner = os.getpid()
        try:
            fd = fileio.open_for_write(os.path.join(self.path, OWNER_LOCK), exclusive=True)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        try:
            # waits only while another process's cleaner looks at it (microseconds: polled closely)
            filelock.lock_descriptor(fd, poll_interval=0.001)
            fileio.pwrite(fd, f"{self.owner}\n".encode(), 0)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            fileio.close(fd)
            raise
        self._finalizer = weakref.finalize(self, _remove_dir, self.path, fd, self.owner)

    @property
    def removed(self) -> bool:
        """Whether the directory was removed (by :meth:`remove`, or at exit)."""
        return not self._finalizer.alive

    def remove(self) -> None:
        """Remove the directory and release its lock (idempotent; nothing in a forked copy)."""
        self._finalizer()


class SpillTier(MemmapTier):
    """The spill tier: a :class:`~tiered.tiers.memmap.MemmapTier` in a :class:`SpillDir`.

    It differs from a durable cold tier in three ways: freed space is reused at once (there is
    no commit to wait for), :meth:`flush` does nothing (nothing in it needs to survive a crash),
    and :meth:`close` removes the directory. Pickling copies its bytes, and the copy spills to
    a directory of its own when unpickled.

    Args:
        root: where the spill directory is made (default: the temp dir).
        segment_bytes: size of one segment file.
        threads: threads for large reads.
        budget: optional cap on the bytes of live blobs (``None``: as much as the disk holds).
    """

    name = "cold"  # its place among the tiers (the index's cold column); stats() call it "spill"
    format = "spill"

    def __init__(self, root: str | os.PathLike[str] | None = None, segment_bytes: int | str = SEGMENT_BYTES,
                 threads: int = 8, *, budget: int | str | None = None) -> None:
        self.spill_dir = SpillDir(root)
        try:
            super().__init__(self.spill_dir.path, segment_bytes, threads, budget=budget)
        except BaseException:
            self.spill_dir.remove()
            raise
        # Frees so far: this process's count, and the owner's in an anonymous shared page that a
        # forked child shares. A child's own count stays what it was at the fork, so the two
        # differ once the owner may have reused space the child's index still names.
        self.frees = 0
        self._shared_frees = mmap.mmap(-1, 8)

    def writable_here(self) -> bool:
        """Whether this process may write the tier: it made it (not a forked copy) and it is open."""
        return os.getpid() == self.spill_dir.owner and not self.spill_dir.removed

    def check_writable(self) -> None:
        """Refuse a write from a forked copy (:class:`NotSharedError`) or after close
        (:class:`StoreClosedError`)."""
        if os.getpid() != self.spill_dir.owner:
            raise NotSharedError(
                f"this store's spill directory {self.directory} belongs to process {self.spill_dir.owner}; "
                f"a forked copy (process {os.getpid()}) may read the store but not write it. Write from the "
                "process that made the store, or give the store a path and share() it")
        if self.spill_dir.removed:
            raise StoreClosedError(f"the spill directory {self.directory} was removed: the store was closed")

    def free(self, offsets: np.ndarray, sizes: np.ndarray, *, defer: bool = False) -> None:
        """Release blobs; the space is reusable at once (``defer`` is ignored: nothing is durable)."""
        self.check_writable()
        # counted before the space can be reused: a forked copy that reads after this sees it
        self.frees += 1
        struct.pack_into("<q", self._shared_frees, 0, self.frees)
        super().free(offsets, sizes, defer=False)

    def read(self, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray | Any,
             out_offsets: np.ndarray) -> None:
        """Read blobs, as :meth:`MemmapTier.read`; in a forked copy, only while the owner has
        freed no spill space since the fork.

        Raises:
            StaleReadError: this is a forked copy, and the owner freed space (maybe reused for
                other blobs) since the fork: nothing read is returned.
        """
        super().read(offsets, sizes, out, out_offsets)
        # checked after the bytes are copied: a reuse during the read shows too
        if os.getpid() != self.spill_dir.owner and struct.unpack_from("<q", self._shared_frees)[0] != self.frees:
            raise StaleReadError(
                f"this process was forked from process {self.spill_dir.owner}, whose store (no path) has since "
                f"overwritten rows and reused their space in its spill directory {self.directory}: the rows of "
                "the fork cannot be read here any more. Read in the process that writes the store, or give the "
                "store a path and share() it (tiered.open(path) then reads the latest commit).")

    def flush(self) -> None:
        """Nothing: spilled bytes need not survive a crash (they are removed with the process)."""

    def close(self) -> None:
        """Close the files and remove the spill directory."""
        super().close()
        if os.getpid() == self.spill_dir.owner:
            self.spill_dir.remove()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "dir": self.directory}

    def state(self) -> dict[str, Any]:
        raise TypeError("a spill tier has no durable state; give the store a path to make it durable")

    def __getstate__(self) -> dict[str, Any]:
        # the copy gets the bytes, not the directory: another process never uses this one
        data = [os.pread(self.segment_fd(i), size, self._data_offsets[i]) for i, size in enumerate(self._sizes)]
        return {"root": os.path.dirname(self.directory), "segment_bytes": self.segment_bytes, "budget": self.budget,
                "threads": self.threads, "sizes": list(self._sizes), "alloc": self._alloc.state(), "data": data}

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__init__(st["root"], st["segment_bytes"], st["threads"], budget=st["budget"])
        self._alloc = ExtentAllocator.from_state(st["alloc"])
        for i, (size, data) in enumerate(zip(st["sizes"], st["data"], strict=True)):
            self._reserve(np.array([i * self.segment_bytes]), np.array([size]))
            fileio.pwrite(self.segment_fd(i), data, 0)

    def __repr__(self) -> str:
        return f"SpillTier({self.directory!r}, used={self.bytes_used}, segments={len(self._sizes)})"
