"""The write stage (tiered/engine/stage.py): small writes wait raw and are compressed together.

Checked against a plain TensorDict model on real Atari rows: reads see staged rows at once and
bit-exactly, every error is raised by the write that causes it and leaves the store as it was,
and staged rows survive flush, reopen and pickling.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, check_refcounts
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.engine.gpu_read import GpuDecoder
from tiered.errors import IndexOutOfRangeError, SchemaMismatchError, StorageFullError
from tiered.store import DEFAULT_STAGE_ROWS
from tiered.testing import faults, parts


class Model:
    """What a store must hold: rows in a plain TensorDict, with the store's length rules."""

    def __init__(self, capacity: int, like: TensorDict):
        self.rows = like[:1].expand(capacity).clone().zero_()
        self.capacity, self.len, self.cursor = capacity, 0, 0
        self.written = np.zeros(capacity, dtype=bool)  # set() may leave rows below len unwritten
        self.max_staged = 0  # the most rows the store held staged after an op

    def extend(self, data: TensorDict) -> None:
        n = data.batch_size[0]
        rows = (self.cursor + torch.arange(n)) % self.capacity
        self.rows[rows] = data
        self.written[rows.numpy()] = True
        self.cursor = int((self.cursor + n) % self.capacity)
        self.len = min(self.capacity, self.len + n)

    def set(self, rows: np.ndarray, data: TensorDict) -> None:
        for r, i in zip(rows.tolist(), range(rows.size), strict=True):  # duplicates: last wins
            self.rows[r] = data[i]
        self.written[rows] = True
        self.len = max(self.len, int(rows.max()) + 1)


def random_ops(store: TieredStore, data: TensorDict, steps: int, seed: int) -> Model:
    """Mixed small and large writes at random, each followed by a read checked against the model."""
    rng = np.random.default_rng(seed)
    model = Model(store.capacity, data)
    src = 0

    def take(n: int) -> TensorDict:
        nonlocal src
        if src + n > data.batch_size[0]:
            src = 0
        src += n
        return data[src - n:src]

    store.extend(take(3))
    model.extend(data[src - 3:src])
    for _ in range(steps):
        op = rng.random()
        if op < 0.45:
            n = int(rng.choice([1, 1, 1, 2, 3, 5, 8, 9, 40]))
            d = take(n)
            store.extend(d)
            model.extend(d)
        elif op < 0.65:  # one row at a scalar index, data without a batch dimension
            r = int(rng.integers(0, store.capacity))
            d = take(1)
            store.set(r, d[0])
            model.set(np.array([r]), d)
        elif op < 0.8:  # a few rows at random places, duplicates included
            rows = rng.integers(0, store.capacity, int(rng.integers(1, 5)))
            d = take(rows.size)
            store.set(rows, d)
            model.set(rows, d)
        elif op < 0.85:
            store.flush()
        model.max_staged = max(model.max_staged, store.stats()["staged_rows"])
        ix = rng.choice(np.flatnonzero(model.written), int(rng.integers(1, 40)))
        assert_td_equal(store.get(ix), model.rows[torch.from_numpy(ix)])
        assert len(store) == model.len and store.cursor == model.cursor
    return model


@pytest.mark.parametrize("stage_rows", [16, 64])
@pytest.mark.parametrize("chunk_frames", [1, 4])
def test_staged_rows_read_back_bit_exact(atari_mixed, stage_rows, chunk_frames):
    store = TieredStore(50, frames={"observation": 0}, chunk_frames=chunk_frames, stage_rows=stage_rows)
    model = random_ops(store, atari_mixed, steps=300, seed=stage_rows + chunk_frames)
    assert model.max_staged > 1  # the reads above did meet staged rows
    every = np.flatnonzero(model.written)
    assert_td_equal(store.get(every), model.rows[torch.from_numpy(every)])
    store.flush()
    assert store.stats()["staged_rows"] == 0
    check_refcounts(store)
    assert_td_equal(store.get(every), model.rows[torch.from_numpy(every)])


