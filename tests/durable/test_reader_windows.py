"""Readers of commit ``g`` while the writer's commit ``g + 1`` is half done, for every kind of
commit a writer makes (tiered/durable/array_files.py: arrays changed in place with before-images).

* Killed commits: each case commits ``g + 1`` in a child process killed before a file event
  (:func:`tiered.testing.faults.inject_faults`, ``kill_on``), at every event between its intent
  and its manifest's rename (every few in the fast variants), a few before the intent and every
  one after the manifest: the files are then exactly what a live writer leaves at that instant.
  There a read-only open reads every row of its commit bit for bit and ``verify_store`` passes,
  and a reader opened at ``g`` before the writer started, which read the first rows then, reads
  the others after the kill as commit ``g``'s.
* The kinds of commit: rows overwritten in place with blob fields, a commit after ``clear()``, a
  narrowed dense column widened (its file replaced by one of another dtype; others shrink), a
  ring that wraps and frees blobs, a dense-only store, the HDF5 cold tier, a shared store
  (``share()``), and many small blobs whose index spans several checksum pages, with ids reused.
* Interleaved: a writer run one file event at a time while readers open and read, the writer
  moving on at their file opens: their opens and reads straddle every point of two commits.
* A dead commit rolled back by the next writer's open: killed at each of that open's events, and
  run between a reader's copy of a page the dead commit changed and its rebuild of that page.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import fork_child, manifest_body, wait_child
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.durable.array_files import ARRAYS_DIR, INTENT, KEEP, read_intent
from tiered.durable.commit_arrays import array_path
from tiered.durable.manifest import MANIFEST, read_npy_header
from tiered.testing import faults
from tiered.util import fileio
from tiered.verify import verify_store


def same(a: TensorDict, b: TensorDict) -> bool:
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


def _commit_in_child(path: Path, write: Callable[[tiered.TieredStore], None], open_kw: dict,
                     **injected) -> tuple[str, int]:
    def child():
        with faults.inject_faults(**injected):
            w = tiered.open(path, mode="r+", **open_kw)
            write(w)
            w.flush()
        os._exit(0)

    return wait_child(fork_child(child))


def _copy(src: Path, dst: Path) -> None:
    """A copy of a store keeping sparse files sparse (an HDF5 segment is 256 MiB, mostly holes)."""
    subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dst)], check=True)


def _files(path: Path) -> dict[str, tuple[int, int, str]]:
    """Per array of the last commit: its file's number, its size and its dtype."""
    body = manifest_body(path)
    out = {}
    for name, size in body["files"].items():
        f = array_path(str(path), body, name)
        fd = os.open(f, os.O_RDONLY)
        try:
            out[name] = (body["array_files"][name], size, str(read_npy_header(fd, f, size).dtype))
        finally:
            os.close(fd)
    return out


def _kinds(before: dict[str, tuple[int, int, str]], after: dict[str, tuple[int, int, str]]) -> set[str]:
    """How the commit changed each array of the last commit: ``grown`` in place, or written to a
    new file ``shrunk``, ``retyped`` or ``replaced`` (same size and dtype)."""
    kinds = set()
    for name, (file, size, dtype) in before.items():
        if name not in after:
            continue
        f2, s2, d2 = after[name]
        if f2 == file:
            kinds.add("grown" if s2 > size else "in place")
        else:
            kinds.add("retyped" if d2 != dtype else "shrunk" if s2 < size else "replaced")
    return kinds


class _WindowMarks(faults.FaultInjector):
    """Counts a commit's file events, noting the event that writes its intent and the one that
    renames its manifest into place: the window where a kill leaves the arrays half changed."""

    def __init__(self) -> None:
        super().__init__()
        self.intent = self.manifest = 0

    def before_write(self, fd: int, view: memoryview, offset: int) -> None:
        super().before_write(fd, view, offset)
        if os.path.basename(fileio.path_of(fd)) == INTENT and not self.intent:
            self.intent = self.events

    def before_replace(self, src: str, dst: str) -> None:
        super().before_replace(src, dst)
        if os.path.basename(dst) == MANIFEST:
            self.manifest = self.events


