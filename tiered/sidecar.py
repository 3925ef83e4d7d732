"""The import sidecar of a store: ``source.json``, written by ``tiered import`` (numpy/torch-free).

Read by ``tiered info`` (which must not wait for torch) and by ``tiered export``.

Example:
    >>> import tempfile
    >>> read_source(tempfile.mkdtemp()) is None  # a store not made by `tiered import`
    True
"""

from __future__ import annotations

import json
import os
from typing import Any

from .errors import CorruptionError

__all__ = ["SOURCE_FILE", "read_source"]

#: Name of the sidecar a store made by ``tiered import`` keeps next to its manifest: where the
#: data came from (format, original names, dtypes, shapes, file metadata) and which fields the
#: import derived, so that ``tiered export`` to the same format is the exact inverse.
SOURCE_FILE = "source.json"


def read_source(store_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The import sidecar of a store, or ``None`` (store not made by ``tiered import``).

    Raises:
        CorruptionError: the sidecar exists but is not valid JSON.
    """
    path = os.path.join(os.fspath(store_path), SOURCE_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CorruptionError(
            f"{path}: the import sidecar is not valid JSON; delete it to export with the default key mapping"
        ) from None
    return doc if isinstance(doc, dict) else None