def test_one_row_writes_are_staged_until_the_stage_fills(atari_pong):
    store = TieredStore(1000, frames={"observation": 0}, stage_rows=16)
    store.extend(atari_pong[:1])  # the first write fixes the schema and goes through
    for i in range(1, 17):
        store.extend(atari_pong[i:i + 1])
    assert store.stats()["staged_rows"] == 16
    assert store.stats()["counters"]["blobs_decoded"] == 0
    # a staged row that was never written before is a row like any other
    assert_td_equal(store.get(5), atari_pong[5])
    assert_td_equal(store.get([-1, 0, 7]), atari_pong[torch.tensor([16, 0, 7])])
    with pytest.raises(IndexOutOfRangeError):
        store.get(17)
    store.extend(atari_pong[17:18])  # finds the stage full: the staged rows go through first
    assert store.stats()["staged_rows"] == 1
    check_refcounts(store)
    store.extend(atari_pong[18:60])  # a larger write sends the stage first, then writes through
    assert store.stats()["staged_rows"] == 0
    assert_td_equal(store.get(slice(None)), atari_pong[:60])


def test_a_small_collector_batch_is_staged(atari_mixed):
    """A write of 16 rows (a collector of 16 vectorized envs) waits in the default stage (writes
    of up to stage_rows // 4 rows do: 32 by default); 33 rows go through; reads are exact either way."""
    data = atari_mixed[1900:2200]  # Pong's end, MsPacman's start: trajectories end and begin
    store = TieredStore(500)
    assert DEFAULT_STAGE_ROWS == 128
    store.extend(data[:16])  # the first write fixes the schema and goes through
    assert store.stats()["staged_rows"] == 0
    store.extend(data[16:32])
    assert store.stats()["staged_rows"] == 16
    assert_td_equal(store.get(torch.arange(8, 24)), data[8:24])  # stored and staged rows in one read
    store.extend(data[32:65])  # 33 rows: the stage goes first, then the write goes through
    assert store.stats()["staged_rows"] == 0
    for lo in range(65, 65 + 16 * 9, 16):  # the ninth 16-row write finds the stage full
        store.extend(data[lo:lo + 16])
    assert store.stats()["staged_rows"] == 16
    assert_td_equal(store.get(slice(None)), data[:209])
    check_refcounts(store)


def test_staged_rows_are_stored_as_one_batched_write_of_them(atari_mixed):
    # one row at a time comes out as writes of `stage_rows` rows: same sharing, same chunks
    data = atari_mixed[1900:2300]  # Pong's end, MsPacman's start: trajectories end and begin
    batched = TieredStore(500, frames={"observation": 0}, stage_rows=0)
    batched.extend(data[:1])
    for lo in range(1, 400, 64):
        batched.extend(data[lo:lo + 64])
    batched.flush()
    staged = TieredStore(500, frames={"observation": 0}, stage_rows=64)
    for i in range(data.batch_size[0]):
        staged.extend(data[i:i + 1])
    staged.flush()
    a, b = batched.stats()["fields"]["observation"], staged.stats()["fields"]["observation"]
    assert a["unique_frames"] == b["unique_frames"] and a["stored_bytes"] == b["stored_bytes"]
    assert np.array_equal(parts(batched).layout.tables[("observation",)].blob, parts(staged).layout.tables[("observation",)].blob)
    assert_td_equal(staged.get(slice(None)), data)


