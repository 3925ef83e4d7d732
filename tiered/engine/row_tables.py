"""Row tables: for each blob field, row -> the (blob id, slot) of each of its frames.

A :class:`RowTable` maps each row of a blob field to ``frames_per_row`` (blob id, slot)
pairs: the frame ``j`` of row ``r`` is frame ``slot[r, j]`` inside blob ``blob[r, j]``. Blob
ids are ``int32`` (-1: none; an index holds at most :data:`~tiered.engine.blob_index.MAX_BLOB_IDS` ids) and slots
``uint16`` (a chunk holds at most 65536 frames), 6 bytes per frame reference; whoever does
arithmetic on them widens to ``int64`` first. Stacked fields keep compact forms that rebuild the
same entries: a :class:`ShiftedRowTable` keeps each row's newest frame (the rest of a stack is
the previous row's, shifted by one step), a :class:`NextRowTable` nothing per row for a
``("next", X)`` stack (it is ``X``'s stack of the row shifted, then the newest frame of the next
row), each with a list of the rows where that rule fails.

The blobs themselves are entries of the :class:`~tiered.engine.blob_index.BlobIndex`.

Example:
    >>> t = RowTable(4, 2)  # 4 rows of 2 frames each, none written
    >>> t.blob.shape, int(t.blob[0, 0])
    ((4, 2), -1)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..util.filemap import file_array
from .blob_index import BLOB_DTYPE, SLOT_DTYPE

__all__ = ["RowTable", "NextRowTable", "ShiftedRowTable"]


_WINDOW_STEPS: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}


def _window_steps(frames: int, step: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(back, cols)`` of :meth:`ShiftedRowTable._window`, made once per (frames, step, width):
    how far back each frame's row lies (``[width]``) and the frames' columns (``[1, width]``)."""
    got = _WINDOW_STEPS.get((frames, step, width))
    if got is None:
        cols = np.arange(step, step + width, dtype=np.int64)[None, :]
        back = frames - 1 - cols[0]
        back.flags.writeable = cols.flags.writeable = False
        got = _WINDOW_STEPS[(frames, step, width)] = (back, cols)
    return got



def _row_ids(rows: Any) -> np.ndarray:
    """Row indices (an int array) of ``rows``: an int array or a bool mask over the rows."""
    rows = np.asarray(rows)
    return rows.ravel().nonzero()[0] if rows.dtype == np.bool_ else rows.reshape(-1)


