"""A read-only open keeps what it reads whole (blob index, policy state, written mask) mapped from
the files its writer changes in place: every page is checked at open, and copied private and
checked again at its first use. It reads its commit's rows after the writer changed those pages
(rebuilt from the writer's before-images), finds a page damaged after the open when it uses it,
and holds as its own memory only the pages it used."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fork_child, wait_child
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.durable.array_files import INTENT, read_intent, read_intent_token, write_intent
from tiered.durable.manifest import PAGE_BYTES
from tiered.engine.blob_index import COLD, WARM
from tiered.errors import ChecksumError, CorruptionError, StaleReadError
from tiered.testing import parts

# one blob per frame (chunk_frames=1): the index spans several 1 MiB pages (loc: 24 B a blob, four
# pages; 8 B columns: two, the second holding the newest blobs, which the writer's tail pins)
N = 150_000


def _data(n: int, start: int) -> TensorDict:
    ids = torch.arange(start, start + n)[:, None] + torch.arange(4)
    obs = ((ids[:, :, None, None] * 7 + torch.arange(16)[:, None]) % 251).to(torch.uint8).expand(n, 4, 16, 16).clone()
    obs[:, :, 0, :4] = ids.to(torch.int32)[..., None].view(torch.uint8).reshape(n, 4, 4)  # every frame its own
    return TensorDict({"observation": obs, ("next", "observation"): obs,
                       "action": torch.arange(start, start + n)}, [n])


def _same(a: TensorDict, b: TensorDict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b.keys(True, True))


def _file(path: Path, name: str) -> Path:
    body = json.loads((path / "manifest.json").read_text())["body"]
    return path / "arrays" / f"{name}.{body['array_files'][name]}.npy"


@pytest.fixture
def writer(tmp_path) -> TieredStore:
    s = TieredStore(N, tmp_path / "s", frames={"observation": 0}, chunk_frames=1, hot_bytes=0, warm_bytes=0)
    for lo in range(0, N, 50_000):
        s.extend(_data(50_000, lo))
    s.flush()
    yield s
    s.close()


def test_an_open_copies_no_page_of_what_it_reads_whole(writer):
    with tiered.open(writer.path, warm_bytes=0, hot_bytes=0) as reader:
        pages = parts(reader).files.whole_pages
        assert {"index.loc", "index.checksum", "written"} <= set(pages)
        assert pages["index.loc"].checked.size >= 4
        # private: at most the pages of the few ids the open itself writes (the writer's tail pins)
        assert all(int(p.checked.sum()) <= 2 for p in pages.values()), {n: int(p.checked.sum()) for n, p in pages.items()}
        # taking the tail pins off the counts copies the counts' pages of the pins, no other column's
        owned = {n for n, p in pages.items() if p.checked.any()}
        assert owned <= {"index.refcount", "index.loc"}, owned
        first = torch.arange(1000)
        assert _same(reader.get(first), writer.get(first))
        assert pages["index.loc"].checked[0] and not pages["index.loc"].checked[1:-1].any()  # used: copied
        assert pages["written"].checked[0]  # the mask's page of the rows read


def test_a_reader_reads_its_commit_after_the_writer_changed_its_index_pages(writer):
    path = Path(writer.path)
    reader = tiered.open(path, warm_bytes=0, hot_bytes=0)
    expect = writer.get(torch.arange(N))
    files = {name: _file(path, name) for name in ("index.loc", "index.checksum", "index.refcount", "written")}
    before = {name: f.read_bytes() for name, f in files.items()}
    writer.set(torch.arange(0, N, 2), _data(N // 2, 10 * N))  # frees half the blobs; new ones reuse their ids
    writer.flush()
    for name, f in files.items():  # changed in place: the same files, other bytes
        assert _file(path, name) == f, name
        if name != "written":
            assert f.read_bytes() != before[name], name
    assert _same(reader.get(torch.arange(N)), expect)  # its commit's rows: pages rebuilt from the before-images
    reader.close()
    with tiered.open(path) as again:
        assert _same(again.get(torch.arange(N)), writer.get(torch.arange(N)))


@pytest.mark.parametrize("name", ["index.loc", "index.checksum", "policy.lru.last_access"])
def test_an_index_page_damaged_after_the_open_is_found_when_used(writer, name):
    path = Path(writer.path)
    writer_rows = writer.get(torch.arange(N - 1000, N))
    writer.close()
    reader = tiered.open(path, warm_bytes=0, hot_bytes=0)
    f = _file(path, name)
    assert f.stat().st_size > PAGE_BYTES
    with open(f, "r+b") as fh:  # another program damages the first page (the oldest blobs) after the open
        fh.seek(PAGE_BYTES // 2)
        old = fh.read(1)
        fh.seek(PAGE_BYTES // 2)
        fh.write(bytes([old[0] ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())
    last = torch.arange(N - 1000, N)
    assert _same(reader.get(last), writer_rows)  # the newest blobs' pages: still its commit's
    with pytest.raises(ChecksumError, match=f"{name}.*damaged"):
        reader.get(torch.arange(1000))
    assert _same(reader.get(last), writer_rows)
    reader.close()
    if name == "index.checksum":  # read by no check of an open: found at its first use
        with tiered.open(path) as again, pytest.raises(ChecksumError, match=f"{name}.*damaged"):
            again.get(torch.arange(1000))
    else:
        with pytest.raises(CorruptionError, match=name):  # found by the next open's check of every page
            tiered.open(path)


def test_stats_of_a_reader_after_the_writer_moved_are_its_commits(writer):
    reader = tiered.open(writer.path, warm_bytes=0, hot_bytes=0)
    expect = reader.stats()
    writer.set(torch.arange(0, N, 2), _data(N // 2, 10 * N))
    writer.flush()
    again = reader.stats()
    assert again["fields"] == expect["fields"]
    assert all(p.done for p in parts(reader).files.whole_pages.values())  # every page used: its own now
    reader.close()


def _version(v: int, n: int) -> TensorDict:
    td = _data(n, 1_000 * v)
    td["action"] = torch.full((n,), v)
    return td


def test_opens_racing_a_writers_commits_each_read_one_commit(tmp_path):
    """A writer process commits new versions of every row as fast as it can while this one opens
    the store read-only again and again: an open that a commit overlaps opens again (with
    private copies), so every open reads exactly one version, or says to reopen."""
    path, n = tmp_path / "s", 3_000
    with TieredStore(n, path, frames={"observation": 0}, chunk_frames=1, hot_bytes=0, warm_bytes=0) as s:
        s.extend(_version(0, n))
    stop_r, stop_w = os.pipe()
    os.set_blocking(stop_r, False)

    def commits() -> None:
        with tiered.open(path, mode="r+", hot_bytes=0, warm_bytes=0) as w:
            for v in range(1, 10_000):
                w.set(torch.arange(n), _version(v, n))
                w.flush()
                try:
                    if os.read(stop_r, 1):
                        return
                except BlockingIOError:
                    pass

    pid = fork_child(commits)
    outcomes: dict[str, int] = {}
    try:
        for _ in range(40):
            try:
                with tiered.open(path, hot_bytes=0, warm_bytes=0) as r:
                    got = r.get(torch.arange(n))
                v = int(got["action"][0])
                outcomes["one version"] = outcomes.get("one version", 0) + 1
                assert _same(got, _version(v, n)), f"rows of no single commit (version {v})"
            except StaleReadError as e:
                assert "reopen" in str(e)
                outcomes["stale"] = outcomes.get("stale", 0) + 1
    finally:
        os.write(stop_w, b"s")
        assert wait_child(pid) == ("exited", 0)
    assert outcomes.get("one version", 0) > 0, outcomes


def test_an_intent_written_again_for_the_same_generation_is_another_token(tmp_path):
    """A commit that rolled back sets the intent back to the generation it had: readers still tell
    that the files may have changed meanwhile, by the count of intents written."""
    store = str(tmp_path)
    assert read_intent_token(store) is None
    write_intent(store, 5)
    first = read_intent_token(store)
    write_intent(store, 6)
    write_intent(store, 5)  # the roll-back of commit 6
    again = read_intent_token(store)
    assert first[0] == again[0] == read_intent(store) == 5 and again != first
    with open(tmp_path / INTENT, "r+b") as f:  # cut short: not what write_intent writes
        f.truncate(16)
    assert read_intent_token(store) is None
    write_intent(store, 7)
    assert read_intent_token(store) == (7, 1)


def test_a_reader_forgets_the_writers_memory_tiers_page_by_page(tmp_path):
    path = tmp_path / "s"
    with TieredStore(N, path, frames={"observation": 0}, chunk_frames=1, hot_bytes=0) as s:  # a warm cache
        s.extend(_data(N, 0))
        expect = s.get(torch.arange(N))
    loc = np.load(_file(path, "index.loc"), mmap_mode="r")
    held = np.flatnonzero(loc[:, WARM] >= 0)  # the writer's warm cache, as its last commit saved it
    assert held.size and np.unique(held * loc.itemsize * 3 // PAGE_BYTES).size >= 2
    with tiered.open(path, warm_bytes=0, hot_bytes=0) as reader:
        p = parts(reader)
        pages = p.files.whole_pages["index.loc"]
        assert not pages.checked.any()  # the open wrote none of them
        first = torch.arange(1000)
        assert _same(reader.get(first), expect[:1000])
        used = np.flatnonzero(pages.checked)
        assert 0 < used.size < pages.checked.size
        size = p.index.size
        # the entries wholly in pages it owns are forgotten; the others still the file's
        starts = pages.offset + np.arange(size) * pages.row_bytes
        owned = np.flatnonzero(pages.checked[starts // PAGE_BYTES]
                               & pages.checked[(starts + pages.row_bytes - 1) // PAGE_BYTES])
        assert (p.index.loc[owned, :WARM + 1] == -1).all()
        p.index.check_ids(None)  # every page its own: every entry forgotten, the cold ones kept
        assert (p.index.loc[:size, :WARM + 1] == -1).all()
        assert np.array_equal(p.index.loc[:size, COLD], loc[:size, COLD])
        assert _same(reader.get(torch.arange(N)), expect)


def test_stats_of_a_reader_give_back_the_index_pages_they_used(tmp_path):
    path = tmp_path / "s"
    with TieredStore(N, path, frames={"observation": 0}, chunk_frames=1, hot_bytes=0) as s:  # a warm cache
        s.extend(_data(N, 0))
        s.flush()
        expect, rows = s.stats(), s.get(torch.arange(N))
        assert expect["tiers"]["warm"]["blobs"] > 0
    with tiered.open(path, hot_bytes=0) as reader:
        p = parts(reader)
        pages = p.files.whole_pages
        owned = {n: int(pg.checked.sum()) for n, pg in pages.items()}
        got = reader.stats()
        assert got["fields"] == expect["fields"] and got["blobs"] == expect["blobs"]
        # the writer's warm cache is not the reader's: it has cached nothing yet
        assert got["tiers"]["warm"]["blobs"] == 0 and got["tiers"]["cold"]["blobs"] == expect["tiers"]["cold"]["blobs"]
        # every index page was checked for the figures and given back: what the open owned, no more
        assert {n: int(pg.checked.sum()) for n, pg in pages.items()} == owned
        assert not pages["written"].checked.any()  # no priorities: the figures do not read the mask
        assert _same(reader.get(torch.arange(N)), rows)  # pages given back are checked again at their use
        again = reader.stats()  # its warm tier now holds what the reads cached
        assert again["fields"] == got["fields"] and again["tiers"]["warm"]["blobs"] > 0
