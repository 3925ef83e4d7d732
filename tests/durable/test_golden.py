"""The golden fixtures of format v1 decode bit-exactly, forever (numcodecs' ``fixture/`` pattern).

``tests/fixtures/golden/`` holds stores and codec blobs written once by
``benchmarks/make_golden.py`` from real Atari frames, and ``golden.json``, what a reader must get
back from them (docs/format.md, "Golden fixtures"). These tests read them with today's code:

* every store is extracted from its archive (holes come back as holes, so the reserved cold
  segments keep the length their manifest records), opened read-only, read row by row and whole,
  compared with the SHA-256 of every column and the digest of every row, verified with
  :func:`tiered.verify.verify_store`, and left byte for byte as it was;
* a copy of every store is opened ``mode="r+"``, extended (a staged write and a direct one),
  committed, reopened, and its old and new rows checked;
* every codec blob set is decoded with every codec that reads its format (any zstd level for
  zstd blobs) into a preallocated buffer, and its stored checksums recomputed.

A failure here means format v1 changed: fix the code, never the fixture.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiered
from tiered.codecs import codec_for_format_id, get_codec, segment_checksums, segment_checksums_torch
from tiered.durable.commit_arrays import array_path
from tiered.errors import TieredError
from tiered.verify import verify_store

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "golden"
GOLDEN: dict[str, Any] = json.loads((FIXTURE / "golden.json").read_text())
STORES = sorted(GOLDEN["stores"])
CODEC_SETS = sorted(GOLDEN["codecs"])
# The whole folder travels with the repository (and to remote test machines): keep it small.
MAX_FIXTURE_BYTES = 2 << 20
# Decoders of each format: every zstd level reads every zstd frame; the GPU codecs read the same
# bitstreams where nvCOMP and a CUDA device exist (skipped elsewhere).
DECODERS = {
    "zstd": ["zstd:-5", "zstd:1", "zstd:3", "zstd:9", "zstd:19", "zstd:22", "nvcomp:zstd"],
    "lz4": ["lz4", "nvcomp:lz4"],
    "raw": ["raw"],
}
ROWS_ADDED = 6


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------
def extract(name: str, destination: Path) -> Path:
    """Extract store ``name`` into ``destination``; return the store directory."""
    archive = FIXTURE / GOLDEN["stores"][name]["archive"]
    with tarfile.open(archive, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(destination, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            tar.extractall(destination)
    return destination / name


def cell_bytes(column: torch.Tensor) -> np.ndarray:
    """``[n, bytes]``: each row's cell as C-order bytes (bool: one 0/1 byte per element)."""
    n = column.shape[0]
    return column.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy()


def row_digests(rows: Any, keys: list[tuple[str, ...]]) -> list[str]:
    """golden.json's per-row digest: the row's fields' bytes, concatenated in schema order."""
    joined = np.concatenate([cell_bytes(rows.get(k)) for k in keys], axis=1)
    width = len(GOLDEN["stores"][STORES[0]]["rows"][0])
    return [hashlib.sha256(joined[r].tobytes()).hexdigest()[:width] for r in range(joined.shape[0])]


def field_keys(expected: dict[str, Any]) -> list[tuple[str, ...]]:
    return [tuple(f["key"]) for f in expected["fields"]]


def differing(got: list[str], want: list[str], rows: np.ndarray | range) -> list[int]:
    return [int(r) for r, g, w in zip(rows, got, want, strict=True) if g != w]


