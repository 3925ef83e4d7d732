"""The arrays' files: one file per array holding the last commit, changed in place, and the
before-images through which a crash, and a reader of an older commit, get the old bytes back.

Design note:

* **Files.** Each array of a commit (index columns, row tables, dense columns, ...) lives in
  ``arrays/<name>.<f>.npy``, ``f`` being the commit that created the file (the manifest's
  ``array_files``). A commit writes only what changed of an array indexed by row or blob id, in
  place: the dirty row or blob-id blocks widened to :data:`WRITE_UNIT`, and for an array that
  grew (blob ids added) its header and new tail: the file only gets longer. An array that shrank
  or changed dtype, and a small array whose changes are not tracked by block that differs from
  its file, is written whole to a new file ``<name>.<g>.npy``; the old file is never written
  again.
* **Before-images.** What a commit writes in place, the file ``arrays/undo.<g>`` holds first as
  the file held it (pages that were all zero, rows never written, as ranges alone), with the
  file's size and a CRC-32 per :data:`PAGE_BYTES` page: a crash
  between the intent and the manifest is undone from it (:func:`roll_back`), and a reader of an
  older commit rebuilds its pages from the images of the commits after it
  (:meth:`UndoChain.rebuild`). The order of a commit's writes, what a crash leaves and what
  readers see: the design note of :mod:`tiered.durable`.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> d = tempfile.mkdtemp()
    >>> a = np.arange(10_000, dtype=np.int64)
    >>> first = write_new(os.path.join(d, "x.npy"), a, 1)
    >>> a[5] = -1
    >>> blocks = np.zeros(1, dtype=bool); blocks[0] = True
    >>> runs = plan_in_place(os.path.join(d, "x.npy"), a, blocks, first)
    >>> old = read_runs(os.path.join(d, "x.npy"), runs)
    >>> again = write_in_place(os.path.join(d, "x.npy"), a, runs, first)
    >>> again.size == first.size and again.written < first.written, int(np.load(os.path.join(d, "x.npy"))[5])
    (True, -1)
    >>> int(np.frombuffer(old, np.int64, 1, 128 + 40)[0])  # the before-image of element 5
    5
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptionError, StaleReadError
from ..util import fileio
from ..util.crc import crc32_patch
from ..util.dirty import BLOCK_SHIFT
from ..util.filemap import npy_header
from .manifest import PAGE_BYTES, page_checksums, read_npy_header

__all__ = ["KEEP", "ARRAYS_DIR", "INTENT", "WRITE_UNIT", "FileState", "UndoImage", "UndoChain", "array_file",
           "undo_file", "stale_error", "kind_of", "plan_in_place", "read_runs", "write_in_place", "write_new", "write_undo",
           "Pending", "sync_files", "standing_intent",
           "roll_back", "remove_obsolete", "write_intent", "read_intent", "read_intent_token", "stamp_of"]

#: Commits whose before-images are kept: a read-only open reads its commit until the writer's
#: ``KEEP + 1``-th commit after it starts.
KEEP = 2
ARRAYS_DIR = "arrays"
INTENT = "commit.intent"
_INTENT_MAGIC = 0x7469657265643221  # "tiered2!"
#: Bytes a commit writes at least around a change (a memory page: a whole page of a file is then
#: what a writer maps back from it).
WRITE_UNIT = max(4096, mmap.PAGESIZE)
_UNDO_MAGIC = b"tieredU1"
#: A before-image file's head: magic, generation, bytes of its JSON table, CRC-32 of the table.
_UNDO_HEAD = struct.Struct("<8sqqI4x")
#: Largest JSON table of a before-image file accepted (it lists the arrays a commit changed).
_MAX_UNDO_TABLE = 16 << 20
_ARRAY_FILE = re.compile(r"^(.+)\.(\d+)\.npy$")
_UNDO_FILE = re.compile(r"^undo\.(\d+)$")


@dataclass
class FileState:
    """What an array's file holds: the array as the last commit left it.

    Attributes:
        file: the commit that created the file (its name's number, :func:`array_file`).
        size: bytes of the file.
        crcs: CRC-32 of each :data:`PAGE_BYTES` page of the file.
        written: bytes the last write of the file wrote (for measurements).
        ranges: the byte ranges ``[lo, hi)`` the last write wrote (what a writer may map back from
            the file, :func:`tiered.util.filemap.remap`).
        stamp: the file's identity and time stamps once written (:func:`stamp_of`; None: not known).
    """

    file: int
    size: int
    crcs: list[int]
    written: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)
    stamp: tuple[int, int, int, int] | None = None


def array_file(store: str, name: str, file: int) -> str:
    """The file of array ``name`` created by commit ``file`` in the store directory ``store``."""
    return os.path.join(store, ARRAYS_DIR, f"{name}.{file}.npy")


def undo_file(store: str, generation: int) -> str:
    """The before-image file of commit ``generation``."""
    return os.path.join(store, ARRAYS_DIR, f"undo.{generation}")


def kind_of(name: str) -> str:
    """How an array's first axis is indexed: ``"rows"``, ``"blobs"``, or ``"whole"`` (arrays whose
    changes are not tracked by block: a commit compares them with their file)."""
    if name in ("written", "flags") or name.startswith(("dense.", "rows.")) or name == "priority.rows":
        return "rows"
    if name.startswith("index.") and name not in ("index.free_ids", "index.meta"):
        return "blobs"
    if name.startswith("policy.") and not name.endswith(".clock"):
        return "blobs"
    return "whole"


def _dirty_runs(arr: np.ndarray, hlen: int, size: int, blocks: np.ndarray) -> np.ndarray:
    """Byte runs ``[lo, hi)`` of the file holding the elements of the dirty id ``blocks`` (first
    axis of ``arr``), widened to whole :data:`WRITE_UNIT` units (clipped to the file's end) and
    merged: an ``(n, 2)`` int64 array, sorted."""
    ids = np.flatnonzero(blocks)
    if not (ids.size and arr.ndim and arr.shape[0]):
        return np.empty((0, 2), dtype=np.int64)
    row_bytes = arr.nbytes // arr.shape[0]
    lo = hlen + (ids << BLOCK_SHIFT) * row_bytes
    hi = np.minimum(hlen + ((ids + 1) << BLOCK_SHIFT) * row_bytes, size)
    keep = lo < hi
    return _merge(lo[keep] // WRITE_UNIT * WRITE_UNIT, np.minimum(-(-hi[keep] // WRITE_UNIT) * WRITE_UNIT, size))


def _merge(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Sorted, merged runs of the byte ranges ``[lo, hi)`` (touching ranges join)."""
    if not lo.size:
        return np.empty((0, 2), dtype=np.int64)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order].astype(np.int64), np.maximum.accumulate(hi[order].astype(np.int64))
    start = np.ones(lo.size, dtype=bool)
    start[1:] = lo[1:] > hi[:-1]  # a gap before it: a new run
    first = np.flatnonzero(start)
    last = np.append(first[1:], lo.size) - 1
    return np.stack([lo[first], hi[last]], axis=1)


