"""Dense columns that narrow themselves, and widen when a value does not fit.

A dense integer or float column not named in ``dense_dtypes`` is stored in the narrowest dtype
that holds every value written so far (non-negative integers: uint8, then int16, int32, the given
dtype; negative ones: int8 first; floats: integers while every value is one, then float16, then
the given dtype) and is rewritten once in a wider dtype when a write's values do not fit. These
tests show that:

* each boundary widens, for signed and unsigned values, on the batched and the staged (one row)
  paths, and every value reads back in the written dtype;
* float columns narrow only where every value round-trips exactly: -0.0 keeps its sign, a NaN
  keeps its payload (such a column keeps the given dtype); bool columns stay bool;
* ``dense_dtypes`` still forces a dtype (a value that does not fit is refused, nothing widens);
* a write refused for another reason widens nothing;
* a durable store records the stored dtype, commits a widened column whole, and reopens it;
  a commit of a widening that fails half-way (injected full disk, at every write of the commit)
  leaves the last commit as it was and the writer readable, and the next commit lands.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, manifest_body, schema_entry
from tensordict import TensorDict

import tiered
from tiered import LossyValueError, SchemaMismatchError, TieredStore
from tiered.errors import StorageFullError
from tiered.fileio import inject_faults
from tiered.verify import verify_store


def rows(**cells: torch.Tensor) -> TensorDict:
    n = next(iter(cells.values())).shape[0]
    return TensorDict(cells, [n])


def stored(s: TieredStore, key: str) -> str | None:
    return s.stats()["fields"][key].get("stored_dtype")


@pytest.mark.parametrize("staged", [False, True])
def test_integers_widen_at_each_boundary_and_read_back(staged):
    s = TieredStore(64, stage_rows=64 if staged else 0)
    written = []

    def write(values: list[int]) -> None:
        x = torch.tensor(values, dtype=torch.int64)
        if staged:
            for v in x:  # one row at a time (ReplayBuffer.add)
                s.extend(rows(x=v.reshape(1)))
        else:
            s.extend(rows(x=x))
        written.extend(values)

    write([0, 7, 255])
    assert stored(s, "x") == "uint8"
    write([256])              # uint8 -> int16
    assert stored(s, "x") == "int16"
    write([32767, 32768])     # int16 -> int32
    assert stored(s, "x") == "int32"
    write([2**31 - 1])        # still int32
    assert stored(s, "x") == "int32"
    write([2**31])            # int32 -> the given int64
    assert stored(s, "x") is None
    write([-(2**63)])
    got = s.get(slice(0, len(s)))["x"]
    assert got.dtype == torch.int64 and got.tolist() == written
    assert s.stats()["memory"]["dense"] == 64 * 8


def test_signed_values_start_at_int8_and_a_negative_value_widens_uint8():
    s = TieredStore(16, stage_rows=0)
    s.extend(rows(x=torch.tensor([-1, 5], dtype=torch.int32)))
    assert stored(s, "x") == "int8"
    s.extend(rows(x=torch.tensor([127, -128], dtype=torch.int32)))
    assert stored(s, "x") == "int8"
    s.extend(rows(x=torch.tensor([128], dtype=torch.int32)))   # int8 -> int16
    assert stored(s, "x") == "int16"
    s.extend(rows(x=torch.tensor([-40000], dtype=torch.int32)))  # int16 -> the given int32
    assert stored(s, "x") is None
    u = TieredStore(16, stage_rows=0)
    u.extend(rows(x=torch.tensor([200])))
    assert stored(u, "x") == "uint8"
    u.extend(rows(x=torch.tensor([-1])))   # uint8 cannot hold -1, int8 cannot hold 200: int16
    assert stored(u, "x") == "int16"
    assert u.get(slice(0, 2))["x"].tolist() == [200, -1]
    assert s.get(slice(0, 6))["x"].tolist() == [-1, 5, 127, -128, 128, -40000]


def test_bool_and_byte_columns_stay_as_they_are():
    n = 32
    data = rows(mask=torch.rand(n, 3) < 0.5, b=torch.randint(0, 255, (n,), dtype=torch.uint8),
                flag=torch.rand(n, 1) < 0.5)
    s = TieredStore(n)
    s.extend(data)
    fields = s.stats()["fields"]
    assert "stored_dtype" not in fields["mask"] and "stored_dtype" not in fields["b"]
    assert fields["flag"]["flag_bit"] == 0  # a bit of the flags byte, as before
    assert_td_equal(s.get(slice(0, n)), data)


def test_floats_narrow_only_where_every_value_round_trips():
    s = TieredStore(32, stage_rows=0)
    s.extend(rows(r=torch.tensor([-1.0, 0.0, 1.0])))   # SignTransform'd rewards
    assert stored(s, "r") == "int8"
    s.extend(rows(r=torch.tensor([0.5])))               # int8 -> float16 (holds every int8)
    assert stored(s, "r") == "float16"
    s.extend(rows(r=torch.tensor([0.1])))               # inexact in float16: the given float32
    assert stored(s, "r") is None
    assert s.get(slice(0, 5))["r"].tolist() == torch.tensor([-1.0, 0.0, 1.0, 0.5, 0.1]).tolist()
    big = TieredStore(8, stage_rows=0)
    big.extend(rows(r=torch.tensor([300.0])))           # no int8, uint8: int16
    assert stored(big, "r") == "int16"
    big.extend(rows(r=torch.tensor([0.5])))             # float16 cannot hold every int16: float32
    assert stored(big, "r") is None
    d = TieredStore(8, stage_rows=0)
    d.extend(rows(r=torch.tensor([1e10], dtype=torch.float64)))
    assert stored(d, "r") == "float32" and d.get([0])["r"].dtype == torch.float64


def test_negative_zero_and_nan_payloads_are_kept():
    s = TieredStore(8, stage_rows=0)
    s.extend(rows(z=torch.tensor([0.0, -0.0])))  # no integer holds -0.0: float16 does
    assert stored(s, "z") == "float16"
    assert torch.signbit(s.get([1])["z"]).item()
    s.extend(rows(z=torch.tensor([-0.0])))
    assert torch.signbit(s.get([2])["z"]).item()
    nan = torch.tensor([0x7FC00123, 0x7F800001, -0x80000 - 1], dtype=torch.int32).view(torch.float32)  # payloads
    assert torch.isnan(nan).all()
    p = TieredStore(8, stage_rows=0)
    p.extend(rows(x=torch.tensor([1.0, 2.0])))
    assert stored(p, "x") == "uint8"
    p.extend(rows(x=nan))  # a NaN fits no narrower dtype: the given float32, bits kept
    assert stored(p, "x") is None
    assert torch.equal(p.get(slice(2, 5))["x"].view(torch.int32), nan.view(torch.int32))
    q = TieredStore(8, stage_rows=0)
    q.extend(rows(x=nan))
    assert stored(q, "x") is None
    assert torch.equal(q.get(slice(0, 3))["x"].view(torch.int32), nan.view(torch.int32))


def test_dense_dtypes_still_forces_a_dtype():
    s = TieredStore(8, stage_rows=0, dense_dtypes={"a": torch.int16, "r": torch.float32})
    s.extend(rows(a=torch.tensor([1, 2]), r=torch.tensor([0.0, 1.0])))
    assert stored(s, "a") == "int16" and stored(s, "r") is None  # r: the given dtype, never narrowed
    with pytest.raises(LossyValueError, match="'a' is stored as int16"):
        s.extend(rows(a=torch.tensor([40000]), r=torch.tensor([0.0])))
    assert stored(s, "a") == "int16" and len(s) == 2


def test_a_refused_write_widens_nothing(tmp_path):
    s = TieredStore(16, tmp_path / "s", stage_rows=4, dense_dtypes={"a": torch.uint8})
    s.extend(rows(a=torch.tensor([1, 2]), x=torch.tensor([3, 4])))
    assert stored(s, "x") == "uint8"
    for bad in (rows(a=torch.tensor([300]), x=torch.tensor([1000])),  # refused: 'a' does not fit
                rows(a=torch.tensor([1]), x=torch.tensor([1000]), y=torch.tensor([0]))):  # a key too many
        with pytest.raises((LossyValueError, SchemaMismatchError)):
            s.extend(bad)
        assert stored(s, "x") == "uint8" and len(s) == 2
    s.flush()
    assert schema_entry(manifest_body(tmp_path / "s"), ["x"])["stored_dtype"] == "uint8"
    s.close()


def test_a_widening_is_committed_and_reopened(atari_pong, tmp_path):
    path = tmp_path / "s"
    data = atari_pong[:200].clone()
    with TieredStore(512, path, frames={"observation": 0}) as s:
        s.extend(data[:100])
        assert stored(s, "collector/traj_ids") == "uint8"
        s.flush()
        more = data[100:200]
        more["collector", "traj_ids"] = more["collector", "traj_ids"] + 1000  # past uint8
        s.extend(more)
        data[100:200] = more
        assert stored(s, "collector/traj_ids") == "int16"
        for _ in range(4):  # commits after it (each copy of the column file is rewritten whole once)
            s.extend(data[:1])
            s.flush()
    body = manifest_body(path)
    assert schema_entry(body, ["collector", "traj_ids"])["stored_dtype"] == "int16"
    for mode in ("r", "r+"):
        with tiered.open(path, mode=mode) as s:
            got = s.get(slice(0, 200))
            assert_td_equal(got, data)
            assert got["collector", "traj_ids"].dtype == torch.int64
    assert verify_store(path, progress=False).ok


def test_a_widening_whose_commit_fails_half_way_leaves_the_last_commit(tmp_path):
    n = 6_000  # columns of several memory pages
    first = rows(step=torch.arange(n) % 200, r=torch.zeros(n))
    wide = rows(step=torch.full((16,), 70_000), r=torch.full((16,), 0.25))
    want = torch.cat([first["step"], wide["step"]])
    with TieredStore(2 * n, tmp_path / "pristine") as s:
        s.extend(first)
    failed = 0
    for k in range(1, 200):  # a full disk at the k-th write of the commit, until the commit lands
        path = tmp_path / "s"
        if path.exists():
            shutil.rmtree(path)
        shutil.copytree(tmp_path / "pristine", path)  # the store before the widening, for each k
        s = tiered.open(path, mode="r+")
        s.extend(wide)
        assert stored(s, "step") == "int32" and stored(s, "r") == "float16"
        with inject_faults(enospc_on=k):
            try:
                s.flush()
                landed = True
            except StorageFullError:
                landed = False
        assert torch.equal(s.get(slice(0, n + 16))["step"], want)  # the writer still reads it all
        if not landed:
            failed += 1
            with tiered.open(path, mode="r") as old:  # the last commit, as it was
                assert len(old) == n and stored(old, "step") == "uint8" and stored(old, "r") == "uint8"
                assert torch.equal(old.get(slice(0, n))["step"], first["step"])
        s.close()  # no fault now: the commit at close lands
        with tiered.open(path, mode="r") as now:
            assert stored(now, "step") == "int32" and stored(now, "r") == "float16"
            assert torch.equal(now.get(slice(0, n + 16))["step"], want)
            assert torch.equal(now.get(slice(n, n + 16))["r"], wide["r"])
        if landed:
            break
    assert failed >= 2, "the sweep never failed inside the commit"
    assert verify_store(path, progress=False).ok


def test_the_fit_check_is_one_vectorized_pass_per_column():
    """A write's fit check costs about the same number of Python calls for 40 rows and 10,000 rows
    (data-dependent branches elsewhere may differ by a few; a per-row loop would add thousands)."""
    import cProfile
    import pstats

    def calls(n: int) -> int:
        s = TieredStore(20_000, stage_rows=0)
        s.extend(rows(a=torch.arange(4) % 100, r=torch.zeros(4)))
        data = rows(a=torch.arange(n) % 100, r=torch.zeros(n))
        prof = cProfile.Profile()
        prof.enable()
        s.extend(data)
        prof.disable()
        return sum(v[1] for v in pstats.Stats(prof).stats.values())

    assert abs(calls(10_000) - calls(40)) <= 10


def test_float_noise_is_stored_raw_and_saved(tmp_path):
    path = tmp_path / "s"
    rng = np.random.default_rng(0)
    noise = torch.from_numpy(rng.standard_normal((24, 64, 64)).astype(np.float32))  # does not compress
    data = rows(x=noise, a=torch.arange(24))
    with TieredStore(32, path, stage_rows=0) as s:
        s.extend(data)
        assert s.stats()["fields"]["x"]["compression_factor"] == pytest.approx(1.0)
        assert_td_equal(s.get(slice(0, 24)), data)
    family = manifest_body(path)["families"][0]
    assert family["stored_raw"] is True and family["chunk_frames"] == 4  # 16 KiB cells: 4 per 64 KiB
    with tiered.open(path, mode="r+") as s:
        s.extend(data[:4])
        assert_td_equal(s.get(slice(0, 28)), torch.cat([data, data[:4]]))
    assert verify_store(path, progress=False).ok


def test_a_widening_over_a_damaged_page_is_refused_before_anything_changes(tmp_path):
    """The wider column is made (its pages checked) before the write changes a byte: a damaged
    page refuses the write, every row reads as before, and the damaged page is still refused."""
    n = 50_000

    def data(count: int, start: int, action: int) -> TensorDict:
        ids = torch.arange(start, start + count)[:, None] + torch.arange(4)
        obs = ((ids[:, :, None, None] * 7 + torch.arange(16)[:, None]) % 251).to(torch.uint8)
        return rows(observation=obs.expand(count, 4, 16, 16).contiguous(),
                    action=torch.full((count, 64), action, dtype=torch.int64))

    path = tmp_path / "s"
    with TieredStore(n, path, frames={"observation": 0}, hot_bytes=0, warm_bytes=0) as s:
        for lo in range(0, n, 10_000):
            s.extend(data(10_000, lo, 3))
        assert stored(s, "action") == "uint8"
    body = manifest_body(path)
    column = next(k for k in body["files"] if k.startswith("dense."))
    copy = path / "arrays" / f"{column}.{body['array_files'][column]}.npy"
    with open(copy, "r+b") as fh:  # one flipped byte in the last page, far from the rows written
        at = copy.stat().st_size - 100
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    with tiered.open(path, "r+") as w:
        before = w.get(torch.arange(64))
        with pytest.raises(tiered.ChecksumError):
            w.extend(data(64, 10**6, 1000))  # rows 0..63; 1000 widens the uint8 column
        assert_td_equal(w.get(torch.arange(64)), before)
        assert stored(w, "action") == "uint8"
        with pytest.raises(tiered.ChecksumError):
            w.get(torch.tensor([n - 1]))  # the damaged page is still checked
