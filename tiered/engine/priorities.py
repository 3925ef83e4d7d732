"""Row priorities and the exact blob priorities they give: each blob's max over its rows.

A prioritized replay buffer gives every *row* a priority; residency is decided per *blob*, and a
blob (a frame, or a time chunk of frames) is shared by several rows: the frames of overlapping
stacks, an observation and the previous row's next observation. A blob's priority is the
maximum over the rows that reference it now. :class:`RowPriorities` keeps one float64 per row
and, whenever something changes which rows reference a blob or what those rows are worth,
recounts exactly the blobs concerned:

* ``set`` (new row priorities): the blobs of those rows;
* ``staged`` (rows rewritten by a small write, waiting raw in the write stage): the rows get
  the ``default`` priority; their table entries still name the previous occupant's blobs, which
  lose the rows now;
* ``written`` (the write path pointed the rows' table entries at new blobs: a direct write, or
  staged rows compressed by a stage flush): a directly written row gets ``default`` (a flushed
  one keeps what it was given while staged); the blobs the rows named before and the ones they
  name now are recounted.

So a staged row counts for no blob until the flush points its entries at its own blobs, and a
priority set while it is staged lands on those blobs, not on the previous occupant's.

Until the first ``set`` (stores whose policy is not ``priority``) nothing is tracked: every row
is at ``default`` and the write events cost nothing.

A recount finds every row that references the touched blobs without scanning the tables: a
reverse index (table entries sorted by blob id, rebuilt after ``capacity / 16`` rows were
written) plus the rows written since, whose entries are read directly; candidate rows are then
checked against the tables as they are now, and one ``np.maximum.at`` gives the maxima. A
decrease is therefore exact too: the max is recomputed from the rows that still reference the
blob, never kept as a running max. No step loops over rows or blobs in Python.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> from tiered.testing import parts
    >>> store = TieredStore(8, frames={"obs": 0}, policy="priority", stage_rows=0, chunk_frames=1)
    >>> frames = torch.arange(5, dtype=torch.uint8)[:, None, None].expand(5, 32, 32)
    >>> stacks = torch.stack([frames[t:t + 2] for t in range(4)])  # row t shows frames t, t+1
    >>> _ = store.extend(TensorDict({"obs": stacks}, [4]))
    >>> store.set_priority([0, 1, 2, 3], [0.5, 4.0, 0.25, 1.0])
    >>> priorities = parts(store).placement.priorities
    >>> priorities.blob_priorities(np.arange(5)).tolist()  # frame 1: rows 0 and 1, max(0.5, 4.0)
    [0.5, 4.0, 4.0, 1.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptionError, InvalidPriorityError
from ..util.batch import isin, ranges
from ..util.dirty import DirtyBlocks
from ..util.filemap import file_array
from .blob_index import FREE, STORED, BlobIndex
from .layout import FieldLayout
from .stage import WriteStage

__all__ = ["RowPriorities", "checked_row_priorities"]


def checked_row_priorities(rows: np.ndarray, priority: Any) -> np.ndarray:
    """``priority`` as float64, one per row of ``rows`` (a scalar is broadcast).

    Raises:
        InvalidPriorityError: a value is NaN, infinite or negative (naming the rows), or the
            number of values matches neither 1 nor the rows.

    Example:
        >>> checked_row_priorities(np.array([3, 4]), 0.5).tolist()
        [0.5, 0.5]
        >>> checked_row_priorities(np.array([3, 4]), [1.0, float("nan")])
        Traceback (most recent call last):
        ...
        tiered.errors.InvalidPriorityError: priorities must be finite and >= 0: row 4 got nan; ...
    """
    if hasattr(priority, "detach"):  # a torch tensor, on any device
        priority = priority.detach().cpu().numpy()
    try:
        values = np.asarray(priority, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise InvalidPriorityError(f"priorities must be numbers, got {type(priority).__name__}: {e}") from None
    if values.size == 1:
        values = np.broadcast_to(values, rows.shape)
    elif values.size != rows.size:
        raise InvalidPriorityError(
            f"got {values.size} priorities for {rows.size} rows; pass one per row, or one for all")
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        named = ", ".join(f"row {int(rows[i])} got {float(values[i])}" for i in bad[:5])
        more = f" (and {bad.size - 5} more)" if bad.size > 5 else ""
        raise InvalidPriorityError(
            f"priorities must be finite and >= 0: {named}{more}; nothing was changed. Fix the TD "
            "error / priority computation (e.g. torch.nan_to_num, abs) before updating")
    return np.ascontiguousarray(values)


class RowPriorities:
    """Per-row priorities and the per-blob maxima they give (see the module docstring).

    Args:
        capacity: rows in the ring.
        index: the blob index (released blobs are never recounted).
        default: the priority of a row nobody set, and of a row just rewritten.
        active: track blob maxima from the start (the ``priority`` policy); otherwise from the
            first :meth:`activate`.
    """

    def __init__(self, capacity: int, index: BlobIndex, default: float = 1.0, active: bool = False) -> None:
        self.capacity = int(capacity)
        self.index = index
        self.default = float(default)
        self.active = bool(active)
        # allocated on first use: a store whose rows nobody prioritizes pays nothing per row
        self._row: np.ndarray | None = None
        self._held = np.zeros(self.capacity, dtype=bool)  # staged rows that keep their priority
        self._alpha = 1.0
        self._blob = np.full(1024, self.default, dtype=np.float64)  # blob maxima by id
        self._mass = np.zeros(1024, dtype=np.float64)  # blob sampling weights by id
        #: rows whose priority changed since the last commit
        self.dirty = DirtyBlocks()
        self._clear_reverse_index()

    @property
    def alpha(self) -> float:
        """The exponent of the sampling distribution (``P(row) ~ priority ** alpha``) used by
        :meth:`tier_mass`; TorchRL's prioritized samplers set theirs."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        value = float(value)
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"priority_alpha must be finite and >= 0, got {value}")
        self._alpha = value

    @property
    def row(self) -> np.ndarray:
        """float64 ``[capacity]``: each row's priority (allocated on first use)."""
        if self._row is None:
            self._row = file_array(self.capacity, np.float64, fill=self.default)  # laid out as its file
        return self._row

    def of(self, rows: np.ndarray) -> np.ndarray:
        """A copy of the priorities of ``rows`` (``default`` for rows nobody set)."""
        if self._row is None:
            return np.full(rows.shape, self.default, dtype=np.float64)
        return self._row[rows].copy()

    def _clear_reverse_index(self) -> None:
        self._sorted_blob: np.ndarray | None = None  # table entries sorted by blob id ...
        self._sorted_row = np.empty(0, dtype=np.int64)  # ... and the row of each
        self._recent = np.zeros(self.capacity, dtype=bool)  # rows written since the build
        self._n_recent = 0

    # -- events ---------------------------------------------------------------------------------
    def set(self, layout: FieldLayout | None, rows: np.ndarray, priority: np.ndarray,
            stage: WriteStage | None) -> tuple[np.ndarray, np.ndarray]:
        """Give ``rows`` their (checked) priorities; duplicates: the last wins, as in a sum tree.

        Returns:
            ``(blob ids, priorities)`` of the blobs whose max was recounted.
        """
        rev_unique, rev_first = np.unique(rows[::-1], return_index=True)
        self.row[rev_unique] = priority[::-1][rev_first]
        self.dirty.mark(rev_unique)
        return self.recount(layout, self.blobs_of(layout, rev_unique), stage)

    def activate(self, layout: FieldLayout | None, stage: WriteStage | None) -> tuple[np.ndarray, np.ndarray]:
        """Start tracking blob maxima: every live blob is counted from the rows as they are."""
        self.active = True
        if stage is not None and stage.count:  # rows staged now keep what they are given until the flush
            self._held[stage.rows[: stage.count]] = True
        return self.recount_all(layout, stage)

    def staged(self, layout: FieldLayout | None, rows: np.ndarray,
               stage: WriteStage | None) -> tuple[np.ndarray, np.ndarray]:
        """``rows`` now wait in the stage with new data: they get ``default`` and keep whatever
        they are given until the flush; the blobs their (stale) entries name are recounted."""
        self.row[rows] = self.default
        self.dirty.mark(rows)
        self._held[rows] = True
        return self.recount(layout, self.blobs_of(layout, rows), stage)

    def written(self, layout: FieldLayout, rows: np.ndarray, previous_blobs: np.ndarray,
                stage: WriteStage | None) -> tuple[np.ndarray, np.ndarray]:
        """The write path pointed ``rows``' table entries at new blobs (``previous_blobs``: what
        they named before). ``rows`` count as unstaged even if the stage still lists them."""
        direct = rows[~self._held[rows]]
        self.row[direct] = self.default
        self.dirty.mark(direct)
        self._held[rows] = False
        fresh = rows[~self._recent[rows]]
        self._recent[fresh] = True
        self._n_recent += fresh.size
        touched = np.concatenate([previous_blobs.reshape(-1), self.blobs_of(layout, rows)])
        return self.recount(layout, touched, stage, flushing=rows)

    def cleared(self) -> None:
        """Every row is gone: every row priority goes back to ``default``."""
        if self._row is not None:
            self._row[:] = self.default
            self.dirty.mark_range(0, self.capacity)
        self._held[:] = False
        self._clear_reverse_index()

    # -- recounting -----------------------------------------------------------------------------
    @staticmethod
    def blobs_of(layout: FieldLayout | None, rows: np.ndarray) -> np.ndarray:
        """Every blob id ``rows``' table entries name (with repeats; -1 entries dropped)."""
        if layout is None or not layout.tables:
            return np.empty(0, dtype=np.int64)
        layout.check_rows(rows)
        refs = layout.ids(rows).reshape(-1)
        return refs[refs >= 0]

    def recount(self, layout: FieldLayout | None, blobs: np.ndarray, stage: WriteStage | None,
                flushing: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The max over referencing rows of each live blob among ``blobs`` (0 where no row does:
        nothing can sample it). Staged rows do not count (their entries are stale), except
        ``flushing`` ones. Stores the maxima and returns ``(blob ids, maxima)``."""
        index = self.index
        blobs = np.unique(blobs)
        blobs = blobs[(blobs >= 0) & (blobs < index.size)]
        blobs = blobs[index.state[blobs] != FREE]
        maxima = np.zeros(blobs.size, dtype=np.float64)
        if blobs.size and layout is not None and layout.tables:
            rows = self._rows_naming(layout, blobs)
            layout.check_rows(rows)
            refs = layout.ids(rows)
            counts = np.ones(rows.size, dtype=bool)
            if stage is not None and stage.count:
                counts = stage.staged(rows) < 0
                if flushing is not None:
                    counts |= isin(rows, flushing)
            pos = np.minimum(np.searchsorted(blobs, refs), blobs.size - 1)
            hit = (blobs[pos] == refs) & counts[:, None]
            values = np.broadcast_to(self.row[rows][:, None], refs.shape)
            np.maximum.at(maxima, pos[hit], values[hit])
            share = np.broadcast_to((self.row[rows] ** self._alpha / refs.shape[1])[:, None], refs.shape)
            mass = np.bincount(pos[hit], weights=share[hit], minlength=blobs.size)
        else:
            mass = np.zeros(blobs.size, dtype=np.float64)
        self._blob = self._grown(self._blob, blobs, self.default)
        self._blob[blobs] = maxima
        self._mass = self._grown(self._mass, blobs, 0.0)
        self._mass[blobs] = mass
        return blobs, maxima

    def _rows_naming(self, layout: FieldLayout, blobs: np.ndarray) -> np.ndarray:
        """Rows whose table entries may name one of ``blobs`` (sorted): a superset, checked by the caller."""
        if self._sorted_blob is None or self._n_recent > max(1024, self.capacity // 16):
            self._build(layout)
        lo = np.searchsorted(self._sorted_blob, blobs, side="left")
        hi = np.searchsorted(self._sorted_blob, blobs, side="right")
        from_index = self._sorted_row[ranges(lo, hi - lo)]
        recent = np.flatnonzero(self._recent)
        if recent.size:
            layout.check_rows(recent)
            refs = layout.ids(recent)
            recent = recent[isin(refs.reshape(-1), blobs).reshape(refs.shape).any(1)]
        return np.unique(np.concatenate([from_index, recent]))

    def _build(self, layout: FieldLayout) -> None:
        """Sort every table entry by blob id (one argsort over ``capacity x frames per row``)."""
        layout.check_rows(None)
        blob = np.concatenate([t.full()[0].reshape(-1) for t in layout.tables.values()])
        row = np.concatenate([np.repeat(np.arange(self.capacity, dtype=np.int64), t.frames)
                              for t in layout.tables.values()])
        keep = blob >= 0
        blob, row = blob[keep], row[keep]
        order = np.argsort(blob, kind="stable")
        self._sorted_blob, self._sorted_row = blob[order], row[order]
        self._recent[:] = False
        self._n_recent = 0

    @staticmethod
    def _grown(column: np.ndarray, blobs: np.ndarray, fill: float) -> np.ndarray:
        """``column`` long enough for the sorted ids ``blobs``."""
        if blobs.size and int(blobs[-1]) >= column.shape[0]:
            grown = np.full(max(int(blobs[-1]) + 1, 2 * column.shape[0]), fill, dtype=np.float64)
            grown[: column.shape[0]] = column
            return grown
        return column

    @staticmethod
    def _looked_up(column: np.ndarray, ids: np.ndarray, fill: float) -> np.ndarray:
        """``column[ids]``, ``fill`` for the ids past its end (never recounted)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.full(ids.shape, fill, dtype=np.float64)
        known = ids < column.shape[0]
        out[known] = column[ids[known]]
        return out

    def blob_mass(self, ids: np.ndarray) -> np.ndarray:
        """Each blob's sampling weight: the sum over the table entries that name it of their
        row's ``priority ** alpha`` split over the row's entries (as :meth:`tier_mass` splits
        it; not normalized), as of the last recount of the blob; 0 for blobs never recounted."""
        return self._looked_up(self._mass, ids, 0.0)

    def recount_all(self, layout: FieldLayout | None, stage: WriteStage | None) -> tuple[np.ndarray, np.ndarray]:
        """Recount every live blob (after an open: the saved row priorities decide)."""
        self._clear_reverse_index()
        return self.recount(layout, self.index.live_ids(), stage)

    def blob_priorities(self, ids: np.ndarray) -> np.ndarray:
        """The current max of each blob of ``ids`` (live blobs; others read as ``default``)."""
        return self._looked_up(self._blob, ids, self.default)

    # -- the share of the sampling mass each tier serves ----------------------------------------
    def tier_mass(self, layout: FieldLayout | None, written: np.ndarray, stage: WriteStage | None,
                  fastest_tier: Any, only_tier: str | None = None) -> dict[str, float]:
        """The share of the sampling probability (``priority ** alpha``, over written rows) whose
        frames each place serves: ``hot``, ``warm``, ``cold`` (the fastest tier holding the
        blob), ``memory`` (open time chunks and staged rows, raw in host memory). A row's mass
        is split over its frames. ``only_tier``: the one tier that holds every stored blob, when
        the caller knows it; with no staged rows and no blob outside it (open chunks), that tier
        serves all the mass and no row's frames are looked up (``tiered info`` of a 50M-row store
        would otherwise read every row table page)."""
        shares = {"hot": 0.0, "warm": 0.0, "cold": 0.0, "memory": 0.0}
        rows = np.flatnonzero(written)
        if layout is None or not layout.tables or rows.size == 0:
            return shares
        weight = self.of(rows) ** self.alpha
        total = float(weight.sum())
        if total <= 0:
            return shares
        if only_tier is not None and (stage is None or not stage.count):
            live = self.index.live_ids()
            if bool((self.index.state[live] == STORED).all()):
                shares[only_tier] = 1.0
                return shares
        layout.check_rows(rows)
        refs = layout.ids(rows)
        place = np.full(refs.shape, 3, dtype=np.int64)  # 3: raw in memory
        stored = refs >= 0
        stored[stored] = self.index.state[refs[stored]] == STORED
        place[stored] = fastest_tier(refs[stored])
        if stage is not None and stage.count:
            place[stage.staged(rows) >= 0] = 3
        per_frame = np.broadcast_to((weight / refs.shape[1])[:, None], refs.shape)
        mass = np.bincount(place.reshape(-1), weights=per_frame.reshape(-1), minlength=4)
        return {name: float(mass[i] / total) for i, name in enumerate(shares)}

    # -- saved state -----------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """``{"rows": float64 [capacity]}``: what a reopened store recounts blob priorities from
        (nothing while every row is at ``default``: no row was ever given a priority)."""
        return {} if self._row is None else {"rows": self._row}

    def load_state_arrays(self, arrays: dict[str, np.ndarray], where: str) -> None:
        """Restore saved row priorities (checked first: on an error nothing changes).

        Raises:
            CorruptionError: the array has the wrong dtype or shape, or holds NaN, infinite or
                negative values.
        """
        rows = arrays.get("rows")
        if not isinstance(rows, np.ndarray) or rows.dtype != np.float64 or rows.shape != (self.capacity,):
            got = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
            raise CorruptionError(f"{where}: row priorities must be float64 ({self.capacity},), got {got}")
        bad = ~np.isfinite(rows) | (rows < 0)
        if bad.any():
            raise CorruptionError(f"{where}: row priority of row {int(np.flatnonzero(bad)[0])} is "
                                  f"{float(rows[bad][0])}; priorities are finite and >= 0")
        self._row = np.array(rows, dtype=np.float64)
