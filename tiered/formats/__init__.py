"""Import datasets into stores and export stores as datasets (used by ``tiered import/export``).

Formats:

=========  =====================================================================================
name       what
=========  =====================================================================================
d4rl       one flat HDF5 file (observations, actions, rewards, terminals, timeouts, ...)
minari     a dataset directory as the ``minari`` package writes it (``data/main_data.hdf5``)
torchrl    a TensorDict memmap directory (``TensorDict.load_memmap``; TorchRL dataset caches)
npz        a NumPy ``.npz`` archive (D4RL names or ``/``-joined TorchRL keys)
dqn-replay Dopamine's replay checkpoints, the DQN Replay Dataset (``<game>/<run>/replay_logs/``)
=========  =====================================================================================

Both directions stream: a source is read, and an export written, in slices of rows (4096, or
fewer so that a slice stays under 32 MiB), so datasets larger than RAM convert with bounded
memory. Outputs appear under their final name only once complete (written under a temporary
name, then renamed). The key mapping is in :mod:`tiered.formats.keymap`.

Example:
    >>> import tiered.formats as tf
    >>> tf.import_dataset("d4rl", "hopper-medium-v2.hdf5", "hopper.tiered")  # doctest: +SKIP
    ImportReport(rows=1000000, ...)
    >>> tf.export_dataset("hopper.tiered", "hopper-again.hdf5", "d4rl")  # doctest: +SKIP
    ExportReport(rows=1000000, ...)
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import struct
import time
import tokenize
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import TieredError, UnsupportedFormatError
from ..schema import NARROWABLE_DTYPES, Schema
from ..sidecar import read_source
from ..util.progress import progress_bar
from .common import (
    atomic_output,
    check_new_output,
    chronological_rows,
    write_source,
)

__all__ = ["FORMATS", "ImportReport", "ExportReport", "open_source", "import_dataset", "export_dataset"]

FORMATS = ("d4rl", "minari", "torchrl", "npz", "dqn-replay")

#: Flush the store being imported every this many rows: closes the time chunks still open
#: (their frames are held in memory until then) and spaces commits out, since each one writes
#: the index and row tables (O(capacity) bytes).
FLUSH_EVERY_ROWS = 1 << 18


@dataclass
class ImportReport:
    """What :func:`import_dataset` did."""

    rows: int
    seconds: float
    source_bytes: int
    store_bytes: int
    fields: list[str] = field(default_factory=list)
    derived: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else float("inf")


@dataclass
class ExportReport:
    """What :func:`export_dataset` did."""

    rows: int
    seconds: float
    output_bytes: int
    details: dict[str, Any] = field(default_factory=dict)


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.stat(path).st_blocks * 512
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UnsupportedFormatError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    return fmt


#: What the readers (h5py, zipfile, numpy's .npy header parser, tensordict) raise for a damaged or
#: foreign source; import reports them as :class:`UnsupportedFormatError` naming the source.
_SOURCE_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError, EOFError, SyntaxError,
                  tokenize.TokenError, zipfile.BadZipFile, zlib.error, struct.error)


@contextlib.contextmanager
def _source_errors(fmt: str, src: Any) -> Iterator[None]:
    try:
        yield
    except (TieredError, FileNotFoundError, MemoryError):
        raise
    except _SOURCE_ERRORS as e:
        raise UnsupportedFormatError(
            f"{os.fspath(src)}: cannot read it as a {fmt} dataset ({type(e).__name__}: {e}); the source is "
            "damaged or not of that format") from e


def _guarded_chunks(source: Any, chunk_rows: int | None, fmt: str, src: Any) -> Iterator[Any]:
    """``source.chunks(chunk_rows)`` with read errors reported as :func:`_source_errors` does (errors of
    the caller's work between two chunks are not touched)."""
    with _source_errors(fmt, src):
        it = iter(source.chunks(chunk_rows))
    while True:
        with _source_errors(fmt, src):
            try:
                td = next(it)
            except StopIteration:
                return
        yield td


def open_source(fmt: str, src: str | os.PathLike[str]) -> Any:
    """A reader of ``src`` in format ``fmt`` (``.num_rows``, ``.chunks()``, ``.attrs()``, ``.close()``).

    Raises:
        UnsupportedFormatError: ``src`` is not a readable dataset of that format (its subclasses
            :class:`~tiered.errors.InvalidDatasetError` and :class:`~tiered.errors.PickledDataError`
            say why); FileNotFoundError: there is no ``src``.
    """
    fmt = _check_format(fmt)
    with _source_errors(fmt, src):
        return _part(fmt, writer=False)(src)


#: format -> (module, reader class, writer function); a format's module (h5py, gzip readers, ...)
#: loads when that format is first used
_PARTS = {
    "d4rl": ("d4rl", "D4RLSource", "write_d4rl"),
    "minari": ("minari", "MinariSource", "write_minari"),
    "torchrl": ("torchrl_memmap", "TorchRLSource", "write_torchrl"),
    "npz": ("npz", "NpzSource", "write_npz"),
    "dqn-replay": ("dqn_replay", "DQNReplaySource", "write_dqn_replay"),
}


def _part(fmt: str, writer: bool) -> Any:
    module, reader_name, writer_name = _PARTS[fmt]
    return getattr(importlib.import_module(f".{module}", __name__), writer_name if writer else reader_name)


def import_dataset(
    fmt: str,
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    codec: str = "zstd",
    frames: dict[str | tuple[str, ...], int] | None = None,
    chunk_frames: int | None = None,
    capacity: int | None = None,
    backend: str = "memmap",
    chunk_rows: int | None = None,
    progress: bool | None = False,
    force: bool = False,
    dense_dtypes: dict[str | tuple[str, ...], Any] | None = None,
) -> ImportReport:
    """Import a dataset into a new store at ``dst``.

    Args:
        fmt: ``"d4rl"``, ``"minari"``, ``"torchrl"``, ``"npz"`` or ``"dqn-replay"``.
        src: the dataset (file or directory, per format).
        dst: the new store's directory (must not exist unless ``force``).
        codec: codec of the blob fields (``"zstd"``, ``"zstd:9"``, ``"lz4"``, ``"raw"``).
        frames: per key, the frame-stack dimension (``{"observation": 0}`` for ``[4, 84, 84]``);
            ``None``: found in the first slice, as :class:`~tiered.TieredStore` does (dqn-replay:
            ``{"observation": 0}``); ``{}``: none.
        chunk_frames: frames of one episode compressed together (``None``: the store's default).
        capacity: rows of the store (default: the dataset's rows; fewer keeps the last ones).
        backend: cold tier files, ``"memmap"`` or ``"hdf5"``.
        chunk_rows: rows per slice (default: 4096, fewer if a slice would pass 32 MiB).
        progress: show a progress bar (``None``: only on a terminal).
        force: replace an existing ``dst``.
        dense_dtypes: per dense key, a narrower dtype its column is stored in
            (``{"action": torch.uint8}``; see :class:`~tiered.TieredStore`); a value it cannot
            hold exactly stops the import (:class:`~tiered.errors.LossyValueError`, nothing left
            under ``dst``). ``None``: a format that can read its value ranges first picks them
            (dqn-replay: :meth:`~tiered.formats.dqn_replay.DQNReplaySource.narrow_dtypes`, unless
            ``capacity`` leaves room for more rows), other formats keep their dtypes; ``{}``: every
            column in its own dtype.

    Returns:
        An :class:`ImportReport`.

    Raises:
        UnsupportedFormatError: ``src`` is not a dataset of that format.
        StorageFullError: the disk filled up (nothing is left under ``dst``).
        StoreLockedError: ``force`` and ``dst`` is a store that a writer has open.
    """
    from ..store import TieredStore

    dst = check_new_output(dst, force=force)
    # replacing a store takes its writer lock in atomic_output (StoreLockedError while open)
    t0 = time.perf_counter()
    source = open_source(fmt, src)
    try:
        with _source_errors(fmt, src):
            n = source.num_rows
            attrs = source.attrs()
        if frames is None:  # a format of frame stacks says which (dqn-replay)
            frames = getattr(source, "frames", None)
        if n == 0:
            raise UnsupportedFormatError(f"{src}: the dataset has no rows")
        cap = n if capacity is None else int(capacity)
        if dense_dtypes is None and hasattr(source, "narrow_dtypes") and cap <= n:
            # a format that can read its value ranges first (dqn-replay: the action and reward
            # files) stores the columns in the narrowest dtypes that hold them exactly; a store
            # with room for more rows keeps the dataset's dtypes (what comes later may not fit)
            with _source_errors(fmt, src):
                dense_dtypes = source.narrow_dtypes(progress=progress)
        chunks = _guarded_chunks(source, chunk_rows, fmt, src)
        if dense_dtypes is not None and not dense_dtypes:
            # {}: every dense column in the dataset's own dtype (a store narrows the columns that
            # dense_dtypes does not name): named with their dtypes, from the first chunk
            first = next(chunks, None)
            if first is not None:
                dense_dtypes = {f.key: f.dtype for f in Schema.infer(first).dense_fields if f.dtype in NARROWABLE_DTYPES}
                chunks = itertools.chain([first], chunks)
        fields: list[str] = []
        with atomic_output(dst, force=force) as tmp:
            # warm_bytes=0 / hot_bytes=0: blobs go straight to the cold tier (files), so the
            # importer's memory does not grow with the dataset; stage_rows=0: slices are already
            # batches, and the slices of a source of large frames (one row each) must not wait
            # raw in the write stage (64 rows of 4096x4096 stacks would be 8 GiB)
            store = TieredStore(
                cap,
                tmp,
                codec=codec,
                frames=frames,
                **({} if chunk_frames is None else {"chunk_frames": chunk_frames}),
                backend=backend,
                warm_bytes=0,
                hot_bytes=0,
                stage_rows=0,
                dense_dtypes=dense_dtypes,
            )
            try:
                write_source(tmp, attrs)
                bar = progress_bar(n, f"import {fmt}", enabled=progress)
                since_flush = 0
                try:
                    for td in chunks:
                        store.extend(td)
                        since_flush += td.shape[0]
                        if since_flush >= FLUSH_EVERY_ROWS:
                            store.flush()
                            since_flush = 0
                        bar.update(td.shape[0])
                finally:
                    bar.close()
                store.flush()
                fields = ["/".join(f.key) for f in store.schema.values()] if store.schema else []
            finally:
                with contextlib.suppress(Exception):
                    store.close()
        src_path = os.fspath(src)
        return ImportReport(
            rows=n,
            seconds=time.perf_counter() - t0,
            source_bytes=_du(src_path) if os.path.exists(src_path) else 0,
            store_bytes=_du(dst),
            fields=fields,
            derived=["/".join(k) for k in attrs.get("derived", [])],
            dropped=list(attrs.get("dropped", [])),
        )
    finally:
        source.close()


def export_dataset(
    store_path: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    fmt: str,
    *,
    chunk_rows: int | None = None,
    progress: bool | None = False,
    force: bool = False,
    layout: str | None = None,
    dataset_id: str | None = None,
) -> ExportReport:
    """Export a store (read-only) as a dataset in format ``fmt`` at ``dst``.

    Rows are written oldest first. For a store made by :func:`import_dataset` from the same
    format, the output holds exactly the source's arrays (names, dtypes, shapes; derived fields
    dropped).

    Args:
        store_path: the store directory.
        dst: the output file (d4rl, npz) or directory (minari, torchrl, dqn-replay).
        fmt: ``"d4rl"``, ``"minari"``, ``"torchrl"``, ``"npz"`` or ``"dqn-replay"``.
        chunk_rows: rows per slice.
        progress: show a progress bar (``None``: only on a terminal).
        force: replace an existing ``dst`` (only once the new output is complete).
        layout: npz only: ``"ted"`` or ``"d4rl"`` array names.
        dataset_id: minari only: the ``dataset_id`` written into the metadata.

    Returns:
        An :class:`ExportReport`.
    """
    from ..store import TieredStore

    fmt = _check_format(fmt)
    dst = check_new_output(dst, force=force)
    t0 = time.perf_counter()
    source = read_source(store_path)
    store = TieredStore.open(store_path, mode="r", warm_bytes=0, hot_bytes=0)
    try:
        rows = chronological_rows(store)
        bar = progress_bar(int(rows.size), f"export {fmt}", enabled=progress)
        try:
            with atomic_output(dst, force=force) as tmp:
                # the one option of a format that others lack
                extra = {"minari": {"dataset_id": dataset_id}, "npz": {"layout": layout}}.get(fmt, {})
                details = _part(fmt, writer=True)(store, rows, tmp, source, chunk_rows, bar, **extra)
        finally:
            bar.close()
    finally:
        store.close()
    return ExportReport(
        rows=int(rows.size), seconds=time.perf_counter() - t0, output_bytes=_du(dst), details=details
    )
