#!/usr/bin/env python3
"""GPU check of tiered: a run that cannot be wasted.

On a machine with one CUDA GPU (finishes inside ``--budget`` seconds, 300 by default)::

    python benchmarks/gpu_check.py [--budget 300] [--rows 100000] [--out DIR]

On a CPU-only machine the same stage machinery runs with the CPU codecs and the GPU decoder's
CPU stand-in (no figure is a GPU figure)::

    python benchmarks/gpu_check.py --cpu-dry-run

How it protects the run:

* the first line prints at once, the preflight line (versions, device, free memory) within
  seconds;
* every stage runs in its own child process under a hard time limit: a hang is killed at the
  limit (``faulthandler`` dumps every thread's stack shortly before), a crash (SIGABRT,
  SIGSEGV, a sticky CUDA error) ends only that child; the next stage starts in a fresh process;
* each stage records its results as it goes; after every stage the parent prints its verdict
  and rewrites ``gpu_check.json`` (and ``gpu_check.log``, everything printed) in
  ``benchmarks/out/`` (or ``--out DIR``) and in ``$OUT`` when it is set;
* stages come in order of value, and each gets ``min(its cap, time left)``: the throughput
  buffer is built with as many rows as its share of the time allows (never an error), and
  timings shrink with the time left;
* one overall ``--budget`` (default 300 s) bounds the whole run, so a second try fits the same
  device session.

Stages (``--only`` selects some):

1. ``preflight``: versions, device, free memory, a tiny CUDA kernel;
2. ``probe``: nvCOMP's probe per format (errors first), then the decode configuration the GPU
   decoder chose from it;
3. ``tiers``: bit-exact CPU <-> GPU: stores with blobs in the hot CUDA arena, the warm pinned
   arena, the cold file and an open chunk, read on the GPU and compared with a CPU twin store
   (zstd, lz4, one frame per blob, and RGB frames larger than 64 KiB); a damaged blob must raise;
4. ``interop``: codec level, CPU zstd (levels -5..19) -> nvCOMP, nvCOMP -> zstandard, LZ4 both
   ways, raw deflate;
5. ``tests``: ``pytest -m cuda`` on tests/test_gpu*.py, test_prefetch, test_copy, test_tiers (each outcome
   recorded as it happens): the claims only a GPU can check (an allocation failure raised into
   nvCOMP, a sticky CUDA error, a prefetch thread's promotions against the main thread's writes,
   the registered pinned arena) run in child processes there; before the figures, since a
   wrong result makes them moot;
6. ``throughput``: sample throughput at batch 256/1024/4096 with every blob hot, warm or cold,
   side by side with a plain uncompressed CUDA gather of the same rows, and the VRAM each holds;
7. ``decode``: nvCOMP decode GB/s per codec beside the CPU codec.

Test hooks: ``--inject-hang STAGE`` (the stage's child sleeps until killed) and
``--inject-crash STAGE[:abort|segv]`` (it dies by that signal); ``--stage-limit STAGE=SECONDS``
shortens one stage's limit.

Needs torch, numpy, zstandard, tensordict, h5py, psutil and this checkout; nvidia-nvcomp for
the GPU parts; lz4 for the LZ4 rows. Real Atari frames come from
``benchmarks/data/atari_frames.npz``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
FIXTURE = REPO / "benchmarks" / "data" / "atari_frames.npz"
FRAME = 84 * 84
SCHEMA = 2  # of gpu_check.json

TARGETS = [
    "hot tier >= 500k transitions/s at batch 256",
    "hot tier >= 2M transitions/s at batch 4096",
    "hot at batch 256 >= 0.3x the uncompressed CUDA gather",
    "hot tier holds >= 60x less VRAM than the uncompressed CUDA tensors",
    "warm (pinned) tier >= 200k transitions/s at batch 256",
]


@dataclass(frozen=True)
class StageSpec:
    name: str
    cap_s: float  # the most seconds the stage may take
    min_s: float  # not started with less time left than this
    what: str


STAGES = [
    StageSpec("preflight", 60, 5, "versions, device, free memory"),
    StageSpec("probe", 45, 8, "nvCOMP's probe, then the decode configuration in use"),
    StageSpec("tiers", 80, 15, "bit-exact CPU <-> GPU on every tier"),
    StageSpec("interop", 45, 10, "codec-level CPU <-> GPU bitstreams"),
    StageSpec("tests", 150, 25, "pytest -m cuda"),
    StageSpec("throughput", 130, 25, "sample throughput beside an uncompressed gather, VRAM"),
    StageSpec("decode", 40, 10, "decode GB/s per codec"),
]
STAGE_NAMES = [s.name for s in STAGES]


# ---------------------------------------------------------------------------------------------
# Child side: what a stage sees
# ---------------------------------------------------------------------------------------------


class Recorder:
    """A stage's results, rewritten to its JSON file after every change (a kill keeps them)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def add(self, key: str, item: Any) -> None:
        self.data.setdefault(key, []).append(item)
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, default=_json_default)
        os.replace(tmp, self.path)


@dataclass
class Ctx:
    """One stage's child: its settings, its clock and its recorder."""

    name: str
    dry: bool
    limit: float
    rows: int
    quick: bool
    rec: Recorder
    t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.limit - (time.monotonic() - self.t0)

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.dry else torch.device("cuda", 0)

    def sync(self) -> None:
        if not self.dry:
            import torch

            torch.cuda.synchronize()


def say(text: str) -> None:
    print(text, flush=True)


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
    except ImportError:
        pass
    return str(x)


