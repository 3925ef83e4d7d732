"""The mutation sweep: damage every file of a committed store, one way at a time, and classify
what a user then gets (used by tests/durable/test_mutation.py and benchmarks/mutation_sweep.py).

A store is built from real Atari rows in three commits (the ring wraps, so its arrays hold free
blob ids and free and deferred cold extents, and the previous generation's files still exist).
Each *case* changes one file in place (or swaps two, or puts back an older copy), then:

1. ``tiered.open(path)`` (read-only);
2. ``store.get`` of every row, compared with the rows the commit holds;
3. :func:`tiered.verify.verify_store`;

and the file is restored byte for byte before the next case. Outcomes:

* ``detected``: a :mod:`tiered.errors` exception at open or get, or a verify report that is not
  ok (``tiered verify`` exits 3 for it); ``named`` says whether the exception or report names the
  damaged file (by file name, or the array's name in it);
* ``harmless``: every row read back is identical and verify is clean (a flipped bit in unused
  reserved space, in the lock file, a swap of two equal files, ...);
* ``older-commit``: the store opened, consistently, at the commit an older manifest names, and
  every row equals that commit's rows (a rolled-back manifest cannot be told from the real
  previous commit without an outside record; nothing wrong is read);
* ``SILENT``: rows read back differ and nothing said so. Must never happen;
* ``RAW``: an exception that is not a :mod:`tiered.errors` one (open, get or verify). Must never
  happen.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from helpers import gen_files
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.errors import TieredError
from tiered.verify import verify_store

CAP = 48
OPTS = {"frames": {"observation": 0}, "chunk_frames": 4, "warm_bytes": 0, "hot_bytes": 0}
PAGE = 4096
OUTCOMES = ("detected", "harmless", "older-commit", "SILENT", "RAW")


@dataclass
class Store:
    """A committed store and what its last two commits hold (the oracles)."""

    path: Path
    backend: str
    rows: TensorDict  # every row of the last commit, in row order
    older_rows: TensorDict  # every row of the commit before it
    older_manifest: bytes  # that commit's manifest.json
    older_len: int
    files: list[Path] = field(default_factory=list)  # every file of the store, relative to path


def build_store(path: Path, backend: str, data: TensorDict) -> Store:
    """Three commits of real rows through a ring of ``CAP`` (the last two wrap it)."""
    store = TieredStore(CAP, path, backend=backend, **OPTS)
    store.extend(data[:40])
    store.flush()
    store.extend(data[40:64])
    store.flush()
    older_len = len(store)
    older_rows = store.get(torch.arange(older_len))
    older_manifest = (path / "manifest.json").read_bytes()
    store.extend(data[64:84])
    store.close()
    with tiered.open(path) as ro:
        rows = ro.get(torch.arange(len(ro)))
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    current = {p.relative_to(path) for p in _current_arrays(path)}
    files = [p for p in files if p.parts[0] != "arrays" or p in current]
    return Store(path, backend, rows, older_rows, older_manifest, older_len, files)


def _current_arrays(path: Path) -> list[Path]:
    """The array files the last commit names (one copy of each array)."""
    body = json.loads((path / "manifest.json").read_text())["body"]
    files = gen_files(path, body)
    return [files / f"{name}.npy" for name in body["files"]]


def _older_copy(path: Path, rel: Path) -> Path | None:
    """The same array in the newest file an earlier commit wrote and a later one replaced, if any
    (kept while readers of the last two commits may map it)."""
    if rel.parts[0] != "arrays":
        return None
    name, f, _ = rel.name.rsplit(".", 2)
    older = sorted((int(p.name.rsplit(".", 2)[1]), p) for p in (path / "arrays").glob(f"{name}.*.npy")
                   if p.name.rsplit(".", 2)[0] == name and int(p.name.rsplit(".", 2)[1]) < int(f))
    return older[-1][1].relative_to(path) if older else None


def _data_offset(store: Store, rel: Path) -> int:
    cold = json.loads((store.path / "manifest.json").read_text())["body"]["cold"]
    return int(cold["data_offsets"][int(rel.name.split("-")[1].split(".")[0])])


def _used_end(store: Store, rel: Path) -> int:
    """Bytes of a file worth damaging: a segment's used bytes (the rest is reserved zeros)."""
    full = os.path.getsize(store.path / rel)
    if rel.parts[0] != "cold":
        return full
    cold = json.loads((store.path / "manifest.json").read_text())["body"]["cold"]
    seg = int(rel.name.split("-")[1].split(".")[0])
    used = cold["high_water"] - seg * cold["segment_bytes"]
    return min(full, cold["data_offsets"][seg] + max(0, min(used, cold["segment_bytes"])))


# ---------------------------------------------------------------------------------- mutations


@dataclass
class Mutation:
    """One way to damage one file (``other``: the second file of a swap or the older copy)."""

    file: Path
    kind: str
    arg: int = 0
    other: Path | None = None

    def label(self) -> str:
        return f"{self.kind}({self.arg}) {self.file}" + (f" <-> {self.other}" if self.other else "")


