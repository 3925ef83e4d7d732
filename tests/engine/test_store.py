"""TieredStore on real Atari data: round trips, ring wrap, index forms, dtypes, errors, call counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, check_refcounts
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.engine.blob_index import OPEN
from tiered.errors import IndexOutOfRangeError, SchemaMismatchError, UnknownCodecError
from tiered.testing import count_calls, parts

CONFIGS = {
    "default": {},
    "frames_k4": {"frames": {"observation": 0}, "chunk_frames": 4},
    "frames_k1": {"frames": {"observation": 0}, "chunk_frames": 1},
    "no_dedup": {"dedup": False, "chunk_frames": 1},
    "lz4": {"codec": "lz4", "frames": {"observation": 0}},
    "raw_codec": {"codec": "raw", "frames": {"observation": 0}, "chunk_frames": 2},
}


def model_after(data: TensorDict, capacity: int, chunks: list[int]) -> tuple[TensorDict, int]:
    """Expected ring contents after extending with `chunks` consecutive pieces of `data`."""
    n = sum(chunks)
    rows = np.arange(n) % capacity
    # last write wins: position p of the ring holds the last i with i % capacity == p
    last = {}
    for i, r in enumerate(rows):
        last[int(r)] = i
    order = [last[p] for p in range(min(n, capacity))]
    return data[torch.tensor(order)], min(n, capacity)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_round_trip_every_field_after_wrap(atari_mixed, config):
    data = atari_mixed[:1500]
    capacity = 700
    chunks = [1, 7, 256, 3, 600, 256, 1, 376]
    store = TieredStore(capacity, **CONFIGS[config])
    start = 0
    for c in chunks:
        store.extend(data[start:start + c])
        start += c
    expected, n = model_after(data, capacity, chunks)
    assert len(store) == n == capacity
    assert_td_equal(store.get(slice(None)), expected)
    store.flush()  # closes open chunks; data must not change
    assert_td_equal(store.get(torch.arange(capacity)), expected)
    assert store.cursor == sum(chunks) % capacity


def test_defaults_bit_exact_pong(atari_pong):
    store = TieredStore(5000, frames={"observation": 0})
    store.extend(atari_pong)
    assert_td_equal(store.get(slice(None)), atari_pong)
    st = store.stats()
    obs = st["fields"]["observation"]
    assert obs["unique_frames"] < 2 * len(atari_pong)  # obs and next share; stacks share 3 of 4
    assert obs["dedup_factor"] > 4
    assert st["fields"]["observation"]["ratio"] > 25


def test_a_slice_is_a_copy_unless_views_are_asked_for():
    # a column kept in its own dtype (dense_dtypes names it): a column that narrows itself is read as a copy
    store = TieredStore(8, dense_dtypes={"r": torch.float32})
    store.extend(TensorDict({"r": torch.arange(8.0)}, [8]))
    got = store.get(slice(0, 3))
    got["r"] += 100  # the caller's batch is its own
    assert store.get(slice(0, 3))["r"].tolist() == [0.0, 1.0, 2.0]
    view = store.get(slice(0, 3), copy=False)  # what TorchRL's storage[:] gets: no copy
    store.extend(TensorDict({"r": torch.full((8,), 7.0)}, [8]))
    assert view["r"].tolist() == [7.0, 7.0, 7.0]


def test_index_forms(atari_pong):
    data = atari_pong[:50]
    store = TieredStore(100)
    store.extend(data)
    one = store.get(3)
    assert one.batch_size == torch.Size([])
    assert torch.equal(one["observation"], data["observation"][3])
    assert torch.equal(store.get(-1)["action"], data["action"][49])
    assert torch.equal(store.get(np.int64(2))["action"], data["action"][2])
    for idx in ([1, 4, 4, 0], np.array([5, 2]), torch.tensor([7, 1]), range(3, 9, 2), (torch.tensor([2, 3]),),
                torch.tensor([-1, -50])):
        got = store.get(idx)
        ref = torch.as_tensor(np.asarray(idx[0] if isinstance(idx, tuple) else list(idx)))
        ref = torch.where(ref < 0, ref + 50, ref)
        assert_td_equal(got, data[ref])
    assert_td_equal(store.get(slice(10, 1000)), data[10:])  # slices clip to len
    assert store.get(slice(60, 70)).batch_size == torch.Size([0])
    assert torch.equal(store.get(torch.tensor(4))["action"], data["action"][4])
    part = store.get([0, 1], keys=["action", ("next", "reward")])
    assert set(part.keys(include_nested=True, leaves_only=True)) == {"action", ("next", "reward")}


def test_set_overwrites_and_frees(atari_pong):
    data = atari_pong[:200]
    store = TieredStore(200, frames={"observation": 0})
    store.extend(data)
    other = atari_pong[1000:1010]
    store.set(torch.arange(50, 60), other)
    expected = data.clone()
    expected[50:60] = other
    assert_td_equal(store.get(slice(None)), expected)
    store.set(5, atari_pong[1500])
    expected[5] = atari_pong[1500]
    assert_td_equal(store.get(slice(None)), expected)
    check_refcounts(store)


@pytest.mark.parametrize("config", ["frames_k4", "frames_k1"])
def test_refcounts_match_recount_after_overwrites(atari_mixed, config):
    store = TieredStore(300, **CONFIGS[config])
    rng = np.random.default_rng(0)
    pos = 0
    for _ in range(12):
        c = int(rng.integers(1, 200))
        store.extend(atari_mixed[pos:pos + c])
        pos += c
        check_refcounts(store)
    store.flush()
    check_refcounts(store)
    assert not (parts(store).index.state[: parts(store).index.size] == OPEN).any()


def test_flush_with_open_chunks_leaks_no_blob(atari_pong):
    # regression: closing open chunks on flush pinned the tail's blobs a second time, so they
    # were never freed once their rows were overwritten
    store = TieredStore(100, frames={"observation": 0}, chunk_frames=4)
    store.extend(atari_pong[:30])
    assert parts(store).layout.families[0].open_blob.size  # a chunk is still open
    store.flush()
    check_refcounts(store)
    for lo in range(30, 260, 23):
        store.extend(atari_pong[lo:lo + 23])
        store.flush()
        check_refcounts(store)
    live = parts(store).index.live_ids()
    used = np.unique(np.concatenate([t.blob.reshape(-1) for t in parts(store).layout.tables.values()]))
    tail = parts(store).layout.families[0].tail_blob
    assert np.isin(live, np.concatenate([used, tail])).all()


@pytest.mark.parametrize("stage_rows", [0, 64], ids=["write-through", "staged"])
def test_frames_shared_across_extend_boundaries(atari_pong, stage_rows):
    data = atari_pong[:40]
    store = TieredStore(100, frames={"observation": 0}, chunk_frames=1, stage_rows=stage_rows)
    for i in range(40):
        store.extend(data[i:i + 1])
    # the first write fixes the schema and goes through; the next 39 wait in the stage
    assert store.stats()["staged_rows"] == (0 if stage_rows == 0 else 39)
    store.flush()  # staged rows reach the row tables
    # row t's next observation and row t+1's observation are the very same blobs
    obs = parts(store).layout.tables[("observation",)].blob
    nxt = parts(store).layout.tables[("next", "observation")].blob
    same_traj = ~data["next", "done"].reshape(-1)[:39].numpy()
    assert (nxt[:39][same_traj] == obs[1:40][same_traj]).all()
    # and stacks share 3 of 4 frames with the previous row
    assert (obs[1:40, :3][same_traj] == obs[:39, 1:][same_traj]).all()
    assert_td_equal(store.get(slice(None)), data)


def _expected_unique_frames(data: TensorDict, pieces: list[int], tail_rows: int = 8) -> int:
    """Frames a store keeps when ``data`` is written in ``pieces``: a frame is shared with an equal
    one earlier in its own write or in the last ``tail_rows`` rows of the previous write."""
    obs, nxt = data["observation"].numpy(), data["next", "observation"].numpy()
    count, start, tail = 0, 0, set()
    for c in pieces:
        seen = set(tail)
        for r in range(start, start + c):
            for f in (*obs[r], *nxt[r]):
                if f.tobytes() not in seen:
                    seen.add(f.tobytes())
                    count += 1
        tail = {f.tobytes() for r in range(max(start, start + c - tail_rows), start + c) for f in (*obs[r], *nxt[r])}
        start += c
    return count


def test_tail_keeps_each_frame_once_and_dedups_as_a_single_write(atari_mixed):
    """The frames kept for the next write's dedup are distinct (8 rows of two 4-frame stacks are
    ~12 frames, not 64) and still share every frame the last rows of a write held."""
    data = atari_mixed[400:1400]  # Pong, then MsPacman: an episode end and a change of game
    cuts = [1, 2, 9, 3, 100, 7, 256, 1, 121, 500]
    whole = TieredStore(1000, frames={"observation": 0}, stage_rows=0)
    whole.extend(data)
    pieces = TieredStore(1000, frames={"observation": 0}, stage_rows=0)
    frame_nbytes = data["observation"][0, 0].numel()
    start = 0
    for c in cuts:
        pieces.extend(data[start:start + c])
        start += c
        fam = parts(pieces).layout.families[0]
        assert fam.tail_frames.shape[0] == fam.tail_blob.size == np.unique(fam.tail_hash).size
        assert pieces.stats()["memory"]["tail"] <= 16 * frame_nbytes
        check_refcounts(pieces)
    assert whole.stats()["fields"]["observation"]["unique_frames"] == _expected_unique_frames(data, [len(data)])
    assert pieces.stats()["fields"]["observation"]["unique_frames"] == _expected_unique_frames(data, cuts)
    assert_td_equal(pieces.get(slice(None)), data)
    pieces.flush()
    check_refcounts(pieces)


def test_frames_differing_in_one_byte_are_never_shared(atari_pong):
    data = atari_pong[:20].clone()
    base = data["observation"][10].clone()
    data["observation"][11] = base
    data["observation"][11][2, 40, 40] ^= 1  # one byte differs in one frame
    store = TieredStore(50, frames={"observation": 0})
    store.extend(data)
    assert_td_equal(store.get(slice(None)), data)
    assert not torch.equal(store.get(10)["observation"], store.get(11)["observation"])


@pytest.mark.parametrize("row, key, frame, pixel", [
    (20, ("observation",), 1, (5, 5)),              # a stacked frame (previous row's rule)
    (20, ("observation",), 3, (0, 0)),              # the newest frame (previous next observation's rule)
    (30, ("next", "observation"), 2, (83, 83)),     # a next frame (its own row's rule), last byte
    (31, ("next", "observation"), 0, (40, 41)),
])
def test_neighbour_frames_one_byte_apart_are_compared_exactly(atari_pong, row, key, frame, pixel):
    """The layout's neighbour runs (one comparison per run of stacked frames) compare every byte:
    a frame that differs from its neighbour by one bit (first, middle or last word) is its own
    frame, and every equal neighbour is still shared."""
    data = atari_pong[:64].clone()
    data[key][row][(frame, *pixel)] ^= 1
    store = TieredStore(64, frames={"observation": 0}, stage_rows=0)
    store.extend(data)
    assert_td_equal(store.get(slice(None)), data)
    assert store.stats()["fields"]["observation"]["unique_frames"] == _expected_unique_frames(data, [64])
    check_refcounts(store)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int64, torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
def test_every_dtype_dense_and_blob(dtype):
    g = torch.Generator().manual_seed(0)
    n = 64

    def make(shape):
        if dtype == torch.bool:
            return torch.rand(n, *shape, generator=g) > 0.5
        if dtype.is_floating_point:
            return torch.randn(n, *shape, generator=g).to(dtype)
        return torch.randint(0, 200, (n, *shape), generator=g).to(dtype)

    td = TensorDict({"small": make((3,)), "big": make((4, 32, 32)), ("nested", "deep", "x"): make((2, 600))},
                    batch_size=[n])
    store = TieredStore(40, frames={"big": 0})
    store.extend(td[:30])
    store.extend(td[30:])
    assert store.schema["big"].kind == "blob" and store.schema["small"].kind == "dense"
    assert store.schema[("nested", "deep", "x")].kind == "blob"
    expected, _ = model_after(td, 40, [30, 34])
    assert_td_equal(store.get(slice(None)), expected)


def test_non_contiguous_input(atari_pong):
    data = atari_pong[:64]
    obs_t = data["observation"].transpose(-1, -2)  # non-contiguous
    td = TensorDict({"observation": obs_t, "action": data["action"][:, None].expand(64, 3)}, batch_size=[64])
    assert not td["observation"].is_contiguous()
    store = TieredStore(64, frames={"observation": 0})
    store.extend(td)
    assert torch.equal(store.get(slice(None))["observation"], obs_t)
    assert torch.equal(store.get(slice(None))["action"], td["action"])


def test_frame_dim_not_first():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 255, (10, 84, 84, 4), dtype=torch.uint8, generator=g)
    store = TieredStore(10, frames={"pixels": -1})
    store.extend(TensorDict({"pixels": x}, batch_size=[10]))
    assert torch.equal(store.get(slice(None))["pixels"], x)


def test_schema_errors_leave_store_unchanged(atari_pong):
    data = atari_pong[:10]
    store = TieredStore(100)
    store.extend(data)
    before = store.get(slice(None))
    bad_dtype = data.clone()
    bad_dtype["action"] = bad_dtype["action"].to(torch.int32)
    missing = data.exclude("action")
    extra = data.clone()
    extra["extra"] = torch.zeros(10)
    bad_shape = data.clone()
    bad_shape.set("observation", torch.zeros(10, 4, 84, 83, dtype=torch.uint8))
    for bad, words in [(bad_dtype, ["'action'", "int64", "int32"]), (missing, ["'action'", "missing"]),
                       (extra, ["'extra'", "not in the schema"]), (bad_shape, ["'observation'", "84, 83"])]:
        with pytest.raises(SchemaMismatchError) as e:
            store.extend(bad)
        for w in words:
            assert w in str(e.value)
        assert len(store) == 10 and store.cursor == 10
    with pytest.raises(TypeError):  # SchemaMismatchError is a TypeError
        store.extend(bad_dtype)
    assert_td_equal(store.get(slice(None)), before)


def test_index_errors(atari_pong):
    store = TieredStore(100)
    with pytest.raises(IndexOutOfRangeError, match="empty"):
        store.get(0)
    store.extend(atari_pong[:10])
    with pytest.raises(IndexOutOfRangeError, match="index 10 .*length 10"):
        store.get(10)
    with pytest.raises(IndexError, match="-11"):
        store.get([0, -11])
    with pytest.raises(IndexOutOfRangeError):
        store.get(torch.tensor([0.5]))
    with pytest.raises(IndexOutOfRangeError, match="capacity 100"):
        store.set(100, atari_pong[0])
    store.set(50, atari_pong[0])  # a row beyond the length extends it...
    assert len(store) == 51
    with pytest.raises(IndexOutOfRangeError, match="never written"):
        store.get(30)  # ...but rows in between were never written


def test_bad_options():
    with pytest.raises(UnknownCodecError) as e:
        TieredStore(10, codec="zsdt")
    assert "zstd" in str(e.value) and "lz4" in str(e.value)
    for cap in (0, -5):
        with pytest.raises(ValueError):
            TieredStore(cap)
    with pytest.raises(ValueError):
        TieredStore(10, policy="random")


def test_context_manager_and_closed(atari_pong):
    with TieredStore(10) as store:
        store.extend(atari_pong[:3])
    with pytest.raises(tiered.errors.StoreClosedError):
        store.get(0)


def test_stats_keys(atari_pong):
    store = TieredStore(500, frames={"observation": 0})
    store.extend(atari_pong[:300])
    st = store.stats()
    assert st["rows"] == 300 and st["capacity"] == 500
    for key in ("logical_bytes", "stored_bytes", "ratio", "unique_frames", "dedup_factor", "compression_factor"):
        assert key in st["fields"]["observation"]
    for key in ("bytes_used", "budget", "blobs", "hits", "promotions", "demotions", "fragmentation"):
        assert key in st["tiers"]["warm"]
    assert st["tiers"]["warm"]["bytes_used"] > 0


def _count_calls(fn) -> tuple[int, int]:
    """``(all calls, Python-level calls)`` of ``fn()`` (the measure the per-call bounds below use)."""
    c = count_calls(fn)
    return c.all, c.python


#: the most Python-level calls (Python functions, numpy's Python wrappers included) one get and
#: one batched extend of Atari stacks with next observations may make, whatever the batch
MAX_GET_PYTHON_CALLS = 300
MAX_EXTEND_PYTHON_CALLS = 900
# calls the size classes of a blob copy make that a copy of up to 64 runs does not (util/hostcopy.py)
SMALL_COPY_CALLS = 30
# calls a split read makes that a read below the split points does not (a fixed number, whatever
# the batch): the decode's split (each slice checked on its own, the pool thread's job prepared by
# the calling thread, the handoff) and the gather's, plus the slices the calling thread runs itself
# when the pool's thread starts late (run_parallel(claim=True): a few calls each, how many depends
# on timing)
CLAIMED_SLICE_CALLS = 100


@pytest.mark.parametrize("config", ["frames_k4", "frames_k1", "default"])
def test_python_call_count_does_not_grow_with_batch(atari_mixed, config):
    """No per-item Python loop on extend/get: the call count is the same at batch 32 and 1024,
    and the fixed cost per call is bounded.

    Both stores are first filled past capacity (so the measured extend also overwrites rows and
    frees blobs, and arenas have grown); the 1024-row window crosses episode ends and the 32-row
    one does not, so trajectory handling must be vectorized too. The small window still closes a
    time chunk at the default K=8 (a window that closes none skips the encode branch entirely);
    extend may differ by a few calls (data-dependent branches), a per-row loop would add ~1000.
    A get of Atari stacks with next observations makes at most ``MAX_GET_PYTHON_CALLS`` Python
    function calls and a batched extend at most ``MAX_EXTEND_PYTHON_CALLS`` (634 and 1,858 before
    issue 31: per-call work is done once per schema and numpy's Python-level wrappers are avoided).
    """
    counts, python = {}, {}
    for b in (32, 1024):
        # the batched path at both sizes (a write of 32 rows would wait in the default write stage)
        store = TieredStore(2048, threads=2, stage_rows=0, **CONFIGS[config])
        store.extend(atari_mixed[:1500])
        store.extend(atari_mixed[1500:3000])
        store.get(torch.arange(b))
        for rep in range(2):  # the first round may grow arenas and buffers (amortized, not per item)
            win = atari_mixed[3000 + 500 * rep:3000 + 500 * rep + b]
            ext = _count_calls(lambda: store.extend(win))  # noqa: B023
            idx = torch.randperm(len(store), generator=torch.Generator().manual_seed(rep))[:b]
            g = _count_calls(lambda: store.get(idx))  # noqa: B023
        counts[b] = (ext[0], g[0])
        python[b] = (ext[1], g[1])
    # the same work whatever the batch, but for a constant: a large decode is split over the
    # decode threads (cut points, one slice call each), a small one stays on the calling thread
    # as one slice (no cut points); so is a large gather of frames into cells; the calling thread
    # may run a slice the pool's thread did not start; a small read's or write's blobs (up to 64
    # runs) are copied one memcpy each, not by size class
    assert abs(counts[32][1] - counts[1024][1]) <= 20 + SMALL_COPY_CALLS + CLAIMED_SLICE_CALLS, counts
    assert abs(counts[32][0] - counts[1024][0]) <= 10 + SMALL_COPY_CALLS, counts
    for b in (32, 1024):
        assert python[b][1] <= MAX_GET_PYTHON_CALLS, python
        assert python[b][0] <= MAX_EXTEND_PYTHON_CALLS, python


def test_get_returns_resolved_row_positions_under_index_key(atari_pong):
    store = TieredStore(50, frames={"observation": 0})
    store.extend(atari_pong[:30])
    out = store.get([-1, 3, 3], index_key="index")
    assert out["index"].dtype == torch.int64 and out["index"].tolist() == [29, 3, 3]
    assert_td_equal(out.exclude("index"), atari_pong[torch.tensor([29, 3, 3])])
    one = store.get(-2, index_key="index")
    assert one.batch_size == torch.Size([]) and int(one["index"]) == 28
    assert "index" not in store.get([0]).keys()


def test_root_exports_every_exception():
    import tiered.errors

    classes = {n for n, v in vars(tiered.errors).items() if isinstance(v, type) and issubclass(v, Exception)
               and v.__module__ == "tiered.errors"}
    assert classes <= set(tiered.__all__)
    assert all(getattr(tiered, n) is getattr(tiered.errors, n) for n in classes)


def test_a_large_write_leaves_no_large_scratch_behind(atari_mixed):
    """The neighbour comparison's temporaries are reused up to SCRATCH_MAX_BYTES; a write
    needing more gets fresh ones that go away with it (a store does not keep a buffer sized for
    its largest write)."""
    from tiered.engine.frames import SCRATCH_MAX_BYTES

    data = atari_mixed[:3600]
    store = TieredStore(3600, frames={"observation": 0}, stage_rows=0)
    store.extend(data[:16])
    family = parts(store).layout.families[0]
    assert 0 < family.scratch_nbytes <= SCRATCH_MAX_BYTES
    store.extend(data[16:])  # 3584 rows x 3 frames x 882 words of comparisons: past the bound
    assert family.scratch_nbytes <= SCRATCH_MAX_BYTES
    assert_td_equal(store.get(slice(None)), data)
