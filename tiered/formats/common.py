"""Helpers shared by the format readers and writers: the source sidecar, atomic outputs,
chunk sizes, progress bars and chronological row order.

Nothing here knows a format; :mod:`tiered.formats.keymap` holds the key mapping.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np
import torch
from tensordict import TensorDictBase

from ..errors import InvalidDatasetError, PickledDataError, UnsupportedFormatError
from ..sidecar import SOURCE_FILE
from ..util import fileio
from ..util.filemap import parse_npy_header

__all__ = [
    "write_source",
    "atomic_output",
    "check_new_output",
    "chunk_rows_for",
    "chronological_rows",
    "iter_store",
    "row_nbytes",
    "json_safe",
    "numpy_dtype",
    "np_to_torch",
    "to_numpy",
    "read_npy_header",
    "open_hdf5",
    "hdf5_datasets",
    "refuse_hdf5_links",
    "refuse_foreign_storage",
    "NPY_MAX_HEADER",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CHUNK_ROWS",
]

#: Rows per slice read from a source or from a store, whichever of the two limits is smaller.
#: The importer's peak memory is a small multiple of one slice (the store's extend makes a few
#: working copies of a batch), so the byte limit is what bounds it.
DEFAULT_CHUNK_ROWS = 4096
DEFAULT_CHUNK_BYTES = 32 << 20
#: The longest ``.npy`` header a source may have (numpy writes a few hundred bytes).
NPY_MAX_HEADER = 1 << 16


def read_npy_header(f: BinaryIO, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype of the ``.npy`` header at the position of the stream ``f``,
    which is left at the first byte of the array's data.

    numpy's own header parser (it evaluates literals only): nothing is unpickled, and an array of
    Python objects is refused before any of its bytes are read.

    Args:
        f: a binary stream (a file, a zip member, a gzip stream, a ``BytesIO``).
        where: how error messages name the array (its file, or archive and member).

    Raises:
        InvalidDatasetError: a ``.npy`` version numpy does not write.
        PickledDataError: the array holds Python objects.
        ValueError: a damaged header (numpy's parser: bad magic, dict, or a length over
            :data:`NPY_MAX_HEADER`).

    Example:
        >>> import io
        >>> buf = io.BytesIO(); np.save(buf, np.zeros((2, 3), np.int32)); _ = buf.seek(0)
        >>> read_npy_header(buf, "a.npy"), buf.tell()
        (((2, 3), False, dtype('int32')), 128)
    """
    version, header = parse_npy_header(f, NPY_MAX_HEADER)
    if header is None:
        raise InvalidDatasetError(f"{where}: .npy version {version} is not one numpy writes")
    shape, fortran, dtype = header
    if dtype.hasobject:
        raise PickledDataError(
            f"{where}: the array holds Python objects (a pickle); tiered never unpickles data: save it as "
            "a plain array (np.save(..., allow_pickle=False))")
    return tuple(int(d) for d in shape), bool(fortran), dtype


def open_hdf5(path: str) -> Any:
    """``h5py.File(path, "r")``, once the file is known to hold no soft or external link.

    A file h5py cannot open is refused as not HDF5, naming h5py's reason. Links are refused
    before anything reads through them (see :func:`refuse_hdf5_links`).

    Raises:
        UnsupportedFormatError: not an HDF5 file, or it holds a soft or external link.
    """
    import h5py  # here, not at the top: the npz and torchrl formats read no HDF5

    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise UnsupportedFormatError(f"{path} is not an HDF5 file ({e})") from None
    try:
        refuse_hdf5_links(f)
    except BaseException:
        f.close()
        raise
    return f


def _link_refusal(filename: str, where: str, link: Any) -> UnsupportedFormatError:
    """The error for the link at path ``where`` of the file: its target, and what to do
    (``link``: the h5py link object, or the link class number of a user-defined link)."""
    import h5py

    if isinstance(link, h5py.SoftLink):
        what = f"a soft link to {link.path}"
    elif isinstance(link, h5py.ExternalLink):
        what = f"an external link to {link.path} in the file {link.filename}"
    else:
        what = f"a user-defined link (HDF5 link class {link})"
    return UnsupportedFormatError(
        f"{filename}: {where} is {what}. tiered does not follow HDF5 links (a soft link can "
        "loop back on its own group, an external one reads a file you did not name): in a copy of the "
        f"file, delete the link or replace it by a copy of the data it names (h5py: del f[{where!r}], "
        f"then f.copy(source, {where!r})), and import that copy. Nothing was imported")


