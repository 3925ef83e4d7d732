"""Every Python code block of README.md and docs/ runs, or says why it cannot.

A page's ```` ```python ```` blocks run in order, in one namespace (as a reader would paste them
into one session), in a fresh temporary directory. A block preceded by the comment
``<!-- not-run: REASON -->`` (the last non-blank line before its fence) is skipped and counted; the
reason must be given. A comment ``<!-- doc-setup ... -->`` holds Python code a reader does not
need to see (making the example data of a fragment) and runs at its place in the page.

Console sessions (```` ```console ````, ```` ```bash ````) are not run here: ``tests/cli/test_cli.py``
covers the commands.
"""

from __future__ import annotations

import re
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(.*?)\s*-->\s*$")
SETUP = re.compile(r"<!--\s*doc-setup\s*\n(.*?)-->", re.DOTALL)
PYTHON = {"python", "py", "python3"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence (or of the setup comment)
    code: str
    skip_reason: str | None = None
    hidden: bool = False

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The Python blocks and setup comments of ``page``, in page order."""
    text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    found: list[Block] = []
    for m in SETUP.finditer(text):
        found.append(Block(page, text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group(1)), hidden=True))
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if lang.lower() in PYTHON:
            prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            reason = NOT_RUN.match(prev)
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1 : end])
            found.append(Block(page, i + 1, body + "\n", reason.group(1) if reason else None))
        i = end + 1
    return sorted(found, key=lambda b: b.line)


ALL = {page: blocks_of(page) for page in PAGES}
RUNNABLE = [p for p, bs in ALL.items() if any(b.skip_reason is None for b in bs)]


def test_every_not_run_block_says_why():
    for blocks in ALL.values():
        for b in blocks:
            if b.skip_reason is not None:
                assert len(b.skip_reason) >= 10, f"{b.where()}: a not-run block needs a reason, got {b.skip_reason!r}"


def test_the_pages_have_blocks_to_run():
    run = sum(b.skip_reason is None and not b.hidden for bs in ALL.values() for b in bs)
    not_run = sum(b.skip_reason is not None for bs in ALL.values() for b in bs)
    print(f"{run} Python blocks run, {not_run} not run, over {len(ALL)} pages")
    assert run >= 10
    assert (REPO / "README.md") in RUNNABLE


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(REPO)))
def test_page_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict[str, object] = {"__name__": "__doc_blocks__"}
    ran = 0
    for block in ALL[page]:
        if block.skip_reason is not None:
            continue
        try:
            exec(compile(block.code, block.where(), "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the block at {block.where()} failed: {type(e).__name__}: {e}") from e
        ran += 1
    assert ran > 0
    for value in list(namespace.values()):  # release files and locks before tmp_path goes
        close = getattr(value, "close", None)
        if callable(close) and type(value).__module__.startswith("tiered"):
            close()
