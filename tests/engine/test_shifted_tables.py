"""Shifted row tables: a stacked field keeps only each row's newest frame, the rest of
its stack being the previous row's shifted by one step, plus the rows where that rule fails.

Real Atari stacks (Pong truncated every 500 steps, MsPacman game overs) read back bit-exactly
after sequential writes, ring laps, random overwrites and single-row rewrites; stacks that never
follow the rule turn the table explicit; commits save them shifted, damage is refused; random
put/unset sequences match an explicit table.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, manifest_body, restamp
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.atari import concat_rollouts
from tiered.durable.manifest import FORMAT_VERSION, PAGE_BYTES
from tiered.engine.row_tables import RowTable, ShiftedRowTable
from tiered.errors import ChecksumError, CorruptionError
from tiered.testing.inspection import parts
from tiered.torchrl import TieredStorage
from tiered.verify import verify_store

OBS, NEXT = ("observation",), ("next", "observation")


def _breaks(stacks: torch.Tensor) -> np.ndarray:
    """Rows (of a full ring, around it) whose stack is not the previous row's shifted by one."""
    prev = stacks.roll(1, 0)
    return np.flatnonzero((stacks[:, :-1] != prev[:, 1:]).flatten(1).any(1).numpy())


@pytest.fixture(scope="module")
def games(atari_pong, atari_mspacman) -> TensorDict:
    return concat_rollouts([atari_pong[300:1300], atari_mspacman[:1000]])


def test_sequential_writes_and_ring_laps_read_bit_exactly(games, tmp_path):
    cap = 700  # 2000 rows: the ring laps almost three times
    path = tmp_path / "s"
    with TieredStore(cap, path, chunk_frames=8) as s:
        truth = games[:cap].clone()
        for a in range(0, 2000, 150):
            s.extend(games[a:a + 150])
            rows = torch.arange(a, min(a + 150, 2000)) % cap
            truth[rows] = games[a:a + 150]
            n = min(a + 150, cap)
            assert_td_equal(s.get(torch.arange(n)), truth[:n])
        table = parts(s).layout.tables[OBS]
        assert table.shifted and not table.crowded
        # the exceptions are the rows whose stack does not follow the row before (episode
        # starts, the game switch, the ring's seam): few, and exactly those
        assert table.exc_rows.tolist() == _breaks(truth["observation"]).tolist()
        assert 0 < table.exc_rows.size < 20
        nxt = parts(s).layout.tables[NEXT]
        assert nxt.derived and nxt.exc_rows.size < 10  # no per-row column: episode ends, the cursor
        assert s.stats()["memory"]["row_tables"] == (cap * 6 + table.exc_rows.size * (8 + 3 * 6)
                                                     + nxt.exc_rows.size * (8 + 4 * 6))
        index_of = {k: i for i, k in enumerate(s.schema)}
    body = manifest_body(path)
    assert body["format_version"] == FORMAT_VERSION == 1 and body["shifted_tables"] == [index_of[OBS]]
    assert f"shift.{index_of[OBS]}.rows" in body["files"] and body["files"][f"rows.{index_of[OBS]}.blob"] < cap * 8
    with tiered.open(path) as s:
        assert_td_equal(s.get(torch.arange(cap)), truth)
        assert parts(s).layout.tables[OBS].shifted
    assert verify_store(path, progress=False).ok


def test_overwrites_keep_every_other_row(games, tmp_path):
    """TorchRL-style random-index writes (``storage[idx] = td``) and a single row rewritten in the
    middle of an episode: the rows around them keep their stacks."""
    cap = 600
    storage = TieredStorage(cap, tmp_path / "s", frames={"observation": 0})
    storage.set(torch.arange(cap), games[:cap])
    truth = games[:cap].clone()
    rng = np.random.default_rng(0)
    for _ in range(4):
        idx = torch.as_tensor(rng.choice(cap, 40, replace=False))
        src = torch.as_tensor(rng.choice(2000, 40, replace=False))
        storage[idx] = games[src]
        truth[idx] = games[src]
        assert_td_equal(storage.get(torch.arange(cap)), truth)
    store = storage.store
    table = parts(store).layout.tables[OBS]
    assert table.shifted and table.exc_rows.tolist() == _breaks(truth["observation"]).tolist()
    # one row in the middle of an episode (row 250: step 550 of Pong) gets another game's row
    before = store.get(torch.arange(cap))
    store.set(250, games[1500])
    truth[250] = games[1500]
    after = store.get(torch.arange(cap))
    assert_td_equal(after, truth)
    keep = torch.arange(cap) != 250
    assert_td_equal(after[keep], before[keep])
    store.flush()  # a single-row write is staged: into the tables
    assert {250, 251} <= set(table.exc_rows.tolist())
    store.set(250, games[550])  # back: the rule holds again where it did
    truth[250] = games[550]
    store.flush()
    assert_td_equal(store.get(torch.arange(cap)), truth)
    assert table.exc_rows.tolist() == _breaks(truth["observation"]).tolist()
    storage.close()


