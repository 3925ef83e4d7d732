"""ShardedStore: N Ray actors, each owning one TieredStore shard, sampled as one buffer.

* **Writes** are routed by trajectory: rows with trajectory ids (``traj_key``) go to shard
  ``traj_id % N``, so a trajectory's dedup, time chunks and slices stay in one shard; a batch
  without them goes whole to one shard, round robin.
* **Global row ids** encode ``(shard, row)`` as ``shard << 40 | row`` (:func:`global_ids`).
* **Uniform sampling** draws ``B`` positions over all rows: a shard's count follows its size.
* **Prioritized sampling** is exact global PER: each shard keeps a sum tree of its leaves
  ``(p + eps) ** alpha``; the driver keeps the shard totals (every reply carries them), draws
  ``B`` masses in ``[0, total)``, gives each shard the masses that fall in its range, and
  computes probabilities ``leaf / total`` and weights ``(leaf / min leaf) ** -beta`` from the
  global figures, as one TorchRL ``PrioritizedSampler`` over every row would.
* **Transport**: a shard returns decoded TensorDicts; or (``transport="compressed"``) the
  stored blobs of the batch plus the row -> frame tables; or (``"repacked"``) only the frames
  the batch uses, compressed again by the shard. Compressed replies are decoded in the caller's
  process by the store's own decoder, straight into one batch in the requested order
  (:func:`tiered.engine.transport.decode_batch`).
* **Failures**: a dead shard is detected on the next call to it; with a path it is restarted
  from its last commit (rows written and priority updates acknowledged since its last flush are
  lost, and counted); then the call
  raises :class:`~tiered.errors.ShardFailedError` (``on_shard_failure="raise"``) or, for reads,
  goes on with the shards alive (``"skip"``).

Shards answer in parallel: each call sends every shard its part, then waits for all of them.
Totals are those of each shard's last reply: writes by other processes straight to the actors
show after the next reply from that shard (:meth:`ShardedStore.refresh` asks them all).

Example:
    >>> import ray, torch
    >>> from tensordict import TensorDict
    >>> from tiered.ray import ShardedStore
    >>> _ = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    >>> store = ShardedStore(2, 1000, frames={"obs": 0}, actor_options={"num_cpus": 0})
    >>> td = TensorDict({"obs": torch.randint(0, 4, (8, 4, 16, 16), dtype=torch.uint8),
    ...                  ("collector", "traj_ids"): torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])}, [8])
    >>> ids = store.extend(td)
    >>> store.shard_rows()
    [4, 4]
    >>> batch, info = store.sample(16, prioritized=True, transport="compressed")
    >>> batch["obs"].shape, info["priority_weight"].shape
    (torch.Size([16, 4, 16, 16]), torch.Size([16]))
    >>> store.close(); ray.shutdown()
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from ..engine.priorities import checked_row_priorities
from ..engine.transport import CompressedRows, decode_batch
from ..errors import InvalidArgumentError, ShardFailedError
from ..schema import as_bits, normalize_key
from .shard import ShardServer, ShardStatus

__all__ = ["ShardedStore", "ShardFailure", "global_ids", "split_ids", "require_ray", "SHARD_SHIFT"]

#: global id = shard << SHARD_SHIFT | row (a store holds at most 2**40 rows)
SHARD_SHIFT = 40
_TRANSPORTS = ("decoded", "compressed", "repacked")


def require_ray() -> Any:
    """Import Ray, or say how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError('tiered.ray needs Ray: pip install "tiered[ray]" (ray>=2.40)') from e
    return ray


