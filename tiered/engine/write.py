"""The write path: validate -> plan (frames, dedup, chunks) -> encode -> place -> index.

:class:`WritePath` takes a batch of rows and the positions they go to. Blob fields are split into
frames, deduplicated and grouped into time chunks per frame family
(:class:`~tiered.engine.frames.FrameFamily`); closed chunks are compressed in one batched
``encode`` per family and handed to :class:`~tiered.engine.placement.Placement`; only when every
family's blobs are placed are the row tables, reference counts and dense columns updated, so a
failed write (bad input, a full tier, a full disk) leaves the store as it was.

Small writes (``ReplayBuffer.add``) wait raw in the write stage (:mod:`tiered.engine.stage`) and
go through the batched path together.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> frames = torch.randint(0, 255, (9, 16, 16), dtype=torch.uint8)
    >>> stacks = torch.stack([frames[t:t + 4] for t in range(6)])   # frame stacks of a rollout
    >>> store = TieredStore(16, frames={"obs": 0}, stage_rows=0)
    >>> _ = store.extend(TensorDict({"obs": stacks}, [6]))
    >>> store.stats()["fields"]["obs"]["unique_frames"]   # 6 stacks of 4 frames share 9 frames
    9
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import psutil
import torch
from tensordict import TensorDictBase

from ..codecs import Codec, RawCodec, ZstdCodec
from ..codecs.zstd import DEFAULT_LEVEL
from ..errors import CorruptionError, InvalidArgumentError, SchemaMismatchError
from ..schema import (
    Field,
    Key,
    Narrowing,
    Schema,
    dtype_from_str,
    dtype_to_str,
    key_to_str,
    narrowest_dtype,
    normalize_key,
    row_number_mismatch,
    str_to_key,
)
from ..util.batch import exclusive_cumsum
from .advice import first_write_advice
from .blob_index import OPEN, STORED, BlobIndex
from .detect import detect_frames
from .frames import TAIL_ROWS, FrameColumns, FrameFamily, FramePlan, auto_chunk_frames
from .layout import FieldLayout
from .placement import Placement
from .rows import DONE_KEYS, RowSpace, held_rows, index_shape
from .stage import WriteStage

__all__ = ["WritePath", "WriteOptions", "check_cells_readable", "check_layout_fits", "check_values_fit", "MAX_CHUNK_BYTES",
           "DEFAULT_CHUNK_FRAMES", "RAW_BELOW_RATIO", "saved_families"]

#: The default ``chunk_frames`` (K): frames of one trajectory compressed together per blob.
#: 8, measured with ``python benchmarks/bench_chunk_frames.py --steps 20000 --rounds 60 --threads 1``
#: (20k real Atari transitions of 5 games, 2-core VM, 2026-12-03): bytes held per transition
#: K=2/4/8/16: 464/345/291/278 (blobs 261/163/110/82; LazyTensorStorage 56,474); get B=256
#: 22.5k/23.3k/21.5k/17.7k per s, B=32 14.1k/14.5k/13.8k/11.9k (LazyTensorStorage 16.5k, 14.2k).
#: K=8 holds 16% fewer bytes than K=4 for 5-8% of sample rate; K=16 saves 4% more and loses 15-18%.
DEFAULT_CHUNK_FRAMES = 8

#: A frame family whose first encoded chunks compress less than this (raw bytes / encoded bytes:
#: noise, already-compressed bytes) is stored raw from then on: its reads are a copy, no decode.
RAW_BELOW_RATIO = 1.5

#: The zstd level of a family whose frames are too large to share a chunk (its chunk length, left
#: to the store, is below :data:`DEFAULT_CHUNK_FRAMES`) when the store has the default codec.
#: On VecNorm'd float stacks (``python benchmarks/bench_float_stacks.py --levels``, a loaded 2-core
#: VM, 2026-12-07, noisy): level 3 4.32x, encode 233 ms, decode 57 ms per 400 stacks; level -1 4.10x,
#: 135 ms, 47 ms. The bytes are zstd frames like any other (same format id, any decoder reads them).
LARGE_FRAME_LEVEL = -1

#: An encode of less raw bytes than this runs on the calling thread (a codec twin of one thread):
#: a write-stage flush (128 Atari rows: ~17 chunks, ~1 MB) or a 256-row write (~1.8 MB). Handing
#: half of it to a pool thread saves at most half of a few hundred microseconds of zstd, and the
#: handoff (waking the thread, the GIL back and forth) costs about that or more on a 2-core VM:
#: ``python benchmarks/bench_encode_split.py`` (a loaded 2-core VM, 2026-12-07, noisy), chunks of
#: 8 real Atari frames, median per encode, one thread against two: 9 chunks (0.5 MB) 178 against
#: 233 us, 32 (1.8 MB) 446 against 511, 64 (3.6 MB) 877 against 951. The frames are the same
#: bytes either way (each blob is its own zstd frame).
ENCODE_SPLIT_BYTES = 4 << 20


def _as_dtype(key: Any, dtype: torch.dtype | str) -> torch.dtype:
    """A ``dense_dtypes`` value as a torch dtype (``torch.uint8`` or ``"uint8"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        return dtype_from_str(dtype.replace("torch.", ""))
    raise SchemaMismatchError(f"dense_dtypes[{key!r}] must be a torch dtype or its name, got {dtype!r}")


def check_values_fit(schema: Schema, data: Any, forced: Any = None) -> None:
    """Refuse, before anything is written, values that a narrowed dense column (``dense_dtypes``)
    cannot hold exactly. ``data``: a TensorDict or the cells :meth:`Schema.match` returns;
    ``forced``: the keys ``dense_dtypes`` names (None: every narrowed column is checked; the
    others narrow and widen themselves, :class:`~tiered.schema.Narrowing`).

    Raises:
        LossyValueError: naming the field and the value.

    Example:
        >>> schema = Schema([Field(("action",), torch.int64, (), "dense", stored_dtype=torch.uint8)])
        >>> check_values_fit(schema, {("action",): torch.tensor([3, 17])})   # fits: no error
    """
    for f in schema.dense_fields:
        if f.stored_dtype is not None and (forced is None or f.key in forced):
            f.to_column(data[f.key] if isinstance(data, dict) else data.get(f.key))


def row_number_dtype(field: Field, values: torch.Tensor, held: np.ndarray) -> torch.dtype | None:
    """The dtype a row-number column becomes when ``values`` are written to it: the narrowest that
    holds them and the row numbers of the ``held`` rows (sorted) it keeps (None: the field's own).

    Example:
        >>> f = Field(("index",), torch.int64, (), "dense", row_number=True)
        >>> row_number_dtype(f, torch.tensor([7]), np.arange(300)), row_number_dtype(f, torch.tensor([-1]), np.empty(0, np.int64))
        (torch.int16, torch.int8)
    """
    rows = narrowest_dtype(torch.tensor([int(held[-1])]), field.dtype) if held.size else None
    if held.size and rows is None:
        return None
    return narrowest_dtype(values, field.dtype, rows)


def check_cells_readable(schema: Schema | None, data: Any) -> None:
    """Refuse, before anything is written, cells whose bytes cannot be read: a tensor on the
    ``meta`` device (it has a shape but no data), or one that is not a plain strided tensor
    (sparse, nested). ``data``: a TensorDict or the cells :meth:`Schema.match` returns; with
    ``schema=None`` (a first write, before the schema is inferred from it) every leaf of the
    TensorDict ``data``. One check per field, never per row: a write's fields are copied one after
    another, so a later field failing halfway would leave the earlier ones written.

    Raises:
        SchemaMismatchError: naming the fields, what they are, and what to pass instead.

    Example:
        >>> schema = Schema([Field(("x",), torch.float32, (), "dense")])
        >>> check_cells_readable(schema, {("x",): torch.zeros(3)})   # plain tensors: no error
        >>> check_cells_readable(schema, {("x",): torch.zeros(3, device="meta")})
        Traceback (most recent call last):
        ...
        tiered.errors.SchemaMismatchError: field 'x' is a tensor on the meta device; ...
    """
    bad = []
    if schema is None:
        leaves = [(normalize_key(k), v) for k, v in data.items(include_nested=True, leaves_only=True)]
    else:
        leaves = [(f.key, data[f.key] if isinstance(data, dict) else data.get(f.key, None)) for f in schema.values()]
    for key, v in leaves:
        if not isinstance(v, torch.Tensor):
            continue  # the schema check names it
        if v.is_meta:  # (an attribute: a quarter of v.device's cost, once per field and write)
            bad.append(f"field {key_to_str(key)!r} is a tensor on the meta device")
        elif v.layout != torch.strided or v.is_nested:
            bad.append(f"field {key_to_str(key)!r} is a {'nested' if v.is_nested else v.layout} tensor")
    if bad:
        raise SchemaMismatchError(
            "; ".join(bad) + "; its values cannot be read, so nothing was written. Write dense tensors with "
            "data (x.to_dense(), or materialize meta tensors, e.g. torch.empty_like(x, device='cpu'))")


class WriteOptions:
    """The layout options fixed at creation (they are saved in the manifest).

    ``frames=None`` asks the first write to find the frame stacks (:mod:`tiered.engine.detect`);
    once it has, ``frames`` holds what it found (``{}``: none), as if it had been passed.
    ``chunk_frames=None`` lets each frame family take as many frames per chunk as fit 64 KiB, up to
    :data:`DEFAULT_CHUNK_FRAMES` (:func:`~tiered.engine.frames.auto_chunk_frames`).

    Example:
        >>> WriteOptions(frames={"obs": 0}).frames
        {('obs',): 0}
        >>> WriteOptions().frames is None   # detected on the first write
        True
    """

    def __init__(self, *, blob_min_bytes: int = 1024, blob_keys=(), dense_keys=(), frames=None,
                 chunk_frames: int | None = None, dedup: bool = True, traj_key: Key | None = None,
                 dense_dtypes=None) -> None:
        self.blob_min_bytes = int(blob_min_bytes)
        self.blob_keys = [normalize_key(k) for k in (blob_keys or ())]
        self.dense_keys = [normalize_key(k) for k in (dense_keys or ())]
        self.frames: dict[Key, int] | None = (
            None if frames is None else {normalize_key(k): int(v) for k, v in frames.items()})
        self.chunk_frames: int | None = None if chunk_frames is None else int(chunk_frames)
        self.dedup = bool(dedup)
        self.traj_key = normalize_key(traj_key) if traj_key is not None else None
        self.dense_dtypes: dict[Key, torch.dtype] = {
            normalize_key(k): _as_dtype(k, d) for k, d in (dense_dtypes or {}).items()}

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``options`` entry (keys as lists / "a/b" strings: docs/format.md).

        Detection still to come (no write yet) is ``frames: {}`` plus ``frames_auto: true``; a
        manifest without ``frames_auto`` keeps exactly the frames it names."""
        out = dict(
            blob_min_bytes=self.blob_min_bytes,
            blob_keys=[list(k) for k in self.blob_keys],
            dense_keys=[list(k) for k in self.dense_keys],
            frames={key_to_str(k): v for k, v in (self.frames or {}).items()},
            chunk_frames=DEFAULT_CHUNK_FRAMES if self.chunk_frames is None else self.chunk_frames,
            dedup=self.dedup,
            traj_key=list(self.traj_key) if self.traj_key is not None else None,
        )
        if self.frames is None:
            out["frames_auto"] = True
        if self.chunk_frames is None:  # chosen per family by the first write (saved in "families")
            out["chunk_frames_auto"] = True
        if self.dense_dtypes:  # only when used: a store without it keeps the manifest it always had
            out["dense_dtypes"] = {key_to_str(k): dtype_to_str(d) for k, d in self.dense_dtypes.items()}
        return out

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> WriteOptions:
        return cls(blob_min_bytes=o["blob_min_bytes"], blob_keys=[tuple(k) for k in o["blob_keys"]],
                   dense_keys=[tuple(k) for k in o["dense_keys"]],
                   frames=None if o.get("frames_auto") else {str_to_key(k): v for k, v in o["frames"].items()},
                   chunk_frames=None if o.get("chunk_frames_auto") else o["chunk_frames"], dedup=o["dedup"],
                   traj_key=tuple(o["traj_key"]) if o.get("traj_key") else None,
                   dense_dtypes={str_to_key(k): dtype_from_str(v) for k, v in o.get("dense_dtypes", {}).items()})

    def as_kwargs(self) -> dict[str, Any]:
        """Constructor keyword arguments of :class:`~tiered.store.TieredStore` that copy this layout."""
        return {"blob_min_bytes": self.blob_min_bytes, "blob_keys": list(self.blob_keys),
                "dense_keys": list(self.dense_keys),
                "frames": dict(self.frames) if self.frames is not None else None,
                "chunk_frames": self.chunk_frames, "dedup": self.dedup, "traj_key": self.traj_key,
                "dense_dtypes": dict(self.dense_dtypes) or None}


class WritePath:
    """Validates, plans, encodes, places and indexes written rows (see the module docstring).

    Args:
        options: the layout options.
        rows: the ring and dense columns.
        index: the blob index.
        placement: the tiering manager the encoded blobs go to.
        codec: the codec blob fields are written with.
        stage_rows: rows the write stage holds (0 disables it).
    """

    def __init__(self, options: WriteOptions, rows: RowSpace, index: BlobIndex, placement: Placement,
                 codec: Codec, stage_rows: int) -> None:
        self.options = options
        self.rows = rows
        self.index = index
        self.placement = placement
        self.codec = codec
        self.stage_rows = int(stage_rows)
        self.layout: FieldLayout | None = None
        self.stage: WriteStage | None = None  # created by the first staged write
        self.raw_codec = RawCodec()
        #: which dense columns narrow themselves (all but those dense_dtypes names)
        self.narrowing = Narrowing(options.dense_dtypes, rows.capacity)
        #: the widenings the write being validated needs (:meth:`validate_values`), applied by it
        self.widen: dict[Key, torch.dtype | None] = {}

    @property
    def schema(self) -> Schema | None:
        return self.layout.schema if self.layout is not None else None

    # -- the schema ---------------------------------------------------------------------------
    def prepare(self, data: Any) -> int:
        """Validate ``data`` (inferring the schema on the first write); return its row count."""
        if not isinstance(data, TensorDictBase):
            raise SchemaMismatchError(f"expected a TensorDict with batch_size [n], got {type(data).__name__}")
        if self.layout is None:
            check_cells_readable(None, data)  # before inference reads them
            o = self.options
            frames = o.frames
            if frames is None:  # find the frame stacks in this first batch
                plain = Schema.infer(data, blob_min_bytes=o.blob_min_bytes, blob_keys=o.blob_keys,
                                     dense_keys=o.dense_keys, frames={}, dense_dtypes=o.dense_dtypes)
                frames = detect_frames(data, plain)
            # dense bool fields of one value per row (done, terminated, truncated) share a byte
            schema = Schema.infer(data, blob_min_bytes=o.blob_min_bytes, blob_keys=o.blob_keys,
                                  dense_keys=o.dense_keys, frames=frames, dense_dtypes=o.dense_dtypes).with_flags()
            n = schema.validate(data)
            check_values_fit(schema, data)
            # the other integer, bool and float columns: the narrowest dtype this write's values fit
            schema = self.narrowing.first(schema, data)
            self.widen = {}
            check_layout_fits(schema, self.rows.capacity, o.chunk_frames or 1)
            self.adopt_schema(schema)
            o.frames = frames  # saved in the manifest as if it had been passed
            names = list(schema.families())
            first_write_advice(data, schema, frames, dict(zip(names, self.family_codecs, strict=True)),
                               {name: fam.chunk_frames for name, fam in zip(names, self.layout.families, strict=True)}, o.dedup)
            return n
        schema = self.layout.schema
        n = schema.validate(data)
        check_cells_readable(schema, data)
        self.validate_values(schema, data)
        return n

    def validate_values(self, schema: Schema, data: Any) -> None:
        """Refuse values a ``dense_dtypes`` column cannot hold; note the self-narrowing columns
        this write widens (:attr:`widen`, put in by :meth:`install_widening` when it writes)."""
        check_values_fit(schema, data, self.narrowing.forced)
        self.widen = self.narrowing.widenings(schema, data)

    def prepare_widening(self, at: np.ndarray,
                         data: dict[Key, torch.Tensor]) -> tuple[list[Field], dict[Key, torch.Tensor], Schema] | None:
        """The columns :attr:`widen` names, and the row-number columns a value of ``data`` (the
        cells written at rows ``at``) is not the row of, rewritten in their wider dtype, and the
        schema naming the new dtypes, made before the write changes anything (a damaged page, or
        no memory, refuses the write with the store unchanged); :meth:`install_widening` puts
        them in."""
        schema = self.layout.schema
        widen = self.widen
        # (detach only what carries autograd history: ~0.4 us a field on every small write)
        numbered = [f for f in schema.row_number_fields
                    if f.key in data and row_number_mismatch(_no_grad(data[f.key]), at)]
        held = None
        if numbered:  # a row-number column becomes a column: one compare per column said so
            stage = self.stage
            held = held_rows(self.rows.written, stage.rows[:stage.count] if stage is not None else None)
            widen = {**widen, **{f.key: row_number_dtype(f, data[f.key].detach(), held) for f in numbered}}
        if not widen:
            return None
        fields = [dataclasses.replace(schema[k], stored_dtype=d, row_number=False) for k, d in widen.items()]
        columns = self.rows.widened_columns(fields, held)
        return fields, columns, Schema([next((g for g in fields if g.key == f.key), f) for f in schema.values()])

    def install_widening(self, prepared: tuple[list[Field], dict[Key, torch.Tensor], Schema] | None) -> None:
        """Put in what :meth:`prepare_widening` made (assignments only: cannot fail): the next
        commit saves the new dtypes and the column files whole."""
        self.widen = {}
        if prepared is None:
            return
        fields, columns, schema = prepared
        self.rows.install_columns(fields, columns)
        self.layout.schema = schema

    def adopt_schema(self, schema: Schema, allocate: bool = True,
                     families: list[dict[str, Any]] | None = None) -> FieldLayout:
        """Build the layout and dense columns of ``schema`` (first write, or open: with
        ``allocate=False``, no row table or dense column is made; the caller sets them all).
        ``families``: the manifest's entries, whose chunk lengths and codec choices are kept.

        Raises:
            CorruptionError: ``families`` does not fit the schema, or a row-number field's dtype cannot
                hold every row.
        """
        frame_nbytes = [fields[0].frame_nbytes for fields in schema.families().values()]
        if families is not None:
            chunks, raw = saved_families(families, frame_nbytes)
        else:
            most = self.options.chunk_frames
            chunks = [auto_chunk_frames(nb, DEFAULT_CHUNK_FRAMES) if most is None else most for nb in frame_nbytes]
            # with the raw codec there is nothing to decide
            raw = [False if self.codec.format_id == self.raw_codec.format_id else None] * len(frame_nbytes)
        self.layout = FieldLayout(schema, self.rows.capacity, chunk_frames=chunks,
                                  dedup=self.options.dedup, tables=allocate, stored_raw=raw)
        fast = (self.options.chunk_frames is None and isinstance(self.codec, ZstdCodec)
                and self.codec.level == DEFAULT_LEVEL)
        large = ZstdCodec(LARGE_FRAME_LEVEL, threads=self.codec.threads) if fast else self.codec
        #: per family, the codec its blobs are encoded with (unless it stores them raw)
        self.family_codecs = [large if fast and k < DEFAULT_CHUNK_FRAMES else self.codec for k in chunks]
        #: the same codecs on one thread, for small encodes (:data:`ENCODE_SPLIT_BYTES`)
        self.family_codecs_one = [one_thread(c) for c in self.family_codecs]
        if allocate:
            self.rows.init_dense(schema)
        else:  # an open: the row-number fields have nothing to load (their cells are the rows)
            self.rows.load_row_numbers(schema)
        return self.layout

    # -- appends and overwrites ----------------------------------------------------------------
    def append(self, data: Any) -> np.ndarray:
        """Write ``data`` at the cursor (wrapping around); return the rows written."""
        rows_space = self.rows
        small = self.small_write(data, 1)
        if small is not None:
            n, cells = small
            rows = rows_space.next_rows(n)
            self.stage_write(rows, cells)
        else:
            n = self.prepare(data)
            self.flush_stage()  # after validation: a bad write must not do any work
            rows = rows_space.next_rows(n)
            if n > rows_space.capacity:  # only the last `capacity` rows survive a write this large
                data = data[n - rows_space.capacity:]
                rows = rows[n - rows_space.capacity:]
            self.write_rows(rows, data)
        rows_space.advance(n)
        return rows

    def overwrite(self, index: Any, data: Any, length: int | None,
                  cells: dict[Key, torch.Tensor] | None = None) -> None:
        """Write ``data`` at ``index`` (duplicates: the last wins); the cursor does not move.

        An integer index of several dimensions takes data of that batch shape. ``cells``: what
        ``schema.match(data, batch_dims)`` returned for ``data``, when the caller has it (the
        data is not walked again)."""
        shape = index_shape(index)
        if shape is not None and isinstance(data, TensorDictBase):
            if tuple(data.batch_size[:len(shape)]) != shape:
                raise SchemaMismatchError(
                    f"an index of shape {list(shape)} needs data of batch size {list(shape)}, got "
                    f"{list(data.batch_size)}; nothing was written")
            data, cells = data.reshape(-1), None
        scalar = isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)
        small = self.small_write(data, 0 if scalar else 1, cells)
        if small is not None:
            rows = self.rows.resolve_write(index, small[0])
            if rows.size == 1 or np.unique(rows).size == rows.size:
                self.stage_write(rows, small[1])
                self.rows.length_after(rows, length)
                return
        if scalar and isinstance(data, TensorDictBase) and len(data.batch_size) == 0:
            data = data.unsqueeze(0)
        n = self.prepare(data)
        rows = self.rows.resolve_write(index, n)
        self.flush_stage()  # after validation: a bad write must not do any work
        # duplicates: keep the last occurrence only (as a sequential write would)
        rev_unique, rev_first = np.unique(rows[::-1], return_index=True)
        if rev_unique.size != rows.size:
            keep = np.sort(rows.size - 1 - rev_first)
            rows = rows[keep]
            data = data[torch.from_numpy(keep)]
        self.write_rows(rows, data)
        self.rows.length_after(rows, length)

    def set_columns(self, rows: np.ndarray, data: TensorDictBase) -> bool:
        """Overwrite the dense fields ``data`` holds (batch ``[len(rows)]``, no other field) of
        written ``rows`` in their columns: no blob field is read, decoded or encoded again.

        Returns False, having changed nothing, where a column write cannot stand for the write: a
        field that is not a column of its own (a blob field, a flag bit, a row-number field), one
        that cuts trajectories (done keys, the trajectory key: the frame layout was planned with
        them), an unknown key, cells not of the fields' shapes, repeated rows or a row never
        written. The caller then writes whole rows.

        Raises:
            LossyValueError: a value that a ``dense_dtypes`` column cannot hold (nothing written).
            ChecksumError, CorruptionError: a page of the rows' columns is damaged (nothing written).
        """
        layout = self.layout
        if layout is None or not isinstance(data, TensorDictBase) or rows.size == 0:
            return False
        schema = layout.schema
        cuts = {*DONE_KEYS, self.options.traj_key or ("collector", "traj_ids")}
        columns = {f.key for f in schema.column_fields} - cuts
        keys = [normalize_key(k) for k in data.keys(include_nested=True, leaves_only=True)]
        if not keys or not set(keys) <= columns or len(set(keys)) != len(keys):
            return False
        sub = Schema([schema[k] for k in keys])
        cells = sub.match(data, 1)
        if cells is None or np.unique(rows).size != rows.size:
            return False
        written = self.rows.written[rows]
        if not written.all():  # rows in the write stage have their dense cells in the columns too
            staged = self.staged_slots(rows)
            if staged is None or not (written | (staged >= 0)).all():
                return False
        check_cells_readable(sub, cells)
        self.validate_values(sub, cells)
        self.rows.check_dense(rows)  # the pages these rows overwrite, before anything changes
        self.install_widening(self.prepare_widening(rows, cells))
        # the fields as the store now keeps them (a widening just made a new schema)
        self.rows.write_dense_cells(Schema([self.layout.schema[k] for k in keys]), rows, cells, flags=False)
        return True

    # -- the write stage ----------------------------------------------------------------------
    def small_write(self, data: Any, batch_dims: int,
                    cells: dict[Key, torch.Tensor] | None = None) -> tuple[int, dict[Key, torch.Tensor]] | None:
        """``(n, cells)`` when ``data`` is a write small enough to stage and matches the schema
        exactly; ``None`` sends it down the batched path (which also explains any mismatch).
        ``cells``: ``schema.match(data, batch_dims)`` when the caller already has it."""
        if self.layout is None or not self.stage_rows or not isinstance(data, TensorDictBase):
            return None
        bs = data.batch_size
        if len(bs) != batch_dims:
            return None
        n = int(bs[0]) if batch_dims else 1
        # up to a quarter of the stage: a small collector batch (16 envs) waits raw too
        if not 0 < n <= min(self.stage_rows // 4, self.rows.capacity):
            return None
        schema = self.layout.schema
        if cells is None:
            cells = schema.match(data, batch_dims)
            if cells is None:
                return None
        check_cells_readable(schema, cells)
        self.validate_values(schema, cells)  # a lossy narrowing is refused before it is staged
        return n, cells

    def stage_write(self, rows: np.ndarray, cells: dict[Key, torch.Tensor]) -> None:
        """Stage a small write whose cells match the schema (nothing here can fail on input).

        Raises:
            ChecksumError, CorruptionError: a page of the rows it overwrites is damaged (checked
                before anything changes, as the batched path checks them).
        """
        self.layout.check_rows(rows)
        self.rows.check_dense(rows)
        stage = self.stage
        if stage is None:
            stage = self.stage = WriteStage(self.layout.schema, self.stage_rows, self.rows.capacity)
        if not stage.room_for(rows):
            # a write of the rows staged before (tier space or the disk can fail it): before this
            # write touches anything
            self.flush_stage()
        self.install_widening(self.prepare_widening(rows, cells))
        self.rows.write_dense_cells(self.layout.schema, rows, cells)
        stage.put(rows, cells)
        self.placement.rows_staged(self.layout, rows, stage)

    def flush_stage(self) -> None:
        """Compress the staged rows through the batched path (all or nothing; the stage keeps
        its rows if it fails)."""
        stage = self.stage
        if stage is None or stage.count == 0:
            return
        self.rows.check_dense(stage.rows[:stage.count])
        # the dense cells are in their columns already (write_rows(staged=True) leaves them):
        # only the fields that cut trajectories are read back
        traj_keys = {*DONE_KEYS, self.options.traj_key or ("collector", "traj_ids")}
        dense = [f for f in self.layout.schema.dense_fields if f.key in traj_keys]
        rows, data = stage.batch(lambda r, out: self.rows.read_dense_fields(dense, r, out))
        pending, self.widen = self.widen, {}  # the widenings of the write this flush comes before
        try:
            self.write_rows(rows, data, staged=True)
        finally:
            self.widen = pending
        stage.reset()

    def staged_slots(self, rows: np.ndarray) -> np.ndarray | None:
        """The stage slot of each row (-1: not staged), or None when nothing is staged."""
        stage = self.stage
        return stage.staged(rows) if stage is not None and stage.count else None

    # -- the batched path ---------------------------------------------------------------------
    def write_rows(self, rows: np.ndarray, data: TensorDictBase | dict[Key, torch.Tensor],
                   staged: bool = False) -> None:
        """Write validated rows at ``rows`` (unique positions). All or nothing.

        ``data``: a TensorDict matching the schema, or its cells per key on the CPU (the stage's).
        ``staged``: the rows of the write stage, whose dense cells (flags included) are already in
        their columns (the stage write put them there): only their blob fields are written, and
        ``data`` needs only those and the dense fields that cut trajectories."""
        layout, n = self.layout, rows.size
        if n == 0:
            return
        # the pages these rows overwrite are checked first: a page keeps the other rows' bytes
        layout.check_rows(rows)
        self.rows.check_dense(rows)
        if isinstance(data, TensorDictBase):
            # the cells as a plain dict: each nested TensorDict get costs ~15 Python calls
            cells = layout.schema.match(data, 1)
            data = cells if cells is not None else {k: data.get(k) for k in layout.schema}
        if {v.device.type for v in data.values()} != {"cpu"}:
            # .numpy() below needs every cell on the CPU (a TensorDict of device=None may mix)
            data = {k: v.cpu() for k, v in data.items()}
        traj, ended, next_trajectory = self.rows.trajectory_ids(layout.schema, data, n, self.options.traj_key)
        plans: list[FramePlan] = []
        undecided = [fam for fam in layout.families if fam.stored_raw is None]
        # staged rows: their values are the columns' own (no wider dtype, no row-number mismatch)
        widening = None if staged else self.prepare_widening(rows, data)
        try:
            for fid, fields in enumerate(layout.fields_of):
                fam = layout.families[fid]
                # frames row-major (row, field, frame) so a trajectory's frames come in time order
                frames = FrameColumns([f.frames_of_cells(data.get(f.key), n) for f in fields])
                per_row = frames.per_row
                tail_mask = np.zeros(n * per_row, dtype=bool)
                tail_mask[max(0, n - TAIL_ROWS) * per_row:] = True
                plan = fam.plan(frames, np.repeat(traj, per_row), ended, tail_mask, self.index,
                                rules=layout.rules[fid])
                plans.append(plan)
                self.encode_and_place(fam, plan.closed_ids, plan.closed_raw, plan.closed_nframes)
        except BaseException:
            for plan in plans:
                self._abort(plan)
            for fam in undecided:  # a codec choice is part of the write that made it
                fam.stored_raw = None
            raise
        # --- commit: nothing below can fail on bad input ---------------------------------
        dead, previous = [], []
        written = self.rows.written[rows]
        for fid, plan in enumerate(plans):
            fam = layout.families[fid]
            dead.append(fam.commit(plan, self.index))
            per_row = plan.blob.size // n
            blob, slot = plan.blob.reshape(n, per_row), plan.slot.reshape(n, per_row)
            old_refs = layout.put_family(fid, rows, blob, slot, written)
            # count the new references before dropping the old: frames both share must survive
            self.index.incref(blob)
            dead += [self.index.decref(old) for old in old_refs]
            previous += old_refs
            self.placement.policy.on_insert(plan.closed_ids)
        self.install_widening(widening)  # the wider columns come with the rows
        if not staged:
            self.rows.write_dense(layout.schema, rows, data)
        self.rows.mark_written(rows)
        self.rows.next_trajectory = next_trajectory
        self.release_blobs(np.unique(np.concatenate(dead)) if dead else np.empty(0, np.int64))
        # blob priorities follow the rows (the max over the rows that reference each blob)
        self.placement.rows_written(layout, rows, np.concatenate([np.empty(0, np.int64)] + [
            p.reshape(-1) for p in previous]), self.stage)

    def encode_and_place(self, fam: FrameFamily, ids: np.ndarray, raw: np.ndarray, nframes: np.ndarray) -> None:
        """One batched encode of closed chunks, then placement; fills the index entries."""
        if ids.size == 0:
            return
        raw_sizes = nframes * fam.frame_nbytes
        offsets = exclusive_cumsum(raw_sizes)
        codec = self.raw_codec if fam.stored_raw else self.family_codecs[fam.family_id]
        if raw.nbytes < ENCODE_SPLIT_BYTES and not fam.stored_raw:
            codec = self.family_codecs_one[fam.family_id]
        enc = codec.encode(raw.reshape(-1), offsets, raw_sizes)
        if fam.stored_raw is None:  # the family's first encode measures what the codec gets
            fam.stored_raw = bool(int(raw_sizes.sum()) < RAW_BELOW_RATIO * int(enc.sizes.sum()))
            if fam.stored_raw:
                codec = self.raw_codec
                enc = codec.encode(raw.reshape(-1), offsets, raw_sizes)
        idx = self.index
        idx.dirty.mark(ids)
        idx.nbytes[ids] = enc.sizes
        idx.raw_nbytes[ids] = raw_sizes
        idx.checksum[ids] = enc.checksums
        idx.codec[ids] = codec.format_id
        idx.family[ids] = fam.family_id
        self.placement.place(ids, enc.data, enc.offsets, enc.sizes)
        idx.state[ids] = STORED

    def _abort(self, plan: FramePlan) -> None:
        """Undo a plan whose write failed: new blobs go away, open chunks it closed stay open."""
        idx = self.index
        # never committed: their space is reusable at once
        self.placement.free_in_tiers(np.concatenate([plan.new_ids, plan.reopened_closed]), defer=False)
        idx.dirty.mark(plan.reopened_closed)
        idx.state[plan.reopened_closed] = OPEN
        idx.release(plan.new_ids)

    def close_open_chunks(self) -> None:
        """Compress and place every open time chunk (``flush``)."""
        if self.layout is None:
            return
        e = np.empty(0, dtype=np.int64)
        for fam in self.layout.families:
            if fam.open_blob.size == 0:
                continue
            empty = FrameColumns([np.empty((0, 1, fam.frame_nbytes), dtype=np.uint8)])
            plan = fam.plan(empty, e, e, np.zeros(0, bool), self.index, close_all=True)
            # keep the tail as it is
            plan.tail_frames, plan.tail_blob, plan.tail_slot = fam.tail_frames, fam.tail_blob, fam.tail_slot
            plan.tail_hash = fam.tail_hash
            undecided = fam.stored_raw is None
            try:
                self.encode_and_place(fam, plan.closed_ids, plan.closed_raw, plan.closed_nframes)
            except BaseException:
                if undecided:  # a codec choice is part of the flush that made it
                    fam.stored_raw = None
                raise
            dead = fam.commit(plan, self.index)  # pins the (same) tail and unpins it: net zero
            self.placement.policy.on_insert(plan.closed_ids)
            self.release_blobs(dead)

    # -- deleting -----------------------------------------------------------------------------
    def release_blobs(self, ids: np.ndarray) -> None:
        """Free the blobs among ``ids`` that no row references any more.
        No early exits on empty groups: the call count must not depend on the batch."""
        idx = self.index
        ids = ids[idx.refcount[ids] == 0]
        opened = ids[idx.state[ids] == OPEN]
        for fam in (self.layout.families if self.layout is not None else ()):
            fam.drop_open(opened[idx.family[opened] == fam.family_id], idx)
        # a cold tier reuses their space only after the next commit (a reader may still use it)
        self.placement.free_in_tiers(ids[idx.state[ids] == STORED], defer=True)
        self.placement.policy.on_release(ids)
        idx.release(ids)

    def clear(self) -> None:
        """Forget every row and release every blob."""
        if self.layout is None:
            self.rows.reset()
            return
        if self.stage is not None:
            self.stage.reset()  # staged rows go with the rest
        written = np.flatnonzero(self.rows.written)
        self.layout.check_rows(None)
        dead = [self.index.decref(ids) for ids in self.layout.unset(written)]
        dead += [fam.release_tail(self.index) for fam in self.layout.families]
        self.rows.reset()
        self.placement.rows_cleared()
        self.release_blobs(np.unique(np.concatenate(dead)) if dead else np.empty(0, np.int64))


#: The largest raw chunk (``chunk_frames`` frames of one family) a blob may hold.
MAX_CHUNK_BYTES = 1 << 31


def check_layout_fits(schema: Schema, capacity: int, chunk_frames: int) -> None:
    """Refuse, before anything is allocated, a first write whose row metadata (dense columns and
    row tables, held in memory) cannot fit this machine's memory, or whose chunks are too large.

    Raises:
        InvalidArgumentError: with the sizes and what to lower.

    Example:
        >>> from tiered.schema import Field
        >>> check_layout_fits(Schema([Field(("x",), torch.float32, (4,), "dense")]), 1000, 4)
    """
    for f in schema.blob_fields:
        if chunk_frames * f.frame_nbytes > MAX_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"a chunk of {chunk_frames} frames of {key_to_str(f.key)!r} ({f.frame_nbytes:,} bytes each) "
                f"would hold {chunk_frames * f.frame_nbytes:,} bytes, more than a blob may ({MAX_CHUNK_BYTES:,}); "
                "lower chunk_frames or split the field into frames (frames={key: dim})")
    # row tables: an int32 blob id and a uint16 slot per frame; dense columns: their cells
    per_row = 1 + sum(f.column_nbytes for f in schema.dense_fields) + sum(6 * f.frames_per_row
                                                                      for f in schema.blob_fields)
    memory = psutil.virtual_memory().total
    if capacity * per_row > memory:
        raise InvalidArgumentError(
            f"a store of capacity {capacity:,} with this schema keeps {per_row:,} bytes per row of dense columns "
            f"and row tables in memory ({capacity * per_row:,} bytes), more than this machine's {memory:,}; "
            "lower the capacity, or make large dense fields blob fields (blob_keys=...); nothing was written")


def saved_families(families: Any, frame_nbytes: list[int]) -> tuple[list[int], list[bool | None]]:
    """The chunk lengths and codec choices (stored raw or not; None: still to decide) a manifest's
    ``families`` entry gives, checked against the schema's families (``frame_nbytes`` each). An
    entry without ``stored_raw`` uses the store's codec (docs/format.md).

    Raises:
        CorruptionError: an entry that does not fit.

    Example:
        >>> saved_families([{"frame_nbytes": 7056, "chunk_frames": 8}], [7056])
        ([8], [False])
    """
    if not isinstance(families, list) or len(families) != len(frame_nbytes):
        raise CorruptionError(f"the manifest's families {families!r} do not fit the schema's "
                              f"{len(frame_nbytes)} frame families; the store is damaged")
    chunks: list[int] = []
    raw: list[bool | None] = []
    for entry, nbytes in zip(families, frame_nbytes, strict=True):
        k = entry.get("chunk_frames") if isinstance(entry, dict) else None
        choice = entry.get("stored_raw", False) if isinstance(entry, dict) else 0
        if (type(k) is not int or not 1 <= k or k * nbytes > MAX_CHUNK_BYTES
                or entry.get("frame_nbytes") != nbytes or not (choice is None or isinstance(choice, bool))):
            raise CorruptionError(f"the manifest's family entry {entry!r} does not fit a family of "
                                  f"{nbytes}-byte frames; the store is damaged")
        chunks.append(k)
        raw.append(choice)
    return chunks, raw


def one_thread(codec: Codec) -> Codec:
    """``codec`` with one thread when it is a zstd codec of several (its frames are the same
    bytes: each blob is its own frame), else ``codec`` itself.

    Example:
        >>> one_thread(ZstdCodec(5, threads=4))
        ZstdCodec(level=5, threads=1)
    """
    if type(codec) is ZstdCodec and codec.threads > 1:
        return ZstdCodec(codec.level, threads=1)
    return codec


def _no_grad(v: torch.Tensor) -> torch.Tensor:
    """``v`` without autograd history (detached only when it has some)."""
    return v.detach() if v.requires_grad else v
