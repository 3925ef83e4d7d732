"""A committed store's figures read from its manifest and blob index alone (numpy; no torch).

``tiered info`` shows rows, per-field bytes and ratios, and the cold tier's bytes. Opening the
store builds every part of it and imports torch and tensordict, seconds before the first line;
these figures need only the manifest, the ``index.*`` arrays (each page checked against the
manifest's CRC-32 as it is read) and the cold tier's recorded state. The per-field figures are
:func:`tiered.engine.figures.field_figures`' (as :meth:`tiered.TieredStore.stats` computes them
from the live parts), given the manifest's facts.

:func:`read_summary` answers ``None`` where its figures could differ from what an opened store
reports (row priorities, open time chunks): the caller then opens the store.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> d = tempfile.mkdtemp() + "/s"
    >>> with TieredStore(10, d) as s:
    ...     _ = s.extend(TensorDict({"x": torch.zeros(4, 32, 32)}, [4]))
    >>> from tiered.durable.manifest import read_manifest
    >>> summary = read_summary(d, read_manifest(d))
    >>> summary["rows"], summary["fields"]["x"]["kind"], summary["tiers"]["cold"]["blobs"]
    (4, 'blob', 1)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine.blob_index import COLD, STORED, BlobIndex
from ..engine.figures import bytes_per_row, field_facts, field_figures
from ..errors import TieredError
from ..util.units import fragmentation
from .array_files import kind_of
from .commit_arrays import array_path, page_checksums_of
from .manifest import load_npy

__all__ = ["read_summary"]

def read_summary(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """``rows``, ``capacity``, ``blobs``, ``resident_bytes`` (None: known only once opened),
    ``bytes_per_row``, ``schema`` (the manifest's entries, keys ``"/"``-joined),
    ``fields`` and ``tiers`` of the store at ``path`` whose manifest says ``body``
    (:func:`~tiered.durable.manifest.read_manifest`), as :meth:`tiered.TieredStore.stats` reports
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
    per_row = sum(int(size) for name, size in files.items() if kind_of(name) == "rows")
    table_bytes = per_row * length / capacity if capacity else 0.0
    return {
        "rows": length,
        "capacity": capacity,
        "blobs": int(live.size),
        "resident_bytes": None,
        "bytes_per_row": bytes_per_row(index, table_bytes + index.nbytes_held, length),
        "schema": schema,
        "fields": field_figures(facts, frame_nbytes, length, capacity, index) if entries else {},
        "tiers": {"cold": {
            "bytes_used": int(cold["bytes_used"]),
            "budget": None if cold.get("budget") is None else int(cold["budget"]),
            "blobs": cold_blobs,
            "fragmentation": fragmentation(load("cold.free_sizes")),
            "hits": 0, "promotions": 0, "demotions": 0,
            "probability_mass": mass,
        }},
    }
