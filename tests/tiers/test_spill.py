"""Stores without a path spill to a temporary cold tier when their memory budgets are full.

Float32 4x84x84 stacks of noise (113 kB per row, incompressible) and a 4 MiB warm budget force
the spill with a few hundred rows. The spill directory's life is checked with real processes:
closed, exited, SIGKILLed (its directory then removed by the next process that spills), forked.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, check_refcounts
from tensordict import TensorDict

from tiered import TieredStore
from tiered.cli import main
from tiered.engine.blob_index import COLD, HOT, WARM
from tiered.errors import InvalidArgumentError, StorageFullError
from tiered.testing import parts
from tiered.testing.faults import inject_faults
from tiered.tiers.spill import OWNER_LOCK, SPILL_PREFIX, SpillDir, remove_abandoned

ROW = (4, 84, 84)  # a float32 frame stack, as TorchRL's DQN Atari example stores it: 112,896 bytes


def noise_rows(n: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"observation": torch.randn(n, *ROW, generator=g),
                       "action": torch.randint(0, 6, (n,), generator=g),
                       "reward": torch.randn(n, generator=g)}, batch_size=[n])


def spill_dirs(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(SPILL_PREFIX))


def one_tier_each(store: TieredStore) -> None:
    """Exclusive tiers: every stored blob is in exactly one of hot, warm and spill."""
    idx = parts(store).index
    live = idx.live_ids()
    stored = live[idx.state[live] != 1]  # 1: an open chunk, raw in memory
    held = (idx.loc[stored][:, [HOT, WARM, COLD]] >= 0).sum(1)
    assert (held == 1).all(), np.bincount(held)


def test_spills_past_the_warm_budget_and_reads_back_bit_exact(tmp_path):
    data = noise_rows(400)
    store = TieredStore(300, warm_bytes="4MiB", spill_dir=tmp_path)
    assert spill_dirs(tmp_path) == []  # made at the first spill, not before
    for i in range(0, 300, 50):
        store.extend(data[i:i + 50])
    st = store.stats()["tiers"]
    assert st["warm"]["bytes_used"] <= st["warm"]["budget"] == 4 << 20
    assert st["spill"]["bytes_used"] > 6 * (4 << 20)  # ~31 MB of compressed noise; all but 4 MiB spilled
    assert st["spill"]["budget"] is None
    assert os.path.dirname(st["spill"]["dir"]) == str(tmp_path)
    assert spill_dirs(tmp_path) == [os.path.basename(st["spill"]["dir"])]
    one_tier_each(store)
    rng = np.random.default_rng(0)
    for _ in range(5):
        idx = torch.as_tensor(rng.integers(0, 300, size=32))
        assert_td_equal(store.get(idx), data[idx])
    st = store.stats()["tiers"]
    assert st["spill"]["hits"] > 0 and st["warm"]["promotions"] > 0  # sampled blobs move up, victims down
    assert st["warm"]["bytes_used"] <= st["warm"]["budget"]
    one_tier_each(store)
    # the ring wraps: overwritten rows free their spilled blobs at once, and the space is reused
    reserved = parts(store).tiers[COLD].stats()["bytes_reserved"]
    for rep in range(3):
        store.extend(noise_rows(100, seed=rep + 1))
    assert parts(store).tiers[COLD].stats()["bytes_reserved"] <= reserved + (16 << 20)
    for rep in range(3):
        assert_td_equal(store.get(torch.arange(rep * 100, rep * 100 + 100)), noise_rows(100, seed=rep + 1))
    check_refcounts(store)
    one_tier_each(store)
    store.close()
    assert spill_dirs(tmp_path) == []


def test_a_batch_larger_than_every_budget_goes_straight_to_the_spill_tier(tmp_path):
    data = noise_rows(64)
    store = TieredStore(64, warm_bytes="1MiB", hot_device="cpu", hot_bytes="512KiB", spill_dir=tmp_path)
    store.extend(data)  # 7 MB in one write: neither memory tier can take the batch
    st = store.stats()["tiers"]
    assert st["spill"]["blobs"] > 0 and st["spill"]["bytes_used"] >= 6 << 20
    assert_td_equal(store.get(torch.arange(64)), data)
    one_tier_each(store)
    store.close()


def test_close_removes_the_spill_directory_and_clear_keeps_it_usable(tmp_path):
    store = TieredStore(100, warm_bytes="1MiB", spill_dir=tmp_path)
    store.extend(noise_rows(40))
    d = store.stats()["tiers"]["spill"]["dir"]
    assert sorted(os.listdir(d))[0] == OWNER_LOCK and any(n.startswith("seg-") for n in os.listdir(d))
    assert open(os.path.join(d, OWNER_LOCK)).read().strip() == str(os.getpid())
    store.clear()
    assert store.stats()["tiers"]["spill"]["bytes_used"] == 0
    store.extend(noise_rows(40, seed=5))
    assert_td_equal(store.get(torch.arange(40)), noise_rows(40, seed=5))
    store.close()
    assert not os.path.exists(d)
    store.close()  # idempotent


def test_spill_false_raises_storage_full_and_makes_no_directory(tmp_path):
    store = TieredStore(100, warm_bytes="1MiB", spill=False, spill_dir=None)
    store.extend(noise_rows(4))
    before = store.get(torch.arange(4))
    with pytest.raises(StorageFullError, match="spill=True"):
        store.extend(noise_rows(40, seed=1))
    assert len(store) == 4 and store.cursor == 4
    assert_td_equal(store.get(torch.arange(4)), before)
    assert "spill" not in store.stats()["tiers"]


def test_spill_options_are_checked_before_anything_is_made(tmp_path):
    f = tmp_path / "a-file"
    f.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        TieredStore(10, spill_dir=f)
    with pytest.raises(InvalidArgumentError, match="without a path"):
        TieredStore(10, tmp_path / "store", spill_dir=tmp_path / "spill")
    assert not (tmp_path / "store").exists()
    with pytest.raises(InvalidArgumentError, match="spill=False"):
        TieredStore(10, spill=False, spill_dir=tmp_path)
    with pytest.raises(InvalidArgumentError, match="True or False"):
        TieredStore(10, spill="yes")


def test_full_disk_during_a_spill_leaves_the_store_unchanged(tmp_path):
    store = TieredStore(400, warm_bytes="4MiB", spill_dir=tmp_path, stage_rows=0)
    data = noise_rows(200)
    store.extend(data[:100])  # spilled already: the spill tier exists
    before = store.get(torch.arange(100))
    used = {k: v["bytes_used"] for k, v in store.stats()["tiers"].items()}
    for faults in ({"quota_bytes": 0}, {"enospc_on": 1}, {"enospc_on": 3}):
        with inject_faults(**faults), pytest.raises(StorageFullError) as e:
            store.extend(data[100:200])
        assert str(tmp_path) in str(e.value), e.value  # names where it tried to spill
        assert len(store) == 100 and store.cursor == 100
        assert_td_equal(store.get(torch.arange(100)), before)
        check_refcounts(store)
        one_tier_each(store)
        assert store.stats()["tiers"]["spill"]["bytes_used"] <= used["spill"] + 1_000_000  # victims only
    # space is back: the write goes through
    store.extend(data[100:200])
    assert_td_equal(store.get(torch.arange(200)), data)
    store.close()
    assert spill_dirs(tmp_path) == []


def test_full_disk_at_the_first_spill_makes_no_directory(tmp_path):
    store = TieredStore(400, warm_bytes="4MiB", spill_dir=tmp_path, stage_rows=0)
    data = noise_rows(60)
    store.extend(data[:20])  # fits in warm: nothing spilled yet
    before = store.get(torch.arange(20))
    with inject_faults(quota_bytes=0), pytest.raises(StorageFullError):
        store.extend(data[20:60])
    assert len(store) == 20
    assert_td_equal(store.get(torch.arange(20)), before)
    assert spill_dirs(tmp_path) == []  # the half-made directory was removed
    store.extend(data[20:60])
    assert_td_equal(store.get(torch.arange(60)), data)
    store.close()


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


SPILLER = """
    import os, sys, time, torch
    from tensordict import TensorDict
    from tiered import TieredStore
    store = TieredStore(100, warm_bytes="1MiB", spill_dir=sys.argv[1])
    store.extend(TensorDict({"x": torch.randn(30, 4, 84, 84)}, [30]))
    print(store.stats()["tiers"]["spill"]["dir"], flush=True)
    if sys.argv[2] == "wait":
        time.sleep(120)
