"""Format 2's array files: rotating copies of each array, rewritten page by page.

Each array of a commit (index columns, row tables, dense columns, ...) lives in
``arrays/<name>.<copy>.npy`` with :data:`NCOPIES` copies. Commit ``g`` writes each array into
the copy after the one commit ``g - 1`` published (``(copy + 1) % NCOPIES``), which holds the
array as some older commit ``G`` left it; only the pages that changed since ``G`` are rewritten
(the dirty row and blob-id blocks of the commits after ``G``, which the manifest keeps for the
last ``NCOPIES - 1`` commits), plus the first page (the ``.npy`` header) and a changed tail.
Unchanged pages keep their CRC-32 from the manifest, so a commit costs what changed, not the
size of the store. A copy is overwritten only by the third commit after the one that published
it, so a read-only open stays valid through the writer's next two commits' page writes.

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

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import fileio
from ..errors import CorruptionError
from ..util.dirty import BLOCK_SHIFT
from ..util.filemap import npy_header
from .manifest import PAGE_BYTES, page_checksums, read_npy_header

__all__ = ["NCOPIES", "ARRAYS_DIR", "INTENT", "CopyState", "copy_path", "write_copy", "write_intent",
           "read_intent", "kind_of"]

#: Copies of each array (a copy is overwritten by the third commit after the one that wrote it).
NCOPIES = 3
ARRAYS_DIR = "arrays"
INTENT = "commit.intent"
_INTENT_MAGIC = 0x7469657265643221  # "tiered2!"


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

    def to_json(self, copy: int) -> list:
        return [copy, self.generation, self.size, self.crcs]


def copy_path(store: str, name: str, copy: int) -> str:
    """The file of copy ``copy`` of array ``name`` in the store directory ``store``."""
    return os.path.join(store, ARRAYS_DIR, f"{name}.{copy}.npy")


def kind_of(name: str) -> str:
    """How an array's first axis is indexed: ``"rows"``, ``"blobs"``, or ``"whole"`` (small
    arrays a commit always rewrites whole)."""
    if name == "written" or name.startswith(("dense.", "rows.")) or name == "priority.rows":
        return "rows"
    if name.startswith("index.") and name not in ("index.free_ids", "index.meta"):
        return "blobs"
    if name.startswith("policy.") and not name.endswith(".clock"):
        return "blobs"
    return "whole"


def _dirty_pages(arr: np.ndarray, hlen: int, size: int, blocks: np.ndarray, n_pages: int) -> np.ndarray:
    """Pages of the file holding the elements of the dirty id blocks (first axis of ``arr``)."""
    pages = np.zeros(n_pages + 1, dtype=np.int64)
    ids = np.flatnonzero(blocks)
    if ids.size and arr.ndim and arr.shape[0]:
        row_bytes = arr.nbytes // arr.shape[0]
        lo = hlen + (ids << BLOCK_SHIFT) * row_bytes
        hi = np.minimum(hlen + ((ids + 1) << BLOCK_SHIFT) * row_bytes, size)
        keep = lo < hi
        lo, hi = lo[keep] // PAGE_BYTES, (hi[keep] - 1) // PAGE_BYTES + 1
        np.add.at(pages, lo, 1)
        np.add.at(pages, hi, -1)
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
               generation: int = 0, before: Callable[[int, int], None] | None = None) -> CopyState:
    """Write ``arr`` as the ``.npy`` file ``path``, which holds ``base`` (None: unknown), rewriting
    only the pages of the dirty id ``blocks`` (None: every page), the header page and a changed
    tail; fsync it. Returns what the file now holds, with the CRC-32 of every page (those not
    rewritten are ``base``'s). ``before(lo, hi)`` is called with each range of ``arr``'s bytes
    before they are read (to check bytes memory-mapped from a file whose pages are checked on
    first use)."""
    if not (arr.flags.c_contiguous or arr.ndim == 1):
        arr = np.ascontiguousarray(arr)
    head = npy_header(arr.shape, arr.dtype)  # the same header file_array lays out in memory
    hlen, size = len(head), len(head) + arr.nbytes
    flat = arr.reshape(-1) if arr.flags.c_contiguous else arr
    item = max(arr.itemsize, 1)
    n_pages = -(-size // PAGE_BYTES)
    fd = fileio.open_for_write(path)
    try:
        if blocks is not None and _reusable(fd, path, base, hlen, arr):
            assert base is not None
            todo = _dirty_pages(arr, hlen, size, blocks, n_pages)
            if size != base.size or os.pread(fd, hlen, 0) != head:
                todo[:1] = True  # the header
                todo[min(size, base.size) // PAGE_BYTES:] = True  # a tail that grew or shrank
            crcs = list(base.crcs[:n_pages]) + [0] * max(0, n_pages - len(base.crcs))
            if size < base.size:
                fileio.truncate(fd, size)
        else:
            todo = np.ones(n_pages, dtype=bool)
            crcs = [0] * n_pages
            fileio.truncate(fd, size)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], todo.astype(np.int8), [0]])))
        written, ranges = 0, []
        for p0, p1 in edges.reshape(-1, 2).tolist():  # one run of consecutive dirty pages at a time
            b0, b1 = p0 * PAGE_BYTES, min(p1 * PAGE_BYTES, size)
            ranges.append((b0, b1))
            parts = []
            if b0 < hlen:
                parts.append(memoryview(head)[b0:min(b1, hlen)])
            if b1 > hlen:
                if before is not None:
                    before(max(b0, hlen) - hlen, b1 - hlen)
                e0, e1 = (max(b0, hlen) - hlen) // item, (b1 - hlen) // item
                parts.append(memoryview(np.ascontiguousarray(flat[e0:e1]).reshape(-1).view(np.uint8)))
            at = b0
            for part in parts:  # header and data: two at most
                fileio.pwrite(fd, part, at)
                at += part.nbytes
            crcs[p0:p1] = page_checksums(parts)
            written += b1 - b0
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    return CopyState(generation, size, crcs, written, ranges)


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