def test_stacks_that_never_shift_turn_the_table_explicit(atari_pong):
    small = ShiftedRowTable(10_000, 4)
    small.put(np.arange(5000), np.arange(20_000).reshape(5000, 4), np.zeros((5000, 4)))
    assert small.exc_rows.size == 5001 and small.crowded  # and the first row not written  # more than max(4096, capacity / 32)
    assert np.array_equal(small.full()[0][:5000], np.arange(20_000).reshape(5000, 4))
    data = atari_pong[:1000].clone()
    data["observation"] = data["observation"].flip(1)  # no row follows the rule
    with TieredStore(10_000, chunk_frames=8, frames={"observation": 0}) as s:
        s.extend(data)
        table = parts(s).layout.tables[OBS]
        assert table.shifted and 990 < table.exc_rows.size <= 1001  # nearly every row, and the first unwritten
        for _ in range(4):  # 5000 rows, each an exception: crowded, so explicit
            s.extend(data)
        table = parts(s).layout.tables[OBS]
        assert not table.shifted and not table.derived
        nxt = parts(s).layout.tables[NEXT]
        assert not nxt.derived or nxt.base is table  # a derived next table reads the new one
        got = s.get(torch.arange(5000))
        for k in range(5):
            assert_td_equal(got[k * 1000:(k + 1) * 1000], data)
        s.extend(data[:10])
        assert_td_equal(s.get(torch.arange(5000, 5010)), data[:10])


def _obs_file(path: Path, prefix: str) -> Path:
    body = manifest_body(path)
    (i,) = body["shifted_tables"]
    name = f"{prefix}.{i}.{'blob' if prefix == 'rows' else 'rows'}"
    return path / "arrays" / f"{name}.{body['array_files'][name]}.npy"


def test_a_damaged_exception_list_is_refused_at_open(tmp_path, atari_pong):
    path = tmp_path / "s"
    with TieredStore(1000, path, chunk_frames=8) as s:
        s.extend(atari_pong[:1000])
        assert parts(s).layout.tables[OBS].exc_rows.tolist() == [0, 500]
    f = _obs_file(path, "shift")
    raw = f.read_bytes()
    f.write_bytes(raw[:-16] + raw[-8:] + raw[-16:-8])  # [500, 0]: not sorted
    restamp(path)  # checksums of the damaged bytes: the content check must catch it
    with pytest.raises(CorruptionError, match=re.escape(f.name)):
        tiered.open(path)
    assert not verify_store(path, progress=False).ok


def test_a_damaged_last_column_page_raises_at_the_first_read_that_uses_it(tmp_path, atari_pong):
    cap = 1_200_000  # the observation's last column (4 B a row) spans 5 pages
    first = 2 * PAGE_BYTES // 4 + 1000  # rows whose entries lie on the third page
    path = tmp_path / "s"
    with TieredStore(cap, path, chunk_frames=8) as s:
        s.extend(atari_pong[:100])
        s.set(torch.arange(first, first + 100), atari_pong[100:200])
    f = _obs_file(path, "rows")
    at = 2 * PAGE_BYTES + PAGE_BYTES // 2  # the third page: rows 0..99 (and the 4 rows before, at
    # the ring's end) are checked with the first two and the last
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    with tiered.open(path) as s:  # the open reads no page of the table
        assert_td_equal(s.get(torch.arange(100)), atari_pong[:100])
        with pytest.raises(ChecksumError, match=re.escape(f.name)):
            s.get(torch.tensor([first + 3]))  # its stack's last frames are in the damaged page
        assert_td_equal(s.get(torch.arange(100)), atari_pong[:100])
    assert not verify_store(path, progress=False).ok


def _model_check(table: ShiftedRowTable, model: RowTable) -> None:
    blob, slot = table.full()
    assert np.array_equal(blob, model.blob)
    assert np.array_equal(slot, model.slot)


@settings(max_examples=50, deadline=None)
@given(cap=st.integers(1, 40), frames=st.integers(2, 5), data=st.data())
def test_random_puts_and_unsets_match_an_explicit_table(cap, frames, data):
    table, model = ShiftedRowTable(cap, frames), RowTable(cap, frames)
    for _ in range(data.draw(st.integers(1, 8))):
        rows = np.array(data.draw(st.lists(st.integers(0, cap - 1), unique=True, max_size=cap)), dtype=np.int64)
        if data.draw(st.booleans()) and rows.size:
            table.unset(rows)
            model.unset(rows)
            model.slot[rows] = 0  # an unset shifted row keeps slot 0
        else:
            # mostly a stream of frames (stacks that shift), sometimes anything
            stream = np.array(data.draw(st.lists(st.integers(-1, 6), min_size=rows.size + frames,
                                                 max_size=rows.size + frames)))
            blob = np.lib.stride_tricks.sliding_window_view(stream, frames)[:rows.size]
            if data.draw(st.booleans()):
                blob = (blob + np.arange(rows.size)[:, None] % 3) % 7
            slot = np.array(data.draw(st.lists(st.integers(0, 2), min_size=blob.size, max_size=blob.size)),
                            dtype=np.int64).reshape(blob.shape)
            table.put(rows, blob, slot)
            model.put(rows, blob, slot)
        _model_check(table, model)
        picked = np.array(data.draw(st.lists(st.integers(0, cap - 1), max_size=10)), dtype=np.int64)
        assert np.array_equal(table.ids(picked), model.blob[picked])
        ahead = table.ahead(picked)  # one step ahead: frames 1.. of the row, the newest of the next row
        nb, ns = model.blob[(picked + 1) % cap, -1:], model.slot[(picked + 1) % cap, -1:]
        assert np.array_equal(ahead[0], np.concatenate([model.blob[picked, 1:], nb], 1))
        assert np.array_equal(ahead[1], np.concatenate([model.slot[picked, 1:], ns], 1))
