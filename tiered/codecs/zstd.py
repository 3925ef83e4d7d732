"""Zstandard codec: one standard zstd frame per blob, batched in C, multi-threaded.

Bitstream (format ``"zstd"``, format_id 1): every blob is exactly one zstd frame (RFC 8878)
with the decompressed size in the frame header, no checksum and no dictionary, as written by
``zstandard.ZstdCompressor(level=L, write_content_size=True, write_checksum=False)``. These are
the bytes nvCOMP's Zstd decoder reads in ``BitstreamKind.RAW`` mode, so a store written here
decodes on a GPU and back. A 0-byte cell is stored as the empty frame (9 bytes) so that every
blob is a valid frame; decoders skip blobs whose expected output size is 0.

Batching: encode and decode hand the whole batch to zstandard's C loops
(``multi_compress_to_buffer`` / ``multi_decompress_to_buffer``) through a ``BufferWithSegments``
(the input buffer plus a packed ``(offset, length)`` uint64 table), so no Python code runs per
blob. Their results are ``BufferWithSegmentsCollection`` objects whose sub-buffers zstandard's C
backend does not expose; the segments are moved with C-level iteration instead
(``bytearray().join(collection)`` on encode, a ``map`` of memoryview slice assignments straight
into the caller's ``out`` on decode: one memcpy per blob, no Python frame per blob, ~0.3 us per
blob against ~3-13 us to decode it). The number of Python-level calls is the same for 80 blobs
and for 1024 (tests/codecs/test_codecs.py counts them).

Decodes of large frames (16 KiB of output or more each) skip that memcpy and zstandard's fresh
output buffer: when every frame's header declares exactly the expected size, the frames are
decoded straight into ``out`` by ``ZstdDecompressionReader.readinto``, one reader per run of frames
that lie back to back both in the input and in ``out`` (``read_across_frames``: libzstd goes from
frame to frame in C and checks each frame's decoded size against its header), again through
``map`` (C iteration, no Python frame per blob). A read's blobs are gathered back to back and
decode into consecutive places, so a batch is one run or a few, and a thread takes the GIL back
once per run, not once per frame (what two threads decoding at once wait on each other for).
64 float32 4x84x84 stacks (7.2 MB): 1.71 ms against 2.08 ms of thread CPU on a 2-core VM (one
reader per frame). Frames that declare no size (a GPU encoder may leave it out) take the batch
path. :meth:`ZstdCodec.sliced_decode` prepares the same decode as jobs for other threads.

Threads: a batch is cut into ``threads`` slices of similar byte size; each slice runs
``multi_*_to_buffer(threads=1)`` (which releases the GIL) on a small persistent thread pool, the
calling thread taking the last slice. zstandard's own ``threads=N`` (``native_threads = True``)
starts and joins N native threads inside every call instead; the sliced pool is the default
(it never starts threads per call). ``threads=1`` starts no thread, and a decode of under
8 MiB of output stays on the calling thread (a handoff can cost more than it saves there).

Example:
    >>> import numpy as np
    >>> from tiered.codecs.zstd import ZstdCodec
    >>> codec = ZstdCodec(level=3, threads=1)
    >>> cells = np.frombuffer(b"a" * 1000 + b"b" * 500, dtype=np.uint8)
    >>> enc = codec.encode(cells, np.array([0, 1000]), np.array([1000, 500]))
    >>> out = np.empty(1500, dtype=np.uint8)
    >>> codec.decode(enc.data, enc.offsets, enc.sizes, out, np.array([0, 1000]), np.array([1000, 500]))
    >>> out.tobytes() == cells.tobytes(), codec.name
    (True, 'zstd:3')
"""

from __future__ import annotations

import operator
import re
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain, repeat

import numpy as np
import zstandard

from ..errors import CorruptionError, UnknownCodecError
from ..util.batch import exclusive_cumsum, split_balanced
from ..util.pool import run_parallel
from .base import Codec, EncodedBatch, SlicedDecode, thread_count
from .checksum import segment_checksums
from .raw import as_batch, check_out

