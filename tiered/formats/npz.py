"""npz: a NumPy ``.npz`` archive of row-aligned arrays.

Two namings are recognised on import:

* **D4RL names** (``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts``,
  optional ``next_observations``, ``infos/<k>``): mapped exactly as the ``d4rl`` format
  (:mod:`tiered.formats.keymap`), next observations / done / episode ids derived when absent;
* anything else (**TED paths**): each array name is a ``/``-joined store key
  (``next/reward`` -> ``("next", "reward")``), imported as it is.

Export writes the naming the store was imported with (default: TED paths; ``layout="d4rl"``
for D4RL names). Archives written by :func:`numpy.savez` (stored) and
:func:`numpy.savez_compressed` (deflate) both stream: members are read and written row slice by
row slice (stored members with ``pread`` at their offset in the archive, compressed ones by
streaming decompression), so an archive larger than RAM imports and exports with bounded memory.

Example:
    >>> import numpy as np, tempfile, os
    >>> from tiered.formats.npz import NpzSource
    >>> p = os.path.join(tempfile.mkdtemp(), "a.npz")
    >>> np.savez(p, **{"observation": np.zeros((5, 3), np.float32), "next/reward": np.ones((5, 1))})
    >>> src = NpzSource(p)
    >>> src.naming, sorted(next(src.chunks()).keys(True, True), key=str)
    ('ted', [('next', 'reward'), 'observation'])
"""

from __future__ import annotations

import io
import os
import zipfile
from typing import Any

import numpy as np

from ..errors import UnsupportedFormatError
from ..util import fileio
from .common import chunk_rows_for, iter_store, read_npy_header, row_nbytes, to_numpy, writing
from .d4rl import FlatSource, plan_flat_columns

__all__ = ["NpzSource", "write_npz"]


class _Member:
    """One ``.npy`` member of an archive, sliceable by rows without loading it whole."""

    def __init__(self, zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> None:
        self._zf, self._info, self._path = zf, info, path
        with zf.open(info) as f:
            shape, fortran, dtype = read_npy_header(f, f"{path}: {info.filename}")
            self._data_start = f.tell()
        if fortran and len(shape) > 1:
            raise UnsupportedFormatError(f"{path}: {info.filename} is Fortran-ordered; save it C-ordered")
        self.shape, self.dtype = shape, dtype
        self._row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self._start: int | None = None  # file offset of the rows of a stored member
        self._fd = -1
        if info.compress_type == zipfile.ZIP_STORED:
            # a stored member is a plain byte range of the archive: read rows with pread (not a
            # memory map, whose touched pages would stay in the importer's resident set)
            with open(path, "rb") as raw:
                raw.seek(info.header_offset)
                header = raw.read(30)
            name_len = int.from_bytes(header[26:28], "little")
            extra_len = int.from_bytes(header[28:30], "little")
            self._start = info.header_offset + 30 + name_len + extra_len + self._data_start
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._stream: Any = None
        self._pos = 0  # next row of the stream

    @property
    def streamed(self) -> bool:
        """Rows are read from a decompressing stream, cheaply only forward (a compressed member)."""
        return self._start is None

    def __getitem__(self, index: slice) -> np.ndarray:
        lo, hi, _ = index.indices(self.shape[0] if self.shape else 0)
        hi = max(lo, hi)
        if self._start is not None:
            n = (hi - lo) * self._row
            raw = np.empty(n, dtype=np.uint8)
            if fileio.read_into(self._fd, memoryview(raw), self._start + lo * self._row) < n:
                raise UnsupportedFormatError(f"{self._path}: {self._info.filename} is truncated")
        else:
            if self._stream is None or lo < self._pos:
                if self._stream is not None:
                    self._stream.close()
                self._stream = self._zf.open(self._info)
                self._stream.read(self._data_start)
                self._pos = 0
            if lo > self._pos:  # skip forward (sequential readers never do, except by one row)
                self._read_exact((lo - self._pos) * self._row)
            raw = np.frombuffer(self._read_exact((hi - lo) * self._row), dtype=np.uint8)
            self._pos = hi
        return raw.view(self.dtype).reshape(hi - lo, *self.shape[1:])

    def _read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)  # writable: torch.from_numpy accepts it without a copy
        view, got = memoryview(buf), 0
        while got < n:
            k = self._stream.readinto(view[got:])
            if not k:
                raise UnsupportedFormatError(f"{self._path}: {self._info.filename} is truncated")
            got += k
        return buf

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Rewind:
    """Column view that rereads the last row so slices ``[lo:hi + 1]`` stay sequential."""

    def __init__(self, member: _Member) -> None:
        self.member, self.shape, self.dtype = member, member.shape, member.dtype
        self._last: tuple[int, np.ndarray] | None = None

    def __getitem__(self, index: slice) -> np.ndarray:
        lo, hi, _ = index.indices(self.shape[0])
        if self._last is not None and self._last[0] == lo and self.member.streamed:
            rest = self.member[lo + 1 : hi] if hi > lo + 1 else np.empty((0, *self.shape[1:]), self.dtype)
            out = np.concatenate([self._last[1], rest])
        else:
            out = self.member[lo:hi]
        if hi > lo:
            self._last = (hi - 1, out[-1:].copy())
        return out


