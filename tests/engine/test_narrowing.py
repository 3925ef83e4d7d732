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
from tiered.testing.faults import inject_faults
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


def sweep_full_disk_commits(tmp_path, wide, key, want, wrote, last_commit, landed) -> None:
    """From the store at ``tmp_path / "pristine"``: write ``wide`` and commit it with a full disk at
    the k-th write, k = 1, 2, ... until the commit lands. Each time the writer still reads
    ``want`` in field ``key``; ``wrote(store)`` checks the store after the write, ``last_commit``
    a reopen after a failed commit, ``landed`` a reopen after the commit at close."""
    failed = 0
    for k in range(1, 200):  # a full disk at the k-th write of the commit, until the commit lands
        path = tmp_path / "s"
        if path.exists():
            shutil.rmtree(path)
        shutil.copytree(tmp_path / "pristine", path)  # the store before the widening, for each k
        s = tiered.open(path, mode="r+")
        s.extend(wide)
        wrote(s)
        with inject_faults(enospc_on=k):
            try:
                s.flush()
                committed = True
            except StorageFullError:
                committed = False
        assert torch.equal(s.get(slice(0, want.shape[0]))[key], want)  # the writer still reads it all
        if not committed:
            failed += 1
            with tiered.open(path, mode="r") as old:  # the last commit, as it was
                last_commit(old)
        s.close()  # no fault now: the commit at close lands
        with tiered.open(path, mode="r") as now:
            landed(now)
        if committed:
            break
    assert failed >= 2, "the sweep never failed inside the commit"
    assert verify_store(path, progress=False).ok


def test_a_widening_whose_commit_fails_half_way_leaves_the_last_commit(tmp_path):
    n = 6_000  # columns of several memory pages
    first = rows(step=torch.arange(n) % 200, r=torch.zeros(n))
    wide = rows(step=torch.full((16,), 70_000), r=torch.full((16,), 0.25))
    want = torch.cat([first["step"], wide["step"]])
    with TieredStore(2 * n, tmp_path / "pristine") as s:
        s.extend(first)

    def wrote(s):
        assert stored(s, "step") == "int32" and stored(s, "r") == "float16"

    def last_commit(old):
        assert len(old) == n and stored(old, "step") == "uint8" and stored(old, "r") == "uint8"
        assert torch.equal(old.get(slice(0, n))["step"], first["step"])

    def landed(now):
        assert stored(now, "step") == "int32" and stored(now, "r") == "float16"
        assert torch.equal(now.get(slice(0, n + 16))["step"], want)
        assert torch.equal(now.get(slice(n, n + 16))["r"], wide["r"])

    sweep_full_disk_commits(tmp_path, wide, "step", want, wrote, last_commit, landed)


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


# -- row-number columns: every value is its row, stored as nothing ------------------------------

def row_number(s: TieredStore, key: str) -> bool:
    return s.stats()["fields"][key].get("row_number", False)


@pytest.mark.parametrize("staged", [False, True])
def test_a_column_of_its_rows_stores_nothing_and_reads_them_back(staged):
    s = TieredStore(32, stage_rows=16 if staged else 0)
    if staged:
        for r in range(6):  # ReplayBuffer.add: one row at a time, staged
            s.extend(rows(index=torch.tensor([r]), pair=torch.tensor([[r, r]], dtype=torch.int32)))
    else:
        s.extend(rows(index=torch.arange(6), pair=torch.arange(6, dtype=torch.int32)[:, None].expand(6, 2)))
    assert row_number(s, "index") and row_number(s, "pair")
    assert s.stats()["fields"]["index"]["stored_bytes"] == 0 and s.stats()["memory"]["dense"] == 0
    got = s.get(torch.tensor([5, 0, 3]))
    assert got["index"].dtype == torch.int64 and got["index"].tolist() == [5, 0, 3]
    assert got["pair"].dtype == torch.int32 and got["pair"].tolist() == [[5, 5], [0, 0], [3, 3]]
    view = s.get(slice(0, 6), copy=False)["index"]  # a new tensor: writing to it reaches nothing
    view += 100
    assert s.get(slice(0, 6))["index"].tolist() == list(range(6))