__all__ = ["ZstdCodec", "MIN_LEVEL", "MAX_LEVEL", "DEFAULT_LEVEL", "declared_content_sizes"]

#: Fastest level libzstd accepts (negative levels trade ratio for speed).
MIN_LEVEL = -(1 << 17)
#: Strongest level.
MAX_LEVEL = int(zstandard.MAX_COMPRESSION_LEVEL)
#: Level of the plain spec ``"zstd"``.
DEFAULT_LEVEL = 3
# With native_threads, zstandard's own threads start only from this many blobs: starting and
# joining them costs more than a smaller batch saves.
_MIN_BLOBS_FOR_THREADS = 8
# A decode producing less than this stays on the calling thread. Handing half of it to a pool
# thread saves at most half of the zstd work, and the handoff (waking the thread, the GIL back and
# forth) costs more than that up to a few MB: a B=32 `storage.get` of Atari stacks at K=8 (~2.5-6
# MB of output) took 1.40 ms on one thread against 1.68 ms split over two, on a quiet 2-core VM
# (`python benchmarks/profile_calls.py --only storage.get32 rb.sample32 storage.get256 --threads 2`
# with 1 MiB and 8 MiB here); B=256 (tens of MB) is split either way. A store's reads do not come
# here split: `checked.decode_checked` cuts them (checks and decodes together, from
# `checked.MIN_CHUNK_SPLIT_BYTES`, the calling thread claiming slices no pool thread started)
# and each slice's decode runs on its own thread.
_MIN_BYTES_FOR_THREADS = 8 << 20
# Frames of at least this much output each (on average over a batch) are decoded straight into
# ``out`` (``readinto``); smaller ones go through the batch decoder, whose cost per frame is
# lower. A property of the data, not of the batch size: a store's gets all take one path. Thread
# CPU per chunk of real Atari frames on a 2-core VM, direct against batch + copy
# (`python benchmarks/bench_zstd_decode_paths.py`): K=1 (7 kB) 2.4 against 1.9 us, K=2 (14 kB)
# 3.3 against 3.1, K=4 (28 kB) 5.9 against 7.8, K=8 (56 kB) 10.0 against 13.6; 64 float32
# 4x84x84 stacks (113 kB each, 7.2 MB) 1.71 against 2.08 ms.
_MIN_FRAME_BYTES_FOR_DIRECT = 16 << 10
_READINTO = zstandard.ZstdDecompressionReader.readinto
_READ_SIZE = zstandard.DECOMPRESSION_RECOMMENDED_INPUT_SIZE  # (unused for a buffer: read whole)
_FIRST = np.zeros(1, dtype=np.int64)
_FIRST.flags.writeable = False  # _runs hands this array itself to callers (one run)
_ZSTD_MAGIC = 0xFD2FB528
_ITEM_RE = re.compile(r"item (\d+)")


def _check_level(level: object) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)):
        raise UnknownCodecError(f"zstd level must be an integer, got {level!r}; e.g. 'zstd:3'")
    level = int(level)
    if level == 0 or not MIN_LEVEL <= level <= MAX_LEVEL:
        raise UnknownCodecError(
            f"zstd level must be in 1..{MAX_LEVEL} (stronger) or {MIN_LEVEL}..-1 (faster), got {level}; "
            f"'zstd' alone means level {DEFAULT_LEVEL}"
        )
    return level


def _segments(offsets: np.ndarray, sizes: np.ndarray) -> bytes:
    """The packed native-endian uint64 ``(offset, length)`` table zstandard's C code reads."""
    table = np.empty((offsets.size, 2), dtype=np.uint64)
    table[:, 0] = offsets
    table[:, 1] = sizes
    return table.tobytes()


