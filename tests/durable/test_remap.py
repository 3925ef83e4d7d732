"""After a commit, a writer's per-row arrays are mapped back from the copy files it wrote.

The per-row arrays of a new store (row tables, dense columns, the written mask) are laid out in
memory as their ``.npy`` files (:mod:`tiered.util.filemap`); once a commit is published, the pages
it wrote are mapped from the copy file just written, so they stop being anonymous memory. These
tests check, with real files, that this never changes a byte anyone reads: across commits that
wrap the three rotating copies, through writes after the remap, a failed commit, a read-only
store opened beside the writer, and a table replaced by one of another layout.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _commit_check import commits_unchecked
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.durable.array_files import array_file, read_intent
from tiered.errors import StorageFullError
from tiered.testing import faults
from tiered.testing.inspection import parts
from tiered.util import filemap

pytestmark = pytest.mark.skipif(not filemap.supported(), reason="remapping needs Linux mmap(MAP_FIXED)")

STACK = 4  # frames of 16 x 16: a stack of 1 KiB, a blob field


def frames(k: np.ndarray) -> np.ndarray:
    """A distinct 16x16 uint8 frame per integer ``k``."""
    k = np.asarray(k, dtype=np.int64)
    out = ((k[:, None, None] + np.arange(16)[:, None] * 7 + np.arange(16) * 13) % 251).astype(np.uint8)
    out[:, 0, :4] = k.astype("<u4").view(np.uint8).reshape(-1, 4)
    return out


def batch(start: int, n: int, salt: int = 0, shuffled: bool = False, state: bool = True) -> TensorDict:
    """``n`` transitions of a trajectory whose frame ``t`` is ``frames(t)`` (stacks of 4 frames,
    consecutive rows sharing 3 of them); ``shuffled`` stacks share nothing (they break the
    shifted-table rule, so the tables turn explicit). ``state``: a dense float32[64] field too
    (256 B a row: a column of several 1 MiB pages in a small store)."""
    k = np.arange(start, start + n, dtype=np.int64) + salt * 100_000_000
    step = 1000 if shuffled else 1
    obs = np.stack([frames(k * step + j) for j in range(STACK)], 1)
    nxt = np.stack([frames(k * step + j + 1) for j in range(STACK)], 1)
    td = TensorDict({
        "observation": torch.from_numpy(obs),
        "action": torch.from_numpy(k % 6),
        "next": {"observation": torch.from_numpy(nxt),
                 "reward": torch.from_numpy((k % 1000).astype(np.float32) * 0.5),
                 "done": torch.from_numpy(k % 97 == 96)[:, None]},
    }, [n])
    if state:
        td["state"] = torch.from_numpy((k[:, None] * 64 + np.arange(64)).astype(np.float32))
    return td


def new_store(path: str, capacity: int) -> TieredStore:
    return TieredStore(capacity, path, frames={"observation": 0}, hot_bytes=0, warm_bytes=0, chunk_frames=16)


def committed_store(tmp_path, capacity: int) -> tuple[TieredStore, Model]:
    """A new store with every row written and committed once, and its model."""
    store = new_store(str(tmp_path / "s"), capacity)
    model = Model(capacity)
    write(store, model, np.arange(capacity), batch(0, capacity))
    store.flush()
    return store, model


class Model:
    """What every row of the store must read back: a plain copy of each written row."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: dict[int, TensorDict] = {}
        self.data: TensorDict | None = None

    def put(self, rows: np.ndarray, td: TensorDict) -> None:
        if self.data is None:
            self.data = td[:1].expand(self.capacity).clone()
        self.data[torch.from_numpy(rows)] = td
        self.rows.update(dict.fromkeys(rows.tolist()))

    def check(self, store: TieredStore) -> None:
        rows = np.array(sorted(self.rows), dtype=np.int64)
        got = store.get(rows)
        want = self.data[torch.from_numpy(rows)]
        for key in want.keys(True, True):
            assert torch.equal(got[key], want[key]), key


def write(store: TieredStore, model: Model, rows: np.ndarray, td: TensorDict) -> None:
    store.set(rows, td)
    model.put(rows, td)


def per_row_arrays(store: TieredStore) -> dict[str, np.ndarray]:
    """Copies of the per-row arrays a commit saves (row tables, dense columns, written mask)."""
    p = parts(store)
    out = {"written": p.rows.written.copy()}
    for key, table in p.layout.tables.items():
        for suffix, arr in table.state_arrays().items():
            if arr.shape[:1] == (store.capacity,):
                out[f"{key}.{suffix}"] = arr.copy()
    for key in p.rows.dense:
        out[f"dense.{key}"] = p.rows.dense_array(key).copy()
    if p.rows.flags is not None:
        out["flags"] = p.rows.flags_array().copy()
    return out


