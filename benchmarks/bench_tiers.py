"""Where the sampled blobs live: warm memory, cold files in the page cache, or cold on disk.

One run builds several stores of the same real Atari transitions and samples them side by side,
round by round, on the same random indices (B=256, fresh indices every round, a new store order
every round):

- ``warm (no path)``: ``TieredStore(N, frames={"observation": 0}, warm_bytes=<all>)``: the
  exclusive in-memory layout, every blob in the warm tier;
- ``warm (path)``: the same with a path; cold holds everything, warm caches all of it;
- ``cold, page cache warm``: a path, ``warm_bytes=4096``, ``promote=False``: every blob is
  read from the segment files with ``preadv``, which the page cache answers;
- ``cold, disk``: the same, with ``posix_fadvise(DONTNEED)`` on the store's files before each
  batch, so the reads go to the disk; once as tiered leaves its fds (it sets
  ``POSIX_FADV_RANDOM`` on every segment fd: no read-ahead), and once on a twin store whose
  segment fds the benchmark sets to ``POSIX_FADV_NORMAL`` (the kernel's read-ahead on), to show
  what the advice saves;
- ``LRU mix``: a path, ``policy="lru"``, a warm budget of ~25% of the compressed bytes,
  ``promote=True``: the share of warm hits an LRU cache gives under uniform sampling;
- TorchRL's ``LazyMemmapStorage`` with its files in the page cache, and cold (its mappings
  dropped with ``madvise(MADV_DONTNEED)`` and its files with ``posix_fadvise(DONTNEED)`` before
  each batch), once with the default read-ahead and once with ``madvise(MADV_RANDOM)``.

For the two cold-disk stores the bytes read from the disk per batch are the ``read_bytes``
deltas of ``/proc/self/io`` around ``get`` (real block-device reads, read-ahead included); the
bytes *requested* are the ``rchar`` delta for tiered (what its ``preadv`` calls asked for,
coalescing gaps included) and the rows' logical bytes for LazyMemmapStorage (it reads by page
faults, which ``rchar`` does not count).

Also measured: the reopen time of a 100k-row store (``tiered.open(path)``; built by tiling the
real frames, each copy XOR-ed with its copy number so it does not deduplicate against the
others), with the page cache warm and after dropping it; and a store whose compressed data is
over 10x its hot+warm budgets, read completely and compared bit for bit with the source rows.

Usage:
    python benchmarks/bench_tiers.py              # default run (~2.5-4 min on 2 cores)
    python benchmarks/bench_tiers.py --write-docs # ... and update docs/benchmarks.md
    python benchmarks/bench_tiers.py --quick      # ~1 min, checks that the script works
    python benchmarks/bench_tiers.py --steps 40000 --rounds 60

Results: a table on stdout, raw numbers in ``benchmarks/out/bench_tiers.json`` and the report in
``benchmarks/out/bench_tiers.md`` (``--quick``: ``bench_tiers_quick.*``). Only with
``--write-docs`` does the report also replace the section between ``<!-- bench_tiers:begin -->`` /
``<!-- bench_tiers:end -->`` of ``docs/benchmarks.md``. Targets are printed PASS/FAIL and never
change the exit status.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import plots  # noqa: E402

H.ensure_repo_on_path()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDictBase  # noqa: E402

BEGIN = "<!-- bench_tiers:begin -->"
END = "<!-- bench_tiers:end -->"
HEADING = "## Tiers (bench_tiers.py)"
BATCH = 256
CHUNK = 256  # rows per extend while building
FRAMES = {"observation": 0}
# Keys compared with the source rows: both frame stacks and a few dense fields.
CHECK_KEYS = ["observation", ("next", "observation"), "action", ("next", "reward"), ("next", "done")]
MADV_NORMAL, MADV_RANDOM, MADV_DONTNEED = 0, 1, 4
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Case ids, in table order: (id, label).
CASES = [
    ("warm", "tiered, warm (no path)"),
    ("warm_path", "tiered, warm (path, warm caches all)"),
    ("cold_cache", "tiered, cold, page cache warm"),
    ("cold_disk", "tiered, cold, disk (DONTNEED)"),
    ("cold_disk_ra", "tiered, cold, disk, read-ahead on"),
    ("lru_mix", "tiered, LRU mix (warm ~25%, promote)"),
    ("lms_cache", "LazyMemmapStorage, page cache warm"),
    ("lms_disk", "LazyMemmapStorage, disk (DONTNEED)"),
    ("lms_disk_rand", "LazyMemmapStorage, disk, MADV_RANDOM"),
]
LABEL = dict(CASES)


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------
def rows_equal(out: TensorDictBase, want: TensorDictBase) -> bool:
    """Bit-exact comparison of the checked keys."""
    for k in CHECK_KEYS:
        a, b = out.get(k), want.get(k)
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.cpu(), b):
            return False
    return True


# ------------------------------------------------------------------------------------------
# I/O accounting and the page cache
# ------------------------------------------------------------------------------------------
def read_io() -> dict[str, int]:
    """``/proc/self/io`` as a dict (zeros where it is not available)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {"rchar": 0, "read_bytes": 0}
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = int(v)
    return out


def rchar_overhead() -> int:
    """``rchar`` that reading ``/proc/self/io`` itself adds (subtracted from every delta)."""
    a = read_io()
    b = read_io()
    return max(b.get("rchar", 0) - a.get("rchar", 0), 0)


