"""The manifest (format version 1) and the checked ``.npy`` array files a commit names.

``manifest.json`` is the commit record (docs/format.md): ``{"body": {...}, "sha256": ...}``, the
SHA-256 of the body so that a torn or garbage manifest is detected rather than trusted. It is
published atomically (:func:`write_manifest`: a temp file, fsync, rename, fsync of the store
directory) after every array file it names is written and fsynced, so a reader always finds
either the old commit or the new one, never a mix. :func:`read_manifest` refuses anything that
is not a tiered manifest of :data:`FORMAT_VERSION`.

Every array file (``arrays/<name>.<f>.npy``, :mod:`tiered.durable.array_files`) is a ``.npy`` file
whose size and the CRC-32 of each 1 MiB page (:func:`page_checksums`) the manifest records;
opening one (:func:`map_npy`, :func:`load_npy`) takes regular files only, parses and bounds its
header without running code (:func:`read_npy_header`: it must account for exactly the file's
size) and checks its pages before the bytes are trusted.

All file writes go through :mod:`tiered.util.fileio`.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import io
import json
import math
import mmap as mmap_module
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ChecksumError, CorruptionError, FormatVersionError, NotATieredStoreError
from ..util import fileio
from ..util.filemap import parse_npy_header
from ..util.pool import run_parallel
from ..version import __version__

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "PAGE_BYTES", "NpyHeader",
           "load_npy", "npy_array", "read_npy_header", "page_checksums", "check_pages", "arrays_verified",
           "already_verified", "map_npy",
           "write_manifest", "read_manifest"]

FORMAT_NAME = "tiered"
#: The one on-disk format this tiered writes and reads (docs/format.md).
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


#: Bytes of one checksummed page of an array file (the last page of a file may be shorter).
PAGE_BYTES = 1 << 20
#: A manifest larger than this is not one tiered wrote (it holds a few KiB per million rows).
MAX_MANIFEST_BYTES = 64 << 20
# Largest .npy header accepted (numpy's own default limit is 10000 bytes).
_MAX_HEADER = 1 << 16
# Bytes of a .npy file before its header: magic, version and the header's length (12 at most).
_NPY_PREFIX = 12
# Pages checked on one thread below this many (a thread hop costs more than a small CRC).
_THREADED_PAGES = 8

# Array files whose checksums were already verified in this context (by `tiered verify`, which
# then opens the store as a user would without reading them a second time): identity -> True.
_verified: contextvars.ContextVar[frozenset[tuple[int, ...]] | None] = contextvars.ContextVar(
    "tiered_verified_arrays", default=None)


def page_checksums(parts: list[memoryview], page_bytes: int = PAGE_BYTES, threads: int = 8) -> list[int]:
    """CRC-32 of each ``page_bytes`` page of the concatenation of ``parts`` (the bytes of a file).

    Pages are hashed on up to ``threads`` threads (``zlib.crc32`` releases the GIL).

    Example:
        >>> import zlib
        >>> page_checksums([memoryview(b"abc"), memoryview(b"defg")], page_bytes=4) == [
        ...     zlib.crc32(b"abcd"), zlib.crc32(b"efg")]
        True
    """
    bounds = np.cumsum([0] + [p.nbytes for p in parts])
    total = int(bounds[-1])
    n_pages = -(-total // page_bytes)
    out = [0] * n_pages

    def chunk(ks: range) -> None:
        for k in ks:  # one call per MiB page: the unit of work here
            lo, hi = k * page_bytes, min(total, (k + 1) * page_bytes)
            crc = 0
            for i, part in enumerate(parts):  # a page may straddle two parts: its CRC runs on over both
                a, b = max(lo, int(bounds[i])), min(hi, int(bounds[i + 1]))
                if a < b:
                    crc = zlib.crc32(part[a - int(bounds[i]):b - int(bounds[i])], crc)
            out[k] = crc

    if n_pages < _THREADED_PAGES or threads <= 1:
        chunk(range(n_pages))
    else:
        step = -(-n_pages // threads)
        run_parallel(chunk, [(range(a, min(n_pages, a + step)),) for a in range(0, n_pages, step)], threads)
    return out


@dataclass(frozen=True)
class NpyHeader:
    """A parsed ``.npy`` header whose sizes were checked against the file.

    Attributes:
        dtype, shape, fortran_order: as in the header.
        offset: where the array's bytes start in the file.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    offset: int


def _bad(path: str, why: str) -> CorruptionError:
    return CorruptionError(f"{path}: not a valid .npy file of a tiered store ({why}); the store is damaged")


