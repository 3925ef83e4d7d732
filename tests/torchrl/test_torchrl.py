"""TieredStorage: TorchRL's storage contract, checkpointing, pickling, threads and decode economy.

Every test uses real TorchRL buffers and real Atari frames; where TorchRL has a behaviour of its
own, ``LazyTensorStorage`` (or ``LazyMemmapStorage``) is run beside it as the oracle.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import re
import threading

import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictReplayBuffer,
    TensorStorage,
)
from torchrl.data.replay_buffers.storages import _collate_id, _get_default_collate

import tiered
from tiered.atari import concat_rollouts
from tiered.errors import FormatVersionError, InvalidArgumentError, ReadOnlyStoreError
from tiered.tiers.memmap import GROW_MIN
from tiered.torchrl import TieredStorage, TieredStorageCheckpointer

OPTS = {"frames": {"observation": 0}}


def _names(td: TensorDictBase) -> list[str]:
    return sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))


def assert_same(got, want, what: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), what
        return
    assert _names(got) == _names(want), f"{what}: keys {_names(got)} != {_names(want)}"
    assert got.batch_size == want.batch_size, what
    for key in want.keys(include_nested=True, leaves_only=True):
        assert torch.equal(got.get(key), want.get(key)), f"{what}: {key} differs"


def decoded(storage: TieredStorage) -> int:
    return storage.store.stats()["counters"]["blobs_decoded"]


@pytest.fixture(scope="module")
def pong(atari_pong) -> TensorDict:
    return atari_pong


@pytest.fixture(scope="module")
def big(atari_mixed) -> TensorDict:
    """20,000 real Atari transitions: Pong + MsPacman tiled 5 times, episode ids kept distinct."""
    return concat_rollouts([atari_mixed] * 5)


@pytest.fixture(scope="module")
def big_rb(big):
    storage = TieredStorage(big.shape[0], **OPTS)
    rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(slice_len=32), batch_size=256)
    for lo in range(0, big.shape[0], 2500):
        rb.extend(big[lo:lo + 2500])
    return rb


# ----------------------------------------------------------------------------------------
# Type-level contract
# ----------------------------------------------------------------------------------------
def test_is_a_tensor_storage_with_identity_collate(pong):
    storage = TieredStorage(100, **OPTS)
    assert isinstance(storage, TensorStorage)
    assert _get_default_collate(storage) is _collate_id
    rb = ReplayBuffer(storage=storage, batch_size=4)  # no collate_fn= needed
    rb.extend(pong[:10])
    sample = rb.sample()
    assert isinstance(sample, TensorDictBase) and sample.batch_size == torch.Size([4])
    assert sample["observation"].shape == (4, 4, 84, 84)
    assert storage.supports_conditional_update  # rb.update_if_present writes through


def test_constructor_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="ndim"):
        TieredStorage(10, ndim=0)
    with pytest.raises(ValueError, match="auto"):
        TieredStorage(10, device="auto")


def test_shape_is_len_until_full_then_max_size(pong):
    storage = TieredStorage(10, **OPTS)
    oracle = LazyTensorStorage(10)
    for s in (storage, oracle):
        s.set(torch.arange(4), pong[:4])
    assert storage.shape == oracle.shape == torch.Size([4])
    for s in (storage, oracle):
        s.set(torch.tensor([4, 5, 6, 7, 8, 9, 0, 1]), pong[4:12])
    assert storage.shape == oracle.shape == torch.Size([10])
    assert storage._is_full and len(storage) == 10


# ----------------------------------------------------------------------------------------
# set(): every index form, set_cursor, revision, length
# ----------------------------------------------------------------------------------------
# form -> (index factory, rows); TorchRL passes numpy indices only from rb[...] = td (set_cursor=False)
SET_FORMS = {
    "int": (lambda: 3, 1),
    "negative int": (lambda: -1, 1),
    "0-d tensor": (lambda: torch.tensor(7), 1),
    "wrapping tensor": (lambda: torch.tensor([8, 9, 0, 1]), 4),
    "unsorted tensor": (lambda: torch.tensor([5, 2, 9, 0]), 4),
    "slice": (lambda: slice(2, 6), 4),
    "range": (lambda: range(4, 8), 4),
    "list": (lambda: [1, 3, 5], 3),
    "1-tuple": (lambda: (torch.tensor([2, 4]),), 2),
    "numpy": (lambda: np.array([6, 0]), 2),
}


def _data_for(data: TensorDict, lo: int, n: int, scalar: bool) -> TensorDict:
    return data[lo] if scalar else data[lo:lo + n]


@pytest.mark.parametrize("form,set_cursor", [(f, c) for f in sorted(SET_FORMS) for c in (True, False)
                                             if c is False or f != "numpy"])
def test_set_index_forms_match_lazy_tensor_storage(pong, form, set_cursor):
    make_index, n = SET_FORMS[form]
    scalar = form in ("int", "negative int", "0-d tensor")
    storages = [TieredStorage(10, **OPTS), LazyTensorStorage(10)]
    for s in storages:
        s.set(torch.arange(10), pong[:10])
    revisions = [s._mutation_revision for s in storages]
    for s in storages:
        s.set(make_index(), _data_for(pong, 600, n, scalar), set_cursor=set_cursor)
    got, want = storages
    assert [s._mutation_revision - r for s, r in zip(storages, revisions, strict=True)] == [1, 1]
    assert len(got) == len(want) == 10
    assert got._last_cursor_index == want._last_cursor_index
    assert_same(got[:], want[:], form)
    assert_same(got.get(torch.arange(10)), want.get(torch.arange(10)), form)


def test_set_slice_on_empty_storage(pong):
    storages = [TieredStorage(10, **OPTS), LazyTensorStorage(10)]
    for s in storages:
        s.set(slice(0, 4), pong[:4])
        s.set(slice(None, 2), pong[100:102])
    got, want = storages
    assert len(got) == len(want) == 6  # TorchRL grows the length by the rows written
    assert got._last_cursor_index == want._last_cursor_index == 1
    assert_same(got[:4], want[:4], "slice on empty storage")


def test_set_cursor_false_leaves_length(pong):
    storages = [TieredStorage(10, **OPTS), LazyTensorStorage(10)]
    for s in storages:
        s.set(torch.arange(4), pong[:4])
        s.set(torch.tensor([2, 3]), pong[50:52], set_cursor=False)
        s.set(6, pong[60], set_cursor=False)  # past the length: written, not counted
    got, want = storages
    assert len(got) == len(want) == 4
    assert got._last_cursor_index == want._last_cursor_index == 3
    assert_same(got[:], want[:], "after set_cursor=False")
    assert torch.equal(got[1]["observation"], pong[1]["observation"])
    assert torch.equal(got[3]["observation"], pong[51]["observation"])


@pytest.mark.cuda
def test_set_with_cuda_index(pong):
    storages = [TieredStorage(10, **OPTS), LazyTensorStorage(10)]
    for s in storages:
        s.set(torch.arange(10, device="cuda"), pong[:10])
        s.set(torch.tensor([8, 9, 0, 1], device="cuda"), pong[20:24].to("cuda"))
    got, want = storages
    assert got._last_cursor_index == want._last_cursor_index == 1
    assert_same(got[:], want[:], "cuda index")


def test_mutation_revision_goes_up_once_per_call(pong, tmp_path):
    rbs = [TensorDictReplayBuffer(storage=s, batch_size=4)
           for s in (TieredStorage(20, **OPTS), LazyTensorStorage(20))]
    ops = {
        "extend": lambda rb: rb.extend(pong[:7]),
        "add": lambda rb: rb.add(pong[7]),
        "rb[i] = td": lambda rb: rb.__setitem__(3, pong[30]),
        "rb[a:b] = td": lambda rb: rb.__setitem__(slice(2, 5), pong[40:43]),
        "rb[tensor] = td": lambda rb: rb.__setitem__(torch.tensor([1, 6]), pong[50:52]),
        "empty": lambda rb: rb.empty(),
        "extend again": lambda rb: rb.extend(pong[100:110]),
    }
    for name, op in ops.items():
        for rb in rbs:
            before = rb.storage._mutation_revision
            op(rb)
            assert rb.storage._mutation_revision - before == 1, f"{name} on {type(rb.storage).__name__}"
    state = rbs[0].state_dict()
    before = rbs[0].storage._mutation_revision
    rbs[0].load_state_dict(state)
    assert rbs[0].storage._mutation_revision - before == 1
    rbs[0].dumps(tmp_path / "ckpt")
    before = rbs[0].storage._mutation_revision
    rbs[0].loads(tmp_path / "ckpt")
    assert rbs[0].storage._mutation_revision - before == 1


def test_rb_setitem_keeps_length_and_cursor(pong):
    rbs = [TensorDictReplayBuffer(storage=s) for s in (TieredStorage(30, **OPTS), LazyTensorStorage(30))]
    for rb in rbs:
        rb.extend(pong[:25])
        rb[3:4] = pong[200:201]
        rb[10:20] = pong[300:310]
        rb[torch.tensor([0, 24])] = pong[400:402]
    got, want = rbs
    assert len(got) == len(want) == 25
    assert got._writer._cursor == want._writer._cursor == 25
    assert_same(got[:], want[:], "after rb[...] = td")
    assert torch.equal(got[10]["observation"], pong[300]["observation"])


def test_empty_then_reuse(pong):
    rb = TensorDictReplayBuffer(storage=TieredStorage(20, **OPTS), batch_size=4)
    rb.extend(pong[:20])
    oracle = TensorDictReplayBuffer(storage=LazyTensorStorage(20), batch_size=4)
    oracle.extend(pong[:20])
    rb.empty()
    oracle.empty()
    # TorchRL's storages keep the last cursor through empty(); so does TieredStorage
    assert len(rb) == 0 and rb.storage._last_cursor_index == oracle.storage._last_cursor_index == 19
    with pytest.raises(RuntimeError, match="empty storage"):
        rb.sample()
    rb.extend(pong[500:505])
    assert len(rb) == 5
    assert torch.equal(rb[:]["observation"], pong[500:505]["observation"])


def test_plain_tensor_data_matches_lazy_tensor_storage(pong):
    frames = pong["observation"][:40, 0]  # [40, 84, 84] uint8
    rbs = [ReplayBuffer(storage=s, batch_size=8, generator=torch.Generator().manual_seed(0))
           for s in (TieredStorage(30), LazyTensorStorage(30))]
    for rb in rbs:
        rb.extend(frames[:25])
        rb.extend(frames[25:])
        rb.add(frames[0])
    got, want = [rb.sample() for rb in rbs]
    assert torch.equal(got, want)
    assert torch.equal(rbs[0][:], rbs[1][:])
    assert torch.equal(rbs[0][2], rbs[1][2])


def test_index_entry_is_stored_like_lazy_tensor_storage(pong):
    """TensorDictRoundRobinWriter stores each row's position under "index": a field like any other."""
    rbs = [TensorDictReplayBuffer(storage=s) for s in (TieredStorage(12, **OPTS), LazyTensorStorage(12))]
    for rb in rbs:
        rb.extend(pong[:9])
        rb.extend(pong[9:16])
    got, want = rbs
    assert ("index",) in got.storage.store.schema
    assert_same(got[:], want[:], "rb[:] with index")
    assert torch.equal(got[torch.tensor([3, 1])]["index"], torch.tensor([3, 1]))


