"""Array files checked on first use: memory-mapped, each page's CRC-32 checked the first time a
read or a write touches it.

A store's per-row arrays (row tables, dense columns) are as large as the store; reading every
page at open to check its checksum would make opening cost the size of the store. Instead they
are memory-mapped copy-on-write (reads are served from the page cache, a write makes a private
page) and :class:`RowCheck` checks the pages holding a set of rows before their bytes are used:
the pages not yet checked are read and compared with the commit's CRC-32 (a loop over pages,
never rows), and the rows they hold are then handed to a callback (the reference checks of the
row tables). A damaged page raises :class:`~tiered.errors.ChecksumError` at the first read or
write that touches it (docs/durability.md).

A reader of a commit that a writer goes on changing in place (a read-only open) passes
``rebuild``: each page is first copied private (:func:`~tiered.util.filemap.make_private`), so
the writer's later writes never reach it, and a page that fails its check is rebuilt as the
reader's commit left it from the writer's before-images (:class:`~tiered.durable.array_files.UndoChain`)
before it is declared damaged.

What such a reader reads whole at open (its blob index, policy state and written mask: checks of
every entry) is checked page by page through the maps, which leaves the pages the file's (page
cache, not the reader's memory; :func:`map_verified`; the columns no check of the open reads are
only mapped, :func:`map_checked`), and copied private and checked again at first use, by blob id
(:class:`IdCheck`) or by row (:class:`RowCheck`).

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> from tiered.durable.array_files import write_new
    >>> p = os.path.join(tempfile.mkdtemp(), "a.npy")
    >>> f = write_new(p, np.arange(1_000_000, dtype=np.int64), 1)
    >>> arr, pages = map_checked(p, f.size, f.crcs)
    >>> int(pages.checked.sum())  # none so far
    0
    >>> check = RowCheck([pages], arr.shape[0])
    >>> check.rows(np.array([5, 999_999])); int(arr[5])
    5
    >>> int(pages.checked.sum())  # the pages of the two units of rows read (of 8), the header's among them
    3
"""

from __future__ import annotations

import math
import mmap
import os
import zlib
from collections.abc import Callable

import numpy as np

from ..errors import ChecksumError, CorruptionError
from ..util import fileio
from ..util.filemap import make_private
from .manifest import (
    PAGE_BYTES,
    NpyHeader,
    already_verified,
    map_npy,
    npy_array,
    page_checksums,
    read_npy_header,
)

__all__ = ["PageChecks", "RowCheck", "IdCheck", "map_checked", "map_verified", "map_commit", "load_checked",
           "forget_memory_tiers", "rebuilt_header"]

#: ``rebuild(lo, hi, crc)``: the bytes ``[lo, hi)`` of a file as the reader's commit left them
#: (None: they cannot be rebuilt, so they are damaged)
Rebuild = Callable[[int, int, int], "np.ndarray | None"]


