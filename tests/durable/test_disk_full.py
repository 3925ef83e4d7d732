"""A real full disk: a store on a small tmpfs (mounted for the test; needs root, which CI has).

The writer commits real Atari rows, then the file system is filled by another file. Writing
more must fail with :class:`~tiered.errors.StorageFullError` (a tiered error, errno ENOSPC;
never a raw OSError nor SIGBUS), at ``extend`` (the segment cannot grow) or at ``flush`` (the
commit's arrays cannot be written); every committed row stays readable, by the writer and by a
read-only open; once space is freed the same writer commits again and everything verifies.
Injected full disks (``tiered.util.faults.inject_faults``) are tested elsewhere; this one is real.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import tiered
from tiered import TieredStore
from tiered.errors import StorageFullError, TieredError
from tiered.verify import verify_store

OPTS = {"frames": {"observation": 0}, "chunk_frames": 4, "warm_bytes": 0, "hot_bytes": 0}


@pytest.fixture
def small_fs(tmp_path):
    """A 40 MiB tmpfs, unmounted afterwards; skipped (with the reason) where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for a real full disk needs root (CI runs as root)")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path) -> int:
    """Fill the file system with one file; return its size."""
    n = 0
    chunk = b"\xff" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError:
                break
        for size in (1 << 16, 4096, 512, 16):  # the last few blocks too
            try:
                while True:
                    n += f.write(chunk[:size])
            except OSError:
                pass
    return n


def _rows(store, n):
    return store.get(torch.arange(n))["observation"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_full_disk_fails_writes_with_a_tiered_error_and_keeps_the_store(small_fs, atari_pong, backend):
    data = atari_pong[:600]
    path = small_fs / "s"
    writer = TieredStore(1000, path, backend=backend, **OPTS)
    writer.extend(data[:200])
    writer.flush()
    ballast = small_fs / "ballast"
    assert _fill(ballast) > 0
    errors = []
    for lo in range(200, 600, 100):  # keep writing until the full disk says so
        try:
            writer.extend(data[lo:lo + 100])
            writer.flush()
        except StorageFullError as e:
            errors.append(e)
            print(f"{backend}: rows {lo}..{lo + 100}: {e}")
            break
    assert errors, "filling the file system did not make any write fail"
    err = errors[0]
    assert isinstance(err, TieredError) and isinstance(err, OSError) and err.errno == 28, repr(err)
    assert "space" in str(err)
    # what was committed reads back, through the writer and through a read-only open
    assert torch.equal(_rows(writer, 200), data["observation"][:200])
    with tiered.open(path) as ro:
        assert len(ro) >= 200
        assert torch.equal(_rows(ro, 200), data["observation"][:200])
    # space comes back: the same writer commits what it holds, and everything verifies
    os.remove(ballast)
    writer.extend(data[500:600])
    writer.close()
    with tiered.open(path) as ro:
        n = len(ro)
        got = _rows(ro, n)
    assert torch.equal(got[:200], data["observation"][:200])
    assert torch.equal(got[n - 100:], data["observation"][500:600])
    assert verify_store(path, progress=False).ok


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_a_full_disk_fails_the_extend_that_grows_a_segment_and_changes_nothing(small_fs, atari_pong, backend):
    data = atari_pong[:100]
    path = small_fs / "s"
    writer = TieredStore(1000, path, backend=backend, **OPTS)  # committed, no segment yet
    ballast = small_fs / "ballast"
    _fill(ballast)
    with pytest.raises(StorageFullError) as e:
        writer.extend(data)  # the first segment must reserve its blocks: no space
    assert e.value.errno == 28
    assert len(writer) == 0 and writer.stats()["tiers"]["cold"]["bytes_used"] == 0
    os.remove(ballast)
    writer.extend(data)
    writer.close()
    with tiered.open(path) as ro:
        assert torch.equal(_rows(ro, 100), data["observation"])
    assert verify_store(path, progress=False).ok
