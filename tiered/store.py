"""TieredStore: the public facade. It builds the engine's parts and delegates to them.

A store is a fixed-capacity ring of rows. Dense fields live in one uncompressed column tensor
each; blob fields are split into frames, deduplicated, grouped into time chunks, compressed in one
batched call and placed into the fastest tier with room. The parts (``tiered/engine/``):

* :class:`~tiered.engine.rows.RowSpace`: capacity, cursor, length, written rows, dense columns;
* :class:`~tiered.engine.write.WritePath`: validate -> plan -> encode -> place -> index, the stage;
* :class:`~tiered.engine.placement.Placement`: the tiers and every move between them (asks the policy);
* :class:`~tiered.engine.read.CpuReadPipeline` / :class:`~tiered.engine.gpu_read.GpuReadPipeline`: the reads;
* :class:`~tiered.durable.store_files.StoreFiles`: commits, opening, the writer lock;
* :class:`~tiered.durable.sharing.SharedWriting`: several writer processes (:meth:`TieredStore.share`);
* :func:`~tiered.engine.stats.store_stats`.

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

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import psutil
import torch
from tensordict import TensorDictBase

from . import codecs
from .durable.lock import SharedWriterLock
from .durable.sharing import SharedWriting
from .durable.store_files import StoreFiles, commit_parts, open_commit, options_of, read_fresh, restore_commit
from .engine.blob_index import COLD, BlobIndex
from .engine.gpu_read import GpuDecoder, GpuReadPipeline, maybe_gpu_decoder
from .engine.parts import build_parts
from .engine.priorities import checked_row_priorities
from .engine.read import CpuReadPipeline, ReadPipeline
from .engine.rows import IndexLike, as_row_array
from .engine.stats import store_stats
from .engine.transport import REPACK_FRAMES, CompressedRows, export_rows
from .engine.write import WriteOptions
from .errors import (
    InvalidArgumentError,
    ReadOnlyStoreError,
    StoreClosedError,
)
from .schema import Key, Schema

__all__ = ["TieredStore", "IndexLike", "as_row_array", "MAX_CAPACITY", "MAX_CHUNK_FRAMES", "MAX_STAGE_ROWS",
           "OPEN_OPTIONS"]

T = TypeVar("T")

#: The most rows a store can have (2**40): more cannot be indexed by its int64 blob tables' arithmetic
#: without overflow risks, and no machine holds the row metadata of more.
MAX_CAPACITY = 1 << 40
#: The most frames one blob may hold (``chunk_frames``); the write path also bounds a chunk's bytes.
MAX_CHUNK_FRAMES = 1 << 16
#: The most rows the write stage may hold (``stage_rows``).
MAX_STAGE_ROWS = 1 << 20
#: The write stage's rows by default: a flush of the stage has a fixed cost (~1,300 Python-level
#: calls of planning, encode, placement and row tables, a few ms on a 2-core VM) that 128 rows share
#: half as much per row as 64 (``python benchmarks/bench_stage_write.py --stage-rows 64 128``). It
#: holds 7.2 MB of 4x84x84 Atari stacks with next observations.
DEFAULT_STAGE_ROWS = 128

#: runtime options (they may change when a store is reopened), with their defaults
_RUNTIME_DEFAULTS: dict[str, Any] = dict(hot_bytes=None, warm_bytes=None, hot_device=None, device=None,
                                         policy="lru", verify=True, threads=None, promote=True, gpu_decode=None,
                                         stage_rows=DEFAULT_STAGE_ROWS)
#: the options :meth:`TieredStore.open` takes: the runtime ones
OPEN_OPTIONS = frozenset(_RUNTIME_DEFAULTS)


class TieredStore:
    """A fixed-capacity ring of rows with compressed, tiered blob fields.

    Args:
        capacity: number of rows; writing past it overwrites the oldest rows.
        path: a directory for the cold tier and the durable format. ``None`` keeps the store in
            memory (hot and warm tiers; past their budgets, a temporary spill tier: ``spill``).
        codec: codec spec for blob fields (``"zstd"``, ``"zstd:9"``, ``"lz4"``, ``"raw"``).
        blob_min_bytes: cells at least this large become blob fields.
        blob_keys: keys forced to blob fields. dense_keys: keys forced to dense fields.
        frames: per key, the cell dimension that is a stack of frames (``{"observation": 0}``
            for ``[4, 84, 84]`` stacks; ``("next", X)`` follows ``X``). ``None``: found by the first
            write (:mod:`tiered.engine.detect`), then fixed as if passed. ``{}``: none.
        chunk_frames: frames of one trajectory compressed together per blob (K; 1: least decode work per
            sample). ``None``: per family, as many as fit 64 KiB, at most 8 (84x84 uint8: 8; 113 kB: 1).
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
        dense_dtypes: per dense key, a narrower dtype its column is stored in, e.g.
            ``{"action": torch.uint8, ("collector", "traj_ids"): torch.int32}``: reads give the
            written dtype back; a value the narrower dtype cannot hold exactly is refused
            (:class:`~tiered.errors.LossyValueError`, nothing written). Such a column is read as a
            copy, never as a view (``get(copy=False)``).
        promote: copy sampled blobs up into faster tiers, as the policy decides.
        gpu_decode: with a CUDA ``device``: ``None`` decodes on the GPU when nvCOMP is installed,
            ``True`` requires it, ``False`` decodes on the CPU and copies.
        stage_rows: writes of at most ``stage_rows // 4`` rows (``ReplayBuffer.add``, a small collector batch) wait raw
            and are compressed together later (see :mod:`tiered.engine.stage`); staged rows are
            readable at once. ``0`` writes every call through.
        spill, spill_dir: without a path, blobs that the full memory tiers cannot hold move to a
            private directory made under ``spill_dir`` (default: the temp dir) at the first spill,
            removed on :meth:`close` and at exit (:mod:`tiered.tiers.spill`). ``spill=False``
            raises :class:`~tiered.errors.StorageFullError` instead.
    """

    def __init__(
        self,
        capacity: int,
        path: str | os.PathLike | None = None,
        *,
        # the layout (fixed when the store is created)
        codec: str = "zstd", blob_min_bytes: int = 1024, blob_keys: Iterable[str | Key] | None = None,
        dense_keys: Iterable[str | Key] | None = None, frames: Mapping[str | Key, int] | None = None,
        chunk_frames: int | None = None, dedup: bool = True, traj_key: str | Key | None = None, backend: str = "memmap",
        dense_dtypes: Mapping[str | Key, torch.dtype | str] | None = None,
        # the runtime (may change when the store is reopened)
        hot_bytes: int | str | None = None, warm_bytes: int | str | None = None,
        hot_device: str | torch.device | None = None, device: str | torch.device | None = None,
        policy: str = "lru", verify: bool = True, threads: int | None = None, promote: bool = True,
        gpu_decode: bool | None = None, stage_rows: int = DEFAULT_STAGE_ROWS,
        spill: bool = True, spill_dir: str | os.PathLike | None = None,
    ):
        _check_sizes(capacity, chunk_frames, stage_rows)
        _check_devices(hot_device, device)
        _check_spill(spill, spill_dir, path)
        self._start()
        options = WriteOptions(blob_min_bytes=blob_min_bytes, blob_keys=blob_keys, dense_keys=dense_keys,
                               frames=frames, chunk_frames=chunk_frames, dedup=dedup, traj_key=traj_key,
                               dense_dtypes=dense_dtypes)
        self._build(int(capacity), codec, options, BlobIndex(), dict(
            hot_bytes=hot_bytes, warm_bytes=warm_bytes, hot_device=hot_device, device=device, policy=policy,
            verify=verify, threads=threads, promote=promote, gpu_decode=gpu_decode, stage_rows=stage_rows,
            spill=spill, spill_dir=spill_dir))
        self._files = StoreFiles(os.fspath(path), backend) if path is not None else None
        self._backend = backend
        if self._files is not None:
            self._placement.tiers[COLD] = self._files.create()
            try:
                self._commit()
            except BaseException:
                self._files.release_lock()
                raise
            self._changed = False

    def _start(self) -> None:
        """What a store keeps for its life, whatever commit its parts were last built from."""
        self._lock: threading.RLock | SharedWriting = threading.RLock()
        #: set by share(): the store is written by several processes
        self._sharing: SharedWriting | None = None
        self._closed = False
        self._counters = {"blobs_decoded": 0, "gets": 0, "extends": 0}

    def _build(self, capacity: int, codec: str, options: WriteOptions, index: BlobIndex,
               runtime: dict[str, Any]) -> None:
        """Create the parts (no cold tier: the caller adds it when the store has a path)."""
        self._runtime = runtime
        self._codec, self._device, self._rows, self._index, self._placement, self._write = build_parts(
            capacity, codec, options, index, **runtime)
        #: whether anything changed since the last commit (a flush of an unchanged store writes nothing)
        self._changed = True
        self._make_readers()

    def _build_from(self, path: str, body: dict[str, Any], mode: str, runtime: dict[str, Any], lock: Any) -> None:
        """Build the parts from the commit ``body`` of the store at ``path`` (an open; a shared
        store's reload of another process's commit)."""
        files = StoreFiles(path, body.get("backend", "memmap"), read_only=mode == "r")
        self._build(int(body["capacity"]), body["codec"], options_of(body), files.blob_index(body), runtime)
        self._files, self._backend = files, files.backend
        restore_commit(files, body, mode, self._rows, self._write, self._placement)
        files.writer_lock = lock
        self._changed = False

    def _open_path(self, path: str, mode: str, shared: bool, options: dict[str, Any]) -> None:
        """Open the store at ``path`` into this new object (:meth:`open`, unpickling)."""
        if shared and mode != "r+":
            raise InvalidArgumentError(f"shared=True opens a store for writing: pass mode='r+', not {mode!r}")
        self._start()

        def build(body: dict[str, Any], lock: Any) -> None:
            runtime = {**_RUNTIME_DEFAULTS, "policy": body.get("policy", "lru"), **options}
            self._build_from(path, body, mode, runtime, lock)

        if not shared:
            open_commit(path, mode, build, take_lock=True)
            return
        lock = SharedWriterLock(path)
        lock.acquire()
        try:
            open_commit(path, mode, build, take_lock=False)
            self._share(lock)
        finally:
            lock.release()

    def _make_readers(self) -> None:
        rt = self._runtime
        self._cpu_reader = CpuReadPipeline(self._index, self._placement, self._counters, self._codec,
                                           verify=rt["verify"], promote=rt["promote"], stale=self._stale)
        self._reader: ReadPipeline = self._cpu_reader
        self._gpu: GpuDecoder | None = None
        self.use_gpu_decoder(maybe_gpu_decoder(self._device, rt["gpu_decode"]))

    def _stale(self) -> tuple[int, int] | None:
        return self._files.newer_generation() if self._files is not None else None

    def _check_open(self, mode: str = "") -> None:
        if self._closed:
            raise StoreClosedError(f"the store is closed; reopen it with tiered.open(path{mode})")

    def _check_writable(self) -> None:
        self._check_open(", mode='r+'")
        if self.read_only:
            raise ReadOnlyStoreError(
                f"store {self.path!r} was opened read-only (mode='r'); reopen with mode='r+' to write")
        # every write's one gate (extend, set, clear, flush, share): a forked copy of a store that
        # spilled is refused here, before any of them changes a row
        self._placement.check_writable()

    # -- Several writer processes ------------------------------------------------------------------
    def share(self) -> TieredStore:
        """Let other processes write this store too, each through its own open of the path.

        The store commits, gives up the writer lock it held since it was opened, and from then on
        takes it for the span of each call instead (waiting while another process holds it). A
        call first reloads the latest commit if another process committed since this one last
        looked, and a call that changed the store commits before it returns. So every process
        sees every other's writes, at the cost of a commit per writing call and a reload after
        another process's commit. Open the store in the other processes with
        ``tiered.open(path, mode="r+", shared=True)``, or pickle it to them (a shared store
        travels as "reopen shared"; a ``fork``ed child may use its copy directly). A process
        killed during a call leaves the last commit intact: the others go on from it.

        Returns:
            This store.

        Raises:
            InvalidArgumentError: an in-memory store (there is no path to share).
            ReadOnlyStoreError, StoreClosedError: as for writes.

        Example:
            >>> import tempfile, torch, tiered
            >>> from tensordict import TensorDict
            >>> d = tempfile.mkdtemp() + "/s"
            >>> a = TieredStore(8, d).share()
            >>> b = tiered.open(d, mode="r+", shared=True)   # another process would do the same
            >>> _ = a.extend(TensorDict({"x": torch.arange(3.0)}, [3]))
            >>> len(b), b.get(2)["x"].item()
            (3, 2.0)
            >>> _ = b.extend(TensorDict({"x": torch.ones(2)}, [2]))
            >>> len(a), a.cursor
            (5, 5)
        """
        with self._lock:
            if self._sharing is not None:
                return self
            self._check_writable()
            if self._files is None:
                raise InvalidArgumentError(
                    "an in-memory store cannot be shared with other processes: create it with a path "
                    "(TieredStore(capacity, path)) and share() that")
            self.flush()
            self._files.release_lock()
            self._share(SharedWriterLock(self._files.path))
        return self

    @property
    def shared(self) -> bool:
        """Whether the store is written by several processes (:meth:`share`)."""
        return self._sharing is not None

    def _share(self, lock: SharedWriterLock) -> None:
        self._sharing = SharedWriting(self._files.path, lock, reload=self._reload, pending=self._pending,
                                      commit=self.flush)
        self._lock = self._sharing

    def _reload(self) -> None:
        """(Shared, under the lock) rebuild the parts from the latest commit, another process's."""
        old, path = self._placement, self._files.path
        open_commit(path, "r+", lambda body, lock: self._build_from(path, body, "r+", self._runtime, lock),
                    take_lock=False)
        old.close()

    def _pending(self) -> bool:
        return self._changed

    def _fresh(self) -> None:
        """Bring a shared store up to the latest commit (nothing for a store of one process)."""
        if self._sharing is not None:
            with self._lock:
                pass

    # -- Properties --------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Number of rows the ring holds."""
        return self._rows.capacity

    @property
    def path(self) -> str | None:
        """The store's directory (None for an in-memory store)."""
        return self._files.path if self._files is not None else None

    @property
    def schema(self) -> Schema | None:
        """The schema, fixed by the first write (``None`` before it)."""
        self._fresh()
        return self._write.schema

    @property
    def codec(self) -> codecs.Codec:
        return self._codec

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def cursor(self) -> int:
        """Row index the next :meth:`extend` writes first."""
        self._fresh()
        return self._rows.cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        with self._lock:
            self._rows.set_cursor(value)
            self._changed = True

    @property
    def read_only(self) -> bool:
        """True for a store opened with ``mode="r"``."""
        return self._files is not None and self._files.read_only

    @property
    def generation(self) -> int:
        """The commit this store last wrote or opened (0 for an in-memory store)."""
        return self._files.generation if self._files is not None else 0

    @property
    def gpu_decoder(self) -> GpuDecoder | None:
        """The :class:`~tiered.engine.gpu_read.GpuDecoder` the store reads through (None: the CPU pipeline)."""
        return self._gpu

    @property
    def options(self) -> dict[str, Any]:
        """The constructor options that fix the layout (pass them to a new store to copy it).

        Example:
            >>> s = TieredStore(10, frames={"observation": 0})
            >>> TieredStore(20, **s.options).options["frames"]
            {('observation',): 0}
        """
        return {"codec": self._codec.name, **self._write.options.as_kwargs(), "backend": self._backend}

    @contextlib.contextmanager
    def locked(self) -> Iterator[TieredStore]:
        """Hold the store's lock for a block: other threads' reads and writes wait, so a sequence
        of calls (write, then set the length) is seen as one.

        Example:
            >>> s = TieredStore(4)
            >>> with s.locked():
            ...     s.set_length(0)
        """
        with self._lock:
            yield self

    def set_length(self, length: int) -> None:
        """Set the number of readable rows directly (clipped to ``[0, capacity]``); the cursor does
        not move. TorchRL storages adjust their length this way after a write."""
        with self._lock:
            self._rows.set_length(length)
            self._changed = True

    def __len__(self) -> int:
        self._fresh()
        return self._rows.length

    def __repr__(self) -> str:
        return (f"TieredStore(rows={len(self)}, capacity={self.capacity}, codec={self._codec.name!r}, "
                f"path={self.path!r})")

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- Writing -----------------------------------------------------------------------------------
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
            self._changed = True
            rows = self._write.append(data)
            self._counters["extends"] += 1
            return torch.from_numpy(rows)

    def set(self, index: IndexLike, data: TensorDictBase, *, length: int | None = None,
            cells: Mapping[Key, torch.Tensor] | None = None) -> None:
        """Overwrite rows at ``index`` (ints, slices, lists, arrays or tensors; duplicates: last wins).

        Rows may lie beyond the length (up to the capacity): the length grows to cover them, and
        rows in between that were never written stay *holes*: reading one raises
        :class:`~tiered.errors.UnwrittenRowError`, never another row's data.

        Args:
            index: the rows to write. An integer index of several dimensions takes data of that
                batch shape (as TorchRL's storages do).
            data: a TensorDict of matching batch size (or a single row for an int index).
            length: the store's length after the write. By default rows beyond the current
                length extend it; pass the current ``len(store)`` to leave it unchanged (TorchRL's
                ``set_cursor=False``). The cursor does not move.
            cells: what ``store.schema.match(data, batch_dims)`` returned for this ``data``
                (``batch_dims`` 0 for an int index, else 1), when the caller already walked
                ``data`` with it: a small write then does not walk it again (TorchRL's
                ``rb.add``). Values are still checked as for any write.

        Raises:
            SchemaMismatchError: the data does not match the schema or the index (nothing written).
            IndexOutOfRangeError: an index outside ``[-capacity, capacity)`` (nothing written).
        """
        with self._lock:
            self._check_writable()
            self._changed = True
            self._write.overwrite(index, data, length, None if cells is None else dict(cells))

    def set_columns(self, index: IndexLike, data: TensorDictBase) -> bool:
        """Overwrite some dense fields of rows already written, in their columns: the blob fields
        (frames) are not read, decoded or compressed again, so this costs what the columns hold
        (an advantage or a relabeled reward written back, ``rb.set_at_``). The length, the cursor
        and every other field stay as they are.

        Args:
            index: rows already written (ints, slices, lists, arrays or tensors; no repeats).
            data: a TensorDict of batch size ``[len(rows)]`` holding only dense fields of the
                schema that have a column of their own: not a frame field, a bool flag (``done``
                and the like share a byte), a field that cuts trajectories (done keys, the
                trajectory key) or a field stored as its row numbers.

        Returns:
            True when the columns were written; False when the write is not one this method takes
            (the cases above, a row never written, repeated rows, cells of other shapes), and
            nothing changed: write whole rows with :meth:`set` then.

        Raises:
            LossyValueError: a value a ``dense_dtypes`` column cannot hold (nothing is written).
            IndexOutOfRangeError: an index outside ``[-capacity, capacity)`` (nothing is written).

        Example:
            >>> from tensordict import TensorDict
            >>> s = TieredStore(8, frames={"obs": 0})
            >>> _ = s.extend(TensorDict(obs=torch.zeros(4, 2, 16, 16, dtype=torch.uint8),
            ...                         adv=torch.zeros(4), batch_size=[4]))
            >>> s.set_columns([1, 3], TensorDict(adv=torch.tensor([0.5, -1.0]), batch_size=[2]))
            True
            >>> s.get(torch.arange(4))["adv"].tolist()
            [0.0, 0.5, 0.0, -1.0]
        """
        with self._lock:
            self._check_writable()
            if not isinstance(data, TensorDictBase) or len(data.batch_size) != 1:
                return False  # (one batch dimension, as the docstring asks: anything else is set's)
            rows = self._rows.resolve_write(index, int(data.batch_size[0]))
            done = self._write.set_columns(rows, data)
            self._changed = self._changed or done
            return done

    def clear(self) -> None:
        """Forget every row and release every blob (length and cursor go back to 0)."""
        with self._lock:
            self._check_writable()
            self._changed = True
            self._write.clear()

    # -- Reading -----------------------------------------------------------------------------------
    def get(self, index: IndexLike, keys: Iterable[str | Key] | None = None, *,
            index_key: str | None = None, copy: bool = True) -> TensorDictBase:
        """Read rows.

        Args:
            index: an int (no batch dimension in the result), a list, numpy array, tensor, range,
                slice or bool mask (of ``len`` or ``capacity`` entries). Negative ints count from
                the end of the written rows; slices clip to ``len``. An integer index of several
                dimensions gives a result of that batch shape (as TorchRL's storages do).
            keys: only these fields (a key, or a list of keys; nested keys as tuples); the others
                are not decoded.
            index_key: also return each row's position (int64, negative indices resolved)
                under this key, as TorchRL's storages return ``"index"``.
            copy: with False, a step-1 slice of a writer's store returns the dense columns as views
                of its columns (as TorchRL's ``TensorStorage`` does for ``storage[:]``): writing to
                them writes to the store, and later writes show through. Blob fields are always
                fresh tensors, and so are narrowed columns (``dense_dtypes``), flags (``done``, ...)
                and every column of a read-only or shared store (files other processes rewrite back
                them, docs/durability.md): writes to those do not reach the store.

        Returns:
            A TensorDict of batch size ``[n]`` (or ``[]`` for an int index) on ``device``.

        Raises:
            IndexOutOfRangeError: an index outside ``[-len, len)``, or a bool mask of another length.
            UnwrittenRowError: a row that was never written (a hole left by :meth:`set`).
            ChecksumError: a blob's stored bytes do not match their checksum.
        """
        with self._lock:
            self._check_open()
            rows, scalar = self._resolve_read(index)
            td = self._read_rows(index, rows, keys, index_key, copy)
            return td[0] if scalar else td

    def get_compressed(self, index: IndexLike, keys: Iterable[str | Key] | None = None, *, repack: bool = False,
                       repack_frames: int = REPACK_FRAMES) -> CompressedRows:
        """:meth:`get`'s rows with blob fields still compressed: :func:`tiered.engine.transport.export_rows`."""
        with self._lock:
            self._check_open()
            args = (self._cpu_reader, self._rows, self._write, self._resolve_read(index)[0], keys)
            return self._checked_read(lambda: export_rows(*args, repack=repack, repack_frames=repack_frames))

    def _resolve_read(self, index: IndexLike) -> tuple[np.ndarray, bool]:
        stage = self._write.stage
        return self._rows.resolve_read(index, stage.staged if stage is not None and stage.count else None)

    def _read_rows(self, index: Any, rows: np.ndarray, keys: Any, index_key: str | None, copy: bool) -> Any:
        """:meth:`get`'s read of ``rows``, checked (:meth:`_checked_read`).

        ``copy=False`` gives views of the dense columns only where nothing but this process
        rewrites the files their pages may be mapped from. A read-only open maps its commit's copy
        files, which the writer's later commits rewrite in place; a shared store's columns are
        reloaded from files that other processes rewrite: a view there would come to show rows of
        neither commit, so such a store returns copies."""
        copy = copy or self._sharing is not None or self.read_only
        return self._checked_read(lambda: self._reader.get_rows(self._rows, self._write, index, rows, keys,
                                                                index_key, copy, self._device))

    def _checked_read(self, read: Callable[[], T]) -> T:
        """``read()``, or :class:`~tiered.errors.StaleReadError` where the writer may have rewritten
        what it used (a read-only open, a process forked from the writer): see
        :func:`~tiered.durable.store_files.read_fresh`."""
        return read_fresh(self._files, read, verify=self._runtime["verify"])

    def rows_of(self, index: IndexLike) -> np.ndarray:
        """The row positions :meth:`get` reads for ``index`` (negative indices resolved).

        Raises:
            IndexOutOfRangeError: as :meth:`get` does.

        Example:
            >>> from tensordict import TensorDict
            >>> s = TieredStore(8)
            >>> _ = s.extend(TensorDict({"x": torch.arange(5)}, batch_size=[5]))
            >>> s.rows_of([-1, 0]).tolist(), s.rows_of(slice(3, None)).tolist()
            ([4, 0], [3, 4])
        """
        with self._lock:
            return self._resolve_read(index)[0]

    def use_gpu_decoder(self, decoder: GpuDecoder | None) -> None:
        """Decode blob fields with ``decoder`` (a :class:`~tiered.engine.gpu_read.GpuDecoder`), or go back
        to the CPU pipeline with None. :meth:`GpuDecoder.attach` calls this."""
        with self._lock:
            self._gpu = decoder
            self._reader = self._cpu_reader if decoder is None else GpuReadPipeline(
                decoder, self._index, self._placement, self._counters, self._cpu_reader,
                promote=self._runtime["promote"], stale=self._stale)
            self._placement.on_hot_write = None if decoder is None else decoder.fence_writes

    # -- Priorities, stats, lifecycle --------------------------------------------------------------
    def set_priority(self, index: IndexLike, priority: torch.Tensor | np.ndarray | float) -> None:
        """Set per-row priorities; a blob gets the max over the rows that reference it now, which
        with ``policy="priority"`` decides the blobs kept in the fast tiers (rows start at 1.0;
        a row named twice takes its last value; see :mod:`tiered.engine.priorities`).

        Args:
            index: rows, as for :meth:`get`.
            priority: one value per row, or one for all (finite, >= 0).

        Raises:
            InvalidPriorityError: a value is NaN, infinite or negative (the message names the
                rows); nothing changes.
            IndexOutOfRangeError: as :meth:`get`.

        Example:
            >>> from tensordict import TensorDict
            >>> s = TieredStore(8, policy="priority")
            >>> _ = s.extend(TensorDict({"x": torch.zeros(4, 32, 32)}, [4]))
            >>> s.set_priority([0, 1], [0.5, 2.0])
            >>> s.priorities([0, 1, 2]).tolist()
            [0.5, 2.0, 1.0]
        """
        with self._lock:
            self._check_open()
            rows, _ = self._resolve_read(index)
            values = checked_row_priorities(rows, priority)
            self._placement.set_row_priorities(self._write.layout, rows, values, self._write.stage)
            self._changed = True  # priorities are saved by commits

    def priorities(self, index: IndexLike) -> np.ndarray:
        """The priority of each row of ``index`` (float64; see :meth:`set_priority`)."""
        with self._lock:
            rows, _ = self._resolve_read(index)
            return self._checked_read(lambda: self._placement.priorities.of(rows))

    @property
    def priority_alpha(self) -> float:
        """The exponent of the sampling distribution, ``P(row) ~ priority ** alpha``, that
        :meth:`stats` uses for ``probability_mass`` and the ``priority`` policy to rank blobs (1.0
        by default; TorchRL's prioritized samplers set theirs through ``TieredStorage``)."""
        return self._placement.priorities.alpha

    @priority_alpha.setter
    def priority_alpha(self, value: float) -> None:
        with self._lock:
            self._placement.set_alpha(value, self._write.layout, self._write.stage)

    def stats(self) -> dict[str, Any]:
        """Memory and traffic figures: rows, blobs, per field its bytes and ratios, per tier its bytes,
        budget, hits, moves and probability share (keys: :func:`tiered.engine.stats.store_stats`)."""
        with self._lock, (self._files.borrowed_pages() if self._files is not None else contextlib.nullcontext()):
            # a read-only open checks its index at first use: these figures use all of it (its
            # pages given back after), and the written mask only to weigh rows by priority
            self._index.check_ids(None)
            if self._rows.written_check is not None and self._placement.priorities is not None:
                self._rows.written_check.all()
            return store_stats(self._rows, self._write.layout, self._index, self._placement, self._write.stage,
                               self._codec.name, self._counters, self._gpu.stats() if self._gpu else None)

    def flush(self, *, force: bool = False) -> None:
        """Close open time chunks (compress and place them); with a path, commit durably (with
        ``force``, even if nothing changed)."""
        with self._lock:
            self._check_writable()
            if self._files is not None and not (self._changed or self._rows.live_views()) and not force:
                return  # nothing to commit: an unchanged store gets no new generation
            self._write.flush_stage()
            self._write.close_open_chunks()
            self._commit()
            self._changed = False

    def close(self) -> None:
        """Flush (stores with a path) and release memory, files and handles. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._files is not None and not self.read_only:
                    self.flush()
            finally:
                self._placement.close()
                self._closed = True
                if self._files is not None:
                    self._files.release_lock()
                if self._sharing is not None:
                    self._sharing.close()

    # Pickling: a store with a path travels as "reopen this path" (shared: for writing) ---------
    def __getstate__(self) -> dict[str, Any]:
        if self._files is not None:
            if not self.read_only and not self._closed:
                self.flush()
            return {"__reopen__": self._files.path, "shared": self._sharing is not None,
                    "options": {"verify": self._runtime["verify"]}}
        # the lock and the read pipelines are rebuilt on unpickling (a GPU decoder stays behind)
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_gpu", "_reader", "_cpu_reader")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "__reopen__" in state:
            shared = state.get("shared", False)
            self._open_path(state["__reopen__"], "r+" if shared else "r", shared, state["options"])
            return
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._make_readers()



    # -- The durable format (docs/format.md; tiered/durable/store_files.py) -------------------------
    def _commit(self) -> None:
        """Durably publish the current state (no-op without a path or read-only)."""
        if self._files is not None:
            commit_parts(self._files, self._rows, self._write, self._placement, self._codec.name)

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "r", *, shared: bool = False, **options: Any) -> TieredStore:
        """Open an existing store (see :func:`tiered.open`).

        ``mode="r+"`` takes the store's writer lock (:class:`~tiered.errors.StoreLockedError` if
        another writer holds it); ``"r"`` takes none, so any number of readers can open it.
        ``shared=True`` (with ``"r+"``) opens a store that several processes write: see :meth:`share`.
        A manifest or array that is damaged or inconsistent raises
        :class:`~tiered.errors.CorruptionError` naming the store, never a raw ``KeyError``.
        """
        _check_open_options(options)
        store = cls.__new__(cls)
        store._open_path(os.fspath(path), mode, shared, options)
        return store


def _check_sizes(capacity: Any, chunk_frames: Any, stage_rows: Any) -> None:
    """Refuse sizes the store cannot honour before anything is allocated.

    Raises:
        InvalidArgumentError: naming the argument, its bounds and what was given.
    """
    def is_int(x: Any) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, np.integer))

    if not is_int(capacity) or not 0 < capacity <= MAX_CAPACITY:
        raise InvalidArgumentError(f"capacity must be an int in [1, {MAX_CAPACITY}] (2**40), got {capacity!r}")
    if chunk_frames is not None and (not is_int(chunk_frames) or not 0 < chunk_frames <= MAX_CHUNK_FRAMES):
        raise InvalidArgumentError(
            f"chunk_frames must be None or an int in [1, {MAX_CHUNK_FRAMES}], got {chunk_frames!r} (4 to 64 frames per "
            "blob compress well; more only costs decode work per sample)")
    if not is_int(stage_rows) or not 0 <= stage_rows <= MAX_STAGE_ROWS:
        raise InvalidArgumentError(
            f"stage_rows must be an int in [0, {MAX_STAGE_ROWS}] (0 disables staging), got {stage_rows!r}")
    memory = psutil.virtual_memory().total
    if capacity > memory:  # one byte per row (the written mask) is held in memory from the start
        raise InvalidArgumentError(
            f"capacity {capacity:,} needs at least {capacity:,} bytes of row metadata in memory, more than "
            f"this machine's {memory:,}; lower the capacity")


def _check_spill(spill: Any, spill_dir: Any, path: Any) -> None:
    """Refuse spill options that cannot be honoured, before anything is made.

    Raises:
        InvalidArgumentError: ``spill`` is not a bool; ``spill_dir`` with a path (the cold tier
            at the path already holds every blob), or naming something that is not a directory.
    """
    if not isinstance(spill, bool):
        raise InvalidArgumentError(f"spill must be True or False, got {spill!r}")
    if spill_dir is None:
        return
    if path is not None:
        raise InvalidArgumentError(
            f"spill_dir={os.fspath(spill_dir)!r} is for stores without a path; this store's cold tier at "
            f"{os.fspath(path)!r} already holds every blob on disk. Drop spill_dir, or drop the path")
    if not spill:
        raise InvalidArgumentError("spill_dir= was given with spill=False; drop one of them")
    if os.path.exists(spill_dir) and not os.path.isdir(spill_dir):
        raise InvalidArgumentError(
            f"spill_dir={os.fspath(spill_dir)!r} exists and is not a directory; pass a directory (it is "
            "created if missing)")


def _check_open_options(options: dict[str, Any]) -> None:
    """Refuse options that cannot change when a store is reopened, and missing devices."""
    unknown = set(options) - OPEN_OPTIONS
    if unknown:
        raise TypeError(f"options {sorted(unknown)} cannot change on open; allowed: {sorted(OPEN_OPTIONS)}")
    _check_devices(options.get("hot_device"), options.get("device"))


def _check_devices(hot_device: Any, device: Any) -> None:
    """Refuse a device this machine does not have (a CUDA hot tier without CUDA would silently be
    no hot tier at all).

    Raises:
        InvalidArgumentError: naming the device and the devices present.
    """
    for name, value in (("hot_device", hot_device), ("device", device)):
        if value is None:
            continue
        try:
            dev = torch.device(value)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgumentError(f"{name}={value!r} is not a device ({e})") from None
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0 or (dev.index is not None and dev.index >= count):
                raise InvalidArgumentError(
                    f"{name}={value!r}, but this machine has {count} CUDA device(s) "
                    f"(torch.cuda.is_available() is {torch.cuda.is_available()}); pass {name}='cpu' or leave "
                    "it out (the default picks CUDA when present)")
