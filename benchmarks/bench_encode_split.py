"""Whether a small batched encode should be split over two threads: ``ZstdCodec.encode`` of K=8
chunks of real Atari frames with ``threads=1`` (the calling thread does it all) against
``threads=2`` (half handed to tiered's pool thread), alternating, wall time.

Run: ``python benchmarks/bench_encode_split.py [--reps 400] [--chunks 2 4 9 16 32 64]``

Data: the committed real Atari rows (``benchmarks/data/atari_frames.npz``), the newest 84x84 frame
of each row, cut into chunks of 8 consecutive frames, as a write-stage flush (64 rows: ~9 chunks)
or a 256-row write (~32) closes them. Prints the median and 25th percentile per encode in
microseconds; the write path's ``ENCODE_SPLIT_BYTES`` is set from it. Wall time on a shared
machine is noisy: compare the two columns of one run, not runs.

Not part of CI; prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIXTURE = Path(__file__).resolve().parent / "data" / "atari_frames.npz"
K = 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 9, 16, 32, 64])
    args = p.parse_args(argv)
    from tiered.atari import load_fixture
    from tiered.codecs import ZstdCodec
    from tiered.util.batch import exclusive_cumsum

    obs = load_fixture(FIXTURE)["observation"].numpy()
    frames = np.ascontiguousarray(obs[:, -1]).reshape(obs.shape[0], -1)
    codecs = {1: ZstdCodec(threads=1), 2: ZstdCodec(threads=2)}
    print(f"{'chunks':>6} {'raw MB':>7} {'1 thread us':>12} {'(p25)':>7} {'2 threads us':>13} {'(p25)':>7}")
    for n in args.chunks:
        take = np.arange(n * K) % frames.shape[0]
        raw = np.ascontiguousarray(frames[take]).reshape(-1)
        sizes = np.full(n, K * frames.shape[1], dtype=np.int64)
        offsets = exclusive_cumsum(sizes)
        times: dict[int, list[float]] = {1: [], 2: []}
        for i in range(args.reps):
            for t in ((1, 2) if i % 2 else (2, 1)):
                t0 = time.perf_counter()
                codecs[t].encode(raw, offsets, sizes)
                times[t].append(time.perf_counter() - t0)
        med = {t: np.median(v) * 1e6 for t, v in times.items()}
        p25 = {t: np.percentile(v, 25) * 1e6 for t, v in times.items()}
        print(f"{n:6d} {raw.nbytes / 1e6:7.2f} {med[1]:12.0f} {p25[1]:7.0f} {med[2]:13.0f} {p25[2]:7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
