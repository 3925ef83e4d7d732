"""tiered.ray on a local Ray cluster (2 CPUs, loopback, no dashboard) started once for this module.

What is checked: samples are bit-exact against one TieredStore holding the same rows, for
uniform and prioritized sampling and both transports; global PER probabilities and weights equal
those of one TorchRL PrioritizedSampler over every row; the split of a batch by priority mass
equals a search over one sum tree of all rows; a killed shard is reported, restarted from its
files with its lost rows counted, and sampling goes on with ``on_shard_failure="skip"``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

ray = pytest.importorskip("ray")

from tiered import TieredStore  # noqa: E402
from tiered.errors import InvalidArgumentError, ShardFailedError  # noqa: E402
from tiered.ray import ShardedStore, split_ids  # noqa: E402

OPTIONS = dict(frames={"obs": 0}, chunk_frames=4, threads=1)
ACTOR = {"num_cpus": 0}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False, object_store_memory=200 * 1024 * 1024)
    yield
    ray.shutdown()


def episodes(n_traj: int = 5, length: int = 24, seed: int = 0) -> TensorDict:
    """Stacks of 4 frames from a few trajectories (consecutive stacks share 3 frames)."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, 3, (n_traj, length + 4, 16, 16), dtype=torch.uint8, generator=g)
    t = torch.arange(length)
    obs = torch.stack([frames[:, t + k] for k in range(4)], 2)  # [traj, T, 4, 16, 16]
    nxt = torch.stack([frames[:, t + 1 + k] for k in range(4)], 2)
    traj = torch.arange(n_traj)[:, None].expand(n_traj, length)
    td = TensorDict({"obs": obs, ("next", "obs"): nxt, "action": torch.randint(0, 6, (n_traj, length), generator=g),
                     "reward": torch.rand(n_traj, length, generator=g),
                     ("collector", "traj_ids"): traj}, [n_traj, length])
    return td.reshape(-1)


def positions(gids: torch.Tensor, order_gids: torch.Tensor) -> torch.Tensor:
    """Position in the original data of each global id (one sort, no loop)."""
    sorter = torch.argsort(order_gids)
    return sorter[torch.searchsorted(order_gids[sorter], gids)]


