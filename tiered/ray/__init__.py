"""tiered on Ray: a replay buffer sharded over Ray actors, sampled as one buffer.

:class:`ShardedStore` runs N actors, each owning one :class:`~tiered.TieredStore` shard (its own
directory with a path). Writes are routed by trajectory; sampling is uniform or exact global
prioritized (one sum tree per shard, the shard totals on the driver); shards return decoded
rows or their compressed blobs, decoded in the learner's process. A dead shard is reported
(:class:`~tiered.errors.ShardFailedError`), restarted from its last commit, and reads can go on
without it. :class:`ShardedStorage` and :class:`ShardedSampler` plug it into TorchRL replay
buffers. See docs/distributed.md.

Ray is an optional extra (``pip install "tiered[ray]"``): it is imported when a
:class:`ShardedStore` is built, with that advice if it is missing.

Modules: :mod:`~tiered.ray.client` (the driver), :mod:`~tiered.ray.shard` (the actor's class),
:mod:`~tiered.ray.sumtree`, :mod:`~tiered.ray.storage` (TorchRL).
"""

from __future__ import annotations

from .client import SHARD_SHIFT, ShardedStore, ShardFailure, global_ids, require_ray, split_ids
from .shard import ShardServer, ShardStatus

__all__ = ["ShardedStore", "ShardFailure", "ShardServer", "ShardStatus", "global_ids", "split_ids",
           "require_ray", "SHARD_SHIFT"]
