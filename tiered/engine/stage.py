"""The write stage: small writes wait here, raw, and are compressed together.

Why: a write of one row (``ReplayBuffer.add`` on every environment step) would otherwise pay the
whole batched write path (trajectory ids, frame dedup, encode, placement: about 2 ms of fixed
numpy work) for a single row. The stage copies a small write's blob cells into preallocated raw
tensors (dense cells go straight to their columns) and hands the staged rows to the batched path
at the start of the first write that finds the stage full (``size`` rows) or holding one of its
rows, or before any larger write, flush, commit or pickle.

Promises kept:

- A staged row is in the store: reads serve it from the stage, bit-exactly, and the length and
  cursor count it at once.
- Every error of a small write is raised by that write. Schema problems are found before
  anything is copied. Compressing the stage (which may need tier space) happens at the start of
  the write that finds the stage full, before that write touches anything; if it fails the
  write raises, the stage keeps its rows, and the store is as it was before the call.
- Staged rows keep their write order, so trajectory chunks and frame sharing come out as if
  the rows had been written in one batch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..schema import Key, Schema, as_bits, columns_from_pickle, columns_to_pickle


class WriteStage:
    """Raw blob cells of up to ``size`` rows, in write order, with a row -> slot map.

    Args:
        schema: the store's schema (its blob fields get stage tensors).
        size: rows the stage holds before it must be compressed.
        capacity: the store's capacity (length of the row -> slot map).
    """

    def __init__(self, schema: Schema, size: int, capacity: int):
        self.size = int(size)
        self.cells: dict[Key, torch.Tensor] = {
            f.key: torch.empty((self.size, *f.shape), dtype=f.dtype) for f in schema.blob_fields}
        # the same memory as numpy (integers of the same size for dtypes numpy lacks): put copies
        # with numpy, one memcpy-speed pass on the calling thread; torch's copy_ of a few hundred
        # KB splits over its intra-op threads, which wait behind any other busy process
        self._host = {key: as_bits(t).numpy() for key, t in self.cells.items()}
        self.rows = np.empty(self.size, dtype=np.int64)
        self.count = 0
        # -1: the row is not staged; else its slot. int32 over the capacity: 4 B/row, and a
        # read finds its staged rows with one gather instead of a search.
        self.slot_of = np.full(capacity, -1, dtype=np.int32)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_host": {}, "cells": columns_to_pickle(self.cells)}  # numpy views would unpickle as copies

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.cells = columns_from_pickle(self.cells)
        self._host = {key: as_bits(t).numpy() for key, t in self.cells.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cells.values()) + self.slot_of.nbytes

    def room_for(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` can be staged now (room left and none of them staged already)."""
        return self.count + rows.size <= self.size and not (self.slot_of[rows] >= 0).any()

    def put(self, rows: np.ndarray, values: dict[Key, torch.Tensor]) -> None:
        """Copy the blob cells of ``rows`` (``values[key]``: ``[n, *shape]`` or ``shape`` for one row)."""
        n = rows.size
        lo = self.count
        for key, dst in self.cells.items():
            v = values[key]
            if v.device.type == "cpu" and not v.is_conj() and not v.is_neg():
                # [n, *shape] or one row's shape: numpy broadcasts it over the n slots
                self._host[key][lo:lo + n] = as_bits(v.detach()).numpy()
            elif n == 1 and v.dim() == dst.dim() - 1:
                with torch.no_grad():
                    dst[lo].copy_(v)
            else:
                with torch.no_grad():
                    dst[lo:lo + n].copy_(v)
        self.rows[lo:lo + n] = rows
        self.slot_of[rows] = np.arange(lo, lo + n, dtype=np.int32)
        self.count = lo + n

    def batch(self, read_dense: Callable[[np.ndarray, dict[Key, torch.Tensor]], None],
              ) -> tuple[np.ndarray, dict[Key, torch.Tensor]]:
        """The staged rows and their cells as one batch (``{key: [n, *shape]}``); the dense cells
        are read with ``read_dense(rows, out)``, which fills ``out`` with every dense field's."""
        n = self.count
        rows = self.rows[:n].copy()
        cells: dict[Key, torch.Tensor] = {}
        read_dense(rows, cells)
        for key, t in self.cells.items():
            cells[key] = t[:n]
        return rows, cells

    def staged(self, rows: np.ndarray) -> np.ndarray:
        """The stage slot of each row (-1 where the row is not staged)."""
        return self.slot_of[rows]

    def reset(self) -> None:
        self.slot_of[self.rows[: self.count]] = -1
        self.count = 0