def test_a_bad_small_write_raises_and_changes_nothing(atari_pong):
    store = TieredStore(100, frames={"observation": 0})
    store.extend(atari_pong[:5])
    store.extend(atari_pong[5:6])
    before = store.get(slice(None)).clone()
    bad = atari_pong[6:7].clone()
    bad.set("action", bad.get("action").to(torch.int32))
    with pytest.raises(SchemaMismatchError, match="'action': expected int64"):
        store.extend(bad)
    extra = atari_pong[6:7].clone()
    extra.set("surprise", torch.zeros(1))
    with pytest.raises(SchemaMismatchError, match="'surprise': not in the schema"):
        store.extend(extra)
    with pytest.raises(SchemaMismatchError, match="missing"):
        store.set(3, atari_pong[6].exclude(("next", "observation")))
    with pytest.raises(IndexOutOfRangeError):
        store.set(100, atari_pong[6])
    assert len(store) == 6 and store.cursor == 6 and store.stats()["staged_rows"] == 1
    assert_td_equal(store.get(slice(None)), before)


def test_storage_full_is_raised_by_the_write_that_meets_it(atari_pong):
    # no cold tier, no spill and a small warm budget: compressing the stage eventually finds no room
    store = TieredStore(2000, frames={"observation": 0}, hot_bytes=0, warm_bytes="48KiB", stage_rows=16,
                        spill=False)
    model = Model(2000, atari_pong)
    store.extend(atari_pong[:1])
    model.extend(atari_pong[:1])
    for i in range(1, 2000):
        staged = store.stats()["staged_rows"]
        try:
            store.extend(atari_pong[i:i + 1])
        except StorageFullError as e:
            assert "warm" in str(e) or "budget" in str(e), e
            break
        model.extend(atari_pong[i:i + 1])
    else:
        pytest.fail("the warm budget never filled")
    # the failing write added nothing; every earlier row, staged ones included, is intact
    assert len(store) == model.len == i and store.stats()["staged_rows"] == staged
    assert_td_equal(store.get(slice(None)), model.rows[: model.len])
    # trying again fails the same way and still changes nothing
    with pytest.raises(StorageFullError):
        store.extend(atari_pong[i:i + 1])
    assert len(store) == i and store.stats()["staged_rows"] == staged
    assert_td_equal(store.get(slice(None)), model.rows[: model.len])
    store.clear()  # room again
    store.extend(atari_pong[i:i + 1])
    assert_td_equal(store.get(slice(None)), atari_pong[i:i + 1])


def test_full_disk_while_compressing_the_stage(atari_pong, tmp_path):
    store = TieredStore(500, tmp_path / "s", frames={"observation": 0}, stage_rows=16)
    store.extend(atari_pong[:1])
    for i in range(1, 17):
        store.extend(atari_pong[i:i + 1])
    with faults.inject_faults(enospc_on=1), pytest.raises(StorageFullError):
        store.extend(atari_pong[17:18])  # the stage is full: compressing it needs the disk
    assert len(store) == 17 and store.stats()["staged_rows"] == 16
    assert_td_equal(store.get(slice(None)), atari_pong[:17])
    for i in range(17, 40):  # space is back
        store.extend(atari_pong[i:i + 1])
    store.close()
    with TieredStore.open(tmp_path / "s") as back:
        assert_td_equal(back.get(slice(None)), atari_pong[:40])
        check_refcounts(back)


def test_staged_rows_are_committed_by_flush_and_close(atari_pong, tmp_path):
    store = TieredStore(100, tmp_path / "s", frames={"observation": 0})
    store.extend(atari_pong[:10])
    for i in range(10, 13):
        store.extend(atari_pong[i:i + 1])
    assert store.stats()["staged_rows"] == 3
    store.flush()
    with TieredStore.open(tmp_path / "s") as reader:
        assert_td_equal(reader.get(slice(None)), atari_pong[:13])
    for i in range(13, 15):
        store.set(i, atari_pong[i])
    assert store.stats()["staged_rows"] == 2
    store.close()
    with TieredStore.open(tmp_path / "s") as reader:
        assert_td_equal(reader.get(slice(None)), atari_pong[:15])