@pytest.mark.parametrize("staged", [False, True])
def test_the_first_value_that_is_not_its_row_makes_a_column_keeping_the_rows_before(staged):
    s = TieredStore(1000, stage_rows=16 if staged else 0)
    s.extend(rows(index=torch.arange(300)))  # rows 0..299 (batched)
    if staged:
        s.extend(rows(index=torch.tensor([300])))  # staged, not yet compressed: still its row
        s.extend(rows(index=torch.tensor([-7])))   # row 301: the column is made with 300 staged
    else:
        s.extend(rows(index=torch.tensor([300, -7])))
    assert not row_number(s, "index")
    assert stored(s, "index") == "int16"  # holds -7 and row 300, which no 8-bit dtype does
    want = list(range(301)) + [-7]
    assert s.get(slice(0, 302))["index"].tolist() == want
    s.extend(rows(index=torch.tensor([302])))  # a column now: its row is stored as any value
    assert s.get(slice(0, 303))["index"].tolist() == [*want, 302]


def test_a_first_write_that_is_not_its_rows_is_a_narrowed_column_from_the_start():
    s = TieredStore(1000, stage_rows=0)
    s.extend(rows(index=torch.tensor([3, 1, 2])))
    assert not row_number(s, "index") and stored(s, "index") == "uint8"
    assert s.get(slice(0, 3))["index"].tolist() == [3, 1, 2]


def test_set_at_any_rows_keeps_the_kind_while_each_value_is_its_row():
    s = TieredStore(100, stage_rows=4)
    s.set(torch.tensor([70, 3, 41]), rows(index=torch.tensor([70, 3, 41])))
    s.set(9, TensorDict({"index": torch.tensor(9)}, []))  # one row, staged
    s.set(torch.tensor([5, 5]), rows(index=torch.tensor([5, 5])))  # duplicates: the last wins
    assert row_number(s, "index")
    s.set(torch.tensor([41]), rows(index=torch.tensor([40])))  # not its row: a column
    assert not row_number(s, "index") and stored(s, "index") == "uint8"
    assert s.get(torch.tensor([70, 3, 41, 9, 5]))["index"].tolist() == [70, 3, 40, 9, 5]


def test_the_round_robin_writer_wrapping_around_keeps_the_kind():
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    rbs = [TensorDictReplayBuffer(storage=st, batch_size=4) for st in (TieredStorage(10), LazyTensorStorage(10))]
    for step in range(7):  # 7 x 3 rows into 10: the cursor wraps twice
        data = rows(a=torch.arange(3) + 10 * step, obs=torch.full((3, 1500), step, dtype=torch.uint8))
        for rb in rbs:
            rb.extend(data.clone())
        rbs[0].add(TensorDict({"a": torch.tensor(-step), "obs": torch.zeros(1500, dtype=torch.uint8)}, []))
        rbs[1].add(TensorDict({"a": torch.tensor(-step), "obs": torch.zeros(1500, dtype=torch.uint8)}, []))
    store = rbs[0].storage.store
    assert row_number(store, "index") and not row_number(store, "a")
    assert_td_equal(rbs[0].storage.get(torch.arange(10)), rbs[1].storage.get(torch.arange(10)))
    assert rbs[0].storage.get(torch.arange(10))["index"].tolist() == list(range(10))


def test_dense_dtypes_names_a_column_and_there_are_no_row_numbers():
    s = TieredStore(16, stage_rows=0, dense_dtypes={"index": torch.int32})
    s.extend(rows(index=torch.arange(4)))
    assert not row_number(s, "index") and stored(s, "index") == "int32"
    assert s.get(slice(0, 4))["index"].dtype == torch.int64


