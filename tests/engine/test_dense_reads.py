"""Dense fields read with row indices (what a sampler's ``get`` does) and written a few rows at a
time (``ReplayBuffer.add``, a small collector batch) go through gathers and scatters worked out
once per field list and schema (``tiered.engine.rows.DenseGather``). These tests show they never
serve a stale column:

* a read between widenings gives every value back exactly, in the written dtype, whichever way
  the column was written (staged one row at a time or a batch);
* flag fields of different cell shapes, and a flag-only read, come back as written;
* a read-only open (columns memory-mapped with page checks) and a pickled copy read the same,
  and a column put in under the same fields is the one read and written;
* one-row writes keep every dtype exactly (narrowed, float16, bfloat16, complex conj views,
  values with autograd history, a bool field beyond the flags byte);
* the Python calls of a dense-only ``get`` do not grow with the batch.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.testing import count_calls


def rows(**cols: torch.Tensor) -> TensorDict:
    n = next(iter(cols.values())).shape[0]
    return TensorDict({k: v for k, v in cols.items()}, batch_size=[n])


def stored(s: TieredStore, key: str) -> str | None:
    return s.stats()["fields"][key].get("stored_dtype")


@pytest.mark.parametrize("staged", [False, True])
def test_reads_by_index_between_widenings_give_every_value_back(staged):
    s = TieredStore(64, stage_rows=64 if staged else 0)
    written: list[int] = []
    rewards: list[float] = []
    g = torch.Generator().manual_seed(0)

    def write(values: list[int], reward: float) -> None:
        x = torch.tensor(values, dtype=torch.int64)
        r = torch.full((len(values), 1), reward)
        done = (x % 2 == 0).reshape(-1, 1)
        if staged:
            for i in range(len(values)):  # one row at a time (ReplayBuffer.add)
                s.extend(rows(x=x[i:i + 1], r=r[i:i + 1], done=done[i:i + 1]))
        else:
            s.extend(rows(x=x, r=r, done=done))
        written.extend(values)
        rewards.extend([reward] * len(values))

    def check() -> None:
        idx = torch.randint(0, len(s), (32,), generator=g)
        got = s.get(idx)  # a gather of rows: the path a sampler takes
        want = torch.tensor(written)[idx]
        assert got["x"].dtype == torch.int64 and torch.equal(got["x"], want)
        assert got["r"].dtype == torch.float32 and torch.equal(got["r"].reshape(-1), torch.tensor(rewards)[idx])
        assert got["done"].dtype == torch.bool and torch.equal(got["done"].reshape(-1), want % 2 == 0)

    write([0, 7, 255], 1.0)
    check()
    assert stored(s, "x") == "uint8" and stored(s, "r") == "uint8"
    write([256], -1.0)        # x: uint8 -> int16; r: uint8 -> int16 (int8 cannot hold 255)
    check()
    assert stored(s, "x") == "int16" and stored(s, "r") == "int16"
    write([70000], 0.5)       # x: -> int32; r: -> the given float32 (float16 cannot hold int16's values)
    check()
    assert stored(s, "x") == "int32" and stored(s, "r") is None
    write([-(2**40)], 0.1)    # x: -> the given int64
    check()
    assert stored(s, "x") is None and stored(s, "r") is None


def test_flags_of_several_cell_shapes_and_flag_only_reads():
    n = 40
    g = torch.Generator().manual_seed(1)
    data = rows(a=torch.rand(n, generator=g) < 0.5, b=torch.rand(n, 1, generator=g) < 0.5,
                c=torch.rand(n, 1, 1, generator=g) < 0.5, x=torch.arange(n))
    s = TieredStore(64)
    s.extend(data)
    idx = torch.tensor([5, 0, 39, 5, 17])
    for keys in (None, ["a", "b", "c"], ["b"], ["x", "c"]):
        got = s.get(idx, keys=keys)
        for k in keys or ["a", "b", "c", "x"]:
            assert got[k].shape == data[k][idx].shape and torch.equal(got[k], data[k][idx]), k
    one = s.get(3)
    assert one["c"].shape == (1, 1) and bool(one["c"]) == bool(data["c"][3])


def test_read_only_opens_and_pickled_copies_read_the_same(tmp_path):
    n = 50
    data = rows(x=torch.arange(n) * 3, r=torch.tensor([-1.0, 0.0, 1.0]).repeat(17)[:n].reshape(n, 1),
                done=(torch.arange(n) % 5 == 0).reshape(n, 1))
    idx = torch.tensor([0, 49, 7, 7, 20])
    with TieredStore(64, tmp_path / "s") as s:
        s.extend(data)
        want = s.get(idx)
        copy = pickle.loads(pickle.dumps(s))
        for k in ("x", "r", "done"):
            assert torch.equal(copy.get(idx)[k], want[k])
        s.extend(rows(x=torch.tensor([1000]), r=torch.tensor([[2.5]]), done=torch.tensor([[True]])))  # widens x and r
        assert s.get(torch.tensor([n]))["x"].tolist() == [1000]
    with tiered.open(tmp_path / "s", mode="r") as ro:
        got = ro.get(idx)
        for k in ("x", "r", "done"):
            assert torch.equal(got[k], want[k])
        assert ro.get(torch.tensor([n, 0]))["r"].reshape(-1).tolist() == [2.5, -1.0]


def test_dense_reads_make_the_same_python_calls_at_any_batch():
    n = 2000
    data = rows(x=torch.arange(n) % 7, r=torch.ones(n, 1), done=torch.zeros(n, 1, dtype=torch.bool),
                obs=torch.zeros(n, 3, dtype=torch.float64))
    s = TieredStore(n)
    s.extend(data)
    keys = ["x", "r", "done"]
    s.get(torch.arange(2), keys=keys)  # the first read works its plan and gather out
    small = count_calls(lambda: s.get(torch.arange(4), keys=keys)).all
    large = count_calls(lambda: s.get(torch.arange(n), keys=keys)).all
    assert small == large
    assert np.array_equal(s.get(torch.arange(n), keys=keys)["x"].numpy(), (torch.arange(n) % 7).numpy())


def test_a_column_put_in_under_the_same_fields_is_read_not_the_old_one():
    from tiered.engine.rows import RowSpace
    from tiered.schema import Field, Schema

    schema = Schema([Field(("a",), torch.int64, (), "dense", stored_dtype=torch.uint8),
                     Field(("d",), torch.bool, (1,), "dense", flag_bit=0)])
    space = RowSpace(4)
    space.init_dense(schema)
    space.write_dense(schema, np.arange(4), {("a",): torch.tensor([5, 6, 7, 8]),
                                             ("d",): torch.tensor([[True], [False], [True], [False]])})
    fields, at, out = schema.dense_fields, np.array([3, 0]), {}
    space.read_dense_fields(fields, at, out)  # works the gather of `fields` out
    assert out[("a",)].tolist() == [8, 5]
    # a column of the same field put in (as an open of a commit does), then the flags byte
    space.load_dense(schema["a"], np.array([1, 2, 3, 4], dtype=np.uint8))
    space.load_flags(schema, np.array([0, 0, 0, 1], dtype=np.uint8))
    out = {}
    space.read_dense_fields(fields, at, out)
    assert out[("a",)].tolist() == [4, 1] and out[("d",)].tolist() == [[True], [False]]
    # and a small write after them writes to the new columns
    space.write_dense_cells(schema, np.array([0]), {("a",): torch.tensor(9), ("d",): torch.tensor([True])})
    out = {}
    space.read_dense_fields(fields, np.array([0]), out)
    assert out[("a",)].tolist() == [9] and out[("d",)].tolist() == [[True]]


def test_one_row_writes_keep_every_dtype_and_view_exactly():
    n = 12
    g = torch.Generator().manual_seed(2)
    z = torch.randn(n, 2, generator=g)
    data = rows(
        r=torch.tensor([-1.0, 0.0, 1.0]).repeat(4).reshape(n, 1),        # narrows to int8
        q=torch.randn(n, 1, generator=g, requires_grad=True),            # float32 with autograd history
        h=torch.randn(n, generator=g).to(torch.float16),
        c=torch.complex(z[:, 0], z[:, 1]),                               # complex, written as conj views
        b=torch.randn(n, generator=g).to(torch.bfloat16),                # a dtype numpy lacks
        a=torch.arange(n) * 7,
        **{f"f{i}": torch.rand(n, 1, generator=g) < 0.5 for i in range(9)},  # 8 share the flags byte, one is a column
    )
    s = TieredStore(16)
    for i in range(n):  # one row at a time (ReplayBuffer.add), staged
        row = data[i:i + 1].clone()
        row.set("c", data["c"][i:i + 1].conj())  # a view with its conjugate bit set
        assert row["c"].is_conj()
        s.extend(row)
    got = s.get(torch.arange(n))
    for k in data.keys():
        want = data[k].detach() if k != "c" else data["c"].conj().resolve_conj()
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    assert not got["q"].requires_grad
