"""``TieredStore.stats()``: memory, compression and traffic figures, computed from the parts.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> store = TieredStore(8)
    >>> _ = store.extend(TensorDict({"x": torch.zeros(4, 32, 32)}, [4]))
    >>> s = store.stats()
    >>> s["rows"], s["fields"]["x"]["kind"], sorted(s["tiers"])
    (4, 'blob', ['warm'])
    >>> s["bytes_per_row"] == s["resident_bytes"] / 4, sorted(s["resident"])
    (True, ['dense', 'index', 'priorities', 'raw', 'row_tables', 'tiers'])
"""

from __future__ import annotations

from typing import Any

from ..util.resident import resident_nbytes
from .blob_index import BlobIndex
from .figures import bytes_per_row, field_facts, field_figures
from .layout import FieldLayout
from .placement import Placement
from .rows import RowSpace
from .stage import WriteStage

__all__ = ["store_stats", "tier_stats_with_mass", "resident_figures"]

#: The tiers whose blobs the process holds in memory (the cold tier's are in files).
MEMORY_TIER_NAMES = ("hot", "warm")


def field_stats(rows: RowSpace, layout: FieldLayout, index: BlobIndex) -> dict[str, dict[str, Any]]:
    """Per field: logical and stored bytes, ratio; blob fields add dedup and compression factors
    (from the fields' manifest entries, as ``tiered info`` computes them)."""
    facts = [field_facts(f.to_json()) for f in layout.schema.values()]
    return field_figures(facts, [fam.frame_nbytes for fam in layout.families], rows.length, rows.capacity, index)


def tier_stats_with_mass(rows: RowSpace, layout: FieldLayout | None, placement: Placement,
                         stage: WriteStage | None) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Per tier its figures plus ``probability_mass`` (the share of the sampling probability whose
    frames it serves first); and the ``priority`` entry (``alpha``, the raw in-memory share)."""
    tiers = placement.tier_stats()
    priorities = placement.priorities
    if priorities is None:
        return tiers, {"alpha": None, "in_memory_raw": 0.0}
    column = {"spill": "cold"}  # the spill tier takes the cold tier's place (the index's third column)
    holders = [column.get(name, name) for name, figures in tiers.items() if figures["blobs"]]
    mass = priorities.tier_mass(layout, rows.written, stage, placement.locate,
                                only_tier=holders[0] if len(holders) == 1 else None)
    for name, figures in tiers.items():
        figures["probability_mass"] = mass[column.get(name, name)]
    return tiers, {"alpha": priorities.alpha, "in_memory_raw": mass["memory"]}


def resident_figures(rows: RowSpace, layout: FieldLayout | None, placement: Placement, index: BlobIndex,
                     tiers: dict[str, dict[str, Any]], memory: dict[str, int]) -> dict[str, int]:
    """What the process holds for the store, by part: blobs in the memory tiers, the raw bytes
    waiting (stage, open chunks, tails), and the pages in memory of the blob index (grown
    geometrically: the ids not handed out yet cost nothing) and of the capacity-sized arrays (row
    tables, dense columns and flags, the written mask): a page never written costs nothing
    (:mod:`tiered.util.resident`), so a large store holding few rows counts the rows it holds."""
    tables = [a for t in (layout.tables.values() if layout is not None else ())
              for a in t.state_arrays().values()]
    span = rows.length  # rows at or past it were never written (the ring fills from row 0)
    dense = [c[:span] for c in (*rows.dense.values(), *([rows.flags] if rows.flags is not None else []),
                                rows.written)]
    return {
        "tiers": sum(int(tiers[name]["bytes_used"]) for name in MEMORY_TIER_NAMES if name in tiers),
        "raw": memory["staged"] + memory["open_chunks"] + memory["tail"],
        "index": resident_nbytes(index.arrays_held()),
        "row_tables": resident_nbytes(tables),
        "dense": resident_nbytes(dense),
        "priorities": resident_nbytes(placement.priorities.state_arrays().values())
        if placement.priorities is not None else 0,
    }


def store_stats(rows: RowSpace, layout: FieldLayout | None, index: BlobIndex, placement: Placement,
                stage: WriteStage | None, codec_name: str, counters: dict[str, int],
                gpu: dict[str, Any] | None) -> dict[str, Any]:
    """The dict :meth:`tiered.TieredStore.stats` returns.

    Returns:
        ``{"rows", "capacity", "codec", "blobs", "resident_bytes", "bytes_per_row", "fields":
        {name: {...}}, "tiers": {name: {...}}, "staged_rows", "memory", "resident", "counters",
        "gpu", "priority"}``. ``resident_bytes``: what the process holds in memory for the store
        (blobs in the memory tiers, raw bytes waiting, and the pages in use of the blob index, row
        tables, dense columns, written mask and row priorities; ``resident`` gives these parts). ``bytes_per_row``:
        what one row costs at the current length, dense columns and metadata included, each blob
        counted once wherever it lies (a store with a path counts its cold blobs, not their cached
        copies); 0.0 for an empty store. ``memory``: the in-memory metadata as allocated. Per
        field its logical and
        stored bytes and ratio (blob fields: unique frames, dedup and compression factors); per
        tier its bytes used, budget, blobs, hits, promotions, demotions, fragmentation and
        ``probability_mass``: the share of the sampling probability (row priority **
        ``priority_alpha``, over the written rows) whose frames the tier serves first (a row's
        mass is split over its frames). ``priority`` gives ``alpha`` and the share
        ``in_memory_raw`` served by open time chunks and staged rows.
    """
    families = layout.families if layout is not None else []
    tables = layout.tables.values() if layout is not None else []
    tiers, priority = tier_stats_with_mass(rows, layout, placement, stage)
    memory = {
        "staged": stage.nbytes if stage is not None else 0,
        "open_chunks": sum(int(f.open_frames.nbytes) for f in families),
        "tail": sum(int(f.tail_frames.nbytes) for f in families),
        "index": index.nbytes_held,
        "row_tables": sum(t.nbytes for t in tables),
        "dense": sum(v.numel() * v.element_size() for v in rows.dense.values())
        + (rows.flags.numel() if rows.flags is not None else 0),
    }
    resident = resident_figures(rows, layout, placement, index, tiers, memory)
    resident_bytes = sum(resident.values())
    live = index.live_ids()
    return {
        "rows": rows.length,
        "capacity": rows.capacity,
        "codec": codec_name,
        "blobs": int(live.size),
        "resident_bytes": resident_bytes,
        # the memory tiers' blobs are counted once, with the cold ones, as stored blobs
        "bytes_per_row": bytes_per_row(index, resident_bytes - resident["tiers"], rows.length),
        "fields": field_stats(rows, layout, index) if layout is not None else {},
        "tiers": tiers,
        "priority": priority,
        "staged_rows": stage.count if stage is not None else 0,
        "memory": memory,
        "resident": resident,
        "counters": {**counters, **({"oom_skipped_promotions": placement.oom_skipped_promotions}
                                    if placement.oom_skipped_promotions else {})},
        "gpu": gpu,
    }
