"""Several writer processes on one TieredStorage, as ``LazyMemmapStorage`` + ``rb.share()`` allow.

Real processes (``fork``, as TorchRL's own multiprocessing tests use on Linux), real Pong frames,
real files in ``tmp_path``; the crash case kills a child with the package's fault-injection seam
(``tiered.util.faults.inject_faults(kill_on=N)``: SIGKILL at the N-th file event of the child).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import shutil
import signal

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer

import tiered
from tiered import TieredStore
from tiered.errors import (
    InvalidArgumentError,
    NotSharedError,
    SchemaMismatchError,
    StorageFullError,
    StoreClosedError,
)
from tiered.testing import faults, parts
from tiered.torchrl import TieredStorage
from tiered.verify import verify_store

OPTS = {"frames": {"observation": 0}}
FORK = mp.get_context("fork")
ROWS = 24  # rows each child writes, in two extends


def _same_rows(got: TensorDict, want: TensorDict, what: str) -> None:
    for key in want.keys(include_nested=True, leaves_only=True):
        assert torch.equal(got[key], want[key]), f"{what}: field {key} differs"


def _child_extends(rb, data, queue) -> None:
    torch.set_num_threads(1)  # as DataLoader workers do: an OpenMP pool does not survive a fork
    written = [rb.extend(data[: ROWS // 2]), rb.extend(data[ROWS // 2:])]
    queue.put(torch.cat(written).numpy())


def _run(children: list) -> None:
    for p in children:
        p.start()
    for p in children:
        p.join(timeout=120)
        assert p.exitcode == 0, f"a writer process exited with {p.exitcode}"


@pytest.fixture(scope="module")
def pong(atari_pong) -> TensorDict:
    return atari_pong


def test_forked_writers_extend_one_buffer(pong, tmp_path):
    storage = TieredStorage(200, tmp_path / "rb", **OPTS)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=16).share()
    rb.extend(pong[:10])  # the parent writes first: the schema and frame layout are fixed here
    queue = FORK.Queue()
    parts = [pong[100 + 100 * i: 100 + 100 * i + ROWS] for i in range(3)]
    _run([FORK.Process(target=_child_extends, args=(rb, part, queue)) for part in parts])
    indices = [queue.get(timeout=10) for _ in parts]
    assert len(rb) == 10 + 3 * ROWS
    # every row once: no child overwrote another's rows, nor the parent's
    everything = np.sort(np.concatenate(indices))
    assert np.array_equal(everything, np.arange(10, 10 + 3 * ROWS))
    _same_rows(rb[:10], pong[:10], "the parent's rows")
    for index in indices:  # the queue gives the children's answers in any order: match by content
        got = rb[torch.from_numpy(index)]
        owner = [p for p in parts if torch.equal(p["observation"][0], got["observation"][0])]
        assert len(owner) == 1
        _same_rows(got, owner[0], "a child's rows")
    # the parent samples the children's rows and keeps writing after them
    assert rb.sample()["observation"].shape == (16, 4, 84, 84)
    index = rb.extend(pong[500:504])
    assert index.tolist() == list(range(10 + 3 * ROWS, 14 + 3 * ROWS))
    first = rb[torch.from_numpy(indices[0])]
    storage.close()
    assert verify_store(tmp_path / "rb", progress=False).ok
    reopened = TieredStorage(None, tmp_path / "rb", mode="r")
    assert len(reopened) == 14 + 3 * ROWS
    _same_rows(reopened[torch.from_numpy(indices[0])], first, "reopened rows")


def _child_then_check(rb, queue_in, queue_out) -> None:
    torch.set_num_threads(1)  # as DataLoader workers do: an OpenMP pool does not survive a fork
    rb.extend(TensorDict({"a": torch.ones(10), "b": torch.ones(10, 2)}, [10]))
    queue_out.put("extended")
    assert queue_in.get(timeout=30) == "extended"
    # the parent's write is visible here, as TorchRL's TestMultiProc checks for LazyMemmapStorage
    queue_out.put((len(rb), rb[:]["a"].tolist()))


def test_writes_go_both_ways_without_share_call(tmp_path):
    """TorchRL's TestMultiProc: no rb.share(); the processes take turns through queues."""
    rb = ReplayBuffer(storage=TieredStorage(25, tmp_path / "rb"))
    rb.extend(TensorDict({"a": torch.zeros(10), "b": torch.zeros(10, 2)}, [10]))
    to_child, from_child = FORK.Queue(), FORK.Queue()
    child = FORK.Process(target=_child_then_check, args=(rb, to_child, from_child))
    child.start()
    try:
        assert from_child.get(timeout=60) == "extended"
        assert len(rb) == 20 and rb[10:20]["a"].eq(1).all()
        rb.extend(TensorDict({"a": torch.full((10,), 2.0), "b": torch.zeros(10, 2)}, [10]))
        to_child.put("extended")
        n, a = from_child.get(timeout=60)
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert n == 25 and a == [2.0] * 5 + [0.0] * 5 + [1.0] * 10 + [2.0] * 5