"""


def test_interpreter_exit_removes_the_spill_directory(tmp_path):
    child = _child(SPILLER, str(tmp_path), "exit")  # exits without close()
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    d = out.strip().splitlines()[-1]
    assert os.path.basename(d).startswith(SPILL_PREFIX)
    assert not os.path.exists(d) and spill_dirs(tmp_path) == []


def test_a_killed_owners_directory_is_removed_by_the_next_spill_and_a_live_ones_is_kept(tmp_path, capsys):
    dead = _child(SPILLER, str(tmp_path), "wait")
    live = _child(SPILLER, str(tmp_path), "wait")
    try:
        dead_dir = dead.stdout.readline().strip()
        live_dir = live.stdout.readline().strip()
        assert os.path.isdir(dead_dir) and os.path.isdir(live_dir), (dead.stderr, live.stderr)
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=60)
        assert os.path.isdir(dead_dir)  # SIGKILL ran no clean-up
        # tiered info shows both: owner, whether it runs, bytes on disk
        assert main(["info", str(tmp_path), "--json"]) == 0
        found = {d["dir"]: d for d in json.loads(capsys.readouterr().out)["spill"]}
        assert found.keys() == {dead_dir, live_dir}
        assert found[live_dir]["owner_pid"] == live.pid and found[live_dir]["owner_alive"]
        assert found[dead_dir]["owner_pid"] == dead.pid and not found[dead_dir]["owner_alive"]
        assert found[dead_dir]["segments"] == 1 and found[dead_dir]["bytes"] >= 2_000_000
        assert main(["info", dead_dir]) == 0
        out = capsys.readouterr().out
        assert dead_dir in out and "dead" in out and "MiB" in out and live_dir not in out
        # the next process that spills removes the dead owner's directory, never the live one's
        store = TieredStore(100, warm_bytes="1MiB", spill_dir=tmp_path)
        store.extend(noise_rows(30))
        mine = store.stats()["tiers"]["spill"]["dir"]
        assert not os.path.exists(dead_dir)
        assert os.path.isdir(live_dir) and os.listdir(live_dir)
        assert sorted(spill_dirs(tmp_path)) == sorted(os.path.basename(d) for d in (live_dir, mine))
        store.close()
    finally:
        live.kill()
        live.wait(timeout=60)
        dead.kill()
    assert remove_abandoned(tmp_path) == [live_dir]
    assert spill_dirs(tmp_path) == []


def test_a_directory_being_made_or_without_an_owner_is_not_removed(tmp_path):
    # a lock file not yet holding its owner's pid: its creator is between open and flock
    fresh = tmp_path / f"{SPILL_PREFIX}fresh"
    fresh.mkdir()
    (fresh / OWNER_LOCK).write_bytes(b"")
    # no lock file at all, but recent: its creator is between mkdtemp and the lock file
    bare = tmp_path / f"{SPILL_PREFIX}bare"
    bare.mkdir()
    # a lock file that never got its owner's pid, from long ago: its creator died before writing it
    stale = tmp_path / f"{SPILL_PREFIX}stale"
    stale.mkdir()
    (stale / OWNER_LOCK).write_bytes(b"")
    # a directory of another name is never looked at
    other = tmp_path / "tiered-model-x"
    other.mkdir()
    (other / OWNER_LOCK).write_text("1\n")
    d = SpillDir(tmp_path)
    assert fresh.is_dir() and bare.is_dir() and other.is_dir()
    old = 1_000_000_000
    assert stale.is_dir()
    os.utime(bare, (old, old))  # unfinished directories from long ago: their creators died
    os.utime(stale, (old, old))
    assert sorted(remove_abandoned(tmp_path)) == sorted([str(bare), str(stale)])
    assert fresh.is_dir() and os.path.isdir(d.path)
    d.remove()
    assert not os.path.exists(d.path)


FORKER = """
    import os, sys, torch
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork (DataLoader workers do the same)
    from tensordict import TensorDict
    from tiered import TieredStore
    from tiered.errors import NotSharedError
    store = TieredStore(100, warm_bytes="1MiB", spill_dir=sys.argv[1])
    x = torch.randn(30, 4, 84, 84)
    store.extend(TensorDict({"x": x}, [30]))
    d = store.stats()["tiers"]["spill"]["dir"]
    pid = os.fork()
    if pid == 0:  # the child reads, may not write, and exits normally (atexit runs here too)
        ok = bool((store.get(torch.arange(30))["x"] == x).all())
        try:  # 40 rows: more than the write stage takes, so the write goes to the tiers at once
            store.extend(TensorDict({"x": torch.randn(40, 4, 84, 84)}, [40]))
            refused = False
        except NotSharedError:
            refused = True
        try:  # one row waits in the write stage: refused at once too, not at a later flush
            store.extend(TensorDict({"x": torch.randn(1, 4, 84, 84)}, [1]))
            staged_refused = False
        except NotSharedError:
            staged_refused = True
        sys.exit(0 if ok and refused and staged_refused and len(store) == 30 else 3)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), os.path.isdir(d), flush=True)
    print(bool((store.get(torch.arange(30))["x"] == x).all()), flush=True)
