"""Tiers: every tier runs the TierTests conformance suite (tiered.testing) of the Tier contract
(tiered/tiers/base.py), and below it the tests particular to one tier.

Tiers under the suite: HostTier, DeviceTier on the CPU (standing in for CUDA), MemmapTier and
HDF5Tier on real files in ``tmp_path``, and DeviceTier on CUDA when a GPU is present. Plus the
cold tiers' files and reopening, the arenas' growth, unit tests of the extent allocator,
byte-size parsing and the batched copy.
"""

from __future__ import annotations

import os
import pickle
import threading

import h5py
import numpy as np
import pytest
import torch

from tiered.errors import CorruptionError, ReadOnlyStoreError, StorageFullError
from tiered.testing import TierTests
from tiered.tiers import (
    DeviceTier,
    ExtentAllocator,
    HDF5Tier,
    HostTier,
    MemmapTier,
    SpillTier,
    Tier,
    default_budgets,
)
from tiered.tiers.arena import inject_oom
from tiered.tiers.memmap import GROW_MIN, GROW_STEP
from tiered.util.batch import extents_overlap
from tiered.util.copy import copy_blobs, copy_tensor_blobs
from tiered.util.units import align, parse_bytes

# Small segments so that batches cross segment boundaries.
SEG = 64 << 10
COLD = ("memmap", "hdf5")


def batch(rng, n: int, lo: int = 0, hi: int = 3000):
    """A codec-style batch: random blobs packed back to back in one buffer."""
    sizes = rng.integers(lo, hi, n).astype(np.int64)
    data = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    return data, np.cumsum(sizes) - sizes, sizes


def blobs_of(data, offsets, sizes) -> list[bytes]:
    return [data[o:o + s].tobytes() for o, s in zip(offsets, sizes, strict=True)]


def read_back(t: Tier, offsets, sizes, out_kind: str = "numpy", order=None) -> list[bytes]:
    """Read blobs into a packed output (optionally in another order); return their bytes."""
    offsets, sizes = np.asarray(offsets), np.asarray(sizes)
    order = np.arange(len(sizes)) if order is None else order
    o, s = offsets[order], sizes[order]
    out_off = np.cumsum(s) - s
    if out_kind == "numpy":
        out = np.full(int(s.sum()), 0xAB, dtype=np.uint8)
    else:
        out = torch.full((int(s.sum()),), 0xAB, dtype=torch.uint8,
                         device="cuda" if out_kind == "cuda" else "cpu")
    t.read(o, s, out, out_off)
    host = out if isinstance(out, np.ndarray) else out.cpu().numpy()
    got = blobs_of(host, out_off, s)
    res: list[bytes] = [b""] * len(sizes)
    for k, i in enumerate(order):
        res[i] = got[k]
    return res


# --------------------------------------------------------------------------- conformance


class TestHostTier(TierTests):
    def make_tier(self, tmp_path, budget: int | None) -> Tier:
        return HostTier(budget if budget is not None else 64 << 20)


class TestDeviceTierOnCpu(TierTests):
    def make_tier(self, tmp_path, budget: int | None) -> Tier:
        return DeviceTier(budget if budget is not None else 64 << 20, device="cpu")


# The conftest skips `cuda` tests without a GPU; the skipif keeps that true without it.
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestDeviceTierOnCuda(TierTests):
    def make_tier(self, tmp_path, budget: int | None) -> Tier:
        return DeviceTier(budget if budget is not None else 64 << 20, device="cuda")


class TestMemmapTier(TierTests):
    durable = True

    def make_tier(self, tmp_path, budget: int | None) -> Tier:
        return MemmapTier(os.path.join(tmp_path, "cold"), segment_bytes=SEG, threads=4, budget=budget)


class TestHDF5Tier(TierTests):
    durable = True

    def make_tier(self, tmp_path, budget: int | None) -> Tier:
        return HDF5Tier(os.path.join(tmp_path, "cold"), segment_bytes=SEG, threads=4, budget=budget)


class TestSpillTier(TierTests):
    durable = False  # a store's scratch space: freed space is reused at once, nothing is committed

    def make_tier(self, tmp_path, budget: int | None) -> Tier:
        return SpillTier(tmp_path, segment_bytes=SEG, threads=4, budget=budget)


# --------------------------------------------------------------------------- cold tiers

