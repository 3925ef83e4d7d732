"""Real ALE Pong frames in a TorchRL replay buffer: TieredStorage beside LazyTensorStorage.

Run: ``python examples/atari_replay.py [--steps 5000] [--batch 256] [--rounds 50] [--no-memory]``

This is ``tiered demo``: one demo, whose code is :mod:`tiered.demo`. It plays Pong with a seeded
random policy (ale-py ships the ROM; the rollout is cached), fills two ``TensorDictReplayBuffer``s
with the same transitions (4x84x84 stacks with next stacks), one on
``tiered.torchrl.TieredStorage`` and one on TorchRL's uncompressed ``LazyTensorStorage``, checks
that the same indices give bit-identical samples, and prints bytes held, extend and sample rates
measured the way ``benchmarks/bench_storages.py`` measures them, in that benchmark's words (and
says what differs from the benchmark's run).

The swap it shows is one line::

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n), batch_size=256)
    rb = TensorDictReplayBuffer(storage=TieredStorage(n, frames={"observation": 0}), batch_size=256)

Needs TorchRL and ale-py: ``pip install 'tiered[torchrl,atari]'``.
"""

from __future__ import annotations

import sys

try:
    import torchrl  # noqa: F401
except ImportError as e:  # pragma: no cover - the example is about TorchRL
    raise SystemExit(f"this example needs TorchRL: pip install 'tiered[torchrl,atari]' ({e})") from e

from tiered.demo import main

if __name__ == "__main__":
    sys.exit(main())
