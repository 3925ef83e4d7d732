"""The ring of rows: capacity, cursor, length, which rows were written, and the dense columns.

:class:`RowSpace` turns every index a caller can pass (ints, slices, lists, arrays, tensors, bool
masks) into row positions, checks them against the ring, and owns the uncompressed columns of the
dense fields (action, reward, done flags). It knows nothing of blobs: the blob fields' row tables
live in :class:`~tiered.engine.layout.FieldLayout`.

Example:
    >>> import torch
    >>> from tiered.engine.rows import RowSpace
    >>> rows = RowSpace(8)
    >>> rows.advance(5)
    >>> rows.mark_written(torch.arange(5).numpy())
    >>> rows.resolve_read([-1, 0])[0].tolist(), len(rows)
    ([4, 0], 5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from ..errors import IndexOutOfRangeError, SchemaMismatchError
from ..schema import Key, Schema
from ..util.batch import exclusive_cumsum

__all__ = ["RowSpace", "IndexLike", "as_row_array", "DONE_KEYS"]

IndexLike = int | slice | range | list | tuple | np.ndarray | torch.Tensor

#: Flags that end a trajectory when no trajectory-id field is given.
DONE_KEYS: tuple[Key, ...] = (("next", "done"), ("next", "terminated"), ("next", "truncated"), ("done",))


def as_row_array(index: IndexLike) -> tuple[np.ndarray, bool]:
    """Normalize a row index to a 1-D int64 array, and say whether it named a single row.

    Accepts an int, a 1-tuple (TorchRL's SliceSampler), a list, a numpy array, a tensor (bool
    masks and CUDA tensors included) or a range. Bounds are not checked here.

    Example:
        >>> as_row_array(torch.tensor([3, -1]))[0].tolist(), as_row_array(5)[1]
        ([3, -1], True)
    """
    if isinstance(index, tuple):
        if len(index) != 1:
            raise IndexOutOfRangeError(f"expected a 1-D index, got a tuple of {len(index)} indices")
        index = index[0]
    if isinstance(index, (bool, np.bool_)):
        raise IndexOutOfRangeError(f"a bool is not a row index (got {index!r})")
    if isinstance(index, (int, np.integer)):
        return np.array([int(index)], dtype=np.int64), True
    if isinstance(index, torch.Tensor):
        if index.dtype == torch.bool:
            return np.flatnonzero(index.cpu().numpy()), False
        if index.is_floating_point():
            raise IndexOutOfRangeError(f"row indices must be integers, got a {index.dtype} tensor")
        scalar = index.ndim == 0
        return index.detach().cpu().reshape(-1).to(torch.int64).numpy(), scalar
    if isinstance(index, range):
        return np.arange(index.start, index.stop, index.step, dtype=np.int64), False
    arr = np.asarray(index)
    if arr.dtype == bool:
        return np.flatnonzero(arr), False
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise IndexOutOfRangeError(f"row indices must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64).reshape(-1), arr.ndim == 0


class RowSpace:
    """Capacity, cursor, length, the written mask and the dense columns of a store.

    Args:
        capacity: rows in the ring.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.cursor = 0
        self.length = 0
        self.written = np.zeros(self.capacity, dtype=bool)
        self.dense: dict[Key, torch.Tensor] = {}
        #: trajectory id the next write without a trajectory-id field starts from
        self.next_trajectory = 0

    def __len__(self) -> int:
        return self.length

    # -- the ring ---------------------------------------------------------------------------
    def next_rows(self, n: int) -> np.ndarray:
        """The ``n`` positions an append writes, from the cursor, wrapping around."""
        return (self.cursor + np.arange(n, dtype=np.int64)) % self.capacity

    def advance(self, n: int) -> None:
        """Move the cursor past an append of ``n`` rows and grow the length (up to capacity)."""
        self.cursor = int((self.cursor + n) % self.capacity)
        self.length = min(self.capacity, self.length + n)

    def set_cursor(self, value: int) -> None:
        value = int(value)
        if not 0 <= value < self.capacity:
            raise IndexOutOfRangeError(f"cursor {value} is out of range for capacity {self.capacity}")
        self.cursor = value

    def set_length(self, value: int) -> None:
        """Set the length directly (clipped to ``[0, capacity]``), as TorchRL's ``_len`` setter does."""
        self.length = max(0, min(int(value), self.capacity))

    def length_after(self, rows: np.ndarray, length: int | None) -> None:
        """The length after writing ``rows``: ``length`` if given, else grown to cover them."""
        if length is not None:
            self.set_length(length)
        elif rows.size:
            self.length = max(self.length, int(rows.max()) + 1)

    def mark_written(self, rows: np.ndarray) -> None:
        self.written[rows] = True

    def reset(self) -> None:
        """Forget every row (the dense columns keep their bytes; no row is readable)."""
        self.written[:] = False
        self.length = self.cursor = 0

    # -- index resolution -------------------------------------------------------------------
    def resolve_read(self, index: IndexLike,
                     staged: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray, bool]:
        """Rows a read names (negative indices count from the end of the written rows).

        Args:
            index: any index :func:`as_row_array` accepts, or a slice (clipped to the length).
            staged: a function giving the stage slot of rows (-1: not staged); staged rows count
                as written.

        Raises:
            IndexOutOfRangeError: an index outside ``[-len, len)`` or a row never written.
        """
        n = self.length
        if isinstance(index, slice):
            return np.arange(*index.indices(n), dtype=np.int64), False
        rows, scalar = as_row_array(index)
        bad = (rows < -n) | (rows >= n)
        if bad.any():
            raise IndexOutOfRangeError(
                f"index {int(rows[bad][0])} is out of range for a store of length {n} "
                f"(valid: -{n} <= i < {n})" if n else
                f"index {int(rows[bad][0])} is out of range: the store is empty (length 0)")
        rows = np.where(rows < 0, rows + n, rows)
        unwritten = ~self.written[rows]
        if unwritten.any() and staged is not None:
            unwritten &= staged(rows) < 0  # staged rows are written
        if unwritten.any():
            raise IndexOutOfRangeError(
                f"row {int(rows[unwritten][0])} was never written (length {n}); write it first or sample "
                "written rows only")
        return rows, scalar

    def resolve_write(self, index: IndexLike, n: int) -> np.ndarray:
        """Rows a write of ``n`` rows names (negative indices count from the end of the capacity).

        Raises:
            IndexOutOfRangeError: an index outside ``[-capacity, capacity)``.
            SchemaMismatchError: the index names another number of rows than the data holds.
        """
        cap = self.capacity
        if isinstance(index, slice):
            rows = np.arange(*index.indices(cap), dtype=np.int64)
        else:
            rows, _ = as_row_array(index)
        bad = (rows < -cap) | (rows >= cap)
        if bad.any():
            raise IndexOutOfRangeError(
                f"index {int(rows[bad][0])} is out of range for a store of capacity {cap} (length {self.length})")
        rows = np.where(rows < 0, rows + cap, rows)
        if rows.size != n:
            raise SchemaMismatchError(f"index names {rows.size} rows but the data has {n} rows")
        return rows

    # -- dense columns ----------------------------------------------------------------------
    def init_dense(self, schema: Schema) -> None:
        for f in schema.dense_fields:
            self.dense[f.key] = torch.zeros((self.capacity, *f.shape), dtype=f.dtype)

    def write_dense(self, schema: Schema, rows: np.ndarray, data: TensorDictBase) -> None:
        rows_t = torch.from_numpy(rows)
        n = rows.size
        for f in schema.dense_fields:  # a loop over fields, not rows
            self.dense[f.key].index_copy_(0, rows_t, data.get(f.key).detach().reshape(n, *f.shape))

    def write_dense_cells(self, schema: Schema, rows: np.ndarray, cells: dict[Key, torch.Tensor]) -> None:
        """Write the dense cells of a small write (one row: cells without a batch dimension)."""
        n = rows.size
        with torch.no_grad():  # stored values never carry autograd history
            if n == 1:
                r = int(rows[0])
                for f in schema.dense_fields:
                    self.dense[f.key][r].copy_(cells[f.key].reshape(f.shape))
            else:
                rows_t = torch.from_numpy(rows)
                for f in schema.dense_fields:
                    self.dense[f.key].index_copy_(0, rows_t, cells[f.key].reshape(n, *f.shape).cpu())

    def read_dense(self, key: Key, rows: np.ndarray, span: tuple[int, int] | None = None) -> torch.Tensor:
        """A dense column's cells of ``rows`` (a copy), or a view of ``span = (start, n)`` rows."""
        col = self.dense[key]
        return col.narrow(0, *span) if span else col.index_select(0, torch.from_numpy(rows))

    # -- trajectories -----------------------------------------------------------------------
    def trajectory_ids(self, schema: Schema, data: TensorDictBase, n: int,
                       traj_key: Key | None) -> tuple[np.ndarray, np.ndarray, int]:
        """Trajectory id per row, the sorted ids of trajectories that end in this batch, and the
        id the next batch starts from (commit it with :attr:`next_trajectory` once the write lands).

        With a trajectory-id field (``traj_key``, default ``("collector", "traj_ids")``) its values
        are used; otherwise trajectories are cut after every done/terminated/truncated flag.
        """
        done = np.zeros(n, dtype=bool)
        for k in DONE_KEYS:
            if k in schema:
                done |= data.get(k).reshape(n, -1).any(-1).numpy()
        tk = traj_key if traj_key is not None else ("collector", "traj_ids")
        next_base = self.next_trajectory
        if tk in schema:
            traj = data.get(tk).reshape(n, -1)[:, 0].to(torch.int64).numpy()
        else:
            traj = self.next_trajectory + exclusive_cumsum(done.astype(np.int64))
            next_base = self.next_trajectory + int(done.sum())
        return traj, np.unique(traj[done]), next_base

    # -- persistence ------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"len": self.length, "cursor": self.cursor, "traj_base": self.next_trajectory}

    def load_state(self, body: dict[str, Any], written: np.ndarray) -> None:
        self.length, self.cursor, self.next_trajectory = int(body["len"]), int(body["cursor"]), int(body["traj_base"])
        self.written = np.array(written)
