"""D4RL: one flat HDF5 file of row-aligned columns.

Layout read and written (the layout of D4RL's ``get_dataset()`` files and of most offline RL
HDF5 dumps)::

    observations        [N, *obs]     float32 (any dtype)
    actions             [N, *act]
    rewards             [N]
    terminals           [N]           bool (or 0/1 floats)
    timeouts            [N]           bool (optional)
    next_observations   [N, *obs]     (optional)
    infos/<name>        [N, ...]      (optional, any depth)
    metadata/<name>     any shape     (optional; not per row: kept in the import sidecar)

Episodes end at rows where ``terminals | timeouts``. The key mapping is
:mod:`tiered.formats.keymap`'s. Columns are read and written in slices of rows, so files much
larger than RAM import and export with bounded memory.

Example:
    >>> import h5py, numpy as np, tempfile, os
    >>> from tiered.formats.d4rl import D4RLSource
    >>> p = os.path.join(tempfile.mkdtemp(), "d.hdf5")
    >>> with h5py.File(p, "w") as f:
    ...     f["observations"] = np.arange(8, dtype=np.float32).reshape(4, 2)
    ...     f["actions"] = np.zeros((4, 1), np.float32)
    ...     f["rewards"] = np.ones(4, np.float32)
    ...     f["terminals"] = np.array([0, 1, 0, 0], bool)
    ...     f["timeouts"] = np.array([0, 0, 0, 1], bool)
    >>> src = D4RLSource(p)
    >>> td = next(src.chunks(16))
    >>> td["collector", "traj_ids"].tolist(), td["next", "observation"][:, 0].tolist()
    ([0, 0, 1, 1], [2.0, 2.0, 6.0, 6.0])
    >>> src.close()
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import h5py
import numpy as np
import torch
from tensordict import TensorDict

from ..errors import InvalidDatasetError, UnsupportedFormatError
from ..schema import str_to_key
from ..util import fileio
from .common import (
    chunk_rows_for,
    hdf5_datasets,
    iter_store,
    json_safe,
    np_to_torch,
    numpy_dtype,
    open_hdf5,
    row_nbytes,
    to_numpy,
    writing,
)
from .keymap import (
    DONE,
    FLAGS,
    NEXT_OBS,
    TERMINATED,
    TRAJ,
    TRUNCATED,
    Key,
    d4rl_to_key,
    flat_cell,
    key_str,
    key_to_d4rl,
    step_column,
    stored_cell,
    to_flag,
)

__all__ = ["D4RLSource", "FlatSource", "write_d4rl", "plan_flat_columns", "EXTRAS_MAX_BYTES", "ROW_DATASETS",
           "check_row_columns"]

#: Non-row datasets (D4RL's ``metadata/*``) up to this total size are kept in the import
#: sidecar and written back on export; larger ones are skipped (and reported).
EXTRAS_MAX_BYTES = 16 << 20


class Column(Protocol):
    shape: tuple[int, ...]
    dtype: np.dtype

    def __getitem__(self, index: slice) -> np.ndarray: ...


class FlatSource:
    """Rows of a flat table of columns in D4RL naming (``"d4rl"``) or TED paths (``"ted"``).

    Args:
        columns: column name -> sliceable array with ``N`` rows (h5py datasets, memmaps, ...).
        naming: ``"d4rl"`` (observations, actions, ... mapped by :mod:`.keymap`; next
            observations, done and episode ids derived when absent) or ``"ted"`` (names are
            ``/``-joined store keys, imported as they are).
        fmt: format name recorded in the sidecar.
        extras: non-row data to keep in the sidecar.
        file_attrs: file-level attributes to keep in the sidecar.
    """

    def __init__(
        self,
        columns: Mapping[str, Column],
        *,
        naming: str = "d4rl",
        fmt: str = "d4rl",
        origin: str = "",
        extras: dict[str, Any] | None = None,
        file_attrs: dict[str, Any] | None = None,
    ) -> None:
        if naming not in ("d4rl", "ted"):
            raise ValueError(f"naming must be 'd4rl' or 'ted', got {naming!r}")
        self.naming = naming
        self.fmt = fmt
        self.origin = origin
        self.columns = dict(columns)
        if not self.columns:
            raise UnsupportedFormatError(f"{origin}: no columns found")
        if naming == "d4rl":
            missing = [c for c in ("observations", "actions", "rewards") if c not in self.columns]
            if missing:
                raise UnsupportedFormatError(
                    f"{origin}: not a D4RL-style dataset: missing {missing}; found columns "
                    f"{sorted(self.columns)[:20]}. D4RL files need observations, actions, rewards and "
                    "terminals and/or timeouts"
                )
            if "terminals" not in self.columns and "timeouts" not in self.columns:
                raise UnsupportedFormatError(
                    f"{origin}: neither 'terminals' nor 'timeouts' is present, so episodes cannot be told "
                    "apart; add one of them"
                )
            self.num_rows = int(self.columns["observations"].shape[0])
        else:
            self.num_rows = int(next(iter(self.columns.values())).shape[0])
        bad = {n: c.shape for n, c in self.columns.items() if not c.shape or c.shape[0] != self.num_rows}
        if bad:
            raise InvalidDatasetError(
                f"{origin}: columns must all have {self.num_rows} rows (those of the first); these differ: "
                f"{ {n: shape[0] if shape else 'a scalar' for n, shape in bad.items()} }; nothing was imported"
            )
        self.keys: dict[str, Key] = {
            n: (d4rl_to_key(n) if naming == "d4rl" else str_to_key(n.strip("/"))) for n in self.columns
        }
        dup = len(set(self.keys.values())) != len(self.keys)
        if dup:
            raise UnsupportedFormatError(f"{origin}: two columns map to the same key: {self.keys}")
        present = set(self.keys.values())
        self.derived: list[Key] = []
        if naming == "d4rl":
            for k in (TERMINATED, TRUNCATED, NEXT_OBS, DONE, TRAJ):
                if k not in present:
                    self.derived.append(k)
        self.extras = extras or {}
        self.file_attrs = file_attrs or {}

    # -------------------------------------------------------------------------- metadata
    def _cell(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        c = self.columns[name]
        shape = tuple(c.shape[1:])
        key = self.keys[name]
        if self.naming == "d4rl":
            shape = stored_cell(key, shape)
        dtype = np.dtype(bool) if self.naming == "d4rl" and key in FLAGS else c.dtype
        return shape, dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one imported row (derived fields included)."""
        shapes = {n: self._cell(n) for n in self.columns}
        extra = 0
        if NEXT_OBS in self.derived:
            extra += row_nbytes({"o": self._cell("observations")})
        return row_nbytes(shapes) + extra + 8 + 3

    def attrs(self) -> dict[str, Any]:
        """The import sidecar content: how to write the rows back exactly."""
        return {
            "format": self.fmt,
            "naming": self.naming,
            "origin": self.origin,
            "rows": self.num_rows,
            "columns": {
                n: {"key": list(self.keys[n]), "dtype": c.dtype.str, "shape": list(c.shape[1:])}
                for n, c in self.columns.items()
            },
            "derived": [list(k) for k in self.derived],
            "extras": json_safe(self.extras),
            "file_attrs": json_safe(self.file_attrs),
        }

    # -------------------------------------------------------------------------- rows
    def chunks(self, chunk_rows: int | None = None) -> Iterator[TensorDict]:
        """Yield the rows as TensorDicts in the store's (TED) layout, ``chunk_rows`` at a time."""
        n = self.num_rows
        step = chunk_rows_for(self.row_bytes, chunk_rows)
        traj_base = 0
        derive_next = NEXT_OBS in self.derived
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            m = hi - lo
            out: dict[Key, torch.Tensor] = {}
            for name, col in self.columns.items():
                key = self.keys[name]
                if derive_next and name == "observations":
                    a = np.asarray(col[lo : min(n, hi + 1)])
                    obs_ext = a
                    a = a[:m]
                else:
                    a = np.asarray(col[lo:hi])
                if self.naming == "d4rl":
                    if key in FLAGS:
                        a = to_flag(a, name)
                    a = step_column(key, a)
                out[key] = np_to_torch(a)
            if self.naming == "d4rl":
                zeros = torch.zeros(m, 1, dtype=torch.bool)
                term = out.get(TERMINATED, zeros)
                trunc = out.get(TRUNCATED, zeros)
                if TERMINATED in self.derived:
                    out[TERMINATED] = zeros.clone()
                if TRUNCATED in self.derived:
                    out[TRUNCATED] = zeros.clone()
                done = (term | trunc).reshape(m, -1).any(-1)
                if DONE in self.derived:
                    out[DONE] = done.reshape(m, 1).clone()
                if TRAJ in self.derived:
                    d = done.numpy().astype(np.int64)
                    out[TRAJ] = torch.from_numpy(traj_base + np.concatenate([[0], np.cumsum(d)[:-1]]))
                    traj_base += int(d.sum())
                if derive_next:
                    # next_obs[t] = obs[t + 1] inside an episode; at an episode's last step (and the
                    # file's last row) the last observation is repeated (documented in keymap)
                    nxt = np.empty_like(obs_ext[:m])
                    k = obs_ext.shape[0] - 1  # rows with a successor in this read
                    nxt[:k] = obs_ext[1 : k + 1]
                    last = done.numpy().copy()
                    if k < m:
                        last[k:] = True
                    nxt[last] = obs_ext[:m][last]
                    out[NEXT_OBS] = np_to_torch(nxt)
            yield TensorDict(out, batch_size=[m])

    def close(self) -> None:
        """Release the underlying file (subclasses)."""


