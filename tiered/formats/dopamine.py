"""Dopamine's replay-buffer checkpoints written from a rollout (fixtures, benchmarks, conversions).

What ``OutOfGraphReplayBuffer.add`` and ``.save`` of Dopamine's ``circular_replay_buffer.py`` do
to a stream of transitions, vectorized:

* before the first transition of each episode, ``stack - 1`` zero transitions (observation,
  action, reward and terminal all 0) are added;
* transition ``t`` of the padded stream goes to slot ``t % capacity``; after ``add_count``
  additions the cursor is ``add_count % capacity``;
* ``invalid_range`` is ``[(cursor - h + j) % capacity for j in range(stack + h)]`` (``h``: the
  update horizon, 1 here as in Dopamine's default), or ``zeros(stack)`` (float) before the first
  addition;
* each array is saved with ``np.save(..., allow_pickle=False)`` into a ``gzip.GzipFile`` at its
  default level (9), as ``$store$_<name>_ckpt.<i>.gz``, ``add_count_ckpt.<i>.gz`` and
  ``invalid_range_ckpt.<i>.gz``.

Slots a buffer that is not full never wrote hold zeros here (Dopamine's ``np.empty`` leaves
whatever the memory held).

Example:
    >>> import numpy as np, tempfile
    >>> obs = np.arange(6, dtype=np.uint8).repeat(4).reshape(6, 2, 2)
    >>> slots = padded_stream(obs, np.zeros(6, np.int32), np.zeros(6, np.float32),
    ...                       np.array([0, 0, 1, 0, 0, 1], np.uint8), np.array([1, 0, 0, 1, 0, 0], bool))
    >>> slots["observation"][:, 0, 0].tolist()    # 3 zero slots before each episode
    [0, 0, 0, 0, 1, 2, 0, 0, 0, 3, 4, 5]
    >>> ckpt = buffer_checkpoint(slots, add_count=12, capacity=8)
    >>> ckpt["observation"][:, 0, 0].tolist(), ckpt["invalid_range"].tolist()
    ([0, 3, 4, 5, 1, 2, 0, 0], [3, 4, 5, 6, 7])
    >>> save_checkpoint(tempfile.mkdtemp(), 0, ckpt)
"""

from __future__ import annotations

import gzip
import os
from typing import Any

import numpy as np

__all__ = ["padded_stream", "buffer_checkpoint", "save_checkpoint", "STORE_NAMES"]

#: Dopamine's storage arrays, in its storage signature's order.
STORE_NAMES = ("observation", "action", "reward", "terminal")


def padded_stream(
    observation: np.ndarray,
    action: np.ndarray,
    reward: np.ndarray,
    terminal: np.ndarray,
    episode_start: np.ndarray,
    stack: int = 4,
) -> dict[str, np.ndarray]:
    """The slots a Dopamine buffer is given for these transitions, zero padding included.

    Args:
        observation: ``[T, H, W]`` uint8, the frame observed before each action.
        action: ``[T]`` int32.
        reward: ``[T]`` float32.
        terminal: ``[T]`` uint8, 1 where the transition ended the game.
        episode_start: ``[T]`` bool, True at the first transition of each episode (also after an
            episode cut without a terminal: Dopamine pads after any episode end).
        stack: frames per state.

    Returns:
        ``{name: [T + pads, ...]}`` for the four storage arrays.
    """
    t = observation.shape[0]
    starts = np.asarray(episode_start, bool).copy()
    starts[:1] = True  # the buffer starts with an episode
    pads = np.cumsum(starts) * (stack - 1)  # slots of padding before and at each transition
    pos = np.arange(t) + pads
    total = t + int(pads[-1]) if t else 0
    out = {}
    for name, a in zip(STORE_NAMES, (observation, action, reward, terminal), strict=True):
        arr = np.zeros((total, *a.shape[1:]), dtype=a.dtype)
        arr[pos] = a
        out[name] = arr
    return out


def buffer_checkpoint(slots: dict[str, np.ndarray], add_count: int, capacity: int, stack: int = 4) -> dict[str, np.ndarray]:
    """The arrays a buffer of ``capacity`` slots (update horizon 1, Dopamine's default) saves
    after the first ``add_count`` slots of ``slots``."""
    out: dict[str, np.ndarray] = {}
    take = np.arange(max(0, add_count - capacity), add_count)  # the last writes win
    for name in STORE_NAMES:
        a = slots[name]
        arr = np.zeros((capacity, *a.shape[1:]), dtype=a.dtype)
        arr[take % capacity] = a[take]
        out[name] = arr
    out["add_count"] = np.array(add_count)
    cursor = add_count % capacity
    out["invalid_range"] = (
        np.array([(cursor - 1 + j) % capacity for j in range(stack + 1)])
        if add_count else np.zeros(stack)
    )
    return out


def save_checkpoint(logs: str | os.PathLike[str], ckpt: int, arrays: dict[str, Any]) -> None:
    """Write the six files of checkpoint ``ckpt`` as Dopamine's ``save`` does (gzip level 9)."""
    os.makedirs(logs, exist_ok=True)
    for name, value in arrays.items():
        prefix = "$store$_" if name in STORE_NAMES else ""
        path = os.path.join(os.fspath(logs), f"{prefix}{name}_ckpt.{ckpt}.gz")
        with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9) as out:
            np.save(out, value, allow_pickle=False)
