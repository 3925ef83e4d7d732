"""The shard sum/min tree of tiered.ray against numpy over the same leaves (no Ray needed)."""

from __future__ import annotations

import numpy as np
import pytest

from tiered.ray.sumtree import SumMinTree


@pytest.mark.parametrize("capacity", [1, 2, 7, 64, 1000])
def test_tree_matches_numpy(capacity):
    rng = np.random.default_rng(capacity)
    tree = SumMinTree(capacity)
    leaves = np.zeros(capacity)
    ever = np.zeros(capacity, dtype=bool)  # leaves given a value (the min tree counts them, 0 included)
    for _ in range(5):
        idx = rng.integers(0, capacity, 3 * capacity)          # with repeats: the last one wins
        vals = rng.integers(0, 5, idx.size).astype(np.float64)  # integers: sums are exact; 0 = empty-ish
        tree.update(idx, vals)
        rev_unique, first = np.unique(idx[::-1], return_index=True)
        leaves[rev_unique] = vals[::-1][first]
        ever[idx] = True
        assert tree.total == leaves.sum()
        assert tree.min == leaves[ever].min()
        assert np.array_equal(tree.leaves(np.arange(capacity)), leaves)
        if leaves.sum() > 0:
            mass = rng.random(256) * leaves.sum()
            expected = np.searchsorted(np.cumsum(leaves), mass, side="right")
            found = tree.find(mass)
            assert np.array_equal(found, expected)
            assert (leaves[found] > 0).all()  # a mass never lands on an empty leaf


def test_nan_empties_a_leaf_and_clear():
    tree = SumMinTree(4)
    tree.update(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    tree.update(np.array([0]), np.array([np.nan]))
    assert (tree.total, tree.min) == (9.0, 2.0)
    assert tree.find(np.array([0.0, 8.99])).tolist() == [1, 3]
    tree.clear()
    assert (tree.total, tree.min) == (0.0, np.inf)
    assert tree.find(np.empty(0)).size == 0
