"""Pages checked on first use: reopening a path store reads no page of its per-row arrays (row
tables, dense columns); the first read or write of a row checks the CRC-32 of the pages holding
it, so a damaged page raises ChecksumError before its bytes are used, reads of other rows work,
and ``tiered verify`` still finds the damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.durable.manifest import PAGE_BYTES
from tiered.errors import ChecksumError
from tiered.verify import verify_store

N = 200_000  # the largest row table spans 4 pages: a damaged page leaves rows on either side readable


def _data(n: int, start: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(start)
    # 16x16 frames (256 B: blob fields), one new frame a row, compressible
    ids = torch.arange(start, start + n)[:, None] + torch.arange(4)
    obs = ((ids[:, :, None, None] * 7 + torch.arange(16)[:, None]) % 251).to(torch.uint8).expand(n, 4, 16, 16)
    return TensorDict({"observation": obs, ("next", "observation"): obs,
                       "action": torch.arange(start, start + n), "reward": torch.rand(n, generator=g),
                       "state": torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 8)}, [n])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lazy") / "s"
    with TieredStore(N, path, frames={"observation": 0}, hot_bytes=0, warm_bytes=0) as s:
        for lo in range(0, N, 40_000):
            s.extend(_data(40_000, start=lo))
    return path


@pytest.fixture
def store(built, tmp_path) -> Path:
    path = tmp_path / "s"
    shutil.copytree(built, path)
    return path


def _array_file(path: Path, name: str) -> Path:
    body = json.loads((path / "manifest.json").read_text())["body"]
    return path / "arrays" / f"{name}.{body['array_files'][name]}.npy"


def _damage(path: Path, name: str, page: int) -> range:
    """Flip a byte in the middle of ``page`` of the published copy of ``name``; return the rows
    whose bytes lie wholly in that page."""
    f = _array_file(path, name)
    arr = np.load(f, mmap_mode="r")
    offset, row_bytes = arr.offset, arr.nbytes // arr.shape[0]
    at = page * PAGE_BYTES + PAGE_BYTES // 2
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    first = -(-(page * PAGE_BYTES - offset) // row_bytes)
    last = ((page + 1) * PAGE_BYTES - offset) // row_bytes  # exclusive
    return range(first, last)


def _largest(path: Path, prefix: str, suffix: str = "") -> str:
    """The name of the largest array whose name starts with ``prefix`` and ends with ``suffix``."""
    body = json.loads((path / "manifest.json").read_text())["body"]
    names = [k for k in body["files"] if k.startswith(prefix) and k.endswith(suffix)]
    return max(names, key=lambda k: body["files"][k])


def test_reopen_checks_no_page_of_the_per_row_arrays(store):
    with tiered.open(store) as s:
        tables = s._write.layout.tables.values()  # noqa: SLF001 - the page checks of the open store
        checks = [p for t in tables for p in t.guard.pages] + [
            p for c in s._rows.dense_checks.values() for p in c.pages]  # noqa: SLF001
        assert len(checks) >= 4 and sum(p.checked.size > 2 for p in checks) >= 2
        assert all(int(p.checked.sum()) == 0 for p in checks)  # not even the header's page
        got = s.get(torch.tensor([5]))
        assert int(got["action"][0]) == 5
        # a read of one row checks a page or two of each array, not the store
        assert all(int(p.checked.sum()) <= 3 for p in checks)
        assert any(int(p.checked.sum()) > 1 for p in checks)


def test_a_damaged_row_table_page_raises_when_read_and_other_rows_read(store):
    name = _largest(store, "rows.", ".blob")
    with tiered.open(store) as s:
        expected = s.get(torch.arange(N))
    rows = _damage(store, name, 2)
    with tiered.open(store) as s:  # the open reads no page of the table: no error yet
        far = torch.tensor([0, 1, N - 1])
        got = s.get(far)
        assert torch.equal(got["observation"], expected["observation"][far])
        with pytest.raises(ChecksumError, match=name):
            s.get(torch.tensor([rows[len(rows) // 2]]))
        with pytest.raises(ChecksumError):  # still refused on the next try
            s.get(torch.tensor([rows[0]]))
        assert torch.equal(s.get(far)["action"], far)
    report = verify_store(store, progress=False)
    assert not report.ok and name in json.dumps(report.to_json())


def test_a_damaged_dense_page_raises_when_read(store):
    name = _largest(store, "dense.")
    rows = _damage(store, name, 1)
    with tiered.open(store) as s:
        assert s.get(torch.tensor([N - 1]))["state"].tolist() == [[float(N - 1)] * 8]
        with pytest.raises(ChecksumError, match=name):
            s.get(torch.tensor([rows[0]]))
    assert not verify_store(store, progress=False).ok


def test_a_writer_never_copies_a_damaged_page_into_a_new_commit(store):
    name = _largest(store, "rows.", ".blob")
    with tiered.open(store) as s:
        expected = s.get(torch.arange(N))
    rows = _damage(store, name, 1)
    with tiered.open(store, "r+") as w, pytest.raises(ChecksumError, match=name):
        w.set(torch.arange(rows[0], rows[0] + 10), _data(10, start=7))  # refused before any byte changes
    # the commit at close gave the damaged page no new checksum (it wrote nothing there): the
    # damage is still found, and the rows of the other pages read as before
    report = verify_store(store, progress=False)
    assert not report.ok and name in report.summary()
    with tiered.open(store) as s:
        got = s.get(torch.arange(N - 1000, N))
        with pytest.raises(ChecksumError, match=name):
            s.get(torch.arange(rows[0], rows[0] + 10))
    assert all(torch.equal(got.get(k), expected[N - 1000:].get(k)) for k in expected.keys(True, True))


def test_commits_after_a_reopen_keep_every_row(store):
    with tiered.open(store, "r+") as w:
        w.extend(_data(5000, start=N))
        w.flush()
        w.extend(_data(5000, start=N + 5000))
    with tiered.open(store) as s:
        got = s.get(torch.arange(N))
    assert torch.equal(got["action"][:10_000], torch.arange(N, N + 10_000))
    assert torch.equal(got["action"][10_000:], torch.arange(10_000, N))
    assert verify_store(store, progress=False).ok


def test_a_damaged_header_page_is_found_at_first_use_not_at_open(store):
    """The first page holds the ``.npy`` header (parsed and matched with the manifest at open)
    and the first rows: its checksum is checked when those rows are first used, like any page's,
    and a writer's commit never copies it unchecked."""
    name = _largest(store, "dense.")
    with tiered.open(store) as s:
        expected = s.get(torch.arange(N))
    _damage(store, name, 0)  # a byte of the first page's rows (row 0 lies in that page too)
    with tiered.open(store) as s:  # opens: no page of the column read yet
        assert s.get(torch.tensor([N - 1]))["state"].tolist() == [[float(N - 1)] * 8]
        with pytest.raises(ChecksumError, match=name):
            s.get(torch.tensor([0]))
    with tiered.open(store, "r+") as w:  # a write elsewhere, then the commit at close
        w.set(torch.tensor([N - 1]), _data(1, start=N - 1))
    # the commit wrote no byte of the damaged page and gave it no new checksum: still found
    report = verify_store(store, progress=False)
    assert not report.ok and name in report.summary()
    with tiered.open(store) as s:
        got = s.get(torch.arange(N - 1000, N - 1))  # rows of other pages the writer did not set read as before
        with pytest.raises(ChecksumError, match=name):
            s.get(torch.tensor([0]))
    assert all(torch.equal(got.get(k), expected.get(k)[N - 1000:N - 1]) for k in expected.keys(True, True))
