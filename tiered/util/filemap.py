"""Arrays laid out in memory as their ``.npy`` file, whose committed pages can go back to the file.

A store's per-row arrays (row tables, dense columns, the written mask) grow with its capacity. A
writer that held them as anonymous memory would keep the whole store's metadata resident for
good, though every commit writes it to a file. :func:`file_array` allocates such an array in a
page-aligned private anonymous mapping laid out as its ``.npy`` file: the header, then the data,
the array starting at the header's length, so page ``p`` of the mapping is page ``p`` of the file.
Once a commit has written a file of the array (and published it), :func:`remap` maps the pages
that commit wrote from the file over the same addresses (``mmap(MAP_PRIVATE | MAP_FIXED)``):
every array and view keeps its address and its bytes (the file's pages were written from them),
the anonymous pages are freed, and the kernel may drop the clean file pages and read them back
when they are used. A later write copies the page again (copy-on-write), as in any private map.

A page mapped from a file shows that file's bytes until the page is written: the file must not
be truncated (a read past its end is ``SIGBUS``) or rewritten with other bytes while the page is
mapped. Its owner calls :func:`privatize` first, which gives every mapped page back an anonymous
copy of its bytes. A forked process shares such pages with the file as well, and no later
:func:`privatize` of the parent reaches it: a writer that may fork calls :func:`privatize_files`
first. Where ``MAP_FIXED`` through ``ctypes`` is not available (not Linux), :func:`remap` does
nothing and the arrays stay anonymous.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> a = file_array((100_000,), np.int64, fill=-1)
    >>> a[5] = 7
    >>> p = os.path.join(tempfile.mkdtemp(), "a.npy")
    >>> np.save(p, a)
    >>> done = remap(a, p, 0, [(0, os.path.getsize(p))])
    >>> int(a[5]), int(a[6]), done == supported()
    (7, -1, True)
    >>> a[6] = 8; int(a[6])  # a write copies the page again
    8
    >>> privatize(a); int(a[5])
    7
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["parse_npy_header", "FileLayout", "file_array", "adopt", "layout_of", "remap", "privatize", "privatize_files", "supported",
           "npy_header", "make_private", "discard_private"]

#: Bytes of one memory page (the unit a mapping is replaced in).
PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # Linux (every architecture)


def _libc_mmap() -> Callable[..., int] | None:
    if sys.platform != "linux" or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "mmap64", None) or libc.mmap
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    return fn


_mmap = _libc_mmap()
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable (a private page is copied) without writing
_MADV_DONTNEED = 4  # a private file mapping's copied pages are dropped: the file's show again


def _libc_madvise() -> Callable[..., int] | None:
    if _mmap is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_madvise = _libc_madvise()
# start of the data of each live file-layout array -> its layout
_layouts: dict[int, FileLayout] = {}


def supported() -> bool:
    """Whether :func:`remap` can map file pages over an array (Linux)."""
    return _mmap is not None


def npy_header(shape: tuple[int, ...], dtype: Any) -> bytes:
    """The ``.npy`` (version 1.0) header numpy writes for a C-ordered array of ``shape`` and ``dtype``.

    Example:
        >>> len(npy_header((3,), np.int64)) % 64
        0
    """
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": tuple(shape)})
    return out.getvalue()


def parse_npy_header(f: Any, max_header_size: int) -> tuple[tuple[int, int], tuple[tuple[int, ...], bool, np.dtype] | None]:
    """The ``.npy`` version and ``(shape, fortran_order, dtype)`` of the header at the stream ``f``'s
    position, by numpy's own parser (literals only: nothing runs, nothing is unpickled), the stream
    left at the first byte of the array's data; the header is ``None`` for a version numpy does not
    write. The one reader of headers: the store's arrays and the datasets it imports add their own
    checks.

    Raises:
        ValueError: a damaged header (numpy's parser: bad magic, dict, length over
            ``max_header_size``).

    Example:
        >>> buf = io.BytesIO(npy_header((2, 3), np.int32)); parse_npy_header(buf, 1 << 16)
        ((1, 0), ((2, 3), False, dtype('int32')))
    """
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return version, np.lib.format.read_array_header_1_0(f, max_header_size=max_header_size)
    if version in ((2, 0), (3, 0)):
        return version, np.lib.format.read_array_header_2_0(f, max_header_size=max_header_size)
    return version, None


class FileLayout:
    """The mapping of one array allocated by :func:`file_array`.

    Attributes:
        address: where the mapping starts (page-aligned); the header's bytes are there.
        length: bytes of the mapping (the file's size rounded up to whole pages).
        hlen: bytes of the header (the array starts at ``address + hlen``).
        size: bytes of the array's ``.npy`` file.
        source: per page of the mapping, the id of the file it is mapped from (-1: anonymous).
    """

    def __init__(self, mapping: mmap.mmap, address: int, length: int, hlen: int, size: int) -> None:
        self.address, self.length, self.hlen, self.size = address, length, hlen, size
        self.source = np.full(length // PAGE, -1, dtype=np.int8)
        self.mapping = weakref.ref(mapping)  # unmapped once no array of it is left

    @property
    def alive(self) -> bool:
        """Whether the mapping still exists (some array or view of it is alive)."""
        return self.mapping() is not None

    def bytes_view(self) -> np.ndarray:
        """The mapping's bytes (only while an array of it is alive)."""
        return np.ctypeslib.as_array((ctypes.c_uint8 * self.length).from_address(self.address))

    def fits(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` is this layout's whole array, as a commit writes it (same start, same
        bytes, the header the mapping holds)."""
        return (arr.__array_interface__["data"][0] == self.address + self.hlen and arr.flags.c_contiguous
                and self.hlen + arr.nbytes == self.size
                and npy_header(arr.shape, arr.dtype) == self.bytes_view()[:self.hlen].tobytes())


def file_array(shape: tuple[int, ...] | int, dtype: Any, fill: Any = 0) -> np.ndarray:
    """A new array of ``shape`` and ``dtype`` filled with ``fill``, laid out in a private anonymous
    mapping as its ``.npy`` file (see the module docstring); zero-filled pages cost no memory
    until written.

    Example:
        >>> a = file_array((4, 2), np.uint16)
        >>> a.shape, int(a.sum()), layout_of(a).hlen
        ((4, 2), 0, 128)
    """
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(x) for x in shape)
    dtype = np.dtype(dtype)
    head = npy_header(shape, dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = len(head) + nbytes
    length = -(-size // PAGE) * PAGE
    mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mm[:len(head)] = head
    count = nbytes // dtype.itemsize
    arr = np.frombuffer(mm, dtype=dtype, count=count, offset=len(head)).reshape(shape)
    base = np.frombuffer(mm, dtype=np.uint8, count=1).__array_interface__["data"][0]
    layout = FileLayout(mm, base, length, len(head), size)
    start = base + len(head)
    _layouts[start] = layout
    weakref.finalize(mm, _layouts.pop, start, None)  # unmapped when the last view of it goes
    if fill != 0:
        arr[...] = fill
    return arr


def adopt(mapping: mmap.mmap, arr: np.ndarray, source: int) -> None:
    """Treat ``arr``, an array memory-mapped (privately) from the whole ``.npy`` file ``source``
    by ``mapping``, as a :func:`file_array`: it already is laid out as its file, and its pages
    are mapped from ``source`` until written.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "a.npy")
        >>> np.save(p, np.arange(1000))
        >>> with open(p, "rb") as f:
        ...     m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        >>> a = np.frombuffer(m, np.int64, count=1000, offset=128)
        >>> adopt(m, a, 0); layout_of(a) is not None
        True
    """
    base = np.frombuffer(mapping, dtype=np.uint8, count=1).__array_interface__["data"][0]
    start = arr.__array_interface__["data"][0]
    size = len(mapping)
    if start in _layouts or not base <= start <= base + size or start - base + arr.nbytes != size:
        return
    layout = FileLayout(mapping, base, -(-size // PAGE) * PAGE, start - base, size)
    layout.source[:] = source
    _layouts[start] = layout
    weakref.finalize(mapping, _layouts.pop, start, None)


def layout_of(arr: np.ndarray) -> FileLayout | None:
    """The :class:`FileLayout` whose whole array ``arr`` is (any view of it starting at its first
    element with its bytes), else None."""
    if not isinstance(arr, np.ndarray):
        return None
    layout = _layouts.get(arr.__array_interface__["data"][0])
    return layout if layout is not None and layout.fits(arr) else None


def remap(arr: np.ndarray, path: str, source: int, ranges: Iterable[tuple[int, int]]) -> bool:
    """Map the byte ranges ``[lo, hi)`` of the ``.npy`` file ``path`` over the same pages of
    ``arr``'s mapping; ``source`` identifies the file (:attr:`FileLayout.source`).

    The caller guarantees the file's bytes in the ranges are ``arr``'s (a commit wrote them from
    it and nothing wrote either since). The file's size and header are checked here; ranges are
    widened to whole pages (a range's end may be the file's end).

    Returns:
        Whether the pages were mapped (False: not a :func:`file_array`, another layout, or no
        ``MAP_FIXED`` here); the array's bytes are the same either way.
    """
    layout = layout_of(arr)
    if layout is None or _mmap is None:
        return False
    fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(fd).st_size != layout.size or os.pread(fd, layout.hlen, 0) != layout.bytes_view()[:layout.hlen].tobytes():
            return False
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        for lo, hi in ranges:  # runs of pages a commit wrote: a few per array
            p0, p1 = int(lo) // PAGE, min(-(-int(hi) // PAGE), layout.length // PAGE)
            if p1 <= p0:
                continue
            at, n = layout.address + p0 * PAGE, (p1 - p0) * PAGE
            got = _mmap(at, n, prot, mmap.MAP_PRIVATE | _MAP_FIXED, fd, p0 * PAGE)
            if got != at:  # the range may be unmapped now: map it anonymous and read the bytes back
                _anonymous(at, n)
                os.preadv(fd, [memoryview((ctypes.c_uint8 * n).from_address(at)).cast("B")], p0 * PAGE)
                layout.source[p0:p1] = -1
                return False
            layout.source[p0:p1] = source
    finally:
        os.close(fd)
    return True


def _anonymous(at: int, n: int) -> None:
    assert _mmap is not None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    if _mmap(at, n, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) != at:
        raise MemoryError(f"cannot map {n} bytes of anonymous memory at {at:#x} "
                          f"(errno {ctypes.get_errno()}); the process is out of memory")


def privatize(arr: np.ndarray | FileLayout) -> None:
    """Give the pages of ``arr``'s mapping that are mapped from a file back an anonymous copy of
    their bytes, so that file may be truncated or rewritten. Must be called while an array of the
    mapping is alive."""
    layout = arr if isinstance(arr, FileLayout) else layout_of(arr)
    if layout is None or not layout.alive:
        return
    pages = np.flatnonzero(layout.source >= 0)
    if pages.size:
        view = layout.bytes_view()
        at = pages * PAGE
        view[at] = view[at]  # a write to each page copies it (copy-on-write): anonymous from now on
        layout.source[pages] = -1


def make_private(view: memoryview, lo: int, hi: int) -> None:
    """Give bytes ``[lo, hi)`` (``lo`` page-aligned) of a private, writable file mapping ``view``
    an anonymous copy of their pages, made as the pages are now: a later write to the file no
    longer shows there.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "f")
        >>> with open(p, "wb") as f:
        ...     _ = f.write(bytes(3 * PAGE))
        >>> with open(p, "rb") as f:
        ...     m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        >>> make_private(memoryview(m), 0, PAGE + 1)
        >>> with open(p, "r+b") as f:  # the file changes...
        ...     _ = f.write(b"x")
        >>> m[0]  # ...the private page does not
        0
    """
    part = np.frombuffer(view, dtype=np.uint8)[lo:hi]  # (bounded by the view, as a write would be)
    if not part.flags.writeable:  # the copy below writes through the address: refuse as a write would
        raise ValueError("make_private needs a writable view of a private mapping; this one is read-only")
    if part.size:
        _copy_pages(part.__array_interface__["data"][0], part.size)


def _copy_pages(start: int, n: int) -> None:
    """Give the pages of the ``n`` bytes at address ``start`` (page-aligned) of a private mapping
    an anonymous copy of their bytes. The kernel copies each page as a write fault would, without
    a write: another thread writing them meanwhile loses nothing. Older kernels: a write of each
    page's first byte as it is, which must not race with a writer thread."""
    if _madvise is None or _madvise(start, n, _MADV_POPULATE_WRITE) != 0:
        view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(start))
        view[::PAGE] = view[::PAGE].copy()  # a write to each page copies it (copy-on-write)


def discard_private(view: memoryview, lo: int, hi: int) -> bool:
    """Drop the anonymous copies :func:`make_private` (or a write) gave bytes ``[lo, hi)`` (``lo``
    page-aligned; ``hi`` page-aligned or the mapping's end) of a private file mapping ``view``:
    they show the file's bytes again, as it holds them now, and cost page cache, not this process's
    memory. Returns False where that cannot be done (not Linux): the copies stay.

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "f")
        >>> with open(p, "wb") as f:
        ...     _ = f.write(bytes(2 * PAGE))
        >>> with open(p, "rb") as f:
        ...     m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        >>> m[0] = 7  # a private copy of the first page
        >>> discard_private(memoryview(m), 0, PAGE) and m[0] == 0 or not supported()
        True
    """
    if hi <= lo or _madvise is None:
        return False
    start = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0] + lo
    return _madvise(start, hi - lo, _MADV_DONTNEED) == 0


def privatize_files(directory: str) -> int:
    """Give every page of this process's private file mappings (any array, any layout) of files
    in ``directory`` an anonymous copy of its bytes; returns the bytes of the mappings touched.

    A process about to ``fork`` calls it for the files its writer rewrites in place: a private
    page that was never written is shared with the file, in the child as in the parent, so a
    later rewrite of the file by the parent would change the child's arrays under it. Once
    anonymous (copy-on-write between parent and child), a page keeps the bytes it had at the fork
    in the child whatever the parent's later commits write. Linux only (``/proc/self/maps``);
    elsewhere nothing is mapped from these files (:func:`remap` does nothing) and 0 is returned.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> np.save(os.path.join(d, "a.npy"), np.arange(100_000))
        >>> with open(os.path.join(d, "a.npy"), "rb") as f:
        ...     m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        >>> a = np.frombuffer(m, np.int64, count=100_000, offset=128)
        >>> touched = privatize_files(d)
        >>> with open(os.path.join(d, "a.npy"), "r+b") as f:  # the file changes...
        ...     _ = f.seek(128); _ = f.write(np.int64(-1).tobytes())
        >>> int(a[0]), touched >= a.nbytes or not supported()  # ...the array does not
        (0, True)
    """
    if _mmap is None:
        return 0
    prefix = os.path.join(os.path.realpath(directory), "")
    spans = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:  # one line per mapping of the process (a few hundred)
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[1].startswith("rw") and parts[1][3] == "p" and parts[5].startswith(prefix):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((lo, hi))
    except OSError:
        return 0
    for lo, hi in spans:  # the mappings of a store's arrays: a few dozen
        _copy_pages(lo, hi - lo)
    for layout in list(_layouts.values()):  # the pages are no longer the files' (a few dozen arrays)
        end = layout.address + layout.length
        for lo, hi in spans:
            if layout.alive and lo < end and hi > layout.address:
                layout.source[max(lo - layout.address, 0) // PAGE:(min(hi, end) - layout.address) // PAGE] = -1
    return sum(hi - lo for lo, hi in spans)
