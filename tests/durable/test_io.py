"""The file-write seam (tiered/util/fileio.py): full disks, I/O errors and simulated power loss.

Faults are injected through :func:`tiered.util.faults.inject_faults`, never by replacing a component:
real files in ``tmp_path``, real tiers. Crash tests fork a child that writes with an undo log
and is SIGKILLed (by itself, or at the N-th write event); the parent then applies the power
loss with :func:`tiered.util.faults.apply_power_loss` and checks what is left.
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import traceback

import numpy as np
import pytest

from tiered.errors import StorageFullError
from tiered.testing import faults
from tiered.tiers import HDF5Tier, MemmapTier
from tiered.util import fileio
from tiered.util.units import align

SEG = 64 << 10


def _blobs(rng, n, lo=100, hi=3000):
    sizes = rng.integers(lo, hi, n).astype(np.int64)
    data = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    return data, np.cumsum(sizes) - sizes, sizes


def _read(t, offsets, sizes) -> list[bytes]:
    out_off = np.cumsum(sizes) - sizes
    out = np.zeros(int(sizes.sum()), np.uint8)
    t.read(offsets, sizes, out, out_off)
    return [out[o:o + s].tobytes() for o, s in zip(out_off, sizes, strict=True)]


def _expect(data, src_off, sizes) -> list[bytes]:
    return [data[o:o + s].tobytes() for o, s in zip(src_off, sizes, strict=True)]


def _in_child(fn) -> tuple[str, int]:
    """Run ``fn`` in a forked child; return ("killed", signal) or ("exited", status)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed", os.WTERMSIG(status)
    return "exited", os.WEXITSTATUS(status)


@pytest.fixture(params=["memmap", "hdf5"])
def cold_cls(request):
    return MemmapTier if request.param == "memmap" else HDF5Tier


def _filled(cold_cls, directory, n=40, seed=0):
    t = cold_cls(directory, segment_bytes=SEG, threads=2)
    data, src_off, sizes = _blobs(np.random.default_rng(seed), n)
    off = t.allocate(sizes)
    t.write(off, data, src_off, sizes)
    t.flush()
    return t, off, sizes, _expect(data, src_off, sizes)


# --------------------------------------------------------------------------- full disk, EIO


def test_full_disk_at_allocate_leaves_tier_unchanged_and_readable(cold_cls, tmp_path):
    t, off, sizes, expect = _filled(cold_cls, str(tmp_path / "c"))
    before = t.state()
    data, src_off, s2 = _blobs(np.random.default_rng(1), 200)  # needs new segments
    with faults.inject_faults(enospc_on=1), pytest.raises(StorageFullError) as e:
        t.allocate(s2)
    assert e.value.errno == errno.ENOSPC and "seg-" in str(e.value)
    after = t.state()
    for k in ("high_water", "bytes_used", "segment_sizes"):
        assert before[k] == after[k]
    assert _read(t, off, sizes) == expect
    # the cause is fixed: writes work again
    o2 = t.allocate(s2)
    t.write(o2, data, src_off, s2)
    t.flush()
    assert _read(t, o2, s2) == _expect(data, src_off, s2)
    t.close()


def test_full_disk_by_quota(cold_cls, tmp_path):
    t, off, sizes, expect = _filled(cold_cls, str(tmp_path / "c"))
    used = t.bytes_used
    with faults.inject_faults(quota_bytes=1000) as inj, pytest.raises(StorageFullError, match="quota"):
        t.allocate(np.full(100, 2000))
    assert inj.ops >= 1
    assert t.bytes_used == used
    assert _read(t, off, sizes) == expect
    t.close()


def test_full_disk_at_write_keeps_tier_readable(cold_cls, tmp_path):
    t, off, sizes, expect = _filled(cold_cls, str(tmp_path / "c"))
    data, src_off, s2 = _blobs(np.random.default_rng(2), 30)
    o2 = t.allocate(s2)
    with faults.inject_faults(enospc_on=1), pytest.raises(StorageFullError):
        t.write(o2, data, src_off, s2)
    assert _read(t, off, sizes) == expect
    t.free(o2, s2, defer=False)  # never committed: reusable at once
    o3 = t.allocate(s2)
    t.write(o3, data, src_off, s2)
    assert _read(t, o3, s2) == _expect(data, src_off, s2)
    t.close()


def test_io_error_on_nth_write(tmp_path):
    fd = fileio.open_for_write(tmp_path / "f")
    with faults.inject_faults(eio_on=2) as inj:
        fileio.pwrite(fd, b"a", 0)
        with pytest.raises(OSError) as e:
            fileio.pwrite(fd, b"b", 1)
        assert e.value.errno == errno.EIO and not isinstance(e.value, StorageFullError)
        fileio.pwrite(fd, b"c", 1)  # only the N-th one fails
        assert inj.writes == 3
    fileio.close(fd)
    assert (tmp_path / "f").read_bytes() == b"ac"


def test_hdf5_segment_creation_on_full_disk_leaves_no_file(tmp_path):
    t, off, sizes, expect = _filled(HDF5Tier, str(tmp_path / "c"))
    n_seg = len(t.segments)
    with faults.inject_faults(enospc_on=2), pytest.raises(StorageFullError):
        t.allocate(np.full(60, 2000))  # the first new segment's HDF5 metadata write fails
    assert not os.path.exists(t.segment_path(n_seg))
    assert _read(t, off, sizes) == expect
    t.allocate(np.full(60, 2000))
    t.close()


