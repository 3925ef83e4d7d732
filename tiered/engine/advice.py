"""What a store's first write says about fields that will cost far more than they need to.

At the first write, once the schema and the frame stacks are known (:mod:`tiered.engine.detect`),
:func:`first_write_advice` looks at each large blob field ``X`` (``("next", X)`` is judged with
``X``) and gives one :class:`~tiered.errors.LowCompressionWarning` per field when

* it holds at least :data:`ADVICE_MIN_BYTES` per row and its measured ratio is below
  :data:`ADVICE_MIN_RATIO` (the store's codec is ``"raw"``: the user chose no compression, no
  warning); or
* it is floating point, ``("next", X)`` is ``X`` one row later (a rollout's transitions), its
  cells have a dimension that could be a frame stack, and no stack was found: frames normalized
  after stacking (TorchRL's ``VecNorm`` after ``CatFrames``) differ bit for bit from one stack to
  the next, so nothing is shared and float frames are stored whole.

The ratio is measured the way the store will store the field: the last :data:`ADVICE_ROWS` rows
of ``X`` and ``("next", X)`` split into their frames, identical frames kept once (when the store
deduplicates), grouped ``chunk_frames`` to a blob and encoded with the store's codec: one batched
encode per field, once per store. The warning names the field, the ratio and the page that says
what to change (docs/torchrl-pipelines.md).

Example:
    >>> import warnings
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> from tiered.errors import LowCompressionWarning
    >>> noise = TensorDict({"x": torch.randint(0, 255, (16, 2048), dtype=torch.uint8)}, [16])
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = TieredStore(16).extend(noise)
    >>> [w.category.__name__ for w in caught]
    ['LowCompressionWarning']
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import warnings

import numpy as np
import torch
from tensordict import TensorDictBase

from ..codecs import Codec
from ..errors import LowCompressionWarning
from ..schema import Field, Key, Schema, key_to_str
from ..util.batch import exclusive_cumsum
from .detect import MAX_STACK, MIN_FRAME_BYTES

__all__ = ["first_write_advice", "measured_ratio", "ADVICE_MIN_BYTES", "ADVICE_MIN_RATIO", "ADVICE_ROWS",
           "DOCS_PAGE"]

#: Fields smaller than this per row are never warned about (their bytes matter little).
ADVICE_MIN_BYTES = 1024
#: A large field stored at less than this ratio (logical bytes over stored bytes) is warned about.
ADVICE_MIN_RATIO = 4.0
#: Rows of the first write measured.
ADVICE_ROWS = 32
#: The page the warning points to.
DOCS_PAGE = "docs/torchrl-pipelines.md"


def first_write_advice(td: TensorDictBase, schema: Schema, frames: dict[Key, int], codecs: dict[str, Codec],
                       chunk_frames: dict[str, int], dedup: bool) -> list[str]:
    """Warn (:class:`~tiered.errors.LowCompressionWarning`, once per field) about the fields of
    the first write ``td`` that the module docstring describes; return the messages given.

    Args:
        td: the first batch written (validated against ``schema``).
        schema: the store's schema, with the detected or given frame dimensions.
        frames: the ``frames=`` mapping in force (detected or given).
        codecs: per frame family (:attr:`Field.family`), the codec its blobs are encoded with.
        chunk_frames: per frame family, frames per blob (the store's choice for the family).
        dedup: whether the store keeps identical frames once.
    """
    blob = {f.key: f for f in schema.blob_fields}
    messages = []
    for key, field in blob.items():
        if key[0] == "next" and key[1:] in blob:
            continue  # judged with X
        if field.cell_nbytes < ADVICE_MIN_BYTES:
            continue
        nxt = blob.get(("next", *key))
        if nxt is not None and nxt.family != field.family:
            nxt = None
        # the last rows: the first of a rollout (a reset, running statistics not yet settled) are
        # often unlike the rest
        x = td.get(key)[-ADVICE_ROWS:].detach().cpu()
        y = td.get(nxt.key)[-ADVICE_ROWS:].detach().cpu() if nxt is not None else None
        if x.shape[0] == 0:
            continue  # nothing to measure: an empty first write
        codec = codecs[field.family]
        ratio = measured_ratio(field, x, y, codec, chunk_frames[field.family], dedup)
        unstacked = (field.dtype.is_floating_point and key not in frames and y is not None
                     and _could_stack(field) and _next_is_shifted(x, y))
        low = ratio < ADVICE_MIN_RATIO and codec.name != "raw"
        if not (unstacked or low):
            continue
        messages.append(_message(field, nxt, ratio, x.shape[0], unstacked))
        warnings.warn(messages[-1], LowCompressionWarning, stacklevel=_caller_level())
    return messages


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside tiered, torch, torchrl and tensordict (a
    replay buffer's ``extend`` goes through them before it reaches the store): the warning
    points at the caller's line."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the tiered package
    for name in ("torch", "torchrl", "tensordict"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    prefixes = tuple(d + os.sep for d in dirs)
    frame, level = inspect.currentframe(), 0
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return max(level, 1)


def measured_ratio(field: Field, x: torch.Tensor, y: torch.Tensor | None, codec: Codec, chunk_frames: int,
                   dedup: bool) -> float:
    """Logical bytes of the cells ``x`` (and their ``("next", X)`` cells ``y``) over the bytes
    the store would keep for them: their frames, identical ones once when ``dedup``, encoded
    ``chunk_frames`` to a blob with ``codec``.

    Example:
        >>> from tiered.codecs import get_codec
        >>> f = Field(("x",), torch.uint8, (2048,), "blob")
        >>> measured_ratio(f, torch.zeros(8, 2048, dtype=torch.uint8), None, get_codec("zstd"), 8, True) > 100
        True
    """
    cells = [x] if y is None else [x, y]
    fb = field.frame_nbytes
    frames = np.concatenate([field.frames_of_cells(c, c.shape[0]).reshape(-1, fb) for c in cells])
    logical = sum(c.shape[0] for c in cells) * field.cell_nbytes
    if dedup:  # first occurrences in write order, as the store keeps them
        _, first = np.unique(frames.view(np.dtype((np.void, fb))).reshape(-1), return_index=True)
        frames = frames[np.sort(first)]
    raw = np.ascontiguousarray(frames).reshape(-1)
    sizes = np.full(-(-frames.shape[0] // chunk_frames), chunk_frames * fb, dtype=np.int64)
    sizes[-1] = raw.size - int(sizes[:-1].sum())
    enc = codec.encode(raw, exclusive_cumsum(sizes), sizes)
    stored = int(np.asarray(enc.sizes).sum())
    return logical / stored if stored else math.inf


def _could_stack(field: Field) -> bool:
    """Whether a dimension of the cell could be a frame stack (what detection would try)."""
    return any(2 <= s <= MAX_STACK and field.cell_nbytes // s >= MIN_FRAME_BYTES for s in field.shape)


def _next_is_shifted(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``y[i]`` (``("next", X)``) equals ``x[i + 1]`` bit for bit for at least half of
    the rows, one of them not constant (a constant cell proves nothing)."""
    n = x.shape[0]
    if n < 2:
        return False
    a = x[1:].reshape(n - 1, -1).contiguous().view(torch.uint8)
    b = y[:-1].reshape(n - 1, -1).contiguous().view(torch.uint8)
    same = (a == b).all(-1)
    varied = (a != a[:, :1]).any(-1)
    return 2 * int(same.sum()) >= n - 1 and bool((same & varied).any())


def _message(field: Field, nxt: Field | None, ratio: float, rows: int, unstacked: bool) -> str:
    name = key_to_str(field.key)
    dtype = str(field.dtype).replace("torch.", "")
    pair = f"{name!r} and {key_to_str(nxt.key)!r}" if nxt is not None else repr(name)
    head = (f"field {name!r} ({dtype} {list(field.shape)}, {field.cell_nbytes:,} bytes per row) is stored "
            f"at {ratio:.1f}x (measured on the last {rows} rows of the first write of {pair})")
    if unstacked:
        why = (f": its ('next', {name!r}) is {name!r} one row later, but consecutive rows share no frame bit for "
               "bit, so no frame stack was found and whole float stacks are stored (frames normalized after "
               "stacking, as TorchRL's VecNorm after CatFrames does). Store the frames as uint8 and scale them "
               "in the network")
    elif field.dtype.is_floating_point and not _image_like(field):
        key = field.key[0] if len(field.key) == 1 else field.key
        why = (f", less than {ADVICE_MIN_RATIO:.0f}x. A float vector, not frames: values a network computed "
               "(features, logits, Q-values) keep little redundancy. If nothing reads it back from the buffer "
               "(a loss that recomputes it from the observations, as TorchRL's ClipPPOLoss does the "
               "actor-critic's 'common_features'), leave it out of what is stored: "
               f"rb.extend(data.exclude({key!r})); noise: stored raw without being asked once it compresses "
               "under 1.5x (codec='raw' also skips the trial compression)")
    else:
        why = (f", less than {ADVICE_MIN_RATIO:.0f}x. Pixels: store them as uint8 and normalize in the network; "
               "noise or already-compressed bytes: stored raw without being asked once they compress under "
               "1.5x (codec='raw' also skips the trial compression)")
    return f"{head}{why}. See {DOCS_PAGE}."


def _image_like(field: Field) -> bool:
    """Whether a cell has two dimensions that could be an image's height and width (8 or more
    each): frames get the pixel advice, float vectors (a network's features) the advice to leave
    them out."""
    return sum(s >= 8 for s in field.shape) >= 2
