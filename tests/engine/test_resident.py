"""``stats()``'s honest bytes: ``resident_bytes`` (what the process holds for the store) and
``bytes_per_row`` (dense columns and metadata included), on real Atari rows."""

from __future__ import annotations

import numpy as np
import torch

from tiered import TieredStore
from tiered.util.filemap import file_array
from tiered.util.resident import MINCORE, resident_nbytes

ROWS = 300


def _blob_bytes(stats: dict) -> int:
    return sum(f["stored_bytes"] for f in stats["fields"].values() if f["kind"] == "blob")


def test_a_large_store_holding_few_rows_counts_the_rows_it_holds(atari_pong):
    store = TieredStore(1_000_000)
    store.extend(atari_pong[:ROWS])
    s = store.stats()
    assert s["resident_bytes"] == sum(s["resident"].values())
    # the dense columns are allocated for 1M rows (~8 MB of int64 alone) but hold 300
    assert s["memory"]["dense"] > 1_000_000
    if MINCORE:
        assert s["resident"]["dense"] < 64 * 1024
    assert s["resident"]["tiers"] == s["tiers"]["warm"]["bytes_used"]
    assert s["bytes_per_row"] > 0


def test_bytes_per_row_includes_the_dense_columns(atari_pong):
    n = len(atari_pong)
    store = TieredStore(n)
    store.extend(atari_pong)
    s = store.stats()
    dense_per_row = sum(f["stored_bytes"] for f in s["fields"].values() if f["kind"] == "dense") / n
    assert dense_per_row >= 3  # action, trajectory ids, reward: each narrowed to a byte at least
    assert s["bytes_per_row"] >= dense_per_row + _blob_bytes(s) / n * 0.99
    # and is what the process holds, per row (an in-memory store keeps every blob once, in memory;
    # the tier also counts each blob's alignment padding, under 16 bytes)
    assert 0 <= s["resident_bytes"] - s["bytes_per_row"] * n <= 16 * s["blobs"]


def test_resident_bytes_grow_with_the_rows_written(atari_pong):
    store = TieredStore(100_000)
    store.extend(atari_pong[:200])
    small = store.stats()["resident"]
    store.extend(atari_pong[200:])
    large = store.stats()["resident"]
    assert large["tiers"] > small["tiers"]
    assert large["dense"] >= small["dense"]


def test_a_durable_store_counts_each_blob_once(tmp_path, atari_pong):
    durable = TieredStore(len(atari_pong), tmp_path / "s")
    durable.extend(atari_pong)
    durable.flush()
    s = durable.stats()
    n = len(atari_pong)
    cold = s["tiers"]["cold"]["bytes_used"]
    # the cold tier holds every blob; memory tiers may cache some of them: those count once
    assert s["bytes_per_row"] <= (s["resident_bytes"] + cold) / n
    assert s["bytes_per_row"] >= (cold * 0.9 + s["resident"]["dense"]) / n
    durable.close()


def test_untouched_pages_cost_nothing():
    a = file_array((1 << 20,), np.uint8)
    t = torch.from_numpy(file_array((1 << 18,), np.int32))
    if MINCORE:
        assert resident_nbytes([a, t]) <= 2 * 4096
        t[:1024] = 7  # one page
        assert 4096 <= resident_nbytes([t]) <= 3 * 4096
    else:
        assert resident_nbytes([a, t]) == a.nbytes + t.numel() * 4
    assert resident_nbytes([np.empty(0)]) == 0


def test_row_priorities_count_once_set(atari_pong):
    store = TieredStore(100_000)
    store.extend(atari_pong[:ROWS])
    assert store.stats()["resident"]["priorities"] == 0  # no row was ever given a priority
    store.set_priority(np.arange(10), np.full(10, 2.0))
    # the per-row priorities start at the default: the whole capacity-sized array is written
    assert store.stats()["resident"]["priorities"] >= (100_000 * 8 if MINCORE else 1)


def test_the_blob_index_counts_the_ids_handed_out_not_its_grown_capacity(atari_pong):
    from tiered.engine.blob_index import BlobIndex

    idx = BlobIndex()
    first = idx.allocate(40_000)
    idx.release(first[:10])
    more = idx.allocate(20)  # ten reused, ten fresh: the columns double to 80,000 ids
    assert idx.capacity == 80_000 and idx.size == 40_010
    assert (idx.loc[more] == -1).all() and (idx.open_slot[more] == -1).all() and (idx.state[more] == 2).all()
    held = resident_nbytes(idx.arrays_held())
    if MINCORE:  # the 40,000 ids never handed out cost no page
        assert held <= 64 * idx.size + 20 * 4096 < idx.nbytes_held * 0.6
    else:
        assert held == idx.nbytes_held
    store = TieredStore(ROWS, stage_rows=0)
    store.extend(atari_pong[:ROWS])
    s = store.stats()
    assert 0 < s["resident"]["index"] <= s["memory"]["index"]
