"""Real Atari frames for tests, the demo and benchmarks.

Replay-buffer compression only means something on real observations: synthetic noise does not
compress and synthetic flat images compress too well. This module plays Atari games in the
Arcade Learning Environment with a seeded random policy and returns the transitions in
TorchRL's layout, so the rest of the package can be tested and measured on the data it is
built for.

Layout of the returned :class:`~tensordict.TensorDict` (batch size ``[steps]``)::

    observation              uint8   [stack, size, size]   grayscale frame stack of the state
    action                   int64   []
    done, terminated,        bool    [1]                   always False (TorchRL's root flags)
    truncated
    ("collector","traj_ids") int64   []                    episode counter, from 0
    ("next","observation")   uint8   [stack, size, size]   frame stack after the step
    ("next","reward")        float32 [1]
    ("next","done")          bool    [1]                   terminated | truncated
    ("next","terminated")    bool    [1]                   game over
    ("next","truncated")     bool    [1]                   time limit reached
    pixels, ("next","pixels") uint8  [210, 160, 3]         raw RGB screens (only with raw=True)

Frame stacks restart at each episode start: the stack of the reset state holds ``stack`` copies
of the reset frame, as gymnasium's ``FrameStackObservation(padding_type="reset")`` does.

Internally a rollout is kept as :class:`AtariFrames`: every distinct screen once, plus index
arrays. Stacks are built from it by index arithmetic, and that compact form is what the cache
and the benchmark fixture store (a 4-frame stack plus its next stack would be 8 copies of
mostly the same frames).

``ale-py`` and ``gymnasium`` are the optional extra ``atari``; they are imported only by the
functions that play the emulator. :func:`load_fixture` and cache hits need only numpy, torch
and tensordict.

Example:
    >>> from tiered.atari import cached_rollout
    >>> td = cached_rollout("Pong", steps=100, seed=0)  # doctest: +SKIP
    >>> td["observation"].shape, td["next", "observation"].dtype  # doctest: +SKIP
    (torch.Size([100, 4, 84, 84]), torch.uint8)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from .util.progress import progress_bar

__all__ = [
    "AtariFrames",
    "rollout_frames",
    "rollout",
    "cached_rollout",
    "concat_rollouts",
    "default_cache_dir",
    "save_fixture",
    "load_fixture",
    "ATARI_INSTALL_HINT",
]

ATARI_INSTALL_HINT = "ale-py is needed for real Atari frames: pip install 'tiered[atari]'"

# Bump when the content of a rollout for the same arguments changes (e.g. another resize), so
# stale cache files are not served.
_CACHE_VERSION = 1
# Frames resized per interpolate call: bounds the float32 temporary (256 x 210 x 160 x 4 B = 34 MB)
# while keeping the work vectorized.
_RESIZE_CHUNK = 256


def _import_ale() -> tuple[Any, Any]:
    """Import gymnasium and ale_py lazily; they are an optional extra."""
    try:
        import ale_py
        import gymnasium
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(ATARI_INSTALL_HINT) from e
    # Registers the ALE/<game>-v5 ids; idempotent.
    gymnasium.register_envs(ale_py)
    return gymnasium, ale_py


@dataclass
class AtariFrames:
    """A rollout in compact form: each distinct screen once, plus per-transition indices.

    Transition ``t`` goes from the state whose newest frame is ``frames[first_frame[t] + step[t]]``
    to the state whose newest frame is ``frames[first_frame[t] + step[t] + 1]``. Frame
    ``first_frame[t]`` is the reset screen of the episode of ``t``.

    Attributes:
        frames: uint8 ``[F, size, size]`` grayscale screens, area-resized.
        pixels: uint8 ``[F, 210, 160, 3]`` raw RGB screens, or ``None`` when not recorded.
        action: int64 ``[T]`` action taken at each transition.
        reward: float32 ``[T]`` reward received.
        terminated: bool ``[T]`` the game ended at this transition.
        truncated: bool ``[T]`` the time limit ended the episode at this transition.
        traj_ids: int64 ``[T]`` episode counter, from 0.
        step: int64 ``[T]`` index of the transition inside its episode, from 0.
        first_frame: int64 ``[T]`` index into ``frames`` of the episode's reset screen.
    """

    frames: np.ndarray
    pixels: np.ndarray | None
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    traj_ids: np.ndarray
    step: np.ndarray
    first_frame: np.ndarray

    def __len__(self) -> int:
        return int(self.action.shape[0])

    def stack_index(self, stack: int = 4) -> tuple[np.ndarray, np.ndarray]:
        """Indices into ``frames`` of the stacks of every transition, oldest frame first.

        Args:
            stack: frames per stack.

        Returns:
            ``(obs_index, next_index)``, two int64 arrays ``[T, stack]``. Positions before the
            episode start point at the reset frame (``padding_type="reset"``).
        """
        if stack < 1:
            raise ValueError(f"stack must be >= 1, got {stack}")
        offsets = np.arange(-stack + 1, 1, dtype=np.int64)
        k = self.step[:, None] + offsets
        base = self.first_frame[:, None]
        # Clipping at 0 repeats the reset frame, which is how the stack restarts per episode.
        obs_index = base + np.clip(k, 0, None)
        next_index = base + np.clip(k + 1, 0, None)
        return obs_index, next_index

    def to_tensordict(self, stack: int = 4) -> TensorDict:
        """Expand into TorchRL's layout (see the module docstring).

        Args:
            stack: frames per observation stack.

        Returns:
            A TensorDict of batch size ``[T]`` on the CPU.
        """
        n = len(self)
        obs_index, next_index = self.stack_index(stack)
        frames = torch.from_numpy(self.frames)
        # One gather per stack field; the result owns its memory (no views into `frames`).
        obs = frames[torch.from_numpy(obs_index)]
        next_obs = frames[torch.from_numpy(next_index)]
        terminated = torch.from_numpy(self.terminated.astype(bool)).reshape(n, 1)
        truncated = torch.from_numpy(self.truncated.astype(bool)).reshape(n, 1)
        false = torch.zeros(n, 1, dtype=torch.bool)
        nxt: dict[str, torch.Tensor] = {
            "observation": next_obs,
            "reward": torch.from_numpy(self.reward.astype(np.float32)).reshape(n, 1),
            "done": terminated | truncated,
            "terminated": terminated,
            "truncated": truncated,
        }
        root: dict[str, Any] = {
            "observation": obs,
            "action": torch.from_numpy(self.action.astype(np.int64)),
            # TorchRL's root flags describe how the current state was reached; a collector
            # writes False for them on every stored step, and so do we.
            "done": false.clone(),
            "terminated": false.clone(),
            "truncated": false.clone(),
            "collector": {"traj_ids": torch.from_numpy(self.traj_ids.astype(np.int64))},
        }
        if self.pixels is not None:
            pixels = torch.from_numpy(self.pixels)
            current = torch.from_numpy(self.first_frame + self.step)
            root["pixels"] = pixels[current]
            nxt["pixels"] = pixels[current + 1]
        root["next"] = nxt
        return TensorDict(root, batch_size=[n])

    def to_npz_dict(self, prefix: str = "") -> dict[str, np.ndarray]:
        """Arrays to store with ``np.savez``; ``pixels`` is left out when absent."""
        return {prefix + f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_npz(cls, data: Any, prefix: str = "", pixels: bool = True) -> AtariFrames:
        """Inverse of :meth:`to_npz_dict` on an opened ``np.load`` archive (or a dict).

        Args:
            data: the archive or dict.
            prefix: the prefix given to :meth:`to_npz_dict`.
            pixels: read the raw screens when present; ``False`` skips them (they are most of
                the bytes, and an archive member is only decompressed when read).
        """
        keys = set(data.keys()) if not hasattr(data, "files") else set(data.files)
        wanted = {prefix + f.name for f in fields(cls) if pixels or f.name != "pixels"} & keys
        kwargs = {f.name: np.asarray(data[prefix + f.name]) if prefix + f.name in wanted else None for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name != "pixels" and kwargs[f.name] is None]
        if missing:
            raise KeyError(
                f"expected arrays {missing} (prefix {prefix!r}) in the archive; it has {sorted(keys)}"
            )
        return cls(**kwargs)


def _resize(gray: np.ndarray, size: int) -> np.ndarray:
    """Area-resize uint8 ``[F, H, W]`` screens to ``[F, size, size]``, rounding to uint8.

    ``mode="area"`` averages every source pixel that falls in a target pixel, which is what
    cv2's INTER_AREA does and keeps thin sprites (the Pong ball) visible; 210x160 does not
    divide into 84x84, so a reshape-mean would not do.
    """
    out = np.empty((gray.shape[0], size, size), dtype=np.uint8)
    src = torch.from_numpy(gray)
    for start in range(0, gray.shape[0], _RESIZE_CHUNK):
        chunk = src[start : start + _RESIZE_CHUNK].unsqueeze(1).to(torch.float32)
        small = torch.nn.functional.interpolate(chunk, size=(size, size), mode="area")
        out[start : start + _RESIZE_CHUNK] = small.squeeze(1).round_().clamp_(0, 255).to(torch.uint8).numpy()
    return out


def rollout_frames(
    game: str = "Pong",
    steps: int = 2000,
    seed: int = 0,
    size: int = 84,
    max_episode_steps: int | None = None,
    raw: bool = False,
    progress: bool | None = False,
) -> AtariFrames:
    """Play ``ALE/<game>-v5`` with a seeded random policy and keep each screen once.

    The emulator runs with ``frameskip=4`` and ``repeat_action_probability=0.0`` so the same
    arguments give the same bytes. Episodes end on game over (``terminated``) or after
    ``max_episode_steps`` transitions (``truncated``); the environment is then reset and play
    goes on until ``steps`` transitions are recorded.

    Args:
        game: ALE game name, e.g. ``"Pong"``, ``"MsPacman"``, ``"Breakout"``.
        steps: number of transitions to record.
        seed: seeds both the emulator (first reset) and the policy's numpy Generator.
        size: side of the square grayscale frames.
        max_episode_steps: truncate episodes after this many transitions; ``None`` keeps only
            ALE's own limit.
        raw: also keep the raw 210x160 RGB screens.
        progress: a tqdm progress bar on stderr while the emulator plays; ``None`` shows it
            only when stderr is a terminal.

    Returns:
        The rollout in compact form; see :class:`AtariFrames`.

    Raises:
        ImportError: ale-py or gymnasium is not installed.

    Example:
        >>> fr = rollout_frames("Pong", steps=50, seed=0)
        >>> fr.frames.shape  # one more frame than transitions per episode
        (51, 84, 84)
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    gymnasium, _ = _import_ale()
    env = gymnasium.make(
        f"ALE/{game}-v5",
        obs_type="grayscale",
        frameskip=4,
        repeat_action_probability=0.0,
        max_episode_steps=max_episode_steps,
    )
    try:
        ale = env.unwrapped.ale
        # Draw the whole policy up front: one vectorized call, and the actions do not depend
        # on how the loop below is written.
        action = np.random.default_rng(seed).integers(env.action_space.n, size=steps, dtype=np.int64)
        reward = np.zeros(steps, dtype=np.float32)
        terminated, truncated = np.zeros(steps, dtype=bool), np.zeros(steps, dtype=bool)
        traj_ids, step_in_ep, first_frame = (np.zeros(steps, dtype=np.int64) for _ in range(3))
        gray: list[np.ndarray] = []
        rgb: list[np.ndarray] = []

        def keep(obs: np.ndarray) -> None:
            gray.append(obs)
            if raw:
                rgb.append(ale.getScreenRGB())

        obs, _ = env.reset(seed=seed)
        keep(obs)
        episode, k, start = 0, 0, 0
        bar = progress_bar(steps, f"playing {game}", unit="steps", enabled=progress)
        # The emulator is stepped one transition at a time; everything else is vectorized.
        for t in range(steps):
            if t % 256 == 0 and t:
                bar.update(256)  # in strides: a call per step would cost more than it shows
            obs, r, term, trunc, _ = env.step(int(action[t]))
            keep(obs)
            reward[t], terminated[t], truncated[t] = r, term, trunc
            traj_ids[t], step_in_ep[t], first_frame[t] = episode, k, start
            k += 1
            if (term or trunc) and t + 1 < steps:
                obs, _ = env.reset()
                start = len(gray)
                keep(obs)
                episode, k = episode + 1, 0
        bar.close()
    finally:
        env.close()

    return AtariFrames(
        frames=_resize(np.stack(gray), size),
        pixels=np.stack(rgb) if raw else None,
        action=action,
        reward=reward,
        terminated=terminated,
        truncated=truncated,
        traj_ids=traj_ids,
        step=step_in_ep,
        first_frame=first_frame,
    )