def _timeit(c: Ctx, fn, min_s: float, max_iter: int, warmup: int = 2) -> tuple[float, int]:
    """Seconds per call (mean over at least 2 calls, until ``min_s`` passed)."""
    for _ in range(warmup):
        fn()
    c.sync()
    n, t = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n >= max_iter or (n >= 2 and time.perf_counter() - t >= min_s):
            break
    c.sync()
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
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


# ---------------------------------------------------------------------------------------------
# Stage 1: preflight
# ---------------------------------------------------------------------------------------------


def stage_preflight(c: Ctx) -> None:
    import platform

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "cpu_count": os.cpu_count()}
    for mod in ("numpy", "zstandard", "tensordict", "h5py", "psutil", "lz4", "pytest", "pytest_timeout"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", None) or _dist_version(mod)
        except Exception as e:  # recorded: the stage that needs it says so
            env[mod] = f"missing ({type(e).__name__})"
    try:
        from tiered.codecs.nvcomp import import_nvcomp

        nv = import_nvcomp()
        env["nvcomp"] = f"{nv.__version__} (CUDA {getattr(nv, '__cuda_version__', '?')})"
    except Exception as e:
        env["nvcomp"] = f"unavailable ({type(e).__name__})"
        env["nvcomp_error"] = str(e)
    try:
        import psutil

        env["host_available_bytes"] = int(psutil.virtual_memory().available)
    except Exception:
        pass
    if c.dry:
        env["device"] = "cpu (dry run: the CPU codecs and the decoder's CPU stand-in; no GPU figure)"
    elif torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        x = torch.arange(1024, device="cuda").sum().item()  # a kernel runs and returns
        env.update(device=p.name, capability=f"sm_{p.major}{p.minor}", gpu_free_bytes=int(free),
                   gpu_total_bytes=int(total), tiny_kernel_ok=x == 1023 * 1024 // 2)
    c.rec.put("env", env)
    gpu = (f"{env['device']} {env.get('capability', '')} | free {_fmt_bytes(env.get('gpu_free_bytes'))} of "
           f"{_fmt_bytes(env.get('gpu_total_bytes'))}") if not c.dry else env.get("device")
    say(f"PREFLIGHT python {env['python']} | torch {env['torch']} (CUDA {env['torch_cuda']}) | "
        f"nvCOMP {env['nvcomp']} | {gpu} | zstandard {env['zstandard']} | tensordict {env['tensordict']} | "
        f"lz4 {env['lz4']} | pytest-timeout {env['pytest_timeout']} | {env['cpu_count']} CPUs")
    if not c.dry and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible: run with --cpu-dry-run on a CPU-only machine")


def _dist_version(mod: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(mod.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "?"


# ---------------------------------------------------------------------------------------------
# Stage 2: probe, then the configuration in use
# ---------------------------------------------------------------------------------------------


def stage_probe(c: Ctx) -> None:
    from tiered.engine.gpu_read import GpuDecoder

    if c.dry:
        say("  probe: none (dry run: nvCOMP is not used; the decoder's CPU stand-in decodes)")
        c.rec.put("probes", {})
    else:
        from tiered.codecs.nvcomp import NvcompCodec

        probes = {}
        for fmt in ("zstd", "lz4", "deflate"):
            try:
                p = NvcompCodec(fmt).probe()
            except Exception as e:  # recorded; the other formats are still probed
                p = {"exact": None, "capacity": False, "large": False, "errors": [f"{type(e).__name__}: {e}"]}
            probes[fmt] = p
            c.rec.put("probes", probes)
            for err in p.get("errors", []):
                say(f"  probe {fmt} error: {err}")
            say(f"  probe {fmt}: exact={p.get('exact')} capacity={p.get('capacity')} large={p.get('large')} "
                f"large_capacity={p.get('large_capacity')} oom={p.get('oom')} cached={p.get('cached')} "
                f"cells={p.get('sizes')} large cells={p.get('large_sizes')}")
    dec = GpuDecoder(c.device)
    if not c.dry:
        for fmt_id in (1, 2):  # the formats a store persists: zstd, lz4
            dec.backend.supports(fmt_id)
    st = dec.stats()
    config = {"backend": st["backend"], "bucket": dec.bucket, "min_split": dec.min_split,
              "checksum": dec.checksum, "torch_allocator": st.get("torch_allocator"),
              "chosen": st.get("chosen", {})}
    c.rec.put("config", config)
    say(f"  decoder in use: backend={config['backend']} buckets={config['bucket']} checksum={config['checksum']} "
        f"min_split={config['min_split']} torch_allocator={config['torch_allocator']}")
    for fmt, choice in config["chosen"].items():
        say(f"  {fmt}: {choice}")


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def fixture_frames():
    """Every distinct 84x84 screen of the fixture's games, in play order: uint8 [F, 84*84]."""
    import numpy as np

    with np.load(FIXTURE) as data:
        games = [str(g) for g in data["games"]]
        return np.concatenate([np.asarray(data[f"{g}/frames"]).reshape(-1, FRAME) for g in games])


def chunk_batch(n: int, k: int = 4):
    """``n`` cells of ``k`` consecutive real frames (tiled with a per-copy stamp past the fixture)."""
    import numpy as np

    frames = fixture_frames()
    per_copy = frames.shape[0] // k
    parts = []
    for copy in range(-(-n // per_copy)):
        f = frames[: per_copy * k].copy()
        f[:, 0], f[:, 1] = copy & 255, (copy >> 8) & 255
        parts.append(f)
    raw = np.ascontiguousarray(np.concatenate(parts)[: n * k].reshape(-1))
    return raw, np.arange(n, dtype=np.int64) * k * FRAME, np.full(n, k * FRAME, np.int64)


def stamped_copies(rows: int):
    """TensorDicts of the fixture's transitions, copy ``c`` stamped with ``c``, ``rows`` in all."""
    from tiered.atari import load_fixture

    base = load_fixture(FIXTURE)
    n0 = base.batch_size[0]
    traj_span = int(base["collector", "traj_ids"].max()) + 1
    done = copy = 0
    while done < rows:
        td = base[: min(n0, rows - done)].clone()
        for key in ("observation", ("next", "observation")):
            x = td.get(key)
            # same stamp on every frame of the copy: stacks that shared a frame still share it
            x[..., 0, 0] = copy & 255
            x[..., 0, 1] = (copy >> 8) & 255
        td["collector", "traj_ids"] = td["collector", "traj_ids"] + copy * traj_span
        yield td
        done += td.batch_size[0]
        copy += 1


def rgb_frames(n: int):
    """``n`` RGB 210x160 observations (100,800 bytes: over nvCOMP's 64 KiB default chunk) made
    from the fixture's real screens, as a TensorDict with one frame per row."""
    import numpy as np
    import torch
    from tensordict import TensorDict

    gray = fixture_frames()[:n].reshape(n, 84, 84)
    rows, cols = np.arange(210) * 84 // 210, np.arange(160) * 84 // 160
    big = gray[:, rows][:, :, cols]
    rgb = np.stack([big, big // 2 + 16, 255 - big], axis=-1).astype(np.uint8)
    return TensorDict({"pixels": torch.from_numpy(rgb[:, None]), "action": torch.arange(n)}, [n])


def _aligned_upload(c: Ctx, data, offsets, sizes):
    import numpy as np
    import torch

    from tiered.util.hostcopy import copy_host_blobs

    a = (sizes + 15) // 16 * 16
    off = np.concatenate([[0], np.cumsum(a)[:-1]]).astype(np.int64)
    host = np.zeros(int(a.sum()), np.uint8)
    copy_host_blobs(data, offsets, host, off, sizes)
    return torch.from_numpy(host).to(c.device), off


def _attach(c: Ctx, store):
    from tiered.engine.gpu_read import GpuDecoder

    dec = store.gpu_decoder
    if dec is None:
        dec = GpuDecoder(c.device).attach(store)
    return dec


# ---------------------------------------------------------------------------------------------
# Stage 3: bit-exact on every tier
# ---------------------------------------------------------------------------------------------


def _tier_store(path, data, device: str, hot_device: str, key: str, **kw):
    import torch

    from tiered import TieredStore
    from tiered.testing import spread_over_tiers

    n = data.batch_size[0]
    body = n - 3
    data = data.clone()
    data.set("index", torch.arange(n))  # TorchRL's index: a row-number column (stored as nothing)
    store = TieredStore(n + 64, path, frames={key: 0}, hot_device=hot_device, hot_bytes="256MiB",
                        warm_bytes="256MiB", promote=False, device=device, stage_rows=0, **kw)
    for i in range(0, body, 50):
        store.extend(data[i:min(i + 50, body)])
    store.flush()
    spread_over_tiers(store)
    store.extend(data[body:])  # an open (not yet compressed) chunk when chunk_frames > 1
    return store


def stage_tiers(c: Ctx) -> None:
    import numpy as np
    import torch

    from tiered.atari import load_fixture
    from tiered.engine.blob_index import HOT, OPEN
    from tiered.errors import ChecksumError
    from tiered.testing import parts, tier_counts

    atari = load_fixture(FIXTURE, games=["Breakout", "MsPacman"])[:603]
    cases = [("zstd", atari, "observation", {"codec": "zstd"}),
             ("lz4", atari, "observation", {"codec": "lz4"}),
             ("zstd K=1", atari, "observation", {"codec": "zstd", "chunk_frames": 1}),
             ("zstd RGB 210x160 (100,800 B cells)", rgb_frames(160), "pixels", {"codec": "zstd", "chunk_frames": 1})]
    dev = str(c.device)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, data, key, kw) in enumerate(cases):
            if c.left() < 8:
                c.rec.add("skipped", label)
                say(f"  {label}: skipped (stage time)")
                continue
            ref = _tier_store(Path(tmp) / f"cpu{i}", data, "cpu", "cpu", key, **kw)
            store = _tier_store(Path(tmp) / f"dev{i}", data, dev, dev, key, **kw)
            counts = tier_counts(store)
            dec = _attach(c, store)
            rng = np.random.default_rng(i)
            mismatched = []
            for b in (len(store), 1, 256, 4096):
                ix = np.arange(len(store)) if b == len(store) else rng.integers(0, len(store), b)
                got, want = store.get(ix).to("cpu"), ref.get(ix)
                mismatched += [str(k) for k in want.keys(include_nested=True, leaves_only=True)
                               if not torch.equal(got.get(k), want.get(k))]
            st = dec.stats()
            result = {"tiers": counts, "bit_exact": not mismatched, "mismatched": sorted(set(mismatched)),
                      "decoder": {k: st.get(k) for k in ("hot", "warm", "cold", "open", "hot_on_device", "pads",
                                                         "cpu_fallbacks", "fallback_reasons", "oom_events")},
                      "hot_arena_device": str(parts(store).tiers[HOT].device),
                      "warm_pinned": bool(getattr(parts(store).tiers[1], "pinned", False))}
            # damage one hot blob: the GPU path must raise before decoding
            idx = parts(store).index
            live = idx.live_ids()
            hot_ids = live[(idx.loc[live, HOT] >= 0) & (idx.state[live] != OPEN)]
            raised = None
            if hot_ids.size:
                victim = int(hot_ids[0])
                pos = int(idx.loc[victim, HOT]) + 2
                arena = parts(store).tiers[HOT].buffer
                arena[pos] ^= 0x5A
                rows = np.flatnonzero((parts(store).layout.tables[(key,)].blob[: len(store)] == victim).any(1))
                try:
                    store.get(rows[:2])
                    raised = False
                except ChecksumError:
                    raised = True
                arena[pos] ^= 0x5A
            result["damaged_blob_raises"] = raised
            # made on the device from the rows read (no host copy of the values)
            numbers = store.get(np.array([len(store) - 1, 0]))["index"]
            result["row_numbers_on_device"] = (store.stats()["fields"]["index"].get("row_number") is True
                                               and numbers.device.type == torch.device(dev).type
                                               and numbers.cpu().tolist() == [len(store) - 1, 0])
            c.rec.put(label, result)
            ok = result["bit_exact"] and raised and result["row_numbers_on_device"]
            say(f"  {'OK  ' if ok else 'FAIL'} {label}: bit-exact vs CPU twin "
                f"{result['bit_exact']}, damaged hot blob raises {raised}, row numbers on the device "
                f"{result['row_numbers_on_device']}, tiers {counts}, "
                f"decoder {result['decoder']}")
            store.close()
            ref.close()


# ---------------------------------------------------------------------------------------------
# Stage 4: codec-level interop
# ---------------------------------------------------------------------------------------------


def stage_interop(c: Ctx) -> None:
    import zlib

    import numpy as np
    import torch
    import zstandard

    from tiered.codecs import Lz4Codec, ZstdCodec

    def record(name: str, fn) -> None:
        if c.left() < 3:
            c.rec.put(name, {"ok": None, "detail": "skipped (stage time)"})
            return
        try:
            ok, detail = fn()
        except Exception as e:  # recorded; the next check runs
            ok, detail = False, f"{type(e).__name__}: {e}"
        c.rec.put(name, {"ok": bool(ok), "detail": detail})
        say(f"  {'OK  ' if ok else 'FAIL'} {name}: {detail}")

    raw1, off1, sz1 = chunk_batch(512, 1)
    raw4, off4, sz4 = chunk_batch(512, 4)
    if c.dry:
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

    def cpu_to_gpu(level: int, raw, off, sz):
        enc = ZstdCodec(level).encode(raw, off, sz)
        dev, doff = _aligned_upload(c, enc.data, enc.offsets, enc.sizes)
        out = torch.zeros(raw.size, dtype=torch.uint8, device="cuda")
        nv["zstd"].decode_device(dev, doff, enc.sizes, out, off, sz)
        same = torch.equal(out.cpu(), torch.from_numpy(raw))
        return same, f"{sz.size} frames of {int(sz[0])} B, ratio {raw.size / enc.data.size:.1f}x"

    for level in (3, 1, 19, -5):
        record(f"zstd CPU L{level} -> GPU (K=4)", lambda lv=level: cpu_to_gpu(lv, raw4, off4, sz4))
        record(f"zstd CPU L{level} -> GPU (K=1)", lambda lv=level: cpu_to_gpu(lv, raw1, off1, sz1))

    def gpu_to_cpu():
        enc = nv["zstd"].encode(raw4, off4, sz4)
        out = np.zeros_like(raw4)
        ZstdCodec().decode(enc.data, enc.offsets, enc.sizes, out, off4, sz4)
        one = zstandard.ZstdDecompressor().decompress(enc.data[: enc.sizes[0]].tobytes(), max_output_size=int(sz4[0]))
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
# Stage 6: sample throughput beside an uncompressed gather
# ---------------------------------------------------------------------------------------------


def build_buffer(c: Ctx, path: Path, rows: int, deadline: float, with_base: bool):
    """Write up to ``rows`` tiled transitions into a store at ``path`` (CPU encode, cold tier only),
    stopping early at ``deadline`` (the table then uses fewer rows; never an error). With
    ``with_base``, the same rows as uncompressed tensors on the device. Returns (rows, s, base)."""
    import torch

    from tiered import TieredStore

    dev = c.device
    t = time.monotonic()
    builder = TieredStore(rows, path, frames={"observation": 0}, hot_bytes=0, warm_bytes=0)
    base = None
    written = 0
    for td in stamped_copies(rows):
        for i in range(0, td.batch_size[0], 2000):
            part = td[i:i + 2000]
            n = part.batch_size[0]
            builder.extend(part)
            if with_base:
                if base is None:
                    base = td[:1].to(dev).apply(
                        lambda x: torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=dev), batch_size=[rows])
                base[written:written + n] = part.to(dev)
            written += n
            if time.monotonic() > deadline:
                break
        if time.monotonic() > deadline:
            break
    builder.close()
    return written, time.monotonic() - t, (base[:written] if base is not None else None)


def stage_throughput(c: Ctx) -> None:
    import shutil

    import numpy as np
    import torch

    import tiered
    from tiered.testing import parts, tier_counts

    dev = c.device
    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    path = Path(tmp) / "store"
    try:
        written, build_s, base = build_buffer(c, path, c.rows, c.t0 + 0.35 * c.limit, with_base=True)
        c.rec.put("data", f"{written:,} transitions (of {c.rows:,} asked; the build stops at its share of the "
                          "stage time): the fixture's real Atari transitions (4x84x84 uint8 stacks + next stacks) "
                          "tiled, each copy stamped with a 2-byte copy id so copies do not deduplicate")
        c.rec.put("build", {"rows": written, "rows_asked": c.rows, "seconds": round(build_s, 1)})
        say(f"  built {written:,} rows (of {c.rows:,} asked) in {build_s:.1f}s")
        base_bytes = sum(v.numel() * v.element_size() for v in base.values(include_nested=True, leaves_only=True))
        vram = {"uncompressed": base_bytes}
        c.rec.put("vram", vram)
        rng = np.random.default_rng(0)
        batches = (256, 1024, 4096)
        idx_sets = {b: [rng.integers(0, written, b) for _ in range(8)] for b in batches}
        dev_idx = {b: [torch.from_numpy(x).to(dev) for x in idx_sets[b]] for b in batches}
        table: list[dict] = []

        def bench(label: str, fn, held: int, index_sets) -> None:
            for b in batches:
                if c.left() < 6:
                    table.append({"config": label, "batch": b, "skipped": "stage time"})
                    c.rec.put("rows", table)
                    continue
                sets, it = index_sets[b], [0]

                def call(sets=sets, it=it):
                    it[0] += 1
                    return fn(sets[it[0] % len(sets)])

                min_s = max(0.05, min(0.25 if not c.quick else 0.1, c.left() / 60))
                s, n = _timeit(c, call, min_s, 400)
                table.append({"config": label, "batch": b, "transitions_per_s": b / s, "us_per_batch": s * 1e6,
                              "iterations": n, "vram_held": held})
                c.rec.put("rows", table)
                say(f"  {label:<13} batch {b:<5} {_fmt_rate(b / s):>8} transitions/s  {s * 1e6:10.1f} us/batch")

        bench("uncompressed", lambda ix: base[ix], base_bytes, dev_idx)
        configs = [("hot", {"hot_bytes": "32GiB", "warm_bytes": 0, "hot_device": str(dev)}),
                   ("warm", {"hot_bytes": 0, "warm_bytes": "32GiB"}),
                   ("cold", {"hot_bytes": 0, "warm_bytes": 0, "promote": False})]
        for label, opts in configs:
            if c.left() < 10:
                c.rec.add("skipped", label)
                say(f"  {label}: skipped (stage time)")
                continue
            store = tiered.open(path, mode="r", device=str(dev), **opts)
            dec = _attach(c, store)
            t = time.monotonic()
            promoted = 0
            if label != "cold":  # promote blobs into the tier under test, as time allows
                for i in range(0, written, 4096):
                    if c.left() < 12:
                        break
                    store.get(np.arange(i, min(i + 4096, written)))
                    promoted = min(i + 4096, written)
            got, want = store.get(idx_sets[256][0]), base[dev_idx[256][0]]
            same = all(torch.equal(got.get(k).to(dev), want.get(k)) for k in
                       ("observation", ("next", "observation"), "action"))
            hot = parts(store).tiers[0]
            held = int(hot.capacity) if hot is not None else 0
            vram[label] = held
            c.rec.put("vram", vram)
            c.rec.put(f"placement {label}", {"tiers": tier_counts(store), "rows_promoted": promoted,
                                             "warmup_s": round(time.monotonic() - t, 1), "bit_exact": same})
            say(f"  {label}: blobs per tier {tier_counts(store)} (rows promoted {promoted:,}), hot arena "
                f"{_fmt_bytes(held)}, batch equals the uncompressed gather: {same}")
            bench(label, store.get, held, idx_sets)
            keep = ("batches", "hot", "warm", "cold", "pads", "cpu_fallbacks", "fallback_reasons", "oom_events",
                    "splits", "h2d_bytes")
            c.rec.put(f"decoder {label}", {k: v for k, v in dec.stats().items() if k in keep})
            store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Stage 7: decode GB/s
# ---------------------------------------------------------------------------------------------


def stage_decode(c: Ctx) -> None:
    from tiered.codecs import Lz4Codec, ZstdCodec

    nmax = 4096 if not (c.quick or c.dry) else 1024
    raw, off, sz = chunk_batch(nmax, 4)
    for fmt, cpu_codec in (("zstd", ZstdCodec()), ("lz4", Lz4Codec())):
        if c.left() < 4:
            c.rec.add("skipped", fmt)
            continue
        _decode_rows(c, fmt, cpu_codec, raw, off, sz, nmax)


def _decode_rows(c: Ctx, fmt: str, cpu_codec, raw, off, sz, nmax: int) -> None:
    import numpy as np
    import torch

    enc = cpu_codec.encode(raw, off, sz)
    ratio = raw.size / enc.data.size
    out_h = np.empty_like(raw)
    s, _ = _timeit(c, lambda: cpu_codec.decode(enc.data, enc.offsets, enc.sizes, out_h, off, sz), 0.2, 20,
                   warmup=1)
    row = {"codec": f"{fmt} (CPU, {os.cpu_count()} threads)", "n": nmax, "gbps": raw.size / s / 1e9,
           "us_per_call": s * 1e6, "ratio": ratio, "bit_exact": bool(np.array_equal(out_h, raw))}
    c.rec.add("rows", row)
    say(f"  {row['codec']:<26} N={nmax:<5} {row['gbps']:7.2f} GB/s  {row['us_per_call']:9.1f} us/call  "
        f"ratio {ratio:.1f}x  bit-exact {row['bit_exact']}")
    if c.dry:
        return
    from tiered.codecs.nvcomp import NvcompCodec

    codec = NvcompCodec(fmt)
    dev, doff = _aligned_upload(c, enc.data, enc.offsets, enc.sizes)
    out = torch.zeros(raw.size, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    # `dev` and `out` were written on the current stream: the decode stream waits for them
    stream.wait_stream(torch.cuda.current_stream())
    for n in (256, 1024, 4096):
        if n > nmax or c.left() < 3:
            continue

        def call(n: int = n) -> None:
            codec.decode_device(dev, doff[:n], enc.sizes[:n], out, off[:n], sz[:n], stream=stream)

        with torch.cuda.stream(stream):
            call()
            stream.synchronize()
            exact = torch.equal(out[: n * 4 * FRAME].cpu(), torch.from_numpy(raw[: n * 4 * FRAME]))
            s, _ = _timeit(c, call, 0.2, 500)
        row = {"codec": f"{fmt} (nvCOMP)", "n": n, "gbps": n * 4 * FRAME / s / 1e9, "us_per_call": s * 1e6,
               "ratio": ratio, "bit_exact": exact, "mode": codec.probe()["exact"],
               "config_cache": codec.counters()}
        c.rec.add("rows", row)
        say(f"  {row['codec']:<26} N={n:<5} {row['gbps']:7.2f} GB/s  {row['us_per_call']:9.1f} us/call  "
            f"ratio {ratio:.1f}x  bit-exact {exact}")


# ---------------------------------------------------------------------------------------------
# Stage 5: pytest -m cuda
# ---------------------------------------------------------------------------------------------


def stage_tests(c: Ctx) -> None:
    import pytest

    outcomes: dict[str, str] = {}

    class Record:
        """Each test's outcome, recorded when it is known (a kill keeps the ones before)."""

        def pytest_runtest_logreport(self, report) -> None:
            if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or (
                    report.when == "teardown" and report.outcome == "failed"):
                outcome = report.outcome if report.when == "call" or report.outcome == "skipped" else "error"
                outcomes[report.nodeid] = outcome
                c.rec.put("outcomes", outcomes)
                if outcome in ("failed", "error"):
                    say(f"  {outcome.upper()} {report.nodeid}\n{str(report.longrepr)[-1500:]}")

    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_gpu*.py"))
    # test_copy and test_tiers: the host-to-CUDA copies and the CUDA arenas the GPU path relies on
    args = ["-m", "cuda", *files, "tests/engine/test_prefetch.py", "tests/engine/test_copy.py", "tests/tiers/test_tiers.py", "-q", "-rfEs",
            "-p", "no:cacheprovider", "-p", "no:faulthandler"]
    try:
        import pytest_timeout  # noqa: F401  (carried to the GPU machine; bounds each test)

        args += ["--timeout", str(int(max(30, c.left() / 3)))]
    except ImportError:
        say("  pytest-timeout missing: tests are bounded only by this stage's limit")
    os.chdir(REPO)
    rc = pytest.main(args, plugins=[Record()])
    counts: dict[str, int] = {}
    for v in outcomes.values():
        counts[v] = counts.get(v, 0) + 1
    c.rec.put("summary", {"returncode": int(rc), "counts": counts})
    say(f"  pytest -m cuda: {counts} (rc={int(rc)})")
    if int(rc) not in (0, 5):  # 5: nothing collected (not a failure of the run)
        raise RuntimeError(f"pytest -m cuda failed: {counts}")


STAGE_FUNCS = {"preflight": stage_preflight, "probe": stage_probe, "tiers": stage_tiers, "interop": stage_interop,
               "throughput": stage_throughput, "decode": stage_decode, "tests": stage_tests}


def child_main(name: str, ctx_path: str) -> int:
    """Run one stage in this (child) process: faulthandler armed, injections applied."""
    ctx = json.loads(Path(ctx_path).read_text())
    faulthandler.enable(all_threads=True)
    limit = float(ctx["limit"])
    # the stacks of every thread shortly before the parent kills this child at its limit
    faulthandler.dump_traceback_later(max(1.0, limit - min(5.0, max(1.0, 0.15 * limit))), exit=False)
    rec = Recorder(ctx["result_path"])
    c = Ctx(name, bool(ctx["dry"]), limit, int(ctx["rows"]), bool(ctx["quick"]), rec)
    if ctx.get("inject_hang") == name:
        rec.put("partial", "written before the injected hang")
        say(f"  [{name}] injected hang: sleeping until killed")
        while True:
            time.sleep(3600)
    crash = ctx.get("inject_crash") or ""
    if crash.split(":")[0] == name:
        rec.put("partial", "written before the injected crash")
        say(f"  [{name}] injected crash: {crash.partition(':')[2] or 'abort'}")
        if crash.endswith(":segv"):
            import ctypes

            ctypes.string_at(0)  # SIGSEGV
        os.abort()
    try:
        STAGE_FUNCS[name](c)
    except BaseException as e:
        rec.put("error", f"{type(e).__name__}: {e}")
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    return 0


# ---------------------------------------------------------------------------------------------
# Parent side: the run
# ---------------------------------------------------------------------------------------------


class Run:
    """The whole check: stages in child processes, the JSON and the log after every stage."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        dirs = [Path(args.out) if args.out else REPO / "benchmarks" / "out"]
        if os.environ.get("OUT"):
            dirs.append(Path(os.environ["OUT"]))
        self.dirs = []
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            if d.resolve() not in [x.resolve() for x in self.dirs]:
                self.dirs.append(d)
        self.logs = [open(d / "gpu_check.log", "w") for d in self.dirs]  # noqa: SIM115 (closed in finish)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_run_"))
        self.res: dict[str, Any] = {
            "schema": SCHEMA, "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu", "argv": sys.argv,
            "budget_s": args.budget, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "stages": {}, "results": {}, "targets": [],
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        for f in self.logs:
            f.write(text + "\n")
            f.flush()

    def save(self) -> None:
        self.res["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        text = json.dumps(self.res, indent=1, default=_json_default)
        for d in self.dirs:
            tmp = d / "gpu_check.json.tmp"
            tmp.write_text(text)
            os.replace(tmp, d / "gpu_check.json")

    def limit_for(self, spec: StageSpec) -> float:
        cap = self.args.limits.get(spec.name, spec.cap_s * (2 if self.args.cpu_dry_run else 1))
        return max(1.0, min(cap, self.left() - 1.0))

    def run_stage(self, spec: StageSpec) -> None:
        name = spec.name
        if self.left() < spec.min_s:
            self.res["stages"][name] = {"status": "skipped", "reason": f"{self.left():.0f}s of the budget left"}
            self.say(f"[{name}] SKIPPED: {self.left():.0f}s of the budget left (needs {spec.min_s:.0f}s)")
            self.save()
            return
        limit = self.limit_for(spec)
        result_path = self.work / f"{name}.json"
        ctx = {"limit": limit, "dry": self.args.cpu_dry_run, "rows": self.args.rows, "quick": self.args.quick,
               "result_path": str(result_path), "inject_hang": self.args.inject_hang,
               "inject_crash": self.args.inject_crash}
        ctx_path = self.work / f"{name}.ctx.json"
        ctx_path.write_text(json.dumps(ctx))
        self.say(f"[{name}] start: {spec.what} (limit {limit:.0f}s, {self.left():.0f}s of the budget left)")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PYTHONUNBUFFERED"] = "1"
        t = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()),
                                 "--child", name, "--ctx", str(ctx_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                cwd=REPO, env=env, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        tail: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        done_reading = False
        while not done_reading:
            remaining = t + limit - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                line = lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                done_reading = True
                break
            tail.append(line)
            self.say(line if line.startswith("  ") else "  " + line)
        if timed_out:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        end = time.monotonic() + 2.0
        while not done_reading and time.monotonic() < end:  # what the child printed before the kill
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            tail.append(line)
            self.say(line if line.startswith("  ") else "  " + line)
        seconds = round(time.monotonic() - t, 1)
        try:
            self.res["results"][name] = json.loads(result_path.read_text())
        except (OSError, ValueError):
            self.res["results"][name] = {}
        info: dict[str, Any] = {"seconds": seconds, "limit_s": round(limit, 1), "returncode": rc}
        if timed_out:
            info.update(status="timeout", error=f"killed at its {limit:.0f}s limit (stacks dumped above)")
        elif rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
            info.update(status="crashed", signal=sig, error=f"the child died by {sig}")
        elif rc != 0:
            info.update(status="failed", error=self.res["results"][name].get("error", f"exit code {rc}"))
        else:
            info["status"] = "ok"
        info["output_tail"] = "\n".join(tail)[-4000:]
        self.res["stages"][name] = info
        verdict = {"ok": "ok", "timeout": "TIMEOUT", "crashed": "CRASHED", "failed": "FAILED"}[info["status"]]
        self.say(f"[{name}] {verdict} in {seconds}s" + (f": {info['error']}" if "error" in info else "")
                 + "; partial results kept, later stages still run" * (info["status"] != "ok"))
        self.save()

    def finish(self) -> int:
        try:
            evaluate_targets(self.res)
        except Exception as e:  # the report must still print
            self.res["targets"] = [{"target": "evaluation", "verdict": "ERROR", "value": repr(e)}]
        self.save()
        for line in report_lines(self.res):
            self.say(line)
        for f in self.logs:
            f.close()
        bad = [k for k, v in self.res["stages"].items() if v.get("status") not in ("ok", "skipped")]
        return 1 if bad else 0


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _rate(res: dict, config: str, batch: int) -> float | None:
    for r in res.get("results", {}).get("throughput", {}).get("rows", []):
        if r["config"] == config and r["batch"] == batch and "transitions_per_s" in r:
            return r["transitions_per_s"]
    return None


def evaluate_targets(res: dict) -> None:
    dry = res["mode"] != "gpu"
    vram = res.get("results", {}).get("throughput", {}).get("vram", {})
    hot256, hot4096 = _rate(res, "hot", 256), _rate(res, "hot", 4096)
    unc256, warm256 = _rate(res, "uncompressed", 256), _rate(res, "warm", 256)
    vr = (vram["uncompressed"] / vram["hot"]) if vram.get("hot") and vram.get("uncompressed") else None
    checks = [
        (TARGETS[0], hot256, hot256 is not None and hot256 >= 500e3, f"{_fmt_rate(hot256)}/s"),
        (TARGETS[1], hot4096, hot4096 is not None and hot4096 >= 2e6, f"{_fmt_rate(hot4096)}/s"),
        (TARGETS[2], hot256 and unc256, bool(hot256 and unc256 and hot256 >= 0.3 * unc256),
         f"{hot256 / unc256:.2f}x" if hot256 and unc256 else "-"),
        (TARGETS[3], vr, vr is not None and vr >= 60, f"{vr:.0f}x less" if vr else "-"),
        (TARGETS[4], warm256, warm256 is not None and warm256 >= 200e3, f"{_fmt_rate(warm256)}/s"),
    ]
    res["targets"] = [{"target": name, "value": text,
                       "verdict": "SKIP" if dry else ("PASS" if ok else ("FAIL" if value is not None else "MISSING"))}
                      for name, value, ok, text in checks]


def report_lines(res: dict) -> list[str]:
    dry = res["mode"] != "gpu"
    out = ["", "=" * 100,
           f"tiered gpu_check ({'CPU DRY RUN: no figure below is a GPU measurement' if dry else 'GPU'}), "
           f"{res.get('elapsed_s', 0):.0f}s of a {res['budget_s']:.0f}s budget"]
    env = res.get("results", {}).get("preflight", {}).get("env", {})
    out.append(f"  {env.get('device', 'no device')} | torch {env.get('torch')} | nvCOMP {env.get('nvcomp')}")
    out.append("stages: " + ", ".join(f"{k}={v.get('status')}" for k, v in res["stages"].items()))
    for k, v in res["stages"].items():
        if v.get("status") not in ("ok", "skipped"):
            out.append(f"  {k}: {v.get('error')}")
    r = res.get("results", {})
    for fmt, choice in r.get("probe", {}).get("config", {}).get("chosen", {}).items():
        out.append(f"decoder {fmt}: {choice}")
    for label, v in r.get("tiers", {}).items():
        if isinstance(v, dict) and "bit_exact" in v:
            out.append(f"tiers {label}: bit-exact {v['bit_exact']}, damaged blob raises {v.get('damaged_blob_raises')}")
    checks = {k: v for k, v in r.get("interop", {}).items() if isinstance(v, dict) and "ok" in v}
    bad = [k for k, v in checks.items() if v["ok"] is False]
    if checks:
        out.append(f"interop: {sum(v['ok'] is True for v in checks.values())}/{len(checks)} OK" +
                   (f"; FAILED: {', '.join(bad)}" if bad else ""))
    summary = r.get("tests", {}).get("summary")
    if summary:
        out.append(f"pytest -m cuda: {summary['counts']} (rc={summary['returncode']})")
    out.append("\ntargets" + (" (dry run: not evaluated)" if dry else ""))
    out += [f"  {t['verdict']:<7} {t['target']}: {t['value']}" for t in res.get("targets", [])]
    tp = r.get("throughput", {})
    out.append(f"\nsample throughput: {tp.get('data', '(not run)')}")
    vram = tp.get("vram", {})
    out.append(f"  {'config':<13} {'batch':>6} {'transitions/s':>14} {'us/batch':>10} {'vs uncompr.':>11} "
               f"{'VRAM held':>11} {'VRAM ratio':>11}")
    for row in tp.get("rows", []):
        if "transitions_per_s" not in row:
            out.append(f"  {row['config']:<13} {row['batch']:>6} {'skipped':>14}")
            continue
        unc = _rate(res, "uncompressed", row["batch"])
        held = row.get("vram_held")
        ratio = "-" if row["config"] == "uncompressed" or not unc else f"{row['transitions_per_s'] / unc:.2f}x"
        vr = "-" if not held or not vram.get("uncompressed") or row["config"] == "uncompressed" else \
            f"{vram['uncompressed'] / held:.0f}x less"
        out.append(f"  {row['config']:<13} {row['batch']:>6} {_fmt_rate(row['transitions_per_s']):>14} "
                   f"{row['us_per_batch']:>10.1f} {ratio:>11} {_fmt_bytes(held):>11} {vr:>11}")
    for row in r.get("decode", {}).get("rows", []):
        out.append(f"decode {row['codec']:<26} N={row['n']:<5} {row['gbps']:7.2f} GB/s  bit-exact {row['bit_exact']}")
    out.append("=" * 100)
    return out


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default 300; 600 in a dry run)")
    ap.add_argument("--out", help="write gpu_check.json and gpu_check.log here instead of benchmarks/out "
                                  "(they also go to $OUT when it is set)")
    ap.add_argument("--rows", type=int, default=None,
                    help="transitions asked for the throughput buffer (100,000; 12,000 in a dry run)")
    ap.add_argument("--quick", action="store_true", help="shorter timings")
    ap.add_argument("--only", help=f"comma-separated stages to run, in this order: {','.join(STAGE_NAMES)}")
    ap.add_argument("--skip", help="comma-separated stages not to run")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: the same stages with the CPU codecs and the decoder's CPU stand-in")
    ap.add_argument("--stage-limit", action="append", default=[], metavar="STAGE=SECONDS",
                    help="a shorter limit for one stage (repeatable)")
    ap.add_argument("--inject-hang", metavar="STAGE", help="test hook: that stage's child hangs")
    ap.add_argument("--inject-crash", metavar="STAGE[:abort|segv]", help="test hook: that stage's child dies")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rows is None:
        args.rows = 12_000 if args.cpu_dry_run else 100_000
    if args.budget is None:
        args.budget = 600.0 if args.cpu_dry_run else 300.0
    args.limits = {}
    for item in args.stage_limit:
        name, _, secs = item.partition("=")
        if name not in STAGE_NAMES or not secs:
            ap.error(f"--stage-limit wants STAGE=SECONDS with STAGE in {STAGE_NAMES}, got {item!r}")
        args.limits[name] = float(secs)
    for hook in (args.inject_hang, (args.inject_crash or "").split(":")[0] or None):
        if hook is not None and hook not in STAGE_NAMES:
            ap.error(f"injection stage must be one of {STAGE_NAMES}, got {hook!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, args.ctx)
    faulthandler.enable()
    faulthandler.dump_traceback_later(args.budget + 60, exit=True)  # the parent itself never hangs
    run = Run(args)
    run.say(f"gpu_check: {run.res['mode']}, budget {args.budget:.0f}s, python {sys.version.split()[0]}, "
            f"results in {', '.join(str(d / 'gpu_check.json') for d in run.dirs)}")
    run.save()
    selected = [s for s in STAGES if (not args.only or s.name in args.only.split(","))
                and (not args.skip or s.name not in args.skip.split(","))]
    try:
        for spec in selected:
            run.run_stage(spec)
    finally:
        code = run.finish()
        faulthandler.cancel_dump_traceback_later()
    return code


if __name__ == "__main__":
    sys.exit(main())
