"""Write ``tests/fixtures/golden/``: format-v1 stores and codec blobs that must decode forever.

numcodecs keeps a ``fixture/`` folder of bytes written by old releases and a test that decodes
them with the current code; this is the same idea for tiered. The folder holds:

``stores/<name>.tar.xz``
    Small format-v1 stores (see docs/format.md) written with the public API
    (``tiered.TieredStore(capacity, path, ...)``, ``extend``, ``flush``, ``close``) from a few
    hundred real Atari transitions of ``benchmarks/data/atari_frames.npz`` (Pong, Breakout and
    MsPacman, stacked into ``4x84x84`` observations by :func:`tiered.atari.load_fixture`):
    ``chunk_frames`` 1 and 4, cold backends ``memmap`` and ``hdf5``, whole-cell blobs with the
    lz4 codec, and one store with a dense field of each dtype format v1 commits today. The ring
    stores are written in several commits (small staged writes among them) and wrap (320 rows
    into 256), so their manifests carry free blob ids and free and deferred cold extents.
``codecs/<name>.bin``
    Real frames (single frames, 4-frame chunks, a partial frame and an empty cell) encoded with
    ``tiered.codecs.get_codec(spec).encode`` for zstd levels -5, 1, 3, 9 and 19, lz4 and raw: the
    encoder's output buffer byte for byte.
``golden.json``
    What a reader must get back: per store its shape (capacity, len, cursor, generation, schema),
    per field the dtype, shape and SHA-256 of the whole column in row order, per row a short
    digest of all its fields (so a failure names the rows); per codec set the blobs' offsets,
    sizes, stored checksums, decoded sizes and the SHA-256 of the decoded bytes. Every
    expectation is computed from the *source* rows and frames, not by reading the fixture back,
    and the script then checks the fixture against it (extracting, opening, verifying, reading)
    before it writes ``golden.json``.

Why the stores are tar archives (and why that is still exactly what tiered wrote): a cold
segment is reserved on disk ahead of its blobs, ``posix_fallocate`` in 16 MiB steps for
``memmap``, and for ``hdf5`` a contiguous ``blobs`` dataset of the whole segment size (256 MiB,
never filled, so sparse). The manifest records the *reserved* length (``cold.segment_sizes``),
and :meth:`tiered.tiers.memmap.MemmapTier.open`, ``tiered verify`` and the HDF5 segment check
all require the file to be at least that long (and the dataset to have that shape), so a
segment truncated to its high-water mark would be a file tiered never writes and refuses to
open. Instead each store directory is archived as it is on disk, with its files' zero-filled
4 KiB blocks (the reserved, never written space) recorded as holes: members with holes are
written in the POSIX/GNU sparse format 1.0, which :mod:`tarfile` and GNU tar extract back to
files of the same length and the same bytes (sparse on disk). The archives are xz-compressed
with fixed metadata (mtime 0, uid 0), so an archive depends only on the bytes of the store.
The one file left out is ``lock``: it is the writer lock, not data, it holds the writing
machine's host name and pid, and the next writer creates it again (``tiered.open(path,
mode="r+")`` is exercised on every store by ``tests/durable/test_golden.py``).

A fixture must decode forever: never regenerate one that exists because a test fails; a failing
golden test means format v1 broke. Add new fixtures for new features instead. This script
therefore refuses to overwrite an existing fixture unless ``--force`` is given (for a
deliberate change of the fixture set, which must come with a note in docs/format.md). The set
was written once more, with ``--force``, when the pre-release layouts were folded into the one
format v1 (the codec blobs came out byte for byte the same); from then on the stores and the
blobs decode forever, and every later tiered reads them.

Dense dtypes: format v1 commits dense fields of ``bool``, ``uint8``, ``int8``, ``int16``,
``int32``, ``int64``, ``float16``, ``float32``, ``float64``, ``complex64`` and ``complex128``.
``bfloat16`` and ``complex32`` are accepted by ``extend`` but fail at commit (NumPy has no such
dtype for the ``.npy`` files), and ``uint16``/``uint32``/``uint64`` and the ``float8`` types fail
in ``extend`` (torch's ``index_copy`` is not implemented for them on the CPU); they are left out
until the format can hold them.

Usage:
    python benchmarks/make_golden.py                # refuses when tests/fixtures/golden exists
    python benchmarks/make_golden.py --force        # deliberately replace the fixture set
    python benchmarks/make_golden.py --out /tmp/g   # write elsewhere (e.g. to compare)

Example (the archive helpers on a tiny directory):
    >>> import tempfile, pathlib
    >>> src = pathlib.Path(tempfile.mkdtemp()) / "d"; src.mkdir()
    >>> _ = (src / "f.bin").write_bytes(b"x" + bytes(3 * HOLE_BLOCK))
    >>> archive = pathlib.Path(tempfile.mkdtemp()) / "d.tar.xz"
    >>> pack_directory(src, archive)
    >>> out = extract_archive(archive, tempfile.mkdtemp())
    >>> (out / "f.bin").read_bytes() == (src / "f.bin").read_bytes()
    True
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the package.
sys.path.insert(0, str(REPO))

import tiered  # noqa: E402
from tiered.atari import load_fixture  # noqa: E402
from tiered.codecs import get_codec, segment_checksums  # noqa: E402
from tiered.durable.commit_arrays import array_path  # noqa: E402
from tiered.durable.manifest import FORMAT_VERSION  # noqa: E402
from tiered.verify import verify_store  # noqa: E402

__all__ = ["pack_directory", "extract_archive", "tensor_bytes", "main"]

DEFAULT_OUT = REPO / "tests" / "fixtures" / "golden"
DEFAULT_SOURCE = REPO / "benchmarks" / "data" / "atari_frames.npz"
MANIFEST_NAME = "golden.json"
# What --force replaces (and what must not exist without it).
OWNED = ("stores", "codecs", MANIFEST_NAME)
# Written next to them: git must never convert line ends in, or diff, the fixture's bytes (a zstd
# blob set may hold no NUL byte in its first 8000 bytes, which git would take for text).
GITATTRIBUTES = """\
# Golden fixtures must stay byte for byte as written: no end-of-line conversion, no text diffs
# of the binary files (a zstd blob set may hold no NUL byte, which git would take for text).
* -text
*.bin binary
*.xz binary
"""
#: Granularity of the holes recorded in the archives (the page size the tiers reserve in).
HOLE_BLOCK = 4096
#: Files of a store directory that are not data (see the module docstring).
LEFT_OUT = frozenset({"lock"})
#: Rows of each game in the source rows: (game, first transition, count). Windows with
#: rewards, an episode end (Breakout at 127, MsPacman at 420) and three different screens.
WINDOWS = (("Pong", 40, 140), ("Breakout", 100, 140), ("MsPacman", 400, 40))
#: Rows per ``extend`` call of the ring stores, and where they commit. 5 and 3 are staged
#: writes (below ``stage_rows // 8``); 320 rows into capacity 256 wrap the ring, the last three
#: writes overwrite committed rows in three commits (cold space freed before the previous commit
#: is reusable, the rest deferred), so free ids and free and deferred cold extents are on disk.
RING_PLAN: tuple[int | str, ...] = (100, "flush", 5, 3, 92, "flush", 80, "flush", 20, "flush", 20, "close")
RING_CAPACITY = 256
#: Dense dtypes format v1 commits today (see the module docstring for the others).
DENSE_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
                "complex64", "complex128")
#: Codec sets: name -> spec.
CODEC_SETS = {"zstd_m5": "zstd:-5", "zstd_1": "zstd:1", "zstd_3": "zstd:3", "zstd_9": "zstd:9",
              "zstd_19": "zstd:19", "lz4": "lz4", "raw": "raw"}
# Digits of the per-row digests kept in golden.json (64 bits: enough to name a damaged row;
# the full SHA-256 of every column is kept too).
ROW_DIGEST_HEX = 16


# ------------------------------------------------------------------------------------------
# Sparse tar archives of a directory
# ------------------------------------------------------------------------------------------
def _data_runs(data: np.ndarray) -> list[tuple[int, int]]:
    """(offset, length) of the runs of ``HOLE_BLOCK`` blocks of ``data`` holding a nonzero byte."""
    size = data.size
    blocks = -(-size // HOLE_BLOCK)
    padded = np.zeros(blocks * HOLE_BLOCK, dtype=np.uint8)
    padded[:size] = data
    nonzero = padded.reshape(blocks, HOLE_BLOCK).any(axis=1)
    edges = np.flatnonzero(np.diff(np.r_[0, nonzero.astype(np.int8), 0]))
    starts, stops = edges[0::2] * HOLE_BLOCK, np.minimum(edges[1::2] * HOLE_BLOCK, size)
    return list(zip(starts.tolist(), (stops - starts).tolist(), strict=True))


def _info(name: str, kind: bytes, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_file(tar: tarfile.TarFile, path: Path, name: str) -> None:
    data = np.fromfile(path, dtype=np.uint8)
    runs = _data_runs(data)
    if sum(length for _, length in runs) == data.size:  # no hole: a plain member
        tar.addfile(_info(name, tarfile.REGTYPE, data.size), io.BytesIO(data.tobytes()))
        return
    # POSIX/GNU sparse format 1.0: the member's data starts with a map "count\n(offset\nlength\n)*"
    # padded to 512 bytes, then the runs back to back; the real name and size are in pax headers.
    # A file that ends in a hole ends its map with a run of length 0 at the end of the file.
    if not runs or runs[-1][0] + runs[-1][1] < data.size:
        runs.append((data.size, 0))
    text = f"{len(runs)}\n" + "".join(f"{o}\n{n}\n" for o, n in runs)
    sparse_map = text.encode().ljust(-(-len(text) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE, b"\0")
    payload = sparse_map + b"".join(data[o:o + n].tobytes() for o, n in runs)
    parent, _, base = name.rpartition("/")
    info = _info(f"{parent}/GNUSparseFile.0/{base}", tarfile.REGTYPE, len(payload))
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                        "GNU.sparse.realsize": str(data.size)}
    tar.addfile(info, io.BytesIO(payload))


def pack_directory(directory: str | os.PathLike[str], archive: str | os.PathLike[str],
                   leave_out: frozenset[str] = frozenset()) -> None:
    """Archive ``directory`` as ``archive`` (``.tar.xz``), zero blocks recorded as holes.

    Members are named ``<directory name>/...`` in sorted order with fixed metadata, so the
    archive depends only on the files' names and bytes.

    Args:
        directory: the directory to archive.
        archive: the ``.tar.xz`` file to write.
        leave_out: file names (at any depth) not to archive.
    """
    root = Path(directory)
    with tarfile.open(archive, "w:xz", format=tarfile.PAX_FORMAT, preset=9) as tar:
        tar.addfile(_info(root.name, tarfile.DIRTYPE))
        for path in sorted(root.rglob("*")):
            name = f"{root.name}/{path.relative_to(root).as_posix()}"
            if path.is_dir():
                tar.addfile(_info(name, tarfile.DIRTYPE))
            elif path.name not in leave_out:
                _add_file(tar, path, name)


def extract_archive(archive: str | os.PathLike[str], destination: str | os.PathLike[str]) -> Path:
    """Extract an archive written by :func:`pack_directory`; return the directory it holds.

    Holes come back as holes (sparse files of the original length). Uses tarfile's ``"data"``
    extraction filter where this Python has it (no absolute paths, links or devices).
    """
    destination = Path(destination)
    with tarfile.open(archive, "r:xz") as tar:
        top = {m.name.split("/", 1)[0] for m in tar.getmembers()}
        if len(top) != 1:
            raise ValueError(f"{archive} holds {sorted(top)}, expected one top-level directory")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(destination, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            tar.extractall(destination)
    return destination / top.pop()


# ------------------------------------------------------------------------------------------
# Expected contents
# ------------------------------------------------------------------------------------------
def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The C-order bytes of a CPU tensor (bool as one 0/1 byte per element)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def expected_store(rows: Any, fields: Sequence[Any]) -> dict[str, Any]:
    """Field and row digests of ``rows`` (a TensorDict in ring-slot order) for ``fields``."""
    columns = [rows.get(f.key) for f in fields]
    # dtype and shape of the rows themselves, so that a schema read back wrong cannot agree
    out_fields = [{"key": list(f.key), "dtype": dtype_name(c.dtype), "shape": list(c.shape[1:]),
                   "kind": f.kind, "sha256": sha256(tensor_bytes(c))} for f, c in zip(fields, columns, strict=True)]
    n = rows.batch_size[0]
    flat = [c.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy() for c in columns]
    # one digest per row over its fields' bytes in schema order
    joined = np.concatenate(flat, axis=1)
    row_digests = [hashlib.sha256(joined[r].tobytes()).hexdigest()[:ROW_DIGEST_HEX] for r in range(n)]
    return {"fields": out_fields, "rows": row_digests}


def ring_slots(written: int, capacity: int) -> np.ndarray:
    """For each ring slot (``0 .. min(written, capacity) - 1``), the source row it holds last."""
    slots = np.arange(min(written, capacity), dtype=np.int64)
    last_lap = (written - 1 - slots) // capacity
    return slots + last_lap * capacity


# ------------------------------------------------------------------------------------------
# Source data
# ------------------------------------------------------------------------------------------
def source_rows(source: Path) -> Any:
    """The 320 real transitions of :data:`WINDOWS`, in TorchRL's layout (see tiered.atari)."""
    games = [g for g, _, _ in WINDOWS]
    data = load_fixture(source, games=games)  # games concatenated in this order, 2000 each
    per_game = data.batch_size[0] // len(games)
    index = np.concatenate([np.arange(first, first + count) + i * per_game
                            for i, (_, first, count) in enumerate(WINDOWS)])
    return data[torch.from_numpy(index)].clone()


