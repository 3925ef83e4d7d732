"""Hostile store files: size lies, special files, damaged headers and index pools.

* Size lies (a manifest claiming capacity 5e7 for a 100-row store, ``index.meta`` claiming 1e9
  blobs, a ``.npy`` header promising more than its file, a manifest that lists a larger file)
  are refused with :class:`~tiered.errors.CorruptionError` before anything sized by them is
  allocated: peak RSS, measured in a fresh subprocess, stays under 100 MB above its baseline.
* Only regular files are opened: a FIFO ``manifest.json`` does not block, a symlink to
  ``/dev/zero`` is not read, a directory or a symlink loop is named as such.
* Raw exceptions become errors naming the file: a damaged ``.npy`` header (``tokenize``),
  deeply nested manifest JSON (``RecursionError``), negative offsets.
* A damaged ``index.free_ids`` is found at open and by ``verify``, not by the next write.

Damage the page checksums would catch first is also tried restamped (``helpers.restamp``: the
manifest records the checksums of the damaged bytes, a self-consistent lie): the bounds and
consistency checks behind the checksums must hold on their own. A manifest without its
``checksums`` entry is damage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import GenFiles, gen_files, restamp

import tiered
from tiered import TieredStore
from tiered.cli import main
from tiered.errors import ChecksumError, CorruptionError, NotATieredStoreError
from tiered.verify import verify_store

OPTS = {"frames": {"observation": 0}, "chunk_frames": 4}


@pytest.fixture
def store(atari_pong, tmp_path) -> Path:
    path = tmp_path / "s"
    with TieredStore(100, path, **OPTS) as s:
        s.extend(atari_pong[:100])
    return path


def _gen(path: Path) -> GenFiles:
    return gen_files(path)


def _edit_manifest(path: Path, fn) -> None:
    """Change the manifest body and recompute its digest (a self-consistent lie)."""
    doc = json.loads((path / "manifest.json").read_text())
    fn(doc["body"])
    doc["sha256"] = hashlib.sha256(json.dumps(doc["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(doc))


def test_a_manifest_without_page_checksums_is_damage(store, capsys):
    _edit_manifest(store, lambda b: b.pop("checksums"))
    with pytest.raises(CorruptionError, match="checksums"):
        tiered.open(store)
    rep = verify_store(store, progress=False)
    assert not rep.ok and "checksums" in rep.summary(), rep.summary()


def _rewrite_array(path: Path, name: str, fn) -> None:
    f = _gen(path) / f"{name}.npy"
    a = np.load(f)
    np.save(f, fn(a))
    _edit_manifest(path, lambda b: b["files"].__setitem__(name, os.path.getsize(f)))


# ------------------------------------------------------------------------------------------ size lies

_RSS_PROBE = textwrap.dedent("""
    import json, resource, sys
    import tiered
    from tiered.errors import TieredError
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    for path in sys.argv[1:]:
        try:
            tiered.open(path).get(list(range(3)))
            outcome = "opened"
        except TieredError as e:
            outcome = type(e).__name__ + ": " + str(e)
        except BaseException as e:
            outcome = "RAW " + type(e).__name__ + ": " + str(e)[:300]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the peak so far: it only grows
        out[path] = {"outcome": outcome, "grew_mb": (peak - base) / 1024}
    print(json.dumps(out))