def global_ids(shard: int | np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Global row ids of ``rows`` of ``shard``: ``shard << 40 | row``.

    Example:
        >>> import numpy as np
        >>> split_ids(global_ids(3, np.array([0, 7])))
        (array([3, 3]), array([0, 7]))
    """
    return (np.asarray(shard, dtype=np.int64) << SHARD_SHIFT) | np.asarray(rows, dtype=np.int64)


def split_ids(ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(shard, row)`` of global row ids."""
    ids = torch.as_tensor(ids).numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    ids = ids.astype(np.int64).reshape(-1)
    return ids >> SHARD_SHIFT, ids & ((1 << SHARD_SHIFT) - 1)


@dataclass(frozen=True)
class ShardFailure:
    """A shard found dead: ``restarted`` from its directory or not (no path), ``lost_rows``
    (written since its last flush, or all of them without a path), rows before and after, and
    ``lost_priority_updates``: row priorities :meth:`ShardedStore.update_priority` set on it since
    its last flush (acknowledged, but committed only by a flush), which the restarted shard no
    longer has (its rows went back to their last committed priorities)."""

    shard: int
    error: str
    restarted: bool
    lost_rows: int
    rows_before: int
    rows_after: int
    lost_priority_updates: int = 0


class ShardedStore:
    """A replay buffer spread over Ray actors, one :class:`~tiered.TieredStore` each.

    Args:
        num_shards: number of shard actors.
        shard_capacity: rows each shard holds (the buffer holds ``num_shards * shard_capacity``).
        path: a directory; shard ``i`` keeps its store in ``path/shard-i`` (``None``: memory).
            On a multi-node cluster the path must be on each shard's node (local disk).
        alpha, beta, eps: prioritized sampling as TorchRL's ``PrioritizedSampler``.
        transport: ``"decoded"``, ``"compressed"`` or ``"repacked"``: how shards return data by
            default (see the module docstring).
        on_shard_failure: ``"raise"`` or ``"skip"`` (reads go on with the live shards).
        traj_key: key of the trajectory ids that route rows to shards.
        seed: seed of the driver's sampling generator.
        actor_options: passed to ``ray.remote(...).options`` (``num_cpus``, ``resources``,
            ``scheduling_strategy`` to pin shards to nodes, ...).
        **store_options: :class:`~tiered.TieredStore` options of every shard (``frames``,
            ``codec``, ``chunk_frames``, ``warm_bytes``, ...).
    """

    def __init__(self, num_shards: int, shard_capacity: int, path: str | os.PathLike | None = None, *,
                 alpha: float = 1.0, beta: float = 1.0, eps: float = 1e-8, transport: str = "decoded",
                 on_shard_failure: str = "raise", traj_key: Any = ("collector", "traj_ids"),
                 seed: int | None = None, actor_options: dict[str, Any] | None = None, **store_options: Any) -> None:
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 0 < num_shards < 1 << 20:
            raise InvalidArgumentError(f"num_shards must be an int in [1, 2**20), got {num_shards!r}")
        _check_choice("transport", transport, _TRANSPORTS)
        _check_choice("on_shard_failure", on_shard_failure, ("raise", "skip"))
        self._ray = require_ray()
        self.num_shards, self.shard_capacity = num_shards, int(shard_capacity)
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.transport, self.on_shard_failure = transport, on_shard_failure
        self.traj_key = normalize_key(traj_key) if traj_key is not None else None
        self.paths = [None if path is None else os.path.join(os.fspath(path), f"shard-{i}") for i in range(num_shards)]
        self._store_options = store_options
        self._actor_cls = self._ray.remote(ShardServer).options(**(actor_options or {}))
        self._rng = np.random.default_rng(seed)
        self._next = 0  # round-robin shard of batches without trajectory ids
        self._max_priority = 1.0
        self._unflushed = np.zeros(num_shards, dtype=np.int64)
        # priority updates acknowledged since each shard's last flush (lost if it dies before one)
        self._unflushed_priorities = np.zeros(num_shards, dtype=np.int64)
        self.dead: set[int] = set()
        self.closed = False
        self.failures: list[ShardFailure] = []
        #: Ray calls made to shards, by operation (one per shard asked): what a call costs in round trips
        self.calls: dict[str, int] = {}
        self.actors = [self._start(i, reopen=False) for i in range(num_shards)]
        self._status: list[ShardStatus] = self._ray.get([a.status.remote() for a in self.actors])

    def _start(self, shard: int, *, reopen: bool) -> Any:
        return self._actor_cls.remote(shard, self.shard_capacity, self.paths[shard], self._store_options,
                                      alpha=self.alpha, eps=self.eps, reopen=reopen)

    # -- sizes ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(sum(self.shard_rows()))

    def shard_rows(self) -> list[int]:
        """Rows of each shard (as of its last reply)."""
        return [s.rows for s in self._status]

    @property
    def total_priority(self) -> float:
        """Sum of every live shard's leaves (as of their last replies)."""
        return float(sum(s.total for i, s in enumerate(self._status) if i not in self.dead))

    def refresh(self) -> None:
        """Ask every live shard for its rows and priority mass (after writes by other processes)."""
        self._run({s: self.actors[s].status.remote() for s in self._live()}, "refresh", read=True)

    def reseed(self, seed: int | None) -> None:
        """Restart the driver's sampling generator (``numpy.random.default_rng(seed)``): masses are
        ``rng.random(B) * total``, uniform positions ``rng.integers(0, rows, B)``."""
        self._rng = np.random.default_rng(seed)

    def _live(self) -> list[int]:
        return [s for s in range(self.num_shards) if s not in self.dead]

    # -- writes -----------------------------------------------------------------------------------
    def extend(self, data: TensorDictBase) -> torch.Tensor:
        """Append rows, routed by trajectory (see the module docstring).

        Returns:
            The global row ids, in the order of ``data``.

        Raises:
            ShardFailedError: a shard died (always raised for writes; the rows sent to the other
                shards are written).
        """
        n = data.batch_size[0] if data.batch_dims else 0
        shard_of = self._route(data, n)
        ids = np.empty(n, dtype=np.int64)
        parts = _group(shard_of, self.num_shards)
        refs = {s: self.actors[s].extend.remote(data[torch.from_numpy(pos)], self._max_priority)
                for s, pos in parts.items()}
        replies = self._run(refs, "extend", read=False, unpack=lambda r: r[1])
        for s, (rows, _) in replies.items():
            ids[parts[s]] = global_ids(s, rows)
            self._unflushed[s] += rows.size
        return torch.from_numpy(ids)

    def _route(self, data: TensorDictBase, n: int) -> np.ndarray:
        live = self._live()
        if not live:
            raise ShardFailedError(f"every shard of this store is dead ({self.failures[-1:]}); nothing can be written")
        if self.traj_key is not None and self.traj_key in data.keys(include_nested=True):
            traj = data.get(self.traj_key).reshape(n, -1)[:, 0].numpy().astype(np.int64)
            shard_of = np.mod(traj, self.num_shards)
            if self.dead:  # rows of dead shards (no path) go to live ones, still by trajectory
                shard_of = np.asarray(live)[np.mod(traj, len(live))]
            return shard_of
        self._next = (self._next + 1) % len(live)
        return np.full(n, live[self._next], dtype=np.int64)

    def update_priority(self, ids: Any, priority: Any) -> None:
        """Set raw priorities of global row ids (each shard gets its rows).

        Acknowledged when every shard has taken them, not when they are durable: like rows, they
        are committed by the next :meth:`flush`. A shard that dies before it restarts with the
        priorities of its last commit, and the failure counts the updates it lost
        (``lost_priority_updates``), as it counts lost rows."""
        shard, rows = split_ids(ids)
        # checked before any state changes, the error naming the global ids
        p = checked_row_priorities((shard << SHARD_SHIFT) | rows, priority)
        if p.size:
            self._max_priority = max(self._max_priority, float(p.max()))
        parts = _group(shard, self.num_shards)
        refs = {s: self.actors[s].update_priority.remote(rows[pos], p[pos]) for s, pos in parts.items()
                if s not in self.dead}
        # committed by each shard's next flush; counted until then (also when another shard fails)
        self._run(refs, "update_priority", read=True, acknowledged={s: parts[s].size for s in refs})

    def flush(self) -> None:
        """Commit every shard (with a path, what was written survives a shard's crash)."""
        self._run({s: self.actors[s].flush.remote() for s in self._live()}, "flush", read=False)
        self._unflushed[:] = 0
        self._unflushed_priorities[:] = 0

    def close(self) -> None:
        """Flush and close every live shard, then end the actors (also when a shard fails to close).
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._run({s: self.actors[s].close.remote() for s in self._live()}, "close", read=True, unpack=None)
        finally:
            for a in self.actors:
                self._ray.kill(a)

    # A copy sent to another process (a collector) shares the actors; its bookkeeping is its own.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_ray"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ray = require_ray()

    # -- reads ------------------------------------------------------------------------------------
    def get(self, ids: Any, keys: Any = None, *, transport: str | None = None) -> TensorDictBase:
        """The rows of global ids, in their order (``transport`` as the constructor's)."""
        transport = self._transport(transport)
        shard, rows = split_ids(ids)
        parts = _group(shard, self.num_shards)
        gone = sorted(self.dead.intersection(parts))
        if gone:
            raise ShardFailedError(f"get: shard {gone[0]} is dead and had no path: its rows are gone "
                                   f"({len(parts[gone[0]])} of the ids asked for)", shard=gone[0])
        refs = {s: self.actors[s].get.remote(rows[pos], keys, transport) for s, pos in parts.items()}
        replies = self._run(refs, "get", read=False, unpack=None)
        return self._assemble({s: replies[s] for s in parts}, parts, rows.size)

    def sample(self, batch_size: int, *, prioritized: bool = False, keys: Any = None,
               transport: str | None = None) -> tuple[TensorDictBase, dict[str, torch.Tensor]]:
        """Draw ``batch_size`` rows over every shard (see the module docstring).

        Returns:
            ``(data, info)``: ``info["index"]`` the global ids; with ``prioritized``, also
            ``"probability"`` and ``"priority_weight"`` (float64).
        """
        return self._sample(batch_size, prioritized, keys, self._transport(transport))

    def sample_ids(self, batch_size: int, *, prioritized: bool = False) -> dict[str, torch.Tensor]:
        """As :meth:`sample`, without the data (``info`` only)."""
        return self._sample(batch_size, prioritized, None, None)[1]

    def probabilities(self, ids: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampling probability and importance weight of global ids under prioritized sampling."""
        shard, rows = split_ids(ids)
        parts = _group(shard, self.num_shards)
        refs = {s: self.actors[s].sample.remote(None, rows[pos], None, None) for s, pos in parts.items()}
        replies = self._run(refs, "probabilities", read=False, unpack=lambda r: r[3])
        leaves = np.empty(rows.size, dtype=np.float64)
        for s, pos in parts.items():
            leaves[pos] = replies[s][1]
        return self._weights(leaves)

    def _transport(self, transport: str | None) -> str:
        transport = self.transport if transport is None else transport
        _check_choice("transport", transport, _TRANSPORTS)
        return transport

    def _weights(self, leaves: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        live = [self._status[s] for s in self._live()]
        total, low = sum(s.total for s in live), min(s.min for s in live)
        return torch.from_numpy(leaves / total), torch.from_numpy(np.power(leaves / low, -self.beta))

    def _draw(self, batch_size: int, prioritized: bool) -> tuple[np.ndarray, np.ndarray]:
        """Each draw's shard, and its mass (prioritized) or row (uniform) within that shard."""
        live = np.zeros(self.num_shards, dtype=bool)
        live[self._live()] = True
        if prioritized:
            weight = np.array([s.total if s.rows else 0.0 for s in self._status]) * live
            what = "priority mass"
            point = self._rng.random(batch_size) * weight.sum()
        else:
            weight = np.array([s.rows for s in self._status], dtype=np.float64) * live
            what = "rows"
            point = self._rng.integers(0, max(int(weight.sum()), 1), batch_size).astype(np.float64)
        if weight.sum() <= 0:
            raise ShardFailedError(f"no live shard holds any {what} to sample from (shards {self.shard_rows()} rows, "
                                   f"dead {sorted(self.dead)}); write rows first")
        ends = np.cumsum(weight)
        shard = np.searchsorted(ends, point, side="right")
        shard = np.minimum(shard, int(np.flatnonzero(weight > 0)[-1]))
        local = point - (ends - weight)[shard]
        return shard, local if prioritized else local.astype(np.int64)

    def _sample(self, batch_size: int, prioritized: bool, keys: Any,
                transport: str | None) -> tuple[TensorDictBase, dict[str, torch.Tensor]]:
        for _ in range(self.num_shards + 1):  # "skip": a failure redraws over the shards left
            shard, local = self._draw(int(batch_size), prioritized)
            parts = _group(shard, self.num_shards)
            refs = {s: self.actors[s].sample.remote(local[pos] if prioritized else None,
                                                    None if prioritized else local[pos], keys, transport)
                    for s, pos in parts.items()}
            replies = self._run(refs, "sample", read=True, unpack=lambda r: r[3])
            if len(replies) == len(refs):
                break
        else:
            raise ShardFailedError(f"sample: shards kept failing ({self.failures[-self.num_shards:]})")
        ids = np.empty(shard.size, dtype=np.int64)
        leaves = np.empty(shard.size, dtype=np.float64)
        for s, pos in parts.items():
            ids[pos] = global_ids(s, replies[s][0])
            leaves[pos] = replies[s][1]
        info = {"index": torch.from_numpy(ids)}
        if prioritized:
            info["probability"], info["priority_weight"] = self._weights(leaves)
        data = None if transport is None else self._assemble({s: r[2] for s, r in replies.items()}, parts, ids.size)
        return data, info

    def _assemble(self, pieces: dict[int, Any], parts: dict[int, np.ndarray], n: int) -> TensorDictBase:
        """One TensorDict in the requested order from per-shard pieces, each written once into it
        (compressed pieces decoded straight into their places: no concatenation, no reorder)."""
        shards = sorted(pieces)
        if all(isinstance(pieces[s], CompressedRows) for s in shards):
            return decode_batch([pieces[s] for s in shards], [parts[s] for s in shards])
        first = pieces[shards[0]]
        if len(shards) == 1 and np.array_equal(parts[shards[0]], np.arange(n)):
            return first
        keys = list(first.keys(True, True))
        cells = {k: torch.empty((n, *first.get(k).shape[1:]), dtype=first.get(k).dtype) for k in keys}
        for s in shards:
            at = torch.from_numpy(parts[s])
            for k in keys:  # as same-size integers: torch cannot index_put uint16/32/64 and float8
                as_bits(cells[k])[at] = as_bits(pieces[s].get(k))
        return TensorDict(cells, [n])

    # -- failures ---------------------------------------------------------------------------------
    def _run(self, refs: dict[int, Any], op: str, *, read: bool, unpack: Any = "status",
             acknowledged: dict[int, int] | None = None) -> dict[int, Any]:
        """Wait for every shard's reply; note each new status (and, per shard that replied, its
        ``acknowledged`` priority updates); handle dead shards (see the module)."""
        replies, failed = {}, []
        self.calls[op] = self.calls.get(op, 0) + len(refs)
        for s, ref in refs.items():
            try:
                replies[s] = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as e:
                failed.append((s, e))
        for s, reply in replies.items():
            status = reply if unpack == "status" else (unpack(reply) if unpack is not None else None)
            if isinstance(status, ShardStatus):
                self._status[s] = status
            if acknowledged is not None:
                self._unflushed_priorities[s] += acknowledged[s]
        if failed:
            records = [self._recover(s, e) for s, e in failed]
            if not read or self.on_shard_failure == "raise":
                raise _failure_error(records[0], op, self.paths[records[0].shard])
            warnings.warn(f"{op}: {_describe(records[0], self.paths[records[0].shard])}; going on with the live shards",
                          RuntimeWarning, stacklevel=3)
        return replies

    def _recover(self, shard: int, error: BaseException) -> ShardFailure:
        before = self._status[shard].rows
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if self.paths[shard] is None:
            self.dead.add(shard)
            self._status[shard] = ShardStatus(0, 0.0, np.inf, 1.0)
            record = ShardFailure(shard, message, False, before, before, 0,
                                  int(self._unflushed_priorities[shard]))
        else:
            self.actors[shard] = self._start(shard, reopen=True)
            self._status[shard] = self._ray.get(self.actors[shard].status.remote())
            record = ShardFailure(shard, message, True, int(self._unflushed[shard]), before, self._status[shard].rows,
                                  int(self._unflushed_priorities[shard]))
            self._unflushed[shard] = 0
        self._unflushed_priorities[shard] = 0
        self.failures.append(record)
        return record

    def restart_shard(self, shard: int) -> ShardFailure:
        """Kill shard ``shard``'s actor if alive and restart it from its directory (a test of recovery)."""
        self._ray.kill(self.actors[shard])
        return self._recover(shard, RuntimeError("restarted by restart_shard"))


def _group(shard: np.ndarray, num_shards: int) -> dict[int, np.ndarray]:
    """Positions of each shard's items (shards with none left out): one argsort, no loop over items."""
    order = np.argsort(shard, kind="stable")
    counts = np.bincount(shard, minlength=num_shards)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return {s: order[bounds[s]:bounds[s + 1]] for s in np.flatnonzero(counts).tolist()}


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidArgumentError(f"{name} must be one of {list(choices)}, got {value!r}")


def _describe(r: ShardFailure, path: str | None) -> str:
    where = f"directory {path!r}" if path else "in memory"
    if r.restarted:
        what = (f"restarted from its last commit with {r.rows_after} rows; {r.lost_rows} row(s) written and "
                f"{r.lost_priority_updates} priority update(s) made since its last flush were lost (its rows have "
                "their last committed priorities; flush() more often to lose fewer)")
    else:
        what = (f"it had no path, so its {r.lost_rows} row(s) are gone and it is left out from now on "
                "(give the store a path to restart shards from their files)")
    return f"shard {r.shard} ({where}) died ({r.error}): {what}"


def _failure_error(r: ShardFailure, op: str, path: str | None) -> ShardFailedError:
    return ShardFailedError(
        f"{op}: {_describe(r, path)}. Retry the call, or pass on_shard_failure='skip' to let reads go on with "
        "the live shards.", shard=r.shard, lost_rows=r.lost_rows, restarted=r.restarted,
        lost_priority_updates=r.lost_priority_updates)
