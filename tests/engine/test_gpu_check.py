"""benchmarks/gpu_check.py on CPU: its stage machinery survives what a GPU run can throw at it.

The GPU check runs each stage in a child process under a hard limit, so a hang or a crash in
one stage (a sticky CUDA error, a segfault in a native library) costs that stage only. These
tests run its ``--cpu-dry-run`` with the test hooks ``--inject-hang`` and ``--inject-crash`` and
check what a reader of a real run relies on: the preflight line, each stage's verdict and
partial output as it happens, the later stages still running, and the JSON written after every
stage. The injections happen before a stage imports anything heavy, so the runs are cheap.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # results only under `out`
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=900)


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    """One dry run: preflight, a hang in probe, a segfault in tiers, then interop."""
    out = tmp_path_factory.mktemp("gpu_check")
    res = run_check(out, "--only", "preflight,probe,tiers,interop", "--inject-hang", "probe",
                    "--inject-crash", "tiers:segv", "--stage-limit", "probe=5")
    return res, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.log").read_text()


def test_preflight_line_comes_first_and_every_stage_reports(injected):
    res, data, log = injected
    out = res.stdout
    assert out.index("PREFLIGHT python") < out.index("[probe] start"), out[-3000:]
    assert "[preflight] ok" in out
    assert list(data["stages"]) == ["preflight", "probe", "tiers", "interop"]
    env = data["results"]["preflight"]["env"]
    assert env["torch"] and "dry run" in env["device"]
    assert log.splitlines()[0].startswith("gpu_check: cpu-dry-run")  # the log holds what was printed
    assert "PREFLIGHT python" in log and "[interop] ok" in log


def test_a_hung_stage_is_killed_at_its_limit_with_stacks_and_partial_results(injected):
    res, data, _ = injected
    probe = data["stages"]["probe"]
    assert probe["status"] == "timeout" and probe["limit_s"] == 5, probe
    assert "most recent call first" in probe["output_tail"]  # faulthandler's dump before the kill
    assert data["results"]["probe"]["partial"] == "written before the injected hang"
    assert "[probe] TIMEOUT" in res.stdout


def test_a_crashed_stage_is_reported_and_later_stages_still_run(injected):
    res, data, _ = injected
    tiers = data["stages"]["tiers"]
    assert tiers["status"] == "crashed" and tiers["signal"] == "SIGSEGV", tiers
    assert "Fatal Python error" in tiers["output_tail"]
    assert data["results"]["tiers"]["partial"] == "written before the injected crash"
    interop = data["stages"]["interop"]
    assert interop["status"] == "ok", interop
    checks = data["results"]["interop"]
    assert checks and all(v["ok"] for v in checks.values()), checks
    assert "OK   zstd CPU round trip" in res.stdout  # a stage's lines print as they come
    assert res.returncode == 1  # failed stages make the run fail, after the report
    assert "stages: preflight=ok, probe=timeout, tiers=crashed, interop=ok" in res.stdout


def test_the_overall_budget_cuts_a_stage_and_skips_the_rest(tmp_path):
    res = run_check(tmp_path, "--only", "preflight,interop", "--budget", "7", "--inject-hang", "preflight",
                    "--stage-limit", "preflight=100")
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    cut = data["stages"]["preflight"]
    assert cut["status"] == "timeout" and cut["limit_s"] < 7, cut  # the budget, not its own limit
    assert data["stages"]["interop"]["status"] == "skipped", data["stages"]
    assert "[interop] SKIPPED" in res.stdout


def test_bad_hook_arguments_are_refused(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--inject-hang", "nope"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--stage-limit", "tiers"])
    args = gpu_check.parse_args(["--cpu-dry-run", "--stage-limit", "tiers=7"])
    assert args.limits == {"tiers": 7.0} and args.budget == 600 and args.rows == 12_000
