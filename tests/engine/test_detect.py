"""Frame stacks found without configuration (``frames=None``, the default), on real Atari rows."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer, TensorDictReplayBuffer

from tiered import TieredStore
from tiered.engine.detect import detect_frames, stack_dim
from tiered.schema import Schema
from tiered.testing import count_calls
from tiered.torchrl import TieredStorage

OBS, NEXT_OBS = ("observation",), ("next", "observation")


def _held(store: TieredStore) -> int:
    st = store.stats()
    return sum(int(t["bytes_used"]) for t in st["tiers"].values()) + sum(st["memory"].values())


def _assert_same_rows(a: TieredStore, b: TieredStore, data: TensorDict) -> None:
    idx = torch.arange(len(data))
    ga, gb = a.get(idx), b.get(idx)
    for key in data.keys(include_nested=True, leaves_only=True):
        assert torch.equal(ga.get(key), data.get(key)), key
        assert torch.equal(gb.get(key), data.get(key)), key


def test_no_options_store_equals_the_explicit_frames_store(atari_mixed):
    n = atari_mixed.batch_size[0]
    auto = TieredStore(n)
    explicit = TieredStore(n, frames={"observation": 0})
    for s in range(0, n, 256):
        auto.extend(atari_mixed[s:s + 256])
        explicit.extend(atari_mixed[s:s + 256])
    assert auto.options["frames"] == {OBS: 0}
    assert auto.schema[OBS].frame_dim == 0 and auto.schema[NEXT_OBS].frame_dim == 0
    assert auto.schema == explicit.schema
    held_auto, held_explicit = _held(auto), _held(explicit)
    assert abs(held_auto - held_explicit) <= 0.03 * held_explicit, (held_auto, held_explicit)
    st_a, st_e = auto.stats()["fields"]["observation"], explicit.stats()["fields"]["observation"]
    assert st_a["unique_frames"] == st_e["unique_frames"]
    _assert_same_rows(auto, explicit, atari_mixed)


def test_empty_frames_turns_detection_off(atari_pong):
    store = TieredStore(500, frames={})
    store.extend(atari_pong[:256])
    assert store.options["frames"] == {}
    assert store.schema[OBS].frame_dim is None and store.schema[NEXT_OBS].frame_dim is None
    assert store.stats()["fields"]["observation"]["family"] == "uint8[4,84,84]"


def test_frames_given_overrides_detection(atari_pong):
    data = atari_pong[:64].clone()
    data["other"] = data["observation"].clone()  # a stack too, but frames= names only observation
    store = TieredStore(100, frames={"observation": 0})
    store.extend(data)
    assert store.schema[OBS].frame_dim == 0 and store.schema[("other",)].frame_dim is None


def test_non_stack_fields_are_not_detected(atari_raw):
    """Raw RGB screens, random stacks and constant frames stay whole cells; the stacks are found."""
    data = atari_raw[:128].clone()
    gen = torch.Generator().manual_seed(0)
    data["noise"] = torch.randint(0, 256, (128, 4, 84, 84), dtype=torch.uint8, generator=gen)
    data["blank"] = torch.zeros(128, 4, 84, 84, dtype=torch.uint8)
    data["still"] = data["observation"][:1].expand(128, 4, 84, 84).clone()  # one stack repeated
    store = TieredStore(200)
    store.extend(data)
    assert store.options["frames"] == {OBS: 0}
    for key in ("pixels", ("next", "pixels"), "noise", "blank", "still"):
        assert store.schema[key].frame_dim is None, key
    got = store.get(torch.arange(128))
    for key in data.keys(include_nested=True, leaves_only=True):
        assert torch.equal(got.get(key), data.get(key)), key


def test_rows_out_of_order_need_the_next_field(atari_pong):
    shuffled = atari_pong[torch.randperm(2000, generator=torch.Generator().manual_seed(1))[:256]]
    without = TieredStore(300)
    without.extend(shuffled.exclude("next"))
    assert without.options["frames"] == {}
    with_next = TieredStore(300)
    with_next.extend(shuffled)
    assert with_next.options["frames"] == {OBS: 0}


def test_single_row_first_write(atari_pong):
    """One transition with its next stack is enough; one bare stack cannot be decided."""
    with_next = TieredStore(10)
    with_next.extend(atari_pong[100:101])
    assert with_next.options["frames"] == {OBS: 0}
    bare = TieredStore(10)
    bare.extend(atari_pong[100:101].exclude("next"))
    assert bare.options["frames"] == {}


def test_other_frame_dimension_and_dtype(atari_pong):
    """A channels-last float stack [84, 84, 4] is found along its last dimension."""
    data = TensorDict({"obs": atari_pong["observation"][:64].movedim(1, -1).float() / 255}, [64])
    store = TieredStore(64)
    store.extend(data)
    assert store.options["frames"] == {("obs",): 2}
    assert torch.equal(store.get(torch.arange(64))["obs"], data["obs"])
    assert stack_dim(data["obs"], 2) and not stack_dim(data["obs"], 0)


def test_detection_is_saved_and_reopens(atari_pong, tmp_path):
    path = tmp_path / "s"
    TieredStore(300, path).close()  # no write yet: detection is still to come after a reopen
    store = TieredStore.open(path, mode="r+")
    assert store.options["frames"] is None
    store.extend(atari_pong[:256])
    store.close()
    again = TieredStore.open(path)
    assert again.options["frames"] == {OBS: 0} and again.schema[OBS].frame_dim == 0
    off = tmp_path / "off"
    TieredStore(300, off, frames={}).close()
    reopened = TieredStore.open(off, mode="r+")
    reopened.extend(atari_pong[:256])
    assert reopened.options["frames"] == {} and reopened.schema[OBS].frame_dim is None


def test_copying_options_copies_the_detected_layout(atari_pong):
    store = TieredStore(300)
    assert TieredStore(10, **store.options).options["frames"] is None
    store.extend(atari_pong[:64])
    assert TieredStore(10, **store.options).options["frames"] == {OBS: 0}


@pytest.mark.parametrize("first", ["extend", "add"])
def test_torchrl_storage_with_no_options_detects(atari_pong, first):
    """TieredStorage(n) in a ReplayBuffer, first written by extend or by one add; LazyTensorStorage is the oracle."""
    data = atari_pong[:512]
    tiered_rb = TensorDictReplayBuffer(storage=TieredStorage(1000), sampler=RandomSampler(), batch_size=64)
    oracle = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), sampler=RandomSampler(), batch_size=64)
    for rb in (tiered_rb, oracle):
        if first == "add":
            rb.add(data[0])
            rb.extend(data[1:])
        else:
            rb.extend(data)
    store = tiered_rb.storage.store
    assert store.options["frames"] == {OBS: 0} and store.schema[NEXT_OBS].frame_dim == 0
    idx = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(3))
    got, want = tiered_rb[idx], oracle[idx]
    for key in ("observation", ("next", "observation"), "action", ("next", "reward")):
        assert torch.equal(got.get(key), want.get(key)), key


def test_plain_tensor_buffer_detects(atari_pong):
    rb = ReplayBuffer(storage=TieredStorage(300), batch_size=8)
    rb.extend(atari_pong["observation"][:128])
    assert rb.storage.store.schema.blob_fields[0].frame_dim == 0
    assert torch.equal(rb[torch.arange(128)], atari_pong["observation"][:128])


def _python_calls(fn) -> int:
    return count_calls(fn).all


def test_detection_is_vectorized(atari_pong):
    """The Python call count of detection does not grow with the rows compared."""
    schema = Schema.infer(atari_pong[:256], frames={})
    counts = [_python_calls(lambda b=b: detect_frames(atari_pong[:b], schema)) for b in (8, 256)]
    assert counts[0] == counts[1], counts
    assert detect_frames(atari_pong[:8], schema) == {OBS: 0}
