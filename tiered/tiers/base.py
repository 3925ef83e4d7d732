"""The tier contract.

A tier is a byte arena with an allocator and a byte budget. It stores compressed blobs at
offsets it chooses and gives them back in batches. Tiers know nothing of codecs, rows or
policies: the store decides *what* goes where; a tier only keeps bytes.

Batches are laid out like codec batches: ``offsets``/``sizes`` int64 arrays, one entry per
blob, and one contiguous source or destination buffer. No method loops over blobs in
Python when the work can be done by one vectorized copy.

Every tier passes the conformance suite in ``tests/tiers/test_tiers.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

__all__ = ["Tier"]


class Tier(ABC):
    """A byte arena under a budget.

    Attributes:
        name: ``"hot"``, ``"warm"`` or ``"cold"``.
        budget: the most bytes this tier may hold (``None``: unbounded, e.g. a disk tier).
        device: the torch device the arena's bytes live on (``cpu`` for host and file tiers).
    """

    name: str
    budget: int | None
    device: torch.device

    @abstractmethod
    def allocate(self, sizes: np.ndarray) -> np.ndarray:
        """Reserve space for blobs of ``sizes`` bytes; return their int64 offsets.

        Either every blob gets space or none does: if the batch does not fit under the budget,
        raise :class:`tiered.errors.StorageFullError` and leave the tier unchanged.
        """

    @abstractmethod
    def write(self, offsets: np.ndarray, data: np.ndarray | torch.Tensor, src_offsets: np.ndarray,
              sizes: np.ndarray) -> None:
        """Copy blob ``i`` from ``data[src_offsets[i]:+sizes[i]]`` to this tier at ``offsets[i]``."""

    @abstractmethod
    def read(self, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray | torch.Tensor,
             out_offsets: np.ndarray) -> None:
        """Copy blob ``i`` (at ``offsets[i]``, ``sizes[i]`` bytes) into ``out[out_offsets[i]:]``."""

    @abstractmethod
    def free(self, offsets: np.ndarray, sizes: np.ndarray, *, defer: bool = False) -> None:
        """Release the space of these blobs so that later allocations can reuse it.

        ``defer=True`` asks to reuse the space only after the next durable commit; tiers that
        lose their contents with the process (memory arenas) ignore it.
        """

    @property
    @abstractmethod
    def bytes_used(self) -> int:
        """Bytes currently allocated to live blobs (aligned sizes)."""

    def flush(self) -> None:  # noqa: B027 - memory tiers have nothing to flush
        """Make every write so far durable (file tiers); a no-op for memory tiers."""

    def close(self) -> None:  # noqa: B027
        """Release file handles and memory."""

    def stats(self) -> dict[str, Any]:
        """``bytes_used``, ``budget`` and ``fragmentation`` (0..1) of the arena."""
        return {"bytes_used": self.bytes_used, "budget": self.budget, "fragmentation": 0.0}
