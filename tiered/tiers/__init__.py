"""Tiers: byte arenas under budgets (``hot`` GPU memory, ``warm`` host memory, ``cold`` files).

Every tier implements :class:`Tier` (see :mod:`tiered.tiers.base`) and passes the
conformance suite in ``tests/tiers/test_tiers.py``.

Example:
    >>> import numpy as np
    >>> from tiered.tiers import HostTier
    >>> t = HostTier("1MiB")
    >>> t.allocate(np.array([100, 3]))
    array([  0, 112])
"""

from __future__ import annotations

from .arena import ArenaTier, DeviceTier, HostTier, default_budgets
from .base import Tier
from .extents import ExtentAllocator
from .hdf5 import HDF5Tier
from .memmap import MemmapTier
from .spill import SpillTier

__all__ = [
    "Tier",
    "ArenaTier",
    "HostTier",
    "DeviceTier",
    "MemmapTier",
    "HDF5Tier",
    "SpillTier",
    "ExtentAllocator",
    "default_budgets",
]
