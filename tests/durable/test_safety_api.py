"""Nothing lost, nothing silent, nothing run: the API side of the adversarial findings.

* no source is ever unpickled: a payload planted in every import format's source, in a TorchRL
  replay-buffer dump and in a store's arrays never runs (its marker file never appears);
* every dtype a field can have is written, committed, reopened, verified and exported as a dense
  and as a blob field, or refused by an export (or a first write) with the list of what works;
* never-written rows (holes left by ``set`` beyond the length) are refused on every read path,
  after reopening and by ``tiered export``;
* a D4RL file whose per-row column has another length is refused, naming it;
* argument checks: bounds on sizes, bool masks, 2-D indices, ``keys="x"``, priorities,
  non-tensor leaves, ``/`` in keys, CUDA devices, CLI exit codes, no commit for an unchanged store.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import gen_files
from tensordict import NonTensorData, TensorDict

import tiered
from tiered import errors as E
from tiered.cli import main
from tiered.durable.manifest import read_manifest
from tiered.formats import export_dataset, import_dataset
from tiered.schema import SUPPORTED_DTYPES
from tiered.verify import verify_store


# ------------------------------------------------------------------------------------------------
# 1. no code from a dataset is ever run
# ------------------------------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates the marker file (``open(marker, "w")``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_in_memmap(directory: Path, marker: Path) -> None:
    """Add a non-tensor leaf ``o`` whose pickle sidecar is the payload to a TensorDict memmap dir."""
    (directory / "o").mkdir()
    (directory / "o" / "meta.json").write_text(json.dumps(
        {"_type": "<class 'tensordict.tensorclass.NonTensorData'>", "_is_non_tensor": True, "_metadata": None}))
    (directory / "o" / "other.pickle").write_bytes(pickle.dumps(_Payload(marker)))
    meta = json.loads((directory / "meta.json").read_text())
    meta["o"] = {"type": "NonTensorData"}
    (directory / "meta.json").write_text(json.dumps(meta))


def _rows(n: int = 6) -> TensorDict:
    return TensorDict({"observation": torch.arange(n * 4, dtype=torch.float32).reshape(n, 4),
                       "action": torch.arange(n)}, [n])


def test_planted_pickle_in_a_torchrl_memmap_source_never_runs(tmp_path):
    marker = tmp_path / "ran"
    src = tmp_path / "td"
    _rows().memmap(src)
    _plant_in_memmap(src, marker)
    with pytest.raises(E.PickledDataError, match="pickled"):
        import_dataset("torchrl", src, tmp_path / "dst")
    assert main(["import", str(src), str(tmp_path / "dst2"), "--format", "torchrl"]) == 2
    assert not marker.exists()
    assert not (tmp_path / "dst").exists()


def test_planted_pickle_in_a_replay_buffer_dump_never_runs(tmp_path):
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    from tiered.torchrl import TieredStorage

    marker = tmp_path / "ran"
    rb = ReplayBuffer(storage=LazyMemmapStorage(10))
    rb.extend(_rows())
    rb.dumps(tmp_path / "rb")
    _plant_in_memmap(tmp_path / "rb" / "storage", marker)
    # `tiered import torchrl` of the dump
    with pytest.raises(E.PickledDataError):
        import_dataset("torchrl", tmp_path / "rb", tmp_path / "dst")
    # TieredStorage's loader of TorchRL checkpoints (what rb.loads calls for the storage)
    storage = TieredStorage(10)
    with pytest.raises(E.PickledDataError):
        storage.loads(tmp_path / "rb" / "storage")
    assert not marker.exists()


def test_planted_pickle_in_npz_d4rl_and_minari_sources_never_runs(tmp_path):
    marker = tmp_path / "ran"
    obj = np.empty(6, dtype=object)
    obj[:] = [_Payload(marker)] * 6
    # npz: an object member (np.save pickles it)
    npz = tmp_path / "a.npz"
    np.savez(npz, observation=np.zeros((6, 3), np.float32), evil=obj)
    with pytest.raises(E.UnsupportedFormatError, match="Python objects"):
        import_dataset("npz", npz, tmp_path / "npz-store")
    # d4rl: pickle bytes as an opaque per-row dataset and as an attribute: kept as bytes, never loaded
    d4rl = tmp_path / "d.hdf5"
    blob = np.frombuffer(pickle.dumps(_Payload(marker)), dtype=np.uint8)
    with h5py.File(d4rl, "w") as f:
        f["observations"] = np.zeros((6, 3), np.float32)
        f["actions"] = np.zeros((6, 1), np.float32)
        f["rewards"] = np.zeros(6, np.float32)
        f["terminals"] = np.zeros(6, bool)
        f["metadata/evil"] = np.void(blob.tobytes())
        f.attrs["evil"] = np.void(blob.tobytes())
    report = import_dataset("d4rl", d4rl, tmp_path / "d4rl-store")  # the bytes stay bytes
    assert report.rows == 6 and report.dropped == ["metadata/evil", "attrs/evil"]  # opaque bytes are named, not kept
    export_dataset(tmp_path / "d4rl-store", tmp_path / "back.hdf5", "d4rl")
    # minari: an episode with an opaque (pickle bytes) info
    mdir = tmp_path / "m" / "data"
    mdir.mkdir(parents=True)
    (mdir / "metadata.json").write_text(json.dumps({"data_format": "hdf5", "total_episodes": 1}))
    with h5py.File(mdir / "main_data.hdf5", "w") as f:
        g = f.create_group("episode_0")
        g["observations"] = np.zeros((4, 2), np.float32)
        g["actions"] = np.zeros(3, np.int64)
        g["rewards"] = np.zeros(3, np.float32)
        g["terminations"] = np.zeros(3, bool)
        g["truncations"] = np.zeros(3, bool)
        g["infos/evil"] = np.array([np.void(blob.tobytes())] * 3)
    with pytest.raises(E.UnsupportedFormatError, match="infos/evil"):
        import_dataset("minari", tmp_path / "m", tmp_path / "minari-store")
    assert not marker.exists()


def test_planted_pickle_in_a_store_array_never_runs(tmp_path):
    """A store's .npy arrays are loaded with allow_pickle=False: an object array is damage, not code."""
    marker = tmp_path / "ran"
    path = tmp_path / "s"
    with tiered.TieredStore(10, path) as s:
        s.extend(_rows())
    gen = gen_files(path)
    obj = np.empty(1, dtype=object)
    obj[0] = _Payload(marker)
    np.save(gen / "written.npy", obj, allow_pickle=True)
    with pytest.raises(E.CorruptionError):
        tiered.open(path)
    assert not verify_store(path).ok
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------
# 2-3. every dtype, dense and blob, in memory and with a path
# ------------------------------------------------------------------------------------------------
def _values(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``[n, 4, 8]`` values of ``dtype`` with varied bytes (random bits, so every byte pattern counts)."""
    if dtype == torch.bool:
        return torch.rand(n, 4, 8, generator=torch.Generator().manual_seed(0)) > 0.5
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 127, (n, 4, 8 * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    return raw.view(dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all())


NUMPY_LACKS = {torch.bfloat16, torch.complex32} | {d for d in SUPPORTED_DTYPES if str(d).startswith("torch.float8")}


def test_the_issue_dtypes_are_all_supported():
    names = ("bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 complex32 "
             "complex64 complex128 float8_e4m3fn float8_e5m2").split()
    assert {getattr(torch, n) for n in names} <= set(SUPPORTED_DTYPES)


@pytest.mark.parametrize("kind", ["dense", "blob"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_dtype_end_to_end(tmp_path, dtype, kind):
    warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
    x = _values(dtype, 12)
    td = TensorDict({"x": x, "a": torch.arange(12)}, [12])
    options = {"blob_keys": ["x"]} if kind == "blob" else {"dense_keys": ["x"]}

    def fill(store: tiered.TieredStore) -> None:
        store.extend(td[:6])  # the batched path
        for i in range(6, 12):  # staged small writes, then an overwrite of a staged and a stored row
            store.extend(td[i:i + 1])
        store.set([3, 9], td[[3, 9]])

    mem = tiered.TieredStore(20, **options)
    fill(mem)
    assert mem.schema["x"].kind == kind
    assert _same_bytes(mem.get(slice(None))["x"], x)
    assert _same_bytes(mem.get([11, 2, 9])["x"], x[[11, 2, 9]])

    path = tmp_path / "s"
    with tiered.TieredStore(20, path, **options) as s:
        fill(s)
    assert read_manifest(path)["schema"][0]["dtype"] == str(dtype).replace("torch.", "")
    with tiered.open(path) as s:
        assert _same_bytes(s.get(slice(None))["x"], x)
    report = verify_store(path, decode=True, progress=False)
    assert report.ok, report.summary()

    if str(dtype).startswith("torch.float8"):
        with pytest.raises(E.UnsupportedFormatError, match="float8"):
            export_dataset(path, tmp_path / "td", "torchrl")
    else:
        export_dataset(path, tmp_path / "td", "torchrl")
        back = TensorDict.load_memmap(tmp_path / "td", allow_pickle=False)["x"]
        assert _same_bytes(torch.as_tensor(back), x)
    if dtype in NUMPY_LACKS:
        with pytest.raises(E.UnsupportedFormatError, match="numpy has no such dtype"):
            export_dataset(path, tmp_path / "x.npz", "npz")
        assert not (tmp_path / "x.npz").exists()
    else:
        export_dataset(path, tmp_path / "x.npz", "npz")
        with np.load(tmp_path / "x.npz", allow_pickle=False) as z:
            assert _same_bytes(torch.from_numpy(z["x"]), x)


def test_an_unsupported_dtype_is_refused_by_the_first_write(tmp_path):
    bad = torch.zeros(3, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    store = tiered.TieredStore(10, tmp_path / "s")
    with pytest.raises(E.SchemaMismatchError, match="supported dtypes: bool, uint8") as e:
        store.extend(TensorDict({"x": bad, "a": torch.arange(3)}, [3]))
    assert "float4_e2m1fn_x2" in str(e.value)
    assert store.schema is None and len(store) == 0
    store.extend(TensorDict({"a": torch.arange(3)}, [3]))  # the store still takes good data
    store.close()
    assert len(tiered.open(tmp_path / "s")) == 3


# ------------------------------------------------------------------------------------------------
# 4. never-written rows
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("blob", [True, False], ids=["blob", "dense-only"])
def test_holes_are_refused_on_every_read_path(tmp_path, blob):
    n = 4
    frames = {"pixels": torch.randint(0, 255, (n, 32, 32), dtype=torch.uint8)} if blob else {}
    td = TensorDict({"a": torch.arange(1, n + 1), **frames}, [n])
    path = tmp_path / "s"
    store = tiered.TieredStore(16, path, stage_rows=0)
    store.extend(td)
    store.set(10, td[0])  # rows 4..9 are never written
    assert len(store) == 11
    for index in (slice(None), slice(2, 6), [5], 7, torch.tensor([0, 9]), range(3, 11),
                  torch.arange(16) < 11):
        with pytest.raises(E.UnwrittenRowError, match="never written"):
            store.get(index)
    assert store.get([0, 10])["a"].tolist() == [1, 1]  # written rows read fine
    store.close()
    with tiered.open(path) as s:  # the holes come back as holes
        with pytest.raises(E.UnwrittenRowError, match=r"\[4, 5, 6, 7, 8, 9\]"):
            s.get(slice(None))
    with pytest.raises(E.UnwrittenRowError):
        export_dataset(path, tmp_path / "out.npz", "npz")
    assert not (tmp_path / "out.npz").exists()
    assert main(["export", str(path), str(tmp_path / "out2.npz"), "--format", "npz"]) == 2
    # filling the holes makes every row readable
    with tiered.open(path, mode="r+") as s:
        s.set(slice(4, 10), TensorDict({"a": torch.arange(6), **{k: v[:1].expand(6, *v.shape[1:])
                                                                   for k, v in frames.items()}}, [6]))
        assert s.get(slice(None))["a"].tolist() == [1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 1]


def test_staged_rows_beyond_the_length_are_readable_but_holes_are_not():
    store = tiered.TieredStore(16, stage_rows=64)
    store.extend(TensorDict({"a": torch.arange(4)}, [4]))
    store.set(6, TensorDict({"a": torch.tensor(9)}, []))  # staged, beyond the length
    assert store.get(6)["a"].item() == 9
    with pytest.raises(E.UnwrittenRowError, match="row 4"):
        store.get(slice(None))


# ------------------------------------------------------------------------------------------------
# 9. D4RL per-row columns of the wrong length
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("column", ["terminals", "actions", "infos/qpos"])
def test_d4rl_per_row_column_of_the_wrong_length_is_refused(tmp_path, column):
    n = 20
    arrays = {"observations": np.zeros((n, 3), np.float32), "actions": np.zeros((n, 2), np.float32),
              "rewards": np.zeros(n, np.float32), "terminals": np.zeros(n, bool), "timeouts": np.zeros(n, bool),
              "infos/qpos": np.zeros((n, 2), np.float32)}
    arrays[column] = arrays[column][: n - 3]
    src = tmp_path / "d.hdf5"
    with h5py.File(src, "w") as f:
        for k, v in arrays.items():
            f[k] = v
    with pytest.raises(E.InvalidDatasetError) as e:
        import_dataset("d4rl", src, tmp_path / "dst")
    assert f"'{column}' has 17 rows" in str(e.value) and "'observations' (20)" in str(e.value)
    assert str(src) in str(e.value)
    assert main(["import", str(src), str(tmp_path / "dst2"), "--format", "d4rl"]) == 2
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst2").exists()


def test_a_damaged_npz_member_header_exits_2(tmp_path):
    src = tmp_path / "a.npz"
    np.savez(src, observation=np.zeros((5, 3), np.float32))
    raw = bytearray(src.read_bytes())
    at = raw.index(b"{'descr'")
    raw[at:at + 8] = b"{'descr("  # an unterminated header dict (tokenize.TokenError in numpy)
    src.write_bytes(bytes(raw))
    with pytest.raises(E.UnsupportedFormatError, match="a.npz"):
        import_dataset("npz", src, tmp_path / "dst")
    assert main(["import", str(src), str(tmp_path / "dst2"), "--format", "npz"]) == 2


# ------------------------------------------------------------------------------------------------
# minor items
# ------------------------------------------------------------------------------------------------
def test_sizes_are_bounded_before_allocation(tmp_path):
    with pytest.raises(E.InvalidArgumentError, match="capacity"):
        tiered.TieredStore(10**15)
    with pytest.raises(E.InvalidArgumentError, match="capacity"):
        tiered.TieredStore(1 << 39)  # within the bound, but more row metadata than this machine has
    with pytest.raises(E.InvalidArgumentError, match="chunk_frames"):
        tiered.TieredStore(10, chunk_frames=10**9)
    with pytest.raises(E.InvalidArgumentError, match="stage_rows"):
        tiered.TieredStore(10, stage_rows=10**12)
    # the first write: a chunk too large for a blob, dense columns larger than memory
    store = tiered.TieredStore(10, chunk_frames=1 << 16, blob_keys=["x"])
    with pytest.raises(E.InvalidArgumentError, match="chunk"):
        store.extend(TensorDict({"x": torch.zeros(2, 1 << 16, dtype=torch.uint8)}, [2]))
    assert store.schema is None
    big = tiered.TieredStore(1 << 32, stage_rows=0)
    with pytest.raises(E.InvalidArgumentError, match="bytes per row"):
        big.extend(TensorDict({"x": torch.zeros(2, 64)}, [2]))
    assert big.schema is None and len(big) == 0
    assert not list(tmp_path.iterdir())


def test_bool_masks_must_have_the_length_or_the_capacity():
    store = tiered.TieredStore(10)
    store.extend(TensorDict({"a": torch.arange(6)}, [6]))
    assert store.get(torch.tensor([True, False] * 3))["a"].tolist() == [0, 2, 4]
    assert store.get(np.arange(10) == 5)["a"].tolist() == [5]
    for mask in (torch.ones(5, dtype=torch.bool), np.ones(7, bool), torch.ones(2, 3, dtype=torch.bool)):
        with pytest.raises(E.IndexOutOfRangeError, match="bool mask"):
            store.get(mask)
    with pytest.raises(E.IndexOutOfRangeError, match="bool mask"):
        store.set(torch.ones(4, dtype=torch.bool), TensorDict({"a": torch.arange(4)}, [4]))
    assert store.get(slice(None))["a"].tolist() == list(range(6))


def test_a_2d_index_keeps_its_shape_as_torchrl_storages_do():
    from torchrl.data import LazyTensorStorage

    td = TensorDict({"a": torch.arange(6), "x": torch.arange(12.0).reshape(6, 2)}, [6])
    lazy = LazyTensorStorage(10)
    lazy.set(torch.arange(6), td)
    store = tiered.TieredStore(10)
    store.extend(td)
    index = torch.tensor([[0, 5], [2, 2], [4, 1]])
    got, want = store.get(index), lazy.get(index)
    assert got.batch_size == want.batch_size == torch.Size([3, 2])
    assert got["a"].equal(want["a"]) and got["x"].equal(want["x"])
    # a write with a 2-D index takes data of that batch shape
    store.set(torch.tensor([[7, 8], [6, 9]]), TensorDict({"a": torch.tensor([[70, 80], [60, 90]]),
                                                          "x": torch.zeros(2, 2, 2)}, [2, 2]))
    assert store.get(slice(6, 10))["a"].tolist() == [60, 70, 80, 90]
    with pytest.raises(E.SchemaMismatchError, match="batch size"):
        store.set(torch.tensor([[1, 2]]), td[:2])


def test_keys_as_a_plain_string_is_one_key():
    store = tiered.TieredStore(10)
    store.extend(TensorDict({"observation": torch.zeros(3, 2), "action": torch.arange(3)}, [3]))
    assert list(store.get([0, 1], keys="observation").keys()) == ["observation"]


def test_set_priority_of_the_wrong_length_is_a_tiered_error():
    store = tiered.TieredStore(10, policy="priority")
    store.extend(TensorDict({"x": torch.zeros(4, 1024, dtype=torch.uint8)}, [4]))
    with pytest.raises(E.InvalidPriorityError, match="3 priorities for 2 rows"):
        store.set_priority([0, 1], torch.ones(3))
    store.set_priority([0, 1], 2.0)  # one for all is fine


def test_non_tensor_leaves_and_slash_keys_are_refused(tmp_path):
    store = tiered.TieredStore(10, tmp_path / "s")
    with pytest.raises(E.SchemaMismatchError, match="'text' is a NonTensorData"):
        store.extend(TensorDict({"a": torch.arange(3), "text": NonTensorData("hi", batch_size=[3])}, [3]))
    with pytest.raises(E.SchemaMismatchError, match="contain '/'"):
        store.extend(TensorDict({"a/b": torch.arange(3)}, [3]))
    assert store.schema is None and len(store) == 0
    store.extend(TensorDict({"a": {"b": torch.arange(3)}}, [3]))
    # once the schema is fixed, a later non-tensor leaf is named, never dropped
    with pytest.raises(E.SchemaMismatchError, match="'note': not in the schema"):
        store.extend(TensorDict({"a": {"b": torch.arange(3)}, "note": NonTensorData("x", batch_size=[3])}, [3]))
    store.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused(tmp_path):
    with pytest.raises(E.InvalidArgumentError, match="hot_device='cuda'.*0 CUDA device"):
        tiered.TieredStore(10, hot_device="cuda")
    with pytest.raises(E.InvalidArgumentError, match="device='cuda:1'"):
        tiered.TieredStore(10, device="cuda:1")
    with tiered.TieredStore(10, tmp_path / "s") as s:
        s.extend(_rows())
    with pytest.raises(E.InvalidArgumentError, match="hot_device"):
        tiered.open(tmp_path / "s", hot_device="cuda")
    assert not (tmp_path / "x").exists()


def test_opening_and_closing_an_unchanged_store_writes_no_generation(tmp_path):
    path = tmp_path / "s"
    with tiered.TieredStore(10, path) as s:
        s.extend(_rows())
    gen = read_manifest(path)["generation"]
    listing = sorted(p.name for p in path.iterdir())
    for _ in range(3):
        with tiered.open(path, mode="r+") as s:
            s.get([0, 1])  # reads change nothing durable
            s.flush()
    assert read_manifest(path)["generation"] == gen
    assert sorted(p.name for p in path.iterdir()) == listing
    with tiered.open(path, mode="r+") as s:  # a change still commits
        s.extend(_rows(2))
    assert read_manifest(path)["generation"] == gen + 1
    with tiered.open(path) as s:
        assert len(s) == 8
