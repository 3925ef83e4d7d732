"""The engine's parts, each with one job, built and driven by :class:`tiered.store.TieredStore`.

None of them imports the facade. docs/architecture.md shows the parts and the path of one
``extend`` and one ``get`` through them.
"""
