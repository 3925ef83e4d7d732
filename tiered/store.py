"""TieredStore: the tiering manager and the only module that drives all the layers below.

A store is a fixed-capacity ring of rows. Dense fields live in one uncompressed column
tensor each; blob fields are split into frames, deduplicated, grouped into time chunks,
compressed in one batched call and placed into the fastest tier with room (DESIGN.md 4-5).

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> store = TieredStore(100, frames={"observation": 0})
    >>> td = TensorDict({
    ...     "observation": torch.randint(0, 4, (8, 4, 84, 84), dtype=torch.uint8),
    ...     "action": torch.arange(8),
    ... }, batch_size=[8])
    >>> store.extend(td).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    >>> batch = store.get([1, 5])
    >>> bool((batch["observation"] == td["observation"][[1, 5]]).all())
    True
    >>> len(store), store.capacity
    (8, 100)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from . import codecs as _codecs
from .engine.frames import FrameColumns, FrameFamily, layout_rules
from .engine.stage import WriteStage
from .errors import (
    ChecksumError,
    IndexOutOfRangeError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    StorageFullError,
    StoreClosedError,
)
from .gpu import maybe_gpu_decoder
from .index import COLD, HOT, OPEN, STORED, WARM, BlobIndex, RowTable
from .policy import PriorityPolicy, get_policy
from .schema import Field, Key, Schema, key_to_str, normalize_key, str_to_key
from .tiers import DeviceTier, HostTier, default_budgets, parse_bytes
from .tiers.base import Tier
from .util.batch import exclusive_cumsum, isin
from .util.units import align

__all__ = ["TieredStore", "IndexLike", "as_row_array"]

IndexLike = int | slice | range | list | tuple | np.ndarray | torch.Tensor

_TIER_NAMES = ("hot", "warm", "cold")
_DONE_KEYS: tuple[Key, ...] = (
    ("next", "done"), ("next", "terminated"), ("next", "truncated"), ("done",),
)


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


class TieredStore:
    """A fixed-capacity ring of rows with compressed, tiered blob fields.

    Args:
        capacity: number of rows; writing past it overwrites the oldest rows.
        path: a directory for the cold tier and the durable format. ``None`` keeps everything
            in memory (hot and warm tiers only).
        codec: codec spec for blob fields (``"zstd"``, ``"zstd:9"``, ``"lz4"``, ``"raw"``).
        blob_min_bytes: cells at least this large become blob fields.
        blob_keys: keys forced to blob fields. dense_keys: keys forced to dense fields.
        frames: per key, the cell dimension that is a stack of frames (e.g.
            ``{"observation": 0}`` for ``[4, 84, 84]`` stacks); ``("next", X)`` follows ``X``.
        chunk_frames: frames of one trajectory compressed together per blob (K). 1 keeps single
            frames (least decode work per sample); larger compresses better.
        dedup: share equal frames between rows (exact, byte-confirmed).
        traj_key: key holding trajectory ids (default ``("collector", "traj_ids")`` when present;
            otherwise trajectories are cut at done/terminated/truncated flags).
        hot_bytes: budget of the hot tier (GPU memory; ``0`` disables it).
        warm_bytes: budget of the warm tier (pinned host memory).
        hot_device: device of the hot arena (CUDA by default when available; ``"cpu"`` stands
            in for it on CPU-only machines).
        device: where :meth:`get` returns data (default CPU).
        policy: ``"lru"``, ``"fifo"`` or ``"priority"``.
        verify: check blob checksums on every read (always on before a GPU decode).
        threads: decode/encode threads (default: all cores).
        backend: cold-tier backend with a path: ``"memmap"`` or ``"hdf5"``.
        stage_rows: writes of at most ``stage_rows // 8`` rows (``ReplayBuffer.add``, a few
            environments at a time) are staged raw and compressed together by the first write that
            finds the stage full (``stage_rows`` rows) or holding one of its rows, or before any
            larger write, :meth:`flush` or pickling. Staged
            rows are readable at once and every error is still raised by the write that causes
            it (see ``tiered/engine/stage.py``). ``0`` writes every call through.
    """

    def __init__(
        self,
        capacity: int,
        path: str | os.PathLike | None = None,
        *,
        codec: str = "zstd",
        blob_min_bytes: int = 1024,
        blob_keys: Iterable[str | Key] | None = None,
        dense_keys: Iterable[str | Key] | None = None,
        frames: Mapping[str | Key, int] | None = None,
        chunk_frames: int = 4,
        dedup: bool = True,
        traj_key: str | Key | None = None,
        hot_bytes: int | str | None = None,
        warm_bytes: int | str | None = None,
        hot_device: str | torch.device | None = None,
        device: str | torch.device | None = None,
        policy: str = "lru",
        verify: bool = True,
        threads: int | None = None,
        backend: str = "memmap",
        promote: bool = True,
        gpu_decode: bool | None = None,
        stage_rows: int = 64,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        if isinstance(stage_rows, bool) or not isinstance(stage_rows, (int, np.integer)) or stage_rows < 0:
            raise ValueError(f"stage_rows must be an int >= 0 (0 disables staging), got {stage_rows!r}")
        self._capacity = int(capacity)
        self._codec = _codecs.get_codec(codec)
        if threads is not None and hasattr(self._codec, "threads"):
            self._codec.threads = int(threads)
        self._options = dict(
            blob_min_bytes=int(blob_min_bytes),
            blob_keys=[list(normalize_key(k)) for k in (blob_keys or ())],
            dense_keys=[list(normalize_key(k)) for k in (dense_keys or ())],
            frames={key_to_str(normalize_key(k)): int(v) for k, v in (frames or {}).items()},
            chunk_frames=int(chunk_frames),
            dedup=bool(dedup),
            traj_key=list(normalize_key(traj_key)) if traj_key is not None else None,
        )
        self._policy = get_policy(policy)
        self._verify = bool(verify)
        self._promote = bool(promote)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._lock = threading.RLock()
        self._local = threading.local()
        self._closed = False
        self._writer_lock = None
        self._readonly = False
        self.path = os.fspath(path) if path is not None else None
        self._backend = backend

        defaults = default_budgets()
        hot_b = parse_bytes(hot_bytes) if hot_bytes is not None else None
        if hot_device is None:
            hot_device = "cuda" if torch.cuda.is_available() else None
        self._hot_device = torch.device(hot_device) if hot_device is not None else None
        if self._hot_device is not None and hot_b is None:
            hot_b = defaults["hot"] if self._hot_device.type == "cuda" else defaults["warm"]
        warm_b = parse_bytes(warm_bytes) if warm_bytes is not None else defaults["warm"]
        self._tiers: list[Tier | None] = [None, None, None]
        if self._hot_device is not None and hot_b:
            self._tiers[HOT] = DeviceTier(hot_b, self._hot_device)
        self._tiers[WARM] = HostTier(warm_b) if warm_b else None
        self._stats = {name: {"hits": 0, "promotions": 0, "demotions": 0} for name in _TIER_NAMES}
        self._counters = {"blobs_decoded": 0, "gets": 0, "extends": 0}

        self._schema: Schema | None = None
        self._rules: list = []
        self._fam_fields: list[list[Field]] = []  # blob fields per family, in family-id order
        self._dense: dict[Key, torch.Tensor] = {}
        self._tables: dict[Key, RowTable] = {}
        self._families: list[FrameFamily] = []
        self._family_of: dict[Key, int] = {}
        self._field_stats: dict[Key, dict[str, int]] = {}
        self._written = np.zeros(self._capacity, dtype=bool)
        self._index = BlobIndex()
        self._len = 0
        self._cursor = 0
        self._traj_base = 0
        self._generation = 0
        self._stage_rows = int(stage_rows)
        self._stage: WriteStage | None = None  # created by the first staged write
        # nvCOMP batch decode when `device` is CUDA (tiered/gpu.py); None keeps the CPU path
        self._gpu_option = gpu_decode
        self._gpu = maybe_gpu_decoder(self, gpu_decode)
        self._cold_init()

    # ------------------------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Number of rows the ring holds."""
        return self._capacity

    @property
    def schema(self) -> Schema | None:
        """The schema, fixed by the first write (``None`` before it)."""
        return self._schema

    @property
    def codec(self) -> _codecs.Codec:
        return self._codec

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def cursor(self) -> int:
        """Row index the next :meth:`extend` writes first."""
        return self._cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        value = int(value)
        if not 0 <= value < self._capacity:
            raise IndexOutOfRangeError(f"cursor {value} is out of range for capacity {self._capacity}")
        with self._lock:
            self._cursor = value

    @property
    def read_only(self) -> bool:
        """True for a store opened with ``mode="r"``."""
        return self._readonly

    @property
    def options(self) -> dict[str, Any]:
        """The constructor options that fix the layout (pass them to a new store to copy it).

        Example:
            >>> s = TieredStore(10, frames={"observation": 0})
            >>> TieredStore(20, **s.options).options["frames"]
            {('observation',): 0}
        """
        return self._layout_kwargs(self._options, self._codec.name, self._backend)

    @staticmethod
    def _layout_kwargs(o: dict[str, Any], codec: str, backend: str) -> dict[str, Any]:
        """Constructor kwargs from the stored option dict (``self._options``, a manifest's "options")."""
        return {
            "codec": codec,
            "blob_min_bytes": o["blob_min_bytes"],
            "blob_keys": [tuple(k) for k in o["blob_keys"]],
            "dense_keys": [tuple(k) for k in o["dense_keys"]],
            "frames": {str_to_key(k): v for k, v in o["frames"].items()},
            "chunk_frames": o["chunk_frames"],
            "dedup": o["dedup"],
            "traj_key": tuple(o["traj_key"]) if o.get("traj_key") else None,
            "backend": backend,
        }

    def clear(self) -> None:
        """Forget every row and release every blob (length and cursor go back to 0)."""
        with self._lock:
            self._check_writable()
            if self._schema is None:
                self._len = self._cursor = 0
                return
            if self._stage is not None:
                self._stage.reset()  # staged rows go with the rest
            written = np.flatnonzero(self._written)
            dead = [self._index.decref(t.blob[written]) for t in self._tables.values()]
            for t in self._tables.values():
                t.blob[written] = -1
            for fam in self._families:
                dead.append(fam.release_tail(self._index))
            self._written[:] = False
            self._len = self._cursor = 0
            self._delete_blobs(np.unique(np.concatenate(dead)) if dead else np.empty(0, np.int64))

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return (f"TieredStore(rows={self._len}, capacity={self._capacity}, codec={self._codec.name!r}, "
                f"path={self.path!r})")

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------
    # Writing
    # ------------------------------------------------------------------------------------
    def extend(self, data: TensorDictBase) -> torch.Tensor:
        """Append rows at the cursor (wrapping around and overwriting the oldest rows).

        Args:
            data: a TensorDict with batch size ``[n]`` matching the schema.

        Returns:
            The row indices written, as an int64 tensor of length ``n``.

        Raises:
            SchemaMismatchError: wrong keys, dtypes or shapes (nothing is written).
            StorageFullError: no tier can take the new blobs (nothing is written).
        """
        with self._lock:
            self._check_writable()
            small = self._small_write(data, 1)
            if small is not None:
                n, cells = small
                rows = (self._cursor + np.arange(n, dtype=np.int64)) % self._capacity
                self._stage_write(rows, cells)
            else:
                n = self._prepare_schema(data)
                self._flush_stage()  # after validation: a bad write must not do any work
                rows = (self._cursor + np.arange(n, dtype=np.int64)) % self._capacity
                if n > self._capacity:  # only the last `capacity` rows survive a write this large
                    data = data[n - self._capacity:]
                    rows = rows[n - self._capacity:]
                self._write_rows(rows, data)
            self._cursor = int((self._cursor + n) % self._capacity)
            self._len = min(self._capacity, self._len + n)
            self._counters["extends"] += 1
            return torch.from_numpy(rows)

    def set(self, index: IndexLike, data: TensorDictBase, *, length: int | None = None) -> None:
        """Overwrite rows at ``index`` (ints, slices, lists, arrays or tensors; duplicates: last wins).

        Args:
            index: the rows to write.
            data: a TensorDict of matching batch size (or a single row for an int index).
            length: the store's length after the write. By default rows beyond the current
                length extend it; pass the current ``len(store)`` to leave it unchanged (TorchRL's
                ``set_cursor=False``). The cursor does not move.
        """
        with self._lock:
            self._check_writable()
            scalar = isinstance(index, (int, np.integer)) or (
                isinstance(index, torch.Tensor) and index.ndim == 0)
            small = self._small_write(data, 0 if scalar else 1)
            if small is not None:
                rows = self._resolve_write_index(index, small[0])
                if rows.size == 1 or np.unique(rows).size == rows.size:
                    self._stage_write(rows, small[1])
                    self._set_length_after(rows, length)
                    return
            if scalar and len(data.batch_size) == 0:
                data = data.unsqueeze(0)
            n = self._prepare_schema(data)
            rows = self._resolve_write_index(index, n)
            self._flush_stage()  # after validation: a bad write must not do any work
            # duplicates: keep the last occurrence only (as a sequential write would)
            rev_unique, rev_first = np.unique(rows[::-1], return_index=True)
            if rev_unique.size != rows.size:
                keep = np.sort(rows.size - 1 - rev_first)
                rows = rows[keep]
                data = data[torch.from_numpy(keep)]
            self._write_rows(rows, data)
            self._set_length_after(rows, length)

    def _set_length_after(self, rows: np.ndarray, length: int | None) -> None:
        if length is not None:
            self._len = max(0, min(int(length), self._capacity))
        elif rows.size:
            self._len = max(self._len, int(rows.max()) + 1)

    # -- the write stage (tiered/engine/stage.py) ----------------------------------------------------
    def _small_write(self, data: Any, batch_dims: int) -> tuple[int, dict[Key, torch.Tensor]] | None:
        """``(n, cells)`` when ``data`` is a write small enough to stage and matches the schema
        exactly; ``None`` sends it down the batched path (which also explains any mismatch)."""
        if self._schema is None or not self._stage_rows or not isinstance(data, TensorDictBase):
            return None
        bs = data.batch_size
        if len(bs) != batch_dims:
            return None
        n = int(bs[0]) if batch_dims else 1
        if not 0 < n <= min(self._stage_rows // 8, self._capacity):
            return None
        cells = self._schema.match(data, batch_dims)
        return None if cells is None else (n, cells)

    def _stage_write(self, rows: np.ndarray, cells: dict[Key, torch.Tensor]) -> None:
        """Stage a small write whose cells match the schema (nothing here can fail on input)."""
        stage = self._stage
        if stage is None:
            stage = self._stage = WriteStage(self._schema, self._stage_rows, self._capacity)
        if not stage.room_for(rows):
            # the only step that can fail (tier space, disk): before this write touches anything
            self._flush_stage()
        n = rows.size
        with torch.no_grad():  # stored values never carry autograd history
            if n == 1:
                r = int(rows[0])
                for f in self._schema.dense_fields:
                    self._dense[f.key][r].copy_(cells[f.key].reshape(f.shape))
            else:
                rows_t = torch.from_numpy(rows)
                for f in self._schema.dense_fields:
                    self._dense[f.key].index_copy_(0, rows_t, cells[f.key].reshape(n, *f.shape).cpu())
            stage.put(rows, cells)

    def _flush_stage(self) -> None:
        """Compress the staged rows through the batched path (all or nothing; the stage keeps
        its rows if it fails)."""
        stage = self._stage
        if stage is None or stage.count == 0:
            return
        rows, data = stage.batch(self._dense)
        self._write_rows(rows, data)
        stage.reset()

    def _check_writable(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; reopen it with tiered.open(path, mode='r+')")
        if self._readonly:
            raise ReadOnlyStoreError(
                f"store {self.path!r} was opened read-only (mode='r'); reopen with mode='r+' to write")

    def _prepare_schema(self, data: TensorDictBase) -> int:
        if not isinstance(data, TensorDictBase):
            raise SchemaMismatchError(f"expected a TensorDict with batch_size [n], got {type(data).__name__}")
        if self._schema is None:
            kw = self.options
            schema = Schema.infer(data, blob_min_bytes=kw["blob_min_bytes"], blob_keys=kw["blob_keys"],
                                  dense_keys=kw["dense_keys"], frames=kw["frames"])
            n = schema.validate(data)
            self._init_schema(schema)
            return n
        return self._schema.validate(data)

    def _init_schema(self, schema: Schema) -> None:
        self._schema = schema
        for f in schema.dense_fields:
            self._dense[f.key] = torch.zeros((self._capacity, *f.shape), dtype=f.dtype)
        # family ids in order of first appearance in the schema (Schema.families keeps it)
        self._fam_fields = list(schema.families().values())
        for fid, fields in enumerate(self._fam_fields):
            self._families.append(FrameFamily(fid, fields[0].frame_nbytes, self._options["chunk_frames"],
                                              dedup=self._options["dedup"]))
            for f in fields:
                self._family_of[f.key] = fid
                self._tables[f.key] = RowTable(self._capacity, f.frames_per_row)
                self._field_stats[f.key] = {"unique_frames": 0}
        self._rules = [layout_rules([(f.key, f.frames_per_row, f.frame_dim is not None) for f in fields])
                       for fields in self._fam_fields]

    def _traj_ids(self, data: TensorDictBase, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Trajectory id per row and the sorted ids of trajectories that end in this batch."""
        done = np.zeros(n, dtype=bool)
        for k in _DONE_KEYS:
            if k in self._schema:
                done |= data.get(k).reshape(n, -1).any(-1).numpy()
        tk = self._options["traj_key"]
        tk = tuple(tk) if tk is not None else ("collector", "traj_ids")
        if tk in self._schema:
            traj = data.get(tk).reshape(n, -1)[:, 0].to(torch.int64).numpy()
        else:
            before = exclusive_cumsum(done.astype(np.int64))
            traj = self._traj_base + before
            self._traj_base_next = self._traj_base + int(done.sum())
        ended = np.unique(traj[done])
        return traj, ended

    def _cell_frames(self, f: Field, value: torch.Tensor, n: int) -> np.ndarray:
        """``[n, F, frame_nbytes]`` uint8 view/copy of a blob field's cells (numpy: its row
        gathers and concatenations run at memcpy speed, several times torch's uint8 kernels)."""
        v = value.detach()  # stored values never carry autograd history
        if f.frame_dim is not None and f.frame_dim != 0:
            v = v.movedim(f.frame_dim + 1, 1)
        v = v.contiguous()
        if v.dtype != torch.uint8:
            v = v.view(torch.uint8) if v.dim() else v.reshape(1).view(torch.uint8)
        return v.numpy().reshape(n, f.frames_per_row, f.frame_nbytes)

    def _write_rows(self, rows: np.ndarray, data: TensorDictBase) -> None:
        schema = self._schema
        n = rows.size
        if n == 0:
            return
        data = data.to("cpu") if data.device not in (None, torch.device("cpu")) else data
        self._traj_base_next = self._traj_base
        traj, ended = self._traj_ids(data, n)
        rows_t = torch.from_numpy(rows)

        plans = []
        try:
            for fid, fields in enumerate(self._fam_fields):
                fam = self._families[fid]
                # frames row-major (row, field, frame) so a trajectory's frames come in time order
                frames = FrameColumns([self._cell_frames(f, data.get(f.key), n) for f in fields])
                per_row = frames.per_row
                frame_traj = np.repeat(traj, per_row)
                tail_mask = np.zeros(n * per_row, dtype=bool)
                tail_mask[max(0, n - fam.tail_rows) * per_row:] = True
                plan = fam.plan(frames, frame_traj, ended, tail_mask, self._index, rules=self._rules[fid])
                plans.append((fid, fields, per_row, plan))
                self._store_chunks(fam, plan.closed_ids, plan.closed_raw, plan.closed_nframes)
        except BaseException:
            for _, _, _, plan in plans:
                self._abort_plan(plan)
            raise

        # --- commit: nothing below can fail on bad input ---------------------------------
        dead_all = []
        for fid, fields, per_row, plan in plans:
            fam = self._families[fid]
            dead_all.append(fam.commit(plan, self._index))
            blob = plan.blob.reshape(n, per_row)
            slot = plan.slot.reshape(n, per_row)
            col = 0
            old_refs = []
            for f in fields:
                F = f.frames_per_row
                table = self._tables[f.key]
                old = table.blob[rows]
                old_refs.append(old[self._written[rows]])
                table.blob[rows] = blob[:, col:col + F]
                table.slot[rows] = slot[:, col:col + F]
                col += F
            self._index.incref(blob)
            for old in old_refs:
                dead_all.append(self._index.decref(old))
            self._field_stats[fields[0].key]["unique_frames"] += plan.unique_new
            self._policy.on_insert(plan.closed_ids)
        for f in schema.dense_fields:
            self._dense[f.key].index_copy_(0, rows_t, data.get(f.key).detach().reshape(n, *f.shape))
        self._written[rows] = True
        self._traj_base = self._traj_base_next
        self._delete_blobs(np.unique(np.concatenate(dead_all)) if dead_all else np.empty(0, np.int64))

    def _abort_plan(self, plan) -> None:
        """Undo a plan whose write failed: new blobs go away, open chunks it closed stay open."""
        idx = self._index
        # never committed: their space is reusable at once
        self._free_in_tiers(np.concatenate([plan.new_ids, plan.reopened_closed]), defer=False)
        idx.loc[plan.reopened_closed] = -1
        idx.state[plan.reopened_closed] = OPEN
        idx.release(plan.new_ids)

    # ------------------------------------------------------------------------------------
    # Encoding and placement
    # ------------------------------------------------------------------------------------
    def _store_chunks(self, fam: FrameFamily, ids: np.ndarray, raw: np.ndarray, nframes: np.ndarray) -> None:
        if ids.size == 0:
            return
        raw_sizes = nframes * fam.frame_nbytes
        raw_offsets = exclusive_cumsum(raw_sizes)
        enc = self._codec.encode(raw.reshape(-1), raw_offsets, raw_sizes)
        idx = self._index
        idx.nbytes[ids] = enc.sizes
        idx.raw_nbytes[ids] = raw_sizes
        idx.checksum[ids] = enc.checksums
        idx.codec[ids] = self._codec.format_id
        idx.family[ids] = fam.family_id
        self._place(ids, enc.data, enc.offsets, enc.sizes)
        idx.state[ids] = STORED
        if self._gpu is not None:  # a decode on another stream must see these arena writes
            self._gpu.fence_writes()

    def _place(self, ids: np.ndarray, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Put encoded blobs into tiers (DESIGN.md 5). All-or-nothing for the new blobs."""
        idx = self._index
        cold = self._tiers[COLD]
        if cold is not None:
            loc = cold.allocate(sizes)
            try:
                cold.write(loc, data, offsets, sizes)
            except BaseException:
                cold.free(loc, align(sizes), defer=False)  # never committed: reusable at once
                raise
            idx.loc[ids, COLD] = loc
            # best effort: cache new blobs in the fastest memory tier with room
            for t in (HOT, WARM):
                if self._tiers[t] is not None and self._cache_into(t, ids, data, offsets, sizes):
                    break
            return
        errors = []
        for t in (HOT, WARM):
            tier = self._tiers[t]
            if tier is None:
                continue
            try:
                loc = self._allocate_in(t, sizes)
            except (StorageFullError, ValueError) as e:
                errors.append(f"{tier.name}: {e}")
                continue
            tier.write(loc, data, offsets, sizes)
            idx.loc[ids, t] = loc
            return
        budgets = ", ".join(
            f"{_TIER_NAMES[t]}={self._tiers[t].budget}" for t in (HOT, WARM) if self._tiers[t] is not None)
        raise StorageFullError(
            f"no tier can take {ids.size} new blobs ({int(sizes.sum())} bytes); budgets: {budgets or 'none'}. "
            "Nothing was written. Raise warm_bytes/hot_bytes, give the store a path (a cold tier on disk), "
            "or use a smaller capacity. Details: " + "; ".join(errors))

    def _allocate_in(self, t: int, sizes: np.ndarray, protect: np.ndarray | None = None) -> np.ndarray:
        """Allocate in tier ``t``, moving policy victims out first.

        Enough free *bytes* may still not hold a batch when the free space is in small holes;
        then more victims leave (four times the batch, then sixteen times, then the whole budget) until
        the holes coalesce. A bounded number of rounds, never a loop over blobs.
        """
        tier = self._tiers[t]
        need = int(align(sizes).sum())
        rounds = 4
        for attempt in range(rounds):
            room = need if attempt == 0 or tier.budget is None else min(tier.budget, need << (2 * attempt))
            if attempt == rounds - 1 and tier.budget is not None:
                room = tier.budget
            self._make_room(t, room, protect)
            try:
                return tier.allocate(sizes)
            except StorageFullError:
                if attempt == rounds - 1:
                    raise
        raise AssertionError("unreachable")

    def _tier_ids(self, t: int) -> np.ndarray:
        return np.flatnonzero(self._index.loc[: self._index.size, t] >= 0)

    def _make_room(self, t: int, need: int, protect: np.ndarray | None = None) -> None:
        """Move victims of tier ``t`` down (no path) until ``need`` more bytes fit under its budget."""
        tier = self._tiers[t]
        if tier.budget is None:
            return
        short = tier.bytes_used + need - tier.budget
        if short <= 0:
            return
        if need > tier.budget:
            raise StorageFullError(f"batch of {need} bytes exceeds the {tier.name} budget of {tier.budget}")
        ids = self._tier_ids(t)
        if protect is not None and protect.size:
            ids = ids[~isin(ids, protect)]
        victims = self._policy.victims(ids, align(self._index.nbytes[ids]), short)
        if victims.size == 0:
            raise StorageFullError(f"{tier.name} tier is full and holds no evictable blob")
        self._demote(t, victims)

    def _demote(self, t: int, ids: np.ndarray) -> None:
        idx = self._index
        tier = self._tiers[t]
        sizes = idx.nbytes[ids]
        lower = [u for u in range(t + 1, 3) if self._tiers[u] is not None]
        if self._tiers[COLD] is not None:
            # cold holds every blob: dropping a cached copy is free
            tier.free(idx.loc[ids, t], align(sizes))
            idx.loc[ids, t] = -1
            self._stats[_TIER_NAMES[t]]["demotions"] += int(ids.size)
            return
        if not lower:
            raise StorageFullError(f"the {tier.name} tier is full and there is no lower tier to move blobs to")
        buf_off = exclusive_cumsum(sizes)
        buf = np.empty(int(sizes.sum()), dtype=np.uint8)
        tier.read(idx.loc[ids, t], sizes, buf, buf_off)
        u = lower[0]
        loc = self._allocate_in(u, sizes)  # copy, switch the index, then free
        self._tiers[u].write(loc, buf, buf_off, sizes)
        idx.loc[ids, u] = loc
        tier.free(idx.loc[ids, t], align(sizes))
        idx.loc[ids, t] = -1
        self._stats[_TIER_NAMES[t]]["demotions"] += int(ids.size)

    def _cache_into(self, t: int, ids, data, offsets, sizes) -> bool:
        """Copy blobs into cache tier ``t`` (stores with a path), evicting by policy. Best effort."""
        tier = self._tiers[t]
        try:
            loc = self._allocate_in(t, sizes)
        except (StorageFullError, ValueError):
            return False
        except torch.cuda.OutOfMemoryError:
            self._counters["oom_skipped_promotions"] = self._counters.get("oom_skipped_promotions", 0) + 1
            return False
        tier.write(loc, data, offsets, sizes)
        self._index.loc[ids, t] = loc
        return True

    def _delete_blobs(self, ids: np.ndarray) -> None:
        """Free blobs no row references any more."""
        # No early exits on empty groups: the call count must not depend on the batch.
        idx = self._index
        ids = ids[idx.refcount[ids] == 0]
        opened = ids[idx.state[ids] == OPEN]
        for fam in self._families:
            fam.drop_open(opened[idx.family[opened] == fam.family_id], idx)
        # a cold tier reuses their space only after the next commit (a reader may still use it)
        self._free_in_tiers(ids[idx.state[ids] == STORED], defer=True)
        self._policy.on_release(ids)
        idx.release(ids)

    def _free_in_tiers(self, ids: np.ndarray, *, defer: bool) -> None:
        """Free ``ids`` in every tier that holds them (``defer`` matters to cold tiers only).
        No early exits on empty groups: the call count must not depend on the batch."""
        idx = self._index
        for t in range(3):
            tier = self._tiers[t]
            if tier is None:
                continue
            sel = ids[idx.loc[ids, t] >= 0]
            tier.free(idx.loc[sel, t], align(idx.nbytes[sel]), defer=defer)

    # ------------------------------------------------------------------------------------
    # Reading
    # ------------------------------------------------------------------------------------
    def get(self, index: IndexLike, keys: Iterable[str | Key] | None = None, *,
            index_key: str | None = None, copy: bool = True) -> TensorDictBase:
        """Read rows.

        Args:
            index: an int (no batch dimension in the result), a list, numpy array, 1-D tensor,
                range or slice. Negative ints count from the end of the written rows; slices
                clip to ``len``.
            keys: only these fields (nested keys as tuples); the others are not decoded.
            index_key: also return each row's position (int64, negative indices resolved)
                under this key, as TorchRL's storages return ``"index"``.
            copy: with False, a step-1 slice returns the dense columns as views of the store's
                own columns (as TorchRL's ``TensorStorage`` does for ``storage[:]``): no copy that
                grows with the buffer, but writing to them writes to the store, and later writes
                to the store show through. Blob fields are always fresh tensors.

        Returns:
            A TensorDict of batch size ``[n]`` (or ``[]`` for an int index) on ``device``.

        Raises:
            IndexOutOfRangeError: an index outside ``[-len, len)`` or a row never written.
            ChecksumError: a blob's stored bytes do not match their checksum.
        """
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed; reopen it with tiered.open(path)")
            rows, scalar = self._resolve_read_index(index)
            if self._schema is None:
                out = TensorDict({}, batch_size=[rows.size])
                return out[0] if scalar else out
            fields = self._select_fields(keys)
            n = rows.size
            rows_t = torch.from_numpy(rows)
            out: dict[Key, torch.Tensor] = {}
            # copy=False: a slice with step 1 reads dense columns as views, as TensorStorage does
            # (TorchRL's SliceSampler reads `storage[:]` on every sample through the adapter).
            span = None
            if not copy and isinstance(index, slice) and n and rows[-1] - rows[0] == n - 1:
                span = (int(rows[0]), n)
            for f in fields:
                if f.kind == "dense":
                    col = self._dense[f.key]
                    out[f.key] = col.narrow(0, *span) if span else col.index_select(0, rows_t)
            by_fam: dict[int, list[Field]] = {}
            for f in fields:
                if f.kind == "blob":
                    by_fam.setdefault(self._family_of[f.key], []).append(f)
            stage = self._stage
            slots = stage.staged(rows) if stage is not None and stage.count else None
            if slots is not None and (slots >= 0).any():
                self._get_with_stage(by_fam, rows, slots, out)
            else:
                for fid, fs in by_fam.items():
                    self._get_family(fid, fs, rows, out)
            self._counters["gets"] += 1
            td = TensorDict({}, batch_size=[n])
            for k, v in out.items():
                td.set(k, v)
            if index_key is not None:
                td.set(index_key, rows_t)
            if self._device.type != "cpu":
                td = td.to(self._device, non_blocking=True)
            return td[0] if scalar else td

    def _get_with_stage(self, by_fam: dict[int, list[Field]], rows: np.ndarray, slots: np.ndarray,
                        out: dict) -> None:
        """Blob cells of ``rows`` when some are staged: the others decode as usual, staged
        ones are copied from the stage."""
        hit = slots >= 0
        miss = np.flatnonzero(~hit)
        if miss.size:
            # decode at full size with staged rows pointing at a stored row (its blobs are
            # decoded anyway), then overwrite them: no second [n, ...] buffer and copy
            read = np.where(hit, rows[miss[0]], rows)
            for fid, fs in by_fam.items():
                self._get_family(fid, fs, read, out)
        hit_pos = torch.from_numpy(np.flatnonzero(hit))
        hit_slots = torch.from_numpy(slots[hit].astype(np.int64))
        for fs in by_fam.values():
            for f in fs:
                staged = self._stage.cells[f.key].index_select(0, hit_slots)
                if miss.size:
                    cells = out[f.key]
                    cells[hit_pos.to(cells.device)] = staged.to(cells.device)
                else:
                    out[f.key] = staged

    def rows_of(self, index: IndexLike) -> np.ndarray:
        """The row positions :meth:`get` reads for ``index`` (negative indices resolved).

        Raises:
            IndexOutOfRangeError: as :meth:`get` does.

        Example:
            >>> s = TieredStore(8)
            >>> _ = s.extend(TensorDict({"x": torch.arange(5)}, batch_size=[5]))
            >>> s.rows_of([-1, 0]).tolist(), s.rows_of(slice(3, None)).tolist()
            ([4, 0], [3, 4])
        """
        with self._lock:
            return self._resolve_read_index(index)[0]

    def _select_fields(self, keys) -> list[Field]:
        if keys is None:
            return list(self._schema.values())
        want = []
        for k in keys:
            k = normalize_key(k)
            sub = [f for f in self._schema.values() if f.key[: len(k)] == k]
            if not sub:
                raise SchemaMismatchError(
                    f"key {key_to_str(k)!r} is not in the store; keys: "
                    f"{sorted(key_to_str(f.key) for f in self._schema.values())}")
            want.extend(x for x in sub if x not in want)
        return want

    def _get_family(self, fid: int, fields: list[Field], rows: np.ndarray, out: dict) -> None:
        if self._gpu is not None:
            return self._gpu.get_family(self, fid, fields, rows, out)
        fam = self._families[fid]
        n = rows.size
        blobs = np.concatenate([self._tables[f.key].blob[rows] for f in fields], axis=1)
        slots = np.concatenate([self._tables[f.key].slot[rows] for f in fields], axis=1)
        uniq, inv = np.unique(blobs, return_inverse=True)
        frame_idx = inv.reshape(blobs.shape) * fam.chunk_frames + slots
        flat = self._materialize(fam, uniq).reshape(-1, fam.frame_nbytes)  # decoded frames, reused buffer
        col = 0
        for f in fields:  # a loop over fields, not rows
            F = f.frames_per_row
            # numpy row gathers run at memcpy speed (torch's uint8 index_select is ~8x slower here)
            out[f.key] = f.cells_from_frames(torch.from_numpy(flat[frame_idx[:, col:col + F].reshape(-1)]), n)
            col += F

    def _scratch(self, name: str, nbytes: int) -> np.ndarray:
        """A per-thread reusable buffer (fresh allocations cost page faults on every sample)."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(name)
        if buf is None or buf.size < nbytes:
            # at least 4 MiB, then doubling: small batches never regrow it
            buf = np.empty(max(nbytes, 2 * buf.size if buf is not None else 4 << 20), dtype=np.uint8)
            bufs[name] = buf
        return buf[:nbytes]

    def _materialize(self, fam: FrameFamily, uniq: np.ndarray) -> np.ndarray:
        """Raw frames ``[len(uniq), K, nbytes]`` of the given blobs, in a reused buffer."""
        idx = self._index
        K, nb = fam.chunk_frames, fam.frame_nbytes
        row_bytes = K * nb
        dst = self._scratch(f"raw{fam.family_id}", uniq.size * row_bytes)
        dst_t = dst.reshape(uniq.size, K, nb)
        state = idx.state[uniq]
        if (state == 0).any():
            raise AssertionError("a row references a freed blob: index is inconsistent")
        is_open = state == OPEN
        # no early exits on empty groups: the call count of get must not depend on the batch
        pos = np.flatnonzero(is_open)
        dst_t[pos] = fam.open_raw(uniq[pos], idx)
        pos = np.flatnonzero(~is_open)
        ids = uniq[pos]
        sizes = idx.nbytes[ids]
        src_off = exclusive_cumsum(sizes)
        comp = self._scratch("comp", int(sizes.sum()))
        loc = idx.loc[ids]
        remaining = np.ones(ids.size, dtype=bool)
        from_tier = np.full(ids.size, -1, dtype=np.int8)
        for t in (HOT, WARM, COLD):
            tier = self._tiers[t]
            if tier is None:
                continue
            sel = remaining & (loc[:, t] >= 0)
            if sel.any():
                tier.read(loc[sel, t], sizes[sel], comp, src_off[sel])
                remaining &= ~sel
                from_tier[sel] = t
                self._stats[_TIER_NAMES[t]]["hits"] += int(sel.sum())
        if remaining.any():
            raise AssertionError(f"{int(remaining.sum())} blobs have no location: index is inconsistent")
        if self._verify:
            sums = _codecs.segment_checksums(comp, src_off, sizes)
            bad = np.flatnonzero(sums != idx.checksum[ids])
            if bad.size:
                raise ChecksumError(self._describe_bad_blobs(ids[bad]))
        self._codec_for(idx.codec[ids]).decode(
            comp, src_off, sizes, dst, pos.astype(np.int64) * row_bytes, idx.raw_nbytes[ids])
        self._counters["blobs_decoded"] += int(ids.size)
        self._policy.on_access(ids)
        if self._promote:
            self._promote_blobs(ids, from_tier, comp, src_off, sizes)
        return dst_t

    def _codec_for(self, format_ids: np.ndarray) -> _codecs.Codec:
        fmt = int(format_ids[0]) if format_ids.size else self._codec.format_id
        if fmt == self._codec.format_id and (format_ids == fmt).all():
            return self._codec
        if not (format_ids == fmt).all():
            raise NotImplementedError("blobs of several codecs in one batch are not supported yet")
        return _codecs.codec_for_format_id(fmt)

    def _promote_blobs(self, ids, from_tier, comp, src_off, sizes) -> None:
        """Copy sampled blobs up into faster tiers with room (copy up, then switch)."""
        for t in (HOT, WARM):
            tier = self._tiers[t]
            if tier is None:
                continue
            sel = from_tier > t
            if not sel.any():
                continue
            if self._tiers[COLD] is None:
                # Exclusive tiers: copy up, switch the index, then free below. Victims of the
                # faster tier move down first (policy order); a quarter of the budget at most per
                # call, so one sample cannot flush the whole hot set. Any failure (lower tier
                # full, GPU out of memory) just skips the promotion: the data is already correct.
                cand = np.flatnonzero(sel)
                cand = cand[np.cumsum(align(sizes[cand])) <= (tier.budget or 0) // 4]
                if cand.size == 0:
                    continue
                moved = ids[cand]
                old_t = from_tier[cand]
                try:
                    loc = self._allocate_in(t, sizes[cand], protect=moved)
                except (StorageFullError, ValueError):
                    continue
                except torch.cuda.OutOfMemoryError:
                    self._counters["oom_skipped_promotions"] = self._counters.get("oom_skipped_promotions", 0) + 1
                    continue
                tier.write(loc, comp, src_off[cand], sizes[cand])
                for u in range(t + 1, 3):
                    m = old_t == u
                    if m.any() and self._tiers[u] is not None:
                        self._tiers[u].free(self._index.loc[moved[m], u], align(sizes[cand][m]))
                        self._index.loc[moved[m], u] = -1
                self._index.loc[moved, t] = loc
                from_tier[cand] = t
                self._stats[_TIER_NAMES[t]]["promotions"] += int(cand.size)
            else:
                # at most half the cache per call: a batch larger than the cache still promotes
                # part of itself instead of nothing
                cand = np.flatnonzero(sel)
                cand = cand[np.cumsum(align(sizes[cand])) <= (tier.budget or 0) // 2]
                if cand.size and self._cache_into(t, ids[cand], comp, src_off[cand], sizes[cand]):
                    from_tier[cand] = t
                    self._stats[_TIER_NAMES[t]]["promotions"] += int(cand.size)

    def _describe_bad_blobs(self, bad_ids: np.ndarray) -> str:
        idx = self._index
        lines = []
        for b in bad_ids[:5]:
            refs = []
            for key, table in self._tables.items():
                r = np.flatnonzero((table.blob == b).any(1))
                if r.size:
                    refs.append(f"{key_to_str(key)!r} rows {r[:5].tolist()}")
            where = ", ".join(f"{_TIER_NAMES[t]} offset {int(idx.loc[b, t])}" for t in range(3) if idx.loc[b, t] >= 0)
            lines.append(f"  blob {int(b)} ({where}; used by {'; '.join(refs) or 'no row'})")
        stale = self._newer_generation()
        if stale is not None:
            # a read-only open outlived its commit: the writer reused the space of blobs only that
            # commit still used, so the bytes are not damaged, they are someone else's
            return (f"{bad_ids.size} blob(s) failed their checksum:\n" + "\n".join(lines)
                    + f"\nThis store was opened read-only at commit {self._generation}; a writer has since "
                    f"committed generation {stale} and reused the space of blobs that only older commits "
                    "used. The files are most likely not damaged: reopen the store (tiered.open(path)) to "
                    "read the latest commit, and run `tiered verify` if the error stays after that.")
        return (f"{bad_ids.size} blob(s) failed their checksum (stored bytes are damaged):\n" + "\n".join(lines)
                + "\nOther rows are still readable. Run `tiered verify` on the store to list all damage.")

    def _newer_generation(self) -> int | None:
        """A read-only store's hint on a checksum failure: the generation a writer has committed
        since this store opened, at least two after it (reused space), else None."""
        if self.path is None or not self._readonly:
            return None
        from .engine.manifest import read_manifest

        try:
            g = int(read_manifest(self.path)["generation"])
        except Exception:  # noqa: BLE001 - only a hint; the checksum error is what is raised
            return None
        return g if g >= self._generation + 2 else None

    # ------------------------------------------------------------------------------------
    # Index resolution
    # ------------------------------------------------------------------------------------
    def _resolve_read_index(self, index: IndexLike) -> tuple[np.ndarray, bool]:
        n = self._len
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
        unwritten = ~self._written[rows]
        if unwritten.any() and self._stage is not None:
            unwritten &= self._stage.staged(rows) < 0  # staged rows are written
        if unwritten.any():
            raise IndexOutOfRangeError(
                f"row {int(rows[unwritten][0])} was never written (length {n}); write it first or sample "
                "written rows only")
        return rows, scalar

    def _resolve_write_index(self, index: IndexLike, n: int) -> np.ndarray:
        cap = self._capacity
        if isinstance(index, slice):
            rows = np.arange(*index.indices(cap), dtype=np.int64)
        else:
            rows, _ = as_row_array(index)
        bad = (rows < -cap) | (rows >= cap)
        if bad.any():
            raise IndexOutOfRangeError(
                f"index {int(rows[bad][0])} is out of range for a store of capacity {cap} (length {self._len})")
        rows = np.where(rows < 0, rows + cap, rows)
        if rows.size != n:
            raise SchemaMismatchError(f"index names {rows.size} rows but the data has {n} rows")
        return rows

    # ------------------------------------------------------------------------------------
    # Priorities, stats, lifecycle
    # ------------------------------------------------------------------------------------
    def set_priority(self, index: IndexLike, priority: torch.Tensor | np.ndarray | float) -> None:
        """Set per-row priorities used by the ``priority`` policy (a blob gets its rows' max)."""
        with self._lock:
            rows, _ = self._resolve_read_index(index)
            prio = np.broadcast_to(np.asarray(
                priority.detach().cpu().numpy() if isinstance(priority, torch.Tensor) else priority,
                dtype=np.float64).reshape(-1), rows.shape)
            if not isinstance(self._policy, PriorityPolicy):
                if not np.isfinite(prio).all():
                    from .errors import InvalidPriorityError
                    raise InvalidPriorityError(f"priorities must be finite, got {prio[~np.isfinite(prio)][:5]}")
                return
            ids, pr = [], []
            for table in self._tables.values():
                b = table.blob[rows]
                ids.append(b.reshape(-1))
                pr.append(np.repeat(prio, b.shape[1]))
            if ids:
                ids_a, pr_a = np.concatenate(ids), np.concatenate(pr)
                keep = ids_a >= 0
                self._policy.set_priority(ids_a[keep], pr_a[keep])

    def stats(self) -> dict[str, Any]:
        """Memory and traffic figures (DESIGN.md section 5).

        Returns:
            ``{"rows", "capacity", "fields": {name: {...}}, "tiers": {name: {...}}, ...}``.
        """
        with self._lock:
            idx = self._index
            live = idx.live_ids()
            fields: dict[str, dict[str, Any]] = {}
            if self._schema is not None:
                for f in self._schema.values():
                    name = key_to_str(f.key)
                    logical = f.cell_nbytes * self._len
                    if f.kind == "dense":
                        fields[name] = {"kind": "dense", "logical_bytes": logical,
                                        "stored_bytes": f.cell_nbytes * self._capacity, "ratio": 1.0}
                fam_stored: dict[int, int] = {}
                fam_frames: dict[int, int] = {}
                fam_raw: dict[int, int] = {}
                for fam in self._families:
                    sel = live[idx.family[live] == fam.family_id]
                    fam_stored[fam.family_id] = int(idx.nbytes[sel[idx.state[sel] == STORED]].sum()) + \
                        int(idx.raw_nbytes[sel[idx.state[sel] == OPEN]].sum())
                    fam_raw[fam.family_id] = int(idx.raw_nbytes[sel].sum())
                    fam_frames[fam.family_id] = int(idx.raw_nbytes[sel].sum()) // fam.frame_nbytes
                fam_logical: dict[int, int] = {}
                for f in self._schema.blob_fields:
                    fid = self._family_of[f.key]
                    fam_logical[fid] = fam_logical.get(fid, 0) + f.cell_nbytes * self._len
                for f in self._schema.blob_fields:
                    fid = self._family_of[f.key]
                    logical = f.cell_nbytes * self._len
                    share = logical / fam_logical[fid] if fam_logical[fid] else 0.0
                    stored = fam_stored[fid] * share
                    uniq_bytes = fam_raw[fid]
                    fields[key_to_str(f.key)] = {
                        "kind": "blob",
                        "family": f.family,
                        "logical_bytes": logical,
                        "stored_bytes": int(stored),
                        "ratio": logical / stored if stored else float("inf") if logical else 1.0,
                        "unique_frames": fam_frames[fid],
                        "dedup_factor": fam_logical[fid] / uniq_bytes if uniq_bytes else 1.0,
                        "compression_factor": uniq_bytes / fam_stored[fid] if fam_stored[fid] else 1.0,
                    }
            tiers = {}
            for t, name in enumerate(_TIER_NAMES):
                tier = self._tiers[t]
                if tier is None:
                    continue
                st = tier.stats()
                tiers[name] = {
                    "bytes_used": int(st.get("bytes_used", tier.bytes_used)),
                    "budget": tier.budget,
                    "blobs": int((idx.loc[: idx.size, t] >= 0).sum()),
                    "fragmentation": float(st.get("fragmentation", 0.0)),
                    **self._stats[name],
                }
            open_bytes = sum(int(f.open_frames.nbytes) for f in self._families)
            staged = self._stage.count if self._stage is not None else 0
            stage_bytes = self._stage.nbytes if self._stage is not None else 0
            tail_bytes = sum(int(f.tail_frames.nbytes) for f in self._families)
            index_bytes = sum(getattr(idx, c).nbytes for c in ("state", "refcount", "nbytes", "raw_nbytes",
                                                             "checksum", "codec", "family", "loc", "open_slot", "birth"))
            table_bytes = sum(t.blob.nbytes + t.slot.nbytes for t in self._tables.values())
            dense_bytes = sum(v.numel() * v.element_size() for v in self._dense.values())
            return {
                "rows": self._len,
                "capacity": self._capacity,
                "codec": self._codec.name,
                "blobs": int(live.size),
                "fields": fields,
                "tiers": tiers,
                "staged_rows": staged,
                "memory": {"staged": stage_bytes, "open_chunks": open_bytes, "tail": tail_bytes, "index": index_bytes,
                           "row_tables": table_bytes, "dense": dense_bytes},
                "counters": dict(self._counters),
                "gpu": self._gpu.stats() if self._gpu is not None else None,
            }

    def flush(self) -> None:
        """Close open time chunks (compress and place them); with a path, commit durably."""
        with self._lock:
            self._check_writable()
            self._flush_stage()
            self._close_open_chunks()
            self._commit()

    def _close_open_chunks(self) -> None:
        for fam in self._families:
            if fam.open_blob.size == 0:
                continue
            empty = FrameColumns([np.empty((0, 1, fam.frame_nbytes), dtype=np.uint8)])
            e = np.empty(0, dtype=np.int64)
            plan = fam.plan(empty, e, e, np.zeros(0, bool), self._index, close_all=True)
            # keep the tail as it is
            plan.tail_frames, plan.tail_blob, plan.tail_slot = fam.tail_frames, fam.tail_blob, fam.tail_slot
            plan.tail_hash = fam.tail_hash
            self._store_chunks(fam, plan.closed_ids, plan.closed_raw, plan.closed_nframes)
            dead = fam.commit(plan, self._index)  # pins the (same) tail and unpins it: net zero
            self._policy.on_insert(plan.closed_ids)
            if dead.size:
                self._delete_blobs(dead)

    def close(self) -> None:
        """Flush (stores with a path) and release memory, files and handles. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                if self.path is not None and not self._readonly:
                    self.flush()
            finally:
                for tier in self._tiers:
                    if tier is not None:
                        tier.close()
                self._closed = True
                from .engine.lock import release

                release(self._writer_lock)
                self._writer_lock = None

    # ------------------------------------------------------------------------------------
    # The cold tier and the durable format (DESIGN.md section 6; docs/format.md)
    # ------------------------------------------------------------------------------------
    def _make_cold_tier(self, mode: str = "w", state: dict | None = None) -> Tier:
        from .tiers import HDF5Tier, MemmapTier

        cls = {"memmap": MemmapTier, "hdf5": HDF5Tier}.get(self._backend)
        if cls is None:
            raise ValueError(f"unknown backend {self._backend!r}; known: memmap, hdf5")
        directory = os.path.join(self.path, "cold")
        if state is None:
            return cls(directory)
        return cls.open(directory, state, mode)

    def _cold_init(self) -> None:
        if self.path is None or getattr(self, "_opening", False):
            return
        from .engine.manifest import MANIFEST
        from .errors import StoreExistsError

        if os.path.exists(os.path.join(self.path, MANIFEST)):
            raise StoreExistsError(
                f"{self.path!r} already holds a tiered store; open it with tiered.open(path, mode='r+'), "
                "or choose another path")
        os.makedirs(self.path, exist_ok=True)
        from .engine.lock import acquire_writer_lock, release

        self._writer_lock = acquire_writer_lock(self.path)  # one writer at a time
        try:
            self._tiers[COLD] = self._make_cold_tier()
            self._commit()
        except BaseException:
            release(self._writer_lock)
            self._writer_lock = None
            raise

    def _snapshot_arrays(self) -> dict[str, np.ndarray]:
        arrays = {f"index.{k}": v for k, v in self._index.state_arrays().items()}
        arrays["written"] = self._written
        if self._schema is not None:
            for i, f in enumerate(self._schema.values()):
                if f.kind == "dense":
                    arrays[f"dense.{i}"] = self._dense[f.key].numpy()
                else:
                    arrays[f"rows.{i}.blob"] = self._tables[f.key].blob
                    arrays[f"rows.{i}.slot"] = self._tables[f.key].slot
        cold_state = self._tiers[COLD].state()
        for k, v in cold_state.items():
            if isinstance(v, np.ndarray):
                arrays[f"cold.{k}"] = v
        return arrays

    def _commit(self) -> None:
        """Durably publish the current state (no-op without a path)."""
        if self.path is None or self._readonly:
            return
        from . import fileio
        from .engine.manifest import gen_dir_name, save_npy, write_manifest

        cold = self._tiers[COLD]
        cold.flush()
        g = self._generation + 1
        gdir = os.path.join(self.path, gen_dir_name(g))
        if os.path.isdir(gdir):  # left over by a crash before its manifest was published
            for name in os.listdir(gdir):
                fileio.remove(os.path.join(gdir, name))
        os.makedirs(gdir, exist_ok=True)
        files = {}
        for name, arr in self._snapshot_arrays().items():
            files[name] = save_npy(os.path.join(gdir, name + ".npy"), arr)
        fileio.fsync_dir(gdir)
        fileio.fsync_dir(self.path)
        cold_state = {k: v for k, v in cold.state().items() if not isinstance(v, np.ndarray)}
        body = {
            "generation": g,
            "capacity": self._capacity,
            "len": self._len,
            "cursor": self._cursor,
            "traj_base": self._traj_base,
            "codec": self._codec.name,
            "backend": self._backend,
            "options": self._options,
            "policy": self._policy.name,
            "schema": self._schema.to_json() if self._schema is not None else None,
            "families": [{"frame_nbytes": f.frame_nbytes, "chunk_frames": f.chunk_frames} for f in self._families],
            "cold": cold_state,
            "files": files,
        }
        write_manifest(self.path, body)
        # Keep the previous generation one commit longer: a reader (or `tiered verify`) that read
        # the old manifest an instant ago can still load its arrays.
        old = os.path.join(self.path, gen_dir_name(self._generation - 1))
        self._generation = g
        if os.path.isdir(old):
            for name in os.listdir(old):
                fileio.remove(os.path.join(old, name))
            os.rmdir(old)
        # space freed by overwritten rows is reusable only now that the commit is durable
        cold.release_deferred()

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "r", **options: Any) -> TieredStore:
        """Open an existing store (see :func:`tiered.open`).

        ``mode="r+"`` takes the store's writer lock (:class:`~tiered.errors.StoreLockedError` if
        another writer holds it); ``"r"`` takes none, so any number of readers can open it.
        A manifest or array that is damaged or inconsistent raises
        :class:`~tiered.errors.CorruptionError` naming the store, never a raw ``KeyError``.
        """
        from .engine.lock import acquire_writer_lock, release
        from .engine.manifest import read_manifest
        from .errors import CorruptionError, TieredError

        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        allowed = {"warm_bytes", "hot_bytes", "hot_device", "device", "policy", "verify", "threads", "promote",
                   "gpu_decode", "stage_rows"}
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f"options {sorted(unknown)} cannot change on open; allowed: {sorted(allowed)}")
        path = os.fspath(path)
        read_manifest(path)  # "not a store" before touching the directory (no lock file)
        lock = acquire_writer_lock(path) if mode == "r+" else None
        try:
            body = read_manifest(path)  # under the lock: the last complete commit
            try:
                for attempt in range(3):
                    try:
                        self = cls._open_body(path, mode, options, body)
                        break
                    except CorruptionError:
                        # a writer may have committed twice since we read the manifest (its old
                        # generation is gone): read the new one; a real damage persists
                        newer = read_manifest(path)
                        if attempt == 2 or newer["generation"] == body["generation"]:
                            raise
                        body = newer
                self._check_consistency()
            except TieredError:
                raise
            except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError,
                    OverflowError) as e:
                raise CorruptionError(
                    f"{path}: the manifest and its arrays are inconsistent ({type(e).__name__}: {e}); "
                    f"the store is damaged. Run `tiered verify {path}` for details.") from e
            self._writer_lock = lock
            return self
        except BaseException:
            release(lock)
            raise

    def _check_consistency(self) -> None:
        """Cheap, vectorized checks that the loaded arrays agree with the manifest."""
        from .errors import CorruptionError

        cap, idx = self._capacity, self._index
        problems = []
        if self._written.shape != (cap,):
            problems.append(f"written has shape {self._written.shape}, expected ({cap},)")
        if not (0 <= self._len <= cap and 0 <= self._cursor < cap):
            problems.append(f"len {self._len} / cursor {self._cursor} do not fit capacity {cap}")
        for key, t in self._tables.items():
            if t.blob.shape != (cap, self._schema[key].frames_per_row) or t.slot.shape != t.blob.shape:
                problems.append(f"row table of {key_to_str(key)!r} has shape {t.blob.shape}")
            elif t.blob.size and int(t.blob.max()) >= idx.size:
                problems.append(f"row table of {key_to_str(key)!r} names blob {int(t.blob.max())} "
                                f"of an index of {idx.size}")
        for key, col in self._dense.items():
            if tuple(col.shape) != (cap, *self._schema[key].shape):
                problems.append(f"dense column {key_to_str(key)!r} has shape {tuple(col.shape)}")
        live = idx.live_ids()
        cold = self._tiers[COLD]
        if live.size and cold is not None:
            loc = idx.loc[live, COLD]
            end = loc + idx.nbytes[live]
            high = getattr(getattr(cold, "allocator", None), "high_water", None)
            if (loc < 0).any() or (high is not None and int(end.max()) > high):
                problems.append("blob locations fall outside the cold segments")
            if (idx.raw_nbytes[live] < 0).any() or (idx.raw_nbytes[live] > (1 << 34)).any():
                problems.append("blob sizes are impossible")
        if problems:
            raise CorruptionError(f"{self.path}: the store is damaged: " + "; ".join(problems[:5])
                                  + f". Run `tiered verify {self.path}` for details.")

    @classmethod
    def _open_body(cls, path: str, mode: str, options: dict[str, Any], body: dict[str, Any]) -> TieredStore:
        from .engine.manifest import gen_dir_name, load_npy

        o = body["options"]
        self = cls.__new__(cls)
        self._opening = True
        try:
            cls.__init__(
                self, body["capacity"], path, **cls._layout_kwargs(o, body["codec"], body.get("backend", "memmap")),
                **{"policy": body.get("policy", "lru"), **options},
            )
        finally:
            self._opening = False
        gdir = os.path.join(path, gen_dir_name(body["generation"]))
        files = body["files"]

        def load(name: str) -> np.ndarray:
            if name not in files:
                from .errors import CorruptionError
                raise CorruptionError(f"{path}: the manifest lists no {name!r} array; the store is damaged")
            return load_npy(os.path.join(gdir, name + ".npy"), files[name])

        self._generation = body["generation"]
        self._len, self._cursor, self._traj_base = body["len"], body["cursor"], body["traj_base"]
        index_arrays = {k.split(".", 1)[1]: load(k) for k in files if k.startswith("index.")}
        self._index = BlobIndex.from_arrays(index_arrays)
        self._index.loc[:, HOT] = -1
        self._index.loc[:, WARM] = -1
        self._written = np.array(load("written"))
        if body["schema"] is not None:
            self._init_schema(Schema.from_json(body["schema"]))
            for i, f in enumerate(self._schema.values()):
                if f.kind == "dense":
                    self._dense[f.key] = torch.from_numpy(load(f"dense.{i}"))
                else:
                    self._tables[f.key] = RowTable.from_arrays(load(f"rows.{i}.blob"), load(f"rows.{i}.slot"))
            # reference counts are recomputed from the row tables (the tail pins do not survive)
            refs = np.concatenate([t.blob[self._written].reshape(-1) for t in self._tables.values()]) \
                if self._tables else np.empty(0, np.int64)
            refs = refs[refs >= 0]
            self._index.refcount[: self._index.size] = np.bincount(refs, minlength=self._index.size)[
                : self._index.size].astype(np.int32)
            self._policy.on_insert(self._index.live_ids())
            # blobs only the previous writer's tail pinned are unreferenced now
            live = self._index.live_ids()
            dead = live[self._index.refcount[live] == 0]
            if dead.size and mode == "r+":
                self._tiers[COLD] = self._make_cold_tier(mode, self._cold_state_from(body, files, load))
                self._delete_blobs(dead)
                self._readonly = False
                return self
            self._index.release(dead)
        self._tiers[COLD] = self._make_cold_tier(mode, self._cold_state_from(body, files, load))
        self._readonly = mode == "r"
        return self

    @staticmethod
    def _cold_state_from(body, files, load) -> dict:
        cold_state = dict(body["cold"])
        for k in files:
            if k.startswith("cold."):
                cold_state[k.split(".", 1)[1]] = load(k)
        return cold_state

    # Pickling: a store with a path travels as "reopen this path read-only" -----------------
    def __getstate__(self) -> dict[str, Any]:
        if self.path is not None:
            if not self._readonly and not self._closed:
                self.flush()
            return {"__reopen__": self.path, "options": {"verify": self._verify}}
        state = self.__dict__.copy()
        state.pop("_lock", None)
        state.pop("_local", None)
        state.pop("_gpu", None)
        state.pop("_writer_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "__reopen__" in state:
            other = TieredStore.open(state["__reopen__"], mode="r", **state["options"])
            self.__dict__.update(other.__dict__)
            return
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._local = threading.local()
        self._writer_lock = None
        self._gpu = maybe_gpu_decoder(self, self.__dict__.get("_gpu_option"))
