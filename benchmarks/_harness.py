"""Shared helpers for the CPU benchmarks: machine facts, background load, memory, tables, docs.

The benchmarks compare storages side by side in one run on small, noisy VMs, so every number
they print needs its context: which machine, what else was running on it (another process
holding one of two cores stalls torch's thread pool), and
how memory was counted. These helpers gather that context once so each benchmark script stays
about what it measures.

Example:
    >>> from benchmarks._harness import CpuMeter, median
    >>> meter = CpuMeter()
    >>> busy = sum(range(10**5))
    >>> meter.stop()["other_cores"] >= 0.0  # doctest: +SKIP
    True
    >>> median([3.0, 1.0, 2.0])
    2.0
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import gc
import math
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "benchmarks" / "out"
DOC_PATH = REPO / "docs" / "benchmarks.md"
# ALE games of the benchmarks' default data, in order (a game's seed is its position)
DEFAULT_GAMES = ["Pong", "Breakout", "SpaceInvaders", "MsPacman", "Seaquest"]


def ensure_repo_on_path() -> None:
    """Let ``import tiered`` work from a checkout that is not installed in the venv."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------------
# Machine facts
# ------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as e:  # any import failure is a fact to report, not a reason to stop
        return f"unavailable ({type(e).__name__})"
    return str(getattr(mod, "__version__", "unknown"))


