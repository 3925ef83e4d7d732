"""Prefetcher: bit-exact batches in order, bounded look-ahead, errors reach the consumer, clean shutdown.

Runs on CPU-only CI with real Atari frames (benchmarks/data fixture); the CUDA test checks the
stream/event ordering on a GPU machine.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_td_equal

from tiered import TieredStore
from tiered.atari import load_fixture
from tiered.engine.gpu_read import GpuDecoder
from tiered.errors import IndexOutOfRangeError
from tiered.prefetch import Prefetcher
from tiered.testing import parts

FIXTURE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "atari_frames.npz"


@pytest.fixture(scope="module", autouse=True)
def _collect_prefetchers():
    """Leave no Prefetcher garbage behind: a later ``__del__`` would run inside other modules' tests
    (e.g. the call-count tests, which profile every Python call of the main thread)."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def frames():
    return load_fixture(FIXTURE, games=["Breakout"])[:400]


@pytest.fixture()
def store(frames):
    s = TieredStore(500, frames={"observation": 0}, hot_device="cpu", hot_bytes="32KiB", warm_bytes="64MiB")
    for i in range(0, 400, 50):
        s.extend(frames[i:i + 50])
    return s


def _sampler(seed: int, n: int, batch: int = 32):
    rng = np.random.default_rng(seed)
    return lambda: rng.integers(0, n, batch)


def _wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("depth", [1, 3])
def test_batches_bit_exact_and_in_order(store, depth):
    ref = _sampler(1, len(store))
    expected_idx = [ref() for _ in range(12)]
    with Prefetcher(store, _sampler(1, len(store)), depth=depth) as pf:
        for want in expected_idx:
            idx, batch = next(pf)
            assert np.array_equal(idx, want)
            assert_td_equal(batch, store.get(idx))
        assert pf.stats()["batches"] == 12


def test_keys_limit_the_fields(store):
    with Prefetcher(store, _sampler(2, len(store)), keys=["action"]) as pf:
        idx, batch = next(pf)
    assert set(batch.keys()) == {"action"}
    assert torch.equal(batch["action"], store.get(idx)["action"])


def test_look_ahead_is_bounded_by_depth(store):
    calls = []
    base = _sampler(3, len(store))

    def sampler():
        calls.append(1)
        return base()

    pf = Prefetcher(store, sampler, depth=2)
    try:
        assert _wait_for(lambda: len(calls) >= 2)
        time.sleep(0.2)  # a worker that ignored the bound would keep sampling now
        assert len(calls) == 2
        next(pf)
        assert _wait_for(lambda: len(calls) == 3)
        time.sleep(0.1)
        assert len(calls) == 3
    finally:
        pf.close()


def test_sampler_exception_reaches_the_consumer(store):
    base = _sampler(4, len(store))
    n = [0]

    def sampler():
        n[0] += 1
        if n[0] == 3:
            raise ValueError("sampler broke on call 3")
        return base()

    pf = Prefetcher(store, sampler, depth=2)
    next(pf)
    next(pf)
    with pytest.raises(ValueError, match="call 3") as info:
        next(pf)
    # the traceback shows where the worker failed
    assert any(tb.name == "sampler" for tb in __import__("traceback").extract_tb(info.value.__traceback__))
    assert not pf.alive
    with pytest.raises(StopIteration):
        next(pf)
    pf.close()


def test_get_exception_reaches_the_consumer(store):
    with Prefetcher(store, lambda: np.array([0, 10_000])) as pf, pytest.raises(IndexOutOfRangeError):
        next(pf)


def test_stop_iteration_ends_a_for_loop(store):
    plan = iter([np.array([0, 1]), np.array([5]), np.array([7, 8, 9])])
    with Prefetcher(store, lambda: next(plan), depth=2) as pf:
        got = [idx.tolist() for idx, _ in pf]
    assert got == [[0, 1], [5], [7, 8, 9]]


