"""The demo (``tiered demo``, ``examples/atari_replay.py``): Pong frames in two TorchRL replay buffers.

It plays ALE Pong with a seeded random policy (cached after the first run), fills one
``TensorDictReplayBuffer`` on :class:`~tiered.torchrl.TieredStorage` and one on TorchRL's
``LazyTensorStorage`` with the same transitions (4x84x84 stacks with next stacks), checks that
the same indices give bit-identical samples, and prints three of the measures of
``benchmarks/bench_storages.py``, measured the way that script measures them and named with its
words:

- **anon RSS growth** (bytes held): ``RssAnon`` of a fresh process after it filled the storage in
  chunks of 256 transitions (each a fresh copy, as a collector hands them over), minus before,
  garbage collected and ``malloc_trim``-ed both times; **per transition** and **LTS / store**
  follow from it;
- **extend 256 (rb)**: ``rb.extend`` of 256 transitions: 256 / the median seconds per call;
- **sample B=256 (rb)**: ``rb.sample()`` with ``RandomSampler`` at batch 256: 256 / the median
  seconds per call; both buffers draw the same indices each round (reseeded generators), in a
  shuffled order per round, round 0 being an untimed warm-up.

What differs from the benchmark (the demo says it too): one game instead of five, fewer
transitions and rounds, the memory fill goes through ``rb.extend`` (the benchmark's through the
storage's own API), and it runs once, where the benchmark's numbers in docs/benchmarks.md come
from a full run on a quiet machine.

Example:
    >>> import logging
    >>> from tiered.demo import main, quiet_torchrl
    >>> with quiet_torchrl():  # what the demo runs under: no "[torchrl][INFO]" lines
    ...     logging.getLogger("torchrl").isEnabledFor(logging.INFO)
    False
    >>> main(["--steps", "600", "--rounds", "3"])  # doctest: +SKIP
    playing 600 steps of ALE Pong (cached after the first run)...
    ...
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DemoResult", "run_demo", "main", "quiet_torchrl"]

CHUNK = 256
STORAGES = {"tiered": "TieredStorage", "lts": "LazyTensorStorage"}
_RESULT = "RESULT "


@contextlib.contextmanager
def quiet_torchrl() -> Iterator[None]:
    """Hide TorchRL's INFO log lines (``Initialized LazyTensorStorage ...``) inside the block.

    The ``torchrl`` logger's level is restored on exit, so a caller's own logging set-up is
    left as it was.
    """
    with contextlib.suppress(ImportError):
        import torchrl  # noqa: F401 - its import sets the logger's level: set ours after it

    logger = logging.getLogger("torchrl")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class DemoResult:
    """What :func:`run_demo` measured, per storage name (``"TieredStorage"``, ``"LazyTensorStorage"``)."""

    steps: int
    batch: int
    rounds: int
    identical: bool
    anon_growth: dict[str, int | None] = field(default_factory=dict)
    extend_rate: dict[str, float] = field(default_factory=dict)
    sample_rate: dict[str, float] = field(default_factory=dict)
    load: float | None = None  # 1-minute load average after the timed part (None: not on this OS)
    #: the TieredStorage's own ``stats()["resident_bytes"]`` and ``["bytes_per_row"]`` after the run
    resident_bytes: int | None = None
    bytes_per_row: float | None = None


# ---------------------------------------------------------------------------------- measuring


def _rss_anon() -> int | None:
    """``RssAnon`` of this process in bytes (Linux), else ``None``."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"^RssAnon:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _release_memory() -> None:
    # what the benchmark does before each reading: RSS then counts what is held, not free heap
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _make_buffer(name: str, steps: int, batch: int) -> tuple[Any, Any]:
    """A replay buffer on one of the two storages, and the generator its sampler draws from."""
    from torch import Generator
    from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

    from .torchrl import TieredStorage

    storage = TieredStorage(steps, frames={"observation": 0}) if name == "tiered" else LazyTensorStorage(steps)
    gen = Generator()
    return TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=batch, generator=gen), gen


def _rollout(steps: int, progress: bool | None) -> Any:
    from .atari import cached_rollout

    return cached_rollout("Pong", steps=steps, seed=0, progress=progress)