def _pages_of(runs: np.ndarray, n_pages: int) -> np.ndarray:
    """Which :data:`PAGE_BYTES` pages the byte ``runs`` touch (a bool per page)."""
    pages = np.zeros(n_pages + 1, dtype=np.int64)
    if runs.size:
        np.add.at(pages, runs[:, 0] // PAGE_BYTES, 1)
        np.add.at(pages, (runs[:, 1] - 1) // PAGE_BYTES + 1, -1)
    return np.cumsum(pages)[:n_pages] > 0


def _reusable(fd: int, path: str, base: FileState | None, hlen: int, arr: np.ndarray) -> bool:
    """Whether the file on disk is the one ``base`` describes, with a header of ``hlen`` bytes and
    the dtype and row shape of ``arr`` (an array whose dtype changed, as a narrowed dense column
    widened by a write, has every page moved: it is rewritten whole)."""
    if base is None:
        return False
    size = os.fstat(fd).st_size
    if size != base.size or len(base.crcs) != -(-size // PAGE_BYTES):
        return False
    try:
        head = read_npy_header(fd, path, size)
    except CorruptionError:
        return False
    return head.offset == hlen and head.dtype == arr.dtype and tuple(head.shape[1:]) == arr.shape[1:]


def _source(arr: np.ndarray, before: Callable[[int, int], None] | None = None) -> tuple[_Source, int]:
    """The ``.npy`` file's bytes of ``arr`` (:class:`_Source`) and the file's size."""
    if not (arr.flags.c_contiguous or arr.ndim == 1):
        arr = np.ascontiguousarray(arr)
    head = npy_header(arr.shape, arr.dtype)  # the same header file_array lays out in memory
    flat = arr.reshape(-1) if arr.flags.c_contiguous else arr
    return _Source(head, flat, max(arr.itemsize, 1), before), len(head) + arr.nbytes


def plan_in_place(path: str, arr: np.ndarray, blocks: np.ndarray | None, base: FileState | None) -> np.ndarray | None:
    """The byte runs ``[lo, hi)`` (an ``(n, 2)`` int64 array) of the file ``path``, which holds
    ``base``, that a commit rewrites in place to make it ``arr``'s ``.npy`` file: those of the
    dirty id ``blocks``, widened to whole :data:`WRITE_UNIT` units; with ``blocks`` None (an array
    whose changes no block tracks), none where the file holds its bytes already.

    An array that grew (a blob-indexed array gets longer as blob ids are added) is written in
    place too: its header and its new tail with the dirty blocks; the file only gets longer
    (what a reader maps stays where it was).

    Returns:
        None where the array cannot be written in place: no ``base``, a file that is not the one
        ``base`` describes, an array that shrank or whose dtype or row shape changed, or one not
        tracked by block that differs from its file: the array then goes to a new file
        (:func:`write_new`).
    """
    source, size = _source(arr)
    if base is None or size < base.size or (size > base.size and blocks is None):
        return None
    try:
        fd = fileio.open_for_read(path)
    except (FileNotFoundError, CorruptionError):
        return None
    try:
        hlen = len(source.head)
        if not _reusable(fd, path, base, hlen, arr):
            return None
        if size == base.size:
            if os.pread(fd, hlen, 0) != source.head:
                return None
            if blocks is None:
                # a small array that changes goes to a new file: what an open checks before it
                # reads any page (index.meta's count) is never half a commit's
                return np.empty((0, 2), dtype=np.int64) if _holds(fd, source, size) else None
            return _dirty_runs(arr, hlen, size, blocks)
        # grown (more blob ids): the header and the tail too, in place; the file only gets longer
        runs = _dirty_runs(arr, hlen, size, blocks)
        tail = base.size // WRITE_UNIT * WRITE_UNIT
        return _merge(np.append(runs[:, 0], [0, tail]),
                      np.append(runs[:, 1], [min(size, -(-hlen // WRITE_UNIT) * WRITE_UNIT), size]))
    finally:
        fileio.close(fd)


def read_runs(path: str, runs: np.ndarray) -> np.ndarray:
    """The bytes of the file ``path`` in the byte ``runs``, one after the other (``uint8``).

    Raises:
        CorruptionError: the file is shorter than the runs.
    """
    lengths = runs[:, 1] - runs[:, 0]
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    if not out.size:
        return out
    fd = fileio.open_for_read(path)
    try:
        at = 0
        for (lo, hi), n in zip(runs.tolist(), lengths.tolist(), strict=True):  # the commit's runs of this file
            if fileio.read_into(fd, memoryview(out)[at:at + n], lo) != n:
                raise CorruptionError(f"{path}: shorter than its last commit wrote it (at least {hi} bytes "
                                      "expected); another process changed the store's files: open the store again")
            at += n
    finally:
        fileio.close(fd)
    return out


def write_in_place(path: str, arr: np.ndarray, runs: np.ndarray, base: FileState,
                   before: Callable[[int, int], None] | None = None, pending: Pending | None = None) -> FileState:
    """Write the byte ``runs`` of ``arr``'s ``.npy`` file into ``path`` (which holds ``base``, with
    the same header) and fsync it. Returns what the file now holds, with the CRC-32 of every page
    (those not touched are ``base``'s). ``before(lo, hi)`` is called with each range of ``arr``'s
    bytes before they are read (to check bytes memory-mapped from a file whose pages are checked
    on first use).

    A page that a run covers in part gets its new CRC from ``base``'s and the bytes that changed
    (:func:`_write_runs`): what a commit writes and hashes is what changed, not the size of the
    array (nor of a checksum page). With ``pending``, the fsync is left to :func:`sync_files`.
    """
    if not runs.size:
        return FileState(base.file, base.size, base.crcs, 0, [], base.stamp)
    source, size = _source(arr, before)
    fd = fileio.open_for_write(path)
    try:
        crcs = list(base.crcs) + [0] * max(0, -(-size // PAGE_BYTES) - len(base.crcs))
        written, ranges = _write_runs(fd, path, source, runs, base, crcs, size)
        stamp = stamp_of(os.fstat(fd))  # an fsync changes none of what it notes
    except BaseException:
        fileio.close(fd)
        raise
    _sync_or_defer(fd, pending)
    return FileState(base.file, size, crcs, written, ranges, stamp)


def write_new(path: str, arr: np.ndarray, file: int, before: Callable[[int, int], None] | None = None,
              pending: Pending | None = None) -> FileState:
    """Write ``arr`` whole as the new ``.npy`` file ``path`` (created by commit ``file``) and fsync
    it (with ``pending``: leave it to :func:`sync_files`); the caller fsyncs the directory before
    publishing. A file left there by a commit that died is replaced: no commit published it, so
    no reader maps it."""
    source, size = _source(arr, before)
    fileio.remove(path)
    fd = fileio.open_for_write(path, exclusive=True)
    try:
        fileio.truncate(fd, size)
        parts, at = source.parts(0, size), 0
        for part in parts:  # header and data: two at most
            fileio.pwrite(fd, part, at)
            at += part.nbytes
        stamp = stamp_of(os.fstat(fd))  # an fsync changes none of what it notes
    except BaseException:
        fileio.close(fd)
        raise
    _sync_or_defer(fd, pending)
    return FileState(file, size, page_checksums(parts), size, [(0, size)], stamp)


#: Files written but not fsynced yet, each with what to do once it is (:func:`sync_files`).
Pending = list[tuple[int, Callable[[], None] | None]]


def _sync_or_defer(fd: int, pending: Pending | None) -> None:
    """fsync and close ``fd``, or leave that to :func:`sync_files`."""
    if pending is not None:
        pending.append((fd, None))
        return
    try:
        fileio.fsync(fd)
    finally:
        fileio.close(fd)


def sync_files(pending: Pending) -> None:
    """fsync the files of ``pending`` all at once, close them, then run what each waits for (in
    order), and empty ``pending``.

    The fsyncs run on several threads: the file system then makes them durable in one journal
    commit, where one after the other each waits for its own (a commit's few dozen files take a
    few milliseconds instead of a few dozen). Nothing after this call starts before every file is
    durable, so the order of what is durable when is the same as one fsync after the other.

    Raises:
        OSError: the first fsync that failed (as :func:`~tiered.util.fileio.fsync_many` raises it),
            once every one has finished (every file is closed; nothing waiting runs).
    """
    todo, pending[:] = list(pending), []
    try:
        fileio.fsync_many([fd for fd, _ in todo])
    finally:
        for fd, _ in todo:  # every file of the commit: a few dozen
            fileio.close(fd)
    for _, then in todo:  # a rename or two
        if then is not None:
            then()


def stamp_of(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when another program writes, truncates or replaces a file: its inode, size,
    and modification and change times."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass
class _Source:
    """The bytes of a ``.npy`` file as they are in memory: its header, then the array's bytes."""

    head: bytes
    flat: np.ndarray
    item: int
    before: Callable[[int, int], None] | None

    def parts(self, b0: int, b1: int) -> list[memoryview]:
        """The file's bytes ``[b0, b1)``: a piece of the header and a piece of the array."""
        hlen, out = len(self.head), []
        if b0 < hlen:
            out.append(memoryview(self.head)[b0:min(b1, hlen)])
        if b1 > hlen:
            if self.before is not None:
                self.before(max(b0, hlen) - hlen, b1 - hlen)
            e0, e1 = (max(b0, hlen) - hlen) // self.item, (b1 - hlen) // self.item
            out.append(memoryview(np.ascontiguousarray(self.flat[e0:e1]).reshape(-1).view(np.uint8)))
        return out


def _holds(fd: int, source: _Source, size: int) -> bool:
    """Whether the file (``size`` bytes, as the array's) holds ``source``'s bytes."""
    disk = np.empty(size, dtype=np.uint8)
    if fileio.read_into(fd, memoryview(disk), 0) != size:
        return False
    pos = 0
    for part in source.parts(0, size):  # header, then the array: compared where they lie, no joined copy
        mem = np.frombuffer(part, dtype=np.uint8)
        if not np.array_equal(disk[pos:pos + mem.size], mem):
            return False
        pos += mem.size
    return True


#: Most bytes of pages read at once while a commit rewrites parts of them.
_SPAN_BYTES = 16 * PAGE_BYTES


def _write_runs(fd: int, path: str, source: _Source, runs: np.ndarray, base: FileState, crcs: list[int],
                size: int) -> tuple[int, list[tuple[int, int]]]:
    """Write the byte ``runs`` of the file from ``source``, updating ``crcs`` of the pages they
    touch; returns the bytes written and the ranges written.

    A page that is whole before and after (all but the last one or two) gets its new CRC from
    its old one and the bytes that changed (:func:`~tiered.util.crc.crc32_patch`): a few KiB
    written in a 1 MiB page cost a few KiB to hash. The others are read, checked and hashed
    whole (:func:`_splice_pages`)."""
    whole = min(size, base.size) // PAGE_BYTES * PAGE_BYTES  # bytes of the pages whole before and after
    written, ranges, rest = 0, [], []
    for r0, r1 in runs.tolist():  # a few runs per array
        if r0 < whole:
            written += _patch_pages(fd, path, source, r0, min(r1, whole), crcs)
            ranges.append((r0, min(r1, whole)))
        if r1 > whole:
            rest.append((max(r0, whole), r1))
    end = min(size, whole + PAGE_BYTES)  # the old last page, when short, as it ends now
    if rest and whole < base.size < end and _covers(rest, base.size, end):
        # the short last page grows (blob ids added): its CRC patched and extended, not the page
        # read and hashed whole (every grown index column paid a read and a hash of up to 1 MiB)
        mine = [(r0, min(r1, end)) for r0, r1 in rest if r0 < end]
        written += _grow_page(fd, path, source, mine, whole, base.size, end, crcs)
        ranges += mine
        rest = [(max(r0, end), r1) for r0, r1 in rest if r1 > end]
    if rest:
        more, where = _splice_pages(fd, source, np.array(rest, dtype=np.int64), base, crcs, size)
        written += more
        ranges += where
    return written, ranges


def _patch_pages(fd: int, path: str, source: _Source, b0: int, b1: int, crcs: list[int]) -> int:
    """Write bytes ``[b0, b1)`` (on pages whole before and after) from ``source``; pages it covers
    whole get the CRC of their bytes, the others their CRC patched. Returns the bytes written."""
    m0, m1 = -(-b0 // PAGE_BYTES) * PAGE_BYTES, b1 // PAGE_BYTES * PAGE_BYTES  # the whole pages inside
    if m0 < m1:
        parts, at = source.parts(m0, m1), m0
        for part in parts:  # header and data: two at most
            fileio.pwrite(fd, part, at)
            at += part.nbytes
        crcs[m0 // PAGE_BYTES:m1 // PAGE_BYTES] = page_checksums(parts)
    pieces = [(b0, min(b1, m0)), (max(b0, m1), b1)] if m0 < m1 else [(b0, min(b1, m0)), (max(b0, m0), b1)]
    for a, b in pieces:  # the parts of pages at either end (each within one page)
        if a >= b:
            continue
        new = b"".join(source.parts(a, b))
        old = bytearray(b - a)
        if fileio.read_into(fd, memoryview(old), a) != b - a:
            raise CorruptionError(f"{path}: shorter than its last commit wrote it (at least {b} bytes expected); "
                                  "another process changed the store's files: open the store again")
        p = a // PAGE_BYTES
        crcs[p] = crc32_patch(crcs[p], PAGE_BYTES, a - p * PAGE_BYTES, old, new)
        fileio.pwrite(fd, new, a)
    return b1 - b0


def _covers(runs: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether the sorted, disjoint byte ``runs`` cover ``[lo, hi)`` without a gap."""
    at = lo
    for r0, r1 in runs:  # a few
        if r0 > at:
            break
        at = max(at, r1)
    return at >= hi


def _grow_page(fd: int, path: str, source: _Source, runs: list[tuple[int, int]], lo: int, old_end: int,
               end: int, crcs: list[int]) -> int:
    """Write the byte ``runs`` of the page at ``lo``, which held ``[lo, old_end)`` and now ends at
    ``end`` (the runs cover ``[old_end, end)``): its CRC-32 is patched with the bytes that changed
    in its old part (:func:`~tiered.util.crc.crc32_patch`, as :func:`_patch_pages` does) and extended
    over the new bytes, so damage elsewhere in the page stays detectable. Returns the bytes written."""
    p = lo // PAGE_BYTES
    crc = crcs[p]
    for r0, r1 in runs:  # a few runs in the old part, then the new tail
        a, b = r0, min(r1, old_end)
        if a < b:
            new = b"".join(source.parts(a, b))
            old = bytearray(b - a)
            if fileio.read_into(fd, memoryview(old), a) != b - a:
                raise CorruptionError(f"{path}: shorter than its last commit wrote it (at least {old_end} bytes "
                                      "expected); another process changed the store's files: open the store again")
            crc = crc32_patch(crc, old_end - lo, a - lo, old, new)
            fileio.pwrite(fd, new, a)
    tail = b"".join(source.parts(old_end, end))
    fileio.pwrite(fd, tail, old_end)
    crcs[p] = zlib.crc32(tail, crc)
    return sum(r1 - r0 for r0, r1 in runs)


def _splice_pages(fd: int, source: _Source, runs: np.ndarray, base: FileState, crcs: list[int],
                  size: int) -> tuple[int, list[tuple[int, int]]]:
    """Write the byte ``runs`` on pages whose size changed (or that are new): each page is read,
    checked against ``base``'s CRC (one that fails is rewritten whole from ``source``), the runs
    are written into it and its CRC is that of the whole page."""
    n_pages = len(crcs)
    touched = _pages_of(runs, n_pages)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], touched.astype(np.int8), [0]]))).reshape(-1, 2)
    spans = [(p, min(p + _SPAN_BYTES // PAGE_BYTES, p1)) for p0, p1 in edges.tolist()
             for p in range(p0, p1, _SPAN_BYTES // PAGE_BYTES)]  # a few per array
    written, ranges = 0, []
    for p0, p1 in spans:
        b0, b1 = p0 * PAGE_BYTES, min(p1 * PAGE_BYTES, size)
        page = np.empty(b1 - b0, dtype=np.uint8)
        old = max(0, min(b1, base.size) - b0)  # bytes of the span the file held before
        got = fileio.read_into(fd, memoryview(page)[:old], b0)
        sums = page_checksums([memoryview(page)[:got]]) if got else []
        for k, p in enumerate(range(p0, p1)):  # the pages as base's commit left them (16 at most)
            lo, hi = p * PAGE_BYTES, min((p + 1) * PAGE_BYTES, base.size)
            if lo < base.size and (b0 + got < hi or p >= len(base.crcs) or sums[k] != base.crcs[p]):
                # not what base's commit wrote: rewritten whole from memory
                runs = _merge(np.append(runs[:, 0], lo), np.append(runs[:, 1], min(lo + PAGE_BYTES, size)))
        inside = runs[(runs[:, 0] < b1) & (runs[:, 1] > b0)]
        for r0, r1 in inside.tolist():  # the dirty runs of these pages: a few
            r0, r1 = max(r0, b0), min(r1, b1)
            at = r0
            for part in source.parts(r0, r1):
                page[at - b0:at - b0 + part.nbytes] = np.frombuffer(part, dtype=np.uint8)
                at += part.nbytes
            fileio.pwrite(fd, memoryview(page)[r0 - b0:r1 - b0], r0)
            written += r1 - r0
            ranges.append((r0, r1))
        crcs[p0:p1] = page_checksums([memoryview(page)])
    return written, ranges


def write_undo(store: str, generation: int, images: list[tuple[str, int, int, np.ndarray, np.ndarray]],
               pending: Pending) -> int:
    """Durably write the before-images of commit ``generation``: per array ``(name, file, size,
    runs, old)``, the byte ``runs`` of its file ``file`` (``size`` bytes now) about to be
    rewritten, within ``size``, and their ``old`` bytes.
    The file is written under a temp name, left in ``pending`` to be fsynced and renamed
    (:func:`sync_files`); the caller fsyncs the directory before the intent names the commit.
    Returns the bytes written.

    Layout: :data:`_UNDO_HEAD`, a JSON table (``arrays``: ``[name, file, runs, offset, size,
    zero_runs]`` each, ``body``: bytes of the body, ``crcs``: CRC-32 of each :data:`PAGE_BYTES`
    page of the body), then the body: per array its runs as ``(n, 2)`` little-endian int64, its
    zero runs likewise, then the old bytes of its runs. A run whose old bytes are all zero (rows
    or blob ids never written: a buffer's first fill, an import) is a zero run and keeps no bytes.
    """
    parts: list[memoryview] = []
    table, at = [], 0
    for name, file, size, runs, old in images:  # the arrays the commit changes in place (a few dozen)
        runs, kept, lengths = _zero_pages(runs, old)
        if not kept.all():
            old = old[np.repeat(kept, lengths)]
        spans = np.ascontiguousarray(runs[kept], dtype="<i8")
        zeros = np.ascontiguousarray(runs[~kept], dtype="<i8")
        table.append([name, int(file), int(spans.shape[0]), at, int(size), int(zeros.shape[0])])
        parts += [memoryview(spans.reshape(-1).view(np.uint8)), memoryview(zeros.reshape(-1).view(np.uint8)),
                  memoryview(np.ascontiguousarray(old, dtype=np.uint8))]
        at += spans.nbytes + zeros.nbytes + old.nbytes
    meta = json.dumps({"generation": generation, "arrays": table, "body": at,
                       "crcs": page_checksums(parts)}).encode()
    path = undo_file(store, generation)
    tmp = path + ".new"
    fileio.remove(tmp)  # left by a commit that died here: it holds nothing known
    fd = fileio.open_for_write(tmp, exclusive=True)
    try:
        fileio.pwrite(fd, _UNDO_HEAD.pack(_UNDO_MAGIC, generation, len(meta), zlib.crc32(meta)) + meta, 0)
        pos = _UNDO_HEAD.size + len(meta)
        for part in parts:  # three per array
            if part.nbytes:
                fileio.pwrite(fd, part, pos)
                pos += part.nbytes
    except BaseException:
        fileio.close(fd)
        raise
    pending.append((fd, lambda: fileio.replace(tmp, path)))  # renamed once complete and durable
    return pos


def _zero_pages(runs: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``runs`` (whose bytes are ``old``, one run after the other) cut at the file's
    :data:`WRITE_UNIT` pages where their old bytes turn all-zero or back: ``(runs, kept, lengths)``,
    ``kept`` False for the runs whose old bytes are all zero. A commit's runs are whole blocks of
    rows, and a block a buffer is still filling holds rows never written (zeros) beside others."""
    if not runs.size:
        return runs, np.ones(0, dtype=bool), np.zeros(0, dtype=np.int64)
    unit = WRITE_UNIT
    first, last = runs[:, 0] // unit, (runs[:, 1] - 1) // unit
    counts = last - first + 1
    starts = np.cumsum(counts) - counts
    run_of = np.repeat(np.arange(counts.size), counts)
    page = first[run_of] + np.arange(int(counts.sum())) - starts[run_of]
    lo = np.maximum(page * unit, runs[run_of, 0])
    hi = np.minimum((page + 1) * unit, runs[run_of, 1])
    sizes = hi - lo
    nonzero = np.logical_or.reduceat(old != 0, np.cumsum(sizes) - sizes)
    # one run per stretch of pieces that touch and agree
    cut = np.ones(nonzero.size, dtype=bool)
    cut[1:] = (lo[1:] != hi[:-1]) | (nonzero[1:] != nonzero[:-1])
    begin = cut.nonzero()[0]
    end = np.append(begin[1:], nonzero.size) - 1
    merged = np.stack([lo[begin], hi[end]], axis=1)
    return merged, nonzero[begin], merged[:, 1] - merged[:, 0]


class UndoImage:
    """The before-images of one commit (:func:`write_undo`), read and checked: the head and table
    at once, the body a page at a time as it is used (each page against its CRC-32).

    Raises:
        FileNotFoundError: no such file.
        CorruptionError: naming the file, for anything :func:`write_undo` does not write.
    """

    def __init__(self, path: str, generation: int) -> None:
        self.path = path
        fd = fileio.open_for_read(path)
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, _UNDO_HEAD.size, 0)
            if len(raw) != _UNDO_HEAD.size:
                raise self.bad("shorter than its head")
            magic, g, n, crc = _UNDO_HEAD.unpack(raw)
            if magic != _UNDO_MAGIC or g != generation or not 0 < n <= min(_MAX_UNDO_TABLE, size - _UNDO_HEAD.size):
                raise self.bad(f"not the before-images of commit {generation}")
            meta = os.pread(fd, n, _UNDO_HEAD.size)
            if len(meta) != n or zlib.crc32(meta) != crc:
                raise self.bad("its table fails its checksum")
        finally:
            fileio.close(fd)
        try:
            doc = json.loads(meta)
            self.start, self.size = _UNDO_HEAD.size + n, int(doc["body"])
            self.crcs = [int(c) for c in doc["crcs"]]
            #: per array file: its runs, where they start in the body, its zero runs
            self.arrays: dict[tuple[str, int], tuple[int, int, int]] = {}
            #: bytes of each file before the commit (a file that grew is cut back to them)
            self.sizes: dict[tuple[str, int], int] = {}
            for entry in doc["arrays"]:  # (files written before zero runs have five items)
                name, file, k, at, before, *zero = entry
                if len(zero) > 1:
                    raise ValueError(f"an entry of {len(entry)} items")
                self.arrays[(str(name), int(file))] = (int(k), int(at), int(zero[0]) if zero else 0)
                self.sizes[(str(name), int(file))] = int(before)
        except (ValueError, TypeError, KeyError) as e:
            raise self.bad(f"its table cannot be read ({e})") from None
        if self.start + self.size != size or len(self.crcs) != -(-self.size // PAGE_BYTES) or any(
                k < 0 or z < 0 or at < 0 or at + 16 * (k + z) > self.size for k, at, z in self.arrays.values()) or any(
                n < 0 for n in self.sizes.values()):
            raise self.bad("its table does not fit the file")

    def bad(self, what: str) -> CorruptionError:
        """The error for this file, saying ``what`` is wrong with it."""
        return CorruptionError(f"{self.path}: a before-image file of the store, {what}; the store is damaged. "
                               "Run `tiered verify` for details.")

    def body(self, lo: int, hi: int) -> np.ndarray:
        """Bytes ``[lo, hi)`` of the body, once the pages holding them passed their checksums."""
        if hi <= lo:
            return np.empty(0, dtype=np.uint8)
        if hi > self.size:
            raise self.bad("a run lies past its end")
        p0, p1 = lo // PAGE_BYTES, -(-hi // PAGE_BYTES)
        buf = np.empty(min(p1 * PAGE_BYTES, self.size) - p0 * PAGE_BYTES, dtype=np.uint8)
        fd = fileio.open_for_read(self.path)
        try:
            got = fileio.read_into(fd, memoryview(buf), self.start + p0 * PAGE_BYTES)
        finally:
            fileio.close(fd)
        if got != buf.size or page_checksums([memoryview(buf)]) != self.crcs[p0:p1]:
            raise self.bad("its bytes fail their checksums")
        return buf[lo - p0 * PAGE_BYTES:hi - p0 * PAGE_BYTES]

    def runs(self, name: str, file: int) -> tuple[np.ndarray, np.ndarray]:
        """The byte runs of array ``name``'s file ``file`` this commit changed (``(n, 2)``) and
        where each run's old bytes start in the body: -1 for a zero run (its old bytes were all
        zero), which come after the others."""
        k, at, z = self.arrays.get((name, file), (0, 0, 0))
        runs = self.body(at, at + 16 * (k + z)).view("<i8").reshape(k + z, 2).astype(np.int64)
        lengths = runs[:, 1] - runs[:, 0]
        kept = lengths[:k]
        if k + z and (int(runs[:, 0].min()) < 0 or int(lengths.min()) <= 0
                      or at + 16 * (k + z) + int(kept.sum()) > self.size):
            raise self.bad(f"the runs of {name} are impossible")
        where = np.full(k + z, -1, dtype=np.int64)
        where[:k] = at + 16 * (k + z) + np.cumsum(kept) - kept
        return runs, where

    def overlay(self, name: str, file: int, lo: int, buf: np.ndarray) -> None:
        """Write this commit's before-images of ``name``'s file ``file`` over ``buf``, which holds
        the file's bytes ``[lo, lo + buf.size)``."""
        runs, where = self.runs(name, file)
        hi = lo + buf.size
        pick = np.flatnonzero((runs[:, 0] < hi) & (runs[:, 1] > lo))
        if not pick.size:
            return
        # the old bytes of these runs (zero runs keep none) lie together in the body, in the
        # runs' order: read (and checked) at once
        kept = pick[where[pick] >= 0]
        b0 = int(where[kept[0]]) if kept.size else 0
        old = self.body(b0, int(where[kept[-1]] + runs[kept[-1], 1] - runs[kept[-1], 0])) if kept.size else None
        for r in pick.tolist():  # the runs of one checksum page
            r0, r1 = int(runs[r, 0]), int(runs[r, 1])
            a, b = max(r0, lo), min(r1, hi)
            if where[r] < 0:
                buf[a - lo:b - lo] = 0
            else:
                src = int(where[r]) + a - r0 - b0
                buf[a - lo:b - lo] = old[src:src + b - a]


class UndoChain:
    """The before-images a read-only open of commit ``generation`` rebuilds its pages from: those
    of the commits after it (each read once, then kept while the writer's intent token stays the
    one they were read under)."""

    def __init__(self, store: str, generation: int) -> None:
        self.store, self.generation = store, generation
        self.images: dict[int, UndoImage] = {}
        #: the intent token (:func:`read_intent_token`) :attr:`images` were read under
        self.token: tuple[int, int] | None = None

    def rebuild(self, name: str, file: int, lo: int, hi: int, crc: int) -> tuple[np.ndarray | None, int | None]:
        """The bytes ``[lo, hi)`` of array ``name``'s file ``file`` as commit :attr:`generation`
        left them, and the intent they were rebuilt under: the file's bytes now, then over them
        the before-images of commits ``generation + 1`` to the intent (read *after* the file's
        bytes, so no commit after it wrote any of them), newest first, so that a byte changed by
        several commits is the oldest image's. Where the intent names no commit after
        :attr:`generation` (none was started, or the one that was died and the next writer's open
        rolled it back since the caller read the page), the file's bytes are the commit's own. The
        bytes are None where they fail ``crc``, where there is no intent, or where it names a
        commit more than :data:`KEEP` after :attr:`generation` (its images may be gone).

        Raises:
            FileNotFoundError: an image (or the file) is gone: the writer moved on meanwhile.
        """
        buf = np.empty(hi - lo, dtype=np.uint8)
        fd = fileio.open_for_read(array_file(self.store, name, file))
        try:
            got = fileio.read_into(fd, memoryview(buf), lo)
        finally:
            fileio.close(fd)
        token = read_intent_token(self.store)
        intent = standing_intent(self.store, token, self.generation)
        if got != buf.size or intent is None or intent > self.generation + KEEP:
            return None, intent
        if token != self.token:  # images read under another intent may be another commit's since
            self.images.clear()
            self.token = token
        for g in range(intent, self.generation, -1):  # newest first: the oldest image of a byte wins
            image = self.images.get(g)
            if image is None:
                image = self.images[g] = UndoImage(undo_file(self.store, g), g)
            image.overlay(name, file, lo, buf)
        return (buf if zlib.crc32(memoryview(buf)) == crc else None), intent

    def page(self, name: str, file: int, lo: int, hi: int, crc: int) -> np.ndarray | None:
        """:meth:`rebuild`, again while a commit starts or is rolled back meanwhile (a few times);
        None: the bytes are damaged (no commit after :attr:`generation` was started, or they
        cannot be made to match ``crc``).

        A rebuild that fails while the writer's intent token moves (a dead commit rolled back,
        its images removed, or a commit started) is tried again: what failed may be another
        commit's bytes or images, not damage.

        Raises:
            StaleReadError: the writer is more than :data:`KEEP` commits ahead: the before-images
                of the commits after :attr:`generation` are gone (:func:`stale_error`).
        """
        for _attempt in range(3):  # a few: each retry follows a commit that started meanwhile
            token = read_intent_token(self.store)
            try:
                got, intent = self.rebuild(name, file, lo, hi, crc)
            except (FileNotFoundError, CorruptionError) as e:
                if read_intent_token(self.store) != token:
                    continue  # the writer moved meanwhile: its images, and the file, are another commit's
                intent = standing_intent(self.store, read_intent_token(self.store), self.generation)
                if intent is not None and intent > self.generation:
                    raise stale_error(self.store, self.generation, intent) from e
                raise
            if got is not None:
                return got
            if intent is not None and intent > self.generation + KEEP:
                raise stale_error(self.store, self.generation, intent)
            if read_intent_token(self.store) == token and (intent is None or intent <= self.generation):
                return None  # no commit after this one under way, and none moved meanwhile: damaged
            self.images.clear()  # a commit rolled back and made again rewrites its images
        return None


def stale_error(store: str, generation: int, intent: int) -> StaleReadError:
    """The error of a reader of commit ``generation`` whose writer has moved on to ``intent``."""
    return StaleReadError(
        f"{store}: this store was opened read-only at commit {generation}; a writer has since "
        f"committed up to generation {intent} and reused the files of older commits. The files are "
        "most likely not damaged: reopen the store (tiered.open(path)) to read the latest commit, and "
        "run `tiered verify` if the error stays after that.")


def roll_back(store: str, published: int) -> bool:
    """Undo what a commit that died after its intent wrote in place (the writer's open of a store,
    or a writer whose commit failed): write the before-images of the commit the intent names back,
    fsync, set the intent back to ``published`` (the manifest's generation), then remove the
    images. Idempotent: a crash here is rolled back again by the next open.

    An intent file that is missing or damaged (its check word wrong: a torn write or a bad sector)
    names no commit; then the before-images of a commit after ``published``, if any, are the dead
    commit's: they are complete before its intent is written, so writing them back is right
    whether or not it got to change the arrays (left alone, the next writer's clean-up would
    remove them, and with them the only copy of the bytes the commit overwrote). A damaged intent
    with nothing to roll back is written again.

    Returns:
        Whether there was anything to roll back.

    Raises:
        CorruptionError: the intent names a commit whose before-images are missing or damaged, or
            names none and the before-images of a commit after ``published`` are damaged.
    """
    token = read_intent_token(store)
    guessed = token is None
    intent = standing_intent(store, token, published)
    if intent is None:
        if guessed and os.path.lexists(os.path.join(store, INTENT)):
            write_intent(store, published)  # damaged, with no commit under way: harmless, made whole
        return False
    if intent <= published:
        return False
    path = undo_file(store, intent)
    try:
        image = UndoImage(path, intent)
    except FileNotFoundError:
        raise CorruptionError(f"{path}: missing, though {os.path.join(store, INTENT)} says commit {intent} was "
                              "being written; the store is damaged. Run `tiered verify` for details.") from None
    except CorruptionError as e:
        if not guessed:
            raise
        raise CorruptionError(f"{os.path.join(store, INTENT)} is missing or damaged, so whether commit {intent} "
                              f"changed the arrays in place is not known, and its before-images cannot be "
                              f"read back: {e}") from None
    body = image.body(0, image.size)
    for name, file in image.arrays:  # the arrays the dead commit changed
        runs, where = image.runs(name, file)
        target = array_file(store, name, file)
        try:
            fd = fileio.open_for_write(target)
        except FileNotFoundError:
            raise CorruptionError(f"{target}: missing, though commit {intent} changed it; the store is "
                                  "damaged") from None
        try:
            old_size = image.sizes[(name, file)]
            if int(runs[:, 1].max(initial=0)) > old_size or os.fstat(fd).st_size < old_size:
                raise image.bad(f"its runs of {name} lie past the end of {target}")
            for (lo, hi), src in zip(runs.tolist(), where.tolist(), strict=True):  # the dead commit's runs
                fileio.pwrite(fd, body[src:src + hi - lo] if src >= 0 else bytes(hi - lo), lo)
            if os.fstat(fd).st_size > old_size:  # grown by the dead commit: cut back
                fileio.truncate(fd, old_size)
            fileio.fsync(fd)
        finally:
            fileio.close(fd)
    write_intent(store, published)
    fileio.remove(path)
    return True


def standing_intent(store: str, token: tuple[int, int] | None, after: int) -> int | None:
    """The commit an intent ``token`` (:func:`read_intent_token`) names; where the intent file is
    missing or garbled (``token`` None), the newest commit after ``after`` whose before-images are
    in place, which stand for it (they are complete before an intent names their commit), else None.
    The one place readers (:class:`UndoChain`) and the writer's roll-back (:func:`roll_back`) decide
    which commit was under way."""
    if token is not None:
        return token[0]
    try:
        names = os.listdir(os.path.join(store, ARRAYS_DIR))
    except FileNotFoundError:
        return None
    made = [int(m.group(1)) for m in map(_UNDO_FILE.match, names) if m is not None]  # a few files
    newest = max(made, default=after)
    return newest if newest > after else None


def remove_obsolete(store: str, published: int, current: dict[str, int]) -> None:
    """Remove what no reader of commit ``published - KEEP`` or later needs: before-images of
    commits up to ``published - KEEP`` and after ``published`` (left by a commit that died), array
    files replaced by commit ``published - KEEP`` or before, files newer than their array's (no
    commit published them), and temp files. ``current``: the file of each array of commit
    ``published``."""
    adir = os.path.join(store, ARRAYS_DIR)
    try:
        names = os.listdir(adir)
    except FileNotFoundError:
        return
    files: dict[str, list[int]] = {}
    doomed = []
    for entry in names:  # the store's array files: a few dozen
        m = _UNDO_FILE.match(entry)
        if m:
            g = int(m.group(1))
            if g <= published - KEEP or g > published:
                doomed.append(entry)
            continue
        m = _ARRAY_FILE.match(entry)
        if m:
            files.setdefault(m.group(1), []).append(int(m.group(2)))
        elif entry.endswith(".new"):
            doomed.append(entry)
    for name, made in files.items():  # per array, its files oldest first
        if name not in current:
            continue  # an array no longer saved: kept (which commit dropped it is not known)
        made.sort()
        for f, successor in zip(made, [*made[1:], None], strict=True):
            # newer than the array's file: no commit published it (one that failed wrote it)
            if f > current[name] or (f != current[name] and successor is not None and successor <= published - KEEP):
                doomed.append(f"{name}.{f}.npy")
    for entry in doomed:  # a few per commit
        fileio.remove(os.path.join(adir, entry))


def write_intent(store: str, generation: int) -> None:
    """Durably record that the commit of ``generation`` starts changing array files in place (or,
    after a roll-back, that the files hold ``generation`` again), with a count of the intents
    written that only grows: a reader tells by it that the files may have changed, even when a
    commit rolled back leaves the same generation (:func:`read_intent_token`)."""
    token = read_intent_token(store)
    sequence = token[1] + 1 if token is not None else 1
    fd = fileio.open_for_write(os.path.join(store, INTENT))
    try:
        fileio.pwrite(fd, struct.pack("<qqq", generation, generation ^ _INTENT_MAGIC, sequence), 0)
        fileio.fsync(fd)
    finally:
        fileio.close(fd)


def read_intent(store: str) -> int | None:
    """The generation the last commit that started changing array files was to publish (None:
    no intent file, or one that is not what :func:`write_intent` writes)."""
    token = read_intent_token(store)
    return token[0] if token is not None else None


def read_intent_token(store: str) -> tuple[int, int] | None:
    """``(generation, count)`` of the last :func:`write_intent`; None as for :func:`read_intent`.
    Another token means the writer wrote an intent since."""
    try:
        fd = fileio.open_for_read(os.path.join(store, INTENT))
    except (FileNotFoundError, CorruptionError):
        return None
    try:
        raw = os.pread(fd, 24, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != 24:
        return None
    g, check, count = struct.unpack("<qqq", raw)
    return (g, count) if check == g ^ _INTENT_MAGIC else None
