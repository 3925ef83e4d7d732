"""Commits after the first ones write what changed, not the whole store (nor whole checksum
pages), in place in each array's file (docs/format.md, "Commit protocol")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import manifest_body
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.durable.array_files import WRITE_UNIT, plan_in_place, write_in_place, write_new
from tiered.durable.manifest import PAGE_BYTES, page_checksums
from tiered.testing import parts
from tiered.util.dirty import BLOCK, BLOCK_SHIFT
from tiered.verify import verify_store


def write_copy(path, arr, blocks, base, generation=0, *, compare=False):
    """What a commit does with one array's file: in place where the header is the same (the
    dirty ``blocks``' bytes, or with ``compare`` those that differ), else a new file."""
    runs = plan_in_place(str(path), arr, None if compare else blocks, base) if base is not None else None
    if runs is None:
        return write_new(str(path), arr, generation)
    return write_in_place(str(path), arr, runs, base)


def test_a_commit_writes_what_changed(tmp_path):
    n = 40_000
    obs = torch.randint(0, 255, (n, 4, 8, 8), dtype=torch.uint8)
    td = TensorDict({"observation": obs, "action": torch.arange(n), ("next", "observation"): obs}, [n])
    path = tmp_path / "s"
    with TieredStore(n, path, frames={"observation": 0}) as s:
        s.extend(td)
        s.flush()
        s.extend(td[:100])
        s.flush()
        first = sum(f.stat().st_size for f in (path / "arrays").glob("*.npy"))
        s.extend(td[100:200])
        s.flush()
    with tiered.open(path, "r+") as w:
        w.extend(td[200:300])
        w.flush()
        assert 0 < w._files.last_commit_bytes < first / 2  # noqa: SLF001 - the bytes a commit wrote
    with tiered.open(path) as r:
        got = r.get(torch.arange(300))
    assert torch.equal(got["observation"], obs[:300]) and torch.equal(got["action"], torch.arange(300))
    assert verify_store(path, progress=False).ok


def test_writes_through_dense_views_are_committed(tmp_path):
    """``get(copy=False)`` hands out views of the dense columns, and writing to them writes to the
    store (its docstring says so): every commit while such a view is alive saves its rows, so
    nothing written through it is lost at reopen, however many commits later it was written."""
    n = 10_000  # more than one dirty block of rows, so a missed mark would leave rows behind
    path = tmp_path / "s"
    # columns kept in their own dtypes (dense_dtypes): a column that narrows itself is read as a copy
    with TieredStore(n, path, dense_dtypes={"reward": torch.float32, "step": torch.int64}) as s:
        s.extend(TensorDict({"reward": torch.zeros(n), "step": torch.arange(n)}, [n]))
        s.flush()
        view = s.get(slice(0, n), copy=False)
        view["reward"] += 1.0  # before the next commit
        s.flush()
        s.extend(TensorDict({"reward": torch.zeros(1), "step": torch.zeros(1, dtype=torch.int64)}, [1]))
        s.flush()
        view["reward"][-5000:] += 1.0  # two commits after the view was taken
    with tiered.open(path) as s:
        reward = s.get(slice(0, n))["reward"]
    expected = torch.ones(n)
    expected[0] = 0.0  # overwritten by the ring's 10,001st row
    expected[-5000:] += 1.0
    assert torch.equal(reward, expected)


def _copy_matches(path: Path, arr: np.ndarray, state) -> bool:
    """The file holds ``arr`` and ``state`` has the CRC-32 of each of its pages."""
    raw = path.read_bytes()
    return np.array_equal(np.load(path), arr) and state.crcs == page_checksums([memoryview(raw)])


