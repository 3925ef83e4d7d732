"""TorchRL's DQN Atari example (``sota-implementations/dqn``) with its replay buffer on TieredStorage.

Run: ``python examples/torchrl_dqn_atari.py [--frames 16000] [--init-random-frames 3200]``
(``--help`` for the rest). It runs on the CPU; ``--device cuda`` trains on a GPU.

The loop, its environment transforms, network, loss, optimizer, configuration values and
timers ("collecting", "rb - extend", "rb - sample", "update") are those of TorchRL's
``dqn_atari.py`` / ``utils_atari.py`` / ``config_atari.yaml``, with four changes (the recipe,
docs/torchrl-pipelines.md):

1. the frames stay uint8: ``ToTensorImage(from_int=False, dtype=torch.uint8)`` instead of
   ``ToTensorImage()`` (which divides by 255 into float32);
2. ``VecNorm(in_keys=["pixels"])`` is dropped: normalized after ``CatFrames``, the same frame has
   different float values in consecutive stacks, so no stack can share frames with its neighbour;
3. the Q-network starts with :class:`ScaleFrames` (``x / 255``), since the collector's policy
   sees the same uint8 pixels as the loss (a transform on sampled batches alone would not do);
4. the buffer gets what the loss reads: the collector's ``action_value`` and
   ``chosen_action_value`` (the exploring policy's Q-values, recomputed by ``DQNLoss``; float32,
   28 bytes per transition at Pong's 6 actions, more than the frames take) are left out.

and the storage: ``TieredStorage(buffer_size)`` instead of ``LazyMemmapStorage(buffer_size)``.
``--as-shipped`` runs TorchRL's float pipeline unchanged (float32 stacks, VecNorm) on
TieredStorage, to see the difference (and the :class:`~tiered.errors.LowCompressionWarning`).
At the end it prints TorchRL's timers and what the buffer holds per transition
(``stats()["bytes_per_row"]``, with ``resident_bytes``).

Needs TorchRL, ale-py and torchvision (``Resize``): ``pip install 'tiered[pipelines]'``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn

try:
    import ale_py
    import gymnasium
    from tensordict.nn import TensorDictSequential
    from torchrl._utils import timeit
    from torchrl.collectors import Collector
    from torchrl.data import Composite, TensorDictReplayBuffer
    from torchrl.envs import (
        CatFrames,
        DoubleToFloat,
        EndOfLifeTransform,
        GrayScale,
        GymEnv,
        NoopResetEnv,
        Resize,
        RewardSum,
        SignTransform,
        StepCounter,
        ToTensorImage,
        TransformedEnv,
        VecNorm,
        set_gym_backend,
    )
    from torchrl.modules import MLP, ConvNet, EGreedyModule, QValueActor
    from torchrl.objectives import DQNLoss, HardUpdate
except ImportError as e:  # pragma: no cover - the example is about TorchRL's pipeline
    raise SystemExit(f"this example needs TorchRL, ale-py and torchvision: pip install 'tiered[pipelines]' ({e})") from e

from tiered.torchrl import TieredStorage

gymnasium.register_envs(ale_py)

#: TorchRL's config_atari.yaml, the values this loop uses.
CONFIG = {
    "env_name": "ALE/Pong-v5", "frame_skip": 4, "frames_per_batch": 1600, "eps_start": 1.0, "eps_end": 0.01,
    "annealing_frames": 4_000_000, "init_random_frames": 200_000, "buffer_size": 1_000_000, "batch_size": 32,
    "lr": 2.5e-4, "max_grad_norm": 10, "gamma": 0.99, "hard_update_freq": 10_000, "num_updates": 100,
}


class ScaleFrames(torch.nn.Module):
    """uint8 pixels to floats in [0, 1]: the first layer of the Q-network (Nature DQN's scaling)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().div(255)


def make_env(env_name: str = CONFIG["env_name"], frame_skip: int = CONFIG["frame_skip"], device: str = "cpu",
             uint8: bool = True, is_test: bool = False) -> TransformedEnv:
    """TorchRL's ``utils_atari.make_env``; ``uint8=True`` keeps the frames uint8 and drops VecNorm."""
    with set_gym_backend("gymnasium"):
        env = GymEnv(env_name, frame_skip=frame_skip, from_pixels=True, pixels_only=False, device=device,
                     categorical_action_encoding=True)
    env = TransformedEnv(env)
    env.append_transform(NoopResetEnv(noops=30, random=True))
    if not is_test:
        env.append_transform(EndOfLifeTransform())
        env.append_transform(SignTransform(in_keys=["reward"]))
    # the recipe, 1 of 4: frames stay uint8 (ToTensorImage() would divide by 255 into float32)
    env.append_transform(ToTensorImage(from_int=False, dtype=torch.uint8) if uint8 else ToTensorImage())
    env.append_transform(GrayScale())
    env.append_transform(Resize(84, 84))
    env.append_transform(CatFrames(N=4, dim=-3))
    env.append_transform(RewardSum())
    env.append_transform(StepCounter(max_steps=4500))
    env.append_transform(DoubleToFloat())
    if not uint8:
        # the recipe, 2 of 4: no VecNorm (its running statistics make every stack's floats unique)
        env.append_transform(VecNorm(in_keys=["pixels"]))
    return env


#: what TorchRL's QValueActor adds to each transition, which DQNLoss never reads back
Q_VALUE_KEYS = ("action_value", "chosen_action_value")


def make_dqn_model(env: TransformedEnv, device: str = "cpu", uint8: bool = True) -> QValueActor:
    """TorchRL's Nature-CNN Q-network (``make_dqn_modules_pixels``); with ``uint8``, :class:`ScaleFrames` first."""
    input_shape = env.observation_spec["pixels"].shape
    action_spec = env.specs["input_spec", "full_action_spec", "action"]
    cnn = ConvNet(activation_class=torch.nn.ReLU, num_cells=[32, 64, 64], kernel_sizes=[8, 4, 3],
                  strides=[4, 2, 1], device=device)
    # the recipe, 3 of 4: the network scales the frames (the collector's policy sees uint8 pixels too)
    layers = [ScaleFrames()] if uint8 else []
    probe = torch.ones(input_shape, device=device, dtype=torch.uint8 if uint8 else torch.float32)
    cnn_out = torch.nn.Sequential(*layers, cnn)(probe)
    mlp = MLP(in_features=cnn_out.shape[-1], activation_class=torch.nn.ReLU, out_features=action_spec.space.n,
              num_cells=[512], device=device)
    return QValueActor(module=torch.nn.Sequential(*layers, cnn, mlp), spec=Composite(action=action_spec).to(device),
                       in_keys=["pixels"])


def make_update(model: QValueActor, device: str = "cpu") -> tuple[Callable[[Any], torch.Tensor], EGreedyModule]:
    """TorchRL's loss, optimizer and target update: returns ``update(batch) -> loss`` and the
    exploration module (built on ``model``'s spec)."""
    loss_module = DQNLoss(value_network=model, loss_function="l2", delay_value=True)
    loss_module.set_keys(done="end-of-life", terminated="end-of-life")
    loss_module.make_value_estimator(gamma=CONFIG["gamma"], device=device)
    target_net_updater = HardUpdate(loss_module, value_network_update_interval=CONFIG["hard_update_freq"])
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=CONFIG["lr"])
    params = list(loss_module.parameters())

    def update(sampled):
        loss = loss_module(sampled)["loss"]
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm=CONFIG["max_grad_norm"])
        optimizer.step()
        target_net_updater.step()
        return loss.detach()

    greedy = EGreedyModule(annealing_num_steps=CONFIG["annealing_frames"], eps_init=CONFIG["eps_start"],
                           eps_end=CONFIG["eps_end"], spec=model.spec, device=device)
    return update, greedy


