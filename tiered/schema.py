"""Fields, dtypes and per-row shapes of a store; validation before any side effect.

The schema is fixed by the first write. Each leaf of the row TensorDict becomes a
:class:`Field`. A field is either

* **dense**: small (action, reward, done flags), kept uncompressed in one column tensor; or
* **blob**: large (images), each cell split into *frames* that are compressed into blobs.

By default a field whose per-row cell holds ``blob_min_bytes`` (1 KiB) or more is a blob
field. ``blob_keys``/``dense_keys`` override that per key. ``frames={"observation": 0}``
says that dimension 0 of a cell is a stack of frames, stored frame by frame so that
consecutive stacks share frames. ``("next", X)`` inherits the frame dimension of ``X``.

Blob fields whose frames have the same dtype and shape form one *family*: their frames are
deduplicated against each other (``observation`` and ``("next", "observation")`` share).

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered.schema import Schema
    >>> td = TensorDict({"observation": torch.zeros(2, 4, 84, 84, dtype=torch.uint8),
    ...                  "action": torch.zeros(2, dtype=torch.int64)}, batch_size=[2])
    >>> schema = Schema.infer(td, frames={"observation": 0})
    >>> schema["observation"].kind, schema["observation"].frames_per_row
    ('blob', 4)
    >>> schema["action"].kind
    'dense'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDictBase, is_leaf_nontensor

from .errors import LossyValueError, SchemaMismatchError

__all__ = ["Field", "Schema", "Key", "normalize_key", "key_to_str", "str_to_key", "SUPPORTED_DTYPES", "bits_dtype",
           "as_bits", "columns_to_pickle", "columns_from_pickle", "check_key", "dtype_from_str", "dtype_to_str", "NARROWABLE_DTYPES", "check_narrowing", "MAX_FLAGS",
           "round_trip", "narrow_candidates", "holds_dtype", "fits_exactly", "narrowest_dtype", "Narrowing",
           "row_number_eligible", "row_number_mismatch"]

Key = tuple[str, ...]

#: Every dtype a field can have. Each is stored as raw bytes (blob fields) or in a column of its own
#: dtype (dense fields); the manifest records its name. Others (quantized, bit and packed float4
#: types) are refused by the first write, with this list.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex32, torch.complex64, torch.complex128,
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None),
        getattr(torch, "float8_e8m0fnu", None),
    ) if d is not None
)

_DTYPES: dict[str, torch.dtype] = {str(d).replace("torch.", ""): d for d in SUPPORTED_DTYPES}

#: dtypes whose indexing kernels torch and numpy both have; the others are moved as same-size
#: integers (:func:`as_bits`), which copies the same bytes
_NATIVE: frozenset[torch.dtype] = frozenset((
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
))
_BITS_OF_SIZE: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a column of ``dtype`` is indexed and saved as: itself when torch and numpy support
    it fully, else the integer of the same size (bfloat16 -> int16, float8 -> uint8).

    Example:
        >>> bits_dtype(torch.bfloat16), bits_dtype(torch.float32)
        (torch.int16, torch.float32)
    """
    if dtype in _NATIVE:
        return dtype
    return _BITS_OF_SIZE[dtype.itemsize]


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view of :func:`bits_dtype` (the same bytes; writes to it write to ``t``).

    Example:
        >>> col = torch.zeros(3, dtype=torch.uint16)
        >>> as_bits(col)[torch.tensor([1])] = as_bits(torch.tensor([7], dtype=torch.uint16))
        >>> col.tolist()
        [0, 7, 0]
    """
    bits = bits_dtype(t.dtype)
    if bits == t.dtype:
        return t
    return t.view(bits) if t.dim() else t.reshape(1).view(bits).reshape(())


def columns_to_pickle(cols: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor | tuple[torch.Tensor, torch.dtype]]:
    """``cols`` as pickle takes them: a column of a dtype that is not :func:`bits_dtype` itself
    becomes ``(as_bits(col), dtype)``, because torch 2.14 pickles uint16/uint32/uint64 tensors it
    cannot unpickle (``UntypedStorage`` has no ``dtype``). :func:`columns_from_pickle` undoes it.

    Example:
        >>> cols = {"depth": torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16)}
        >>> state = columns_to_pickle(cols)
        >>> state["depth"][0].dtype, state["depth"][1]
        (torch.int16, torch.uint16)
        >>> back = columns_from_pickle(state)
        >>> back["depth"].dtype, back["depth"].tolist()
        (torch.uint16, [1, 65535])
    """
    return {k: c if bits_dtype(c.dtype) == c.dtype else (as_bits(c), c.dtype) for k, c in cols.items()}


def columns_from_pickle(cols: dict[Key, torch.Tensor | tuple[torch.Tensor, torch.dtype]]) -> dict[Key, torch.Tensor]:
    """The columns :func:`columns_to_pickle` gave, in their own dtypes again (views of the same bytes)."""
    return {k: c[0].view(c[1]) if isinstance(c, tuple) else c for k, c in cols.items()}


def supported_dtypes_text() -> str:
    """The names of the supported dtypes, for error messages."""
    return ", ".join(_DTYPES)


def normalize_key(key: str | Iterable[str]) -> Key:
    """``"obs"`` -> ``("obs",)``; ``("next", "obs")`` stays; ``"next.obs"`` is *not* split."""
    if isinstance(key, str):
        return (key,)
    key = tuple(key)
    if not key or not all(isinstance(k, str) for k in key):
        raise SchemaMismatchError(f"a key must be a string or a tuple of strings, got {key!r}")
    return key


def key_to_str(key: Key) -> str:
    """Human/JSON form of a key: ``("next", "observation")`` -> ``"next/observation"``."""
    return "/".join(key)


def str_to_key(s: str) -> Key:
    """Inverse of :func:`key_to_str`."""
    return tuple(s.split("/"))


def check_key(key: Key) -> Key:
    """Refuse a key whose parts are empty or hold ``/``: ``/`` joins nested keys in stats, the
    manifest and exports, so ``"a/b"`` and ``("a", "b")`` would be one name.

    Raises:
        SchemaMismatchError: naming the key and what to do.

    Example:
        >>> check_key(("next", "observation"))
        ('next', 'observation')
    """
    bad = [part for part in key if not part or "/" in part]
    if bad:
        raise SchemaMismatchError(
            f"key {key!r} cannot be stored: its part(s) {bad!r} are empty or contain '/', which joins "
            "nested keys in stats, the manifest and exports (so 'a/b' would collide with ('a', 'b')). "
            "Rename the key (e.g. replace '/' with '_') or nest it as a tuple key.")
    return key


def _leaves(td: TensorDictBase) -> list:
    """Every leaf key of ``td``, non-tensor leaves (``NonTensorData``, strings) included, so that
    none is dropped without a word."""
    return list(td.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor))


def check_dtype(key: Key, dtype: torch.dtype) -> None:
    """Refuse a dtype the store cannot keep (before anything is written).

    Raises:
        SchemaMismatchError: listing the supported dtypes.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise SchemaMismatchError(
            f"field {key_to_str(key)!r} has dtype {dtype_to_str(dtype)}, which tiered cannot store; "
            f"supported dtypes: {supported_dtypes_text()}. Convert the field first (e.g. .to(torch.float32)); "
            "nothing was written.")