# ----------------------------------------------------------------------------------------
# Reading: physical order, lazy views, decode economy
# ----------------------------------------------------------------------------------------
def test_full_slice_is_physical_order_and_lazy(pong):
    rb = TensorDictReplayBuffer(storage=TieredStorage(10, **OPTS, chunk_frames=4))  # K=4: closed chunks
    rb.extend(pong[:8])
    rb.extend(pong[8:14])  # rows 0-3 now hold transitions 10-13
    storage = rb.storage
    before = decoded(storage)
    view = storage[:]
    traj = view["collector", "traj_ids"]
    assert decoded(storage) == before, "storage[:] decoded frames for a dense column"
    expected = torch.cat([pong[10:14], pong[4:10]])
    assert torch.equal(traj, expected["collector", "traj_ids"])
    assert torch.equal(view["observation"], expected["observation"])  # decoded now, in one call
    assert decoded(storage) > before
    assert torch.equal(rb[:]["next", "observation"], expected["next", "observation"])


def _check_slice_sampler_decode_economy(rb) -> None:
    """Each sample decodes exactly the blobs a direct get of its rows decodes: SliceSampler's
    storage[:] / storage[index] lookups of trajectory ids and done flags decode no frame."""
    storage = rb.storage
    total_blobs = storage.store.stats()["blobs"]
    for _ in range(3):
        before = decoded(storage)
        sample, info = rb.sample(return_info=True)
        by_sample = decoded(storage) - before
        before = decoded(storage)
        direct = storage.store.get(info["index"])
        by_batch = decoded(storage) - before
        assert by_sample == by_batch, "SliceSampler's storage[:] / storage[index] decoded frames"
        assert 0 < by_sample < total_blobs / 10
        assert torch.equal(sample["observation"], direct["observation"])
        traj = sample["collector", "traj_ids"].view(8, 32)
        assert (traj == traj[:, :1]).all(), "a slice crossed a trajectory"