class PageChecks:
    """The pages of one memory-mapped array file and which of them were checked.

    Args:
        path: the file (for messages).
        view: the file's bytes (the memory map).
        crcs: the commit's CRC-32 of each :data:`PAGE_BYTES` page.
        offset: where the array's elements start in the file.
        row_bytes: bytes of one row (first-axis entry) of the array.
        stale: called before a mismatch is reported; raises its own error when the bytes were
            replaced by a newer commit rather than damaged (a read-only store a writer moved past).
        rebuild: for a reader of a file a writer changes in place: each page is copied private
            before its check, and one that fails is rebuilt by ``rebuild`` (see the module
            docstring).
    """

    def __init__(self, path: str, view: memoryview, crcs: list[int], offset: int, row_bytes: int,
                 stale: Callable[[], None] | None = None, rebuild: Rebuild | None = None) -> None:
        self.path, self.view, self.crcs = path, view, crcs
        self.offset, self.row_bytes, self.stale, self.rebuild = offset, max(row_bytes, 1), stale, rebuild
        self.size = view.nbytes
        #: per page: its CRC-32 was compared with the commit's (for a reader: and the page is its own)
        self.checked = np.zeros(len(crcs), dtype=bool)
        #: every page is checked (nothing left to do at a use)
        self.done = not crcs
        #: called with a page's byte range ``(lo, hi)`` once it is this reader's own and checked
        #: (a reader's fix-ups of entries it holds differently from the file, made only in its own
        #: pages: :func:`forget_memory_tiers`)
        self.on_own: Callable[[int, int], None] | None = None

    def rows_pages(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The sorted pages holding the bytes of the row ranges ``[lo, hi)`` (``hi > lo``)."""
        first = (self.offset + lo * self.row_bytes) // PAGE_BYTES
        last = (self.offset + hi * self.row_bytes - 1) // PAGE_BYTES
        span = last - first + 1
        if int(span.max(initial=0)) <= 1:
            return np.unique(first)
        pages = np.repeat(first - np.cumsum(span) + span, span) + np.arange(int(span.sum()))
        return np.unique(pages)

    def check(self, pages: np.ndarray) -> None:
        """Check the pages (sorted page numbers) not checked yet.

        Raises:
            ChecksumError: naming the file and the first damaged byte range.
        """
        todo = pages[~self.checked[pages]]
        for p in todo.tolist():  # one CRC per 1 MiB page: the unit of work here
            lo = p * PAGE_BYTES
            hi = min(self.size, lo + PAGE_BYTES)
            if self.rebuild is not None:
                make_private(self.view, lo, hi)
            got = zlib.crc32(self.view[lo:hi])
            if got != self.crcs[p] and self.rebuild is not None:
                fixed = self.rebuild(lo, hi, self.crcs[p])
                if fixed is not None:  # the page as the reader's commit left it, checked
                    np.frombuffer(self.view, dtype=np.uint8)[lo:hi] = fixed
                    got = self.crcs[p]
            if got != self.crcs[p]:
                if self.stale is not None:
                    self.stale()
                raise ChecksumError(
                    f"{self.path}: checksum mismatch at bytes {lo}..{min(self.size, lo + PAGE_BYTES)} "
                    f"(stored crc32 {self.crcs[p]:#010x}, computed {got:#010x}), found when the page was "
                    "first read; the stored bytes are damaged. Restore the store from a copy; run "
                    "`tiered verify` for details.")
            self.checked[p] = True
            if self.on_own is not None:
                self.on_own(lo, hi)
        if todo.size:
            self.done = bool(self.checked.all())

    def check_bytes(self, lo: int, hi: int) -> None:
        """Check the pages holding file bytes ``[lo, hi)``."""
        if hi > lo:
            self.check(np.arange(lo // PAGE_BYTES, (hi - 1) // PAGE_BYTES + 1))


class RowCheck:
    """Checks the rows of one or more memory-mapped arrays of ``capacity`` rows before use.

    Rows are checked in units of rows that span about a page of the widest array; the first
    use of a unit checks the pages of every array that hold it, then calls ``on_rows`` with the
    unit's rows (for checks of their values).

    Args:
        pages: the arrays' :class:`PageChecks` (the same rows of each).
        capacity: rows of each array.
        on_rows: called with the sorted row numbers of newly checked units.
    """

    def __init__(self, pages: list[PageChecks], capacity: int,
                 on_rows: Callable[[np.ndarray], None] | None = None) -> None:
        self.pages, self.capacity, self.on_rows = pages, int(capacity), on_rows
        self.unit = max(1, PAGE_BYTES // max((p.row_bytes for p in pages), default=1))
        self.done = np.zeros(-(-self.capacity // self.unit), dtype=bool)

    def rows(self, rows: np.ndarray) -> None:
        """Check the units holding ``rows`` (any int array of rows in ``[0, capacity)``)."""
        rows = np.asarray(rows)
        if rows.dtype == np.bool_:
            rows = np.flatnonzero(rows)
        if rows.size:
            self._units(np.unique(rows.reshape(-1) // self.unit))

    def span(self, start: int, n: int) -> None:
        """Check the units holding rows ``[start, start + n)``."""
        if n > 0:
            self._units(np.arange(start // self.unit, (start + n - 1) // self.unit + 1))

    def all(self) -> None:
        """Check every unit (a whole-array use)."""
        self._units(np.arange(self.done.size))

    def forget(self, pages: PageChecks, which: np.ndarray) -> None:
        """Count the units whose rows lie on the pages ``which`` (a bool per page) of ``pages``
        (one of this check's arrays) unchecked again: their pages were given back to the file
        and are checked again at the next use of their rows."""
        if not which.any():
            return
        lo = np.arange(self.done.size, dtype=np.int64) * self.unit
        hi = np.minimum(lo + self.unit, self.capacity)
        first = (pages.offset + lo * pages.row_bytes) // PAGE_BYTES
        last = (pages.offset + hi * pages.row_bytes - 1) // PAGE_BYTES
        given = np.cumsum(which)  # a page given back in [first, last]: in first, or more after it
        self.done &= ~(which[first] | (given[last] > given[first]))

    def _units(self, units: np.ndarray) -> None:
        todo = units[~self.done[units]]
        if not todo.size:
            return
        lo = todo * self.unit
        hi = np.minimum(lo + self.unit, self.capacity)
        for p in self.pages:  # a few arrays
            p.check(p.rows_pages(lo, hi))
        if self.on_rows is not None:
            span = hi - lo
            self.on_rows(np.repeat(lo - np.cumsum(span) + span, span) + np.arange(int(span.sum())))
        self.done[todo] = True


class IdCheck:
    """Checks the entries of blob ids in the arrays indexed by blob id of a read-only open (its
    blob index and policy state) before they are used.

    An open reads these arrays whole, through their memory maps, once their pages passed their
    checksums (:func:`map_verified`): their pages stay the file's (page cache, not this process's
    memory). The writer changes the files in place at its next commits, so before a read or a
    write of some ids' entries, the pages holding them are copied private and checked again (and
    rebuilt where the writer changed them since, :meth:`PageChecks.check`); from then on no write
    of the writer reaches them.

    Example:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from tiered.durable.array_files import write_new
        >>> p = os.path.join(tempfile.mkdtemp(), "ids.npy")
        >>> f = write_new(p, np.arange(300_000, dtype=np.int64), 1)
        >>> arr, pages = map_verified(p, f.size, f.crcs, rebuild=lambda lo, hi, crc: None)
        >>> check = IdCheck(); check.add(pages)
        >>> check.ids(np.array([7, 299_999])); int(pages.checked.sum()), int(arr[7])
        (2, 7)
    """

    def __init__(self) -> None:
        #: the arrays' page checks, by where their elements start and the bytes of one entry
        #: (arrays of one layout share the pages of an id)
        self.groups: dict[tuple[int, int], list[PageChecks]] = {}
        self.done = True

    def add(self, pages: PageChecks) -> None:
        """Check the entries of ``pages``' array too."""
        self.groups.setdefault((pages.offset, pages.row_bytes), []).append(pages)
        self.done = self.done and pages.done

    def ids(self, ids: np.ndarray | None) -> None:
        """Check the pages holding the entries of blob ``ids`` (valid ids, any shape; None: every
        page) in every array.

        Raises:
            ChecksumError: a page is damaged (naming its file).
            StaleReadError: the page changed since and the writer is too far ahead to rebuild it.
        """
        if self.done:
            return
        for group in self.groups.values():  # a few entry sizes
            left = [p for p in group if not p.done]
            if not left:
                continue
            if ids is None:
                pages = None
            else:
                flat = ids.reshape(-1)
                pages = left[0].rows_pages(flat, flat + 1) if flat.size else np.empty(0, dtype=np.int64)
            for p in left:  # the arrays of this entry size
                p.check(np.arange(p.checked.size) if pages is None else pages[pages < p.checked.size])
        self.done = all(p.done for group in self.groups.values() for p in group)


