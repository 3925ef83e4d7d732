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

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (
    ChecksumError,
    CodecUnavailableError,
    CorruptionError,
    DeviceFailedError,
    FormatVersionError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidDatasetError,
    InvalidPriorityError,
    LossyValueError,
    LowCompressionWarning,
    NotATieredStoreError,
    NotSharedError,
    PickledDataError,
    RaggedDataError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    ShardFailedError,
    StaleReadError,
    StorageFullError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    TieredError,
    TieredWarning,
    UnknownCodecError,
    UnsupportedFormatError,
    UnwrittenRowError,
)
from .version import __version__

if TYPE_CHECKING:
    from .codecs import Codec, get_codec
    from .schema import Field, Schema
    from .store import TieredStore

# The names below import torch; they load on first use (PEP 562), so that `tiered --help`,
# `tiered --version` and `import tiered.errors` stay fast.
_LAZY = {
    "TieredStore": "store",
    "Schema": "schema",
    "Field": "schema",
    "Codec": "codecs",
    "get_codec": "codecs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("_"):
        # `import tiered; tiered.util.fileio...` kept working while the package root imported
        # everything; a submodule still loads on first attribute access.
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'tiered' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "NotSharedError",
    "RaggedDataError",
    "ShardFailedError",
    "InvalidDatasetError",
    "PickledDataError",
    "LossyValueError",
    "DeviceFailedError",
    "TieredWarning",
    "LowCompressionWarning",
    "__version__",
]


def open(path, mode: str = "r", **options) -> TieredStore:  # noqa: A001 - mirrors h5py.File / zarr.open
    """Open an existing store directory.

    Args:
        path: the store's directory.
        mode: ``"r"`` (read-only; any number of readers) or ``"r+"`` (one writer).
        **options: ``shared=True`` with ``mode="r+"`` opens a store that several processes write
            (:meth:`TieredStore.share`); the others are runtime options (``warm_bytes``, ``hot_bytes``, ``device``, ``verify``, ...).
    """
    from .store import TieredStore

    return TieredStore.open(path, mode=mode, **options)
