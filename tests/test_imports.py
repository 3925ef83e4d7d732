"""The commands that only read files (`tiered verify`, `tiered info`) load neither torch nor tensordict.

Each case runs the CLI's ``main`` in a fresh interpreter on a small store made here, then lists
the heavy modules that interpreter loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

from tiered import TieredStore

HEAVY = ("torch", "tensordict")

_PROBE = f"""
import json, sys
from tiered.cli import main
rc = main(sys.argv[1:])
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""


def _run_cli(*argv: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("imports") / "s"
    with TieredStore(100, path) as store:
        store.extend(TensorDict({"pixels": torch.arange(10, dtype=torch.uint8).view(10, 1, 1).expand(10, 84, 84),
                                 "reward": torch.arange(10.0), "done": torch.zeros(10, dtype=torch.bool)}, [10]))
    return path


@pytest.mark.parametrize("argv", [["verify", "-q"], ["verify", "-q", "--decode"]])
def test_verify_imports_neither_torch_nor_tensordict(small_store, argv):
    result = _run_cli(*argv, str(small_store))
    assert result == {"rc": 0, "heavy": []}


def test_verify_open_imports_torch_and_still_passes(small_store):
    result = _run_cli("verify", "-q", "--open", str(small_store))
    assert result["rc"] == 0 and "torch" in result["heavy"]
