"""Build the engine's parts for a store: the codec, the rows, the placement and the write path.

:class:`~tiered.TieredStore` calls :func:`build_parts` when it is created and when it is opened
(the blob index then comes from the commit), and keeps the parts; nothing else holds them.

Example:
    >>> from tiered.engine.parts import build_parts
    >>> from tiered.engine.write import WriteOptions
    >>> from tiered.engine.blob_index import BlobIndex
    >>> parts = build_parts(8, "zstd", WriteOptions(), BlobIndex(), policy="lru", threads=None,
    ...                     hot_bytes=0, warm_bytes=None, hot_device=None, device=None, stage_rows=64)
    >>> parts.rows.capacity, parts.placement.policy.name, parts.codec.name
    (8, 'lru', 'zstd:3')
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch

from .. import codecs
from ..policy import PriorityPolicy, get_policy
from ..tiers.spill import SpillTier
from .blob_index import BlobIndex
from .placement import Placement, memory_tiers
from .priorities import RowPriorities
from .rows import RowSpace
from .write import WriteOptions, WritePath

__all__ = ["StoreParts", "build_parts"]


class StoreParts(NamedTuple):
    """The parts of one store (the read pipelines are built on top of them by the store)."""

    codec: codecs.Codec
    device: torch.device
    rows: RowSpace
    index: BlobIndex
    placement: Placement
    write: WritePath


def build_parts(capacity: int, codec: str, options: WriteOptions, index: BlobIndex, *, policy: str,
                threads: int | None, hot_bytes: Any, warm_bytes: Any, hot_device: Any, device: Any,
                stage_rows: int, spill: bool = True, spill_dir: str | os.PathLike[str] | None = None,
                **_runtime: Any) -> StoreParts:
    """Create the parts (no cold tier: the store adds it when it has a path; without one, a spill
    tier is made when the memory tiers are first full, unless ``spill`` is False).

    Args:
        capacity: rows in the ring.
        codec: the codec spec (``"zstd"``, ``"lz4:1"``, ...).
        options: the layout options (frames, chunks, dedup, ...).
        index: the blob index (empty for a new store; a commit's for an opened one).
        policy: the residency policy's name; ``threads``: the codec's threads (None: all cores);
            ``hot_bytes``, ``warm_bytes``, ``hot_device``: the memory tiers; ``device``: where reads
            land; ``stage_rows``: the write stage's rows; ``spill``, ``spill_dir``: whether a store
            without a path spills blobs to a temporary directory, and under which directory
            (:mod:`tiered.tiers.spill`). Other runtime options are ignored here.
    """
    chosen = codecs.get_codec(codec)
    if threads is not None and hasattr(chosen, "threads"):
        chosen.threads = int(threads)
    where = torch.device(device) if device is not None else torch.device("cpu")
    rows = RowSpace(capacity)
    decider = get_policy(policy)
    prioritized = isinstance(decider, PriorityPolicy)
    priorities = RowPriorities(capacity, index, default=decider.default if prioritized else 1.0, active=prioritized)
    make_spill = functools.partial(SpillTier, spill_dir) if spill else None
    placement = Placement(memory_tiers(hot_bytes, warm_bytes, hot_device, where), index, decider, priorities,
                          spill=make_spill)
    return StoreParts(chosen, where, rows, index, placement, WritePath(options, rows, index, placement, chosen,
                                                                       stage_rows))