def bytes_per_transition(storage: TieredStorage) -> tuple[float, int]:
    """``(bytes per row at the current length, resident bytes)`` from the store's ``stats()``."""
    s = storage.stats()
    return s["bytes_per_row"], s["resident_bytes"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=16_000, help="env frames in all (TorchRL counts frames before frame skip)")
    p.add_argument("--init-random-frames", type=int, default=3_200,
                   help=f"frames collected before the first update (TorchRL's: {CONFIG['init_random_frames']:,})")
    p.add_argument("--buffer-size", type=int, default=CONFIG["buffer_size"])
    p.add_argument("--num-updates", type=int, default=CONFIG["num_updates"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="tiered's decode threads (default: its own choice)")
    p.add_argument("--as-shipped", action="store_true", help="TorchRL's float pipeline (VecNorm) on TieredStorage")
    args = p.parse_args(argv)
    uint8, device, frame_skip = not args.as_shipped, args.device, CONFIG["frame_skip"]

    # TorchRL counts frames before the frame skip
    total_frames = args.frames // frame_skip
    frames_per_batch = CONFIG["frames_per_batch"] // frame_skip
    init_random_frames = args.init_random_frames // frame_skip

    proof = make_env(device=device, uint8=uint8)
    model = make_dqn_model(proof, device, uint8)
    proof.close()
    update, greedy = make_update(model, device)
    model_explore = TensorDictSequential(model, greedy)

    storage = TieredStorage(args.buffer_size, threads=args.threads)
    replay_buffer = TensorDictReplayBuffer(pin_memory=False, storage=storage, batch_size=CONFIG["batch_size"])
    replay_buffer.append_transform(lambda td: td.to(device))

    collector = Collector(create_env_fn=make_env(device=device, uint8=uint8), policy=model_explore,
                          frames_per_batch=frames_per_batch, total_frames=total_frames, device=device,
                          storing_device=device, max_frames_per_traj=-1, init_random_frames=init_random_frames)
    collected_frames = 0
    timeit.erase()
    c_iter = iter(collector)
    for _ in range(len(collector)):
        with timeit("collecting"):
            data = next(c_iter)
        data = data.reshape(-1)
        current_frames = data.numel() * frame_skip
        collected_frames += current_frames
        greedy.step(current_frames)
        with timeit("rb - extend"):
            # the recipe, 4 of 4: DQNLoss recomputes the Q-values; storing the policy's would cost
            # more per transition than the frames
            replay_buffer.extend(data.exclude(*Q_VALUE_KEYS) if uint8 else data)
        if collected_frames < args.init_random_frames:
            continue
        for _ in range(args.num_updates):
            with timeit("rb - sample"):
                sampled = replay_buffer.sample()
            with timeit("update"):
                update(sampled)
        collector.update_policy_weights_()
    collector.shutdown()

    timeit.print()
    per_row, resident = bytes_per_transition(storage)
    pixels = storage.stats()["fields"]["pixels"]
    print(f"buffer: {len(replay_buffer):,} transitions, {per_row:,.0f} bytes per transition "
          f"({resident:,} bytes resident; pixels {pixels['logical_bytes'] / max(pixels['stored_bytes'], 1):,.0f}x smaller "
          f"than their {pixels['logical_bytes'] // max(len(replay_buffer), 1):,} bytes per row)")
    # a short run holds few rows in a buffer sized for many: the row tables and dense columns
    # are sized by the capacity, the blobs grow with the rows (their index too, by a few bytes a
    # row that a short run's minimum allocation hides)
    s, n = storage.stats(), max(len(replay_buffer), 1)
    full = s["resident"]["tiers"] / n * args.buffer_size + s["memory"]["row_tables"] + s["memory"]["dense"]
    print(f"a full {args.buffer_size:,}-transition buffer: about {full / 2**30:,.2f} GiB (blobs scaled from "
          "this run's frames, plus the capacity-sized row tables and dense columns; "
          "benchmarks/bench_torchrl_dqn.py measures it at 100,000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
