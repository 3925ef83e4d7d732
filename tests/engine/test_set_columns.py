"""``TieredStore.set_columns``: some dense fields of written rows rewritten in their columns, the
frames left alone (not read, decoded or compressed again), and ``rb.set_at_`` through it; every
write it does not take leaves the store unchanged and says so (False), so the caller writes rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.errors import LossyValueError
from tiered.testing import parts

N = 300


def _frames_state(store: TieredStore) -> tuple[int, bytes]:
    """The blobs decoded so far, and the blob index's bytes (a frame written again changes them)."""
    index = parts(store).index
    return (store.stats()["counters"]["blobs_decoded"],
            index.state.tobytes() + index.refcount.tobytes() + index.checksum.tobytes())


def _store(atari_pong, **kw) -> tuple[TieredStore, TensorDict]:
    data = atari_pong[:N].clone()
    data["advantage"] = torch.randn(N)
    store = TieredStore(1000, frames={"observation": 0}, **kw)
    store.extend(data)
    return store, data


def test_set_columns_rewrites_those_columns_and_no_frame(atari_pong):
    store, data = _store(atari_pong)
    before = _frames_state(store)
    rows = torch.tensor([3, 150, 299, 0])
    new = TensorDict({"advantage": torch.tensor([1.5, -2.0, 3.25, 0.5]),
                      "next": {"reward": torch.tensor([[7.0], [8.0], [9.0], [10.0]])}}, [4])
    assert store.set_columns(rows, new)
    assert _frames_state(store) == before  # no frame decoded or written, no blob touched
    expect = data.clone()
    expect["advantage"][rows] = new["advantage"]
    expect["next", "reward"][rows] = new["next", "reward"]
    got = store.get(torch.arange(N))
    for key in expect.keys(True, True):
        assert torch.equal(got[key], expect[key]), key
    assert len(store) == N


def test_set_columns_takes_only_what_a_column_write_can_stand_for(atari_pong):
    store, data = _store(atari_pong)
    two = torch.tensor([1, 2])
    refused = {
        "a frame field": TensorDict({"observation": data["observation"][:2]}, [2]),
        "a flag bit": TensorDict({"next": {"terminated": torch.ones(2, 1, dtype=torch.bool)}}, [2]),
        "a done key": TensorDict({"done": torch.ones(2, 1, dtype=torch.bool)}, [2]),
        "the trajectory key": TensorDict({"collector": {"traj_ids": torch.zeros(2, dtype=torch.int64)}}, [2]),
        "an unknown key": TensorDict({"value": torch.zeros(2)}, [2]),
        "another shape": TensorDict({"advantage": torch.zeros(2, 3)}, [2]),
    }
    snapshot = store.get(torch.arange(N))
    for why, td in refused.items():
        assert not store.set_columns(two, td), why
    assert not store.set_columns(torch.tensor([5, 5]), TensorDict({"advantage": torch.zeros(2)}, [2])), "repeats"
    assert not store.set_columns(torch.tensor([5, 600]), TensorDict({"advantage": torch.zeros(2)}, [2])), "unwritten"
    after = store.get(torch.arange(N))
    assert all(torch.equal(after[k], snapshot[k]) for k in snapshot.keys(True, True))


def test_set_columns_widens_a_narrowed_column_and_refuses_what_a_forced_dtype_cannot_hold(atari_pong):
    store, data = _store(atari_pong, dense_dtypes={("next", "reward"): torch.int8})
    assert str(parts(store).rows.dense[("action",)].dtype) == "torch.uint8"  # Pong's 6 actions, narrowed
    assert store.set_columns(torch.tensor([4, 9]), TensorDict({"action": torch.tensor([70_000, -3])}, [2]))
    got = store.get(torch.arange(N))["action"]
    expect = data["action"].clone()
    expect[[4, 9]] = torch.tensor([70_000, -3])
    assert torch.equal(got, expect) and got.dtype == torch.int64
    before = store.get(torch.arange(N))
    with pytest.raises(LossyValueError, match="next/reward"):
        store.set_columns(torch.tensor([1]), TensorDict({"next": {"reward": torch.tensor([[300.0]])}}, [1]))
    after = store.get(torch.arange(N))
    assert all(torch.equal(after[k], before[k]) for k in before.keys(True, True))


def test_set_columns_of_staged_rows_and_after_a_commit(atari_pong, tmp_path):
    data = atari_pong[:40].clone()
    data["advantage"] = torch.zeros(40)
    with TieredStore(100, tmp_path / "s", frames={"observation": 0}) as store:
        store.extend(data[:30])
        for k in range(30, 40):  # one-row adds: they wait in the write stage
            store.extend(data[k:k + 1])
        assert store.set_columns(np.arange(25, 40), TensorDict({"advantage": torch.arange(15.0)}, [15]))
        store.flush()
    with tiered.open(tmp_path / "s") as ro:
        got = ro.get(torch.arange(40))
    assert torch.equal(got["advantage"][25:], torch.arange(15.0)) and not got["advantage"][:25].any()
    assert torch.equal(got["observation"], data["observation"])
    assert torch.equal(got["next", "observation"], data["next", "observation"])


def test_rb_set_at_of_an_advantage_matches_lazy_tensor_storage_and_decodes_no_frame(atari_pong):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    data = atari_pong[:N].clone()
    data["advantage"] = torch.zeros(N)
    tiered_rb = TensorDictReplayBuffer(storage=TieredStorage(N))
    lazy_rb = TensorDictReplayBuffer(storage=LazyTensorStorage(N))
    for rb in (tiered_rb, lazy_rb):
        rb.extend(data)
    store = tiered_rb.storage.store
    before = _frames_state(store)
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(0))[:128]
    values = torch.randn(128, generator=torch.Generator().manual_seed(1))
    for rb in (tiered_rb, lazy_rb):
        rb.set_at_("advantage", values, idx)
    assert _frames_state(store) == before
    a, b = tiered_rb[:], lazy_rb[:]
    for key in b.keys(True, True):
        if key != "index":
            assert torch.equal(a[key], b[key]), key
