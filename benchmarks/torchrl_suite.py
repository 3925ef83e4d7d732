"""Run TorchRL's own replay-buffer test suite with ``TieredStorage`` standing in for its storages.

Not a CI test (it takes about ten minutes per target on two cores). It needs a checkout of
pytorch/rl whose ``test/rb/`` matches the installed torchrl (the suite at commit ``ae9719f`` runs
against torchrl 0.14.1 unmodified); nothing of that checkout is copied here.

How it works: this file is also a pytest plugin (``-p torchrl_suite``). Before the test modules
are imported, it replaces ``LazyTensorStorage`` (target ``lazy_tensor``) or ``LazyMemmapStorage``
(target ``lazy_memmap``) in ``torchrl.data``, ``torchrl.data.replay_buffers`` and
``torchrl.data.replay_buffers.storages`` with a subclass of :class:`tiered.torchrl.TieredStorage`
that accepts the original constructor. Every test's outcome is logged with whether it built the
substitute; the script then compares each target's run with a baseline run (no substitution),
per test id, and prints the pass count of the storage-building, baseline-passing tests, and the
failures grouped by cause.

Usage::

    python benchmarks/torchrl_suite.py /path/to/pytorch-rl                  # baseline + both targets
    python benchmarks/torchrl_suite.py /path/to/rl --targets lazy_tensor --files test_storages.py
    python benchmarks/torchrl_suite.py /path/to/rl --report-only            # re-read the last logs
    python benchmarks/torchrl_suite.py /path/to/rl --rerun-failed           # rerun the last failures only

Logs go to ``benchmarks/out/torchrl_suite/<target>.jsonl``.

Example:
    >>> classify("test/rb/test_storages.py::test_x[ndim2]", "boom")
    'ndim>1 storages'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "torchrl_suite"
TARGETS = ("lazy_tensor", "lazy_memmap")
_ENV_TARGET = "TIERED_SUITE_TARGET"
_ENV_LOG = "TIERED_SUITE_LOG"

# Causes, first match wins: (name, pattern searched in "test id + failure message").
CAUSES: list[tuple[str, str]] = [
    ("not supported: several writer processes", r"share|shared_init|SharedStorageInit|multiproc|mp_|processes"),
    ("LazyMemmapStorage API (scratch_dir, existsok, cleanup)", r"scratch_dir|existsok|cleanup|memmap_(?:path|dir)"),
    ("ndim>1 storages", r"ndim|\[.*-2-|dim_extend|env_per_collector|parallel_env"),
    ("compilable=True", r"compil"),
    ("tensorclass data", r"tensorclass|TensorClass|MyClass|_is_tensorclass"),
    ("pytree data", r"pytree|tree|\bdict\b|list of|NonTensor"),
    ("checkpointers (Flat/Nested/H5)", r"checkpointer|Checkpointer|H5|h5|Flat|Nested"),
    ("state_dict interchange", r"state_dict"),
    ("update_if_present", r"update_if_present|conditional"),
    ("set_at_/set_/update_", r"set_at_|update_\b|inplace_view|set_\b"),
    ("get(key) / Sequence sample unit", r"Sequence|sample_unit|column"),
    ("schema evolution (new key)", r"SchemaMismatch|new key|write_all|keys differ"),
    ("index field", r"\bindex\b"),
]


def classify(test_id: str, message: str) -> str:
    """The cause a failure is counted under (see :data:`CAUSES`)."""
    text = f"{test_id}\n{message}"
    for name, pattern in CAUSES:
        if re.search(pattern, text):
            return name
    return "other"


# ----------------------------------------------------------------------------------------
# The pytest plugin half (imported by pytest with -p torchrl_suite)
# ----------------------------------------------------------------------------------------
_built = False


def _substitute(target: str) -> None:
    import torchrl.data
    import torchrl.data.replay_buffers
    import torchrl.data.replay_buffers.storages as storages_mod

    from tiered.torchrl import TieredStorage

    name = {"lazy_tensor": "LazyTensorStorage", "lazy_memmap": "LazyMemmapStorage"}[target]

    def init(self, max_size=None, *, device="cpu", ndim=1, compilable=False, scratch_dir=None,
             existsok=False, shared_init=False, auto_cleanup=None, consolidated=False,
             cleanup_memmap=True, **options):
        global _built
        _built = True
        if device == "auto":
            device = "cpu"
        path = None
        if target == "lazy_memmap":
            # LazyMemmapStorage keeps its rows on disk: give the store a directory of its own
            path = os.path.join(tempfile.mkdtemp(prefix="tiered-suite-"), "store")
        TieredStorage.__init__(self, max_size, path, device=device, ndim=ndim, compilable=compilable, **options)

    sub = type(name, (TieredStorage,), {"__init__": init, "__module__": __name__, "__qualname__": name})
    globals()[name] = sub  # picklable by name (spawned workers import this plugin module)
    for mod in (torchrl.data, torchrl.data.replay_buffers, storages_mod):
        setattr(mod, name, sub)


def __getattr__(name: str):
    """The substitute class in a spawned worker (TorchRL sets the ``spawn`` start method): pickle
    finds it by name here, before any ``pytest_configure`` ran in that process."""
    target = os.environ.get(_ENV_TARGET, "none")
    if target != "none" and name == {"lazy_tensor": "LazyTensorStorage", "lazy_memmap": "LazyMemmapStorage"}[target]:
        _substitute(target)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pytest_configure(config) -> None:  # pragma: no cover - runs inside the suite's pytest
    target = os.environ.get(_ENV_TARGET, "none")
    if target != "none":
        _substitute(target)


def pytest_runtest_setup(item) -> None:  # pragma: no cover
    global _built
    _built = False


def pytest_runtest_logreport(report) -> None:  # pragma: no cover
    log = os.environ.get(_ENV_LOG)
    if not log:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        message = ""
        if report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)[-2000:]
        outcome = "xfail" if hasattr(report, "wasxfail") else report.outcome
        with open(log, "a") as f:
            f.write(json.dumps({"id": report.nodeid, "outcome": outcome, "built": _built,
                                "message": message[:2000]}) + "\n")


# ----------------------------------------------------------------------------------------
# The script half
# ----------------------------------------------------------------------------------------
def _run(checkout: Path, target: str, files: list[str], extra: list[str], timeout: int,
         ids: list[str] | None = None) -> float:
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / (f"{target}.rerun.jsonl" if ids is not None else f"{target}.jsonl")
    log.unlink(missing_ok=True)
    env = dict(os.environ)
    env[_ENV_TARGET] = target
    env[_ENV_LOG] = str(log)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    paths = [str(checkout / "test" / "rb" / f) for f in files] if files else [str(checkout / "test" / "rb")]
    if ids is not None:
        paths = ids
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "torchrl_suite", "-p", "no:cacheprovider",
           "--timeout", str(timeout), *extra]
    start = time.perf_counter()
    print(f"[{target}] {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _load(target: str) -> dict[str, dict]:
    """A run's outcomes per test id; a later rerun of some of them (``--rerun-failed``) wins."""
    out = {}
    for log in (OUT / f"{target}.jsonl", OUT / f"{target}.rerun.jsonl"):
        if log.exists():
            for line in log.read_text().splitlines():
                rec = json.loads(line)
                out[rec["id"]] = rec
    return out


