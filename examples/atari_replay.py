"""Real ALE Pong frames in a TorchRL replay buffer: TieredStorage beside LazyTensorStorage.

Run: ``python examples/atari_replay.py [--steps 5000] [--batch 256]``

It plays Pong with a random policy (ale-py ships the ROM; the rollout is cached), fills two
``TensorDictReplayBuffer``s with the transitions (4x84x84 stacks with next observations), one on
``tiered.torchrl.TieredStorage`` and one on TorchRL's uncompressed ``LazyTensorStorage``, draws the
same random batches from both (same seeds), checks that they are bit-identical, and prints bytes
held, extend and sample speed side by side.

Needs TorchRL: ``pip install 'tiered[torchrl,atari]'``.
"""

from __future__ import annotations

import argparse
import time

import torch

from tiered.atari import cached_rollout

try:
    from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage
except ImportError as e:  # pragma: no cover - the example is about TorchRL
    raise SystemExit(f"this example needs TorchRL: pip install 'tiered[torchrl]' ({e})") from e


def make_rb(storage, batch: int) -> TensorDictReplayBuffer:
    # the same generator seed on both buffers: they draw the same indices
    return TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=batch,
                                  generator=torch.Generator().manual_seed(0))


def fill(rb: TensorDictReplayBuffer, data, steps: int) -> float:
    """Extend in collector-sized chunks; return transitions per second."""
    t0 = time.perf_counter()
    for i in range(0, steps, 256):
        rb.extend(data[i:i + 256])
    if isinstance(rb.storage, TieredStorage):
        rb.storage.flush()  # compress the frames still held open for their time chunk
    return steps / (time.perf_counter() - t0)


def bench(rb: TensorDictReplayBuffer, rounds: int, batch: int) -> float:
    """Transitions per second through rb.sample()."""
    rb.sample()  # warm-up: scratch buffers, promotion into the warm tier
    t = time.perf_counter()
    for _ in range(rounds):
        rb.sample()
    return rounds * batch / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=50)
    args = p.parse_args()

    print(f"playing {args.steps} steps of ALE Pong (cached after the first run)...")
    data = cached_rollout("Pong", steps=args.steps, seed=0)

    tiered_rb = make_rb(TieredStorage(args.steps, frames={"observation": 0}), args.batch)
    lazy_rb = make_rb(LazyTensorStorage(args.steps), args.batch)
    ext = {"tiered": fill(tiered_rb, data, args.steps), "lazy": fill(lazy_rb, data, args.steps)}

    a, b = tiered_rb.sample(), lazy_rb.sample()  # the generators are in step: same indices
    same = all(torch.equal(a.get(k), b.get(k)) for k in b.keys(True, True))
    print(f"bit-identical samples: {same}")

    st = tiered_rb.storage.stats()
    tiered_bytes = sum(t["bytes_used"] for t in st["tiers"].values()) + sum(st["memory"].values())
    lazy_bytes = sum(v.numel() * v.element_size() for v in lazy_rb.storage._storage.values(True, True))
    rows = [
        ("TieredStorage", tiered_bytes, ext["tiered"], bench(tiered_rb, args.rounds, args.batch)),
        ("LazyTensorStorage", lazy_bytes, ext["lazy"], bench(lazy_rb, args.rounds, args.batch)),
    ]

    print(f"\n{'storage':<20}{'bytes held':>14}{'per transition':>16}{'extend/s':>12}{'sample/s':>12}")
    for name, nbytes, extend_rate, sample_rate in rows:
        print(f"{name:<20}{nbytes / 2**20:>11.1f} MiB{nbytes / args.steps:>14.0f} B"
              f"{extend_rate:>12.0f}{sample_rate:>12.0f}")
    print(f"\nTieredStorage holds {rows[1][1] / rows[0][1]:.0f}x less memory and samples at "
          f"{rows[0][3] / rows[1][3]:.2f}x the speed of LazyTensorStorage (TensorDictReplayBuffer, "
          f"batch {args.batch}).")


if __name__ == "__main__":
    main()