def test_fallocate_reserves_and_pwrite_loops(tmp_path):
    fd = fileio.open_for_write(tmp_path / "f")
    fileio.fallocate(fd, 0, 1 << 20)
    st = os.fstat(fd)
    assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20
    big = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    fileio.pwrite(fd, big, 100)
    fileio.fsync(fd)
    fileio.truncate(fd, 50)
    fileio.close(fd)
    assert os.path.getsize(tmp_path / "f") == 50


# --------------------------------------------------------------------------- power loss


def test_power_loss_drops_unsynced_writes(tmp_path):
    a, b, c, d = (str(tmp_path / x) for x in "abcd")
    with open(b, "wb") as f:  # B exists, durable, before the child runs
        f.write(b"old-B")
        os.fsync(f.fileno())
    log = str(tmp_path / "undo.log")

    def child():
        with faults.inject_faults(undo_log=log):
            fa = fileio.open_for_write(a)
            fileio.pwrite(fa, b"A" * 5000, 0)
            fileio.fsync(fa)
            fileio.fsync_dir(str(tmp_path))
            fileio.pwrite(fa, b"late", 0)  # after the fsync: lost
            fb = fileio.open_for_write(b)
            fileio.pwrite(fb, b"new-B and longer", 0)
            fc = fileio.open_for_write(c)  # created, never synced
            fileio.pwrite(fc, b"C", 0)
            fd = fileio.open_for_write(d)  # data synced, but its name never was
            fileio.pwrite(fd, b"D", 0)
            fileio.fsync(fd)
            os.kill(os.getpid(), signal.SIGKILL)

    assert _in_child(child) == ("killed", signal.SIGKILL)
    # before the power loss the page cache still shows everything
    assert open(b, "rb").read() == b"new-B and longer"
    assert faults.apply_power_loss(log) > 0
    assert open(a, "rb").read() == b"A" * 5000
    assert open(b, "rb").read() == b"old-B"
    assert not os.path.exists(c) and not os.path.exists(d)


@pytest.mark.parametrize("old", [None, b"old content " * 100])
def test_write_file_atomic_leaves_old_or_new_at_every_crash_point(tmp_path, old):
    path = str(tmp_path / "manifest.json")
    new = b"new content " * 300
    outcomes = set()
    for k in range(1, 100):
        if old is None:
            if os.path.exists(path):
                os.remove(path)
        else:
            with open(path, "wb") as f:
                f.write(old)
        log = str(tmp_path / f"undo-{k}.log")

        def child(k=k, log=log):
            with faults.inject_faults(undo_log=log, kill_on=k):
                fileio.write_file_atomic(path, new)

        how, _ = _in_child(child)
        assert how in ("killed", "exited")
        faults.apply_power_loss(log)
        content = open(path, "rb").read() if os.path.exists(path) else None
        assert content in (old, new), f"crash point {k}: torn manifest"
        assert sorted(os.listdir(tmp_path)) == sorted(
            [f"undo-{j}.log" for j in range(1, k + 1)] + ([] if content is None else ["manifest.json"])
        ), "a temp file survived the crash"
        outcomes.add(content == new)
        if how == "exited":
            assert content == new  # it completed: durable
            print(f"write_file_atomic: {k - 1} crash points")
            break
    else:
        pytest.fail("write_file_atomic never completed")
    assert outcomes == {False, True}


def test_cold_tier_flush_survives_power_loss_at_every_crash_point(cold_cls, tmp_path):
    """Flushed blobs survive a crash at any write event; the last flushed state reopens exactly."""
    d = str(tmp_path / "c")
    t, off0, s0, e0 = _filled(cold_cls, d, n=20)
    state_file = str(tmp_path / "state.pkl")

    def publish(state, blobs):
        # stands in for the manifest commit (made durable by other means in this test)
        with open(state_file + ".tmp", "wb") as f:
            pickle.dump((state, blobs), f)
        os.replace(state_file + ".tmp", state_file)

    publish(t.state(), [(off0, s0, e0)])
    t.close()
    rng = np.random.default_rng(5)
    batches = [_blobs(rng, 25) for _ in range(3)]
    completed = False
    for k in range(1, 400):
        with open(state_file, "rb") as f:
            state, blobs = pickle.load(f)
        log = str(tmp_path / "undo.log")
        if os.path.exists(log):
            os.remove(log)

        def child(state=state, blobs=blobs, log=log, k=k):
            with faults.inject_faults(undo_log=log, kill_on=k):
                w = cold_cls.open(d, state, "r+")
                published = list(blobs)
                for data, src_off, sizes in batches:
                    o = w.allocate(sizes)
                    w.write(o, data, src_off, sizes)
                    w.flush()
                    published.append((o, sizes, _expect(data, src_off, sizes)))
                    publish(w.state(), published)
                    w.release_deferred()

        how, code = _in_child(child)
        assert (how, code) in (("killed", signal.SIGKILL), ("exited", 0))
        faults.apply_power_loss(log)
        with open(state_file, "rb") as f:
            state_now, blobs_now = pickle.load(f)
        r = cold_cls.open(d, state_now, "r")
        for o, s, e in blobs_now:
            assert _read(r, o, s) == e, f"crash point {k}: flushed blobs lost"
        r.close()
        if how == "exited":
            completed = True
            assert len(blobs_now) == 1 + len(batches)
            assert k > 10  # the child went through many crash points first
            print(f"{cold_cls.__name__}: {k - 1} crash points")
            break
        # start the next crash point from the original commit again
        publish(state, blobs)
    assert completed
    assert int(align(s0).sum()) > 0
