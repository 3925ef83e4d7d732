"""Tools for testing tiered and code built on it: conformance suites and inspection helpers.

Not for training code. The inspection helpers look inside a store on purpose (a test of the read
path wants every tier represented in one batch, whatever the placement policy would have done).

The conformance suites (:class:`CodecTests`, :class:`TierTests`, :class:`PolicyTests`, see
:mod:`tiered.testing.suites`) are base classes a test module subclasses with a factory; they
need pytest, which is imported only when one of them is first used, so ``import tiered.testing``
works without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from .calls import CallCount, count_calls, run_profiled
from .inspection import EngineParts, decode_blobs, parts, spread_over_tiers, tier_counts

if TYPE_CHECKING:
    from .suites import BlobHistory, CodecTests, PolicyTests, TierTests

__all__ = ["CallCount", "count_calls", "run_profiled", "EngineParts", "parts", "decode_blobs", "spread_over_tiers", "tier_counts", "CodecTests", "TierTests", "PolicyTests", "BlobHistory"]

_SUITES = "tiered.testing.suites"
_SUITE_NAMES = {"CodecTests", "TierTests", "PolicyTests", "BlobHistory"}


def __getattr__(name: str) -> Any:
    if name not in _SUITE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _SUITES not in sys.modules and importlib.util.find_spec("pytest") is not None:
        import pytest

        # pytest rewrites the suites' asserts (detailed failure messages) if told before the import
        pytest.register_assert_rewrite(_SUITES)
    return getattr(importlib.import_module(_SUITES), name)
