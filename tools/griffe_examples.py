"""A griffe extension for the API reference (named in mkdocs.yml).

The package's docstrings head their doctest examples ``Example:``, which the Google style parser
reads as a note of plain Markdown: prompts become text and ``[...]`` outputs look like links.
Renamed ``Examples:``, they are parsed as examples and rendered as Python code. The docstrings
themselves are left as they are (``tests/docs/test_docstrings.py`` runs them either way).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section headings to ``Examples:`` in every docstring."""

    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None and "Example:" in obj.docstring.value:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
