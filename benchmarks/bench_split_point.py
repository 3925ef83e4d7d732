"""Where a store's read should split its time-chunk decode: ``rb.sample()`` at a few batch sizes
with :data:`tiered.codecs.checked.MIN_CHUNK_SPLIT_BYTES` at two values, against LazyTensorStorage.

Run: ``python benchmarks/bench_split_point.py [--low 2] [--high 8] [--batches 32 64 128] [--rounds 3]``

Data: real Atari stacks with next observations (``_harness.load_atari``, Pong and MsPacman, 4,000
transitions), one ``TensorDictReplayBuffer`` over ``TieredStorage`` (no options) and one over
``LazyTensorStorage``, torch at 2 threads. Per batch size and round, LazyTensorStorage, then tiered
with the split point at ``--high`` MiB, then at ``--low`` MiB (the constant is read per call, so one
store serves both): 5 warm-up samples and the median of 150. Prints each round's medians (us per
sample) and the ratio of LazyTensorStorage's best round to each setting's best. Not part of CI.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import torch  # noqa: E402


def _median_us(fn, calls: int = 150) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return H.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--low", type=float, default=2.0, help="split point in MiB")
    p.add_argument("--high", type=float, default=8.0, help="split point in MiB")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

    import tiered.codecs.checked as checked
    from tiered.torchrl import TieredStorage

    print(H.describe_load(H.load_snapshot()))
    data = H.load_atari(["Pong", "MsPacman"], 4000, 2000)
    n = data.batch_size[0]
    storages = {"lts": LazyTensorStorage(n), "tiered": TieredStorage(n)}
    for s in storages.values():
        TensorDictReplayBuffer(storage=s).extend(data)
    settings = [("lts", None), (f"{args.high:g} MiB", int(args.high * (1 << 20))),
                (f"{args.low:g} MiB", int(args.low * (1 << 20)))]
    saved = checked.MIN_CHUNK_SPLIT_BYTES
    try:
        for b in args.batches:
            rbs = {k: TensorDictReplayBuffer(storage=s, sampler=RandomSampler(), batch_size=b)
                   for k, s in storages.items()}
            res: dict[str, list[float]] = {name: [] for name, _ in settings}
            for _ in range(args.rounds):
                for name, point in settings:
                    if point is not None:
                        checked.MIN_CHUNK_SPLIT_BYTES = point
                    res[name].append(_median_us(rbs["lts" if point is None else "tiered"].sample))
            lts = min(res["lts"])
            cols = [f"{name} {' / '.join(f'{x:.0f}' for x in v)} us ({lts / min(v):.2f}x)" for name, v in res.items()]
            print(f"B={b}: " + " | ".join(cols), flush=True)
    finally:
        checked.MIN_CHUNK_SPLIT_BYTES = saved
    print(H.describe_load(H.load_snapshot()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
