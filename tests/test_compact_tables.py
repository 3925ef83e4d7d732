"""Compact row tables (format 3): int32 blob ids and uint16 slots, stores written with the int64 /
int32 tables of formats 1 and 2 still open, read the same rows and are rewritten compact at
their next commit.

``tests/fixtures/format2/pong_format2.tar.xz`` is a format-2 store written by tiered before
format 3 (``FORMAT_VERSION == 2``), 200 rows of real Pong frames, with::

    td = cached_rollout(game="Pong", steps=2000, seed=0, max_episode_steps=500)
    with tiered.TieredStore(40_000, "pong_format2", chunk_frames=8) as s:
        for a in range(400, 600, 50):
            s.extend(td[a:a + 50])
        s.flush()

(an episode boundary, step 500, lies inside; the capacity makes each row table more than one
1 MiB page, so commits rewrite them page by page). A failure here means old stores stopped
reading: fix the code, never the fixture.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.engine.manifest import FORMAT_VERSION, PAGE_BYTES
from tiered.engine.pages import write_copy
from tiered.errors import StorageFullError
from tiered.index import MAX_BLOB_IDS, BlobIndex, check_blob_ids
from tiered.testing.inspection import parts
from tiered.verify import verify_store

FIXTURE = Path(__file__).parent / "fixtures" / "format2" / "pong_format2.tar.xz"
CAPACITY, ROWS = 40_000, 200
FIRST = 400  # row r of the fixture holds transition FIRST + r of the Pong rollout


def _body(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())["body"]


def _table_dtypes(path: Path) -> set[tuple[str, str]]:
    """``(name, dtype)`` of every row table array the last commit published."""
    body = _body(path)
    out = set()
    for name, copy in body["copy"].items():
        if name.startswith("rows."):
            out.add((name, str(np.load(path / "arrays" / f"{name}.{copy}.npy", mmap_mode="r").dtype)))
    return out


def _assert_same(a: TensorDict, b: TensorDict) -> None:
    keys = sorted(a.keys(True, True), key=str)
    assert keys == sorted(b.keys(True, True), key=str)
    for k in keys:
        assert torch.equal(a.get(k), b.get(k)), k


def _extract(tmp_path: Path) -> Path:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "pong_format2"


def test_a_new_store_writes_32_bit_row_tables(tmp_path, atari_pong):
    path = tmp_path / "s"
    with TieredStore(256, path, chunk_frames=8) as s:
        s.extend(atari_pong[:300])
        tables = parts(s).layout.tables
        assert {(str(t.blob.dtype), str(t.slot.dtype)) for t in tables.values()} == {("int32", "uint16")}
        # 4-frame observation and next observation: 2 x 4 x (4 + 2) bytes per row
        assert s.stats()["memory"]["row_tables"] == 256 * 2 * 4 * 6
        s.flush()
    assert _body(path)["format_version"] == FORMAT_VERSION == 3
    dtypes = {d for _, d in _table_dtypes(path)}
    assert dtypes == {"int32", "uint16"}
    with tiered.open(path) as s:
        r = np.arange(256)
        _assert_same(s.get(torch.arange(256)), atari_pong[torch.as_tensor(np.where(r < 44, 256 + r, r))])
    assert verify_store(path, progress=False).ok


def test_a_format2_store_reads_the_same_and_upgrades_at_its_next_commit(tmp_path, atari_pong, monkeypatch):
    monkeypatch.setenv("TIERED_CHECK_COMMITS", "1")  # every copy a commit writes equals memory
    path = _extract(tmp_path)
    assert _body(path)["format_version"] == 2
    assert {d for _, d in _table_dtypes(path)} == {"int64", "int32"}
    expected = atari_pong[FIRST:FIRST + ROWS]
    before = {p.name: p.read_bytes() for p in (path / "arrays").iterdir()}
    with tiered.open(path) as s:  # read-only: converted in memory, nothing written
        assert len(s) == ROWS
        _assert_same(s.get(torch.arange(ROWS)), expected)
        assert {str(t.blob.dtype) for t in parts(s).layout.tables.values()} == {"int32"}
        assert s.stats()["memory"]["row_tables"] == CAPACITY * 2 * 4 * 6  # was 2 x 4 x 12
    assert {p.name: p.read_bytes() for p in (path / "arrays").iterdir()} == before
    assert verify_store(path, progress=False).ok
    # a writer: its commits write format 3, the copies left by format 2 are rewritten whole
    with tiered.open(path, mode="r+") as s:
        for a in (600, 610, 620):  # three commits: every copy of every array is rewritten once
            s.extend(atari_pong[a:a + 10])
            s.flush(force=True)
            assert _body(path)["format_version"] == 3
            assert {d for _, d in _table_dtypes(path)} == {"int32", "uint16"}
    with tiered.open(path) as s:
        assert len(s) == ROWS + 30
        _assert_same(s.get(torch.arange(ROWS + 30)), atari_pong[FIRST:FIRST + ROWS + 30])
    assert verify_store(path, progress=False).ok


def test_a_write_needing_more_blob_ids_than_32_bits_hold_is_refused(atari_pong):
    with pytest.raises(StorageFullError, match="2,147,483,647"):
        check_blob_ids(MAX_BLOB_IDS - 3, 4)
    check_blob_ids(MAX_BLOB_IDS - 4, 4)
    index = BlobIndex()
    index.size = MAX_BLOB_IDS - 1  # a seam: pretend the ids below were handed out
    with pytest.raises(StorageFullError, match="32-bit"):
        index.allocate(2)
    assert index.size == MAX_BLOB_IDS - 1 and index.capacity == 1024  # nothing grown
    # through a store: the write is refused before anything changes
    with TieredStore(64, chunk_frames=4) as s:
        s.extend(atari_pong[:20])
        before = s.get(torch.arange(20))
        idx = parts(s).index
        size = idx.size
        idx.size = MAX_BLOB_IDS - 1
        with pytest.raises(StorageFullError, match="nothing was written"):
            s.extend(atari_pong[20:40])
        idx.size = size
        assert len(s) == 20
        _assert_same(s.get(torch.arange(20)), before)
        s.extend(atari_pong[20:40])
        _assert_same(s.get(torch.arange(20, 40)), atari_pong[20:40])


def test_an_array_whose_dtype_changed_is_rewritten_whole(tmp_path):
    """A copy holding a format-2 int64 table is not patched page by page with int32 rows (every
    page moved): the commit rewrites it whole."""
    path = str(tmp_path / "rows.0.blob.0.npy")
    old = np.arange(3 * PAGE_BYTES // 8 * 4, dtype=np.int64).reshape(-1, 4)  # int32: 6 pages
    base = write_copy(path, old, None, None, 1)
    new = old.astype(np.int32)
    new[0] = -1
    blocks = np.zeros(1, dtype=bool)
    blocks[0] = True  # only the first block of rows changed
    state = write_copy(path, new, blocks, base, 2)
    disk = np.load(path)
    assert disk.dtype == np.int32 and np.array_equal(disk, new)
    assert state.written == state.size
