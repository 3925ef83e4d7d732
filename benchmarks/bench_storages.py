"""Storages side by side on real Atari transitions: tiered against TorchRL's storages, on CPU.

One run fills and samples, interleaved round by round on the same random indices:

- ``tiered``: ``TieredStore(N, frames={"observation": 0})`` with its default ``chunk_frames``,
  and the same with ``chunk_frames=1``; ``tiered (no options)``: ``TieredStore(N)`` /
  ``TieredStorage(N)`` exactly as a user first writes it (the frame stacks are detected);
  through TorchRL via ``tiered.torchrl.TieredStorage`` when that module exists (else those cells
  read n/a);
- TorchRL 0.14's ``LazyTensorStorage``, ``LazyMemmapStorage`` (in a temp dir) and
  ``CompressedListStorage`` (its default codec: zlib-3 below Python 3.14, zstd from 3.14).

Measured: extend rate (chunks of 256; one transition at a time; ``rb.extend`` of 16 rows), sample
rate (B=1, 8, 32, 64, 256, 1024 side by side, with a plot of rate vs batch size) through the
storage's own ``get`` and through ``TensorDictReplayBuffer`` + ``RandomSampler``,
and the anonymous memory each store holds after filling it in a fresh process (this script
re-run with ``--child``). The tiered store is also filled with ``--scale`` (2) times the
transitions, so the 1M-transition projection rests on two measurements: bytes per transition at
both sizes, and the line through them (fixed + marginal bytes per transition).

Data: ``tiered.atari.cached_rollout`` of each game (random policy, played once then cached),
4x84x84 uint8 stacks with next stacks, TorchRL's layout.

Usage:
    python benchmarks/bench_storages.py                 # full run (~5-10 min on 2 cores)
    python benchmarks/bench_storages.py --write-docs    # ... and update docs/benchmarks.md
    python benchmarks/bench_storages.py --quick         # ~1-2 min, checks that the script works
    python benchmarks/bench_storages.py --threads 1     # one torch thread, one decode thread, see below
    python benchmarks/bench_storages.py --profile       # also cProfile tiered get/extend at B=256

``--threads N``: ``torch.set_num_threads(N)`` and ``threads=N`` decode threads for every tiered
store. On a 2-core VM, another process holding a core can stall torch's 2-thread pool
(index_select 1.2 ms -> 41 ms median, measured on such a VM) and tiered's handoff to its second
decode thread alike; one thread gives steadier comparisons, at some cost to LazyTensorStorage's
gathers and tiered's large decodes. The background load is printed either way.

Results: a table on stdout, raw numbers in ``benchmarks/out/bench_storages.json`` and the report
in ``benchmarks/out/bench_storages.md`` (``--quick``: ``bench_storages_quick.*``). Only with
``--write-docs`` does the report also replace the section between ``<!-- bench_storages:begin -->``
/ ``<!-- bench_storages:end -->`` of ``docs/benchmarks.md``. Thresholds from the issues are
printed PASS/FAIL; they never change the exit status.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import math
import pstats
import random
import subprocess
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

import torch  # noqa: E402
from tensordict import LazyStackedTensorDict, TensorDictBase  # noqa: E402

BEGIN = "<!-- bench_storages:begin -->"
END = "<!-- bench_storages:end -->"
HEADING = "## CPU: storages side by side (bench_storages.py)"
CHUNK = 256
BATCHES = (32, 256)  # the batch sizes of the main table
SWEEP = (1, 8, 32, 64, 256, 1024)  # sample rates side by side (table and plot of rate vs batch size)
SMALL_EXTEND = 16  # rows of one rb.extend of a small collector batch (16 vectorized envs)
ONE_M = 1_000_000
GB = 1e9

# Measure ids, in table order: (id, column label, path).
MEASURES = [
    ("extend256_rb", "extend 256 (rb)", "rb"),
    ("extend256_raw", "extend 256 (raw)", "raw"),
    ("add1_rb", "add 1 (rb)", "rb"),
    ("online_rb", "add 1 + sample 256 (rb)", "rb"),
    ("extend1_raw", "extend 1 (raw)", "raw"),
    ("extend16_rb", f"extend {SMALL_EXTEND} (rb)", "rb"),
    ("sample32_rb", "sample B=32 (rb)", "rb"),
    ("sample256_rb", "sample B=256 (rb)", "rb"),
    ("get32_raw", "get B=32 (raw)", "raw"),
    ("get256_raw", "get B=256 (raw)", "raw"),
]


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------
def rollout_steps(total: int, games: list[str], scale: int) -> int:
    """Transitions per game played (and cached): enough for the scaled memory measurement."""
    return math.ceil(scale * total / len(games))


# ------------------------------------------------------------------------------------------
# Stores
# ------------------------------------------------------------------------------------------
def cls_codec_name() -> str:
    """What CompressedListStorage's default compression_fn uses on this Python (level 3)."""
    return "zstd-3 (compression.zstd)" if sys.version_info >= (3, 14) else "zlib-3"


def tiered_adapter() -> tuple[Any, str | None]:
    """``tiered.torchrl.TieredStorage`` or ``(None, why)`` when it is not there yet."""
    try:
        mod = importlib.import_module("tiered.torchrl")
        return mod.TieredStorage, None
    except Exception as e:  # the adapter is optional here: report, measure the rest
        return None, f"{type(e).__name__}: {e}"


@dataclass
class StoreSpec:
    key: str
    name: str
    family: str  # "tiered" or "torchrl"
    make_raw: Callable[[int, str], Any]
    make_rb_storage: Callable[[int, str], Any] | None
    note: str = ""


def _default_chunk_frames() -> int:
    """The K a default store takes for 84x84 uint8 frames (``chunk_frames=None`` lets the store
    choose per frame family; Atari frames get the most, ``DEFAULT_CHUNK_FRAMES``)."""
    import inspect

    import tiered
    from tiered.engine.frames import auto_chunk_frames
    from tiered.engine.write import DEFAULT_CHUNK_FRAMES

    p = inspect.signature(tiered.TieredStore.__init__).parameters.get("chunk_frames")
    if p is None or p.default is inspect.Parameter.empty:
        return -1
    return int(p.default) if p.default is not None else auto_chunk_frames(84 * 84, DEFAULT_CHUNK_FRAMES)


_DEFAULT_K = _default_chunk_frames()
EXTRA_K = tuple(k for k in (2, 4, 8, 16) if k != _DEFAULT_K)  # the default K is the 'tiered' row


