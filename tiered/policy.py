"""Eviction and promotion policies. A policy only decides; it never moves bytes.

The store tells a policy which blobs were inserted and accessed; when a tier is full it asks
the policy which of the blobs in that tier should leave first, and after a sample which
accessed blobs are worth promoting to a faster tier.

* ``fifo``: the oldest written blobs leave first.
* ``lru``: the least recently sampled blobs leave first. Recency is counted per ``get`` call
  (an epoch counter), a CLOCK-like approximation that costs one vectorized store per call.
* ``priority``: the caller passes priorities (``store.set_priority(rows, p)``); blobs whose
  highest row priority is lowest leave first, ties broken by age.

Example:
    >>> import numpy as np
    >>> from tiered.policy import get_policy
    >>> p = get_policy("lru")
    >>> p.on_insert(np.array([0, 1, 2]))
    >>> p.on_access(np.array([0]))
    >>> p.order(np.array([0, 1, 2])).tolist()  # eviction order: least recently used first
    [1, 2, 0]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from .errors import InvalidPriorityError

__all__ = ["TierState", "Policy", "FifoPolicy", "LruPolicy", "PriorityPolicy", "get_policy", "POLICIES"]


class _Column:
    """A growable per-blob-id numpy column."""

    def __init__(self, dtype, fill):
        self.fill = fill
        self.data = np.full(1024, fill, dtype=dtype)

    def ensure(self, max_id: int) -> None:
        if max_id >= self.data.shape[0]:
            new = np.full(max(max_id + 1, self.data.shape[0] * 2), self.fill, dtype=self.data.dtype)
            new[: self.data.shape[0]] = self.data
            self.data = new

    def set(self, ids: np.ndarray, values) -> None:
        if ids.size:
            self.ensure(int(ids.max()))
            self.data[ids] = values

    def get(self, ids: np.ndarray) -> np.ndarray:
        if ids.size:
            self.ensure(int(ids.max()))
        return self.data[ids]


@dataclass(frozen=True)
class TierState:
    """What a policy may know of a tier when it decides."""

    name: str
    budget: int | None
    bytes_used: int
    exclusive: bool


class Policy(ABC):
    """Decides residency. Subclasses implement :meth:`_keys` (lower leaves first)."""

    name: str

    def __init__(self) -> None:
        self._clock = 0
        self._birth = _Column(np.int64, 0)

    def on_insert(self, ids: np.ndarray) -> None:
        """New blobs were written."""
        self._clock += 1
        self._birth.set(np.asarray(ids, dtype=np.int64), self._clock)

    def on_access(self, ids: np.ndarray) -> None:  # noqa: B027 - only LRU cares
        """Blobs were read by a ``get``."""

    def on_release(self, ids: np.ndarray) -> None:  # noqa: B027
        """Blobs were deleted (their ids may be reused)."""

    def admit(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """Which new blobs to copy into cache tier ``tier`` at write time (default: all)."""
        return np.ones(np.asarray(ids).size, dtype=bool)

    def promote(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """Which blobs just read from a slower tier to copy up into ``tier``."""
        limit = (tier.budget or 0) // (4 if tier.exclusive else 2)
        return np.cumsum(np.asarray(sizes, dtype=np.int64)) <= limit

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The policy's per-blob state, saved at commit."""
        return {"birth": self._birth.data.copy(), "clock": np.array([self._clock], np.int64)}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore :meth:`state_arrays`."""
        self._birth.data = np.array(arrays["birth"], dtype=np.int64)
        self._clock = int(arrays["clock"][0])

    @abstractmethod
    def _keys(self, ids: np.ndarray) -> np.ndarray:
        """Sort keys: the smallest leaves first."""

    def order(self, ids: np.ndarray) -> np.ndarray:
        """Return ``ids`` in eviction order (first to leave first)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return ids
        keys = self._keys(ids)
        # lexsort: last key is primary; age breaks ties so the order is deterministic.
        return ids[np.lexsort((self._birth.get(ids), keys))]

    def victims(self, ids: np.ndarray, sizes: np.ndarray, need: int) -> np.ndarray:
        """The shortest eviction-ordered prefix of ``ids`` whose ``sizes`` add up to ``need`` bytes."""
        ids = np.asarray(ids, dtype=np.int64)
        if need <= 0 or ids.size == 0:
            return np.empty(0, dtype=np.int64)
        perm = np.lexsort((self._birth.get(ids), self._keys(ids)))
        cum = np.cumsum(np.asarray(sizes, dtype=np.int64)[perm])
        k = int(np.searchsorted(cum, need)) + 1
        return ids[perm[:k]]


class FifoPolicy(Policy):
    """Oldest written first."""

    name = "fifo"

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return self._birth.get(ids)


class LruPolicy(Policy):
    """Least recently accessed first (per-call epochs: a CLOCK-like approximation of LRU)."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._last = _Column(np.int64, 0)

    def on_insert(self, ids: np.ndarray) -> None:
        super().on_insert(ids)
        self._last.set(np.asarray(ids, dtype=np.int64), self._clock)

    def on_access(self, ids: np.ndarray) -> None:
        self._clock += 1
        self._last.set(np.asarray(ids, dtype=np.int64), self._clock)

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return self._last.get(ids)


class PriorityPolicy(Policy):
    """Lowest priority first; blobs without a priority count as ``default``."""

    name = "priority"

    def __init__(self, default: float = 1.0) -> None:
        super().__init__()
        self._prio = _Column(np.float64, default)
        self.default = default

    def on_insert(self, ids: np.ndarray) -> None:
        super().on_insert(ids)
        self._prio.set(np.asarray(ids, dtype=np.int64), self.default)

    def set_priority(self, ids: np.ndarray, priority: np.ndarray) -> None:
        """Set the priority of blobs (the store passes, per blob, the max over its rows)."""
        priority = np.asarray(priority, dtype=np.float64)
        if not np.isfinite(priority).all() or (priority < 0).any():
            bad = priority[~np.isfinite(priority) | (priority < 0)]
            raise InvalidPriorityError(
                f"priorities must be finite and >= 0, got {bad[:5].tolist()}; "
                "fix the TD error / priority computation (e.g. nan_to_num) before updating"
            )
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size:
            # Several rows may map to one blob: keep the max (np.maximum.at handles duplicates).
            self._prio.ensure(int(ids.max()))
            self._prio.data[ids] = -np.inf
            np.maximum.at(self._prio.data, ids, priority)

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return self._prio.get(ids)


POLICIES: dict[str, type[Policy]] = {"fifo": FifoPolicy, "lru": LruPolicy, "priority": PriorityPolicy}


def get_policy(policy: str | Policy) -> Policy:
    """Resolve ``"fifo"``, ``"lru"`` or ``"priority"`` (or pass a :class:`Policy` through)."""
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[str(policy).lower()]()
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; known policies: {', '.join(POLICIES)}") from None
