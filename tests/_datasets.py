"""Real datasets in every import format, built in the tests from real rollouts.

* vector observations: a gymnasium CartPole-v1 rollout (seeded random policy);
* frames: the Atari Pong rollout of ``tests/conftest.py`` (ale-py), 4x84x84 uint8 stacks;
* minari: written by the ``minari`` package itself (``DataCollector`` +
  ``create_dataset``), offline, into ``MINARI_DATASETS_PATH`` set to a temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import torch
from tensordict import TensorDict


def cartpole_rollout(steps: int = 3000, seed: int = 0) -> dict[str, np.ndarray]:
    """A CartPole-v1 rollout, D4RL-style flat arrays (episodes end by termination or time limit)."""
    import gymnasium as gym

    env = gym.make("CartPole-v1", max_episode_steps=200)
    rng = np.random.default_rng(seed)
    obs, nxt, acts, rews, terms, truncs = [], [], [], [], [], []
    o, _ = env.reset(seed=seed)
    for _ in range(steps):
        a = int(rng.integers(2))
        o2, r, te, tr, _ = env.step(a)
        obs.append(o)
        nxt.append(o2)
        acts.append(a)
        rews.append(r)
        terms.append(te)
        truncs.append(tr)
        o = o2
        if te or tr:
            o, _ = env.reset()
    env.close()
    return {
        "observations": np.array(obs, np.float32),
        "next_observations": np.array(nxt, np.float32),
        "actions": np.array(acts, np.int64),
        "rewards": np.array(rews, np.float32),
        "terminals": np.array(terms, bool),
        "timeouts": np.array(truncs, bool),
    }


def write_d4rl(
    path: Path,
    arrays: dict[str, np.ndarray],
    *,
    infos: dict[str, np.ndarray] | None = None,
    metadata: bool = True,
) -> Path:
    """An HDF5 file in D4RL's layout (what ``d4rl``'s ``get_dataset()`` files hold)."""
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f[k] = v
        for k, v in (infos or {}).items():
            f[f"infos/{k}"] = v
        if metadata:
            f["metadata/algorithm"] = "random"
            f["metadata/policy/fc0/weight"] = np.arange(12, dtype=np.float32).reshape(3, 4)
            f.attrs["env_name"] = "CartPole-v1"
    return path


def pong_d4rl_arrays(td: TensorDict, next_obs: bool = False) -> dict[str, np.ndarray]:
    """The Atari rollout in D4RL names (frames as [N, 4, 84, 84] uint8 stacks)."""
    out = {
        "observations": td["observation"].numpy(),
        "actions": td["action"].numpy(),
        "rewards": td["next", "reward"].reshape(-1).numpy(),
        "terminals": td["next", "terminated"].reshape(-1).numpy(),
        "timeouts": td["next", "truncated"].reshape(-1).numpy(),
    }
    if next_obs:
        out["next_observations"] = td["next", "observation"].numpy()
    return out


def minari_dataset(
    root: Path,
    env_id: str = "CartPole-v1",
    episodes: int = 12,
    seed: int = 0,
    record_infos: bool = True,
    dataset_id: str = "test/cartpole-v0",
    **make_kwargs,
) -> Path:
    """A minari dataset made by minari's own DataCollector; returns its directory."""
    import gymnasium as gym

    os.environ["MINARI_DATASETS_PATH"] = str(root)
    import minari
    from minari import DataCollector

    if env_id.startswith("ALE/"):
        import ale_py

        gym.register_envs(ale_py)
    env = DataCollector(gym.make(env_id, **make_kwargs), record_infos=record_infos)
    env.action_space.seed(seed)
    for ep in range(episodes):
        env.reset(seed=seed + ep)
        done = False
        while not done:
            _, _, te, tr, _ = env.step(env.action_space.sample())
            done = te or tr
    env.create_dataset(
        dataset_id=dataset_id,
        algorithm_name="random",
        author="tiered tests",
        author_email="tests@example.com",
        code_permalink="https://example.com/tiered",
        description="random policy rollouts for tiered's tests",
        eval_env=env_id,
    )
    env.close()
    namespace, name = dataset_id.rsplit("/", 1)
    path = root / namespace / name
    assert (path / "data" / "main_data.hdf5").is_file(), list(root.rglob("*"))
    del minari
    return path


def h5_datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of an HDF5 file, by path."""
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
    return out


def assert_arrays_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, bytes) or isinstance(y, bytes):
            assert x == y, k
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(x, y), f"{k} differs"


def td_leaves(td: TensorDict) -> dict[tuple[str, ...], torch.Tensor]:
    return {(k,) if isinstance(k, str) else tuple(k): td.get(k) for k in td.keys(True, True)}