def build_specs(keys: list[str] | None, threads: int = 0) -> tuple[list[StoreSpec], str | None]:
    """The stores measured (``keys``: a subset); ``threads`` > 0: tiered's decode threads too."""
    from torchrl.data import CompressedListStorage, LazyMemmapStorage, LazyTensorStorage

    import tiered

    adapter, why = tiered_adapter()
    frames = {"observation": 0}
    # --threads N: N decode threads for every tiered store (the "no options" row included)
    pool = {"threads": threads} if threads else {}

    def tiered_raw(**kw: Any) -> Callable[[int, str], Any]:
        kw = {"frames": frames, **pool, **kw}
        return lambda n, tmp: tiered.TieredStore(n, **kw)

    def tiered_rb(**kw: Any) -> Callable[[int, str], Any] | None:
        if adapter is None:
            return None
        kw = {"frames": frames, **pool, **kw}
        return lambda n, tmp: adapter(n, **kw)

    def no_options_raw(n: int, tmp: str) -> Any:
        return tiered.TieredStore(n, **pool)

    def memmap(n: int, tmp: str) -> Any:
        return LazyMemmapStorage(n, scratch_dir=tempfile.mkdtemp(dir=tmp, prefix="lms_"))

    default_k = _DEFAULT_K
    specs = [
        StoreSpec("tiered", f"tiered (K={default_k}, default)", "tiered", tiered_raw(), tiered_rb()),
        StoreSpec("tiered_auto", "tiered (no options)", "tiered", no_options_raw,
                  None if adapter is None else (lambda n, tmp: adapter(n, **pool)),
                  note="frame stacks detected on the first write"),
        StoreSpec("tiered_k1", "tiered (K=1)", "tiered",
                  tiered_raw(chunk_frames=1), tiered_rb(chunk_frames=1)),
        StoreSpec("lts", "LazyTensorStorage", "torchrl", lambda n, t: LazyTensorStorage(n),
                  lambda n, t: LazyTensorStorage(n)),
        StoreSpec("lms", "LazyMemmapStorage", "torchrl", memmap, memmap, note="files in a temp dir"),
        StoreSpec("cls", f"CompressedListStorage ({cls_codec_name().split(' ')[0]})", "torchrl",
                  lambda n, t: CompressedListStorage(n), lambda n, t: CompressedListStorage(n)),
    ]
    # more chunk sizes for the K trade-off plot; measured only when named in --stores
    specs += [StoreSpec(f"tiered_k{k}", f"tiered (K={k})", "tiered",
                        tiered_raw(chunk_frames=k), tiered_rb(chunk_frames=k)) for k in EXTRA_K]
    keys = keys or [s.key for s in specs if s.key not in {f"tiered_k{k}" for k in EXTRA_K}]
    specs = [s for s in specs if s.key in keys]
    return specs, why


def dense(out: Any) -> TensorDictBase:
    """What a training step needs: dense tensors. CompressedListStorage returns a list / lazy stack."""
    if isinstance(out, list):
        return torch.stack(out)
    if isinstance(out, LazyStackedTensorDict):
        return out.contiguous()
    return out


class RawOps:
    """The storage's own API: ``TieredStore.extend/get``; TorchRL ``Storage.set/get``."""

    def __init__(self, spec: StoreSpec, capacity: int, tmp: str):
        self.spec = spec
        self.capacity = capacity
        self.store = spec.make_raw(capacity, tmp)
        self._cursor = 0

    def extend(self, chunk: TensorDictBase, one: TensorDictBase | None = None) -> None:
        n = chunk.batch_size[0]
        if self.spec.family == "tiered":
            self.store.extend(chunk)
        elif one is not None:
            # What RoundRobinWriter.add does: one row, an int cursor.
            self.store.set(self._cursor, one)
        else:
            idx = torch.arange(self._cursor, self._cursor + n) % self.capacity
            self.store.set(idx, chunk)
        self._cursor = (self._cursor + n) % self.capacity

    def get(self, idx: torch.Tensor) -> TensorDictBase:
        return dense(self.store.get(idx))


