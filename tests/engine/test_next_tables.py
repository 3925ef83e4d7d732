"""Next row tables: a stacked ``("next", X)`` field keeps nothing per row. As a rule,
row ``r``'s next stack is ``X``'s stack of ``r`` shifted by one step, then the newest frame of
row ``r + 1``; only the rows where that fails (episode ends, the row before the write cursor,
rows written out of order) are kept, with their whole stacks.

Random puts/unsets through a layout match explicit tables, reference counts included (a write of
``X``'s rows must not change what the rows before them reference); real Atari stacks sampled
through a TorchRL replay buffer over ring laps read back bit-exactly with exact reference
counts; damaged exception entries are refused at open.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, check_refcounts, manifest_body, restamp
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import RandomSampler

import tiered
from tiered import TieredStore
from tiered.atari import concat_rollouts
from tiered.cli import main
from tiered.durable.manifest import FORMAT_VERSION
from tiered.engine.layout import FieldLayout
from tiered.engine.row_tables import NextRowTable, RowTable, ShiftedRowTable
from tiered.errors import CorruptionError
from tiered.schema import Schema
from tiered.testing.inspection import parts
from tiered.torchrl import TieredStorage
from tiered.verify import verify_store

OBS, NEXT = ("observation",), ("next", "observation")


def _rule_breaks(td: TensorDict, written: np.ndarray) -> np.ndarray:
    """Rows (of a ring) whose next stack is not the observation stack shifted by one frame, then
    the next row's newest frame: written rows where the data says so or whose next row is not
    written, and unwritten rows (they name no frame) whose next row is."""
    nxt, obs = td["next", "observation"], td["observation"]
    rule = torch.cat([obs[:, 1:], obs.roll(-1, 0)[:, -1:]], 1)
    after = np.roll(written, -1)
    bad = (nxt != rule).flatten(1).any(1).numpy() | ~after
    return np.flatnonzero(np.where(written, bad, after))


@pytest.fixture(scope="module")
def games(atari_pong, atari_mspacman) -> TensorDict:
    return concat_rollouts([atari_pong[300:1300], atari_mspacman[:1000]])


def test_a_replay_buffer_over_ring_laps_samples_exact_stacks_with_exact_reference_counts(games, tmp_path):
    """A TorchRL replay buffer over real Pong and MsPacman frames (truncations, game overs, a game
    switch), 2000 rows through a ring of 700 (almost three laps): every sampled stack is the
    data's, the exceptions are exactly the rows that break the rule, the reference counts equal
    a recount after every extend, and the committed store verifies."""
    cap = 700
    path = tmp_path / "s"
    storage = TieredStorage(cap, path, chunk_frames=8)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=64, sampler=RandomSampler())
    truth = games[:cap].clone()
    written = np.zeros(cap, dtype=bool)
    torch.manual_seed(0)
    for a in range(0, 2000, 130):
        chunk = games[a:a + 130]
        rb.extend(chunk)
        rows = torch.arange(a, a + chunk.shape[0]) % cap
        truth[rows] = chunk
        written[rows.numpy()] = True
        store = storage.store
        store.flush()  # staged rows into the tables
        check_refcounts(store)
        table = parts(store).layout.tables[NEXT]
        assert isinstance(table, NextRowTable) and table.exc_rows.tolist() == _rule_breaks(truth, written).tolist()
        for _ in range(3):
            sample, info = rb.sample(return_info=True)
            idx = torch.as_tensor(info["index"])
            assert torch.equal(sample["next", "observation"], truth["next", "observation"][idx])
            assert torch.equal(sample["observation"], truth["observation"][idx])
    store = storage.store
    truth = truth.exclude("index")  # the replay buffer's own key, written with each row
    assert_td_equal(store.get(torch.arange(cap)).exclude("index"), truth)
    table = parts(store).layout.tables[NEXT]
    assert 0 < table.exc_rows.size < 20  # episode ends, the game switch, the cursor
    assert store.stats()["memory"]["row_tables"] == (cap * 6 + parts(store).layout.tables[OBS].exc_rows.size * 26
                                                     + table.exc_rows.size * (8 + 4 * 6))
    index_of = {k: i for i, k in enumerate(store.schema)}
    storage.close()
    body = manifest_body(path)
    i = index_of[NEXT]
    assert body["format_version"] == FORMAT_VERSION == 1 and body["derived_tables"] == {str(i): index_of[OBS]}
    assert f"rows.{i}.blob" not in body["files"] and f"next.{i}.rows" in body["files"]
    assert verify_store(path, progress=False).ok
    assert main(["verify", str(path)]) == 0
    with tiered.open(path) as s:
        assert_td_equal(s.get(torch.arange(cap)).exclude("index"), truth)
        check_refcounts(s)
    with tiered.open(path, mode="r+") as s:  # a writer goes on where the cursor stands
        more = games[:300].clone()
        more["index"] = torch.zeros(300, dtype=torch.int64)
        s.extend(more)
        rows = torch.arange(2000, 2300) % cap
        truth[rows] = games[:300]
        assert_td_equal(s.get(torch.arange(cap)).exclude("index"), truth)
        check_refcounts(s)
        s.clear()
        assert parts(s).layout.tables[NEXT].exc_rows.size == 0
        check_refcounts(s)


def _corrupt_exception(path: Path, value: int) -> Path:
    """Set the first blob id of a next table's first exception to ``value``, with the page
    checksums of the damaged bytes (the content check must catch it)."""
    body = manifest_body(path)
    (i,) = body["derived_tables"]
    name = f"next.{i}.blob"
    f = path / "arrays" / f"{name}.{body['array_files'][name]}.npy"
    arr = np.load(f)
    arr[0, 0] = value
    np.save(f, arr)
    restamp(path)
    return f


def test_a_damaged_exception_entry_is_refused_at_open(tmp_path, atari_pong):
    path = tmp_path / "s"
    with TieredStore(1000, path, chunk_frames=8) as s:
        s.extend(atari_pong[:300])
        assert parts(s).layout.tables[NEXT].exc_rows.tolist() == [299, 999]
    _corrupt_exception(path, 10**9)
    with pytest.raises(CorruptionError, match="next/observation"):
        tiered.open(path)
    assert not verify_store(path, progress=False).ok


def _layout(cap: int, frames: int) -> FieldLayout:
    td = TensorDict({"observation": torch.zeros(1, frames, 2, 2, dtype=torch.uint8),
                     ("next", "observation"): torch.zeros(1, frames, 2, 2, dtype=torch.uint8)}, [1])
    layout = FieldLayout(Schema.infer(td, blob_min_bytes=1, frames={"observation": 0}), cap, chunk_frames=4,
                         dedup=True)
    assert isinstance(layout.tables[NEXT], NextRowTable) and layout.tables[OBS].shifted
    return layout


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 30), frames=st.integers(2, 4), data=st.data())
def test_random_puts_and_unsets_match_explicit_tables_with_exact_counts(cap, frames, data):
    """Writes through a layout (the write path's calls), as a stream of frames written in order
    around the ring (laps), in random order, or anything; reference counts kept as the write path
    keeps them (new entries counted, the written rows' old ones dropped) equal a recount."""
    layout = _layout(cap, frames)
    model = {OBS: RowTable(cap, frames), NEXT: RowTable(cap, frames)}
    written = np.zeros(cap, dtype=bool)
    counts = np.zeros(64, dtype=np.int64)
    cursor, t = 0, 0  # the ring's write position, the stream's frame counter
    for _ in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["extend", "extend", "random", "unset"]))
        if kind == "extend":  # rows at the cursor, around the ring, the stream going on
            n = data.draw(st.integers(1, cap))
            rows = (cursor + np.arange(n)) % cap
            cursor = int((cursor + n) % cap)
        else:
            rows = np.array(data.draw(st.lists(st.integers(0, cap - 1), unique=True, max_size=cap)), dtype=np.int64)
        if kind == "unset":
            old = layout.unset(rows[written[rows]])
            for ids in old:
                np.subtract.at(counts, ids[ids >= 0], 1)
            for m in model.values():
                m.unset(rows[written[rows]])
                m.slot[rows[written[rows]]] = 0
            written[rows] = False
        else:
            # frames t .. t + n + F: obs stack of row k = frames t+k .. t+k+F-1, next = shifted by one
            stream = t + np.arange(rows.size + frames + 1)
            if data.draw(st.booleans()):  # an episode end somewhere: another next frame there
                stream[data.draw(st.integers(frames, rows.size + frames))] += 1000
            win = np.lib.stride_tricks.sliding_window_view(stream, frames + 1)[:rows.size]
            obs, nxt = win[:, :-1] % 60, win[:, 1:] % 60
            if kind == "random" and data.draw(st.booleans()):
                nxt = (nxt + np.arange(rows.size)[:, None] % 3) % 60  # anything
            t += rows.size
            blob = np.concatenate([obs, nxt], 1)
            slot = np.array(data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=1)) * blob.size).reshape(blob.shape)
            old = layout.put_family(0, rows, blob, slot, written[rows])
            np.add.at(counts, blob.reshape(-1), 1)
            for ids in old:
                np.subtract.at(counts, ids[ids >= 0], 1)
            model[OBS].put(rows, obs, slot[:, :frames])
            model[NEXT].put(rows, nxt, slot[:, frames:])
            written[rows] = True
        for key, m in model.items():
            got = layout.tables[key].full()
            assert np.array_equal(got[0], m.blob) and np.array_equal(got[1][written], m.slot[written]), key
        recount = np.bincount(layout.ids(np.flatnonzero(written)).reshape(-1), minlength=64)
        assert np.array_equal(recount, counts)
        # a read of X and ("next", X) (one window of the shifted table for both), rows in any
        # order and repeated, equals the tables read one by one
        read = np.flatnonzero(written)
        read = np.concatenate([read, read[::-1]])
        fields = layout.fields_of[0]
        got = layout.blob_refs(fields, read)
        for k, want in enumerate((np.concatenate([model[f.key].blob[read] for f in fields], 1),
                                  np.concatenate([model[f.key].slot[read] for f in fields], 1))):
            assert got[k].dtype == np.int64 and np.array_equal(got[k], want)
        nxt_table = layout.tables[NEXT]
        if isinstance(nxt_table, NextRowTable):  # no row that follows the rule is kept as an exception
            rb, rs = nxt_table.rule(nxt_table.exc_rows)
            follow = ((rb == nxt_table.exc_blob) & (rs == nxt_table.exc_slot)).all(1)
            assert not follow.any()


