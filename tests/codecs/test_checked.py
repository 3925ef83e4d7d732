"""Checking and decoding one-blob cells split over threads (tiered.codecs.checked).

Large cells that share no frames (VecNorm'd float32 ``[4, 84, 84]`` stacks) are stored one blob
per cell; a batch of megabytes is cut into one slice of blobs per thread, and each thread checks
its blobs' checksums before it decodes them. These tests show that:

* the bytes are the same on one thread and split over two (both codecs that split, zstd and raw),
  with blobs used by several cells and blobs of different sizes;
* a damaged blob is caught whichever slice it falls in, in the function and through a store's
  ``get`` (a ChecksumError naming the blob; nothing promoted from the damaged read);
* small batches stay on the calling thread, and a slice whose codec would split its decode again
  runs that decode inline instead of waiting for the pool's busy threads;
* when the pool's threads are all busy, the calling thread runs the slices they have not started
  instead of waiting for them.
"""

from __future__ import annotations

import threading
import time
from functools import partial

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, flip_blob_byte
from tensordict import TensorDict

from tiered import TieredStore
from tiered.codecs import RawCodec, ZstdCodec, checked
from tiered.codecs import zstd as zstd_module
from tiered.codecs.checked import decode_cells_checked
from tiered.errors import ChecksumError, CorruptionError
from tiered.testing import parts
from tiered.testing.calls import run_profiled
from tiered.util.pool import run_parallel

CELL = 4 * 84 * 84 * 4

pytestmark = pytest.mark.filterwarnings("ignore::tiered.errors.LowCompressionWarning")


def float_stacks(atari: TensorDict, n: int) -> TensorDict:
    """Real frames as float stacks normalized after stacking (no two stacks share bytes)."""
    obs = atari["observation"][:n + 1].float() / 255.0
    scale = 1.0 + torch.arange(n + 1, dtype=torch.float32).reshape(-1, 1, 1, 1) * 1e-3
    norm = (obs - 0.3) / scale
    return TensorDict({"pixels": norm[:n], ("next", "pixels"): norm[1:n + 1]}, [n])


def encoded_cells(atari: TensorDict, codec, n: int = 24):
    raw = float_stacks(atari, n)["pixels"].numpy().reshape(-1).view(np.uint8)
    enc = codec.encode(raw, np.arange(n, dtype=np.int64) * CELL, np.full(n, CELL, dtype=np.int64))
    return raw.reshape(n, CELL), enc


def damage_blob_then_get(s: TieredStore, data: TensorDict, rows: np.ndarray, fields: list, blob: int,
                         n: int) -> None:
    """Flip a bit in the middle of `blob` where `s` keeps it; a get of `rows` raises a ChecksumError
    naming the blob and decodes and promotes nothing, and the rows of the first `n` that do not read
    the blob still read back as `data`."""
    p = parts(s)
    flip_blob_byte(s, blob)
    decoded = s.stats()["counters"]["blobs_decoded"]
    where_before = p.index.loc[blob].copy()
    with pytest.raises(ChecksumError, match=f"blob {blob} "):
        s.get(rows)
    assert s.stats()["counters"]["blobs_decoded"] == decoded
    assert np.array_equal(p.index.loc[blob], where_before)  # the damaged bytes were not promoted
    others = np.array([r for r in range(n) if blob not in p.layout.blob_refs(fields, np.array([r]))[0]])
    assert_td_equal(s.get(others), data[torch.from_numpy(others)])