def _child(name: str, steps: int) -> int:
    """In a fresh process: fill one buffer and print its anon RSS growth (the benchmark's measure)."""
    data = _rollout(steps, progress=False)
    import torchrl.data  # noqa: F401 - imported before the first reading, as the benchmark does

    from . import torchrl as _adapter  # noqa: F401

    _release_memory()
    before = _rss_anon()
    rb, _ = _make_buffer(name, steps, CHUNK)
    for lo in range(0, steps, CHUNK):
        chunk = data[lo : lo + CHUNK].clone()
        rb.extend(chunk)
        del chunk
    _release_memory()
    after = _rss_anon()
    growth = None if before is None or after is None else after - before
    print(_RESULT + json.dumps({"storage": name, "anon_growth": growth, "len": len(rb)}), flush=True)
    return 0


def _memory_in_fresh_processes(steps: int) -> dict[str, int | None]:
    """Anon RSS growth per storage, each filled in its own process (run side by side: RSS is per process)."""
    env = dict(os.environ, RL_LOGGING_LEVEL="WARNING")
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tiered.demo", "--child", name, "--steps", str(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name in STORAGES
    }
    out: dict[str, int | None] = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        lines = [ln for ln in stdout.splitlines() if ln.startswith(_RESULT)]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the memory measurement of {STORAGES[name]} failed "
                               f"(exit {proc.returncode}): {stderr.strip()[-2000:]}")
        out[STORAGES[name]] = json.loads(lines[-1][len(_RESULT):])["anon_growth"]
    return out


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_demo(steps: int = 5000, batch: int = 256, rounds: int = 50, *, memory: bool = True) -> DemoResult:
    """Fill and sample both buffers, measure as the benchmark does, print the report.

    Args:
        steps: Pong transitions (the capacity of both buffers).
        batch: sample batch size.
        rounds: timed sample rounds (after one warm-up round).
        memory: measure the anon RSS growth in fresh processes (two extra interpreter starts).
    """
    import torch

    print(f"playing {steps:,} steps of ALE Pong (cached after the first run)...")
    data = _rollout(steps, progress=None)  # the bar only on a terminal
    result = DemoResult(steps, batch, rounds, identical=False)
    if memory:
        print("measuring the bytes each storage holds, each filled in a fresh process...")
        result.anon_growth = _memory_in_fresh_processes(steps)
    print(f"filling and sampling both buffers (RandomSampler, batch {batch}), alternating call by call...")
    with quiet_torchrl():
        made = {STORAGES[name]: _make_buffer(name, steps, batch) for name in STORAGES}
        names = list(made)
        extend_s: dict[str, list[float]] = {n: [] for n in names}
        for r, lo in enumerate(range(0, steps, CHUNK)):
            chunk = data[lo : lo + CHUNK]
            for name in _shuffled(names, r):
                dt, _ = _timed(lambda rb=made[name][0], chunk=chunk: rb.extend(chunk))
                if chunk.batch_size[0] == CHUNK:  # the benchmark times full chunks only
                    extend_s[name].append(dt)
        sample_s: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds + 1):
            samples = {}
            for name in _shuffled(names, r):
                rb, gen = made[name]
                gen.manual_seed(1234 + r)  # both buffers draw the same indices this round
                dt, samples[name] = _timed(rb.sample)
                if r:  # round 0 warms up (scratch buffers, promotion into the warm tier)
                    sample_s[name].append(dt)
            if r == 0:
                a, b = (samples[n] for n in names)
                result.identical = all(torch.equal(a.get(k), b.get(k)) for k in b.keys(True, True))
    stats = made[STORAGES["tiered"]][0].storage.stats()
    result.resident_bytes, result.bytes_per_row = stats["resident_bytes"], stats["bytes_per_row"]
    for name in names:
        result.extend_rate[name] = CHUNK / statistics.median(extend_s[name]) if extend_s[name] else float("nan")
        result.sample_rate[name] = batch / statistics.median(sample_s[name]) if sample_s[name] else float("nan")
    with contextlib.suppress(OSError, AttributeError):
        result.load = os.getloadavg()[0]
    for line in report(result):
        print(line)
    return result


