"""What the shared writers' lock costs per call: filelock's lock object against a kept descriptor.

Run: ``python benchmarks/bench_lock.py [--holds 2000] [--repeats 5] [--samples 300]``

A store written by several processes (:meth:`tiered.TieredStore.share`) takes its writer lock
for every call, reads included. This compares, on one lock file, the time of one acquire and
release of:

- ``filelock.UnixFileLock``: opens the lock file, ``flock``, and closes it again on every hold;
- ``SharedWriterLock``: ``tiered.durable.lock``'s, which keeps its descriptor open and takes the
  ``flock`` with ``filelock.lock_descriptor`` / ``unlock_descriptor``;

and then the time of ``rb.sample(32)`` on a shared ``TieredStorage`` (2,048 rows of 4x84x84
uint8 stacks), with its store's lock as shipped and with a ``UnixFileLock`` per hold in its
place. Times are the best of ``--repeats`` runs of ``--holds`` holds, and medians over
``--samples`` samples. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import filelock  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from benchmarks._harness import machine_facts, markdown_table  # noqa: E402
from tiered.durable.lock import LOCK_FILE, SharedWriterLock  # noqa: E402


class _FileLockPerHold:
    """A stand-in for SharedWriterLock built on filelock.UnixFileLock (one per process)."""

    def __init__(self, directory: str) -> None:
        self.lock = filelock.UnixFileLock(os.path.join(directory, LOCK_FILE), timeout=600, thread_local=False,
                                          fallback_to_soft=False, preserve_lock_file=True)

    @property
    def held(self) -> bool:
        return self.lock.is_locked

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        if self.lock.is_locked:
            self.lock.release()

    def close(self) -> None:
        self.release()


def hold_us(lock, holds: int, repeats: int) -> float:
    def cycle() -> None:
        lock.acquire()
        lock.release()

    return min(timeit.repeat(cycle, number=holds, repeat=repeats)) / holds * 1e6


def sample_ms(per_hold: bool, samples: int) -> float:
    from torchrl.data import TensorDictReplayBuffer

    from tiered.testing import parts
    from tiered.torchrl import TieredStorage

    storage = TieredStorage(4096, tempfile.mkdtemp() + "/rb", shared=True, frames={"observation": 0})
    rb = TensorDictReplayBuffer(storage=storage, batch_size=32)
    frames = (torch.arange(2048 + 3).view(-1, 1, 1) % 7 * 30).expand(-1, 84, 84).to(torch.uint8).contiguous()
    obs = torch.stack([frames[i:i + 4] for i in range(2048)])
    rb.extend(TensorDict({"observation": obs, "action": torch.arange(2048)}, [2048]))
    if per_hold:
        sharing = parts(storage.store).sharing
        sharing.lock.close()
        sharing.lock = _FileLockPerHold(storage.store.path)
    for _ in range(20):
        rb.sample()
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        rb.sample()
        times.append(time.perf_counter() - t)
    storage.close()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--holds", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=300)
    args = ap.parse_args()
    facts = machine_facts()
    print(f"{facts['cpu_model']}, {facts['affinity_cores']} cores; {facts['date']}; {facts['command']}")
    d = tempfile.mkdtemp()
    locks = [("filelock.UnixFileLock, per hold", _FileLockPerHold(d), True),
             ("SharedWriterLock, kept descriptor", SharedWriterLock(d), False)]
    table = []
    for name, lock, per_hold in locks:
        us = hold_us(lock, args.holds, args.repeats)
        lock.close()
        table.append([name, f"{us:.1f} us", f"{sample_ms(per_hold, args.samples):.3f} ms"])
    print(markdown_table(["lock", "acquire + release", "rb.sample(32), shared storage"], table))


if __name__ == "__main__":
    main()
