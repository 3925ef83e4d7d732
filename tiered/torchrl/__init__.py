"""TieredStorage: a TorchRL replay-buffer storage backed by a :class:`~tiered.TieredStore`.

A drop-in for ``LazyTensorStorage``, ``LazyMemmapStorage`` and ``CompressedListStorage``:
frames are stored compressed (and deduplicated) by the store, everything else about the
replay buffer (samplers, writers, priorities, ``dumps``/``loads``) is TorchRL's own.

The package: :mod:`~tiered.torchrl.storage` (the storage), :mod:`~tiered.torchrl.forms` (the
forms data comes in), :mod:`~tiered.torchrl.columns` (fields added after the first write),
:mod:`~tiered.torchrl.views` (lazy views of rows), :mod:`~tiered.torchrl.checkpoint`.

``torchrl`` is an optional extra (``pip install 'tiered[torchrl]'``); this package imports it.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import TensorDictReplayBuffer
    >>> from tiered.torchrl import TieredStorage
    >>> rb = TensorDictReplayBuffer(storage=TieredStorage(1000, frames={"observation": 0}), batch_size=8)
    >>> td = TensorDict({
    ...     "observation": torch.randint(0, 4, (64, 4, 84, 84), dtype=torch.uint8),
    ...     "action": torch.arange(64),
    ... }, batch_size=[64])
    >>> _ = rb.extend(td)
    >>> rb.sample()["observation"].shape
    torch.Size([8, 4, 84, 84])
"""

from __future__ import annotations

try:
    import torchrl  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tiered.torchrl needs TorchRL: pip install 'tiered[torchrl]' (torchrl>=0.9)") from e

from .checkpoint import TieredStorageCheckpointer
from .storage import TieredStorage

__all__ = ["TieredStorage", "TieredStorageCheckpointer"]