""")


def _capacity_lie(p: Path) -> None:
    _edit_manifest(p, lambda b: b.update(capacity=50_000_000))


def _meta_lie(p: Path) -> None:
    _rewrite_array(p, "index.meta", lambda a: np.array([10**9, 0], np.int64))


def _header_lie(p: Path) -> None:
    f = _gen(p) / "rows.0.blob.npy"
    raw = f.read_bytes()
    head = raw[:128].replace(b"(100, 1)", b"(10000000, 1)")  # (a shifted table: last frames) 5 bytes longer: cut the padding
    f.write_bytes(head[:127] + b"\n" + raw[128:])


def _files_lie(p: Path) -> None:
    _edit_manifest(p, lambda b: b["files"].__setitem__("written", 10**12))


_LIES = {"capacity-5e7": _capacity_lie, "index-meta-1e9": _meta_lie, "npy-header-shape": _header_lie,
         "manifest-file-size": _files_lie}


@pytest.mark.timeout(300)
def test_size_lies_are_refused_before_allocating(store, tmp_path):
    """Every lie, with the page checksums of the files before it and restamped after it, opened
    in one fresh process: each is refused with a CorruptionError and the process's peak RSS grows
    by less than 100 MB."""
    paths = []
    for checksums in (True, False):
        for name, lie in _LIES.items():
            p = tmp_path / f"{name}-{'checksummed' if checksums else 'restamped'}"
            shutil.copytree(store, p)
            lie(p)
            if not checksums:
                restamp(p)
            paths.append(str(p))
    r = subprocess.run([sys.executable, "-c", _RSS_PROBE, *paths], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for p in paths:
        assert got[p]["outcome"].startswith(("CorruptionError", "ChecksumError")), (p, got[p])
        assert got[p]["grew_mb"] < 100, (p, got[p])


# ------------------------------------------------------------------------------------- special files


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "symlink-loop"])
def test_a_manifest_that_is_not_a_regular_file(store, kind, capsys):
    m = store / "manifest.json"
    m.unlink()
    if kind == "fifo":
        os.mkfifo(m)
    elif kind == "dev-zero":
        m.symlink_to("/dev/zero")
    elif kind == "directory":
        m.mkdir()
    else:
        m.symlink_to(m)
    what = {"fifo": "FIFO", "dev-zero": "character device", "directory": "directory", "symlink-loop": "symlink loop"}
    with pytest.raises(CorruptionError, match=what[kind]) as e:
        tiered.open(store)
    assert "manifest.json" in str(e.value)
    capsys.readouterr()
    assert main(["info", str(store)]) == 3
    assert main(["verify", str(store), "-q"]) == 3
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["array", "segment"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_store_files_that_are_not_regular_files(store, target, kind):
    f = _gen(store) / "rows.0.slot.npy" if target == "array" else store / "cold" / "seg-000000.bin"
    f.unlink()
    if kind == "fifo":
        os.mkfifo(f)
    else:
        f.symlink_to("/dev/zero")
    with pytest.raises(CorruptionError, match=f.name):
        tiered.open(store).get([0, 1])
    rep = verify_store(store, progress=False)
    assert not rep.ok and any(p.file == str(f) for p in rep.problems), rep.summary()


# -------------------------------------------------------------------------------- raw exceptions


def test_a_damaged_npy_header_names_the_file(store):
    f = _gen(store) / "index.nbytes.npy"
    raw = bytearray(f.read_bytes())
    i = raw.index(b"'descr'")
    raw[i:i + 7] = b"'descr\n"  # an unterminated string: tokenize.TokenError inside numpy's parser
    f.write_bytes(bytes(raw))
    restamp(store)  # checksums of the damaged header: the header itself must be refused
    with pytest.raises(CorruptionError, match=re.escape(f.name)):
        tiered.open(store)
    rep = verify_store(store, progress=False)
    assert not rep.ok and any(p.file == str(f) for p in rep.problems), rep.summary()
    assert main(["verify", str(store), "-q"]) == 3


def test_deeply_nested_manifest_json(store, capsys):
    (store / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CorruptionError, match="manifest"):
        tiered.open(store)
    assert main(["verify", str(store), "-q"]) == 3
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed", "restamped"])
@pytest.mark.parametrize("case", ["negative-offset", "row-blob-far", "row-blob-negative", "slot-past-blob"])
def test_flipped_index_entries_are_tiered_errors(store, case, checksums):
    name, fn = {
        "negative-offset": ("index.loc", lambda a: np.where(a >= 0, -a - 4096, a)),
        "row-blob-far": ("rows.0.blob", lambda a: np.where(a >= 0, a + (1 << 30), a)),  # int32 tables
        "row-blob-negative": ("rows.0.blob", lambda a: np.where(a >= 0, -7, a)),
        "slot-past-blob": ("rows.0.slot", lambda a: a + 1000),
    }[case]
    f = _gen(store) / f"{name}.npy"
    a = np.load(f)
    b = fn(a).astype(a.dtype)
    f.write_bytes(f.read_bytes()[: os.path.getsize(f) - b.nbytes] + b.tobytes())  # same header, same size
    if not checksums:
        restamp(store)
    with pytest.raises(ChecksumError if checksums else CorruptionError):
        tiered.open(store).get(list(range(100)))
    assert not verify_store(store, progress=False).ok


# ------------------------------------------------------------------------------------- free ids


@pytest.mark.parametrize("how", ["duplicate", "a-stored-id", "out-of-range", "missing"])
def test_a_damaged_free_id_pool_is_found_at_open_and_by_verify(atari_pong, tmp_path, how):
    path = tmp_path / "s"
    with TieredStore(40, path, **OPTS) as s:  # wraps: freed ids in the pool
        s.extend(atari_pong[:40])
        s.flush()
        s.extend(atari_pong[40:70])
    free = np.load(_gen(path) / "index.free_ids.npy")
    assert free.size >= 2
    state = np.load(_gen(path) / "index.state.npy")
    stored = int(np.flatnonzero(state == 2)[0])
    edit = {"duplicate": lambda a: np.r_[a[:-1], a[:1]], "a-stored-id": lambda a: np.r_[a[:-1], stored],
            "out-of-range": lambda a: np.r_[a[:-1], 10**9], "missing": lambda a: a[:-1]}[how]
    _rewrite_array(path, "index.free_ids", edit)
    restamp(path)
    for mode in ("r", "r+"):
        with pytest.raises(CorruptionError, match="free_ids"):
            tiered.open(path, mode=mode)
    rep = verify_store(path, progress=False)
    assert any(p.file and p.file == str(_gen(path) / "index.free_ids.npy") for p in rep.problems), rep.summary()


def test_not_a_store_is_still_not_a_store(tmp_path):
    with pytest.raises(NotATieredStoreError):
        tiered.open(tmp_path)


# ---------------------------------------------------------------------------- overlapping cold extents


def _wrapped_store(atari_pong, tmp_path) -> tuple[Path, object]:
    """A store whose ring wrapped: freed cold extents and free ids; with every row it holds."""
    path = tmp_path / "s"
    with TieredStore(40, path, **OPTS) as s:
        s.extend(atari_pong[:40])
        s.flush()
        s.extend(atari_pong[40:70])
        s.flush()
        s.extend(atari_pong[70:75])
        rows = s.get(list(range(40)))
    return path, rows


def _stored_blobs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Cold offsets and sizes of the stored blobs, in id order."""
    state = np.load(_gen(path) / "index.state.npy")
    live = np.flatnonzero(state == 2)
    return np.load(_gen(path) / "index.loc.npy")[live, 2], np.load(_gen(path) / "index.nbytes.npy")[live]