def fadvise_dontneed(paths: list[str]) -> None:
    """fsync, then drop the files' pages from the page cache (dirty pages cannot be dropped)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in names)
    return sorted(out)


def block_device_facts(path: str) -> dict[str, Any]:
    """The block device under ``path``: name, read-ahead, rotational (``/sys``; best effort)."""
    try:
        st = os.stat(path)
        base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        queue = base / "queue"
        if not queue.exists():  # a partition: the queue belongs to the parent disk
            queue = base.parent / "queue"
        return {
            "device": base.name,
            "read_ahead_kb": int((queue / "read_ahead_kb").read_text()),
            "rotational": int((queue / "rotational").read_text()),
        }
    except (OSError, ValueError) as e:
        return {"device": "unknown", "error": f"{type(e).__name__}: {e}"}


class MappedLeaves:
    """The memory-mapped files of a ``LazyMemmapStorage``, to make them cold between batches.

    ``posix_fadvise(DONTNEED)`` skips pages that are mapped into a process, and every page a
    previous gather touched is still mapped here, so the mappings are dropped first with
    ``madvise(MADV_DONTNEED)`` (a shared file mapping loses nothing: the data is in the file).
    """

    def __init__(self, storage: Any):
        self.leaves = [v for v in storage._storage.values(True, True) if getattr(v, "filename", None)]
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.madvise.restype = ctypes.c_int

    @property
    def files(self) -> list[str]:
        return [v.filename for v in self.leaves]

    def _madvise(self, advice: int) -> None:
        for v in self.leaves:
            ptr = v.data_ptr()
            start = ptr - ptr % PAGE
            length = ptr + v.numel() * v.element_size() - start
            if length and self.libc.madvise(start, length, advice) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"madvise({advice}) on {v.filename}: {os.strerror(err)}")

    def drop(self) -> None:
        self._madvise(MADV_DONTNEED)
        fadvise_dontneed(self.files)

    def advise(self, random_access: bool) -> None:
        """``MADV_RANDOM`` turns off the kernel's read-around on page faults; ``MADV_NORMAL`` restores it."""
        self._madvise(MADV_RANDOM if random_access else MADV_NORMAL)


def advise_segments(store: Any, random_access: bool) -> None:
    """``posix_fadvise(POSIX_FADV_RANDOM)`` (or ``NORMAL``) on the store's own segment fds.

    Read-ahead state belongs to an open file description, so the advice must go to the fds
    the cold tier reads with (``segment_fd``): sorted, coalesced ``preadv`` runs look
    sequential to the kernel, which then reads ahead up to the device's read-ahead window.
    """
    from tiered.testing import parts
    cold = parts(store).tiers[2]
    advice = os.POSIX_FADV_RANDOM if random_access else os.POSIX_FADV_NORMAL
    for i in range(len(cold.segments)):
        os.posix_fadvise(cold.segment_fd(i), 0, 0, advice)


# ------------------------------------------------------------------------------------------
# Stores
# ------------------------------------------------------------------------------------------
def build_tiered(data: TensorDictBase, path: str | None, **kw: Any) -> tuple[Any, float]:
    """A ``TieredStore`` filled with ``data`` in chunks of 256 (flushed); returns it and the seconds."""
    import tiered

    n = data.batch_size[0]
    t0 = time.perf_counter()
    store = tiered.TieredStore(n, path, frames=FRAMES, hot_bytes=0, **kw)
    for i in range(0, n, CHUNK):
        store.extend(data[i:i + CHUNK])
    store.flush()
    return store, time.perf_counter() - t0


def build_lms(data: TensorDictBase, scratch: str) -> tuple[Any, float]:
    """A ``LazyMemmapStorage`` filled with ``data`` in chunks of 256, written back to its files."""
    from torchrl.data import LazyMemmapStorage

    n = data.batch_size[0]
    t0 = time.perf_counter()
    s = LazyMemmapStorage(n, scratch_dir=scratch)
    for i in range(0, n, CHUNK):
        j = min(i + CHUNK, n)
        s.set(torch.arange(i, j), data[i:j])
    return s, time.perf_counter() - t0