def check_window(tmp_path: Path, path0: Path, write: Callable[[tiered.TieredStore], None], *,
                 open_kw: dict | None = None, every: int = 1) -> dict:
    """Kill the commit ``write`` makes on a copy of ``path0`` at each event between its intent and
    its manifest (every ``every``-th, and the last one); at each, a fresh read-only open reads
    every row of the last commit bit for bit and verify passes; so it does at a few kill points
    before the intent and at every one after the manifest (the new commit's rows there). A
    reader opened before the writer started, which read the first rows then, reads the others
    (and all again) after the kill as the last commit's. Returns what the commit changed
    (:func:`_kinds`) and counts of what was checked."""
    open_kw = open_kw or {}
    with tiered.open(path0) as ro:
        g, n = ro.generation, len(ro)
        before = ro.get(torch.arange(n))
    counted = tmp_path / "counted"
    _copy(path0, counted)
    marks = _WindowMarks()  # the events of the same commit, counted here
    fileio.set_fault_hook(marks)
    try:
        w = tiered.open(counted, mode="r+", **open_kw)
        write(w)
        w.flush()
    finally:
        fileio.set_fault_hook(None)
    events = marks.events
    w.close()
    assert manifest_body(counted)["generation"] == g + 1
    kinds = _kinds(_files(path0), _files(counted))
    with tiered.open(counted) as ro:
        n1 = len(ro)
        after = ro.get(torch.arange(n1))

    def killed_at(kill_on: int) -> Path:
        path = tmp_path / f"k{kill_on}"
        if not path.exists():
            _copy(path0, path)
            assert _commit_in_child(path, write, open_kw, kill_on=kill_on) == ("killed", signal.SIGKILL)
        return path

    # the first kill point after the intent's write, and after the manifest's rename
    intent_at, published_at = marks.intent + 1, marks.manifest + 1
    assert (read_intent(str(killed_at(intent_at - 1))) or 0) == g  # the window's edges, as marked
    assert manifest_body(killed_at(published_at))["generation"] == g + 1
    window = list(range(intent_at, published_at))
    assert window, (intent_at, published_at, events)
    points = sorted({*window[::every], window[-1]})
    for kill_on in points:
        path = killed_at(kill_on)
        assert manifest_body(path)["generation"] == g and read_intent(str(path)) == g + 1
        with tiered.open(path) as ro:
            assert ro.generation == g and same(ro.get(torch.arange(n)), before), f"kill at event {kill_on}"
        report = verify_store(path, progress=False)
        assert report.ok, (f"kill at event {kill_on}", report)
    # before the intent (cold blobs appended, new files and before-images written), after the manifest
    outside = sorted({*range(1, intent_at, max(1, intent_at // (6 if every == 1 else 3))),
                      *range(published_at, events + 1)})
    for kill_on in outside:
        path = killed_at(kill_on)
        new = kill_on >= published_at
        with tiered.open(path) as ro:
            assert ro.generation == g + new, f"kill at event {kill_on}"
            assert same(ro.get(torch.arange(n1 if new else n)), after if new else before), f"kill at event {kill_on}"
        report = verify_store(path, progress=False)
        assert report.ok, (f"kill at event {kill_on}", report)
    # a reader opened at g before the writer started, reading only once it died mid-commit
    half = torch.arange(0, max(1, n // 8))  # the first pages of the per-row arrays only
    rest = torch.arange(max(1, n // 8), n)
    opened = points[:: max(1, len(points) // (4 if every == 1 else 2))] + points[-1:]
    for kill_on in opened:
        path = tmp_path / f"open{kill_on}"
        _copy(path0, path)
        reader = tiered.open(path)
        try:
            assert same(reader.get(half), before[half])
            assert _commit_in_child(path, write, open_kw, kill_on=kill_on) == ("killed", signal.SIGKILL)
            assert same(reader.get(rest), before[rest]), f"already open, kill at event {kill_on}"
            assert same(reader.get(torch.arange(n)), before), f"already open, kill at event {kill_on}"
        finally:
            reader.close()
        shutil.rmtree(path)
    return {"kinds": kinds, "events": events, "window": len(window), "checked": len(points),
            "outside": len(outside), "opened": len(opened)}


def _rows(td: TensorDict, lo: int, hi: int, **extra: torch.Tensor) -> TensorDict:
    out = td[lo:hi].clone()
    for k, v in extra.items():
        out[k] = v
    return out


def _store(path: Path, commits: list[TensorDict], capacity: int = 200, **kw) -> Path:
    with TieredStore(capacity, path, **kw) as s:
        for td in commits:
            s.extend(td)
            s.flush()
    return path


BLOBS = dict(frames={"observation": 0}, chunk_frames=4)
#: every kill point of the window (slow), or every few (each phase of the commit still hit)
EVERY = pytest.mark.parametrize("every", [pytest.param(1, marks=pytest.mark.slow, id="every-event"),
                                          pytest.param(5, id="every-5th-event")])


@EVERY
def test_rows_overwritten_in_place_with_blob_fields(atari_pong, tmp_path, every):
    """``set`` of rows holding blobs: row tables and blob-id arrays change in place, blobs freed."""
    path0 = _store(tmp_path / "base", [atari_pong[:60], atari_pong[60:120]], **BLOBS)
    new = atari_pong[500:540]
    seen = check_window(tmp_path, path0, lambda w: w.set(torch.arange(0, 120, 3), new), every=every)
    assert "in place" in seen["kinds"], seen


@EVERY
def test_a_commit_after_clear(atari_pong, tmp_path, every):
    """``clear()`` then new rows: every row and blob of the last commit dropped in one commit."""
    path0 = _store(tmp_path / "base", [atari_pong[:60], atari_pong[60:120]], **BLOBS)

    def write(w):
        w.clear()
        w.extend(atari_pong[300:340])

    seen = check_window(tmp_path, path0, write, every=every)
    assert "in place" in seen["kinds"], seen


@EVERY
def test_a_narrowed_dense_column_that_widens(atari_pong, tmp_path, every):
    """A dense integer column narrowed to its small values gets one that needs a wider dtype: its
    file is replaced by a new one of the wider dtype."""
    small = torch.arange(60) % 11
    path0 = _store(tmp_path / "base", [_rows(atari_pong, 0, 60, count=small)], **BLOBS)
    wide = _rows(atari_pong, 0, 10, count=torch.full((10,), 70000))
    seen = check_window(tmp_path, path0, lambda w: w.set(torch.arange(10), wide), every=every)
    assert {"retyped", "shrunk", "in place"} <= seen["kinds"], seen


@EVERY
def test_a_ring_that_wraps_and_reuses_freed_cold_space(atari_pong, tmp_path, every):
    """Writes past the capacity overwrite the oldest rows, free their blobs, and (two commits
    after they were freed) reuse their cold space."""
    path0 = _store(tmp_path / "base", [atari_pong[k * 80:(k + 1) * 80] for k in range(5)], capacity=150, **BLOBS)
    seen = check_window(tmp_path, path0, lambda w: w.extend(atari_pong[400:480]), every=every)
    assert "in place" in seen["kinds"], seen


@EVERY
def test_a_dense_only_store(tmp_path, every):
    """No blob fields: dense columns and row arrays only, rows overwritten and added."""
    g = torch.Generator().manual_seed(0)

    def dense(n: int) -> TensorDict:
        return TensorDict({"reward": torch.randn(n, generator=g), "state": torch.randn(n, 64, generator=g),
                           "action": torch.randint(0, 6, (n,), generator=g)}, [n])

    path0 = _store(tmp_path / "base", [dense(300), dense(300)], capacity=1000)
    a, b = dense(100), dense(200)

    def write(w):
        w.set(torch.arange(0, 600, 6), a)
        w.extend(b)

    seen = check_window(tmp_path, path0, write, every=every)
    assert "in place" in seen["kinds"], seen


@EVERY
def test_the_hdf5_cold_tier(atari_pong, tmp_path, every):
    """The cold tier in an HDF5 file: blobs added and rows overwritten."""
    path0 = _store(tmp_path / "base", [atari_pong[:60]], backend="hdf5", **BLOBS)

    def write(w):
        w.extend(atari_pong[60:120])
        w.set(torch.arange(0, 60, 4), atari_pong[600:615])

    seen = check_window(tmp_path, path0, write, every=every)
    assert "in place" in seen["kinds"], seen


@EVERY
def test_a_shared_store(atari_pong, tmp_path, every):
    """A store written by several processes (``share()``): a call commits under the lock."""
    path0 = _store(tmp_path / "base", [atari_pong[:60]], **BLOBS)
    with tiered.open(path0, mode="r+") as w:
        w.share()
    seen = check_window(tmp_path, path0, lambda w: w.extend(atari_pong[60:120]), open_kw={"shared": True},
                        every=every)
    assert "grown" in seen["kinds"], seen


class _StopAtEachEvent(faults.FaultInjector):
    """Stops this process (SIGSTOP) before each file event takes effect: the parent runs the
    writer one event at a time (:class:`_SteppedWriter`)."""

    def _event(self) -> None:
        self.events += 1
        os.kill(os.getpid(), signal.SIGSTOP)


class _SteppedWriter:
    """A writer process making the commits ``writes`` (one each), one file event at a time."""

    def __init__(self, path: Path, writes: list[Callable[[tiered.TieredStore], None]], open_kw: dict) -> None:
        def child():
            fileio.set_fault_hook(_StopAtEachEvent())
            w = tiered.open(path, mode="r+", **open_kw)
            for write in writes:
                write(w)
                w.flush()
            w.close()
            fileio.set_fault_hook(None)
            os._exit(0)

        self.pid, self.done, self.events = fork_child(child), False, 0
        self._wait()

    def _wait(self) -> None:
        _, status = os.waitpid(self.pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            self.done = True

    def step(self, events: int = 1) -> None:
        """Let the writer make ``events`` more file events (fewer where it finishes first)."""
        for _ in range(events):
            if self.done:
                return
            os.kill(self.pid, signal.SIGCONT)
            self.events += 1
            self._wait()

    def finish(self) -> None:
        while not self.done:
            self.step(1000)


def check_interleaved(tmp_path: Path, path0: Path, writes: list[Callable[[tiered.TieredStore], None]], *,
                      open_kw: dict | None = None, strides: tuple[int, ...] = (1, 4, 16)) -> int:
    """Readers interleaved with a writer making ``len(writes)`` commits (at most :data:`KEEP`),
    one file event at a time: every ``stride``-th file open of the readers (of an array, the
    intent, a before-image, the manifest, a cold segment) lets the writer make one more event, so
    their opens and reads see the writer at every point of its commits. One reader after the
    other opens and reads every row; the last few readers opened read their rows again meanwhile.
    Each reads its commit's rows bit for bit. Returns the readers checked."""
    open_kw = open_kw or {}
    assert len(writes) <= KEEP
    with tiered.open(path0) as ro:
        g = ro.generation
        expect = {g: ro.get(torch.arange(len(ro)))}
    counted = tmp_path / "counted"
    _copy(path0, counted)
    with tiered.open(counted, mode="r+", **open_kw) as w:
        for write in writes:
            write(w)
            w.flush()
            expect[w.generation] = w.get(torch.arange(len(w)))
    readers = 0
    for stride in strides:
        path = tmp_path / f"stride{stride}"
        _copy(path0, path)
        writer = _SteppedWriter(path, writes, open_kw)
        stepping = {"on": True, "opens": 0}

        def step_on_open(_path: str, writer=writer, stepping=stepping, stride=stride) -> None:
            stepping["opens"] += 1
            if stepping["on"] and stepping["opens"] % stride == 0:
                writer.step(1)

        opened: list[tuple[tiered.TieredStore, int]] = []
        with faults.inject_faults(on_open_read=step_on_open):  # the readers' opens step the writer
            try:
                while not writer.done:
                    at = writer.events
                    ro = tiered.open(path)
                    rows = expect[ro.generation]
                    n = rows.batch_size[0]
                    for k in range(0, n, max(1, n // 4)):  # a few reads, the writer moving on between them
                        idx = torch.arange(k, min(n, k + max(1, n // 4)))
                        assert same(ro.get(idx), rows[idx]), (stride, at, writer.events, ro.generation)
                    for other, og in opened:  # readers already open: rows of their commit still
                        idx = torch.arange(0, len(other), 7)
                        assert same(other.get(idx), expect[og][idx]), (stride, writer.events, og)
                    opened.append((ro, ro.generation))
                    readers += 1
                    if len(opened) > 4:  # the oldest, once more at the writer's point now, then closed
                        other, og = opened.pop(0)
                        assert same(other.get(torch.arange(len(other))), expect[og]), (stride, writer.events, og)
                        other.close()
                stepping["on"] = False
                for other, og in opened:
                    assert same(other.get(torch.arange(len(other))), expect[og])
                    other.close()
            finally:
                if not writer.done:
                    os.kill(writer.pid, signal.SIGKILL)
                    os.waitpid(writer.pid, 0)
        assert verify_store(path, progress=False).ok
    return readers


@pytest.mark.parametrize("strides", [pytest.param((1, 4, 16), marks=pytest.mark.slow, id="fine"),
                                     pytest.param((6,), id="coarse")])
def test_readers_interleaved_with_a_writer_adding_and_overwriting_blob_rows(atari_pong, tmp_path, strides):
    """Readers opened and reading at every point of two commits (blobs added, rows overwritten)."""
    path0 = _store(tmp_path / "base", [atari_pong[:60], atari_pong[60:120]], **BLOBS)
    writes = [lambda w: w.extend(atari_pong[120:180]),
              lambda w: w.set(torch.arange(0, 120, 3), atari_pong[500:540])]
    assert check_interleaved(tmp_path, path0, writes, strides=strides) >= 5 * len(strides)


def _small_blobs(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"obs": torch.randint(0, 255, (n, 48), dtype=torch.uint8, generator=g),
                       "reward": torch.randn(n, generator=g)}, [n])


SMALL_BLOBS = dict(blob_keys=["obs"], frames={}, chunk_frames=1, warm_bytes=0, hot_bytes=0)


@pytest.mark.parametrize(("n", "every"), [pytest.param(150_000, 1, marks=pytest.mark.slow, id="every-event"),
                                          pytest.param(50_000, 30, id="every-30th-event")])
def test_many_blobs_on_many_pages_ids_reused(tmp_path, n, every):
    """Many one-row blobs: the blob index and policy arrays span several checksum pages (its
    locations two at 50,000 blobs, four at 150,000), and the commit reuses blob ids freed by the
    one before, on every page."""
    path0 = tmp_path / "base"
    with TieredStore(n, path0, **SMALL_BLOBS) as s:
        s.extend(_small_blobs(n, 0))
        s.flush()
        s.set(torch.arange(0, n, 7), _small_blobs(len(range(0, n, 7)), 1))
        s.flush()
    new = _small_blobs(len(range(0, n, 5)), 2)
    seen = check_window(tmp_path, path0, lambda w: w.set(torch.arange(0, n, 5), new), every=every)
    assert "in place" in seen["kinds"], seen


def _dead_commit(atari_pong: TensorDict, path0: Path, tmp_path: Path) -> tuple[Callable[[tiered.TieredStore], None], _WindowMarks]:
    """The commit the roll-back tests kill (rows added, rows overwritten: arrays grown and changed
    in place) and its window, marked on a copy of ``path0``."""

    def write(w: tiered.TieredStore) -> None:
        w.extend(atari_pong[60:120])
        w.set(torch.arange(0, 60, 3), atari_pong[700:720])

    marks = _WindowMarks()
    counted = tmp_path / "counted"
    _copy(path0, counted)
    fileio.set_fault_hook(marks)
    try:
        with tiered.open(counted, mode="r+") as w:
            write(w)
    finally:
        fileio.set_fault_hook(None)
    return write, marks


@pytest.mark.parametrize("then", [0, 1, KEEP], ids=["rolled-back", "then-one-commit", "then-two-commits"])
def test_a_reader_rebuilding_a_page_while_the_next_writer_rolls_a_dead_commit_back(atari_pong, tmp_path, then):
    """A writer died after its in-place writes (its intent names commit ``g + 1``); a reader of
    ``g`` copies a page it changed, and before the reader rebuilds it from the dead commit's
    before-images, the next writer's open rolls that commit back (the files hold ``g`` again,
    the intent says ``g``, the before-images are removed), and may commit again (``then``
    commits, at most :data:`KEEP`): the reader still reads commit ``g``'s rows."""
    path = _store(tmp_path / "s", [atari_pong[:60]], **BLOBS)
    with tiered.open(path) as ro:
        g, before = ro.generation, ro.get(torch.arange(60))

    write, marks = _dead_commit(atari_pong, path, tmp_path)
    # killed before its manifest's rename: every in-place write done
    assert _commit_in_child(path, write, {}, kill_on=marks.manifest) == ("killed", signal.SIGKILL)
    assert read_intent(str(path)) == g + 1 and manifest_body(path)["generation"] == g

    def next_writer():
        with tiered.open(path, mode="r+") as w:  # rolls the dead commit back
            for k in range(then):
                w.set(torch.arange(k, 60, 4), atari_pong[800 + 20 * k:815 + 20 * k])
                w.flush()

    ran = []

    def writer_moves_first(p: str) -> None:
        # the reader's first rebuild opens the array file after it copied the page: the writer moves first
        if not ran and os.path.basename(os.path.dirname(p)) == ARRAYS_DIR and not os.path.basename(p).startswith("undo"):
            ran.append(p)
            assert wait_child(fork_child(next_writer)) == ("exited", 0)

    reader = tiered.open(path)
    try:
        with faults.inject_faults(on_open_read=writer_moves_first):
            got = reader.get(torch.arange(60))
    finally:
        reader.close()
    assert ran and manifest_body(path)["generation"] == g + then
    assert same(got, before)


@EVERY
def test_readers_while_the_next_writer_rolls_a_dead_commit_back_and_dies_too(atari_pong, tmp_path, every):
    """A writer died after its in-place writes; the next writer's open, which writes the
    before-images back, cuts grown files back and sets the intent back, is killed at each of its
    file events (every ``every``-th). There a fresh read-only open, and one opened before that writer started, read
    commit ``g``'s rows and verify passes; the open after that rolls back and reads ``g`` too."""
    path0 = _store(tmp_path / "base", [atari_pong[:60]], **BLOBS)
    with tiered.open(path0) as ro:
        g, before = ro.generation, ro.get(torch.arange(60))

    write, marks = _dead_commit(atari_pong, path0, tmp_path)
    dead = tmp_path / "dead"
    _copy(path0, dead)
    assert _commit_in_child(dead, write, {}, kill_on=marks.manifest) == ("killed", signal.SIGKILL)
    rolled = tmp_path / "rolled"
    _copy(dead, rolled)
    with faults.inject_faults() as counting:
        tiered.open(rolled, mode="r+").close()
    assert counting.events > 0 and read_intent(str(rolled)) == g

    def nothing(w):
        pass

    for kill_on in sorted({*range(1, counting.events + 1, every), counting.events}):
        path = tmp_path / f"r{kill_on}"
        _copy(dead, path)
        reader = tiered.open(path)
        assert _commit_in_child(path, nothing, {}, kill_on=kill_on) == ("killed", signal.SIGKILL)
        try:
            assert same(reader.get(torch.arange(60)), before), f"already open, kill at event {kill_on}"
        finally:
            reader.close()
        with tiered.open(path) as ro:
            assert ro.generation == g and same(ro.get(torch.arange(60)), before), f"kill at event {kill_on}"
        assert verify_store(path, progress=False).ok, f"kill at event {kill_on}"
        with tiered.open(path, mode="r+") as w:
            assert same(w.get(torch.arange(60)), before), f"kill at event {kill_on}"
        shutil.rmtree(path)
