"""Per-field figures of a store: logical and stored bytes, ratios, dedup and compression factors.

:func:`field_figures` is the one computation of them: :meth:`tiered.TieredStore.stats` gives it the
live parts' facts (:mod:`tiered.engine.stats`), ``tiered info`` the facts of a committed store's
manifest (:func:`field_facts`, :mod:`tiered.durable.summary`). numpy only: ``tiered info`` runs
without torch.

Example:
    >>> field_facts({"key": ["done"], "dtype": "bool", "shape": [], "kind": "dense", "frame_dim": None}).cell_nbytes
    1
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .blob_index import OPEN, STORED, BlobIndex

__all__ = ["DTYPE_NBYTES", "FieldFacts", "field_facts", "field_figures", "stored_blob_bytes", "bytes_per_row"]

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


def stored_blob_bytes(index: BlobIndex) -> int:
    """Encoded bytes of the live stored blobs, each counted once whichever tiers hold it (a store
    with a path caches cold blobs in memory).

    Example:
        >>> stored_blob_bytes(BlobIndex())
        0
    """
    live = index.live_ids()
    return int(index.nbytes[live[index.state[live] == STORED]].sum())


def bytes_per_row(index: BlobIndex, other_bytes: float, length: int) -> float:
    """What one row costs at ``length`` rows: the stored blobs (:func:`stored_blob_bytes`) plus
    ``other_bytes`` (dense columns and metadata), over the rows; 0.0 for an empty store.

    Example:
        >>> bytes_per_row(BlobIndex(), 400, 4), bytes_per_row(BlobIndex(), 400, 0)
        (100.0, 0.0)
    """
    return (stored_blob_bytes(index) + other_bytes) / length if length else 0.0
