"""What opening a large store costs: ``tiered.open`` of a 1M-row store, three times.

Opening maps every array of the last commit, checks its page checksums (where the commit
records them), and runs the vectorized consistency checks of docs/format.md ("Damage"). This
builds (once, under ``benchmarks/out/open_cost_store``) a store of ``--rows`` rows: dense action,
reward and done, and a 4-frame observation stack of 16x16 frames (one new frame per row, shared
with its neighbours), then times three opens. The numbers depend on the machine and its load.

Usage::

    python benchmarks/open_cost.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tiered  # noqa: E402
from tiered import TieredStore  # noqa: E402


def build(path: Path, n: int, batch: int = 100_000) -> None:
    store = TieredStore(n, path, frames={"observation": 0}, chunk_frames=4, warm_bytes=0, hot_bytes=0)
    frames = torch.randint(0, 255, (n + 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for lo in range(0, n, batch):
        idx = torch.arange(lo, min(n, lo + batch))
        obs = torch.stack([frames[idx + k] for k in range(4)], 1)
        store.extend(TensorDict({"observation": obs, "action": idx, "reward": idx.float().unsqueeze(1),
                                 "done": torch.zeros(idx.numel(), 1, dtype=torch.bool)}, [idx.numel()]))
    store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    path = REPO / "benchmarks" / "out" / f"open_cost_store_{args.rows}"
    if not (path / "manifest.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        build(path, args.rows)
    arrays = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs if f.endswith(".npy"))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        tiered.open(path).close()
        times.append(time.perf_counter() - t)
    print(f"{args.rows} rows, {arrays / 1e6:.0f} MB of arrays: open {', '.join(f'{x:.2f}' for x in times)} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