def rebuilt_header(size: int, path: str, expected_size: int,
                   first_page: Callable[[], np.ndarray | None] | None) -> NpyHeader | None:
    """The header of a ``.npy`` file (``size`` bytes now) as its commit wrote it
    (``expected_size`` bytes), rebuilt by ``first_page`` (the file's first page as the commit
    left it: :meth:`~tiered.durable.array_files.UndoChain.page`) for a file a writer has grown in
    place since. A writer rewrites a grown file's header before it writes the new tail, so the
    file may still be the commit's size. None where the file is shorter than the commit or its
    first page cannot be rebuilt (no commit after it under way: the header is damaged)."""
    if first_page is None or size < expected_size:
        return None
    raw = first_page()
    return None if raw is None else read_npy_header(raw.tobytes(), path, expected_size)


def map_commit(path: str, expected_size: int, crcs: list[int] | None,
               rebuild: Rebuild | None) -> tuple[mmap.mmap, os.stat_result, NpyHeader, int]:
    """:func:`~tiered.durable.manifest.map_npy` of the commit's bytes of a file: ``(map, stat,
    header, size)``. For a reader (``rebuild`` given), a file that a writer has since grown in
    place is mapped to the commit's size, with the header the commit wrote (rebuilt from the
    writer's before-images); its first page is rebuilt like any other when first checked. A
    writer rewrites the header before it writes the new tail, so a file still of the commit's
    size may already hold the next commit's header: it is rebuilt the same way.

    Raises:
        CorruptionError (its subclass ChecksumError where ``crcs`` are not one per page): naming
            the file.
    """
    try:
        whole, st, head = map_npy(path, expected_size)
        size = st.st_size
    except CorruptionError:
        if rebuild is None or not crcs:
            raise
        fd = fileio.open_for_read(path)
        try:
            st = os.fstat(fd)
            head = rebuilt_header(st.st_size, path, expected_size,
                                  lambda: rebuild(0, min(PAGE_BYTES, expected_size), crcs[0]))
            if head is None:
                raise
            whole = mmap.mmap(fd, expected_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            fileio.close(fd)
        size = expected_size
    if crcs is not None and len(crcs) != -(-size // PAGE_BYTES):
        raise ChecksumError(f"{path}: the commit records {len(crcs)} checksummed pages, the file has "
                            f"{-(-size // PAGE_BYTES)}; the store is damaged. Run `tiered verify` for details.")
    return whole, st, head, size


def map_checked(path: str, expected_size: int, crcs: list[int] | None,
                stale: Callable[[], None] | None = None, rebuild: Rebuild | None = None) -> tuple[np.ndarray, PageChecks]:
    """Memory-map (copy-on-write) a ``.npy`` array file whose pages are checked on first use.

    Checked now: the file is a regular file of ``expected_size`` bytes and its header is valid
    and accounts for the file's size (the caller has matched its shape and dtype with the
    manifest). No page is read: every page, the header's too, is checked by a :class:`RowCheck`
    over the returned :class:`PageChecks` when its rows are first used (all pages count as
    checked when ``crcs`` is None, or inside
    :func:`~tiered.durable.manifest.arrays_verified`).

    Raises:
        CorruptionError (its subclass ChecksumError for a page mismatch): naming the file.
    """
    whole, st, head, size = map_commit(path, expected_size, crcs, rebuild)
    if not head.shape or head.fortran_order:
        raise CorruptionError(f"{path}: not a row array of a tiered store (shape {head.shape}); "
                              "the store is damaged")
    rows = head.shape[0]
    row_bytes = math.prod(head.shape[1:]) * head.dtype.itemsize
    pages = PageChecks(path, memoryview(whole), list(crcs) if crcs is not None else [0] * -(-size // PAGE_BYTES),
                       head.offset, row_bytes, stale, rebuild)
    if crcs is None or already_verified(st):
        pages.checked[:] = True
        pages.done = True
    if rows * row_bytes == 0:
        return np.empty(head.shape, head.dtype), pages
    arr = np.frombuffer(whole, dtype=head.dtype, count=rows * (row_bytes // head.dtype.itemsize), offset=head.offset)
    return arr.reshape(head.shape), pages


def map_verified(path: str, expected_size: int, crcs: list[int] | None,
                 stale: Callable[[], None] | None = None, rebuild: Rebuild | None = None) -> tuple[np.ndarray, PageChecks]:
    """:func:`map_checked`, with every page's CRC-32 checked now, read through the map: for an
    array a read-only open reads whole (its blob index, policy state and written mask), which the
    writer changes in place at its next commits. The pages stay the file's (they cost page cache,
    not this process's memory) and count as not checked: a use checks them again, and copies them
    private first (:class:`IdCheck`, :class:`RowCheck`). A page that fails now is copied private
    and rebuilt from the writer's before-images (``rebuild``) before it is declared damaged.

    The open must make sure that the writer did not start a commit while it read these pages (its
    intent, :func:`~tiered.durable.array_files.read_intent`, is the same before and after).

    Raises:
        CorruptionError (its subclass ChecksumError for a page mismatch): naming the file.
    """
    arr, pages = map_checked(path, expected_size, crcs, stale, rebuild)
    if crcs is not None and not pages.done:
        got = np.array(page_checksums([pages.view]), dtype=np.int64)
        bad = np.flatnonzero(got != np.array(crcs, dtype=np.int64))
        if bad.size:  # pages a writer changed since (or damaged): rebuilt, or raised
            pages.check(bad)
    return arr, pages


def load_checked(path: str, expected_size: int, crcs: list[int] | None, rebuild: Rebuild) -> np.ndarray:
    """Memory-map (copy-on-write) a ``.npy`` file and check every page now, as
    :func:`~tiered.durable.manifest.load_npy` does, for a reader of a file a writer changes in
    place: each page is copied private first and rebuilt when it fails (:class:`PageChecks`).

    Raises:
        CorruptionError (its subclass ChecksumError for a page mismatch): naming the file.
    """
    whole, st, head, size = map_commit(path, expected_size, crcs, rebuild)
    if crcs is not None and not already_verified(st):
        view = memoryview(whole)
        make_private(view, 0, size)  # all at once, then hashed on several threads
        bad = np.flatnonzero(np.array(page_checksums([view]), dtype=np.int64) != np.array(crcs, dtype=np.int64))
        if bad.size:  # pages a writer changed since (or damaged): rebuilt, or raised
            PageChecks(path, view, list(crcs), head.offset, 1, rebuild=rebuild).check(bad)
    return npy_array(whole, head)


def forget_memory_tiers(loc: np.ndarray, pages: PageChecks, columns: slice, lo: int, hi: int) -> None:
    """For a read-only open's blob locations (``loc``, ``[B, tiers]``, mapped from a file its
    writer changes in place): set the ``columns`` (the memory tiers) of every entry whose bytes lie
    in pages now its own (``pages.checked``) and that touches file bytes ``[lo, hi)`` to -1. The
    file holds where the writer's memory tiers held each blob, which means nothing to a reader
    whose arenas start empty; forgetting them at open would write, so copy private, every page
    holding one (the writer's whole warm cache: spread over every page). An entry that straddles
    a page not yet its own waits for that page (a write there would make its bytes differ from the
    file's before they are checked).

    Example:
        >>> import os, tempfile
        >>> from tiered.durable.array_files import write_new
        >>> p = os.path.join(tempfile.mkdtemp(), "loc.npy")
        >>> f = write_new(p, np.full((100_000, 3), 7, dtype=np.int64), 1)
        >>> loc, pages = map_verified(p, f.size, f.crcs, rebuild=lambda lo, hi, crc: None)
        >>> pages.on_own = lambda lo, hi: forget_memory_tiers(loc, pages, slice(0, 2), lo, hi)
        >>> pages.check(np.array([0]))
        >>> loc[0].tolist(), loc[50_000].tolist()  # page 0's entries forgotten; page 1's still the file's
        ([-1, -1, 7], [7, 7, 7])
    """
    row = pages.row_bytes
    first = max(0, (lo - pages.offset) // row)
    last = min(loc.shape[0], -(-(hi - pages.offset) // row))
    page = lo // PAGE_BYTES
    if first < last and pages.offset + first * row < lo and not pages.checked[page - 1]:
        first += 1  # begins in the page before, not yet its own
    after = hi // PAGE_BYTES
    if first < last and pages.offset + last * row > hi and (after >= pages.checked.size or not pages.checked[after]):
        last -= 1  # ends in the page after, not yet its own
    if first < last:
        loc[first:last, columns] = -1
