"""tiered: compressed, tiered storage for RL replay buffers and offline datasets.

Hot compressed blobs live in GPU memory, warm ones in pinned host memory, cold ones in files;
a whole batch is decompressed in one call (nvCOMP on a GPU, multi-threaded zstd on a CPU);
each frame is stored once. ``tiered.torchrl.TieredStorage`` is a drop-in TorchRL storage.

Example:
    >>> import torch, tiered
    >>> from tensordict import TensorDict
    >>> store = tiered.TieredStore(1000)
    >>> _ = store.extend(TensorDict({"pixels": torch.zeros(4, 84, 84, dtype=torch.uint8)}, batch_size=[4]))
    >>> store.get([0, 3])["pixels"].shape
    torch.Size([2, 84, 84])
"""

from __future__ import annotations

from . import errors
from .codecs import Codec, get_codec
from .errors import (
    ChecksumError,
    CodecUnavailableError,
    CorruptionError,
    FormatVersionError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidDatasetError,
    InvalidPriorityError,
    NotATieredStoreError,
    PickledDataError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    StorageFullError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    TieredError,
    UnknownCodecError,
    UnsupportedFormatError,
    UnwrittenRowError,
)
from .schema import Field, Schema
from .store import TieredStore
from .version import __version__

__all__ = [
    "TieredStore",
    "open",
    "Schema",
    "Field",
    "Codec",
    "get_codec",
    "errors",
    "TieredError",
    "SchemaMismatchError",
    "IndexOutOfRangeError",
    "CorruptionError",
    "ChecksumError",
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
    "__version__",
]


def open(path, mode: str = "r", **options) -> TieredStore:  # noqa: A001 - mirrors h5py.File / zarr.open
    """Open an existing store directory.

    Args:
        path: the store's directory.
        mode: ``"r"`` (read-only; any number of readers) or ``"r+"`` (one writer).
        **options: runtime options (``warm_bytes``, ``hot_bytes``, ``device``, ``verify``, ...).
    """
    return TieredStore.open(path, mode=mode, **options)
