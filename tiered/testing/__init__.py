"""Tools for testing tiered and code built on it: conformance suites and inspection helpers.

Not for training code. The inspection helpers look inside a store on purpose (a test of the read
path wants every tier represented in one batch, whatever the placement policy would have done).
"""

from __future__ import annotations

from .inspection import EngineParts, decode_blobs, parts, spread_over_tiers, tier_counts

__all__ = ["EngineParts", "parts", "decode_blobs", "spread_over_tiers", "tier_counts"]