class NpzSource(FlatSource):
    """An ``.npz`` archive as a source of rows (see the module docstring).

    Args:
        path: the ``.npz`` file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file")
        try:
            self._zf = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise UnsupportedFormatError(f"{path} is not an .npz archive (not a zip file)") from None
        try:
            members = {info.filename[:-4]: _Member(self._zf, info, path) for info in self._zf.infolist()
                       if info.filename.endswith(".npy")}
            if not members:
                raise UnsupportedFormatError(f"{path}: the archive holds no .npy arrays")
            naming = "d4rl" if "observations" in members and "actions" in members else "ted"
            self._members = members
            cols = {k: _Rewind(m) for k, m in members.items()}
            super().__init__(cols, naming=naming, fmt="npz", origin=path)
        except BaseException:
            self._zf.close()
            raise

    def close(self) -> None:
        for m in self._members.values():
            m.close()
        self._zf.close()


def write_npz(
    store: Any,
    rows: np.ndarray,
    tmp: str,
    source: dict[str, Any] | None,
    chunk_rows: int | None,
    progress: Any,
    layout: str | None = None,
) -> dict[str, Any]:
    """Write a store's rows as an uncompressed ``.npz`` at ``tmp`` (``np.load`` reads it).

    Args:
        layout: ``"ted"`` (array names are ``/``-joined keys) or ``"d4rl"`` (D4RL names);
            default: the naming of the import, else ``"ted"``.

    Returns:
        ``{"arrays": [...names...], "rows": n}``.
    """
    naming = (
        layout
        or (source.get("naming") if source and source.get("format") in ("npz", "d4rl") else None)
        or "ted"
    )
    if naming not in ("ted", "d4rl"):
        raise UnsupportedFormatError(f"npz layout must be 'ted' or 'd4rl', got {naming!r}")
    schema = store.schema
    keys = {f.key: (f.shape, f.dtype) for f in schema.values()} if schema is not None else {}
    plan = plan_flat_columns(
        keys, source if source and source.get("format") in ("npz", "d4rl") else None, naming
    )
    n = int(rows.size)
    out = fileio.WritableFile(tmp)
    with writing(out):
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            total_bytes = row_nbytes({p[0]: (p[3], p[2]) for p in plan})
            for name, key, dtype, shape in plan:
                # one member at a time (zipfile streams one open member); each is a pass over the
                # store reading only its field
                step = chunk_rows_for(max(1, row_nbytes({name: (shape, dtype)})), chunk_rows)
                head = io.BytesIO()
                np.lib.format.write_array_header_2_0(
                    head,
                    {
                        "descr": np.lib.format.dtype_to_descr(dtype),
                        "fortran_order": False,
                        "shape": (n, *shape),
                    },
                )
                with zf.open(name + ".npy", "w", force_zip64=True) as w:
                    w.write(head.getvalue())
                    for lo, hi, td in iter_store(store, rows, step, keys=[key]):
                        w.write(
                            memoryview(np.ascontiguousarray(to_numpy(td.get(key), dtype, shape))).cast("B")
                        )
                        if total_bytes:
                            progress.update((hi - lo) * row_nbytes({name: (shape, dtype)}) / total_bytes)
    return {"arrays": [p[0] for p in plan], "rows": n}
