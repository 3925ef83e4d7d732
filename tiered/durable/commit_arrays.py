"""Where a commit's arrays are and what its saved row tables expand to: manifest arithmetic.

The store's open path (:mod:`tiered.durable.store_files`) and the verifier (:mod:`tiered.verify`)
both need these; they live apart from the open path so that ``tiered verify`` and ``tiered info``
load numpy and the manifest reader, not torch.

Example:
    >>> array_path("/s", {"generation": 40, "array_files": {"written": 12}}, "written")
    '/s/arrays/written.12.npy'
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..engine.row_tables import NextRowTable, RowTable, ShiftedRowTable
from ..errors import CorruptionError
from .array_files import array_file
from .manifest import MANIFEST, PAGE_BYTES

__all__ = ["CHECKSUMS", "EXCEPTION_SUFFIXES", "array_path", "derived_tables", "expand_derived", "page_checksums_of",
           "shifted_tables", "table_file"]

#: Manifest entry holding the page checksums of the commit's arrays.
CHECKSUMS = "checksums"

#: The exception list a next or shifted row table saves besides its per-row arrays (if any).
EXCEPTION_SUFFIXES = ("exc_rows", "exc_blob", "exc_slot")


def table_file(i: int, suffix: str, shifted: bool = False) -> str:
    """The array name of part ``suffix`` of blob field ``i``'s row table: ``rows.<i>.blob`` and
    ``rows.<i>.slot`` (indexed by row), ``next.<i>.rows|blob|slot`` (a next table's
    exceptions), ``shift.<i>.rows|blob|slot`` (a shifted table's).

    Example:
        >>> table_file(3, "slot"), table_file(3, "exc_rows"), table_file(0, "exc_blob", shifted=True)
        ('rows.3.slot', 'next.3.rows', 'shift.0.blob')
    """
    if suffix.startswith("exc_"):
        return f"{'shift' if shifted else 'next'}.{i}.{suffix[4:]}"
    return f"rows.{i}.{suffix}"



def shifted_tables(body: dict[str, Any], kinds: list[str]) -> set[int]:
    """The field indexes of the row tables the commit ``body`` saved shifted; ``kinds``: the kind
    of each schema field.

    Raises:
        CorruptionError: the entry is not a list of the schema's blob fields.
    """
    entry = body.get("shifted_tables", [])
    try:
        out = {int(i) for i in entry}
    except (TypeError, ValueError):
        raise CorruptionError(f"the manifest's shifted_tables is {entry!r}, expected a list of field indexes") from None
    derived = body.get("derived_tables", {})
    if not isinstance(derived, dict) or not all(0 <= i < len(kinds) and kinds[i] == "blob" and str(i) not in derived
                                                for i in out):
        raise CorruptionError(f"the manifest's shifted_tables {entry!r} names fields that are not blob fields")
    return out


def derived_tables(body: dict[str, Any], kinds: list[str]) -> dict[int, int]:
    """``{field index: base field index}`` of the ``("next", X)`` row tables the commit ``body``
    saved as next tables, derived from ``X``'s; ``kinds``: the kind of each schema field.

    Raises:
        CorruptionError: the entry is not such a map over the schema's blob fields.
    """
    entry = body.get("derived_tables", {})
    try:
        out = {int(i): int(j) for i, j in entry.items()}
    except (AttributeError, TypeError, ValueError):
        raise CorruptionError(f"the manifest's derived_tables is {entry!r}, expected a map of field indexes") from None
    n = len(kinds)
    if not all(0 <= i < n and 0 <= j < n and i != j and j not in out and kinds[i] == kinds[j] == "blob"
               for i, j in out.items()):
        raise CorruptionError(f"the manifest's derived_tables {entry!r} names fields that are not blob fields")
    return out


def expand_derived(body: dict[str, Any], kinds: list[str], arrays: dict[str, np.ndarray]) -> list[str]:
    """Replace, in ``arrays`` (a commit's arrays by name), each shifted or next row table's saved
    parts by its whole ``rows.<i>.blob`` / ``rows.<i>.slot`` (for checks that read the files
    directly).

    Returns:
        The problems found, in words (a table whose arrays do not fit).
    """
    try:
        derived = derived_tables(body, kinds)
        shifted = shifted_tables(body, kinds)
    except CorruptionError as e:
        return [str(e)]
    problems = []
    for i in sorted(shifted):  # first: a next table's base may be shifted
        try:
            parts = {s: np.asarray(arrays[table_file(i, s, True)]) for s in ("blob", "slot", *EXCEPTION_SUFFIXES)}
            width = parts["exc_blob"].shape[1] + 1 if parts["exc_blob"].ndim == 2 else -1
            table = ShiftedRowTable.from_state(parts["blob"].shape[0], width, parts)
            arrays[f"rows.{i}.blob"], arrays[f"rows.{i}.slot"] = table.full()
        except (KeyError, ValueError, IndexError) as e:
            problems.append(f"the shifted row table of field {i}: {e}")
    for i, j in derived.items():
        try:
            base = RowTable.from_arrays(np.asarray(arrays[f"rows.{j}.blob"]), np.asarray(arrays[f"rows.{j}.slot"]))
            table = NextRowTable.from_state(base, {s: np.asarray(arrays[table_file(i, s)]) for s in EXCEPTION_SUFFIXES})
            arrays[f"rows.{i}.blob"], arrays[f"rows.{i}.slot"] = table.full()
        except (KeyError, ValueError, IndexError) as e:
            problems.append(f"the next row table of field {i}: {e}")
    return problems



def page_checksums_of(body: dict[str, Any]) -> dict[str, list[int]]:
    """The commit's page checksums per array name.

    Raises:
        CorruptionError: the entry is missing or is not what tiered writes.
    """
    entry = body.get(CHECKSUMS)
    if entry is None:
        raise CorruptionError(f"the manifest has no {CHECKSUMS!r} entry (every commit writes one); the store is "
                              "damaged")
    ok = (isinstance(entry, dict) and entry.get("algorithm") == "crc32" and entry.get("page_bytes") == PAGE_BYTES
          and isinstance(entry.get("files"), dict)
          and all(isinstance(v, list) and all(isinstance(x, int) for x in v) for v in entry["files"].values()))
    if not ok:
        raise CorruptionError(f"the manifest's {CHECKSUMS!r} entry is not the crc32 page list tiered writes; "
                              "the store is damaged")
    files = body.get("files")
    if isinstance(files, dict) and set(files) != set(entry["files"]):
        raise CorruptionError(f"the manifest's {CHECKSUMS!r} entry lists other arrays than its 'files' "
                              f"({sorted(set(files) ^ set(entry['files']))[:5]}); the store is damaged")
    return entry["files"]



def array_path(store: str, body: dict[str, Any], name: str) -> str:
    """The file holding array ``name`` of the commit ``body`` of the store ``store``: the file
    ``arrays/<name>.<f>.npy`` its ``array_files`` names (``f``: the commit that made the file).

    Raises:
        CorruptionError: the manifest names no valid file for the array.
    """
    files = body.get("array_files")
    f = files.get(name) if isinstance(files, dict) else None
    if not isinstance(f, int) or isinstance(f, bool) or not 0 <= f <= body.get("generation", -1):
        raise CorruptionError(f"{os.path.join(store, MANIFEST)}: the manifest names no file of array {name!r} "
                              f"(got {f!r}, expected the commit that made it); the store is damaged")
    return array_file(store, name, f)
