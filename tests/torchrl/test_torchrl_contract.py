"""TieredStorage runs what TorchRL's own storages run: column reads, pytrees, tensorclasses, ndim>1,
schema evolution, in-place writes, conditional updates, TorchRL's checkpointers and state dicts.

Every case runs the same calls on ``LazyTensorStorage`` (the oracle) and on ``TieredStorage`` with
real Atari rows, and compares the results.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle

import numpy as np
import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, tensorclass
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SliceSampler,
    TensorDictMaxValueWriter,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.checkpointers import (
    FlatStorageCheckpointer,
    H5StorageCheckpointer,
    NestedStorageCheckpointer,
)

from tiered.errors import NotSharedError, RaggedDataError, SchemaMismatchError
from tiered.torchrl import TieredStorage

OPTS = {"frames": {"observation": 0}}


@tensorclass
class Transition:
    observation: torch.Tensor
    action: torch.Tensor


def _leaves(td: TensorDictBase) -> list:
    return sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))


def assert_same(got, want, what: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), what
        return
    assert type(got) is type(want) or isinstance(got, TensorDictBase), f"{what}: {type(got)} != {type(want)}"
    assert _leaves(got) == _leaves(want), f"{what}: keys {_leaves(got)} != {_leaves(want)}"
    assert got.batch_size == want.batch_size, f"{what}: {got.batch_size} != {want.batch_size}"
    for key in want.keys(include_nested=True, leaves_only=True):
        assert torch.equal(got.get(key), want.get(key)), f"{what}: {key} differs"


@pytest.fixture(scope="module")
def pong(atari_pong) -> TensorDict:
    return atari_pong


def _pair(n: int = 40, **kw):
    return TieredStorage(n, **OPTS, **kw), LazyTensorStorage(n, **kw)


# ----------------------------------------------------------------------------------------
# Priority 1: column reads, "index", last cursor, MaxValueWriter
# ----------------------------------------------------------------------------------------
def test_get_key_reads_a_column_and_sequence_units_sample(pong):
    ours, oracle = _pair()
    for s in (ours, oracle):
        s.set(range(30), pong[:30])
    for key in (("next", "done"), "action", "observation"):
        assert torch.equal(ours.get(key), oracle.get(key)), key
        assert torch.equal(ours[key], oracle[key]), key
    rb = TensorDictReplayBuffer(storage=TieredStorage(200, **OPTS), batch_size=32,
                                sampler=SliceSampler(slice_len=8, end_key=("next", "done")))
    rb.extend(pong[:200])
    sample = rb.sample()
    assert sample["observation"].shape == (32, 4, 84, 84)


def test_column_read_of_tensor_data_is_a_type_error(pong):
    storage = TieredStorage(10)
    storage.set(range(3), pong["action"][:3])
    with pytest.raises(SchemaMismatchError, match="needs TensorDict data"):
        storage.get(("next", "done"))
    with pytest.raises(TypeError, match="TensorDict"):  # what TorchRL's Sequence unit expects
        storage["done"]


def test_storage_attribute_reads_the_written_rows(pong):
    ours, oracle = _pair()
    assert ours._storage is None
    for s in (ours, oracle):
        s.set(range(12), pong[:12])
    index = torch.tensor([3, 0, 11])
    assert_same(ours._storage[index], oracle._storage[index], "storage._storage[index]")
    assert ours._storage.batch_size == (12,)  # the written rows, not max_size of them
    with pytest.raises(AttributeError, match="set()"):
        ours._storage = pong[:12]


def test_user_field_named_index_is_kept(pong):
    data = pong[:10].clone()
    data["index"] = torch.arange(100, 110)
    ours, oracle = _pair()
    rbs = [ReplayBuffer(storage=s) for s in (ours, oracle)]
    for rb in rbs:
        rb.extend(data)
    assert torch.equal(rbs[0][:]["index"], torch.arange(100, 110))
    assert_same(rbs[0][:], rbs[1][:])


@pytest.mark.parametrize("how", ["add", "extend", "mixed"])
def test_max_value_writer_index_column_matches(pong, how):
    data = pong[:24].clone()
    data["key"] = torch.linspace(0, 1, 24)[torch.randperm(24, generator=torch.Generator().manual_seed(1))]
    rbs = [TensorDictReplayBuffer(storage=s, writer=TensorDictMaxValueWriter(rank_key="key"))
           for s in (TieredStorage(8, **OPTS), LazyTensorStorage(8))]
    for rb in rbs:
        if how in ("add", "mixed"):
            for i in range(12):
                rb.add(data[i])
        rest = data[12:] if how == "mixed" else data
        if how != "add":
            rb.extend(rest)
    assert_same(rbs[0][:], rbs[1][:], "rb[:] after MaxValueWriter")


def test_last_cursor_index_after_loads_and_empty(pong, tmp_path):
    rbs = [TensorDictReplayBuffer(storage=s) for s in _pair(n=20)]
    for rb in rbs:
        rb.extend(pong[:13])
        rb.dumps(tmp_path / type(rb.storage).__name__)
    fresh = [TensorDictReplayBuffer(storage=s) for s in _pair(n=20)]
    for rb, src in zip(fresh, rbs, strict=True):
        rb.loads(tmp_path / type(src.storage).__name__)
    assert fresh[0].storage._last_cursor_index == fresh[1].storage._last_cursor_index
    for rb in rbs:
        rb.empty()
    assert rbs[0].storage._last_cursor_index == rbs[1].storage._last_cursor_index == 12


# ----------------------------------------------------------------------------------------
# Priority 2: pytrees and tensorclasses
# ----------------------------------------------------------------------------------------
def _rows(tree: dict, n: int) -> list:
    return [[torch.utils._pytree.tree_map(lambda x, i=i: x[i], v) for v in tree.values()] for i in range(n)]


def test_pytrees_come_back_as_pytrees(pong):
    obs = pong["observation"][:20]
    tree = {"observation": obs, "b": {"c": [pong["action"][:20], (pong["next", "reward"][:20],)]}, 30: obs[:, 0, 0]}
    rbs = [ReplayBuffer(storage=s, batch_size=5, sampler=RandomSampler()) for s in _pair()]
    for rb in rbs:
        rb.extend(tree)
        rb.add(torch.utils._pytree.tree_map(lambda x: x[3], tree))
        rb.extend([{k: v for k, v in zip(tree, row, strict=True)} for row in _rows(tree, 2)])
    got, want = rbs[0][:], rbs[1][:]
    assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(want)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert torch.equal(g, w)
    idx = torch.tensor([4, 0, 21])
    for g, w in zip(torch.utils._pytree.tree_leaves(rbs[0][idx]), torch.utils._pytree.tree_leaves(rbs[1][idx]), strict=True):
        assert torch.equal(g, w)


def test_tensorclasses_come_back_as_tensorclasses(pong):
    data = Transition(observation=pong["observation"][:16], action=pong["action"][:16], batch_size=[16])
    rbs = [ReplayBuffer(storage=s, batch_size=4) for s in _pair()]
    for rb in rbs:
        rb.extend(data)
    got, want = rbs[0][torch.tensor([3, 0, 9])], rbs[1][torch.tensor([3, 0, 9])]
    assert isinstance(got, Transition) and isinstance(rbs[0].sample(), Transition)
    assert torch.equal(got.observation, want.observation) and torch.equal(got.action, want.action)


def test_rows_with_extra_batch_dims(pong):
    traj = pong[:40].reshape(8, 5)  # one 5-step trajectory per row
    rbs = [ReplayBuffer(storage=s, batch_size=2) for s in _pair(n=6)]
    for rb in rbs:
        rb.extend(traj[:4])
        rb.extend(traj[4:])  # wraps around: rows 4, 5, 0, 1
    assert_same(rbs[0][:], rbs[1][:], "rows of [5] transitions")
    assert_same(rbs[0][1], rbs[1][1], "one row")


# ----------------------------------------------------------------------------------------
# Priority 3: ndim>1
# ----------------------------------------------------------------------------------------
def test_ndim2_grid_matches_lazy_tensor_storage(pong):
    data = pong[:120].reshape(4, 30)  # [n_envs, T]
    rbs = [TensorDictReplayBuffer(storage=s, batch_size=16, sampler=RandomSampler())
           for s in (TieredStorage(90, ndim=2, **OPTS), LazyTensorStorage(90, ndim=2))]
    for rb in rbs:
        rb.extend(data[:, :10])
        rb.extend(data[:, 10:30])
    got, want = rbs
    assert got.storage.shape == want.storage.shape and len(got) == len(want)
    assert got.storage.max_size == want.storage.max_size
    assert_same(got[:], want[:], "rb[:] of an ndim=2 storage")
    idx = (torch.tensor([0, 5, 21]), torch.tensor([3, 1, 0]))
    assert_same(got.storage[idx], want.storage[idx], "grid index")
    assert_same(got.storage.get(2), want.storage.get(2), "one time step")
    torch.manual_seed(0)
    _, info = got.sample(return_info=True)
    assert torch.equal(got.storage[info["index"]]["observation"], want.storage[info["index"]]["observation"])


def test_ndim2_slice_sampler_stays_in_trajectories(pong):
    data = pong[:160].reshape(4, 40)
    data["traj"] = torch.arange(4).unsqueeze(1).expand(4, 40)
    rb = TensorDictReplayBuffer(storage=TieredStorage(160, ndim=2, **OPTS), batch_size=32,
                                sampler=SliceSampler(slice_len=8, traj_key="traj"))
    rb.extend(data)
    sample = rb.sample()
    traj = sample["traj"].view(4, 8)
    assert (traj == traj[:, :1]).all()
    flat = data.reshape(-1)
    rows = {int(t) * 40 for t in traj[:, 0]}
    assert rows  # each slice comes from one environment's trajectory
    for s in sample.split(8):
        env = int(s["traj"][0])
        match = (data[env]["action"].unfold(0, 8, 1) == s["action"]).all(-1).any()
        assert bool(match)
    assert flat.shape[0] == 160


def test_ndim2_list_of_bools_is_a_mask(pong):
    """A list of bools indexing an ndim=2 storage selects as a bool tensor would (torch's reading),
    not rows 0 and 1: along the first dimension, along the second, and as a grid-shaped mask."""
    data = pong[:40].reshape(4, 10)
    rbs = [TensorDictReplayBuffer(storage=s) for s in (TieredStorage(60, ndim=2, **OPTS), LazyTensorStorage(60, ndim=2))]
    for rb in rbs:
        rb.extend(data)
    got, want = (rb.storage for rb in rbs)
    rows, envs = want.shape
    first = [i % 3 == 0 for i in range(rows)]
    masks = {
        "along dim 0": first,
        "none along dim 0": [False] * rows,
        "every one along dim 0": [True] * rows,
        "a 1-tuple": (first,),
        "along dim 1": (slice(None), [j % 2 == 1 for j in range(envs)]),
        "the grid's shape": [[(i + j) % 3 == 0 for j in range(envs)] for i in range(rows)],
    }
    for what, mask in masks.items():
        for read in (lambda s, m: s[m], lambda s, m: s.get(m)):
            ours, oracle = read(got, mask), read(want, mask)
            assert_same(ours, oracle, what)
    assert got[first].batch_size == (sum(first), envs)  # a mask: not rows 1 and 0 of the grid
    assert torch.equal(got[first]["observation"], want[:]["observation"][torch.tensor(first)])
    env_mask = [j % 2 == 0 for j in range(envs)]  # rb[index] reads storage[:, index] (its data is env-major)
    assert_same(rbs[0][env_mask], rbs[1][env_mask], "rb[mask]")
    for bad in ([True, False], [[True] * envs] * (rows - 1)):  # a mask of another shape: refused by both
        for s in (got, want):
            with pytest.raises(IndexError):
                s[bad]


def test_ndim2_item_assignment_writes_through(pong):
    data = pong[:60].reshape(2, 30)
    rbs = [ReplayBuffer(storage=s) for s in (TieredStorage(62, ndim=2, **OPTS), LazyTensorStorage(62, ndim=2))]
    patch = pong[100:101]
    for rb in rbs:
        rb.extend(data)
        rb[0, 3:4] = patch  # ReplayBuffer routes a 2-tuple through rb[:][index] = value
        rb[:, 7:8] = patch.expand(2, 1)
        rb[:, 10:13] = pong[200:203]  # broadcast over the environments
    assert_same(rbs[0][:], rbs[1][:], "rb[i, j] = td on an ndim=2 storage")
    assert torch.equal(rbs[0][0, 3:4]["observation"], patch["observation"])
    assert rbs[0].writer._cursor == rbs[1].writer._cursor and len(rbs[0]) == len(rbs[1])


def test_ndim2_prioritized_buffer_matches(pong):
    data = pong[:24].reshape(4, 6)
    rbs = [TensorDictPrioritizedReplayBuffer(storage=s, batch_size=4, alpha=0.9, beta=1.1)
           for s in (TieredStorage(60, ndim=2, **OPTS), LazyTensorStorage(60, ndim=2))]
    index = torch.tensor([[0, 1], [5, 3], [2, 0]])  # grid coordinates, as samplers return them
    for rb in rbs:
        rb.extend(data)  # the writer marks [n, 2] coordinates
        rb.update_priority(index, torch.tensor([5.0, 2.0, 3.0]))
    trees = [rb.sampler._sum_tree[torch.arange(24)] for rb in rbs]
    assert torch.equal(trees[0], trees[1])
    stored = rbs[0].storage.grid_cells[tuple(index.unbind(-1))].numpy()
    assert rbs[0].storage.store.priorities(stored).tolist() == [5.0, 2.0, 3.0]
    assert rbs[0].sample()["observation"].shape == (4, 4, 84, 84)


def test_ragged_rows_are_refused_with_ragged_data_error(pong):
    rb = ReplayBuffer(storage=TieredStorage(10, **OPTS))
    obs = pong["observation"][:2]
    with pytest.raises(RaggedDataError, match="Stacking the elements of the list"):
        rb.extend([obs[0], obs[1, :2]])
    ragged = LazyStackedTensorDict(pong[:3].select("observation"),
                                   TensorDict(observation=obs[:1, :2].expand(3, 2, 84, 84), batch_size=[3]),
                                   stack_dim=1)
    with pytest.raises(RaggedDataError, match="LazyStackStorage"):
        ReplayBuffer(storage=TieredStorage(10, **OPTS)).extend(ragged)
    assert len(rb) == 0


# ----------------------------------------------------------------------------------------
# Priority 4: schema evolution, write-through, conditional updates, compilable
# ----------------------------------------------------------------------------------------
def test_new_key_after_first_write_reads_zeros_before(pong):
    rbs = [TensorDictReplayBuffer(storage=s) for s in _pair()]
    later = pong[10:20].clone()
    later["advantage"] = torch.randn(10, 1)
    for rb in rbs:
        rb.extend(pong[:10])
        rb.extend(later)
    assert_same(rbs[0][:], rbs[1][:], "a key added by the second write")
    for rb in rbs:  # PPO writes its targets back over every row
        rb[0:20] = rb[:].update({"value_target": torch.arange(20.0).unsqueeze(-1)})
    assert_same(rbs[0][:], rbs[1][:], "rb[:] = td with a new key")


def test_in_place_writes_go_through(pong):
    rbs = [TensorDictReplayBuffer(storage=s) for s in _pair()]
    for rb in rbs:
        rb.extend(pong[:20])
        rb.set_at_(("next", "reward"), torch.tensor([[5.0], [6.0]]), torch.tensor([3, 7]))
        rb.set_("action", torch.arange(20))
        rb.update_({"next": {"reward": torch.ones(20, 1)}})
    assert_same(rbs[0][:], rbs[1][:], "set_at_/set_/update_")
    assert torch.equal(rbs[0][:]["action"], torch.arange(20))


def test_mutation_revision_moves_as_lazy_tensor_storage(pong):
    revisions = []
    for storage in _pair(n=8):
        rb = TensorDictReplayBuffer(storage=storage)
        rb.extend(pong[:4])
        rb[0] = pong[4]
        rb.set_at_("action", torch.tensor([1]), torch.tensor([1]))
        rb.set_("action", torch.arange(4))
        rb.update_({"action": torch.arange(4) + 1})
        rb.empty()
        revisions.append(int(storage._mutation_revision))
    assert revisions[0] == revisions[1] == 6


def test_update_if_present_writes_live_rows(pong):
    rbs = [TensorDictReplayBuffer(storage=s, writer=RoundRobinWriter(track_generations=True))
           for s in _pair(n=10)]
    results = []
    for rb in rbs:
        rb.extend(pong[:10])
        index = torch.tensor([1, 4])
        gens = rb._writer.generations_of(index)
        rb.extend(pong[10:12])  # rows 0 and 1 are overwritten: row 1's patch is stale
        results.append(rb.update_if_present(index=index, generation=gens,
                                            patch={("next", "reward"): torch.tensor([[9.0], [8.0]])}).updated)
    assert torch.equal(results[0], results[1])
    assert_same(rbs[0][:], rbs[1][:], "update_if_present")


def test_compilable_is_accepted(pong):
    rb = TensorDictReplayBuffer(storage=TieredStorage(20, compilable=True, **OPTS), batch_size=4, compilable=True)
    rb.extend(pong[:10])
    assert rb.sample()["observation"].shape == (4, 4, 84, 84)
    ours, oracle = _pair(n=20, compilable=True)
    rb = ReplayBuffer(storage=ours, batch_size=4, compilable=True)

    @torch.compile(backend="eager")  # the storage runs eagerly inside compiled code (a graph break)
    def step(data):
        rb.extend(data)
        return rb.sample()

    for i in range(3):
        assert step(pong[i * 8:(i + 1) * 8])["observation"].shape == (4, 4, 84, 84)
        oracle.set(torch.arange(i * 8, (i + 1) * 8) % 20, pong[i * 8:(i + 1) * 8])
    assert len(ours) == 20
    assert_same(ours.get(np.arange(20)), oracle.get(np.arange(20)), "compiled extend")


# ----------------------------------------------------------------------------------------
# Priority 5: state dicts, TorchRL's checkpointers, processes
# ----------------------------------------------------------------------------------------
def test_state_dicts_interchange_with_lazy_tensor_storage(pong):
    lazy = LazyTensorStorage(30)
    lazy.set(range(12), pong[:12])
    ours = TieredStorage(30, **OPTS)
    ours.load_state_dict(lazy.state_dict())
    assert len(ours) == 12
    assert_same(ours[:], lazy[:], "LazyTensorStorage -> TieredStorage")
    back = LazyTensorStorage(30)
    back.load_state_dict(ours.torchrl_state_dict())
    assert_same(back[:], lazy[:], "TieredStorage -> LazyTensorStorage")


@pytest.mark.parametrize("checkpointer", [FlatStorageCheckpointer, NestedStorageCheckpointer, H5StorageCheckpointer])
def test_torchrl_checkpointers(pong, tmp_path, checkpointer):
    data = pong[:30].clone()
    data["done"] = torch.zeros(30, 1, dtype=torch.bool)
    data["terminated"] = torch.zeros(30, 1, dtype=torch.bool)
    data["truncated"] = torch.zeros(30, 1, dtype=torch.bool)
    rbs = [TensorDictReplayBuffer(storage=s, checkpointer=checkpointer()) for s in _pair(n=30)]
    for rb, name in zip(rbs, ("ours", "oracle"), strict=True):
        rb.extend(data)
        rb.dumps(tmp_path / name)
    loaded = [TensorDictReplayBuffer(storage=s, checkpointer=checkpointer()) for s in _pair(n=30)]
    # each loads the other's files
    loaded[0].loads(tmp_path / "oracle")
    loaded[1].loads(tmp_path / "ours")
    assert_same(loaded[0][:], loaded[1][:], f"{checkpointer.__name__} round trip")
    assert_same(loaded[0][:], rbs[1][:], f"{checkpointer.__name__} contents")


def test_lazy_memmap_state_dict_loads(pong, tmp_path):
    mm = LazyMemmapStorage(20, scratch_dir=tmp_path / "mm")
    mm.set(range(7), pong[:7])
    ours = TieredStorage(20, **OPTS)
    ours.load_state_dict(mm.state_dict())
    assert_same(ours[:], mm[:], "LazyMemmapStorage -> TieredStorage")


def _child_writes(rb, queue):
    try:
        rb.extend(rb[:2])
        queue.put("wrote")
    except NotSharedError as e:
        queue.put(f"NotSharedError: {e}")


def test_writer_in_another_process_is_refused_loudly(pong):
    rb = TensorDictReplayBuffer(storage=TieredStorage(20, **OPTS))
    rb.extend(pong[:4])
    # an in-process copy stays writable
    copy = pickle.loads(pickle.dumps(rb))
    copy.extend(pong[4:6])
    assert len(copy) == 6 and len(rb) == 4
    assert np.array_equal(copy[:]["action"].numpy(), pong[:6]["action"].numpy())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_writes, args=(rb, queue))
    proc.start()
    answer = queue.get(timeout=120)
    proc.join(timeout=60)
    assert answer.startswith("NotSharedError") and "process" in answer
    assert len(rb) == 4  # the child's refused write changed nothing here
