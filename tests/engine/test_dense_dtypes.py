"""Dense columns stored in a narrower dtype (``dense_dtypes``).

A rollout's int64 actions and trajectory ids and float32 rewards take 20 of the ~23 bytes per row
of its dense columns; Atari's actions fit uint8, clipped rewards int8. These tests show that:

* reads give the written dtype and values back, on every write path (batched, staged, ``set``),
  in memory and after a reopen, through a TorchRL replay buffer too;
* a value the narrower dtype cannot hold exactly is refused with :class:`LossyValueError` before
  anything is written (first write, later writes, staged writes, overwrites);
* options that cannot be honoured (a blob field, an unknown key, a dtype without exact conversions)
  are refused; a store without ``dense_dtypes`` keeps the manifest entries it always had;
* a dense file whose dtype the manifest does not say is refused by open and named by ``verify``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, edit_manifest, gen_files, manifest_body, schema_entry
from tensordict import TensorDict

import tiered
from tiered import LossyValueError, SchemaMismatchError, TieredStore
from tiered.errors import CorruptionError
from tiered.verify import verify_store

NARROW = {"action": torch.uint8, ("collector", "traj_ids"): "int32", ("next", "reward"): torch.int8}
OPTS = {"frames": {"observation": 0}, "chunk_frames": 4}


def test_reads_give_the_written_dtypes_back_on_every_path(atari_pong, tmp_path):
    data = atari_pong[:300]
    path = tmp_path / "s"
    with TieredStore(400, path, dense_dtypes=NARROW, **OPTS) as s:
        s.extend(data[:200])               # batched
        for i in range(200, 230):          # staged one row at a time (ReplayBuffer.add)
            s.extend(data[i:i + 1])
        s.extend(data[230:300])
        s.set([5, 7], data[[250, 251]])    # overwrites
        want = data.clone()
        want[5], want[7] = data[250], data[251]
        got = s.get(slice(0, 300))
        assert_td_equal(got, want)
        got_view = s.get(slice(0, 300), copy=False)  # a narrowed column cannot be a view: a copy
        assert got_view["action"].dtype == torch.int64
        assert_td_equal(s.get(np.arange(299, -1, -1)), want[torch.arange(299, -1, -1)])
        fields = s.stats()["fields"]
        assert fields["action"]["stored_dtype"] == "uint8"
        assert fields["collector/traj_ids"]["stored_dtype"] == "int32"
        assert "stored_dtype" not in fields["next/done"]
        assert fields["action"]["stored_bytes"] == 400  # one byte per row of capacity
    body = manifest_body(path)
    assert schema_entry(body, ["action"])["stored_dtype"] == "uint8" and schema_entry(body, ["action"])["dtype"] == "int64"
    assert body["options"]["dense_dtypes"] == {"action": "uint8", "collector/traj_ids": "int32", "next/reward": "int8"}
    i = [f["key"] for f in body["schema"]].index(["action"])
    assert np.load(gen_files(path) / f"dense.{i}.npy").dtype == np.uint8
    for mode in ("r", "r+"):
        with tiered.open(path, mode=mode) as s:
            assert_td_equal(s.get(slice(0, 300)), want)
    with tiered.open(path, mode="r+") as s:   # a reopened writer narrows too, and still refuses
        assert s.options["dense_dtypes"][("action",)] == torch.uint8
        bad = data[:1].clone()
        bad["action"] = torch.tensor([256])
        with pytest.raises(LossyValueError, match="'action' is stored as uint8"):
            s.extend(bad)
        s.extend(data[:1])
        assert len(s) == 301
    assert verify_store(path, progress=False).ok


@pytest.mark.parametrize("how", ["first write", "batched", "staged", "set", "set one row"])
def test_a_value_that_does_not_fit_is_refused_and_nothing_is_written(atari_pong, tmp_path, how):
    data = atari_pong[:40]
    s = TieredStore(64, tmp_path / "s", dense_dtypes=NARROW, **OPTS)
    bad = data[:8].clone()
    bad["next", "reward"] = torch.tensor([0, 1, 0, 0.5, 0, 0, 0, 0]).reshape(8, 1)  # 0.5 is no int8
    if how != "first write":
        s.extend(data[:20])
    before = s.get(slice(0, len(s))) if len(s) else None
    cursor = s.cursor
    with pytest.raises(LossyValueError) as e:
        if how in ("first write", "batched"):
            s.extend(bad)
        elif how == "staged":
            s.extend(bad[3:4])
        elif how == "set":
            s.set([0, 1, 2, 3, 4, 5, 6, 7], bad)
        else:
            s.set(3, bad[3])
    message = str(e.value)
    assert "'next/reward' is stored as int8" in message and "0.5" in message and "nothing was written" in message
    assert s.cursor == cursor and len(s) == (0 if before is None else before.batch_size[0])
    if before is not None:
        assert_td_equal(s.get(slice(0, len(s))), before)
    assert s.stats()["staged_rows"] == 0
    s.extend(data[20:40])  # the store goes on
    assert s.get(slice(0, len(s)))["next", "reward"].dtype == torch.float32
    s.close()


def test_exact_conversions_only(tmp_path):
    def one(dtype: torch.dtype, values: list) -> TensorDict:
        return TensorDict({"x": torch.tensor(values, dtype=dtype)}, [len(values)])

    s = TieredStore(8, dense_dtypes={"x": torch.float16})
    s.extend(one(torch.float32, [1.5, -0.0, float("inf")]))  # inf and -0.0 fit float16
    got = s.get(slice(0, 3))["x"]
    assert got.dtype == torch.float32 and got[1].signbit() and got[2] == float("inf")
    # a float32 NaN would read back as torch's canonical NaN (sign and payload lost): refused
    for nan in (float("nan"), -float("nan")):
        with pytest.raises(LossyValueError, match="sign and payload"):
            s.extend(one(torch.float32, [2.0, nan]))
    assert len(s) == 3
    # float64 NaNs survive float32 bit for bit, sign included
    d = TieredStore(8, dense_dtypes={"x": torch.float32})
    nans = torch.tensor([float("nan"), -float("nan")], dtype=torch.float64)
    d.extend(TensorDict({"x": nans}, [2]))
    assert torch.equal(d.get(slice(0, 2))["x"].view(torch.int64), nans.view(torch.int64))
    with pytest.raises(LossyValueError, match="0.1"):
        s.extend(one(torch.float32, [0.1]))
    with pytest.raises(LossyValueError, match="70000"):
        s.extend(one(torch.float32, [70000.0]))
    b = TieredStore(8, dense_dtypes={"x": "bool"})
    b.extend(one(torch.int64, [0, 1, 1]))
    assert b.get(slice(0, 3))["x"].tolist() == [0, 1, 1]
    with pytest.raises(LossyValueError, match="2"):
        b.extend(one(torch.int64, [2]))
    n = TieredStore(8, dense_dtypes={"x": torch.int8})
    with pytest.raises(LossyValueError, match="-129"):
        n.extend(one(torch.int64, [-128, -129]))
    assert len(n) == 0
    z = TieredStore(8, dense_dtypes={"x": torch.int8})  # -0.0 == 0.0, but an int8 cannot hold its sign
    with pytest.raises(LossyValueError, match="-0.0"):
        z.extend(one(torch.float32, [1.0, -0.0]))
    with pytest.raises(LossyValueError, match="-0.0"):
        z.extend(one(torch.float32, [-0.0]))  # a staged one-row write too
    assert len(z) == 0
    h = TieredStore(8, dense_dtypes={"x": torch.float16})  # float16 has a sign bit: -0.0 reads back as -0.0
    h.extend(one(torch.float32, [-0.0]))
    assert torch.signbit(h.get([0])["x"]).item()


@pytest.mark.parametrize("narrow, match", [
    ({"observation": torch.uint8}, "a blob field"),
    ({"nope": torch.uint8}, "not in the data"),
    ({"action": torch.complex64}, "complex64 is not one of"),
    ({"action": "uint3"}, "unknown dtype"),
    ({"action": 8}, "must be a torch dtype"),
])
def test_options_that_cannot_be_honoured_are_refused(atari_pong, narrow, match):
    with pytest.raises(SchemaMismatchError, match=match):
        s = TieredStore(16, dense_dtypes=narrow, **OPTS)
        s.extend(atari_pong[:4])


def test_a_store_without_it_narrows_its_columns_itself(atari_pong, tmp_path):
    with TieredStore(16, tmp_path / "s", **OPTS) as s:
        s.extend(atari_pong[:8])
    body = manifest_body(tmp_path / "s")
    assert "dense_dtypes" not in body["options"]
    stored = {"/".join(f["key"]): f.get("stored_dtype") for f in body["schema"] if f["kind"] == "dense"}
    assert stored["action"] == "uint8" and stored["collector/traj_ids"] == "uint8" and stored["next/reward"] == "uint8"  # 8 rewards of 0
    assert stored["next/done"] is None  # a bit of the flags byte


def test_a_dense_file_of_another_dtype_is_refused_at_open_and_named_by_verify(atari_pong, tmp_path):
    path = tmp_path / "s"
    with TieredStore(64, path, dense_dtypes={"action": torch.uint8}, **OPTS) as s:
        s.extend(atari_pong[:40])

    def forget(body: dict) -> None:  # the manifest now says int64 for a file of uint8
        schema_entry(body, ["action"]).pop("stored_dtype")
        body["options"].pop("dense_dtypes")

    edit_manifest(path, forget)
    for mode in ("r", "r+"):
        with pytest.raises(CorruptionError, match=r"dense\.1\.\d\.npy holds uint8\[64\], the manifest implies int64"):
            tiered.open(path, mode=mode)
    rep = verify_store(path, progress=False)
    assert not rep.ok
    assert any("dense.1." in (p.file or "") + p.message and "uint8" in p.message for p in rep.problems), rep.summary()


def test_a_torchrl_replay_buffer_samples_the_written_dtypes(atari_pong, tmp_path):
    rb_mod = pytest.importorskip("torchrl.data")
    from tiered.torchrl import TieredStorage

    rb = rb_mod.ReplayBuffer(storage=TieredStorage(500, tmp_path / "rb", dense_dtypes=NARROW, **OPTS), batch_size=64)
    rb.extend(atari_pong[:300])
    for i in range(300, 310):
        rb.add(atari_pong[i])
    batch = rb.sample()
    assert batch["action"].dtype == torch.int64 and batch["next", "reward"].dtype == torch.float32
    storage = rb.storage
    cursor = storage._last_cursor  # noqa: SLF001 - what TorchRL's slice samplers read
    bad = atari_pong[310:311].clone()
    bad["action"] = torch.tensor([1000])
    with pytest.raises(LossyValueError):
        rb.extend(bad)
    assert storage._last_cursor == cursor and len(rb) == 310  # noqa: SLF001 - a refused write moves nothing
    idx = batch["index"] if "index" in batch.keys() else None
    whole = rb[:]
    assert_td_equal(whole.select(*atari_pong.keys(True, True)), atari_pong[:310])
    if idx is not None:
        assert torch.equal(batch["action"], atari_pong["action"][idx])


@pytest.mark.parametrize("entry, value", [("stored_dtype", "complex64"), ("stored_dtype", "uint3"), ("dtype", "float99")])
def test_a_schema_the_code_cannot_read_is_damage(atari_pong, tmp_path, entry, value):
    path = tmp_path / "s"
    with TieredStore(64, path, dense_dtypes={"action": torch.uint8}, **OPTS) as s:
        s.extend(atari_pong[:8])
    edit_manifest(path, lambda body: schema_entry(body, ["action"]).__setitem__(entry, value))
    for mode in ("r", "r+"):
        with pytest.raises(CorruptionError, match="the manifest's schema cannot be read"):
            tiered.open(path, mode=mode)
    rep = verify_store(path, progress=False)
    assert not rep.ok and "schema cannot be read" in rep.summary()


def test_options_the_code_cannot_read_are_damage(atari_pong, tmp_path):
    path = tmp_path / "s"
    with TieredStore(64, path, dense_dtypes={"action": torch.uint8}, **OPTS) as s:
        s.extend(atari_pong[:8])
    edit_manifest(path, lambda body: body["options"]["dense_dtypes"].__setitem__("action", "uint99"))
    for mode in ("r", "r+"):
        with pytest.raises(CorruptionError, match="the manifest's options cannot be read"):
            tiered.open(path, mode=mode)
    assert not verify_store(path, progress=False).ok