#: Dense bool fields of one value per row (done, terminated, truncated) that share one flags byte per row.
MAX_FLAGS = 8

#: dtypes a dense column can be stored in, and narrowed from (``dense_dtypes``): real numbers whose
#: conversions torch does exactly when the value fits
NARROWABLE_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64,
)


def round_trip(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``values`` converted to ``dtype``, converted back, and where that kept each value: the same
    value with the same sign (``-0.0`` is not ``0.0``), or a NaN for a NaN with the same bits, sign
    and payload (torch widens every float16 or bfloat16 NaN to one canonical float32 NaN, so a
    float32 NaN never survives them; float64 NaNs survive float32). The one test of "stored
    exactly" that writes and importers' scans share.

    Example:
        >>> round_trip(torch.tensor([1.0, 0.5, -0.0, 300.0]), torch.int16)[2].tolist()
        [True, False, False, True]
        >>> round_trip(torch.tensor([float("nan"), -float("nan")], dtype=torch.float64), torch.float32)[2].tolist()
        [True, True]
        >>> round_trip(torch.tensor([float("nan")]), torch.float16)[2].tolist()
        [False]
    """
    narrow = values.to(dtype)
    back = narrow.to(values.dtype)
    same = back == values
    if values.is_floating_point():
        same &= torch.signbit(back) == torch.signbit(values)  # -0.0 == 0.0, but it is another value
        bits = _SAME_SIZE_INT[values.element_size()]
        same |= torch.isnan(back) & torch.isnan(values) & (back.view(bits) == values.view(bits))
    return narrow, back, same


#: the integer dtype of each float size, to compare floats bit for bit (NaN payloads)
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


#: the dtypes a dense column may narrow itself to, in order of preference at each size
_LADDER: tuple[torch.dtype, ...] = (torch.uint8, torch.int8, torch.int16, torch.float16, torch.int32, torch.float32)
#: integers each float dtype holds exactly (its significand's bits, plus one)
_EXACT_INT_BITS = {torch.float16: 11, torch.float32: 24, torch.float64: 53}


def narrow_candidates(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The narrower dtypes a dense column of ``dtype`` may be stored in when the values allow,
    narrowest first: integers for integer fields (``uint8`` for non-negative values, then
    ``int8``, ``int16``, ``int32``), integers then smaller floats for float fields (``float32``
    rewards of -1/0/1 fit ``int8``). Bool, 8-bit and other dtypes have none.

    Example:
        >>> narrow_candidates(torch.int64)
        (torch.uint8, torch.int8, torch.int16, torch.int32)
        >>> narrow_candidates(torch.float32), narrow_candidates(torch.bool)
        ((torch.uint8, torch.int8, torch.int16, torch.float16), ())
    """
    if dtype in (torch.int16, torch.int32, torch.int64):
        return tuple(d for d in _LADDER if not d.is_floating_point and d.itemsize < dtype.itemsize)
    if dtype in (torch.float32, torch.float64):
        return tuple(d for d in _LADDER if d.itemsize < dtype.itemsize)
    return ()


def holds_dtype(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of ``narrow`` is exactly a value of ``wide`` (a widening keeps them all).

    Example:
        >>> holds_dtype(torch.int16, torch.uint8), holds_dtype(torch.int8, torch.uint8), holds_dtype(torch.float16, torch.int16)
        (True, False, False)
    """
    if wide == narrow:
        return True
    if narrow.is_floating_point:
        return wide.is_floating_point and wide.itemsize > narrow.itemsize
    lo, hi = torch.iinfo(narrow).min, torch.iinfo(narrow).max
    if wide.is_floating_point:
        bound = 1 << _EXACT_INT_BITS.get(wide, 0)
        return -bound <= lo and hi <= bound
    return torch.iinfo(wide).min <= lo and hi <= torch.iinfo(wide).max


def fits_exactly(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of ``values`` is kept exactly by ``dtype``: the same value with the same
    sign (``-0.0`` is not ``0.0``); a NaN never fits a narrower dtype (its payload bits could
    change). One vectorized check; a few values are compared in Python (cheaper than the torch ops
    for one row's cells).

    Example:
        >>> fits_exactly(torch.tensor([-1.0, 0.0, 1.0]), torch.int8), fits_exactly(torch.tensor([-0.0]), torch.int8)
        (True, False)
        >>> fits_exactly(torch.tensor([300]), torch.uint8), fits_exactly(torch.tensor([0.5, 1e4]), torch.float16)
        (False, True)
    """
    if values.dtype == dtype:
        return True
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if values.numel() <= 16:  # one row: a Python comparison beats a handful of torch calls
            cells = values.reshape(-1).tolist()
            if values.is_floating_point():
                return all(x == x and x.is_integer() and info.min <= x <= info.max and (x != 0 or math.copysign(1.0, x) > 0)
                           for x in cells)
            return all(info.min <= x <= info.max for x in cells)
        if not values.is_floating_point():
            lo, hi = torch.aminmax(values)
            return info.min <= int(lo) and int(hi) <= info.max
        inside = (values >= info.min) & (values <= info.max)  # before the cast, which wraps outside
        if not bool(inside.all()):
            return False
    if values.is_floating_point() and bool(torch.isnan(values).any()):
        return False
    return bool(round_trip(values, dtype)[2].all())


def narrowest_dtype(values: torch.Tensor, dtype: torch.dtype, at_least: torch.dtype | None = None) -> torch.dtype | None:
    """The narrowest of :func:`narrow_candidates` that holds ``values`` exactly and every value of
    ``at_least`` (the dtype a column is stored in now), else None (keep ``dtype``).

    Example:
        >>> narrowest_dtype(torch.tensor([0, 200]), torch.int64), narrowest_dtype(torch.tensor([-5]), torch.int64, torch.uint8)
        (torch.uint8, torch.int16)
        >>> narrowest_dtype(torch.tensor([0.25]), torch.float32) is None
        False
        >>> narrowest_dtype(torch.tensor([0.1]), torch.float32) is None
        True
    """
    for cand in narrow_candidates(dtype):  # narrowest first: the first that holds the values is the answer
        if (at_least is None or holds_dtype(cand, at_least)) and fits_exactly(values, cand):
            return cand
    return None


class Narrowing:
    """Which dense columns narrow themselves (every column field not forced by ``dense_dtypes``
    that has :func:`narrow_candidates`) and the checks of each write against them.

    Args:
        forced: the keys ``dense_dtypes`` names: their columns keep the dtype given (a value that
            does not fit is refused), never narrowed or widened by the data.
        capacity: rows of the store; an integer column whose dtype holds every row number starts
            as a row-number column (:attr:`Field.row_number`: nothing stored while every value
            equals its row), else in the narrowest dtype of the first write's values. None: no
            row-number columns.

    Example:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"step": torch.arange(3), "r": torch.tensor([1.0, -1.0, 0.0])}, [3])
        >>> schema = Narrowing().first(Schema.infer(td), td)
        >>> schema["step"].stored_dtype, schema["r"].stored_dtype
        (torch.uint8, torch.int8)
        >>> Narrowing().widenings(schema, {("step",): torch.tensor([300]), ("r",): torch.tensor([0.1])})
        {('step',): torch.int16, ('r',): None}
        >>> Narrowing(capacity=1000).first(Schema.infer(td), td)["step"].row_number   # decided with the rows
        True
    """

    def __init__(self, forced: Iterable[Key] = (), capacity: int | None = None) -> None:
        self.forced = frozenset(forced)
        self.capacity = capacity

    def auto(self, f: Field) -> bool:
        """Whether ``f``'s column narrows and widens itself."""
        return (f.kind == "dense" and f.flag_bit is None and f.key not in self.forced
                and bool(narrow_candidates(f.dtype)))

    def first(self, schema: Schema, data: Any) -> Schema:
        """``schema`` with each self-narrowing column in the narrowest dtype the first write's values
        fit, or a row-number column (whether the values are their rows is known with the rows: the
        write path widens such a column before anything is written, :func:`row_number_mismatch`)."""
        fields = []
        for f in schema.values():
            if self.capacity is not None and f.key not in self.forced and row_number_eligible(f, self.capacity):
                f = dataclasses.replace(f, row_number=True)
            elif self.auto(f):
                f = dataclasses.replace(f, stored_dtype=narrowest_dtype(_cells(data, f.key), f.dtype))
            fields.append(f)
        return Schema(fields)

    def widenings(self, schema: Schema, data: Any) -> dict[Key, torch.dtype | None]:
        """The self-narrowing columns whose current dtype cannot hold this write's values, with the
        dtype each widens to (None: the field's own dtype). Empty for almost every write.

        One vectorized check per column; a one-value cell (``ReplayBuffer.add``'s) is compared with
        the column's cached bounds in Python, a few hundred nanoseconds a column."""
        if schema is not self._schema:  # the checks of a schema, made once (a widening makes a new one)
            self._schema = schema
            self._checks = [(f.key, f, *_bounds(f.stored_dtype)) for f in schema.column_fields
                            if f.stored_dtype is not None and f.key not in self.forced]
        out: dict[Key, torch.dtype | None] = {}
        is_dict = isinstance(data, dict)
        for key, f, lo, hi in self._checks:
            values = data[key] if is_dict else data.get(key)
            if lo is not None and values.numel() == 1:
                x = values.item()
                if lo <= x <= hi and (type(x) is int or (x.is_integer() and (x != 0 or math.copysign(1.0, x) > 0))):
                    continue
            elif fits_exactly(values.detach(), f.stored_dtype):
                continue
            out[key] = narrowest_dtype(values.detach(), f.dtype, f.stored_dtype)
        return out

    _schema: Schema | None = None
    _checks: list = []


def _bounds(dtype: torch.dtype) -> tuple[int | None, int | None]:
    """The smallest and largest value of an integer dtype (None, None for a float dtype)."""
    if dtype.is_floating_point:
        return None, None
    info = torch.iinfo(dtype)
    return info.min, info.max


def _cells(data: Any, key: Key) -> torch.Tensor:
    """A field's cells from a TensorDict or the dict :meth:`Schema.match` gives."""
    return (data[key] if isinstance(data, dict) else data.get(key)).detach()


def row_number_eligible(field: Field, capacity: int) -> bool:
    """Whether ``field`` may be a row-number column in a store of ``capacity`` rows: a dense
    integer column (not a flag bit) whose dtype holds every row number.

    Example:
        >>> row_number_eligible(Field(("index",), torch.int64, (), "dense"), 1_000_000)
        True
        >>> row_number_eligible(Field(("index",), torch.uint8, (), "dense"), 1_000)
        False
    """
    dtype = field.dtype
    return (field.kind == "dense" and field.flag_bit is None and field.stored_dtype is None
            and dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
            and torch.iinfo(dtype).max >= capacity - 1)


def row_number_mismatch(values: torch.Tensor, rows: Any) -> bool:
    """Whether a write of ``values`` (cells of ``len(rows)`` rows) to ``rows`` (numpy int64
    positions) stores a value that is not its row: one vectorized compare (a Python one for a
    single value).

    Example:
        >>> import numpy as np
        >>> row_number_mismatch(torch.tensor([4, 5, 0]), np.array([4, 5, 0]))
        False
        >>> row_number_mismatch(torch.tensor([[7], [9]]), np.array([7, 8]))
        True
    """
    n = len(rows)
    if n == 0 or values.numel() == 0:
        return False
    if values.numel() == 1:  # one row (rb.add): a Python compare (item() of any shape: no reshape)
        return values.item() != int(rows[0])
    if values.device.type == "cpu" and values.dtype in _NUMPY_COMPARABLE:  # numpy: no torch dispatch
        return not np.logical_and.reduce((values.numpy().reshape(n, -1) == np.asarray(rows).reshape(n, 1)), axis=None)
    at = torch.from_numpy(rows).to(values.device).view(n, 1)
    return not bool((values.reshape(n, -1) == at).all())


#: integer dtypes a row-number check compares in numpy (CPU values; torch's compare of a few
#: values costs ~5 us an op)
_NUMPY_COMPARABLE = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


def check_narrowing(key: Key, dtype: torch.dtype, stored: torch.dtype, kind: str) -> None:
    """Refuse a ``dense_dtypes`` entry the store cannot honour: a blob field, or a dtype outside
    :data:`NARROWABLE_DTYPES` on either side.

    Raises:
        SchemaMismatchError: naming the field and what is possible.

    Example:
        >>> check_narrowing(("action",), torch.int64, torch.uint8, "dense")
    """
    if kind != "dense":
        raise SchemaMismatchError(
            f"dense_dtypes names {key_to_str(key)!r}, a blob field: only dense columns can be stored in another "
            "dtype (list the key in dense_keys to make it dense, or leave it out of dense_dtypes)")
    bad = [dtype_to_str(d) for d in (dtype, stored) if d not in NARROWABLE_DTYPES]
    if bad:
        raise SchemaMismatchError(
            f"dense_dtypes cannot store field {key_to_str(key)!r} ({dtype_to_str(dtype)}) as "
            f"{dtype_to_str(stored)}: {', '.join(bad)} is not one of "
            f"{', '.join(dtype_to_str(d) for d in NARROWABLE_DTYPES)}")


def dtype_from_str(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise SchemaMismatchError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Field:
    """One leaf of the row TensorDict.

    Attributes:
        key: the nested key as a tuple of strings.
        dtype: torch dtype of the values.
        shape: per-row shape (without the batch dimension).
        kind: ``"dense"`` or ``"blob"``.
        frame_dim: for blob fields, the dimension of ``shape`` holding a stack of frames,
            or ``None`` when the whole cell is one frame.
        stored_dtype: for dense fields, a narrower dtype the column is kept in (``dense_dtypes``);
            reads give ``dtype`` back. ``None``: the column is kept in ``dtype``.
        flag_bit: for a dense bool field of one value per row (done, terminated, truncated), the
            bit of the store's shared flags byte that holds it (:data:`MAX_FLAGS` such fields
            share one byte per row); ``None``: the field has a column of its own.
        row_number: a dense integer field whose every value written so far equals the row it is
            stored at (TorchRL's ``index``): nothing is stored, reads give the row numbers in
            ``dtype``. The first value that is not its row makes it a column (a widening).
    """

    key: Key
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: Literal["dense", "blob"]
    frame_dim: int | None = None
    stored_dtype: torch.dtype | None = None
    flag_bit: int | None = None
    row_number: bool = False

    @property
    def flaggable(self) -> bool:
        """Whether the field can be a bit of the flags byte: dense, bool, one value per row, not narrowed."""
        return (self.kind == "dense" and self.dtype == torch.bool and math.prod(self.shape) == 1
                and self.stored_dtype is None)

    @property
    def column_dtype(self) -> torch.dtype:
        """The dtype of the field's dense column: ``stored_dtype`` when narrowed, else ``dtype``."""
        return self.stored_dtype if self.stored_dtype is not None else self.dtype

    @property
    def frames_per_row(self) -> int:
        return 1 if self.frame_dim is None else self.shape[self.frame_dim]

    @property
    def frame_shape(self) -> tuple[int, ...]:
        if self.frame_dim is None:
            return self.shape
        return self.shape[: self.frame_dim] + self.shape[self.frame_dim + 1:]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def cell_nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def column_nbytes(self) -> int:
        """Bytes a row of the field's dense column takes (``cell_nbytes`` unless narrowed; 0 for a
        row-number field)."""
        if self.row_number:
            return 0
        return math.prod(self.shape) * self.column_dtype.itemsize

    @property
    def column_file_dtype(self) -> Any:
        """The numpy dtype the dense column is saved as (:func:`bits_dtype` of ``column_dtype``)."""
        return torch.empty(0, dtype=bits_dtype(self.column_dtype)).numpy().dtype

    @property
    def frame_nbytes(self) -> int:
        return math.prod(self.frame_shape) * self.itemsize

    @property
    def family(self) -> str:
        """Blob fields with equal family share frames (and dedup against each other)."""
        return f"{dtype_to_str(self.dtype)}[{','.join(map(str, self.frame_shape))}]"

    def to_json(self) -> dict[str, Any]:
        out = {
            "key": list(self.key),
            "dtype": dtype_to_str(self.dtype),
            "shape": list(self.shape),
            "kind": self.kind,
            "frame_dim": self.frame_dim,
        }
        if self.stored_dtype is not None:  # only when used: other fields' entries stay as they were
            out["stored_dtype"] = dtype_to_str(self.stored_dtype)
        if self.flag_bit is not None:
            out["flag_bit"] = self.flag_bit
        if self.row_number:
            out["row_number"] = True
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Field:
        field = cls(
            key=tuple(d["key"]),
            dtype=dtype_from_str(d["dtype"]),
            shape=tuple(int(s) for s in d["shape"]),
            kind=d["kind"],
            frame_dim=d.get("frame_dim"),
            stored_dtype=dtype_from_str(d["stored_dtype"]) if d.get("stored_dtype") is not None else None,
            flag_bit=d.get("flag_bit"),
            row_number=d.get("row_number", False),
        )
        if field.stored_dtype is not None:
            check_narrowing(field.key, field.dtype, field.stored_dtype, field.kind)
        if field.flag_bit is not None and not (
                type(field.flag_bit) is int and 0 <= field.flag_bit < MAX_FLAGS and field.flaggable):
            raise ValueError(f"field {key_to_str(field.key)!r}: flag_bit {field.flag_bit!r} is not a bit of the "
                             f"flags byte (0..{MAX_FLAGS - 1}) of a dense bool field of one value per row")
        if field.row_number is not False and not (field.row_number is True and row_number_eligible(field, 1)):
            raise ValueError(f"field {key_to_str(field.key)!r}: row_number {field.row_number!r} is not true on a "
                             "dense integer field without a stored dtype or flag bit")
        return field

    def describe(self) -> str:
        return f"{dtype_to_str(self.dtype)}{list(self.shape)}"

    def to_column(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (of ``dtype``) in the column's dtype, refused if that would change one of them.

        Raises:
            LossyValueError: naming the field, the first value that does not fit and what to do.

        Example:
            >>> f = Field(("action",), torch.int64, (), "dense", stored_dtype=torch.uint8)
            >>> f.to_column(torch.tensor([0, 17])).dtype
            torch.uint8
        """
        if self.stored_dtype is None or self.stored_dtype == values.dtype:
            return values
        narrow, back, same = round_trip(values, self.stored_dtype)
        if not bool(same.all()):
            bad = values[~same][0].item()
            nan = " (a NaN must read back with its sign and payload bits)" if bad != bad else ""
            raise LossyValueError(
                f"field {key_to_str(self.key)!r} is stored as {dtype_to_str(self.stored_dtype)} (dense_dtypes), "
                f"but the value {bad!r}{nan} does not fit it: it would read back as "
                f"{back[~same][0].item()!r}; nothing was written. Store this field in a wider dtype "
                "(dense_dtypes) in a new store, or write values the dtype holds exactly")
        return narrow

    def frames_of_cells(self, cells: torch.Tensor, n: int) -> np.ndarray:
        """``[n, frames_per_row, frame_nbytes]`` uint8 view/copy of ``n`` cells of this blob field
        (as the store splits them): the inverse of :meth:`cells_from_frames`. numpy, because its row
        gathers and concatenations run at memcpy speed, several times torch's uint8 kernels.

        Example:
            >>> f = Field(("x",), torch.int16, (2, 3), "blob", frame_dim=0)
            >>> frames = f.frames_of_cells(torch.arange(12, dtype=torch.int16).reshape(2, 2, 3), 2)
            >>> frames.shape
            (2, 2, 6)
            >>> bool((f.cells_from_frames(torch.from_numpy(frames).reshape(4, 6), 2)
            ...       == torch.arange(12, dtype=torch.int16).reshape(2, 2, 3)).all())
            True
        """
        v = cells.detach()  # stored values never carry autograd history
        if self.frame_dim is not None and self.frame_dim != 0:
            v = v.movedim(self.frame_dim + 1, 1)
        v = v.contiguous()
        if v.dtype != torch.uint8:
            v = v.view(torch.uint8) if v.dim() else v.reshape(1).view(torch.uint8)
        return v.numpy().reshape(n, self.frames_per_row, self.frame_nbytes)

    def cells_from_frames(self, frames: torch.Tensor, n: int) -> torch.Tensor:
        """Rebuild ``n`` cells from their frames' bytes (``[n * frames_per_row, frame_nbytes]``
        uint8, rows in order, frames in order): the inverse of splitting a cell into frames."""
        part = frames if self.dtype == torch.uint8 else frames.view(self.dtype)
        if self.frame_dim is None:
            return part.reshape(n, *self.shape)
        val = part.reshape(n, self.shape[self.frame_dim], *self.frame_shape)
        return val.movedim(1, self.frame_dim + 1) if self.frame_dim != 0 else val


#: TensorDict classes seen by :meth:`Schema.match` (an exact type test is cheaper than isinstance)
_TD_CLASSES: set[type] = set()


def _leafless(value: Any) -> bool:
    """Whether ``value`` is a TensorDict holding no tensor at any depth (it stores nothing)."""
    return isinstance(value, TensorDictBase) and next(iter(value.keys(include_nested=True, leaves_only=True)), None) is None


class Schema(Mapping[Key, Field]):
    """The ordered set of fields of a store. Immutable once created."""

    def __init__(self, fields: Iterable[Field]):
        self._fields: dict[Key, Field] = {f.key: f for f in fields}
        bits = [f.flag_bit for f in self._fields.values() if f.flag_bit is not None]
        if len(set(bits)) != len(bits):
            raise ValueError(f"two fields name the same bit of the flags byte: {sorted(bits)}")
        # names expected at each nesting level, for match(): comparing one small set per level
        # is far cheaper than listing a TensorDict's nested leaves
        levels: dict[Key, set[str]] = {}
        for key in self._fields:
            for depth in range(len(key)):
                levels.setdefault(key[:depth], set()).add(key[depth])
        self._levels = levels
        # what match() compares each leaf with, unpacked once: (level, name, key, dtype, cell shape)
        self._leaves = [(f.key[:-1], f.key[-1], f.key, f.dtype, f.shape) for f in self._fields.values()]
        # every write looks at them (a small write too): listed once
        self._row_numbers = [f for f in self._fields.values() if f.row_number]

    # Mapping interface -------------------------------------------------------------------
    def __getitem__(self, key: str | Key) -> Field:
        return self._fields[normalize_key(key)]

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def values(self):
        # the field dict's own view: Mapping's would look every key up again through __getitem__
        # (a normalize_key call each), and every write goes over the fields. (keys() and items()
        # stay Mapping's: theirs find "obs" as ("obs",), a dict view would not.)
        return self._fields.values()

    def __repr__(self) -> str:
        inner = ", ".join(f"{key_to_str(k)}: {f.kind} {f.describe()}" for k, f in self._fields.items())
        return f"Schema({inner})"

    @property
    def dense_fields(self) -> list[Field]:
        return [f for f in self._fields.values() if f.kind == "dense"]

    @property
    def blob_fields(self) -> list[Field]:
        return [f for f in self._fields.values() if f.kind == "blob"]

    @property
    def column_fields(self) -> list[Field]:
        """The dense fields with a column of their own (every dense field but the flag bits and
        the row-number fields)."""
        return [f for f in self._fields.values() if f.kind == "dense" and f.flag_bit is None and not f.row_number]

    @property
    def row_number_fields(self) -> list[Field]:
        """The dense fields whose values are their rows, stored as nothing (``row_number``)."""
        return list(self._row_numbers)

    @property
    def flag_fields(self) -> list[Field]:
        """The dense fields kept as bits of the shared flags byte (``flag_bit`` set)."""
        return [f for f in self._fields.values() if f.flag_bit is not None]

    def with_flags(self) -> Schema:
        """This schema with its first :data:`MAX_FLAGS` flaggable fields (dense bool, one value per
        row: done, terminated, truncated) given bits of one shared flags byte, in schema order: one
        byte per row holds them all (a column each takes a byte per row per field).

        Example:
            >>> from tensordict import TensorDict
            >>> td = TensorDict({"done": torch.zeros(4, 1, dtype=torch.bool), "r": torch.zeros(4)}, [4])
            >>> [(key_to_str(f.key), f.flag_bit) for f in Schema.infer(td).with_flags().values()]
            [('done', 0), ('r', None)]
        """
        fields, bit = [], 0
        for f in self._fields.values():
            if f.flag_bit is None and f.flaggable and bit < MAX_FLAGS:
                f = dataclasses.replace(f, flag_bit=bit)
                bit += 1
            fields.append(f)
        return Schema(fields)

    def families(self) -> dict[str, list[Field]]:
        out: dict[str, list[Field]] = {}
        for f in self.blob_fields:
            out.setdefault(f.family, []).append(f)
        return out

    # Construction ------------------------------------------------------------------------
    @classmethod
    def infer(
        cls,
        td: TensorDictBase,
        *,
        blob_min_bytes: int = 1024,
        blob_keys: Iterable[str | Key] | None = None,
        dense_keys: Iterable[str | Key] | None = None,
        frames: Mapping[str | Key, int] | None = None,
        batched: bool = True,
        dense_dtypes: Mapping[str | Key, torch.dtype] | None = None,
    ) -> Schema:
        """Build a schema from the first batch written.

        Args:
            td: the data; ``batch_size`` is ``[n]`` when ``batched`` else ``[]``.
            blob_min_bytes: cells of at least this many bytes become blob fields.
            blob_keys: keys forced to be blob fields.
            dense_keys: keys forced to be dense fields.
            frames: per key, the cell dimension that is a stack of frames.
            batched: whether ``td`` has a leading batch dimension.
            dense_dtypes: per dense key, a dtype its column is stored in (narrower than the
                data's, e.g. ``torch.uint8`` for int64 actions); reads give the data's dtype back.
        """
        blob_set = {normalize_key(k) for k in (blob_keys or ())}
        dense_set = {normalize_key(k) for k in (dense_keys or ())}
        both = blob_set & dense_set
        if both:
            raise ValueError(f"keys listed both as blob and dense: {sorted(map(key_to_str, both))}")
        frame_map = {normalize_key(k): int(d) for k, d in (frames or {}).items()}
        narrow = {normalize_key(k): d for k, d in (dense_dtypes or {}).items()}
        nb = 1 if batched else 0
        if batched and len(td.batch_size) < 1:
            raise SchemaMismatchError(
                f"expected a TensorDict with a batch dimension [n], got batch_size={list(td.batch_size)}"
            )
        fields = []
        for key in _leaves(td):
            k = check_key(normalize_key(key))
            value = td.get(key)
            if not isinstance(value, torch.Tensor):
                raise SchemaMismatchError(
                    f"field {key_to_str(k)!r} is a {type(value).__name__}; only tensor leaves can be "
                    "stored (convert non-tensor data to tensors first, or exclude the key: "
                    f"td.exclude({key!r})); nothing was written"
                )
            check_dtype(k, value.dtype)
            shape = tuple(value.shape[nb:])
            nbytes = math.prod(shape) * value.element_size()
            if k in dense_set:
                kind = "dense"
            elif k in blob_set:
                kind = "blob"
            else:
                kind = "blob" if nbytes >= blob_min_bytes else "dense"
            frame_dim = None
            if kind == "blob":
                fd = frame_map.get(k)
                if fd is None and len(k) > 1 and k[0] == "next":
                    fd = frame_map.get(k[1:])
                if fd is not None:
                    if not -len(shape) <= fd < len(shape):
                        raise ValueError(
                            f"frames[{key_to_str(k)!r}] = {fd} is not a dimension of the per-row shape {list(shape)}"
                        )
                    frame_dim = fd % len(shape)
            stored = narrow.get(k)
            if stored is not None:
                check_narrowing(k, value.dtype, stored, kind)
            fields.append(Field(k, value.dtype, shape, kind, frame_dim,
                                stored_dtype=stored if stored != value.dtype else None))
        unknown = (set(frame_map) | blob_set | dense_set | set(narrow)) - {f.key for f in fields}
        if unknown:
            raise SchemaMismatchError(
                f"options name keys that are not in the data: {sorted(map(key_to_str, unknown))}; "
                f"data keys: {sorted(key_to_str(f.key) for f in fields)}"
            )
        return cls(fields)

    def select(self, keys: str | Iterable[str | Key] | None) -> list[Field]:
        """The fields ``keys`` name (a key names every field below it), in schema order of first
        mention; ``None``: every field; a plain string is one key.

        Raises:
            SchemaMismatchError: a key that names no field.

        Example:
            >>> s = Schema([Field(("next", "x"), torch.float32, (), "dense"), Field(("y",), torch.float32, (), "dense")])
            >>> [f.key for f in s.select(["next"])]
            [('next', 'x')]
        """
        if keys is None:
            return list(self.values())
        if isinstance(keys, str):  # one key, not its characters
            keys = [keys]
        want: list[Field] = []
        for k in keys:
            k = normalize_key(k)
            sub = [f for f in self.values() if f.key[: len(k)] == k]
            if not sub:
                raise SchemaMismatchError(
                    f"key {key_to_str(k)!r} is not in the store; keys: {sorted(key_to_str(f.key) for f in self.values())}")
            want.extend(x for x in sub if x not in want)
        return want

    def match(self, td: TensorDictBase, batch_dims: int) -> dict[Key, torch.Tensor] | None:
        """The cells of ``td`` per key when it matches the schema exactly, else ``None``.

        The fast check of small writes; on ``None`` call :meth:`validate`, which explains the
        mismatch. Example:

            >>> from tensordict import TensorDict
            >>> s = Schema([Field(("x",), torch.float32, (2,), "dense")])
            >>> sorted(s.match(TensorDict({"x": torch.zeros(3, 2)}, [3]), 1))
            [('x',)]
            >>> s.match(TensorDict({"x": torch.zeros(3, 2, dtype=torch.int64)}, [3]), 1) is None
            True
        """
        # one dict of each nesting level's entries (a C-level walk of its items), then plain
        # dict lookups: a nested td.get costs ~15 Python calls a key, this ~1 a level
        entries = self._entries(td)
        if entries is None:
            return None
        cells = {}
        for prefix, name, key, dtype, shape in self._leaves:
            v = entries[prefix][name]
            # (a torch.Size equals the tuple of its sizes: no tuple() per leaf)
            if not isinstance(v, torch.Tensor) or v.dtype != dtype or v.shape[batch_dims:] != shape:
                return None
            cells[key] = v
        return cells

    def _entries(self, td: TensorDictBase) -> dict[Key, dict[str, Any]] | None:
        """``{prefix: {name: value}}`` of every nesting level of the schema in ``td``, or None when
        a level is not a TensorDict holding exactly the schema's names."""
        entries: dict[Key, dict[str, Any]] = {}
        for prefix, names in self._levels.items():  # parents before children: keys grow in length
            sub = entries[prefix[:-1]].get(prefix[-1]) if prefix else td
            # TensorDictBase is an ABC: isinstance costs 3 Python-level calls; known classes none
            if type(sub) not in _TD_CLASSES:
                if not isinstance(sub, TensorDictBase):
                    return None
                _TD_CLASSES.add(type(sub))
            level = dict(sub.items())
            if level.keys() != names and not (names <= level.keys() and all(
                    _leafless(level[k]) for k in level.keys() - names)):
                # a TensorDict without leaves (("collector",) once its only key was excluded) is
                # no field, as for the batched path's check: it must not cost a small write its stage
                return None
            entries[prefix] = level
        return entries

    def validate(self, td: TensorDictBase, *, batched: bool = True) -> int:
        """Check ``td`` against the schema; return its number of rows.

        Raises:
            SchemaMismatchError: listing, per key, what was expected and what was given.
        """
        nb = 1 if batched else 0
        if batched and len(td.batch_size) != 1:
            raise SchemaMismatchError(
                f"expected a TensorDict with batch_size [n], got batch_size={list(td.batch_size)}"
            )
        if not batched and len(td.batch_size) != 0:
            raise SchemaMismatchError(
                f"expected a single row (batch_size []), got batch_size={list(td.batch_size)}"
            )
        if self.match(td, nb) is not None:  # the common case, in a few calls; else say what differs
            return int(td.batch_size[0]) if batched else 1
        given = {normalize_key(k): td.get(k) for k in _leaves(td)}
        problems = []
        for key, f in self._fields.items():
            v = given.get(key)
            if v is None:
                problems.append(f"  {key_to_str(key)!r}: expected {f.describe()}, missing")
                continue
            if not isinstance(v, torch.Tensor):
                problems.append(f"  {key_to_str(key)!r}: expected {f.describe()}, got {type(v).__name__}")
                continue
            if v.dtype != f.dtype or tuple(v.shape[nb:]) != f.shape:
                problems.append(
                    f"  {key_to_str(key)!r}: expected {f.describe()}, "
                    f"got {dtype_to_str(v.dtype)}{list(v.shape[nb:])}"
                )
        for key in given.keys() - self._fields.keys():
            v = given[key]
            desc = f"{dtype_to_str(v.dtype)}{list(v.shape[nb:])}" if isinstance(v, torch.Tensor) else type(v).__name__
            problems.append(f"  {key_to_str(key)!r}: not in the schema, got {desc}")
        if problems:
            raise SchemaMismatchError(
                "data does not match the store's schema (fixed by the first write); nothing was written:\n"
                + "\n".join(sorted(problems))
                + "\nWrite the same keys, dtypes and per-row shapes as the first batch, or create a new store."
            )
        return int(td.batch_size[0]) if batched else 1

    # Serialization -----------------------------------------------------------------------
    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self._fields.values()]

    @classmethod
    def from_json(cls, data: Iterable[Mapping[str, Any]]) -> Schema:
        return cls(Field.from_json(d) for d in data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and list(self._fields.values()) == list(other._fields.values())

    __hash__ = None  # type: ignore[assignment]
