"""The cold tier on HDF5 files: one contiguous uint8 dataset per segment file.

Each segment ``seg-000000.h5``, ``seg-000001.h5``, ... is an ordinary HDF5 file holding one
1-D ``uint8`` dataset ``"blobs"`` of exactly ``segment_bytes`` bytes, contiguous (not chunked,
no filters), its storage allocated when the file is created (``H5D_ALLOC_TIME_EARLY``, never
filled, so unwritten space stays sparse on disk) and without timestamps
(``track_times=False``). Any HDF5 reader sees the blobs: ``h5py.File(seg)["blobs"][o:o + n]``.

How bytes move (and why):

* The file and its metadata are created by h5py writing through
  :class:`tiered.util.fileio.WritableFile` (h5py's ``fileobj`` driver), so even HDF5's own writes go
  through :mod:`tiered.util.fileio`, the package's single write seam, where tests inject full
  disks and power cuts. h5py then closes the file; it is never held open.
* A contiguous, unfiltered dataset is a plain byte range of the file starting at
  ``dset.id.get_offset()``. Blob bytes are written there with :func:`tiered.util.fileio.pwrite` and
  read with the same coalesced, threaded ``pread`` code as
  :class:`~tiered.tiers.memmap.MemmapTier` (:func:`~tiered.tiers.memmap.read_blobs`),
  bypassing HDF5's pipeline (which would serialize every read behind h5py's global lock).
  Space is reserved with ``posix_fallocate`` in steps, as for memmap segments.
* :meth:`HDF5Tier.flush` fsyncs every segment written since the last flush (and the
  directory after a creation), so a segment is complete and durable before the manifest
  names it.
* When a process first reads a segment it did not create, it opens it once with h5py to
  check that it is an HDF5 file with the expected dataset at the recorded offset.
"""

from __future__ import annotations

import os

import h5py

from ..errors import CorruptionError
from ..util import fileio
from ..util.segments import DATASET, hdf5_segment_problem
from .memmap import MemmapTier

__all__ = ["HDF5Tier"]


class HDF5Tier(MemmapTier):
    """The ``cold`` tier with HDF5 segment files (see the module docstring).

    Args:
        directory: where the segment files live (created if missing; must hold no segments).
        segment_bytes: size of the ``"blobs"`` dataset of each segment file.
        threads: threads for large reads.
        budget: optional cap on the bytes of live blobs.

    Example:
        >>> import tempfile, h5py, numpy as np
        >>> t = HDF5Tier(tempfile.mkdtemp(), segment_bytes=1 << 20)
        >>> data = np.frombuffer(b"hello world!", dtype=np.uint8)
        >>> off = t.allocate(np.array([5, 7]))
        >>> t.write(off, data, np.array([0, 5]), np.array([5, 7])); t.flush()
        >>> with h5py.File(t.segments[0], "r") as f:
        ...     bytes(f["blobs"][off[1]:off[1] + 7])
        b' world!'
    """

    format = "hdf5"

    def _create_segment(self, i: int) -> tuple[int, int]:
        path = self.segment_path(i)
        f = fileio.WritableFile(path)
        try:
            if os.fstat(f.fd).st_size:  # left over by a crash after the last commit
                f.truncate(0)
            with h5py.File(f, "w", libver="earliest") as h:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_layout(h5py.h5d.CONTIGUOUS)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                dcpl.set_obj_track_times(False)
                space = h5py.h5s.create_simple((self.segment_bytes,), (self.segment_bytes,))
                dset = h5py.h5d.create(h.id, DATASET.encode(), h5py.h5t.STD_U8LE, space, dcpl=dcpl)
                data_offset = int(dset.get_offset())
                h.attrs["tiered_segment"] = i
                h.attrs["segment_bytes"] = self.segment_bytes
            # HDF5 sets the end of file at close; make sure the whole dataset is inside it
            if os.fstat(f.fd).st_size < data_offset + self.segment_bytes:
                f.truncate(data_offset + self.segment_bytes)
        except BaseException as e:
            error = f.error
            f.close()
            fileio.remove(path)
            if error is not None and error is not e:
                raise error from e
            raise
        self._checked.add(i)
        return f.detach(), data_offset

    def _check_segment(self, i: int) -> None:
        if i in self._checked:
            return
        path = self.segment_path(i)
        why = hdf5_segment_problem(path, self._data_offsets[i], self.segment_bytes)
        if why:
            raise CorruptionError(f"{path} {why}; it is not a tiered segment, the store is damaged")
        self._checked.add(i)