def declared_content_sizes(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Content size written in each zstd frame header, vectorized over the batch.

    Returns:
        int64 array: the declared size, ``-1`` when the header has no content-size field (legal
        in zstd, e.g. frames written by a streaming or GPU encoder), ``-2`` when the blob does
        not start with a valid zstd frame header (wrong magic, reserved bit set, too short).

    Example:
        >>> import zstandard
        >>> f = np.frombuffer(zstandard.ZstdCompressor().compress(b"x" * 300), np.uint8)
        >>> declared_content_sizes(f, np.array([0]), np.array([f.size])).tolist()
        [300]
    """
    n = sizes.size
    result = np.full(n, -2, dtype=np.int64)
    if n == 0 or data.size == 0:
        return result
    # Read the first 18 bytes of every blob (the longest frame header); bytes past a blob's end
    # are masked out by the length checks below.
    pos = offsets[:, None] + np.arange(18, dtype=np.int64)
    head = data[np.minimum(pos, data.size - 1)].astype(np.uint64)
    head[pos >= (offsets + sizes)[:, None]] = 0
    magic = head[:, 0] | (head[:, 1] << 8) | (head[:, 2] << 16) | (head[:, 3] << 24)
    fhd = head[:, 4].astype(np.int64)
    fcs_flag = fhd >> 6
    single = (fhd >> 5) & 1
    dict_len = np.array([0, 1, 2, 4], dtype=np.int64)[fhd & 3]
    fcs_len = np.where(fcs_flag == 0, single, np.array([0, 2, 4, 8], dtype=np.int64)[fcs_flag])
    fcs_at = 5 + (1 - single) + dict_len
    header_len = fcs_at + fcs_len
    valid = (magic == _ZSTD_MAGIC) & ((fhd & 0x08) == 0) & (sizes >= header_len + 3)
    # Little-endian value of the fcs_len bytes at fcs_at (fcs_at + 8 <= 18 always holds).
    k = np.arange(8, dtype=np.int64)
    take = np.take_along_axis(head, np.minimum(fcs_at[:, None] + k, 17), axis=1)
    take[k[None, :] >= fcs_len[:, None]] = 0
    value = (take << (np.uint64(8) * k.astype(np.uint64))).sum(axis=1, dtype=np.uint64)
    value = np.where(fcs_len == 2, value + np.uint64(256), value)
    # Sizes past 2**63 cannot be real; they stay -2 (invalid).
    fits = value < np.uint64(1 << 63)
    declared = np.where(fcs_len == 0, -1, value.astype(np.int64))
    result[valid & fits] = declared[valid & fits]
    return result


class ZstdCodec(Codec):
    """Batched zstd: standard frames, one per blob, readable by nvCOMP's Zstd RAW decoder.

    Args:
        level: Compression level, 1..22 or negative (faster, larger). ``name`` is
            ``"zstd:<level>"``; the spec ``"zstd"`` means level 3.
        threads: Threads per batch (default ``os.cpu_count()``); 1 starts no thread.

    Example:
        >>> import numpy as np
        >>> codec = ZstdCodec(9)
        >>> enc = codec.encode(np.zeros(4096, np.uint8), np.array([0, 2048]), np.array([2048, 2048]))
        >>> len(enc), codec.name, codec.format_id
        (2, 'zstd:9', 1)
    """

    format = "zstd"
    format_id = 1
    #: Let zstandard run its own ``threads=N`` pool on the whole batch instead of slicing the batch
    #: over tiered's persistent threads. Kept for benchmarks (see the module docstring).
    native_threads: bool = False

    def __init__(self, level: int = DEFAULT_LEVEL, threads: int | None = None) -> None:
        self.level = _check_level(level)
        self.threads = thread_count(threads)
        self.name = f"zstd:{self.level}"
        # zstandard's (de)compressor objects are not safe to share between threads.
        self._local = threading.local()

    def __reduce__(self) -> tuple:
        # Contexts and thread-locals are not picklable; rebuild them in the other process.
        return (type(self), (self.level, self.threads))

    def __repr__(self) -> str:
        return f"ZstdCodec(level={self.level}, threads={self.threads})"

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = zstandard.ZstdCompressor(
                level=self.level, write_content_size=True, write_checksum=False, write_dict_id=False
            )
            self._local.cctx = cctx
        return cctx

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = zstandard.ZstdDecompressor()
            self._local.dctx = dctx
        return dctx

    def sliced_decode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray,
                      out_offsets: np.ndarray, out_sizes: np.ndarray, bounds: list[int]) -> SlicedDecode:
        """:meth:`decode` cut at ``bounds`` into jobs for other threads; a slice of large frames
        whose headers declare their expected sizes is one C call (``array.extend`` over a ``map``
        of ``readinto``: the thread that runs it holds the GIL only between frames).

        Raises:
            ValueError: the batch's layout is inconsistent (as :meth:`decode`).

        Example:
            >>> codec = ZstdCodec(threads=2)
            >>> enc = codec.encode(np.arange(3 << 14, dtype=np.uint8), np.array([0, 1 << 14, 2 << 14]),
            ...                    np.full(3, 1 << 14))
            >>> out = np.empty(3 << 14, np.uint8)
            >>> sd = codec.sliced_decode(enc.data, enc.offsets, enc.sizes, out, np.array([0, 1 << 14, 2 << 14]),
            ...                          np.full(3, 1 << 14), [0, 1, 3])
            >>> jobs = [sd.job(1), sd.job(0)]
            >>> for fn, args in jobs:
            ...     _ = fn(*args)
            >>> sd.finish(None)
            >>> bool((out == np.arange(3 << 14, dtype=np.uint8)).all())
            True
        """
        data, offsets, sizes = as_batch(data, offsets, sizes)
        out, out_offsets, out_sizes = check_out(out, out_offsets, out_sizes, sizes.size)
        if not np.logical_and.reduce(out_sizes > 0):  # frames of 0 bytes: decode's own handling
            return SlicedDecode(self, data, offsets, sizes, out, out_offsets, out_sizes, bounds)
        return _ZstdSlices(self, data, offsets, sizes, out, out_offsets, out_sizes, bounds)

    def _parts(self, n: int, out_bytes: int | None = None) -> int:
        # As many slices as threads whenever there are 2+ blobs (and, for a decode, enough output
        # to be worth a handoff): the Python call count of a batch must not depend on its size
        # beyond that (a slice may hold a single blob).
        parts = max(1, min(self.threads, n))
        if self.native_threads or (out_bytes is not None and out_bytes < _MIN_BYTES_FOR_THREADS):
            parts = 1
        return parts

    def _native(self, n: int) -> int:
        # zstandard's threads argument: 1 runs on the calling thread (GIL released), N > 1 starts
        # and joins N native threads inside the call.
        return self.threads if self.native_threads and n >= _MIN_BLOBS_FOR_THREADS else 1

    # -- encode -------------------------------------------------------------------------------

    def encode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> EncodedBatch:
        """Compress every cell into its own zstd frame; returns the frames packed in one buffer.

        Example:
            >>> import numpy as np
            >>> enc = ZstdCodec(threads=1).encode(np.zeros(10, np.uint8), np.array([0]), np.array([10]))
            >>> import zstandard
            >>> zstandard.frame_content_size(enc.data.tobytes())
            10
        """
        data, offsets, sizes = as_batch(data, offsets, sizes)
        n = sizes.size
        if n == 0:
            return EncodedBatch.empty()
        bounds = split_balanced(sizes, self._parts(n)).tolist()
        results: list = [None] * (len(bounds) - 1)
        tasks = [
            (results, j, data, offsets[a:b], sizes[a:b])
            for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
        ]
        run_parallel(self._compress_slice, tasks, self.threads)
        # Each result is a BufferWithSegmentsCollection; iterating it in C yields its frames in
        # order. bytearray (not bytes) so the returned array is writable.
        frames = bytearray().join(chain.from_iterable(results))
        out_sizes = np.fromiter(map(len, chain.from_iterable(results)), dtype=np.int64, count=n)
        packed = np.frombuffer(frames, dtype=np.uint8)
        out_offsets = exclusive_cumsum(out_sizes)
        return EncodedBatch(packed, out_offsets, out_sizes, segment_checksums(packed, out_offsets, out_sizes))

    def _compress_slice(
        self, results: list, j: int, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
    ) -> None:
        if sizes.size == 0:
            results[j] = ()
            return
        if not sizes.any():
            # zstandard refuses a batch with no input bytes at all; an empty cell's frame is the
            # same whatever its neighbours are.
            results[j] = [self._cctx().compress(b"")] * sizes.size
            return
        batch = zstandard.BufferWithSegments(data, _segments(offsets, sizes))
        results[j] = self._cctx().multi_compress_to_buffer(batch, threads=self._native(sizes.size))

    # -- decode -------------------------------------------------------------------------------

    def decode(
        self,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        out: np.ndarray,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
    ) -> None:
        """Decompress every frame into ``out[out_offsets[i] : out_offsets[i] + out_sizes[i]]``.

        Raises:
            CorruptionError: a blob is not a zstd frame, declares another size than
                ``out_sizes[i]``, or fails to decompress; the message names the blob index.
        """
        data, offsets, sizes = as_batch(data, offsets, sizes)
        out, out_offsets, out_sizes = check_out(out, out_offsets, out_sizes, sizes.size)
        n = sizes.size
        if n == 0:
            return
        keep = None
        if not int(np.minimum.reduce(out_sizes)):  # (one reduction where no frame is empty: every read's)
            # zstandard's batch decoder refuses frames of 0 output bytes, and there is nothing to
            # write for them; still check (vectorized) that each one is a frame of 0 bytes.
            empty = out_sizes == 0
            keep = (~empty).nonzero()[0]
            idx = np.flatnonzero(empty)
            declared = declared_content_sizes(data, offsets[idx], sizes[idx])
            bad = np.flatnonzero((declared == -2) | (declared > 0))
            if bad.size:
                i = int(idx[bad[0]])
                what = (
                    "is not a valid zstd frame"
                    if declared[bad[0]] == -2
                    else (f"declares {int(declared[bad[0]])} decompressed bytes")
                )
                raise CorruptionError(
                    f"zstd blob {i} of this batch ({int(sizes[i])} bytes at offset {int(offsets[i])}) {what} "
                    "but 0 were expected; the stored bytes or the blob index are damaged: run "
                    "`tiered verify` and restore the store from a copy"
                )
            if keep.size == 0:
                return
            offsets, sizes, out_offsets, out_sizes = (
                offsets[keep],
                sizes[keep],
                out_offsets[keep],
                out_sizes[keep],
            )
        m = sizes.size
        total = int(np.add.reduce(out_sizes))
        in_mv = memoryview(data)
        direct = total >= _MIN_FRAME_BYTES_FOR_DIRECT * m and _sizes_declared(in_mv, offsets, sizes, out_sizes)
        parts = self._parts(m, total)
        out_mv = memoryview(out)
        try:
            if parts == 1 and direct:  # every small batch of time chunks: straight into out, here
                self._decompress_into(self._dctx(), data, offsets, sizes, in_mv, out_mv, out_offsets, out_sizes, 0)
                return
            in_mv = in_mv if direct else None
            if parts == 1:  # one slice on this thread, no cut points nor pool
                tasks = [(data, offsets, sizes, out_mv, out_offsets, out_sizes, 0, in_mv)]
            else:
                bounds = split_balanced(sizes, parts).tolist()
                tasks = [
                    (data, offsets[a:b], sizes[a:b], out_mv, out_offsets[a:b], out_sizes[a:b], a, in_mv)
                    for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                ]
            run_parallel(self._decompress_slice, tasks, self.threads)
        except _SliceError as e:
            i = e.index if keep is None else int(keep[e.index])
            raise _undecodable(i, e.index, offsets, sizes, out_sizes, e.cause) from e.cause

    def _decompress_slice(
        self,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        out_mv: memoryview,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
        first: int,
        in_mv: memoryview | None = None,
    ) -> None:
        if sizes.size == 0:
            return
        dctx = self._dctx()
        if in_mv is not None:
            self._decompress_into(dctx, data, offsets, sizes, in_mv, out_mv, out_offsets, out_sizes, first)
            return
        frames = zstandard.BufferWithSegments(data, _segments(offsets, sizes))
        try:
            result = dctx.multi_decompress_to_buffer(
                frames,
                decompressed_sizes=out_sizes.astype(np.uint64).tobytes(),
                threads=self._native(sizes.size),
            )
        except zstandard.ZstdError as e:
            raise _SliceError(first + self._find_bad_frame(e, data, offsets, sizes, out_sizes), e) from e
        # One memcpy per frame straight into the caller's buffer, looped in C: map/slice/setitem
        # are C callables and iterating the collection yields its segments in order.
        ends = out_offsets + out_sizes
        deque(
            map(operator.setitem, repeat(out_mv), map(slice, out_offsets.tolist(), ends.tolist()), result),
            maxlen=0,
        )

    def _decompress_into(
        self,
        dctx: zstandard.ZstdDecompressor,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        in_mv: memoryview,
        out_mv: memoryview,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
        first: int,
    ) -> None:
        """Decode the frames straight into their places in ``out`` (headers already checked to
        declare ``out_sizes``): one reader per run of frames (:func:`_runs`), created and used
        inside C iteration; a slice that is one run gets one reader, called here."""
        runs = _runs(offsets, sizes, out_offsets, out_sizes)
        if runs[0].size == 1:  # one run (a read without open time chunks): one reader, no iterators
            a, b, oa, ob = int(runs[1][0]), int(runs[2][0]), int(runs[3][0]), int(runs[4][0])
            try:
                whole = _READINTO(dctx.stream_reader(in_mv[a:b], _READ_SIZE, True), out_mv[oa:ob]) == ob - oa
            except zstandard.ZstdError:
                whole = False  # decoded again below, frame by frame
        else:
            got = array("q")
            try:
                got.extend(_run_readers(dctx, in_mv, out_mv, runs))
            except zstandard.ZstdError:
                pass  # decoded again below, frame by frame
            whole = len(got) == runs[0].size and not np.logical_or.reduce(
                np.frombuffer(got, np.int64) != runs[4] - runs[3])
        if not whole:
            self._decompress_each(dctx, data, offsets, sizes, in_mv, out_mv, out_offsets, out_sizes, first)

    def _decompress_each(
        self,
        dctx: zstandard.ZstdDecompressor,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        in_mv: memoryview,
        out_mv: memoryview,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
        first: int,
    ) -> None:
        """Decode each frame with its own reader: after a run of frames failed (it raises for the
        frame that fails, or decodes them all where each frame alone is whole, e.g. a blob with
        bytes past its frame's end, which a run would read as the next frame)."""
        sources = map(operator.getitem, repeat(in_mv), map(slice, offsets.tolist(), (offsets + sizes).tolist()))
        targets = map(operator.getitem, repeat(out_mv),
                      map(slice, out_offsets.tolist(), (out_offsets + out_sizes).tolist()))
        try:
            got = np.fromiter(map(_READINTO, map(dctx.stream_reader, sources), targets), np.int64, count=sizes.size)
        except zstandard.ZstdError as e:
            raise _SliceError(first + self._find_bad_frame(e, data, offsets, sizes, out_sizes), e) from e
        short = (got != out_sizes).nonzero()[0]
        if short.size:  # a frame that ends early (truncated or damaged)
            k = int(short[0])
            raise _SliceError(first + k, ValueError(f"it decoded to {int(got[k])} bytes"))

    def _find_bad_frame(
        self,
        error: Exception,
        data: np.ndarray,
        offsets: np.ndarray,
        sizes: np.ndarray,
        out_sizes: np.ndarray,
    ) -> int:
        """Index (within the slice) of the frame that failed; error path only, so a loop is fine."""
        m = _ITEM_RE.search(str(error))
        if m is not None and int(m.group(1)) < sizes.size:
            return int(m.group(1))
        return _first_undecodable(data, offsets, sizes, out_sizes)


def _first_undecodable(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, out_sizes: np.ndarray) -> int:
    """Index of the first frame that does not decode to its expected size alone (0 when each
    does); error path only, so a loop is fine."""
    dctx = zstandard.ZstdDecompressor()
    for k in range(sizes.size):
        o, s, want = int(offsets[k]), int(sizes[k]), int(out_sizes[k])
        try:
            if len(dctx.decompress(data[o : o + s].tobytes(), max_output_size=want)) != want:
                return k
        except zstandard.ZstdError:
            return k
    return 0


def _runs(offsets: np.ndarray, sizes: np.ndarray, out_offsets: np.ndarray,
          out_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The frames cut into runs that lie back to back both in the input and in ``out`` (a read's
    blobs are gathered back to back and decode into consecutive places, but for its open time
    chunks): ``(first frame, input start, input end, output start, output end)`` per run.

    One reader decodes a whole run into its span of ``out`` (``read_across_frames``: libzstd
    goes on to the next frame in C, and checks each frame's decoded size against its header):
    a thread takes the GIL back once per run rather than once per frame, which is what two
    threads decoding at once otherwise wait on each other for.

    Example:
        >>> _runs(np.array([0, 5, 9]), np.array([5, 4, 3]), np.array([0, 8, 20]), np.array([8, 8, 8]))[0].tolist()
        [0, 2]
    """
    ends = offsets + sizes
    out_ends = out_offsets + out_sizes
    cut = ((offsets[1:] != ends[:-1]) | (out_offsets[1:] != out_ends[:-1])).nonzero()[0]
    if not cut.size:  # one run (a read without open time chunks): its ends are slices, no gathers
        return _FIRST, offsets[:1], ends[-1:], out_offsets[:1], out_ends[-1:]
    cut += 1
    first = np.concatenate((_FIRST, cut))
    last = np.concatenate((cut, (sizes.size,))) - 1
    return first, offsets[first], ends[last], out_offsets[first], out_ends[last]


def _run_readers(dctx: zstandard.ZstdDecompressor, in_mv: memoryview, out_mv: memoryview, runs: tuple) -> Iterator[int]:
    """The bytes each run decodes to, as it goes: a ``map`` of ``readinto`` (C iteration)."""
    _, a, b, oa, ob = runs
    sources = map(operator.getitem, repeat(in_mv), map(slice, a.tolist(), b.tolist()))
    targets = map(operator.getitem, repeat(out_mv), map(slice, oa.tolist(), ob.tolist()))
    return map(_READINTO, map(dctx.stream_reader, sources, repeat(_READ_SIZE), repeat(True)), targets)


def _undecodable(i: int, k: int, offsets: np.ndarray, sizes: np.ndarray, out_sizes: np.ndarray,
                 cause: BaseException) -> CorruptionError:
    """The error for blob ``i`` of a batch (at position ``k`` of ``offsets``, ``sizes``, ``out_sizes``)."""
    return CorruptionError(
        f"zstd blob {i} of this batch ({int(sizes[k])} bytes at offset {int(offsets[k])}) could not be "
        f"decoded into {int(out_sizes[k])} bytes ({cause}); its compressed bytes or the blob index are "
        "damaged: run `tiered verify` to find every damaged blob and restore the store from a copy"
    )


class _ZstdSlices(SlicedDecode):
    """:meth:`ZstdCodec.sliced_decode`'s jobs (every frame of the batch has a positive size).

    ``job(j)`` does on the calling thread all of slice ``j``'s Python work: the check that every
    frame header declares its expected size (then the frames are decoded straight into ``out``)
    and the iterators; the job itself is one C call. A slice of small frames, or of frames that
    declare no size, gets the batch decoder's job (:meth:`ZstdCodec._decompress_slice`).
    """

    def __init__(self, codec: ZstdCodec, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                 out: np.ndarray, out_offsets: np.ndarray, out_sizes: np.ndarray, bounds: list[int]) -> None:
        super().__init__(codec, data, offsets, sizes, out, out_offsets, out_sizes, bounds)
        self.in_mv, self.out_mv = memoryview(data), memoryview(out)
        # the same choice of path as ZstdCodec.decode's (a property of the data, not of the cut),
        # made once for the whole batch
        self.direct = (int(np.add.reduce(out_sizes)) >= _MIN_FRAME_BYTES_FOR_DIRECT * sizes.size
                       and _sizes_declared(self.in_mv, offsets, sizes, out_sizes))
        self.done: dict[int, tuple[array, array]] = {}
        # the calling thread's decompressors for slices 1, 2, ... (it waits for their jobs, so no
        # two threads use one at once; slice 0 uses the thread's own)
        slots = getattr(codec._local, "slots", None)
        if slots is None:
            slots = codec._local.slots = {}
        self.slots: dict[int, zstandard.ZstdDecompressor] = slots

    def job(self, j: int) -> tuple[Callable[..., object], tuple]:
        data, offsets, sizes, _, out_offsets, out_sizes = self.batch
        a, b = self.bounds[j], self.bounds[j + 1]
        offs, szs, oo, osz = offsets[a:b], sizes[a:b], out_offsets[a:b], out_sizes[a:b]
        codec: ZstdCodec = self.codec  # type: ignore[assignment]
        if a == b or not self.direct:
            return codec._decompress_slice, (data, offs, szs, self.out_mv, oo, osz, a)
        runs = _runs(offs, szs, oo, osz)
        # the bytes each run decoded to, appended as it goes (a failed run ends it early), and the
        # bytes each run must decode to: one comparison of the two tells a whole slice
        got = array("q")
        self.done[j] = (got, array("q", (runs[4] - runs[3]).tolist()))
        dctx = codec._dctx() if j == 0 else self.slots.get(j)
        if dctx is None:
            dctx = self.slots[j] = zstandard.ZstdDecompressor()
        return got.extend, (_run_readers(dctx, self.in_mv, self.out_mv, runs),)

    def finish(self, error: BaseException | None) -> None:
        data, offsets, sizes, _, out_offsets, out_sizes = self.batch
        if isinstance(error, _SliceError):
            raise _undecodable(error.index, error.index, offsets, sizes, out_sizes, error.cause) from error.cause
        # a job's runs that raised ended it early (each job's error is lost but the first one)
        failed = isinstance(error, zstandard.ZstdError)
        for j, (got, want) in self.done.items():
            if got == want:
                continue
            if len(got) < len(want) and not failed:
                continue  # (the job did not run, or stopped for another reason: raised below)
            # a run failed: this slice again, frame by frame (names the frame, or decodes them all)
            a, b = self.bounds[j], self.bounds[j + 1]
            codec: ZstdCodec = self.codec  # type: ignore[assignment]
            try:
                codec._decompress_each(zstandard.ZstdDecompressor(), data, offsets[a:b], sizes[a:b], self.in_mv,
                                       self.out_mv, out_offsets[a:b], out_sizes[a:b], a)
            except _SliceError as e:
                raise _undecodable(e.index, e.index, offsets, sizes, out_sizes, e.cause) from e.cause
            error = None if failed else error  # (a run's error: its frames decode one by one)
        if error is not None:
            raise error


def _sizes_declared(in_mv: memoryview, offsets: np.ndarray, sizes: np.ndarray, out_sizes: np.ndarray) -> bool:
    """Whether every frame's header declares exactly its expected output size: the readers of the
    direct decode trust it (a longer frame would fill its slice and stop there). A frame without a
    size or with a broken header says no; the batch decoder then decodes or names it."""
    sources = map(operator.getitem, repeat(in_mv), map(slice, offsets.tolist(), (offsets + sizes).tolist()))
    try:  # (two lists of Python ints compared in C: no array, comparison and reduction calls)
        return list(map(zstandard.frame_content_size, sources)) == out_sizes.tolist()
    except zstandard.ZstdError:
        return False


class _SliceError(Exception):
    """A frame of a slice failed to decode (carries its index within the batch)."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(index, cause)
        self.index = index
        self.cause = cause