def directory_state(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``path`` with its size and modification time."""
    return {p.relative_to(path).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every store, extracted once for the read-only tests."""
    root = tmp_path_factory.mktemp("golden")
    return {name: extract(name, root) for name in STORES}


# ------------------------------------------------------------------------------------------
# The fixture itself
# ------------------------------------------------------------------------------------------
def test_the_fixture_folder_is_small():
    files = [p for p in FIXTURE.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert len(files) >= len(STORES) + len(CODEC_SETS) + 1
    assert total < MAX_FIXTURE_BYTES, f"tests/fixtures/golden holds {total:,} bytes, over {MAX_FIXTURE_BYTES:,}"


def test_golden_json_names_every_file_of_the_folder():
    named = {GOLDEN["stores"][s]["archive"] for s in STORES} | {GOLDEN["codecs"][c]["file"] for c in CODEC_SETS}
    on_disk = {p.relative_to(FIXTURE).as_posix() for p in FIXTURE.rglob("*") if p.is_file()}
    assert on_disk - {"golden.json", ".gitattributes"} == named
    assert GOLDEN["format_version"] == 1


def test_the_fixture_covers_what_format_v1_holds():
    stores = GOLDEN["stores"].values()
    assert {s["backend"] for s in stores} == {"memmap", "hdf5"}
    assert {s["chunk_frames"] for s in stores} >= {1, 4}
    assert {s["codec"].partition(":")[0] for s in stores} >= {"zstd", "lz4"}
    assert any(s["rows_written"] > s["capacity"] for s in stores), "no store whose ring wrapped"
    assert any(s["commits"] >= 3 for s in stores), "no store written in several commits"
    assert any(s["cold"]["free_extents"] and s["cold"]["pending_extents"] and s["cold"]["free_ids"]
               for s in stores), "no store with free ids and free and deferred cold space"
    dense = {f["dtype"] for s in stores for f in s["fields"] if f["kind"] == "dense"}
    assert dense >= {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
                     "complex64", "complex128"}
    assert {GOLDEN["codecs"][c]["format"] for c in CODEC_SETS} == {"zstd", "lz4", "raw"}


# ------------------------------------------------------------------------------------------
# Stores, read-only
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", STORES)
def test_store_reads_bit_exactly(name: str, extracted: dict[str, Path]):
    expected = GOLDEN["stores"][name]
    path = extracted[name]
    keys = field_keys(expected)
    with tiered.open(path, mode="r") as store:
        assert store.read_only
        assert (store.capacity, len(store), store.cursor) == (expected["capacity"], expected["len"], expected["cursor"])
        schema = [{"key": list(f.key), "dtype": str(f.dtype).removeprefix("torch."), "shape": list(f.shape),
                   "kind": f.kind} for f in store.schema.values()]
        assert schema == [{k: f[k] for k in ("key", "dtype", "shape", "kind")} for f in expected["fields"]]
        # the layout it was written with, whatever today's defaults (chunk_frames, frame detection)
        assert store.options["chunk_frames"] == expected["chunk_frames"]
        assert {"/".join(k): d for k, d in store.options["frames"].items()} == expected["frames"]
        rows = store.get(range(len(store)))
        # the same rows again in a shuffled order, as a sampler reads them
        order = np.random.default_rng(0).permutation(len(store))
        shuffled = store.get(torch.from_numpy(order))
        single = store.get(int(order[0]))
    for field in expected["fields"]:
        column = rows.get(tuple(field["key"]))
        assert column.dtype == getattr(torch, field["dtype"]) and list(column.shape[1:]) == field["shape"]
        got = hashlib.sha256(cell_bytes(column).tobytes()).hexdigest()
        assert got == field["sha256"], f"{name}: field {field['key']} decodes to other bytes"
    assert differing(row_digests(rows, keys), expected["rows"], range(len(rows))) == []
    want = [expected["rows"][r] for r in order]
    assert differing(row_digests(shuffled, keys), want, order) == []
    assert row_digests(single.unsqueeze(0), keys) == [expected["rows"][order[0]]]


@pytest.mark.parametrize("name", STORES)
def test_store_verifies(name: str, extracted: dict[str, Path]):
    expected = GOLDEN["stores"][name]
    report = verify_store(extracted[name], progress=False)
    assert report.ok, report.summary()
    assert (report.generation, report.rows, report.capacity, report.codec) == (
        expected["generation"], expected["len"], expected["capacity"], expected["codec"])
    assert report.blobs_checked > 0
    decoded = verify_store(extracted[name], progress=False, decode=True)
    assert decoded.ok, decoded.summary()


@pytest.mark.parametrize("name", STORES)
def test_read_only_open_leaves_the_store_untouched(name: str, tmp_path: Path):
    path = extract(name, tmp_path)
    before = directory_state(path)
    with tiered.open(path, mode="r") as store:
        store.get(range(len(store)))
    verify_store(path, progress=False)
    assert directory_state(path) == before


@pytest.mark.parametrize("name", STORES)
def test_committed_free_lists_match(name: str, extracted: dict[str, Path]):
    """The free ids and cold extents are on disk as golden.json says (docs/format.md arrays)."""
    expected = GOLDEN["stores"][name]
    body = json.loads((extracted[name] / "manifest.json").read_text())["body"]
    assert body["format_version"] == 1 and body["generation"] == expected["generation"]

    def count(array: str) -> int:
        return int(np.load(array_path(str(extracted[name]), body, array), allow_pickle=False).shape[0])

    assert {"free_ids": count("index.free_ids"), "free_extents": count("cold.free_offsets"),
            "pending_extents": count("cold.pending_offsets")} == expected["cold"]


# ------------------------------------------------------------------------------------------
# Stores, written again
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", STORES)
def test_store_extends_after_reopening(name: str, tmp_path: Path):
    expected = GOLDEN["stores"][name]
    path = extract(name, tmp_path)
    keys = field_keys(expected)
    capacity, cursor = expected["capacity"], expected["cursor"]
    source = np.arange(10, 10 + ROWS_ADDED)  # rows of the store itself, written again further on
    with tiered.open(path, mode="r+") as store:
        added = store.get(torch.from_numpy(source))
        store.extend(added[:2])  # staged (a small write)
        store.extend(added[2:])
        store.flush()
    targets = (cursor + np.arange(ROWS_ADDED)) % capacity
    want = list(expected["rows"])
    want.extend([""] * (min(capacity, expected["len"] + ROWS_ADDED) - len(want)))
    for slot, row in zip(targets.tolist(), source.tolist(), strict=True):
        want[slot] = expected["rows"][row]
    with tiered.open(path, mode="r") as store:
        assert len(store) == min(capacity, expected["len"] + ROWS_ADDED)
        assert store.cursor == (cursor + ROWS_ADDED) % capacity
        rows = store.get(range(len(store)))
        new = store.get(torch.from_numpy(targets))
    assert differing(row_digests(rows, keys), want, range(len(rows))) == []
    for key in keys:
        assert torch.equal(torch.from_numpy(cell_bytes(new.get(key))), torch.from_numpy(cell_bytes(added.get(key))))
    report = verify_store(path, progress=False, decode=True)
    assert report.ok, report.summary()


# ------------------------------------------------------------------------------------------
# Codec blobs
# ------------------------------------------------------------------------------------------
def _codec_cases() -> list[tuple[str, str]]:
    return [(s, spec) for s in CODEC_SETS for spec in DECODERS[GOLDEN["codecs"][s]["format"]]]


def _decoder(spec: str):
    try:
        return get_codec(spec)
    except (ImportError, TieredError, RuntimeError) as e:  # nvCOMP or CUDA missing here
        pytest.skip(f"{spec} cannot run here: {e}")


def _blobs(name: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray]:
    entry = GOLDEN["codecs"][name]
    data = np.fromfile(FIXTURE / entry["file"], dtype=np.uint8)
    return entry, data, np.array(entry["offsets"], dtype=np.int64), np.array(entry["sizes"], dtype=np.int64)


@pytest.mark.parametrize("name", CODEC_SETS)
def test_codec_blobs_keep_their_checksums(name: str):
    entry, data, offsets, sizes = _blobs(name)
    assert data.size == entry["nbytes"] and hashlib.sha256(data.tobytes()).hexdigest() == entry["sha256"]
    assert segment_checksums(data, offsets, sizes).tolist() == entry["checksums"]
    on_torch = segment_checksums_torch(torch.from_numpy(data), torch.from_numpy(offsets), torch.from_numpy(sizes))
    assert on_torch.tolist() == entry["checksums"]


@pytest.mark.parametrize(("name", "spec"), _codec_cases())
def test_codec_blobs_decode_bit_exactly(name: str, spec: str):
    entry, data, offsets, sizes = _blobs(name)
    codec = _decoder(spec)
    assert codec.format == entry["format"] and codec.format_id == entry["format_id"]
    out_offsets = np.array(entry["decoded_offsets"], dtype=np.int64)
    out_sizes = np.array(entry["decoded_sizes"], dtype=np.int64)
    total = int(out_sizes.sum())
    out = np.full(total + 64, 0xA5, dtype=np.uint8)  # preallocated, with a guard band after it
    codec.decode(data, offsets, sizes, out, out_offsets, out_sizes)
    assert hashlib.sha256(out[:total].tobytes()).hexdigest() == entry["decoded_sha256"]
    assert bool((out[total:] == 0xA5).all()), "decode wrote past the decoded sizes"
    blob_digests = [hashlib.sha256(out[o:o + n].tobytes()).hexdigest()
                    for o, n in zip(out_offsets.tolist(), out_sizes.tolist(), strict=True)]
    assert blob_digests == entry["decoded_blob_sha256"]


@pytest.mark.parametrize("name", CODEC_SETS)
def test_codec_blobs_decode_by_format_id_in_any_order(name: str):
    """The store's path: the codec named by the blob index's format id, blobs scattered."""
    entry, data, offsets, sizes = _blobs(name)
    codec = codec_for_format_id(entry["format_id"])
    out_sizes = np.array(entry["decoded_sizes"], dtype=np.int64)
    order = np.arange(sizes.size)[::-1].copy()  # last blob first, packed the other way round
    out_offsets = np.r_[0, np.cumsum(out_sizes[order])[:-1]].astype(np.int64)
    out = np.empty(int(out_sizes.sum()), dtype=np.uint8)
    codec.decode(data, offsets[order], sizes[order], out, out_offsets, out_sizes[order])
    got = [hashlib.sha256(out[o:o + n].tobytes()).hexdigest()
           for o, n in zip(out_offsets.tolist(), out_sizes[order].tolist(), strict=True)]
    assert got == [entry["decoded_blob_sha256"][i] for i in order]


# ------------------------------------------------------------------------------------------
# The script that made them
# ------------------------------------------------------------------------------------------
def _make_golden():
    """The fixture script as a module (it lives in benchmarks/, outside the package)."""
    spec = importlib.util.spec_from_file_location("make_golden", REPO / "benchmarks" / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_golden_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    script = _make_golden()
    (tmp_path / "golden.json").write_text("{}")
    assert script.main(["--out", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden.json"]
    assert (tmp_path / "golden.json").read_text() == "{}"
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    usage = capsys.readouterr().out
    assert done.value.code == 0 and "--force" in usage and "never overwritten" in usage
