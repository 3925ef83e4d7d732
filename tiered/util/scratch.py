"""Per-thread scratch buffers: reusable host memory, by name, for the paths that run per batch.

A fresh multi-megabyte ``np.empty`` costs a page fault per 4 KiB page the first time it is
written, on every call; a buffer kept from one batch to the next costs nothing. Each thread
gets its own buffers (the read and write paths run on several threads), created on first use:

* a buffer grows by doubling, from ``floor`` bytes, to the largest request seen so far;
* a request over ``keep_max`` bytes gets a temporary instead, so one large write or
  whole-store read does not pin that much memory for the life of the thread;
* ``pinned=True`` allocates page-locked memory (CUDA hosts), so that a host-to-device copy from
  it can run asynchronously; temporaries are never pinned.

The contents of a buffer are undefined when it is handed out. Two requests for one name in one
thread may return the same memory: be done with the first before making the second.

Example:
    >>> from tiered.util.scratch import ScratchBuffers
    >>> scratch = ScratchBuffers(floor=1 << 16, keep_max=1 << 20)
    >>> buf = scratch.get("staging", 1000)
    >>> buf.size, buf.dtype.name, scratch.kept_bytes("staging")
    (1000, 'uint8', 65536)
    >>> scratch.get("staging", 5000).base is buf.base   # the same memory, reused
    True
    >>> big = scratch.get("staging", 2 << 20)           # over keep_max: a temporary
    >>> big.size, scratch.kept_bytes("staging")
    (2097152, 65536)
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["ScratchBuffers"]


class ScratchBuffers(threading.local):
    """Reusable uint8 host buffers, one set per thread, looked up by name.

    Args:
        floor: the smallest buffer kept (bytes); smaller requests share it.
        keep_max: requests over this many bytes get a temporary that is not kept; ``None``
            keeps every buffer, however large.
        pinned: allocate the kept buffers in page-locked memory (needs CUDA).

    The object can be shared by every thread: each sees its own buffers.
    """

    def __init__(self, *, floor: int = 1 << 16, keep_max: int | None = 16 << 20, pinned: bool = False) -> None:
        if floor < 0 or (keep_max is not None and keep_max < floor):
            raise ValueError(f"need 0 <= floor <= keep_max, got floor={floor}, keep_max={keep_max}")
        self.floor = floor
        self.keep_max = keep_max
        self.pinned = pinned
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes (a 1-D uint8 array, contents undefined) of this thread's buffer ``name``.

        Example:
            >>> ScratchBuffers().get("comp", 10).shape
            (10,)
        """
        if self.keep_max is not None and nbytes > self.keep_max:
            return np.empty(nbytes, dtype=np.uint8)
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.size), self.floor)
            if self.keep_max is not None:
                size = min(size, self.keep_max)
            buf = self._allocate(size)
            self._buffers[name] = buf
        return buf[:nbytes]

    def kept_bytes(self, name: str | None = None) -> int:
        """Bytes this thread keeps for ``name`` (every name when None).

        Example:
            >>> s = ScratchBuffers(floor=4096)
            >>> _ = s.get("a", 10), s.get("b", 5000)
            >>> s.kept_bytes("a"), s.kept_bytes()
            (4096, 9096)
        """
        if name is not None:
            buf = self._buffers.get(name)
            return 0 if buf is None else int(buf.size)
        return sum(int(b.size) for b in self._buffers.values())

    def _allocate(self, nbytes: int) -> np.ndarray:
        if self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(nbytes, dtype=np.uint8)
