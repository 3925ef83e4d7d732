"""One file per array, changed in place, with before-images (tiered/durable/array_files.py).

* A writer killed at every file event of a commit, with and without a power cut after: the next
  writer open finds the previous commit bit-exact (every array file the manifest names holds the
  bytes it held before) or the new one; kill points between the in-place writes and the
  manifest are among them, and a read-only open made there reads the previous commit too.
* A read-only open reads its commit across the writer's next two commits, which rewrite every
  page it has not read yet (rebuilt from their before-images); at the third, what it already read
  stays its commit's and what it had not read says to reopen.
* A committed store holds one file per array and the before-images of its last two commits.
* A dead commit whose ``commit.intent`` is then damaged or lost is still rolled back from its
  before-images (they are not removed as strays), and readers meanwhile rebuild from them;
  damaged images with it are refused.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fork_child, manifest_body, wait_child
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.durable.array_files import ARRAYS_DIR, KEEP, UndoImage, read_intent, read_intent_token
from tiered.durable.commit_arrays import array_path
from tiered.durable.manifest import read_npy_header
from tiered.errors import CorruptionError, StaleReadError
from tiered.testing import faults, parts
from tiered.verify import verify_store

CAP = 6_000


def batch(n: int, seed: int, *, blobs: bool = True) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    fields = {"reward": torch.randn(n, generator=g), "action": torch.randint(0, 1 << 30, (n,), generator=g),
              "state": torch.randn(n, 128, generator=g)}  # 512 B a row: three checksum pages
    if blobs:
        fields["observation"] = torch.randint(0, 4, (n, 16, 16), dtype=torch.uint8, generator=g)
    return TensorDict(fields, [n])


def same(a: TensorDict, b: TensorDict) -> bool:
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


def array_bytes(path: Path) -> dict[str, bytes]:
    """The bytes of every array file the manifest names."""
    body = manifest_body(path)
    return {name: Path(array_path(str(path), body, name)).read_bytes() for name in body["files"]}


ROWS = np.arange(0, CAP, 3)  # rows the crashing commit overwrites: on every page of every array


def _commit_in_child(path: Path, **injected) -> tuple[str, int]:
    def child():
        with faults.inject_faults(**injected):
            store = tiered.open(path, mode="r+", warm_bytes=0, hot_bytes=0)
            store.set(torch.as_tensor(ROWS), batch(ROWS.size, 77))
            store.flush()
        os._exit(0)

    return wait_child(fork_child(child))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, TensorDict, TensorDict]:
    """A committed store, what it reads, and what it reads after the crashing commit lands."""
    path = tmp_path_factory.mktemp("undo") / "s"
    with TieredStore(CAP, path, frames={"observation": 0}, chunk_frames=4, warm_bytes=0, hot_bytes=0) as s:
        for k in range(3):
            s.extend(batch(CAP // 2, k))
            s.flush()
        before = s.get(torch.arange(CAP))
        after = before.clone()
        after[torch.as_tensor(ROWS)] = batch(ROWS.size, 77)
    return path, before, after


@pytest.mark.slow
@pytest.mark.parametrize("power_loss", [False, True], ids=["crash", "power-loss"])
def test_a_commit_killed_at_any_event_leaves_the_previous_commit_bit_exact_or_the_new_one(base, tmp_path,
                                                                                           power_loss):
    path0, before, after = base
    g = manifest_body(path0)["generation"]
    files0 = array_bytes(path0)
    counted = tmp_path / "counted"
    shutil.copytree(path0, counted)
    log = tmp_path / "count.log"
    assert _commit_in_child(counted, undo_log=str(log)) == ("exited", 0)
    assert manifest_body(counted)["generation"] == g + 1
    with faults.inject_faults() as counting:  # the events of the same commit, counted here
        store = tiered.open(counted, mode="r+", warm_bytes=0, hot_bytes=0)
        store.set(torch.as_tensor(ROWS), batch(ROWS.size, 78))
        store.flush()
    events = counting.events
    store.close()
    outcomes = {"previous": 0, "new": 0, "between in-place writes and manifest": 0}
    # about 40 points, every phase of the commit, and its last events (after the manifest's rename)
    for kill_on in sorted({*range(1, events + 1, max(1, events // 40)), *range(max(1, events - 3), events + 1)}):
        path = tmp_path / f"k{kill_on}"
        shutil.copytree(path0, path)
        log = tmp_path / f"k{kill_on}.log"
        assert _commit_in_child(path, undo_log=str(log), kill_on=kill_on) == ("killed", signal.SIGKILL)
        if power_loss:
            faults.apply_power_loss(log)
        published = manifest_body(path)["generation"]
        if published == g and (read_intent(str(path)) or 0) > g:  # died after changing arrays in place
            outcomes["between in-place writes and manifest"] += 1
            with tiered.open(path) as ro:  # a reader now: the previous commit, rebuilt from its before-images
                assert same(ro.get(torch.arange(CAP)), before)
        with tiered.open(path, mode="r+") as w:  # rolls a dead commit back
            assert w.generation == published
        if published == g:
            outcomes["previous"] += 1
            assert array_bytes(path) == files0, f"kill at event {kill_on}/{events}"  # bit-exact
            expect = before
        else:
            outcomes["new"] += 1
            expect = after
        with tiered.open(path) as ro:
            assert same(ro.get(torch.arange(CAP)), expect), f"kill at event {kill_on}/{events}"
        assert verify_store(path, progress=False).ok
        shutil.rmtree(path)
    assert outcomes["between in-place writes and manifest"] > 0, outcomes
    assert outcomes["new"] > 0 or power_loss, outcomes  # a power cut before the last fsync of the directory: the old one


def test_a_read_only_open_reads_its_commit_across_the_writers_next_two_commits(tmp_path):
    path = tmp_path / "s"
    writer = TieredStore(CAP, path, warm_bytes=0, hot_bytes=0)
    writer.extend(batch(CAP, 0, blobs=False))
    writer.flush()
    expect = writer.get(torch.arange(CAP))
    child_go_r, child_go_w = os.pipe()
    opened_r, opened_w = os.pipe()

    def child():  # another process, opened at the same commit before the writer moved on
        other = tiered.open(path)
        os.write(opened_w, b"o")
        assert os.read(child_go_r, 1) == b"g"
        assert same(other.get(torch.arange(CAP)), expect)

    # forked first: the fork makes this process's mapped array pages private, a reader's too
    pid = fork_child(child)
    assert os.read(opened_r, 1) == b"o"
    reader = tiered.open(path)  # reads nothing yet: no page of its arrays is checked
    g = reader.generation
    for k in (1, 2):  # every row rewritten: every page of every per-row array changes in place
        writer.set(torch.arange(CAP), batch(CAP, 10 + k, blobs=False))
        writer.flush()
    assert read_intent(str(path)) == g + KEEP
    os.write(child_go_w, b"g")
    assert wait_child(pid) == ("exited", 0)
    half = torch.arange(100)  # the first two pages of the widest column (its rows lie across them)
    assert same(reader.get(half), expect[half])  # pages rebuilt from the before-images of both commits
    writer.set(torch.arange(CAP), batch(CAP, 13, blobs=False))
    writer.flush()  # a third commit: the reader's oldest before-images are gone
    assert same(reader.get(half), expect[half])  # pages it checked are its own: still its commit
    with pytest.raises(StaleReadError, match="reopen"):
        reader.get(torch.arange(CAP - 10, CAP))  # pages it never read cannot be rebuilt: reopen
    reader.close()
    with tiered.open(path) as again:
        assert same(again.get(torch.arange(CAP)), writer.get(torch.arange(CAP)))
    writer.close()


def _header_ahead_of_size(path: Path) -> bool:
    """Whether an array file still of its committed size holds a newer commit's header (a
    writer growing it in place writes the header before the new tail)."""
    body = manifest_body(path)
    for name, size in body["files"].items():
        f = array_path(str(path), body, name)
        if os.path.getsize(f) == size:
            fd = os.open(f, os.O_RDONLY)
            try:
                read_npy_header(fd, f, size)
            except CorruptionError:
                return True
            finally:
                os.close(fd)
    return False


def test_a_reader_opened_while_a_commit_grows_arrays_in_place_reads_the_last_commit(atari_pong, tmp_path):
    """A writer killed at every file event of a commit that adds blobs (its blob-id arrays grow in
    place): a read-only open and verify made there, as a reader would meanwhile, read the last
    commit, also where a file's header is already the next commit's and its tail not yet written."""
    path0 = tmp_path / "base"
    with TieredStore(200, path0, frames={"observation": 0}, chunk_frames=4) as s:
        s.extend(atari_pong[:60])
        s.flush()
        before, g = s.get(torch.arange(60)), s.generation
    more = atari_pong[60:120]

    def commit(path: Path, **injected) -> tuple[str, int]:
        def child():
            with faults.inject_faults(**injected):
                w = tiered.open(path, mode="r+")
                w.extend(more)
                w.flush()
            os._exit(0)

        return wait_child(fork_child(child))

    counted = tmp_path / "counted"
    shutil.copytree(path0, counted)
    with faults.inject_faults() as counting:  # the events of the same commit, counted here
        w = tiered.open(counted, mode="r+")
        w.extend(more)
        w.flush()
    w.close()

    def killed_at(kill_on: int) -> Path:
        path = tmp_path / f"k{kill_on}"
        if not path.exists():
            shutil.copytree(path0, path)
            assert commit(path, kill_on=kill_on) == ("killed", signal.SIGKILL)
        return path

    def first(started) -> int:
        """The first kill point where ``started`` holds (it holds at every one after)."""
        lo, hi = 1, counting.events
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if started(killed_at(mid)) else (mid + 1, hi)
        return lo

    # every kill point between the intent and the manifest: the writer died changing arrays in place
    intent_at = first(lambda p: (read_intent(str(p)) or 0) > g)
    published_at = first(lambda p: manifest_body(p)["generation"] > g)
    mid_commit, header_ahead = published_at - intent_at, 0
    for kill_on in range(intent_at, published_at):
        path = killed_at(kill_on)
        assert manifest_body(path)["generation"] == g and read_intent(str(path)) == g + 1
        header_ahead += _header_ahead_of_size(path)
        with tiered.open(path) as ro:
            assert ro.generation == g and same(ro.get(torch.arange(60)), before), f"kill at event {kill_on}"
        assert verify_store(path, progress=False).ok, f"kill at event {kill_on}"
    assert mid_commit > 0 and header_ahead > 0, (mid_commit, header_ahead)


def test_a_committed_store_holds_one_file_per_array_and_two_commits_of_before_images(tmp_path):
    path = tmp_path / "s"
    with TieredStore(CAP, path, frames={"observation": 0}, chunk_frames=4) as s:
        for k in range(6):  # varying sizes: some small arrays grow and shrink (new files)
            s.extend(batch(300 + 700 * (k % 3), k))
            s.flush()
        g = s.generation
    body = manifest_body(path)
    named = {os.path.basename(array_path(str(path), body, n)) for n in body["files"]}
    on_disk = set(os.listdir(path / "arrays"))
    assert {f"undo.{g}", f"undo.{g - 1}"} <= on_disk
    per_array: dict[str, int] = {}
    for f in on_disk - {f"undo.{g}", f"undo.{g - 1}"}:
        assert f.endswith(".npy"), f
        per_array[f.rsplit(".", 2)[0]] = per_array.get(f.rsplit(".", 2)[0], 0) + 1
    # besides its file, an array keeps only files replaced by the last KEEP commits (their readers map them)
    assert named <= on_disk and max(per_array.values()) <= KEEP + 1, per_array
    with tiered.open(path, mode="r+") as w:
        w.extend(batch(10, 99))
    assert len([f for f in os.listdir(path / "arrays") if f.startswith("undo.")]) == KEEP
    assert verify_store(path, progress=False).ok


def _store_with_a_pending_overwrite(tmp_path) -> tuple[TieredStore, TensorDict, TensorDict]:
    """A committed store, what its commit holds, and what it holds in memory after an overwrite of
    rows on every page of every array (its next commit changes them in place)."""
    store = TieredStore(CAP, tmp_path / "s", frames={"observation": 0}, chunk_frames=4, warm_bytes=0,
                        hot_bytes=0)
    store.extend(batch(CAP, 0))
    store.flush()
    before = store.get(torch.arange(CAP))
    store.set(torch.as_tensor(ROWS), batch(ROWS.size, 77))
    return store, before, store.get(torch.arange(CAP))


def _failed_commit_left_the_last_one(store: TieredStore, before: TensorDict, after: TensorDict,
                                     files: dict[str, bytes], g: int) -> None:
    """After a commit that failed: every array file the manifest names holds the bytes of the last
    commit (now, not at the next commit or open), a reader reads that commit, the writer still holds
    its rows in memory, and its next commit lands."""
    path = Path(store.path)
    assert manifest_body(path)["generation"] == store.generation == g
    assert array_bytes(path) == files
    assert not parts(store).files.rollback_pending
    with tiered.open(path) as ro:
        assert same(ro.get(torch.arange(CAP)), before)
    assert same(store.get(torch.arange(CAP)), after)
    store.flush()
    assert manifest_body(path)["generation"] == store.generation == g + 1
    store.close()
    with tiered.open(path) as ro:
        assert same(ro.get(torch.arange(CAP)), after)
    assert verify_store(path, progress=False).ok


def test_a_commit_failing_before_its_intent_changed_nothing_in_place(tmp_path):
    store, before, after = _store_with_a_pending_overwrite(tmp_path)
    path, g = tmp_path / "s", store.generation
    files, token = array_bytes(path), read_intent_token(str(path))
    with faults.inject_faults(eio_on=1), pytest.raises(OSError) as e:  # the commit's first write
        store.flush()
    assert os.path.dirname(e.value.filename) == str(path / ARRAYS_DIR)  # a new array file or a before-image
    assert read_intent_token(str(path)) == token  # no intent written: no file changed in place, none undone
    _failed_commit_left_the_last_one(store, before, after, files, g)


def test_a_commit_failing_while_it_changes_arrays_in_place_is_undone_at_once(tmp_path):
    store, before, after = _store_with_a_pending_overwrite(tmp_path)
    path, g = tmp_path / "s", store.generation
    files, token = array_bytes(path), read_intent_token(str(path))
    body = manifest_body(path)
    named = {array_path(str(path), body, name) for name in body["files"]}
    # fail the commit's 1st write, 2nd, ...: those before its intent change nothing in place (the
    # test above); the first that changes the intent's token is the first write after the intent
    for at in range(1, 200):
        with faults.inject_faults(eio_on=at), pytest.raises(OSError) as e:
            store.flush()
        if read_intent_token(str(path)) != token:
            break
        assert array_bytes(path) == files
    # the intent of commit g + 1, then the roll-back's for g: the files were written in place and
    # put back before flush raised
    assert read_intent_token(str(path)) == (g, token[1] + 2)
    assert e.value.filename in named, (e.value.filename, sorted(named))  # an array file, in place
    _failed_commit_left_the_last_one(store, before, after, files, g)


def _died_after_intent(tmp_path) -> tuple[Path, TensorDict]:
    """A store whose last commit died after changing its arrays in place (and what it held)."""
    path = tmp_path / "s"
    with TieredStore(CAP, path, warm_bytes=0, hot_bytes=0) as s:
        s.extend(batch(CAP, 0, blobs=False))
        before = s.get(torch.arange(CAP))
    with tiered.open(path, mode="r+") as w, faults.inject_faults() as counting:  # a commit like the ones below
        w.set(torch.arange(CAP), batch(CAP, 2, blobs=False))
        w.flush()
        before = w.get(torch.arange(CAP))
    for at in range(counting.ops + 2, 0, -1):  # the first write count that fails the commit is its last (the manifest's)
        w = tiered.open(path, mode="r+")
        w.set(torch.arange(CAP), batch(CAP, 1, blobs=False))
        g = w.generation
        try:
            with faults.inject_faults(enospc_on=at):  # the roll-back fails too: left to the next open
                w.flush()
        except OSError:
            parts(w).files.release_lock()  # the writer dies here: its lock goes with it
            break
        before = w.get(torch.arange(CAP))
        w.close()
    assert read_intent(str(path)) == g + 1 and manifest_body(path)["generation"] == g
    return path, before


def test_a_damaged_before_image_is_refused_not_rolled_back(tmp_path):
    path, _ = _died_after_intent(tmp_path)
    image = path / "arrays" / f"undo.{read_intent(str(path))}"
    raw = bytearray(image.read_bytes())
    raw[-1] ^= 0xFF  # a byte of the old bytes
    image.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="before-image"):
        tiered.open(path, mode="r+")
    image.write_bytes(bytes(raw[:40]))  # cut inside its table
    with pytest.raises(CorruptionError, match="before-image"):
        tiered.open(path, mode="r+")


def test_a_commit_that_failed_with_its_roll_back_is_rolled_back_at_the_next_open(tmp_path):
    path, before = _died_after_intent(tmp_path)
    with tiered.open(path) as ro:  # a reader meanwhile: the last commit, rebuilt
        assert same(ro.get(torch.arange(CAP)), before)
    with tiered.open(path, mode="r+") as w:
        assert same(w.get(torch.arange(CAP)), before)
    assert read_intent(str(path)) == manifest_body(path)["generation"]
    assert verify_store(path, progress=False).ok


def _damage_intent(path: Path, how: str) -> None:
    intent = path / "commit.intent"
    if how == "missing":
        intent.unlink()
    elif how == "torn":
        intent.write_bytes(intent.read_bytes()[:10])
    else:  # a flipped bit in the check word
        raw = bytearray(intent.read_bytes())
        raw[9] ^= 0x10
        intent.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def killed_in_place(base, tmp_path_factory) -> Path:
    """``base`` with a commit killed after it changed the arrays in place, before its manifest."""
    path0 = base[0]
    g, files0 = manifest_body(path0)["generation"], array_bytes(path0)
    tmp = tmp_path_factory.mktemp("killed")
    with faults.inject_faults() as counting:  # the events of the commit, counted here
        shutil.copytree(path0, tmp / "counted")
        store = tiered.open(tmp / "counted", mode="r+", warm_bytes=0, hot_bytes=0)
        store.set(torch.as_tensor(ROWS), batch(ROWS.size, 77))
        store.flush()
    store.close()
    for kill_on in range(counting.events, 0, -1):  # from the last event back to the manifest's
        path = tmp / f"k{kill_on}"
        shutil.copytree(path0, path)
        assert _commit_in_child(path, kill_on=kill_on) == ("killed", signal.SIGKILL)
        if manifest_body(path)["generation"] == g and array_bytes(path) != files0:
            return path
    raise AssertionError("no kill point left the arrays changed in place before the manifest")


@pytest.mark.parametrize("how", ["flipped", "torn", "missing"])
def test_a_dead_commit_is_rolled_back_from_its_images_when_its_intent_is_damaged(base, killed_in_place, tmp_path,
                                                                                    how):
    """Without a readable intent, the before-images of a commit after the manifest's are the dead
    commit's: the next writer writes them back instead of removing them as strays."""
    path0, before, _ = base
    path = tmp_path / "s"
    shutil.copytree(killed_in_place, path)
    g = manifest_body(path)["generation"]
    assert read_intent(str(path)) == g + 1 and (path / ARRAYS_DIR / f"undo.{g + 1}").exists()
    _damage_intent(path, how)
    assert read_intent(str(path)) is None
    with tiered.open(path) as ro:  # a reader first: the pages the commit changed, rebuilt from its images
        assert ro.generation == g and same(ro.get(torch.arange(CAP)), before)
    assert verify_store(path, progress=False).ok
    with tiered.open(path, mode="r+") as w:
        assert w.generation == g and same(w.get(torch.arange(CAP)), before)
    assert array_bytes(path) == array_bytes(path0)  # bit-exact
    assert read_intent(str(path)) == g and not (path / ARRAYS_DIR / f"undo.{g + 1}").exists()
    assert verify_store(path, progress=False).ok
    with tiered.open(path) as ro:
        assert same(ro.get(torch.arange(CAP)), before)