def rollout(
    game: str = "Pong",
    steps: int = 2000,
    seed: int = 0,
    stack: int = 4,
    size: int = 84,
    max_episode_steps: int | None = None,
    raw: bool = False,
    progress: bool | None = False,
) -> TensorDict:
    """Play an Atari game and return the transitions in TorchRL's layout.

    Same as ``rollout_frames(...).to_tensordict(stack)``; see the module docstring for the keys.

    Args:
        stack: frames per observation stack.
        game, steps, seed, size, max_episode_steps, raw, progress: as :func:`rollout_frames`
            (``steps`` is the batch size of the result; ``raw`` adds ``pixels`` and
            ``("next", "pixels")``, the raw 210x160x3 RGB screens).

    Returns:
        A TensorDict of batch size ``[steps]``.

    Raises:
        ImportError: ale-py or gymnasium is not installed.

    Example:
        >>> td = rollout("Pong", steps=10, seed=0)
        >>> td["observation"].shape
        torch.Size([10, 4, 84, 84])
    """
    return rollout_frames(game, steps, seed, size, max_episode_steps, raw, progress).to_tensordict(stack)


def default_cache_dir() -> Path:
    """``$TIERED_CACHE`` if set, else ``~/.cache/tiered/atari``."""
    env = os.environ.get("TIERED_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tiered" / "atari"


def _cache_path(cache_dir: Path, **key: Any) -> Path:
    """A file name that changes with every argument that changes the content."""
    key["version"] = _CACHE_VERSION
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{key['game']}-{key['steps']}-s{key['seed']}-{digest}.npz"


def cached_rollout(
    game: str = "Pong",
    steps: int = 2000,
    seed: int = 0,
    stack: int = 4,
    size: int = 84,
    max_episode_steps: int | None = None,
    raw: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = False,
) -> TensorDict:
    """:func:`rollout`, played once and then read back from a cache file.

    The compact :class:`AtariFrames` form is stored uncompressed (``np.savez``): a few tens of
    MB, and loading is a plain read, much faster than replaying the emulator. The file name
    hashes every argument that changes the content (``stack`` does not: stacks are rebuilt at
    load). Writes go to a temporary file that is renamed into place, so concurrent test
    workers never read half a file.

    Args:
        cache_dir: where to keep the files; default :func:`default_cache_dir`.
        game, steps, seed, stack, size, max_episode_steps, raw, progress: as :func:`rollout`
            (a cache hit plays nothing, so shows no progress bar).

    Returns:
        The same TensorDict :func:`rollout` returns for these arguments.

    Raises:
        ImportError: the rollout is not cached and ale-py or gymnasium is not installed.

    Example:
        >>> td = cached_rollout("MsPacman", steps=2000, seed=1)  # played once, then read from the cache
        >>> bool(td["next", "terminated"].any())
        True
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = _cache_path(
        directory, game=game, steps=steps, seed=seed, size=size, max_episode_steps=max_episode_steps, raw=raw
    )
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as data:
                return AtariFrames.from_npz(data).to_tensordict(stack)
        except (OSError, ValueError, KeyError):
            # A damaged or foreign file: replay and overwrite it rather than fail the caller.
            pass
    frames = rollout_frames(game, steps, seed, size, max_episode_steps, raw, progress)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **frames.to_npz_dict())
        # mkstemp creates 0600 files; a cache is plain data that other users may share.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return frames.to_tensordict(stack)


def concat_rollouts(tds: list[TensorDict]) -> TensorDict:
    """Concatenate rollouts, shifting ``("collector", "traj_ids")`` so episodes stay distinct.

    Args:
        tds: TensorDicts in the layout of :func:`rollout`, with the same keys and stack size.

    Returns:
        One TensorDict; the episodes of ``tds[i]`` get ids after those of ``tds[i - 1]``.

    Example:
        >>> mixed = concat_rollouts([pong, mspacman])  # doctest: +SKIP
    """
    if not tds:
        raise ValueError("expected at least one TensorDict to concatenate, got none")
    parts = []
    offset = 0
    for td in tds:
        td = td.clone(recurse=False)
        ids = td["collector", "traj_ids"]
        td["collector", "traj_ids"] = ids - ids.min() + offset if ids.numel() else ids
        offset = int(td["collector", "traj_ids"].max()) + 1 if ids.numel() else offset
        parts.append(td)
    return torch.cat(parts, dim=0)


def save_fixture(path: str | os.PathLike[str], rollouts: dict[str, AtariFrames]) -> None:
    """Write rollouts to one compressed ``.npz`` that :func:`load_fixture` reads back.

    Only the compact form is stored (each screen once), compressed with
    ``np.savez_compressed``: Atari screens are mostly flat colour and compress well.

    Args:
        path: the ``.npz`` file to write.
        rollouts: game name -> rollout; the order is kept.
    """
    arrays: dict[str, np.ndarray] = {"games": np.array(list(rollouts), dtype=np.str_)}
    for game, frames in rollouts.items():
        arrays.update(frames.to_npz_dict(prefix=f"{game}/"))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)


def load_fixture(
    path: str | os.PathLike[str],
    games: list[str] | None = None,
    stack: int = 4,
    pixels: bool = False,
) -> TensorDict:
    """Read a fixture written by :func:`save_fixture` (``benchmarks/make_fixture.py``).

    Needs only numpy, torch and tensordict, so it runs where ale-py is not installed.

    Args:
        path: the ``.npz`` file.
        games: games to load, in this order; default all, in file order.
        stack: frames per observation stack.
        pixels: include ``pixels`` / ``("next", "pixels")`` when the file has them for every
            loaded game. Off by default: expanded per transition they take ~200 kB a row.

    Returns:
        The games' transitions concatenated in TorchRL's layout, with distinct
        ``("collector", "traj_ids")`` across games.

    Raises:
        KeyError: a requested game is not in the file.

    Example:
        >>> td = load_fixture("benchmarks/data/atari_frames.npz", games=["Pong"])  # doctest: +SKIP
        >>> td["observation"].dtype  # doctest: +SKIP
        torch.uint8
    """
    with np.load(path, allow_pickle=False) as data:
        available = [str(g) for g in data["games"]]
        chosen = available if games is None else list(games)
        unknown = [g for g in chosen if g not in available]
        if unknown:
            raise KeyError(f"games {unknown} are not in {os.fspath(path)}; it holds {available}")
        parts = [AtariFrames.from_npz(data, prefix=f"{g}/", pixels=pixels) for g in chosen]
    if any(p.pixels is None for p in parts):
        for p in parts:
            p.pixels = None
    return concat_rollouts([p.to_tensordict(stack) for p in parts])