def _child_killed_mid_write(rb, data, kill_on: int) -> None:
    torch.set_num_threads(1)  # as DataLoader workers do: an OpenMP pool does not survive a fork
    with faults.inject_faults(kill_on=kill_on):
        rb.extend(data)
    raise SystemExit(7)  # not killed: kill_on was past this write's last file event


def _write_events(pong, path) -> int:
    """File events of the child's write (blob bytes, then the commit: before-images, intent, array
    files, fsyncs, manifest rename, directory fsync), counted on a twin of the store."""
    rb = TensorDictReplayBuffer(storage=TieredStorage(100, path, **OPTS)).share()
    rb.extend(pong[:30])
    with faults.inject_faults() as counting:
        rb.extend(pong[200:220])
    return counting.events


# kill points from the first file event of the child's write to its last
@pytest.mark.parametrize("at", [0.0, 0.2, 0.5, 0.85, 0.98, 1.0])
def test_writer_killed_mid_write_leaves_the_store_whole(pong, tmp_path, at):
    events = _write_events(pong, tmp_path / "twin")
    kill_on = min(events, max(1, round(at * events)))
    storage = TieredStorage(100, tmp_path / "rb", **OPTS)
    rb = TensorDictReplayBuffer(storage=storage).share()
    rb.extend(pong[:30])
    child = FORK.Process(target=_child_killed_mid_write, args=(rb, pong[200:220], kill_on))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, f"the child was to be killed at file event {kill_on}"
    # the store is the last commit, whole: without the dead child's write, or (killed after its
    # manifest was renamed into place) with all of it
    n = len(rb)
    assert n in (30, 50), n
    _same_rows(rb[:30], pong[:30], "rows written before the crash")
    if n == 50:
        _same_rows(rb[30:50], pong[200:220], "the dead child's committed rows")
    assert verify_store(tmp_path / "rb", progress=False).ok
    # the dead child moved TorchRL's shared writer cursor; writing at explicit rows works at once
    storage.set(torch.arange(n, n + 20), pong[300:320])
    assert len(rb) == n + 20
    _same_rows(rb[n:n + 20], pong[300:320], "rows written after the crash")
    storage.close()
    assert verify_store(tmp_path / "rb", progress=False).ok
    assert len(tiered.open(tmp_path / "rb")) == n + 20


def _extend_in_thread(rb, data, seconds: float) -> bool:
    """Whether ``rb.extend(data)`` returns within ``seconds`` (run in a daemon thread, which a
    hung extend leaves behind)."""
    import threading
    done = threading.Event()
    threading.Thread(target=lambda: (rb.extend(data), done.set()), daemon=True).start()
    return done.wait(seconds)


def test_a_killed_rb_share_writer_hangs_the_others_and_a_new_buffer_recovers(pong, tmp_path):
    """docs/torchrl.md: a writer SIGKILLed inside ``rb.extend`` of an ``rb.share()`` buffer holds
    TorchRL's own ``multiprocessing.Lock`` forever, so the others' extends wait for good (as with
    LazyMemmapStorage); the store is whole, and a new buffer over the same path goes on."""
    storage = TieredStorage(100, tmp_path / "rb", **OPTS)
    rb = TensorDictReplayBuffer(storage=storage).share()
    rb.extend(pong[:30])
    child = FORK.Process(target=_child_killed_mid_write, args=(rb, pong[200:220], 30))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    assert not _extend_in_thread(rb, pong[300:310], 3.0)  # TorchRL's lock died held: this waits for good
    storage.close()  # what to do: close the storage (tiered's own lock died with its holder)...
    rb2 = TensorDictReplayBuffer(storage=TieredStorage(100, tmp_path / "rb")).share()  # ...and rebuild
    assert len(rb2) == 30
    _same_rows(rb2[:30], pong[:30], "rows written before the crash")
    idx = rb2.extend(pong[300:310])  # where the new buffer's writer puts them
    _same_rows(rb2[idx], pong[300:310], "rows written after the crash")
    assert verify_store(tmp_path / "rb", progress=False).ok