def _read_extra(d: h5py.Dataset) -> dict[str, Any]:
    sd = h5py.check_string_dtype(d.dtype)
    if sd is not None:  # keep vlen vs fixed length and the encoding: both come back exactly
        raw = np.asarray(d[()], dtype=object)
        value = [
            v.decode(sd.encoding, "surrogateescape") if isinstance(v, bytes) else str(v)
            for v in raw.reshape(-1).tolist()
        ]
        return {
            "kind": "string",
            "encoding": sd.encoding,
            "length": sd.length,
            "shape": list(d.shape),
            "value": value,
        }
    arr = np.asarray(d[()])
    return {
        "kind": "array",
        "dtype": arr.dtype.str,
        "shape": list(arr.shape),
        "value": json_safe(arr.reshape(-1)),
    }


def _write_extra(h: h5py.File, name: str, spec: dict[str, Any]) -> None:
    shape = tuple(spec.get("shape", ()))
    if spec.get("kind") == "string":
        enc = spec.get("encoding", "utf-8")
        vals = [v.encode(enc, "surrogateescape") for v in spec["value"]]
        data = np.array(vals, dtype=object).reshape(shape) if shape else vals[0]
        h.create_dataset(name, data=data, dtype=h5py.string_dtype(enc, spec.get("length")))
    elif spec.get("kind") == "array":
        h.create_dataset(name, data=np.array(spec["value"], dtype=np.dtype(spec["dtype"])).reshape(shape))