class RbOps:
    """``TensorDictReplayBuffer(storage, RandomSampler(), batch_size=B)`` with a seedable generator."""

    def __init__(self, storage: Any, batch_size: int = 32):
        from torchrl.data import RandomSampler, TensorDictReplayBuffer

        self.storage = storage
        self.gen = torch.Generator()
        self.rbs: dict[int, Any] = {}
        self._cls = (TensorDictReplayBuffer, RandomSampler)
        self.rb = self.for_batch(batch_size)

    def for_batch(self, b: int) -> Any:
        if b not in self.rbs:
            rb_cls, sampler_cls = self._cls
            self.rbs[b] = rb_cls(
                storage=self.storage, sampler=sampler_cls(), batch_size=b, generator=self.gen
            )
        return self.rbs[b]

    def sample(self, b: int, seed: int) -> TensorDictBase:
        self.gen.manual_seed(seed)
        return dense(self.for_batch(b).sample())


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------
@dataclass
class Results:
    times: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # store -> measure -> s/call
    items: dict[str, int] = field(default_factory=dict)  # measure -> transitions per timed call
    errors: dict[str, dict[str, str]] = field(default_factory=dict)
    checks: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, store: str, measure: str, seconds: float) -> None:
        self.times.setdefault(store, {}).setdefault(measure, []).append(seconds)

    def fail(self, store: str, measure: str, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        self.errors.setdefault(store, {})[measure] = msg
        print(f"  ! {store} {measure}: {msg}", file=sys.stderr)
        traceback.print_exc(limit=3, file=sys.stderr)

    def failed(self, store: str, measure: str) -> bool:
        return measure in self.errors.get(store, {})

    def rate(self, store: str, measure: str) -> float | None:
        ts = self.times.get(store, {}).get(measure)
        if not ts or self.failed(store, measure):
            return None
        return self.items[measure] / H.median(ts)


def rotated(seq: list, r: int) -> list:
    """Round ``r``'s order: a fresh (seeded) permutation, so drift and the after-effects of one
    store on the next (caches, freed memory, a stalled thread pool) hit all of them alike."""
    out = list(seq)
    random.Random(r).shuffle(out)
    return out


def run_timed(res: Results, store: str, measure: str, fn: Callable[[], Any], record: bool = True) -> Any:
    if res.failed(store, measure):
        return None
    try:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    except Exception as e:  # one broken store must not stop the comparison
        res.fail(store, measure, e)
        return None
    if record:
        res.add(store, measure, dt)
    return out


def make_units(specs: list[StoreSpec], capacity: int, tmp: str, res: Results, measures: tuple[str, str]):
    """(spec, raw ops, rb ops) per store; a store that cannot be built is recorded as an error."""
    units = []
    for spec in specs:
        raw = rb = None
        try:
            raw = RawOps(spec, capacity, tmp)
        except Exception as e:
            res.fail(spec.key, measures[0], e)
        if spec.make_rb_storage is None:
            res.errors.setdefault(spec.key, {})[measures[1]] = "n/a: tiered.torchrl is not available"
        else:
            try:
                rb = RbOps(spec.make_rb_storage(capacity, tmp))
            except Exception as e:
                res.fail(spec.key, measures[1], e)
        units.append((spec, raw, rb))
    return units


def bench_add_one(specs, data, steps, block, res, tmp, capacity) -> None:
    """One transition per call, timed in blocks of ``block`` calls, stores alternating per block."""
    res.items["add1_rb"] = res.items["extend1_raw"] = block
    units = make_units(specs, capacity, tmp, res, ("extend1_raw", "add1_rb"))
    zero_d = [data[i] for i in range(steps)]
    one_row = [data[i : i + 1] for i in range(steps)]
    pairs = [(u, p) for u in units for p in ("raw", "rb")]
    for b in range(steps // block):
        lo, hi = b * block, (b + 1) * block
        for (spec, raw, rb), path in rotated(pairs, b):
            if path == "raw" and raw is not None:
                def fn(raw=raw, lo=lo, hi=hi):
                    for i in range(lo, hi):
                        raw.extend(one_row[i], zero_d[i])
                run_timed(res, spec.key, "extend1_raw", fn)
            elif path == "rb" and rb is not None:
                def fn(rb=rb, lo=lo, hi=hi):
                    for i in range(lo, hi):
                        rb.rb.add(zero_d[i])
                run_timed(res, spec.key, "add1_rb", fn)
    del units


def bench_extend_small(specs, data, steps, block, res, tmp, capacity, rows=SMALL_EXTEND) -> None:
    """``rb.extend`` of ``rows`` transitions per call (a small collector batch), timed in blocks of
    ``block`` calls (so a store that compresses its write stage every few calls pays for it inside
    the block), stores alternating per block."""
    res.items["extend16_rb"] = block * rows
    units = make_units(specs, capacity, tmp, res, ("extend1_raw", "extend16_rb"))
    rbs = [(spec, rb) for spec, _raw, rb in units if rb is not None]
    chunks = [data[i:i + rows] for i in range(0, steps - rows + 1, rows)]
    for b in range(len(chunks) // block):
        for spec, rb in rotated(rbs, b):
            def fn(rb=rb, b=b):
                for c in chunks[b * block:(b + 1) * block]:
                    rb.rb.extend(c)
            run_timed(res, spec.key, "extend16_rb", fn)
    del units


def bench_online(specs, data, steps, block, res, tmp, capacity, prefill=2048, batch=256) -> None:
    """The online RL loop: every step adds one transition and samples a batch, so a tiered
    store's sample meets rows still in its write stage. Each store is prefilled with ``prefill``
    transitions; timed in blocks of ``block`` steps, stores alternating per block."""
    res.items["online_rb"] = block
    units = make_units(specs, capacity, tmp, res, ("extend1_raw", "online_rb"))
    rbs = [(spec, rb) for spec, _raw, rb in units if rb is not None]
    for _spec, rb in rbs:
        rb.rb.extend(data[:prefill])
        rb.for_batch(batch)
    zero_d = [data[prefill + i] for i in range(steps)]
    for b in range(steps // block):
        lo, hi = b * block, (b + 1) * block
        for spec, rb in rotated(rbs, b):
            def fn(rb=rb, lo=lo, hi=hi):
                sampler = rb.for_batch(batch)
                for i in range(lo, hi):
                    rb.rb.add(zero_d[i])
                    sampler.sample()
            run_timed(res, spec.key, "online_rb", fn)
    del units


def bench_extend(specs, data, res, tmp, capacity):
    """Fill every store with all of ``data`` in chunks of 256, alternating stores per chunk."""
    res.items["extend256_rb"] = res.items["extend256_raw"] = CHUNK
    units = make_units(specs, capacity, tmp, res, ("extend256_raw", "extend256_rb"))
    n = data.batch_size[0]
    starts = list(range(0, n, CHUNK))
    pairs = [(u, p) for u in units for p in ("raw", "rb")]
    for r, s in enumerate(starts):
        chunk = data[s : s + CHUNK]
        full = chunk.batch_size[0] == CHUNK
        for (spec, raw, rb), path in rotated(pairs, r):
            if path == "raw" and raw is not None:
                run_timed(res, spec.key, "extend256_raw", lambda raw=raw, c=chunk: raw.extend(c),
                          record=full)
            elif path == "rb" and rb is not None:
                run_timed(res, spec.key, "extend256_rb", lambda rb=rb, c=chunk: rb.rb.extend(c),
                          record=full)
    return units


def check_content(out: TensorDictBase, data: TensorDictBase, idx: torch.Tensor) -> str:
    """'ok' when the sample equals the source rows, else what differs."""
    bad = []
    for key in ("observation", ("next", "observation"), "action", ("next", "reward")):
        got = out.get(key)
        want = data.get(key)[idx]
        if got.shape != want.shape or not torch.equal(got.cpu(), want):
            bad.append(str(key))
    return "ok" if not bad else "MISMATCH in " + ", ".join(bad)


def bench_sample(units, data, rounds, res, seed=1234, batches=SWEEP) -> None:
    """Fresh random indices every round, the same for every store and path; round 0 is a warm-up
    whose output is checked against the source rows."""
    n = data.batch_size[0]
    pairs = [(u, p) for u in units for p in ("raw", "rb")]
    # For tiered, also the rb's own TieredStore.get on the same indices: the overhead of going
    # through TensorDictReplayBuffer is measured on one and the same store.
    pairs += [(u, "rbstore") for u in units if u[2] is not None and hasattr(u[2].storage, "store")]
    for b in batches:
        get_m, rb_m, own_m = f"get{b}_raw", f"sample{b}_rb", f"get{b}_rbstore"
        res.items[get_m] = res.items[rb_m] = res.items[own_m] = b
        for r in range(rounds + 1):
            round_seed = seed + 1000 * b + r
            idx = torch.randint(0, n, (b,), generator=torch.Generator().manual_seed(round_seed))
            for (spec, raw, rb), path in rotated(pairs, r):
                if path == "raw" and raw is not None:
                    out = run_timed(res, spec.key, get_m, lambda raw=raw, i=idx: raw.get(i),
                                    record=r > 0)
                    if r == 0 and out is not None:
                        res.checks.setdefault(spec.key, {})[get_m] = check_content(out, data, idx)
                elif path == "rbstore":
                    run_timed(res, spec.key, own_m, lambda rb=rb, i=idx: rb.storage.store.get(i),
                              record=r > 0)
                elif path == "rb" and rb is not None:
                    out = run_timed(res, spec.key, rb_m, lambda rb=rb, b=b, s=round_seed: rb.sample(b, s),
                                    record=r > 0)
                    if r == 0 and out is not None:
                        got_idx = out.get("index").reshape(-1).cpu()
                        same = torch.equal(got_idx, idx)
                        status = check_content(out, data, got_idx)
                        if not same:
                            status += " (sampler drew other indices than the other stores)"
                        res.checks.setdefault(spec.key, {})[rb_m] = status


# ------------------------------------------------------------------------------------------
# Memory (child processes)
# ------------------------------------------------------------------------------------------
def child_main(args: argparse.Namespace) -> int:
    """Fill one store in this fresh process and print the memory it holds as JSON."""
    if args.threads:
        torch.set_num_threads(args.threads)
    games = args.games
    n = args.child_n
    data = H.load_atari(games, n, rollout_steps(args.steps, games, args.scale))
    specs, _ = build_specs([args.child], args.threads)
    spec = specs[0]
    tmp = tempfile.mkdtemp(prefix="bench_storages_child_")
    try:
        H.release_memory()
        before = H.proc_status_bytes()
        ops = RawOps(spec, n, tmp)
        t0 = time.perf_counter()
        for s in range(0, n, CHUNK):
            # A fresh copy per chunk, as a collector hands over new tensors each time: a store
            # that keeps references to the caller's tensors is charged for them.
            chunk = data[s : s + CHUNK].clone()
            ops.extend(chunk)
            del chunk
        fill_s = time.perf_counter() - t0
        H.release_memory()
        after = H.proc_status_bytes()
        out: dict[str, Any] = {
            "store": spec.key,
            "transitions": n,
            "fill_s": fill_s,
            "before": before,
            "after": after,
            "anon_growth": after.get("RssAnon", 0) - before.get("RssAnon", 0),
            "file_rss_growth": after.get("RssFile", 0) - before.get("RssFile", 0),
            "shmem_growth": after.get("RssShmem", 0) - before.get("RssShmem", 0),
            "row_bytes": H.row_bytes(data),
        }
        if spec.key == "lms":
            out["disk"] = H.dir_bytes(tmp)
        if spec.family == "tiered":
            try:
                st = ops.store.stats()
            except Exception as e:  # the bytes above are the measurement; stats() is a breakdown
                out["stats_error"] = f"{type(e).__name__}: {e}"
                st = {}
            out["tiers"] = {k: v.get("bytes_used") for k, v in st.get("tiers", {}).items()}
            out["memory"] = st.get("memory")
            out["blob_fields"] = {
                k: {kk: v.get(kk) for kk in ("stored_bytes", "logical_bytes", "ratio", "dedup_factor",
                                              "compression_factor", "unique_frames")}
                for k, v in st.get("fields", {}).items() if v.get("kind") == "blob"
            }
        print("RESULT " + json.dumps(out))
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_child(args: argparse.Namespace, key: str, n: int) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--child-n", str(n),
           "--steps", str(args.steps), "--scale", str(args.scale), "--games", *args.games]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            out["child_wall_s"] = time.perf_counter() - t0
            return out
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"store": key, "transitions": n, "error": f"child exited {proc.returncode}: {tail}"}


# ------------------------------------------------------------------------------------------
# Profile
# ------------------------------------------------------------------------------------------
def profile_tiered(spec: StoreSpec, data: TensorDictBase, tmp: str, calls: int = 40) -> str:
    """cProfile of TieredStore: extend in chunks of 256 and of 1 row, get at B=256 and B=32."""
    n = data.batch_size[0]
    buf = io.StringIO()

    def run(title: str, fn: Callable[[], Any], sorts: tuple[str, ...] = ("tottime", "cumulative")) -> None:
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        buf.write(f"### {spec.name}: {title} ({time.perf_counter() - t0:.3f} s under the profiler)\n")
        for key in sorts:
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(16)

    store = spec.make_raw(n, tmp)
    chunks = [data[s : s + CHUNK] for s in range(0, n, CHUNK)]
    run(f"extend, {len(chunks)} chunks of {CHUNK}", lambda: [store.extend(c) for c in chunks])
    gen = torch.Generator().manual_seed(7)
    for b in (256, 32):
        idxs = [torch.randint(0, n, (b,), generator=gen) for _ in range(calls)]
        store.get(idxs[0])
        run(f"get, {calls} calls at B={b}", lambda idxs=idxs: [store.get(i) for i in idxs])
    ones = [data[i : i + 1] for i in range(min(200, n))]
    fresh = spec.make_raw(n, tmp)
    run(f"extend, {len(ones)} calls of 1 row", lambda: [fresh.extend(o) for o in ones])
    return buf.getvalue()


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def throughput_table(specs, res: Results) -> str:
    headers = ["store", *[label for _, label, _ in MEASURES]]
    rows = []
    for spec in specs:
        row = [spec.name]
        for mid, _, _ in MEASURES:
            r = res.rate(spec.key, mid)
            if r is None:
                err = res.errors.get(spec.key, {}).get(mid, "")
                row.append("n/a" if err.startswith("n/a") or not err else "error")
                continue
            cell = H.fmt_rate(r)
            vs_lts = ratio(r, res.rate("lts", mid))
            vs_cls = ratio(r, res.rate("cls", mid))
            cell += f" ({H.fmt_ratio(vs_lts)} / {H.fmt_ratio(vs_cls)})"
            if res.checks.get(spec.key, {}).get(mid, "ok").startswith("MISMATCH"):
                cell += " MISMATCH"
            row.append(cell)
        rows.append(row)
    return H.markdown_table(headers, rows)


def sweep_table(specs, res: Results, batches: tuple[int, ...], path: str) -> str:
    """Sample rates at every batch size of the sweep, one row per store (``path``: "rb" for
    ``rb.sample()``, "raw" for the storage's own ``get``); in parentheses the ratio vs LTS."""
    prefix, suffix = ("sample", "_rb") if path == "rb" else ("get", "_raw")
    rows = []
    for spec in specs:
        row = [spec.name]
        for b in batches:
            m = f"{prefix}{b}{suffix}"
            r = res.rate(spec.key, m)
            row.append("n/a" if r is None else f"{H.fmt_rate(r)} ({H.fmt_ratio(ratio(r, res.rate('lts', m)))})")
        rows.append(row)
    return H.markdown_table(["store", *[f"B={b}" for b in batches]], rows)


def memory_rows(specs, mem: dict[str, dict[str, Any]],
                scaled: dict[str, dict[str, Any]]) -> tuple[str, dict[str, float | None]]:
    per_tr: dict[str, float | None] = {}
    for spec in specs:
        m = mem.get(spec.key)
        per_tr[spec.key] = None if not m or "error" in m else m["anon_growth"] / m["transitions"]
    lts = per_tr.get("lts")
    headers = ["store", "transitions", "anon RSS growth", "per transition", "LTS / store",
               "on disk (allocated)", "tier bytes / transition"]
    rows = []
    entries = [(spec, mem.get(spec.key)) for spec in specs]
    entries += [(spec, scaled[spec.key]) for spec in specs if spec.key in scaled]
    for spec, m in entries:
        if not m or "error" in m:
            rows.append([spec.name, "", "error" if m else "n/a", "", "", "", ""])
            continue
        pt = m["anon_growth"] / m["transitions"]
        disk = m.get("disk", {}).get("allocated")
        tiers = m.get("tiers") or {}
        tier_b = sum(v or 0 for v in tiers.values()) / m["transitions"] if tiers else None
        rows.append([
            spec.name, f"{m['transitions']:,}", H.fmt_bytes(m["anon_growth"]), H.fmt_bytes(pt),
            H.fmt_ratio(ratio(lts, pt)) if pt and pt > 0 else ("inf" if pt is not None else "n/a"),
            H.fmt_bytes(disk) if disk is not None else "-",
            H.fmt_bytes(tier_b) if tier_b is not None else "-",
        ])
    return H.markdown_table(headers, rows), per_tr


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "FAIL"


def thresholds(specs, res: Results, per_tr: dict[str, float | None],
               proj: dict[str, dict[str, float]]) -> tuple[str, list[dict[str, Any]]]:
    """The issues' targets for each tiered row; PASS/FAIL only, never an exit status."""
    tiered_specs = [s for s in specs if s.family == "tiered"]
    checks: list[tuple[str, str, Callable[[str], float | None], float, bool, str]] = []

    def sample_rate(key: str) -> float | None:
        return res.rate(key, "sample256_rb")

    def sample_vs(other: str) -> Callable[[str], float | None]:
        return lambda k: ratio(sample_rate(k), sample_rate(other))

    def extend_vs_cls(k: str) -> float | None:
        return ratio(res.rate(k, "extend256_rb"), res.rate("cls", "extend256_rb"))

    def bytes_fraction(k: str) -> float | None:
        a, b = per_tr.get(k), per_tr.get("lts")
        return None if a is None or not b else a / b

    def marginal_fraction(k: str) -> float | None:
        p = proj.get(k, {})
        a, b = p.get("marginal"), per_tr.get("lts")
        return None if a is None or not b or not p.get("marginal_reliable") else a / b

    def rb_overhead(b: int) -> Callable[[str], float | None]:
        def f(k: str) -> float | None:
            get_r, rb_r = res.rate(k, f"get{b}_rbstore"), res.rate(k, f"sample{b}_rb")
            return None if get_r is None or rb_r is None else get_r / rb_r - 1.0
        return f

    def vs_lts(measure: str) -> Callable[[str], float | None]:
        return lambda k: ratio(res.rate(k, measure), res.rate("lts", measure))

    def add_vs_lts(k: str) -> float | None:
        return ratio(res.rate(k, "add1_rb"), res.rate("lts", "add1_rb"))

    def no_options_vs_frames(what: str) -> Callable[[str], float | None]:
        """The no-options row against the explicit frames= row (same K); other rows: n/a."""
        def f(k: str) -> float | None:
            if k != "tiered_auto":
                return None
            if what == "sample":
                return ratio(sample_rate(k), sample_rate("tiered"))
            return ratio(per_tr.get(k), per_tr.get("tiered"))
        return f

    checks = [
        ("issue 2", "sample B=256 (rb) vs CompressedListStorage", sample_vs("cls"), 3.0, True, ">= 3x"),
        ("issue 2", "sample B=256 (rb) vs LazyTensorStorage", sample_vs("lts"), 0.5, True, ">= 0.5x"),
        ("issue 5", "sample B=256 (rb) vs CompressedListStorage", sample_vs("cls"), 5.0, True, ">= 5x"),
        ("issue 5", "sample B=256 (rb) vs LazyTensorStorage", sample_vs("lts"), 0.6, True, ">= 0.6x"),
        ("issue 2", "bytes held vs LazyTensorStorage", bytes_fraction, 1 / 25, False, "<= 1/25"),
        ("issue 5", "bytes held vs LazyTensorStorage", bytes_fraction, 1 / 100, False, "<= 1/100"),
        ("issue 2", "bytes per extra transition (N -> kN) vs LTS", marginal_fraction, 1 / 25, False,
         "<= 1/25"),
        ("issue 5", "bytes per extra transition (N -> kN) vs LTS", marginal_fraction, 1 / 100, False,
         "<= 1/100"),
        ("", "extend 256 (rb) vs CompressedListStorage", extend_vs_cls, 2.0, True, ">= 2x"),
        ("", "extend 256 (rb) vs CompressedListStorage", extend_vs_cls, 3.0, True, ">= 3x"),
        ("", "rb.sample B=256 overhead over TieredStore.get", rb_overhead(256), 0.10, False, "<= +10%"),
        ("", "rb.sample B=32 overhead over TieredStore.get", rb_overhead(32), 0.10, False, "<= +10%"),
        ("", "rb.add one transition vs LazyTensorStorage", add_vs_lts, 0.8, True, ">= 0.8x"),
        ("issue 14", "sample B=256 (rb) vs LazyTensorStorage", sample_vs("lts"), 1.0, True, ">= 1x"),
        ("issue 14", "bytes held vs LazyTensorStorage", bytes_fraction, 1 / 150, False, "<= 1/150"),
        ("issue 14", "no options: sample B=256 (rb) vs frames=", no_options_vs_frames("sample"), 0.95, True,
         ">= 0.95x"),
        ("issue 14", "no options: bytes held vs frames=", no_options_vs_frames("bytes"), 1.05, False,
         "<= 1.05x"),
        *[("issue 31", f"{label} vs LazyTensorStorage", vs_lts(mid), 1.0, True, ">= 1x")
          for mid, label, _ in MEASURES],
        ("issue 31", "sample B=256 (rb) vs LazyTensorStorage", sample_vs("lts"), 1.5, True, ">= 1.5x"),
    ]
    rows, raw = [], []
    for issue, what, fn, target, hib, label in checks:
        row = [issue, what, label]
        for s in tiered_specs:
            v = fn(s.key)
            vd = verdict(v, target, hib)
            if v is None:
                shown = "n/a"
            elif label.startswith("<= +"):
                shown = f"{v * 100:+.1f}%"
            elif label.startswith("<= 1/"):
                shown = f"1/{1 / v:.0f}" if v > 0 else "0"
            else:
                shown = H.fmt_ratio(v)
            row.append(f"{vd} {shown}" if vd != "n/a" else "n/a")
            raw.append({"issue": issue, "check": what, "target": label, "store": s.key, "value": v,
                        "verdict": vd})
        rows.append(row)
    return H.markdown_table(["issue", "check", "target", *[s.name for s in tiered_specs]], rows), raw


def projection(mem: dict[str, dict[str, Any]], scaled: dict[str, dict[str, Any]], specs) -> tuple[str, dict]:
    """Bytes per transition measured at N and kN, times 1,000,000, with the arithmetic shown.

    Two figures, because a store also holds fixed costs (scratch buffers, thread pools, the
    tail of raw frames) that do not grow with the rows: (a) the bytes per transition measured at
    kN times 1M, which scales those fixed costs by 1M / kN and so overstates; (b) a line through
    the two measurements, fixed + marginal x 1M, which is what a 1M-row store holds if the
    marginal cost stays what it was between N and kN. When (a) differs much between N and kN,
    per-transition bytes are not stable and (b) is the figure to use.
    """
    lines, raw = [], {}
    for spec in specs:
        if spec.family != "tiered":
            continue
        a, b = mem.get(spec.key), scaled.get(spec.key)
        if not a or not b or "error" in a or "error" in b:
            lines.append(f"- {spec.name}: n/a (measurement failed)")
            continue
        na, nb = a["transitions"], b["transitions"]
        ga, gb = a["anon_growth"], b["anon_growth"]
        pa, pb = ga / na, gb / nb
        marginal = (gb - ga) / (nb - na)
        fixed = ga - marginal * na
        naive = pb * ONE_M
        fit = fixed + marginal * ONE_M
        tier_a = sum(v or 0 for v in (a.get("tiers") or {}).values()) / na
        tier_b = sum(v or 0 for v in (b.get("tiers") or {}).values()) / nb
        stable = abs(pa - pb) <= 0.1 * pb
        # The compressed blobs alone are a floor for the marginal cost; below it, RSS noise
        # (allocator, page-granular growth) swamped the difference between the two sizes.
        reliable = marginal >= 0.9 * tier_b if tier_b else marginal > 0
        raw[spec.key] = {"n": na, "n_scaled": nb, "anon_n": ga, "anon_scaled": gb, "per_transition_n": pa,
                         "per_transition_scaled": pb, "marginal": marginal, "fixed": fixed,
                         "projected_1m_bytes": naive, "projected_1m_fit_bytes": fit,
                         "per_transition_stable": stable, "marginal_reliable": reliable,
                         "tier_per_transition_n": tier_a, "tier_per_transition_scaled": tier_b}
        lines.append(
            f"- {spec.name}: at {na:,} transitions {ga:,} B / {na:,} = **{pa:,.0f} B/transition**; "
            f"at {nb:,}: {gb:,} B / {nb:,} = **{pb:,.0f} B/transition** "
            f"({'stable within 10%' if stable else 'NOT stable: fixed costs dominate at this size'}).\n"
            f"  (a) {pb:,.0f} B x 1,000,000 = **{H.fmt_bytes(naive)}** -> "
            f"{'PASS' if naive < GB else 'FAIL'} (< 1 GB).\n"
            f"  (b) marginal ({gb:,} - {ga:,}) / {nb - na:,} = {marginal:,.0f} B/transition, fixed "
            f"{ga:,} - {marginal:,.0f} x {na:,} = {H.fmt_bytes(fixed)}; "
            f"{H.fmt_bytes(fixed)} + {marginal:,.0f} B x 1,000,000 = **{H.fmt_bytes(fit)}** -> "
            f"{'PASS' if fit < GB else 'FAIL'} (< 1 GB)"
            f"{'' if reliable else ' UNRELIABLE: marginal below the blob bytes; use more --steps'}.\n"
            f"  Compressed blobs in the tiers alone: {tier_a:,.0f} / {tier_b:,.0f} B/transition "
            f"({H.fmt_bytes(tier_b * ONE_M)} per 1M)."
        )
    return "\n".join(lines), raw


def describe_cpu_meters(meters: dict[str, dict[str, float]]) -> str:
    return "; ".join(
        f"{phase}: other processes {m['other_cores']:.2f} cores, steal {m['steal_pct']:.1f}% "
        f"({m['wall_s']:.0f} s)" for phase, m in meters.items()
    )


def doc_body(facts, args, n, rb_bytes, thr_note, tables, loads, meters, proj_text, notes) -> str:
    f = facts
    return "\n".join([
        HEADING,
        "",
        "Written by `benchmarks/bench_storages.py`; rerun it to refresh this section.",
        "",
        f"- Machine: {f['cpu_model']}, {f['logical_cores']} logical cores ({f['affinity_cores']} usable), "
        f"{H.fmt_bytes(f['ram_bytes'])} RAM, {f['os']}",
        f"- Python {f['python']}, torch {f['torch']} ({f['torch_threads']} threads), torchrl {f['torchrl']}, "
        f"tensordict {f['tensordict']}, tiered {f['tiered']}, zstandard {f['zstandard']}",
        f"- Date: {f['date']}",
        f"- Command: `{f['command']}`",
        f"- Data: {n:,} real Atari transitions ({', '.join(args.games)}; random policy; "
        f"`tiered.atari.cached_rollout`), 4x84x84 uint8 stacks with next stacks, {rb_bytes:,} B per "
        "transition uncompressed",
        f"- Background load before: {H.describe_load(loads['before'])}",
        f"- Background load after: {H.describe_load(loads['after'])}",
        f"- CPU used by other processes during each phase: {describe_cpu_meters(meters)}",
        "",
        "### Throughput (transitions/s; in parentheses: ratio vs LazyTensorStorage / vs "
        "CompressedListStorage)",
        "",
        tables["throughput"],
        "",
        "### Sample rate vs batch size (transitions/s; in parentheses: ratio vs LazyTensorStorage)",
        "",
        "Through `TensorDictReplayBuffer` (`rb.sample()`):",
        "",
        tables["sweep_rb"],
        "",
        "Through the storage's own `get`:",
        "",
        tables["sweep_raw"],
        "",
        "### Bytes held after filling, each store in a fresh process",
        "",
        tables["memory"],
        "",
        "### 1M-transition projection (tiered)",
        "",
        "Anonymous bytes held, from the fresh-process fills above: (a) bytes per transition at the "
        "larger size x 1,000,000 (overstates: it scales fixed costs too); (b) fixed + marginal bytes "
        "per transition x 1,000,000, from the line through both sizes.",
        "",
        proj_text,
        "",
        "### Thresholds from the issues (informational; never fail the run)",
        "",
        tables["thresholds"],
        "",
        thr_note,
        "",
        "### Method",
        "",
        *[f"- {x}" for x in notes],
    ])


def method_notes(args, rounds, ext1_steps, block, why_no_adapter) -> list[str]:
    notes = [
        "Medians over rounds. Each round draws fresh random indices; every store, through its raw "
        "`get` and through `TensorDictReplayBuffer(storage, RandomSampler(), batch_size=B)`, samples "
        "those same indices (the replay buffer's generator is reseeded per round; the sampled `index` "
        "is checked), in a new random order every round. Round 0 is a warm-up whose output is "
        "compared with the source rows. Quartiles of every measure are in the JSON.",
        f"Sampling: {rounds} timed rounds per batch size. Extend 256: every store is filled with all "
        "transitions, one chunk of 256 per store per round (raw and rb paths fill separate stores). "
        f"One at a time: {ext1_steps} transitions, timed in blocks of {block}; rb path = `rb.add(td[i])`, "
        "raw path = `TieredStore.extend(td[i:i+1])` / `Storage.set(cursor, td[i])`. "
        f"Online: after a prefill of {args.online_prefill} transitions, {args.online_steps} steps of "
        "`rb.add(td[i])` then `rb.sample()` at B=256, the online RL loop (a tiered sample then meets "
        "rows in the write stage); the rate counts steps.",
        "raw = the storage's own API (`TieredStore.get/extend`, TorchRL `Storage.get/set`); rb = through "
        "`TensorDictReplayBuffer`. Times include making the result dense: CompressedListStorage returns "
        "a list / lazy stack, stacked here as a training step would.",
        f"CompressedListStorage uses its default compression_fn: {cls_codec_name()} on Python "
        f"{sys.version_info.major}.{sys.version_info.minor}; it compresses only the root tensors "
        "(`(\"next\", \"observation\")` sits in a nested TensorDict and stays raw) and keeps references "
        "to the caller's nested tensors.",
        "Bytes held: RssAnon growth (from /proc/self/status) of a fresh process filling one store with "
        "fresh copies of 256-transition chunks, measured after `gc.collect()` and `malloc_trim(0)`; the "
        "source data was loaded before the first reading. LazyMemmapStorage holds its rows in files "
        "(page cache, RssFile), so its anonymous growth is small; its on-disk bytes are listed.",
        "Tier bytes: the compressed blobs alone (`stats()['tiers'][*]['bytes_used']`); anon growth "
        "also counts row tables, the index, dense columns and buffers.",
    ]
    if why_no_adapter:
        notes.append(f"tiered through TorchRL: n/a, `tiered.torchrl` could not be imported "
                     f"({why_no_adapter}).")
    if args.threads:
        notes.append(f"torch.set_num_threads({args.threads}) in every process, and {args.threads} decode "
                     f"thread(s) for every tiered store (`threads={args.threads}`, the no-options row included).")
    return notes


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="total transitions (default 20000; quick 2000)")
    p.add_argument("--games", nargs="+", default=H.DEFAULT_GAMES, help="ALE games, mixed in this order")
    p.add_argument("--rounds", type=int, default=None, help="timed sample rounds per batch size (def. 200)")
    p.add_argument("--one-steps", type=int, default=None, help="transitions added one by one (default 2000)")
    p.add_argument("--online-steps", type=int, default=None,
                   help="steps of add 1 + sample 256 after a prefill of min(2048, steps/2) rows (default 400; quick 100)")
    p.add_argument("--quick", action="store_true", help="small run (~1-2 min) to check the script works")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads(N) and N tiered decode threads; 0 keeps both defaults")
    p.add_argument("--stores", nargs="+", default=None, help="subset: tiered tiered_auto tiered_k1 lts lms cls; also tiered_kK for the K in (2, 4, 8, 16) that is not the default")
    p.add_argument("--batches", type=int, nargs="+", default=list(SWEEP),
                   help=f"sample batch sizes (default {' '.join(map(str, SWEEP))}; 32 and 256 fill the main table)")
    p.add_argument("--profile", action="store_true", help="cProfile tiered get/extend at B=256 too")
    p.add_argument("--scale", type=int, default=2,
                   help="also fill tiered with scale x steps transitions (memory only; default 2)")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="wait up to this many seconds for other processes to use < 0.25 cores")
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory measurement")
    H.add_output_arguments(p)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-n", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 2000 if args.quick else 20000
    if args.rounds is None:
        args.rounds = 20 if args.quick else 200
    if args.one_steps is None:
        args.one_steps = 200 if args.quick else 2000
    args.one_steps = min(args.one_steps, args.steps)
    if args.online_steps is None:
        args.online_steps = 100 if args.quick else 400
    args.online_prefill = min(2048, args.steps // 2)
    args.online_steps = min(args.online_steps, args.steps - args.online_prefill)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    facts = H.machine_facts(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"{facts['cpu_model']}, {facts['logical_cores']} cores, {H.fmt_bytes(facts['ram_bytes'])} RAM; "
          f"Python {facts['python']}, torch {facts['torch']} ({facts['torch_threads']} threads), "
          f"torchrl {facts['torchrl']}, tiered {facts['tiered']}")
    loads = {"before": H.load_snapshot()}
    deadline = time.monotonic() + args.wait_quiet
    while loads["before"]["other_cores"] >= 0.25 and time.monotonic() < deadline:
        print("waiting for a quiet machine:", H.describe_load(loads["before"]))
        time.sleep(5)
        loads["before"] = H.load_snapshot(2.0)
    print("background before:", H.describe_load(loads["before"]))
    meters: dict[str, dict[str, float]] = {}

    m = H.CpuMeter()
    n = args.steps
    data = H.load_atari(args.games, n, rollout_steps(n, args.games, args.scale))
    rb_bytes = H.row_bytes(data)
    meters["load data"] = m.stop()
    print(f"data: {n:,} transitions of {', '.join(args.games)}, {rb_bytes:,} B each "
          f"({meters['load data']['wall_s']:.1f} s)")

    specs, why = build_specs(args.stores, args.threads)
    if why:
        print(f"tiered.torchrl not available ({why}): tiered rb cells are n/a")
    res = Results()
    block = max(10, args.one_steps // 40)
    profile_text = ""
    with tempfile.TemporaryDirectory(prefix="bench_storages_") as tmp:
        m = H.CpuMeter()
        bench_add_one(specs, data, args.one_steps, block, res, tmp, n)
        H.release_memory()
        meters["one at a time"] = m.stop()
        print(f"one at a time: done ({meters['one at a time']['wall_s']:.0f} s)")

        m = H.CpuMeter()
        bench_extend_small(specs, data, args.one_steps, 8, res, tmp, n)
        H.release_memory()
        meters["extend 16"] = m.stop()
        print(f"extend {SMALL_EXTEND}: done ({meters['extend 16']['wall_s']:.0f} s)")

        m = H.CpuMeter()
        bench_online(specs, data, args.online_steps, max(5, args.online_steps // 20), res, tmp, n,
                     prefill=args.online_prefill)
        H.release_memory()
        meters["online"] = m.stop()
        print(f"online: done ({meters['online']['wall_s']:.0f} s)")

        m = H.CpuMeter()
        units = bench_extend(specs, data, res, tmp, n)
        meters["extend 256"] = m.stop()
        print(f"extend 256: done ({meters['extend 256']['wall_s']:.0f} s)")

        m = H.CpuMeter()
        bench_sample(units, data, args.rounds, res, batches=tuple(args.batches))
        meters["sample"] = m.stop()
        print(f"sample: done ({meters['sample']['wall_s']:.0f} s)")
        del units
        H.release_memory()

        if args.profile:
            for spec in specs:
                if spec.family == "tiered":
                    profile_text += profile_tiered(spec, data, tmp)
            print(profile_text)

    mem: dict[str, dict[str, Any]] = {}
    scaled: dict[str, dict[str, Any]] = {}
    if not args.no_memory:
        m = H.CpuMeter()
        for spec in specs:
            mem[spec.key] = run_child(args, spec.key, n)
            if spec.family == "tiered":
                scaled[spec.key] = run_child(args, spec.key, args.scale * n)
        meters["memory (children)"] = m.stop()
        for k, v in {**mem, **{f"{k}@{args.scale}n": v for k, v in scaled.items()}}.items():
            if "error" in v:
                print(f"  ! memory {k}: {v['error']}", file=sys.stderr)
        print(f"memory: done ({meters['memory (children)']['wall_s']:.0f} s)")

    loads["after"] = H.load_snapshot()
    print("background after:", H.describe_load(loads["after"]))

    tables = {"throughput": throughput_table(specs, res),
              "sweep_rb": sweep_table(specs, res, tuple(args.batches), "rb"),
              "sweep_raw": sweep_table(specs, res, tuple(args.batches), "raw")}
    tables["memory"], per_tr = memory_rows(specs, mem, scaled)
    proj_text, proj_raw = projection(mem, scaled, specs)
    tables["thresholds"], thr_raw = thresholds(specs, res, per_tr, proj_raw)
    thr_note = ("Sample and extend checks use the TensorDictReplayBuffer path (rb); the overhead checks "
                "compare `rb.sample()` with `rb.storage.store.get(idx)` (the same TieredStore, the same "
                "indices, interleaved); bytes use the anon RSS growth above. A cell reads n/a when its "
                "path was not measurable.")
    problems = [f"{k} {m}: {s}" for k, d in res.checks.items() for m, s in d.items() if s != "ok"]

    print()
    print("Throughput (transitions/s; ratio vs LazyTensorStorage / vs CompressedListStorage)")
    print(tables["throughput"])
    print()
    print("Sample rate vs batch size, rb.sample() (transitions/s; ratio vs LazyTensorStorage)")
    print(tables["sweep_rb"])
    print()
    print("Sample rate vs batch size, the storage's own get")
    print(tables["sweep_raw"])
    print()
    print("Bytes held after filling (fresh process per store)")
    print(tables["memory"])
    print()
    print("1M-transition projection")
    print(proj_text)
    print()
    print("Thresholds (informational)")
    print(tables["thresholds"])
    print("content checks:", "all ok" if not problems else "; ".join(problems))
    print("CPU used by other processes:", describe_cpu_meters(meters))
    print(f"total {time.perf_counter() - t_start:.0f} s")

    summary = {
        "facts": facts,
        "args": vars(args),
        "transitions": n,
        "row_bytes": rb_bytes,
        "background": loads,
        "cpu_meters": meters,
        "rates": {s.key: {m: res.rate(s.key, m) for m in res.times.get(s.key, {})} for s in specs},
        "times_s": res.times,
        "quartiles_s": {s: {m: [H.quantile(t, q) for q in (0.25, 0.5, 0.75)] for m, t in d.items()}
                        for s, d in res.times.items()},
        "items_per_call": res.items,
        "errors": res.errors,
        "checks": res.checks,
        "memory": mem,
        "memory_scaled": scaled,
        "projection_1m": proj_raw,
        "thresholds": thr_raw,
        "profile": profile_text,
        "stores": {s.key: s.name for s in specs},
    }
    H.OUT_DIR.mkdir(parents=True, exist_ok=True)
    out_path = H.OUT_DIR / ("bench_storages_quick.json" if args.quick else "bench_storages.json")
    out_path.write_text(json.dumps(summary, indent=1, default=str))
    print(f"raw results: {out_path}")
    plots.plot_storages(out_path, plots.plot_dir(args.write_docs))

    notes = method_notes(args, args.rounds, args.one_steps, block, why)
    body = doc_body(facts, args, n, rb_bytes, thr_note, tables, loads, meters, proj_text, notes)
    print(f"report: {H.write_output(out_path.with_suffix('.md').name, body)}")
    if H.wants_docs(args):
        H.write_doc_section(body, BEGIN, END)
        print(f"docs: {H.DOC_PATH} (section {HEADING!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
