"""Counting the function calls one operation makes: the check that a hot path has no per-item loop.

The number of Python-level calls of ``get``, ``extend``, a codec's batch or the copy engine must
not grow with the batch; tests assert it, and ``benchmarks/profile_calls.py`` reports it. Both
count with :func:`count_calls` (a ``sys.setprofile`` hook), or hook their own profiler into
:func:`run_profiled`.

Example:
    >>> import numpy as np
    >>> small, large = count_calls(np.sort, np.arange(10)), count_calls(np.sort, np.arange(10_000))
    >>> small == large, small.python <= small.all
    (True, True)
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CallCount", "count_calls", "run_profiled"]


@dataclass(frozen=True)
class CallCount:
    """Function calls one operation made, in this thread.

    Attributes:
        all: Python and C functions called ("call" and "c_call" profiler events).
        python: Python functions alone ("call" events).
    """

    all: int
    python: int


def run_profiled(fn: Callable[[], Any], hook: Callable[[Any, str, Any], None]) -> None:
    """Run ``fn()`` with ``hook`` as this thread's profiler (``sys.setprofile``), with garbage
    collection off: another object's finalizers must not run inside the measurement."""
    gc.collect()
    gc.disable()
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()


def count_calls(fn: Callable[..., Any], *args: Any) -> CallCount:
    """The calls ``fn(*args)`` makes (:class:`CallCount`)."""
    every = python = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal every, python
        if event in ("call", "c_call"):
            every += 1
            python += event == "call"

    run_profiled(lambda: fn(*args), hook)
    return CallCount(every, python)
