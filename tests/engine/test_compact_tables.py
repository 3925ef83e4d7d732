"""Compact row tables: int32 blob ids and uint16 slots, and next tables (a stacked
``("next", X)`` field keeps only the rows where its stack is not ``X``'s shifted by one step),
read back like the data where the rule fails too; a crowded table turns explicit; damage to an
exception list is refused naming its file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, manifest_body, restamp
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.atari import concat_rollouts
from tiered.durable.array_files import plan_in_place, write_new
from tiered.durable.commit_arrays import array_path
from tiered.durable.manifest import FORMAT_VERSION, PAGE_BYTES
from tiered.engine.blob_index import MAX_BLOB_IDS, BlobIndex, check_blob_ids
from tiered.engine.layout import FieldLayout
from tiered.errors import CorruptionError, StorageFullError
from tiered.schema import Schema
from tiered.testing.inspection import parts
from tiered.verify import verify_store


def _table_dtypes(path: Path) -> set[tuple[str, str]]:
    """``(name, dtype)`` of every row table array the last commit published."""
    body = manifest_body(path)
    out = set()
    for name in body["files"]:
        if name.startswith("rows."):
            out.add((name, str(np.load(array_path(str(path), body, name), mmap_mode="r").dtype)))
    return out


def _dtypes(store: TieredStore) -> set[str]:
    return {str(a.dtype) for t in parts(store).layout.tables.values() for name, a in t.state_arrays().items()
            if name != "exc_rows"}


def test_a_new_store_writes_32_bit_row_tables(tmp_path, atari_pong):
    path = tmp_path / "s"
    with TieredStore(256, path, chunk_frames=8) as s:
        s.extend(atari_pong[:300])
        assert _dtypes(s) == {"int32", "uint16"}
        # observation and its next stack keep only their last frame per row (shifted, derived),
        # plus one exception of the observation: row 44, whose stack does not follow row 43's
        assert parts(s).layout.tables[("observation",)].exc_rows.tolist() == [44]
        # the next stack keeps nothing per row: one exception, row 43 (the cursor's row 44 is not its successor)
        assert parts(s).layout.tables[("next", "observation")].exc_rows.tolist() == [43]
        assert s.stats()["memory"]["row_tables"] == 256 * 6 + (8 + 3 * 6) + (8 + 4 * 6)
        index_of = {k: i for i, k in enumerate(s.schema)}
        s.flush()
    body = manifest_body(path)
    assert body["format_version"] == FORMAT_VERSION == 1
    assert body["derived_tables"] == {str(index_of[("next", "observation")]): index_of[("observation",)]}
    assert body["shifted_tables"] == [index_of[("observation",)]]
    assert {d for _, d in _table_dtypes(path)} == {"int32", "uint16"}
    with tiered.open(path) as s:
        r = np.arange(256)
        assert_td_equal(s.get(torch.arange(256)), atari_pong[torch.as_tensor(np.where(r < 44, 256 + r, r))])
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
    # through a store: the write is refused before anything changes (no write stage: a 20-row
    # write would otherwise wait in it and take its ids only at the flush)
    with TieredStore(64, chunk_frames=4, stage_rows=0) as s:
        s.extend(atari_pong[:20])
        before = s.get(torch.arange(20))
        idx = parts(s).index
        size = idx.size
        idx.size = MAX_BLOB_IDS - 1
        with pytest.raises(StorageFullError, match="nothing was written"):
            s.extend(atari_pong[20:40])
        idx.size = size
        assert len(s) == 20
        assert_td_equal(s.get(torch.arange(20)), before)
        s.extend(atari_pong[20:40])
        assert_td_equal(s.get(torch.arange(20, 40)), atari_pong[20:40])


def test_an_array_whose_dtype_changed_is_rewritten_whole(tmp_path):
    """A file holding an array of another dtype (a narrowed dense column widened by a write that
    did not fit it) is not patched page by page (every page moved): the commit writes the array
    whole to a new file."""
    path = str(tmp_path / "rows.0.blob.1.npy")
    old = np.arange(3 * PAGE_BYTES // 8 * 4, dtype=np.int64).reshape(-1, 4)  # int32: 6 pages
    base = write_new(path, old, 1)
    new = old.astype(np.int32)
    new[0] = -1
    blocks = np.zeros(1, dtype=bool)
    blocks[0] = True  # only the first block of rows changed
    assert plan_in_place(path, new, blocks, base) is None  # not in place
    state = write_new(str(tmp_path / "rows.0.blob.2.npy"), new, 2)
    disk = np.load(str(tmp_path / "rows.0.blob.2.npy"))
    assert disk.dtype == np.int32 and np.array_equal(disk, new)
    assert state.written == state.size and np.array_equal(np.load(path), old)


def _stacks_mismatch(td: TensorDict) -> np.ndarray:
    """Rows (of a full ring) whose next stack is not their observation stack shifted by one
    frame, then the next row's newest frame (bytes)."""
    nxt, obs = td["next", "observation"], td["observation"]
    rule = torch.cat([obs[:, 1:], obs.roll(-1, 0)[:, -1:]], 1)
    return (nxt != rule).flatten(1).any(1).numpy()


