"""Bytes of memory arrays actually occupy: their pages resident in RAM, not their size.

A store's per-row arrays (dense columns, row tables, the written mask) are as large as its
capacity, but they live in anonymous mappings whose zero pages cost nothing until a row is written
(:mod:`tiered.util.filemap`). :func:`resident_nbytes` asks the kernel which of an array's pages
are in memory (``mincore``), so a 1M-row store holding 1,000 rows reports what it holds, not what
it could hold. Where ``mincore`` is not available (not Linux or macOS) it falls back to the
arrays' sizes: an over-count, never an under-count.

Example:
    >>> import numpy as np
    >>> from tiered.util.filemap import file_array
    >>> a = file_array(1 << 20, np.uint8)      # 1 MiB of zero pages: nothing resident yet
    >>> before = resident_nbytes([a])
    >>> a[:10_000] = 1                          # touch the first three pages
    >>> after = resident_nbytes([a])
    >>> before <= 4096 < after < 1 << 18 if MINCORE else after == 1 << 20
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["resident_nbytes", "MINCORE"]

PAGE = mmap.PAGESIZE


def _load_mincore() -> Any:
    if not sys.platform.startswith(("linux", "darwin")):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_mincore = _load_mincore()
#: Whether page residency is measured (True) or arrays count their whole size (False).
MINCORE = _mincore is not None


def _span(arr: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous numpy array or torch tensor's bytes."""
    if isinstance(arr, np.ndarray):
        return arr.__array_interface__["data"][0], int(arr.nbytes)
    return int(arr.data_ptr()), int(arr.numel() * arr.element_size())


def resident_nbytes(arrays: Iterable[Any]) -> int:
    """Bytes of the pages of ``arrays`` (numpy arrays or CPU tensors) resident in memory.

    A page shared by two arrays counts once per array; a page partly outside an array counts
    whole (what it costs).

    Args:
        arrays: contiguous arrays; empty ones count nothing.

    Returns:
        The resident bytes; the arrays' total size where residency cannot be measured.
    """
    total = 0
    for arr in arrays:
        addr, nbytes = _span(arr)
        if nbytes == 0:
            continue
        if _mincore is None:
            total += nbytes
            continue
        start = addr - addr % PAGE
        length = addr + nbytes - start
        pages = -(-length // PAGE)
        vec = np.zeros(pages, dtype=np.uint8)
        if _mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec.ctypes.data_as(ctypes.c_void_p)) != 0:
            total += nbytes  # not a mapping mincore can describe: count its size
            continue
        total += int(np.count_nonzero(vec & 1)) * PAGE
    return total
