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

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from ..errors import CorruptionError, IndexOutOfRangeError, SchemaMismatchError, UnwrittenRowError
from ..schema import (
    Field,
    Key,
    Schema,
    as_bits,
    bits_dtype,
    columns_from_pickle,
    columns_to_pickle,
    key_to_str,
    row_number_eligible,
)
from ..util.batch import exclusive_cumsum
from ..util.dirty import DirtyBlocks
from ..util.filemap import file_array

__all__ = ["as_mask", "RowSpace", "DenseGather", "IndexLike", "as_row_array", "index_shape", "DONE_KEYS", "row_number_cells", "held_rows"]

IndexLike = int | slice | range | list | tuple | np.ndarray | torch.Tensor

#: Flags that end a trajectory when no trajectory-id field is given.
DONE_KEYS: tuple[Key, ...] = (("next", "done"), ("next", "terminated"), ("next", "truncated"), ("done",))


def as_row_array(index: IndexLike, mask_lengths: tuple[int, ...] | None = None) -> tuple[np.ndarray, bool]:
    """Normalize a row index to a 1-D int64 array, and say whether it named a single row.

    Accepts an int, a 1-tuple (TorchRL's SliceSampler), a list, a numpy array, a tensor (bool
    masks and CUDA tensors included) or a range. An integer index of several dimensions is
    flattened (:func:`index_shape` gives its shape back). Bounds are not checked here.

    Args:
        index: the index.
        mask_lengths: the lengths a bool mask may have (None: any).

    Raises:
        IndexOutOfRangeError: a float index, a bool scalar, a tuple of several indices, or a bool
            mask that is not 1-D or whose length is not one of ``mask_lengths``.

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
        index = _readable_index(index)
        if index.dtype == torch.bool:
            return _mask_rows(index.cpu().numpy(), mask_lengths), False
        if index.dtype.is_floating_point or index.dtype.is_complex:  # attributes: no calls
            raise IndexOutOfRangeError(f"row indices must be integers, got a {index.dtype} tensor")
        scalar = index.ndim == 0
        if index.device.type == "cpu" and index.dtype == torch.int64:
            # a sampler's own indices: one view, no copies (a read never writes to its index)
            return index.detach().numpy().reshape(-1), scalar
        return index.detach().cpu().reshape(-1).to(torch.int64).numpy(), scalar
    if isinstance(index, range):
        return np.arange(index.start, index.stop, index.step, dtype=np.int64), False
    arr = np.asarray(index)
    if arr.dtype == bool:
        return _mask_rows(arr, mask_lengths), False
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise IndexOutOfRangeError(f"row indices must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64).reshape(-1), arr.ndim == 0


def _readable_index(index: torch.Tensor) -> torch.Tensor:
    """An index tensor as torch indexes with it: a uint8 tensor is a mask (:func:`as_mask`), a
    meta tensor is refused (no values).

    Raises:
        IndexOutOfRangeError: an index on the meta device.
    """
    if index.device.type == "meta":
        raise IndexOutOfRangeError(
            f"an index tensor on the meta device has a shape ({list(index.shape)}) but no values; "
            "index with a tensor on the CPU or a CUDA device")
    return as_mask(index) if index.dtype == torch.uint8 else index


def as_mask(index: torch.Tensor) -> torch.Tensor:
    """A uint8 index tensor as the bool mask torch (and so TorchRL's storages) takes it for, with a
    deprecation warning as torch gives; numpy's uint8 arrays stay row numbers, as numpy reads them.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     as_mask(torch.tensor([1, 0, 1], dtype=torch.uint8)).tolist()
        [True, False, True]
    """
    warnings.warn("indexing with dtype torch.uint8 is deprecated (as in torch) and takes the index as a mask; "
                  "use a torch.bool mask, or an int64 tensor of row numbers", DeprecationWarning, stacklevel=3)
    return index.bool()


def _mask_rows(mask: np.ndarray, lengths: tuple[int, ...] | None) -> np.ndarray:
    if mask.ndim != 1 or (lengths is not None and mask.shape[0] not in lengths):
        want = " or ".join(map(str, sorted(set(lengths)))) if lengths is not None else "any"
        raise IndexOutOfRangeError(
            f"a bool mask must be 1-D with {want} entries (the store's length or capacity), got shape "
            f"{list(mask.shape)}; index with row numbers to read fewer rows")
    return np.flatnonzero(mask)


def index_shape(index: IndexLike) -> tuple[int, ...] | None:
    """The shape of an integer index of two or more dimensions (a read keeps it, as TorchRL's
    storages do), else None.

    Example:
        >>> index_shape(torch.zeros(2, 3, dtype=torch.int64)), index_shape([1, 2])
        ((2, 3), None)
    """
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if isinstance(index, (torch.Tensor, np.ndarray)) and index.ndim > 1 and index.dtype not in (torch.bool, np.bool_):
        return tuple(index.shape)
    if isinstance(index, list) and index and isinstance(index[0], (list, tuple, np.ndarray, torch.Tensor)):
        arr = np.asarray(index)
        return tuple(arr.shape) if arr.ndim > 1 and arr.dtype != bool else None
    return None


def row_number_cells(field: Field, rows: np.ndarray, span: tuple[int, int] | None = None,
                     device: torch.device | None = None) -> torch.Tensor:
    """The cells of a row-number field (:attr:`~tiered.schema.Field.row_number`) at ``rows`` (or
    the ``span = (start, n)``): the rows themselves in the field's dtype, a new tensor, made on
    ``device`` (a GPU read copies the row positions there and casts them there: no host sync).

    Example:
        >>> f = Field(("index",), torch.int64, (1,), "dense", row_number=True)
        >>> row_number_cells(f, np.array([5, 2])).tolist(), row_number_cells(f, None, (3, 2)).tolist()
        ([[5], [2]], [[3], [4]])
    """
    n = span[1] if span is not None else rows.size
    if device is not None and device.type != "cpu":
        if span is not None:
            at = torch.arange(span[0], span[0] + n, dtype=torch.int64, device=device)
        else:
            at = torch.from_numpy(rows).to(device, non_blocking=True)
        cells = at.to(field.dtype)
    else:  # numpy's cast is a few times cheaper than torch's for a sample's rows; always a copy,
        # never a view of ``rows`` (a caller's own index array)
        at = np.arange(span[0], span[0] + n) if span is not None else rows
        cells = torch.from_numpy(at.astype(_NUMPY_INT[field.dtype]))
    if not field.shape:
        return cells
    cells = cells.view(n, *([1] * len(field.shape)))
    return cells if math.prod(field.shape) == 1 else cells.expand(n, *field.shape).contiguous()


#: the numpy dtype of each dtype a row-number field may have (:func:`~tiered.schema.row_number_eligible`)
_NUMPY_INT = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
              torch.int64: np.int64}


def held_rows(written: np.ndarray, staged: np.ndarray | None) -> np.ndarray:
    """The rows whose cells a reader could see (``written``: the written mask, or ``staged``),
    sorted: what a row-number column that widens must hold (one pass over the mask, a few times
    in a store's life).

    Example:
        >>> held_rows(np.array([True, False, True, False]), np.array([3])).tolist()
        [0, 2, 3]
    """
    held = np.flatnonzero(written)
    return held if staged is None or not staged.size else np.union1d(held, staged)


#: the numpy dtype of each torch dtype a dense column widens to in numpy (numpy's cast of a
#: sample's cells costs ~0.3 us, torch's ~3 us); others widen in torch
_NUMPY_DTYPES = {torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
                 torch.float32: np.float32, torch.float64: np.float64}


class DenseGather:
    """How :meth:`RowSpace.read_dense_fields` gathers one list of dense fields for some rows,
    worked out once per list (and again after a column, the flags or a page check changes): the
    flags byte of the rows once, split into every flag in one table lookup and handed out as
    views of one ``[flags, n, ...]`` array; each column in one numpy gather (and one numpy cast
    when it is stored narrower); the row-number fields made from the rows.

    Args:
        flags: the flag fields read (bits of the flags byte), in order.
        table: ``[len(flags), 256]`` bool, bit of each flag for every byte value (None without flags).
        flag_bytes: the flags byte column (numpy; None without flag fields).
        flags_check: what checks the flags column's pages before use (None: nothing to check).
        columns: per column field, ``(key, numpy column, page check or None, numpy dtype it widens
            to or None, torch dtype its bits are viewed as or None, torch dtype it widens to or None)``.
        numbered: the row-number fields read.

    Example:
        >>> space = RowSpace(4)
        >>> schema = Schema([Field(("a",), torch.int64, (), "dense", stored_dtype=torch.uint8),
        ...                  Field(("d",), torch.bool, (1,), "dense", flag_bit=0)])
        >>> space.init_dense(schema)
        >>> space.write_dense(schema, np.arange(4), {("a",): torch.tensor([5, 6, 7, 8]),
        ...                                          ("d",): torch.tensor([[True], [False], [True], [False]])})
        >>> out = {}
        >>> space.read_dense_fields(schema.dense_fields, np.array([2, 1]), out)
        >>> out[("a",)].tolist(), out[("a",)].dtype, out[("d",)].tolist()
        ([7, 6], torch.int64, [[True], [False]])
    """

    __slots__ = ("flag_keys", "flag_shapes", "flag_shape", "table", "flag_bytes", "flags_check", "columns", "numbered")

    def __init__(self, flags: list[Field], table: np.ndarray | None, flag_bytes: np.ndarray | None, flags_check: Any,
                 columns: list[tuple], numbered: list[Field]) -> None:
        self.flag_keys = [f.key for f in flags]
        self.flag_shapes = [f.shape for f in flags]
        shapes = set(self.flag_shapes)
        #: the one cell shape of every flag (they are split in one step), else None
        self.flag_shape = shapes.pop() if len(shapes) == 1 else None
        self.table = table
        self.flag_bytes = flag_bytes
        self.flags_check = flags_check
        self.columns = columns
        self.numbered = numbered

    def read(self, rows: np.ndarray, out: dict[Key, torch.Tensor], device: torch.device | None = None) -> None:
        """The cells of ``rows`` (int64, checked) of every field into ``out`` (row-number fields on ``device``)."""
        if self.flag_keys:
            if self.flags_check is not None:
                self.flags_check.rows(rows)
            # [flags, n]: every flag of every row in one lookup of the rows' bytes (torch's shift,
            # mask and cast cost ~5 us each even for one row); each flag's rows are contiguous
            bits = self.table[:, self.flag_bytes[rows]]
            if self.flag_shape is not None:
                cells = torch.from_numpy(bits.reshape(len(self.flag_keys), rows.size, *self.flag_shape)).unbind(0)
                out.update(zip(self.flag_keys, cells, strict=True))
            else:
                for k, (key, shape) in enumerate(zip(self.flag_keys, self.flag_shapes, strict=True)):
                    out[key] = torch.from_numpy(bits[k].reshape(-1, *shape))
        for key, col, check, np_wide, view, wide in self.columns:
            if check is not None:
                check.rows(rows)
            cells = col[rows]  # a numpy gather: a copy
            if np_wide is not None:
                cells = cells.astype(np_wide)
            cells = torch.from_numpy(cells)
            if view is not None:
                cells = cells.view(view)
            out[key] = cells if wide is None else cells.to(wide)
        for f in self.numbered:
            out[f.key] = row_number_cells(f, rows, None, device)


class RowSpace:
    """Capacity, cursor, length, the written mask and the dense columns of a store.

    Args:
        capacity: rows in the ring.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.cursor = 0
        self.length = 0
        # laid out as its file, as the dense columns: a commit hands its pages back to the file
        self.written = file_array(self.capacity, np.bool_)
        #: the written mask memory-mapped from a store a writer changes in place (a read-only
        #: open): what checks its pages before first use (None: nothing to check)
        self.written_check: Any = None
        self.dense: dict[Key, torch.Tensor] = {}
        # each column's bytes as numpy (its bits dtype): a gather of a few rows costs ~0.2 us in
        # numpy against ~1-5 us for torch's index_select, and never wakes torch's thread pool;
        # kept in step with `dense` by the methods that set a column (init, install, load)
        self._dense_np: dict[Key, tuple[np.ndarray, torch.dtype | None]] = {}
        #: the dtype reads give back, for columns stored narrower (``dense_dtypes``)
        self.widen: dict[Key, torch.dtype] = {}
        #: dense columns memory-mapped from a store: what checks their pages before first use
        self.dense_checks: dict[Key, Any] = {}
        #: the dense bool fields kept as bits of one shared flags byte per row (``Field.flag_bit``)
        self.flag_fields: dict[Key, Field] = {}
        #: that byte per row (``uint8 [capacity]``; None without such fields), and its page check
        self.flags: torch.Tensor | None = None
        self.flags_check: Any = None
        #: the dense fields stored as nothing: every value is its row (``Field.row_number``)
        self.row_numbers: dict[Key, Field] = {}
        self._shifts: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._flag_tables: tuple[tuple[int, ...], np.ndarray] | None = None
        #: trajectory id the next write without a trajectory-id field starts from
        self.next_trajectory = 0
        #: rows changed since the last commit (what an incremental commit rewrites)
        self.dirty = DirtyBlocks()
        # dense views handed out by get(copy=False), with their rows: a write through one is a
        # change no write path sees, so every commit while one is alive saves its rows
        self.views: list[tuple[weakref.ref, int, int]] = []
        # the gather of each list of dense fields a read asks for (a ReadPlan's), worked out once:
        # dropped whenever a column, the flags, a widening or a page check changes
        self._gathers: dict[int, tuple[list[Field], DenseGather]] = {}
        # and the numpy columns small writes of one schema write to (same lifetime)
        self._scatters: dict[int, tuple[Schema, list[tuple[Field, np.ndarray, bool, bool]], Any]] = {}

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict:
        # the views handed out stay with this process (weak references do not pickle): a copy's
        # columns are its own, so no view of them exists yet
        # (and the numpy views of the columns would unpickle as copies: rebuilt from the columns)
        return {**self.__dict__, "views": [], "_dense_np": {}, "_gathers": {}, "_scatters": {}, "dense": columns_to_pickle(self.dense)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.dense = columns_from_pickle(self.dense)
        self._gathers, self._scatters = {}, {}
        for key, col in list(self.dense.items()):
            self._set_column(key, col)

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
        self.dirty.mark(rows)

    def reset(self) -> None:
        """Forget every row (the dense columns keep their bytes; no row is readable)."""
        self.written[:] = False
        self.dirty.mark_range(0, self.capacity)
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
            bounds = index.indices(n)
            rows = np.arange(*bounds, dtype=np.int64)
            if self.written_check is not None:  # a run of rows: its units, not a unique of the rows
                self.written_check.span(bounds[0], rows.size) if bounds[2] == 1 else self.written_check.rows(rows)
            if self.written[slice(*bounds)].all():  # a view: no gather for the common case
                return rows, False
            scalar = False
        else:
            rows, scalar = as_row_array(index, (n, self.capacity))
            # the common case (every row in [0, n)) in two ufunc reductions; else the full check
            if not rows.size or int(np.minimum.reduce(rows)) < 0 or int(np.maximum.reduce(rows)) >= n:
                bad = (rows < -n) | (rows >= n)
                if bad.any():
                    raise IndexOutOfRangeError(
                        f"index {int(rows[bad][0])} is out of range for a store of length {n} "
                        f"(valid: -{n} <= i < {n})" if n else
                        f"index {int(rows[bad][0])} is out of range: the store is empty (length 0)")
                rows = np.where(rows < 0, rows + n, rows)
        self.check_written(rows, staged)
        return rows, scalar

    def check_written(self, rows: np.ndarray, staged: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """Refuse to read rows that were never written (``set`` beyond the length leaves holes):
        their cells would be another row's or zeros.

        Raises:
            UnwrittenRowError: naming the first few such rows and how many there are.
        """
        if self.written_check is not None:
            self.written_check.rows(rows)
        seen = self.written[rows]
        if np.logical_and.reduce(seen):  # the common case, in one call
            return
        unwritten = ~seen
        if unwritten.any() and staged is not None:
            unwritten &= staged(rows) < 0  # staged rows are written
        if unwritten.any():
            holes = np.unique(rows[unwritten])
            raise UnwrittenRowError(
                f"row {int(holes[0])} was never written ({holes.size} never-written row(s) read: "
                f"{holes[:8].tolist()}{' ...' if holes.size > 8 else ''}; length {self.length}). "
                "A set() beyond the length leaves the rows in between unwritten: write them first, "
                "or read and sample written rows only")

    def resolve_write(self, index: IndexLike, n: int) -> np.ndarray:
        """Rows a write of ``n`` rows names (negative indices count from the end of the capacity).

        Raises:
            IndexOutOfRangeError: an index outside ``[-capacity, capacity)``.
            SchemaMismatchError: the index names another number of rows than the data holds.
        """
        cap = self.capacity
        if type(index) is int and n == 1 and -cap <= index < cap:  # a writer's add: one row
            return np.array([index % cap], dtype=np.int64)
        if isinstance(index, slice):
            rows = np.arange(*index.indices(cap), dtype=np.int64)
        else:
            rows, _ = as_row_array(index, (self.length, cap))
            if (rows.size == n and n and rows.dtype == np.int64 and 0 <= int(np.minimum.reduce(rows))
                    and int(np.maximum.reduce(rows)) < cap):
                # every row in [0, capacity) (a writer's extend): nothing to check or wrap; a copy,
                # as the wrap would make: the rows may be a view of the caller's index
                return rows.copy()
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
        self._changed()
        self.flag_fields = {f.key: f for f in schema.flag_fields}
        self.flags = torch.from_numpy(file_array(self.capacity, np.uint8)) if self.flag_fields else None
        self.flags_check = None
        self.load_row_numbers(schema)
        for f in schema.column_fields:
            dtype = f.column_dtype
            col = torch.from_numpy(file_array((self.capacity, *f.shape), f.column_file_dtype))
            self._set_column(f.key, col if col.dtype == dtype else col.view(dtype))
            self.dense_checks.pop(f.key, None)
            self._note_widen(f)

    def _changed(self) -> None:
        """Forget the gathers and scatters worked out so far (a column, the flags, a widening or a
        page check changed)."""
        self._gathers.clear()
        self._scatters.clear()

    def _set_column(self, key: Key, col: torch.Tensor) -> None:
        self._changed()
        self.dense[key] = col
        bits = as_bits(col)
        self._dense_np[key] = (bits.numpy(), None if bits.dtype == col.dtype else col.dtype)

    def widened_columns(self, fields: list[Field], held: np.ndarray | None = None) -> dict[Key, torch.Tensor]:
        """The columns of ``fields`` rewritten in their (wider) ``column_dtype``, every value kept
        (:func:`~tiered.schema.holds_dtype`): one copy of each column, a few times in a store's
        life; a row-number field's column gets the row numbers of the ``held`` rows
        (:func:`held_rows`) and nothing else (pages no row uses stay untouched). Nothing
        changes here (:meth:`install_columns` puts them in), so a failure leaves the store as it was.
        A column memory-mapped from a store has its pages checked first; the new one is anonymous
        until the next commit writes its file whole (the dtype in its header changed).

        Raises:
            ChecksumError: a page of a column is damaged (its check stays in force).
        """
        out = {}
        for f in fields:
            check = self.dense_checks.get(f.key)
            if check is not None:
                check.all()
            col = torch.from_numpy(file_array((self.capacity, *f.shape), f.column_file_dtype))
            col = col if col.dtype == f.column_dtype else col.view(f.column_dtype)
            if f.key in self.row_numbers:
                at = torch.from_numpy(held)
                col[at] = row_number_cells(f, held).to(col.dtype)
            else:
                col.copy_(self.dense[f.key])
            out[f.key] = col
        return out

    def install_columns(self, fields: list[Field], columns: dict[Key, torch.Tensor]) -> None:
        """Put in the columns :meth:`widened_columns` made (assignments only: cannot fail)."""
        for f in fields:
            self.dense_checks.pop(f.key, None)  # every page was checked when it was copied
            self.row_numbers.pop(f.key, None)
            self._set_column(f.key, columns[f.key])
            self._note_widen(f)

    def _note_widen(self, field: Field) -> None:
        self._changed()
        if field.stored_dtype is not None:
            self.widen[field.key] = field.dtype
        else:
            self.widen.pop(field.key, None)

    def is_view(self, key: Key) -> bool:
        """Whether :meth:`read_dense` of a span gives a view of ``key``'s column (a column stored
        narrower gives a widened copy: a write to it does not reach the store; so does a bit of the
        flags byte)."""
        return key not in self.widen and key not in self.flag_fields and key not in self.row_numbers

    def check_dense(self, rows: np.ndarray | None, span: tuple[int, int] | None = None) -> None:
        """Check the pages of the dense columns holding ``rows`` (or the ``span = (start, n)``;
        None for both: every row) before their first use, for columns memory-mapped from a store.

        Raises:
            ChecksumError: a damaged page.
        """
        checks = [*self.dense_checks.values(), *([self.flags_check] if self.flags_check is not None else [])]
        for check in checks:
            if span is not None:
                check.span(*span)
            elif rows is None:
                check.all()
            else:
                check.rows(rows)

    def write_dense(self, schema: Schema, rows: np.ndarray, data: TensorDictBase | dict[Key, torch.Tensor]) -> None:
        self.check_dense(rows)
        rows_t = torch.from_numpy(rows)
        n = rows.size
        self.dirty.mark(rows)
        for f in schema.column_fields:
            col = self.dense[f.key]
            # in the column's dtype: narrowed values were checked to fit before the write began
            cells = data.get(f.key).detach().reshape(n, *f.shape).to(col.dtype)
            # as same-size integers: torch has no index_copy_ for uint16/32/64 and float8
            as_bits(col).index_copy_(0, rows_t, as_bits(cells))
        if self.flags is not None:
            self._write_flags(rows, {k: data.get(k) for k in self.flag_fields})

    def _write_flags(self, rows: np.ndarray, values: dict[Key, torch.Tensor]) -> None:
        """Set the flag bits of ``rows`` (int64) to ``values`` (one bool per row and flag field):
        each row's byte is read, its bits replaced, and written back, one vectorized op per field."""
        n = rows.size
        fields = list(self.flag_fields.values())
        if n == 1:  # one row (rb.add): its byte as a Python int, no tensor ops per flag
            r = int(rows[0])
            flags = self.flags.numpy()  # (a torch element get and set cost ~2 us each, numpy's ~0.1)
            byte = int(flags[r])
            for f in fields:  # one row: its bits set in the byte it shares with the other flags
                byte = (byte & ~(1 << f.flag_bit)) | (int(bool(values[f.key])) << f.flag_bit)
            flags[r] = byte
            return
        keep = 0xFF
        for f in fields:
            keep ^= 1 << f.flag_bit
        given = [values[f.key] for f in fields]
        if {v.device.type for v in given} == {"cpu"}:
            # numpy, no torch dispatch (~5 us an op): [flags, n] 0/1 bytes, each shifted to its
            # bit; the bits are distinct, so their sum is their or
            # (np.array of the list, nonzero -> True: one C call where np.stack and a compare
            # cost ~10 us of Python for the six flags of an Atari row)
            flags = self.flags.numpy()
            bits = np.array([v.detach().numpy().reshape(n) for v in given], dtype=bool)
            weights = np.left_shift(np.uint8(1), self._flag_shifts(fields).numpy())
            flags[rows] = (flags[rows] & keep) | np.bitwise_or.reduce(bits.view(np.uint8) * weights, axis=0)
            return
        # [flags, n] 0/1 bytes, each shifted to its bit; bits are distinct, so their sum is their or
        bits = torch.stack([values[f.key].detach().reshape(n) for f in fields]).cpu().to(torch.uint8)
        rows_t = torch.from_numpy(rows)
        byte = (self.flags.index_select(0, rows_t) & keep) | (bits << self._flag_shifts(fields)).sum(0, dtype=torch.uint8)
        self.flags.index_copy_(0, rows_t, byte)

    def _flag_shifts(self, fields: list[Field]) -> torch.Tensor:
        """``[len(fields), 1]`` uint8: each flag field's bit (made once per set of flag fields)."""
        bits = tuple([f.flag_bit for f in fields])  # (a list: a generator is a Python call per item)
        cached = self._shifts
        if cached is None or cached[0] != bits:
            cached = self._shifts = (bits, torch.tensor(bits, dtype=torch.uint8).unsqueeze(1))
        return cached[1]

    def _flag_table(self, fields: list[Field]) -> np.ndarray:
        """``[len(fields), 256]`` bool: bit ``fields[k].flag_bit`` of every byte value (made once
        per set of flag fields)."""
        bits = tuple([f.flag_bit for f in fields])  # (a list: a generator is a Python call per item)
        cached = self._flag_tables
        if cached is None or cached[0] != bits:
            table = ((np.arange(256, dtype=np.uint8)[None, :] >> np.array(bits, dtype=np.uint8)[:, None]) & 1)
            cached = self._flag_tables = (bits, table.astype(bool))
        return cached[1]

    def write_dense_cells(self, schema: Schema, rows: np.ndarray, cells: dict[Key, torch.Tensor], *,
                          flags: bool = True) -> None:
        """Write the dense cells of a small write (one row: cells without a batch dimension), or of
        the columns of ``schema`` alone with ``flags=False`` (the flags byte left as it is)."""
        self.check_dense(rows)
        n = rows.size
        one = n == 1
        if one:
            r = int(rows[0])
            self.dirty.mark_one(r)
        else:
            self.dirty.mark(rows)
        scatter = self._scatters.get(id(schema))
        if scatter is None or scatter[0] is not schema:
            scatter = self._scatter_of(schema)
        for f, col, native, single in scatter[1]:
            v = cells[f.key]
            if native and one and single:
                # one value (rb.add's reward, step count, action): a Python number, which numpy
                # casts as torch's copy_ does (values were checked to fit the column), ~0.5 us
                col[r] = v.item()
                continue
            if native and v.device.type == "cpu" and not v.is_conj() and not v.is_neg():
                # numpy's assignment casts as torch's copy_ does (values were checked to fit the
                # column), for ~0.3 us against ~5 us of torch ops per column; the cells have the
                # field's shape (one row) or [n, *shape] (Schema.match checked them)
                if one:
                    col[r] = (v.detach() if v.requires_grad else v).numpy().reshape(f.shape)
                else:
                    col[rows] = (v.detach() if v.requires_grad else v).numpy().reshape(n, *f.shape)
                continue
            with torch.no_grad():  # stored values never carry autograd history
                dst = self.dense[f.key]
                if one:
                    dst[r].copy_(v.reshape(f.shape))
                else:
                    as_bits(dst).index_copy_(0, torch.from_numpy(rows),
                                             as_bits(v.reshape(n, *f.shape).cpu().to(dst.dtype)))
        if self.flags is not None and flags:
            if one:  # one row (rb.add): its byte as a Python int, each flag's value one item() (~0.3 us)
                keep, _, bits = scatter[2]
                flags = self.flags.numpy()  # (a torch element get and set cost ~2 us each, numpy's ~0.1)
                byte = int(flags[r]) & int(keep)
                for key, bit in bits:
                    if cells[key].item():
                        byte |= bit
                flags[r] = byte
                return
            given = [cells[k] for k in self.flag_fields]
            if all([v.device.type == "cpu" for v in given]):
                keep, weights, _ = scatter[2]
                # [flags, n] 0/1 bytes (bool tensors carry no autograd history: no detach), each
                # shifted to its bit; the bits are distinct, so their or is their sum
                bits = np.array([v.numpy().reshape(n) for v in given], dtype=bool)
                flags = self.flags.numpy()
                flags[rows] = (flags[rows] & keep) | np.bitwise_or.reduce(bits.view(np.uint8) * weights, axis=0)
            else:
                self._write_flags(rows, dict(zip(self.flag_fields, given, strict=True)))

    def read_dense(self, key: Key, rows: np.ndarray, span: tuple[int, int] | None = None) -> torch.Tensor:
        """A dense column's cells of ``rows`` (a copy), or a view of ``span = (start, n)`` rows
        (a copy for a column stored narrower: see :meth:`is_view`), in the field's dtype."""
        if key in self.row_numbers:
            return row_number_cells(self.row_numbers[key], rows, span)
        flag = self.flag_fields.get(key)
        if flag is not None:
            if self.flags_check is not None:
                self.flags_check.span(*span) if span else self.flags_check.rows(rows)
            byte = self.flags.narrow(0, *span) if span else self.flags.index_select(0, torch.from_numpy(rows))
            return ((byte >> flag.flag_bit) & 1).to(torch.bool).reshape(-1, *flag.shape)
        col = self.dense[key]
        check = self.dense_checks.get(key)
        if check is not None:
            check.span(*span) if span else check.rows(rows)
        out = col.narrow(0, *span) if span else col.index_select(0, torch.from_numpy(rows))
        wide = self.widen.get(key)
        return out if wide is None else out.to(wide)

    def read_dense_fields(self, fields: list[Field], rows: np.ndarray, out: dict[Key, torch.Tensor],
                          span: tuple[int, int] | None = None, device: torch.device | None = None) -> None:
        """:meth:`read_dense` of every dense field of ``fields`` into ``out``, with the flags byte
        gathered once and split into all its bits in one step (a get reads up to 8 flags); the
        row-number fields made on ``device`` (the others come from the columns, on the CPU).

        A gather of rows (no ``span``) runs the :class:`DenseGather` of ``fields``, worked out on
        its first use (``fields`` is a read plan's list, the same object call after call)."""
        if span is None:
            gather = self._gathers.get(id(fields))
            if gather is None or gather[0] is not fields:
                gather = self._gather_of(fields)
            gather[1].read(rows, out, device)
            return
        flags = [f for f in fields if f.key in self.flag_fields]
        if flags:
            if self.flags_check is not None:
                self.flags_check.span(*span) if span else self.flags_check.rows(rows)
            byte = self.flags.numpy()[span[0]:span[0] + span[1]] if span else self.flags.numpy()[rows]
            table = self._flag_table([self.flag_fields[f.key] for f in flags])
            # [flags, n]: one lookup of every row's byte (torch's shift, mask and cast cost ~5 us
            # each even for one row); each flag's row is contiguous, so its cells are a plain view
            bits = table[:, byte]
            for k, f in enumerate(flags):
                out[f.key] = torch.from_numpy(bits[k].reshape(-1, *f.shape))
        dense, checks, widen = self.dense, self.dense_checks, self.widen
        for f in fields:
            key = f.key
            if key not in dense:
                if key in self.row_numbers:
                    out[key] = row_number_cells(f, rows, span, device)
                continue
            if key in checks:
                checks[key].span(*span) if span else checks[key].rows(rows)
            if span:
                cells = dense[key].narrow(0, *span)
            else:  # a numpy gather (a copy), seen as the column's dtype
                col, dtype = self._dense_np[key]
                cells = torch.from_numpy(col[rows])
                cells = cells if dtype is None else cells.view(dtype)
            out[key] = cells.to(widen[key]) if key in widen else cells

    def _scatter_of(self, schema: Schema) -> tuple[Schema, list[tuple[Field, np.ndarray, bool, bool]], Any]:
        """What small writes of ``schema`` write to, kept until a column changes: per column field,
        the field, its numpy column, whether numpy can write its cells (a dtype numpy has, column
        not stored as bits) and whether a cell is one value; and for the flag fields ``(bits of a
        row's byte they keep, [flags, 1] weight of each one's bit, (key, bit) pairs)`` (None
        without flag fields)."""
        if len(self._scatters) >= 8:
            self._scatters.clear()
        plan = []
        for f in schema.column_fields:
            col, special = self._dense_np[f.key]
            plan.append((f, col, special is None and bits_dtype(f.dtype) == f.dtype, math.prod(f.shape) == 1))
        flags = None
        if self.flag_fields:  # the bits the flag fields keep of a row's byte, and each one's weight
            shifts = np.array([f.flag_bit for f in self.flag_fields.values()], dtype=np.uint8)
            keep = np.uint8(0xFF ^ int(np.bitwise_or.reduce(np.left_shift(np.uint8(1), shifts))))
            flags = (keep, np.left_shift(np.uint8(1), shifts)[:, None],
                     [(key, 1 << f.flag_bit) for key, f in self.flag_fields.items()])
        entry = self._scatters[id(schema)] = (schema, plan, flags)
        return entry

    def _gather_of(self, fields: list[Field]) -> tuple[list[Field], DenseGather]:
        """The :class:`DenseGather` of ``fields`` (made now, kept until a column or check changes)."""
        if len(self._gathers) >= 64:  # a caller cycling through many field lists
            self._gathers.clear()
        flags = [f for f in fields if f.key in self.flag_fields]
        columns, numbered = [], []
        for f in fields:
            key = f.key
            if key not in self.dense:
                if key in self.row_numbers:
                    numbered.append(f)
                continue
            col, view = self._dense_np[key]
            wide = self.widen.get(key)
            np_wide = _NUMPY_DTYPES.get(wide) if wide is not None and view is None else None
            columns.append((key, col, self.dense_checks.get(key), np_wide, view, None if np_wide is not None else wide))
        table = self._flag_table([self.flag_fields[f.key] for f in flags]) if flags else None
        gather = DenseGather(flags, table, None if self.flags is None else self.flags.numpy(), self.flags_check,
                             columns, numbered)
        entry = self._gathers[id(fields)] = (fields, gather)
        return entry

    def remember_view(self, view: torch.Tensor, start: int, n: int) -> None:
        """Note that ``view`` shows rows ``[start, start + n)`` of a dense column to a caller."""
        if len(self.views) >= 64:
            self.views = [v for v in self.views if v[0]() is not None]
        self.views.append((weakref.ref(view), start, n))

    def live_views(self) -> bool:
        """Whether a dense view handed out is still alive (a commit must then look at its rows)."""
        self.views = [v for v in self.views if v[0]() is not None]
        return bool(self.views)

    def mark_views(self) -> None:
        """Mark the rows of the dense views still alive (a commit saves what they may have written)."""
        self.views = [v for v in self.views if v[0]() is not None]
        for _, start, n in self.views:  # one entry per live view, not per row
            self.dirty.mark_range(start, start + n)

    def dense_array(self, key: Key) -> np.ndarray:
        """A dense column as the numpy array a commit saves (a view; dtypes numpy lacks, such as
        bfloat16 and float8, as the integers of their size: the manifest records the dtype)."""
        return as_bits(self.dense[key]).numpy()

    def flags_array(self) -> np.ndarray | None:
        """The flags byte per row as the numpy array a commit saves (a view; None without flag fields)."""
        return None if self.flags is None else self.flags.numpy()

    def load_flags(self, schema: Schema, array: np.ndarray, check: Any = None) -> None:
        """Use a saved flags byte column (:meth:`flags_array`'s form) for ``schema``'s flag fields,
        without a copy; ``check`` checks its pages before their first use.

        Raises:
            CorruptionError: the array is not one uint8 per row.
        """
        if array.dtype != np.uint8 or array.shape != (self.capacity,):
            raise CorruptionError(f"the flags column is {array.dtype} {array.shape}, expected uint8 "
                                  f"({self.capacity},); the store is damaged")
        self._changed()
        self.flag_fields = {f.key: f for f in schema.flag_fields}
        self.flags = torch.from_numpy(array)
        self.flags_check = check

    def load_row_numbers(self, schema: Schema) -> None:
        """Take ``schema``'s row-number fields (saved as nothing: their cells are the rows).

        Raises:
            CorruptionError: a field's dtype cannot hold every row of the store.
        """
        bad = [f for f in schema.row_number_fields if not row_number_eligible(f, self.capacity)]
        if bad:
            raise CorruptionError(f"field {key_to_str(bad[0].key)!r} is a row-number field of dtype {bad[0].dtype}, "
                                  f"which cannot hold row {self.capacity - 1}; the store is damaged")
        self._changed()
        self.row_numbers = {f.key: f for f in schema.row_number_fields}

    def load_dense(self, field: Field, array: np.ndarray, check: Any = None) -> None:
        """Use a saved column (:meth:`dense_array`'s form) as ``field``'s column, without a copy;
        ``check`` checks its pages before their first use (``rows(rows)``, ``span(start, n)``,
        ``all()``).

        Raises:
            CorruptionError: the array's dtype is not the one the field is saved as.
        """
        col = torch.from_numpy(array)
        dtype = field.column_dtype
        if col.dtype != bits_dtype(dtype):
            raise CorruptionError(
                f"dense column {key_to_str(field.key)!r} is saved as {col.dtype}, but its field is "
                f"{field.dtype} (saved as {bits_dtype(dtype)}); the store is damaged")
        self._set_column(field.key, col if col.dtype == dtype else col.view(dtype))
        self._note_widen(field)
        if check is not None:
            self.dense_checks[field.key] = check
            self._changed()

    # -- trajectories -----------------------------------------------------------------------
    def trajectory_ids(self, schema: Schema, data: TensorDictBase | dict[Key, torch.Tensor], n: int,
                       traj_key: Key | None) -> tuple[np.ndarray, np.ndarray, int]:
        """Trajectory id per row, the sorted ids of trajectories that end in this batch, and the
        id the next batch starts from (commit it with :attr:`next_trajectory` once the write lands).

        With a trajectory-id field (``traj_key``, default ``("collector", "traj_ids")``) its values
        are used; otherwise trajectories are cut after every done/terminated/truncated flag.
        """
        done = np.zeros(n, dtype=bool)
        for k in DONE_KEYS:
            if k in schema:
                v = data.get(k)
                if v.dtype == torch.bool or not (v.is_floating_point() or v.is_complex()):
                    # bool and integer flags in numpy: torch's compare, any and copy cost ~5 us
                    # a flag even for a few rows (a flush of the write stage reads four)
                    done |= np.logical_or.reduce(v.numpy().reshape(n, -1) != 0, axis=-1)
                else:  # any dtype (bfloat16 too), -0.0 not a done
                    done |= (v.reshape(n, -1) != 0).any(-1).numpy()
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

    def load_state(self, body: dict[str, Any], written: np.ndarray, check: Any = None) -> None:
        """Take a commit's length, cursor and written mask (``check``: what checks the mask's pages
        before first use, :attr:`written_check`)."""
        self.length, self.cursor, self.next_trajectory = int(body["len"]), int(body["cursor"]), int(body["traj_base"])
        self.written = written if written.flags.writeable else np.array(written)  # a private map: no copy
        self.written_check = check if self.written is written else None
