"""The array files of a store: rotating copies of each array, rewritten page by page.

Each array of a commit (index columns, row tables, dense columns, ...) lives in
``arrays/<name>.<copy>.npy`` with :data:`NCOPIES` copies. Commit ``g`` writes each array into
the copy after the one commit ``g - 1`` published (``(copy + 1) % NCOPIES``), which holds the
array as some older commit ``G`` left it; only the bytes that changed since ``G`` are rewritten,
in whole memory pages (the dirty row and blob-id blocks of the commits after ``G``, which the
manifest keeps for the last ``NCOPIES - 1`` commits), plus the ``.npy`` header and a changed
tail. A checksum page such a write touches gets its CRC-32 patched from the old one and the bytes
that changed; the others keep their CRC-32 from the manifest, so a commit costs what changed, not
the size of the store (nor of a checksum page). A copy is overwritten only by the third commit after the one that published
it, so a read-only open stays valid through the writer's next two commits' page writes. A copy
that gets shorter is written to a new file renamed over it, never truncated: a process that maps
the old file past the new end would get ``SIGBUS``.

Before the first page of a commit is written, the generation it will publish is written to the
``commit.intent`` file and fsynced: a writer that opens a store whose intent is not its last
commit knows a commit died while writing pages, so the copies it was writing hold nothing known
and are rewritten whole. A read-only open compares the intent with its own commit after reading
(:func:`read_intent`): three commits on, the copies it reads may have been overwritten.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> d = tempfile.mkdtemp()
    >>> a = np.arange(10_000, dtype=np.int64)
    >>> first = write_copy(os.path.join(d, "x.npy"), a, None, None)
    >>> a[5] = -1
    >>> blocks = np.zeros(1, dtype=bool); blocks[0] = True
    >>> again = write_copy(os.path.join(d, "x.npy"), a, blocks, first)
    >>> again.size == first.size and again.written <= first.written
    True
    >>> int(np.load(os.path.join(d, "x.npy"))[5])
    -1
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import fileio
from ..errors import CorruptionError
from ..util.crc import crc32_patch
from ..util.dirty import BLOCK_SHIFT
from ..util.filemap import npy_header
from .manifest import PAGE_BYTES, page_checksums, read_npy_header

__all__ = ["NCOPIES", "ARRAYS_DIR", "INTENT", "WRITE_UNIT", "CopyState", "copy_path", "write_copy", "write_intent",
           "read_intent", "kind_of", "stamp_of"]

#: Copies of each array (a copy is overwritten by the third commit after the one that wrote it).
NCOPIES = 3
ARRAYS_DIR = "arrays"
INTENT = "commit.intent"
_INTENT_MAGIC = 0x7469657265643221  # "tiered2!"
#: Bytes a commit writes at least around a change (a memory page: a whole page of a copy is then
#: what a writer maps back from it).
WRITE_UNIT = max(4096, mmap.PAGESIZE)


@dataclass
class CopyState:
    """What one copy file holds: the array as commit ``generation`` left it.

    Attributes:
        generation: the commit that last wrote the copy.
        size: bytes of the file.
        crcs: CRC-32 of each :data:`PAGE_BYTES` page of the file.
        written: bytes the last write of the copy wrote (for measurements).
        ranges: the byte ranges ``[lo, hi)`` of the file the last write wrote (what a writer may
            map back from the file, :func:`tiered.util.filemap.remap`).
    """

    generation: int
    size: int
    crcs: list[int]
    written: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)
    #: the file's identity and time stamps once written (:func:`stamp_of`; None: not known)
    stamp: tuple[int, int, int, int] | None = None

    def to_json(self, copy: int) -> list:
        return [copy, self.generation, self.size, self.crcs]


def copy_path(store: str, name: str, copy: int) -> str:
    """The file of copy ``copy`` of array ``name`` in the store directory ``store``."""
    return os.path.join(store, ARRAYS_DIR, f"{name}.{copy}.npy")


def kind_of(name: str) -> str:
    """How an array's first axis is indexed: ``"rows"``, ``"blobs"``, or ``"whole"`` (small
    arrays a commit always rewrites whole)."""
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


def _reusable(fd: int, path: str, base: CopyState | None, hlen: int, arr: np.ndarray) -> bool:
    """Whether the copy on disk is the one ``base`` describes, with a header of ``hlen`` bytes and
    the dtype and row shape of ``arr`` (an array whose dtype changed, as row tables did in format
    3, has every page moved: it is rewritten whole)."""
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


def write_copy(path: str, arr: np.ndarray, blocks: np.ndarray | None, base: CopyState | None,
               generation: int = 0, before: Callable[[int, int], None] | None = None, *,
               compare: bool = False) -> CopyState:
    """Write ``arr`` as the ``.npy`` file ``path``, which holds ``base`` (None: unknown), rewriting
    only the bytes of the dirty id ``blocks`` (None: every byte), the header and a changed tail;
    fsync it. Returns what the file now holds, with the CRC-32 of every page (those not touched
    are ``base``'s). ``before(lo, hi)`` is called with each range of ``arr``'s bytes before they
    are read (to check bytes memory-mapped from a file whose pages are checked on first use).
    ``compare`` (with ``blocks`` None): an array whose changes are not tracked by blocks but are
    few (the sorted exception lists of the row tables) is compared with the copy, and only the
    memory pages that differ are written.

    A dirty block's bytes are written in whole :data:`WRITE_UNIT` units, not whole
    :data:`PAGE_BYTES` pages: what a commit writes (and syncs) is what changed, whatever the size
    of the array. A page a write touches gets its new CRC from ``base``'s and the bytes that
    changed (:func:`_write_runs`).
    """
    if not (arr.flags.c_contiguous or arr.ndim == 1):
        arr = np.ascontiguousarray(arr)
    head = npy_header(arr.shape, arr.dtype)  # the same header file_array lays out in memory
    hlen, size = len(head), len(head) + arr.nbytes
    flat = arr.reshape(-1) if arr.flags.c_contiguous else arr
    source = _Source(head, flat, max(arr.itemsize, 1), before)
    n_pages = -(-size // PAGE_BYTES)
    if os.path.exists(path) and os.path.getsize(path) > size:
        return _replace_copy(path, source, size, generation)
    fd = fileio.open_for_write(path)
    try:
        runs = None  # the byte runs to write (None: the whole file)
        if base is not None and _reusable(fd, path, base, hlen, arr):
            if blocks is not None:
                runs = _dirty_runs(arr, hlen, size, blocks)
                if size != base.size or os.pread(fd, hlen, 0) != head:
                    tail = min(size, base.size) // WRITE_UNIT * WRITE_UNIT  # a tail that grew or shrank
                    runs = _merge(np.append(runs[:, 0], [0, tail]),
                                  np.append(runs[:, 1], [min(size, -(-hlen // WRITE_UNIT) * WRITE_UNIT), size]))
            elif compare and base.size == size:
                runs = _differing_runs(fd, source, size)
        if runs is not None:
            assert base is not None
            crcs = list(base.crcs[:n_pages]) + [0] * max(0, n_pages - len(base.crcs))
            if size < base.size:
                fileio.truncate(fd, size)
            written, ranges = _write_runs(fd, path, source, runs, base, crcs, size)
        else:
            fileio.truncate(fd, size)
            parts = source.parts(0, size)
            at = 0
            for part in parts:  # header and data: two at most
                fileio.pwrite(fd, part, at)
                at += part.nbytes
            crcs = page_checksums(parts)
            written, ranges = size, [(0, size)]
        fileio.fsync(fd)
        stamp = stamp_of(os.fstat(fd))
    finally:
        fileio.close(fd)
    return CopyState(generation, size, crcs, written, ranges, stamp)


def _replace_copy(path: str, source: _Source, size: int, generation: int) -> CopyState:
    """Write the whole file to a new file renamed over ``path`` (whose file is larger).

    A copy never shrinks in place: a reader (a read-only open, the writer's own arrays) that maps
    the old file past the new end would get ``SIGBUS`` at its next read there. Renamed over, the
    old file lives on, unchanged, for whoever still maps it."""
    tmp = path + ".new"
    fileio.remove(tmp)  # left by a commit that died here: it holds nothing known
    fd = fileio.open_for_write(tmp, exclusive=True)
    try:
        fileio.truncate(fd, size)
        parts, at = source.parts(0, size), 0
        for part in parts:  # header and data: two at most
            fileio.pwrite(fd, part, at)
            at += part.nbytes
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    fileio.replace(tmp, path)  # the caller fsyncs the directory before publishing
    return CopyState(generation, size, page_checksums(parts), size, [(0, size)], stamp_of(os.stat(path)))


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


def _differing_runs(fd: int, source: _Source, size: int) -> np.ndarray | None:
    """The :data:`WRITE_UNIT` runs of the file (``size`` bytes, as the array's) whose bytes differ
    from ``source``'s (None: the file is shorter than it should be)."""
    disk = np.empty(size, dtype=np.uint8)
    if fileio.read_into(fd, memoryview(disk), 0) != size:
        return None
    mem = np.concatenate([np.frombuffer(part, dtype=np.uint8) for part in source.parts(0, size)])
    full, unit = size // WRITE_UNIT, WRITE_UNIT
    differ = np.zeros(-(-size // unit), dtype=bool)
    differ[:full] = (disk[:full * unit].reshape(full, unit) != mem[:full * unit].reshape(full, unit)).any(axis=1)
    if full < differ.size:
        differ[full] = not np.array_equal(disk[full * unit:], mem[full * unit:])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], differ.astype(np.int8), [0]]))).reshape(-1, 2)
    return np.minimum(edges.astype(np.int64) * unit, size)


#: Most bytes of pages read at once while a commit rewrites parts of them.
_SPAN_BYTES = 16 * PAGE_BYTES


def _write_runs(fd: int, path: str, source: _Source, runs: np.ndarray, base: CopyState, crcs: list[int],
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


def _splice_pages(fd: int, source: _Source, runs: np.ndarray, base: CopyState, crcs: list[int],
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


def write_intent(store: str, generation: int) -> None:
    """Durably record that the commit of ``generation`` starts overwriting array copies."""
    fd = fileio.open_for_write(os.path.join(store, INTENT))
    try:
        fileio.pwrite(fd, struct.pack("<qq", generation, generation ^ _INTENT_MAGIC), 0)
        fileio.fsync(fd)
    finally:
        fileio.close(fd)


def read_intent(store: str) -> int | None:
    """The generation the last commit that started writing array copies was to publish (None:
    no intent file, or one that is not what :func:`write_intent` writes)."""
    try:
        fd = fileio.open_for_read(os.path.join(store, INTENT))
    except (FileNotFoundError, CorruptionError):
        return None
    try:
        raw = os.pread(fd, 16, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != 16:
        return None
    g, check = struct.unpack("<qq", raw)
    return g if check == g ^ _INTENT_MAGIC else None