def _store_child_killed_mid_write(path, data, kill_on: int) -> None:
    torch.set_num_threads(1)
    store = tiered.open(path, mode="r+", shared=True)
    with faults.inject_faults(kill_on=kill_on):
        store.extend(data)
    raise SystemExit(7)


def test_a_killed_store_writer_does_not_block_the_others(pong, tmp_path):
    """The alternative docs/torchrl.md names for writers that may be killed: each writes through
    a shared store, whose only lock is tiered's ``flock``, released by the kernel with its holder."""
    store = TieredStore(100, tmp_path / "s", **OPTS).share()
    store.extend(pong[:30])
    child = FORK.Process(target=_store_child_killed_mid_write, args=(str(tmp_path / "s"), pong[200:220], 30))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    store.extend(pong[300:310])  # returns: the dead child's lock went with it
    assert len(store) == 40
    _same_rows(store.get(slice(30, 40)), pong[300:310], "rows written after the crash")
    store.close()


def _child_writes(rb, queue) -> None:
    torch.set_num_threads(1)  # as DataLoader workers do: an OpenMP pool does not survive a fork
    try:
        rb.extend(TensorDict({"x": torch.ones(2)}, [2]))
        queue.put("wrote")
    except NotSharedError as e:
        queue.put(f"NotSharedError: {e}")


@pytest.mark.parametrize("options", [{}, {"shared": False}])
def test_unshared_storages_refuse_a_forked_writer(tmp_path, options):
    """An in-memory storage cannot be shared; shared=False keeps a path store to its owner."""
    path = tmp_path / "rb" if options else None
    storage = TieredStorage(10, path, **options)
    rb = ReplayBuffer(storage=storage)
    rb.extend(TensorDict({"x": torch.zeros(4)}, [4]))
    queue = FORK.Queue()
    _run([FORK.Process(target=_child_writes, args=(rb, queue))])
    answer = queue.get(timeout=10)
    assert answer.startswith("NotSharedError") and "path=DIR" in answer
    assert len(rb) == 4 and not storage.store.shared


def test_store_share_and_open_shared(tmp_path):
    """TieredStore's own API: share() in one process, open(shared=True) in another."""
    with pytest.raises(InvalidArgumentError, match="path"):
        TieredStore(8).share()
    a = TieredStore(8, tmp_path / "s").share()
    with pytest.raises(InvalidArgumentError, match="mode='r\\+'"):
        tiered.open(tmp_path / "s", mode="r", shared=True)
    b = tiered.open(tmp_path / "s", mode="r+", shared=True)
    a.extend(TensorDict({"x": torch.arange(3.0)}, [3]))
    assert len(b) == 3 and b.get(2)["x"].item() == 2.0
    b.extend(TensorDict({"x": torch.ones(2)}, [2]))
    assert len(a) == 5 and a.cursor == 5
    assert a.get(slice(None))["x"].tolist() == [0.0, 1.0, 2.0, 1.0, 1.0]
    b.close()
    a.close()
    assert tiered.open(tmp_path / "s").get(slice(None))["x"].tolist() == [0.0, 1.0, 2.0, 1.0, 1.0]


