"""A small ``TieredStore.get`` of this checkout against another commit's, in one process.

Both versions are imported side by side (the other commit's ``tiered`` package is extracted with
``git archive`` into a temporary directory under the name ``tiered_base``: the package imports
itself relatively), each builds a ``TieredStore(N)`` with no options from the same real Atari
stacks with next observations, and the two are called alternately on the same random indices.
Per batch size it prints the median time per call of each (the calling thread's CPU time with
``--cpu``, steadier on a shared machine) and their ratio; alternating in one process keeps a busy
host's bursts out of the comparison better than two runs one after the other.

With ``--stages``, each call is also timed stage by stage (``profile_calls.py``'s list of a
read's stages, wrapped in timers in both versions; a stage one version does not have shows as
``-``): per batch size, each stage's median us per call in this checkout and in the base, inclusive
(inner stages are timed inside outer ones; the timers add ~1 us a stage to both sides).

Usage:
    python benchmarks/ab_get.py --base main --cpu                 # B=1, 8, 32 against main
    python benchmarks/ab_get.py --base HEAD~3 --batches 1 32 256 --calls 3000 --threads 1
    python benchmarks/ab_get.py --base main --cpu --threads 1 --batches 32 --stages   # per stage
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()


def import_base(rev: str, where: Path):
    """The ``tiered`` package of commit ``rev``, imported as ``tiered_base`` from ``where``."""
    archive = subprocess.run(["git", "-C", str(H.REPO), "archive", rev, "tiered"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    (where / "tiered").rename(where / "tiered_base")
    sys.path.insert(0, str(where))
    return importlib.import_module("tiered_base")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="the commit to compare with (any git revision)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--calls", type=int, default=2000, help="timed calls per batch size and version")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--games", nargs="+", default=["Pong", "MsPacman"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="the calling thread's CPU time, not wall time")
    p.add_argument("--stages", action="store_true", help="time each call stage by stage too (both versions)")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    import tiered

    torch.set_num_threads(args.threads)
    data = H.load_atari(args.games, args.steps, 2000)
    n = data.batch_size[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = import_base(args.base, Path(tmp))
        stores = {"this": tiered.TieredStore(n, threads=args.threads),
                  "base": base.TieredStore(n, threads=args.threads)}
        for s in stores.values():
            s.extend(data)
        clock = time.thread_time_ns if args.cpu else time.perf_counter_ns
        gen = torch.Generator().manual_seed(0)
        print(f"{'batch':>5} {'this us':>9} {'base us':>9} {'this/base':>9}   ({args.base}, "
              f"{'thread CPU' if args.cpu else 'wall'}, median of {args.calls})")
        if args.stages:
            from profile_calls import stage_timers
        timers = contextlib.ExitStack()
        with timers:
            accs = ({k: timers.enter_context(stage_timers(clock, name))
                     for k, name in (("this", "tiered"), ("base", "tiered_base"))} if args.stages else {})
            for b in args.batches:
                run_batch(b, args, stores, accs, clock, gen, n, np, torch)
    return 0


def run_batch(b, args, stores, accs, clock, gen, n, np, torch) -> None:
    """Batch size ``b``: the two versions called alternately, medians printed (per stage too
    when ``accs`` holds the stage timers' accumulators)."""
    times = {k: [] for k in stores}
    stages: dict[str, dict[int, list[float]]] = {k: {} for k in stores}
    for c in range(args.calls + 20):
        idx = torch.randint(0, n, (b,), generator=gen)
        for k in (list(stores) if c % 2 else list(stores)[::-1]):
            if accs:
                accs[k][:] = 0
            t0 = clock()
            td = stores[k].get(idx)
            dt = clock() - t0
            if c >= 20:  # warm: plans, buffers
                times[k].append(dt)
                if accs:
                    for i in accs[k][:-1, 1].nonzero()[0].tolist():
                        stages[k].setdefault(i, []).append(float(accs[k][i, 0]))
        if c == 0:  # the same bits from both
            same = stores["base"].get(idx)
            assert all(bool((td.get(key) == same.get(key)).all()) for key in td.keys(True, True))
    med = {k: float(np.median(v)) / 1e3 for k, v in times.items()}
    print(f"{b:5d} {med['this']:9.1f} {med['base']:9.1f} {med['this'] / med['base']:9.2f}", flush=True)
    if accs:
        from profile_calls import STAGES

        for i in sorted(set(stages["this"]) | set(stages["base"])):
            row = [f"{np.median(stages[k][i]) / 1e3:9.1f}" if i in stages[k] else f"{'-':>9}" for k in stores]
            print(f"      {row[0]} {row[1]}   {STAGES[i][1]}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
