"""Dense bool fields of one value per row share one flags byte per row.

A TorchRL rollout has three such fields (``("next", "done")``, ``terminated``, ``truncated``): as
columns of their own they take a byte per row each, as bits of one ``flags`` column one byte in
all. These tests show that:

* reads give the written values back (bool, the field's shape) on every write path (batched,
  staged one-row writes, ``set`` with duplicates), in memory and after a reopen, and through a
  TorchRL replay buffer and its slice sampler;
* the manifest names each field's bit, the store has one ``flags`` file of a byte per row and no
  column file for those fields; at most 8 fields share the byte, others keep their columns;
* a damaged ``flags`` page is found before its bytes are used and named by ``verify``; a manifest
  whose bits are impossible is damage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, edit_manifest, manifest_body, schema_entry
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.errors import ChecksumError, CorruptionError
from tiered.testing import parts
from tiered.verify import verify_store

OPTS = {"frames": {"observation": 0}, "chunk_frames": 4}
FLAGS = [["next", "done"], ["next", "terminated"], ["next", "truncated"]]


def _with_random_flags(data: TensorDict, seed: int = 0) -> TensorDict:
    """The rollout with its done flags drawn at random (every bit pattern appears)."""
    g = torch.Generator().manual_seed(seed)
    out = data.clone()
    for key in FLAGS:
        out[tuple(key)] = torch.rand(data.shape[0], 1, generator=g) < 0.5
    return out


def test_flags_read_back_on_every_write_path(atari_pong, tmp_path):
    data = _with_random_flags(atari_pong[:300])
    path = tmp_path / "s"
    with TieredStore(400, path, **OPTS) as s:
        s.extend(data[:200])                 # batched
        for i in range(200, 230):            # staged one row at a time (ReplayBuffer.add)
            s.extend(data[i:i + 1])
        for i in range(230, 245, 3):         # staged a few rows at a time (a small collector batch)
            s.extend(data[i:i + 3])
        s.extend(data[245:300])
        s.set([5, 7, 5], data[[250, 251, 252]])  # overwrites, a duplicate among them (the last wins)
        s.set(9, data[253])                  # one row
        want = data.clone()
        want[5], want[7], want[9] = data[252], data[251], data[253]
        assert_td_equal(s.get(slice(0, 300)), want)
        assert s.get([9, 5])["next", "done"].shape == (2, 1)
    for mode in ("r", "r+"):
        with tiered.open(path, mode=mode) as s:
            got = s.get(np.arange(300))
            assert_td_equal(got, want)
            assert got["next", "terminated"].dtype == torch.bool
    with tiered.open(path, mode="r+") as s:  # writes after a reopen land in the mapped byte
        s.set(np.arange(10), data[290:300])
        want[:10] = data[290:300]
    with tiered.open(path, mode="r") as s:
        assert_td_equal(s.get(slice(0, 300)), want)
    assert verify_store(path, progress=False).ok


def test_one_flags_file_of_a_byte_per_row(atari_pong, tmp_path):
    with TieredStore(1000, tmp_path / "s", **OPTS) as s:
        s.extend(atari_pong[:100])
        # action (uint8), traj id (uint8), reward (int8: -1/0/1), each narrowed; the flags byte
        assert s.stats()["memory"]["dense"] == 1000 * (1 + 1 + 1 + 1)
    body = manifest_body(tmp_path / "s")
    assert body["format_version"] == 1
    # the rollout's six flags (done, terminated, truncated, and the same under "next"), in schema order
    assert [schema_entry(body, k)["flag_bit"] for k in [[k[-1]] for k in FLAGS] + FLAGS] == [0, 1, 2, 3, 4, 5]
    index_of = {tuple(f["key"]): i for i, f in enumerate(body["schema"])}
    assert all(f"dense.{index_of[tuple(k)]}" not in body["files"] for k in FLAGS + [["done"]])
    header = body["files"]["flags"] - 1000
    assert 0 < header <= 128  # the .npy header, then one byte per row
    assert "flag_bit" not in schema_entry(body, ["action"])


def test_at_most_eight_fields_share_the_byte(tmp_path):
    n = 64
    cells = {f"f{i}": torch.rand(n) < 0.5 for i in range(10)}
    cells["wide"] = torch.rand(n, 3) < 0.5  # three values per row: a column of its own
    cells["x"] = torch.arange(n)
    data = TensorDict(cells, [n])
    with TieredStore(n, tmp_path / "s") as s:
        s.extend(data)
        assert_td_equal(s.get(slice(0, n)), data)
    body = manifest_body(tmp_path / "s")
    assert [schema_entry(body, [f"f{i}"]).get("flag_bit") for i in range(10)] == [0, 1, 2, 3, 4, 5, 6, 7, None, None]
    assert "flag_bit" not in schema_entry(body, ["wide"])
    with tiered.open(tmp_path / "s", mode="r") as s:
        assert_td_equal(s.get(slice(0, n)), data)


def test_flags_of_other_dtypes_keep_their_columns_and_still_end_trajectories(atari_pong, tmp_path):
    data = atari_pong[:64].exclude(("collector", "traj_ids")).clone()
    for key in FLAGS:  # as some environments give them: uint8, not bool
        data[tuple(key)] = data[tuple(key)].to(torch.uint8)
    data["next", "done"][20] = 1
    with TieredStore(64, tmp_path / "s", **OPTS) as s:
        s.extend(data)
        assert_td_equal(s.get(slice(0, 64)), data)
        assert s.stats()["fields"]["next/done"].get("flag_bit") is None
        info = s.stats()["fields"]["done"]
        assert info["flag_bit"] == 0 and info["stored_bytes"] == 64 // 3  # its share of the byte
    assert "flag_bit" not in schema_entry(manifest_body(tmp_path / "s"), ["next", "done"])


def test_a_flag_read_is_a_copy(atari_pong, tmp_path):
    with TieredStore(64, tmp_path / "s", **OPTS) as s:
        s.extend(_with_random_flags(atari_pong[:32]))
        before = s.get(slice(0, 32))["next", "done"].clone()
        got = s.get(slice(0, 32), copy=False)
        got["next", "done"][:] = ~got["next", "done"]  # a copy: the store keeps its bits
        assert torch.equal(s.get(slice(0, 32))["next", "done"], before)


def test_a_damaged_flags_page_is_found_before_use(atari_pong, tmp_path):
    path = tmp_path / "s"
    with TieredStore(64, path, **OPTS) as s:
        s.extend(_with_random_flags(atari_pong[:64]))
    body = manifest_body(path)
    file = path / "arrays" / f"flags.{body['array_files']['flags']}.npy"
    raw = bytearray(file.read_bytes())
    raw[-10] ^= 0x04  # a bit of row 54's byte
    file.write_bytes(bytes(raw))
    with tiered.open(path, mode="r") as s, pytest.raises(ChecksumError, match="flags"):
        s.get([54])
    rep = verify_store(path, progress=False)
    assert not rep.ok and any("flags" in (p.file or "") + p.message for p in rep.problems), rep.summary()


@pytest.mark.parametrize("edit, match", [
    (lambda b: schema_entry(b, ["next", "done"]).__setitem__("flag_bit", 9), "not a bit of the flags byte"),
    (lambda b: schema_entry(b, ["next", "done"]).__setitem__("flag_bit", 1), "the same bit"),
    (lambda b: schema_entry(b, ["action"]).__setitem__("flag_bit", 3), "not a bit of the flags byte"),
    (lambda b: schema_entry(b, ["next", "done"]).__setitem__("flag_bit", "0"), "not a bit of the flags byte"),
])
def test_impossible_bits_are_damage(atari_pong, tmp_path, edit, match):
    path = tmp_path / "s"
    with TieredStore(64, path, **OPTS) as s:
        s.extend(atari_pong[:8])
    edit_manifest(path, edit)
    for mode in ("r", "r+"):
        with pytest.raises(CorruptionError, match=match):
            tiered.open(path, mode=mode)
    assert not verify_store(path, progress=False).ok


def test_a_missing_flags_file_is_damage(atari_pong, tmp_path):
    path = tmp_path / "s"
    with TieredStore(64, path, **OPTS) as s:
        s.extend(atari_pong[:8])
    edit_manifest(path, lambda b: b["files"].pop("flags"))
    with pytest.raises(CorruptionError, match="flags"):
        tiered.open(path, mode="r")
    assert not verify_store(path, progress=False).ok


def test_a_torchrl_slice_sampler_reads_the_flags(atari_pong, tmp_path):
    data_mod = pytest.importorskip("torchrl.data")
    from tiered.torchrl import TieredStorage

    rb = data_mod.ReplayBuffer(storage=TieredStorage(2000, tmp_path / "rb", **OPTS), batch_size=64,
                               sampler=data_mod.SliceSampler(slice_len=8, end_key=("next", "done")))
    rb.extend(atari_pong[:1000])
    batch = rb.sample()
    assert batch["next", "done"].dtype == torch.bool and batch.shape == (64,)
    # the slices end where episodes end: a done flag only as the last step of a slice, if at all
    done = batch["next", "done"].reshape(8, 8)
    assert not done[:, :-1].any()
    whole = rb[:]
    assert torch.equal(whole["next", "done"], atari_pong["next", "done"][:1000])


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16])
def test_done_flags_of_every_dtype_cut_trajectories_the_same(dtype):
    """Trajectory ids from done flags (no trajectory-id field): any nonzero cell of a done,
    terminated or truncated flag ends its row's trajectory, whatever the flag's dtype (bool and
    integers are read with numpy, the others with torch); a float -0.0 is not a done."""
    n = 40
    done = torch.zeros(n, 1, dtype=dtype)
    done[5] = 1
    done[20] = 2 if dtype not in (torch.bool,) else True
    if dtype.is_floating_point:
        done[30] = -0.0
    truncated = torch.zeros(n, dtype=dtype)
    truncated[11] = 1
    td = TensorDict({"obs": torch.zeros(n, 3), ("next", "done"): done, ("next", "truncated"): truncated}, [n])
    store = TieredStore(n)
    store.extend(td)
    rows = parts(store).rows
    cells = {key: td.get(key) for key in store.schema}
    base = rows.next_trajectory
    traj, ended, next_base = rows.trajectory_ids(store.schema, cells, n, None)
    assert next_base == base + 3
    expected = base + np.cumsum([0] + [int(r in (5, 11, 20)) for r in range(n - 1)])
    assert traj.tolist() == expected.tolist()
    assert ended.tolist() == [base, base + 1, base + 2]
