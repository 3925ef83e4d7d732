"""A committed store's figures read from its manifest and blob index alone (numpy; no torch).

``tiered info`` shows rows, per-field bytes and ratios, and the cold tier's bytes. Opening the
store builds every part of it and imports torch and tensordict, seconds before the first line;
these figures need only the manifest, the ``index.*`` arrays (each page checked against the
manifest's CRC-32 as it is read) and the cold tier's recorded state. :func:`field_figures` is the
one computation of the per-field figures: :meth:`tiered.TieredStore.stats` gives it the live
parts' facts, :func:`read_summary` the manifest's.

:func:`read_summary` answers ``None`` where its figures could differ from what an opened store
reports (row priorities, open time chunks): the caller then opens the store.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> d = tempfile.mkdtemp() + "/s"
    >>> with TieredStore(10, d) as s:
    ...     _ = s.extend(TensorDict({"x": torch.zeros(4, 32, 32)}, [4]))
    >>> from tiered.engine.manifest import read_manifest
    >>> summary = read_summary(d, read_manifest(d))
    >>> summary["rows"], summary["fields"]["x"]["kind"], summary["tiers"]["cold"]["blobs"]
    (4, 'blob', 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TieredError
from ..index import COLD, OPEN, STORED, BlobIndex
from .commit_arrays import array_path, page_checksums_of
from .manifest import load_npy
from .pages import kind_of

__all__ = ["DTYPE_NBYTES", "FieldFacts", "field_facts", "field_figures", "read_summary"]

#: Bytes per element of every dtype a schema names (the names of ``tiered.schema``).
DTYPE_NBYTES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}

@dataclass(frozen=True)
class FieldFacts:
    """What the per-field figures need of one schema field, as plain values.

    Attributes:
        key: the field's key, ``"/"``-joined.
        kind: ``"dense"`` or ``"blob"``.
        cell_nbytes: bytes of one row's cell as read.
        column_nbytes: bytes of one row of its dense column (narrower when ``stored_dtype`` is set).
        family: blob fields: the frame family they share (dtype and frame shape); dense: ``""``.
        stored_dtype: the narrower dtype a dense column is kept in, or ``None``.
        flag_bit: the bit of the shared flags byte holding the field, or ``None``.
        row_number: whether the field's values are its rows, stored as nothing.
    """

    key: str
    kind: str
    cell_nbytes: int
    column_nbytes: int
    family: str
    stored_dtype: str | None = None
    flag_bit: int | None = None
    row_number: bool = False


def field_facts(entry: dict[str, Any]) -> FieldFacts:
    """The facts of a manifest schema entry (``Field.to_json()``).

    Raises:
        KeyError, TypeError, ValueError: the entry is not one tiered writes.

    Example:
        >>> field_facts({"key": ["obs"], "dtype": "uint8", "shape": [4, 84, 84], "kind": "blob", "frame_dim": 0})
        FieldFacts(key='obs', kind='blob', cell_nbytes=28224, column_nbytes=28224, family='uint8[84,84]', stored_dtype=None, flag_bit=None, row_number=False)
    """
    shape = [int(s) for s in entry["shape"]]
    frame_dim, stored = entry.get("frame_dim"), entry.get("stored_dtype")
    cells = math.prod(shape)
    frame_shape = shape if frame_dim is None else shape[:frame_dim] + shape[frame_dim + 1:]
    return FieldFacts(
        key="/".join(entry["key"]), kind=entry["kind"], cell_nbytes=cells * DTYPE_NBYTES[entry["dtype"]],
        column_nbytes=0 if entry.get("row_number") else cells * DTYPE_NBYTES[stored if stored is not None else entry["dtype"]],
        family=f"{entry['dtype']}[{','.join(map(str, frame_shape))}]" if entry["kind"] == "blob" else "",
        stored_dtype=stored, flag_bit=entry.get("flag_bit"), row_number=entry.get("row_number") is True)


def field_figures(fields: Sequence[FieldFacts], frame_nbytes: Sequence[int], length: int, capacity: int,
                  index: BlobIndex) -> dict[str, dict[str, Any]]:
    """Per field, in schema order: logical and stored bytes and ratio; blob fields add dedup and
    compression factors (``TieredStore.stats()["fields"]``).

    Args:
        fields: the schema's fields; blob fields of one ``family`` share frames, families
            numbered in order of first appearance (``Schema.families``).
        frame_nbytes: bytes of one frame of each family.
        length, capacity: written rows and capacity.
        index: the blob index.
    """
    live = index.live_ids()
    flags = sum(f.flag_bit is not None for f in fields)
    families: dict[str, list[FieldFacts]] = {}
    out: dict[str, dict[str, Any]] = {}
    for f in fields:
        if f.kind == "blob":
            families.setdefault(f.family, []).append(f)
            continue
        # a flag field's share of the flags byte it shares with the other flag fields
        row_bytes = f.column_nbytes if f.flag_bit is None else 1 / flags
        out[f.key] = {"kind": "dense", "logical_bytes": f.cell_nbytes * length,
                      "stored_bytes": round(row_bytes * capacity),
                      "ratio": f.cell_nbytes / row_bytes if row_bytes else float("inf")}
        if f.stored_dtype is not None:
            out[f.key]["stored_dtype"] = f.stored_dtype
        if f.flag_bit is not None:
            out[f.key]["flag_bit"] = f.flag_bit
        if f.row_number:
            out[f.key]["row_number"] = True
    for fid, members in enumerate(families.values()):
        sel = live[index.family[live] == fid]
        is_open = index.state[sel] == OPEN
        stored = int(index.nbytes[sel[index.state[sel] == STORED]].sum()) + int(index.raw_nbytes[sel[is_open]].sum())
        unique_bytes = int(index.raw_nbytes[sel].sum())
        fam_logical = sum(f.cell_nbytes * length for f in members)
        for f in members:
            logical = f.cell_nbytes * length
            share = stored * (logical / fam_logical if fam_logical else 0.0)
            out[f.key] = {
                "kind": "blob",
                "family": f.family,
                "logical_bytes": logical,
                "stored_bytes": int(share),
                "ratio": logical / share if share else float("inf") if logical else 1.0,
                "unique_frames": unique_bytes // frame_nbytes[fid],
                "dedup_factor": fam_logical / unique_bytes if unique_bytes else 1.0,
                "compression_factor": unique_bytes / stored if stored else 1.0,
            }
    return {f.key: out[f.key] for f in fields}


def read_summary(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """``rows``, ``capacity``, ``blobs``, ``resident_bytes`` (None: known only once opened),
    ``bytes_per_row``, ``schema`` (the manifest's entries, keys ``"/"``-joined),
    ``fields`` and ``tiers`` of the store at ``path`` whose manifest says ``body``
    (:func:`~tiered.engine.manifest.read_manifest`), as :meth:`tiered.TieredStore.stats` reports
    them on the store opened read-only without memory tiers; ``None`` where that takes opening
    the store (see the module docstring), damage included.
    """
    try:
        return _summary(path, body)
    except (TieredError, KeyError, TypeError, ValueError, IndexError):
        return None  # damage or a layout this reader does not know: opening the store says what


def _summary(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    files, cold = body["files"], body["cold"]
    if body["policy"] == "priority" or any(k.startswith("priority.") for k in files):
        return None
    sums = page_checksums_of(body)

    def load(name: str) -> np.ndarray:
        return load_npy(array_path(path, body, name), files[name], pages=sums.get(name))

    index = BlobIndex.from_arrays({k.split(".", 1)[1]: load(k) for k in files if k.startswith("index.")})
    live = index.live_ids()
    if not bool((index.state[live] == STORED).all()):
        return None  # open time chunks: their share of the sampling mass takes the row tables
    entries = body.get("schema") or []
    facts = [field_facts(e) for e in entries]
    cold_blobs = int((index.loc[: index.size, COLD] >= 0).sum())
    mass = 0.0
    if any(f.kind == "blob" for f in facts) and bool(load("written").any()):
        if not cold_blobs:
            return None
        mass = 1.0  # every stored blob is in the cold tier: it serves all the sampling mass
    free = np.asarray(load("cold.free_sizes"), dtype=np.int64)
    free_total = int(free.sum())
    schema = []
    for e in entries:
        doc = {"key": "/".join(e["key"]), "dtype": e["dtype"], "shape": [int(s) for s in e["shape"]],
               "kind": e["kind"], "frame_dim": e.get("frame_dim")}
        doc.update({k: e[k] for k in ("stored_dtype", "flag_bit", "row_number") if e.get(k) is not None})
        schema.append(doc)
    length, capacity = int(body["len"]), int(body["capacity"])
    frame_nbytes = [int(f["frame_nbytes"]) for f in body.get("families") or []]
    # as TieredStore.stats() counts it, from the files: each stored blob once, the per-row arrays'
    # share of the written rows and the blob index (what a process holds is only known once open)
    blob_bytes = int(index.nbytes[live].sum())
    per_row = sum(int(size) for name, size in files.items() if kind_of(name) == "rows")
    table_bytes = per_row * length / capacity if capacity else 0.0
    return {
        "rows": length,
        "capacity": capacity,
        "blobs": int(live.size),
        "resident_bytes": None,
        "bytes_per_row": (blob_bytes + table_bytes + index.nbytes_held) / length if length else 0.0,
        "schema": schema,
        "fields": field_figures(facts, frame_nbytes, length, capacity, index) if entries else {},
        "tiers": {"cold": {
            "bytes_used": int(cold["bytes_used"]),
            "budget": None if cold.get("budget") is None else int(cold["budget"]),
            "blobs": cold_blobs,
            "fragmentation": 0.0 if free_total == 0 else 1.0 - int(free.max()) / free_total,
            "hits": 0, "promotions": 0, "demotions": 0,
            "probability_mass": mass,
        }},
    }
