"""Cold segment files as they lie on disk: their names, and the check of an HDF5 segment.

The cold tiers (:mod:`tiered.tiers.memmap`, :mod:`tiered.tiers.hdf5`) write these files and
:mod:`tiered.verify` checks them; both take the names and the check from here, which imports
neither torch nor (until an HDF5 segment is checked) h5py, so ``tiered verify`` runs without
either.

Example:
    >>> segment_name("memmap", 3), segment_name("hdf5", 3)
    ('seg-000003.bin', 'seg-000003.h5')
"""

from __future__ import annotations

import os
import stat

__all__ = ["DATASET", "segment_name", "segment_problem", "hdf5_segment_problem"]

#: The one dataset of an HDF5 segment file: its blob bytes, a contiguous uint8 array.
DATASET = "blobs"

_SUFFIX = {"hdf5": ".h5"}  # every other backend (memmap, spill) writes raw ``.bin`` files


def segment_name(backend: str, i: int) -> str:
    """File name of segment ``i`` of a cold tier of ``backend`` (``"memmap"``, ``"hdf5"``, ``"spill"``)."""
    return f"seg-{i:06d}{_SUFFIX.get(backend, '.bin')}"


def segment_problem(path: str, expected: int) -> tuple[str, str] | None:
    """What is wrong with segment file ``path``, which must hold at least ``expected`` bytes
    (``None``: nothing): ``(kind, words)``, kind ``"missing"``, ``"file"`` or ``"truncated"``, the
    words to follow the path (``"is truncated: 100 bytes, expected at least 4096 bytes"``)."""
    try:
        st = os.stat(path)
    except OSError:  # missing, a dangling symlink or a symlink loop
        return "missing", f"is missing or unreachable (it should hold at least {expected} bytes)"
    if not stat.S_ISREG(st.st_mode):
        return "file", "is not a regular file"
    if st.st_size < expected:
        return "truncated", f"is truncated: {st.st_size} bytes, expected at least {expected} bytes"
    return None


def hdf5_segment_problem(path: str, data_offset: int, segment_bytes: int) -> str | None:
    """What is wrong with HDF5 segment ``path`` (``None``: nothing).

    A segment holds one contiguous, unfiltered uint8 dataset :data:`DATASET` of ``segment_bytes``
    bytes whose data starts at byte ``data_offset`` of the file (where blob bytes are read and
    written without HDF5). The answer follows the path, e.g. ``"holds no 'blobs' dataset"``.
    """
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as h:
            if DATASET not in h:
                return f"holds no {DATASET!r} dataset"
            link = h.get(DATASET, getlink=True)
            if not isinstance(link, h5py.HardLink):  # tiered writes the dataset itself, never a link
                return f"holds {DATASET!r} as a link ({type(link).__name__}), not as the dataset itself"
            d = h[DATASET]
            problems = []
            if d.shape != (segment_bytes,) or d.dtype != "u1":
                problems.append(f"{DATASET!r} has shape {d.shape} dtype {d.dtype}, expected ({segment_bytes},) uint8")
            if d.chunks is not None or d.compression is not None:
                problems.append(f"{DATASET!r} is chunked or filtered, expected contiguous")
            offset = d.id.get_offset()
            if offset != data_offset:
                problems.append(f"{DATASET!r} data starts at byte {offset}, the manifest says {data_offset}")
    except Exception as e:  # noqa: BLE001 - h5py raises OSError, KeyError, ValueError... on damaged metadata
        return f"is not a readable HDF5 file ({type(e).__name__}: {e})"
    return "; ".join(problems) or None
