"""A :class:`~tiered.ray.ShardedStore` as a TorchRL replay buffer in the learner's process.

TorchRL's own samplers draw positions in ``[0, len(storage))`` and keep their own sum tree; a
sharded store samples where its rows live, so the three parts come together:

* :class:`ShardedStorage`: reads rows by global id (and returns the rows of the last sample
  without a second round trip);
* :class:`ShardedSampler`: uniform or exact global prioritized sampling by the shards, with
  ``priority_weight`` in the sample info; ``update_priority`` goes to the owning shards;
* :class:`ShardedWriter`: ``rb.extend`` routes rows to shards by trajectory.

:func:`sharded_replay_buffer` builds a ``TensorDictReplayBuffer`` from them. Writers elsewhere
(collectors on other nodes) push to the same shards through :meth:`ShardedStore.extend` on
their own copy of the store handle, or straight to the actors.

Example:
    >>> import ray, torch
    >>> from tensordict import TensorDict
    >>> from tiered.ray import ShardedStore
    >>> from tiered.ray.storage import sharded_replay_buffer
    >>> _ = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    >>> store = ShardedStore(2, 100, frames={"obs": 0}, actor_options={"num_cpus": 0})
    >>> rb = sharded_replay_buffer(store, batch_size=8, prioritized=True, priority_key="td_error")
    >>> _ = rb.extend(TensorDict({"obs": torch.zeros(16, 4, 8, 8, dtype=torch.uint8),
    ...                           ("collector", "traj_ids"): torch.arange(16) // 8}, [16]))
    >>> batch = rb.sample()
    >>> batch["obs"].shape, batch["priority_weight"].shape
    (torch.Size([8, 4, 8, 8]), torch.Size([8]))
    >>> batch["td_error"] = torch.rand(8)
    >>> rb.update_tensordict_priority(batch)
    >>> store.close(); ray.shutdown()
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

try:
    from torchrl.data import TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import Sampler
    from torchrl.data.replay_buffers.storages import Storage
    from torchrl.data.replay_buffers.writers import Writer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("tiered.ray.storage needs TorchRL: pip install 'tiered[torchrl,ray]'") from e

from ..errors import InvalidArgumentError
from .client import ShardedStore

__all__ = ["ShardedStorage", "ShardedSampler", "ShardedWriter", "ShardedReplayBuffer", "sharded_replay_buffer"]


class ShardedStorage(Storage):
    """TorchRL storage over a :class:`ShardedStore`; indices are global row ids.

    Args:
        store: the sharded store.
        transport: how shards return rows (default: the store's).
    """

    def __init__(self, store: ShardedStore, transport: str | None = None) -> None:
        super().__init__(max_size=store.num_shards * store.shard_capacity)
        self.store = store
        self.transport = transport
        self.last: tuple[torch.Tensor, TensorDictBase] | None = None

    def __len__(self) -> int:
        return len(self.store)

    def get(self, index: Any) -> TensorDictBase:
        if self.last is not None and index is self.last[0]:
            data, self.last = self.last[1], None
            return data
        return self.store.get(index, transport=self.transport)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        raise InvalidArgumentError("a ShardedStorage is written through ShardedWriter (rb.extend) or "
                                   "ShardedStore.extend, which route rows to shards; positions cannot be set")

    def sample(self, batch_size: int, prioritized: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sample ids and rows in one round trip; the next :meth:`get` of these ids returns the rows."""
        data, info = self.store.sample(batch_size, prioritized=prioritized, transport=self.transport)
        index = info.pop("index")
        self.last = (index, data)
        return index, info

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def _empty(self) -> None:
        raise InvalidArgumentError("a ShardedStorage cannot be emptied from the learner; close the store")


class _StatelessParts:
    """Checkpoint hooks of the TorchRL parts that hold no state of their own: the shards'
    directories hold everything (:meth:`ShardedStore.flush`)."""

    def dumps(self, path: Any) -> None:
        return None

    def loads(self, path: Any) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class ShardedSampler(_StatelessParts, Sampler):
    """Uniform or exact global prioritized sampling by the shards (with :class:`ShardedStorage`).

    Args:
        store: the sharded store (its ``alpha``, ``beta`` and ``eps`` apply).
        prioritized: sample by priority (info gets ``priority_weight``) or uniformly.
    """

    def __init__(self, store: ShardedStore, prioritized: bool = False) -> None:
        super().__init__()
        self.store = store
        self.prioritized = bool(prioritized)

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if isinstance(storage, ShardedStorage):
            index, info = storage.sample(batch_size, self.prioritized)
        else:
            info = self.store.sample_ids(batch_size, prioritized=self.prioritized)
            index = info.pop("index")
        info.pop("probability", None)
        return index, info

    def update_priority(self, index: Any, priority: Any, *, storage: Storage | None = None) -> None:
        if self.prioritized:
            self.store.update_priority(index, priority)

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        return None

    @property
    def default_priority(self) -> float:
        return 1.0

    def _empty(self) -> None:
        return None



class ShardedWriter(_StatelessParts, Writer):
    """``rb.extend`` / ``rb.add`` through :meth:`ShardedStore.extend` (routed by trajectory)."""

    def __init__(self, store: ShardedStore) -> None:
        super().__init__()
        self.store = store

    def add(self, data: Any) -> torch.Tensor:
        return self.store.extend(data.unsqueeze(0))[0]

    def extend(self, data: Any) -> torch.Tensor:
        return self.store.extend(data)

    def _empty(self, empty_write_count: bool = True) -> None:
        return None



class ShardedReplayBuffer(TensorDictReplayBuffer):
    """A ``TensorDictReplayBuffer`` whose ``update_tensordict_priority`` reaches a
    :class:`ShardedSampler` (TorchRL's only updates its own ``PrioritizedSampler``)."""

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        sampler = self.sampler
        if not isinstance(sampler, ShardedSampler) or not sampler.prioritized:
            return super().update_tensordict_priority(data)
        priority = data.get(self.priority_key).detach().reshape(data.shape[0], -1).amax(-1)
        sampler.update_priority(data.get("index"), priority)


def sharded_replay_buffer(store: ShardedStore, *, batch_size: int | None = None, prioritized: bool = False,
                          transport: str | None = None, **kwargs: Any) -> ShardedReplayBuffer:
    """A :class:`ShardedReplayBuffer` over ``store`` (see the module docstring; ``kwargs`` go to
    ``TensorDictReplayBuffer``, e.g. ``priority_key``, ``transform``, ``prefetch``)."""
    return ShardedReplayBuffer(storage=ShardedStorage(store, transport), sampler=ShardedSampler(store, prioritized),
                                  writer=ShardedWriter(store), batch_size=batch_size,
                                  collate_fn=_identity, **kwargs)


def _identity(data: Any) -> Any:
    return data