def test_a_next_table_holds_the_row_before_each_write_and_lets_it_go_once_it_follows():
    """The row before the cursor is an exception after each extend, until the next extend writes
    its successor; the list does not grow with the number of extends."""
    base = ShiftedRowTable(100, 2)
    nxt = NextRowTable(base)
    frames = np.arange(200)
    for a in range(0, 100, 10):  # ten extends of ten rows, one trajectory
        rows = np.arange(a, a + 10)
        nxt.hold(rows)
        base.put(rows, np.stack([frames[rows], frames[rows + 1]], 1), np.zeros((10, 2)))
        nxt.put(rows, np.stack([frames[rows + 1], frames[rows + 2]], 1), np.zeros((10, 2)))
        # the row before the cursor, and the last row: unwritten (it names no frame) or, at the
        # end, its successor row 0 is not the next step
        assert nxt.exc_rows.tolist() == ([a + 9, 99] if a < 90 else [99])
    assert np.array_equal(nxt.full()[0][:99], np.stack([frames[1:100], frames[2:101]], 1))
    assert nxt.nbytes == 8 + 2 * 6
    crowded = NextRowTable(RowTable(10_000, 4))
    crowded.put(np.arange(0, 10_000, 2), np.full((5000, 4), 7), np.zeros((5000, 4)))
    assert crowded.exc_rows.size == 5000 and crowded.crowded  # more than max(4096, capacity / 32)
