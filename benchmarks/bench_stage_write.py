"""Small writes through TorchRL with a stage flush's encode on the calling thread or split over the
pool, side by side in one process, against LazyTensorStorage.

Run: ``python benchmarks/bench_stage_write.py [--threads 2] [--blocks 16] [--between-samples 0]
[--stage-rows 64 128]``

On real Atari stacks with next observations (the rows ``profile_calls.py`` uses), a
``TensorDictReplayBuffer`` over ``TieredStorage`` is written with ``rb.extend`` of 16 rows and
``rb.add`` of one row, in blocks of four whole stage cycles (256 rows), the settings rotating from
block to block (the machine's drift hits each alike), ``LazyTensorStorage`` in the same rotation.
Settings (``tiered.engine.write.ENCODE_SPLIT_BYTES``): ``encode-1`` (4 MiB, the default: a
flush's ~0.5 MB encode on the calling thread) or ``encode-split`` (0: split over ``--threads``
pool threads, as before); with ``--stage-rows K ...``, also a ``TieredStorage`` per stage size
``K`` (``stage_rows=K``, encode-1), written with the same rows.

``--between-samples N``: ``rb.sample()`` of 256 rows N times after each write (a training loop's
reads between writes); only the writes are timed. Prints the median over blocks of wall and
calling-thread CPU microseconds per call, and the ratio to LazyTensorStorage (wall). Wall time on
a shared machine is noisy: compare within one run.

Not part of CI; prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {"encode-split": 0, "encode-1": 4 << 20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads and the store's codec threads")
    p.add_argument("--blocks", type=int, default=16, help="timed blocks per setting (2 more warm up)")
    p.add_argument("--between-samples", type=int, default=0)
    p.add_argument("--ops", nargs="+", default=["rb.extend16", "rb.add1"])
    p.add_argument("--stage-rows", nargs="*", type=int, default=[],
                   help="also a TieredStorage(N, stage_rows=K) per K (encode-1), in the same rotation")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    import profile_calls as P

    import tiered.engine.write as W

    data = P.H.load_atari(["Pong", "MsPacman"], 4000, 2000)
    n = data.batch_size[0]
    store, ts, lts, rbs = P.build(n, data)
    table, state = P.ops(store, ts, lts, rbs, data, n)
    runs = {**{k: ("tiered", v) for k, v in SETTINGS.items()}, "LazyTensorStorage": ("lts", None)}
    from torchrl.data import RandomSampler, TensorDictReplayBuffer

    from tiered.store import DEFAULT_STAGE_ROWS
    from tiered.torchrl import TieredStorage

    add_rows = [data[i] for i in range(512)]
    ext_rows = [data[i:i + 16] for i in range(0, 4096 - 15, 16)]
    for k in args.stage_rows:  # one more storage per stage size, its writes on the same rows
        rb = TensorDictReplayBuffer(storage=TieredStorage(n, stage_rows=k), sampler=RandomSampler(), batch_size=256)
        rb.extend(data)
        table["rb.extend16"][f"stage-{k}"] = lambda rb=rb: rb.extend(ext_rows[state["row"] % len(ext_rows)])
        table["rb.add1"][f"stage-{k}"] = lambda rb=rb: rb.add(add_rows[state["row"] % len(add_rows)])
        table["rb.sample256"][f"stage-{k}"] = rb.sample
        runs[f"stage-{k} (encode-1)"] = (f"stage-{k}", SETTINGS["encode-1"])
    for op in args.ops:
        rows = 16 if "extend" in op else 1
        calls = 4 * max([DEFAULT_STAGE_ROWS, *args.stage_rows]) // rows  # four whole stage cycles
        samplers = {who: table["rb.sample256"][who] for who, _ in runs.values()}
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for b in range(args.blocks + 2):
            order = list(runs)
            order = order[b % len(order):] + order[:b % len(order)]
            for name in order:
                who, setting = runs[name]
                if setting is not None:
                    W.ENCODE_SPLIT_BYTES = setting
                fn, sample = table[op][who], samplers[who]
                w = c = 0.0
                for _ in range(calls):
                    state["row"] += 1
                    t0, c0 = time.perf_counter(), time.thread_time()
                    fn()
                    w, c = w + time.perf_counter() - t0, c + time.thread_time() - c0
                    for _ in range(args.between_samples):
                        sample()
                if b >= 2:
                    wall[name].append(w / calls * 1e6)
                    cpu[name].append(c / calls * 1e6)
        lts_wall = float(np.median(wall["LazyTensorStorage"]))
        print(f"### {op} ({args.threads} threads, {args.between_samples} samples of 256 between writes, "
              f"{args.blocks} blocks of {calls} calls)")
        print(f"{'setting':20} {'wall us':>8} {'cpu us':>8} {'vs LTS (wall)':>14}")
        for name in runs:
            mw, mc = float(np.median(wall[name])), float(np.median(cpu[name]))
            print(f"{name:20} {mw:8.0f} {mc:8.0f} {lts_wall / mw:13.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
