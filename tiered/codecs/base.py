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
* ``sliced_decode`` cuts a decode into jobs that other threads run (:class:`SlicedDecode`); the
  base class's jobs call ``decode`` on each slice, a codec may prepare cheaper ones.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Codec", "EncodedBatch", "SlicedDecode", "thread_count"]


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


class SlicedDecode:
    """One batch decode cut into slices, each a job that any one thread can run.

    Made by :meth:`Codec.sliced_decode` on the calling thread, which then hands the jobs to
    threads (:func:`tiered.codecs.checked.decode_checked` prepares the pool thread's job before
    the handoff, so the pool thread runs only the decode). This base class's job for slice ``j``
    is ``codec.decode`` of the slice.

    Args:
        codec: decodes the slices.
        data, offsets, sizes, out, out_offsets, out_sizes: the batch, as :meth:`Codec.decode` takes it.
        bounds: slice ``j`` is blobs ``bounds[j]:bounds[j + 1]``.

    Example:
        >>> from tiered.codecs.raw import RawCodec
        >>> src, out = np.arange(6, dtype=np.uint8), np.zeros(6, np.uint8)
        >>> sd = RawCodec().sliced_decode(src, np.array([0, 2, 4]), np.full(3, 2), out,
        ...                               np.array([4, 2, 0]), np.full(3, 2), [0, 1, 3])
        >>> for j in range(2):
        ...     fn, args = sd.job(j)
        ...     _ = fn(*args)
        >>> sd.finish(None)
        >>> out.tolist()
        [4, 5, 2, 3, 0, 1]
    """

    def __init__(self, codec: Codec, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray,
                 out_offsets: np.ndarray, out_sizes: np.ndarray, bounds: list[int]) -> None:
        self.codec = codec
        self.batch = (data, offsets, sizes, out, out_offsets, out_sizes)
        self.bounds = bounds

    def job(self, j: int) -> tuple[Callable[..., object], tuple]:
        """``(fn, args)``: ``fn(*args)`` decodes slice ``j`` (call it on any one thread)."""
        data, offsets, sizes, out, out_offsets, out_sizes = self.batch
        a, b = self.bounds[j], self.bounds[j + 1]
        return self.codec.decode, (data, offsets[a:b], sizes[a:b], out, out_offsets[a:b], out_sizes[a:b])

    def finish(self, error: BaseException | None) -> None:
        """After every job ran: raise the codec's error for what failed (``error``: the first
        exception a job raised, or None), naming the blob; return when all decoded.

        Raises:
            CorruptionError: a blob could not be decoded into its expected size.
        """
        if error is not None:
            raise error


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

    def sliced_decode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray,
                      out_offsets: np.ndarray, out_sizes: np.ndarray, bounds: list[int]) -> SlicedDecode:
        """The decode of a batch (as :meth:`decode` takes it) cut at ``bounds`` into jobs for
        other threads (see :class:`SlicedDecode`)."""
        return SlicedDecode(self, data, offsets, sizes, out, out_offsets, out_sizes, bounds)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)
