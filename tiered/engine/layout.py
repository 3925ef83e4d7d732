"""Where the blob fields' frames live: frame families, their fields and the row -> blob tables.

A :class:`FieldLayout` is built from the schema once, by the first write (or on open). It holds,
per frame family (blob fields whose frames have one dtype and shape), the family's dedup and
chunking state (:class:`~tiered.engine.frames.FrameFamily`), its fields in layout order, the
neighbour rules that predict shared frames, and one :class:`~tiered.engine.row_tables.RowTable` per blob
field. The write path fills the tables; the read pipelines gather from them.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered.schema import Schema
    >>> from tiered.engine.layout import FieldLayout
    >>> td = TensorDict({"observation": torch.zeros(2, 4, 8, 8, dtype=torch.uint8),
    ...                  ("next", "observation"): torch.zeros(2, 4, 8, 8, dtype=torch.uint8)}, [2])
    >>> layout = FieldLayout(Schema.infer(td, blob_min_bytes=1, frames={"observation": 0}), 10,
    ...                      chunk_frames=4, dedup=True)
    >>> len(layout.families), [f.key for f in layout.fields_of[0]]
    (1, [('observation',), ('next', 'observation')])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..schema import Field, Key, Schema, key_to_str
from .frames import FrameFamily, layout_rules
from .row_tables import NextRowTable, RowTable, ShiftedRowTable

__all__ = ["FieldLayout"]


class FieldLayout:
    """Frame families, their fields and row tables for a schema (see the module docstring).

    Args:
        schema: the store's schema.
        capacity: rows in the ring (length of each row table).
        chunk_frames: frames of one trajectory compressed together per blob: one value for every
            family, or one per family (in family-id order).
        dedup: share equal frames between rows.
        stored_raw: per family, whether its blobs are stored raw (None: decided by its first
            encode); default: none is.
        tables: make empty row tables (False: the caller sets ``tables``, e.g. memory-mapped
            from a store).
    """

    def __init__(self, schema: Schema, capacity: int, *, chunk_frames: int | Sequence[int], dedup: bool,
                 tables: bool = True, stored_raw: Sequence[bool | None] | None = None) -> None:
        self.schema = schema
        #: blob fields per family, in family-id order (first appearance in the schema)
        self.fields_of: list[list[Field]] = list(schema.families().values())
        self.families: list[FrameFamily] = []
        self.family_of: dict[Key, int] = {}
        self.tables: dict[Key, RowTable] = {}
        n = len(self.fields_of)
        chunks = [int(chunk_frames)] * n if isinstance(chunk_frames, (int, np.integer)) else list(chunk_frames)
        raw = [False] * n if stored_raw is None else list(stored_raw)
        if len(chunks) != n or len(raw) != n:
            raise ValueError(f"the schema has {n} frame families, but {len(chunks)} chunk lengths and "
                             f"{len(raw)} codec choices were given")
        for fid, fields in enumerate(self.fields_of):
            self.families.append(FrameFamily(fid, fields[0].frame_nbytes, chunks[fid], dedup=dedup,
                                             stored_raw=raw[fid]))
            for f in fields:
                self.family_of[f.key] = fid
        self.rules = [layout_rules([(f.key, f.frames_per_row, f.frame_dim is not None) for f in fields])
                      for fields in self.fields_of]
        #: ("next", X) field -> X, for the tables kept derived from X's (dedup shares their frames)
        self.derived_from: dict[Key, Key] = {f.key: b for f in schema.blob_fields
                                             if dedup and (b := self.derivable(f)) is not None}
        #: the other stacked fields, whose tables keep only each row's newest frame (dedup gives
        #: consecutive rows the same frames)
        self.shifted: set[Key] = {f.key for f in schema.blob_fields if dedup and f.frame_dim is not None
                                  and f.frames_per_row >= 2 and f.key not in self.derived_from}
        if tables:  # each field's table of its kind at once (no full table made only to be replaced)
            for f in (f for fields in self.fields_of for f in fields):
                if f.key in self.shifted:
                    self.tables[f.key] = ShiftedRowTable(capacity, f.frames_per_row)
                elif f.key not in self.derived_from:
                    self.tables[f.key] = RowTable(capacity, f.frames_per_row)
            derived = {key: NextRowTable(self.tables[base]) for key, base in self.derived_from.items()}
            self.tables = {f.key: derived.get(f.key) or self.tables[f.key]
                           for fields in self.fields_of for f in fields}

    def derivable(self, f: Field) -> Key | None:
        """The field whose table ``f``'s may be derived from: ``X`` for a stacked ``("next", X)``
        of ``X``'s family and stack length (2 frames or more), else None."""
        if len(f.key) < 2 or f.key[0] != "next" or f.frame_dim is None or f.frames_per_row < 2:
            return None
        base = f.key[1:]
        if base[0] == "next" or base not in self.schema:  # no chains of derived tables
            return None
        b = self.schema[base]
        ok = (b.kind == "blob" and b.frame_dim is not None and b.frames_per_row == f.frames_per_row
              and self.family_of.get(base) == self.family_of.get(f.key))
        return base if ok else None

    def explicit(self, key: Key) -> None:
        """Keep ``key``'s table explicit from now on (its derived or shifted form has too many
        exceptions); a table derived from it reads the new one."""
        table = self.tables[key]
        if table.derived or table.shifted:
            for guard in ((table.base.guard, table.guard) if table.derived else (table.guard,)):
                if guard is not None:  # every row is read: every page checked first
                    guard.all()
            self._swap(key, RowTable.from_arrays(*table.full()))

    def _swap(self, key: Key, new: RowTable) -> None:
        """Put ``new`` (same entries) in place of ``key``'s table; a table derived from it reads ``new``."""
        old, self.tables[key] = self.tables[key], new
        for other in self.tables.values():
            if other.derived and other.base is old:
                other.base = new

    def by_family(self, fields: list[Field]) -> dict[int, list[Field]]:
        """The blob fields among ``fields``, grouped by family id (schema order kept)."""
        groups: dict[int, list[Field]] = {}
        for f in fields:
            if f.kind == "blob":
                groups.setdefault(self.family_of[f.key], []).append(f)
        return groups

    def check_rows(self, rows: np.ndarray | None, fields: list[Field] | None = None) -> None:
        """Check the row table pages holding ``rows`` (None: every row) of ``fields`` (None: every
        blob field) before their first use, for tables memory-mapped from a store.

        Raises:
            ChecksumError, CorruptionError: a damaged page, or rows naming impossible blobs.
        """
        tables = self.tables.values() if fields is None else [self.tables[f.key] for f in fields]
        for t in tables:
            # a derived table's reads gather its base's rows too (a next table's, the rows around
            # each row): those pages first; a shifted table's, the rows before (and a write's,
            # after) each row
            for table in (t.base, t) if t.derived else (t,):
                if table.guard is not None:
                    at = rows if table is t or rows is None else t.reach(rows)
                    table.guard.all() if at is None else table.guard.rows(table.reach(at))

    def put_family(self, fid: int, rows: np.ndarray, blob: np.ndarray, slot: np.ndarray,
                   written: np.ndarray) -> list[np.ndarray]:
        """Set the entries of ``rows`` (distinct) for every field of family ``fid`` from the
        ``[len(rows), per_row]`` columns ``blob``/``slot`` (fields in layout order); returns the
        blob ids the ``written`` rows named before, per field (for reference counts)."""
        fields = self.fields_of[fid]
        old = [self.tables[f.key].ids(rows[written]) for f in fields]  # before any table changes
        self._hold(rows, [self.tables[f.key] for f in fields])
        edges = np.cumsum([0] + [f.frames_per_row for f in fields])
        # explicit and shifted tables first: a derived one compares with its base's new entries
        for f, a, b in sorted(zip(fields, edges[:-1], edges[1:], strict=True),
                              key=lambda x: self.tables[x[0].key].derived):
            table = self.tables[f.key]
            table.put(rows, blob[:, a:b], slot[:, a:b])
            if (table.derived or table.shifted) and table.crowded:
                self.explicit(f.key)
        return old

    def unset(self, rows: np.ndarray) -> list[np.ndarray]:
        """Mark ``rows`` unwritten in every table; returns the blob ids they named, per field."""
        self.check_rows(rows)
        old = [t.ids(rows) for t in self.tables.values()]
        self._hold(rows, list(self.tables.values()))
        for t in sorted(self.tables.values(), key=lambda t: t.derived):  # bases first
            t.unset(rows)
        return old

    @staticmethod
    def _hold(rows: np.ndarray, tables: list[RowTable]) -> None:
        """Before any base table's ``rows`` change: the next tables' rows just before them keep
        their entries (:meth:`~tiered.engine.row_tables.NextRowTable.hold`), so only written rows change
        what they reference (reference counts stay exact)."""
        for t in tables:
            if isinstance(t, NextRowTable):
                t.hold(rows)

    def blob_refs(self, fields: list[Field], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[len(rows), frames]`` blob ids and slots of ``rows`` over ``fields`` (one gather each),
        widened to int64 (callers do index arithmetic with them)."""
        self.check_rows(rows, fields)
        if len(fields) == 2:  # X and ("next", X) of a shifted table: one gather for both
            first, second = self.tables[fields[0].key], self.tables[fields[1].key]
            if isinstance(second, NextRowTable) and second.base is first and isinstance(first, ShiftedRowTable):
                return second.refs_after_base(rows)
        refs = [self.tables[f.key].refs(rows) for f in fields]
        blobs = np.concatenate([r[0] for r in refs], axis=1, dtype=np.int64)
        slots = np.concatenate([r[1] for r in refs], axis=1, dtype=np.int64)
        return blobs, slots

    def ids(self, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), all frames]``: the blob ids of ``rows`` over every table (int64)."""
        return np.concatenate([t.ids(rows) for t in self.tables.values()], axis=1, dtype=np.int64)

    def rows_using(self, blob_ids: np.ndarray, limit: int = 5) -> list[str]:
        """Per blob id, the fields and first rows that reference it (for error messages)."""

        out = []
        self.check_rows(None)
        full = {key: table.full()[0] for key, table in self.tables.items()}
        for b in blob_ids[:limit]:
            refs = []
            for key, blob in full.items():
                r = np.flatnonzero((blob == b).any(1))
                if r.size:
                    refs.append(f"{key_to_str(key)!r} rows {r[:5].tolist()}")
            out.append("; ".join(refs) or "no row")
        return out