def kill(actor) -> None:
    """Kill a shard actor and wait until Ray reports it dead: ``ray.kill`` only asks, and a call
    sent an instant later may still be answered by the live actor."""
    ray.kill(actor)
    for _ in range(200):
        try:
            ray.get(actor.status.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def assert_same(a: TensorDict, b: TensorDict) -> None:
    keys = sorted(b.keys(True, True), key=str)
    assert sorted(a.keys(True, True), key=str) == keys
    for k in keys:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def filled():
    td = episodes()
    single = TieredStore(256, **OPTIONS)
    single.extend(td)
    # alpha=1, eps=0: leaves are the priorities themselves (integer priorities give exact sums)
    store = ShardedStore(3, 128, alpha=1.0, eps=0.0, seed=7, actor_options=ACTOR, **OPTIONS)
    gids = store.extend(td)
    yield [td, single, store, gids]  # a test that writes more rows appends them to all
    store.close()


def test_routing_keeps_trajectories_in_one_shard(filled):
    td, _, store, gids = filled
    shard, rows = split_ids(gids)
    traj = td["collector", "traj_ids"].numpy()
    assert (shard == traj % 3).all()
    assert store.shard_rows() == [48, 48, 24] and len(store) == td.shape[0]
    assert np.unique(gids.numpy()).size == gids.numel()


@pytest.mark.parametrize("transport", ["decoded", "compressed", "repacked"])
@pytest.mark.parametrize("prioritized", [False, True])
def test_samples_bit_exact_against_one_store(filled, transport, prioritized):
    td, single, store, gids = filled
    if prioritized:  # skewed priorities: rows of trajectory 4 (shard 1) weigh 10x the others
        store.update_priority(gids, 1.0 + 9.0 * (td["collector", "traj_ids"] == 4).double())
    data, info = store.sample(200, prioritized=prioritized, transport=transport)
    pos = positions(info["index"], gids)
    assert_same(data, single.get(pos))
    assert_same(store.get(info["index"][:17], transport=transport), single.get(pos[:17]))
    counts = np.bincount(split_ids(info["index"])[0], minlength=3)
    assert (counts > 0).all()  # every shard took part


@pytest.mark.parametrize("transport", ["compressed", "repacked"])
def test_shard_replies_carry_exactly_the_frames_the_rows_use(filled, transport):
    from tiered.engine.transport import decode_rows

    td, _, store, gids = filled
    sel = gids[:120:3]  # rows of episodes(): 5 trajectories of 24 steps
    shard, rows = split_ids(sel)
    mine = rows[shard == 0]
    packed = ray.get(store.actors[0].get.remote(mine, None, transport))
    decoded = ray.get(store.actors[0].get.remote(mine, None, "decoded"))
    assert_same(decode_rows(packed), decoded)
    row_bytes = sum(v[0].numel() * v.element_size() for v in td.values(True, True))
    assert sum(v.numel() * v.element_size() for v in decoded.values(True, True)) == mine.size * row_bytes
    # stack t of a trajectory holds its frames t..t+3 and the next stack adds t+4; each frame is
    # stored once per trajectory, in time chunks of 4 frames from the trajectory's start
    pos = positions(sel[torch.from_numpy(shard == 0)], gids).numpy()
    traj, step = pos // 24, pos % 24
    frames = {(int(a), int(b) + k) for a, b in zip(traj, step, strict=True) for k in range(5)}
    (fam,) = packed.families
    frame_nbytes = 16 * 16
    assert fam.blobs.frame_nbytes == frame_nbytes
    sent = int(fam.blobs.raw_nbytes.astype(np.int64).sum())
    if transport == "repacked":  # each needed frame once
        assert sent == len(frames) * frame_nbytes
    else:  # every chunk that holds one of them, whole
        chunks = {(a, f // 4) for a, f in frames}
        assert fam.blobs.n_blobs == len(chunks) and sent == len(chunks) * 4 * frame_nbytes
    assert packed.staged_pos.size == 0 and fam.frame_idx.dtype == np.uint16


def test_global_per_matches_torchrl_prioritized_sampler(filled):
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

    td = filled[0]
    n = td.shape[0]
    alpha, beta, eps = 0.7, 0.5, 1e-6
    local = ShardedStore(2, 128, alpha=alpha, beta=beta, eps=eps, seed=3, actor_options=ACTOR, **OPTIONS)
    try:
        ids = local.extend(td)
        prio = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 5 + 0.01
        local.update_priority(ids, prio)
        sampler = PrioritizedSampler(n, alpha=alpha, beta=beta, eps=eps)  # float32 trees
        rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=sampler, batch_size=64)
        rb.extend(td)
        rb.update_priority(torch.arange(n), prio.float())
        _, rb_info = rb.sample(return_info=True)
        idx = torch.as_tensor(rb_info["index"])
        prob, weight = local.probabilities(ids[idx])
        p_sum = sampler._sum_tree.query(0, n)
        expected_prob = torch.as_tensor(sampler._sum_tree[idx]) / p_sum
        torch.testing.assert_close(prob, expected_prob.double(), rtol=1e-5, atol=0)
        torch.testing.assert_close(weight, torch.as_tensor(rb_info["priority_weight"]).double(), rtol=1e-5, atol=0)
        # and the weights a prioritized sample returns are those of its ids
        _, info = local.sample(128, prioritized=True, transport="compressed")
        again = local.probabilities(info["index"])
        torch.testing.assert_close(info["priority_weight"], again[1])
        torch.testing.assert_close(info["probability"], again[0])
    finally:
        local.close()


def test_split_by_mass_equals_one_sum_tree_over_all_rows(filled):
    td, _, store, gids = filled
    prio = torch.randint(1, 9, (td.shape[0],), generator=torch.Generator().manual_seed(5)).double()
    store.update_priority(gids, prio)
    total = store.total_priority
    assert total == float(prio.sum())
    seed = 11
    store.reseed(seed)
    info = store.sample_ids(256, prioritized=True)
    # the same masses over one tree of every row, rows in shard order (integers: sums are exact)
    masses = np.random.default_rng(seed).random(256) * total
    order = torch.argsort(gids)
    ends = np.cumsum(prio[order].numpy())
    expected = gids[order][np.searchsorted(ends, masses, side="right")]
    assert torch.equal(info["index"], expected)


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError, match="transport"):
        ShardedStore(2, 16, transport="zip")
    with pytest.raises(InvalidArgumentError, match="on_shard_failure"):
        ShardedStore(2, 16, on_shard_failure="ignore")
    from tiered.ray.shard import ShardServer

    with pytest.raises(InvalidArgumentError, match="transport must be"):
        ShardServer(0, 16).get(np.array([], dtype=np.int64), transport="zip")


def test_killed_shard_restarts_from_its_files_and_skip_goes_on(tmp_path):
    td = episodes(n_traj=4, length=16, seed=4)
    first, second = td[:32], td[32:]  # trajectories 0, 1 then 2, 3
    store = ShardedStore(2, 64, tmp_path / "buf", seed=1, actor_options=ACTOR, **OPTIONS)
    try:
        store.extend(first)
        store.flush()
        ids = store.extend(second)
        unflushed = int((split_ids(ids)[0] == 1).sum())
        rows_before = store.shard_rows()
        kill(store.actors[1])
        with pytest.raises(ShardFailedError, match=r"shard 1 .*shard-1.*restarted.* (\d+) row") as err:
            store.sample(32)
        assert err.value.shard == 1 and err.value.restarted and err.value.lost_rows == unflushed == 16
        assert store.shard_rows() == [rows_before[0], rows_before[1] - unflushed]
        assert store.failures[-1].lost_rows == 16
        # the restarted shard serves its committed rows, bit-exact
        data, info = store.sample(64)
        shard, rows = split_ids(info["index"])
        mine = torch.from_numpy(shard == 1)
        assert mine.any()
        assert_same(data[mine], first[16 + torch.from_numpy(rows[shard == 1])])  # trajectory 1: rows 16..31
        # with "skip", a killed shard does not stop sampling
        store.on_shard_failure = "skip"
        kill(store.actors[0])
        with pytest.warns(RuntimeWarning, match="shard 0"):
            data, info = store.sample(48)
        assert data.shape[0] == 48 and len(store.failures) == 2
    finally:
        store.close()


def test_in_memory_dead_shard_is_left_out_with_skip():
    td = episodes(n_traj=4, length=8, seed=6)
    store = ShardedStore(2, 32, on_shard_failure="skip", seed=2, actor_options=ACTOR, **OPTIONS)
    try:
        store.extend(td)
        kill(store.actors[0])
        with pytest.warns(RuntimeWarning, match="no path"):
            data, info = store.sample(20, prioritized=True)
        assert (split_ids(info["index"])[0] == 1).all() and data.shape[0] == 20
        assert store.dead == {0} and store.failures[0].lost_rows == 16
        with pytest.raises(ShardFailedError, match="shard 0"):
            store.get(torch.tensor([0]))
    finally:
        store.close()


@pytest.mark.parametrize("prioritized", [False, True])
def test_torchrl_replay_buffer_over_the_shards(filled, prioritized):
    from tiered.ray.storage import sharded_replay_buffer

    td, single, store, gids = filled
    rb = sharded_replay_buffer(store, batch_size=32, prioritized=prioritized, transport="compressed",
                               priority_key="td_error")
    calls = dict(store.calls)
    batch = rb.sample()
    index = batch["index"]
    # ids and rows came in one round trip: one sample call per shard drawn, no get
    made = {op: n - calls.get(op, 0) for op, n in store.calls.items() if n != calls.get(op, 0)}
    assert made == {"sample": np.unique(split_ids(index)[0]).size}
    assert rb.storage.last is None  # the rows were handed over, once
    assert_same(batch.exclude("index", "priority_weight"), single.get(positions(index, gids)))
    if prioritized:
        torch.testing.assert_close(batch["priority_weight"], store.probabilities(index)[1].to(batch["priority_weight"].dtype))
        batch["td_error"] = torch.full((32,), 3.5)
        rb.update_tensordict_priority(batch)
        prob, _ = store.probabilities(index)
        assert torch.allclose(prob * store.total_priority, torch.full((32,), 3.5, dtype=torch.float64))
    else:
        assert "priority_weight" not in batch.keys()
    # rb.extend routes through the shards too
    before = store.shard_rows()
    more = episodes(n_traj=1, length=4, seed=9)
    more.set(("collector", "traj_ids"), torch.ones(4, dtype=torch.int64))  # trajectory 1 -> shard 1
    new_ids = rb.extend(more)
    assert store.shard_rows()[1] == before[1] + 4
    single.extend(more)
    filled[0], filled[3] = torch.cat([td, more]), torch.cat([gids, new_ids])
    assert_same(store.get(new_ids), more)


def test_a_copy_in_another_process_writes_to_the_same_shards(filled):
    td, single, store, gids = filled
    copy = ray.cloudpickle.loads(ray.cloudpickle.dumps(store))  # what a collector actor receives
    more = episodes(n_traj=1, length=6, seed=12)
    more.set(("collector", "traj_ids"), torch.full((6,), 2, dtype=torch.int64))  # trajectory 2 -> shard 2
    before = store.shard_rows()
    new_ids = copy.extend(more)
    assert store.shard_rows() == before  # the learner's totals lag until it hears from the shard ...
    store.refresh()
    assert store.shard_rows()[2] == before[2] + 6  # ... or asks
    single.extend(more)
    filled[0], filled[3] = torch.cat([td, more]), torch.cat([gids, new_ids])
    assert_same(store.get(new_ids, transport="compressed"), more)


def test_priority_updates_since_the_last_flush_are_counted_when_a_shard_dies(tmp_path):
    """Acknowledged priority updates are committed by the next flush; a shard killed before it
    restarts with its committed priorities, and the failure counts the updates it lost."""
    td = episodes(n_traj=4, length=16, seed=5)
    store = ShardedStore(2, 64, tmp_path / "buf", alpha=1.0, eps=0.0, seed=3, actor_options=ACTOR, **OPTIONS)
    try:
        ids = store.extend(td)
        shard = split_ids(ids)[0]
        on1, on0 = ids[torch.from_numpy(shard == 1)], ids[torch.from_numpy(shard == 0)]
        store.update_priority(on1[:4], torch.tensor([2.0, 3.0, 4.0, 5.0]))
        store.flush()  # durable: survives the kill below
        store.update_priority(on1[4:10], torch.full((6,), 7.0))  # acknowledged, not committed
        store.update_priority(on1[4:6], torch.full((2,), 9.0))   # the same rows again: 2 more updates
        store.update_priority(on0[:3], torch.full((3,), 6.0))    # another shard's: not lost
        kill(store.actors[1])
        with pytest.raises(ShardFailedError, match=r"8 priority update\(s\)") as err:
            store.update_priority(on1[:1], torch.tensor([1.0]))
        assert err.value.shard == 1 and err.value.restarted and err.value.lost_rows == 0
        assert err.value.lost_priority_updates == 8 and store.failures[-1].lost_priority_updates == 8
        # the restarted shard has the committed priorities: the flushed ones, 1.0 for the others
        probability, _ = store.probabilities(on1[:10])
        total = store.total_priority
        assert probability.mul(total).tolist() == pytest.approx([2.0, 3.0, 4.0, 5.0] + [1.0] * 6)
        # shard 0 kept its updates (not lost, and not counted as lost)
        assert store.probabilities(on0[:3])[0].mul(total).tolist() == pytest.approx([6.0] * 3)
        # after a flush nothing is pending: a kill loses no update
        store.update_priority(on1[:2], torch.tensor([8.0, 8.0]))
        store.flush()
        kill(store.actors[1])
        with pytest.raises(ShardFailedError) as err:
            store.sample(8)
        assert err.value.lost_priority_updates == 0 and err.value.lost_rows == 0
        assert store.probabilities(on1[:2])[0].mul(store.total_priority).tolist() == pytest.approx([8.0, 8.0])
    finally:
        store.close()
