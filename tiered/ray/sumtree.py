"""A sum tree and a min tree over one shard's rows, in numpy, for exact prioritized sampling.

Leaves hold ``(priority + eps) ** alpha`` for written rows and are empty otherwise (0 in the sum
tree, ``inf`` in the min tree). Updates and searches are vectorized level by level: a batch of
``B`` updates or searches costs ``log2(capacity)`` numpy calls, never a Python loop over items.

Example:
    >>> import numpy as np
    >>> from tiered.ray.sumtree import SumMinTree
    >>> t = SumMinTree(5)
    >>> t.update(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    >>> t.total, t.min
    (10.0, 1.0)
    >>> t.find(np.array([0.5, 1.0, 9.99])).tolist()
    [0, 1, 3]
"""

from __future__ import annotations

import numpy as np

__all__ = ["SumMinTree"]


class SumMinTree:
    """Sum and min over ``capacity`` leaves (float64).

    Args:
        capacity: number of leaves (rows of the shard).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.size = 1 << max(0, (self.capacity - 1).bit_length())
        self.sums = np.zeros(2 * self.size, dtype=np.float64)
        self.mins = np.full(2 * self.size, np.inf, dtype=np.float64)

    @property
    def total(self) -> float:
        """Sum of every leaf."""
        return float(self.sums[1]) if self.size > 1 else float(self.sums[self.size])

    @property
    def min(self) -> float:
        """Smallest non-empty leaf (``inf`` when all are empty)."""
        return float(self.mins[1]) if self.size > 1 else float(self.mins[self.size])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        """The leaf values of ``idx`` (0 for empty leaves)."""
        return self.sums[self.size + np.asarray(idx, dtype=np.int64)]

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` to ``values`` (duplicates: the last wins); ``nan`` empties a leaf."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        values = np.broadcast_to(np.asarray(values, dtype=np.float64), idx.shape)
        if idx.size == 0:
            return
        uniq, first = np.unique(idx[::-1], return_index=True)
        vals = values[::-1][first]
        empty = np.isnan(vals)
        node = uniq + self.size
        self.sums[node] = np.where(empty, 0.0, vals)
        self.mins[node] = np.where(empty, np.inf, vals)
        while node[0] > 1:
            node = np.unique(node >> 1)
            self.sums[node] = self.sums[2 * node] + self.sums[2 * node + 1]
            self.mins[node] = np.minimum(self.mins[2 * node], self.mins[2 * node + 1])

    def clear(self) -> None:
        """Empty every leaf."""
        self.sums[:] = 0.0
        self.mins[:] = np.inf

    def find(self, mass: np.ndarray) -> np.ndarray:
        """For each ``mass`` in ``[0, total)``, the leaf ``i`` with ``prefix(i) <= mass < prefix(i + 1)``
        (a mass at or past the total lands on the last non-empty leaf)."""
        mass = np.minimum(np.asarray(mass, dtype=np.float64).reshape(-1), np.nextafter(self.total, 0.0))
        node = np.ones(mass.shape, dtype=np.int64)
        if self.size == 1 or mass.size == 0:
            return np.zeros(mass.shape, dtype=np.int64)
        while node[0] < self.size:
            left = 2 * node
            left_sum = self.sums[left]
            right = (mass >= left_sum) & (self.sums[left + 1] > 0)
            mass = np.where(right, mass - left_sum, mass)
            node = np.where(right, left + 1, left)
        return node - self.size