def read_npy_header(source: int | bytes, path: str, size: int) -> NpyHeader:
    """Parse and bound the header of the ``.npy`` file (``size`` bytes long) open at the fd
    ``source``, or whose first bytes ``source`` holds (as a commit left them, rebuilt from
    before-images where a writer grew the file since).

    The header's shape times the item size must account for exactly the rest of the file, so
    no size written in the file can make a reader allocate more than the file holds.

    Raises:
        CorruptionError: naming the file, for any header that is not what
            :func:`~tiered.durable.array_files.write_new` writes (bad magic, version, length, dict,
            dtype, shape, or a size lie).
    """
    # numpy's parser reads from a bounded prefix: no length written in the file makes us read more
    n = min(size, _NPY_PREFIX + _MAX_HEADER)
    f = io.BytesIO(source[:n] if isinstance(source, bytes) else os.pread(source, n, 0))
    try:
        # numpy's own reader: the header dict is a literal (ast.literal_eval, no code runs); any
        # failure (bad magic, version, length, dict, dtype; a header longer than _MAX_HEADER or than
        # the file; MemoryError, RecursionError on deep nesting) is damage
        version, header = parse_npy_header(f, _MAX_HEADER)
        if header is None:
            raise ValueError(f"unknown .npy version {version}")
        shape, fortran, dtype = header
        # numpy checks the types; the values a reader allocates by are bounded here
        if not all(not isinstance(x, bool) and x >= 0 for x in shape) or len(shape) > 32:
            raise ValueError(f"shape {shape!r}")
    except Exception as e:  # noqa: BLE001 - whatever the parser raises, the header is damaged
        raise _bad(path, f"unreadable header: {type(e).__name__}: {str(e)[:200]}") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise _bad(path, f"dtype {dtype.descr!r} is not a plain numeric type")
    start = f.tell()
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if start + nbytes != size:
        raise _bad(path, f"the header promises {nbytes} bytes of {dtype} {shape}, the file holds "
                         f"{size - start}")
    return NpyHeader(dtype, shape, fortran, start)


@contextlib.contextmanager
def arrays_verified(paths: list[str]) -> Iterator[None]:
    """Within the block, :func:`load_npy` skips the page checksums of ``paths`` (still the same
    files: device, inode, size and modification time unchanged) because the caller has just
    verified them (``tiered verify`` then opens the store as a user would)."""
    ids = set()
    for p in paths:
        with contextlib.suppress(OSError):
            ids.add(_identity(os.stat(p)))
    token = _verified.set(frozenset(ids))
    try:
        yield
    finally:
        _verified.reset(token)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def already_verified(st: os.stat_result) -> bool:
    """Whether the file of ``st`` is one whose pages :func:`arrays_verified` says were just checked."""
    verified = _verified.get()
    return bool(verified) and _identity(st) in verified


def map_npy(path: str, expected_size: int | None = None) -> tuple[mmap_module.mmap, os.stat_result, NpyHeader]:
    """Open and memory-map (copy-on-write) a ``.npy`` file written by
    :func:`~tiered.durable.array_files.write_new`:
    ``(map, stat, header)``, after checking, before anything is allocated, that it is a regular
    file of ``expected_size`` bytes whose header is valid and accounts for the file's size.

    Raises:
        CorruptionError: naming the file.
    """
    try:
        fd = fileio.open_for_read(path)
    except FileNotFoundError:
        raise CorruptionError(f"{path}: file named by the manifest is missing; the store is damaged "
                              "(restore it from a copy)") from None
    try:
        st = os.fstat(fd)
        size = st.st_size
        if expected_size is not None and size != expected_size:
            raise CorruptionError(f"{path}: expected {expected_size} bytes, found {size} (truncated or overwritten)")
        if size == 0:
            raise _bad(path, "empty file")
        head = read_npy_header(fd, path, size)
        whole = mmap_module.mmap(fd, size, flags=mmap_module.MAP_PRIVATE,
                                 prot=mmap_module.PROT_READ | mmap_module.PROT_WRITE)
    except OSError as e:
        raise CorruptionError(f"{path}: cannot be read ({e}); the store is damaged") from None
    finally:
        os.close(fd)
    return whole, st, head


