"""CRC-32 patching (tiered.util.crc): the checksum of a page after some of its bytes changed,
computed from the old checksum and those bytes, equals zlib's CRC-32 of the new page."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered.util.crc import crc32_patch


@settings(max_examples=200, deadline=None)
@given(page=st.binary(min_size=1, max_size=5000), data=st.data())
def test_a_patched_crc_is_the_crc_of_the_patched_page(page, data):
    at = data.draw(st.integers(0, len(page)))
    new = data.draw(st.binary(min_size=0, max_size=len(page) - at))
    patched = page[:at] + new + page[at + len(new):]
    assert crc32_patch(zlib.crc32(page), len(page), at, page[at:at + len(new)], new) == zlib.crc32(patched)


def test_a_patch_in_a_mib_page():
    page = bytearray(range(256)) * 4096  # 1 MiB
    before = zlib.crc32(page)
    old = bytes(page[700_000:704_096])
    page[700_000:704_096] = b"\x07" * 4096
    assert crc32_patch(before, len(page), 700_000, old, b"\x07" * 4096) == zlib.crc32(page)


def test_a_patch_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        crc32_patch(0, 10, 8, b"abc", b"xyz")
    with pytest.raises(ValueError, match="does not fit"):
        crc32_patch(0, 10, 0, b"ab", b"xyz")