def test_a_copy_rewrite_writes_the_changed_bytes_not_whole_pages(tmp_path):
    """A dirty block inside a 1 MiB checksum page is written as the memory pages that hold it:
    the bytes written do not grow with the page (nor the array), and every page's CRC is that of
    the file."""
    path = tmp_path / "dense.0.0.npy"
    arr = np.arange(4 * PAGE_BYTES // 8, dtype=np.int64)  # four checksum pages
    first = write_copy(str(path), arr, None, None, 1)
    blocks = np.zeros(arr.size >> BLOCK_SHIFT, dtype=bool)
    blocks[100] = True  # ids 409,600..413,695: inside the fourth page
    arr[(100 << BLOCK_SHIFT) + 7] = -1
    again = write_copy(str(path), arr, blocks, first, 2)
    assert again.written <= (BLOCK << 3) + 2 * WRITE_UNIT < PAGE_BYTES
    assert _copy_matches(path, arr, again)
    assert again.crcs[:3] == first.crcs[:3] and again.crcs[3] != first.crcs[3]


def test_damage_beside_a_dirty_block_is_not_blessed_with_a_new_crc(tmp_path):
    """A byte of the copy damaged beside a dirty block (in the same checksum page, outside the
    block) keeps failing its page's CRC after the rewrite: the new CRC is patched from the old
    one, never taken from what the file holds; a page read and hashed whole (the last, short
    one) is rewritten from memory instead."""
    path = tmp_path / "dense.0.0.npy"
    arr = np.arange(2 * PAGE_BYTES // 8, dtype=np.int64)  # pages: two whole, one of 128 bytes
    first = write_copy(str(path), arr, None, None, 1)
    with open(path, "r+b") as f:  # the copy rots outside what the next commit writes
        f.seek(PAGE_BYTES + 5000)
        f.write(b"\xff")
        f.seek(2 * PAGE_BYTES + 3)
        f.write(b"\xff")
    blocks = np.zeros(arr.size >> BLOCK_SHIFT, dtype=bool)
    blocks[-1] = True
    arr[-1] = 7
    again = write_copy(str(path), arr, blocks, first, 2)
    disk = page_checksums([memoryview(path.read_bytes())])
    assert again.crcs[0] == disk[0] and again.crcs[2] == disk[2]
    assert again.crcs[1] != disk[1]  # still found by a read of the page
    assert np.load(path)[-1] == 7 and np.load(path)[(PAGE_BYTES + 5000 - 128) // 8] != arr[(PAGE_BYTES + 5000 - 128) // 8]


@pytest.mark.parametrize("damaged", [False, True])
def test_a_short_last_page_that_grows_gets_its_crc_patched_and_extended(tmp_path, damaged):
    """An array that grows (blob ids added) on a short last page: the page's CRC is patched with
    the bytes that changed and extended over the new ones, the page never read whole; damage in
    the page outside what the commit writes keeps failing the new CRC."""
    path = tmp_path / "index.nbytes.0.npy"
    arr = np.arange(PAGE_BYTES // 8 + 20_000, dtype=np.int64)  # one whole page, one short
    first = write_copy(str(path), arr, None, None, 1)
    if damaged:
        with open(path, "r+b") as f:  # rot in the short page, away from every byte written next
            f.seek(PAGE_BYTES + 60_000)
            f.write(b"\xff")
    grown = np.concatenate([arr, -np.arange(30_000, dtype=np.int64)])  # still two pages
    grown[PAGE_BYTES // 8 + 10] = -7  # a change in the short page's old part
    blocks = np.zeros(-(-grown.size >> BLOCK_SHIFT), dtype=bool)
    blocks[(PAGE_BYTES // 8 + 10) >> BLOCK_SHIFT] = True
    blocks[arr.size >> BLOCK_SHIFT:] = True
    again = write_copy(str(path), grown, blocks, first, 2)
    raw = path.read_bytes()
    assert again.written < PAGE_BYTES // 2  # the changes and the tail, not the page
    disk = page_checksums([memoryview(raw)])
    assert len(again.crcs) == len(disk) == 2 and again.crcs[0] == disk[0]  # its header patched
    if damaged:
        assert again.crcs[1] != disk[1]  # still found by a read of the page
    else:
        assert again.crcs[1] == disk[1] and np.array_equal(np.load(path), grown)


def test_a_copy_keeps_its_own_bytes_outside_the_dirty_blocks(tmp_path):
    """Bytes of memory outside the dirty blocks (a change no dirty block recorded) are not
    written, and the page's CRC is of what the file holds: the copy stays self-consistent."""
    path = tmp_path / "dense.0.0.npy"
    arr = np.arange(PAGE_BYTES // 8, dtype=np.int64)
    first = write_copy(str(path), arr, None, None, 1)
    blocks = np.zeros(-(-arr.size >> BLOCK_SHIFT), dtype=bool)
    blocks[0] = True
    arr[0], arr[-1] = -5, -6  # the second change is in no dirty block
    again = write_copy(str(path), arr, blocks, first, 2)
    disk = np.load(path)
    assert disk[0] == -5 and disk[-1] == arr.size - 1
    assert again.crcs == page_checksums([memoryview(path.read_bytes())])


def test_an_untracked_array_is_compared_with_its_copy(tmp_path):
    """An array whose changes no id block tracks (a row table's exception list) writes nothing
    while it equals its copy, and goes whole to a new file once it differs (an open never reads
    half a commit's)."""
    path = tmp_path / "next.3.rows.1.npy"
    arr = np.arange(PAGE_BYTES // 4, dtype=np.int64)  # 2 MiB: every byte differs from zeros
    first = write_copy(str(path), arr, None, None, 1)
    same = write_copy(str(path), arr, None, first, 1, compare=True)
    assert same.written == 0 and _copy_matches(path, arr, same)
    arr[100_000] = -3
    assert plan_in_place(str(path), arr, None, same) is None
    again = write_copy(str(tmp_path / "next.3.rows.2.npy"), arr, None, same, 2, compare=True)
    assert again.file == 2 and again.written == again.size
    assert _copy_matches(tmp_path / "next.3.rows.2.npy", arr, again)


def test_a_small_commit_after_a_large_one_writes_only_its_own_rows(tmp_path):
    """One file per array, changed in place: the first commit after a build (and after reopening)
    writes its own rows and their before-images, with no catch-up of earlier commits."""
    n = 300_000
    # step: a column (a row's own number would be stored as nothing, and the write below would widen it)
    td = TensorDict({"reward": torch.zeros(n), "step": torch.arange(n) + 1}, [n])
    path = tmp_path / "big"
    with TieredStore(n, path) as s:
        s.extend(td)
        s.flush()
        generation = manifest_body(path)["generation"]
    assert manifest_body(path)["generation"] == generation  # close() commits nothing more
    with tiered.open(path, "r+") as w:
        w.set(torch.arange(10), td[:10].apply(lambda x: x + 1))
        w.flush()
        assert 0 < w._files.last_commit_bytes < 100_000  # noqa: SLF001 - the bytes a commit wrote
    with tiered.open(path) as r:
        got = r.get(torch.arange(n))
    assert torch.equal(got["step"][:10], torch.arange(10) + 2) and torch.equal(got["step"][10:], torch.arange(10, n) + 1)
    assert verify_store(path, progress=False).ok


def test_one_row_writes_in_several_blocks_are_committed(tmp_path):
    # one-row writes (staged: dense cells and flag bits written at once, the row's block marked
    # alone) in rows of three dirty blocks reach the reopened store, values and flags exact.
    # The flush that compresses the stage writes its rows' dense cells again and marks them too,
    # so the reopened values alone would not notice a one-row write that marked nothing: the
    # marks are checked where the write leaves them, before the flush.
    n = 3 * BLOCK
    obs = torch.randint(0, 255, (n, 4, 8, 8), dtype=torch.uint8)
    td = TensorDict({"observation": obs, "action": torch.arange(n), "reward": torch.zeros(n),
                     "done": torch.zeros(n, dtype=torch.bool)}, [n])
    path = tmp_path / "s"
    rows = [5, BLOCK + 9, 2 * BLOCK + 1]
    with TieredStore(n, path, frames={"observation": 0}) as s:
        s.extend(td)
        s.flush()
        for k, r in enumerate(rows):
            row = td[r].clone()
            row["action"], row["reward"], row["done"] = torch.tensor(-7 - k), torch.tensor(2.5 + k), torch.tensor(True)
            s.set(r, row)
            # the first flush took every mark; each one-row write marks its own block
            assert parts(s).rows.dirty.blocks().tolist() == list(range(k + 1))
        assert parts(s).write.stage.count == len(rows)  # (still staged: no flush marked them)
        s.flush()
    with tiered.open(path) as r:
        got = r.get(torch.tensor(rows + [6, BLOCK + 10]))
    assert got["action"].tolist() == [-7, -8, -9, 6, BLOCK + 10]
    assert got["reward"].tolist() == [2.5, 3.5, 4.5, 0.0, 0.0]
    assert got["done"].tolist() == [True, True, True, False, False]
    assert torch.equal(got["observation"], obs[rows + [6, BLOCK + 10]])