def test_close_joins_a_blocked_worker_and_is_idempotent(store):
    before = threading.active_count()
    pf = Prefetcher(store, _sampler(5, len(store)), depth=1)
    assert _wait_for(lambda: pf._sh.queue.qsize() == 1)  # the worker now waits for the consumer
    pf.close()
    assert not pf._thread.is_alive()  # close() joined it (a wedged worker would still run)
    assert not pf.alive
    pf.close()
    with pytest.raises(StopIteration):
        next(pf)
    assert threading.active_count() == before


def test_garbage_collection_stops_the_worker(store):
    pf = Prefetcher(store, _sampler(6, len(store)))
    thread = pf._thread
    del pf
    gc.collect()
    thread.join(5.0)
    assert not thread.is_alive()


def test_with_the_gpu_decoder_cpu_stand_in(store, frames):
    reference = TieredStore(500, frames={"observation": 0})
    for i in range(0, 400, 50):
        reference.extend(frames[i:i + 50])
    dec = GpuDecoder("cpu").attach(store)
    ref_idx = _sampler(7, len(store))
    want = [ref_idx() for _ in range(5)]
    with Prefetcher(store, _sampler(7, len(store)), depth=2) as pf:
        for w in want:
            idx, batch = next(pf)
            assert np.array_equal(idx, w)
            assert_td_equal(batch, reference.get(idx))
    assert dec.stats()["batches"] >= 5


def test_device_option_on_cpu(store):
    with Prefetcher(store, _sampler(8, len(store)), device="cpu") as pf:
        idx, batch = next(pf)
    assert_td_equal(batch, store.get(idx))


def test_bad_arguments(store):
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(store, _sampler(0, 10), depth=0)
    with pytest.raises(TypeError, match="callable"):
        Prefetcher(store, 3)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_cuda_batches_ordered_on_the_consumer_stream(frames):
    store = TieredStore(500, frames={"observation": 0}, device="cuda", hot_bytes="64MiB")
    store.extend(frames)
    dec = GpuDecoder("cuda").attach(store)
    cpu_ref = TieredStore(500, frames={"observation": 0})
    cpu_ref.extend(frames)
    ref = _sampler(9, len(store), batch=256)
    want = [ref() for _ in range(10)]
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer), Prefetcher(store, _sampler(9, len(store), batch=256), depth=2) as pf:
        for w in want:
            # keep the consumer stream busy so a missing wait would read unfinished data
            a = torch.randn(2048, 2048, device="cuda")
            for _ in range(4):
                a = a @ a
            idx, batch = next(pf)
            assert np.array_equal(idx, w)
            got = batch.to("cpu")
            assert_td_equal(got, cpu_ref.get(idx))
    assert dec.stats()["batches"] >= 10 and dec.stats()["cpu_fallbacks"] == 0


@pytest.mark.cuda
def test_prefetch_while_extends_grow_the_hot_arena():
    # extends on the main stream grow the hot arena (a new tensor; the old one is dropped) while
    # the worker's decode stream may still gather from the old one: its memory must not be handed
    # out again before that stream is done (the decoder ties the arena to its stream)
    data = load_fixture(FIXTURE, games=["Breakout", "MsPacman"])[:2400]
    store = TieredStore(2400, frames={"observation": 0}, device="cuda", hot_bytes="1GiB", warm_bytes=0)
    ref = TieredStore(2400, frames={"observation": 0})
    store.extend(data[:200])
    ref.extend(data[:200])
    dec = GpuDecoder("cuda").attach(store)
    arena_sizes = set()
    with Prefetcher(store, _sampler(3, 200, batch=512), depth=3) as pf:
        for i in range(200, 2400, 200):
            store.extend(data[i:i + 200])
            arena_sizes.add(parts(store).tiers[0].capacity)
            junk = torch.full((1 << 22,), 255, dtype=torch.uint8, device="cuda")  # takes freed blocks
            idx, batch = next(pf)
            assert_td_equal(batch.to("cpu"), ref.get(idx))
            del junk
    assert len(arena_sizes) > 2, arena_sizes  # the arena did grow while batches were prefetched
    assert dec.stats()["hot"] > 0 and dec.stats()["cpu_fallbacks"] == 0
