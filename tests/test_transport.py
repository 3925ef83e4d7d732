"""Compressed transport without Ray: ``TieredStore.get_compressed`` + ``decode_rows`` give what ``get`` gives.

Covered: stored blobs, open time chunks (compressed for the trip, the store keeps them open),
staged rows (compressed first), several frame families and dense fields, damage on the way.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tiered import TieredStore
from tiered.engine.transport import decode_rows
from tiered.errors import ChecksumError


def rows(n: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, 4, (n + 4, 24, 24), dtype=torch.uint8, generator=g)
    t = torch.arange(n)
    return TensorDict({
        "obs": torch.stack([frames[t + k] for k in range(4)], 1),
        ("next", "obs"): torch.stack([frames[t + 1 + k] for k in range(4)], 1),
        "depth": torch.rand(n, 32, 32, generator=g),           # a second family (float32 cells)
        "action": torch.randint(0, 6, (n,), generator=g),
        ("collector", "traj_ids"): t // 10,
    }, [n])


def assert_same(a: TensorDict, b: TensorDict) -> None:
    assert list(a.keys(True, True)) == list(b.keys(True, True))
    for k in b.keys(True, True):
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("chunk_frames", [1, 4])
def test_compressed_rows_decode_to_what_get_returns(chunk_frames):
    store = TieredStore(200, frames={"obs": 0}, chunk_frames=chunk_frames, stage_rows=64)
    store.extend(rows(57))               # the last trajectory's chunks stay open
    store.extend(rows(3, seed=1))        # a small write: staged
    idx = np.array([0, 56, 58, 13, 13, 59, 2])
    packed = store.get_compressed(idx)
    assert all(f.blobs.open_pos.size == 0 for f in packed.families)   # nothing raw is sent
    assert_same(decode_rows(packed), store.get(idx))
    assert_same(decode_rows(pickle.loads(pickle.dumps(packed))), store.get(idx))  # as it crosses a process
    assert_same(decode_rows(store.get_compressed(idx, keys=["obs"]), index_key="index"),
                store.get(idx, keys=["obs"], index_key="index"))


def test_damage_on_the_way_is_caught():
    store = TieredStore(100, frames={"obs": 0})
    store.extend(rows(40))
    store.flush()
    packed = store.get_compressed([1, 2, 30])
    packed.families[0].blobs.comp[5] ^= 0xFF
    with pytest.raises(ChecksumError, match="after transport"):
        decode_rows(packed)
