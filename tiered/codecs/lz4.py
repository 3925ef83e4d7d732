"""LZ4 codec: one raw LZ4 block per blob (the codec with a per-blob loop).

Bitstream (format ``"lz4"``, format_id 2): every blob is a raw LZ4 *block* with no size prefix
and no frame, i.e. ``lz4.block.compress(cell, store_size=False)``; the decompressed size comes
from the blob index. nvCOMP's LZ4 decoder in ``BitstreamKind.RAW`` mode reads the same bytes, so
a GPU codec can decode these blobs. A 0-byte cell is stored as the 1-byte empty block ``b"\\x00"``.

Why a per-blob loop here: the ``lz4`` package has no batch API, so this module calls
``lz4.block.compress``/``decompress`` once per blob, unlike every other codec. The loop runs over
slices of the batch on a small thread pool (``lz4.block`` releases the GIL while it works), but
its Python-level work grows with the batch, ~1-2 us per blob. Prefer ``zstd`` for CPU decode of
many small blobs; LZ4 is here for its very fast decode of large blobs (~8-9 GB/s) and for GPU
decode of the same bytes.

``lz4`` is imported when the codec is created; without it :class:`~tiered.errors.CodecUnavailableError`
names the install command.

Example:
    >>> import numpy as np
    >>> from tiered.codecs.lz4 import Lz4Codec
    >>> codec = Lz4Codec(threads=1)
    >>> cells = np.frombuffer(b"abc" * 100, dtype=np.uint8)
    >>> enc = codec.encode(cells, np.array([0, 150]), np.array([150, 150]))
    >>> out = np.empty(300, dtype=np.uint8)
    >>> codec.decode(enc.data, enc.offsets, enc.sizes, out, np.array([0, 150]), np.array([150, 150]))
    >>> out.tobytes() == cells.tobytes()
    True
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

from ..errors import CodecUnavailableError, CorruptionError
from ..util.batch import exclusive_cumsum, split_balanced
from ..util.pool import run_parallel
from .base import Codec, EncodedBatch, thread_count
from .checksum import segment_checksums
from .raw import as_batch, check_out

__all__ = ["Lz4Codec"]

# Blobs per thread below which a batch stays on the calling thread.
_MIN_BLOBS_PER_THREAD = 16


def _lz4_block() -> ModuleType:
    try:
        return importlib.import_module("lz4.block")
    except ImportError as e:
        raise CodecUnavailableError(
            "the 'lz4' codec needs the lz4 package, which is not installed: pip install lz4 "
            "(or use the 'zstd' codec, which needs nothing extra)"
        ) from e


class Lz4Codec(Codec):
    """Raw LZ4 blocks, one per blob; decoded with a per-blob loop over a thread pool.

    Args:
        threads: Threads per batch (default ``os.cpu_count()``); 1 starts no thread.

    Raises:
        CodecUnavailableError: the ``lz4`` package is not installed.

    Example:
        >>> import numpy as np
        >>> enc = Lz4Codec().encode(np.zeros(1000, np.uint8), np.array([0]), np.array([1000]))
        >>> import lz4.block
        >>> len(lz4.block.decompress(enc.data.tobytes(), uncompressed_size=1000))
        1000
    """

    name = "lz4"
    format = "lz4"
    format_id = 2

    def __init__(self, threads: int | None = None) -> None:
        self._block = _lz4_block()
        self.threads = thread_count(threads)

    def __reduce__(self) -> tuple:
        # The lz4.block module object is not picklable; re-import it in the other process.
        return (type(self), (self.threads,))

    def _parts(self, n: int) -> int:
        return max(1, min(self.threads, n // _MIN_BLOBS_PER_THREAD))

    def encode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> EncodedBatch:
        """Compress every cell into one raw LZ4 block (per-blob calls, run on a thread pool)."""
        data, offsets, sizes = as_batch(data, offsets, sizes)
        n = sizes.size
        if n == 0:
            return EncodedBatch.empty()
        blocks: list = [None] * n
        bounds = split_balanced(sizes, self._parts(n)).tolist()
        mv = memoryview(data)
        tasks = [
            (blocks, mv, offsets[a:b].tolist(), sizes[a:b].tolist(), a)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        run_parallel(self._compress_slice, tasks, self.threads)
        packed = np.frombuffer(bytearray().join(blocks), dtype=np.uint8)
        out_sizes = np.fromiter(map(len, blocks), dtype=np.int64, count=n)
        out_offsets = exclusive_cumsum(out_sizes)
        return EncodedBatch(packed, out_offsets, out_sizes, segment_checksums(packed, out_offsets, out_sizes))

    def _compress_slice(self, blocks: list, mv: memoryview, offsets: list, sizes: list, first: int) -> None:
        compress = self._block.compress
        # The one per-blob Python loop of the codecs package (see the module docstring).
        for k, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
            blocks[first + k] = compress(mv[o : o + s], store_size=False)

    def decode(
        self,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        out: np.ndarray,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
    ) -> None:
        """Decompress every block into ``out[out_offsets[i] : out_offsets[i] + out_sizes[i]]``.

        Raises:
            CorruptionError: a block fails to decode or decodes to another size than
                ``out_sizes[i]``; the message names the blob index.
        """
        data, offsets, sizes = as_batch(data, offsets, sizes)
        out, out_offsets, out_sizes = check_out(out, out_offsets, out_sizes, sizes.size)
        n = sizes.size
        if n == 0:
            return
        bounds = split_balanced(sizes, self._parts(n)).tolist()
        in_mv = memoryview(data)
        out_mv = memoryview(out)
        failures: list[tuple[int, str]] = []
        tasks = [
            (
                in_mv,
                offsets[a:b].tolist(),
                sizes[a:b].tolist(),
                out_mv,
                out_offsets[a:b].tolist(),
                out_sizes[a:b].tolist(),
                a,
                failures,
            )
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        run_parallel(self._decompress_slice, tasks, self.threads)
        if failures:
            i, why = min(failures)
            raise CorruptionError(
                f"lz4 blob {i} of this batch ({int(sizes[i])} compressed bytes at offset {int(offsets[i])}) "
                f"could not be decoded into {int(out_sizes[i])} bytes: {why}; its bytes or the blob "
                "index are damaged: run `tiered verify` to find every damaged blob and restore the store "
                "from a copy"
            )

    def _decompress_slice(
        self,
        in_mv: memoryview,
        offsets: list,
        sizes: list,
        out_mv: memoryview,
        out_offsets: list,
        out_sizes: list,
        first: int,
        failures: list,
    ) -> None:
        decompress = self._block.decompress
        error = self._block.LZ4BlockError
        # Per-blob loop (see the module docstring); each call releases the GIL while decoding.
        for k, (o, s, oo, want) in enumerate(zip(offsets, sizes, out_offsets, out_sizes, strict=True)):
            if want == 0:
                # lz4 rejects uncompressed_size=0; the only valid 0-byte block is the empty block.
                if in_mv[o : o + s] != b"\x00":
                    failures.append((first + k, "expected the 1-byte empty block for a 0-byte cell"))
                    return
                continue
            try:
                raw = decompress(in_mv[o : o + s], uncompressed_size=want)
            except (error, ValueError) as e:
                failures.append((first + k, str(e)))
                return
            # lz4 returns fewer bytes without an error when the block is shorter than announced.
            if len(raw) != want:
                failures.append((first + k, f"it decoded to {len(raw)} bytes"))
                return
            out_mv[oo : oo + want] = raw