"""


def test_a_forked_copy_reads_never_writes_and_never_removes_the_parents_directory(tmp_path):
    child = _child(FORKER, str(tmp_path))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    lines = out.split("\n")
    assert lines[0] == "0 True", (out, err)  # the child's exit left the parent's directory alone
    assert lines[1] == "True"
    assert spill_dirs(tmp_path) == []  # the parent's own exit removed it


FORK_OVERWRITER = """
    import os, sys, torch
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork
    from tensordict import TensorDict
    from tiered.errors import NotSharedError
    from tiered.torchrl import TieredStorage
    storage = TieredStorage(100, warm_bytes="1MiB", spill_dir=sys.argv[1])
    store = storage.store
    x = torch.randn(30, 4, 84, 84)
    store.extend(TensorDict({"x": x}, [30]))
    assert store.stats()["tiers"]["spill"]["bytes_used"] > 0  # spilled: the child shares its files
    pid = os.fork()
    if pid == 0:  # the child overwrites rows it already holds: each write is refused at once
        refused = []
        for write in (  # 40 rows go to the tiers at once; one row would wait in the write stage
            lambda: store.set(torch.arange(40) % 30, TensorDict({"x": torch.randn(40, 4, 84, 84)}, [40])),
            lambda: store.set(5, TensorDict({"x": torch.randn(4, 84, 84)}, [])),
            lambda: storage.set(torch.arange(3, 13), TensorDict({"x": torch.zeros(10, 4, 84, 84)}, [10]),
                                set_cursor=False),
            lambda: storage.set(7, TensorDict({"x": torch.zeros(4, 84, 84)}, []), set_cursor=False),
            store.clear,  # refused before it forgets a row
        ):
            try:
                write()
                refused.append(False)
            except NotSharedError:
                refused.append(True)
        same = bool(torch.equal(store.get(torch.arange(30))["x"], x))
        os._exit(0 if all(refused) and same and len(store) == 30 else 3)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
    print(bool(torch.equal(store.get(torch.arange(30))["x"], x)), flush=True)
    store.set(5, TensorDict({"x": x[6]}, []))  # the parent still writes
    print(bool(torch.equal(store.get(5)["x"], x[6])), flush=True)
