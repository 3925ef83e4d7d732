"""Shared helpers, the leaf of the package, that both tiers and codecs use (so neither imports the other).

* :mod:`~tiered.util.batch`: batch index arithmetic (offsets, ranges, membership, balanced splits);
* :mod:`~tiered.util.buffers`: byte buffers and their checks (numpy arrays and torch tensors);
* :mod:`~tiered.util.copy`: the byte-copy engine (many blobs between buffers, any device);
* :mod:`~tiered.util.hostcopy`: its host half (numpy buffers only; no torch);
* :mod:`~tiered.util.pool`: the worker pool;
* :mod:`~tiered.util.progress`: the progress bar of the long commands;
* :mod:`~tiered.util.scratch`: per-thread reusable scratch buffers;
* :mod:`~tiered.util.segments`: cold segment file names and the check of an HDF5 segment;
* :mod:`~tiered.util.units`: byte units and alignment.

Nothing here imports any other module of the package except :mod:`tiered.errors`.
"""
