"""Byte units and alignment: parsing budgets such as ``"2GiB"``, printing sizes, aligning offsets,
and the fragmentation figure of a byte space's free extents.

Example:
    >>> from tiered.util.units import align, format_bytes, parse_bytes
    >>> parse_bytes("1.5 GiB"), format_bytes(3 * 2**20), align([1, 16, 17]).tolist()
    (1610612736, '3.00 MiB', [16, 16, 32])
"""

from __future__ import annotations

import re
from numbers import Integral

import numpy as np

__all__ = ["ALIGNMENT", "align", "parse_bytes", "format_bytes", "fragmentation"]

#: Blob start offsets are multiples of this (nvCOMP's Zstd needs 8, ANS 16).
ALIGNMENT = 16


def align(sizes: np.ndarray) -> np.ndarray:
    """Round sizes up to :data:`ALIGNMENT`."""
    return (np.asarray(sizes, dtype=np.int64) + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Parse a byte count: an int, or a string like ``"2GiB"``, ``"512MB"``, ``"1.5 GiB"``.

    ``KB/MB/GB/TB`` are decimal (1000), ``KiB/MiB/GiB/TiB`` and the bare ``K/M/G/T`` binary
    (1024). Units are case-insensitive.

    Raises:
        ValueError: a negative number, an unknown unit or an unparsable string.

    Example:
        >>> parse_bytes("1.5 GiB"), parse_bytes("512MB"), parse_bytes(4096)
        (1610612736, 512000000, 4096)
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count (int or string like '2GiB'), got {value!r}")
    if isinstance(value, Integral):
        if value < 0:
            raise ValueError(f"a byte count must be >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is not None and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        raise ValueError(
            f"cannot parse {value!r} as a byte count; expected a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '2GiB' or '512MB'"
        )
    raise ValueError(f"expected a byte count (int or string like '2GiB'), got {type(value).__name__}")


def format_bytes(n: float | None, *, si: bool = False, none: str = "unbounded") -> str:
    """A byte count for people: binary units with two decimals (``si=True``: units of 1000).

    ``none`` is what ``None`` prints as (an unbounded budget; ``tiered info`` prints ``"-"``).

    Example:
        >>> format_bytes(3 * 2**20), format_bytes(3 * 2**20, si=True), format_bytes(512), format_bytes(None)
        ('3.00 MiB', '3.15 MB', '512 B', 'unbounded')
    """
    if n is None:
        return none
    base, units = (1000, ("kB", "MB", "GB", "TB")) if si else (1024, ("KiB", "MiB", "GiB", "TiB"))
    if abs(n) < base:
        return f"{n:.0f} B"
    for unit in units[:-1]:
        n /= base
        if abs(n) < base:
            return f"{n:.2f} {unit}"
    return f"{n / base:.2f} {units[-1]}"


def fragmentation(free_sizes: np.ndarray) -> float:
    """``1 - largest free extent / free bytes`` of the free extents' lengths ``free_sizes``; 0.0
    with no free bytes. One definition for the live tiers and ``tiered info``, which reads the
    lengths from a committed store's files (numpy only: it runs without torch).

    Example:
        >>> fragmentation(np.array([48, 16])), fragmentation(np.array([], dtype=np.int64))
        (0.25, 0.0)
    """
    free = np.asarray(free_sizes, dtype=np.int64)
    total = int(free.sum())
    return 0.0 if total == 0 else 1.0 - int(free.max()) / total