def dense_dtype_columns(n: int, seed: int = 11) -> dict[str, torch.Tensor]:
    """A ``[n, 4]`` column of each dense dtype: random bit patterns (NaN payloads, infinities,
    subnormals and negative zeros among the floats) with each type's extremes in row 0."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in DENSE_DTYPES:
        dtype = getattr(torch, name)
        if dtype == torch.bool:
            out[name] = torch.from_numpy(rng.integers(0, 2, size=(n, 4)).astype(bool))
            continue
        itemsize = torch.empty(0, dtype=dtype).element_size()
        bits = rng.integers(0, 256, size=(n, 4 * itemsize), dtype=np.uint8)
        column = torch.from_numpy(bits).view(dtype).clone()
        if dtype.is_floating_point or dtype.is_complex:
            column[0] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")]).to(dtype)
        else:
            info = torch.iinfo(dtype)
            column[0] = torch.tensor([info.min, info.max, 0, -1 if info.min < 0 else 1], dtype=dtype)
        out[name] = column
    return out


# ------------------------------------------------------------------------------------------
# Stores
# ------------------------------------------------------------------------------------------
def _write(path: Path, rows: Any, capacity: int, plan: Sequence[int | str], **kwargs: Any) -> int:
    """Write ``rows`` into a new store following ``plan``; return the number of commits."""
    store = tiered.TieredStore(capacity, path, **kwargs)
    commits, at = 1, 0  # creating the store commits generation 1
    for step in plan:
        if step == "flush":
            store.flush()
            commits += 1
        elif step == "close":
            store.close()
            commits += 1
        else:
            store.extend(rows[at:at + int(step)])
            at += int(step)
    if at != rows.batch_size[0]:
        raise ValueError(f"the plan writes {at} rows, the data has {rows.batch_size[0]}")
    return commits


def store_specs(rows: Any) -> dict[str, dict[str, Any]]:
    """Every fixture store: its rows, capacity, write plan and TieredStore options."""
    frames = {"observation": 0}
    with_dtypes = rows.clone()
    with_dtypes["dtypes"] = dense_dtype_columns(rows.batch_size[0])
    cells = rows[-96:].clone()  # Breakout, then MsPacman and its episode end
    return {
        "memmap_k1": dict(rows=rows, capacity=RING_CAPACITY, plan=RING_PLAN,
                          options=dict(backend="memmap", frames=frames, chunk_frames=1)),
        "memmap_k4": dict(rows=rows, capacity=RING_CAPACITY, plan=RING_PLAN,
                          options=dict(backend="memmap", frames=frames, chunk_frames=4)),
        "hdf5_k1": dict(rows=rows, capacity=RING_CAPACITY, plan=RING_PLAN,
                        options=dict(backend="hdf5", frames=frames, chunk_frames=1)),
        "hdf5_k4": dict(rows=rows, capacity=RING_CAPACITY, plan=RING_PLAN,
                        options=dict(backend="hdf5", frames=frames, chunk_frames=4)),
        # not wrapped (320 rows in 384), two commits
        "dense_dtypes": dict(rows=with_dtypes, capacity=384, plan=(200, "flush", 120, "close"),
                             options=dict(backend="memmap", frames=frames, chunk_frames=4)),
        # whole 4x84x84 cells as blobs (no frame dimension), lz4, wrapped: 96 rows into 64
        "cells_lz4": dict(rows=cells, capacity=64, plan=(40, "flush", 30, "flush", 26, "close"),
                          options=dict(backend="memmap", codec="lz4", chunk_frames=4)),
    }


def _cold_state(store_dir: Path) -> dict[str, int]:
    """Counts of the free lists in the committed arrays (docs/format.md, arrays/NAME.COPY.npy)."""
    body = json.loads((store_dir / "manifest.json").read_text())["body"]

    def count(name: str) -> int:
        return int(np.load(array_path(str(store_dir), body, name), allow_pickle=False).shape[0])

    return {"free_ids": count("index.free_ids"), "free_extents": count("cold.free_offsets"),
            "pending_extents": count("cold.pending_offsets")}


def check_store(store_dir: Path, expected: dict[str, Any]) -> None:
    """Open, verify and read a store directory; raise if anything differs from ``expected``."""
    report = verify_store(store_dir, progress=False, decode=True)
    if not report.ok:
        raise RuntimeError(f"verify failed on {store_dir}:\n{report.summary()}")
    with tiered.open(store_dir, mode="r") as store:
        got = expected_store(store.get(range(len(store))), list(store.schema.values()))
        facts = {"capacity": store.capacity, "len": len(store), "cursor": store.cursor}
    for name, value in facts.items():
        if value != expected[name]:
            raise RuntimeError(f"{store_dir}: {name} is {value}, expected {expected[name]}")
    if got["fields"] != expected["fields"] or got["rows"] != expected["rows"]:
        bad = [f["key"] for f, g in zip(expected["fields"], got["fields"], strict=False) if f != g]
        raise RuntimeError(f"{store_dir}: the stored rows differ from the source rows (fields {bad})")


def build_store(name: str, spec: dict[str, Any], out: Path, work: Path) -> dict[str, Any]:
    """Write, archive and check one store; return its golden.json entry."""
    path = work / name
    commits = _write(path, spec["rows"], spec["capacity"], spec["plan"], **spec["options"])
    written = spec["rows"].batch_size[0]
    order = torch.from_numpy(ring_slots(written, spec["capacity"]))
    body = json.loads((path / "manifest.json").read_text())["body"]
    with tiered.open(path, mode="r") as store:
        fields = list(store.schema.values())
    entry: dict[str, Any] = {
        "archive": f"stores/{name}.tar.xz",
        "capacity": spec["capacity"],
        "len": min(written, spec["capacity"]),
        "cursor": written % spec["capacity"],
        "rows_written": written,
        "commits": commits,
        "generation": int(body["generation"]),
        "codec": body["codec"],
        "backend": body["backend"],
        "chunk_frames": int(body["options"]["chunk_frames"]),
        "frames": body["options"]["frames"],
        "cold": _cold_state(path),
        **expected_store(spec["rows"][order], fields),
    }
    archive = out / entry["archive"]
    pack_directory(path, archive, leave_out=LEFT_OUT)
    check_store(extract_archive(archive, work / "check" / name), entry)
    entry["archive_bytes"] = archive.stat().st_size
    return entry


# ------------------------------------------------------------------------------------------
# Codec blobs
# ------------------------------------------------------------------------------------------
def codec_cells(source: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Real 84x84 frames laid out back to back: per game four single frames and one 4-frame
    chunk, then a partial frame (1000 bytes, not a multiple of anything) and an empty cell."""
    pieces: list[np.ndarray] = []
    with np.load(source) as data:
        for game, first, _ in WINDOWS:
            frames = data[f"{game}/frames"]
            for i in (first, first + 1, first + 50, first + 120):
                pieces.append(frames[i].reshape(-1))
            pieces.append(frames[first + 20:first + 24].reshape(-1))
        pieces.append(data[f"{WINDOWS[0][0]}/frames"][WINDOWS[0][1] + 60].reshape(-1)[:1000])
    pieces.append(np.empty(0, dtype=np.uint8))
    sizes = np.array([p.size for p in pieces], dtype=np.int64)
    offsets = np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)
    return np.concatenate(pieces), offsets, sizes


