"""Prioritized replay decides what stays hot: exact blob priorities on real Atari rows, the
priority policy's admission, promotion and hysteresis in a real store, the probability mass
per tier, and a TorchRL PER loop (TensorDictPrioritizedReplayBuffer, rb.update_priority every
step) that samples exactly as on LazyTensorStorage while the store's blob priorities follow the
sampler's.

Nothing is mocked: real Pong frames from benchmarks/data/atari_frames.npz, real stores (in
memory and in tmp_path), real TorchRL replay buffers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tiered import TieredStore
from tiered.atari import load_fixture
from tiered.engine.blob_index import WARM
from tiered.errors import InvalidPriorityError
from tiered.policy import PriorityPolicy, TierState
from tiered.testing import parts
from tiered.testing.suites import recounted_blob_priorities

FIXTURE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "atari_frames.npz"
FRAMES = {"observation": 0}


@pytest.fixture(scope="module")
def pong():
    return load_fixture(FIXTURE, games=["Pong"])[:600]


def check_blob_priorities(store: TieredStore) -> None:
    live, expected = recounted_blob_priorities(store)
    assert parts(store).placement.priorities.blob_priorities(live).tolist() == expected.tolist()
    policy = parts(store).placement.policy
    if isinstance(policy, PriorityPolicy):
        assert policy.priorities(live).tolist() == expected.tolist()


@pytest.mark.parametrize("chunk_frames", [1, 4])
def test_blob_priorities_stay_exact_through_a_random_history_of_real_rows(pong, chunk_frames: int) -> None:
    """Extends (staged and direct), overwrites, priority updates with duplicates, flushes and a
    clear, on Pong stacks whose frames are shared between rows and chunked in time."""
    rng = np.random.default_rng(chunk_frames)
    store = TieredStore(150, frames=FRAMES, chunk_frames=chunk_frames, policy="priority", stage_rows=32)
    cursor = 0
    for step in range(40):
        op = rng.integers(5)
        if op == 0 or len(store) < 20:
            n = int(rng.choice([1, 3, 40]))  # 1 and 3 rows are staged, 40 go through at once
            store.extend(pong[cursor:cursor + n])
            cursor = (cursor + n) % 500
        elif op == 1:
            rows = np.unique(rng.integers(0, len(store), 2 if step % 2 else 12))
            src = rng.integers(0, 500, rows.size)
            store.set(rows, pong[torch.from_numpy(src)])
        elif op in (2, 3):
            rows = rng.integers(0, len(store), 64)  # duplicates: the last value wins
            store.set_priority(rows, rng.pareto(1.2, 64))
        elif step % 3 == 0:
            store.flush()
        check_blob_priorities(store)
    store.clear()
    check_blob_priorities(store)
    assert store.stats()["blobs"] == 0


def test_invalid_priorities_name_the_rows_and_change_nothing(pong) -> None:
    store = TieredStore(64, frames=FRAMES, policy="priority")
    store.extend(pong[:32])
    store.set_priority(np.arange(32), 0.5)
    for bad in (np.nan, np.inf, -1.0):
        with pytest.raises(InvalidPriorityError, match=r"row 7 got"):
            store.set_priority([3, 7], [2.0, bad])
        assert store.priorities([3, 7]).tolist() == [0.5, 0.5]
    with pytest.raises(InvalidPriorityError, match="2 priorities for 3 rows"):
        store.set_priority([1, 2, 3], [1.0, 2.0])
    check_blob_priorities(store)


def test_the_warm_tier_keeps_the_high_priority_blobs(pong, tmp_path) -> None:
    """A store on disk with a warm cache of ~10% of its blobs: after reads, the cache holds the
    blobs of the high-priority rows, and its share of the sampling mass far exceeds 10%."""
    store = TieredStore(600, tmp_path / "s", frames=FRAMES, policy="priority", hot_bytes=0, chunk_frames=4)
    for i in range(0, 600, 100):
        store.extend(pong[i:i + 100])
    store.flush()
    compressed = sum(f["stored_bytes"] for f in store.stats()["fields"].values() if f["kind"] == "blob")
    store.close()
    store = TieredStore.open(tmp_path / "s", mode="r+", policy="priority", hot_bytes=0,
                             warm_bytes=compressed // 10)
    rng = np.random.default_rng(0)
    priority = np.full(600, 0.01)
    hot_rows = rng.choice(600, 5, replace=False)  # their blobs fit the cache (~10% of ~170 blobs)
    priority[hot_rows] = 10.0
    store.set_priority(np.arange(600), priority)
    for _ in range(30):
        p = priority / priority.sum()
        store.get(rng.choice(600, 64, p=p))
    stats = store.stats()
    assert stats["tiers"]["warm"]["probability_mass"] > 0.5
    assert stats["tiers"]["warm"]["probability_mass"] + stats["tiers"]["cold"]["probability_mass"] + \
        stats["priority"]["in_memory_raw"] == pytest.approx(1.0)
    # every blob of a high-priority row is cached
    p = parts(store)
    held = p.index.loc[:, WARM] >= 0
    hot_blobs = np.unique(np.concatenate([t.blob[hot_rows].reshape(-1) for t in p.layout.tables.values()]))
    assert held[hot_blobs].all()
    store.close()


def _reopened_with_a_tenth_warm(pong, tmp_path) -> TieredStore:
    """The Pong rows committed to disk, reopened read-only with a warm tier that holds a tenth
    of the compressed blob bytes (4-frame blobs: the budgets of the tests below are sized for them)."""
    store = TieredStore(600, tmp_path / "s", frames=FRAMES, policy="priority", hot_bytes=0, chunk_frames=4)
    store.extend(pong)
    store.flush()
    compressed = sum(f["stored_bytes"] for f in store.stats()["fields"].values() if f["kind"] == "blob")
    store.close()
    return TieredStore.open(tmp_path / "s", mode="r", policy="priority", hot_bytes=0, warm_bytes=compressed // 10)


def test_set_priority_alone_moves_the_top_ranked_blobs_into_the_warm_tier(pong, tmp_path) -> None:
    """No reads at all: the priorities a ``set_priority`` gives move the best blobs (sampling
    weight per byte, the weight recounted exactly) up from the cold tier, a bounded share per call, until no blob left out
    beats the weakest one held by more than the margin; a blob whose priority jumps gets in."""
    store = _reopened_with_a_tenth_warm(pong, tmp_path)
    store.priority_alpha = 0.6
    p = parts(store)
    policy = p.placement.policy
    assert policy.alpha == 0.6  # the store tells the policy the sampler's exponent
    rng = np.random.default_rng(0)
    priority = rng.pareto(1.2, 600) + 0.01
    for _ in range(10):  # at most an eighth of the budget moves per call
        store.set_priority(np.arange(600), priority)
    warm = store.stats()["tiers"]["warm"]
    assert warm["hits"] == 0 and warm["promotions"] > 0 and store.stats()["tiers"]["cold"]["hits"] == 0
    live = p.index.live_ids()
    held = p.index.loc[live, WARM] >= 0
    # the rank: each blob's share of the sampling weight (priority ** alpha of each row, split
    # over the row's frame entries, summed over the entries naming the blob), per byte
    refs = np.concatenate([t.blob[:600] for t in p.layout.tables.values()], axis=1)
    share = np.repeat(store.priorities(np.arange(600)) ** 0.6 / refs.shape[1], refs.shape[1])
    mass = np.bincount(refs.reshape(-1), weights=share, minlength=int(live.max()) + 1)[live]
    np.testing.assert_allclose(p.placement.priorities.blob_mass(live), mass, rtol=1e-12)
    rank = mass / p.index.nbytes[live]  # sizes align to a few bytes more
    assert held.sum() >= 0.05 * live.size
    assert rank[~held].max() <= rank[held].min() * (1 + policy.margin) * 1.2
    assert warm["probability_mass"] > 0.2  # 10% of the bytes, well over 10% of the sampling mass
    # one row's priority jumps: its blobs come in without being read
    best = int(np.argmin(priority))
    store.set_priority([best], 1e6)
    row_blobs = np.unique(np.concatenate([t.blob[best] for t in p.layout.tables.values()]))
    assert (p.index.loc[row_blobs, WARM] >= 0).all()
    assert store.stats()["tiers"]["cold"]["hits"] == 0
    store.close()


def test_a_churning_warm_cache_stays_full_and_reads_back_exactly(pong, tmp_path) -> None:
    """Priorities that move every call make the warm cache swap blobs of many sizes: the blobs
    that fit its holes are taken, and its holes are compacted (blobs moved to the start of the
    arena, in place) instead of leaving it part empty, and every row reads back as written."""
    store = _reopened_with_a_tenth_warm(pong, tmp_path)
    rng = np.random.default_rng(1)
    fill = []
    for _ in range(40):
        store.set_priority(np.arange(600), rng.pareto(1.2, 600) + 0.01)
        warm = store.stats()["tiers"]["warm"]
        fill.append(warm["bytes_used"] / warm["budget"])
    assert warm["demotions"] >= 15  # the cache churned (more than its ~15 blobs left it)
    assert parts(store).placement.compactions > 0
    assert np.mean(fill[10:]) > 0.85
    rows = rng.choice(600, 200, replace=False)
    got = store.get(rows)
    assert (store.stats()["tiers"]["warm"]["hits"]) > 0
    for key in ("observation", ("next", "observation")):
        assert torch.equal(got.get(key), pong[rows].get(key))
    store.close()


def test_a_read_from_disk_only_to_cache_needs_a_priority_jump() -> None:
    """``promote`` (blobs a read already brought into memory) takes a blob that beats the one
    it displaces by the margin; ``prefetch`` (a ``set_priority`` would read the blob from disk
    just to cache it) only one that beats it by ``prefetch_margin``; free space is filled
    either way."""
    policy = PriorityPolicy(margin=0.25, prefetch_margin=3.0)
    held, cand = np.arange(16), np.arange(16, 20)
    policy.set_priority(np.arange(20), np.r_[np.ones(16), 1.5, 3.0, 4.5, 9.0])
    full = TierState("warm", budget=512, bytes_used=512, exclusive=False, ids=held, sizes=np.full(16, 32))
    assert policy.promote(cand, np.full(4, 16), full).tolist() == [True] * 4
    assert policy.prefetch(cand, np.full(4, 16), full).tolist() == [False, False, True, True]
    empty = TierState("warm", budget=512, bytes_used=0, exclusive=False, ids=np.empty(0, np.int64),
                      sizes=np.empty(0, np.int64))
    assert policy.prefetch(cand, np.full(4, 16), empty).tolist() == [True] * 4
    with pytest.raises(ValueError, match="prefetch_margin"):
        PriorityPolicy(prefetch_margin=-1.0)


def test_jittering_priorities_do_not_make_the_cache_thrash(pong) -> None:
    """Promotion needs a margin over the blob that would leave: priorities that jitter by a few
    percent around equal values promote nothing once the tier is full."""
    policy = PriorityPolicy(margin=0.25)
    held, cand = np.arange(10), np.arange(10, 20)
    policy.on_insert(np.arange(20))
    rng = np.random.default_rng(0)
    full = TierState("warm", budget=1280, bytes_used=1280, exclusive=False, ids=held, sizes=np.full(10, 128))
    for _ in range(20):
        policy.set_priority(np.arange(20), 1.0 + 0.1 * rng.random(20))
        assert not policy.promote(cand, np.full(10, 16), full).any()
    policy.set_priority(cand[:2], 5.0)  # a clear winner does get in, and only as far as it beats
    assert policy.promote(cand, np.full(10, 16), full).tolist() == [True, True] + [False] * 8
    # free space is taken without comparing, up to an eighth of the budget per call
    empty = TierState("warm", budget=1280, bytes_used=0, exclusive=False, ids=np.empty(0, np.int64),
                      sizes=np.empty(0, np.int64))
    assert policy.admit(cand, np.full(10, 64), empty).sum() == 2


def test_lru_and_fifo_keep_their_decisions_and_still_report_the_mass(pong) -> None:
    for name in ("lru", "fifo"):
        store = TieredStore(64, frames=FRAMES, policy=name, chunk_frames=4)  # closed chunks in 48 rows
        store.extend(pong[:48])
        assert parts(store).placement.priorities.active is False  # nothing tracked until a set
        store.set_priority(np.arange(48), np.linspace(0, 1, 48))
        check_blob_priorities(store)
        stats = store.stats()  # the open time chunk of the last rows is raw in memory
        assert stats["tiers"]["warm"]["probability_mass"] + stats["priority"]["in_memory_raw"] == pytest.approx(1.0)
        assert stats["tiers"]["warm"]["probability_mass"] > 0.9
        assert "admit" not in type(parts(store).placement.policy).__dict__


# ------------------------------------------------------------------------------------------
# TorchRL end to end
# ------------------------------------------------------------------------------------------
def _per_loop(storage, pong, steps: int = 12):
    from torchrl.data import TensorDictPrioritizedReplayBuffer

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=storage, batch_size=32,
                                           priority_key="td_error", generator=torch.Generator().manual_seed(0))
    errors = torch.Generator().manual_seed(1)
    sampled = []
    for i in range(steps):
        rb.extend(pong[i * 50:(i + 1) * 50])
        rb.add(pong[i])  # one row: staged in the store
        batch = rb.sample()
        sampled.append((batch["index"].clone(), batch["priority_weight"].clone()))
        td_error = torch.distributions.Pareto(0.1, 1.5).sample((32,)) * torch.rand(32, generator=errors)
        rb.update_priority(batch["index"], td_error)
    return rb, sampled


def test_torchrl_per_loop_samples_as_lazy_tensor_storage_and_the_store_follows_the_sampler(pong) -> None:
    pytest.importorskip("torchrl._torchrl", reason="TorchRL's C++ extension (segment trees) is missing")
    from torchrl.data import LazyTensorStorage

    from tiered.torchrl import TieredStorage

    torch.manual_seed(0)
    _, reference = _per_loop(LazyTensorStorage(400), pong)
    torch.manual_seed(0)
    rb, got = _per_loop(TieredStorage(400, frames=FRAMES, policy="priority", stage_rows=16), pong)
    for (ref_index, ref_weight), (index, weight) in zip(reference, got, strict=True):
        assert torch.equal(index, ref_index) and torch.equal(weight, ref_weight)
    store = rb.storage.store
    assert store.priority_alpha == 0.6
    # the store's row priorities are the sampler's: its tree holds (p + eps) ** alpha per row
    sampler = rb.sampler
    rows = np.arange(len(store))
    tree = np.array([sampler._sum_tree[int(r)] for r in rows], dtype=np.float64)
    expected_tree = (store.priorities(rows) + sampler._eps) ** sampler.alpha
    np.testing.assert_allclose(tree, expected_tree, rtol=1e-5)
    # and every blob's priority is the max over its rows, recounted from the sampler's tree
    check_blob_priorities(store)
    live, blob_prio = recounted_blob_priorities(store)
    p = parts(store)
    row_tree = np.zeros(store.capacity)
    row_tree[rows] = tree
    staged = p.write.stage.staged(rows) >= 0 if p.write.stage is not None else np.zeros(rows.size, bool)
    recount = np.zeros(live.size)
    position = np.searchsorted(live, np.concatenate([t.blob[rows[~staged]] for t in p.layout.tables.values()], 1))
    values = np.broadcast_to(row_tree[rows[~staged]][:, None], position.shape)
    np.maximum.at(recount, position.reshape(-1), values.reshape(-1))
    named = recount > 0
    np.testing.assert_allclose(recount[named], (blob_prio[named] + sampler._eps) ** sampler.alpha, rtol=1e-5)

    # a bad priority raises, naming the row, before the sampler or the store changes
    before_tree = sampler._sum_tree[3]
    before_rows = store.priorities([2, 3]).tolist()
    with pytest.raises(InvalidPriorityError, match="row 3 got nan"):
        rb.update_priority(torch.tensor([2, 3]), torch.tensor([1.0, float("nan")]))
    assert sampler._sum_tree[3] == before_tree and store.priorities([2, 3]).tolist() == before_rows


def test_torchrl_prioritized_slice_sampler_reaches_the_store(pong) -> None:
    pytest.importorskip("torchrl._torchrl", reason="TorchRL's C++ extension (segment trees) is missing")
    from torchrl.data import PrioritizedSliceSampler, TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    storage = TieredStorage(300, frames=FRAMES, policy="priority")
    sampler = PrioritizedSliceSampler(max_capacity=300, alpha=0.7, beta=0.5, slice_len=4,
                                      traj_key=("collector", "traj_ids"))
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=32)
    rb.extend(pong[:300])
    batch, info = rb.sample(return_info=True)
    index = info["index"][0] if isinstance(info["index"], tuple) else info["index"]
    rb.update_priority(index, torch.full((index.numel(),), 3.0))
    assert (storage.store.priorities(index.numpy()) == 3.0).all()
    assert storage.store.priority_alpha == pytest.approx(0.7)
    check_blob_priorities(storage.store)



def test_one_tier_serves_all_the_mass(pong, tmp_path) -> None:
    """A store whose stored blobs all lie in one tier (a path store opened with no memory tiers,
    as ``tiered info`` opens it): ``stats()`` gives that tier the whole mass without the row-by-row
    count, and the count (``tier_mass`` without ``only_tier``) agrees; open chunks still count as
    memory. (That the shortcut skips the rows is not observable here: a priority store's open
    already recounts every row.)"""
    store = TieredStore(600, tmp_path / "s", frames=FRAMES, policy="priority", hot_bytes=0, chunk_frames=4)
    store.extend(pong[:500])
    store.set_priority(np.arange(500), np.linspace(0.1, 2.0, 500))
    store.close()
    store = TieredStore.open(tmp_path / "s", policy="priority", hot_bytes=0, warm_bytes=0)
    p = parts(store)
    stats = store.stats()
    assert stats["tiers"]["cold"]["probability_mass"] == 1.0
    assert stats["priority"]["in_memory_raw"] == 0.0
    counted = p.placement.priorities.tier_mass(p.write.layout, p.rows.written, p.write.stage, p.placement.locate)
    assert counted["cold"] == pytest.approx(1.0) and counted["memory"] == 0.0
    store.close()
    # rows in an open time chunk are raw in memory: the shortcut must not claim them for a tier
    store = TieredStore(600, frames=FRAMES, policy="priority", hot_bytes=0, chunk_frames=4)
    store.extend(pong[:6])
    stats = store.stats()
    assert stats["priority"]["in_memory_raw"] > 0.0