@pytest.mark.parametrize("codec", [ZstdCodec(3, threads=2), RawCodec()], ids=["zstd", "raw"])
@pytest.mark.parametrize("split", [False, True])
def test_same_bytes_on_one_thread_and_split_over_two(atari_pong, codec, split, monkeypatch):
    monkeypatch.setattr(checked, "MIN_SPLIT_BYTES", 0 if split else 1 << 62)
    raw, enc = encoded_cells(atari_pong, codec)
    assert split is False or np.unique(enc.sizes).size > 1 or codec.format == "raw"
    which = np.array([5, 0, 0, 23, 7, 7, 7, 12, 1, 2, 3, 4, 6, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22])
    want = raw[which]
    for threads in (1, 2):
        out = np.full(which.size * CELL, 0xAB, np.uint8)
        bad = decode_cells_checked(codec, enc.data, enc.offsets, enc.sizes, enc.checksums, which, out, CELL,
                                   threads=threads)
        assert bad.tolist() == []
        assert np.array_equal(out.reshape(-1, CELL), want)


@pytest.mark.parametrize("where", ["first", "last", "both"])
def test_a_damaged_blob_is_caught_in_either_slice(atari_pong, where, monkeypatch):
    monkeypatch.setattr(checked, "MIN_SPLIT_BYTES", 0)
    codec = ZstdCodec(3, threads=2)
    raw, enc = encoded_cells(atari_pong, codec)
    which = np.arange(enc.sizes.size)
    # two slices of consecutive blobs: the first blob is in the first one, the last in the other
    last = enc.sizes.size - 1
    damaged = {"first": [0], "last": [last], "both": [0, last]}[where]
    data = enc.data.copy()
    for b in damaged:
        data[enc.offsets[b] + enc.sizes[b] // 2] ^= 0x10
    out = np.empty(which.size * CELL, np.uint8)
    bad = decode_cells_checked(codec, data, enc.offsets, enc.sizes, enc.checksums, which, out, CELL, threads=2)
    assert bad.tolist() == damaged
    # unchecked, the same bytes are decoded (or fail in the codec): the check is what caught them
    assert decode_cells_checked(codec, enc.data, enc.offsets, enc.sizes, None, which, out, CELL,
                                threads=2).tolist() == []
    assert np.array_equal(out.reshape(-1, CELL), raw)


def test_small_batches_stay_on_the_calling_thread(atari_pong, monkeypatch):
    codec = RawCodec()
    raw, enc = encoded_cells(atari_pong, codec, n=4)
    calls: list[str] = []
    original = codec.decode

    def decode(*args):
        calls.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(codec, "decode", decode)
    which = np.arange(4)
    out = np.empty(4 * CELL, np.uint8)
    # 4 stacks stay on the calling thread; 32 sampled transitions with their next observations split
    assert 4 * CELL < checked.MIN_SPLIT_BYTES <= 64 * CELL
    decode_cells_checked(codec, enc.data, enc.offsets, enc.sizes, enc.checksums, which, out, CELL, threads=2)
    assert calls == [threading.current_thread().name]
    monkeypatch.setattr(checked, "MIN_SPLIT_BYTES", 0)
    calls.clear()
    decode_cells_checked(codec, enc.data, enc.offsets, enc.sizes, enc.checksums, which, out, CELL, threads=2)
    # two slices (on two threads, or both on the caller when the pool thread starts late)
    assert len(calls) == 2 and np.array_equal(out.reshape(-1, CELL), raw)


def test_a_slice_whose_codec_would_split_again_decodes_inline(atari_pong, monkeypatch):
    # both levels would split: the outer slices hold the pool's only thread and the caller, so an
    # inner split waiting for the pool would never finish
    monkeypatch.setattr(checked, "MIN_SPLIT_BYTES", 0)
    monkeypatch.setattr(zstd_module, "_MIN_BYTES_FOR_THREADS", 0)
    codec = ZstdCodec(3, threads=2)
    raw, enc = encoded_cells(atari_pong, codec)
    which = np.arange(enc.sizes.size)
    out = np.empty(which.size * CELL, np.uint8)
    result: list = []
    names: list[str] = []

    def nested() -> None:
        result.append(decode_cells_checked(codec, enc.data, enc.offsets, enc.sizes, enc.checksums, which, out,
                                           CELL, threads=2))
        run_parallel(lambda: run_parallel(lambda: names.append(threading.current_thread().name), [(), ()], 2),
                     [(), ()], 2)

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "a nested split waited for busy pool threads"
    assert result[0].tolist() == [] and np.array_equal(out.reshape(-1, CELL), raw)
    assert len(names) == 4 and len(set(names)) == 2  # the inner tasks ran where their outer task ran


@pytest.mark.parametrize("half", [0, 1])
def test_store_get_checks_each_slice(atari_pong, half, monkeypatch):
    monkeypatch.setattr(checked, "MIN_SPLIT_BYTES", 0)
    data = float_stacks(atari_pong, 40)
    s = TieredStore(64, stage_rows=0, threads=2)
    s.extend(data)
    p = parts(s)
    rows = np.arange(0, 40, 3)
    assert_td_equal(s.get(rows), data[torch.from_numpy(rows)])  # split, both slices clean
    # damage a blob that the next get's slice `half` checks: the first or the last one it reads
    fields = [p.layout.schema["pixels"], p.layout.schema["next", "pixels"]]
    blobs = np.unique(p.layout.blob_refs(fields, rows)[0])
    blob = int(blobs[0] if half == 0 else blobs[-1])
    damage_blob_then_get(s, data, rows, fields, blob, 40)


def test_slices_no_pool_thread_started_run_on_the_calling_thread():
    # every pool thread busy: another caller's tasks block them (its own last task too). The pool's
    # queue is first in, first out, so the claiming call's helper jobs wait behind those tasks and
    # it runs all its tasks itself and returns; a call without claim would wait for a pool thread
    release = threading.Event()
    entered = threading.Semaphore(0)
    busy = 16

    def block() -> None:
        entered.release()
        release.wait()

    blocker = threading.Thread(target=run_parallel, args=(block, [()] * (busy + 1), busy + 1), daemon=True)
    blocker.start()
    ran: list[tuple[int, str]] = []
    try:
        for _ in range(busy + 1):  # every blocking task running: the pool's threads are all taken
            assert entered.acquire(timeout=60)
        run_parallel(lambda k: ran.append((k, threading.current_thread().name)), [(0,), (1,), (2,)], 3, claim=True)
        assert sorted(k for k, _ in ran) == [0, 1, 2]
        assert {name for _, name in ran} == {threading.current_thread().name}
    finally:
        release.set()
        blocker.join(60)
    assert not blocker.is_alive()


# -- batches of many small blobs (time chunks of Atari frames): decode_checked -----------------

K = 8


def encoded_chunks(atari: TensorDict, codec, n: int = 40):
    """Real 84x84 frames in time chunks of K, compressed as a store writes them."""
    frames = atari["observation"][:n * K, -1].numpy().reshape(n, -1)
    enc = codec.encode(frames.reshape(-1), np.arange(n, dtype=np.int64) * frames.shape[1],
                       np.full(n, frames.shape[1], dtype=np.int64))
    return frames, enc


@pytest.mark.parametrize("split", [False, True])
def test_chunks_decode_to_the_same_bytes_on_one_thread_and_split(atari_pong, split, monkeypatch):
    monkeypatch.setattr(checked, "MIN_CHUNK_SPLIT_BYTES", 0 if split else 1 << 62)
    codec = ZstdCodec(3, threads=2)
    frames, enc = encoded_chunks(atari_pong, codec)
    cb = frames.shape[1]
    order = np.random.default_rng(0).permutation(enc.sizes.size)  # decoded into shuffled places
    for threads in (1, 2):
        out = np.full(order.size * cb, 0xAB, np.uint8)
        bad = checked.decode_checked(codec, enc.data, enc.offsets, enc.sizes, enc.checksums, out, order * cb,
                                     np.full(order.size, cb, dtype=np.int64), threads=threads)
        assert bad.tolist() == []
        assert np.array_equal(out.reshape(-1, cb)[order], frames)


@pytest.mark.parametrize("where", ["first", "last", "both"])
def test_a_damaged_chunk_is_caught_in_either_slice(atari_pong, where, monkeypatch):
    monkeypatch.setattr(checked, "MIN_CHUNK_SPLIT_BYTES", 0)
    codec = ZstdCodec(3, threads=2)
    frames, enc = encoded_chunks(atari_pong, codec)
    cb, last = frames.shape[1], enc.sizes.size - 1
    damaged = {"first": [0], "last": [last], "both": [0, last]}[where]
    data = enc.data.copy()
    for b in damaged:
        data[enc.offsets[b] + enc.sizes[b] // 2] ^= 0x10
    out = np.empty(frames.size, np.uint8)
    out_offsets, out_sizes = np.arange(last + 1, dtype=np.int64) * cb, np.full(last + 1, cb, dtype=np.int64)
    for threads in (1, 2):
        bad = checked.decode_checked(codec, data, enc.offsets, enc.sizes, enc.checksums, out, out_offsets,
                                     out_sizes, threads=threads)
        # one thread stops at the first check; split, each slice reports its own damage
        assert bad.tolist() == damaged
    assert checked.decode_checked(codec, enc.data, enc.offsets, enc.sizes, None, out, out_offsets, out_sizes,
                                  threads=2).tolist() == []
    assert np.array_equal(out.reshape(-1, cb), frames)


def test_a_b256_sample_of_atari_stacks_is_split(atari_pong, monkeypatch):
    """The decoded bytes of a batch-256 sample of stacks with next observations (~180 chunks of 8
    frames, ~10 MB) are past the split point; a batch-64 sample's (~90 chunks) and a batch-1
    sample's (a few) are not."""
    frame = 84 * 84
    assert 90 * K * frame < checked.MIN_CHUNK_SPLIT_BYTES <= 180 * K * frame
    codec = RawCodec()
    calls: list[str] = []
    original = codec.decode

    def decode(*args):
        calls.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(codec, "decode", decode)
    frames, enc = encoded_chunks(atari_pong, codec, n=180)
    cb = frames.shape[1]
    out = np.empty(frames.size, np.uint8)
    for n, slices in ((4, 1), (90, 1), (180, 2)):
        calls.clear()
        bad = checked.decode_checked(codec, enc.data, enc.offsets[:n], enc.sizes[:n], enc.checksums[:n], out,
                                     np.arange(n, dtype=np.int64) * cb, np.full(n, cb, dtype=np.int64), threads=2)
        assert bad.tolist() == [] and len(calls) == slices  # (two slices: on two threads, or both here)
        assert np.array_equal(out[:n * cb].reshape(n, cb), frames[:n])


@pytest.mark.parametrize("half", [0, 1])
def test_store_get_of_atari_stacks_checks_each_slice(atari_pong, half, monkeypatch):
    monkeypatch.setattr(checked, "MIN_CHUNK_SPLIT_BYTES", 0)
    data = atari_pong[:400]
    s = TieredStore(512, stage_rows=0, threads=2)
    s.extend(data)
    p = parts(s)
    rows = np.arange(3, 390, 7)
    assert_td_equal(s.get(rows), data[torch.from_numpy(rows)])  # split, both slices clean
    fields = [p.layout.schema["observation"], p.layout.schema["next", "observation"]]
    blobs = np.unique(p.layout.blob_refs(fields, rows)[0])
    stored = blobs[p.index.state[blobs] != 1]  # (not an open time chunk: those are raw in memory)
    blob = int(stored[0] if half == 0 else stored[-1])
    damage_blob_then_get(s, data, rows, fields, blob, 390)


def _pool_cpu_seconds() -> float:
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threading.enumerate()
               if t.name.startswith("tiered-codec") and t.ident is not None)


def test_no_pool_thread_uses_cpu_once_its_batch_is_done(atari_pong, monkeypatch):
    """A pool thread sleeps as soon as its batch is done: over an idle second after split gets,
    the pool's threads use (almost) no CPU time, where a thread still spinning would use the
    whole second. (CPU time, not wall time: what a learner on the same cores would lose.)"""
    monkeypatch.setattr(checked, "MIN_CHUNK_SPLIT_BYTES", 0)
    s = TieredStore(512, stage_rows=0, threads=4)
    s.extend(atari_pong[:400])
    for k in range(20):
        s.get(np.arange(k, 400, 5))
    assert any(t.name.startswith("tiered-codec") for t in threading.enumerate())
    before = _pool_cpu_seconds()
    time.sleep(1.0)
    assert _pool_cpu_seconds() - before < 0.05


# -- the split decode's jobs: prepared by the calling thread, one C call on the pool's ------------


def _split_decode(codec, data, enc, out_offsets, out_sizes, out, checksums="stored"):
    sums = enc.checksums if checksums == "stored" else checksums
    return checked.decode_checked(codec, data, enc.offsets, enc.sizes, sums, out, out_offsets, out_sizes, threads=2)


def split_chunks(atari: TensorDict, monkeypatch, n: int):
    """A two-thread zstd codec that splits every batch, ``n`` real time chunks encoded by it, and
    the chunks' decoded size and count: ``(codec, frames, enc, cb, n)``."""
    monkeypatch.setattr(checked, "MIN_CHUNK_SPLIT_BYTES", 0)
    codec = ZstdCodec(3, threads=2)
    frames, enc = encoded_chunks(atari, codec, n=n)
    return codec, frames, enc, frames.shape[1], enc.sizes.size


@pytest.mark.parametrize("n", [2, 3, 5, 40])
def test_a_split_of_a_small_batch_decodes_exactly(atari_pong, n, monkeypatch):
    # two chunks and up, into places with gaps (an open time chunk's place between stored ones)
    # and out of order: runs of frames back to back in both buffers, and frames alone
    monkeypatch.setattr(checked, "MIN_CHUNK_SPLIT_BYTES", 0)
    codec = ZstdCodec(3, threads=2)
    frames, enc = encoded_chunks(atari_pong, codec, n=n)
    cb = frames.shape[1]
    place = np.arange(n, dtype=np.int64)
    place[n // 2:] += 1  # a gap in the middle
    if n > 3:
        place[[0, 1]] = place[[1, 0]]  # two swapped
    out = np.full((n + 1) * cb, 0xAB, np.uint8)
    bad = _split_decode(codec, enc.data, enc, place * cb, np.full(n, cb, dtype=np.int64), out)
    assert bad.tolist() == []
    assert np.array_equal(out.reshape(-1, cb)[place], frames)
    assert (out.reshape(-1, cb)[n // 2] == 0xAB).all()  # the gap: left alone


@pytest.mark.parametrize("which", ["first", "last"])
def test_an_undecodable_chunk_is_named_in_either_slice(atari_pong, which, monkeypatch):
    # damage that the checksums do not see (none given): the codec names the blob, whichever
    # thread's slice (the calling thread's: the first; the pool thread's: the last) decoded it
    codec, frames, enc, cb, n = split_chunks(atari_pong, monkeypatch, 20)
    b = 0 if which == "first" else n - 1
    data = enc.data.copy()
    data[enc.offsets[b] + 6: enc.offsets[b] + enc.sizes[b]] = 0xFF  # the header kept, the blocks garbage
    out = np.empty(n * cb, np.uint8)
    with pytest.raises(CorruptionError, match=f"zstd blob {b} of this batch"):
        _split_decode(codec, data, enc, np.arange(n, dtype=np.int64) * cb, np.full(n, cb, dtype=np.int64), out,
                      checksums=None)
    # the decompressors that met the damage decode the next batch whole
    assert _split_decode(codec, enc.data, enc, np.arange(n, dtype=np.int64) * cb, np.full(n, cb, dtype=np.int64),
                         out).tolist() == []
    assert np.array_equal(out.reshape(n, cb), frames)


def test_a_truncated_chunk_is_named_in_the_pool_threads_slice(atari_pong, monkeypatch):
    # a frame cut short at the end of the batch decodes to fewer bytes than its header declares
    codec, frames, enc, cb, n = split_chunks(atari_pong, monkeypatch, 20)
    sizes = enc.sizes.copy()
    sizes[-1] -= 20
    out = np.empty(n * cb, np.uint8)
    with pytest.raises(CorruptionError, match=f"zstd blob {n - 1} of this batch"):
        checked.decode_checked(codec, enc.data, enc.offsets, sizes, None, out, np.arange(n, dtype=np.int64) * cb,
                               np.full(n, cb, dtype=np.int64), threads=2)


def test_a_damaged_chunk_in_the_pool_threads_slice_decodes_nothing(atari_pong, monkeypatch):
    # the pool thread's slice is checked before the handoff: damage there starts no decode at all
    codec, frames, enc, cb, n = split_chunks(atari_pong, monkeypatch, 20)
    data = enc.data.copy()
    data[enc.offsets[n - 2] + enc.sizes[n - 2] // 2] ^= 0x01
    out = np.full(n * cb, 0xAB, np.uint8)
    bad = _split_decode(codec, data, enc, np.arange(n, dtype=np.int64) * cb, np.full(n, cb, dtype=np.int64), out)
    assert bad.tolist() == [n - 2]
    assert (out == 0xAB).all()


def test_split_decodes_from_several_threads_at_once(atari_pong, monkeypatch):
    # each calling thread's slices use its own decompressors: concurrent callers of one codec
    codec, frames, enc, cb, n = split_chunks(atari_pong, monkeypatch, 30)
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = np.empty(n * cb, np.uint8)
        try:
            for _ in range(30):
                place = rng.permutation(n)
                bad = _split_decode(codec, enc.data, enc, place * cb, np.full(n, cb, dtype=np.int64), out)
                assert bad.tolist() == [] and np.array_equal(out.reshape(-1, cb)[place], frames)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]


def test_the_pool_threads_job_is_one_c_call(atari_pong):
    # what the handoff gives a pool thread: a C callable over C iterators, so a thread that runs
    # it takes the GIL only between runs of frames (none of the slice's Python work is left in it)
    codec = ZstdCodec(3, threads=2)
    frames, enc = encoded_chunks(atari_pong, codec, n=10)
    cb, n = frames.shape[1], enc.sizes.size
    out = np.empty(n * cb, np.uint8)
    sliced = codec.sliced_decode(enc.data, enc.offsets, enc.sizes, out, np.arange(n, dtype=np.int64) * cb,
                                 np.full(n, cb, dtype=np.int64), [0, 4, n])
    fn, args = sliced.job(1)
    seen: list[str] = []
    run_profiled(partial(fn, *args), lambda frame, event, arg: seen.append(event) if event == "call" else None)
    assert seen == []  # no Python frame ran
    fn0, args0 = sliced.job(0)
    fn0(*args0)
    sliced.finish(None)
    assert np.array_equal(out.reshape(n, cb), frames)


def test_blobs_with_bytes_past_their_frame_decode_as_each_alone_does(atari_pong, monkeypatch):
    # a run of frames read as one stream would take a blob's trailing bytes for the next frame;
    # each frame decodes whole alone, so the split decode must give the frames (one thread too)
    codec, frames, enc, cb, n = split_chunks(atari_pong, monkeypatch, 12)
    pad = 5
    data = np.concatenate([np.concatenate([enc.data[o:o + s], np.full(pad, 0x11, np.uint8)])
                           for o, s in zip(enc.offsets.tolist(), enc.sizes.tolist(), strict=True)])
    sizes = enc.sizes + pad
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    for threads in (1, 2):
        out = np.empty(n * cb, np.uint8)
        bad = checked.decode_checked(codec, data, offsets, sizes, None, out, np.arange(n, dtype=np.int64) * cb,
                                     np.full(n, cb, dtype=np.int64), threads=threads)
        assert bad.tolist() == [] and np.array_equal(out.reshape(n, cb), frames)
