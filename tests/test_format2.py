"""Format 2: a v1 golden store upgrades (``tiered upgrade``) and reads the same rows; commits
after the first ones write what changed, not the whole store."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import torch
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.cli import main
from tiered.verify import verify_store

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "stores"


def _body(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())["body"]


def test_a_v1_store_upgrades_and_reads_the_same_rows(tmp_path, capsys):
    with tarfile.open(GOLDEN / "memmap_k4.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    path = tmp_path / "memmap_k4"
    assert _body(path)["format_version"] == 1
    with tiered.open(path) as old:
        before = old.get(torch.arange(len(old)))
    assert main(["upgrade", str(path)]) == 0
    assert "upgraded" in capsys.readouterr().out
    assert _body(path)["format_version"] == 2
    with tiered.open(path) as new:
        after = new.get(torch.arange(len(new)))
    assert all(torch.equal(before.get(k), after.get(k)) for k in before.keys(True, True))
    assert verify_store(path, progress=False).ok
    assert main(["upgrade", str(path)]) == 0 and "nothing to do" in capsys.readouterr().out


def test_a_commit_writes_what_changed(tmp_path):
    n = 40_000
    obs = torch.randint(0, 255, (n, 4, 8, 8), dtype=torch.uint8)
    td = TensorDict({"observation": obs, "action": torch.arange(n), ("next", "observation"): obs}, [n])
    path = tmp_path / "s"
    with TieredStore(n, path, frames={"observation": 0}) as s:
        s.extend(td)
        s.flush()
        s.extend(td[:100])
        s.flush()
        first = sum(f.stat().st_size for f in (path / "arrays").glob("*.0.npy"))
        s.extend(td[100:200])
        s.flush()
    with tiered.open(path, "r+") as w:
        w.extend(td[200:300])
        w.flush()
        assert 0 < w._files.last_commit_bytes < first / 2  # noqa: SLF001 - the bytes a commit wrote
    with tiered.open(path) as r:
        got = r.get(torch.arange(300))
    assert torch.equal(got["observation"], obs[:300]) and torch.equal(got["action"], torch.arange(300))
    assert verify_store(path, progress=False).ok
