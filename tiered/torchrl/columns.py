"""Fields that first appear after a storage's first write, kept uncompressed beside its store.

TorchRL's ``LazyTensorStorage`` accepts a new key at any write (PPO writes ``advantage`` and
``value_target`` back; ``TensorDictRoundRobinWriter`` adds ``"index"``): it allocates the new
column, zero-filled, and earlier rows read zeros. A :class:`~tiered.TieredStore` fixes its schema
at the first write, so a :class:`SideColumns` holds such fields: one plain tensor of
``[capacity, *cell]`` per field, zero-filled when it appears, written and read with the same rows
as the store.

Example:
    >>> import numpy as np, torch
    >>> side = SideColumns(4)
    >>> side.write(np.array([2, 3]), {("adv",): torch.tensor([1.5, 2.5])})
    >>> side.read(np.array([0, 3]))[("adv",)].tolist()
    [0.0, 2.5]
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SchemaMismatchError
from ..schema import Key, key_to_str, str_to_key

__all__ = ["SideColumns"]


class SideColumns:
    """Uncompressed columns of ``capacity`` rows, created (zero-filled) on their first write."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.columns: dict[Key, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.columns)

    def check(self, values: dict[Key, torch.Tensor]) -> None:
        """Refuse, before anything is written (the store's fields included), cells that :meth:`write`
        could not write: not plain tensors with values (meta, sparse, nested), or another dtype or
        cell shape than the column holds.

        Raises:
            SchemaMismatchError: naming the field.
        """
        for key, value in values.items():
            if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.is_nested \
                    or value.layout != torch.strided:
                what = type(value).__name__ if not isinstance(value, torch.Tensor) else (
                    "tensor on the meta device" if value.device.type == "meta"
                    else "nested tensor" if value.is_nested else f"{value.layout} tensor")
                raise SchemaMismatchError(
                    f"field {key_to_str(key)!r} is a {what}: its values cannot be read, so nothing was "
                    "written; write a dense tensor with data")
            col = self.columns.get(key)
            if col is not None and (col.shape[1:] != value.shape[1:] or col.dtype != value.dtype):
                raise SchemaMismatchError(
                    f"field {key_to_str(key)!r} holds {col.dtype} cells of shape {list(col.shape[1:])}; got "
                    f"{value.dtype} cells of shape {list(value.shape[1:])}. Write the same dtype and shape")

    def write(self, rows: np.ndarray, values: dict[Key, torch.Tensor]) -> None:
        """Write ``values[key][i]`` into row ``rows[i]`` (columns are created as needed); all the
        values are checked (:meth:`check`) before the first is written."""
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        self.check(values)
        for key, value in values.items():
            value = value.detach()
            col = self.columns.get(key)
            if col is None:
                col = torch.zeros((self.capacity, *value.shape[1:]), dtype=value.dtype)
            col.index_copy_(0, index, value.to(col.device).reshape(rows.size, *col.shape[1:]))
            self.columns[key] = col

    def read(self, rows: np.ndarray) -> dict[Key, torch.Tensor]:
        """Every column's cells of ``rows`` (copies)."""
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        return {key: col.index_select(0, index) for key, col in self.columns.items()}

    def span(self, start: int, n: int) -> dict[Key, torch.Tensor]:
        """Views of ``n`` rows from ``start`` (what a slice of the storage shows)."""
        return {key: col.narrow(0, start, n) for key, col in self.columns.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """``{"a/b": tensor}`` (``torch.save``-able; loaded with ``weights_only=True``)."""
        return {key_to_str(k): v for k, v in self.columns.items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        columns = {}
        for name, value in state.items():
            if not isinstance(value, torch.Tensor) or value.ndim < 1 or value.shape[0] != self.capacity:
                raise SchemaMismatchError(
                    f"side column {name!r} must be a tensor of {self.capacity} rows, got "
                    f"{getattr(value, 'shape', type(value).__name__)}")
            columns[str_to_key(name)] = value.clone()
        self.columns = columns
