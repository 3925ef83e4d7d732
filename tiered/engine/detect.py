"""Finding frame stacks without configuration (what ``frames=None``, the default, does).

On the first write, before the schema is fixed, :func:`detect_frames` looks at the blob fields of
the batch and returns the ``frames=`` mapping a user would have written: a field is a stack of
frames along dimension ``d`` when

* **consecutive rows share all but one frame**: row ``i + 1`` holds frames ``1..S-1`` of row ``i``
  as its frames ``0..S-2`` (a frame stack of a rollout), for at least half of the row pairs
  compared; or
* **its** ``("next", X)`` **is** ``X`` **shifted by one**: ``next[i]`` holds frames ``1..S-1`` of
  ``X[i]`` as its frames ``0..S-2``, for at least half of the rows (this needs one row only, so
  a first ``ReplayBuffer.add`` of a TorchRL transition is enough).

Either test also needs *evidence*: at least one row whose frames are not all equal and that
matches. Rows of one repeated frame (a constant image, a reset stack) match any shift and so
prove nothing: constant data is never detected. Random data never matches. A single-row first
write without a ``("next", X)`` field cannot be decided and is not detected (pass ``frames=``).

Candidate dimensions are the dimensions of a cell of size 2..64 whose frames (the rest of the
cell) hold at least :data:`MIN_FRAME_BYTES` bytes, tried in order (dimension 0 first): the
first that passes wins. Only the first :data:`DETECT_ROWS` rows of the batch are compared, each
test being a few whole-batch tensor comparisons (no loop over rows). A wrong guess can only cost
compression: frames are stored losslessly either way.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered.schema import Schema
    >>> frames = torch.randint(0, 255, (9, 16, 16), dtype=torch.uint8)
    >>> td = TensorDict({"obs": torch.stack([frames[t:t + 4] for t in range(6)]),   # stacks of a rollout
    ...                  "noise": torch.randint(0, 255, (6, 4, 16, 16), dtype=torch.uint8)}, [6])
    >>> detect_frames(td, Schema.infer(td))
    {('obs',): 0}
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase

from ..schema import Field, Key, Schema

__all__ = ["detect_frames", "stack_dim", "MIN_FRAME_BYTES", "MAX_STACK", "DETECT_ROWS"]

#: Smallest frame (bytes) auto-detection splits a cell into; smaller frames cost more index than
#: they can save. ``frames=`` has no such limit.
MIN_FRAME_BYTES = 256
#: Largest stack size auto-detection considers.
MAX_STACK = 64
#: Rows of the first batch compared (the tests are whole-batch comparisons over these rows).
DETECT_ROWS = 256


def detect_frames(td: TensorDictBase, schema: Schema) -> dict[Key, int]:
    """The ``frames=`` mapping the first batch ``td`` implies (see the module docstring).

    Args:
        td: the first batch written, batch size ``[n]``.
        schema: its schema inferred without frames (which fields are blob fields).

    Returns:
        ``{key: frame dimension}`` for each detected field. ``("next", X)`` is left out when
        ``X`` is a blob field (it inherits ``X``'s dimension, as with ``frames=``).
    """
    blob = {f.key: f for f in schema.values() if f.kind == "blob"}
    found: dict[Key, int] = {}
    for key, field in blob.items():
        if key[0] == "next" and key[1:] in blob:
            continue  # judged with X (inherits X's frame dimension)
        nxt = blob.get(("next", *key))
        if nxt is not None and (nxt.shape != field.shape or nxt.dtype != field.dtype):
            nxt = None
        x = td.get(key)[:DETECT_ROWS]
        y = td.get(nxt.key)[:DETECT_ROWS] if nxt is not None else None
        for d in _candidate_dims(field):
            if stack_dim(x, d, y):
                found[key] = d
                break
    return found


def _candidate_dims(field: Field) -> list[int]:
    shape = field.shape
    cell = math.prod(shape) * field.itemsize
    return [d for d, s in enumerate(shape)
            if 2 <= s <= MAX_STACK and cell // s >= MIN_FRAME_BYTES]


def _frames(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` ``[n, *cell]`` as ``[n, S, frame bytes]`` uint8, frames along cell dimension ``d``."""
    n, s = x.shape[0], x.shape[d + 1]
    y = x.movedim(d + 1, 1).contiguous()
    if y.dtype != torch.uint8:  # compare bytes: NaNs equal themselves, -0.0 differs from 0.0
        y = y.reshape(n, s, -1).view(torch.uint8)
    return y.reshape(n, s, -1)


def stack_dim(x: torch.Tensor, d: int, nxt: torch.Tensor | None = None) -> bool:
    """Whether cells ``x`` ``[n, *cell]`` are frame stacks along cell dimension ``d``.

    Args:
        x: the rows compared (consecutive rows of one write).
        d: the candidate dimension of a cell.
        nxt: the ``("next", X)`` cells of the same rows, or ``None``.

    Example:
        >>> frames = torch.arange(6, dtype=torch.uint8)[:, None].expand(6, 300)
        >>> stacks = torch.stack([frames[t:t + 3] for t in range(4)])   # [4, 3, 300]
        >>> stack_dim(stacks, 0), stack_dim(torch.zeros(4, 3, 300, dtype=torch.uint8), 0)
        (True, False)
    """
    f = _frames(x, d)
    n = f.shape[0]
    varied = (f[:, 1:] != f[:, :-1]).any(-1).any(-1)  # rows whose frames are not all equal
    if n >= 2:
        shift = (f[:-1, 1:] == f[1:, :-1]).all(-1).all(-1)
        if 2 * int(shift.sum()) >= n - 1 and bool((shift & varied[:-1]).any()):
            return True
    if nxt is not None and n >= 1:
        g = _frames(nxt[:n], d)
        shift = (f[:, 1:] == g[:, :-1]).all(-1).all(-1)
        if 2 * int(shift.sum()) >= n and bool((shift & (varied | (g[:, 1:] != g[:, :-1]).any(-1).any(-1))).any()):
            return True
    return False
