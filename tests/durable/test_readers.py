"""Readers never see silently wrong rows (issue 33, items 1-4): a process forked from a writer, a
stale read-only open, a view of a shared or read-only store, and a writer whose files another
program changes each read the commit they started from bit-exact, or raise the error that says
to reopen (``StaleReadError``, ``CorruptionError``): never rows of another commit, never a raw
exception, never a signal."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered.durable.array_files import ARRAYS_DIR, read_intent
from tiered.durable.manifest import read_manifest
from tiered.errors import CorruptionError, NotSharedError, StaleReadError
from tiered.verify import verify_store

CAP = 4_096


def batch(n: int, seed: int, *, blobs: bool = True) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    fields = {"reward": torch.randn(n, generator=g), "action": torch.randint(0, 1 << 30, (n,), generator=g),
              "done": torch.rand(n, generator=g) < 0.1}
    if blobs:
        fields["observation"] = torch.randint(0, 255, (n, 32, 40), dtype=torch.uint8, generator=g)
    return TensorDict(fields, [n])


def same(a: TensorDict, b: TensorDict) -> bool:
    return set(a.keys()) == set(b.keys()) and all(torch.equal(a[k], b[k]) for k in a.keys())


def writer_commits(store: tiered.TieredStore, commits: int, seed: int, rows: int = 700, *,
                   blobs: bool = True) -> None:
    """Commits that overwrite rows (freeing blobs), with a varying number of rows each, so the
    free lists and exception lists grow and shrink between commits."""
    for k in range(commits):
        n = min(rows + 97 * ((seed + k) % 5) - 150, CAP)
        store.extend(batch(n, seed * 100 + k, blobs=blobs))
        store.flush()


def _child_reads(store: tiered.TieredStore, expect: TensorDict, go, done, blobs: bool) -> None:
    torch.set_num_threads(1)  # forked: PyTorch's OpenMP threads do not survive a fork
    go.wait()
    outcome = "exact"
    try:
        for lo in range(0, CAP, 512):  # slices and random rows
            if not same(store.get(slice(lo, lo + 512)), expect[lo:lo + 512]):
                outcome = "wrong"
        idx = torch.randperm(CAP, generator=torch.Generator().manual_seed(1))[:1000]
        if not same(store.get(idx), expect[idx]):
            outcome = "wrong"
        if not blobs and not same(store.get(slice(0, CAP), copy=False), expect):
            outcome = "wrong view"
    except StaleReadError:
        outcome = "stale"
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        outcome = f"raw {type(e).__name__}: {e}"
    done.put(outcome)


@pytest.mark.parametrize("blobs", [False, True], ids=["dense", "blobs"])
@pytest.mark.parametrize("reopened", [False, True], ids=["created", "reopened"])
def test_forked_child_of_a_writer_reads_the_fork_time_rows(tmp_path, blobs, reopened):
    store = tiered.TieredStore(CAP, str(tmp_path / "s"), stage_rows=0)
    for k in range(3):  # dense columns only: no blob space to reuse, every read must be exact
        store.extend(batch(CAP, k, blobs=blobs))
        store.flush()
    if reopened:  # the arrays of an r+ open are mapped from the copy files it opened
        p = store.path
        store.close()
        store = tiered.open(p, mode="r+")
    expect = store.get(slice(0, CAP))
    ctx = mp.get_context("fork")
    go, done = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child_reads, args=(store, expect, go, done, blobs))
    child.start()
    writer_commits(store, 4, 3, blobs=blobs)  # each commit rewrites copy files in place; the fourth reuses blob space
    go.set()
    outcome = done.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    store.close()
    if blobs:
        assert outcome in ("exact", "stale"), outcome
    else:
        assert outcome == "exact", outcome


def _child_commits(store: tiered.TieredStore, done) -> None:
    torch.set_num_threads(1)
    try:
        store.extend(batch(10, 5, blobs=False))
        store.flush()
        done.put("committed")
    except NotSharedError:
        done.put("refused")
    except BaseException as e:  # noqa: BLE001
        done.put(f"raw {type(e).__name__}")


def test_forked_child_of_a_writer_cannot_commit(tmp_path):
    store = tiered.TieredStore(64, str(tmp_path / "s"))
    store.extend(batch(20, 0, blobs=False))
    store.flush()
    g = store.generation
    ctx = mp.get_context("fork")
    done = ctx.Queue()
    child = ctx.Process(target=_child_commits, args=(store, done))
    child.start()
    assert done.get(timeout=60) == "refused"
    child.join(timeout=60)
    assert tiered.open(store.path).generation == g  # the child's close wrote nothing either
    store.extend(batch(5, 1, blobs=False))
    store.close()  # the parent still holds its lock and commits
    assert len(tiered.open(store.path)) == 25


#: rows per commit: one large overwrite frees many blobs, the small ones after it reuse their ids
#: and space, so the free lists and the deferred-space lists grow, then shrink
SIZES = [3000, 100, 100, 100]


@pytest.mark.parametrize("commits", [1, 2, 3, 4])
@pytest.mark.parametrize("verify", [True, False])
def test_stale_read_only_reader_reads_its_commit_or_says_reopen(tmp_path, commits, verify):
    writer = tiered.TieredStore(CAP, str(tmp_path / "s"), stage_rows=0)
    for k in range(5):
        writer.extend(batch(SIZES[k % 4], k))
        writer.flush()
    reader = tiered.open(writer.path, verify=verify)
    opened = read_manifest(writer.path)["files"]
    expect = reader.get(slice(0, len(reader)))
    view = reader.get(slice(0, len(reader)), keys=["reward", "action"], copy=False)
    kept = view.clone()
    shrank = False
    for k in range(5, 5 + commits):
        writer.extend(batch(SIZES[k % 4], k))
        writer.flush()
        now = read_manifest(writer.path)["files"]
        shrank |= any(now[n] < size for n, size in opened.items() if n in now)
    assert shrank or commits < 2  # arrays of the reader's commit shrank (copies replaced, not cut)
    outcomes = set()
    for rows in (slice(0, len(expect)), torch.arange(len(expect)).flip(0), slice(100, 600)):
        try:
            got = reader.get(rows)
            outcomes.add("exact" if same(got, expect[rows]) else "wrong")
        except StaleReadError as e:
            assert "reopen" in str(e)
            outcomes.add("stale")
    assert "wrong" not in outcomes
    if commits < 2:  # neither array copies nor blob space of the reader's commit were reused yet
        assert outcomes == {"exact"}
    assert same(view, kept)  # a read-only store hands out copies: its rows stay its commit's
    reader.close()
    again = tiered.open(writer.path)  # reopened: the latest commit
    assert same(again.get(slice(0, len(again))), writer.get(slice(0, len(writer))))
    writer.close()


def test_views_of_a_shared_store_keep_their_rows(tmp_path):
    a = tiered.TieredStore(CAP, str(tmp_path / "s")).share()
    a.extend(batch(1000, 0, blobs=False))
    b = tiered.open(a.path, mode="r+", shared=True)
    b.extend(batch(10, 1, blobs=False))  # a reloads this commit: its columns are mapped from its files
    view = a.get(slice(0, 1000), copy=False)
    kept = view.clone()
    for k in range(4):  # four commits of another writer rewrite every copy file at least once
        b.set(slice(0, 1000), batch(1000, 10 + k, blobs=False))
    assert same(view, kept)  # neither changed under the holder...
    view["reward"][:] = 0.0
    assert torch.equal(a.get(slice(0, 1000))["reward"], batch(1000, 13, blobs=False)["reward"])  # ...nor written
    a.close()
    b.close()


# -- outside changes to the current metadata files of an open writer ---------------------------

KINDS = ["dense.", "rows.", "index.state", "flags", "written"]


def current_file(path: str, prefix: str) -> str:
    body = read_manifest(path)
    name = next(n for n in body["array_files"] if n.startswith(prefix))
    return os.path.join(path, ARRAYS_DIR, f"{name}.{body['array_files'][name]}.npy")


@pytest.mark.parametrize("kind", KINDS)
def test_outside_rewrite_is_never_laundered_into_a_commit(tmp_path, kind):
    store = tiered.TieredStore(CAP, str(tmp_path / "s"), stage_rows=0)
    writer_commits(store, 3, 0, rows=CAP)
    store.get(slice(0, CAP))  # every page checked and trusted from here on
    f = current_file(store.path, kind)
    with open(f, "r+b") as fh:  # another program flips bytes of the copy the writer maps
        fh.seek(os.path.getsize(f) - 8)
        old = fh.read(8)
        fh.seek(os.path.getsize(f) - 8)
        fh.write(bytes(b ^ 0x5A for b in old))
    g = store.generation
    store.extend(batch(10, 99))
    with pytest.raises(CorruptionError, match="another program changed"):
        store.flush()
    assert read_manifest(store.path)["generation"] == g  # nothing was committed
    report = verify_store(store.path, progress=False)
    assert not report.ok  # the altered bytes still fail their checksums: not laundered


TRUNCATE = textwrap.dedent("""
    import os, sys, torch, tiered
    from tensordict import TensorDict
    sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]  # this module, and the helpers it imports
    from test_readers import batch, writer_commits, current_file, CAP
    store = tiered.TieredStore(CAP, {path!r}, stage_rows=0)
    writer_commits(store, 3, 0, rows=CAP)
    f = current_file(store.path, {kind!r})
    size = os.path.getsize(f)
    os.truncate(f, max(size - 8192, size // 2))  # another program cuts the end of a copy the writer maps
    store.cursor = 0
    store.extend(batch(10, 99))  # rows in the pages left (writing a cut page would be SIGBUS, see the docs)
    try:
        store.flush()
        print("committed")
    except tiered.errors.CorruptionError as e:
        print("refused" if "another program changed" in str(e) else "other corruption")
    """)


@pytest.mark.parametrize("kind", KINDS)
def test_outside_truncation_is_refused_before_the_commit_reads_mapped_pages(tmp_path, kind):
    code = TRUNCATE.format(tests=os.path.dirname(os.path.abspath(__file__)), path=str(tmp_path / "s"), kind=kind)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # no SIGBUS
    assert run.stdout.strip() == "refused"


def test_a_resized_array_goes_to_a_new_file_not_cut_under_its_readers(tmp_path):
    from tiered.durable.array_files import plan_in_place, write_new
    p = str(tmp_path / "x.1.npy")
    big = np.arange(100_000, dtype=np.int64)
    first = write_new(p, big, 1)
    mapped = np.load(p, mmap_mode="r")  # a reader maps the file
    assert plan_in_place(p, big[:10], None, first) is None  # a shorter array: not in place
    write_new(str(tmp_path / "x.2.npy"), big[:10], 2)
    assert int(mapped[-1]) == 99_999  # the reader's file is untouched (a truncation would be SIGBUS here)
    assert np.load(str(tmp_path / "x.2.npy")).tolist() == list(range(10))


def _worker_samples(rb, expect: TensorDict, go, done) -> None:
    torch.set_num_threads(1)  # as DataLoader workers do
    go.wait()
    outcome = "exact"
    try:
        for k in range(20):
            idx = torch.randint(0, CAP, (256,), generator=torch.Generator().manual_seed(k))
            if not same(rb.storage.get(idx), expect[idx]):
                outcome = "wrong"
    except StaleReadError:
        outcome = "stale"
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        outcome = f"raw {type(e).__name__}: {e}"
    done.put(outcome)


def test_dataloader_style_workers_of_an_unshared_storage(tmp_path):
    """The pattern docs/torchrl.md documents: ``TieredStorage(..., shared=False)`` with readers
    forked from the training process, which goes on writing and committing."""
    from torchrl.data import TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage
    rb = TensorDictReplayBuffer(storage=TieredStorage(CAP, path=tmp_path / "rb", shared=False, warm_bytes=0))
    for k in range(3):
        rb.extend(batch(CAP, k))
        rb.storage.flush()
    expect = rb.storage.get(torch.arange(CAP))
    ctx = mp.get_context("fork")
    go, done = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_worker_samples, args=(rb, expect, go, done)) for _ in range(2)]
    for w in workers:
        w.start()
    for k in range(4):  # the trainer goes on: commits that rewrite copies and reuse blob space
        rb.extend(batch(1500, 20 + k))
        rb.storage.flush()
    go.set()
    outcomes = [done.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert set(outcomes) <= {"exact", "stale"}, outcomes
    rb.storage.close()


@pytest.mark.parametrize("step", ["undo.", "manifest.json"])
def test_info_while_a_commit_is_under_way_reports_the_last_commit(tmp_path, capsys, step):
    """``tiered info`` run while a writer commits (the fault seam runs it as the commit renames its
    before-images into place, before its intent, and as it renames its manifest, its arrays
    changed in place) reports the commit before it."""
    from tiered.cli import main
    from tiered.testing.faults import inject_faults

    path = tmp_path / "s"
    with tiered.TieredStore(CAP, path, frames={"observation": 0}) as w:
        w.extend(batch(CAP, 0))
        w.flush()
        committed = read_manifest(path)["generation"]
        assert main(["info", str(path), "--json"]) == 0
        before = json.loads(capsys.readouterr().out)
        w.extend(batch(CAP // 2, 1))  # a ring lap: blobs freed and their ids reused, index changed in place
        seen: dict = {}

        def info(dst: str) -> None:
            if os.path.basename(dst).startswith(step) and not seen:
                seen["intent"] = read_intent(path)
                seen["rc"] = main(["info", str(path), "--json"])
                seen["doc"] = json.loads(capsys.readouterr().out)

        with inject_faults(on_replace=info):
            w.flush()
        # at the manifest's rename the arrays were changed in place under the intent
        assert seen["intent"] == (committed + 1 if step == "manifest.json" else committed)
        assert seen["rc"] == 0
        assert seen["doc"]["generation"] == committed and seen["doc"]["rows"] == before["rows"]
        assert seen["doc"]["fields"] == before["fields"]
        assert main(["info", str(path), "--json"]) == 0
        after = json.loads(capsys.readouterr().out)
        assert after["generation"] == committed + 1