def test_pickled_store_keeps_its_staged_rows(atari_pong):
    store = TieredStore(100, frames={"observation": 0})
    store.extend(atari_pong[:10])
    for i in range(10, 14):
        store.extend(atari_pong[i:i + 1])
    copy = pickle.loads(pickle.dumps(store))
    assert copy.stats()["staged_rows"] == 4
    assert_td_equal(copy.get(slice(None)), atari_pong[:14])
    copy.extend(atari_pong[14:40])
    assert_td_equal(copy.get(slice(None)), atari_pong[:40])


def test_clear_drops_staged_rows(atari_pong):
    store = TieredStore(100, frames={"observation": 0})
    store.extend(atari_pong[:10])
    store.extend(atari_pong[10:11])
    assert store.stats()["staged_rows"] == 1
    store.clear()
    assert len(store) == 0 and store.stats()["staged_rows"] == 0
    check_refcounts(store)
    store.extend(atari_pong[20:21])
    assert_td_equal(store.get(slice(None)), atari_pong[20:21])


def test_staged_rows_with_the_gpu_decoder_stand_in(atari_pong):
    store = TieredStore(200, frames={"observation": 0}, hot_device="cpu")
    dec = GpuDecoder("cpu").attach(store)
    store.extend(atari_pong[:100])
    for i in range(100, 110):
        store.extend(atari_pong[i:i + 1])
    assert store.stats()["staged_rows"] == 10
    ix = np.random.default_rng(0).integers(0, 110, 64)
    assert_td_equal(store.get(ix), atari_pong[torch.from_numpy(ix)])
    assert_td_equal(store.get(np.arange(100, 110)), atari_pong[100:110])
    assert dec.stats()["batches"] > 0  # the unstaged rows went through the decoder


def test_stage_rows_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="stage_rows"):
        TieredStore(10, stage_rows=-1)
    with pytest.raises(ValueError, match="stage_rows"):
        TieredStore(10, stage_rows=2.5)


def test_stage_rows_can_be_set_on_open(tmp_path):
    # a runtime setting like threads: not stored in the manifest, given again on open
    TieredStore(10, tmp_path / "s", stage_rows=0).close()
    with tiered.open(tmp_path / "s", mode="r+", stage_rows=0) as store:
        store.extend(TensorDict({"x": torch.zeros(1, 3)}, [1]))
        assert store.stats()["staged_rows"] == 0
    with tiered.open(tmp_path / "s", mode="r+", stage_rows=16) as store:
        store.extend(TensorDict({"x": torch.ones(1, 3)}, [1]))
        assert store.stats()["staged_rows"] == 1


@pytest.mark.parametrize("rows_per_write", [1, 50], ids=["staged", "batched"])
def test_values_with_autograd_history_are_stored_detached(rows_per_write):
    # policy outputs often carry autograd history: stored copies must not (nor fail on it)
    torch.manual_seed(0)
    logits = torch.randn(100, 6, requires_grad=True) * 2  # dense, with a grad_fn
    features = torch.randn(100, 512, requires_grad=True) * 2  # 2 KiB per row: a blob field
    data = TensorDict({"logits": logits, "features": features}, batch_size=[100])
    store = TieredStore(100)
    for lo in range(0, 100, rows_per_write):
        store.extend(data[lo:lo + rows_per_write])
    assert (store.stats()["staged_rows"] > 0) == (rows_per_write == 1)
    out = store.get(slice(None))
    assert not out["logits"].requires_grad and not out["features"].requires_grad
    assert torch.equal(out["logits"], logits.detach()) and torch.equal(out["features"], features.detach())
    assert store.schema["features"].kind == "blob"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int16, torch.int8,
                                   torch.complex64, torch.bool, torch.uint16, torch.uint32])
