"""The stateful model test of ``tests/durable/test_stateful.py``, run for minutes with random seeds.

Each round runs one store kind's state machine (in-memory, memmap, HDF5, in turn) under a fresh
random seed; a failure is printed with its seed and hypothesis's shrunk steps, and the run goes on.
At the end it prints the examples, steps and failures per kind.

Run: ``nice python benchmarks/stateful_long.py --minutes 3 [--examples 20] [--steps 50]``
Reproduce a failure: ``python benchmarks/stateful_long.py --seed SEED --kind KIND --rounds 1``
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the machine and its helpers live with the tests

from _store_model import MACHINES, RUN_COUNTS, frame_pool  # noqa: E402
from hypothesis import HealthCheck, seed, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402


def run_round(kind: str, round_seed: int, examples: int, steps: int) -> str | None:
    """One machine run; the failure's text, or None."""
    factory = seed(round_seed)(lambda: MACHINES[kind]())
    try:
        run_state_machine_as_test(factory, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    except Exception:  # noqa: BLE001 - every failure is reported and the run goes on
        return traceback.format_exc()
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="stop starting rounds after this long")
    ap.add_argument("--examples", type=int, default=20, help="examples per round")
    ap.add_argument("--steps", type=int, default=50, help="steps per example (at most)")
    ap.add_argument("--kind", choices=list(MACHINES), action="append", help="store kinds (default: all)")
    ap.add_argument("--seed", type=int, default=None, help="first round's seed (default: random)")
    ap.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    args = ap.parse_args(argv)
    kinds = args.kind or list(MACHINES)
    frame_pool()  # load the frames before the clock starts
    rng = random.Random()
    start = time.monotonic()
    per_kind: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in kinds}
    failures: list[tuple[str, int]] = []
    rounds = 0
    while time.monotonic() - start < args.minutes * 60 and (args.rounds is None or rounds < args.rounds):
        kind = kinds[rounds % len(kinds)]
        round_seed = args.seed + rounds if args.seed is not None else rng.getrandbits(32)
        before = RUN_COUNTS.copy()
        error = run_round(kind, round_seed, args.examples, args.steps)
        ran = RUN_COUNTS - before
        per_kind[kind].update(examples=ran["examples"], steps=ran["steps"], rounds=1, failures=int(error is not None))
        rounds += 1
        if error is not None:
            failures.append((kind, round_seed))
            print(f"FAILURE kind={kind} seed={round_seed}\n{error}", flush=True)
        print(f"[{time.monotonic() - start:6.0f} s] round {rounds}: {kind} seed {round_seed}: "
              f"{ran['examples']} examples, {ran['steps']} steps, {'FAILED' if error else 'ok'}", flush=True)
    elapsed = time.monotonic() - start
    print(f"\n{'kind':8} {'rounds':>7} {'examples':>9} {'steps':>8} {'failures':>9}")
    for kind, c in per_kind.items():
        print(f"{kind:8} {c['rounds']:7d} {c['examples']:9d} {c['steps']:8d} {c['failures']:9d}")
    total = sum((c for c in per_kind.values()), collections.Counter())
    print(f"{'all':8} {total['rounds']:7d} {total['examples']:9d} {total['steps']:8d} {total['failures']:9d}"
          f"   in {elapsed:.0f} s")
    print("per rule:", ", ".join(f"{k} {v}" for k, v in sorted(RUN_COUNTS.items()) if k not in ("steps", "examples")))
    for kind, s in failures:
        print(f"reproduce: python benchmarks/stateful_long.py --kind {kind} --seed {s} --rounds 1")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
