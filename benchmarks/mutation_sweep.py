"""The long mutation sweep: many more cases than tests/durable/test_mutation.py, counts per file kind.

Builds committed stores from real Atari frames (Pong, ``tiered.atari.cached_rollout``) with the
memmap and the HDF5 backend, then damages every file of each, one case at a time (truncations at
several points, appended bytes, zeroed 4 KiB pages, many flipped bits, swaps with other files,
older copies of the previous generation, the previous commit's manifest), and classifies what
``tiered.open`` + ``get`` of every row + ``verify_store`` give (tests/_mutation.py):
detected / harmless / older-commit / SILENT / RAW. SILENT and RAW must be 0.

Usage::

    python benchmarks/mutation_sweep.py [--flips 24] [--seeds 2] [--backends memmap hdf5]

It prints one table per backend and writes ``benchmarks/out/mutation_sweep.json``. Timings are
not its point (they depend on the machine's load).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from _mutation import OUTCOMES, Tally, build_store, sweep  # noqa: E402

from tiered.atari import cached_rollout  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flips", type=int, default=24, help="flipped-bit cases per file (x3 for segments)")
    ap.add_argument("--seeds", type=int, default=2, help="sweeps with different random positions")
    ap.add_argument("--backends", nargs="+", default=["memmap", "hdf5"])
    args = ap.parse_args(argv)
    rows = cached_rollout(game="Pong", steps=2000, seed=0, max_episode_steps=500)[:100].clone()
    out: dict[str, dict] = {}
    failures = 0
    for backend in args.backends:
        total = Tally()
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            store = build_store(Path(d) / "s", backend, rows)
            for seed in range(args.seeds):
                t = sweep(store, flips=args.flips, seed=seed, thorough=True)
                total.counts.update(t.counts)
                total.unnamed.update(t.unnamed)
                total.failures += t.failures
                total.cases += t.cases
        print(f"\n{backend}: {total.cases} cases in {time.perf_counter() - t0:.0f} s (flips {args.flips}, "
              f"seeds {args.seeds})")
        print(total.table())
        for f in total.failures[:20]:
            print("  " + f[:500])
        failures += len(total.failures)
        out[backend] = {"cases": total.cases, "unnamed": dict(total.unnamed), "failures": total.failures,
                        "counts": {f"{k}|{o}": v for (k, o), v in sorted(total.counts.items())},
                        "by_outcome": {o: sum(v for (_, oc), v in total.counts.items() if oc == o)
                                       for o in OUTCOMES}}
    (REPO / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (REPO / "benchmarks" / "out" / "mutation_sweep.json").write_text(json.dumps(out, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