def tier_stats(store: Any, errors: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``store.stats()["tiers"]``; if ``stats()`` raises, the same figures from the store's
    internals (the error is recorded once, so a broken ``stats()`` does not hide the numbers)."""
    try:
        return store.stats()["tiers"]
    except Exception as e:  # report and fall back: this benchmark is about sampling
        errors.setdefault("stats", f"{type(e).__name__}: {e}")
        out = {}
        for t, name in enumerate(("hot", "warm", "cold")):
            from tiered.testing import parts
            tier = parts(store).tiers[t]
            if tier is None:
                continue
            out[name] = {
                "bytes_used": int(tier.bytes_used), "budget": tier.budget,
                "blobs": int((parts(store).index.loc[: parts(store).index.size, t] >= 0).sum()),
                **parts(store).placement.counts[name],
            }
        return out


@dataclass
class Case:
    key: str
    kind: str  # "tiered" or "lms"
    store: Any
    get: Callable[[torch.Tensor], TensorDictBase]
    prepare: Callable[[], None] = lambda: None  # before each batch, untimed (drop caches)
    disk: bool = False  # read_bytes is meaningful (the files were made cold)
    times: list[float] = field(default_factory=list)
    read_bytes: list[int] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)
    warm_share: list[float] = field(default_factory=list)  # tiered: blobs served by memory tiers
    mismatches: int = 0
    errors: dict[str, str] = field(default_factory=dict)


def tiered_get(store: Any) -> Callable[[torch.Tensor], TensorDictBase]:
    return lambda idx: store.get(idx)


def lms_get(storage: Any) -> Callable[[torch.Tensor], TensorDictBase]:
    return lambda idx: storage.get(idx)


# ------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------
def sample_rounds(cases: list[Case], data: TensorDictBase, rounds: int, seed: int,
                  lms_row_bytes: int) -> None:
    """Round 0 warms up; rounds 1..``rounds`` are timed. Every case gets the same indices."""
    n = data.batch_size[0]
    rng = np.random.default_rng(seed)
    over = rchar_overhead()
    for r in range(rounds + 1):
        idx = torch.from_numpy(rng.integers(0, n, BATCH))
        want = data[idx]
        order = list(cases)
        random.Random(seed * 1000 + r).shuffle(order)
        for c in order:
            if "get" in c.errors:
                continue
            try:
                before = tier_stats(c.store, c.errors) if c.kind == "tiered" else None
                c.prepare()
                io0 = read_io()
                t0 = time.perf_counter()
                out = c.get(idx)
                dt = time.perf_counter() - t0
                io1 = read_io()
            except Exception as e:  # one broken case must not stop the comparison
                c.errors["get"] = f"{type(e).__name__}: {e}"
                print(f"  ! {c.key}: {c.errors['get']}", file=sys.stderr)
                traceback.print_exc(limit=4, file=sys.stderr)
                continue
            if not rows_equal(out, want):
                c.mismatches += 1
            if r == 0:
                continue
            c.times.append(dt)
            c.read_bytes.append(io1.get("read_bytes", 0) - io0.get("read_bytes", 0))
            if c.kind == "tiered":
                c.requested.append(max(io1.get("rchar", 0) - io0.get("rchar", 0) - over, 0))
                after = tier_stats(c.store, c.errors)
                hits = {k: after[k]["hits"] - before.get(k, {}).get("hits", 0) for k in after}
                total = sum(hits.values())
                mem = hits.get("hot", 0) + hits.get("warm", 0)
                c.warm_share.append(mem / total if total else float("nan"))
            else:
                c.requested.append(BATCH * lms_row_bytes)


# ------------------------------------------------------------------------------------------
# A dataset 10x larger than the hot+warm budgets
# ------------------------------------------------------------------------------------------
def check_large(data: TensorDictBase, tmp: str, compressed: int, errors: dict[str, str]) -> dict[str, Any]:
    """Warm budget ~1/12 of the compressed bytes (no hot tier), LRU + promotion; read every row
    in shuffled batches of 256, and 20 random batches, comparing each with the source."""
    n = data.batch_size[0]
    budget = max(compressed // 12, 4096)
    store, build_s = build_tiered(data, os.path.join(tmp, "large"), warm_bytes=budget, policy="lru",
                                  promote=True)
    try:
        perm = torch.from_numpy(np.random.default_rng(7).permutation(n))
        batches = [perm[i:i + BATCH] for i in range(0, n, BATCH)]
        rng = np.random.default_rng(8)
        batches += [torch.from_numpy(rng.integers(0, n, BATCH)) for _ in range(20)]
        bad = 0
        t0 = time.perf_counter()
        for idx in batches:
            if not rows_equal(store.get(idx), data[idx]):
                bad += 1
        read_s = time.perf_counter() - t0
        tiers = tier_stats(store, errors)
    finally:
        store.close()
    stored = tiers.get("cold", {}).get("bytes_used", compressed)
    return {
        "rows": n, "warm_budget": budget, "hot_budget": 0, "stored_bytes": stored,
        "stored_over_budgets": stored / budget, "batches": len(batches), "mismatched_batches": bad,
        "rows_checked": sum(int(b.numel()) for b in batches), "build_s": build_s, "read_s": read_s,
        "tiers": tiers, "ok": bad == 0 and stored >= 10 * budget,
    }


# ------------------------------------------------------------------------------------------
# Reopen
# ------------------------------------------------------------------------------------------
def tiled(data: TensorDictBase, k: int, i: int, j: int) -> TensorDictBase:
    """Rows ``i:j`` of copy ``k`` of ``data``: frames XOR ``k`` (distinct bytes, same compressibility),
    trajectory ids shifted so episodes of different copies stay apart."""
    part = data[i:j].clone()
    if k:
        for key in ("observation", ("next", "observation")):
            part.set(key, part.get(key) ^ k)
        tk = ("collector", "traj_ids")
        part.set(tk, part.get(tk) + k * (int(data.get(tk).max()) + 1))
    return part


def measure_reopen(data: TensorDictBase, tmp: str, rows: int, repeats: int) -> dict[str, Any]:
    """Build a ``rows``-row store from tiled copies of ``data``, then time ``tiered.open``."""
    import tiered

    n = data.batch_size[0]
    copies = math.ceil(rows / n)
    path = os.path.join(tmp, "reopen")
    t0 = time.perf_counter()
    store = tiered.TieredStore(rows, path, frames=FRAMES, hot_bytes=0, chunk_frames=4)
    written = 0
    for k in range(copies):
        for i in range(0, n, CHUNK):
            j = min(i + CHUNK, n, i + rows - written)
            if j <= i:
                break
            store.extend(tiled(data, k, i, j))
            written += j - i
    store.close()
    build_s = time.perf_counter() - t0
    disk = H.dir_bytes(path)

    def reopen_once(drop: bool) -> tuple[float, float, bool]:
        if drop:
            fadvise_dontneed(files_under(path))
        t = time.perf_counter()
        s = tiered.open(path)
        open_s = time.perf_counter() - t
        rng = np.random.default_rng(len(times_warm) + len(times_cold))
        idx = torch.from_numpy(rng.integers(0, rows, BATCH))
        io0 = read_io()
        t = time.perf_counter()
        out = s.get(idx)
        get_s = time.perf_counter() - t
        (get_read_bytes if drop else []).append(read_io().get("read_bytes", 0) - io0.get("read_bytes", 0))
        k, base = idx // n, idx % n
        want = data[base].clone()
        for key in ("observation", ("next", "observation")):
            want.set(key, want.get(key) ^ k.to(torch.uint8).view(-1, 1, 1, 1))
        ok = rows_equal(out, want)
        s.close()
        return open_s, get_s, ok

    get_read_bytes: list[int] = []
    times_warm: list[tuple[float, float, bool]] = []
    times_cold: list[tuple[float, float, bool]] = []
    reopen_once(False)  # untimed: imports and first-use costs
    for _ in range(repeats):
        times_warm.append(reopen_once(False))
        times_cold.append(reopen_once(True))
    return {
        "rows": written, "copies": copies, "build_s": build_s, "disk": disk,
        "open_s_cache_warm": [t[0] for t in times_warm], "open_s_cache_cold": [t[0] for t in times_cold],
        "first_get_s_cache_warm": [t[1] for t in times_warm],
        "first_get_s_cache_cold": [t[1] for t in times_cold],
        "first_get_read_bytes_cache_cold": get_read_bytes,
        "bit_exact": all(t[2] for t in times_warm + times_cold),
    }


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------
def case_summary(c: Case) -> dict[str, Any]:
    t = c.times
    med = H.median(t) if t else float("nan")
    return {
        "label": LABEL[c.key], "rounds": len(t), "median_s": med,
        "q1_s": H.quantile(t, 0.25) if t else None, "q3_s": H.quantile(t, 0.75) if t else None,
        "rate": BATCH / med if t else None,
        "read_bytes_median": H.median(c.read_bytes) if c.read_bytes else None,
        "requested_bytes_median": H.median(c.requested) if c.requested else None,
        "warm_share_median": H.median([x for x in c.warm_share if x == x]) if c.warm_share else None,
        "mismatched_batches": c.mismatches, "errors": c.errors, "disk": c.disk,
    }


def fmt_pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.0f}%"


def throughput_table(summ: dict[str, dict[str, Any]], ref: str) -> str:
    rows = []
    ref_rate = summ.get(ref, {}).get("rate")
    for key, label in CASES:
        s = summ.get(key)
        if s is None:
            continue
        if s["errors"].get("get"):
            rows.append([label, "error", "", "", "", "", ""])
            continue
        rate = s["rate"]
        ratio = rate / ref_rate if rate and ref_rate else None
        rb = s["read_bytes_median"] if s["disk"] else None
        rows.append([
            label, H.fmt_rate(rate), f"{1e3 * s['median_s']:.1f}", H.fmt_ratio(ratio),
            H.fmt_bytes(rb) if rb is not None else "-",
            fmt_pct(s["warm_share_median"]),
            "ok" if s["mismatched_batches"] == 0 else f"MISMATCH x{s['mismatched_batches']}",
        ])
    return H.markdown_table(
        ["store / where the blobs are", "transitions/s", "ms/batch", f"vs {LABEL[ref].split(', ', 1)[1]}",
         "disk read/batch", "memory-tier hits", "bit-exact"], rows)


def build_report(summ, derived, large, reopen, facts, loads, meters, dev, args, n, rbytes,
                 compressed, builds, checks, lru) -> str:
    f = facts
    cpu = "; ".join(f"{k}: other processes {m['other_cores']:.2f} cores, steal {m['steal_pct']:.1f}% "
                    f"({m['wall_s']:.0f} s)" for k, m in meters.items())
    ra = dev.get("read_ahead_kb")
    lines = [
        HEADING, "",
        "Written by `benchmarks/bench_tiers.py`; rerun it to refresh this section.", "",
        f"- Machine: {f['cpu_model']}, {f['logical_cores']} logical cores ({f['affinity_cores']} usable), "
        f"{H.fmt_bytes(f['ram_bytes'])} RAM, {f['os']}",
        f"- Disk under the stores: {dev.get('device')} (read_ahead_kb={ra}, "
        f"rotational={dev.get('rotational')})",
        f"- Python {f['python']}, torch {f['torch']} ({f['torch_threads']} threads), torchrl {f['torchrl']}, "
        f"tensordict {f['tensordict']}, tiered {f['tiered']}, zstandard {f['zstandard']}",
        f"- Date: {f['date']}",
        f"- Command: `{f['command']}`",
        f"- Data: {n:,} real Atari transitions ({', '.join(args.games)}; random policy; "
        f"`tiered.atari.cached_rollout`), 4x84x84 uint8 stacks with next stacks, {rbytes:,} B per "
        f"transition; tiered stores them in {H.fmt_bytes(compressed)} of blobs "
        f"({rbytes * n / compressed:.0f}x smaller)",
        f"- Load average: before {', '.join(f'{x:.2f}' for x in loads['before']['loadavg'])}; after "
        f"{', '.join(f'{x:.2f}' for x in loads['after']['loadavg'])}",
        f"- Background before: {H.describe_load(loads['before'])}",
        f"- Background after: {H.describe_load(loads['after'])}",
        f"- CPU used by other processes per phase: {cpu}",
        f"- Build times: {', '.join(f'{k} {v:.1f} s' for k, v in builds.items())}",
        "",
        f"### Sample B={BATCH}: medians of {args.rounds} rounds, same indices for every store", "",
        throughput_table(summ, "warm"), "",
        *lru_lines(lru), "",
        "### Ratios", "",
        H.markdown_table(["ratio", "value"], derived["ratio_rows"]), "",
        "### Reopen and scale", "",
        *reopen_lines(reopen), *large_lines(large), "",
        "### Targets (informational; never fail the run)", "",
        H.markdown_table(["check", "target", "measured", "result"], checks), "",
        "### Method", "",
        *[f"- {x}" for x in method_notes(args, dev, derived)],
    ]
    return "\n".join(lines)


def reopen_lines(r: dict[str, Any] | None) -> list[str]:
    if r is None:
        return ["- reopen: not measured"]
    if "error" in r:
        return [f"- reopen: error ({r['error']})"]
    return [
        f"- Reopen of a {r['rows']:,}-row store ({r['copies']} XOR-ed copies of the data, K=4, "
        f"{H.fmt_bytes(r['disk']['allocated'])} on disk, built in {r['build_s']:.1f} s): `tiered.open(path)` "
        f"median {1e3 * H.median(r['open_s_cache_warm']):.0f} ms with the page cache warm, "
        f"{1e3 * H.median(r['open_s_cache_cold']):.0f} ms after DONTNEED on all its files; first "
        f"`get` (B={BATCH}) after it {1e3 * H.median(r['first_get_s_cache_warm']):.0f} / "
        f"{1e3 * H.median(r['first_get_s_cache_cold']):.0f} ms (cold: "
        f"{H.fmt_bytes(H.median(r['first_get_read_bytes_cache_cold']))} read from disk, row tables "
        "included); samples "
        f"{'bit-exact' if r['bit_exact'] else 'MISMATCH'} vs the tiled source.",
    ]


def lru_lines(lru: dict[str, Any]) -> list[str]:
    """The LRU store's warm tier after the fill and after sampling (did promotion keep up?)."""
    def one(t: dict[str, Any]) -> str:
        w = t.get("warm", {})
        return (f"{w.get('blobs', 0):,} blobs, {H.fmt_bytes(w.get('bytes_used'))} used, "
                f"fragmentation {w.get('fragmentation', 0.0):.2f}, {w.get('promotions', 0):,} promotions, "
                f"{w.get('demotions', 0):,} demotions")
    return [
        f"LRU mix, warm tier (budget {H.fmt_bytes(lru['warm_budget'])}): after the fill "
        f"{one(lru['tiers_after_build'])}; after sampling {one(lru['tiers_after_sampling'])}.",
    ]


def large_lines(g: dict[str, Any] | None) -> list[str]:
    if g is None:
        return ["- large-dataset check: not run"]
    if "error" in g:
        return [f"- large-dataset check: error ({g['error']})"]
    return [
        f"- dataset 10x larger than hot+warm budgets samples bit-exactly: "
        f"{'yes' if g['ok'] else 'NO'} ({H.fmt_bytes(g['stored_bytes'])} of blobs, hot budget 0, warm budget "
        f"{H.fmt_bytes(g['warm_budget'])}: {g['stored_over_budgets']:.1f}x; {g['rows_checked']:,} rows in "
        f"{g['batches']} batches, every row once plus 20 random batches, "
        f"{g['mismatched_batches']} mismatched; {g['read_s']:.1f} s).",
    ]


def method_notes(args, dev, derived) -> list[str]:
    ra = dev.get("read_ahead_kb")
    notes = [
        f"Round 0 warms up; rounds 1..{args.rounds} are timed. Each round draws {BATCH} fresh uniform "
        "random row indices; every store samples those same indices, in a new random order every round. "
        "Every batch of every store is compared bit for bit with the source rows (observation, next "
        "observation, action, next reward, next done): column bit-exact. Quartiles are in the JSON.",
        "tiered stores: `TieredStore(N, path, frames={\"observation\": 0}, hot_bytes=0)` with the default "
        "codec (zstd) and chunk_frames=4, filled in chunks of 256 and flushed. hot_bytes=0 keeps the "
        "comparison about warm and cold on any machine. Times are `store.get(idx)`; LazyMemmapStorage: "
        "`storage.get(idx)` (a gather out of its memory maps).",
        "cold, disk: before each batch, untimed, fsync and `posix_fadvise(POSIX_FADV_DONTNEED)` on "
        "every file of the store. LazyMemmapStorage additionally gets `madvise(MADV_DONTNEED)` on its "
        "mappings first: fadvise leaves pages that are mapped into a process in the cache, and every "
        "page an earlier gather touched is mapped.",
        "disk read/batch: median `read_bytes` delta of `/proc/self/io` around the `get`: bytes the block "
        "device delivered for this process (all threads), read-ahead included. Requested bytes: tiered, "
        "the `rchar` delta (bytes its `preadv` calls asked for, coalescing gaps included); "
        "LazyMemmapStorage, B x the row bytes of its files (it reads through page faults, which `rchar` "
        "does not count).",
        f"This disk's read-ahead is {ra} KiB. A page fault in a mapping with default advice reads "
        "around the faulting page up to that window, so LazyMemmapStorage's random rows pull whole "
        "megabytes each; `madvise(MADV_RANDOM)` turns that off. tiered's `preadv` runs are sorted by "
        "offset, which the kernel's read-ahead takes for a sequential stream; tiered sets "
        "`posix_fadvise(POSIX_FADV_RANDOM)` on every segment fd it opens or creates, which turns that "
        "off (the `read-ahead on` row sets `POSIX_FADV_NORMAL` on the same fds, to show the difference). "
        "tiered's default row and LazyMemmapStorage's default row are what each store does out of the "
        "box, and the target checks those; `MADV_RANDOM` against tiered's default is the like-for-like "
        f"comparison with read-ahead off in both. With {derived.get('n', 0):,} transitions the whole compressed store is "
        f"{H.fmt_bytes(derived.get('compressed'))}, so a tiered cold batch cannot read more than that; "
        "on a larger store, without read-ahead, it reads about one page per coalesced run of blobs.",
        "LRU mix: `policy=\"lru\"`, warm budget 25% of the compressed bytes, `promote=True`; after a "
        "fill the warm tier holds the most recently written blobs; sampled cold blobs are promoted and "
        "LRU victims dropped (a dropped cached copy costs nothing: cold holds every blob). "
        "memory-tier hits: share of the blobs of a batch served by hot/warm "
        "(`stats()['tiers'][t]['hits']` deltas).",
    ]
    if derived.get("stats_error"):
        notes.append(f"`store.stats()` raised `{derived['stats_error']}`; tier figures were read from the "
                     "store's internals instead.")
    if derived.get("read_bytes_zero"):
        notes.append("read_bytes stayed 0 (a virtual disk that does not account reads): the bytes check "
                     "uses requested bytes instead.")
    if args.threads:
        notes.append(f"torch.set_num_threads({args.threads}).")
    return notes


def write_doc_section_atomic(body: str, path: Path = H.DOC_PATH, attempts: int = 5) -> None:
    """Replace this script's marked section of ``path`` and nothing else, atomically.

    Other benchmarks write their own sections concurrently: the file is re-read right before
    writing, the new text goes to a temp file renamed over the old one (no torn file), and if
    the file changed between the read and the rename the update is redone on the new text.
    """
    block = f"{BEGIN}\n{body.rstrip()}\n{END}"
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(attempts):
        old = path.read_text() if path.exists() else None
        if old is None:
            text = ("# Benchmarks\n\nMeasured results of the scripts in `benchmarks/`; each section is "
                    "written by its script.\n\n" + block + "\n")
        else:
            i, j = old.find(BEGIN), old.find(END)
            if i >= 0 and j > i:
                text = old[:i] + block + old[j + len(END):]
            else:
                text = old.rstrip("\n") + "\n\n" + block + "\n"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".benchmarks.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, 0o644)
            now = path.read_text() if path.exists() else None
            if now != old:  # someone else wrote meanwhile: redo on their text
                os.unlink(tmp)
                continue
            os.replace(tmp, path)
            return
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    raise RuntimeError(f"{path} kept changing under us; section not written")


def sample_side_by_side(data: TensorDictBase, tmp: str, args: argparse.Namespace,
                        errors: dict[str, str]) -> dict[str, Any]:
    """Build every store of the comparison, sample them round by round, close them.

    A function of its own so that every store and mapping is released when it returns.
    """
    n = data.batch_size[0]
    m = H.CpuMeter()
    builds: dict[str, float] = {}
    # cold, page cache warm: built first, its compressed bytes size the other budgets
    cold_cache, builds["cold, cache"] = build_tiered(data, os.path.join(tmp, "cold_cache"),
                                                     warm_bytes=4096, promote=False)
    compressed = int(tier_stats(cold_cache, errors)["cold"]["bytes_used"])
    big = 2 * compressed + (64 << 20)
    warm, builds["warm (no path)"] = build_tiered(data, None, warm_bytes=big)
    warm_path, builds["warm (path)"] = build_tiered(data, os.path.join(tmp, "warm_path"), warm_bytes=big)
    cold_disk, builds["cold, disk"] = build_tiered(data, os.path.join(tmp, "cold_disk"),
                                                   warm_bytes=4096, promote=False)
    # its twin for the read-ahead case: advice belongs to the fds, so the default store's fds
    # keep exactly the advice tiered gave them
    cold_ra, builds["cold, disk, read-ahead"] = build_tiered(data, os.path.join(tmp, "cold_disk_ra"),
                                                             warm_bytes=4096, promote=False)
    lru, builds["LRU mix"] = build_tiered(data, os.path.join(tmp, "lru"), warm_bytes=compressed // 4,
                                          policy="lru", promote=True)
    lru_after_build = tier_stats(lru, errors)
    stores = [cold_cache, warm, warm_path, cold_disk, cold_ra, lru]

    def drop_tiered(store: Any, read_ahead: bool) -> Callable[[], None]:
        files = files_under(store.path)

        def prep() -> None:
            from tiered.testing import parts
            parts(store).tiers[2].drop_cache()  # the store's own helper (segments) ...
            fadvise_dontneed(files)  # ... and every other file of the store
            if read_ahead:  # the default store keeps tiered's own advice (FADV_RANDOM)
                advise_segments(store, random_access=False)
        return prep

    lms_cache, builds["LazyMemmap (cache)"] = build_lms(data, os.path.join(tmp, "lms_cache"))
    lms_disk, builds["LazyMemmap (disk)"] = build_lms(data, os.path.join(tmp, "lms_disk"))
    mapped = MappedLeaves(lms_disk)
    t0 = time.perf_counter()
    mapped.drop()  # the first drop writes the mapped pages back: do it untimed, once
    builds["LazyMemmap writeback"] = time.perf_counter() - t0
    lms_row = sum(v.numel() * v.element_size() for v in mapped.leaves) // n

    def drop_lms(random_access: bool) -> Callable[[], None]:
        def prep() -> None:
            mapped.advise(random_access)
            mapped.drop()
        return prep

    cases = [
        Case("warm", "tiered", warm, tiered_get(warm)),
        Case("warm_path", "tiered", warm_path, tiered_get(warm_path)),
        Case("cold_cache", "tiered", cold_cache, tiered_get(cold_cache)),
        Case("cold_disk", "tiered", cold_disk, tiered_get(cold_disk), prepare=drop_tiered(cold_disk, False),
             disk=True),
        Case("cold_disk_ra", "tiered", cold_ra, tiered_get(cold_ra), prepare=drop_tiered(cold_ra, True),
             disk=True),
        Case("lru_mix", "tiered", lru, tiered_get(lru)),
        Case("lms_cache", "lms", lms_cache, lms_get(lms_cache)),
        Case("lms_disk", "lms", lms_disk, lms_get(lms_disk), prepare=drop_lms(False), disk=True),
        Case("lms_disk_rand", "lms", lms_disk, lms_get(lms_disk), prepare=drop_lms(True), disk=True),
    ]
    meter_build = m.stop()
    print("built: " + ", ".join(f"{k} {v:.1f} s" for k, v in builds.items())
          + f"; compressed blobs {H.fmt_bytes(compressed)}")
    m = H.CpuMeter()
    try:
        sample_rounds(cases, data, args.rounds, args.seed, lms_row)
    finally:
        meter_sample = m.stop()
        for c in cases:
            if c.errors.get("stats"):
                errors.setdefault("stats", c.errors["stats"])
        lru_after = tier_stats(lru, errors)
        for s in stores:
            s.close()
    return {
        "cases": {c.key: case_summary(c) for c in cases}, "compressed": compressed, "builds": builds,
        "lru": {"warm_budget": compressed // 4, "tiers_after_build": lru_after_build,
                "tiers_after_sampling": lru_after},
        "meter_build": meter_build, "meter_sample": meter_sample,
    }


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="transitions (default 20000; quick 4000)")
    p.add_argument("--rounds", type=int, default=None, help="timed sample rounds (default 40; quick 5)")
    p.add_argument("--quick", action="store_true", help="small run (~1 min) to check the script works")
    p.add_argument("--reopen-rows", type=int, default=None, help="rows of the reopen store (default 100000)")
    p.add_argument("--reopen-repeats", type=int, default=None,
                   help="timed reopens per cache state (default 5)")
    p.add_argument("--games", nargs="+", default=H.DEFAULT_GAMES, help="ALE games, mixed in this order")
    p.add_argument("--dir", default=None, help="where the stores' files go (default: a temp dir)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads(N); 0 keeps torch's default")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled indices")
    H.add_output_arguments(p)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4000 if args.quick else 20000
    if args.rounds is None:
        args.rounds = 5 if args.quick else 40
    if args.reopen_rows is None:
        args.reopen_rows = 20000 if args.quick else 100_000
    if args.reopen_repeats is None:
        args.reopen_repeats = 2 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    facts = H.machine_facts(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"{facts['cpu_model']}, {facts['logical_cores']} cores, {H.fmt_bytes(facts['ram_bytes'])} RAM; "
          f"torch {facts['torch']} ({facts['torch_threads']} threads), torchrl {facts['torchrl']}")
    loads = {"before": H.load_snapshot()}
    print("background before:", H.describe_load(loads["before"]))
    meters: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}

    m = H.CpuMeter()
    # rollouts of 8000 steps per game are what bench_storages.py caches for its default run,
    # so the default here needs no emulator
    data = H.load_atari(args.games, args.steps, max(8000, math.ceil(args.steps / len(args.games))))
    n = data.batch_size[0]
    rbytes = H.row_bytes(data)
    meters["load data"] = m.stop()
    print(f"data: {n:,} transitions, {rbytes:,} B each ({meters['load data']['wall_s']:.1f} s)")

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_tiers_") as tmp:
        dev = block_device_facts(tmp)
        print(f"disk: {dev}")
        side = sample_side_by_side(data, tmp, args, errors)
        meters["build"], meters["sample"] = side.pop("meter_build"), side.pop("meter_sample")
        summ, compressed, builds = side["cases"], side["compressed"], side["builds"]
        H.release_memory()

        m = H.CpuMeter()
        try:
            large = check_large(data, tmp, compressed, errors)
        except Exception as e:  # report, measure the rest
            traceback.print_exc()
            large = {"error": f"{type(e).__name__}: {e}", "ok": False}
        meters["10x check"] = m.stop()
        print(large_lines(large)[0])

        m = H.CpuMeter()
        try:
            reopen = measure_reopen(data, tmp, args.reopen_rows, args.reopen_repeats)
        except Exception as e:  # report, measure the rest
            traceback.print_exc()
            reopen = {"error": f"{type(e).__name__}: {e}"}
        meters["reopen"] = m.stop()
        print(reopen_lines(reopen)[0])
    loads["after"] = H.load_snapshot()

    # ---- ratios and targets
    def rate(k: str) -> float | None:
        return summ[k]["rate"] if not summ[k]["errors"].get("get") else None

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    cold_vs_warm = div(rate("cold_cache"), rate("warm"))
    cold_vs_warm_path = div(rate("cold_cache"), rate("warm_path"))
    rb_t = summ["cold_disk"]["read_bytes_median"]
    rb_l = summ["lms_disk"]["read_bytes_median"]
    rb_lr = summ["lms_disk_rand"]["read_bytes_median"]
    rb_tra = summ["cold_disk_ra"]["read_bytes_median"]
    rq_t = summ["cold_disk"]["requested_bytes_median"]
    rq_l = summ["lms_disk"]["requested_bytes_median"]
    read_zero = not rb_t and not rb_l
    bytes_ratio = div(rq_l, rq_t) if read_zero else div(rb_l, rb_t)
    derived = {
        "cold_cache_vs_warm": cold_vs_warm, "cold_cache_vs_warm_path": cold_vs_warm_path,
        "cold_disk_vs_warm": div(rate("cold_disk"), rate("warm")),
        "lru_vs_warm": div(rate("lru_mix"), rate("warm")),
        "lms_cache_vs_warm": div(rate("lms_cache"), rate("warm")),
        "cold_disk_vs_lms_disk": div(rate("cold_disk"), rate("lms_disk")),
        "bytes_lms_over_tiered": bytes_ratio, "bytes_lms_random_over_tiered": div(rb_lr, rb_t),
        "bytes_lms_over_tiered_read_ahead": div(rb_l, rb_tra),
        "requested_lms_over_tiered": div(rq_l, rq_t), "read_bytes_zero": read_zero,
        "stats_error": errors.get("stats"), "n": n, "compressed": compressed,
    }
    derived["ratio_rows"] = [
        ["tiered cold (page cache warm) / tiered warm (no path), transitions/s", H.fmt_ratio(cold_vs_warm)],
        ["tiered cold (page cache warm) / tiered warm (path), transitions/s", H.fmt_ratio(cold_vs_warm_path)],
        ["tiered cold (disk) / tiered warm (no path), transitions/s",
         H.fmt_ratio(derived["cold_disk_vs_warm"])],
        ["tiered LRU mix / tiered warm (no path), transitions/s", H.fmt_ratio(derived["lru_vs_warm"])],
        ["tiered cold (disk) / LazyMemmapStorage (disk), transitions/s",
         H.fmt_ratio(derived["cold_disk_vs_lms_disk"])],
        [f"disk bytes per batch: LazyMemmapStorage {H.fmt_bytes(rb_l)} / tiered {H.fmt_bytes(rb_t)}",
         H.fmt_ratio(div(rb_l, rb_t))],
        [f"disk bytes per batch, read-ahead off in both: LazyMemmapStorage MADV_RANDOM "
         f"{H.fmt_bytes(rb_lr)} / tiered {H.fmt_bytes(rb_t)}", H.fmt_ratio(derived["bytes_lms_random_over_tiered"])],
        [f"disk bytes per batch, read-ahead on in both: LazyMemmapStorage {H.fmt_bytes(rb_l)} / tiered "
         f"FADV_NORMAL {H.fmt_bytes(rb_tra)}", H.fmt_ratio(derived["bytes_lms_over_tiered_read_ahead"])],
        [f"requested bytes per batch: LazyMemmapStorage {H.fmt_bytes(rq_l)} / tiered {H.fmt_bytes(rq_t)}",
         H.fmt_ratio(derived["requested_lms_over_tiered"])],
    ]
    reopen_warm = H.median(reopen["open_s_cache_warm"]) if "open_s_cache_warm" in reopen else None
    reopen_cold = H.median(reopen["open_s_cache_cold"]) if "open_s_cache_cold" in reopen else None
    rrows = reopen.get("rows", args.reopen_rows)

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    checks = [
        ["tiered cold sampling, page cache warm vs warm-only (B=256)", ">= 0.5x", H.fmt_ratio(cold_vs_warm),
         verdict(None if cold_vs_warm is None else cold_vs_warm >= 0.5)],
        [f"cold-disk batch (B={BATCH}) bytes read, LazyMemmapStorage / tiered, same indices"
         + (" (requested bytes)" if read_zero else ""), ">= 5x", H.fmt_ratio(bytes_ratio),
         verdict(None if bytes_ratio is None else bytes_ratio >= 5)],
        [f"reopen a {rrows:,}-row store, page cache warm", "< 2 s",
         "n/a" if reopen_warm is None else f"{reopen_warm:.3f} s",
         verdict(None if reopen_warm is None else reopen_warm < 2)],
        [f"reopen a {rrows:,}-row store, page cache dropped", "< 2 s",
         "n/a" if reopen_cold is None else f"{reopen_cold:.3f} s",
         verdict(None if reopen_cold is None else reopen_cold < 2)],
        ["dataset 10x larger than hot+warm budgets samples bit-exactly", "yes",
         "yes" if large.get("ok") else "no", verdict(bool(large.get("ok")))],
        ["every sampled batch bit-exact (all stores)", "yes",
         "yes" if all(s["mismatched_batches"] == 0 for s in summ.values()) else "no",
         verdict(all(s["mismatched_batches"] == 0 for s in summ.values()))],
    ]

    report = build_report(summ, derived, large, reopen, facts, loads, meters, dev, args, n, rbytes,
                          compressed, builds, checks, side["lru"])
    print()
    print(report)
    for row in checks:
        print(f"{row[3]}: {row[0]}: {row[2]} (target {row[1]})")
    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.0f} s")

    H.OUT_DIR.mkdir(parents=True, exist_ok=True)
    out_path = H.OUT_DIR / ("bench_tiers_quick.json" if args.quick else "bench_tiers.json")
    derived.pop("ratio_rows")
    out_path.write_text(json.dumps({
        "facts": facts, "disk": dev, "loads": loads, "cpu_other_processes": meters, "args": vars(args),
        "transitions": n, "row_bytes": H.row_bytes(data), "compressed_bytes": compressed,
        "lru": side["lru"], "builds_s": builds,
        "cases": summ, "derived": derived, "large": large, "reopen": reopen,
        "checks": [dict(zip(["check", "target", "measured", "result"], r, strict=True)) for r in checks],
        "errors": errors, "total_s": total,
    }, indent=1, default=str))
    print(f"wrote {out_path.relative_to(H.REPO)}")
    print(f"wrote {H.write_output(out_path.with_suffix('.md').name, report).relative_to(H.REPO)}")
    plots.plot_tiers(out_path, plots.plot_dir(args.write_docs))
    if H.wants_docs(args):
        write_doc_section_atomic(report)
        print(f"wrote {H.DOC_PATH.relative_to(H.REPO)} (section {BEGIN})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
