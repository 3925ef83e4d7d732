"""The version of tiered, in a module of its own so that any module can read it without
importing the package root.

Example:
    >>> from tiered.version import __version__
    >>> __version__.count(".")
    2
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
