"""Every docstring example in the package runs and prints what it says.

The examples are the first code a user copies, so they are tests like any other. Examples that
create files call ``tempfile.mkdtemp()``; here that lands in the test's ``tmp_path`` so nothing
is left behind in the system temp directory.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import tempfile

import pytest

import tiered
from tiered import codecs


def _modules_with_examples() -> list[str]:
    finder = doctest.DocTestFinder()
    names = []
    for info in pkgutil.walk_packages(tiered.__path__, "tiered."):
        module = importlib.import_module(info.name)
        if any(t.examples for t in finder.find(module)):
            names.append(info.name)
    return names


MODULES = _modules_with_examples()


def test_the_public_modules_have_examples():
    for name in ("tiered.store", "tiered.torchrl", "tiered.cli", "tiered.verify", "tiered.formats",
                 "tiered.engine.gpu_read", "tiered.prefetch", "tiered.codecs", "tiered.tiers", "tiered.atari"):
        assert name in MODULES, f"{name} has no docstring example"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # examples may register codecs; keep the registry as it was for the other tests
    monkeypatch.setattr(codecs, "_FACTORIES", dict(codecs._FACTORIES))
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=False)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (run it with -s)"