def test_a_damaged_intent_with_no_commit_under_way_is_harmless_and_written_again(tmp_path):
    path = tmp_path / "s"
    with TieredStore(CAP, path, warm_bytes=0, hot_bytes=0) as s:
        s.extend(batch(CAP, 0))
        s.set(torch.as_tensor(ROWS), batch(ROWS.size, 1))
        s.flush()
        expect = s.get(torch.arange(CAP))
        g = s.generation
    _damage_intent(path, "flipped")
    with tiered.open(path, mode="r+") as w:
        assert same(w.get(torch.arange(CAP)), expect)
    assert read_intent(str(path)) == g
    assert verify_store(path, progress=False).ok


def test_a_damaged_intent_and_damaged_images_of_a_dead_commit_are_refused(killed_in_place, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(killed_in_place, path)
    g = manifest_body(path)["generation"]
    image = path / ARRAYS_DIR / f"undo.{g + 1}"
    image.write_bytes(image.read_bytes()[:40])  # cut inside its table
    _damage_intent(path, "flipped")
    with pytest.raises(CorruptionError, match=r"commit\.intent is missing or damaged.*before-image"):
        tiered.open(path, mode="r+")
    assert image.exists()  # kept: the only copy of what the commit overwrote


def test_before_images_keep_no_bytes_of_rows_never_written(tmp_path):
    """A commit into rows never written (a buffer's first fill, an import) keeps no old bytes for
    them, only their ranges; a reader of the last commit and the roll-back of a dead one still get
    its bytes back (the zeros included), bit for bit."""
    path0 = tmp_path / "s"
    with TieredStore(CAP, path0, frames={"observation": 0}, chunk_frames=4, warm_bytes=0, hot_bytes=0) as s:
        s.extend(batch(CAP // 4, 0))
        s.flush()
        before = s.get(torch.arange(CAP // 4))
        s.extend(batch(CAP // 2, 1))
        s.flush()
        g = s.generation
    # the commit rewrote whole blocks of rows (rows 0 to CAP here), three quarters of them never
    # written: the images keep the old bytes of the rest only
    image = UndoImage(str(path0 / ARRAYS_DIR / f"undo.{g}"), g)
    kept = zero = 0
    for name, file in image.arrays:
        runs, where = image.runs(name, file)
        lengths = runs[:, 1] - runs[:, 0]
        kept, zero = kept + int(lengths[where >= 0].sum()), zero + int(lengths[where < 0].sum())
    assert zero > 2 * kept and image.size < kept + (64 << 10), (kept, zero, image.size)
    files0 = array_bytes(path0)

    def extend_in_child(path: Path, **injected) -> tuple[str, int]:
        def child():
            with faults.inject_faults(**injected):
                w = tiered.open(path, mode="r+", warm_bytes=0, hot_bytes=0)
                w.extend(batch(CAP // 8, 2))
                w.flush()
            os._exit(0)

        return wait_child(fork_child(child))

    with faults.inject_faults() as counting:  # the events of the commit, counted here
        shutil.copytree(path0, tmp_path / "counted")
        w = tiered.open(tmp_path / "counted", mode="r+", warm_bytes=0, hot_bytes=0)
        w.extend(batch(CAP // 8, 2))
        w.flush()
    w.close()
    checked = 0
    for kill_on in range(counting.events, 0, -1):  # back from the last event, past the manifest's
        path = tmp_path / f"k{kill_on}"
        shutil.copytree(path0, path)
        assert extend_in_child(path, kill_on=kill_on) == ("killed", signal.SIGKILL)
        if manifest_body(path)["generation"] != g or array_bytes(path) == files0:
            shutil.rmtree(path)
            continue  # published, or killed before it changed the arrays in place
        with tiered.open(path) as ro:  # its pages rebuilt from before-images with zero runs
            assert ro.generation == g and len(ro) == 3 * CAP // 4
            assert same(ro.get(torch.arange(CAP // 4)), before)
        with tiered.open(path, mode="r+") as w:  # rolled back
            assert w.generation == g
        assert array_bytes(path) == files0, f"kill at event {kill_on}"
        assert verify_store(path, progress=False).ok
        checked += 1
        if checked == 3:
            break
    assert checked == 3