def test_staged_dense_cells_of_every_dtype_read_back_exactly(atari_pong, dtype):
    """Small writes put dense cells straight into the columns (through numpy views of them, or
    torch for dtypes numpy lacks): one-row appends, a few rows, a scalar and a 2-row overwrite
    read back bit-exactly, before and after pickling and after the stage is compressed."""
    n = 20
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        extra = torch.randint(0, 2, (n, 3), generator=g).bool()
    elif dtype.is_floating_point or dtype.is_complex:
        extra = (torch.randn(n, 3, generator=g) * 50).to(dtype)
    else:
        extra = torch.randint(0, 100, (n, 3), generator=g).to(dtype)
    data = atari_pong[:n].clone()
    data.set("extra", extra)
    store = TieredStore(32, frames={"observation": 0})
    store.extend(data[:4])  # the first write fixes the schema (batched)
    for i in range(4, 12):
        store.extend(data[i:i + 1])
    store.extend(data[12:16])
    store.set(torch.tensor([1, 2]), data[16:18])
    store.set(3, data[18])
    want = data[:16].clone()
    want[1:3] = data[16:18]
    want[3] = data[18]
    assert store.stats()["staged_rows"] > 0
    assert_td_equal(store.get(slice(None)), want)
    assert_td_equal(store.get(torch.tensor([15, 3, 1])), want[torch.tensor([15, 3, 1])])
    copy = pickle.loads(pickle.dumps(store))
    copy.set(5, data[19])  # a staged write into the copy's own columns and stage
    want_copy = want.clone()
    want_copy[5] = data[19]
    assert_td_equal(copy.get(slice(None)), want_copy)
    assert_td_equal(store.get(slice(None)), want)  # the original is untouched
    store.flush()
    assert store.stats()["staged_rows"] == 0
    assert_td_equal(store.get(slice(None)), want)


def test_set_with_the_matched_cells_walks_the_data_once():
    """``set(..., cells=schema.match(data, ...))`` (TorchRL's ``rb.add``): the same rows as a plain
    ``set``, fewer calls (the data is not walked again), and a mismatch still refused."""
    from tiered.testing import count_calls

    td = TensorDict({"a": torch.arange(8), ("next", "b"): torch.rand(8, 3), "obs": torch.rand(8, 64, 64)}, [8])
    store = TieredStore(16)
    store.extend(td[:4])
    row = td[5]
    cells = store.schema.match(row, 0)
    assert cells is not None
    store.set(5, row, cells=cells)
    store.set(6, td[6])
    assert_td_equal(store.get([5, 6]), td[5:7])
    assert count_calls(lambda: store.set(7, row, cells=cells)).all < count_calls(lambda: store.set(7, row)).all
    bad = TensorDict({"a": torch.tensor(7, dtype=torch.int32), ("next", "b"): torch.rand(3), "obs": torch.rand(64, 64)}, [])
    assert store.schema.match(bad, 0) is None  # TorchRL's storage then writes without cells
    with pytest.raises(SchemaMismatchError, match="expected int64"):
        store.set(8, bad)
    assert len(store) == 8
    assert_td_equal(store.get([0, 1, 2, 3, 5, 6, 7]), TensorDict.cat([td[:4], td[5:7], td[5:6]], 0))


@pytest.mark.parametrize("traj_ids", [True, False])
def test_compressing_the_stage_leaves_the_dense_columns_as_the_stage_wrote_them(atari_mixed, tmp_path, traj_ids):
    """A flush of the stage writes only the staged rows' blob fields (their dense cells, narrowed
    ones too, went to the columns when staged) and reads back only the fields that cut
    trajectories: the frames and chunks come out as one batched write's, with the trajectory-id
    field or with the done flags alone, and a commit saves every dense cell."""
    data = atari_mixed[1900:2100]  # an episode end and a change of game
    if not traj_ids:
        data = data.exclude("collector")
    opts = {"frames": {"observation": 0}, "dense_dtypes": {("next", "reward"): torch.float16}}
    batched = TieredStore(300, **opts, stage_rows=0)
    batched.extend(data[:1])
    for lo in range(1, 200, 64):
        batched.extend(data[lo:lo + 64])
    batched.flush()
    staged = TieredStore(300, **opts, stage_rows=64)
    durable = TieredStore(300, tmp_path / "s", **opts, stage_rows=64)
    for i in range(200):
        staged.extend(data[i:i + 1])
        durable.extend(data[i:i + 1])
    assert staged.stats()["staged_rows"] == 199 % 64  # the first write was batched, the others staged
    staged.flush()
    a, b = batched.stats()["fields"]["observation"], staged.stats()["fields"]["observation"]
    assert a["unique_frames"] == b["unique_frames"] and a["stored_bytes"] == b["stored_bytes"]
    assert batched.stats()["blobs"] == staged.stats()["blobs"]
    assert_td_equal(staged.get(slice(None)), batched.get(slice(None)))
    durable.close()
    with TieredStore.open(tmp_path / "s") as reader:
        assert_td_equal(reader.get(slice(None)), batched.get(slice(None)))