def build_codec_set(name: str, spec: str, cells: tuple[np.ndarray, np.ndarray, np.ndarray],
                    out: Path) -> dict[str, Any]:
    """Encode the cells with ``spec``, write the encoded buffer, check it; return its entry."""
    raw, raw_offsets, raw_sizes = cells
    codec = get_codec(spec)
    encoded = codec.encode(raw, raw_offsets, raw_sizes)
    data = np.ascontiguousarray(encoded.data, dtype=np.uint8)
    checksums = segment_checksums(data, encoded.offsets, encoded.sizes)
    if not np.array_equal(checksums, encoded.checksums):
        raise RuntimeError(f"{spec}: encode returned checksums that segment_checksums does not reproduce")
    decoded = np.empty(raw.size, dtype=np.uint8)
    codec.decode(data, encoded.offsets, encoded.sizes, decoded, raw_offsets, raw_sizes)
    if not np.array_equal(decoded, raw):
        raise RuntimeError(f"{spec}: decode(encode(x)) != x")
    path = out / "codecs" / f"{name}.bin"
    data.tofile(path)
    return {
        "file": f"codecs/{name}.bin",
        "spec": codec.name,
        "format": codec.format,
        "format_id": codec.format_id,
        "nbytes": int(data.size),
        "sha256": sha256(data.tobytes()),
        "offsets": encoded.offsets.tolist(),
        "sizes": encoded.sizes.tolist(),
        "checksums": encoded.checksums.tolist(),
        "decoded_offsets": raw_offsets.tolist(),
        "decoded_sizes": raw_sizes.tolist(),
        "decoded_sha256": sha256(raw.tobytes()),
        "decoded_blob_sha256": [sha256(raw[o:o + n].tobytes()) for o, n in zip(raw_offsets.tolist(),
                                                                                 raw_sizes.tolist(), strict=True)],
    }


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------
def _existing(out: Path) -> list[Path]:
    return [out / name for name in OWNED if (out / name).exists()]


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(
        description="Write the golden fixtures of format v1 (stores and codec blobs that must decode forever).",
        epilog="An existing fixture is never overwritten unless --force is given: a failing golden test "
               "means the format broke, not that the fixture needs regenerating.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"fixture folder (default {DEFAULT_OUT})")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="Atari frames npz (real ALE frames)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing fixture (stores/, codecs/, golden.json in --out); "
                             "without it the script refuses to overwrite anything")
    args = parser.parse_args(argv)
    out: Path = args.out
    existing = _existing(out)
    if existing and not args.force:
        names = ", ".join(str(p) for p in existing)
        print(f"refusing to overwrite the existing golden fixture ({names}); golden fixtures must decode "
              "forever, so add new ones instead; pass --force to replace them deliberately", file=sys.stderr)
        return 2
    for path in existing:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (out / "stores").mkdir(parents=True, exist_ok=True)
    (out / "codecs").mkdir(parents=True, exist_ok=True)

    source: Path = args.source
    rows = source_rows(source)
    manifest: dict[str, Any] = {
        "about": "golden fixtures of tiered format v1; written by benchmarks/make_golden.py, read by "
                 "tests/durable/test_golden.py; see docs/format.md, section 'Golden fixtures'",
        "format_version": FORMAT_VERSION,
        "written_by": f"tiered {tiered.__version__}",
        "source": {"file": source.relative_to(REPO).as_posix() if source.is_relative_to(REPO) else str(source),
                   "windows": [list(w) for w in WINDOWS]},
        "column_digest": "sha256 of the field's C-order bytes over rows 0..len-1 (ring slots; bool: one "
                         "0/1 byte per element)",
        "row_digest": f"first {ROW_DIGEST_HEX} hex digits of the sha256 of the row's fields' bytes "
                      "concatenated in schema order",
        "hole_block": HOLE_BLOCK,
        "stores": {},
        "codecs": {},
    }
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        work = Path(tmp)
        for name, spec in store_specs(rows).items():
            entry = build_store(name, spec, out, work)
            manifest["stores"][name] = entry
            log(f"store {name}: {entry['archive_bytes']:,} bytes, {entry['len']} rows, "
                f"{entry['commits']} commits, cold {entry['cold']}")
            shutil.rmtree(work / name)
    cells = codec_cells(source)
    for name, spec in CODEC_SETS.items():
        entry = build_codec_set(name, spec, cells, out)
        manifest["codecs"][name] = entry
        log(f"codec set {name} ({entry['spec']}): {entry['nbytes']:,} bytes for {int(cells[2].sum()):,} raw")
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / ".gitattributes").write_text(GITATTRIBUTES)
    log(f"{out}: {_folder_bytes(out):,} bytes in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