@pytest.fixture(params=COLD)
def cold_cls(request):
    return MemmapTier if request.param == "memmap" else HDF5Tier


def _filled(cold_cls, directory, n=300, seed=7):
    t = cold_cls(directory, segment_bytes=SEG, threads=4)
    rng = np.random.default_rng(seed)
    data, src_off, sizes = batch(rng, n, 0, 3000)
    off = t.allocate(sizes)
    t.write(off, data, src_off, sizes)
    t.flush()
    return t, off, sizes, blobs_of(data, src_off, sizes)


def test_cold_blobs_never_straddle_segments(cold_cls, tmp_path):
    t, off, sizes, _ = _filled(cold_cls, str(tmp_path / "c"))
    end = off + np.maximum(sizes, 1) - 1
    assert (off // SEG == end // SEG).all()
    assert len(t.segments) > 3
    t.close()


def test_cold_reopen_bit_exact(cold_cls, tmp_path):
    d = str(tmp_path / "c")
    t, off, sizes, expect = _filled(cold_cls, d)
    state = t.state()
    t.close()
    for mode in ("r", "r+"):
        r = cold_cls.open(d, state, mode)
        assert r.bytes_used == int(align(sizes).sum())
        assert read_back(r, off, sizes) == expect
        assert read_back(r, off, sizes, "torch", np.random.default_rng(0).permutation(len(sizes))) == expect
        if mode == "r":
            with pytest.raises(ReadOnlyStoreError):
                r.allocate(np.array([10]))
        else:
            data, src_off, s2 = batch(np.random.default_rng(9), 40)
            o2 = r.allocate(s2)
            assert not np.isin(o2, off).any()
            r.write(o2, data, src_off, s2)
            r.flush()
            state2 = r.state()
        r.close()
    r = cold_cls.open(d, state2, "r")
    assert read_back(r, off, sizes) == expect
    assert read_back(r, o2, s2) == blobs_of(data, src_off, s2)
    r.close()


def test_cold_state_is_flat_json_and_arrays(cold_cls, tmp_path):
    import json

    t, *_ = _filled(cold_cls, str(tmp_path / "c"), n=20)
    st = t.state()
    plain = {k: v for k, v in st.items() if not isinstance(v, np.ndarray)}
    json.dumps(plain)
    assert all(v.dtype == np.int64 for v in st.values() if isinstance(v, np.ndarray))
    t.close()


def test_cold_reopen_holds_deferred_frees_until_the_next_commit(cold_cls, tmp_path):
    """A reopened tier reuses the commit's deferred frees only after its next commit: a reader
    of the commit before may still read them until then."""
    d = str(tmp_path / "c")
    t, off, sizes, _ = _filled(cold_cls, d, n=50)
    t.free(off[:10], sizes[:10])
    t.flush()
    state = t.state()
    t.close()
    r = cold_cls.open(d, state, "r+")
    before = r.allocate(sizes[:1])
    assert not np.isin(before, off[:10]).any()
    r.release_deferred(hold_last=True)  # the next commit
    again = r.allocate(sizes[:10])
    assert np.isin(again, off[:10]).any()
    r.close()


def test_cold_missing_or_truncated_segment(cold_cls, tmp_path):
    d = str(tmp_path / "c")
    t, off, sizes, _ = _filled(cold_cls, d)
    state = t.state()
    t.close()
    seg1 = t.segment_path(1)
    with open(seg1, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptionError, match=r"seg-000001.*truncated.*expected at least \d+ bytes"):
        cold_cls.open(d, state, "r")
    os.remove(seg1)
    with pytest.raises(CorruptionError, match=r"seg-000001.*missing"):
        cold_cls.open(d, state, "r")


def test_cold_refuses_a_directory_with_segments(cold_cls, tmp_path):
    d = str(tmp_path / "c")
    t, *_ = _filled(cold_cls, d, n=5)
    t.close()
    with pytest.raises(FileExistsError, match="open"):
        cold_cls(d, segment_bytes=SEG)


def test_cold_pickle_read_only(cold_cls, tmp_path):
    d = str(tmp_path / "c")
    t, off, sizes, expect = _filled(cold_cls, d)
    with pytest.raises(TypeError, match="read-only|mode='r'"):
        pickle.dumps(t)
    state = t.state()
    t.close()
    r = cold_cls.open(d, state, "r")
    assert read_back(r, off[:5], sizes[:5]) == expect[:5]  # opens fds and a pool, then pickle
    r2 = pickle.loads(pickle.dumps(r))
    assert read_back(r2, off, sizes) == expect
    r.close()
    r2.close()


def test_cold_read_after_fork(cold_cls, tmp_path):
    """A read-only tier used before fork still reads in the child (fresh fds and threads)."""
    d = str(tmp_path / "c")
    t, off, sizes, expect = _filled(cold_cls, d, n=400)
    state = t.state()
    t.close()
    r = cold_cls.open(d, state, "r")
    assert read_back(r, off, sizes) == expect  # starts the thread pool in the parent
    pid = os.fork()
    if pid == 0:  # child: exit status says whether the read was bit-exact
        try:
            ok = read_back(r, off, sizes) == expect
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    r.close()


def test_cold_large_threaded_read(cold_cls, tmp_path):
    d = str(tmp_path / "c")
    t = cold_cls(d, segment_bytes=4 << 20, threads=4)
    rng = np.random.default_rng(10)
    data, src_off, sizes = batch(rng, 600, 1000, 20000)  # ~6 MB: the threaded path
    off = t.allocate(sizes)
    t.write(off, data, src_off, sizes)
    t.flush()
    order = rng.permutation(600)
    assert read_back(t, off, sizes, "numpy", order) == blobs_of(data, src_off, sizes)
    sub = order[:300]  # sparse: single-blob runs read straight into out
    assert read_back(t, off[sub], sizes[sub]) == [blobs_of(data, src_off, sizes)[i] for i in sub]
    t.drop_cache()
    assert read_back(t, off, sizes, "torch") == blobs_of(data, src_off, sizes)
    t.close()


def test_a_large_write_leaves_no_large_staging_buffer(tmp_path):
    """The per-thread staging buffer lives as long as the thread (pinned on CUDA hosts); a write
    bigger than its cap stages through a temporary, and the data still lands bit-exactly."""
    from tiered.tiers.memmap import STAGING_KEEP_MAX

    t = MemmapTier(str(tmp_path / "c"), segment_bytes=64 << 20)
    rng = np.random.default_rng(11)
    data, src_off, sizes = batch(rng, 1500, 10000, 20001)  # ~22 MB of unaligned blobs: staged
    assert int(sizes.sum()) > STAGING_KEEP_MAX
    off = t.allocate(sizes)
    t.write(off, data, src_off, sizes)
    assert t.staging.kept_bytes() <= STAGING_KEEP_MAX
    t.flush()
    assert read_back(t, off, sizes) == blobs_of(data, src_off, sizes)
    t.close()


def test_hdf5_segments_are_plain_hdf5(tmp_path):
    d = str(tmp_path / "c")
    t, off, sizes, expect = _filled(HDF5Tier, d)
    for o, s, b in zip(off.tolist(), sizes.tolist(), expect, strict=True):
        seg, inner = divmod(o, SEG)
        with h5py.File(t.segment_path(seg), "r") as f:
            ds = f["blobs"]
            assert ds.shape == (SEG,) and ds.dtype == np.uint8 and ds.chunks is None
            assert ds.compression is None
            assert bytes(ds[inner:inner + s]) == b
    t.close()


def test_hdf5_wrong_file_is_corruption(tmp_path):
    d = str(tmp_path / "c")
    t, off, sizes, _ = _filled(HDF5Tier, d, n=5)
    state = t.state()
    t.close()
    with open(t.segment_path(0), "r+b") as f:  # clobber the HDF5 superblock
        f.write(b"\0" * 512)
    r = HDF5Tier.open(d, state, "r")
    with pytest.raises(CorruptionError, match="seg-000000.h5"):
        read_back(r, off, sizes)
    r.close()


def test_hdf5_segment_whose_blobs_are_a_link_is_corruption(tmp_path):
    # a segment whose "blobs" is an external link to a copy of the real segment: the dataset it
    # names starts at the recorded offset, but blob bytes are read from the segment file itself
    d = str(tmp_path / "c")
    t, off, sizes, _ = _filled(HDF5Tier, d, n=5)
    state = t.state()
    t.close()
    seg = t.segment_path(0)
    size = os.path.getsize(seg)
    os.rename(seg, tmp_path / "elsewhere.h5")
    with h5py.File(seg, "w") as f:
        f["blobs"] = h5py.ExternalLink(str(tmp_path / "elsewhere.h5"), "/blobs")
    os.truncate(seg, size)
    r = HDF5Tier.open(d, state, "r")
    with pytest.raises(CorruptionError, match=r"seg-000000.h5 holds 'blobs' as a link \(ExternalLink\)"):
        read_back(r, off, sizes)
    r.close()


def test_memmap_files_grow_in_steps_without_holes(tmp_path):
    d = str(tmp_path / "c")
    t = MemmapTier(d, segment_bytes=64 << 20)
    off = t.allocate(np.array([1000]))
    t.write(off, np.zeros(1000, np.uint8), np.array([0]), np.array([1000]))
    st = os.stat(t.segment_path(0))
    assert st.st_size == GROW_MIN  # the first growth step, not the whole segment
    assert st.st_blocks * 512 >= st.st_size  # reserved on disk (posix_fallocate), not sparse
    t.close()


def test_memmap_files_grow_geometrically_in_proportion_to_the_data(tmp_path):
    t = MemmapTier(str(tmp_path / "c"), segment_bytes=64 << 20)
    sizes_seen = []
    for _ in range(600):  # 600 x 48 KiB = 28 MiB in one segment
        off = t.allocate(np.array([48 << 10]))
        t.write(off, np.ones(48 << 10, np.uint8), np.array([0]), np.array([48 << 10]))
        size = os.stat(t.segment_path(0)).st_size
        # never more than twice the data (plus the first step), never sparse
        assert size <= max(GROW_MIN, 2 * t.bytes_used), (size, t.bytes_used)
        assert os.stat(t.segment_path(0)).st_blocks * 512 >= size
        if not sizes_seen or sizes_seen[-1] != size:
            sizes_seen.append(size)
    steps = np.diff(sizes_seen)
    # each growth at least doubles the file until the steps reach GROW_STEP; then GROW_STEP each
    assert sizes_seen[0] == GROW_MIN and len(sizes_seen) < 20, sizes_seen
    assert (steps <= GROW_STEP).all() and steps[-1] == GROW_STEP
    doubling = steps[steps < GROW_STEP]
    assert (doubling >= np.array(sizes_seen[:len(doubling)])).all()
    t.flush()
    t.close()


# --------------------------------------------------------------------------- memory tiers


def test_arena_grows_geometrically_and_lazily():
    t = HostTier(1 << 30)
    assert t.capacity == 0
    t.allocate(np.array([100]))
    assert 0 < t.capacity <= 1 << 16
    caps = []
    for _ in range(6):
        t.allocate(np.array([50_000]))
        caps.append(t.capacity)
    assert caps[-1] < 1 << 20  # never the whole budget up front
    assert all(b == a or b >= 2 * a for a, b in zip(caps, caps[1:], strict=False))  # x2 growth
    small = HostTier(100_000)
    small.allocate(np.array([40_000]))
    assert small.capacity == 1 << 16
    small.allocate(np.array([40_000]))
    assert small.capacity == 100_000  # x2 would pass the budget: capped at it


def test_arena_out_of_memory_is_storage_full_and_unchanged():
    t = HostTier(1 << 30)
    data = np.arange(200, dtype=np.uint8)
    off = t.allocate(np.array([200]))
    t.write(off, data, np.array([0]), np.array([200]))
    used, cap = t.bytes_used, t.capacity
    with inject_oom(), pytest.raises(StorageFullError, match="could not grow"):
        t.allocate(np.array([1 << 20]))
    assert t.bytes_used == used and t.capacity == cap
    assert read_back(t, off, np.array([200])) == [data.tobytes()]
    t.allocate(np.array([1 << 20]))


def test_host_tier_is_pinned_only_with_cuda():
    t = HostTier(1 << 20)
    t.allocate(np.array([10]))
    assert t.buffer.is_pinned() == torch.cuda.is_available()
    assert t.name == "warm" and t.device == torch.device("cpu")


def test_device_tier_defaults_to_cuda():
    assert DeviceTier(1 << 20).device.type == "cuda"
    assert DeviceTier(1 << 20, device="cpu").name == "hot"


def test_zero_budget_holds_nothing():
    t = DeviceTier(0, device="cpu")
    with pytest.raises(ValueError, match="budget of 0 bytes"):
        t.allocate(np.array([1]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_arena_to_cpu_and_back():
    rng = np.random.default_rng(11)
    t = DeviceTier(1 << 24, device="cuda")
    data, src_off, sizes = batch(rng, 256, 500, 8000)
    off = t.allocate(sizes)
    t.write(off, torch.from_numpy(data).cuda(), src_off, sizes)
    expect = blobs_of(data, src_off, sizes)
    assert read_back(t, off, sizes, "numpy") == expect
    assert read_back(t, off, sizes, "cuda", rng.permutation(256)) == expect


# --------------------------------------------------------------------------- building blocks


def test_copy_blobs_paths_agree():
    rng = np.random.default_rng(12)
    for trial in range(60):
        n = int(rng.integers(1, 300))
        sizes = rng.integers(0, 5000, n)
        src = rng.integers(0, 256, int(sizes.sum()) * 2 + 64, dtype=np.uint8)
        perm = rng.permutation(n)
        s_off = (np.cumsum(sizes[perm]) - sizes[perm])[np.argsort(perm)] + (trial % 3) * 8
        d_sizes = align(sizes) if trial % 2 else sizes
        d_off = np.cumsum(d_sizes) - d_sizes
        dst_len = int(d_off[-1] + sizes[-1]) + 8
        ref = np.zeros(dst_len, np.uint8)
        for a, b, k in zip(s_off, d_off, sizes, strict=True):
            ref[b:b + k] = src[a:a + k]
        out = np.zeros(dst_len, np.uint8)
        copy_blobs(src, s_off, out, d_off, sizes)
        assert (out == ref).all()
        # the torch (GPU) path, run on CPU tensors
        out_t = torch.zeros(dst_len, dtype=torch.uint8)
        copy_tensor_blobs(torch.from_numpy(src), s_off.astype(np.int64), out_t,
                          d_off.astype(np.int64), sizes.astype(np.int64))
        assert (out_t.numpy() == ref).all()


@pytest.mark.parametrize("hi", [2, 20, 300])
def test_copy_blobs_small_buffers(hi):
    rng = np.random.default_rng(hi)
    sizes = rng.integers(0, hi, 12)
    src = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    s_off = np.cumsum(sizes) - sizes
    perm = rng.permutation(12)
    d_off = (np.cumsum(sizes[perm]) - sizes[perm])[np.argsort(perm)]
    dst = np.zeros(int(sizes.sum()), np.uint8)
    copy_blobs(src, s_off, dst, d_off, sizes)
    assert [dst[o:o + n].tobytes() for o, n in zip(d_off, sizes, strict=True)] == \
        [src[o:o + n].tobytes() for o, n in zip(s_off, sizes, strict=True)]


def test_copy_blobs_checks_bounds_and_types():
    src = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="outside"):
        copy_blobs(src, np.array([5]), np.zeros(10, np.uint8), np.array([0]), np.array([6]))
    with pytest.raises(TypeError, match="uint8"):
        copy_blobs(np.zeros(10, np.float32), np.array([0]), src, np.array([0]), np.array([1]))


def test_allocator_strategies():
    a = ExtentAllocator(1 << 20)
    off = a.allocate(np.full(10, 100))  # 112 aligned each
    assert (np.diff(off) == 112).all()
    a.free(off[2:5], np.full(3, 100))  # a hole of 336 bytes
    a.free(off[7:8], np.full(1, 100))  # a hole of 112 bytes
    assert a.fragmentation == pytest.approx(1 - 336 / 448)
    # 1. first fit in address order: a single blob takes the start of the first hole
    b = a.allocate(np.array([100]))
    assert b.tolist() == [off[2]]
    # 2. spread over the holes in address order, then bump: two blobs fill the rest of the first
    #    hole, one the 112-byte hole, the 4th goes to the end
    c = a.allocate(np.full(4, 100))
    assert c[:3].tolist() == [off[3], off[4], off[7]] and c[3] == off[-1] + 112
    assert a.free_bytes == 0 and a.fragmentation == 0.0
    # 3. a blob that would straddle two holes is bumped, and both holes stay free
    a.free(np.array([off[0], off[2]]), np.full(2, 100))
    d = a.allocate(np.array([200]))
    assert d[0] == off[-1] + 224 and a.free_bytes == 224


def test_allocator_shrinks_end_and_coalesces():
    a = ExtentAllocator(None)
    off = a.allocate(np.full(100, 32))
    a.free(off[::2], np.full(50, 32))
    assert a.free_bytes == 50 * 32
    a.free(off[1::2], np.full(50, 32))
    assert a.high_water == 0 and a.free_bytes == 0 and a.bytes_used == 0


def test_allocator_double_free_and_bad_ranges():
    a = ExtentAllocator(4096)
    off = a.allocate(np.array([64, 64, 64]))
    a.free(off[:1], np.array([64]))
    before = a.state()
    with pytest.raises(ValueError, match="double free"):
        a.free(off[:2], np.array([64, 64]))
    with pytest.raises(ValueError, match="outside"):
        a.free(np.array([4000]), np.array([64]))
    after = a.state()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_allocator_boundary_and_state_round_trip():
    rng = np.random.default_rng(13)
    a = ExtentAllocator(None, boundary=1024)
    live = []
    for _ in range(300):
        sizes = rng.integers(1, 700, int(rng.integers(1, 6)))
        off = a.allocate(sizes)
        assert (off // 1024 == (off + align(sizes) - 1) // 1024).all()
        live += list(zip(off.tolist(), sizes.tolist(), strict=True))
        if rng.random() < 0.5 and live:
            k = int(rng.integers(0, len(live)))
            o, s = live.pop(k)
            a.free(np.array([o]), np.array([s]), defer=bool(rng.random() < 0.5))
        if rng.random() < 0.1:
            a.release_deferred()
    b = ExtentAllocator.from_state(a.state())
    assert b.state().keys() == a.state().keys()
    for k, v in a.state().items():
        assert np.array_equal(v, b.state()[k])
    x, y = a.allocate(np.array([300, 5])), b.allocate(np.array([300, 5]))
    assert x.tolist() == y.tolist()


def test_allocator_deferred():
    a = ExtentAllocator(1024)
    off = a.allocate(np.array([512, 512]))
    a.free(off[:1], np.array([512]), defer=True)
    assert a.bytes_used == 512 and a.bytes_pending == 512
    with pytest.raises(StorageFullError):
        a.allocate(np.array([16]))
    assert a.release_deferred() == 512
    assert a.allocate(np.array([512])).tolist() == [0]


@pytest.mark.parametrize("text,value", [
    ("2GiB", 2 << 30), ("512MB", 512_000_000), ("1.5 GiB", 3 << 29), ("1024", 1024), (4096, 4096),
    ("16k", 16384), ("3 mib", 3 << 20), ("10B", 10), (np.int64(7), 7),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "2 GiBs", "-1GB", -5, True, 1.5, "1e9"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes(bad)


def test_default_budgets():
    b = default_budgets()
    assert b["warm"] > 0
    assert (b["hot"] > 0) == torch.cuda.is_available()



def test_many_scattered_runs_are_read_on_several_threads(tmp_path):
    # 200 blobs read back without coalescing: 200 runs, past the threaded-read threshold
    from tiered.tiers import memmap as memmap_mod

    tier = MemmapTier(str(tmp_path / "cold"), segment_bytes=1 << 20)
    rng = np.random.default_rng(0)
    sizes = rng.integers(100, 3000, 500)
    data = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    src = np.cumsum(sizes) - sizes
    loc = tier.allocate(sizes)
    tier.write(loc, data, src, sizes)
    tier.flush()
    pick = rng.choice(500, 200, replace=False)
    out = np.zeros(int(sizes[pick].sum()), np.uint8)
    out_off = np.cumsum(sizes[pick]) - sizes[pick]
    threads, idents = [], set()
    real = memmap_mod.run_parallel

    def counting(fn, tasks, workers):
        threads.append(len(tasks))

        def on_thread(*args):
            idents.add(threading.get_ident())
            return fn(*args)

        return real(on_thread, tasks, workers)

    memmap_mod.run_parallel = counting
    try:
        memmap_mod.read_blobs(tier.segment_fd, tier.segment_path, tier.data_offsets, tier.segment_bytes,
                              loc[pick], sizes[pick], out, out_off, 8, tier.staging, gap=0)
    finally:
        memmap_mod.run_parallel = real
    assert threads and threads[0] > 1, threads
    assert len(idents) > 1, idents  # the tasks ran on more than the calling thread
    assert np.array_equal(out, np.concatenate([data[src[i]:src[i] + sizes[i]] for i in pick]))
    tier.close()


def test_a_full_bounded_arena_fits_a_batch_into_its_holes_on_a_second_pass() -> None:
    # 1024 bytes, all used, then every other 128-byte blob freed: four holes of 128 bytes and no
    # room at the end. Laid end to end over the holes, two blobs of the batch straddle two holes;
    # a second pass puts them into the holes left, largest first.
    a = ExtentAllocator(1024)
    offsets = a.allocate(np.full(8, 128))
    a.free(offsets[::2], np.full(4, 128))
    assert a.free_bytes == 512 and a.high_water == 1024
    sizes = np.array([64, 128, 128, 64])
    got = a.allocate(sizes)
    assert (got >= 0).all() and (got + sizes <= 1024).all()
    spans = sorted(zip(got.tolist(), (got + sizes).tolist(), strict=True)) + \
        sorted((int(o), int(o) + 128) for o in offsets[1::2])
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))  # no overlap
    assert a.free_bytes == 128
    # a batch the holes cannot hold still fails as a whole and changes nothing
    before = a.extents
    with pytest.raises(StorageFullError):
        a.allocate(np.array([64, 128]))
    assert all(np.array_equal(x, y) for x, y in zip(a.extents, before, strict=True)) and a.free_bytes == 128


def _live_spans(offsets: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    return sorted((int(o), int(o) + int(s)) for o, s in zip(offsets, align(sizes), strict=True))


def _no_overlap(spans: list[tuple[int, int]]) -> bool:
    spans = sorted(spans)
    return all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


def test_a_full_arena_takes_the_blobs_that_fit_and_marks_the_rest() -> None:
    # four 128-byte holes and no room at the end: a 64 and a 128 fit, the 256 nowhere
    a = ExtentAllocator(1024)
    offsets = a.allocate(np.full(8, 128))
    a.free(offsets[::2], np.full(4, 128))
    got = a.allocate(np.array([64, 256, 128]), partial=True)
    assert got[1] == -1 and (got[[0, 2]] >= 0).all()
    assert _no_overlap(_live_spans(np.r_[offsets[1::2], got[[0, 2]]], np.r_[np.full(4, 128), 64, 128]))
    assert a.bytes_used == 512 + 64 + 128 and a.free_bytes == 1024 - a.bytes_used
    with pytest.raises(ValueError, match="boundary"):
        ExtentAllocator(1024, boundary=512).allocate(np.array([16]), partial=True)
    # an arena: the same, and what fits can be written and read back
    t = HostTier(1024, pinned=False)
    first = t.allocate(np.full(8, 128))
    t.free(first[::2], np.full(4, 128))
    got = t.allocate_fitting(np.array([976, 128]))  # a blob no hole holds does not block the others
    assert got[0] == -1 and got[1] in first[::2]


@pytest.mark.parametrize("seed", range(6))
def test_extents_overlap_agrees_with_sorting_the_extents_by_start(seed: int) -> None:
    """The two-sort test (starts and ends sorted apart) says what a sort of whole extents says,
    on random extents that often touch, nest, repeat or are empty."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(0, 12))
        off = rng.integers(0, 64, n) * 16
        ln = rng.integers(0, 6, n) * 16
        spans = [(int(o), int(o + s)) for o, s in zip(off, ln, strict=True) if s > 0]
        assert extents_overlap(off, ln) == (not _no_overlap(spans)), (off.tolist(), ln.tolist())
    packed = np.arange(0, 1 << 20, 64)  # a million bytes of touching extents, then one moved onto another
    assert not extents_overlap(packed, np.full(packed.size, 64))
    packed[7] = packed[3] + 16
    assert extents_overlap(packed, np.full(packed.size, 64))


@pytest.mark.parametrize("seed", range(4))
def test_partial_allocation_never_overlaps_live_blobs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = ExtentAllocator(1 << 14)
    live: dict[int, int] = {}
    for _ in range(60):
        if live and rng.random() < 0.5:
            gone = rng.choice(list(live), size=rng.integers(1, len(live) + 1), replace=False)
            a.free(np.array(gone), np.array([live.pop(int(o)) for o in gone]))
        sizes = rng.integers(1, 1500, rng.integers(1, 12))
        got = a.allocate(sizes, partial=True)
        placed = got >= 0
        live.update(zip(got[placed].tolist(), sizes[placed].tolist(), strict=True))
        spans = _live_spans(np.array(list(live)), np.array(list(live.values())))
        assert _no_overlap(spans) and all(end <= 1 << 14 for _, end in spans)
        assert a.bytes_used == int(align(np.array(list(live.values()))).sum()) if live else a.bytes_used == 0


@pytest.mark.parametrize("step", [1, 700, 1 << 20])
def test_arena_compaction_moves_the_blobs_to_the_start_in_place(step: int) -> None:
    """Blobs of many sizes, every other group freed: compaction packs the live blobs from byte
    0 in address order, in the same arena buffer (no second arena), through moves whose
    sources and destinations overlap, and every blob reads back as written."""
    rng = np.random.default_rng(5)
    t = HostTier(1 << 16, pinned=False)
    data, src_off, sizes = batch(rng, 120, 1, 900)
    off = t.allocate(sizes)
    t.write(off, data, src_off, sizes)
    gone = rng.random(sizes.size) < 0.4
    gone[:3] = False  # a packed prefix that stays where it is
    t.free(off[gone], sizes[gone])
    keep = np.flatnonzero(~gone)
    expected = blobs_of(data, src_off[keep], sizes[keep])
    buf, capacity = t.buffer.data_ptr(), t.capacity
    moved = t.compact_bytes
    assert 0 < moved < t.bytes_used
    new = t.compact(off[keep], sizes[keep], step=step)
    assert t.buffer.data_ptr() == buf and t.capacity == capacity  # moved within the one arena
    assert new[:3].tolist() == off[keep][:3].tolist()
    assert new.tolist() == (np.cumsum(align(sizes[keep])) - align(sizes[keep])).tolist()
    assert t.fragmentation == 0.0 and t.stats()["high_water"] == t.bytes_used and t.compact_bytes == 0
    assert read_back(t, new, sizes[keep]) == expected
    more = t.allocate(np.array([4000]))  # the free space is one range past the blobs
    assert more.tolist() == [t.bytes_used - 4000]


def test_arena_compaction_needs_every_live_blob() -> None:
    t = HostTier(1 << 12, pinned=False)
    off = t.allocate(np.array([64, 64, 64]))
    t.free(off[:1], np.array([64]))
    with pytest.raises(ValueError, match="every live blob"):
        t.compact(off[1:2], np.array([64]))
    with pytest.raises(ValueError, match="overlapping"):
        t.compact(np.array([off[1], off[1]]), np.array([64, 64]))
    assert t.bytes_used == 128 and t.compact_bytes == 128


def test_host_arena_reads_refuse_every_bad_range_by_name():
    # a host read tests every bound at once, then names the one that failed: past the allocated
    # region, a negative offset or size, past the destination; the destination is left as it was
    t = HostTier(1 << 20)
    data = np.arange(200, dtype=np.uint8)
    off = t.allocate(np.array([120, 80]))
    t.write(off, data, np.array([0, 120]), np.array([120, 80]))
    out = np.zeros(200, np.uint8)
    sizes = np.array([120, 80], dtype=np.int64)
    dst = np.array([80, 0], dtype=np.int64)
    t.read(off, sizes, out, dst)
    assert out.tobytes() == data[120:].tobytes() + data[:120].tobytes()
    out[:] = 7
    for offsets, sizes_, dst_, match in [
        (off + np.array([0, 1 << 19]), sizes, dst, "past the allocated region"),
        (off - np.array([0, int(off[1]) + 1]), sizes, dst, "negative blob offsets or sizes"),
        (off, np.array([120, -1], dtype=np.int64), dst, "negative blob offsets or sizes"),
        (off, sizes, np.array([80, -1], dtype=np.int64), "destination buffer's ranges"),
        (off, sizes, np.array([81, 0], dtype=np.int64), "destination buffer's ranges"),
    ]:
        with pytest.raises(ValueError, match=match):
            t.read(offsets.astype(np.int64), sizes_, out, dst_)
        assert (out == 7).all()