@pytest.mark.parametrize("how", ["free-extent-on-a-blob", "two-blobs-at-one-place"])
def test_overlapping_cold_extents_stop_a_writer_and_never_give_a_reader_wrong_rows(atari_pong, tmp_path, how):
    """Overlapping cold extents only endanger a writer's allocations: a writer's open refuses the
    store before it writes anything; a read-only open (which allocates nothing and checks every
    blob's checksum before decoding it) reads every row that is intact, and a blob whose bytes
    are another's raises ChecksumError at its read, never returns wrong rows. verify names it."""
    path, rows = _wrapped_store(atari_pong, tmp_path)
    loc, nbytes = _stored_blobs(path)
    first = int(np.argmin(loc))
    if how == "free-extent-on-a-blob":
        name = next(n for n in ("cold.free_offsets", "cold.pending_offsets")
                    if np.load(_gen(path) / f"{n}.npy").size)
        _rewrite_array(path, name, lambda a: np.r_[a[:-1], loc[first]].astype(a.dtype))
    else:
        state = np.load(_gen(path) / "index.state.npy")
        ids = np.flatnonzero(state == 2)
        moved = int(ids[np.argsort(loc)[1]])  # the blob after the first one, onto the first one's bytes
        _rewrite_array(path, "index.loc", lambda a: np.where(np.arange(a.shape[0])[:, None] == moved,
                                                              np.array([-1, -1, loc[first]]), a).astype(a.dtype))
    restamp(path)  # the edits' page checksums: the consistency checks must catch them
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.rglob("*") if p.is_file() and p.name != "lock"}
    with pytest.raises(CorruptionError, match="overlap"):
        tiered.open(path, mode="r+")
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.rglob("*") if p.is_file() and p.name != "lock"}
    assert after == before  # refused before anything was written
    reader = tiered.open(path)
    if how == "free-extent-on-a-blob":
        assert (reader.get(list(range(40))) == rows).all()
    else:
        with pytest.raises(ChecksumError):
            reader.get(list(range(40)))
    reader.close()
    rep = verify_store(path, progress=False)
    assert not rep.ok and "overlap" in rep.summary(), rep.summary()