def test_derived_next_tables_read_like_the_data_where_the_rule_fails_too(tmp_path, atari_pong, atari_mspacman):
    """Real frame stacks over a truncation (Pong, step 500), game overs (MsPacman), a game switch,
    a ring that wraps, out-of-order writes, staged small writes, and rows whose next stack is
    another row's (the rule fails there: those rows, and only those, are exceptions)."""
    data = concat_rollouts([atari_pong[400:700], atari_mspacman[:300]]).clone()
    odd = torch.tensor([10, 11, 250, 420, 599])
    data["next", "observation"][odd] = data["next", "observation"][odd - 7]
    cap, key = 256, ("next", "observation")
    truth = data[:cap].clone()
    written = np.zeros(cap, dtype=bool)
    path = tmp_path / "s"
    with TieredStore(cap, path, chunk_frames=8) as s:
        for a in range(0, 600, 50):  # rows 0..87 are overwritten
            s.extend(data[a:a + 50])
            rows = torch.arange(a, a + 50) % cap
            truth[rows] = data[a:a + 50]
            written[rows.numpy()] = True
        rows = torch.tensor([5, 200, 17, 3])  # out of order, through the batched path
        s.set(rows, data[torch.tensor([420, 421, 10, 599])])
        truth[rows] = data[torch.tensor([420, 421, 10, 599])]
        for r, t in ((30, 250), (31, 0)):  # small writes: staged, then flushed by the next read
            s.set(r, data[t])
            truth[r] = data[t]
        s.flush()
        got = s.get(torch.arange(cap))
        assert_td_equal(got, truth)
        table = parts(s).layout.tables[key]
        assert table.derived
        bad = np.flatnonzero(_stacks_mismatch(truth) & written)
        assert bad.size >= 5 and table.exc_rows.tolist() == bad.tolist()
        stats = s.stats()["memory"]["row_tables"]
        shifted = parts(s).layout.tables[("observation",)].exc_rows.size
        assert stats == cap * 6 + shifted * (8 + 3 * 6) + bad.size * (8 + 4 * 6)
        # error messages name the next field for a blob only its last frames use
        b = int(table.ids(np.array([100]))[0, -1])
        assert "next/observation" in parts(s).layout.rows_using(np.array([b]))[0]
    assert verify_store(path, progress=False).ok
    with tiered.open(path) as s:
        assert_td_equal(s.get(torch.arange(cap)), truth)
        assert parts(s).layout.tables[key].exc_rows.tolist() == bad.tolist()
    with tiered.open(path, mode="r+") as s:
        s.clear()
        assert parts(s).layout.tables[key].exc_rows.size == 0
        s.extend(data[:20])
        assert_td_equal(s.get(torch.arange(20)), data[:20])


def test_next_stacks_that_are_not_the_shifted_observation_are_exceptions(atari_pong):
    # reversed stacks: every row whose next stack differs from its shifted observation
    data = atari_pong[:300].clone()
    data["next", "observation"] = data["observation"].flip(1)
    with TieredStore(300, chunk_frames=8) as s:
        s.extend(data)
        t = parts(s).layout.tables[("next", "observation")]
        assert t.derived and t.exc_rows.tolist() == np.flatnonzero(_stacks_mismatch(data)).tolist()
        assert_td_equal(s.get(torch.arange(300)), data)


def test_a_layout_turns_a_crowded_derived_table_explicit_and_keeps_its_entries():
    td = TensorDict({"observation": torch.zeros(2, 4, 8, 8, dtype=torch.uint8),
                     ("next", "observation"): torch.zeros(2, 4, 8, 8, dtype=torch.uint8)}, [2])
    cap, key = 10_000, ("next", "observation")
    layout = FieldLayout(Schema.infer(td, blob_min_bytes=1, frames={"observation": 0}), cap, chunk_frames=4,
                         dedup=True)
    assert layout.derived_from == {key: ("observation",)} and layout.tables[key].derived
    rows = np.arange(cap)
    rng = np.random.default_rng(0)
    blob, slot = rng.integers(0, 1000, (cap, 8)), rng.integers(0, 4, (cap, 8))
    blob[:, 4:7], slot[:, 4:7] = blob[:, 1:4], slot[:, 1:4]  # every row follows the rule
    blob[:, 7], slot[:, 7] = np.roll(blob[:, 3], -1), np.roll(slot[:, 3], -1)
    layout.put_family(0, rows, blob, slot, np.zeros(cap, dtype=bool))
    assert layout.tables[key].derived and layout.tables[key].exc_rows.size == 0
    assert np.array_equal(layout.ids(rows), blob)
    blob2 = blob.copy()
    blob2[::2, 4] += 1  # half the rows break it: 5,000 exceptions, more than max(4096, cap / 32)
    old = layout.put_family(0, rows, blob2, slot, np.ones(cap, dtype=bool))
    assert [o.tolist() for o in old] == [blob[:, :4].tolist(), blob[:, 4:].tolist()]
    assert not layout.tables[key].derived
    assert np.array_equal(layout.ids(rows), blob2)
    blobs, slots = layout.blob_refs(list(layout.schema.values()), rows[::7])
    assert np.array_equal(blobs, blob2[::7]) and np.array_equal(slots, slot[::7])


def test_a_damaged_exception_list_is_refused_naming_its_file(tmp_path, atari_pong):
    data = atari_pong[:100].clone()
    data["next", "observation"][[5, 50]] = data["next", "observation"][[70, 90]]
    path = tmp_path / "s"
    with TieredStore(100, path, chunk_frames=8) as s:
        s.extend(data)
        assert parts(s).layout.tables[("next", "observation")].exc_rows.tolist() == [5, 50, 99]
    doc = json.loads((path / "manifest.json").read_text())
    body = doc["body"]
    (i,) = body["derived_tables"]
    name = f"next.{i}.rows"
    f = path / "arrays" / f"{name}.{body['array_files'][name]}.npy"
    raw = f.read_bytes()
    f.write_bytes(raw[:-16] + raw[-8:] + raw[-16:-8])  # [5, 99, 50]: not sorted
    restamp(path)  # checksums of the damaged bytes: the content check must catch it
    with pytest.raises(CorruptionError, match=re.escape(f.name)):
        tiered.open(path)
    assert not verify_store(path, progress=False).ok