def mapped_files(store_path: str) -> set[str]:
    """The array copy files this process has pages mapped from (``/proc/self/maps``)."""
    adir = os.path.join(os.path.realpath(store_path), "arrays") + os.sep
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f
                if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith(adir)}


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def assert_same(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert np.array_equal(before[name], after[name]), name


def test_values_survive_commits_that_wrap_the_copies(tmp_path):
    """Six commits (each array's three copies written twice over), each followed by writes into
    pages the previous commit mapped back: every value read equals the model's, before and
    after each commit, and the per-row arrays are byte for byte what they were before it."""
    cap = 16_000
    store = new_store(str(tmp_path / "s"), cap)
    model = Model(cap)
    rng = np.random.default_rng(0)
    write(store, model, np.arange(12_000), batch(0, 12_000))
    first = store.generation
    for g in range(6):
        before = per_row_arrays(store)
        store.flush()
        assert_same(before, per_row_arrays(store))
        assert store.generation == first + g + 1
        model.check(store)
        assert any(f.endswith(".npy") for f in mapped_files(store.path))  # pages now follow the files
        # overwrite rows spread over the mapped pages (copy-on-write), and a run at the ring's end
        rows = np.unique(rng.integers(0, 12_000, 1_000))
        write(store, model, rows, batch(200_000 + g * 10_000, rows.size, salt=g + 1))
        run = np.arange(12_000 + g * 500, 12_500 + g * 500)
        write(store, model, run, batch(int(run[0]), run.size))
        model.check(store)
    store.close()
    with tiered.open(str(tmp_path / "s")) as ro:
        model.check(ro)


def test_a_mapped_page_is_rewritten_only_with_its_own_bytes(tmp_path):
    """A page mapped clean from an array's file stays mapped while later commits change other
    pages of the file in place: its bytes never change, and the file keeps holding them. A
    commit that fails after changing pages in place writes their before-images back, the
    writer's mapped pages made anonymous first: memory keeps the new values, the next commit
    writes them.

    Why (StoreFiles.map_back): only the writer writes the file of an array, only from that array,
    so it writes a page mapped from the file from that very page: the same bytes.
    """
    cap = 16_000
    store, model = committed_store(tmp_path, cap)
    files = parts(store).files
    layout = filemap.layout_of(parts(store).rows.dense_array(("state",)))
    state = next(name for name, mapped in files.mapped.items() if mapped is layout)
    f = files.array_files[state].file
    assert layout.size > 3 * (1 << 20) and layout.source[0] == 0
    first = per_row_arrays(store)
    # rows in the column's last page only: its first page is never written again
    for g in range(3):
        write(store, model, np.arange(15_000 + g * 100, 15_100 + g * 100), batch(500_000 + g * 100, 100, salt=9))
        store.flush()
        assert layout.source[0] == 0
    assert files.array_files[state].file == f  # the same file, changed in place
    disk = np.load(array_file(store.path, state, f))
    assert np.array_equal(disk, parts(store).rows.dense_array(("state",)))
    for at in range(120, 0, -1):  # the first write count that fails a commit is its last write
        write(store, model, np.arange(15_600 + at, 15_610 + at), batch(800_000 + at * 10, 10, salt=3))
        published, g = np.load(array_file(store.path, state, f)), store.generation
        try:
            with faults.inject_faults(eio_on=at):  # one write fails (a full disk would fail the roll-back too)
                store.flush()
        except OSError:
            break
    assert store.generation == g and read_intent(store.path) == g  # rolled back after its intent
    assert np.array_equal(np.load(array_file(store.path, state, f)), published)
    assert layout.source[0] == -1  # made anonymous before the roll-back wrote the file
    model.check(store)
    store.flush()
    assert files.array_files[state].file == f
    model.check(store)
    now = per_row_arrays(store)
    for name in first:
        assert np.array_equal(first[name][:14_000], now[name][:14_000]), name
    store.close()
    with tiered.open(str(tmp_path / "s")) as ro:
        model.check(ro)


def test_writes_after_the_remap_stay_private_until_committed(tmp_path):
    """A write into a page mapped from the published copy changes memory, not the file; the next
    commit saves it."""
    cap = 12_000
    store, model = committed_store(tmp_path, cap)
    files = parts(store).files
    published = array_file(store.path, "written", files.array_files["written"].file)
    dense = sorted(n for n in files.array_files if n.startswith("dense."))[0]
    published_dense = array_file(store.path, dense, files.array_files[dense].file)
    on_disk = np.load(published_dense).copy()
    write(store, model, np.array([5, 6, 7]), batch(900_000, 3, salt=4))
    store.set_length(cap)
    model.check(store)
    assert np.array_equal(np.load(published_dense), on_disk)  # the file did not follow the write
    assert np.load(published).all()
    store.flush()
    model.check(store)
    store.close()
    with tiered.open(str(tmp_path / "s")) as ro:
        model.check(ro)


def test_a_failed_commit_leaves_the_arrays_and_the_next_commit_works(tmp_path):
    """Commits that run out of space at different points (at the first write, amid the copies)
    change no array in memory, map nothing back, and the next commit lands."""
    cap = 12_000
    store, model = committed_store(tmp_path, cap)
    write(store, model, np.arange(10_000, 10_300), batch(200_000, 300, salt=8))
    with faults.inject_faults() as counting:  # the write calls of a commit like the ones below
        store.flush()
    n = counting.ops
    assert n > 4
    for i, at in enumerate((1, n // 3, n // 2)):  # within each commit below: they write fewer runs
        write(store, model, np.arange(i * 1000, i * 1000 + 300), batch(300_000 + i * 1000, 300, salt=i + 1))
        before, mapped = per_row_arrays(store), set(mapped_files(store.path))
        g = store.generation
        with faults.inject_faults(enospc_on=at), pytest.raises(StorageFullError):
            store.flush()
        assert store.generation == g
        assert_same(before, per_row_arrays(store))
        assert mapped_files(store.path) <= mapped  # nothing new mapped by a failed commit
        model.check(store)
        store.flush()
        assert store.generation == g + 1
        assert_same(before, per_row_arrays(store))
        model.check(store)
    store.close()
    with tiered.open(str(tmp_path / "s")) as ro:
        model.check(ro)


def test_a_read_only_store_beside_the_writer_reads_its_commit(tmp_path):
    """A store opened read-only after each commit reads that commit while the writer goes on
    writing (into pages it mapped back) and commits once more."""
    cap = 12_000
    path = str(tmp_path / "s")
    store = new_store(path, cap)
    model = Model(cap)
    write(store, model, np.arange(cap), batch(0, cap))
    for g in range(5):
        store.flush()
        ro = tiered.open(path)
        want = Model(cap)
        want.data, want.rows = model.data.clone(), dict(model.rows)
        want.check(ro)
        write(store, model, np.arange(g * 2000, g * 2000 + 1000), batch(400_000 + g * 2000, 1000, salt=g + 1))
        want.check(ro)
        store.flush()
        want.check(ro)  # one commit on: its copies are intact
        ro.close()
        model.check(store)
    store.close()


def test_a_replaced_table_gets_its_pages_back_before_its_copies_change(tmp_path):
    """A shifted table whose rows stop following the rule is replaced by an explicit one, of
    another size: before its copies are rewritten (grown), the old table's mapped pages are
    copied back to memory, so a view of it keeps its bytes and is no longer file-mapped."""
    cap = 12_000
    store, model = committed_store(tmp_path, cap)
    key = next(k for k, t in parts(store).layout.tables.items() if t.shifted)
    old = parts(store).layout.tables[key]
    view = old.state_arrays()["blob"]
    layout = filemap.layout_of(view)
    assert layout is not None and (layout.source >= 0).any()
    write(store, model, np.arange(6000), batch(0, 6000, salt=7, shuffled=True))
    assert not parts(store).layout.tables[key].shifted  # explicit now
    kept = view.copy()  # what the old table held when it was replaced
    for _ in range(4):  # the table's file replaced with the explicit layout, then written again
        store.flush(force=True)
    assert layout.alive and not (layout.source >= 0).any()
    assert np.array_equal(view, kept)
    model.check(store)
    store.close()
    with tiered.open(str(tmp_path / "s")) as ro:
        model.check(ro)


def test_anonymous_memory_drops_after_a_commit(tmp_path, monkeypatch):
    """200k rows of stacked observations: the commit maps the per-row arrays back from their
    files, and the process's anonymous memory drops by most of their size."""
    cap = 200_000
    store = new_store(str(tmp_path / "s"), cap)
    for lo in range(0, cap, 50_000):
        store.extend(batch(lo, 50_000, state=False))
    arrays = per_row_arrays(store)
    size = sum(a.nbytes for a in arrays.values())
    assert size > 200_000 * 10  # the tables, the dense columns and the mask: 20 bytes a row
    del arrays
    with commits_unchecked():  # its check reads every array file into memory
        before = rss_anon()
        store.flush()
        after = rss_anon()
    assert before - after > size // 2, (before, after, size)
    store.get(np.arange(0, cap, 1000))  # still readable
    store.close()


def test_a_store_opened_for_writing_maps_back_what_it_commits(tmp_path, monkeypatch):
    """A store opened with mode="r+" has its per-row arrays mapped from the copies it opened;
    rows it overwrites become private memory, and its commit maps them back from the copies it
    wrote: the anonymous memory drops, and every value reads as before the commit."""
    cap = 50_000
    path = str(tmp_path / "s")
    with new_store(path, cap) as store:
        store.extend(batch(0, cap))
    store = tiered.open(path, mode="r+")
    model = Model(cap)
    write(store, model, np.arange(cap), batch(0, cap, salt=5))  # every page of the arrays private
    size = sum(a.nbytes for a in per_row_arrays(store).values())
    assert size > cap * 256
    with commits_unchecked():  # its check reads every array file into memory
        before = rss_anon()
        store.flush()
        after = rss_anon()
    assert before - after > size // 2, (before, after, size)
    files = parts(store).files
    assert {os.path.basename(array_file(path, n, files.array_files[n].file)) for n in files.mapped} <= {
        os.path.basename(f) for f in mapped_files(path)}
    model.check(store)
    write(store, model, np.arange(100), batch(0, 100, salt=6))
    store.flush()
    model.check(store)
    store.close()
    with tiered.open(path) as ro:
        model.check(ro)