def machine_facts(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CPU model, cores, RAM, versions, date and the command line, as a flat dict."""
    import torch

    vm = psutil.virtual_memory()
    argv = list(sys.argv if argv is None else argv)
    return {
        "cpu_model": _cpu_model(),
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": vm.total,
        "ram_available_bytes": vm.available,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torchrl": _version("torchrl"),
        "tensordict": _version("tensordict"),
        "tiered": _version("tiered"),
        "numpy": _version("numpy"),
        "zstandard": _version("zstandard"),
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *argv]),
    }


# ------------------------------------------------------------------------------------------
# Background load
# ------------------------------------------------------------------------------------------
def _busy_seconds(t: Any) -> float:
    """System-wide CPU seconds not idle and not waiting on I/O; steal is counted separately."""
    idle = t.idle + getattr(t, "iowait", 0.0)
    steal = getattr(t, "steal", 0.0)
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return sum(t) - idle - steal - guest


def _own_seconds() -> float:
    """CPU seconds of this process and its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuMeter:
    """CPU used by *other* processes over an interval, in cores, plus hypervisor steal.

    ``other_cores`` is (all busy CPU time - this process tree's CPU time) / wall time; on a
    2-core VM, 1.0 means some other process held a whole core throughout. ``steal_pct`` is the
    share of time the hypervisor gave our vCPUs to someone else.
    """

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._sys0 = psutil.cpu_times()
        self._own0 = _own_seconds()

    def stop(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        sys1 = psutil.cpu_times()
        own = _own_seconds() - self._own0
        busy = _busy_seconds(sys1) - _busy_seconds(self._sys0)
        steal = getattr(sys1, "steal", 0.0) - getattr(self._sys0, "steal", 0.0)
        ncpu = psutil.cpu_count(logical=True) or 1
        return {
            "wall_s": wall,
            "own_cores": own / wall,
            "other_cores": max(busy - own, 0.0) / wall,
            "steal_pct": 100.0 * steal / (wall * ncpu),
        }


def load_snapshot(interval: float = 1.0, top: int = 3) -> dict[str, Any]:
    """Load average, total CPU% and the busiest other processes over ``interval`` seconds."""
    me = os.getpid()
    procs = []
    for p in psutil.process_iter(["pid", "name"]):
        if p.info["pid"] == me:
            continue
        try:
            p.cpu_percent(None)
            procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    meter = CpuMeter()
    psutil.cpu_percent(None)
    time.sleep(interval)
    total = psutil.cpu_percent(None)
    usage = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if pct > 0.5:
            usage.append((pct, p.info["name"], p.info["pid"]))
    usage.sort(reverse=True)
    m = meter.stop()
    return {
        "loadavg": list(os.getloadavg()),
        "cpu_percent_total": total,
        "other_cores": m["other_cores"],
        "steal_pct": m["steal_pct"],
        "top_other": [{"name": n, "pid": pid, "cpu_percent": round(pct, 1)} for pct, n, pid in usage[:top]],
    }


def describe_load(snap: dict[str, Any]) -> str:
    """One line for a :func:`load_snapshot` result."""
    la = ", ".join(f"{x:.2f}" for x in snap["loadavg"])
    others = ", ".join(f"{t['name']} {t['cpu_percent']:.0f}%" for t in snap["top_other"]) or "none"
    return (
        f"loadavg {la}; CPU {snap['cpu_percent_total']:.0f}% of all cores; "
        f"other processes {snap['other_cores']:.2f} cores (busiest: {others}); steal {snap['steal_pct']:.1f}%"
    )


# ------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------
def proc_status_bytes() -> dict[str, int]:
    """RssAnon, RssFile, RssShmem and VmRSS of this process in bytes (Linux ``/proc``)."""
    out: dict[str, int] = {}
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        mi = psutil.Process().memory_full_info()
        return {"RssAnon": int(getattr(mi, "uss", mi.rss)), "VmRSS": int(mi.rss)}
    for key in ("RssAnon", "RssFile", "RssShmem", "VmRSS"):
        m = re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.MULTILINE)
        if m:
            out[key] = int(m.group(1)) * 1024
    return out


def release_memory() -> None:
    """Collect garbage and hand glibc's free heap pages back, so RSS counts what is held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def dir_bytes(path: str | os.PathLike[str]) -> dict[str, int]:
    """Apparent size and allocated (on disk) size of every file under ``path``."""
    apparent = allocated = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return {"apparent": apparent, "allocated": allocated}


# ------------------------------------------------------------------------------------------
# Statistics and formatting
# ------------------------------------------------------------------------------------------
def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of a non-empty sequence."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: Sequence[float]) -> float:
    return quantile(xs, 0.5)


def fmt_rate(x: float | None) -> str:
    """Transitions per second, short: ``950``, ``12.3k``, ``1.20M``."""
    if x is None or x != x:
        return "n/a"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    if x >= 1e3:
        return f"{x / 1e3:.2f}k"
    return f"{x:.0f}"


def fmt_bytes(x: float | None) -> str:
    """Bytes with a binary-free SI unit (kB = 1000 B), as the 1 GB claim is stated."""
    if x is None or x != x:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_ratio(x: float | None) -> str:
    if x is None or x != x:
        return "n/a"
    if x >= 100:
        return f"{x:.0f}x"
    if x >= 10:
        return f"{x:.1f}x"
    return f"{x:.2f}x"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; also readable as plain text."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(str(h))] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = "| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


# ------------------------------------------------------------------------------------------
# Outputs: benchmarks/out/ always, docs/benchmarks.md only when asked
# ------------------------------------------------------------------------------------------
def add_output_arguments(parser: Any) -> None:
    """``--write-docs``, the one spelling in every script; the old opt-outs stay accepted.

    Results always go to ``benchmarks/out/`` (ignored by git); the tracked docs change only when
    a run is asked to write them.
    """
    parser.add_argument("--write-docs", action="store_true",
                        help="also write this script's section of docs/benchmarks.md "
                             "(results always go to benchmarks/out/)")
    # deprecated: the docs used to be written by default, with these to opt out
    parser.add_argument("--no-docs", "--no-doc", dest="no_docs", action="store_true", help=argparse.SUPPRESS)


def wants_docs(args: Any) -> bool:
    """Whether to write docs/benchmarks.md (``--write-docs``); notes a deprecated opt-out."""
    if getattr(args, "no_docs", False):
        print("note: --no-docs/--no-doc are deprecated and do nothing: docs/benchmarks.md is written "
              "only with --write-docs", file=sys.stderr)
    return bool(args.write_docs)


def write_output(name: str, text: str) -> Path:
    """Write ``benchmarks/out/<name>`` (created if needed); return its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------
# docs/benchmarks.md
# ------------------------------------------------------------------------------------------
def write_doc_section(body: str, begin: str, end: str, path: Path = DOC_PATH) -> None:
    """Replace the text between the markers ``begin``/``end`` in ``path`` (append if absent).

    Other benchmarks own other sections of the same file; only this one is touched.
    """
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if path.exists():
        text = path.read_text()
        i, j = text.find(begin), text.find(end)
        if i >= 0 and j > i:
            text = text[:i] + block + text[j + len(end) :]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
    else:
        text = (
            "# Benchmarks\n\nMeasured results of the scripts in `benchmarks/`; each section is written "
            "by its script.\n\n" + block + "\n"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------
def load_atari(games: Sequence[str], n: int, per_game_rollout: int) -> Any:
    """``n`` transitions: the first ``ceil(n / games)`` of each game's cached rollout of
    ``per_game_rollout`` steps, concatenated (seeds are the game's position in ``games``, so the
    default list matches the cached files)."""
    from tiered.atari import cached_rollout, concat_rollouts

    per_game = math.ceil(n / len(games))
    parts = []
    for seed, game in enumerate(games):
        td = cached_rollout(game, per_game_rollout, seed)
        parts.append(td[:per_game].clone())  # clone: free the rest of the rollout now
        del td
    data = concat_rollouts(parts)
    return data[:n].clone() if data.batch_size[0] > n else data


#: the committed real Atari rows (Pong, MsPacman, Breakout) that several benchmarks tile
ATARI_FIXTURE = Path(__file__).resolve().parent / "data" / "atari_frames.npz"


def tiled_atari_rows(copies: int, fixture: Path = ATARI_FIXTURE) -> Any:
    """The fixture's rows ``copies`` times; copy ``k`` has its frames XORed with ``k`` and its
    trajectory ids moved past the others, so copies neither deduplicate nor share trajectories."""
    import torch

    from tiered.atari import load_fixture

    data = load_fixture(fixture)
    parts = []
    top = int(data.get(("collector", "traj_ids")).max()) + 1
    for k in range(copies):
        part = data.clone()
        if k:
            for key in ("observation", ("next", "observation")):
                part.set(key, part.get(key) ^ k)
            part.set(("collector", "traj_ids"), part.get(("collector", "traj_ids")) + k * top)
        parts.append(part)
    return torch.cat(parts)


def row_bytes(data: Any) -> int:
    """Logical (uncompressed) bytes of one transition of a TensorDict ``[n]``."""
    return sum(v.numel() * v.element_size() for v in data.values(True, True)) // data.batch_size[0]