def test_a_small_write_with_an_empty_nested_tensordict_is_staged(atari_pong):
    """A nested TensorDict without tensors (``("collector",)`` once its only key was excluded)
    holds no field: a small write that carries one is staged like any other (not sent down the
    batched path on every call), reads back the same, and a real extra field is still refused."""
    data = atari_pong[:40].exclude(("collector", "traj_ids"))
    assert "collector" in data.keys() and not list(data["collector"].keys())
    store = TieredStore(100, frames={"observation": 0})
    store.extend(data[:8])
    for i in range(8, 20):
        store.extend(data[i:i + 1])
    store.set(20, data[20])
    assert store.stats()["staged_rows"] == 13
    assert_td_equal(store.get(slice(None)), data[:21].exclude("collector"))
    extra = data[21:22].clone()
    extra["collector", "surprise"] = torch.zeros(1)
    with pytest.raises(SchemaMismatchError, match="'collector/surprise': not in the schema"):
        store.extend(extra)
    assert len(store) == 21 and store.stats()["staged_rows"] == 13


@pytest.mark.parametrize("sizes", [(16,), (1, 3, 16, 5), (1,)])
@pytest.mark.parametrize("frame_dim", [0, 2])
def test_staged_writes_of_any_size_share_what_one_batched_write_shares(atari_mixed, sizes, frame_dim):
    """Writes of 16 rows, of mixed sizes (a write's first row meets the previous write's last in
    the stage) and of one row come out as one batched write of the same rows: same sharing (each
    frame compared bit for bit with its layout neighbours), same chunks, same tables, read back
    exactly. Also for stacks along another dimension than the first (channels-last
    ``[84, 84, 4]``)."""
    data = atari_mixed[1900:2300]  # Pong's end, MsPacman's start: trajectories end and begin
    if frame_dim:
        data = data.clone()
        for key in ("observation", ("next", "observation")):
            data.set(key, data.get(key).permute(0, 2, 3, 1).contiguous())
    frames = {"observation": frame_dim}
    batched = TieredStore(500, frames=frames, stage_rows=0)
    batched.extend(data[:16])
    for lo in range(16, 400, 64):
        batched.extend(data[lo:lo + 64])
    batched.flush()
    staged = TieredStore(500, frames=frames, stage_rows=64)
    staged.extend(data[:16])
    lo, k = 16, 0
    while lo < 400:
        # whole stages of 64 rows, as the batched store wrote them
        n = min(sizes[k % len(sizes)], 400 - lo, 64 - (lo - 16) % 64)
        staged.extend(data[lo:lo + n])
        lo, k = lo + n, k + 1
    staged.flush()
    for key in ("observation", "next/observation"):
        a, b = batched.stats()["fields"][key], staged.stats()["fields"][key]
        assert a["unique_frames"] == b["unique_frames"] and a["stored_bytes"] == b["stored_bytes"]
    assert batched.stats()["fields"]["observation"]["dedup_factor"] > 3  # the stacks did share
    ta, tb = parts(batched).layout.tables, parts(staged).layout.tables
    assert ta.keys() == tb.keys()
    every = np.arange(400)
    for key in ta:
        assert all(np.array_equal(x, y) for x, y in zip(ta[key].refs(every), tb[key].refs(every), strict=True))
    assert_td_equal(staged.get(slice(None)), data)
    check_refcounts(staged)