def _shuffled(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order (seeded): drift and one storage's after-effects hit both alike."""
    out = list(names)
    random.Random(r).shuffle(out)
    return out


# ---------------------------------------------------------------------------------- reporting


def _fmt_bytes(x: float | None) -> str:
    # here, not at the top: util.units loads numpy, which `tiered --help` (it lists this command) does without
    from .util.units import format_bytes

    # the benchmark's units: SI (kB = 1000 B), as docs/benchmarks.md states its numbers
    return format_bytes(x, si=True, none="n/a")


def _fmt_rate(x: float) -> str:
    if x != x:
        return "n/a"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x / 1e3:.2f}k" if x >= 1e3 else f"{x:.0f}"


def _fmt_ratio(x: float | None) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def report(result: DemoResult) -> list[str]:
    """The lines :func:`run_demo` prints: the table, the claim in the benchmark's words, the caveats."""
    lts, tiered = "LazyTensorStorage", "TieredStorage"
    headers = ("storage", "anon RSS growth", "per transition", "LTS / store", "extend 256 (rb)",
               f"sample B={result.batch} (rb)")
    rows = [headers]
    for name in (tiered, lts):
        held = result.anon_growth.get(name)
        rows.append((
            name,
            _fmt_bytes(held),
            _fmt_bytes(held / result.steps) if held is not None else "n/a",
            _fmt_ratio(_ratio(result.anon_growth.get(lts), held)),
            f"{_fmt_rate(result.extend_rate[name])} ({_fmt_ratio(_ratio(result.extend_rate[name], result.extend_rate[lts]))})",
            f"{_fmt_rate(result.sample_rate[name])} ({_fmt_ratio(_ratio(result.sample_rate[name], result.sample_rate[lts]))})",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = [f"bit-identical samples: {result.identical}", ""]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
              for row in rows]
    held = _ratio(result.anon_growth.get(lts), result.anon_growth.get(tiered))
    speed = _ratio(result.sample_rate[tiered], result.sample_rate[lts])
    lines += [
        "",
        "In parentheses: the ratio to LazyTensorStorage. As benchmarks/bench_storages.py words it: "
        + (f"TieredStorage's anon RSS growth is 1/{held:.0f} of LazyTensorStorage's (LTS / store {_fmt_ratio(held)}), "
           if held else "TieredStorage's bytes held were not measured (--no-memory, or no /proc), ")
        + f"and its sample B={result.batch} (rb) rate is {_fmt_ratio(speed)} LazyTensorStorage's.",
        *([f"By its own count (storage.stats()), the TieredStorage holds resident_bytes {_fmt_bytes(result.resident_bytes)} (what the "
           f"process holds for the store), bytes_per_row {_fmt_bytes(result.bytes_per_row)} (dense columns and "
           "metadata included)."] if result.resident_bytes is not None else []),
        "Measured as that benchmark measures them (anon RSS growth of a fresh process that fills the storage; "
        "rates from the median seconds per call, the storages alternating on the same indices), on less: "
        f"Pong only, {result.steps:,} transitions, {result.rounds} rounds, one run on this machine, filled "
        "through rb.extend. The benchmark's full run (5 games, 20,000 transitions, 200 rounds) is in "
        "docs/benchmarks.md; rates vary from run to run on a busy machine"
        + (f" (load average {result.load:.1f} on {os.cpu_count()} logical cores here)." if result.load is not None
           else "."),
    ]
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``p`` (``tiered demo``'s parser, or :func:`main`'s)."""
    p.add_argument("--steps", type=int, default=5000, help="transitions (default: %(default)s)")
    p.add_argument("--batch", type=int, default=256, help="sample batch size (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=50, help="timed sample rounds (default: %(default)s)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the bytes-held measurement (it starts two fresh Python processes)")
    p.add_argument("--child", choices=tuple(STORAGES), help=argparse.SUPPRESS)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; exit code 0 when the two buffers' samples are bit-identical."""
    parser = argparse.ArgumentParser(prog="tiered demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:
        with quiet_torchrl():
            return _child(args.child, args.steps)
    result = run_demo(args.steps, args.batch, args.rounds, memory=not args.no_memory)
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