def test_a_row_number_column_is_saved_as_nothing_and_reopened(tmp_path):
    path = tmp_path / "s"
    data = rows(index=torch.arange(40), obs=(torch.arange(40 * 2048) % 7).to(torch.uint8).reshape(40, 2048))
    with TieredStore(64, path) as s:
        s.extend(data)
    body = manifest_body(path)
    entry = schema_entry(body, ["index"])
    assert entry["row_number"] is True and "stored_dtype" not in entry
    i = [f["key"] for f in body["schema"]].index(["index"])
    assert f"dense.{i}" not in body["files"]
    assert verify_store(path, progress=False).ok
    for mode in ("r", "r+"):
        with tiered.open(path, mode=mode) as s:
            assert row_number(s, "index")
            assert_td_equal(s.get(slice(0, 40)), data)
    with tiered.open(path, mode="r+") as s:  # the widening is part of the next commit
        s.extend(rows(index=torch.tensor([1000]), obs=data["obs"][:1]))
        assert stored(s, "index") == "int16"
    entry = schema_entry(manifest_body(path), ["index"])
    assert entry["stored_dtype"] == "int16" and "row_number" not in entry
    with tiered.open(path) as s:
        assert s.get(slice(0, 41))["index"].tolist() == [*range(40), 1000]
    assert verify_store(path, progress=False).ok


def _read_index(store: TieredStore) -> list[int]:
    return store.get(slice(0, len(store)))["index"].tolist()


def test_forked_readers_and_read_only_opens_read_the_rows(tmp_path):
    import multiprocessing as mp

    path = tmp_path / "s"
    with TieredStore(64, path) as s:
        s.extend(rows(index=torch.arange(20), obs=torch.zeros(20, 2048, dtype=torch.uint8)))
    reader = tiered.open(path)
    with mp.get_context("fork").Pool(1) as pool:
        assert pool.apply(_read_index, (reader,)) == list(range(20))
    writer = tiered.open(path, mode="r+")  # the writer widens; the reader keeps its commit
    writer.extend(rows(index=torch.tensor([7]), obs=torch.zeros(1, 2048, dtype=torch.uint8)))
    writer.flush()
    assert _read_index(reader) == list(range(20))
    assert _read_index(tiered.open(path)) == [*range(20), 7]
    writer.close()


def test_a_row_number_widening_whose_commit_fails_half_way_leaves_the_last_commit(tmp_path):
    n = 6_000  # a column of several memory pages once it widens
    first = rows(index=torch.arange(n), r=torch.zeros(n))
    wide = rows(index=torch.full((16,), 70_000), r=torch.zeros(16))
    want = torch.cat([first["index"], wide["index"]])
    with TieredStore(2 * n, tmp_path / "pristine") as s:
        s.extend(first)
        assert row_number(s, "index")

    def wrote(s):
        assert stored(s, "index") == "int32"

    def last_commit(old):
        assert len(old) == n and row_number(old, "index")
        assert torch.equal(old.get(slice(0, n))["index"], first["index"])

    def landed(now):
        assert stored(now, "index") == "int32" and torch.equal(now.get(slice(0, n + 16))["index"], want)

    sweep_full_disk_commits(tmp_path, wide, "index", want, wrote, last_commit, landed)


def test_a_refused_write_leaves_a_row_number_column_as_it_was(tmp_path):
    s = TieredStore(16, tmp_path / "s", stage_rows=4, dense_dtypes={"a": torch.uint8})
    s.extend(rows(a=torch.tensor([1, 2]), index=torch.arange(2)))
    for bad in (rows(a=torch.tensor([300]), index=torch.tensor([9])),  # 'a' does not fit
                rows(a=torch.tensor([1]), index=torch.tensor([9]), y=torch.tensor([0]))):  # a key too many
        with pytest.raises((LossyValueError, SchemaMismatchError)):
            s.extend(bad)
        assert row_number(s, "index") and len(s) == 2
    s.close()
    assert schema_entry(manifest_body(tmp_path / "s"), ["index"])["row_number"] is True
