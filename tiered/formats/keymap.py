"""Key mapping between the D4RL/Minari layouts and TorchRL's (the TED layout a store holds).

=====================  ============================  ==============================================
D4RL (flat HDF5, npz)  Minari (per episode)          store / TorchRL key
=====================  ============================  ==============================================
``observations``       ``observations[:-1]``         ``observation``
``next_observations``  ``observations[1:]``          ``("next", "observation")``
``actions``            ``actions``                   ``action``
``rewards``            ``rewards``                   ``("next", "reward")``, shape ``[n, 1]``
``terminals``          ``terminations``              ``("next", "terminated")``, bool ``[n, 1]``
``timeouts``           ``truncations``               ``("next", "truncated")``, bool ``[n, 1]``
(derived)              (derived)                     ``("next", "done")`` = terminated | truncated
(derived: flags)       episode number                ``("collector", "traj_ids")``
``infos/<k>``          ``infos/<k>[:-1]``            ``("info", <k>)``
--                     ``infos/<k>[1:]``             ``("next", "info", <k>)``
any other ``a/b``      --                            ``("a", "b")``
=====================  ============================  ==============================================

Rules (also in docs/cli.md):

* Per-step scalars (rewards and the flags) get TorchRL's trailing dimension of 1; the flags
  become ``bool`` (a float ``0.0/1.0`` column is accepted and restored on export).
* Derived fields are recorded in the store's import sidecar and dropped again on export to the
  format they came from, so that a round trip gives back exactly the source arrays.
* D4RL has no next observation at the last step of an episode (the next row is the reset
  observation of the next episode). When ``next_observations`` is absent, the import derives
  ``next_obs[t] = obs[t + 1]`` inside an episode and, at the last step of an episode (and the
  last row of the file), **repeats the last observation** ``next_obs[t] = obs[t]``. Such a step
  is always flagged ``terminated`` or ``truncated``; use the flags (e.g. drop or mask the
  truncated last steps) rather than the repeated observation.

Example:
    >>> from tiered.formats.keymap import d4rl_to_key, key_to_d4rl
    >>> d4rl_to_key("rewards"), d4rl_to_key("infos/qpos")
    (('next', 'reward'), ('info', 'qpos'))
    >>> key_to_d4rl(("next", "terminated")), key_to_d4rl(("collector", "traj_ids"))
    ('terminals', 'collector/traj_ids')
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedFormatError
from ..schema import Key
from ..schema import key_to_str as key_str

__all__ = [
    "Key",
    "OBS",
    "NEXT_OBS",
    "ACTION",
    "REWARD",
    "TERMINATED",
    "TRUNCATED",
    "DONE",
    "TRAJ",
    "INFO",
    "NEXT_INFO",
    "D4RL_NAMES",
    "MINARI_NAMES",
    "STEP_SCALARS",
    "d4rl_to_key",
    "key_to_d4rl",
    "to_flag",
    "stored_cell",
    "flat_cell",
    "step_column",
    "key_str",
]

OBS: Key = ("observation",)
NEXT_OBS: Key = ("next", "observation")
ACTION: Key = ("action",)
REWARD: Key = ("next", "reward")
TERMINATED: Key = ("next", "terminated")
TRUNCATED: Key = ("next", "truncated")
DONE: Key = ("next", "done")
TRAJ: Key = ("collector", "traj_ids")
INFO: Key = ("info",)
NEXT_INFO: Key = ("next", "info")

#: D4RL column name -> store key.
D4RL_NAMES: dict[str, Key] = {
    "observations": OBS,
    "next_observations": NEXT_OBS,
    "actions": ACTION,
    "rewards": REWARD,
    "terminals": TERMINATED,
    "timeouts": TRUNCATED,
}
_D4RL_KEYS = {v: k for k, v in D4RL_NAMES.items()}

#: Minari per-episode dataset name -> store key (observations also give NEXT_OBS).
MINARI_NAMES: dict[str, Key] = {
    "observations": OBS,
    "actions": ACTION,
    "rewards": REWARD,
    "terminations": TERMINATED,
    "truncations": TRUNCATED,
}

#: Keys stored with TorchRL's trailing dimension of 1 when the source has one value per step.
STEP_SCALARS: frozenset[Key] = frozenset({REWARD, TERMINATED, TRUNCATED, DONE})
FLAGS: frozenset[Key] = frozenset({TERMINATED, TRUNCATED, DONE})


def d4rl_to_key(name: str) -> Key:
    """Store key of a D4RL column (``infos/x`` -> ``("info", "x")``, ``a/b`` -> ``("a", "b")``)."""
    name = name.strip("/")
    if name in D4RL_NAMES:
        return D4RL_NAMES[name]
    parts = tuple(name.split("/"))
    if parts[0] == "infos" and len(parts) > 1:
        return INFO + parts[1:]
    return parts


def key_to_d4rl(key: Key) -> str:
    """Inverse of :func:`d4rl_to_key`."""
    key = tuple(key)
    if key in _D4RL_KEYS:
        return _D4RL_KEYS[key]
    if key[:1] == INFO and len(key) > 1:
        return "infos/" + "/".join(key[1:])
    return "/".join(key)


def stored_cell(key: Key, cell: tuple[int, ...]) -> tuple[int, ...]:
    """The store's cell shape for a source cell: per-step scalars get TorchRL's trailing 1.

    Example:
        >>> stored_cell(REWARD, ()), stored_cell(OBS, ())
        ((1,), ())
    """
    return (1,) if key in STEP_SCALARS and cell == () else cell


def flat_cell(key: Key, cell: tuple[int, ...]) -> tuple[int, ...]:
    """Inverse of :func:`stored_cell`: the trailing 1 of a per-step scalar goes on export.

    Example:
        >>> flat_cell(DONE, (1,)), flat_cell(OBS, (1,))
        ((), (1,))
    """
    return () if key in STEP_SCALARS and cell == (1,) else cell


def step_column(key: Key, a: np.ndarray) -> np.ndarray:
    """A source column as the store holds it: a per-step scalar ``[m]`` becomes ``[m, 1]``.

    Example:
        >>> step_column(REWARD, np.zeros(3)).shape
        (3, 1)
    """
    return a.reshape(-1, 1) if key in STEP_SCALARS and a.ndim == 1 else a


def to_flag(values: np.ndarray, name: str) -> np.ndarray:
    """A done-like column as ``bool``; refuses values other than 0/1 (they would not round-trip).

    Raises:
        UnsupportedFormatError: a value is neither 0 nor 1.
    """
    if values.dtype == np.bool_:
        return values
    flag = values != 0
    if not np.array_equal(flag.astype(values.dtype), values):
        bad = values[(values != 0) & (values != 1)]
        raise UnsupportedFormatError(
            f"column {name!r} should hold 0/1 flags but holds {bad[:3].tolist()}; TorchRL's done "
            "flags are bool, and these values would not survive the conversion"
        )
    return flag
