"""Helpers for tests and checks that need blobs in particular tiers (not for training code).

They reach into a store's index and tiers on purpose: a test of the GPU or CPU read path wants
every tier represented in one batch, whatever the placement policy would have done.

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
"""

from __future__ import annotations

import numpy as np

from ..index import COLD, HOT, OPEN, WARM
from ..store import TieredStore
from ..util.batch import exclusive_cumsum
from ..util.units import align

__all__ = ["spread_over_tiers", "tier_counts"]


def spread_over_tiers(store: TieredStore, seed: int = 0) -> None:
    """Put a third of the stored blobs in the hot tier, a third in the warm tier and leave a third
    in the cold file only (the store needs a path: its cold tier holds every blob)."""
    idx = store._index
    live = idx.live_ids()
    stored = live[idx.state[live] != OPEN]
    for t in (HOT, WARM):
        held = stored[idx.loc[stored, t] >= 0]
        store._tiers[t].free(idx.loc[held, t], align(idx.nbytes[held]))
        idx.loc[held, t] = -1
    order = np.random.default_rng(seed).permutation(stored)
    for t, ids in zip((HOT, WARM), np.array_split(order, 3)[:2], strict=True):
        sizes = idx.nbytes[ids]
        offs = exclusive_cumsum(sizes)
        buf = np.zeros(int(sizes.sum()), np.uint8)
        store._tiers[COLD].read(idx.loc[ids, COLD], sizes, buf, offs)
        loc = store._tiers[t].allocate(sizes)
        store._tiers[t].write(loc, buf, offs, sizes)
        idx.loc[ids, t] = loc


def tier_counts(store: TieredStore) -> dict[str, int]:
    """Stored blobs by the fastest tier holding them, and the open (uncompressed) chunks."""
    idx = store._index
    live = idx.live_ids()
    stored = live[idx.state[live] != OPEN]
    return {
        "hot": int((idx.loc[stored, HOT] >= 0).sum()),
        "warm": int(((idx.loc[stored, HOT] < 0) & (idx.loc[stored, WARM] >= 0)).sum()),
        "cold_only": int(((idx.loc[stored, HOT] < 0) & (idx.loc[stored, WARM] < 0)).sum()),
        "open": int((idx.state[live] == OPEN).sum()),
    }
