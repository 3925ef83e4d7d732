#!/usr/bin/env python3
"""GPU check of tiered: GPU tests, bit-exact CPU <-> GPU interop, every tier read on the GPU,
sample throughput and VRAM beside an uncompressed CUDA gather, and nvCOMP decode GB/s.

On a machine with one CUDA GPU (under 5 minutes)::

    python benchmarks/gpu_check.py [--out DIR] [--budget 280] [--rows 100000] [--quick] [--skip-tests]

On a CPU-only machine, to check this script's own logic (data prep, store building, tables; the
nvCOMP and CUDA parts are skipped and the decoder runs its CPU stand-in)::

    python benchmarks/gpu_check.py --cpu-dry-run

Needs torch, numpy, zstandard, tensordict, h5py, psutil and this checkout; nvidia-nvcomp for the
GPU parts; lz4 for the LZ4 rows. Not torchrl, not ale-py: real Atari frames come from
``benchmarks/data/atari_frames.npz`` (``tiered.atari.load_fixture``).

Stages, each in its own try/except under a time budget (a failure is recorded, the rest runs):

1. ``pytest -m cuda`` on tests/test_gpu.py and tests/test_prefetch.py (in a subprocess);
2. interop on real frames: CPU zstd -> nvCOMP decode, nvCOMP encode -> zstandard decode, LZ4
   both ways, deflate; nvCOMP's probe results;
3. a store with blobs in the hot CUDA arena, the warm pinned arena and a cold memmap file (plus
   an open chunk) read on the GPU, compared with a CPU store; a damaged blob must raise;
4. decode GB/s per codec (zstd, lz4) for N = 256/1024/4096 chunks of 4 frames;
5. sample throughput at batch 256/1024/4096 with every blob hot, warm or cold, on a buffer of
   ``--rows`` transitions built from the fixture's real frames tiled with a 2-byte per-copy stamp
   in each frame's top-left corner (so copies do not deduplicate into one), beside a gather from
   the same data as uncompressed CUDA tensors (what ``LazyTensorStorage(device="cuda")`` does),
   with the VRAM each holds.

The PASS/FAIL lines of the targets and the table are printed last (from a ``finally`` block);
everything is also written to ``$OUT/gpu_check.json`` (``--out``, else ``$OUT``, else
``./gpu_check_out``), rewritten after every stage so a crash keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
FIXTURE = REPO / "benchmarks" / "data" / "atari_frames.npz"
FRAME = 84 * 84
TRANSITION_BYTES = 2 * 4 * FRAME  # observation + next observation stacks (uint8)

TARGETS = [
    # (name, check(results) -> (ok, value text))
    "hot tier >= 500k transitions/s at batch 256",
    "hot tier >= 2M transitions/s at batch 4096",
    "hot at batch 256 >= 0.3x the uncompressed CUDA gather",
    "hot tier holds >= 60x less VRAM than the uncompressed CUDA tensors",
    "warm (pinned) tier >= 200k transitions/s at batch 256",
]


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------


class Run:
    """Results, time budget and the JSON file of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        out = args.out or os.environ.get("OUT") or str(Path.cwd() / "gpu_check_out")
        self.out_dir = Path(out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.res: dict[str, Any] = {
            "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
            "argv": sys.argv,
            "stages": {},
            "env": {},
            "tests": {},
            "interop": {},
            "store_tiers": {},
            "decode_gbps": [],
            "throughput": {"rows": [], "vram": {}},
            "targets": [],
        }

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def stage(self, name: str, fn, need_s: float = 0.0) -> None:
        if self.left() < need_s:
            self.res["stages"][name] = {"ok": False, "skipped": f"time budget: {self.left():.0f}s left"}
            print(f"[{name}] skipped: only {self.left():.0f}s of the budget left", flush=True)
            return
        print(f"[{name}] start ({self.left():.0f}s of the budget left)", flush=True)
        t = time.monotonic()
        try:
            fn()
            self.res["stages"][name] = {"ok": True, "seconds": round(time.monotonic() - t, 1)}
            print(f"[{name}] done in {time.monotonic() - t:.1f}s", flush=True)
        except BaseException as e:  # one failing stage must not stop the others
            tb = traceback.format_exc()
            self.res["stages"][name] = {"ok": False, "seconds": round(time.monotonic() - t, 1),
                                        "error": f"{type(e).__name__}: {e}", "traceback": tb[-4000:]}
            print(f"[{name}] FAILED: {type(e).__name__}: {e}\n{tb[-2000:]}", flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            self.save()

    def save(self) -> None:
        self.res["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        path = self.out_dir / "gpu_check.json"
        path.write_text(json.dumps(self.res, indent=1, default=str))


def _dev(run: Run):
    import torch

    return torch.device("cpu") if run.args.cpu_dry_run else torch.device("cuda", 0)


def _sync(run: Run) -> None:
    import torch

    if not run.args.cpu_dry_run:
        torch.cuda.synchronize()


def _timeit(run: Run, fn, min_s: float, max_iter: int, warmup: int = 2) -> tuple[float, int]:
    """Seconds per call (mean over at least 2 calls, until ``min_s`` passed)."""
    for _ in range(warmup):
        fn()
    _sync(run)
    n, t = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n >= max_iter or (n >= 2 and time.perf_counter() - t >= min_s):
            break
    _sync(run)
    return (time.perf_counter() - t) / n, n


def _fmt_rate(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def _fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


# ---------------------------------------------------------------------------------------------
# Stage 0: environment
# ---------------------------------------------------------------------------------------------


def stage_env(run: Run) -> None:
    import platform

    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
    for mod in ("zstandard", "tensordict", "lz4", "h5py", "psutil", "numpy"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # record, do not fail: the stage that needs it will say so
            env[mod] = f"unavailable: {e}"
    try:
        from tiered.codecs.nvcomp import import_nvcomp

        nv = import_nvcomp()
        env["nvcomp"] = f"{nv.__version__} (CUDA {getattr(nv, '__cuda_version__', '?')})"
    except Exception as e:
        env["nvcomp"] = f"unavailable: {e}"
    # tiered.atari must load the fixture where gymnasium/ale-py cannot be imported at all
    code = ("import sys; sys.modules['ale_py'] = None; sys.modules['gymnasium'] = None\n"
            "from tiered.atari import load_fixture\n"
            f"td = load_fixture({str(FIXTURE)!r}, games=['Pong']); print(tuple(td['observation'].shape))")
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": pythonpath})
    env["atari_fixture_without_ale"] = p.returncode == 0 and "(2000, 4, 84, 84)" in p.stdout
    if not env["atari_fixture_without_ale"]:
        env["atari_fixture_error"] = (p.stdout + p.stderr)[-500:]
    run.res["env"] = env
    print("  " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if not run.args.cpu_dry_run and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible: run with --cpu-dry-run on a CPU-only machine")


# ---------------------------------------------------------------------------------------------
# Stage 1: pytest -m cuda
# ---------------------------------------------------------------------------------------------


def stage_tests(run: Run) -> None:
    timeout = max(30.0, min(150.0, run.left() - 120.0))
    # no --timeout: pytest-timeout may not be installed there; the subprocess timeout bounds the run
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_gpu.py", "tests/test_prefetch.py",
           "-q", "-rfEs", "-p", "no:cacheprovider"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout + 30, env=env)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    words = ("passed", "failed", "skipped", "error")
    summary = next((ln for ln in reversed(out.splitlines()) if " in " in ln and any(w in ln for w in words)),
                   "no summary line")
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error", "deselected")}
    for part in summary.strip("= ").split(","):
        bits = part.strip().split()
        if len(bits) >= 2 and bits[0].isdigit():
            key = bits[1].rstrip("s") if bits[1].rstrip("s") in counts else bits[1]
            counts[key] = int(bits[0])
    run.res["tests"] = {"returncode": rc, "summary": summary.strip("= "), "counts": counts,
                        "seconds": round(time.monotonic() - t, 1), "tail": out[-6000:]}
    print(f"  pytest -m cuda: {summary.strip('= ')} (rc={rc})", flush=True)
    failing = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    for ln in failing[:20]:
        print("   ", ln, flush=True)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def fixture_frames() -> np.ndarray:
    """Every distinct 84x84 screen of the fixture's games, in play order: uint8 [F, 84*84]."""
    with np.load(FIXTURE) as data:
        games = [str(g) for g in data["games"]]
        return np.concatenate([np.asarray(data[f"{g}/frames"]).reshape(-1, FRAME) for g in games])


def chunk_batch(n: int, k: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` cells of ``k`` consecutive real frames (tiled with a per-copy stamp past the fixture)."""
    frames = fixture_frames()
    per_copy = frames.shape[0] // k
    copies = -(-n // per_copy)
    parts = []
    for c in range(copies):
        f = frames[: per_copy * k].copy()
        f[:, 0], f[:, 1] = c & 255, (c >> 8) & 255
        parts.append(f)
    raw = np.concatenate(parts)[: n * k].reshape(-1)
    sizes = np.full(n, k * FRAME, np.int64)
    return np.ascontiguousarray(raw), np.arange(n, dtype=np.int64) * k * FRAME, sizes


def stamped_copies(rows: int):
    """Yield TensorDicts of the fixture's transitions, copy ``c`` stamped with ``c``, ``rows`` in all."""
    from tiered.atari import load_fixture

    base = load_fixture(FIXTURE)
    n0 = base.batch_size[0]
    traj_span = int(base["collector", "traj_ids"].max()) + 1
    done = 0
    c = 0
    while done < rows:
        td = base[: min(n0, rows - done)].clone()
        for key in ("observation", ("next", "observation")):
            x = td.get(key)
            # same stamp on every frame of the copy: stacks that shared a frame still share it
            x[..., 0, 0] = c & 255
            x[..., 0, 1] = (c >> 8) & 255
        td["collector", "traj_ids"] = td["collector", "traj_ids"] + c * traj_span
        yield td
        done += td.batch_size[0]
        c += 1


def _aligned_upload(run: Run, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray):
    import torch

    from tiered.util.copy import copy_host_blobs

    a = (sizes + 15) // 16 * 16
    off = np.concatenate([[0], np.cumsum(a)[:-1]]).astype(np.int64)
    host = np.zeros(int(a.sum()), np.uint8)
    copy_host_blobs(data, offsets, host, off, sizes)
    return torch.from_numpy(host).to(_dev(run)), off


# ---------------------------------------------------------------------------------------------
# Stage 2: interop
# ---------------------------------------------------------------------------------------------


def stage_interop(run: Run) -> None:
    import zlib

    import torch
    import zstandard

    from tiered.codecs import Lz4Codec, ZstdCodec

    checks = run.res["interop"]

    def record(name: str, fn) -> None:
        try:
            ok, detail = fn()
        except Exception as e:  # record and go on to the next check
            ok, detail = False, f"{type(e).__name__}: {e}"
        checks[name] = {"ok": bool(ok), "detail": detail}
        print(f"  {'OK  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    raw1, off1, sz1 = chunk_batch(512, 1)
    raw4, off4, sz4 = chunk_batch(512, 4)
    if run.args.cpu_dry_run:
        for name, codec in (("zstd", ZstdCodec()), ("lz4", Lz4Codec())):
            def cpu_round(codec=codec):
                enc = codec.encode(raw4, off4, sz4)
                out = np.zeros_like(raw4)
                codec.decode(enc.data, enc.offsets, enc.sizes, out, off4, sz4)
                return np.array_equal(out, raw4), f"CPU round trip, ratio {raw4.size / enc.data.size:.1f}x"
            record(f"{name} CPU round trip (dry run: no nvCOMP)", cpu_round)
        return

    from tiered.codecs.nvcomp import NvcompCodec

    nv = {f: NvcompCodec(f) for f in ("zstd", "lz4", "deflate")}
    for f in ("zstd", "lz4", "deflate"):
        record(f"{f} probe", lambda f=f: (nv[f].probe()["exact"] is not None, json.dumps(nv[f].probe())))

    def cpu_to_gpu(level: int, raw, off, sz):
        enc = ZstdCodec(level).encode(raw, off, sz)
        dev, doff = _aligned_upload(run, enc.data, enc.offsets, enc.sizes)
        out = torch.zeros(raw.size, dtype=torch.uint8, device="cuda")
        nv["zstd"].decode_device(dev, doff, enc.sizes, out, off, sz)
        same = torch.equal(out.cpu(), torch.from_numpy(raw))
        return same, f"{sz.size} frames of {int(sz[0])} B, ratio {raw.size / enc.data.size:.1f}x"

    for level in (1, 3, 19, -5):
        record(f"zstd CPU L{level} -> GPU (K=1)", lambda lv=level: cpu_to_gpu(lv, raw1, off1, sz1))
        record(f"zstd CPU L{level} -> GPU (K=4)", lambda lv=level: cpu_to_gpu(lv, raw4, off4, sz4))

    def gpu_to_cpu():
        enc = nv["zstd"].encode(raw4, off4, sz4)
        out = np.zeros_like(raw4)
        ZstdCodec().decode(enc.data, enc.offsets, enc.sizes, out, off4, sz4)
        first = enc.data[: enc.sizes[0]].tobytes()
        one = zstandard.ZstdDecompressor().decompress(first, max_output_size=int(sz4[0]))
        ok = np.array_equal(out, raw4) and one == raw4[: sz4[0]].tobytes()
        return ok, f"encode path {nv['zstd'].last_encode_path!r}, ratio {raw4.size / enc.data.size:.1f}x"

    record("zstd GPU -> CPU zstandard (K=4)", gpu_to_cpu)

    def host_api():
        enc = ZstdCodec().encode(raw4, off4, sz4)
        out = np.zeros_like(raw4)
        nv["zstd"].decode(enc.data, enc.offsets, enc.sizes, out, off4, sz4)
        return np.array_equal(out, raw4), "NvcompCodec.decode on host buffers"

    record("zstd CPU -> GPU via the Codec contract", host_api)

    def lz4_both():
        enc = Lz4Codec().encode(raw4, off4, sz4)
        out = np.zeros_like(raw4)
        nv["lz4"].decode(enc.data, enc.offsets, enc.sizes, out, off4, sz4)
        enc2 = nv["lz4"].encode(raw4, off4, sz4)
        out2 = np.zeros_like(raw4)
        Lz4Codec().decode(enc2.data, enc2.offsets, enc2.sizes, out2, off4, sz4)
        return np.array_equal(out, raw4) and np.array_equal(out2, raw4), "lz4.block <-> nvCOMP LZ4 RAW"

    record("lz4 CPU <-> GPU (K=4)", lz4_both)

    def deflate():
        enc = nv["deflate"].encode(raw1[: 64 * FRAME], off1[:64], sz1[:64])
        first = zlib.decompress(enc.data[: enc.sizes[0]].tobytes(), -15) == raw1[:FRAME].tobytes()
        out = np.zeros(64 * FRAME, np.uint8)
        nv["deflate"].decode(enc.data, enc.offsets, enc.sizes, out, off1[:64], sz1[:64])
        return first and np.array_equal(out, raw1[: 64 * FRAME]), "GPU deflate -> zlib raw, and back"

    record("deflate GPU <-> zlib (raw RFC 1951)", deflate)


# ---------------------------------------------------------------------------------------------
# Stage 3: a store with blobs in every tier, read on the GPU
# ---------------------------------------------------------------------------------------------


def _attach(run: Run, store):
    from tiered.gpu import GpuDecoder

    dec = store.gpu_decoder
    if dec is None:
        dec = GpuDecoder(_dev(run)).attach(store)
    return dec


def _build_tier_store(path, data, device: str, hot_device: str, codec: str = "zstd"):
    from tiered import TieredStore
    from tiered.testing import spread_over_tiers

    store = TieredStore(700, path, frames={"observation": 0}, hot_device=hot_device, hot_bytes="64MiB",
                        warm_bytes="64MiB", promote=False, device=device, codec=codec)
    for i in range(0, 600, 50):
        store.extend(data[i:i + 50])
    store.flush()
    spread_over_tiers(store)
    store.extend(data[600:603])  # an open chunk
    return store


def stage_store_tiers(run: Run) -> None:
    import torch

    from tiered.atari import load_fixture
    from tiered.errors import ChecksumError
    from tiered.index import HOT, OPEN
    from tiered.testing import parts, tier_counts

    data = load_fixture(FIXTURE, games=["Breakout", "MsPacman"])
    dev = _dev(run)
    out = run.res["store_tiers"]
    with tempfile.TemporaryDirectory() as tmp:
        for codec in ("zstd", "lz4"):
            ref = _build_tier_store(Path(tmp) / f"cpu-{codec}", data, "cpu", "cpu", codec)
            store = _build_tier_store(Path(tmp) / f"dev-{codec}", data, str(dev), str(dev), codec)
            counts = tier_counts(store)
            dec = _attach(run, store)
            rng = np.random.default_rng(0)
            ok = True
            for b in (len(store), 1, 256, 4096):
                ix = np.arange(len(store)) if b == len(store) else rng.integers(0, len(store), b)
                got = store.get(ix).to("cpu")
                want = ref.get(ix)
                for k in want.keys(include_nested=True, leaves_only=True):
                    ok &= bool(torch.equal(got.get(k), want.get(k)))
            st = dec.stats()
            out[codec] = {"tiers": counts, "bit_exact": ok, "decoder": {k: st.get(k) for k in (
                "hot", "warm", "cold", "open", "pads", "cpu_fallbacks", "oom_events", "backend")},
                "hot_arena_device": str(parts(store).tiers[HOT].device),
                "warm_pinned": bool(getattr(parts(store).tiers[1], "pinned", False))}
            print(f"  {codec}: tiers {counts}, bit-exact vs CPU store: {ok}, decoder {out[codec]['decoder']}",
                  flush=True)
            # damage one hot blob: the GPU path must raise before decoding
            idx = parts(store).index
            live = idx.live_ids()
            hot_ids = live[(idx.loc[live, HOT] >= 0) & (idx.state[live] != OPEN)]
            victim = int(hot_ids[0])
            pos = int(idx.loc[victim, HOT]) + 2
            arena = parts(store).tiers[HOT].buffer
            arena[pos] ^= 0x5A
            rows = np.flatnonzero((parts(store).layout.tables[("observation",)].blob[: len(store)] == victim).any(1))
            try:
                store.get(rows[:2])
                raised = False
            except ChecksumError:
                raised = True
            arena[pos] ^= 0x5A
            out[codec]["damaged_blob_raises"] = raised
            print(f"  {codec}: damaged hot blob raises ChecksumError: {raised}", flush=True)
            store.close()
            ref.close()


# ---------------------------------------------------------------------------------------------
# Stage 4: decode GB/s per codec
# ---------------------------------------------------------------------------------------------


def _decode_rows(run: Run, fmt: str, cpu_codec, raw: np.ndarray, off: np.ndarray, sz: np.ndarray,
                 nmax: int) -> list[dict]:
    import torch

    rows = []
    enc = cpu_codec.encode(raw, off, sz)
    ratio = raw.size / enc.data.size
    # CPU reference: the codec tiered uses without a GPU (all cores)
    out_h = np.empty_like(raw)
    s, _ = _timeit(run, lambda: cpu_codec.decode(enc.data, enc.offsets, enc.sizes, out_h, off, sz), 0.3, 20,
                   warmup=1)
    rows.append({"codec": f"{fmt} (CPU, {os.cpu_count()} threads)", "n": nmax, "gbps": raw.size / s / 1e9,
                 "us_per_call": s * 1e6, "ratio": ratio, "bit_exact": bool(np.array_equal(out_h, raw))})
    if run.args.cpu_dry_run:
        return rows
    from tiered.codecs.nvcomp import NvcompCodec

    codec = NvcompCodec(fmt)
    dev, doff = _aligned_upload(run, enc.data, enc.offsets, enc.sizes)
    out = torch.zeros(raw.size, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    for n in (256, 1024, 4096):
        if n > nmax:
            continue
        def call(n: int = n) -> None:
            codec.decode_device(dev, doff[:n], enc.sizes[:n], out, off[:n], sz[:n], stream=stream)
        call()
        stream.synchronize()
        exact = torch.equal(out[: n * 4 * FRAME].cpu(), torch.from_numpy(raw[: n * 4 * FRAME]))
        with torch.cuda.stream(stream):
            s, _ = _timeit(run, call, 0.3, 500)
        stream.synchronize()
        rows.append({"codec": f"{fmt} (nvCOMP)", "n": n, "gbps": n * 4 * FRAME / s / 1e9,
                     "us_per_call": s * 1e6, "ratio": ratio, "bit_exact": exact,
                     "mode": codec.probe()["exact"], "config_cache": codec.counters()})
    return rows


def stage_decode(run: Run) -> None:
    from tiered.codecs import Lz4Codec, ZstdCodec

    nmax = 4096 if not run.args.quick else 1024
    raw, off, sz = chunk_batch(nmax, 4)
    rows = run.res["decode_gbps"]
    for fmt, cpu_codec in (("zstd", ZstdCodec()), ("lz4", Lz4Codec())):
        try:
            rows.extend(_decode_rows(run, fmt, cpu_codec, raw, off, sz, nmax))
        except Exception as e:  # the other codec still runs
            rows.append({"codec": fmt, "n": 0, "gbps": float("nan"), "us_per_call": float("nan"),
                         "ratio": 0.0, "bit_exact": False, "error": f"{type(e).__name__}: {e}"})
            print(f"  {fmt}: FAILED {type(e).__name__}: {e}", flush=True)
    for r in rows:
        print(f"  {r['codec']:<26} N={r['n']:<5} {r['gbps']:7.2f} GB/s  {r['us_per_call']:9.1f} us/call  "
              f"ratio {r['ratio']:.1f}x  bit-exact {r['bit_exact']}", flush=True)


# ---------------------------------------------------------------------------------------------
# Stage 5: sample throughput and VRAM
# ---------------------------------------------------------------------------------------------


def stage_throughput(run: Run) -> None:
    import shutil

    import torch

    dry = run.args.cpu_dry_run
    dev = _dev(run)
    rows = run.args.rows
    tp = run.res["throughput"]
    tp["data"] = (f"{rows:,} transitions: the fixture's 6,000 real Atari transitions (Pong, MsPacman, "
                  "Breakout; 4x84x84 uint8 stacks + next stacks) tiled, each copy stamped with a 2-byte copy "
                  "id in the top-left pixels of every frame so copies do not deduplicate")
    tp["device"] = str(dev)
    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    path = Path(tmp) / "store"

    # 1) the tiered store (CPU build, durable cold tier), and the uncompressed copy on the device
    holder: dict[str, Any] = {}
    try:
        written, build_s = _build_buffer(run, path, rows, None, holder)
        _throughput_tables(run, tmp, path, holder.pop("base"), written, build_s)
    finally:
        holder.clear()
        shutil.rmtree(tmp, ignore_errors=True)
        if not dry:
            torch.cuda.empty_cache()


def _throughput_tables(run: Run, tmp: str, path: Path, base: Any, written: int, build_s: float) -> None:
    import torch

    import tiered
    from tiered.testing import tier_counts

    dry = run.args.cpu_dry_run
    dev = _dev(run)
    rows = written
    tp = run.res["throughput"]
    tp["build"] = {"rows": written, "seconds": round(build_s, 1), "extend_rows_per_s": written / build_s}
    print(f"  built {written:,} rows in {build_s:.1f}s ({written / build_s:,.0f} rows/s, CPU zstd + copy)",
          flush=True)
    base_bytes = sum(v.numel() * v.element_size() for v in base.values(include_nested=True, leaves_only=True))
    tp["vram"]["uncompressed"] = base_bytes
    _sync(run)

    rng = np.random.default_rng(0)
    batches = (256, 1024, 4096)
    idx_sets = {b: [rng.integers(0, rows, b) for _ in range(8)] for b in batches}
    min_s = 0.25 if not run.args.quick else 0.1

    def bench(label: str, fn_for, vram: int | None, check=None) -> None:
        for b in batches:
            if run.left() < 20:
                tp["rows"].append({"config": label, "batch": b, "skipped": "time budget"})
                continue
            sets = idx_sets[b]
            it = [0]

            def call(b=b, sets=sets, it=it):
                it[0] += 1
                return fn_for(sets[it[0] % len(sets)])

            if check is not None:
                check(sets[0])
            if not dry:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            s, n = _timeit(run, call, min_s, 400 if not dry else 6)
            peak = (torch.cuda.max_memory_allocated() - before) if not dry else None
            tp["rows"].append({"config": label, "batch": b, "transitions_per_s": b / s,
                               "us_per_batch": s * 1e6, "iterations": n, "vram_held": vram,
                               "transient_peak_bytes": peak})
            print(f"  {label:<13} batch {b:<5} {_fmt_rate(b / s):>8} transitions/s  {s * 1e6:10.1f} us/batch",
                  flush=True)

    # uncompressed gather: a TensorDict on the device indexed by an index on the device
    dev_idx = {b: [torch.from_numpy(x).to(dev) for x in idx_sets[b]] for b in batches}
    dev_map = {id(x): d for b in batches for x, d in zip(idx_sets[b], dev_idx[b], strict=True)}
    bench("uncompressed", lambda ix: base[dev_map[id(ix)]], base_bytes)

    def check_against_base(store):
        def check(ix):
            got = store.get(ix)
            want = base[dev_map[id(ix)]]
            for k in ("observation", ("next", "observation"), "action"):
                if not torch.equal(got.get(k).to(dev), want.get(k)):
                    raise AssertionError(f"tiered and uncompressed batches differ in {k}")
        return check

    configs = [("hot", path, {"hot_bytes": "32GiB", "warm_bytes": 0, "hot_device": str(dev)}),
               ("warm", path, {"hot_bytes": 0, "warm_bytes": "32GiB"}),
               ("cold", path, {"hot_bytes": 0, "warm_bytes": 0, "promote": False}),
               ("hot (K=1)", None, {"hot_bytes": "32GiB", "warm_bytes": 0, "hot_device": str(dev)})]
    for label, where, opts in configs:
        if where is None:  # optional: one frame per blob decodes only the frames a sample needs
            if run.left() < 110 or run.args.quick:
                print(f"  {label}: skipped (time budget)", flush=True)
                continue
            where = Path(tmp) / "store_k1"
            n1, s1 = _build_buffer(run, where, rows, 1, None)
            tp["build_k1"] = {"rows": n1, "seconds": round(s1, 1)}
        if run.left() < 30:
            print(f"  {label}: skipped (time budget)", flush=True)
            continue
        try:
            store = tiered.open(where, mode="r", device=str(dev), **opts)
            dec = _attach(run, store)
            t = time.monotonic()
            if label != "cold":  # promote every blob into the tier under test (reads in row order)
                for i in range(0, rows, 4096):
                    store.get(np.arange(i, min(i + 4096, rows)))
            counts = tier_counts(store)
            from tiered.testing import parts
            hot = parts(store).tiers[0]
            # the hot arena's allocated bytes (VRAM on a GPU; host memory standing in for it in a dry run)
            vram = int(hot.capacity) if hot is not None else 0
            tp["vram"][label] = vram
            tp.setdefault("placement", {})[label] = {
                "tiers": counts, "warmup_s": round(time.monotonic() - t, 1),
                "hot_bytes_used": int(hot.bytes_used) if hot else 0}
            print(f"  {label}: blobs per tier {counts}, hot arena {_fmt_bytes(vram)}", flush=True)
            bench(label, store.get, vram, check_against_base(store))
            keep = ("batches", "hot", "warm", "cold", "pads", "cpu_fallbacks", "oom_events", "splits",
                    "h2d_bytes")
            tp.setdefault("decoder", {})[label] = {k: v for k, v in dec.stats().items() if k in keep}
            store.close()
        except Exception as e:
            tp.setdefault("errors", {})[label] = f"{type(e).__name__}: {e}"
            print(f"  {label}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", flush=True)


def _build_buffer(run: Run, path: Path, rows: int, chunk_frames: int | None,
                  holder: dict[str, Any] | None) -> tuple[int, float]:
    """Write the tiled buffer into a store at ``path`` (CPU encode, cold tier only); with ``holder``
    also fill ``holder["base"]``, the same rows as uncompressed tensors on the device."""
    import torch

    from tiered import TieredStore

    dev = _dev(run)
    t = time.monotonic()
    kw = {} if chunk_frames is None else {"chunk_frames": chunk_frames}  # None: the store's default
    builder = TieredStore(rows, path, frames={"observation": 0}, hot_bytes=0, warm_bytes=0, **kw)
    written = 0
    for td in stamped_copies(rows):
        n = td.batch_size[0]
        for i in range(0, n, 2000):
            builder.extend(td[i:i + 2000])
        if holder is not None:
            if "base" not in holder:
                def alloc(x: torch.Tensor) -> torch.Tensor:
                    return torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=dev)

                holder["base"] = td[:1].to(dev).apply(alloc, batch_size=[rows])
            holder["base"][written:written + n] = td.to(dev)
        written += n
        if run.left() < 60:
            raise RuntimeError(f"time budget: stopped building after {written:,} rows; rerun with --rows")
    builder.close()
    return written, time.monotonic() - t


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _rate(run: Run, config: str, batch: int) -> float | None:
    for r in run.res["throughput"]["rows"]:
        if r["config"] == config and r["batch"] == batch and "transitions_per_s" in r:
            return r["transitions_per_s"]
    return None


def evaluate_targets(run: Run) -> None:
    dry = run.args.cpu_dry_run
    vram = run.res["throughput"].get("vram", {})
    hot256, hot4096 = _rate(run, "hot", 256), _rate(run, "hot", 4096)
    unc256, warm256 = _rate(run, "uncompressed", 256), _rate(run, "warm", 256)
    vr = (vram["uncompressed"] / vram["hot"]) if vram.get("hot") and vram.get("uncompressed") else None
    checks = [
        (TARGETS[0], hot256, hot256 is not None and hot256 >= 500e3, f"{_fmt_rate(hot256)}/s"),
        (TARGETS[1], hot4096, hot4096 is not None and hot4096 >= 2e6, f"{_fmt_rate(hot4096)}/s"),
        (TARGETS[2], hot256 and unc256, bool(hot256 and unc256 and hot256 >= 0.3 * unc256),
         f"{hot256 / unc256:.2f}x" if hot256 and unc256 else "-"),
        (TARGETS[3], vr, vr is not None and vr >= 60, f"{vr:.0f}x less" if vr else "-"),
        (TARGETS[4], warm256, warm256 is not None and warm256 >= 200e3, f"{_fmt_rate(warm256)}/s"),
    ]
    run.res["targets"] = []
    for name, value, ok, text in checks:
        verdict = "SKIP" if dry else ("PASS" if ok else ("FAIL" if value is not None else "MISSING"))
        run.res["targets"].append({"target": name, "verdict": verdict, "value": text})


def print_report(run: Run) -> None:
    res = run.res
    dry = run.args.cpu_dry_run
    print("\n" + "=" * 100)
    print(f"tiered gpu_check ({'CPU DRY RUN: no GPU figure below is a GPU measurement' if dry else 'GPU'}), "
          f"{res.get('elapsed_s', 0):.0f}s; JSON: {run.out_dir / 'gpu_check.json'}")
    env = res.get("env", {})
    print(f"  {env.get('gpu', 'no GPU')} | torch {env.get('torch')} | nvCOMP {env.get('nvcomp')}")
    verdicts = {k: "ok" if v.get("ok") else ("skipped" if "skipped" in v else "FAILED")
                for k, v in res["stages"].items()}
    print("\nstages: " + ", ".join(f"{k}={v}" for k, v in verdicts.items()))
    for k, v in res["stages"].items():
        if not v.get("ok") and "error" in v:
            print(f"  {k}: {v['error']}")
    if res.get("tests"):
        print(f"pytest -m cuda: {res['tests'].get('summary')}")
    bad = [k for k, v in res.get("interop", {}).items() if not v["ok"]]
    if res.get("interop"):
        print(f"interop: {len(res['interop']) - len(bad)}/{len(res['interop'])} OK" +
              (f"; FAILED: {', '.join(bad)}" if bad else ""))
    for codec, v in res.get("store_tiers", {}).items():
        print(f"store on {'CPU stand-in' if dry else 'GPU'} ({codec}): tiers {v.get('tiers')}, bit-exact "
              f"{v.get('bit_exact')}, damaged blob raises {v.get('damaged_blob_raises')}")
    if res.get("decode_gbps"):
        print("\ndecode throughput (chunks of 4 real 84x84 frames, 28,224 B raw each)")
        print(f"  {'codec':<26} {'N':>5} {'GB/s':>8} {'us/call':>10} {'ratio':>7} {'exact':>6}")
        for r in res["decode_gbps"]:
            print(f"  {r['codec']:<26} {r['n']:>5} {r['gbps']:>8.2f} {r['us_per_call']:>10.1f} "
                  f"{r['ratio']:>6.1f}x {str(r['bit_exact']):>6}")
    print("\ntargets" + (" (dry run: not evaluated)" if dry else ""))
    for t in res.get("targets", []):
        print(f"  {t['verdict']:<7} {t['target']}: {t['value']}")
    tp = res.get("throughput", {})
    print(f"\nsample throughput on {tp.get('device', '?')}: {tp.get('data', '(not run)')}")
    vram = tp.get("vram", {})
    unc_vram = vram.get("uncompressed")
    print(f"  {'config':<13} {'batch':>6} {'transitions/s':>14} {'us/batch':>10} {'vs uncompr.':>11} "
          f"{'VRAM held':>11} {'VRAM ratio':>11}")
    for r in tp.get("rows", []):
        if "transitions_per_s" not in r:
            print(f"  {r['config']:<13} {r['batch']:>6} {'skipped':>14}")
            continue
        unc = _rate(run, "uncompressed", r["batch"])
        held = r.get("vram_held")
        ratio = "-" if r["config"] == "uncompressed" or not unc else f"{r['transitions_per_s'] / unc:.2f}x"
        vr = "-" if not held or not unc_vram or r["config"] == "uncompressed" else \
            f"{unc_vram / held:.0f}x less"
        print(f"  {r['config']:<13} {r['batch']:>6} {_fmt_rate(r['transitions_per_s']):>14} "
              f"{r['us_per_batch']:>10.1f} {ratio:>11} {_fmt_bytes(held):>11} {vr:>11}")
    print("  VRAM held: the hot arena's allocated bytes (the blob index and row tables are host memory) vs "
          "the uncompressed tensors; output batches excluded.")
    print("=" * 100, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output folder (default $OUT, else ./gpu_check_out)")
    ap.add_argument("--budget", type=float, default=280.0, help="soft time budget in seconds")
    ap.add_argument("--rows", type=int, default=None, help="transitions in the throughput buffer (100,000)")
    ap.add_argument("--quick", action="store_true", help="shorter timings and a 20,000-row buffer")
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: skip nvCOMP/CUDA, run data prep, store building and the tables on the CPU")
    args = ap.parse_args(argv)
    if args.rows is None:
        args.rows = 12_000 if args.cpu_dry_run else (20_000 if args.quick else 100_000)
    run = Run(args)
    try:
        run.stage("env", lambda: stage_env(run))
        if not args.skip_tests:
            run.stage("tests", lambda: stage_tests(run), need_s=60)
        run.stage("interop", lambda: stage_interop(run), need_s=20)
        run.stage("store_tiers", lambda: stage_store_tiers(run), need_s=20)
        run.stage("decode_gbps", lambda: stage_decode(run), need_s=20)
        run.stage("throughput", lambda: stage_throughput(run), need_s=45)
    finally:
        try:
            evaluate_targets(run)
        except Exception as e:  # the report must still print
            run.res["targets"] = [{"target": "evaluation", "verdict": "ERROR", "value": repr(e)}]
        run.save()
        print_report(run)
    failed = [k for k, v in run.res["stages"].items() if not v.get("ok") and "skipped" not in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