def refuse_hdf5_links(f: Any) -> None:
    """Refuse an HDF5 file holding any soft, external or user-defined link, anywhere in it.

    HDF5's own link walk (``H5Lvisit``) does the work: it visits every link once without following
    soft or external ones, and does not loop on hard-link cycles.

    Args:
        f: an open ``h5py.File`` (or group: then only the links under it).

    Raises:
        UnsupportedFormatError: naming the first such link, its target, and what to do.

    Example:
        >>> import h5py, io
        >>> f = h5py.File(io.BytesIO(), "w"); f["x"] = [1, 2]; f["y"] = h5py.SoftLink("/x")
        >>> refuse_hdf5_links(f)
        Traceback (most recent call last):
        ...
        tiered.errors.UnsupportedFormatError: ...: /y is a soft link to /x. tiered does not follow ...
    """
    from h5py import h5l

    def not_hard(name: bytes, info: Any) -> tuple[bytes, int] | None:
        return (name, info.type) if info.type != h5l.TYPE_HARD else None  # a value stops the walk

    found = f.id.links.visit(not_hard, info=True)
    if found is not None:
        name = found[0].decode("utf-8", "surrogateescape")
        # h5py's getlink raises TypeError for a user-defined link: only soft and external ones are asked
        link = f.get(name, getlink=True) if found[1] in (h5l.TYPE_SOFT, h5l.TYPE_EXTERNAL) else found[1]
        raise _link_refusal(f.file.filename, f"{f.name.rstrip('/')}/{name}", link)


def refuse_foreign_storage(d: Any, where: str) -> None:
    """Refuse the HDF5 dataset ``d`` (at path ``where``) if its values are read from other files: a
    virtual dataset mapping another file's datasets, or one with external raw storage. As for links
    (:func:`refuse_hdf5_links`), an import reads only the files the user names.

    Raises:
        UnsupportedFormatError: naming the dataset, the files it reads, and what to do.

    Example:
        >>> import h5py, io
        >>> f = h5py.File(io.BytesIO(), "w")
        >>> d = f.create_dataset("x", shape=(4,), dtype="f4", external=[("raw.bin", 0, 16)])
        >>> refuse_foreign_storage(d, "/x")
        Traceback (most recent call last):
        ...
        tiered.errors.UnsupportedFormatError: ...: /x keeps its values in other files (raw.bin), as a ...
    """
    files: list[str] = []
    if d.is_virtual:  # a source file "." is this file itself
        files = sorted({s.file_name for s in d.virtual_sources()} - {"."})
    elif d.external:
        files = sorted({str(name) for name, _offset, _size in d.external})
    if files:
        raise UnsupportedFormatError(
            f"{d.file.filename}: {where} keeps its values in other files ({', '.join(files)}), as a "
            f"{'virtual dataset' if d.is_virtual else 'dataset with external storage'}; an import reads only "
            f"the files you name: in a copy of the file, store the values in it (h5py: a = f[{where!r}][()]; "
            f"del f[{where!r}]; f[{where!r}] = a) and import that copy. Nothing was imported")


def hdf5_datasets(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, dataset)`` of every dataset at or under the HDF5 group or dataset ``obj``, depth first
    in name order.

    Links are never followed, and each group is walked once: a file crafted with a link loop or a
    hard-link cycle is refused, never walked forever.

    Raises:
        UnsupportedFormatError: a soft or external link under ``obj`` (its path and target named),
            a group reached a second time (a hard-link cycle, or one group under two names), or a
            dataset whose values are in other files (:func:`refuse_foreign_storage`).
    """
    import h5py

    if isinstance(obj, h5py.Dataset):
        refuse_foreign_storage(obj, obj.name)
        yield path, obj
        return
    # h5py's object ids compare and hash by (file, object address): one key per group, whatever
    # the link it was reached by
    seen = {obj.id: obj.name}
    stack = [(path, obj.name.rstrip("/"), obj, iter(list(obj)))]
    while stack:
        gpath, gname, group, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        where = f"{gname}/{name}"  # the path walked, whatever name HDF5 keeps for the object
        link = group.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise _link_refusal(group.file.filename, where, link)
        child = group[name]
        if isinstance(child, h5py.Dataset):
            refuse_foreign_storage(child, where)
            yield (*gpath, name), child
        elif isinstance(child, h5py.Group):
            if child.id in seen:
                raise UnsupportedFormatError(
                    f"{group.file.filename}: {where} is a hard link to the group {seen[child.id]}, which "
                    "is already part of the walk (a link cycle, or one group under two names); tiered reads "
                    "each group once: copy the data into a file where every group has one name (h5py: "
                    f"del f[{where!r}] in a copy) and import that copy. Nothing was imported")
            seen[child.id] = where
            stack.append(((*gpath, name), where, child, iter(list(child))))


def write_source(store_path: str | os.PathLike[str], info: dict[str, Any]) -> None:
    """Atomically write the import sidecar (through :mod:`tiered.util.fileio`)."""
    data = json.dumps(json_safe(info), indent=1, allow_nan=True).encode()
    fileio.write_file_atomic(os.path.join(os.fspath(store_path), SOURCE_FILE), data)


def json_safe(x: Any) -> Any:
    """Turn numpy/h5py scalars, arrays and bytes into JSON values (recursively)."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "SO":
            return [json_safe(v) for v in x.tolist()]
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    return x