def load_npy(path: str, expected_size: int | None = None, mmap: bool = True,
             pages: list[int] | None = None) -> np.ndarray:
    """Memory-map (copy-on-write) a ``.npy`` file written by
    :func:`~tiered.durable.array_files.write_new`, checking it.

    Checks, before anything is allocated: the file is a regular file of ``expected_size`` bytes,
    its header is valid and accounts for the file's size exactly, and (with ``pages``, the
    commit's page checksums) every page's CRC-32.

    Raises:
        CorruptionError (its subclass ChecksumError for a page mismatch): naming the file.
    """
    whole, st, head = map_npy(path, expected_size)
    if pages is not None and not already_verified(st):
        check_pages(path, memoryview(whole), pages)
    arr = npy_array(whole, head)
    return arr if mmap else arr.copy()


def npy_array(buf: Any, head: NpyHeader) -> np.ndarray:
    """The array of the ``.npy`` file whose bytes ``buf`` are (``head``: its checked header)."""
    count = math.prod(head.shape)
    order = "F" if head.fortran_order else "C"
    if count == 0:
        return np.empty(head.shape, head.dtype, order=order)
    return np.frombuffer(buf, dtype=head.dtype, count=count, offset=head.offset).reshape(head.shape, order=order)


def check_pages(path: str, view: memoryview, pages: list[int]) -> None:
    """Compare the page checksums of a file's bytes with the commit's.

    Raises:
        ChecksumError: naming the file and the first damaged byte range.
    """
    got = page_checksums([view])
    if got == list(pages):
        return
    if len(got) != len(pages):
        raise ChecksumError(f"{path}: the commit records {len(pages)} checksummed pages, the file has "
                            f"{len(got)}; the store is damaged. Run `tiered verify` for details.")
    bad = [k for k, (a, b) in enumerate(zip(got, pages, strict=True)) if a != b]
    lo = bad[0] * PAGE_BYTES
    raise ChecksumError(
        f"{path}: checksum mismatch in {len(bad)} page(s), first at bytes {lo}..{min(view.nbytes, lo + PAGE_BYTES)} "
        f"(stored crc32 {pages[bad[0]]:#010x}, computed {got[bad[0]]:#010x}); the stored bytes are damaged. "
        "Restore the store from a copy; run `tiered verify` for details.")


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(directory: str, body: dict[str, Any]) -> None:
    """Atomically publish a manifest (temp file, fsync, rename, fsync of the directory)."""
    body = dict(body, format=FORMAT_NAME, format_version=FORMAT_VERSION)
    doc = {"body": body, "sha256": _body_digest(body)}
    fileio.write_file_atomic(os.path.join(directory, MANIFEST), json.dumps(doc, indent=1).encode())


def read_manifest(directory: str) -> dict[str, Any]:
    """Read and check a manifest; raise a specific error for every way it can be wrong."""
    if not os.path.isdir(directory):
        raise NotATieredStoreError(f"{directory!r} is not a directory, so it is not a tiered store")
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        raise NotATieredStoreError(
            f"{directory!r} has no {MANIFEST}: it is not a tiered store (or its first commit never "
            "completed). Create one with TieredStore(capacity, path=...).")
    try:
        fd = fileio.open_for_read(path)  # a regular file: never blocks on a FIFO, never /dev/zero
    except FileNotFoundError:  # a dangling symlink
        raise CorruptionError(f"{path}: the manifest is a symlink to nothing; the store is damaged") from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptionError(f"{path}: the manifest is {size} bytes, more than a tiered manifest ever "
                                  f"holds ({MAX_MANIFEST_BYTES}); the store is damaged")
        raw = os.pread(fd, size, 0)
    except OSError as e:
        raise CorruptionError(f"{path}: the manifest cannot be read ({e})") from None
    finally:
        os.close(fd)
    if not raw:
        raise CorruptionError(f"{path}: the manifest is empty; the store's last commit is damaged")
    try:
        doc = json.loads(raw)
        body = doc["body"]
        digest = doc["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        raise CorruptionError(f"{path}: the manifest is not valid JSON of a tiered store (garbage, "
                              "truncated or nested too deep)") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise NotATieredStoreError(f"{path}: not a tiered manifest (format={body.get('format')!r})"
                                   if isinstance(body, dict) else f"{path}: not a tiered manifest")
    version = body.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise FormatVersionError(
            f"{path}: on-disk format version {version!r}; this tiered ({__version__}) reads format version "
            f"{FORMAT_VERSION} only and has no converter. Open the store with the tiered that wrote it, run "
            "`tiered export STORE OUT --format npz` there, then `tiered import OUT NEW --format npz` with this one.")
    try:
        ok = isinstance(digest, str) and _body_digest(body) == digest
    except (TypeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise CorruptionError(f"{path}: manifest checksum mismatch (the file was modified or torn)")
    return body
