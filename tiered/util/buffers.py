"""Byte buffers as tiers and codecs pass them: 1-D uint8 numpy arrays or torch tensors.

A *buffer* is a contiguous 1-D ``uint8`` numpy array or torch tensor, on any device. A *batch*
of blobs in a buffer is two int64 arrays, ``offsets`` and ``sizes``: blob ``i`` is
``buf[offsets[i]:offsets[i] + sizes[i]]``. These helpers check buffers and batches with a clear
message, and give host memory one numpy view whatever its type.

Example:
    >>> import numpy as np, torch
    >>> from tiered.util.buffers import as_int64, check_buffer, host_view
    >>> t = torch.arange(4, dtype=torch.uint8)
    >>> check_buffer(t, "the source")
    >>> host_view(t).tolist(), as_int64([3, 4]).dtype
    ([0, 1, 2, 3], dtype('int64'))
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["Buffer", "as_int64", "as_tensor", "check_bounds", "check_buffer", "host_view", "is_out_of_memory"]

#: A contiguous 1-D uint8 numpy array or torch tensor (any device).
Buffer = np.ndarray | torch.Tensor


def as_int64(values: Any) -> np.ndarray:
    """``values`` as a flat int64 numpy array (no copy when it already is one).

    Example:
        >>> as_int64([[1, 2], [3, 4]]).tolist()
        [1, 2, 3, 4]
    """
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # what a store's reads pass: no asarray and reshape calls on every read
    return np.asarray(values, dtype=np.int64).reshape(-1)


def host_view(buf: Buffer) -> np.ndarray | None:
    """A numpy view of ``buf`` when it lives in host memory (a numpy array or a CPU tensor), else None.

    Example:
        >>> host_view(torch.zeros(2, dtype=torch.uint8)).dtype
        dtype('uint8')
    """
    if isinstance(buf, np.ndarray):
        return buf
    if buf.device.type == "cpu":
        return buf.detach().numpy()
    return None


def as_tensor(buf: Buffer) -> torch.Tensor:
    """``buf`` as a torch tensor sharing its memory (a numpy array becomes a CPU tensor).

    A read-only numpy array is accepted without torch's "not writable" warning: buffers made
    this way are only read from.

    Example:
        >>> as_tensor(np.arange(3, dtype=np.uint8)).tolist()
        [0, 1, 2]
    """
    if not isinstance(buf, np.ndarray):
        return buf
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(buf)


def check_buffer(buf: Buffer, what: str) -> None:
    """Raise TypeError unless ``buf`` is a contiguous 1-D uint8 numpy array or torch tensor.

    Args:
        buf: the buffer.
        what: how the message names it (``"the source buffer"``, ``"out"``).

    Example:
        >>> check_buffer(np.zeros((2, 2), np.uint8), "out")
        Traceback (most recent call last):
        ...
        TypeError: out must be a contiguous 1-D uint8 numpy array or torch tensor, got ndarray of dtype uint8 and shape (2, 2)
    """
    if isinstance(buf, np.ndarray):
        ok = buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous
    elif isinstance(buf, torch.Tensor):
        ok = buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    else:
        raise TypeError(f"{what} must be a contiguous 1-D uint8 numpy array or torch tensor, "
                        f"got {type(buf).__name__}")
    if not ok:
        raise TypeError(
            f"{what} must be a contiguous 1-D uint8 numpy array or torch tensor, got "
            f"{type(buf).__name__} of dtype {buf.dtype} and shape {tuple(buf.shape)}"
        )


def check_bounds(offsets: np.ndarray, sizes: np.ndarray, length: int, what: str) -> None:
    """Raise ValueError when a range ``[offsets[i], offsets[i] + sizes[i])`` leaves ``[0, length)``.

    Example:
        >>> check_bounds(np.array([0, 6]), np.array([4, 5]), 10, "the source buffer's")
        Traceback (most recent call last):
        ...
        ValueError: the source buffer's ranges [0, 11) fall outside its 10 bytes
    """
    # ufunc reductions, not .min()/.max(): those add Python-level wrapper calls on every read
    if offsets.size and (int(np.minimum.reduce(offsets)) < 0 or int(np.maximum.reduce(offsets + sizes)) > length):
        raise ValueError(
            f"{what} ranges [{int(offsets.min())}, {int((offsets + sizes).max())}) fall outside "
            f"its {length} bytes"
        )


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says an allocation failed: torch's or Python's out-of-memory error, or an
    error whose message does (CUDA and nvCOMP report it in a RuntimeError's text).

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("injected")), is_out_of_memory(ValueError("bad"))
        (True, False)
    """
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(e).lower()
    return "out of memory" in msg or "cudaerrormemoryallocation" in msg or "outofmemory" in msg
