"""The tiering manager: which tier holds each blob, and moving blobs between tiers.

:class:`Placement` owns the tiers (hot GPU arena, warm host arena, cold file segments) and the
``loc`` column of the blob index. It allocates, makes room, demotes, caches, promotes and frees;
every decision (which blobs leave a full tier, whether a new blob is cached, which blobs just read
are copied up) is asked of the residency policy (:mod:`tiered.policy`), which never moves bytes.

Two tier models:

* **With a cold tier** (a store with a path): cold holds every blob and is the source of truth;
  hot and warm are caches. Dropping a cached copy is free and never changes the durable index.
* **Without one**: hot and warm are exclusive. A blob lives in exactly one of them; new blobs go
  to the fastest tier with room; victims of a full tier move down. When both are full, victims
  (and new blobs that fit neither) move down into a spill tier
  (:class:`~tiered.tiers.spill.SpillTier`: a cold tier in a private temporary directory, made
  when first needed, removed on close), and the tiers stay exclusive: a blob lives in exactly
  one of hot, warm and spill. Without a spill tier (``spill=False``), a write that fits nowhere
  raises :class:`~tiered.errors.StorageFullError` naming the budgets; with one, only a full disk
  does.

Example:
    >>> import numpy as np
    >>> from tiered.engine.blob_index import BlobIndex, WARM
    >>> from tiered.policy import get_policy
    >>> from tiered.tiers import HostTier
    >>> from tiered.engine.placement import Placement
    >>> index = BlobIndex()
    >>> placement = Placement([None, HostTier(1 << 20), None], index, get_policy("lru"))
    >>> ids = index.allocate(2)
    >>> placement.place(ids, np.arange(40, dtype=np.uint8), np.array([0, 20]), np.array([20, 20]))
    >>> placement.locate(ids).tolist() == [WARM, WARM]
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import StorageFullError
from ..policy import Policy, TierState
from ..tiers import DeviceTier, HostTier, Tier, default_budgets
from ..tiers.arena import cuda_usable
from ..tiers.spill import SpillTier
from ..util.batch import exclusive_cumsum, isin
from ..util.buffers import is_out_of_memory
from ..util.units import align, parse_bytes
from .blob_index import COLD, HOT, WARM, BlobIndex
from .layout import FieldLayout
from .priorities import RowPriorities
from .stage import WriteStage

__all__ = ["Placement", "TIER_NAMES", "memory_tiers"]

TIER_NAMES = ("hot", "warm", "cold")
#: ``_PRESENT[4 * hot? + 2 * warm? + cold?]``: which tiers a store has, as a mask of a blob's
#: locations (looked up, not built on every read)
_PRESENT = np.array([[k & 4, k & 2, k & 1] for k in range(8)], dtype=bool)
_PRESENT.flags.writeable = False
_TIER_COLUMN = np.array([[HOT], [WARM], [COLD]], dtype=np.int8)  # (tier numbers as from_tier holds them)


def memory_tiers(hot_bytes: int | str | None, warm_bytes: int | str | None,
                 hot_device: str | torch.device | None,
                 device: str | torch.device | None = None) -> list[Tier | None]:
    """``[hot, warm, None]`` arenas for the given budgets (None: the default budget).

    The hot arena lives on ``hot_device`` (CUDA by default when CUDA is usable, see
    :func:`~tiered.tiers.arena.cuda_usable`; ``"cpu"`` stands in for it in CPU-only tests); a
    budget of 0 leaves a tier out. Defaults come from the memory free now
    (:func:`~tiered.tiers.default_budgets`), asked only when a default is needed. The warm arena
    is pinned only when data moves to CUDA (a CUDA hot arena, or ``device``, where the store
    returns data, is CUDA): a CPU-only store never starts CUDA, so it can be made in a forked
    DataLoader worker.
    """
    if hot_device is None:
        hot_device = "cuda" if cuda_usable() else None
    hot_device = torch.device(hot_device) if hot_device is not None else None
    hot_b = parse_bytes(hot_bytes) if hot_bytes is not None else None
    warm_b = parse_bytes(warm_bytes) if warm_bytes is not None else None
    hot_default = hot_device is not None and hot_b is None
    if hot_default or warm_b is None:
        defaults = default_budgets(hot=hot_default and hot_device.type == "cuda")
        if hot_default:
            hot_b = defaults["hot"] if hot_device.type == "cuda" else defaults["warm"]
        if warm_b is None:
            warm_b = defaults["warm"]
    hot = DeviceTier(hot_b, hot_device) if hot_device is not None and hot_b else None
    to_cuda = (hot is not None and hot.device.type == "cuda") or (
        device is not None and torch.device(device).type == "cuda")
    return [hot, HostTier(warm_b, pinned=to_cuda and cuda_usable()) if warm_b else None, None]


def _write_or_free(tier: Tier, loc: np.ndarray, data: Any, offsets: np.ndarray, sizes: np.ndarray) -> None:
    """Write new blobs at ``loc``; if the write fails (a full disk), free the space again: no
    index names it yet, so it is reusable at once."""
    try:
        tier.write(loc, data, offsets, sizes)
    except BaseException:
        tier.free(loc, align(sizes), defer=False)
        raise


def _no_room(tiers: list[Tier | None], count: int, nbytes: int, errors: list[str]) -> StorageFullError:
    """The error of a write no exclusive tier could take (what each tier said in ``errors``)."""
    budgets = ", ".join(f"{TIER_NAMES[t]}={tiers[t].budget}" for t in (HOT, WARM) if tiers[t] is not None)
    if tiers[COLD] is not None:  # the spill tier could not take them either: the disk is full
        return StorageFullError(
            f"no tier can take {count} new blobs ({nbytes} bytes): the memory budgets are full "
            f"({budgets or 'none'}) and spilling to {tiers[COLD].directory} failed. Nothing was written. Free "
            "disk space there or pass spill_dir= a larger file system. Details: " + "; ".join(errors))
    return StorageFullError(
        f"no tier can take {count} new blobs ({nbytes} bytes); budgets: {budgets or 'none'}. "
        "Nothing was written. Raise warm_bytes/hot_bytes, leave spill on (spill=True spills to a temporary "
        "directory), give the store a path (a cold tier on disk), or use a smaller capacity. Details: "
        + "; ".join(errors))


class Placement:
    """Tiers, blob locations and the moves between them (see the module docstring).

    Args:
        tiers: ``[hot, warm, cold]``, each a :class:`~tiered.tiers.Tier` or None.
        index: the blob index (its ``loc`` column is the placement's).
        policy: the residency policy asked for every decision.
        priorities: the row priorities whose per-blob maxima the policy is told (see
            :mod:`tiered.engine.priorities`); ``None`` keeps every blob at the policy's default.
        spill: makes the spill tier of a store without a cold tier when its memory tiers are full
            (called once, at the first spill); ``None``: no spill, a full budget is
            :class:`~tiered.errors.StorageFullError`.
    """

    #: the share of the warm budget that must be free before a compaction may run (see :meth:`compact`)
    compact_share = 1 / 8

    def __init__(self, tiers: list[Tier | None], index: BlobIndex, policy: Policy,
                 priorities: RowPriorities | None = None, spill: Callable[[], Tier] | None = None) -> None:
        self.tiers = tiers
        self.spill = spill
        self.index = index
        self.policy = policy
        self.priorities = priorities
        self.counts = {name: {"hits": 0, "promotions": 0, "demotions": 0} for name in TIER_NAMES}
        self.oom_skipped_promotions = 0
        self.compactions = 0
        #: bytes the cold tier read since the last compaction (see :meth:`compact`)
        self.cold_read_bytes = 0
        #: called after bytes were written into the hot arena (a GPU decoder fences its streams)
        self.on_hot_write: Callable[[], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["on_hot_write"] = None  # a GPU decoder's hook does not travel; the store re-attaches one
        return state

    @property
    def cold(self) -> Tier | None:
        return self.tiers[COLD]

    @property
    def exclusive(self) -> bool:
        """Whether each blob lives in exactly one tier (no durable cold tier holds every blob)."""
        return self.cold is None or isinstance(self.cold, SpillTier)

    def lower_tier(self, t: int) -> int | None:
        """The tier victims of tier ``t`` move down to in exclusive mode (the spill tier is made
        here, at the first spill); None when there is none."""
        for u in range(t + 1, 3):
            if self.tiers[u] is not None:
                return u
        if t < COLD and self.spill is not None:
            self.tiers[COLD] = self.spill()
            return COLD
        return None

    def tier_state(self, t: int) -> TierState:
        """What the policy may know of tier ``t`` (its blobs too, when the policy compares with them)."""
        tier = self.tiers[t]
        ids = sizes = None
        if self.policy.wants_residents:
            ids = self.tier_ids(t)
            sizes = align(self.index.nbytes[ids])
        return TierState(TIER_NAMES[t], tier.budget, int(tier.bytes_used), exclusive=self.exclusive,
                         ids=ids, sizes=sizes)

    def tier_ids(self, t: int) -> np.ndarray:
        """Ids of the blobs tier ``t`` holds."""
        self.index.check_ids(None)  # a whole column (a read-only open's pages: its own from here)
        return np.flatnonzero(self.index.loc[: self.index.size, t] >= 0)

    # -- writing -----------------------------------------------------------------------------
    def place(self, ids: np.ndarray, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Put newly encoded blobs into tiers. All or nothing for the new blobs."""
        idx = self.index
        cold = self.cold
        if not self.exclusive:
            loc = cold.allocate(sizes)
            _write_or_free(cold, loc, data, offsets, sizes)
            idx.dirty.mark(ids)
            idx.loc[ids, COLD] = loc
            # best effort: cache the blobs the policy admits in the fastest memory tier with room
            for t in (HOT, WARM):
                if self.tiers[t] is not None and self._admit_and_cache(t, ids, data, offsets, sizes):
                    break
            self._hot_written()
            return
        errors = []
        for t in (HOT, WARM, COLD):  # the fastest tier with room; victims of full ones move down
            if t == COLD and self.tiers[COLD] is None and self.lower_tier(WARM) is None:
                break
            tier = self.tiers[t]
            if tier is None:
                continue
            try:
                loc = self.allocate_in(t, sizes)
            except (StorageFullError, ValueError) as e:
                errors.append(f"{tier.name}: {e}")
                continue
            _write_or_free(tier, loc, data, offsets, sizes)
            idx.dirty.mark(ids)
            idx.loc[ids, t] = loc
            self._hot_written()
            return
        raise _no_room(self.tiers, int(ids.size), int(sizes.sum()), errors)

    def _hot_written(self) -> None:
        if self.on_hot_write is not None:  # a decode on another stream must see these arena writes
            self.on_hot_write()

    def _admit_and_cache(self, t: int, ids, data, offsets, sizes) -> bool:
        admitted = np.asarray(self.policy.admit(ids, align(sizes), self.tier_state(t)), dtype=bool)
        if not admitted.any():
            return False
        if admitted.all():
            return bool(self.cache_into(t, ids, data, offsets, sizes).any())
        return bool(self.cache_into(t, ids[admitted], data, offsets[admitted], sizes[admitted]).any())

    def allocate_in(self, t: int, sizes: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        """Allocate in tier ``t``, moving policy victims out first (every blob or none).

        Enough free *bytes* may still not hold a batch when the free space is in small holes;
        then more victims leave (four times the batch, then sixteen times, then the whole budget)
        until the holes coalesce. A bounded number of rounds, never a loop over blobs. A cache
        does not come here (:meth:`cache_into` takes what fits instead of evicting more).
        """
        tier = self.tiers[t]
        need = int(align(sizes).sum())
        rounds = 4
        for attempt in range(rounds):
            room = need if attempt == 0 or tier.budget is None else min(tier.budget, need << (2 * attempt))
            if attempt == 3 and tier.budget is not None:
                room = tier.budget
            self.make_room(t, room, protect)
            try:
                return tier.allocate(sizes)
            except StorageFullError:
                if self.compact(t, need):
                    return tier.allocate(sizes)
                if attempt == rounds - 1:
                    raise
        raise AssertionError("unreachable")

    def compact(self, t: int, need: int) -> bool:
        """Move the blobs of the warm arena of a store with a cold tier to its start, in place
        (:meth:`~tiered.tiers.ArenaTier.compact`), so that its holes become one free range.

        It runs when ``need`` bytes fit the arena's free bytes and the copy is cheap next to the
        work around it: it moves no more bytes than the cold tier read since the previous
        compaction (a read from disk costs far more per byte than a copy in memory), or at least
        :attr:`compact_share` of the budget is free (so a large arena under little traffic is
        compacted at most once per that share of its budget freed, and its fill never sinks much
        below ``1 - compact_share``). Returns whether it ran. Pinned arenas wait for pending
        CUDA copies first."""
        tier = self.tiers[t]
        if t != WARM or self.exclusive or tier.budget is None:
            return False
        free = tier.budget - tier.bytes_used
        if free < need or (tier.compact_bytes > self.cold_read_bytes
                           and free < int(tier.budget * self.compact_share)):
            return False
        if getattr(tier, "pinned", False) and cuda_usable():
            torch.cuda.synchronize()
        ids = self.tier_ids(t)
        self.index.dirty.mark(ids)
        self.index.loc[ids, t] = tier.compact(self.index.loc[ids, t], self.index.nbytes[ids])
        self.compactions += 1
        self.cold_read_bytes = 0
        return True

    def make_room(self, t: int, need: int, protect: np.ndarray | None = None) -> None:
        """Move the policy's victims out of tier ``t`` until ``need`` more bytes fit its budget."""
        tier = self.tiers[t]
        if tier.budget is None:
            return
        short = tier.bytes_used + need - tier.budget
        if short <= 0:
            return
        if need > tier.budget:
            raise StorageFullError(f"batch of {need} bytes exceeds the {tier.name} budget of {tier.budget}")
        ids = self.tier_ids(t)
        if protect is not None and protect.size:
            ids = ids[~isin(ids, protect)]
        victims = self.policy.victims(ids, align(self.index.nbytes[ids]), short)
        if victims.size == 0:
            raise StorageFullError(f"{tier.name} tier is full and holds no evictable blob")
        self.demote(t, victims)

    def demote(self, t: int, ids: np.ndarray) -> None:
        """Move blobs out of tier ``t``: drop the copy (with a cold tier) or move it one tier down."""
        idx = self.index
        tier = self.tiers[t]
        sizes = idx.nbytes[ids]
        if not self.exclusive:  # cold holds every blob: dropping a cached copy is free
            tier.free(idx.loc[ids, t], align(sizes))
            idx.dirty.mark(ids)
            idx.loc[ids, t] = -1
            self.counts[TIER_NAMES[t]]["demotions"] += int(ids.size)
            return
        u = self.lower_tier(t)
        if u is None:
            raise StorageFullError(f"the {tier.name} tier is full and there is no lower tier to move blobs to")
        buf_off = exclusive_cumsum(sizes)
        buf = np.empty(int(sizes.sum()), dtype=np.uint8)
        tier.read(idx.loc[ids, t], sizes, buf, buf_off)
        loc = self.allocate_in(u, sizes)  # copy, switch the index, then free
        _write_or_free(self.tiers[u], loc, buf, buf_off, sizes)  # a failure leaves the blobs where they were
        idx.dirty.mark(ids)
        idx.loc[ids, u] = loc
        tier.free(idx.loc[ids, t], align(sizes))
        idx.loc[ids, t] = -1
        self.counts[TIER_NAMES[t]]["demotions"] += int(ids.size)

    def cache_into(self, t: int, ids, data, offsets, sizes) -> np.ndarray:
        """Copy blobs into cache tier ``t`` (stores with a path), evicting by policy; return a
        bool mask over ``ids`` of the blobs cached.

        The policy's victims leave until the batch fits the budget's bytes; the blobs that then
        fit the arena (its holes and the room past its used region, or one free range after a
        :meth:`compact`) are cached, the others skipped: no further victims leave for them (a
        cache that emptied itself to fit one batch would lose the blobs the policy chose to
        keep, and holes left now take later blobs). Best effort: nothing is cached when the
        tier cannot take the batch (full of unevictable blobs, GPU out of memory).
        """
        tier = self.tiers[t]
        try:
            need = int(align(sizes).sum())
            self.make_room(t, need)
            loc = tier.allocate_fitting(sizes)
            if (loc < 0).any():  # give the room back (nothing written yet); compact, then place again
                tier.free(loc[loc >= 0], align(sizes[loc >= 0]))
                self.compact(t, need)
                loc = tier.allocate_fitting(sizes)
        except (StorageFullError, ValueError):
            return np.zeros(np.shape(ids), dtype=bool)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            self.oom_skipped_promotions += 1
            return np.zeros(np.shape(ids), dtype=bool)
        ok = loc >= 0
        tier.write(loc[ok], data, offsets[ok], sizes[ok])
        self.index.dirty.mark(ids[ok])
        self.index.loc[ids[ok], t] = loc[ok]
        return ok

    def free_in_tiers(self, ids: np.ndarray, *, defer: bool) -> None:
        """Free ``ids`` in every tier that holds them (``defer`` matters to cold tiers only).
        No early exits on empty groups: the call count must not depend on the batch."""
        idx = self.index
        for t in range(3):
            tier = self.tiers[t]
            if tier is None:
                continue
            sel = ids[idx.loc[ids, t] >= 0]
            tier.free(idx.loc[sel, t], align(idx.nbytes[sel]), defer=defer)
        idx.dirty.mark(ids)
        idx.loc[ids] = -1

    def drop_memory_copies(self) -> None:
        """Forget every hot and warm location (after an open: the arenas start empty)."""
        loc = self.index.loc
        held = np.flatnonzero(np.maximum(loc[:, HOT], loc[:, WARM]) >= 0)  # in either memory tier
        self.index.dirty.mark(held[held < self.index.size])
        self.index.loc[held, HOT:WARM + 1] = -1  # only those: pages of a mapped index stay unwritten

    # -- reading -----------------------------------------------------------------------------
    def locate(self, ids: np.ndarray) -> np.ndarray:
        """The fastest tier holding each blob (HOT, WARM or COLD), as int8.

        Raises:
            AssertionError: a blob has no location (the index is inconsistent).
        """
        return self._first_tier(self.index.loc[ids])

    def _first_tier(self, loc: np.ndarray) -> np.ndarray:
        """The fastest tier of each blob whose ``[n, 3]`` locations are ``loc``, as int8."""
        tiers = self.tiers
        has = loc >= 0
        has &= _PRESENT[(tiers[HOT] is not None) * 4 + (tiers[WARM] is not None) * 2 + (tiers[COLD] is not None)]
        # ufunc reductions: .any(1).all() adds Python-level wrapper calls on every read
        if not np.logical_and.reduce(np.logical_or.reduce(has, axis=1)):
            raise AssertionError(f"{int((~has.any(1)).sum())} blobs have no location: index is inconsistent")
        return has.argmax(1).astype(np.int8)  # first True column: HOT before WARM before COLD

    def locate_and_read(self, ids: np.ndarray, sizes: np.ndarray, out: Any, out_offsets: np.ndarray) -> np.ndarray:
        """:meth:`locate`, then :meth:`read` from the tiers found, with one gather of the blobs'
        locations for both (what a CPU read does); returns the tier each blob was read from.

        Raises:
            AssertionError: a blob has no location (the index is inconsistent).
        """
        loc = self.index.loc[ids]
        tiers = self.tiers
        if (tiers[HOT] is None) + (tiers[WARM] is None) + (tiers[COLD] is None) == 2:
            # a store of one tier (every store whose blobs fit its memory: warm only): every blob
            # is read from it, so its location column is the whole test and the read (~6 numpy
            # calls fewer than the per-tier masks)
            t = HOT if tiers[HOT] is not None else WARM if tiers[WARM] is not None else COLD
            where = loc[:, t]
            if not np.logical_and.reduce(where >= 0):
                raise AssertionError(f"{int(np.add.reduce(where < 0))} blobs have no location: index is inconsistent")
            tiers[t].read(where, sizes, out, out_offsets)
            if t == COLD:
                self.cold_read_bytes += int(np.add.reduce(sizes))
            from_tier = np.empty(ids.size, np.int8)
            from_tier.fill(t)
            return from_tier
        from_tier = self._first_tier(loc)
        self._read_located(loc, sizes, out, out_offsets, from_tier, None)
        return from_tier

    def read(self, ids: np.ndarray, sizes: np.ndarray, out: Any, out_offsets: np.ndarray,
             from_tier: np.ndarray, skip: np.ndarray | None = None) -> None:
        """Gather the compressed bytes of ``ids`` into ``out``, one batched read per tier.

        ``skip``: a mask of blobs not to read here (e.g. hot blobs a GPU gathers on the device).
        """
        self._read_located(self.index.loc[ids], sizes, out, out_offsets, from_tier, skip)

    def _read_located(self, loc: np.ndarray, sizes: np.ndarray, out: Any, out_offsets: np.ndarray,
                      from_tier: np.ndarray, skip: np.ndarray | None) -> None:
        for t in (HOT, WARM, COLD):  # no early exits: the call count must not depend on the batch
            tier = self.tiers[t]
            if tier is None:
                continue
            sel = from_tier == t if skip is None else (from_tier == t) & ~skip
            if np.logical_or.reduce(sel):
                tier.read(loc[sel, t], sizes[sel], out, out_offsets[sel])
        if self.tiers[COLD] is not None:  # (a tier that is there or not: not a branch on the batch)
            self.cold_read_bytes += int(np.add.reduce(sizes[from_tier == COLD]))

    def note_reads(self, ids: np.ndarray, from_tier: np.ndarray) -> None:
        """Count tier hits and tell the policy which blobs were read."""
        # one compare with the three tier numbers and one reduction (np.bincount's wrapper and
        # the int8 -> int64 cast are more calls on every get)
        hot, warm, cold = np.add.reduce(from_tier == _TIER_COLUMN, axis=1).tolist()
        counts = self.counts
        counts["hot"]["hits"] += hot
        counts["warm"]["hits"] += warm
        counts["cold"]["hits"] += cold
        self.policy.on_access(ids)

    def check_writable(self) -> None:
        """Refuse a write in a forked copy of a store whose spill files its parent owns.

        Checked when a write starts, whatever it would touch: a staged write touches no tier
        until some later call's flush, and one that fits the memory tiers may touch none.
        """
        if isinstance(self.cold, SpillTier):
            self.cold.check_writable()

    def promote(self, ids: np.ndarray, from_tier: np.ndarray, comp: Any, src_off: np.ndarray,
                sizes: np.ndarray) -> None:
        """Copy blobs just read up into faster tiers, as the policy decides (copy up, then switch).

        ``comp[src_off[i]:+sizes[i]]`` holds blob ``ids[i]``'s compressed bytes; ``from_tier`` is
        updated in place. Any failure (lower tier full, GPU out of memory) just skips the
        promotion: the data read is already correct.
        """
        tiers = self.tiers
        fastest = HOT if tiers[HOT] is not None else WARM if tiers[WARM] is not None else COLD
        if not np.logical_or.reduce(from_tier > fastest):  # every blob read from the fastest tier
            self._hot_written()
            return
        if self.exclusive and isinstance(self.cold, SpillTier) and not self.cold.writable_here():
            # a forked copy: a promotion would move victims down into (and free space of) the
            # spill files its parent owns and writes
            return
        for t in (HOT, WARM):
            tier = self.tiers[t]
            if tier is None:
                continue
            sel = (from_tier > t).nonzero()[0]
            if not sel.size:
                continue
            chosen = np.asarray(self.policy.promote(ids[sel], align(sizes[sel]), self.tier_state(t)), dtype=bool)
            cand = sel[chosen]
            if cand.size == 0:
                continue
            if not self.exclusive:
                cand = cand[self.cache_into(t, ids[cand], comp, src_off[cand], sizes[cand])]
                from_tier[cand] = t
                self.counts[TIER_NAMES[t]]["promotions"] += int(cand.size)
                continue
            # Exclusive tiers: copy up, switch the index, then free below. Victims of the faster
            # tier move down first (policy order).
            moved = ids[cand]
            old_t = from_tier[cand]
            try:
                loc = self.allocate_in(t, sizes[cand], protect=moved)
            except (StorageFullError, ValueError):
                continue
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                self.oom_skipped_promotions += 1
                continue
            tier.write(loc, comp, src_off[cand], sizes[cand])
            for u in range(t + 1, 3):
                m = old_t == u
                if m.any() and self.tiers[u] is not None:
                    self.tiers[u].free(self.index.loc[moved[m], u], align(sizes[cand][m]))
                    self.index.loc[moved[m], u] = -1
            self.index.dirty.mark(moved)
            self.index.loc[moved, t] = loc
            from_tier[cand] = t
            self.counts[TIER_NAMES[t]]["promotions"] += int(cand.size)
        self._hot_written()

    # -- priorities: the write path and the store report row changes; the policy hears blob maxima
    def set_row_priorities(self, layout: FieldLayout | None, rows: np.ndarray, priority: np.ndarray,
                           stage: WriteStage | None) -> None:
        """Give ``rows`` checked priorities; the policy hears the recounted blob maxima."""
        if self.priorities is None:
            return
        self.index.check_ids(None)  # the counts read the index of every blob of the rows' fields
        if not self.priorities.active:
            self.tell_policy(*self.priorities.activate(layout, stage))
        self.tell_policy(*self.priorities.set(layout, rows, priority, stage), move=True)

    def tell_policy(self, ids: np.ndarray, maxima: np.ndarray, move: bool = False) -> None:
        """Tell the policy blob priorities and sizes; with ``move`` (a ``set_priority``), a policy
        that :attr:`~tiered.policy.Policy.promotes_on_priority` is asked which to read up now
        (:meth:`~tiered.policy.Policy.prefetch`)."""
        self.index.check_ids(ids)  # a read-only open's index and policy pages of these ids: its own first
        self.policy.set_priority(ids, maxima)
        self.policy.set_sizes(ids, align(self.index.nbytes[ids]))
        self.policy.set_mass(ids, self.priorities.blob_mass(ids))
        if move and self.policy.promotes_on_priority and not self.exclusive and ids.size:
            self.promote_from_cold(ids)

    def promote_from_cold(self, ids: np.ndarray) -> None:
        """Copy the blobs of ``ids`` the policy prefetches into the caches, read from the cold tier
        in one batched read per tier (blobs already cached there, or only in memory, are skipped)."""
        idx = self.index
        for t in (HOT, WARM):
            if self.tiers[t] is None:
                continue
            loc = idx.loc[ids]
            cand = ids[(loc[:, COLD] >= 0) & ~(loc[:, : t + 1] >= 0).any(1)]
            if cand.size == 0:
                continue
            sizes = idx.nbytes[cand]
            cand = cand[np.asarray(self.policy.prefetch(cand, align(sizes), self.tier_state(t)), dtype=bool)]
            if cand.size == 0:
                continue
            sizes = idx.nbytes[cand]
            offsets = exclusive_cumsum(sizes)
            buf = np.empty(int(sizes.sum()), dtype=np.uint8)
            self.cold.read(idx.loc[cand, COLD], sizes, buf, offsets)
            self.cold_read_bytes += int(sizes.sum())
            self.counts[TIER_NAMES[t]]["promotions"] += int(self.cache_into(t, cand, buf, offsets, sizes).sum())
        self._hot_written()

    def set_alpha(self, alpha: float, layout: FieldLayout | None, stage: WriteStage | None) -> None:
        """The sampler's exponent, for the mass statistics and for a policy that ranks by it; a
        new value recounts the blobs' sampling weights (once: TorchRL sets it at every update)."""
        self.policy.set_alpha(alpha)
        if self.priorities is None or float(alpha) == self.priorities.alpha:
            return
        self.priorities.alpha = alpha
        if self.priorities.active:
            self.index.check_ids(None)  # the recount reads the index of every blob
            self.tell_policy(*self.priorities.recount_all(layout, stage))

    def rows_staged(self, layout: FieldLayout, rows: np.ndarray, stage: WriteStage) -> None:
        """``rows`` now wait in the write stage with new data (their blobs lose them)."""
        if self.priorities is not None and self.priorities.active:
            self.tell_policy(*self.priorities.staged(layout, rows, stage))

    def rows_written(self, layout: FieldLayout, rows: np.ndarray, previous_blobs: np.ndarray,
                     stage: WriteStage | None) -> None:
        """The write path pointed ``rows`` at new blobs (``previous_blobs``: what they named)."""
        if self.priorities is not None and self.priorities.active:
            self.tell_policy(*self.priorities.written(layout, rows, previous_blobs, stage))

    def rows_cleared(self) -> None:
        """Every row is gone (their blobs are released: the policy forgets them)."""
        if self.priorities is not None:
            self.priorities.cleared()

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        for tier in self.tiers:
            if tier is not None:
                tier.close()

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for t, name in enumerate(TIER_NAMES):
            tier = self.tiers[t]
            if tier is None:
                continue
            st = tier.stats()
            if isinstance(tier, SpillTier):  # named for what it is, with the directory it fills
                name = "spill"
            out[name] = {
                "bytes_used": int(st.get("bytes_used", tier.bytes_used)),
                "budget": tier.budget,
                "blobs": int((self.index.loc[: self.index.size, t] >= 0).sum()),
                "fragmentation": float(st.get("fragmentation", 0.0)),
                **self.counts[TIER_NAMES[t]],
                **({"dir": st["dir"]} if "dir" in st else {}),
            }
        return out
