"""Inspection helpers: a public view of a store's engine parts, for tests and checks.

:func:`parts` is the one place that looks inside a :class:`~tiered.store.TieredStore`; tests and
tools that need the blob index, the row tables, the tiers or the read pipeline go through it
instead of reaching for private attributes. Not for training code: the parts are not a stable API.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> store = TieredStore(64, tempfile.mkdtemp() + "/s", hot_device="cpu", hot_bytes="1MiB")
    >>> _ = store.extend(TensorDict({"x": torch.randint(0, 9, (48, 2048), dtype=torch.uint8)}, [48]))
    >>> store.flush()
    >>> spread_over_tiers(store)
    >>> sorted(tier_counts(store))
    ['cold_only', 'hot', 'open', 'warm']
    >>> parts(store).layout.tables[("x",)].blob.shape
    (64, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..durable.sharing import SharedWriting
from ..durable.store_files import StoreFiles
from ..engine.blob_index import COLD, HOT, OPEN, WARM, BlobIndex
from ..engine.layout import FieldLayout
from ..engine.placement import Placement
from ..engine.read import CpuReadPipeline, ReadPipeline
from ..engine.rows import RowSpace
from ..engine.write import WritePath
from ..store import TieredStore
from ..util.batch import exclusive_cumsum
from ..util.units import align

__all__ = ["EngineParts", "parts", "spread_over_tiers", "tier_counts", "decode_blobs"]


@dataclass(frozen=True)
class EngineParts:
    """The parts a store is built of (see docs/architecture.md)."""

    rows: RowSpace
    index: BlobIndex
    placement: Placement
    write: WritePath
    reader: ReadPipeline
    cpu_reader: CpuReadPipeline
    files: StoreFiles | None
    #: the lock of a store several processes write (None until :meth:`~tiered.TieredStore.share`)
    sharing: SharedWriting | None = None

    @property
    def layout(self) -> FieldLayout | None:
        """The blob fields' families and row tables (None before the first write)."""
        return self.write.layout

    @property
    def tiers(self) -> list:
        """``[hot, warm, cold]`` tiers (None where absent)."""
        return self.placement.tiers


def parts(store: TieredStore) -> EngineParts:
    """The engine parts of ``store`` (live objects: changing them changes the store)."""
    return EngineParts(store._rows, store._index, store._placement, store._write, store._reader,
                       store._cpu_reader, store._files, store._sharing)


def decode_blobs(store: TieredStore, family_id: int, ids: np.ndarray, *, gpu: bool = False) -> np.ndarray:
    """Raw frames ``[len(ids), chunk_frames, frame_nbytes]`` of blobs, decoded by the store's CPU
    pipeline (or its current pipeline with ``gpu=True``), as a numpy copy."""
    p = parts(store)
    reader = p.reader if gpu else p.cpu_reader
    frames = reader.decode_blobs(p.layout, p.layout.families[family_id], np.asarray(ids, dtype=np.int64))
    return frames.cpu().numpy().copy() if hasattr(frames, "cpu") else np.array(frames)


def spread_over_tiers(store: TieredStore, seed: int = 0) -> None:
    """Put a third of the stored blobs in the hot tier, a third in the warm tier and leave a third
    in the cold file only (the store needs a path: its cold tier holds every blob)."""
    p = parts(store)
    idx, tiers = p.index, p.tiers
    idx.check_ids(None)  # a read-only open's index pages: its own (checked) before they are written
    live = idx.live_ids()
    stored = live[idx.state[live] != OPEN]
    for t in (HOT, WARM):
        held = stored[idx.loc[stored, t] >= 0]
        tiers[t].free(idx.loc[held, t], align(idx.nbytes[held]))
        idx.loc[held, t] = -1
    order = np.random.default_rng(seed).permutation(stored)
    for t, ids in zip((HOT, WARM), np.array_split(order, 3)[:2], strict=True):
        sizes = idx.nbytes[ids]
        offs = exclusive_cumsum(sizes)
        buf = np.zeros(int(sizes.sum()), np.uint8)
        tiers[COLD].read(idx.loc[ids, COLD], sizes, buf, offs)
        loc = tiers[t].allocate(sizes)
        tiers[t].write(loc, buf, offs, sizes)
        idx.loc[ids, t] = loc


def tier_counts(store: TieredStore) -> dict[str, int]:
    """Stored blobs by the fastest tier holding them, and the open (uncompressed) chunks."""
    idx = parts(store).index
    idx.check_ids(None)  # a read-only open's index pages: its own (checked) before they are read
    live = idx.live_ids()
    stored = live[idx.state[live] != OPEN]
    return {
        "hot": int((idx.loc[stored, HOT] >= 0).sum()),
        "warm": int(((idx.loc[stored, HOT] < 0) & (idx.loc[stored, WARM] >= 0)).sum()),
        "cold_only": int(((idx.loc[stored, HOT] < 0) & (idx.loc[stored, WARM] < 0)).sum()),
        "open": int((idx.state[live] == OPEN).sum()),
    }