def check_new_output(dst: str | os.PathLike[str], *, force: bool = False) -> str:
    """Refuse to overwrite ``dst`` unless ``force``; return its absolute path.

    Raises:
        FileExistsError: ``dst`` exists and ``force`` is false.
        FileNotFoundError: the parent directory of ``dst`` does not exist.
    """
    dst = os.path.abspath(os.fspath(dst))
    if os.path.lexists(dst) and not force:
        raise FileExistsError(f"{dst} already exists; choose another destination or pass --force")
    parent = os.path.dirname(dst)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the directory {parent} does not exist; create it first")
    return dst


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def atomic_output(dst: str, *, force: bool = False) -> Iterator[str]:
    """Write an output under a temporary name beside ``dst``; publish it by rename on success.

    A crash or an error leaves no partial output under the final name (a hidden
    ``.NAME.partial-*`` may remain after a SIGKILL; it is never read by anything).

    Yields:
        the temporary path to write (file or directory; it does not exist yet).

    Raises:
        StoreLockedError: ``force`` and ``dst`` is a tiered store that a writer has open (import
            and export alike: a store is never replaced under its writer).
    """
    from ..durable.lock import acquire_writer_lock, release
    from ..durable.manifest import MANIFEST

    dst = check_new_output(dst, force=force)
    parent, name = os.path.split(dst)
    tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")
    # replacing a store: hold its writer lock from the first byte written to the rename
    lock = acquire_writer_lock(dst) if force and os.path.isfile(os.path.join(dst, MANIFEST)) else None
    try:
        try:
            yield tmp
        except BaseException:
            _remove(tmp)
            raise
        if os.path.lexists(dst):  # --force: replace the old output only once the new one is complete
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(dst, old)
            os.rename(tmp, dst)
            _remove(old)
        else:
            os.rename(tmp, dst)
        fileio.fsync_dir(parent)
    finally:
        if lock is not None:
            release(lock)


def chunk_rows_for(row_bytes: int, chunk_rows: int | None = None) -> int:
    """Rows per slice: ``chunk_rows`` (default 4096, fewer if a slice would pass :data:`DEFAULT_CHUNK_BYTES`)."""
    rows = DEFAULT_CHUNK_ROWS if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    if chunk_rows is None and row_bytes > 0:
        rows = min(rows, max(1, DEFAULT_CHUNK_BYTES // row_bytes))
    return rows


def row_nbytes(shapes: dict[Any, tuple[tuple[int, ...], Any]]) -> int:
    """Bytes per row of columns given as ``{name: (cell shape, numpy or torch dtype)}``."""
    return sum(math.prod(shape) * (dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)).itemsize
               for shape, dtype in shapes.values())


def numpy_dtype(dtype: torch.dtype, key: str, fmt: str) -> np.dtype:
    """The numpy dtype a field of ``dtype`` is written as.

    Raises:
        UnsupportedFormatError: numpy has no such dtype (bfloat16, complex32, the float8 types), so
            HDF5 and npz cannot hold it; raised before anything is written.
    """
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        raise UnsupportedFormatError(
            f"field {key!r} is {str(dtype).replace('torch.', '')}, which {fmt} cannot hold (numpy has no such "
            "dtype); export to the torchrl format, or cast the field (e.g. to float32) in a copy of the "
            "store first") from None


def np_to_torch(a: np.ndarray) -> torch.Tensor:
    """A source array as a tensor: contiguous and native byte order (torch has no big-endian)."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("="))
    return torch.from_numpy(a)


def to_numpy(t: torch.Tensor, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A store column slice as the output's dtype and cell shape (exact for recorded casts)."""
    a = t.detach().cpu().contiguous().numpy()
    a = a.reshape(a.shape[0], *shape)
    if a.dtype != dtype:
        a = a.astype(dtype)
    return a


def chronological_rows(store: Any) -> np.ndarray:
    """Row indices of a store, oldest first (a full ring starts at its cursor)."""
    n, cap = len(store), store.capacity
    if n < cap:
        return np.arange(n, dtype=np.int64)
    return (store.cursor + np.arange(cap, dtype=np.int64)) % cap


def iter_store(
    store: Any, rows: np.ndarray, chunk_rows: int, keys: list[tuple[str, ...]] | None = None
) -> Iterator[tuple[int, int, TensorDictBase]]:
    """``(lo, hi, rows[lo:hi] as a TensorDict)`` slices of a store, in the order of ``rows``."""
    for lo in range(0, rows.size, chunk_rows):
        hi = min(rows.size, lo + chunk_rows)
        sel = rows[lo:hi]
        # contiguous ranges go as slices (the store reads them without an index array copy)
        ascending = sel[-1] - sel[0] == hi - lo - 1 and bool((np.diff(sel) == 1).all())
        index: Any = slice(int(sel[0]), int(sel[-1]) + 1) if ascending else sel
        yield lo, hi, store.get(index, keys=keys)


@contextlib.contextmanager
def writing(f: Any) -> Iterator[Any]:
    """Fsync and close an :class:`tiered.util.fileio.WritableFile` after the block.

    If the block fails, the file is closed and the I/O error the file recorded (a full disk hit
    inside h5py or zipfile, which report it as something else) is raised in place of the error it
    caused, so the caller sees ``StorageFullError`` rather than a library's generic error.
    """
    try:
        yield f
        f.fsync()
    except BaseException as e:
        err = f.error
        f.close()
        if err is not None and err is not e:
            raise err from e
        raise
    f.close()