def _failed_ids(target: str) -> list[str]:
    base, got = _load("none"), _load(target)
    return sorted(i for i, r in got.items() if r["built"] and r["outcome"] != "passed"
                  and base.get(i, {}).get("outcome") == "passed")


def report(targets: list[str]) -> dict:
    """Compare each target's log with the baseline log; print and return the counts."""
    base = _load("none")
    summary = {}
    for target in targets:
        got = _load(target)
        built = [i for i, r in got.items() if r["built"] and base.get(i, {}).get("outcome") == "passed"]
        passed = [i for i in built if got[i]["outcome"] == "passed"]
        failed = [i for i in built if got[i]["outcome"] != "passed"]
        causes = Counter(classify(i, got[i]["message"]) for i in failed)
        not_built_failed = [i for i, r in got.items() if not r["built"] and r["outcome"] == "failed"
                            and base.get(i, {}).get("outcome") == "passed"]
        share = 100.0 * len(passed) / max(1, len(built))
        print(f"\n== {target}: {len(passed)} of {len(built)} baseline-passing tests that build the storage "
              f"pass ({share:.1f}%); {len(got)} tests ran; {len(not_built_failed)} other regressions")
        for cause, n in causes.most_common():
            print(f"   {n:5d}  {cause}")
        examples = defaultdict(list)
        for i in failed:
            examples[classify(i, got[i]["message"])].append((i, got[i]["message"].splitlines()[0][:160]
                                                             if got[i]["message"] else ""))
        summary[target] = {"built": len(built), "passed": len(passed), "causes": dict(causes),
                           "examples": {k: v[:5] for k, v in examples.items()},
                           "other_regressions": not_built_failed[:20]}
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkout", type=Path, help="a checkout of pytorch/rl (its test/rb/ is run)")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--files", nargs="*", default=[], help="test files under test/rb/ (default: all)")
    p.add_argument("--no-baseline", action="store_true", help="reuse the last baseline log")
    p.add_argument("--baseline-only", action="store_true", help="run only the baseline (no substitution)")
    p.add_argument("--report-only", action="store_true", help="only compare the last logs")
    p.add_argument("--rerun-failed", action="store_true",
                   help="rerun only the failures of each target's last run (logged to <target>.rerun.jsonl, "
                   "whose outcomes then replace them in the report)")
    p.add_argument("--timeout", type=int, default=120, help="per-test timeout in seconds")
    p.add_argument("-k", default=None, help="pytest -k expression")
    args = p.parse_args(argv)
    if not (args.checkout / "test" / "rb").is_dir():
        p.error(f"{args.checkout} has no test/rb/: pass the root of a pytorch/rl checkout")
    extra = ["-k", args.k] if args.k else []
    if args.rerun_failed:
        for target in args.targets:
            (OUT / f"{target}.rerun.jsonl").unlink(missing_ok=True)
            ids = _failed_ids(target)
            if ids:
                secs = _run(args.checkout, target, [], extra, args.timeout, ids=ids)
                print(f"[{target}] reran {len(ids)} failures: {secs:.0f} s", flush=True)
    elif not args.report_only:
        runs = ([] if args.no_baseline else ["none"]) + ([] if args.baseline_only else list(args.targets))
        for target in runs:
            secs = _run(args.checkout, target, args.files, extra, args.timeout)
            print(f"[{target}] {secs:.0f} s", flush=True)
    report(args.targets)


if __name__ == "__main__":
    main()