def test_another_process_commit_is_reloaded_into_the_same_store(tmp_path):
    """A shared store rebuilds its parts from the other writer's commit: the object stays, its
    counters go on, and a copy pickled while shared writes as a shared store too."""
    a = TieredStore(8, tmp_path / "s").share()
    b = tiered.open(tmp_path / "s", mode="r+", shared=True)
    a.extend(TensorDict({"x": torch.arange(3.0)}, [3]))
    rows_before = parts(a).rows
    b.extend(TensorDict({"x": torch.ones(2)}, [2]))
    assert len(a) == 5 and parts(a).rows is not rows_before  # rebuilt from b's commit
    assert a.stats()["counters"]["extends"] == 1 and a.shared
    c = pickle.loads(pickle.dumps(a))
    assert c.shared and c is not a
    c.extend(TensorDict({"x": torch.full((1,), 7.0)}, [1]))
    assert a.get(slice(None))["x"].tolist() == [0.0, 1.0, 2.0, 1.0, 1.0, 7.0]
    for s in (c, b, a):
        s.close()
    shutil.rmtree(tmp_path / "s")  # a closed shared store looks at its files no more
    with pytest.raises(StoreClosedError):
        a.get(0)


def test_a_failed_call_of_a_shared_store_leaves_the_last_commit(tmp_path):
    """A call whose commit fails (a full disk) or that fails part-way is not committed, and the
    next call starts again from the last commit."""
    a = TieredStore(8, tmp_path / "s").share()
    a.extend(TensorDict({"x": torch.arange(3.0)}, [3]))
    with faults.inject_faults(enospc_on=1), pytest.raises(StorageFullError):
        a.extend(TensorDict({"x": torch.full((2,), 9.0)}, [2]))  # in memory, then its commit fails
    assert len(a) == 3 and a.cursor == 3
    with pytest.raises(SchemaMismatchError):
        a.extend(TensorDict({"y": torch.zeros(2)}, [2]))
    assert len(a) == 3 and a.cursor == 3
    a.extend(TensorDict({"x": torch.full((2,), 5.0)}, [2]))
    assert a.get(slice(None))["x"].tolist() == [0.0, 1.0, 2.0, 5.0, 5.0]
    a.close()
    assert tiered.open(tmp_path / "s").get(slice(None))["x"].tolist() == [0.0, 1.0, 2.0, 5.0, 5.0]


def _spawned_extends(rb, queue) -> None:
    queue.put(rb.extend(TensorDict({"x": torch.arange(5.0) + 10}, [5])).numpy())


@pytest.mark.slow  # a spawned interpreter imports torch and torchrl: tens of seconds on a busy machine
def test_spawned_writer(tmp_path):
    ctx = mp.get_context("spawn")
    rb = ReplayBuffer(storage=TieredStorage(20, tmp_path / "rb")).share()
    rb.extend(TensorDict({"x": torch.arange(5.0)}, [5]))
    queue = ctx.Queue()
    proc = ctx.Process(target=_spawned_extends, args=(rb, queue))
    proc.start()
    index = queue.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and index.tolist() == [5, 6, 7, 8, 9]
    assert len(rb) == 10 and rb[:]["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 10.0, 11.0, 12.0, 13.0, 14.0]


def test_in_memory_storage_pickles_while_a_view_is_alive(pong):
    """storage[:] hands out views of the dense columns; a copy must not try to take them along
    (TorchRL's Sequence sample unit keeps one while the buffer goes to a spawned process)."""
    storage = TieredStorage(50, **OPTS)
    storage.set(range(20), pong[:20])
    view = storage[:]
    copy = pickle.loads(pickle.dumps(storage))
    _same_rows(copy[:], view, "rows of the copy")


def _child_reports_write_error(storage, data, queue) -> None:
    torch.set_num_threads(1)
    try:
        storage.set(torch.arange(2), data)
        queue.put("wrote")
    except NotSharedError as e:
        queue.put(str(e))


def test_a_storage_that_could_not_be_shared_says_why_in_the_child(pong, tmp_path):
    # its store is read-only: the fork hook cannot share it; the child's write must say so, and why
    owner = TieredStorage(200, tmp_path / "rb", **OPTS)
    owner.set(torch.arange(4), pong[:4])
    owner.close()
    storage = TieredStorage(200, tmp_path / "rb", mode="r")
    storage.share_with_children(storage._owner_pid)  # noqa: SLF001 - what the fork hook calls
    queue = FORK.Queue()
    child = FORK.Process(target=_child_reports_write_error, args=(storage, pong[:2], queue))
    child.start()
    child.join(timeout=120)
    message = queue.get(timeout=5)
    assert "could not be shared" in message and "ReadOnlyStoreError" in message
