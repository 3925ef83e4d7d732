"""The ``tiered`` command line: help, info, verify, exit codes, one-line errors, the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import edit_manifest

import tiered
from tiered import errors as E
from tiered.cli import exit_code_for, main
from tiered.durable.lock import acquire_writer_lock, release
from tiered.durable.manifest import FORMAT_VERSION
from tiered.formats import import_dataset

COMMANDS = ["info", "verify", "import", "export", "demo"]


@pytest.fixture(scope="module")
def pong_store(atari_pong, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    atari_pong.memmap(d / "td")
    import_dataset("torchrl", d / "td", d / "pong.tiered", frames={"observation": 0})
    shutil.rmtree(d / "td")  # 113 MB that no test reads again; the module keeps only the store
    return d / "pong.tiered"


def _script() -> list[str]:
    exe = Path(sys.executable).with_name("tiered")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tiered.cli"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"tiered {command}" in out


def test_top_level_help_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS) and "exit codes" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("tiered ")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["info"], "required: store"),
        (["import", "hdf9", "a", "b"], "unrecognized arguments: b"),
        (["import", "a", "b", "--format", "hdf9"], "invalid choice: 'hdf9'"),
        (["export", "s", "d"], "required: --format"),
        (["import", "SRC", "DST", "--format", "d4rl", "--frames", "observation"], "--frames takes KEY=DIM"),
        (["import", "SRC", "DST"], "needs --format FORMAT (one of d4rl, minari, torchrl, npz, dqn-replay); "),
    ],
)
def test_usage_errors_exit_2(argv, says, capsys, tmp_path):
    if "SRC" in argv:  # a real source, so that only the malformed --frames is wrong
        with h5py.File(tmp_path / "d.hdf5", "w") as f:
            f["observations"] = np.zeros((10, 3), np.float32)
            f["actions"] = np.zeros(10, np.int64)
            f["rewards"] = np.zeros(10, np.float32)
            f["terminals"] = np.zeros(10, bool)
        argv = [str(tmp_path / "d.hdf5") if a == "SRC" else str(tmp_path / "s") if a == "DST" else a
                for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not (tmp_path / "s").exists()


def test_info_shows_schema_ratios_tiers_and_format(pong_store, capsys):
    assert main(["info", str(pong_store)]) == 0
    out = capsys.readouterr().out
    for text in (
        f"tiered v{FORMAT_VERSION}",
        "generation",
        "zstd:3",
        "2,000 of capacity 2,000",
        "observation",
        "uint8",
        "[4, 84, 84]",
        "blob",
        "cold",
        "imported from torchrl",
        "bytes per row",
        "from the files",
    ):
        assert text in out, (text, out)
    assert main(["info", str(pong_store), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == FORMAT_VERSION and doc["rows"] == doc["capacity"] == 2000
    assert doc["codec"] == "zstd:3" and doc["generation"] >= 1
    assert doc["fields"]["observation"]["ratio"] > 20
    assert doc["tiers"]["cold"]["bytes_used"] > 0
    # each blob once (in the cold tier), plus the dense columns: a byte of actions at least
    assert doc["bytes_per_row"] >= doc["tiers"]["cold"]["bytes_used"] / 2000 * 0.9 + 1
    # figures read from the files (no torch): what a process holds is known only once it opens it
    assert doc["resident_bytes"] is None
    assert {f["key"] for f in doc["schema"]} >= {"observation", "next/observation", "action"}


def test_verify_ok_and_json(pong_store, capsys):
    assert main(["verify", str(pong_store), "-q"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(pong_store), "-q", "--json", "--decode"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["blobs_checked"] > 0 and doc["problems"] == []


@pytest.mark.parametrize("name", ["index.codec", "index.refcount", "cold.free_offsets"])
def test_verify_reports_a_commit_without_an_array_of_the_format(pong_store, tmp_path, name, capsys):
    # every array the format writes is required: a manifest that leaves one out is damage, never
    # read with a default in its place
    damaged = tmp_path / "damaged"
    shutil.copytree(pong_store, damaged)

    def drop(body: dict) -> None:  # the array as a commit without it would record it: nowhere
        for names in (body["files"], body["checksums"]["files"], body.get("array_files", {})):
            names.pop(name, None)

    edit_manifest(damaged, drop)
    assert main(["verify", str(damaged), "-q", "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert [p["kind"] for p in doc["problems"]] == ["manifest"], doc["problems"]
    assert name in doc["problems"][0]["message"], doc["problems"]


def test_console_script_exit_codes_and_one_line_errors(pong_store, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(pong_store, damaged)
    seg = damaged / "cold" / "seg-000000.bin"
    data = bytearray(seg.read_bytes())
    data[100:110] = bytes(10)  # the first blobs
    seg.write_bytes(bytes(data))
    # the installed console script (each run pays the import of torch: two runs only)
    bad = subprocess.run([*_script(), "verify", str(damaged), "-q"], capture_output=True, text=True)
    assert bad.returncode == 3 and "checksum" in bad.stdout and "observation" in bad.stdout, bad.stdout
    missing = subprocess.run([*_script(), "info", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.startswith("tiered: error:") and len(missing.stderr.strip().splitlines()) == 1


def test_debug_shows_the_traceback_before_or_after_the_command(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope")]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main(["--debug", "info", str(tmp_path / "nope")]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "nope"), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "a"), str(tmp_path / "b"), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_help_and_version_import_no_torch_and_python_dash_m_works():
    # `tiered --help` must not pay for importing torch: each command imports what it needs
    code = ("import sys; from tiered.cli import main; "
            "assert main(['--help']) == 0 and main(['--version']) == 0 and main(['import', '--help']) == 0; "
            "print(sorted(m for m in ('torch', 'numpy', 'tensordict', 'h5py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[]"), out
    version = subprocess.run([sys.executable, "-m", "tiered", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"tiered {tiered.__version__}"
    usage = subprocess.run([sys.executable, "-m", "tiered", "info"], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: tiered info" in usage.stderr


def _d4rl_file(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f["observations"] = np.arange(30, dtype=np.float32).reshape(10, 3)
        f["actions"] = np.zeros(10, np.int64)
        f["rewards"] = np.ones(10, np.float32)
        f["terminals"] = np.zeros(10, bool)
    return path


def test_import_takes_src_dst_and_format_like_export(tmp_path, capsys):
    src = _d4rl_file(tmp_path / "d.hdf5")
    assert main(["import", str(src), str(tmp_path / "new"), "--format", "d4rl", "-q"]) == 0
    assert main(["info", str(tmp_path / "new"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 10
    # FORMAT SRC DST is not a spelling: refused by the parser, nothing written
    assert main(["import", "d4rl", str(src), str(tmp_path / "old")]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    assert not (tmp_path / "old").exists()
    # without --format: refused, naming the format the source looks like
    assert main(["import", str(src), str(tmp_path / "none")]) == 2
    assert "needs --format FORMAT (one of d4rl" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_info_verify_export_on_a_dataset_suggest_the_import_command(tmp_path, capsys):
    import torch
    from tensordict import TensorDict

    td_dir = tmp_path / "td"
    TensorDict({"observation": torch.zeros(4, 3), "action": torch.zeros(4, dtype=torch.long)}, [4]).memmap(td_dir)
    hdf5 = _d4rl_file(tmp_path / "hopper.hdf5")
    np.savez(tmp_path / "roll.npz", observations=np.zeros((4, 3), np.float32))
    (tmp_path / "empty").mkdir()
    cases = [
        (["info", str(td_dir)], f"Import it first: tiered import {td_dir} td.tiered --format torchrl"),
        (["verify", str(td_dir), "-q"], "--format torchrl"),
        (["info", str(hdf5)], f"tiered import {hdf5} hopper.tiered --format d4rl"),
        (["export", str(tmp_path / "roll.npz"), str(tmp_path / "o.hdf5"), "--format", "d4rl"], "--format npz"),
    ]
    for argv, says in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    # a directory that looks like nothing known gets the plain message
    assert main(["info", str(tmp_path / "empty")]) == 2
    assert "tiered import" not in capsys.readouterr().err
    # the suggested command works as printed
    assert main(["import", str(td_dir), str(tmp_path / "td.tiered"), "--format", "torchrl", "-q"]) == 0


def test_import_force_over_a_locked_store_exits_5(pong_store, tmp_path, capsys):
    target = tmp_path / "t"
    shutil.copytree(pong_store, target)
    with h5py.File(tmp_path / "d.hdf5", "w") as f:
        f["observations"] = np.zeros((10, 3), np.float32)
        f["actions"] = np.zeros(10, np.int64)
        f["rewards"] = np.zeros(10, np.float32)
        f["terminals"] = np.zeros(10, bool)
    h = acquire_writer_lock(target)
    try:
        assert main(["import", str(tmp_path / "d.hdf5"), str(target), "--format", "d4rl", "--force", "-q"]) == 5
        assert f"pid {os.getpid()}" in capsys.readouterr().err
    finally:
        release(h)
    assert main(["import", str(tmp_path / "d.hdf5"), str(target), "--format", "d4rl", "--force", "-q"]) == 0
    assert main(["info", str(target), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 10
    # export --force over a store its writer has open is refused the same way, store untouched
    h = acquire_writer_lock(target)
    try:
        assert main(["export", str(pong_store), str(target), "--format", "npz", "--force", "-q"]) == 5
        assert f"pid {os.getpid()}" in capsys.readouterr().err
    finally:
        release(h)
    assert main(["verify", str(target), "-q"]) == 0
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]


@pytest.mark.parametrize(
    "exc, code",
    [
        (E.ChecksumError("x"), 3),
        (E.CorruptionError("x"), 3),
        (E.FormatVersionError("x"), 6),
        (E.NotATieredStoreError("x"), 2),
        (E.StorageFullError(28, "x"), 4),
        (E.StoreLockedError("x"), 5),
        (E.UnsupportedFormatError("x"), 2),
        (FileNotFoundError("x"), 2),
        (RuntimeError("x"), 1),
    ],
)
def test_exit_code_mapping(exc, code):
    assert exit_code_for(exc) == code


def test_demo_reports_the_benchmarks_measures_without_torchrl_log_lines(capfd):
    pytest.importorskip("torchrl")
    import logging

    level = logging.getLogger("torchrl").level
    assert main(["demo", "--steps", "600", "--batch", "32", "--rounds", "2"]) == 0
    out, err = capfd.readouterr()
    assert "bit-identical samples: True" in out
    # the benchmark's measures, in its words, and what differs from its run
    for words in ("anon RSS growth", "per transition", "LTS / store", "extend 256 (rb)", "sample B=32 (rb)",
                  "benchmarks/bench_storages.py", "Pong only, 600 transitions, 2 rounds", "resident_bytes",
                  "bytes_per_row"):
        assert words in out, (words, out)
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("TieredStorage", "LazyTensor"))}
    assert set(rows) == {"TieredStorage", "LazyTensorStorage"} and "n/a" not in rows["TieredStorage"], out
    assert "[torchrl][INFO]" not in out + err and "Initialized LazyTensorStorage" not in out + err
    assert logging.getLogger("torchrl").level == level  # the user's logging is left as it was


def _benchmark_module(name: str):
    """A script of benchmarks/ as a module (it lives outside the package)."""
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, repo / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(repo / "benchmarks"))
    return module


def test_benchmarks_write_docs_and_the_tracked_fixture_only_when_asked(capsys):
    import argparse

    harness = _benchmark_module("_harness")
    parser = argparse.ArgumentParser()
    harness.add_output_arguments(parser)
    assert harness.wants_docs(parser.parse_args([])) is False  # the default leaves docs/ alone
    assert harness.wants_docs(parser.parse_args(["--write-docs"])) is True
    for old in ("--no-doc", "--no-docs"):  # accepted, do nothing, say so
        assert harness.wants_docs(parser.parse_args([old])) is False
        assert "deprecated and do nothing" in capsys.readouterr().err
    make_fixture = _benchmark_module("make_fixture")
    assert make_fixture.DEFAULT_OUT.parent == harness.OUT_DIR
    tracked = make_fixture.TRACKED
    before = tracked.read_bytes()
    assert make_fixture.main(["--out", str(tracked)]) == 2  # refused before playing anything
    assert "--update-fixture" in capsys.readouterr().err
    assert tracked.read_bytes() == before