def test_slice_sampler_decodes_only_what_the_batch_needs(big_rb):
    _check_slice_sampler_decode_economy(big_rb)


@pytest.mark.slow
def test_slice_sampler_decodes_only_what_the_batch_needs_100k_rows(atari_mixed):
    """The issue's size: 100,000 real Atari rows (the 4,000-row Pong + MsPacman rollout written
    25 times, each copy with its own trajectory ids)."""
    storage = TieredStorage(100_000, **OPTS)
    rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(slice_len=32), batch_size=256)
    n = atari_mixed.shape[0]
    shift = int(atari_mixed["collector", "traj_ids"].max()) + 1
    for copy in range(100_000 // n):
        for lo in range(0, n, 2000):
            chunk = atari_mixed[lo:lo + 2000]  # a new TensorDict of views: set() leaves the source
            chunk.set(("collector", "traj_ids"), chunk.get(("collector", "traj_ids")) + copy * shift)
            rb.extend(chunk)
    assert len(rb) == 100_000
    _check_slice_sampler_decode_economy(rb)
    sample = rb.sample()
    index = sample["index"].reshape(-1)
    assert torch.equal(sample["observation"], atari_mixed["observation"][index % n])


def test_slice_sampler_on_large_buffer_returns_the_right_frames(big_rb, big):
    torch.manual_seed(0)
    sample = big_rb.sample()
    index = sample["index"].reshape(-1)
    assert torch.equal(sample["observation"], big["observation"][index])
    assert torch.equal(sample["next", "observation"], big["next", "observation"][index])
    steps = index.view(8, 32)
    assert ((steps[:, 1:] - steps[:, :-1]) == 1).all(), "slices are not consecutive rows"


# ----------------------------------------------------------------------------------------
# Checkpointing
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fill", ["partial", "full"])
@pytest.mark.parametrize("where", ["memory", "path"])
def test_dumps_loads_roundtrip(pong, tmp_path, fill, where):
    n = 30 if fill == "partial" else 64
    path = tmp_path / "live" if where == "path" else None

    def make(p=None):
        return TensorDictReplayBuffer(storage=TieredStorage(50, p, **OPTS), batch_size=8,
                                      sampler=SamplerWithoutReplacement(),
                                      generator=torch.Generator().manual_seed(7))

    rb = make(path)
    rb.extend(pong[:n // 2])
    for i in range(n // 2, n):  # one at a time: the last rows are still staged at dumps()
        rb.add(pong[i])
    assert rb.storage.stats()["staged_rows"] > 0
    rb.sample()  # advances the sampler's permutation and the RNG
    rb.dumps(tmp_path / "ckpt")
    rb.dumps(tmp_path / "ckpt")  # twice into the same directory
    fresh = make()  # uninitialised storage
    fresh.loads(tmp_path / "ckpt")
    assert len(fresh) == len(rb) == min(n, 50)
    assert fresh._writer._cursor == rb._writer._cursor
    # TorchRL's storages leave the last cursor as it was on loads (test_torchrl_contract.py compares)
    assert fresh.storage._last_cursor_index is None
    assert_same(fresh[:], rb[:], "loaded rows")
    assert_same(fresh.sample(), rb.sample(), "next sample after loads")
    # the storage directory is a tiered store anyone can open
    with tiered.open(tmp_path / "ckpt" / "storage" / "store") as store:
        assert torch.equal(store.get(range(len(rb)))["observation"], rb[:]["observation"])
    # into an already initialised storage holding other rows
    used = make()
    used.extend(pong[1000:1040])
    used.loads(tmp_path / "ckpt")
    assert len(used) == len(rb)
    assert_same(used[:], rb[:], "loaded over existing rows")


@pytest.mark.parametrize("version", [1, 3, "2", None])
def test_loads_refuses_a_checkpoint_version_it_does_not_write(pong, tmp_path, version):
    """Only the checkpoint version this tiered writes is read; the buffer is left as it was."""
    rb = TensorDictReplayBuffer(storage=TieredStorage(40, **OPTS), batch_size=8)
    rb.extend(pong[:10])
    rb.dumps(tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / "storage" / "tiered_storage.json"
    meta = json.loads(meta_file.read_text())
    meta["version"] = version
    meta_file.write_text(json.dumps(meta))
    other = TensorDictReplayBuffer(storage=TieredStorage(40, **OPTS), batch_size=8)
    other.extend(pong[20:25])
    before = other[:]
    with pytest.raises(FormatVersionError, match=r"version 2 only.*dump it again"):
        other.loads(tmp_path / "ckpt")
    assert len(other) == 5
    assert_same(other[:], before, "rows after a refused load")


def test_loads_a_lazy_memmap_storage_checkpoint(pong, tmp_path):
    """Migration: a LazyMemmapStorage buffer's dumps() loads into a TieredStorage buffer."""
    old = TensorDictReplayBuffer(storage=LazyMemmapStorage(40, scratch_dir=tmp_path / "mm"), batch_size=8)
    old.extend(pong[:30])
    old.dumps(tmp_path / "ckpt")
    new = TensorDictReplayBuffer(storage=TieredStorage(40, **OPTS), batch_size=8)
    new.loads(tmp_path / "ckpt")
    assert len(new) == 30 and new._writer._cursor == 30
    assert_same(new[:], old[:], "imported rows")


def test_save_hooks_get_shift_and_is_full(pong, tmp_path):
    class SaveHook:
        shift = None
        is_full = None
        given = None

        def __call__(self, data, path=None):
            self.given = data
            return data

    seen = {}
    for name, storage in (("tiered", TieredStorage(10, **OPTS)), ("memmap", LazyMemmapStorage(10))):
        hook = SaveHook()
        rb = TensorDictReplayBuffer(storage=storage)
        rb.register_save_hook(hook)
        rb.extend(pong[:5])
        (tmp_path / name).mkdir()
        rb.dumps(tmp_path / name / "a")
        seen[name, "partial"] = (hook.shift, hook.is_full)
        rb.extend(pong[5:12])  # wraps: the last write is at row 1
        rb.dumps(tmp_path / name / "b")
        seen[name, "full"] = (hook.shift, hook.is_full)
        if name == "tiered":
            assert isinstance(hook.given, TensorDictBase) and hook.given.batch_size == torch.Size([10])
    assert seen["tiered", "partial"] == seen["memmap", "partial"] == (5, False)
    assert seen["tiered", "full"] == seen["memmap", "full"] == (2, True)


def test_save_hook_may_rewrite_rows(pong, tmp_path):
    rb = TensorDictReplayBuffer(storage=TieredStorage(10, **OPTS))
    rb.extend(pong[:6])

    def clip_rewards(data, path=None):
        out = data.clone()
        out["next", "reward"] = out["next", "reward"].clamp(0, 0)
        return out

    rb.register_save_hook(clip_rewards)
    rb.dumps(tmp_path / "ckpt")
    rb2 = TensorDictReplayBuffer(storage=TieredStorage(10, **OPTS))
    rb2.loads(tmp_path / "ckpt")
    assert (rb2[:]["next", "reward"] == 0).all()
    assert torch.equal(rb2[:]["observation"], pong[:6]["observation"])


def test_state_dict_copies_and_round_trips(pong, tmp_path):
    rb = TensorDictReplayBuffer(storage=TieredStorage(40, **OPTS), batch_size=4, prefetch=3)
    rb.extend(pong[:22])
    for i in range(22, 25):
        rb.add(pong[i])  # staged
    assert rb.storage.store.stats()["staged_rows"] == 3
    rb.sample()
    snapshot = rb[:].clone()
    state = rb.state_dict()
    torch.save(state, tmp_path / "rb.pt")
    rb.extend(pong[25:35])  # changes after state_dict() must not leak into it
    loaded_state = torch.load(tmp_path / "rb.pt", weights_only=False)
    for target in (TensorDictReplayBuffer(storage=TieredStorage(40, **OPTS), batch_size=4, prefetch=3), rb):
        target.load_state_dict(loaded_state)
        assert len(target) == 25
        assert_same(target[:], snapshot, "state_dict round trip")
        target.sample()
    for tensor in state["_storage"]["files"].values():
        tensor.zero_()  # the state dict is a copy: clobbering it touches no buffer
    assert_same(rb[:], snapshot, "after clobbering the state dict")


def test_state_dict_grows_with_the_data_not_with_preallocated_segments(pong):
    # 500 rows of Pong: 28 MB raw, ~35 kB of compressed blobs. The state dict carries the store's
    # files; its segment file used to be one 16 MiB growth step (a 17 MB state dict).
    storage = TieredStorage(500, **OPTS)
    TensorDictReplayBuffer(storage=storage).extend(pong[:500])
    blob_bytes = sum(t["bytes_used"] for t in storage.store.stats()["tiers"].values())
    files = storage.state_dict()["files"]
    segments = sum(t.numel() for name, t in files.items() if "/cold/" in name)
    assert 0 < segments <= max(GROW_MIN, 2 * blob_bytes), (segments, blob_bytes)
    assert sum(t.numel() for t in files.values()) < 1 << 20  # blobs + row tables of 500 rows


@pytest.mark.parametrize(
    ("keyword", "says"),
    [
        ({"scratch_dir": "SCRATCH"}, "pass spill_dir=DIR"),
        ({"existsok": True}, "path= opens the store already in that directory"),
        ({"auto_cleanup": False}, "remove its directory when done"),
        ({"compression_level": 9}, "codec='zstd:9'"),
        ({"frame": {"observation": 0}}, "unknown keyword(s) frame; it takes max_size, path"),
    ],
)
def test_torchrl_only_keywords_say_what_to_use_instead(keyword, says, tmp_path):
    kwargs = {k: (str(tmp_path / "s") if v == "SCRATCH" else v) for k, v in keyword.items()}
    with pytest.raises(InvalidArgumentError, match=re.escape(says)) as info:
        TieredStorage(10, **kwargs)
    assert isinstance(info.value, ValueError) and next(iter(keyword)) in str(info.value)
    assert not (tmp_path / "s").exists()  # refused before anything was created


def test_default_checkpointer_is_tiered():
    assert isinstance(TieredStorage(5).checkpointer, TieredStorageCheckpointer)


# ----------------------------------------------------------------------------------------
# Pickling, processes, threads, sharing
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["memory", "path"])
def test_pickle_in_process(pong, tmp_path, where):
    path = tmp_path / "store" if where == "path" else None
    rb = TensorDictReplayBuffer(storage=TieredStorage(50, path, **OPTS), batch_size=8)
    rb.extend(pong[:36])
    for i in range(36, 40):
        rb.add(pong[i])  # staged: pickling sends them along (or flushes them, with a path)
    assert rb.storage.store.stats()["staged_rows"] == 4
    blob = pickle.dumps(rb)
    if where == "path":
        assert len(blob) < 64 * 1024, "a store with a path should travel as 'reopen', not as bytes"
    copy = pickle.loads(blob)
    assert len(copy) == 40
    assert_same(copy[:], rb[:], "unpickled rows")
    idx = torch.tensor([3, 17, 39])
    assert_same(copy[idx], rb[idx], "unpickled rows by index")
    if where == "path":
        with pytest.raises(ReadOnlyStoreError):
            copy.extend(pong[40:42])


def _child_reads(rbs, index, queue):
    out = []
    for rb in rbs:
        rows = rb[index]
        torch.manual_seed(0)
        sample = rb.sample()
        # numpy arrays travel by value; tensors would travel as shared-memory handles that die
        # with this process
        out.append((len(rb), rows["observation"].numpy(), rows["next", "observation"].numpy(),
                    sample["observation"].numpy(), sample["index"].numpy()))
    queue.put(out)


def test_pickle_to_spawned_process(pong, tmp_path):
    rbs = [TensorDictReplayBuffer(storage=TieredStorage(60, p, **OPTS), sampler=SliceSampler(slice_len=4),
                                  batch_size=8) for p in (None, tmp_path / "store")]
    for rb in rbs:
        rb.extend(pong[480:540])  # crosses an episode end
    index = torch.tensor([0, 19, 20, 59])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reads, args=(rbs, index, queue))
    proc.start()
    results = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    for rb, result in zip(rbs, results, strict=True):
        n, obs, next_obs, sampled, sampled_index = (torch.from_numpy(x) if isinstance(x, np.ndarray) else x
                                                    for x in result)
        assert n == 60
        assert torch.equal(obs, pong[480:540]["observation"][index])
        assert torch.equal(next_obs, pong[480:540]["next", "observation"][index])
        assert torch.equal(sampled, rb[sampled_index.reshape(-1)]["observation"])


def test_two_buffers_share_one_storage(pong):
    """As TorchRL's test_shared_storage_prioritized_sampler: one storage and writer, two samplers."""
    storage, writer = TieredStorage(100, **OPTS), RoundRobinWriter()
    rb0 = TensorDictReplayBuffer(storage=storage, writer=writer, sampler=RandomSampler(), batch_size=10)
    prioritized = PrioritizedSampler(max_capacity=100, alpha=0.7, beta=1.1)
    rb1 = TensorDictReplayBuffer(storage=storage, writer=writer, sampler=prioritized, batch_size=10)
    rb0.extend(pong[:50])  # rb1's prioritized sampler must learn of these rows
    assert len(rb0) == len(rb1) == len(storage) == 50
    rb0.sample()
    rb1.sample()
    assert rb1._sampler._sum_tree.query(0, 10) == 10
    assert rb1._sampler._sum_tree.query(0, 70) == 50
    rb1.extend(pong[50:80])  # and the other way round
    assert len(rb0) == 80
    torch.manual_seed(0)
    sample = torch.cat([rb0.sample() for _ in range(6)])
    assert (sample["index"] >= 50).any()
    assert torch.equal(sample["observation"], pong["observation"][sample["index"]])


def test_prefetch_while_extending(pong):
    rb = TensorDictReplayBuffer(storage=TieredStorage(400, **OPTS), batch_size=16, prefetch=3)
    rb.extend(pong[:50])
    checked = 0
    for lo in range(50, 400, 25):
        rb.extend(pong[lo:lo + 25])
        sample = rb.sample()
        idx = sample["index"]
        assert torch.equal(sample["observation"], pong["observation"][idx])
        checked += 1
    assert checked == 14


@pytest.mark.parametrize("step", [20, 1], ids=["batches", "single-rows-staged"])
def test_get_from_threads_while_writing(pong, step):
    """Reader threads call storage.get while the main thread writes; every read is whole and right."""
    data = pong[:300]
    storage = TieredStorage(300, **OPTS)
    storage.set(torch.arange(20), data[:20])
    errors, reads, max_staged = [], [0], 0
    stop = threading.Event()

    def reader(seed):
        gen = torch.Generator().manual_seed(seed)
        while not stop.is_set():
            try:
                n = len(storage)
                idx = torch.randint(0, n, (32,), generator=gen)
                out = storage.get(idx)
                if not torch.equal(out["observation"], data["observation"][idx]):
                    errors.append(f"wrong frames at {idx.tolist()}")
                reads[0] += 1
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    try:
        for rep in range(3):  # row r always receives transition r, so any read can be checked
            for lo in range(20 if rep == 0 else 0, 300, step):
                if step == 1:  # one row at an int cursor: the staged path
                    storage.set(lo, data[lo])
                    max_staged = max(max_staged, storage.store.stats()["staged_rows"])
                else:
                    storage.set(torch.arange(lo, lo + step), data[lo:lo + step])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert reads[0] > 0
    assert (max_staged > 0) == (step == 1)  # the readers met staged rows on the staged path


def test_online_loop_add_one_sample_every_step_matches_lazy_tensor_storage(pong):
    """The online RL pattern: rb.add one transition per step, sample every step (staged rows
    are read from the write stage), identical to LazyTensorStorage with the same seeds."""
    tiered_rb = TensorDictReplayBuffer(storage=TieredStorage(150, **OPTS), batch_size=8)
    oracle_rb = TensorDictReplayBuffer(storage=LazyTensorStorage(150), batch_size=8)
    for t in range(400):  # wraps around the 150-row ring
        assert tiered_rb.add(pong[t]) == oracle_rb.add(pong[t])
        torch.manual_seed(t)
        got = tiered_rb.sample()
        torch.manual_seed(t)
        want = oracle_rb.sample()
        assert_same(got, want, f"step {t}")
    assert tiered_rb.storage.stats()["staged_rows"] > 0
    assert_same(tiered_rb[:], oracle_rb[:], "rb[:]")


# ----------------------------------------------------------------------------------------
# Existing stores: offline datasets
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset_path(atari_mixed, tmp_path_factory):
    path = tmp_path_factory.mktemp("dataset") / "mixed.tiered"
    with tiered.TieredStore(atari_mixed.shape[0], path, frames={"observation": 0}) as store:
        for lo in range(0, atari_mixed.shape[0], 1000):
            store.extend(atari_mixed[lo:lo + 1000])
    return path


def _check_slices(sample, data, slice_len):
    index = sample["index"].reshape(-1, slice_len)
    assert ((index[:, 1:] - index[:, :-1]) == 1).all(), "slice rows are not consecutive"
    traj = sample["collector", "traj_ids"].reshape(-1, slice_len)
    assert (traj == traj[:, :1]).all(), "a slice crosses episodes"
    assert torch.equal(sample["observation"], data["observation"][index.reshape(-1)])


def test_read_only_dataset_samples_slices(dataset_path, atari_mixed):
    storage = TieredStorage.from_store(tiered.open(dataset_path, mode="r"))
    assert len(storage) == atari_mixed.shape[0] == storage.max_size
    rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(slice_len=16), batch_size=64)
    for seed in range(3):
        torch.manual_seed(seed)
        _check_slices(rb.sample(), atari_mixed, 16)
    with pytest.raises(ReadOnlyStoreError):
        rb.extend(atari_mixed[:2])


def test_storage_from_existing_path(dataset_path, atari_mixed):
    storage = TieredStorage(None, dataset_path, mode="r")
    assert storage.max_size == atari_mixed.shape[0] and len(storage) == atari_mixed.shape[0]
    assert storage._last_cursor_index == atari_mixed.shape[0] - 1  # the ring seam, for SliceSampler
    rb = ReplayBuffer(storage=storage, sampler=SliceSampler(slice_len=8, traj_key=("collector", "traj_ids")),
                      batch_size=32)
    torch.manual_seed(1)
    sample, info = rb.sample(return_info=True)
    index = info["index"][0] if isinstance(info["index"], tuple) else info["index"]
    assert torch.equal(sample["next", "observation"], atari_mixed["next", "observation"][index.reshape(-1)])
    with pytest.raises(ValueError, match="capacity"):
        TieredStorage(10, dataset_path, mode="r")
    with pytest.raises(FileNotFoundError):
        TieredStorage(10, dataset_path.parent / "nothing-here", mode="r")


def test_add_with_the_stored_keys_but_another_dtype_is_refused_and_changes_nothing():
    """``rb.add`` walks the row once (the cells go to the store); a row with the stored keys but
    another dtype takes the checked path and is refused, the buffer left as it was."""
    from tiered.errors import SchemaMismatchError

    td = TensorDict({"a": torch.arange(4), ("next", "b"): torch.zeros(4, 3)}, [4])
    rb = TensorDictReplayBuffer(storage=TieredStorage(10))
    rb.extend(td)
    rb.add(TensorDict({"a": torch.tensor(9), ("next", "b"): torch.ones(3)}, []))
    bad = TensorDict({"a": torch.tensor(7, dtype=torch.int32), ("next", "b"): torch.ones(3)}, [])
    with pytest.raises(SchemaMismatchError, match="expected int64"):
        rb.add(bad)
    assert len(rb) == 5
    assert rb.storage.get(slice(None))["a"].tolist() == [0, 1, 2, 3, 9]


def test_add_of_a_row_with_an_empty_nested_tensordict_is_staged():
    """``rb.add`` of rows whose ``("collector",)`` holds nothing (its only key excluded): the
    storage's one walk matches them, so they are staged like any small write, and read back."""
    td = TensorDict({"a": torch.arange(8), "obs": torch.rand(8, 32, 32), ("collector", "traj_ids"): torch.zeros(8)},
                    [8]).exclude(("collector", "traj_ids"))
    rb = TensorDictReplayBuffer(storage=TieredStorage(20))
    rb.extend(td[:4])
    for i in range(4, 8):
        rb.add(td[i])
    assert rb.storage.store.stats()["staged_rows"] == 4
    got = rb.storage.get(slice(None))
    assert torch.equal(got["a"], td["a"]) and torch.equal(got["obs"], td["obs"])