def file_kind(rel: Path) -> str:
    """The kind of a store file, for counting: manifest, lock, index.*, rows.*.blob, dense, ..."""
    if rel.parts[0] == "cold":
        return "cold segment"
    if rel.name in ("manifest.json", "lock", "commit.intent"):
        return rel.name
    name = rel.name[: -len(".npy")]
    if rel.parts[0] == "arrays":  # <name>.<copy>.npy
        name = name.rsplit(".", 1)[0]
    if name.startswith("rows."):
        return "rows.*." + name.rsplit(".", 1)[1]
    if name.startswith("dense."):
        return "dense.*"
    if name.startswith("policy."):
        return "policy.*"
    return name


def mutations(store: Store, flips: int, seed: int, thorough: bool) -> Iterator[Mutation]:
    """The cases for every file of ``store`` (``thorough``: more truncations and page positions)."""
    rng = random.Random(seed)
    by_size: dict[int, list[Path]] = {}
    for rel in store.files:
        by_size.setdefault(os.path.getsize(store.path / rel), []).append(rel)
    for rel in store.files:
        size = os.path.getsize(store.path / rel)
        used = _used_end(store, rel)
        cuts = {0, used // 2, max(used - 1, 0)} if not thorough else {0, 1, 8, used // 4, used // 2,
                                                                      max(used - 1, 0), max(used - 8, 0)}
        for c in sorted(cuts):
            if c < size:
                yield Mutation(rel, "truncate", c)
        yield Mutation(rel, "append", 1 + rng.randrange(64))
        pages = {0, max(used - 1, 0) // PAGE * PAGE}
        if thorough:
            pages |= {rng.randrange(max(used, 1)) // PAGE * PAGE for _ in range(3)}
        for p in sorted(pages):
            if p < size:
                yield Mutation(rel, "zero-page", p)
        segment = rel.parts[0] == "cold"
        for _ in range(flips * (3 if segment else 1)):
            # mostly inside the used bytes; a segment also gets flips in its reserved tail
            hi = used if rng.random() < 0.9 or used >= size else size
            if hi > 0:
                yield Mutation(rel, "flip-bit", rng.randrange(hi * 8))
        data_offset = _data_offset(store, rel) if segment else 0
        for _ in range(flips if data_offset else 0):  # HDF5 metadata before the blobs
            yield Mutation(rel, "flip-bit", rng.randrange(data_offset * 8))
        same = [o for o in by_size[size] if o != rel]
        others = same or [o for o in store.files if o != rel and o.parent == rel.parent]
        if others:
            yield Mutation(rel, "swap", 0, rng.choice(others))
        if _older_copy(store.path, rel) is not None:
            yield Mutation(rel, "older-copy", 0, _older_copy(store.path, rel))
    yield Mutation(Path("manifest.json"), "older-manifest")


class _Saved:
    """The byte ranges a mutation changes and the file's size, to put the file back exactly
    (a segment's reserved zeros are not copied: truncating back restores them)."""

    def __init__(self, path: Path, ranges: list[tuple[int, int]]):
        self.path, self.size = path, os.path.getsize(path)
        self.parts = []
        with open(path, "rb") as f:
            for a, b in ranges:
                f.seek(a)
                self.parts.append((a, f.read(max(0, min(b, self.size) - a))))

    def restore(self) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(self.size)
            for a, data in self.parts:
                f.seek(a)
                f.write(data)


def _data_end(store: Store, rel: Path) -> int:
    """End of a segment's reserved data (HDF5 may keep metadata after it); the file size otherwise."""
    size = os.path.getsize(store.path / rel)
    if rel.parts[0] != "cold":
        return size
    cold = json.loads((store.path / "manifest.json").read_text())["body"]["cold"]
    seg = int(rel.name.split("-")[1].split(".")[0])
    return min(size, cold["data_offsets"][seg] + cold["segment_bytes"])


def apply(store: Store, m: Mutation) -> list[_Saved]:
    """Damage the store as ``m`` says; return what restores it."""
    p = store.path / m.file
    size = os.path.getsize(p)
    if m.kind == "truncate":
        saved = [_Saved(p, [(m.arg, max(m.arg, _used_end(store, m.file))), (_data_end(store, m.file), size)])]
        os.truncate(p, m.arg)
    elif m.kind == "append":
        saved = [_Saved(p, [])]
        with open(p, "ab") as f:
            f.write(bytes(random.Random(m.arg).randrange(256) for _ in range(m.arg)))
    elif m.kind == "zero-page":
        saved = [_Saved(p, [(m.arg, m.arg + PAGE)])]
        with open(p, "r+b") as f:
            f.seek(m.arg)
            f.write(bytes(min(PAGE, size - m.arg)))
    elif m.kind == "flip-bit":
        saved = [_Saved(p, [(m.arg // 8, m.arg // 8 + 1)])]
        with open(p, "r+b") as f:
            f.seek(m.arg // 8)
            b = f.read(1)
            f.seek(m.arg // 8)
            f.write(bytes([b[0] ^ (1 << (m.arg % 8))]))
    elif m.kind in ("swap", "older-copy"):
        q = store.path / m.other
        saved = [_Saved(p, [(0, size)])]
        a, b = p.read_bytes(), q.read_bytes()
        if m.kind == "swap":
            saved.append(_Saved(q, [(0, os.path.getsize(q))]))
            q.write_bytes(a)
        p.write_bytes(b)
    elif m.kind == "older-manifest":
        saved = [_Saved(p, [(0, size)])]
        p.write_bytes(store.older_manifest)
    else:
        raise ValueError(m.kind)
    return saved


# ----------------------------------------------------------------------------------- outcomes


def _names(text: str, m: Mutation) -> bool:
    names = {m.file.name, m.file.name.removesuffix(".npy")}
    if m.other is not None:
        names |= {m.other.name, m.other.name.removesuffix(".npy")}
    if m.file.name == "manifest.json":
        names.add("manifest")
    return any(n in text for n in names)


def _equal(a: TensorDict, b: TensorDict) -> bool:
    keys = set(a.keys(True, True))
    return keys == set(b.keys(True, True)) and all(
        a.get(k).shape == b.get(k).shape and torch.equal(a.get(k), b.get(k)) for k in keys)


def run_case(store: Store, m: Mutation) -> tuple[str, bool, str]:
    """Apply ``m``, classify what open, get and verify do, restore. Returns (outcome, named, detail)."""
    saved = apply(store, m)
    try:
        return _classify(store, m)
    finally:
        for s in reversed(saved):
            s.restore()


def _classify(store: Store, m: Mutation) -> tuple[str, bool, str]:
    found: list[str] = []  # what was detected, where
    read_ok: bool | None = None
    older = False
    try:
        s = tiered.open(store.path, warm_bytes=0, hot_bytes=0)
        try:
            n = len(s)
            got = s.get(torch.arange(n)) if n else None
            if n == len(store.rows) and got is not None and _equal(got, store.rows):
                read_ok = True
            elif n == store.older_len and got is not None and _equal(got, store.older_rows):
                read_ok, older = True, True
            else:
                read_ok = False
        finally:
            s.close()
    except TieredError as e:
        found.append(f"open/get: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - the point of the sweep: a raw error is a finding
        return "RAW", False, f"open/get: {type(e).__name__}: {e}"
    try:
        report = verify_store(store.path, progress=False)
        if not report.ok:
            found.append("verify: " + report.summary())
            if any("verify stopped on" in p.message for p in report.problems):
                return "RAW", False, "verify: " + report.summary()
    except TieredError as e:
        found.append(f"verify: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001
        return "RAW", False, f"verify: {type(e).__name__}: {e}"
    if found:
        return "detected", any(_names(f, m) for f in found), found[0][:400]
    if read_ok is False:
        return "SILENT", False, "rows read back differ and nothing was reported"
    return ("older-commit" if older else "harmless"), False, ""


@dataclass
class Tally:
    """Counts per (file kind, outcome), and the failing cases."""

    counts: Counter = field(default_factory=Counter)
    unnamed: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    cases: int = 0

    def add(self, m: Mutation, outcome: str, named: bool, detail: str) -> None:
        self.cases += 1
        self.counts[(file_kind(m.file), outcome)] += 1
        if outcome == "detected" and not named:
            self.unnamed[file_kind(m.file)] += 1
        if outcome in ("SILENT", "RAW"):
            self.failures.append(f"{outcome}: {m.label()}: {detail}")

    def table(self) -> str:
        kinds = sorted({k for k, _ in self.counts})
        lines = [f"{'file kind':<22}" + "".join(f"{o:>13}" for o in OUTCOMES) + f"{'unnamed':>10}"]
        for k in kinds:
            lines.append(f"{k:<22}" + "".join(f"{self.counts[(k, o)]:>13}" for o in OUTCOMES)
                         + f"{self.unnamed[k]:>10}")
        lines.append(f"{'total':<22}" + "".join(f"{sum(v for (_, o), v in self.counts.items() if o == oc):>13}"
                                                for oc in OUTCOMES) + f"{sum(self.unnamed.values()):>10}")
        return "\n".join(lines)


def sweep(store: Store, flips: int, seed: int, thorough: bool = False, limit: int | None = None) -> Tally:
    """Run every case of :func:`mutations` on ``store``; the store is intact afterwards."""
    tally = Tally()
    for i, m in enumerate(mutations(store, flips, seed, thorough)):
        if limit is not None and i >= limit:
            break
        tally.add(m, *run_case(store, m))
    return tally


def describe(store: Store) -> dict[str, Any]:
    return {"backend": store.backend, "files": len(store.files), "rows": len(store.rows)}


__all__ = ["CAP", "OUTCOMES", "Store", "Mutation", "Tally", "build_store", "mutations", "run_case", "sweep",
           "file_kind", "describe", "np"]