class RowTable:
    """Row -> (blob id, slot) table of one blob field: ``[capacity, frames_per_row]`` each
    (``int32`` blob ids, -1: none; ``uint16`` slots).

    Every user goes through :meth:`ids`, :meth:`refs`, :meth:`full`, :meth:`put` and
    :meth:`unset`, so a compact table (:class:`ShiftedRowTable`, :class:`NextRowTable`) can
    stand in for it.

    Example:
        >>> t = RowTable(4, 2)
        >>> t.put(np.array([1]), np.array([[7, 8]]), np.array([[0, 1]]))
        >>> t.ids(np.array([0, 1])).tolist(), t.nbytes
        ([[-1, -1], [7, 8]], 48)
    """

    derived = False
    shifted = False
    guard: Any = None

    def __init__(self, capacity: int, frames_per_row: int):
        # laid out as their files: a commit can hand the pages it wrote back to them (util.filemap)
        self.blob = file_array((capacity, frames_per_row), BLOB_DTYPE, fill=-1)
        self.slot = file_array((capacity, frames_per_row), SLOT_DTYPE)
        #: for tables memory-mapped from a store: checks the pages of rows before their first use
        #: (``rows(rows)``, ``all()``); None for tables built in memory
        self.guard: Any = None

    @classmethod
    def from_arrays(cls, blob: np.ndarray, slot: np.ndarray) -> RowTable:
        """A table over saved arrays (memory-mapped ones of a store: used as they are)."""
        table = cls.__new__(cls)
        table.blob = blob
        table.slot = slot
        table.guard = None
        return table

    @property
    def capacity(self) -> int:
        return int(self.blob.shape[0])

    @property
    def frames(self) -> int:
        return int(self.blob.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of memory the table takes."""
        return int(self.blob.nbytes + self.slot.nbytes)

    def ids(self, rows: Any) -> np.ndarray:
        """``[len(rows), frames]`` blob ids of ``rows`` (an int array or a bool mask)."""
        return self.blob[rows]

    def reach(self, rows: Any) -> Any:
        """The rows whose stored entries a read or a write of ``rows`` uses (for page checks)."""
        return rows

    def refs(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """``([len(rows), frames]`` blob ids, slots) of ``rows``."""
        return self.blob[rows], self.slot[rows]

    def full(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole ``[capacity, frames]`` blob ids and slots (views: do not write them)."""
        return self.blob, self.slot

    def ahead(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``([len(rows), frames]`` blob ids, slots): each row's stack one step ahead, frames
        ``1 .. F - 1`` of the row then the newest frame of the row after (mod capacity)."""
        b, s = self.refs(rows)
        after = (rows + 1) % self.capacity
        lb, ls = self.blob[after, -1], self.slot[after, -1]
        return (np.concatenate([b[:, 1:], lb[:, None]], axis=1, dtype=BLOB_DTYPE),
                np.concatenate([s[:, 1:], ls[:, None]], axis=1, dtype=SLOT_DTYPE))

    def put(self, rows: np.ndarray, blob: np.ndarray, slot: np.ndarray) -> None:
        """Set the entries of ``rows`` (distinct)."""
        self.blob[rows] = blob
        self.slot[rows] = slot

    def unset(self, rows: Any) -> None:
        """Mark ``rows`` unwritten (blob id -1)."""
        self.blob[rows] = -1

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The arrays a commit saves, by suffix (``rows.<i>.<suffix>``)."""
        return {"blob": self.blob, "slot": self.slot}


class _ExceptionTable(RowTable):
    """What the compact tables share: a sorted exception list (``exc_rows``, with entries of each
    exception row in ``exc_blob``/``exc_slot``) over a rule the subclass gives."""

    #: the list is crowded beyond ``max(4096, capacity // crowd_divisor)`` exception rows
    crowd_divisor = 256
    kind = "compact"
    _frames = 0

    @property
    def blob(self) -> np.ndarray:  # type: ignore[override]
        """The whole ``[capacity, frames]`` blob ids, rebuilt (a copy, O(capacity): for
        inspection; the store itself uses :meth:`ids`)."""
        return self.ids(np.arange(self.capacity))

    @property
    def slot(self) -> np.ndarray:  # type: ignore[override]
        """The whole ``[capacity, frames]`` slots, rebuilt (a copy; see :attr:`blob`)."""
        return self.full()[1]

    @property
    def frames(self) -> int:
        return self._frames

    def _exceptions(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(position in the exception list, whether the row has one)`` per row."""
        if not self.exc_rows.size:
            return np.zeros(rows.shape, np.int64), np.zeros(rows.shape, bool)
        pos = np.minimum(self.exc_rows.searchsorted(rows), self.exc_rows.size - 1)
        return pos, self.exc_rows[pos] == rows

    def ids(self, rows: Any) -> np.ndarray:
        return self.refs(rows)[0]

    def full(self) -> tuple[np.ndarray, np.ndarray]:
        return self.refs(np.arange(self.capacity))

    def _replace(self, rows: np.ndarray, new_rows: np.ndarray, new_blob: np.ndarray, new_slot: np.ndarray) -> None:
        """Drop the exceptions of ``rows``, then add ``new_rows``' (a subset of ``rows``).

        O(exceptions) copies and a sort of the new rows only: a one-row write into a list of
        many exceptions costs a memmove, not a sort of the whole list."""
        exc_rows, exc_blob, exc_slot = self.exc_rows, self.exc_blob, self.exc_slot
        if exc_rows.size:
            pos, hit = self._exceptions(rows)
            if hit.any():
                keep = np.ones(exc_rows.size, dtype=bool)
                keep[pos[hit]] = False
                exc_rows, exc_blob, exc_slot = exc_rows[keep], exc_blob[keep], exc_slot[keep]
        if exc_rows is self.exc_rows and not new_rows.size:
            return
        if new_rows.size:
            order = np.argsort(new_rows, kind="stable")
            new_rows = new_rows.astype(np.int64)[order]
            at = exc_rows.searchsorted(new_rows)  # none of new_rows is left in the list
            exc_rows = np.insert(exc_rows, at, new_rows)
            exc_blob = np.insert(exc_blob, at, new_blob.astype(BLOB_DTYPE)[order], axis=0)
            exc_slot = np.insert(exc_slot, at, new_slot.astype(SLOT_DTYPE)[order], axis=0)
        self.exc_rows, self.exc_blob, self.exc_slot = exc_rows, exc_blob, exc_slot

    def unset(self, rows: Any) -> None:
        """Mark ``rows`` unwritten (blob id -1, slot 0) through :meth:`put`: a shifted table's
        other rows keep their stacks; a next table's base has these rows unset already."""
        rows = _row_ids(rows)
        self.put(rows, np.full((rows.size, self._frames), -1, BLOB_DTYPE), np.zeros((rows.size, self._frames),
                                                                                     SLOT_DTYPE))

    @property
    def crowded(self) -> bool:
        """Whether so many rows break the rule that an explicit table serves better (the
        exception list is rebuilt at every write and rewritten whole at every commit)."""
        return self.exc_rows.size > max(4096, self.capacity // self.crowd_divisor)


def _exceptions(arrays: dict[str, np.ndarray], cap: int, width: int,
                kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The saved exception list (``exc_rows``, and ``exc_blob``/``exc_slot`` of ``width`` entries
    per row) of a table of ``cap`` rows, once checked.

    Raises:
        ValueError: shapes or dtypes that are not what a commit writes, or rows that are not
            sorted distinct rows in ``[0, cap)``.
    """
    rows, eb, es = arrays["exc_rows"], arrays["exc_blob"], arrays["exc_slot"]
    k = rows.shape[0] if rows.ndim == 1 else -1
    if (eb.shape != (k, width) or es.shape != (k, width) or eb.dtype != BLOB_DTYPE or es.dtype != SLOT_DTYPE
            or rows.dtype != np.int64):
        raise ValueError(f"{kind} row table exception arrays of shapes {rows.shape} {eb.shape} {es.shape} do not "
                         f"fit a table of {cap} rows with {width} entries per exception row")
    if k and (int(rows[0]) < 0 or int(rows[-1]) >= cap or (k > 1 and bool((np.diff(rows) <= 0).any()))):
        raise ValueError(f"{kind} row table exception rows are not sorted distinct rows in [0, {cap})")
    return np.asarray(rows), np.asarray(eb), np.asarray(es)


class ShiftedRowTable(_ExceptionTable):
    """The row table of a stacked field ``X`` (frame stacks of ``F`` frames) kept as its newest
    frames only.

    Frame ``j < F - 1`` of row ``r`` is, as a rule, frame ``j + 1`` of row ``r - 1`` (the ring's
    previous row, mod capacity): the stack shifted by one step. Only the last frame column is
    kept per row, plus an exception list: the sorted rows where the rule does not hold (episode
    starts, the first row after a gap or a rewrite, rows written out of order), with their first
    ``F - 1`` entries. Frame ``j`` of row ``r`` is then, with ``e`` the nearest exception row at
    or before ``r`` (around the ring) and ``d = r - e``: ``exc[e][j + d]`` if ``j + d < F - 1``,
    else ``last[r - (F - 1 - j)]``; a read of any rows is a gather and a ``searchsorted``.
    A write keeps every other row's stack as it was (rows after the written ones whose stacks
    no longer follow become exceptions).

    Example:
        >>> t = ShiftedRowTable(6, 3)
        >>> stacks = np.array([[0, 0, 0], [0, 0, 1], [0, 1, 2], [1, 2, 3], [7, 7, 7], [7, 7, 8]])
        >>> t.put(np.arange(6), stacks, np.zeros((6, 3)))
        >>> t.ids(np.arange(6)).tolist() == stacks.tolist(), t.exc_rows.tolist(), t.last_blob.tolist()
        (True, [0, 4], [0, 1, 2, 3, 7, 8])
        >>> t.put(np.array([2]), np.array([[5, 5, 5]]), np.zeros((1, 3)))  # rows 3 and 4 keep their stacks
        >>> t.ids(np.arange(6))[2:5].tolist(), t.exc_rows.tolist()
        ([[5, 5, 5], [1, 2, 3], [7, 7, 7]], [0, 2, 3, 4])
    """

    shifted = True
    kind = "shifted"
    crowd_divisor = 32

    def __init__(self, capacity: int, frames: int):
        self._empty(capacity, frames)

    @classmethod
    def from_state(cls, capacity: int, frames: int, arrays: dict[str, np.ndarray]) -> ShiftedRowTable:
        """A table over the arrays :meth:`state_arrays` saved.

        Raises:
            ValueError: the arrays' shapes, dtypes or exception rows are not what a commit writes.
        """
        table = cls.__new__(cls)  # no empty columns of `capacity` rows: the saved ones replace them
        table._empty(capacity, frames, allocate=False)
        table._load(arrays, capacity)
        return table

    def _empty(self, capacity: int, frames: int, allocate: bool = True) -> None:
        """An empty table (``allocate=False``: no last-frame columns yet, :meth:`_load` sets them)."""
        if frames < 2:
            raise ValueError(f"a {self.kind} row table needs stacks of 2 frames or more, got {frames}")
        self._frames = frames
        self.guard = None
        # [capacity, 1] as saved (state_arrays), laid out as their files (util.filemap)
        n = capacity if allocate else 0
        self.last_blob = file_array((n, 1), BLOB_DTYPE, fill=-1).reshape(n)
        self.last_slot = file_array((n, 1), SLOT_DTYPE).reshape(n)
        self.exc_rows = np.empty(0, dtype=np.int64)
        self.exc_blob = np.empty((0, frames - 1), dtype=BLOB_DTYPE)
        self.exc_slot = np.empty((0, frames - 1), dtype=SLOT_DTYPE)

    def _load(self, arrays: dict[str, np.ndarray], cap: int) -> None:
        """Take the arrays :meth:`state_arrays` saved for a table of ``cap`` rows, once checked.

        Raises:
            ValueError: the arrays' shapes, dtypes or exception rows are not what a commit writes.
        """
        last_blob, last_slot = arrays["blob"], arrays["slot"]
        if (last_blob.shape != (cap, 1) or last_slot.shape != (cap, 1) or last_blob.dtype != BLOB_DTYPE
                or last_slot.dtype != SLOT_DTYPE):
            raise ValueError(f"{self.kind} row table last columns of shapes {last_blob.shape} {last_slot.shape} "
                             f"do not fit a table of {cap} rows")
        self.exc_rows, self.exc_blob, self.exc_slot = _exceptions(arrays, cap, self._frames - 1, self.kind)
        self.last_blob, self.last_slot = last_blob.reshape(cap), last_slot.reshape(cap)

    @property
    def capacity(self) -> int:
        return int(self.last_blob.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.last_blob.nbytes + self.last_slot.nbytes + self.exc_rows.nbytes + self.exc_blob.nbytes
                   + self.exc_slot.nbytes)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"blob": self.last_blob[:, None], "slot": self.last_slot[:, None], "exc_rows": self.exc_rows,
                "exc_blob": self.exc_blob, "exc_slot": self.exc_slot}

    def reach(self, rows: np.ndarray) -> np.ndarray:
        """Rows whose entries a read or a write of ``rows`` may use: ``rows - F .. rows + F - 1``
        around the ring (for page checks: the ends suffice when a unit of checked rows is wider)."""
        rows = _row_ids(rows).astype(np.int64)
        f, cap = self._frames, self.capacity
        unit = getattr(self.guard, "unit", 1)
        steps = np.array([-f, 0, f - 1]) if unit >= 2 * f else np.arange(-f, f)
        return ((rows[:, None] + steps) % cap).reshape(-1)

    def refs(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        return self._window(_row_ids(rows).astype(np.int64), 0)

    def ahead(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._window(_row_ids(rows).astype(np.int64), 1)

    def window(self, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Frames ``0 .. width - 1`` of each of ``rows``' stacks (an int64 array; frame ``F``: the
        newest of the row after, as :meth:`ahead` gives it), in one gather."""
        return self._window(rows, 0, width)

    def _window(self, rows: np.ndarray, step: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Frames ``step .. step + width - 1`` (default ``width``: F) of each row's stack (frame
        ``F``: the newest of the row after): one gather of the last column and a ``searchsorted``."""
        f, cap = self._frames, int(self.last_blob.shape[0])
        back, cols = _window_steps(f, step, f if width is None else width)
        src = (rows[:, None] - back) % cap  # the rows whose last frames make the stack
        blob, slot = self.last_blob[src], self.last_slot[src]
        if not self.exc_rows.size or not rows.size:
            return blob, slot
        pos = self.exc_rows.searchsorted(rows, side="right") - 1  # -1: the last one, a lap before
        d = (rows - self.exc_rows[pos]) % cap  # (a lap before: negative, hence the modulo)
        near = (d < f - 1).nonzero()[0]  # rows within F - 1 of their exception
        if not near.size:  # (most sampled batches: exceptions are episode starts)
            return blob, slot
        col = cols + d[near, None]
        i, j = (col < f - 1).nonzero()  # [m, F]: the exception's column of frame j + step, where it has one
        at, p, c = near[i], pos[near][i], col[i, j]
        blob[at, j], slot[at, j] = self.exc_blob[p, c], self.exc_slot[p, c]
        return blob, slot

    def put(self, rows: np.ndarray, blob: np.ndarray, slot: np.ndarray) -> None:
        """Set the entries of ``rows`` (distinct, any order); every other row keeps its stack."""
        rows = _row_ids(rows).astype(np.int64)
        if not rows.size:
            return
        blob = np.broadcast_to(np.asarray(blob), (rows.size, self._frames)).astype(BLOB_DTYPE)
        slot = np.broadcast_to(np.asarray(slot), (rows.size, self._frames)).astype(SLOT_DTYPE)
        f, cap = self._frames, self.capacity
        # the rows whose exception status may change: the written ones and the F - 1 after each
        if rows.size * f < cap // 64:
            touched = np.sort(np.concatenate([rows, ((rows[:, None] + np.arange(1, f)) % cap).reshape(-1)]))
            touched = touched[np.concatenate([[True], touched[1:] != touched[:-1]])]
        else:  # a large share of the ring (a whole table at open): a mask, not a sort
            mask = np.zeros(cap, dtype=bool)
            for k in range(f):  # a row's stack of f frames touches the rows r .. r + f - 1
                mask[(rows + k) % cap] = True
            touched = mask.ravel().nonzero()[0]
        prev = (touched - 1) % cap
        at_row = touched.searchsorted(rows)
        is_row = np.zeros(touched.size, dtype=bool)
        is_row[at_row] = True
        at_prev = np.minimum(touched.searchsorted(prev), touched.size - 1)
        prev_in = touched[at_prev] == prev
        # the entries every touched row and every untouched previous row hold now (before any change)
        keep_rows, outside = touched[~is_row], prev[~prev_in]
        cur_b, cur_s = self.refs(np.concatenate([keep_rows, outside]))
        want_b = np.empty((touched.size, f), dtype=BLOB_DTYPE)
        want_s = np.empty((touched.size, f), dtype=SLOT_DTYPE)
        want_b[at_row], want_s[at_row] = blob, slot
        want_b[~is_row], want_s[~is_row] = cur_b[:keep_rows.size], cur_s[:keep_rows.size]
        prev_b, prev_s = want_b[at_prev], want_s[at_prev]
        prev_b[~prev_in], prev_s[~prev_in] = cur_b[keep_rows.size:], cur_s[keep_rows.size:]
        bad = ((want_b[:, :-1] != prev_b[:, 1:]) | (want_s[:, :-1] != prev_s[:, 1:])).any(1)
        self.last_blob[rows], self.last_slot[rows] = blob[:, -1], slot[:, -1]
        self._replace(touched, touched[bad], want_b[bad, :-1], want_s[bad, :-1])


class NextRowTable(_ExceptionTable):
    """The row table of a stacked ``("next", X)`` field kept as no per-row column at all: each
    row's entries follow from ``X``'s table ``base``.

    As a rule, the next stack of row ``r`` is ``X``'s stack of ``r`` shifted by one step, its
    newest frame being the newest frame of row ``r + 1`` (mod capacity; the same trajectory,
    written in order): frames ``1 .. F - 1`` of ``base[r]``, then the last frame of
    ``base[r + 1]``. Only the rows where the rule fails are kept (episode ends, the row before
    the write cursor, rows written out of order), sorted, with their whole ``F`` entries. A read
    is a gather from the base and a ``searchsorted`` (no per-row loops).

    A write of ``base``'s rows changes the rule's value of the rows just before them: the caller
    calls :meth:`hold` with those rows before the base changes (the rows before them that follow
    the rule become exceptions holding what they name, so no row's entries ever change but by a
    write of its own), then writes the base, then this table (:meth:`put`, :meth:`unset`), which
    drops the held exceptions that follow the rule again.

    Example:
        >>> x = RowTable(4, 2)
        >>> nxt = NextRowTable(x)
        >>> nxt.hold(np.arange(3))
        >>> x.put(np.arange(3), np.array([[0, 1], [1, 2], [2, 3]]), np.zeros((3, 2)))
        >>> nxt.put(np.arange(3), np.array([[1, 2], [2, 3], [3, 4]]), np.zeros((3, 2)))
        >>> nxt.ids(np.arange(4)).tolist(), nxt.exc_rows.tolist()  # row 2: row 3 is not written
        ([[1, 2], [2, 3], [3, 4], [-1, -1]], [2, 3])
        >>> nxt.hold(np.array([3]))
        >>> x.put(np.array([3]), np.array([[3, 4]]), np.zeros((1, 2)))
        >>> nxt.put(np.array([3]), np.array([[4, 5]]), np.zeros((1, 2)))
        >>> nxt.exc_rows.tolist()  # row 2 follows again; row 3's successor is row 0
        [3]
    """

    derived = True
    kind = "next"
    crowd_divisor = 32

    def __init__(self, base: RowTable):
        if base.frames < 2:
            raise ValueError(f"a {self.kind} row table needs stacks of 2 frames or more, got {base.frames}")
        self.base = base
        self.guard = None
        self._frames = base.frames
        self.exc_rows = np.empty(0, dtype=np.int64)
        self.exc_blob = np.empty((0, self._frames), dtype=BLOB_DTYPE)
        self.exc_slot = np.empty((0, self._frames), dtype=SLOT_DTYPE)

    @classmethod
    def from_state(cls, base: RowTable, arrays: dict[str, np.ndarray]) -> NextRowTable:
        """A table over the arrays :meth:`state_arrays` saved.

        Raises:
            ValueError: the arrays' shapes, dtypes or exception rows are not what a commit writes.
        """
        table = cls(base)
        table.exc_rows, table.exc_blob, table.exc_slot = _exceptions(arrays, table.capacity, table.frames, cls.kind)
        return table

    @property
    def capacity(self) -> int:
        return self.base.capacity

    @property
    def nbytes(self) -> int:
        return int(self.exc_rows.nbytes + self.exc_blob.nbytes + self.exc_slot.nbytes)

    def reach(self, rows: Any) -> np.ndarray:
        """Rows of the base whose entries a read or a write of ``rows`` may use: the rows before,
        the rows and the rows after (for page checks)."""
        rows = _row_ids(rows).astype(np.int64)
        return ((rows[:, None] + np.arange(-1, 2)) % self.capacity).reshape(-1)

    def rule(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``([len(rows), F]`` blob ids, slots) the rule gives ``rows`` (an int array): the
        base's stacks one step ahead (one gather from a shifted base)."""
        blob, slot = self.base.ahead(rows)
        return blob.astype(BLOB_DTYPE, copy=False), slot.astype(SLOT_DTYPE, copy=False)

    def refs(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        rows = _row_ids(rows).astype(np.int64)
        blob, slot = self.rule(rows)
        pos, hit = self._exceptions(rows)
        blob[hit], slot[hit] = self.exc_blob[pos[hit]], self.exc_slot[pos[hit]]
        return blob, slot

    def refs_after_base(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """``[len(rows), 2F]`` int64 blob ids and slots: the base's entries of ``rows``, then this
        table's, as ``np.concatenate`` of both :meth:`refs` gives them, from one window of ``F + 1``
        frames of a shifted base (a stack and the next one share ``F - 1`` frames; a read of ``X``
        and ``("next", X)`` gathers once).

        Example:
            >>> x = ShiftedRowTable(4, 2)
            >>> nxt = NextRowTable(x)
            >>> nxt.hold(np.arange(3))
            >>> x.put(np.arange(3), np.array([[0, 1], [1, 2], [2, 3]]), np.zeros((3, 2)))
            >>> nxt.put(np.arange(3), np.array([[1, 2], [2, 3], [3, 4]]), np.zeros((3, 2)))
            >>> rows = np.array([0, 2, 1])
            >>> nxt.refs_after_base(rows)[0].tolist() == np.concatenate([x.refs(rows)[0], nxt.refs(rows)[0]], 1).tolist()
            True
        """
        f = self._frames
        rows = _row_ids(rows).astype(np.int64)
        wide_b, wide_s = self.base.window(rows, f + 1)
        blob = np.concatenate((wide_b[:, :f], wide_b[:, 1:]), axis=1, dtype=np.int64)
        slot = np.concatenate((wide_s[:, :f], wide_s[:, 1:]), axis=1, dtype=np.int64)
        pos, hit = self._exceptions(rows)
        if np.logical_or.reduce(hit):  # (few sampled batches hold a row of this table's exceptions)
            hit = hit.nonzero()[0]
            at = pos[hit]
            nb, ns = blob[:, f:], slot[:, f:]  # views: the exceptions land in blob and slot
            nb[hit], ns[hit] = self.exc_blob[at], self.exc_slot[at]
        return blob, slot

    def _before(self, rows: np.ndarray) -> np.ndarray:
        """The rows just before ``rows`` (distinct; around the ring) that are not among them,
        sorted (the same calls whatever the rows: no per-row loop, no branch on the batch)."""
        prev = np.sort((rows - 1) % self.capacity)
        ordered = np.sort(rows)
        at = np.minimum(ordered.searchsorted(prev), max(rows.size - 1, 0))
        return prev[ordered[at] != prev]

    def _replace(self, rows: np.ndarray, new_rows: np.ndarray, new_blob: np.ndarray, new_slot: np.ndarray) -> None:
        """Drop the exceptions of ``rows``, then add ``new_rows``' (a subset of ``rows``): one
        O(exceptions) merge, with the same calls whatever the rows (no branch on the batch)."""
        pos, hit = self._exceptions(rows)
        keep = np.ones(self.exc_rows.size, dtype=bool)
        keep[pos[hit]] = False
        order = np.argsort(new_rows, kind="stable")
        new_rows = new_rows.astype(np.int64)[order]
        old = self.exc_rows[keep]
        total = old.size + new_rows.size
        is_new = np.zeros(total, dtype=bool)
        is_new[old.searchsorted(new_rows) + np.arange(new_rows.size)] = True  # none of new_rows is in old
        out_rows = np.empty(total, dtype=np.int64)
        out_blob = np.empty((total, self._frames), dtype=BLOB_DTYPE)
        out_slot = np.empty((total, self._frames), dtype=SLOT_DTYPE)
        out_rows[is_new], out_blob[is_new], out_slot[is_new] = new_rows, new_blob[order], new_slot[order]
        out_rows[~is_new], out_blob[~is_new], out_slot[~is_new] = old, self.exc_blob[keep], self.exc_slot[keep]
        self.exc_rows, self.exc_blob, self.exc_slot = out_rows, out_blob, out_slot

    def hold(self, rows: Any) -> None:
        """The base's ``rows`` are about to change: the rows just before them (not among them)
        that follow the rule become exceptions holding their entries."""
        prev = self._before(_row_ids(rows).astype(np.int64))
        prev = prev[~self._exceptions(prev)[1]]
        self._replace(prev[:0], prev, *self.rule(prev))

    def put(self, rows: np.ndarray, blob: np.ndarray, slot: np.ndarray) -> None:
        """Set the entries of ``rows`` (distinct; the base's rows already written); the held rows
        before them that follow the rule again stop being exceptions."""
        rows = _row_ids(rows).astype(np.int64)
        blob = np.broadcast_to(np.asarray(blob), (rows.size, self._frames)).astype(BLOB_DTYPE)
        slot = np.broadcast_to(np.asarray(slot), (rows.size, self._frames)).astype(SLOT_DTYPE)
        prev = self._before(rows)
        pos, hit = self._exceptions(prev)
        prev, pos = prev[hit], pos[hit]
        rb, rs = self.rule(np.concatenate([rows, prev]))
        bad = ((blob != rb[:rows.size]) | (slot != rs[:rows.size])).any(1)
        follows = ((self.exc_blob[pos] == rb[rows.size:]) & (self.exc_slot[pos] == rs[rows.size:])).all(1)
        self._replace(np.concatenate([rows, prev[follows]]), rows[bad], blob[bad], slot[bad])

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"exc_rows": self.exc_rows, "exc_blob": self.exc_blob, "exc_slot": self.exc_slot}
