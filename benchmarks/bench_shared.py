"""What several writer processes cost: one TieredStorage written by two processes taking turns.

Run: ``python benchmarks/bench_shared.py [--rows 2000 20000] [--batch 64] [--repeats 20]``

For each size, a path ``TieredStorage`` (``frames={"observation": 0}``) holding that many real
Atari transitions (a Pong rollout from ``tiered.atari.cached_rollout``, tiled) is extended by
``--batch`` rows at a time through ``TensorDictReplayBuffer(...).share()``:

- ``one process``: the owner alone, before any other process exists (no lock, no commit per call);
- ``shared, alone``: the same after ``storage.store.share()``: the writer lock and a commit per
  extend, but no other process commits in between (nothing to reload);
- ``shared, taking turns``: a forked child and the parent extend in turn (pipes order them), so
  every extend first reloads the other process's commit, then writes and commits;
- ``reload``: ``len(rb)`` in the parent right after the child's commit (lock, reload, release).

The anchor is ``LazyMemmapStorage`` extended the same way (one process; its rows are shared
memory maps, so other processes pay nothing more). Times are medians over ``--repeats`` calls.
Results go to ``benchmarks/out/bench_shared.json``. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer  # noqa: E402

from benchmarks._harness import OUT_DIR, markdown_table  # noqa: E402
from tiered.atari import cached_rollout  # noqa: E402
from tiered.torchrl import TieredStorage  # noqa: E402


def _data(rows: int) -> TensorDict:
    base = cached_rollout("Pong", steps=2000)
    reps = -(-rows // base.shape[0])
    return torch.cat([base] * reps)[:rows].clone()


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def _timed_extends(rb, batches: list[TensorDict]) -> list[float]:
    out = []
    for b in batches:
        t = time.perf_counter()
        rb.extend(b)
        out.append(time.perf_counter() - t)
    return out


def _taking_turns(rb, batches: list[TensorDict]) -> tuple[list[float], list[float]]:
    """Parent and a forked child extend in turn; the parent's extend times and its reload times."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(to_parent_r)  # the child: wait for a turn, extend, hand the turn back
        code = 0
        try:
            for b in batches:
                os.read(to_child_r, 1)
                rb.extend(b)
                os.write(to_parent_w, b"x")
        except BaseException:  # noqa: BLE001 - report through the exit code
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(to_parent_w)
    extend, reload = [], []
    for b in batches:
        os.write(to_child_w, b"x")
        if not os.read(to_parent_r, 1):  # the child has committed (or died: nothing to read)
            break
        t = time.perf_counter()
        len(rb)  # the parent's next call reloads the child's commit
        reload.append(time.perf_counter() - t)
        os.write(to_child_w, b"x")
        if not os.read(to_parent_r, 1):
            break
        t = time.perf_counter()
        rb.extend(b)  # reload, write, commit
        extend.append(time.perf_counter() - t)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"the child writer failed (status {status})")
    return extend, reload


def run(rows: int, batch: int, repeats: int, workdir: str) -> dict:
    data = _data(rows + 4 * batch * repeats)
    fill, rest = data[:rows], data[rows:]
    batches = [rest[i * batch:(i + 1) * batch] for i in range(repeats)]
    out = {"rows": rows, "batch": batch}
    cap = rows + 4 * batch * repeats

    mm = TensorDictReplayBuffer(storage=LazyMemmapStorage(cap, scratch_dir=os.path.join(workdir, f"mm{rows}"))).share()
    mm.extend(fill)
    out["LazyMemmapStorage"] = _median_ms(_timed_extends(mm, batches))

    storage = TieredStorage(cap, os.path.join(workdir, f"t{rows}"), frames={"observation": 0})
    rb = TensorDictReplayBuffer(storage=storage).share()
    for i in range(0, rows, 1000):
        rb.extend(fill[i:i + 1000])
    out["one process"] = _median_ms(_timed_extends(rb, batches))
    storage.store.share()
    out["shared, alone"] = _median_ms(_timed_extends(rb, batches))
    extend, reload = _taking_turns(rb, batches[: max(2, repeats // 2)])
    out["shared, taking turns"] = _median_ms(extend)
    out["reload"] = _median_ms(reload)
    storage.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for rows in args.rows:
            results.append(run(rows, args.batch, args.repeats, workdir))
    cols = ["LazyMemmapStorage", "one process", "shared, alone", "shared, taking turns", "reload"]
    table = [[f"{r['rows']:,}"] + [f"{r[c]:.1f} ms ({r[c] / r['LazyMemmapStorage']:.1f}x)" for c in cols]
             for r in results]
    print(f"extend of {args.batch} rows (median; ratio to LazyMemmapStorage)")
    print(markdown_table(["rows stored", *cols], table))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "bench_shared.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