#: Datasets of a D4RL file that hold one entry per row (``infos/*`` too): one of another length is
#: an error, never a non-row extra quietly left out of the rows.
ROW_DATASETS = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")


def check_row_columns(path: str, datasets: Mapping[str, Any], n: int) -> None:
    """Refuse a D4RL file whose per-row datasets disagree on the number of rows.

    Raises:
        InvalidDatasetError: naming each such dataset, the rows expected (those of
            ``observations``) and the rows it has.
    """
    bad = {name: (d.shape[0] if d.shape else "a scalar") for name, d in datasets.items()
           if (name in ROW_DATASETS or name.startswith("infos/")) and (not d.shape or d.shape[0] != n)}
    if bad:
        listed = "; ".join(f"{name!r} has {rows} rows" for name, rows in sorted(bad.items(), key=str))
        raise InvalidDatasetError(
            f"{path}: per-row datasets must have as many rows as 'observations' ({n}): {listed}. "
            "The file is inconsistent (truncated or mixed from two datasets); fix or re-create it. "
            "Nothing was imported")


class D4RLSource(FlatSource):
    """A D4RL HDF5 file as a source of rows (see the module docstring).

    Args:
        path: the ``.hdf5`` / ``.h5`` file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file (a D4RL dataset is one HDF5 file)")
        self._file = open_hdf5(path)
        try:
            datasets = {"/".join(name): d for name, d in hdf5_datasets(self._file)}
            if "observations" not in datasets:
                raise UnsupportedFormatError(
                    f"{path}: no 'observations' dataset, so this is not a D4RL-style file; datasets: "
                    f"{sorted(datasets)[:20]}"
                )
            n = datasets["observations"].shape[0] if datasets["observations"].shape else 0
            check_row_columns(path, datasets, n)
            columns, extras, skipped = {}, {}, []
            budget = EXTRAS_MAX_BYTES
            for name, d in datasets.items():
                if (
                    not name.startswith("metadata/")
                    and d.shape
                    and d.shape[0] == n
                    and d.dtype.kind in "biuf"
                ):
                    columns[name] = d
                elif d.nbytes <= budget and (d.dtype.kind in "biuf" or h5py.check_string_dtype(d.dtype)):
                    extras[name] = _read_extra(d)
                    budget -= d.nbytes
                else:
                    skipped.append(name)
            self.skipped = skipped
            super().__init__(
                columns,
                naming="d4rl",
                fmt="d4rl",
                origin=path,
                extras=extras,
                file_attrs=self._plain_attrs(),
            )
        except BaseException:
            self._file.close()
            raise

    def _plain_attrs(self) -> dict[str, Any]:
        """File attributes JSON carries exactly (numbers, strings); the others are reported as dropped."""
        out = {}
        for k, v in self._file.attrs.items():
            kind = np.asarray(v).dtype.kind
            if kind in "biufUSO" and not (kind == "O" and not isinstance(v, str)):
                out[k] = v
            else:
                self.skipped.append(f"attrs/{k}")
        return out

    def attrs(self) -> dict[str, Any]:
        # non-row datasets too large for the sidecar, or of a kind JSON cannot carry exactly
        # (opaque bytes, compound types), are named in the import report, never dropped unsaid
        return {**super().attrs(), "dropped": list(self.skipped)}

    def close(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def plan_flat_columns(
    schema_keys: dict[Key, tuple[tuple[int, ...], torch.dtype]],
    source: dict[str, Any] | None,
    naming: str = "d4rl",
) -> list[tuple[str, Key, np.dtype, tuple[int, ...]]]:
    """Columns of a flat export: ``(name, store key, output dtype, output cell shape)``.

    With the sidecar of a flat import (same naming), the source's names, dtypes and shapes come
    back and derived fields are dropped; otherwise the default mapping applies
    (``("next", "done")`` is dropped: it is ``terminals | timeouts``).
    """
    plan: list[tuple[str, Key, np.dtype, tuple[int, ...]]] = []
    done_with: set[Key] = set()
    same = source is not None and source.get("naming") == naming and "columns" in source
    derived = {tuple(k) for k in source.get("derived", [])} if same else set()
    if same:
        for name, spec in source["columns"].items():
            key = tuple(spec["key"])
            if key in schema_keys and key not in derived:
                plan.append((name, key, np.dtype(spec["dtype"]), tuple(spec["shape"])))
                done_with.add(key)
    for key, (shape, dtype) in schema_keys.items():
        if key in done_with or key in derived:
            continue
        if naming == "d4rl" and key == DONE:
            continue
        name = key_to_d4rl(key) if naming == "d4rl" else key_str(key)
        np_dtype = numpy_dtype(dtype, key_str(key), "HDF5 and npz")
        out_shape = tuple(shape)
        if naming == "d4rl":
            out_shape = flat_cell(key, out_shape)
        plan.append((name, key, np_dtype, out_shape))
    if naming == "d4rl":
        names = {p[0] for p in plan}
        if "terminals" not in names and DONE in schema_keys and TERMINATED not in schema_keys:
            shape = schema_keys[DONE][0]
            plan.append(("terminals", DONE, np.dtype(bool), flat_cell(DONE, tuple(shape))))
    return plan


def write_d4rl(
    store: Any,
    rows: np.ndarray,
    tmp: str,
    source: dict[str, Any] | None,
    chunk_rows: int | None,
    progress: Any,
) -> dict[str, Any]:
    """Write a store's rows as a D4RL HDF5 file at ``tmp`` (through :mod:`tiered.util.fileio`).

    Returns:
        ``{"columns": [...names...], "rows": n}``.
    """
    schema = store.schema
    keys = {f.key: (f.shape, f.dtype) for f in schema.values()} if schema is not None else {}
    plan = plan_flat_columns(keys, source, "d4rl")
    n = int(rows.size)
    step = chunk_rows_for(row_nbytes({p[0]: (p[3], p[2]) for p in plan}), chunk_rows)
    f = fileio.WritableFile(tmp)
    with writing(f):
        with h5py.File(f, "w") as h:
            dsets = {name: h.create_dataset(name, shape=(n, *shape), dtype=dtype, fill_time="never")
                     for name, _key, dtype, shape in plan}
            src_keys = sorted({p[1] for p in plan})
            for lo, hi, td in iter_store(store, rows, step, keys=src_keys):
                for name, key, dtype, shape in plan:
                    dsets[name][lo:hi] = to_numpy(td.get(key), dtype, shape)
                progress.update(hi - lo)
            if source is not None and source.get("naming") == "d4rl":
                for name, spec in (source.get("extras") or {}).items():
                    if name not in h:
                        _write_extra(h, name, spec)
                for k, v in (source.get("file_attrs") or {}).items():
                    h.attrs[k] = v
    return {"columns": [p[0] for p in plan], "rows": n}
