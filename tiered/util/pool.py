"""The worker pool that codecs and file tiers run their batched work on.

Example:
    >>> import numpy as np
    >>> from tiered.util.pool import run_parallel
    >>> out = np.zeros(4, np.int64)
    >>> run_parallel(out.__setitem__, [(0, 1), (3, 7)], threads=2)
    >>> out.tolist()
    [1, 0, 0, 7]
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

__all__ = ["WorkerPool", "run_parallel"]

# Set on the pool's threads, and on a calling thread while it runs its own task: a task that
# itself calls run_parallel (a slice of a batch decoding with a codec that would split it again)
# runs that work inline, since the pool's threads may all be busy with the outer tasks and waiting
# for them from inside one could wait forever.
_LOCAL = threading.local()


class WorkerPool:
    """A few persistent daemon threads fed through a C-implemented queue.

    Not a ``ThreadPoolExecutor``: its ``submit``/``result`` run Python code whose amount depends on
    timing (idle-thread checks, condition waits), while here the calling thread only makes C calls
    (``Lock.acquire``, ``SimpleQueue.put``), so the Python-level work per batch is fixed. Threads
    start on first use and are re-created after ``fork`` (a child inherits no threads).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def ensure(self, count: int) -> None:
        if len(self._threads) >= count:
            return
        with self._lock:
            while len(self._threads) < count:
                t = threading.Thread(
                    target=self._work, name=f"tiered-codec-{len(self._threads)}", daemon=True
                )
                t.start()
                self._threads.append(t)

    def submit(self, task: tuple) -> None:
        self._queue.put(task)

    def _work(self) -> None:
        _LOCAL.inside = True
        get = self._queue.get
        while True:
            fn, args, done, errors = get()
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(e)
            finally:
                # drop the task before waiting for the next one: its arguments are the caller's
                # buffers (a write's raw frames, a sample's output), which an idle thread would
                # otherwise keep alive until the next batch
                del fn, args, errors
                done.release()


_POOL = WorkerPool()


def _reset_pool_after_fork() -> None:
    global _POOL
    _POOL = WorkerPool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


def run_parallel(fn: Callable[..., None], tasks: Sequence[tuple], threads: int, *, claim: bool = False) -> None:
    """Run ``fn(*args)`` for every ``args`` in ``tasks`` on up to ``threads`` threads, then return.

    The calling thread runs the last task itself, so ``threads=1`` (or one task) starts no thread.
    ``fn`` must release the GIL for its heavy work (zstandard, lz4 and numpy copies do). The first
    exception raised by a task is re-raised here after every task has finished. A task that calls
    ``run_parallel`` itself runs those tasks on its own thread.

    With ``claim``, each thread takes the next task nobody has started until none is left, and the
    calling thread waits only for tasks another thread started: when the pool's threads get no
    core (a loaded machine), the calling thread does their work instead of waiting for them to be
    scheduled. How many tasks the calling thread runs then depends on timing (so does its count of
    Python calls: a fixed one per task).
    """
    if threads <= 1 or len(tasks) <= 1 or getattr(_LOCAL, "inside", False):
        for args in tasks:
            fn(*args)
        return
    pool = _POOL
    pool.ensure(min(threads, len(tasks)) - 1)
    errors: list[BaseException] = []
    if claim:
        _run_claiming(pool, fn, tasks, min(threads, len(tasks)) - 1, errors)
    else:
        locks = []
        for args in tasks[:-1]:
            done = threading.Lock()
            done.acquire()
            pool.submit((fn, args, done, errors))
            locks.append(done)
        _LOCAL.inside = True
        try:
            fn(*tasks[-1])
        finally:
            _LOCAL.inside = False
            # Wait for every task even if ours failed: they write into the caller's buffers.
            for done in locks:
                done.acquire()
    if errors:
        raise errors[0]


def _run_claiming(pool: WorkerPool, fn: Callable[..., None], tasks: Sequence[tuple], helpers: int,
                  errors: list[BaseException]) -> None:
    claims = itertools.count()  # next() on it is atomic (one C call under the GIL): each task is claimed once
    dones = [threading.Lock() for _ in tasks]
    for done in dones:
        done.acquire()
    for _ in range(helpers):
        unwaited = threading.Lock()  # released when the helper's job ends; nobody waits for it
        unwaited.acquire()
        pool.submit((_run_claimed, (fn, tasks, claims, dones, errors), unwaited, errors))
    _LOCAL.inside = True
    try:
        _run_claimed(fn, tasks, claims, dones, errors)
    finally:
        _LOCAL.inside = False
        # every task is claimed now; wait for those other threads run: they write into the caller's buffers
        for done in dones:
            done.acquire()


def _run_claimed(fn: Callable[..., None], tasks: Sequence[tuple], claims: Iterator[int],
                 dones: list[threading.Lock], errors: list[BaseException]) -> None:
    """Run the tasks nobody has claimed yet, one at a time, until none is left."""
    n = len(tasks)
    while (i := next(claims)) < n:
        try:
            fn(*tasks[i])
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)
        finally:
            dones[i].release()