"""


def test_a_forked_copy_may_not_overwrite_rows(tmp_path):
    pytest.importorskip("torchrl")
    child = _child(FORK_OVERWRITER, str(tmp_path))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    # the child's overwrites (store.set and TieredStorage.set, to the tiers and to the write
    # stage) were all refused, and the parent reads its rows back bit for bit
    assert out.split("\n")[:3] == ["0", "True", "True"], (out, err)
    assert spill_dirs(tmp_path) == []


def test_a_pickled_copy_spills_to_a_directory_of_its_own(tmp_path):
    data = noise_rows(60)
    store = TieredStore(100, warm_bytes="1MiB", spill_dir=tmp_path)
    store.extend(data)
    copy = pickle.loads(pickle.dumps(store))
    a, b = store.stats()["tiers"]["spill"]["dir"], copy.stats()["tiers"]["spill"]["dir"]
    assert a != b and os.path.dirname(b) == str(tmp_path)
    assert_td_equal(copy.get(torch.arange(60)), data)
    copy.extend(noise_rows(40, seed=9))  # the copy writes its own directory
    store.close()
    assert not os.path.exists(a)
    assert_td_equal(copy.get(torch.arange(60)), data)
    assert_td_equal(copy.get(torch.arange(60, 100)), noise_rows(40, seed=9))
    copy.close()
    assert spill_dirs(tmp_path) == []


def test_torchrl_storage_spills_and_samples(tmp_path):
    pytest.importorskip("torchrl")
    from torchrl.data import ReplayBuffer

    from tiered.torchrl import TieredStorage

    storage = TieredStorage(300, warm_bytes="4MiB", spill_dir=tmp_path)
    rb = ReplayBuffer(storage=storage, batch_size=32)
    data = noise_rows(300)
    for i in range(0, 300, 100):
        rb.extend(data[i:i + 100])
    batch, info = rb.sample(return_info=True)
    assert_td_equal(batch, data[torch.as_tensor(info["index"])])
    st = storage.stats()["tiers"]
    assert st["spill"]["bytes_used"] > 6 * (4 << 20) and st["warm"]["bytes_used"] <= 4 << 20
    d = st["spill"]["dir"]
    storage.close()
    assert not os.path.exists(d)


def test_torchrl_scratch_dir_names_spill_dir(tmp_path):
    pytest.importorskip("torchrl")
    from tiered.torchrl import TieredStorage

    with pytest.raises(InvalidArgumentError, match="spill_dir="):
        TieredStorage(100, scratch_dir=tmp_path)


def test_stats_name_the_spill_tier_and_its_directory(tmp_path):
    store = TieredStore(100, warm_bytes="1MiB", spill_dir=tmp_path)
    store.extend(noise_rows(30))
    st = store.stats()
    json.dumps(st)  # plain values
    spill = st["tiers"]["spill"]
    assert set(spill) >= {"bytes_used", "budget", "blobs", "hits", "promotions", "demotions", "dir",
                          "probability_mass"}
    assert "cold" not in st["tiers"]
    assert sum(t["probability_mass"] for t in st["tiers"].values()) + st["priority"]["in_memory_raw"] == \
        pytest.approx(1.0)
    store.close()


def test_a_spill_dir_that_cannot_be_made_refuses_the_write_and_changes_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    store = TieredStore(100, warm_bytes="1MiB", spill_dir=blocker / "spill")  # made only at the first spill
    store.extend(noise_rows(4))
    before = store.get(torch.arange(4))
    with pytest.raises(InvalidArgumentError, match="spill_dir="):
        store.extend(noise_rows(40, seed=1))
    assert len(store) == 4 and store.cursor == 4
    assert_td_equal(store.get(torch.arange(4)), before)
    check_refcounts(store)
    assert "spill" not in store.stats()["tiers"]
    store.close()


FORK_WHILE_WRITING = """
    import os, sys, torch
    torch.set_num_threads(1)
    from tensordict import TensorDict
    from tiered import TieredStore
    from tiered.errors import StaleReadError
    store = TieredStore(30, warm_bytes="1MiB", spill_dir=sys.argv[1], verify=sys.argv[2] == "on")
    x = torch.randn(30, 4, 84, 84)
    store.extend(TensorDict({"x": x}, [30]))
    r, w = os.pipe()
    r_first, w_first = os.pipe()  # the child's first read is done: only then does the parent write
    pid = os.fork()
    if pid == 0:
        first = bool((store.get(torch.arange(30))["x"] == x).all())
        os.write(w_first, b"r")
        os.read(r, 1)
        try:
            store.get(torch.arange(30))
            outcome = "returned"
        except StaleReadError:
            outcome = "stale"
        print(first, outcome, flush=True)
        os._exit(0)
    os.read(r_first, 1)
    for _ in range(4):  # overwrites every row: spill space is freed and reused
        store.extend(TensorDict({"x": torch.randn(30, 4, 84, 84)}, [30]))
    os.write(w, b"g")
    os.waitpid(pid, 0)
    store.close()
"""


@pytest.mark.parametrize("verify", ["on", "off"])
def test_a_forked_copy_never_reads_space_its_parent_reused(tmp_path, verify):
    child = _child(FORK_WHILE_WRITING, str(tmp_path), verify)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    # its fork-time rows while the parent had freed nothing; then the reopen error, never a
    # ChecksumError (nothing is damaged) nor, without checksums, another row's bytes
    assert out.split() == ["True", "stale"], (out, err)
