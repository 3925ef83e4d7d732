"""The GPU path: nvCOMP codecs, the GPU decoder, its OOM handling, bit-exact CPU <-> GPU interop.

Two groups:

* unmarked tests run on CPU-only CI: nvCOMP missing or unusable gives CodecUnavailableError with
  the install command (checked in a subprocess where ``nvidia.nvcomp`` cannot be imported); the
  GPU decoder's whole pipeline (tier grouping, pinned staging, device gather, checksums, batch
  padding, OOM split, CPU fallback, promotions, bookkeeping) runs with ``device="cpu"`` and the
  CPU codecs standing in for nvCOMP; the fused checksum equals the reference one.
* ``@pytest.mark.cuda`` tests (skipped without a GPU; run by benchmarks/gpu_check.py): nvCOMP
  decodes CPU-written zstd/lz4 bit-exactly and zstandard/lz4 decode nvCOMP's output, and a store
  with blobs in the hot CUDA arena, the pinned warm arena and a cold memmap file samples
  bit-exactly on the GPU. Expected values always come from a CPU twin store, never from the
  path under test; out-of-memory tests (whose failures pass through nvCOMP's allocator
  callback) run in a child process, so an abort there cannot take the test session with it.

Data: real Atari frames from benchmarks/data/atari_frames.npz (no ale-py needed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from helpers import assert_td_equal, check_refcounts
from tensordict import TensorDict

import tiered.engine.gpu_read as gpu_mod
from tiered import TieredStore
from tiered.atari import load_fixture
from tiered.codecs import Lz4Codec, ZstdCodec, available_codecs, get_codec, segment_checksums
from tiered.codecs.checksum import segment_checksums_torch
from tiered.codecs.nvcomp import (
    chunk_class,
    empty_frame,
    filler_frame,
    note_allocation_failure,
    probe_is_final,
    take_allocation_failure,
)
from tiered.engine.blob_index import COLD, HOT, OPEN, WARM
from tiered.engine.gpu_read import GpuDecoder, fused_checksums, maybe_gpu_decoder
from tiered.errors import ChecksumError, CodecUnavailableError, UnknownCodecError
from tiered.testing import decode_blobs, parts, spread_over_tiers, tier_counts
from tiered.tiers.arena import inject_oom

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "benchmarks" / "data" / "atari_frames.npz"


@pytest.fixture(scope="module")
def frames() -> TensorDict:
    """Breakout then MsPacman: 4000 real transitions with 4x84x84 stacks."""
    return load_fixture(FIXTURE, games=["Breakout", "MsPacman"])


def tiered_store(data: TensorDict, path: Path, *, hot_device: str, rows: int = 600, **kw) -> TieredStore:
    """A store with blobs in the hot arena, the warm arena, the cold file only, and an open chunk."""
    kw = {"chunk_frames": 4, **kw}  # the tier spread and the open chunk below are sized for K=4
    store = TieredStore(rows + 64, path, frames={"observation": 0}, hot_device=hot_device,
                        hot_bytes="64MiB", warm_bytes="64MiB", promote=False, stage_rows=0, **kw)
    for i in range(0, rows, 50):
        store.extend(data[i:i + 50])
    store.flush()
    spread_over_tiers(store)
    store.extend(data[rows:rows + 3])  # leaves an open (not yet compressed) chunk
    return store


def snapshot(store: TieredStore) -> TensorDict:
    """Every row of a CPU store: the expected values (a GPU store is the path under test)."""
    assert store.device.type == "cpu", "expected values come from a CPU twin store"
    return store.get(np.arange(len(store))).clone()


def run_child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (tests whose failure may abort a process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                         os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env=env)


def check_gets(store: TieredStore, expected: TensorDict, sizes=(1, 7, 256, 1024), seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for b in sizes:
        ix = rng.integers(0, len(store), b)
        assert_td_equal(store.get(ix).to("cpu"), expected[torch.from_numpy(ix)])


# ---------------------------------------------------------------------------------------------
# Without nvCOMP / without a GPU
# ---------------------------------------------------------------------------------------------


def test_missing_nvcomp_raises_with_install_command():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["nvidia.nvcomp"] = None          # this interpreter cannot import nvCOMP
        from tiered.codecs import available_codecs, get_codec
        from tiered.codecs.nvcomp import NvcompCodec
        from tiered.errors import CodecUnavailableError
        for make in (lambda: NvcompCodec(), lambda: NvcompCodec("lz4"), lambda: get_codec("nvcomp:zstd")):
            try:
                make()
            except CodecUnavailableError as e:
                assert isinstance(e, ImportError)
                msg = str(e)
                assert "pip install 'tiered[gpu-cu12]'" in msg and "'tiered[gpu-cu13]'" in msg, msg
            else:
                raise SystemExit("no CodecUnavailableError")
        assert "nvcomp" not in available_codecs()
        import tiered.engine.gpu_read
        try:
            tiered.engine.gpu_read.GpuDecoder("cuda:0")
        except CodecUnavailableError as e:
            assert "tiered[gpu-cu12]" in str(e)
        else:
            raise SystemExit("GpuDecoder without nvCOMP did not raise CodecUnavailableError")
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_nvcomp_codec_without_a_gpu_is_unavailable():
    with pytest.raises(CodecUnavailableError) as info:
        get_codec("nvcomp")
    assert "CUDA" in str(info.value) or "tiered[gpu-cu12]" in str(info.value)
    assert "nvcomp" not in available_codecs()


def test_unknown_nvcomp_format_is_rejected_on_any_machine():
    with pytest.raises(UnknownCodecError, match="nvcomp:lz4"):
        get_codec("nvcomp:snappy")


@pytest.mark.parametrize("fmt", ["zstd", "lz4", "deflate"])
def test_filler_and_empty_frames_are_what_cpu_codecs_read(fmt):
    filler, empty = filler_frame(fmt), empty_frame(fmt)
    if fmt == "deflate":
        assert zlib.decompress(filler, -15) == b"\x00" and zlib.decompress(empty, -15) == b""
        return
    codec = ZstdCodec(threads=1) if fmt == "zstd" else Lz4Codec(threads=1)
    data = np.frombuffer(filler + empty, np.uint8)
    out = np.full(1, 7, np.uint8)
    codec.decode(data, np.array([0, len(filler)]), np.array([len(filler), len(empty)]), out,
                 np.array([0, 1]), np.array([1, 0]))
    assert out.tolist() == [0]
    enc = codec.encode(np.zeros(0, np.uint8), np.array([0]), np.array([0]))
    assert enc.data.tobytes() == empty


def test_fused_checksums_equal_the_reference():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 300_000, dtype=np.uint8)
    data[1000:50_000] = 255  # worst case for the sums
    offsets = np.concatenate([[0], rng.integers(0, 290_000, 997), [299_990, 5]])
    sizes = np.concatenate([[300_000], rng.integers(0, 10_000, 997), [10, 0]])
    sizes = np.minimum(sizes, data.size - offsets)
    want = segment_checksums(data, offsets, sizes)
    t = torch.from_numpy(data)
    got = fused_checksums(t, torch.from_numpy(offsets), torch.from_numpy(sizes))
    assert np.array_equal(got.numpy(), want)
    ref_torch = segment_checksums_torch(t, torch.from_numpy(offsets), torch.from_numpy(sizes))
    assert np.array_equal(ref_torch.numpy(), want)


def test_bucket_sizes_pad_little_and_repeat():
    sizes = [gpu_mod.bucket_size(n) for n in range(1, 5000)]
    assert all(b >= n for n, b in zip(range(1, 5000), sizes, strict=True))
    assert all(b - n <= max(1, n // 8) for n, b in zip(range(1, 5000), sizes, strict=True))
    assert len(set(sizes[255:4096])) < 40  # few distinct configs for batches of 256..4096


# ---------------------------------------------------------------------------------------------
# The GPU decoder's pipeline with the CPU stand-in
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["zstd", "lz4", "raw"])
@pytest.mark.parametrize("chunk_frames", [1, 4])
def test_cpu_stand_in_every_tier_bit_exact(frames, tmp_path, codec, chunk_frames):
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu", codec=codec, chunk_frames=chunk_frames)
    counts = tier_counts(store)
    assert all(counts[k] > 0 for k in ("hot", "warm", "cold_only")), counts
    assert (counts["open"] > 0) == (chunk_frames > 1), counts
    expected = snapshot(store)
    dec = GpuDecoder("cpu").attach(store)
    check_gets(store, expected)
    assert_td_equal(store.get(slice(None)), expected)
    st = dec.stats()
    assert st["hot"] > 0 and st["warm"] > 0 and st["cold"] > 0 and (st["open"] > 0) == (chunk_frames > 1)
    assert st["hot_on_device"] == st["hot"]
    assert st["cpu_fallbacks"] == 0 and st["oom_events"] == 0
    if codec != "raw":
        assert st["pads"] > 0  # the batch-size buckets were used
    assert store.stats()["tiers"]["cold"]["hits"] > 0
    # materialize agrees with the CPU path on every byte a row can reference
    fam = parts(store).layout.families[0]
    uniq = np.unique(np.concatenate([t.blob[: len(store)].reshape(-1) for t in parts(store).layout.tables.values()]))
    got = decode_blobs(store, 0, uniq, gpu=True).reshape(uniq.size, -1)
    want = decode_blobs(store, 0, uniq).reshape(uniq.size, -1)
    idx = parts(store).index
    used = np.where(idx.state[uniq] == OPEN, fam.chunk_frames * fam.frame_nbytes, idx.raw_nbytes[uniq])
    mask = np.arange(got.shape[1])[None, :] < used[:, None]
    assert np.array_equal(got[mask], want[mask])


def test_cpu_stand_in_exclusive_tiers_with_promotions(frames):
    data = frames[1000:2600]
    store = TieredStore(1200, frames={"observation": 0}, hot_device="cpu", hot_bytes="48KiB",
                        warm_bytes="8MiB", policy="lru", chunk_frames=4)  # budgets sized for K=4
    reference = TieredStore(1200, frames={"observation": 0})
    dec = GpuDecoder("cpu").attach(store)
    rng = np.random.default_rng(1)
    pos = 0
    for _ in range(40):
        if rng.random() < 0.4:
            c = int(rng.integers(1, 90))
            store.extend(data[pos:pos + c])
            reference.extend(data[pos:pos + c])
            pos = (pos + c) % 1400
        elif len(store):
            ix = rng.integers(0, len(store), int(rng.integers(1, 400)))
            assert_td_equal(store.get(ix), reference.get(ix))
    tiers = store.stats()["tiers"]
    assert tiers["hot"]["promotions"] > 0 and tiers["hot"]["demotions"] > 0
    assert tiers["hot"]["bytes_used"] <= tiers["hot"]["budget"]
    assert dec.stats()["batches"] > 0 and dec.stats()["hot"] > 0  # the decoder served the reads
    check_refcounts(store)


def test_cpu_stand_in_other_dtypes_and_frame_layouts():
    g = torch.Generator().manual_seed(3)
    n = 48
    td = TensorDict({
        "depth": (torch.randn(n, 4, 16, 16, generator=g) * 3).round(),  # float32 stacks
        "pixels": torch.randint(0, 4, (n, 24, 24, 3), dtype=torch.uint8, generator=g),  # frames last
        "action": torch.arange(n),
    }, batch_size=[n])
    store = TieredStore(64, frames={"depth": 0, "pixels": -1}, hot_device="cpu", hot_bytes="1MiB")
    store.extend(td[:40])
    store.extend(td[40:])
    dec = GpuDecoder("cpu").attach(store)
    assert_td_equal(store.get(slice(None)), td)
    assert_td_equal(store.get([5, 5, 47, 0]), td[torch.tensor([5, 5, 47, 0])])
    assert_td_equal(store.get(np.array([], dtype=np.int64)), td[:0])
    assert set(store.get([1], keys=["depth"]).keys()) == {"depth"}
    assert dec.stats()["batches"] >= 4


def test_batch_oom_splits_and_stays_exact(frames, tmp_path):
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu")
    expected = snapshot(store)
    dec = GpuDecoder("cpu").attach(store)
    whole = dec.stats()["h2d_bytes"]
    store.get(np.arange(len(store)))
    one_batch = dec.stats()["h2d_bytes"] - whole
    with inject_oom(one_batch // 3, only=("batch", "scratch")):
        got = store.get(np.arange(len(store)))
    assert_td_equal(got, expected)
    st = dec.stats()
    assert st["oom_events"] >= 1 and st["splits"] >= 3 and st["cpu_fallbacks"] == 0


@pytest.mark.parametrize("only", [("output", "batch", "scratch", "index"), None], ids=["decoder", "all"])
def test_oom_falls_back_to_the_cpu_path_with_exact_data(frames, tmp_path, only):
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu")
    expected = snapshot(store)
    dec = GpuDecoder("cpu").attach(store)
    with inject_oom(0, only):
        check_gets(store, expected, sizes=(3, 300))
    st = dec.stats()
    assert st["cpu_fallbacks"] == 2 and st["oom_events"] == 2
    assert st["fallback_reasons"] == {"out of memory for the output": 2}
    check_gets(store, expected, sizes=(5,))  # and back on the device path afterwards
    assert dec.stats()["batches"] == 1


def test_oom_below_min_split_falls_back(frames, tmp_path):
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu")
    expected = snapshot(store)
    dec = GpuDecoder("cpu", min_split=16).attach(store)
    with inject_oom(1, only="batch"):
        check_gets(store, expected, sizes=(200,))
    st = dec.stats()
    assert st["cpu_fallbacks"] == 1 and st["fallback_reasons"] == {"out of memory below min_split blobs": 1}


def test_scratch_oom_inside_the_decode_call_is_raised_after_it_and_splits(frames, tmp_path):
    # nvCOMP's scratch comes through its allocator callback, which must never raise into C++:
    # the stand-in takes its scratch the same way, so the failure is recorded, raised after the
    # decode call, and the batch is split like any out-of-memory error
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu")
    expected = snapshot(store)
    dec = GpuDecoder("cpu", bucket=False).attach(store)
    idx = parts(store).index
    rows = np.arange(len(store))
    blobs = np.unique(parts(store).layout.tables[("observation",)].blob[rows])
    stored = blobs[idx.state[blobs] != OPEN]
    whole = gpu_mod._stand_in_scratch(idx.raw_nbytes[stored])
    with inject_oom(whole // 3, only="scratch"):
        got = store.get(rows)
    assert_td_equal(got, expected)
    st = dec.stats()
    assert st["oom_events"] >= 1 and st["splits"] >= 3 and st["cpu_fallbacks"] == 0, st
    assert take_allocation_failure() is None  # nothing left behind for the next call


def test_a_scratch_failure_is_recorded_then_raised_into_the_codec():
    # nvCOMP gets an exception from its allocator callback, never a null block; the codec raises
    # the recorded error (not what nvCOMP makes of it) after the call
    with inject_oom(0), pytest.raises(torch.OutOfMemoryError, match="injected"):
        gpu_mod._scratch(1024, torch.device("cpu"))
    err = take_allocation_failure()
    assert isinstance(err, torch.OutOfMemoryError) and "injected" in str(err)
    assert gpu_mod._scratch(1024, torch.device("cpu")).numel() == 1024 and take_allocation_failure() is None
    note_allocation_failure(MemoryError("first"))
    note_allocation_failure(MemoryError("second"))
    assert str(take_allocation_failure()) == "first" and take_allocation_failure() is None


def test_a_codec_error_that_is_not_oom_falls_back_to_the_cpu_once_warned(frames, tmp_path):
    # a failure inside the decode call that is not a lack of memory (nvCOMP meeting a shape its
    # probe never tried, a CUDA runtime error): the blobs passed their checksums, so the batch
    # is decoded on the CPU, with one warning per reason, and the GPU path is used again after
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu")
    expected = snapshot(store)
    dec = GpuDecoder("cpu").attach(store)
    with inject_oom(0, only="scratch", error="cudaErrorLaunchFailure"):
        with pytest.warns(UserWarning, match="cudaErrorLaunchFailure.*decoded on the CPU"):
            check_gets(store, expected, sizes=(40,))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second batch falls back silently (counted)
            check_gets(store, expected, sizes=(41,), seed=1)
    st = dec.stats()
    assert st["cpu_fallbacks"] == 2 and st["oom_events"] == 0 and st["splits"] == 0, st
    assert st["fallback_reasons"] == {"nvCOMP zstd decode error: RuntimeError": 2}
    assert take_allocation_failure() is None
    check_gets(store, expected, sizes=(5,))
    assert dec.stats()["batches"] == 1 and dec.stats()["cpu_fallbacks"] == 2


def test_an_oom_spoiled_probe_is_retried_after_1_2_4_calls():
    from tiered.codecs.nvcomp import ProbeResults, RetryGate

    spoiled = {"exact": None, "capacity": False, "large": False, "large_capacity": False, "oom": True}
    runs: list[int] = []
    probes = ProbeResults(cap=4)
    key = ("zstd", 0, "concurrency")
    got = [probes.result(key, lambda: runs.append(1) or dict(spoiled)) for _ in range(20)]
    # probes on calls 1, 3, 6, 11, 16 (waits 1, 2, 4, 4): not before every batch
    assert len(runs) == 5 and all(not g["cached"] and g["oom"] for g in got)
    good = {"exact": "cc", "capacity": True, "large": True, "large_capacity": True, "oom": False}
    for _ in range(5):
        kept = probes.result(key, lambda: runs.append(1) or dict(good))
    assert kept["cached"] and kept["exact"] == "cc" and len(runs) == 6  # kept for good once final
    other = probes.result(("zstd", 0, "latency"), lambda: runs.append(1) or dict(good))
    assert other["cached"] and len(runs) == 7  # the execution policy is part of the key
    gate = RetryGate(cap=8)
    gate.failed()
    gate.succeeded()
    assert gate.ready()


def test_writers_wait_for_a_prefetch_threads_promotions(frames, tmp_path):
    # a prefetch thread's decoder promotes blobs into the hot arena on its own stream (CPU: its
    # thread); the main thread's next use of the arena waits for that work first
    from tiered.prefetch import Prefetcher

    built = tiered_store(frames, tmp_path / "s", hot_device="cpu", rows=400)
    expected = snapshot(built)
    built.close()
    store = TieredStore.open(tmp_path / "s", mode="r", hot_device="cpu", hot_bytes="64MiB", warm_bytes=0)
    dec = GpuDecoder("cpu").attach(store)
    hot = parts(store).tiers[HOT]
    assert hot.stats()["stream_order"] == {"marks": 0, "waits": 0}
    rng = np.random.default_rng(3)
    with Prefetcher(store, lambda: rng.integers(0, len(store), 64), depth=1) as pf:
        for _, (ix, batch) in zip(range(3), pf, strict=False):
            assert_td_equal(batch, expected[torch.from_numpy(ix)])
    marks = hot.stats()["stream_order"]
    assert marks["marks"] > 0 and marks["waits"] == 0, marks  # only the worker wrote (grew, promoted)
    on_device = dec.stats()["hot_on_device"]
    check_gets(store, expected, sizes=(256,))  # the main thread gathers hot blobs: it waits first
    after = hot.stats()["stream_order"]
    assert dec.stats()["hot_on_device"] > on_device and after["waits"] >= 1, after


def test_probe_results_spoiled_by_oom_are_not_kept():
    ok = {"exact": "cc", "capacity": True, "large": True, "large_capacity": True, "oom": False}
    assert probe_is_final(ok) and probe_is_final({**ok, "oom": True})
    assert probe_is_final({"exact": None, "capacity": False, "large": False, "oom": False})
    assert not probe_is_final({"exact": None, "capacity": False, "large": False, "oom": True})
    assert not probe_is_final({**ok, "large": False, "oom": True})


def test_probe_cells_fit_the_codec_chunk_size():
    from tiered.codecs.nvcomp import BASE_CHUNK, PROBE_LARGE_SIZES, PROBE_SIZES

    assert max(PROBE_SIZES) <= BASE_CHUNK == chunk_class(max(PROBE_SIZES))
    assert max(PROBE_LARGE_SIZES) > BASE_CHUNK and chunk_class(max(PROBE_LARGE_SIZES)) >= max(PROBE_LARGE_SIZES)
    assert [chunk_class(n) for n in (1, 65536, 65537, 100800, 1 << 20)] == [65536, 65536, 131072, 131072, 1 << 20]


def test_decoder_reports_what_it_chose():
    st = GpuDecoder("cpu").stats()
    assert st["backend"] == "cpu" and "stand-in" in st["chosen"]["zstd"]
    assert "sync-free" in gpu_mod.describe_choice({"exact": "cc", "capacity": True, "large": True})
    assert "CPU codec" in gpu_mod.describe_choice({"exact": None})


def test_cpu_only_store_pins_nothing_and_moves_device_none_leaves(frames):
    store = TieredStore(64, frames={"observation": 0}, hot_bytes=0)
    warm = parts(store).tiers[WARM]
    assert warm is not None and warm.pinned is False  # page-locking memory would start CUDA
    td = frames[:8].clone()
    td.clear_device_()  # device=None: leaves may live anywhere, they are moved to the CPU
    assert td.device is None
    store.extend(td)
    assert_td_equal(store.get(np.arange(8)), frames[:8])


@pytest.mark.parametrize("checksum", ["fused", "reference"])
@pytest.mark.parametrize("tier", [HOT, WARM, COLD])
def test_corrupt_blob_raises_before_any_decode(frames, tmp_path, tier, checksum):
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu")
    dec = GpuDecoder("cpu", checksum=checksum).attach(store)
    idx = parts(store).index
    live = idx.live_ids()
    stored = live[idx.state[live] != OPEN]
    where = {HOT: idx.loc[stored, HOT] >= 0, WARM: (idx.loc[stored, HOT] < 0) & (idx.loc[stored, WARM] >= 0),
             COLD: (idx.loc[stored, HOT] < 0) & (idx.loc[stored, WARM] < 0)}[tier]
    victim = int(stored[where][0])
    off = int(idx.loc[victim, tier]) + int(idx.nbytes[victim]) // 2
    if tier == COLD:
        buf = np.zeros(1, np.uint8)
        parts(store).tiers[COLD].read(np.array([off]), np.array([1]), buf, np.array([0]))
        buf ^= 0x5A
        parts(store).tiers[COLD].write(np.array([off]), buf, np.array([0]), np.array([1]))
    else:
        parts(store).tiers[tier].buffer[off] ^= 0x5A
    rows = np.flatnonzero((parts(store).layout.tables[("observation",)].blob[: len(store)] == victim).any(1))
    decoded_before = store.stats()["counters"]["blobs_decoded"]
    with pytest.raises(ChecksumError, match=f"blob {victim} "):
        store.get(rows[:3])
    assert store.stats()["counters"]["blobs_decoded"] == decoded_before
    assert dec.stats()["checksum_failures"] == 1


def test_promotion_from_cold_after_reopen(frames, tmp_path):
    built = tiered_store(frames, tmp_path / "s", hot_device="cpu", rows=400)
    expected = snapshot(built)
    built.close()
    store = TieredStore.open(tmp_path / "s", mode="r", hot_device="cpu", hot_bytes="64KiB", warm_bytes=0)
    assert tier_counts(store)["hot"] == 0  # caches start empty: every blob is cold
    dec = GpuDecoder("cpu").attach(store)
    check_gets(store, expected, sizes=(4, 4, 4, 4))
    assert store.stats()["tiers"]["hot"]["promotions"] > 0 and tier_counts(store)["hot"] > 0
    hits_before = store.stats()["tiers"]["hot"]["hits"]
    check_gets(store, expected, sizes=(4, 4, 4, 4))  # the same rows again: now hot
    assert store.stats()["tiers"]["hot"]["hits"] > hits_before
    assert dec.stats()["cold"] > 0 and dec.stats()["hot"] > 0


def test_attach_detach_and_maybe_gpu_decoder(frames):
    store = TieredStore(64, frames={"observation": 0})
    store.extend(frames[:40])
    dec = GpuDecoder("cpu").attach(store)
    store.get([1, 2])
    assert dec.stats()["batches"] == 1
    dec.detach(store)
    store.get([1, 2])
    assert dec.stats()["batches"] == 1
    assert store.gpu_decoder is None
    assert maybe_gpu_decoder(store.device) is None and maybe_gpu_decoder(store.device, False) is None
    with pytest.raises(ValueError, match="device='cuda'"):
        maybe_gpu_decoder(store.device, True)
    with pytest.raises(ValueError, match="checksum"):
        GpuDecoder("cpu", checksum="crc")


def test_reference_checksum_option_agrees(frames, tmp_path):
    store = tiered_store(frames, tmp_path / "s", hot_device="cpu")
    expected = snapshot(store)
    dec = GpuDecoder("cpu", checksum="reference", bucket=False).attach(store)
    check_gets(store, expected, sizes=(100,))
    assert dec.stats()["batches"] > 0


# ---------------------------------------------------------------------------------------------
# On a CUDA GPU with nvCOMP (benchmarks/gpu_check.py runs these first)
# ---------------------------------------------------------------------------------------------


def _frames_batch(frames: TensorDict, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    obs = frames["observation"][:, -1].reshape(-1, 84 * 84).numpy()  # newest frame of each state
    raw = np.ascontiguousarray(obs[: n * k]).reshape(-1)
    sizes = np.full(n, k * 84 * 84, np.int64)
    return raw, np.arange(n, dtype=np.int64) * k * 84 * 84, sizes


def _to_device_aligned(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray):
    a = (sizes + 15) // 16 * 16
    off = np.concatenate([[0], np.cumsum(a)[:-1]]).astype(np.int64)
    host = np.zeros(int(a.sum()), np.uint8)
    for o, s, d in zip(offsets.tolist(), sizes.tolist(), off.tolist(), strict=True):
        host[d:d + s] = data[o:o + s]
    return torch.from_numpy(host).cuda(), off


@pytest.fixture(scope="module")
def nvcomp_codecs():
    from tiered.codecs.nvcomp import NvcompCodec

    return {f: NvcompCodec(f) for f in ("zstd", "lz4", "deflate")}


@pytest.mark.cuda
def test_nvcomp_probe_finds_a_bit_exact_mode(nvcomp_codecs):
    for fmt in ("zstd", "lz4"):
        probe = nvcomp_codecs[fmt].probe()
        assert probe["exact"] in ("cc", "src"), probe
    assert get_codec("nvcomp").format_id == ZstdCodec.format_id
    assert get_codec("nvcomp:lz4").format_id == Lz4Codec.format_id
    assert "nvcomp" in available_codecs()


@pytest.mark.cuda
@pytest.mark.parametrize("level", [1, 3, 19, -5])
@pytest.mark.parametrize("k", [1, 4])
def test_cpu_zstd_frames_decode_on_the_gpu(frames, nvcomp_codecs, level, k):
    raw, offs, sizes = _frames_batch(frames, 500, k)
    enc = ZstdCodec(level).encode(raw, offs, sizes)
    dev, doff = _to_device_aligned(enc.data, enc.offsets, enc.sizes)
    out = torch.zeros(int(sizes.sum()), dtype=torch.uint8, device="cuda")
    nvcomp_codecs["zstd"].decode_device(dev, doff, enc.sizes, out, offs, sizes)
    assert torch.equal(out.cpu(), torch.from_numpy(raw))
    host_out = np.zeros_like(raw)
    nvcomp_codecs["zstd"].decode(enc.data, enc.offsets, enc.sizes, host_out, offs, sizes)
    assert np.array_equal(host_out, raw)


@pytest.mark.cuda
def test_gpu_zstd_frames_decode_on_the_cpu(frames, nvcomp_codecs):
    raw, offs, sizes = _frames_batch(frames, 300, 4)
    sizes = sizes.copy()
    sizes[::7] = 0  # 0-byte cells become the CPU codec's empty frame
    enc = nvcomp_codecs["zstd"].encode(raw, offs, sizes)
    out = np.zeros_like(raw)
    ZstdCodec().decode(enc.data, enc.offsets, enc.sizes, out, offs, sizes)
    keep = np.repeat(sizes > 0, 4 * 84 * 84)
    assert np.array_equal(out[keep], raw[keep])
    frame = enc.data[enc.offsets[1]:enc.offsets[1] + enc.sizes[1]].tobytes()
    one = zstandard.ZstdDecompressor().decompress(frame, max_output_size=int(sizes[1]))
    assert one == raw[offs[1]:offs[1] + sizes[1]].tobytes()


@pytest.mark.cuda
def test_lz4_both_ways(frames, nvcomp_codecs):
    raw, offs, sizes = _frames_batch(frames, 300, 4)
    enc = Lz4Codec().encode(raw, offs, sizes)
    out = np.zeros_like(raw)
    nvcomp_codecs["lz4"].decode(enc.data, enc.offsets, enc.sizes, out, offs, sizes)
    assert np.array_equal(out, raw)
    enc2 = nvcomp_codecs["lz4"].encode(raw, offs, sizes)
    out2 = np.zeros_like(raw)
    Lz4Codec().decode(enc2.data, enc2.offsets, enc2.sizes, out2, offs, sizes)
    assert np.array_equal(out2, raw)


@pytest.mark.cuda
def test_deflate_is_raw_rfc1951(frames, nvcomp_codecs):
    raw, offs, sizes = _frames_batch(frames, 50, 1)
    enc = nvcomp_codecs["deflate"].encode(raw, offs, sizes)
    first = zlib.decompress(enc.data[: enc.sizes[0]].tobytes(), -15)
    assert first == raw[: sizes[0]].tobytes()
    out = np.zeros_like(raw)
    nvcomp_codecs["deflate"].decode(enc.data, enc.offsets, enc.sizes, out, offs, sizes)
    assert np.array_equal(out, raw)


@pytest.mark.cuda
def test_decode_device_rejects_bad_layouts(nvcomp_codecs):
    enc = ZstdCodec().encode(np.zeros(64, np.uint8), np.array([0]), np.array([64]))
    dev = torch.zeros(256, dtype=torch.uint8, device="cuda")
    dev[3:3 + enc.sizes[0]] = torch.from_numpy(enc.data).cuda()
    out = torch.zeros(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="aligned"):
        nvcomp_codecs["zstd"].decode_device(dev, np.array([3]), enc.sizes, out, np.array([0]), np.array([64]))
    with pytest.raises(ValueError, match="outside"):
        nvcomp_codecs["zstd"].decode_device(dev, np.array([0]), enc.sizes, out, np.array([16]),
                                            np.array([64]))
    with pytest.raises(ValueError, match="is on cpu"):  # a CPU tensor: right type, wrong device
        nvcomp_codecs["zstd"].decode_device(dev.cpu(), np.array([0]), enc.sizes, out, np.array([0]),
                                            np.array([64]))
    with pytest.raises(TypeError, match="uint8"):
        nvcomp_codecs["zstd"].decode_device(dev.float(), np.array([0]), enc.sizes, out, np.array([0]),
                                            np.array([64]))


@pytest.mark.cuda
@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_store_on_gpu_every_tier_bit_exact(frames, tmp_path, codec):
    cpu = tiered_store(frames, tmp_path / "cpu", hot_device="cpu", codec=codec)
    expected = snapshot(cpu)
    store = tiered_store(frames, tmp_path / "gpu", hot_device="cuda", codec=codec, device="cuda")
    assert parts(store).tiers[HOT].device.type == "cuda" and parts(store).tiers[WARM].pinned
    assert all(v > 0 for v in tier_counts(store).values()), tier_counts(store)
    dec = GpuDecoder("cuda").attach(store)
    got = store.get(np.arange(len(store)))
    assert got["observation"].is_cuda
    assert_td_equal(got.to("cpu"), expected)
    check_gets(store, expected, sizes=(1, 256, 4096))
    st = dec.stats()
    assert st["hot"] > 0 and st["warm"] > 0 and st["cold"] > 0 and st["open"] > 0
    assert st["hot_on_device"] == st["hot"], st  # the arena's "cuda" is this decoder's "cuda:0"
    assert st["cpu_fallbacks"] == 0, st


@pytest.mark.cuda
def test_gpu_checksum_error_on_a_damaged_hot_blob(frames, tmp_path):
    store = tiered_store(frames, tmp_path / "s", hot_device="cuda", device="cuda")
    GpuDecoder("cuda").attach(store)
    idx = parts(store).index
    live = idx.live_ids()
    victim = int(live[idx.loc[live, HOT] >= 0][0])
    parts(store).tiers[HOT].buffer[int(idx.loc[victim, HOT]) + 3] ^= 0x5A
    rows = np.flatnonzero((parts(store).layout.tables[("observation",)].blob[: len(store)] == victim).any(1))
    with pytest.raises(ChecksumError, match=f"blob {victim} "):
        store.get(rows[:2])


@pytest.mark.cuda
def test_gpu_oom_split_and_fallback_stay_exact(tmp_path):
    # in a child: the injected failures reach nvCOMP's allocator callback (see module docstring)
    res = run_child(f"""
        import numpy as np, torch
        from helpers import assert_td_equal
        from test_gpu import FIXTURE, tiered_store, snapshot
        from tiered.atari import load_fixture
        from tiered.engine.gpu_read import GpuDecoder
        from tiered.tiers.arena import inject_oom

        frames = load_fixture(FIXTURE, games=["Breakout", "MsPacman"])
        expected = snapshot(tiered_store(frames, {str(tmp_path / "cpu")!r}, hot_device="cpu"))
        store = tiered_store(frames, {str(tmp_path / "gpu")!r}, hot_device="cuda", device="cuda")
        dec = GpuDecoder("cuda").attach(store)
        rows = np.arange(len(store))
        # the probe runs on the first batch, outside the injection: an OOM-spoiled probe would
        # send the batch to the CPU, and a fallback would pass for a split
        assert_td_equal(store.get(rows[:8]).to("cpu"), expected[:8])
        assert dec.stats()["backend"] == "nvcomp" and dec.stats()["probes"]["zstd"]["cached"]
        block = dec.stats()["h2d_bytes"]
        assert_td_equal(store.get(rows).to("cpu"), expected)
        block = dec.stats()["h2d_bytes"] - block  # the staged part of one whole batch
        with inject_oom(block // 3, only="batch"):  # parts of 8 blobs stay far below it
            got = store.get(rows)
        assert_td_equal(got.to("cpu"), expected)
        st = dec.stats()
        assert st["splits"] > 0 and st["cpu_fallbacks"] == 0, st
        # Fails inside nvCOMP's call only (the allocator callback raises into nvCOMP). nvCOMP's
        # scratch sizes are its own: some limit between a part's scratch and the whole batch's
        # must split the batch on the GPU, and every limit must give exact data.
        split_at = []
        for shift in range(27, 11, -1):
            before = dec.stats()
            with inject_oom(1 << shift, only="scratch"):
                assert_td_equal(store.get(rows).to("cpu"), expected)
            after = dec.stats()
            d = {{k: after[k] - before[k] for k in ("oom_events", "splits", "cpu_fallbacks")}}
            if d["oom_events"] and d["splits"] and not d["cpu_fallbacks"]:
                split_at.append(1 << shift)
        assert split_at, "no scratch limit split a batch on the GPU"
        with inject_oom(0, only=("output", "batch", "scratch", "index")):
            assert_td_equal(store.get(rows).to("cpu"), expected)
        assert dec.stats()["cpu_fallbacks"] >= 1
        assert_td_equal(store.get(rows).to("cpu"), expected)  # and the GPU path works afterwards
        torch.cuda.synchronize()  # no sticky error was left behind
        print("ok", dec.stats()["oom_events"], split_at)
        """)
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.stdout.startswith("ok"), res.stdout


@pytest.mark.cuda
def test_nvcomp_probe_cells_and_large_cells(nvcomp_codecs):
    probe = nvcomp_codecs["zstd"].probe()
    assert probe["cached"] and not probe["oom"], probe
    assert probe["large"], probe  # 100,800-byte cells (RGB frames) decode with a fitting chunk size


@pytest.mark.cuda
def test_device_none_tensordict_with_cuda_leaves(frames):
    store = TieredStore(64, frames={"observation": 0}, device="cuda")
    td = frames[:8].clone().to("cuda")
    td.clear_device_()
    assert td.device is None and td["observation"].is_cuda
    store.extend(td)
    assert_td_equal(store.get(np.arange(8)).to("cpu"), frames[:8])


@pytest.mark.cuda
def test_cpu_only_store_does_not_start_cuda_and_works_in_a_forked_worker(tmp_path):
    res = run_child(f"""
        import multiprocessing as mp
        import numpy as np, torch
        from test_gpu import FIXTURE
        from tiered import TieredStore
        from tiered.atari import load_fixture

        frames = load_fixture(FIXTURE, games=["Pong"])[:200]
        store = TieredStore(256, {str(tmp_path / "s")!r}, frames={{"observation": 0}}, hot_bytes=0,
                            device="cpu")
        store.extend(frames)
        store.flush()
        assert bool((store.get(np.arange(5))["observation"] == frames["observation"][:5]).all())
        assert not torch.cuda.is_initialized(), "a CPU-only store started CUDA"
        torch.zeros(1, device="cuda")  # the parent starts CUDA, as a training script does

        def worker(q):
            import warnings
            from tiered.engine.gpu_read import maybe_gpu_decoder

            s = TieredStore.open({str(tmp_path / "s")!r}, mode="r")  # default options, in a forked child
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                dec = maybe_gpu_decoder(torch.device("cuda"))  # CUDA cannot start here: warn, CPU
            q.put((int(s.get(np.arange(7))["observation"].sum()), dec is None,
                   any("forked" in str(w.message) for w in seen)))

        q = mp.get_context("fork").Queue()
        p = mp.get_context("fork").Process(target=worker, args=(q,))
        p.start(); p.join(120)
        assert p.exitcode == 0, p.exitcode
        assert q.get(timeout=5) == (int(frames["observation"][:7].sum()), True, True)
        print("ok")
        """)
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.stdout.strip() == "ok"


@pytest.mark.cuda
def test_gpu_decode_is_ordered_against_a_busy_consumer_stream(frames):
    store = TieredStore(4100, frames={"observation": 0}, device="cuda", hot_bytes="256MiB")
    store.extend(frames)
    reference = TieredStore(4100, frames={"observation": 0})
    reference.extend(frames)
    GpuDecoder("cuda").attach(store)
    rng = np.random.default_rng(5)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        for _ in range(5):
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(3):
                a = a @ a  # long kernels queued before the sample on the consumer stream
            ix = rng.integers(0, len(store), 1024)
            got = store.get(ix)
            obs = got["observation"].float().sum()  # consumed on the consumer stream
            assert torch.equal(got["observation"].cpu(), reference.get(ix)["observation"])
            assert obs.item() == reference.get(ix)["observation"].float().sum().item()


@pytest.mark.cuda
def test_gpu_prefetch_promotions_and_main_thread_writes_stay_exact(tmp_path):
    # a prefetch thread's decoder promotes blobs into the hot arena on its own stream while the
    # main thread's gets promote, demote and reuse extents of the same arena on the default
    # stream: every writer waits for the other stream's queued writes (the arena's StreamOrder),
    # so no batch reads stale bytes and no blob fails its checksum
    res = run_child(f"""
        import numpy as np, torch
        from helpers import assert_td_equal
        from test_gpu import FIXTURE, tiered_store, snapshot
        from tiered import TieredStore
        from tiered.atari import load_fixture
        from tiered.engine.gpu_read import GpuDecoder
        from tiered.engine.blob_index import HOT
        from tiered.prefetch import Prefetcher
        from tiered.testing import parts

        frames = load_fixture(FIXTURE, games=["Breakout", "MsPacman"])
        built = tiered_store(frames, {str(tmp_path / "s")!r}, hot_device="cpu", rows=1200)
        expected = snapshot(built)
        built.close()
        store = TieredStore.open({str(tmp_path / "s")!r}, mode="r", hot_device="cuda", hot_bytes="32KiB",
                                 warm_bytes="1MiB", device="cuda")
        dec = GpuDecoder("cuda").attach(store)
        hot = parts(store).tiers[HOT]
        rng, main_rng = np.random.default_rng(0), np.random.default_rng(1)
        with Prefetcher(store, lambda: rng.integers(0, len(store), 512), depth=3) as pf:
            for _ in range(25):
                ix, batch = next(pf)
                assert_td_equal(batch.to("cpu"), expected[torch.from_numpy(ix)])
                j = main_rng.integers(0, len(store), 256)
                assert_td_equal(store.get(j).to("cpu"), expected[torch.from_numpy(j)])
        st, tiers = dec.stats(), store.stats()["tiers"]
        assert st["checksum_failures"] == 0 and st["cpu_fallbacks"] == 0, st
        assert tiers["hot"]["promotions"] > 0 and tiers["hot"]["demotions"] > 0, tiers
        order = hot.stats()["stream_order"]
        assert order["waits"] > 0, order
        torch.cuda.synchronize()
        print("ok", order, tiers["hot"])
        """)
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.stdout.startswith("ok"), res.stdout


@pytest.mark.cuda
def test_gpu_pinned_warm_arena_is_registered_not_cached():
    # growing a pinned arena by doubling through torch's caching host allocator would pin about
    # twice its budget (power-of-two blocks, freed ones kept); the arena registers its own pages
    res = run_child("""
        import gc
        import numpy as np, torch
        from tiered.tiers.arena import HostTier

        torch.zeros(1, device="cuda")
        def cached():
            return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
        before = cached()
        t = HostTier("96MiB", pinned=True)
        for _ in range(90):
            t.allocate(np.array([1 << 20]))  # grows 64 KiB, 128 KiB, ... up to the budget
        assert t.capacity == 96 << 20 and t.buffer.is_pinned(), (t.capacity, t.buffer.is_pinned())
        grown = cached() - before
        assert grown < 8 << 20, f"the arena went through torch's caching host allocator: {grown} bytes"
        data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        t.write(np.array([5 << 20]), data.numpy(), np.array([0]), np.array([1 << 20]))
        dev = t.buffer[5 << 20:6 << 20].to("cuda", non_blocking=True)
        assert torch.equal(dev.cpu(), data)
        t.close()
        gc.collect()
        torch.cuda.synchronize()
        print("ok", grown)
        """)
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.stdout.startswith("ok"), res.stdout


@pytest.mark.cuda
def test_gpu_sticky_cuda_error_is_reported_not_a_cpu_fallback(tmp_path):
    # after an illegal memory access (a sticky error: the CUDA context is dead) neither nvCOMP's
    # probe nor a sample may pass for "decode on the CPU": both raise DeviceFailedError
    res = run_child(f"""
        import numpy as np, torch
        try:
            import cupy
        except ImportError:
            raise SystemExit(3)
        from test_gpu import FIXTURE, tiered_store
        from tiered.atari import load_fixture
        from tiered.codecs.nvcomp import NvcompCodec
        from tiered.errors import DeviceFailedError
        from tiered.engine.gpu_read import GpuDecoder

        frames = load_fixture(FIXTURE, games=["Pong"])
        store = tiered_store(frames, {str(tmp_path / "s")!r}, hot_device="cuda", device="cuda", rows=200)
        GpuDecoder("cuda", bucket=False).attach(store)
        codec = NvcompCodec("zstd", execution_policy="latency")  # a probe key not yet probed
        poke = cupy.RawKernel(r'extern "C" __global__ void poke(unsigned long long a) {{ *(volatile int*)a = 1; }}',
                              "poke")
        poke((1,), (1,), (np.uint64(16),))
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            print("sticky:", str(e).splitlines()[0])
        try:
            codec.probe()
        except DeviceFailedError as e:
            print("probe: DeviceFailedError", str(e)[:100])
        else:
            raise AssertionError("the probe passed on a dead CUDA context")
        try:
            store.get(np.arange(8))
        except RuntimeError as e:  # DeviceFailedError where the decoder meets it first
            print("get:", type(e).__name__, str(e)[:100])
        else:
            raise AssertionError("a sample was returned from a dead CUDA context")
        print("ok")
        """)
    if res.returncode == 3:
        pytest.skip("cupy (the illegal-address kernel) is not installed on this GPU machine")
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.stdout.rstrip().endswith("ok"), res.stdout


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["copy_blobs", "hot arena write"])
def test_gpu_host_to_cuda_copies_do_not_wait_for_the_stream(how):
    # a promotion from the pinned staging (or any host buffer) into the hot arena is queued behind
    # the decode on the same stream; a pageable upload would make the host wait for all of it
    from tiered.tiers.arena import DeviceTier
    from tiered.util.copy import copy_blobs

    rng = np.random.default_rng(2)
    sizes = rng.integers(1, 3000, 300)
    src = rng.integers(0, 256, int(sizes.sum()) + 8 * sizes.size, dtype=np.uint8)
    so = np.concatenate([[0], np.cumsum(sizes + 8)[:-1]]).astype(np.int64)  # scattered: the gather path
    do = np.concatenate([[0], np.cumsum((sizes + 15) // 16 * 16)[:-1]]).astype(np.int64)
    arena = DeviceTier("16MiB", device="cuda")
    off = arena.allocate(sizes)
    dst = torch.zeros(int(do[-1] + sizes[-1]), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time queued on the current stream
    if how == "copy_blobs":
        copy_blobs(src, so, dst, do, sizes)
    else:
        arena.write(off, src, so, sizes)
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "the copy made the host wait for the stream's earlier work"
    got = dst if how == "copy_blobs" else arena.buffer
    at = do if how == "copy_blobs" else off
    want = np.concatenate([src[o:o + n] for o, n in zip(so.tolist(), sizes.tolist(), strict=True)])
    have = np.concatenate([got[o:o + n].cpu().numpy() for o, n in zip(at.tolist(), sizes.tolist(), strict=True)])
    assert np.array_equal(have, want)
