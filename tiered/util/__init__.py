"""Shared helpers, the leaf of the package: batch index arithmetic, the worker pool, byte units.

Tiers and codecs both use these, so neither imports the other. Nothing here imports any other
module of the package except :mod:`tiered.errors`.
"""
