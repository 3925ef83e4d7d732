"""Every exception raised by :mod:`tiered`.

All of them derive from :class:`TieredError`, and most also derive from the built-in
exception a caller would naturally catch (``TypeError`` for a schema mismatch,
``IndexError`` for a bad index, ``OSError`` for a full disk, ``ImportError`` for a
missing optional package), so existing ``except`` clauses keep working.

Messages follow one rule: say what was expected, what was given, and what to do.

Example:
    >>> import tiered
    >>> try:
    ...     raise tiered.errors.IndexOutOfRangeError("index 7 is out of range for a store of length 3")
    ... except IndexError as e:
    ...     print(type(e).__name__)
    IndexOutOfRangeError
"""

from __future__ import annotations

__all__ = [
    "TieredError",
    "SchemaMismatchError",
    "IndexOutOfRangeError",
    "CorruptionError",
    "ChecksumError",
    "StaleReadError",
    "FormatVersionError",
    "NotATieredStoreError",
    "StorageFullError",
    "CodecUnavailableError",
    "UnknownCodecError",
    "StoreLockedError",
    "StoreClosedError",
    "ReadOnlyStoreError",
    "InvalidPriorityError",
    "UnsupportedFormatError",
    "StoreExistsError",
    "UnwrittenRowError",
    "InvalidArgumentError",
    "InvalidDatasetError",
    "PickledDataError",
    "NotSharedError",
    "ShardFailedError",
    "RaggedDataError",
    "LossyValueError",
    "DeviceFailedError",
    "TieredWarning",
    "LowCompressionWarning",
]


class TieredError(Exception):
    """Base class of every error raised by tiered."""


class SchemaMismatchError(TieredError, TypeError):
    """Data does not match the store's schema (keys, dtype or per-row shape).

    Raised before anything is written: the store is unchanged.
    """


class IndexOutOfRangeError(TieredError, IndexError):
    """A row index is outside ``[-len, len)`` or names a row that was never written."""


class CorruptionError(TieredError):
    """A file of the store is damaged, truncated or inconsistent."""


class ChecksumError(CorruptionError):
    """The checksum of a blob's compressed bytes does not match the one recorded at write time."""


class StaleReadError(ChecksumError):
    """A reader fell behind the store's writer: the files of the commit it reads may have been
    reused by the writer's later commits, so what it read is not returned (reopen the store).

    Raised by a read-only open, or by a process forked from a writer, once the writer has gone
    far enough past the commit the reader started from; the files are most likely not damaged.
    A subclass of :class:`ChecksumError` (what such readers raised before it existed).
    """


class FormatVersionError(CorruptionError):
    """The store is in an on-disk format version other than the one this tiered reads (there is
    no converter: the message says how to rewrite the store)."""


class NotATieredStoreError(CorruptionError, FileNotFoundError):
    """The path does not hold a tiered store (no manifest, or a manifest of something else)."""


class StorageFullError(TieredError, OSError):
    """No tier (or the disk) has room for the data; nothing referenced by a row was dropped."""


class CodecUnavailableError(TieredError, ImportError):
    """A codec's package is not installed (the message names the install command)."""


class UnknownCodecError(TieredError, ValueError):
    """A codec string does not name a known codec (the message lists the known ones)."""


class StoreLockedError(TieredError, OSError):
    """Another writer holds the store's lock file."""


class StoreClosedError(TieredError, ValueError):
    """The store was closed; reopen it with :func:`tiered.open`."""


class ReadOnlyStoreError(TieredError, PermissionError):
    """A write was attempted on a store opened with ``mode="r"``."""


class InvalidPriorityError(TieredError, ValueError):
    """A priority is NaN, infinite or negative."""


class UnsupportedFormatError(TieredError, ValueError):
    """An import/export format name or file layout is not supported."""


class StoreExistsError(TieredError, FileExistsError):
    """A new store was asked for at a path that already holds one (open it with :func:`tiered.open`)."""


class UnwrittenRowError(IndexOutOfRangeError):
    """A read names rows that were never written (holes left by ``set`` beyond the length).

    Their cells would be zeros or another row's data, so they are never returned.
    """


class InvalidArgumentError(TieredError, ValueError):
    """An argument is outside what the store can honour (a capacity too large to index, a device
    this machine does not have); raised before anything is allocated or written."""


class LossyValueError(TieredError, ValueError):
    """A value does not fit the narrower dtype its dense column is stored in (``dense_dtypes``):
    storing it would change it. Raised before anything is written: the store is unchanged."""


class InvalidDatasetError(UnsupportedFormatError):
    """A source is a dataset of the format but its content is inconsistent (a per-row column of the
    wrong length); the message names the column, the expected and the actual lengths."""


class PickledDataError(UnsupportedFormatError):
    """A source holds pickled Python objects. tiered never unpickles data (unpickling can run
    arbitrary code), so the source is refused; convert those fields to tensors or remove them."""


class RaggedDataError(SchemaMismatchError, RuntimeError):
    """Rows of one write do not share one shape: a list whose elements have different tree
    structures or leaf shapes, or a lazy stack of differently shaped tensordicts. Every stored
    row has the same fields and cell shapes; pad the rows, or keep ragged data in TorchRL's
    ``ListStorage`` / ``LazyStackStorage``."""


class NotSharedError(TieredError, RuntimeError):
    """A write to a copy of an in-memory storage that another process received: its writes would
    never reach the original (give the store a path and write from one process)."""


class ShardFailedError(TieredError, RuntimeError):
    """A shard of a sharded store (:mod:`tiered.ray`) died or cannot be reached.

    The message names the shard (its number, actor and directory), says whether it was
    restarted from its last commit and how many rows were lost with it (those written since its
    last flush), and what to do. ``shard``, ``lost_rows`` and ``restarted`` hold the same facts;
    ``lost_priority_updates`` counts the row priorities set since its last flush that it lost.
    """

    def __init__(self, message: str, *, shard: int = -1, lost_rows: int = 0, restarted: bool = False,
                 lost_priority_updates: int = 0):
        super().__init__(message)
        self.shard = shard
        self.lost_rows = lost_rows
        self.restarted = restarted
        self.lost_priority_updates = lost_priority_updates


class DeviceFailedError(TieredError, RuntimeError):
    """The CUDA device stopped working in this process (a sticky CUDA error, such as an illegal
    memory access, ends the process's CUDA context): no CUDA call can succeed here any more, so
    neither can a CPU fallback that returns data on the device. The message names the failed
    call and the CUDA error; restart the process (a training script: from its last checkpoint),
    or decode on the CPU with ``gpu_decode=False``."""


class TieredWarning(UserWarning):
    """Base class of every warning tiered gives (filter them all with
    ``warnings.filterwarnings("ignore", category=tiered.errors.TieredWarning)``)."""


class LowCompressionWarning(TieredWarning):
    """Given once per field at a store's first write: a field of at least 1 KiB per row that
    compresses less than 4x, or a floating-point field whose ``("next", X)`` is ``X`` one row
    later but whose frame stacks were not found (pixels normalized after frame stacking, as
    TorchRL's ``VecNorm`` after ``CatFrames`` does). The message names the field, its measured
    ratio and the page that says what to change (docs/torchrl-pipelines.md). Nothing is wrong
    with the data: it is stored losslessly either way, only larger."""
