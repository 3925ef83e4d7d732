"""The commands that only read files (`tiered verify`, `tiered info`) load neither torch nor tensordict.

The import cases run the CLI's ``main`` in a fresh interpreter on a small store made here, then
list the heavy modules that interpreter loaded. The figure cases check that what ``tiered info``
reads from the files alone is what the store, opened, reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.cli import main
from tiered.durable.commit_arrays import array_path
from tiered.durable.manifest import read_manifest
from tiered.durable.summary import read_summary
from tiered.engine.figures import DTYPE_NBYTES

HEAVY = ("torch", "tensordict")

_PROBE = f"""
import contextlib, io, json, sys
from tiered.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    rc = main(sys.argv[1:])
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules), "err": err.getvalue()}}))
"""


def _run_cli(*argv: str) -> dict:
    """``{"rc", "heavy", "err"}`` of ``tiered *argv`` run in a fresh interpreter (stderr in ``err``)."""
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
    assert result["rc"] == 0 and result["heavy"] == [], result


def test_verify_open_imports_torch_and_still_passes(small_store):
    result = _run_cli("verify", "-q", "--open", str(small_store))
    assert result["rc"] == 0 and "torch" in result["heavy"]


def test_info_imports_neither_torch_nor_tensordict(small_store):
    result = _run_cli("info", str(small_store))
    assert result["rc"] == 0 and result["heavy"] == [], result


def _frames(n: int, seed: int) -> torch.Tensor:
    """``[n, 4, 84, 84]`` frame stacks with repeats, as Atari stacks repeat their frames."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 255, ((n + 3) // 3 + 1, 84, 84), dtype=torch.uint8, generator=g)
    frames = base.repeat_interleave(3, dim=0)[: n + 3]
    return torch.stack([frames[i : i + n] for i in range(4)], dim=1)


def _rows(n: int, seed: int) -> TensorDict:
    obs = _frames(n + 1, seed)
    done = torch.zeros(n, dtype=torch.bool)
    done[n // 2] = True
    return TensorDict({
        "observation": obs[:-1], "action": torch.arange(n) % 6, "reward": torch.arange(n) / 4, "done": done,
        "next": {"observation": obs[1:], "done": done.clone(), "reward": torch.rand(n)},
    }, [n])


STORES = {
    "memmap, stacked frames, flags, narrowed, overwritten": dict(
        frames={"observation": 0, ("next", "observation"): 0}, dense_dtypes={"reward": "float16"}, chunk_frames=4),
    "hdf5": dict(backend="hdf5"),
    "fifo, single frames, no dedup": dict(policy="fifo", chunk_frames=1, dedup=False),
}


def _opened_figures(path) -> dict:
    with tiered.open(path, mode="r", warm_bytes=0, hot_bytes=0) as store:
        st = store.stats()
        schema = [dict(f.to_json(), key="/".join(f.key)) for f in store.schema.values()] if store.schema else []
    return {"rows": st["rows"], "capacity": st["capacity"], "blobs": st["blobs"], "schema": schema,
            "fields": st["fields"], "tiers": st["tiers"]}


@pytest.mark.parametrize("name", list(STORES))
def test_info_figures_without_torch_are_the_opened_stores(tmp_path, name):
    path = tmp_path / "s"
    with TieredStore(48, path, **STORES[name]) as store:
        store.extend(_rows(48, seed=0))
        store.flush()
        for i, rows in enumerate(([5, 20, 35], [9, 40])):  # overwritten rows: holes between kept blobs
            store.set(torch.tensor(rows), _rows(len(rows), seed=1 + i))
            store.flush()
        store.flush(force=True)
        if not name.startswith("fifo"):
            store.extend(_rows(30, seed=3))  # past the capacity: the oldest rows are overwritten
    summary = read_summary(str(path), read_manifest(str(path)))
    assert summary is not None
    # what a process holds is known only once it opened the store; the files' figure is positive
    assert summary.pop("resident_bytes") is None and summary.pop("bytes_per_row") > 0
    assert json.dumps(summary) == json.dumps(_opened_figures(path))
    if name.startswith("fifo"):  # one blob per frame: the holes fragment the cold tier's free space
        assert summary["tiers"]["cold"]["fragmentation"] > 0


def test_info_figures_of_an_empty_store(tmp_path):
    TieredStore(10, tmp_path / "s").close()
    summary = read_summary(str(tmp_path / "s"), read_manifest(str(tmp_path / "s")))
    assert summary.pop("resident_bytes") is None and summary.pop("bytes_per_row") == 0.0
    assert summary == _opened_figures(tmp_path / "s") and summary["fields"] == {} and summary["rows"] == 0


def test_info_opens_the_store_where_the_files_alone_do_not_say(tmp_path, capsys):
    """Row priorities weigh the tiers' sampling mass: `tiered info` then opens the store."""
    path = tmp_path / "p"
    with TieredStore(32, path, policy="priority") as store:
        store.extend(_rows(20, seed=0))
        store.set_priority(slice(0, 10), 3.0)
    assert read_summary(str(path), read_manifest(str(path))) is None
    assert main(["info", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fields"] == _opened_figures(path)["fields"] and doc["rows"] == 20


def test_info_on_a_damaged_index_still_reports_what_opening_reports(tmp_path, capsys):
    """A damaged index file: the summary declines, and the open names the damage as before."""
    path = tmp_path / "d"
    with TieredStore(32, path) as store:
        store.extend(_rows(20, seed=0))
    body = read_manifest(str(path))
    damaged = Path(array_path(str(path), body, "index.nbytes"))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert read_summary(str(path), body) is None
    assert main(["info", str(path)]) != 0
    assert "index.nbytes" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_dtype_sizes_match_torch():
    from tiered.schema import SUPPORTED_DTYPES, dtype_to_str

    assert {dtype_to_str(d): torch.empty((), dtype=d).element_size() for d in SUPPORTED_DTYPES} == {
        name: n for name, n in DTYPE_NBYTES.items() if name in {dtype_to_str(d) for d in SUPPORTED_DTYPES}}


def test_info_on_a_dataset_names_the_import_command_without_torch(tmp_path):
    import numpy as np

    np.savez(tmp_path / "roll.npz", observations=np.zeros((4, 3), np.float32))
    result = _run_cli("info", str(tmp_path / "roll.npz"))
    assert result["rc"] == 2 and result["heavy"] == [] and "--format npz" in result["err"], result
