"""The tiering manager: budgets, eviction, promotion, the cold tier, reopen, full disk."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, check_refcounts

import tiered
from tiered import TieredStore
from tiered.engine.blob_index import COLD, HOT, STORED, WARM
from tiered.errors import FormatVersionError, NotATieredStoreError, ReadOnlyStoreError, StorageFullError
from tiered.testing import parts
from tiered.testing.faults import inject_faults


def _tier_blob_sets(store: TieredStore) -> dict[int, set[int]]:
    idx = parts(store).index
    live = idx.live_ids()
    return {t: set(live[idx.loc[live, t] >= 0].tolist()) for t in (HOT, WARM, COLD)}


def test_exclusive_tiers_demote_and_promote_bit_exact(atari_mixed):
    """No path: tiny hot and warm budgets push every blob through demotions and promotions."""
    data = atari_mixed
    store = TieredStore(1500, frames={"observation": 0}, hot_device="cpu", hot_bytes="96KiB",
                       warm_bytes="8MiB", policy="lru", chunk_frames=4)  # budgets sized for K=4 blobs
    model = {}
    rng = np.random.default_rng(0)
    pos = 0
    for step in range(60):
        if rng.random() < 0.5 or len(store) == 0:
            c = int(rng.integers(1, 120))
            rows = store.extend(data[pos % 3800:pos % 3800 + c]).numpy()
            for i, r in enumerate(rows):
                model[int(r)] = pos % 3800 + i
            pos += c
        else:
            idx = rng.integers(0, len(store), size=int(rng.integers(1, 300)))
            got = store.get(idx)
            expect = data[torch.as_tensor([model[int(i)] for i in idx])]
            assert_td_equal(got, expect)
        sets = _tier_blob_sets(store)
        assert not (sets[HOT] & sets[WARM]), f"step {step}: a blob is in two exclusive tiers"
        live = set(parts(store).index.live_ids().tolist())
        stored = live - {int(b) for f in parts(store).layout.families for b in f.open_blob}
        assert sets[HOT] | sets[WARM] == stored, "a live blob is in no tier"
        st = store.stats()["tiers"]
        assert st["hot"]["bytes_used"] <= st["hot"]["budget"]
        assert st["warm"]["bytes_used"] <= st["warm"]["budget"]
    st = store.stats()["tiers"]
    assert st["hot"]["demotions"] > 0 and st["hot"]["promotions"] > 0
    check_refcounts(store)


def test_a_one_tier_store_reads_what_a_two_tier_store_reads_and_refuses_a_blob_with_no_location(atari_pong):
    """A store of the warm tier alone reads each blob from it (its own short path), the same bits
    and tier counts as a store with a hot tier too; a blob the index locates nowhere is refused."""
    data = atari_pong[:600]
    one = TieredStore(600, frames={"observation": 0})
    two = TieredStore(600, frames={"observation": 0}, hot_device="cpu", hot_bytes="64MiB")
    assert [t is None for t in parts(one).placement.tiers] == [True, False, True]
    for store in (one, two):
        store.extend(data)
    idx = torch.randint(0, 600, (64,), generator=torch.Generator().manual_seed(0))
    assert_td_equal(one.get(idx), data[idx])
    assert_td_equal(two.get(idx), data[idx])
    assert one.stats()["tiers"]["warm"]["hits"] > 0
    ids, _ = parts(one).layout.blob_refs(parts(one).layout.fields_of[0], idx.numpy())
    stored = ids[parts(one).index.state[ids] == STORED]
    parts(one).index.loc[stored[0], WARM] = -1  # (an index that lost a location)
    with pytest.raises(AssertionError, match="1 blobs have no location"):
        one.get(idx)


def test_storage_full_names_budgets_and_writes_nothing(atari_pong):
    store = TieredStore(2000, frames={"observation": 0}, warm_bytes="64KiB", chunk_frames=1, spill=False)
    store.extend(atari_pong[:20])
    before = store.get(slice(None))
    with pytest.raises(StorageFullError, match="warm=65536") as e:
        store.extend(atari_pong[100:1100])
    assert isinstance(e.value, OSError)
    assert len(store) == 20 and store.cursor == 20
    assert_td_equal(store.get(slice(None)), before)
    check_refcounts(store)


def test_budget_too_small_for_one_blob_is_storage_full(atari_raw):
    store = TieredStore(100, warm_bytes=64, chunk_frames=1, spill=False)  # every frame is a closed blob
    with pytest.raises(StorageFullError, match="warm=64"):
        store.extend(atari_raw[:4])
    assert len(store) == 0


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_cold_tier_ten_times_the_memory_budgets(tmp_path, atari_mixed, backend):
    """A store holding 10x more compressed data than hot + warm samples bit-exactly."""
    data = atari_mixed
    store = TieredStore(4000, tmp_path / "s", frames={"observation": 0}, hot_device="cpu",
                       hot_bytes="16KiB", warm_bytes="32KiB", backend=backend, chunk_frames=4)  # sized for K=4
    for i in range(0, 4000, 500):
        store.extend(data[i:i + 500])
    store.flush()
    st = store.stats()["tiers"]
    assert st["cold"]["bytes_used"] >= 10 * (st["hot"]["budget"] + st["warm"]["budget"])
    rng = np.random.default_rng(1)
    for _ in range(10):
        idx = torch.as_tensor(rng.integers(0, 4000, size=256))
        assert_td_equal(store.get(idx), data[idx])
    st = store.stats()["tiers"]
    assert st["cold"]["hits"] > 0 and st["warm"]["hits"] + st["hot"]["hits"] > 0
    assert st["warm"]["bytes_used"] <= st["warm"]["budget"]
    store.close()


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_random_ops_against_model_with_reopen(tmp_path, atari_mixed, backend):
    """Mixed extend/set/get/flush/reopen checked against a plain in-memory model."""
    data = atari_mixed
    cap = 900
    path = tmp_path / "s"
    store = TieredStore(cap, path, frames={"observation": 0}, warm_bytes="64KiB", backend=backend,
                       policy="fifo")
    model: dict[int, int] = {}
    rng = np.random.default_rng(2)
    pos = 0
    n_ops = 250
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.35:
            c = int(rng.integers(1, 150))
            src = pos % 3800
            rows = store.extend(data[src:src + c]).numpy()
            for i, r in enumerate(rows):
                model[int(r)] = src + i
            pos += c
        elif op < 0.45 and len(store):
            rows = rng.integers(0, len(store), size=int(rng.integers(1, 20)))
            src = rng.integers(0, 4000, size=rows.size)
            store.set(torch.as_tensor(rows), data[torch.as_tensor(src)])
            for r, s_ in zip(rows, src, strict=True):
                model[int(r)] = int(s_)
        elif op < 0.5:
            store.flush()
        elif op < 0.53:
            store.close()
            store = tiered.open(path, mode="r+")
        elif len(store):
            idx = rng.integers(0, len(store), size=int(rng.integers(1, 200)))
            expect = data[torch.as_tensor([model[int(i)] for i in idx])]
            assert_td_equal(store.get(idx), expect)
    store.close()
    ro = tiered.open(path, mode="r")
    order = torch.as_tensor([model[i] for i in range(len(ro))])
    assert_td_equal(ro.get(slice(None)), data[order])
    with pytest.raises(ReadOnlyStoreError):
        ro.extend(data[:1])
    check_refcounts(ro)


def test_reopen_is_bit_exact_and_keeps_cursor(tmp_path, atari_pong):
    path = tmp_path / "s"
    with TieredStore(1000, path, frames={"observation": 0}) as store:
        store.extend(atari_pong[:1300])
        ref = store.get(slice(None))
        cursor = store.cursor
    ro = tiered.open(path)
    assert len(ro) == 1000 and ro.cursor == cursor
    assert_td_equal(ro.get(slice(None)), ref)
    rw = tiered.open(path, mode="r+")
    rw.extend(atari_pong[1300:1400])
    rw.close()
    again = tiered.open(path)
    assert again.cursor == (cursor + 100) % 1000
    assert_td_equal(again.get(torch.arange(cursor, cursor + 100)), atari_pong[1300:1400])


def test_open_errors(tmp_path):
    with pytest.raises(NotATieredStoreError):
        tiered.open(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotATieredStoreError):
        tiered.open(tmp_path / "empty")
    store = TieredStore(10, tmp_path / "s")
    store.close()
    manifest = tmp_path / "s" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["body"]["format_version"] = 99
    manifest.write_text(json.dumps(doc))
    with pytest.raises(FormatVersionError, match="99"):
        tiered.open(tmp_path / "s")
    with pytest.raises(tiered.errors.StoreExistsError):
        TieredStore(10, tmp_path / "s")


def test_full_disk_keeps_store_readable(tmp_path, atari_mspacman):
    data = atari_mspacman
    store = TieredStore(2000, tmp_path / "s", frames={"observation": 0}, chunk_frames=1)
    store.extend(data[:200])
    store.flush()
    before = store.get(slice(None))
    with inject_faults(quota_bytes=0):
        with pytest.raises(StorageFullError):
            for i in range(200, 2000, 200):
                store.extend(data[i:i + 200])
                store.flush()
        # still readable, and writes keep failing while the disk is full
        n = len(store)
        assert_td_equal(store.get(slice(0, 200)), before)
        with pytest.raises(StorageFullError):
            store.extend(data[1800:2000])
            store.flush()
    # space is back: writing works again and everything reads back
    store.extend(data[1900:2000])
    store.flush()
    assert len(store) == min(n + 100, 2000)
    store.close()
    ro = tiered.open(tmp_path / "s")
    assert_td_equal(ro.get(slice(0, 200)), before)
    rows = torch.arange(len(ro) - 100, len(ro))
    assert_td_equal(ro.get(rows), data[1900:2000])


def test_peak_memory_bounded_by_warm_budget(tmp_path):
    """Resident memory growth stays within the warm budget + 300 MiB and does not grow with data
    (several times more compressed data than the 1 MiB warm budget)."""
    script = textwrap.dedent(f"""
        import gc, json, os, sys, psutil, torch, numpy as np
        from tiered import TieredStore
        from tiered.atari import cached_rollout
        data = cached_rollout("Pong", steps=2000, seed=0, max_episode_steps=500)
        proc = psutil.Process()
        def rss(): gc.collect(); return proc.memory_info().rss
        store = TieredStore(60_000, {str(tmp_path / 's')!r}, frames={{"observation": 0}},
                            warm_bytes="1MiB", chunk_frames=4)
        chunk = data.clone()  # reused working copy: its memory is not the store's
        store.extend(chunk[:250]); store.get(torch.arange(250))
        base = rss()
        peaks = []
        g = torch.Generator().manual_seed(0)
        for rep in range(30):
            # tile real frames, perturbed per repetition so nothing dedups across repetitions
            torch.bitwise_xor(data["observation"], rep, out=chunk["observation"])
            torch.bitwise_xor(data["next", "observation"], rep, out=chunk["next", "observation"])
            for i in range(0, 2000, 250):
                store.extend(chunk[i:i + 250])
            store.get(torch.randint(0, len(store), (256,), generator=g))
            if rep % 10 == 9:
                store.flush()
                peaks.append(rss() - base)
        st = store.stats()["tiers"]
        print(json.dumps({{"peaks": peaks, "cold": st["cold"]["bytes_used"],
                          "warm_demotions": st["warm"]["demotions"]}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    peaks = res["peaks"]
    assert max(peaks) < 1 * 2**20 + 300 * 2**20, peaks
    # not growing with the data: the last third adds as many rows as the first
    assert peaks[-1] - peaks[0] < 64 * 2**20, peaks
    # the data outgrew the warm budget: the cold tier holds it and warm dropped cached copies
    assert res["cold"] > 2 * 2**20, res
    assert res["warm_demotions"] > 0, res


def test_promotion_keeps_working_when_the_warm_cache_is_fragmented(tmp_path, atari_mixed):
    """A full, fragmented warm cache still takes promoted blobs (victims leave until holes merge)."""
    data = atari_mixed
    probe = TieredStore(4000, frames={"observation": 0})
    probe.extend(data)
    compressed = probe.stats()["tiers"]["warm"]["bytes_used"]
    store = TieredStore(4000, tmp_path / "s", frames={"observation": 0}, hot_bytes=0,
                       warm_bytes=compressed // 4, policy="lru", promote=True)
    store.extend(data)
    store.flush()
    rng = np.random.default_rng(3)
    promotions = []
    for _ in range(30):
        idx = torch.as_tensor(rng.integers(0, 4000, size=256))
        assert_td_equal(store.get(idx), data[idx])
        promotions.append(store.stats()["tiers"]["warm"]["promotions"])
    st = store.stats()["tiers"]["warm"]
    assert st["bytes_used"] <= st["budget"]
    assert promotions[-1] > promotions[10] > 0, promotions  # still promoting late in the run
    assert st["hits"] > 0
