"""The codec contract.

A codec turns many raw cells into many compressed blobs in one call, and many blobs back
into raw bytes in one call. Both directions work on *batches laid out in one contiguous
buffer*: a batch is ``(data, offsets, sizes)`` where blob ``i`` is
``data[offsets[i] : offsets[i] + sizes[i]]``. No Python object exists per blob, so the
number of Python-level calls does not grow with the batch.

Contract (every codec passes ``tests/codecs/test_codecs.py``):

* ``decode(encode(x)) == x`` byte for byte, for any sizes including 0 bytes.
* ``encode`` returns the checksum of every blob's *compressed* bytes, computed in batch
  (see :mod:`tiered.codecs.checksum`).
* ``decode`` writes into a caller-provided, preallocated output buffer and never allocates
  an output of its own that the caller must copy (fresh allocations cost page faults).
* A codec's ``format`` names its bitstream; two codecs with the same format (a CPU and a GPU
  one) decode each other's blobs.
* ``name`` round-trips through :func:`tiered.codecs.get_codec`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

__all__ = ["Codec", "EncodedBatch", "thread_count"]


@dataclass
class EncodedBatch:
    """Compressed blobs packed in one buffer.

    Attributes:
        data: uint8 array holding every blob back to back.
        offsets: int64 array, start of each blob in ``data``.
        sizes: int64 array, compressed size of each blob.
        checksums: int64 array, checksum of each blob's compressed bytes.
    """

    data: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    checksums: np.ndarray

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @classmethod
    def empty(cls) -> EncodedBatch:
        """The encoding of a batch of no cells (codecs return it without a codec call)."""
        none = np.zeros(0, dtype=np.int64)
        return cls(np.zeros(0, dtype=np.uint8), none, none.copy(), none.copy())


def thread_count(threads: object) -> int:
    """A codec's ``threads`` argument checked: a positive integer, or ``None`` for all CPUs."""
    if threads is None:
        return os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads must be a positive integer or None (all CPUs), got {threads!r}")
    return int(threads)


class Codec(ABC):
    """Batched compressor/decompressor. See the module docstring for the contract."""

    #: Canonical spec string, e.g. ``"zstd:3"``; ``get_codec(codec.name)`` gives an equal codec.
    name: str
    #: Bitstream format shared by interchangeable codecs (``"zstd"``, ``"lz4"``, ``"raw"``).
    format: str
    #: Small integer stored in the blob index and the manifest to identify the format.
    format_id: int

    @abstractmethod
    def encode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> EncodedBatch:
        """Compress ``len(sizes)`` cells laid out in ``data`` into one :class:`EncodedBatch`."""

    @abstractmethod
    def decode(
        self,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        out: np.ndarray,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
    ) -> None:
        """Decompress blobs ``data[offsets[i]:offsets[i]+sizes[i]]`` into ``out[out_offsets[i]:...]``.

        ``out_sizes[i]`` is the exact decompressed size of blob ``i``; a blob that decodes to
        another size raises :class:`tiered.errors.CorruptionError`.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)