@pytest.mark.parametrize("where", [0, 3, -1])
def test_a_staged_frame_one_byte_off_its_neighbour_is_not_shared(atari_pong, where):
    """Equality is bit-exact: a stacked frame that differs from the previous row's in one byte
    (first, middle or last byte of the frame) gets its own blob, and reads back as written."""
    data = atari_pong[100:140].clone()
    obs = data["observation"]  # [n, 4, 84, 84] stacks of a rollout
    assert torch.equal(obs[20, 0], obs[19, 1])
    flat = obs[20, 0].view(-1)
    flat[where] ^= 1  # row 20's oldest frame no longer equals row 19's second
    store = TieredStore(100, frames={"observation": 0}, stage_rows=64)
    store.extend(data[:1])
    for lo in range(1, 40, 4):
        store.extend(data[lo:lo + 4])
    assert store.stats()["staged_rows"] == 39
    assert_td_equal(store.get(slice(None)), data)  # from the stage
    store.flush()
    assert_td_equal(store.get(slice(None)), data)  # compressed
    ids = parts(store).layout.tables[("observation",)].refs(np.array([19, 20]))[0]
    assert ids[1, 0] != ids[0, 1]
    check_refcounts(store)


def test_a_flush_encodes_the_same_bytes_on_one_thread_as_on_several(atari_mixed):
    """A small encode (a stage flush) runs on the calling thread (write.ENCODE_SPLIT_BYTES); a
    large one is split over the store's threads. Either way each blob is its own zstd frame: the
    stored bytes and checksums are those of a one-thread store."""
    data = atari_mixed[1500:2500]  # Pong's end, MsPacman's start
    stores = {t: TieredStore(1000, threads=t, stage_rows=64) for t in (1, 2)}
    for store in stores.values():
        store.extend(data[:900])  # a batched write: > 6 MB of new frames, split over the threads
        for lo in range(900, 1000, 16):
            store.extend(data[lo:lo + 16])  # staged, flushed every 64 rows
        store.flush()
    one, two = (parts(stores[t]).index for t in (1, 2))
    live = one.live_ids()
    assert live.size > 20 and np.array_equal(live, two.live_ids())
    assert np.array_equal(one.checksum[live], two.checksum[live])
    assert np.array_equal(one.nbytes[live], two.nbytes[live])
    for store in stores.values():
        assert_td_equal(store.get(slice(None)), data)


def test_an_unpickled_store_dedups_the_rows_it_stages_by_their_own_frames(atari_pong):
    """An unpickled store's stage is its own memory: the rows it stages after the copy are
    compared with their own neighbours, not with what the slots held before. Its slots 48..63
    held consecutive rows (whose stacks share frames) in the stage's first cycle; after the copy
    they get rows out of order (which share none)."""
    data = atari_pong[:400]
    store = TieredStore(400, frames={"observation": 0}, stage_rows=64)
    store.extend(data[:100])
    for lo in range(100, 212, 16):  # a whole stage of consecutive rows, then 48 more
        store.extend(data[lo:lo + 16])
    assert store.stats()["staged_rows"] == 48
    copy = pickle.loads(pickle.dumps(store))
    shuffled = torch.arange(212, 212 + 7 * 16, 7)  # rows 7 apart: no frame of theirs is shared
    for s in (store, copy):
        s.extend(data[shuffled])  # slots 48..63
        s.flush()
    expect = torch.cat([torch.arange(212), shuffled])
    for s in (store, copy):
        assert_td_equal(s.get(slice(None)), data[expect])
        check_refcounts(s)
    a, b = store.stats()["fields"]["observation"], copy.stats()["fields"]["observation"]
    assert a["unique_frames"] == b["unique_frames"] and a["stored_bytes"] == b["stored_bytes"]
