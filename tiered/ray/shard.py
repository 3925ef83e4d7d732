"""One shard of a sharded store: a :class:`~tiered.TieredStore` and the sum tree of its rows.

:class:`ShardServer` is a plain class; :class:`~tiered.ray.ShardedStore` runs one per Ray actor
(``ray.remote(ShardServer)``), but it works in-process too, which is how its example runs. Every
method that changes what sampling sees returns the shard's :class:`ShardStatus` (rows, priority
mass, smallest priority), so the driver keeps the shard totals without asking for them.

Priorities follow TorchRL's ``PrioritizedSampler``: a leaf holds ``(p + eps) ** alpha``; new
rows get the largest priority given so far (``max_priority``, 1.0 at first). Raw priorities are
also given to the store (:meth:`~tiered.TieredStore.set_priority`), whose next commit (a
:meth:`ShardServer.flush`) makes them durable: a shard reopened from its directory rebuilds its
tree from the priorities of its last commit (the driver counts the updates made since, which a
restart loses: :class:`~tiered.ray.client.ShardFailure`).

Example:
    >>> import numpy as np, torch
    >>> from tensordict import TensorDict
    >>> from tiered.ray.shard import ShardServer
    >>> shard = ShardServer(0, 100, alpha=1.0, eps=0.0)
    >>> rows, status = shard.extend(TensorDict({"obs": torch.zeros(4, 8, 8)}, [4]))
    >>> rows.tolist(), status.rows, status.total
    ([0, 1, 2, 3], 4, 4.0)
    >>> status = shard.update_priority(np.array([1]), np.array([3.0]))
    >>> shard.find(np.array([0.5, 1.5, 3.9]))[0].tolist()
    [0, 1, 1]
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensordict import TensorDictBase

from ..engine.transport import CompressedRows
from ..errors import IndexOutOfRangeError, InvalidArgumentError, StoreLockedError
from ..store import OPEN_OPTIONS, TieredStore
from .sumtree import SumMinTree

__all__ = ["ShardServer", "ShardStatus"]


@dataclass(frozen=True)
class ShardStatus:
    """What the driver knows of a shard: ``rows`` readable, ``total`` priority mass (sum of
    leaves), ``min`` (smallest leaf, ``inf`` when empty), ``max_priority`` (largest raw priority
    given, which new rows get)."""

    rows: int
    total: float
    min: float
    max_priority: float


class ShardServer:
    """A shard: one store (in memory, or in ``path``) plus its sum and min trees.

    Args:
        shard_id: the shard's number (in error messages).
        capacity: rows of this shard's store.
        path: the shard's own directory (``None``: in memory).
        options: :class:`~tiered.TieredStore` keyword options.
        alpha, eps: priority exponent and offset (leaf = ``(p + eps) ** alpha``).
        reopen: open the store already in ``path`` (a restart) instead of creating one.
    """

    def __init__(self, shard_id: int, capacity: int, path: str | None = None, options: dict[str, Any] | None = None,
                 *, alpha: float = 1.0, eps: float = 1e-8, reopen: bool = False) -> None:
        self.shard_id = int(shard_id)
        self.alpha, self.eps = float(alpha), float(eps)
        options = dict(options or {})
        if reopen:
            runtime = {k: v for k, v in options.items() if k in OPEN_OPTIONS}
            self.store = _open_when_unlocked(path, runtime)
        else:
            self.store = TieredStore(capacity, path, **options)
        self.store.priority_alpha = self.alpha  # the store ranks and reports mass by p ** alpha, as sampled
        self.tree = SumMinTree(self.store.capacity)
        n = len(self.store)
        raw = self.store.priorities(np.arange(n)) if n else np.empty(0)
        self.max_priority = float(max(raw.max(initial=1.0), 1.0)) if n else 1.0
        self.tree.update(np.arange(n), self.leaf(raw))

    def leaf(self, priority: np.ndarray) -> np.ndarray:
        """The tree value of raw priorities: ``(p + eps) ** alpha``."""
        return np.power(np.asarray(priority, dtype=np.float64) + self.eps, self.alpha)

    def status(self) -> ShardStatus:
        """Rows, priority mass, smallest leaf and largest raw priority of the shard."""
        return ShardStatus(len(self.store), self.tree.total, self.tree.min, self.max_priority)

    def where(self) -> dict[str, Any]:
        """Where the shard runs: host, pid and directory (for error messages and docs)."""
        return {"shard": self.shard_id, "host": socket.gethostname(), "pid": os.getpid(), "path": self.store.path}

    # -- writes -------------------------------------------------------------------------------
    def extend(self, data: TensorDictBase, max_priority: float | None = None) -> tuple[np.ndarray, ShardStatus]:
        """Append rows (they get the largest priority given so far, or ``max_priority`` if larger).

        Returns:
            The rows written and the shard's status after the write.
        """
        if max_priority is not None:
            self.max_priority = max(self.max_priority, float(max_priority))
        rows = self.store.extend(data).numpy()
        if self.max_priority != 1.0:  # the store's rows start at 1.0; others are committed with it
            self.store.set_priority(rows, self.max_priority)
        self.tree.update(rows, self.leaf(np.full(rows.shape, self.max_priority)))
        return rows, self.status()

    def update_priority(self, rows: np.ndarray, priority: np.ndarray) -> ShardStatus:
        """Set the raw priorities of ``rows`` (checked by the store: finite, >= 0)."""
        rows = np.asarray(rows, dtype=np.int64)
        priority = np.broadcast_to(np.asarray(priority, dtype=np.float64), rows.shape)
        self.check_rows(rows)
        self.store.set_priority(rows, priority)
        if priority.size:
            self.max_priority = max(self.max_priority, float(priority.max()))
        self.tree.update(rows, self.leaf(priority))
        return self.status()

    def flush(self) -> ShardStatus:
        """Commit the store (with a path, the rows written so far survive a crash)."""
        self.store.flush()
        return self.status()

    def close(self) -> None:
        self.store.close()

    # -- reads ----------------------------------------------------------------------------------
    def check_rows(self, rows: np.ndarray) -> None:
        n = len(self.store)
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise IndexOutOfRangeError(
                f"shard {self.shard_id} holds rows [0, {n}); asked for rows {rows[(rows < 0) | (rows >= n)][:5].tolist()}"
                " (global ids from another store, or from before a restart that lost rows?)")

    def get(self, rows: np.ndarray, keys: Any = None, transport: str = "decoded") -> TensorDictBase | CompressedRows:
        """Rows decoded (``"decoded"``: a TensorDict) or as :class:`~tiered.engine.transport.CompressedRows`:
        the stored blobs (``"compressed"``) or only the frames the rows use, compressed again
        (``"repacked"``)."""
        if transport not in ("decoded", "compressed", "repacked"):
            raise InvalidArgumentError(f"transport must be 'decoded', 'compressed' or 'repacked', got {transport!r}")
        rows = np.asarray(rows, dtype=np.int64)
        self.check_rows(rows)
        if transport == "decoded":
            return self.store.get(rows, keys)
        return self.store.get_compressed(rows, keys, repack=transport == "repacked")

    def find(self, mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows that masses in ``[0, total)`` fall on, and their leaves."""
        rows = self.tree.find(mass)
        return rows, self.tree.leaves(rows)

    def sample(self, mass: np.ndarray | None, rows: np.ndarray | None, keys: Any = None,
               transport: str | None = "decoded") -> tuple[np.ndarray, np.ndarray, Any, ShardStatus]:
        """Rows by priority mass (``mass``) or given (``rows``), their leaves, their data
        (``transport``: ``"decoded"``, ``"compressed"``, ``"repacked"`` or None for none) and the status."""
        if mass is not None:
            rows, leaves = self.find(mass)
        else:
            rows = np.asarray(rows, dtype=np.int64)
            self.check_rows(rows)
            leaves = self.tree.leaves(rows)
        data = None if transport is None else self.get(rows, keys, transport)
        return rows, leaves, data, self.status()


def _open_when_unlocked(path: str | None, options: dict[str, Any]) -> TieredStore:
    """Reopen a dead shard's store for writing; its process may take a moment (up to 10 s) to release the lock."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return TieredStore.open(path, mode="r+", **options)
        except StoreLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
