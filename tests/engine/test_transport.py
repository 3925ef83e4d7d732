"""Compressed transport without Ray: ``TieredStore.get_compressed`` + ``decode_rows`` give what ``get`` gives.

Covered: stored blobs, open time chunks (compressed for the trip, the store keeps them open),
staged rows (sent raw, the stage left as it is), several frame families and dense fields, damage
on the way, repacked blobs (only the frames the rows use), and several pieces decoded into one
batch in request order.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tiered import TieredStore
from tiered.engine.transport import decode_batch, decode_rows
from tiered.errors import ChecksumError, InvalidArgumentError


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


def stage_state(store: TieredStore) -> dict:
    st = store.stats()
    return {"staged": st["staged_rows"], "blobs": st["blobs"], "open": st["memory"]["open_chunks"]}


@pytest.mark.parametrize("repack", [False, True])
@pytest.mark.parametrize("chunk_frames", [1, 4])
def test_compressed_rows_decode_to_what_get_returns(chunk_frames, repack):
    store = TieredStore(200, frames={"obs": 0}, chunk_frames=chunk_frames, stage_rows=64)
    store.extend(rows(57))               # the last trajectory's chunks stay open
    store.extend(rows(3, seed=1))        # a small write: staged
    before = stage_state(store)
    assert before["staged"] == 3
    idx = np.array([0, 56, 58, 13, 13, 59, 2])
    packed = store.get_compressed(idx, repack=repack)
    assert stage_state(store) == before   # nothing flushed, nothing compressed into the store
    assert packed.staged_pos.tolist() == [2, 5]   # rows 58 and 59 travel raw
    assert {k: v.shape[0] for k, v in packed.staged.items()} == {("obs",): 2, ("next", "obs"): 2, ("depth",): 2}
    assert all(f.blobs.open_pos.size == 0 for f in packed.families)   # no other raw frames are sent
    expected = store.get(idx)
    assert_same(decode_rows(packed), expected)
    assert_same(decode_rows(pickle.loads(pickle.dumps(packed))), expected)  # as it crosses a process
    assert_same(decode_rows(store.get_compressed(idx, keys=["obs"], repack=repack), index_key="index"),
                store.get(idx, keys=["obs"], index_key="index"))
    assert stage_state(store) == before


def test_only_staged_rows_need_no_blobs():
    store = TieredStore(100, frames={"obs": 0}, stage_rows=64)
    store.extend(rows(20))
    store.flush()
    store.extend(rows(3, seed=1))        # staged: not compressed yet
    for repack in (False, True):
        packed = store.get_compressed([22, 20, 22], repack=repack)
        assert packed.staged_pos.tolist() == [0, 1, 2] and packed.blob_nbytes == 0
        assert_same(decode_rows(packed), store.get([22, 20, 22]))
    assert stage_state(store)["staged"] == 3


def test_repacked_sends_each_needed_frame_once():
    data = rows(120)                     # trajectories of 10 rows: stacks share frames
    store = TieredStore(200, frames={"obs": 0}, chunk_frames=8, stage_rows=0)
    store.extend(data)
    store.flush()
    idx = np.array([5, 6, 6, 41, 77, 119, 30, 31, 95])
    blobs = store.get_compressed(idx)
    packed = store.get_compressed(idx, repack=True, repack_frames=4)
    assert_same(decode_rows(packed), store.get(idx))
    fam = next(f for f in packed.families if any(g.key == ("obs",) for g in f.fields))
    # the distinct frames of those rows, counted from the data: stack t uses frames t..t+3 of its
    # trajectory and the next stack adds t+4 (the frames of one trajectory are stored once)
    t = data["collector", "traj_ids"].numpy()
    step = np.arange(120) - 10 * t
    needed = {(int(t[i]), int(step[i]) + k) for i in idx for k in range(5)}
    raw = fam.blobs.raw_nbytes.astype(np.int64)
    assert int(raw.sum()) == len(needed) * fam.blobs.frame_nbytes
    assert fam.blobs.n_blobs == -(-len(needed) // 4) and (raw[:-1] == 4 * fam.blobs.frame_nbytes).all()
    # the stored blobs hold whole time chunks: more frames, more bytes
    whole = next(f for f in blobs.families if any(g.key == ("obs",) for g in f.fields))
    assert whole.blobs.raw_nbytes.astype(np.int64).sum() > raw.sum()
    assert packed.blob_nbytes < blobs.blob_nbytes
    with pytest.raises(InvalidArgumentError, match="repack_frames"):
        store.get_compressed(idx, repack=True, repack_frames=0)


def test_pieces_decode_into_one_batch_in_request_order():
    a, b = TieredStore(100, frames={"obs": 0}), TieredStore(100, frames={"obs": 0}, stage_rows=64)
    da, db = rows(40), rows(30, seed=2)
    a.extend(da)
    b.extend(db[:27])
    b.extend(db[27:])                    # b's last rows are staged
    ra, rb_ = np.array([3, 39, 3, 20]), np.array([29, 0, 11])
    at_a, at_b = np.array([6, 0, 2, 4]), np.array([1, 5, 3])   # interleaved in the batch
    out = decode_batch([a.get_compressed(ra), b.get_compressed(rb_, repack=True)], [at_a, at_b], index_key="i")
    order = np.empty(7, dtype=np.int64)
    order[at_a], order[at_b] = ra, rb_
    expected = torch.cat([da[torch.from_numpy(ra)], db[torch.from_numpy(rb_)]])[torch.from_numpy(np.argsort(
        np.concatenate([at_a, at_b])))]
    for k in da.keys(True, True):
        assert torch.equal(out[k], expected[k]), k
    assert out["i"].tolist() == order.tolist()
    with pytest.raises(InvalidArgumentError, match="one positions array per piece"):
        decode_batch([a.get_compressed(ra)], [at_a, at_b])


@pytest.mark.parametrize("repack", [False, True])
def test_damage_on_the_way_is_caught(repack):
    store = TieredStore(100, frames={"obs": 0})
    store.extend(rows(40))
    store.flush()
    packed = store.get_compressed([1, 2, 30], repack=repack)
    packed.families[0].blobs.comp[5] ^= 0xFF
    with pytest.raises(ChecksumError, match="after transport"):
        decode_rows(packed)


def test_dense_cells_and_frame_tables_travel_packed_and_checked():
    store = TieredStore(100, frames={"obs": 0})
    data = rows(40)
    data["flag"] = torch.arange(40) % 3 == 0          # bool cells
    data["half"] = torch.rand(40, 3).to(torch.bfloat16)  # a dtype numpy lacks
    store.extend(data)
    packed = store.get_compressed([1, 2, 30, 2], repack=True)
    state = packed.__getstate__()
    keys, (spec, buf, checksum) = state["dense"]
    assert set(keys) == set(packed.dense) and all(f.frame_idx.size == 0 for f in state["families"])
    assert len(spec) == len(packed.families) + len(packed.dense)  # one buffer for all of them
    again = pickle.loads(pickle.dumps(packed))
    assert_same(decode_rows(again), store.get([1, 2, 30, 2]))
    for f, g in zip(again.families, packed.families, strict=True):
        assert f.frame_idx.dtype == g.frame_idx.dtype and np.array_equal(f.frame_idx, g.frame_idx)
    buf[len(buf) // 2] ^= 0xFF
    with pytest.raises(ChecksumError, match="dense cells"):
        type(packed).__new__(type(packed)).__setstate__(state)
