"""Crash safety, damage detection and locking of stores on disk.

* Crashes: a forked child extends and flushes real Atari rows in a loop and dies, either at the
  N-th file-write event (``tiered.util.fileio``'s ``kill_on``, with an undo log from which the parent
  then simulates a power cut with ``apply_power_loss``) or by a plain SIGKILL from the parent at
  a random time. After every crash the store reopens, every flushed row is bit-exact, and
  ``verify`` is clean.
* Damage: flipped bytes, truncated and garbage files, files that are not stores, future
  versions: each gives a specific :mod:`tiered.errors` exception (never a raw ``KeyError``,
  ``struct.error`` or a hang), and ``tiered verify`` names what is damaged.
* Locking: one writer at a time, a dead writer's lock does not block, readers never block, and
  DataLoader workers (fork and spawn) read a read-only store.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from _store_dataset import StoreDataset
from helpers import fork_child, gen_files, wait_child

import tiered
from tiered import TieredStore
from tiered.cli import main
from tiered.durable.lock import acquire_writer_lock, read_holder, release
from tiered.errors import (
    ChecksumError,
    CorruptionError,
    FormatVersionError,
    NotATieredStoreError,
    StoreLockedError,
)
from tiered.testing import faults
from tiered.verify import verify_store

CAP, B, BATCHES = 200, 60, 5  # 300 rows through a ring of 200: wraps once
OPTS = {"frames": {"observation": 0}, "chunk_frames": 4}
CI_POWER_SEEDS = 24
CI_SIGKILL_SEEDS = 10


# --------------------------------------------------------------------------------------------- helpers


def _read_acks(fd: int) -> list[int]:
    raw = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        raw += chunk
    os.close(fd)
    return [v for (v,) in struct.iter_unpack("<q", raw[: len(raw) // 8 * 8])]


def _writer(path: Path, data, ack_w: int, log: str | None = None, kill_on: int | None = None) -> None:
    """Child: create the store, extend B rows at a time, flush after each batch and tell the parent."""
    ctx = faults.inject_faults(undo_log=log, kill_on=kill_on) if log else nullcontext()
    with ctx as inj:
        store = TieredStore(CAP, path, **OPTS)
        for b in range(BATCHES):
            store.extend(data[b * B : (b + 1) * B])
            store.flush()
            os.write(ack_w, struct.pack("<q", (b + 1) * B))  # acknowledged: must survive any crash now
        store.close()
        events = inj.events if inj is not None else -1
    os.write(ack_w, struct.pack("<q", -events - 1))


def _run_writer(path: Path, data, **kw) -> tuple[tuple[str, int], list[int]]:
    r, w = os.pipe()
    pid = fork_child(lambda: _writer(path, data, w, **kw))
    os.close(w)
    acks = _read_acks(r)
    return wait_child(pid), acks


def _check_after_crash(path: Path, data, acked: int, seed: str) -> str:
    """Reopen after a crash; every acknowledged row must be there, bit-exact; verify clean."""
    if not (path / "manifest.json").exists():
        # the first commit (creation) never completed: nothing was acknowledged, there is no store
        assert acked == 0, f"{seed}: {acked} rows acknowledged but no manifest"
        return "no store"
    store = tiered.open(path)  # must not raise
    n, cursor = len(store), store.cursor
    # the committed state is the one after some flush at or after the last acknowledged one
    total = B * BATCHES
    commits = [c for c in range(acked, total + 1, B) if c % CAP == cursor and min(c, CAP) == n]
    assert commits, f"{seed}: len {n}, cursor {cursor} match no commit at or after {acked} rows"
    c = commits[0]
    if n == 0:
        store.close()
        assert verify_store(path, progress=False).ok
        return "commit 0"
    rows = np.arange(n)
    src = rows + CAP * ((c - 1 - rows) // CAP)  # the last write to each row before the commit
    got = store.get(torch.from_numpy(rows))
    for k in data.keys(True, True):
        assert torch.equal(got.get(k), data.get(k)[torch.from_numpy(src)]), f"{seed}: field {k} differs"
    store.close()
    report = verify_store(path, progress=False)
    assert report.ok, f"{seed}: {report.summary()}"
    return f"commit {c}"


@pytest.fixture(scope="module")
def pong(atari_pong):
    return atari_pong[: B * BATCHES].clone()


@pytest.fixture(scope="module")
def full_run(pong, tmp_path_factory):
    """Events and wall time of an uninterrupted writer run (to draw crash points from)."""
    d = tmp_path_factory.mktemp("full")
    t = time.perf_counter()
    how, acks = _run_writer(d / "s", pong, log=str(d / "log"))
    assert how == ("exited", 0), how
    events = -acks[-1] - 1
    assert acks[:-1] == [B * (i + 1) for i in range(BATCHES)] and events > 50
    _check_after_crash(d / "s", pong, B * BATCHES, "full run")
    return events, time.perf_counter() - t


# ---------------------------------------------------------------------------------------------- crashes


def _power_loss_case(seed: int, pong, full_run, tmp_path: Path) -> str:
    events, _ = full_run
    kill_on = random.Random(seed).randint(1, events)
    path, log = tmp_path / f"s{seed}", str(tmp_path / f"log{seed}")
    how, acks = _run_writer(path, pong, log=log, kill_on=kill_on)
    acked = max([a for a in acks if a >= 0], default=0)
    if how == ("exited", 0):
        _discard(path, log)
        return "finished"
    assert how == ("killed", signal.SIGKILL), how
    faults.apply_power_loss(log)  # drop every write not made durable by an fsync
    outcome = _check_after_crash(path, pong, acked, f"seed {seed} (kill at event {kill_on}/{events})")
    _discard(path, log)
    return outcome


def _sigkill_case(seed: int, pong, full_run, tmp_path: Path) -> str:
    _, wall = full_run
    delay = random.Random(seed).uniform(0.0, wall)
    path = tmp_path / f"k{seed}"
    r, w = os.pipe()
    pid = fork_child(lambda: _writer(path, pong, w))
    os.close(w)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    acks = _read_acks(r)
    wait_child(pid)
    acked = max([a for a in acks if a >= 0], default=0)
    outcome = _check_after_crash(path, pong, acked, f"sigkill seed {seed} after {delay:.2f} s")
    _discard(path)
    return outcome


def _discard(*paths: Path | str) -> None:
    """Delete a checked case's store and log (a failed case keeps them: the assert comes first)."""
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)


