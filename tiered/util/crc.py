"""CRC-32 arithmetic: the checksum of a page after a few of its bytes changed, without the page.

CRC-32 is linear over GF(2): for byte strings of equal length, ``crc(a ^ b ^ c) == crc(a) ^
crc(b) ^ crc(c)``. So when bytes ``[at, at + n)`` of a ``length``-byte page change from ``old``
to ``new``, the page's new CRC is its old one XOR the CRC register of ``old ^ new`` (n bytes,
without the CRC's constant parts) advanced over the ``length - at - n`` bytes after it. Advancing
a register over ``k`` zero bytes is a multiplication by ``x^(8k)`` modulo the CRC polynomial,
as zlib's ``crc32_combine`` does it: a few dozen small multiplications, whatever ``k`` is.

A commit that rewrites a few KiB of a 1 MiB checksum page then hashes those KiB, not the page.

Example:
    >>> import zlib
    >>> page = bytearray(b"x" * 1000)
    >>> before = zlib.crc32(page)
    >>> old = bytes(page[100:104]); page[100:104] = b"abcd"
    >>> crc32_patch(before, len(page), 100, old, b"abcd") == zlib.crc32(page)
    True
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["crc32_patch"]

_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed (as zlib computes it)


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (bit-reversed polynomials of degree < 32)."""
    m, p = 1 << 31, 0
    while True:  # at most 32 rounds
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k = 0..31 (the powers repeat with period 32 here)."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _x2nmodp(n: int, k: int) -> int:
    """``x^(n * 2^k)`` modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:  # one round per bit of n
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_patch(crc: int, length: int, at: int, old: bytes | memoryview, new: bytes | memoryview) -> int:
    """The CRC-32 of a ``length``-byte string whose CRC-32 is ``crc`` once its bytes ``[at, at +
    len(old))`` are ``new`` instead of ``old`` (costs ``len(old)``, not ``length``).

    Args:
        crc: the CRC-32 of the string as it was.
        length: its length in bytes.
        at: where the changed bytes start.
        old: the bytes that were there.
        new: the bytes there now (as many as ``old``).
    """
    n = len(old)
    if len(new) != n or at < 0 or at + n > length:
        raise ValueError(f"a patch of {n} bytes (new: {len(new)}) at {at} does not fit a string of {length} bytes")
    if n == 0:
        return crc
    delta = np.bitwise_xor(np.frombuffer(old, dtype=np.uint8), np.frombuffer(new, dtype=np.uint8))
    linear = zlib.crc32(delta) ^ zlib.crc32(bytes(n))  # the CRC's constant parts cancel out
    return crc ^ _multmodp(_x2nmodp(length - at - n, 3), linear)
