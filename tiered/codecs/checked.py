"""Check and decode one-blob cells in one pass per thread.

Cells too large to share frames with their neighbours (TorchRL's VecNorm'd float32 ``[4, 84, 84]``
stacks: 113 kB each) are stored one blob per cell, and a sampled batch of them decodes megabytes
(7.2 MB for 32 transitions and their next observations). :func:`decode_cells_checked` cuts such a
batch into one slice of blobs per thread, by the work each blob costs (its decoded bytes and its
checksummed bytes). :func:`decode_checked` does the same for batches of many small blobs decoded to
their own places (time chunks of Atari frames, K=8: ~1 kB compressed, ~56 kB decoded each).

Both split the same way: the calling thread checks the pool thread's slice and prepares its decode
(:meth:`tiered.codecs.base.Codec.sliced_decode`: for zstd, one C call that decodes whole runs of
frames and takes the GIL back once per run), hands it off, then checks and decodes its own slice
while the pool thread wakes. Every blob is checked before it is decoded, and the pool thread runs
no Python work: Python work on two threads at once takes turns on the GIL, and a thread that waits
for the GIL sleeps and wakes tens of microseconds late on a VM, which cost the split its gain when
each thread checked and prepared its own slice. A slice no pool thread has started when the
calling thread is done with its own is done by the calling thread too (``run_parallel(claim=True)``):
on a loaded machine, where the pool thread may wait milliseconds for a core, a batch then takes
about what it takes on one thread instead of waiting for it.

A batch with less decoded output than :data:`MIN_SPLIT_BYTES` (one-blob cells) or
:data:`MIN_CHUNK_SPLIT_BYTES` (time chunks) runs on the calling thread: there a handoff costs about
what it saves.

Example:
    >>> import numpy as np
    >>> from tiered.codecs import get_codec
    >>> from tiered.codecs.checked import decode_cells_checked
    >>> codec = get_codec("zstd")
    >>> cells = np.arange(3 * 4096, dtype=np.uint8)
    >>> enc = codec.encode(cells, np.array([0, 4096, 8192]), np.full(3, 4096))
    >>> out = np.empty(4 * 4096, np.uint8)  # cells: blob 2, 0, 0, 1
    >>> bad = decode_cells_checked(codec, enc.data, enc.offsets, enc.sizes, enc.checksums,
    ...                            np.array([2, 0, 0, 1]), out, 4096, threads=2)
    >>> bad.tolist(), bool((out[:4096] == cells[8192:]).all())
    ([], True)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..util.batch import split_balanced
from ..util.pool import run_parallel
from .base import Codec, SlicedDecode
from .checksum import segment_checksums

__all__ = ["decode_cells_checked", "decode_checked", "MIN_SPLIT_BYTES", "MIN_CHUNK_SPLIT_BYTES"]

#: Decoded bytes from which a batch is split across threads; below it the calling thread does all
#: of it. ``store.get`` of real VecNorm'd float stacks on the 2-core VM, quiet (load under 1),
#: one thread against split in two, wall ms (``python benchmarks/bench_check_decode.py``): 3.6 MB
#: decoded 1.47 against 1.80, 7.2 MB (32 sampled transitions with their next observations) 2.67
#: against 2.09; the split costs 0.3-0.5 ms more CPU at any size (two slices' fixed costs, the
#: handoff, the other core's caches). Even at about 5 MB.
MIN_SPLIT_BYTES = 5 << 20
#: Decoded bytes from which :func:`decode_checked` splits a batch of many small blobs (time chunks
#: of Atari frames: ~56 kB decoded from ~1 kB each) across threads: a batch-256 sample of stacks
#: with next observations (~180 chunks, 10 MB) splits, a batch-64 one (~90 chunks, 5 MB) does not.
#: In isolation the split pays from fewer chunks: with the pool thread's slice prepared by the
#: caller and a run of frames decoded per reader, the readinto split of 45 chunks took 327 us
#: against 441 us on one thread (1.35x), and a whole split decode_checked of 180 chunks 1,941 us
#: against 3,000 us for the one-thread decode_checked before this change (quiet bursts on a shared
#: 2-core VM, 2026-12-07, alternating on ``bench_handoff.py``'s chunks; few bursts: noisy). But
#: through a store's get on that VM (``profile_calls.py --threads 2 --only storage.get32
#: rb.sample32`` with this at 2 MiB against 8 MiB, alternating, the machine not quiet) a B=32
#: sample was slower split (storage.get32 1.4-1.8 ms against 1.2-1.5 ms), also with
#: OMP_WAIT_POLICY=PASSIVE: the pool thread wakes ~35 us after it is given work and the caller
#: ~30 us after it is done, and on a VM a busy second vCPU delays both. Lower it only on a quiet
#: run of both benchmarks (``bench_handoff.py --quiet-only`` for the break-even). Quiet, later the
#: same day: ``bench_handoff.py`` gave the split 1.07x at 45 chunks, 1.30x at 90 and 1.48x at 180,
#: but ``python benchmarks/bench_split_point.py`` (rb.sample at 2 against 8 MiB, alternating)
#: swung both ways from run to run at B=32-128 (LazyTensorStorage's own B=32 moved 0.72-1.45 ms).
MIN_CHUNK_SPLIT_BYTES = 8 << 20
# What a check and decode returns when every blob passed (read-only: shared by every call)
_NONE = np.empty(0, np.int64)
_NONE.flags.writeable = False
# Work weight of a checksummed (compressed) byte against a decoded byte: checking ~0.86 MB of
# zstd frames cost ~0.5 ms of thread CPU and decoding their 7.2 MB ~1.8 ms on a 2-core VM, so a
# checked byte costs about 2.5 decoded bytes.
_CHECK_WEIGHT = 5 / 2


def decode_cells_checked(codec: Codec, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                         checksums: np.ndarray | None, which: np.ndarray, out: np.ndarray, cell_nbytes: int,
                         *, threads: int) -> np.ndarray:
    """Decode blob ``which[k]`` into ``out[k * cell_nbytes : (k + 1) * cell_nbytes]`` for every
    ``k``, each blob checked against ``checksums`` first, on up to ``threads`` threads.

    A blob that several cells use is checked once and decoded for each of them.

    Args:
        codec: decodes the blobs (every blob decodes to ``cell_nbytes`` bytes).
        data: uint8 buffer holding the compressed blobs.
        offsets, sizes: where each blob lies in ``data``.
        checksums: each blob's expected checksum (int64), or None to decode unchecked.
        which: int64 blob position (into ``offsets``) of each cell; every blob is used at least once.
        out: uint8 buffer of at least ``which.size * cell_nbytes`` bytes.
        cell_nbytes: decoded bytes of one cell.
        threads: most threads to use (the calling thread included).

    Returns:
        The positions (into ``offsets``) of blobs whose checksum differs, sorted; when it is not
        empty, ``out`` holds no meaningful bytes.

    Raises:
        CorruptionError: a blob whose checksum matched could not be decoded (from the codec).
    """
    n = sizes.size
    parts = max(1, min(int(threads), n)) if which.size * cell_nbytes >= MIN_SPLIT_BYTES else 1
    if parts == 1:
        wrong = _check_slice(data, offsets, sizes, checksums)
        if wrong is not None:
            return wrong
        codec.decode(data, offsets[which], sizes[which], out, np.arange(which.size, dtype=np.int64) * cell_nbytes,
                     np.full(which.size, cell_nbytes, dtype=np.int64))
        return _NONE
    work = np.bincount(which, minlength=n) * cell_nbytes + sizes * _CHECK_WEIGHT
    bounds = split_balanced(work, parts).tolist()
    # the cells by blob: slice j decodes the cells of blobs bounds[j]:bounds[j + 1]
    cells = which.argsort(kind="stable")
    blobs = which[cells]
    cell_bounds = blobs.searchsorted(bounds).tolist()
    sliced = codec.sliced_decode(data, offsets[blobs], sizes[blobs], out, cells * cell_nbytes,
                                 np.full(cells.size, cell_nbytes, dtype=np.int64), cell_bounds)
    return _run_split(sliced, data, offsets, sizes, checksums, bounds)


def decode_checked(codec: Codec, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                   checksums: np.ndarray | None, out: np.ndarray, out_offsets: np.ndarray,
                   out_sizes: np.ndarray, *, threads: int) -> np.ndarray:
    """Decode blob ``i`` into ``out[out_offsets[i] : out_offsets[i] + out_sizes[i]]`` for every
    ``i``, each blob checked against ``checksums`` first, on up to ``threads`` threads.

    A batch of at least :data:`MIN_CHUNK_SPLIT_BYTES` decoded is cut into one slice of blobs per
    thread (by the work each blob costs). The calling thread checks the other threads' slices and
    prepares their decodes (:meth:`~tiered.codecs.base.Codec.sliced_decode`), hands them off, then
    checks and decodes its own: a blob is always checked before it is decoded, and a pool thread
    runs only its decode. A slice no pool thread has started when the calling thread is done with
    its own is decoded by the calling thread (``run_parallel(claim=True)``).

    Args:
        codec: decodes the blobs.
        data: uint8 buffer holding the compressed blobs.
        offsets, sizes: where each blob lies in ``data`` (int64).
        checksums: each blob's expected checksum (int64), or None to decode unchecked.
        out: uint8 buffer the blobs decode into.
        out_offsets, out_sizes: where each blob's decoded bytes go, and how many there are (int64).
        threads: most threads to use (the calling thread included).

    Returns:
        The positions of blobs whose checksum differs, sorted; when it is not empty, ``out`` holds
        no meaningful bytes.

    Raises:
        CorruptionError: a blob whose checksum matched could not be decoded (from the codec).

    Example:
        >>> import numpy as np
        >>> from tiered.codecs import get_codec
        >>> codec = get_codec("zstd")
        >>> raw = np.arange(2 * 4096, dtype=np.uint8)
        >>> enc = codec.encode(raw, np.array([0, 4096]), np.full(2, 4096))
        >>> out = np.empty(2 * 4096, np.uint8)
        >>> bad = decode_checked(codec, enc.data, enc.offsets, enc.sizes, enc.checksums, out,
        ...                      np.array([4096, 0]), np.full(2, 4096), threads=2)
        >>> bad.tolist(), bool((out[4096:] == raw[:4096]).all())
        ([], True)
    """
    n = sizes.size
    if n < 2 or threads < 2 or int(np.add.reduce(out_sizes)) < MIN_CHUNK_SPLIT_BYTES:
        wrong = _check_slice(data, offsets, sizes, checksums)
        if wrong is None:
            codec.decode(data, offsets, sizes, out, out_offsets, out_sizes)
            return _NONE
        return wrong
    parts = min(int(threads), n)
    bounds = split_balanced(out_sizes + sizes * _CHECK_WEIGHT, parts).tolist()
    sliced = codec.sliced_decode(data, offsets, sizes, out, out_offsets, out_sizes, bounds)
    return _run_split(sliced, data, offsets, sizes, checksums, bounds)


def _run_split(sliced: SlicedDecode, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
               checksums: np.ndarray | None, bounds: list[int]) -> np.ndarray:
    """Check blobs ``bounds[j]:bounds[j + 1]`` and run ``sliced``'s job ``j`` for every slice ``j``,
    each slice's blobs checked before its job runs; returns the damaged blobs' positions (then
    ``out`` holds no meaningful bytes) or an empty array."""
    # The pool threads' slices (1, 2, ...) are checked and their jobs prepared here, before the
    # handoff: a pool thread then runs only its decode (one C call for zstd, holding the GIL only
    # between runs of frames), where Python work on two threads at once would take turns on the
    # GIL. The calling thread checks and prepares its own slice (0) after the handoff, while they wake.
    parts = len(bounds) - 1
    own: list[np.ndarray | None] = [None]  # the calling thread's slice's damaged blobs, if any
    jobs: list[tuple] = [(_check_and_run, (sliced, data, offsets[:bounds[1]], sizes[:bounds[1]],
                                           None if checksums is None else checksums[:bounds[1]], own))]
    for j in range(1, parts):
        a, b = bounds[j], bounds[j + 1]
        if checksums is not None and _check_slice(data, offsets[a:b], sizes[a:b], checksums[a:b]) is not None:
            # damage: nothing is decoded, every damaged blob of the batch is reported
            return _check_slice(data, offsets, sizes, checksums)  # type: ignore[return-value]
        jobs.append(sliced.job(j))
    try:
        run_parallel(_run_job, jobs, parts, claim=True)
    except Exception as e:  # noqa: BLE001 - the codec words it (naming the blob) and raises it
        sliced.finish(e)  # raises, or has decoded every failed slice again frame by frame
        return own[0] if own[0] is not None else _NONE
    if own[0] is not None:
        return own[0]
    sliced.finish(None)
    return _NONE


def _run_job(fn: Callable[..., object], args: tuple) -> None:
    fn(*args)


def _check_and_run(sliced: SlicedDecode, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                   checksums: np.ndarray | None, own: list[np.ndarray | None]) -> None:
    """Slice 0 of a split :func:`decode_checked` (the calling thread's, unless a pool thread
    claimed it first): checked, then prepared and decoded; its damaged blobs go to ``own[0]``."""
    wrong = _check_slice(data, offsets, sizes, checksums)
    if wrong is not None:
        own[0] = wrong
        return
    fn, args = sliced.job(0)
    fn(*args)


def _check_slice(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                 checksums: np.ndarray | None) -> np.ndarray | None:
    """Positions (within the slice) of blobs whose checksum differs, or None when all match."""
    if checksums is None:
        return None
    wrong = (segment_checksums(data, offsets, sizes) != checksums).nonzero()[0]
    return wrong if wrong.size else None