@pytest.mark.timeout(300)
def test_power_loss_at_random_write_events_keeps_every_flushed_row(pong, full_run, tmp_path):
    outcomes = [_power_loss_case(seed, pong, full_run, tmp_path) for seed in range(CI_POWER_SEEDS)]
    assert len([o for o in outcomes if o.startswith("commit")]) >= CI_POWER_SEEDS // 2, outcomes


@pytest.mark.timeout(300)
def test_sigkill_at_random_times_keeps_every_flushed_row(pong, full_run, tmp_path):
    outcomes = [_sigkill_case(seed, pong, full_run, tmp_path) for seed in range(CI_SIGKILL_SEEDS)]
    # some kills must land after a commit, or nothing flushed was put to the test
    assert any(o.startswith("commit") and o != "commit 0" for o in outcomes), outcomes


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_power_loss_many_seeds(pong, full_run, tmp_path):
    for seed in range(CI_POWER_SEEDS, CI_POWER_SEEDS + 200):
        _power_loss_case(seed, pong, full_run, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sigkill_many_seeds(pong, full_run, tmp_path):
    for seed in range(CI_SIGKILL_SEEDS, CI_SIGKILL_SEEDS + 100):
        _sigkill_case(seed, pong, full_run, tmp_path)


def test_store_is_writable_after_a_crash(pong, full_run, tmp_path):
    events, _ = full_run
    path, log = tmp_path / "s", str(tmp_path / "log")
    how, acks = _run_writer(path, pong, log=log, kill_on=events * 2 // 3)
    assert how == ("killed", signal.SIGKILL)
    faults.apply_power_loss(log)
    store = tiered.open(path, mode="r+")
    before = len(store)
    rows = store.extend(pong[:B])
    store.close()
    store = tiered.open(path)
    assert torch.equal(store.get(rows)["observation"], pong["observation"][:B])
    assert len(store) == min(before + B, CAP)
    store.close()
    assert verify_store(path, progress=False).ok


# ----------------------------------------------------------------------------------------------- damage


@pytest.fixture(params=["memmap", "hdf5"])
def damaged_base(request, pong, tmp_path):
    path = tmp_path / "s"
    with TieredStore(400, path, backend=request.param, **OPTS) as store:
        store.extend(pong)
    return path


def _blob_location(path: Path, row: int, field: str = "observation") -> tuple[Path, int, int, int]:
    """(segment file, byte offset of the blob in it, its size, blob id) of a row's first frame."""
    body = json.loads((path / "manifest.json").read_text())["body"]
    g = gen_files(path, body)
    fi = next(i for i, f in enumerate(body["schema"]) if "/".join(f["key"]) == field)
    blob = int(np.load(g / f"rows.{fi}.blob.npy")[row, 0])
    off = int(np.load(g / "index.loc.npy")[blob, 2])
    size = int(np.load(g / "index.nbytes.npy")[blob])
    cold = body["cold"]
    seg, inseg = divmod(off, cold["segment_bytes"])
    suffix = ".h5" if cold["format"] == "hdf5" else ".bin"
    return path / "cold" / f"seg-{seg:06d}{suffix}", cold["data_offsets"][seg] + inseg, size, blob


def test_flipped_byte_is_named_by_verify_and_refused_by_get(damaged_base, pong, capsys):
    path = damaged_base
    assert main(["verify", str(path), "-q"]) == 0
    row = 123
    seg, off, size, blob = _blob_location(path, row)
    with open(seg, "r+b") as f:
        f.seek(off + size // 2)
        b = f.read(1)
        f.seek(off + size // 2)
        f.write(bytes([b[0] ^ 0x40]))
    capsys.readouterr()
    assert main(["verify", str(path), "-q"]) == 3
    out = capsys.readouterr().out
    assert f"blob {blob}" in out and str(seg) in out and f"at byte {off}" in out, out
    assert "'observation'" in out and str(row) in out, out
    rep = verify_store(path, progress=False)
    bad = [p for p in rep.problems if p.kind == "checksum"]
    assert bad and all(p.blob == blob for p in bad) and any(row in p.rows for p in bad)
    store = tiered.open(path)
    with pytest.raises(ChecksumError):
        store.get(row)
    hit = set().union(*(p.rows for p in bad if p.n_rows <= len(p.rows)))
    ok_rows = [r for r in range(len(store)) if r not in hit and abs(r - row) > 8][:50]
    got = store.get(ok_rows)
    assert torch.equal(got["observation"], pong["observation"][ok_rows])


def test_truncated_segment_is_a_corruption_error(damaged_base):
    seg = sorted((damaged_base / "cold").iterdir())[0]
    cold = json.loads((damaged_base / "manifest.json").read_text())["body"]["cold"]
    os.truncate(seg, cold["data_offsets"][0] + cold["high_water"] // 2)  # cut through the blobs
    with pytest.raises(CorruptionError, match=seg.name):
        tiered.open(damaged_base)
    rep = verify_store(damaged_base, progress=False)
    assert not rep.ok and any(p.file == str(seg) for p in rep.problems)
    assert main(["verify", str(damaged_base), "-q"]) == 3


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "json-list", "bad-digest"])
def test_damaged_manifest_is_a_corruption_error(damaged_base, how, capsys):
    m = damaged_base / "manifest.json"
    raw = m.read_bytes()
    if how == "truncated":
        m.write_bytes(raw[: len(raw) // 2])
    elif how == "garbage":
        m.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(len(raw))))
    elif how == "empty":
        m.write_bytes(b"")
    elif how == "json-list":
        m.write_text("[1, 2, 3]")
    else:
        doc = json.loads(raw)
        doc["body"]["len"] = 7
        m.write_text(json.dumps(doc))
    with pytest.raises(CorruptionError):
        tiered.open(damaged_base)
    capsys.readouterr()
    assert main(["verify", str(damaged_base), "-q"]) == 3
    assert main(["info", str(damaged_base)]) == 3
    err = capsys.readouterr().err
    assert "manifest" in err and "Traceback" not in err


def test_truncated_generation_array_is_a_corruption_error(damaged_base):
    body = json.loads((damaged_base / "manifest.json").read_text())["body"]
    f = gen_files(damaged_base, body) / "index.nbytes.npy"
    os.truncate(f, os.path.getsize(f) - 5)
    with pytest.raises(CorruptionError, match="index.nbytes"):
        tiered.open(damaged_base)
    rep = verify_store(damaged_base, progress=False)
    assert [p.kind for p in rep.problems] == ["truncated"] and rep.problems[0].file == str(f)


def test_paths_that_are_not_stores(tmp_path, capsys):
    (tmp_path / "empty-file").write_bytes(b"")
    (tmp_path / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("hello")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"body": {"format": "zarr"}, "sha256": ""}))
    for p in ("empty-file", "picture.png", "dir", "missing", "other"):
        with pytest.raises(NotATieredStoreError):
            tiered.open(tmp_path / p)
        with pytest.raises(NotATieredStoreError):
            verify_store(tmp_path / p, progress=False)
        assert main(["info", str(tmp_path / p)]) == 2
        assert main(["verify", str(tmp_path / p), "-q"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("tiered: error:") == 10


def test_store_files_without_a_manifest_are_reported_as_damage(damaged_base):
    (damaged_base / "manifest.json").unlink()
    rep = verify_store(damaged_base, progress=False)
    assert [p.kind for p in rep.problems] == ["manifest"]
    assert main(["verify", str(damaged_base), "-q"]) == 3


@pytest.mark.parametrize("version", [99, 2, 6, 0, "1", None])
def test_any_other_format_version_is_refused_saying_what_to_do(damaged_base, capsys, version):
    """One on-disk format: a later one (99), a pre-release layout (2..6) or garbage is refused,
    naming the version read and the one supported, and the way to rewrite the store."""
    m = damaged_base / "manifest.json"
    doc = json.loads(m.read_text())
    doc["body"]["format_version"] = version
    body = doc["body"]
    doc["sha256"] = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    m.write_text(json.dumps(doc))
    with pytest.raises(FormatVersionError, match=re.escape(f"format version {version!r};")) as e:
        tiered.open(damaged_base)
    assert "reads format version 1 only" in str(e.value) and "tiered export" in str(e.value)
    for mode in ("r", "r+"):
        with pytest.raises(FormatVersionError):
            tiered.open(damaged_base, mode=mode)
    assert main(["info", str(damaged_base)]) == 6
    assert main(["verify", str(damaged_base), "-q"]) == 6
    assert repr(version) in capsys.readouterr().err


def _rewrite(path: Path, fn) -> None:
    m = path / "manifest.json"
    doc = json.loads(m.read_text())
    body = copy.deepcopy(doc["body"])
    fn(body, gen_files(path, body))
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    m.write_text(json.dumps({"body": body, "sha256": digest}))


def _drop(key):
    return lambda body, g: body.pop(key)


def _npy(name, fn):
    def edit(body, g):
        a = np.load(g / f"{name}.npy")
        a = fn(a)
        np.save(g / f"{name}.npy", a)
        body["files"][name] = os.path.getsize(g / f"{name}.npy")

    return edit


def _blob_table(body):
    return next(f"rows.{i}.blob" for i, f in enumerate(body["schema"]) if f["kind"] == "blob")


def _rows_out(body, g):
    _npy(_blob_table(body), lambda a: np.full_like(a, 10**9))(body, g)


# Self-consistent manifests (valid digest) with inconsistent content: the store must still raise
# only tiered errors (CorruptionError from TieredStore.open's consistency checks).
_INCONSISTENT = {
    "missing-capacity": _drop("capacity"),
    "missing-files": _drop("files"),
    "missing-cold": _drop("cold"),
    "missing-options": _drop("options"),
    "negative-capacity": lambda body, g: body.update(capacity=-1),
    "len-past-capacity": lambda body, g: body.update(len=10**6),
    "unknown-backend": lambda body, g: body.update(backend="s3"),
    "written-wrong-shape": _npy("written", lambda a: np.ones(5, bool)),
    "rows-point-past-index": _rows_out,
    "blobs-past-cold-tier": _npy("index.loc", lambda a: np.where(a >= 0, a + 10**12, a)),
    "raw-size-lie": _npy("index.raw_nbytes", lambda a: np.where(a > 0, 2**40, a)),
}


@pytest.mark.parametrize("case", sorted(_INCONSISTENT))
def test_inconsistent_manifest_content_is_reported_by_verify(damaged_base, case):
    _rewrite(damaged_base, _INCONSISTENT[case])
    rep = verify_store(damaged_base, progress=False)  # the verifier itself never raises a raw error
    assert not rep.ok, case


@pytest.mark.parametrize("case", sorted(_INCONSISTENT))
def test_inconsistent_manifest_content_gives_tiered_errors(damaged_base, case):
    _rewrite(damaged_base, _INCONSISTENT[case])
    # every case is caught by the consistency checks on open (the module's promise)
    with pytest.raises(CorruptionError):
        store = tiered.open(damaged_base)
        store.get(slice(None))


# ---------------------------------------------------------------------------------------------- locking


def _store_takes_lock(tmp_path_factory) -> bool:
    """Whether tiered.open(path, "r+") takes the writer lock itself."""
    p = tmp_path_factory.mktemp("probe") / "s"
    TieredStore(4, p).close()
    store = tiered.open(p, mode="r+")
    try:
        h = acquire_writer_lock(p)
    except StoreLockedError:
        return True
    finally:
        store.close()
    release(h)
    return False


@pytest.fixture(scope="module")
def store_locks(tmp_path_factory) -> bool:
    # the locking tests below rely on the store's own lock: no test takes it by hand
    assert _store_takes_lock(tmp_path_factory), "tiered.open(path, 'r+') did not take the writer lock"
    return True


def _open_writer(path: Path, store_locks: bool):
    """Open a writer: ``tiered.open(path, "r+")`` takes the writer lock itself (no handle)."""
    assert store_locks
    return tiered.open(path, mode="r+"), None


def _close_writer(store, handle) -> None:
    store.close()
    release(handle)


@pytest.fixture
def small_store(pong, tmp_path):
    path = tmp_path / "s"
    with TieredStore(400, path, **OPTS) as store:
        store.extend(pong[:100])
    return path


def _hold_writer(path: Path, store_locks: bool, hold_s: float = 30.0) -> tuple[int, int]:
    """Fork a child that opens a writer, says so on a pipe, then sleeps; return (pid, read fd)."""
    r, w = os.pipe()

    def child():
        os.close(r)
        store, h = _open_writer(path, store_locks)
        os.write(w, b"1")
        time.sleep(hold_s)
        _close_writer(store, h)

    pid = fork_child(child)
    os.close(w)
    assert os.read(r, 1) == b"1"
    return pid, r


def test_second_writer_gets_store_locked_error_naming_the_holder(small_store, store_locks, pong):
    pid, r = _hold_writer(small_store, store_locks)
    try:
        with pytest.raises(StoreLockedError) as e:
            _open_writer(small_store, store_locks)
        msg = str(e.value)
        assert f"pid {pid}" in msg and socket.gethostname() in msg and "mode='r'" in msg, msg
        assert read_holder(small_store)["pid"] == pid
        # readers are never blocked by the writer
        with tiered.open(small_store) as ro:
            assert torch.equal(ro.get(slice(0, 100))["observation"], pong["observation"][:100])
        assert main(["verify", str(small_store), "-q"]) == 0
    finally:
        os.kill(pid, signal.SIGKILL)
        wait_child(pid)
        os.close(r)


def test_lock_of_a_killed_writer_does_not_block(small_store, store_locks, pong):
    pid, r = _hold_writer(small_store, store_locks)
    os.kill(pid, signal.SIGKILL)
    assert wait_child(pid) == ("killed", signal.SIGKILL)
    os.close(r)
    assert read_holder(small_store)["pid"] == pid  # the stale details stay, the lock does not
    store, h = _open_writer(small_store, store_locks)
    store.extend(pong[100:110])
    _close_writer(store, h)
    assert read_holder(small_store)["pid"] == os.getpid()
    with tiered.open(small_store) as ro:
        assert len(ro) == 110


def test_second_writer_in_the_same_process_is_refused(small_store, store_locks):
    store, h = _open_writer(small_store, store_locks)
    try:
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            _open_writer(small_store, store_locks)
    finally:
        _close_writer(store, h)
    store, h = _open_writer(small_store, store_locks)  # released: free again
    _close_writer(store, h)


def test_lock_release_is_idempotent_and_a_forked_copy_does_not_unlock(tmp_path):
    h = acquire_writer_lock(tmp_path)
    pid = fork_child(lambda: release(h))  # the child's release must not drop the parent's lock
    assert wait_child(pid) == ("exited", 0)
    with pytest.raises(StoreLockedError):
        acquire_writer_lock(tmp_path)
    release(h)
    release(h)
    release(acquire_writer_lock(tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_read_a_read_only_store(small_store, pong, start_method):
    ds = StoreDataset(str(small_store), 100)
    dl = torch.utils.data.DataLoader(
        ds, batch_size=10, num_workers=2, multiprocessing_context=start_method, shuffle=False
    )
    seen = []
    pids = set()
    for batch in dl:
        seen.append(batch["observation"])
        pids.update(batch["pid"].tolist())
    assert torch.equal(torch.cat(seen), pong["observation"][:100])
    assert len(pids) == 2 and os.getpid() not in pids


@pytest.mark.timeout(300)
def test_a_reader_two_commits_behind_is_told_to_reopen(pong, tmp_path):
    """A read-only open keeps its commit until the writer's second commit after it; then reused
    space fails the checksum, and the error says why (not damage) and what to do."""
    path = tmp_path / "s"
    writer = TieredStore(CAP, path, warm_bytes=0, hot_bytes=0, **OPTS)
    writer.extend(pong[:CAP])
    writer.flush()
    reader = tiered.open(path)
    rows = torch.arange(CAP)
    for k in (1, 2, 3):  # commits of other frames over every row: after the second, the reader's
        other = pong[:CAP].clone()  # blobs are reused by the third write
        for key in ("observation", ("next", "observation")):
            other.set(key, other.get(key) ^ k)
        writer.extend(other)
        if k < 3:
            writer.flush()
    with pytest.raises(ChecksumError, match="reopen the store") as e:
        reader.get(rows)
    assert "opened read-only at commit" in str(e.value) and "damaged)" not in str(e.value)
    writer.close()
    assert torch.equal(tiered.open(path).get(rows)["observation"], pong["observation"][:CAP] ^ 3)
    assert verify_store(path, progress=False).ok


def _xor_frames(td, k: int):
    other = td.clone()
    for key in ("observation", ("next", "observation")):
        other.set(key, other.get(key) ^ k)
    return other


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_reader_one_commit_behind_reads_its_commit_while_the_writer_writes(pong, tmp_path, backend):
    """The promise of docs/format.md: a read-only open sees its commit until the writer's second
    commit after it, also while the writer has written (and not yet committed) rows over every
    row after its first commit. Checked with a second read-only handle in this process and with
    a reader in another process that opened before the writer's commit."""
    path = tmp_path / "s"
    writer = TieredStore(CAP, path, warm_bytes=0, hot_bytes=0, backend=backend, **OPTS)
    writer.extend(pong[:CAP])
    writer.flush()
    rows = torch.arange(CAP)
    reader = tiered.open(path)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()

    def child():
        os.close(go_w)
        other = tiered.open(path, warm_bytes=0, hot_bytes=0)
        os.write(done_w, b"o")  # opened
        assert os.read(go_r, 1) == b"g"  # the writer has committed once and written again
        got = other.get(rows)
        assert torch.equal(got["observation"], pong["observation"][:CAP])
        assert torch.equal(got["next", "observation"], pong["next", "observation"][:CAP])

    pid = fork_child(child)
    os.close(go_r)
    os.close(done_w)
    assert os.read(done_r, 1) == b"o"
    writer.extend(_xor_frames(pong[:CAP], 1))
    writer.flush()  # one commit: the reader's blobs are freed by it
    writer.extend(_xor_frames(pong[:CAP], 2))  # written to the cold files, not committed
    writer.extend(_xor_frames(pong[:CAP], 3))
    os.write(go_w, b"g")
    assert wait_child(pid) == ("exited", 0)
    got = reader.get(rows)
    assert torch.equal(got["observation"], pong["observation"][:CAP])
    writer.close()
    assert torch.equal(tiered.open(path).get(rows)["observation"], pong["observation"][:CAP] ^ 3)
    assert verify_store(path, progress=False).ok


def test_verify_is_clean_while_a_writer_commits(pong, tmp_path):
    """verify reads the last commit without the lock; a commit under its feet is re-checked."""
    path = tmp_path / "s"
    TieredStore(CAP, path, **OPTS).close()
    r, w = os.pipe()

    def child():
        os.close(r)
        store = tiered.open(path, mode="r+")
        os.write(w, b"1")
        for _rep in range(6):
            for b in range(BATCHES):  # wraps the ring: freed space is reused after each commit
                store.extend(pong[b * B : (b + 1) * B])
                store.flush()
        store.close()

    pid = fork_child(child)
    os.close(w)
    assert os.read(r, 1) == b"1"
    reports = []
    while True:
        reports.append(verify_store(path, progress=False))
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
    os.close(r)
    # the writer made all its commits (a writer that died early would leave verify an idle store)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    bad = [rep.summary() for rep in reports if not rep.ok]
    assert not bad, bad[:2]
    assert len({rep.generation for rep in reports}) >= 2  # verify ran while commits landed
    final = verify_store(path, progress=False)
    assert final.ok and final.rows == CAP
    assert final.generation >= 1 + 6 * BATCHES  # creation, then one commit per flush
