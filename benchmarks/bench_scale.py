"""What a large path store costs: build, commit, reopen and sample at 1M rows and beyond.

Run: ``python benchmarks/bench_scale.py [--rows 1000000 10000000] [--workdir DIR] [--keep]``

For each size it builds a path store of that many Atari transitions (4x84x84 uint8 observation
stacks with their ``("next", "observation")``, action, reward and flags), tiled from a real ALE
Pong rollout (``tiered.atari.cached_rollout``). Tile ``t`` has its frames XORed with ``t % 251``
and its first four pixels set to ``t``'s bytes, so tiles neither deduplicate nor share frames
while every frame stays a real, equally compressible screen. Each step runs in a **fresh
subprocess** that samples its own anonymous resident memory (``RssAnon``) every 10 ms:

- ``build``: ``TieredStore(n, path, frames={"observation": 0}, hot_bytes=0, warm_bytes=0,
  chunk_frames=K, codec=CODEC, dense_dtypes=...)`` (``--chunk-frames``, default 8; ``--codec``,
  default zstd; ``--dense-dtypes``, default none: the rollout's dtypes),
  extended in slices of ``--slice`` rows with a ``flush()`` every ``--flush-every`` rows (default
  1,000,000; 0: none), then ``close()``: rows/s and peak RssAnon growth;
- ``commit``: ``tiered.open(path, "r+")``, extend ``--commit-rows`` new rows, time ``flush()``
  and count the bytes it wrote (``/proc/self/io`` ``write_bytes``), ``--commit-rounds`` times
  (default 6; each commit writes the old bytes of what it changes to a before-image file, then
  the changes in place; the ratio of the sizes is also given for the median of the commits from
  the third on);
- ``reopen``: time ``tiered.open(path)`` (the fastest of three opens in a row, each store closed and
  collected before the next; then the fastest of three more, each after ``posix_fadvise(DONTNEED)``
  on every file of the store: "cold") and the growth of RssAnon the first open causes (over a process that
  has already imported torch and tensordict, which take ~350 MiB of their own), also by mapping (which
  array files' pages became the process's own; ``/proc/self/smaps``);
  then the time of ``stats()`` on a fresh read-only open, the anonymous memory it leaves held and
  its peak (above the open's);
- ``sample``: B=256 uniform random rows (``get``), after ``--warmup-batches`` untimed batches,
  warm (files in the page cache) and cold
  (``posix_fadvise(DONTNEED)`` on every file of the store before each batch; pages the process
  has mapped stay cached, which flatters the cold rate of mapped metadata); and the bytes of the
  store's array files that the open and the batches made the process's own ("array pages own after
  sampling": pages copied private at first use; not the warm tier's cache, which its budget bounds).

Bytes on disk per transition are counted over all files, and over one generation (the segments
and the array files of the last commit: the file of each array, without the before-images
of the last two commits and the files they replaced); "arrays"
is the part of one generation that is metadata (row tables, dense columns, blob index), "dense"
the dense columns alone. All files are counted twice: right after the build (whose last flushes,
of ``--flush-every`` rows each, leave before-images of that size) and after the commit rounds
(what ``du`` sees in steady use).
Side by side on the same frames: the Dopamine checkpoint layout (``np.save`` of the per-step
frames, action int32, reward float32 and terminal uint8, each gzipped the way Dopamine's
``circular_replay_buffer`` writes them: ``gzip.GzipFile``'s default level 9), measured on the
first ``--dopamine-rows`` rows and given per transition, and ``LazyMemmapStorage``'s bytes
(its arrays are dense, so they are computed from the shapes: 2 x 4 x 84 x 84 B of frames per
transition plus the small columns). With ``--lms-rows N`` a real ``LazyMemmapStorage`` of the
first ``N`` rows is also built (56 KB a row on disk: pick the largest ``N`` the disk holds) and
sampled warm and cold the same way, and tiered's rates are given as ratios to it.

Results go to ``benchmarks/out/bench_scale.json`` and ``benchmarks/out/bench_scale.md``. Not
part of CI (minutes and GBs at the default size).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks._harness import OUT_DIR, describe_load, load_snapshot, machine_facts, markdown_table  # noqa: E402

FRAME = 84 * 84


def base_rollout() -> dict[str, np.ndarray]:
    from tiered.atari import cached_rollout

    td = cached_rollout("Pong", steps=2000, seed=0, max_episode_steps=500)
    return {
        "observation": td["observation"].numpy(),
        "next_observation": td["next", "observation"].numpy(),
        "action": td["action"].numpy(),
        "reward": td["next", "reward"].numpy(),
        "terminated": td["next", "terminated"].numpy(),
        "truncated": td["next", "truncated"].numpy(),
        "done": td["next", "done"].numpy(),
        "traj": td["collector", "traj_ids"].numpy(),
    }


def perturb(frames: np.ndarray, tile: np.ndarray) -> np.ndarray:
    """XOR each row's frames with its tile number mod 251 and stamp the tile into 4 pixels."""
    shape = (-1,) + (1,) * (frames.ndim - 1)
    out = frames ^ (tile % 251).astype(np.uint8).reshape(shape)
    flat = out.reshape(out.shape[0], -1, FRAME)
    flat[:, :, :4] = tile.astype("<u4").view(np.uint8).reshape(-1, 1, 4)
    return out


class Tiles:
    """The tiled dataset, made fast: each distinct screen of the base rollout once, perturbed once
    per tile, and the stacks gathered from those (one copy per row, not three)."""

    def __init__(self, base: dict[str, np.ndarray]) -> None:
        self.base = base
        self.n = base["observation"].shape[0]
        stacks = np.concatenate([base["observation"], base["next_observation"]], axis=1)  # [n, 2F, 84, 84]
        flat = np.ascontiguousarray(stacks).reshape(-1, FRAME)
        keys = flat.view(np.dtype((np.void, FRAME))).ravel()
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        self.frames = flat[first]  # distinct screens [u, FRAME]
        self.index = inverse.reshape(self.n, -1)  # [n, 2F] into frames
        self.stack = base["observation"].shape[1]
        self._tile = -1
        self._perturbed = self.frames

    def perturbed(self, tile: int) -> np.ndarray:
        if tile != self._tile:
            self._perturbed = perturb(self.frames[:, None], np.full(self.frames.shape[0], tile))[:, 0]
            self._tile = tile
        return self._perturbed

    def frames_of(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``[hi - lo, F, 84, 84]`` observation and next observation stacks of rows ``lo:hi``."""
        m, f = hi - lo, self.stack
        obs = np.empty((m, f, FRAME), np.uint8)
        nxt = np.empty((m, f, FRAME), np.uint8)
        row = lo
        while row < hi:  # a loop over the (at most a few) tiles of the slice
            tile, pos = divmod(row, self.n)
            end = min(hi, (tile + 1) * self.n)
            pf, idx = self.perturbed(tile), self.index[pos: pos + end - row]
            np.take(pf, idx[:, :f], axis=0, out=obs[row - lo: end - lo], mode="clip")  # "raise" buffers the copy
            np.take(pf, idx[:, f:], axis=0, out=nxt[row - lo: end - lo], mode="clip")
            row = end
        return obs.reshape(m, f, 84, 84), nxt.reshape(m, f, 84, 84)


def tile_slice(base: dict[str, np.ndarray] | Tiles, lo: int, hi: int):
    """Rows ``lo:hi`` of the tiled dataset as a TensorDict in TorchRL's layout."""
    import torch
    from tensordict import TensorDict

    tiles = base if isinstance(base, Tiles) else Tiles(base)
    base = tiles.base
    n = tiles.n
    idx = np.arange(lo, hi)
    tile, pos = idx // n, idx % n
    traj_span = int(base["traj"].max()) + 1
    obs, nxt = tiles.frames_of(lo, hi)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in {
        "observation": obs, "next_observation": nxt,
        "action": base["action"][pos], "reward": base["reward"][pos],
        "terminated": base["terminated"][pos], "truncated": base["truncated"][pos],
        "done": base["done"][pos], "traj": base["traj"][pos] + tile * traj_span}.items()}
    return TensorDict({
        "observation": t["observation"], "action": t["action"],
        "collector": {"traj_ids": t["traj"]},
        "next": {"observation": t["next_observation"], "reward": t["reward"], "done": t["done"],
                 "terminated": t["terminated"], "truncated": t["truncated"]},
    }, [hi - lo])


def tile_slice_reference(base: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, np.ndarray]:
    """The slow, obvious form of :func:`tile_slice`'s frames (for checking it)."""
    n = base["observation"].shape[0]
    idx = np.arange(lo, hi)
    tile, pos = idx // n, idx % n
    return {"observation": perturb(base["observation"][pos], tile),
            "next_observation": perturb(base["next_observation"][pos], tile)}


class AnonPeak:
    """Peak ``RssAnon`` of this process (sampled every 10 ms) above where it started."""

    def __init__(self) -> None:
        self.start = self.now()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now()) - self.start


def write_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def store_files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


#: What one generation's files hold, in the order the report lists them.
PARTS = ("frames", "row tables", "dense columns", "blob index", "policy state", "written mask", "other")


def part_of(p: Path, arrays: set[Path]) -> str:
    """Which part of a store the file ``p`` is (one of :data:`PARTS`)."""
    if p.parent.name == "cold":
        return "frames"  # the cold tier's segments: the compressed frame blobs
    if p not in arrays:
        return "other"
    name = p.name
    prefixes = {"rows.": "row tables", "next.": "row tables", "shift.": "row tables", "dense.": "dense columns", "flags.": "dense columns",
                "index.": "blob index", "policy.": "policy state", "written.": "written mask"}
    return next((part for pre, part in prefixes.items() if name.startswith(pre)), "other")


def disk_bytes(path: Path) -> dict[str, int]:
    files = store_files(path)
    body = json.loads((path / "manifest.json").read_text())["body"]
    current = {path / "arrays" / f"{n}.{f}.npy" for n, f in body["array_files"].items()}
    older = {p for p in (path / "arrays").iterdir() if p not in current}  # before-images, files replaced lately
    arrays = {p for p in files if p.parent.name == "arrays"}  # row tables, dense columns, index
    parts: dict[str, int] = dict.fromkeys(PARTS, 0)
    for p in files:
        if p not in older:
            parts[part_of(p, arrays)] += p.stat().st_size
    return {"all": sum(p.stat().st_size for p in files),
            "one_generation_parts": parts,
            "one_generation": sum(p.stat().st_size for p in files if p not in older),
            "one_generation_arrays": sum(p.stat().st_size for p in files if p in arrays and p not in older),
            "one_generation_dense": sum(p.stat().st_size for p in files
                                        if p in arrays and p not in older and p.name.startswith(("dense.", "flags."))),
            "blocks": sum(p.stat().st_blocks * 512 for p in files),
            # what du counts beyond one generation, file by file
            "older_files": {p.name: p.stat().st_size for p in sorted(older)}}


# -- steps, each run in its own process -------------------------------------------------------
def step_build(path: Path, rows: int, slice_rows: int, chunk_frames: int, codec: str,
               flush_every: int = 0, dense_dtypes: dict[str, str] | None = None) -> dict[str, Any]:
    from tiered import TieredStore

    base = Tiles(base_rollout())
    meter = AnonPeak()
    t0 = time.perf_counter()
    store = TieredStore(rows, str(path), frames={"observation": 0}, hot_bytes=0, warm_bytes=0,
                        chunk_frames=chunk_frames, codec=codec,
                        dense_dtypes={tuple(k.split(".")): v for k, v in (dense_dtypes or {}).items()})
    making = 0.0
    for lo in range(0, rows, slice_rows):
        m = time.perf_counter()
        td = tile_slice(base, lo, min(rows, lo + slice_rows))
        making += time.perf_counter() - m
        store.extend(td)
        if flush_every and (lo + td.shape[0]) // flush_every > lo // flush_every:
            store.flush()  # a commit per checkpoint, as an importer makes
        if lo // slice_rows % 50 == 0:
            print(f"  build {lo + td.shape[0]:,}/{rows:,} rows", file=sys.stderr, flush=True)
    store.close()
    seconds = time.perf_counter() - t0 - making
    return {"build_s": seconds, "build_rows_per_s": rows / seconds, "build_peak_anon": meter.stop(),
            "making_data_s": making}


def step_commit(path: Path, rows: int, new_rows: int, rounds: int = 1) -> dict[str, Any]:
    import tiered

    base = Tiles(base_rollout())
    store = tiered.open(str(path), "r+")
    seconds, written = [], []
    for r in range(rounds):
        # new rows from tiles past the end, so they are new frames too
        store.extend(tile_slice(base, rows + r * new_rows, rows + (r + 1) * new_rows))
        before, t = write_bytes(), time.perf_counter()
        store.flush()
        seconds.append(time.perf_counter() - t)
        written.append(write_bytes() - before)
    store.close()
    # the first commit also rewrites what the two commits before it changed (the copies rotate
    # over three commits: docs/format.md); from the third on, a commit writes the pages of
    # its own and the two previous commits' rows
    return {"commit_s": seconds[0], "commit_bytes_written": written[0], "commit_s_all": seconds,
            "commit_bytes_written_all": written}


def step_reopen(path: Path) -> dict[str, Any]:
    import gc

    import tensordict  # noqa: F401  (torch and tensordict take ~350 MiB of their own: not the store's)
    import torch  # noqa: F401

    import tiered

    base_anon = AnonPeak.now()
    base_maps = anon_by_mapping()
    times, anon, cold = [], [], []
    by_mapping: dict[str, int] = {}
    for i in range(6):  # three opens with the page cache as the last one left it, then three cold
        if i >= 3:
            drop_cache(store_files(path))
        t = time.perf_counter()
        store = tiered.open(str(path))
        (times if i < 3 else cold).append(time.perf_counter() - t)
        anon.append(AnonPeak.now() - base_anon)
        if i == 0:
            now = anon_by_mapping()
            by_mapping = {k: v - base_maps.get(k, 0) for k, v in now.items() if v - base_maps.get(k, 0) >= 1 << 18}
        store.close()
        del store
        gc.collect()  # a closed store's parts hold reference cycles: without this, the next open adds to it
    # stats() of a fresh read-only open: the anonymous memory it leaves held, and its peak
    store = tiered.open(str(path))
    opened = AnonPeak.now()
    meter = AnonPeak()
    t = time.perf_counter()
    store.stats()
    stats_s = time.perf_counter() - t
    stats_peak = meter.stop() + meter.start - opened
    stats_held = AnonPeak.now() - opened
    store.close()
    return {"stats_s": stats_s, "stats_anon_held": stats_held, "stats_anon_peak": stats_peak,
            "reopen_s": min(times), "reopen_s_all": times, "reopen_cold_s": min(cold), "reopen_cold_s_all": cold,
            "reopen_anon": anon[0], "reopen_anon_all": anon,
            "reopen_anon_by_mapping": dict(sorted(by_mapping.items(), key=lambda kv: -kv[1]))}


def anon_by_mapping() -> dict[str, int]:
    """Anonymous (private, not file) bytes of this process per mapping (``/proc/self/smaps``): a
    store's array file by its name, other memory as ``[heap]`` or ``[anon]``."""
    out: dict[str, int] = {}
    name = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = Path(head[5]).name if len(head) > 5 and "/arrays/" in head[5] else (
                    head[5] if len(head) > 5 else "[anon]")
            elif head and head[0] == "Anonymous:" and name is not None and int(head[1]):
                out[name] = out.get(name, 0) + int(head[1]) * 1024
    return out


def drop_cache(files: list[Path]) -> None:
    """``posix_fadvise(DONTNEED)`` on every one of ``files``: their pages leave the page cache
    (those a process has mapped stay)."""
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def step_sample(path: Path, rows: int, batches: int, batch: int, warmup: int = 1) -> dict[str, Any]:
    import tiered

    store = tiered.open(str(path))
    out = sample_rates(store.get, store_files(path), rows, batches, batch, warmup)
    # the array files' pages the open and the batches made this process's own (not the warm
    # tier's cache of blobs, which its budget bounds)
    own = sum(v for k, v in anon_by_mapping().items() if k.endswith(".npy"))
    store.close()
    return {**{f"sample_{mode}_per_s": rate for mode, rate in out.items()}, "sample_array_anon": own}


def sample_rates(get: Any, files: list[Path], rows: int, batches: int, batch: int, warmup: int = 1,
                 touch: bool = False) -> dict[str, float]:
    """Rows per second of ``get`` on ``batches`` B=``batch`` uniform random index batches, after
    ``warmup`` untimed batches: ``{"warm": ..., "cold": ...}`` (cold: ``posix_fadvise(DONTNEED)`` on
    every one of ``files`` before each batch). ``touch``: read every byte of the observations ``get``
    returns, inside the timing (for a storage that may hand out lazy views of its files)."""
    import torch

    rng = np.random.default_rng(0)
    out: dict[str, float] = {}
    for mode in ("warm", "cold"):
        for _ in range(warmup if mode == "warm" else 1):  # untimed: warms up the pools (and, with
            # --warmup-batches, checks most pages of the per-row arrays: each is checked at first use)
            get(torch.from_numpy(rng.integers(0, rows, batch)))
        spent = 0.0
        for _ in range(batches):
            idx = torch.from_numpy(rng.integers(0, rows, batch))
            if mode == "cold":
                drop_cache(files)
            t = time.perf_counter()
            td = get(idx)
            if touch:
                td["observation"].sum()
            spent += time.perf_counter() - t
            assert td.shape[0] == batch
        out[mode] = batches * batch / spent
    return out


def step_lms(path: Path, rows: int, slice_rows: int, batches: int, batch: int) -> dict[str, Any]:
    """The anchor: TorchRL's ``LazyMemmapStorage`` of the same rows: build, bytes on disk, sample."""
    import torch
    from torchrl.data import LazyMemmapStorage

    tiles = Tiles(base_rollout())
    storage = LazyMemmapStorage(rows, scratch_dir=str(path), existsok=True)
    making, t0 = 0.0, time.perf_counter()
    for lo in range(0, rows, slice_rows):
        m = time.perf_counter()
        hi = min(rows, lo + slice_rows)
        td = tile_slice(tiles, lo, hi)
        making += time.perf_counter() - m
        storage.set(torch.arange(lo, hi), td)
    os.sync()  # on disk, as tiered's close() leaves its store (and not competing with the sampling)
    seconds = time.perf_counter() - t0 - making
    files = store_files(path)
    out: dict[str, Any] = {"lms_rows": rows, "lms_build_rows_per_s": rows / seconds,
                           "lms_disk_bytes": sum(p.stat().st_blocks * 512 for p in files)}
    rates = sample_rates(storage.get, files, rows, batches, batch, touch=True)
    out.update({f"lms_sample_{mode}_per_s": rate for mode, rate in rates.items()})
    return out


def dopamine_bytes(rows: int) -> dict[str, Any]:
    """Bytes per transition of the Dopamine checkpoint layout of the first ``rows`` rows."""
    base = base_rollout()
    td = tile_slice(base, 0, rows)
    arrays = {"observation": td["observation"][:, -1].numpy(),  # Dopamine saves each step's frame once
              "action": td["action"].numpy().astype(np.int32),
              "reward": td["next", "reward"].reshape(-1).numpy().astype(np.float32),
              "terminal": td["next", "terminated"].reshape(-1).numpy().astype(np.uint8)}
    sizes = {}
    for name, a in arrays.items():
        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb") as f:  # GzipFile's default level, as Dopamine writes
            np.save(f, a, allow_pickle=False)
        sizes[name] = buf.tell()
    return {"dopamine_bytes_per_transition": sum(sizes.values()) / rows,
            "dopamine_frame_bytes": sizes["observation"] / rows, "dopamine_rows": rows}


STEPS = {"build": step_build, "commit": step_commit, "reopen": step_reopen, "sample": step_sample,
         "dopamine": dopamine_bytes, "lms": step_lms}


def run_step(name: str, **kw: Any) -> dict[str, Any]:
    """Run one step in a fresh interpreter and return its JSON result."""
    args = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in kw.items()})
    proc = subprocess.run([sys.executable, __file__, "--step", name, "--step-args", args],
                          stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(rows: int, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    path = workdir / f"scale_{rows}"
    if path.exists():
        shutil.rmtree(path)
    res: dict[str, Any] = {"rows": rows}
    print(f"{rows:,} rows: building {path}", file=sys.stderr, flush=True)
    res.update(run_step("build", path=path, rows=rows, slice_rows=args.slice, chunk_frames=args.chunk_frames,
                        codec=args.codec, flush_every=args.flush_every, dense_dtypes=parse_dense(args.dense_dtypes)))
    res.update({f"disk_{k}": v for k, v in disk_bytes(path).items()})
    res.update(run_step("commit", path=path, rows=rows, new_rows=args.commit_rows, rounds=args.commit_rounds))
    # again after the small commits: the build's last flushes (a million rows each) leave large
    # before-images that the next two commits remove; this is what du sees in steady use
    after = disk_bytes(path)
    res.update({"disk_after_commits_all": after["all"], "disk_after_commits_one_generation": after["one_generation"],
                "disk_after_commits_older_files": after["older_files"]})
    res.update(run_step("reopen", path=path))
    res.update(run_step("sample", path=path, rows=rows, batches=args.batches, batch=256, warmup=args.warmup_batches))
    if not args.keep:
        shutil.rmtree(path)
    return res


def parse_dense(spec: str) -> dict[str, str]:
    """``"action=uint8,next.reward=int8"`` -> ``{"action": "uint8", "next.reward": "int8"}``."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, sep, dtype = item.partition("=")
        if not sep:
            raise SystemExit(f"--dense-dtypes takes KEY=DTYPE,..., got {item!r}")
        out[key.strip()] = dtype.strip()
    return out


def steady(r: dict[str, Any]) -> float:
    """The median time of a store's commits from the third on (the steady state)."""
    return float(np.median(r["commit_s_all"][2:]))


def report(results: list[dict[str, Any]], dop: dict[str, Any], facts: dict[str, Any], load: str,
           args: argparse.Namespace, lms_run: dict[str, Any] | None = None) -> str:
    lms = 2 * 4 * FRAME + 8 + 4 + 4 * 1 + 8  # frames, action, reward, flags, trajectory id
    head = ["rows", "K, codec", "build rows/s", "build peak anon", "disk B/transition (all)",
            "one generation (arrays, dense)",
            f"commit after {args.commit_rows:,} rows", "commit wrote", "reopen", "cold", "anon after reopen",
            "sample B=256 warm", "cold", "cold/warm", "array pages own after sampling"]
    body = [[f"{r['rows']:,}", f"{args.chunk_frames}, {args.codec}", f"{r['build_rows_per_s']:,.0f}", f"{r['build_peak_anon'] / 2**20:,.0f} MiB",
             f"{r['disk_all'] / r['rows']:.0f}", f"{r['disk_one_generation'] / r['rows']:.0f} "
             f"({r.get('disk_one_generation_arrays', 0) / r['rows']:.0f} arrays, "
             f"{r.get('disk_one_generation_dense', 0) / r['rows']:.0f} dense)",
             " / ".join(f"{x:.3f}" for x in r.get("commit_s_all", [r["commit_s"]])) + " s",
             " / ".join(f"{x / 2**20:,.1f}" for x in r.get("commit_bytes_written_all", [r["commit_bytes_written"]]))
             + " MiB",
             f"{r['reopen_s']:.2f} s", f"{r['reopen_cold_s']:.2f} s" if "reopen_cold_s" in r else "-",
             f"{r['reopen_anon'] / 2**20:,.0f} MiB",
             f"{r['sample_warm_per_s']:,.0f}/s", f"{r['sample_cold_per_s']:,.0f}/s",
             f"{r['sample_cold_per_s'] / r['sample_warm_per_s']:.2f}x",
             f"{r['sample_array_anon'] / 2**20:,.0f} MiB" if "sample_array_anon" in r else "-"] for r in results]
    lines = [f"# bench_scale ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {facts['cpu_model']}, {facts['logical_cores']} cores; `{facts['command']}`; "
             f"background load at the start: {load}.", "",
             markdown_table(head, body), "",
             f"Build: a flush() every {args.flush_every:,} rows." if args.flush_every else
             "Build: no flush() before close().", "",
             f"Dense columns stored narrower: {args.dense_dtypes}." if args.dense_dtypes else
             "Dense columns in the rollout's dtypes (int64 action and trajectory id, float32 reward, bool flags).", "",
             f"Same frames, other layouts (bytes per transition): Dopamine checkpoint files (gzip-9 `np.save`, "
             f"first {dop['dopamine_rows']:,} rows) **{dop['dopamine_bytes_per_transition']:.0f}** "
             f"({dop['dopamine_frame_bytes']:.0f} of them frames); LazyMemmapStorage {lms:,} (dense, from the shapes).",
             ""]
    for r in results:
        maps = r.get("reopen_anon_by_mapping")
        if maps:
            lines += [f"Anon after reopen at {r['rows']:,} rows by mapping (at least 0.25 MiB): "
                      + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in maps.items()) + ".", ""]
    for r in results:
        if "stats_s" in r:
            lines += [f"stats() of a read-only open at {r['rows']:,} rows: {r['stats_s']:.3f} s, anonymous memory "
                      f"held after it {r['stats_anon_held'] / 2**20:,.1f} MiB (peak {r['stats_anon_peak'] / 2**20:,.1f} MiB).", ""]
    for r in results:
        older = r.get("disk_older_files")
        if older:
            lines += [f"Files beside one generation at {r['rows']:,} rows right after the build (before-images, "
                      "files replaced by the last two commits): " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in older.items())
                      + f" ({sum(older.values()) / r['rows']:.2f} B/transition).", ""]
        if "disk_after_commits_all" in r:
            n = r["rows"]
            lines += [f"All files at {n:,} rows after the {args.commit_rounds} commits of {args.commit_rows:,} rows: "
                      f"**{r['disk_after_commits_all'] / n:.2f} B/transition** (one generation "
                      f"{r['disk_after_commits_one_generation'] / n:.2f}, files beside it "
                      f"{sum(r['disk_after_commits_older_files'].values()) / n:.2f}; Dopamine's files "
                      f"{dop['dopamine_bytes_per_transition']:.2f}).", ""]
        parts = r.get("disk_one_generation_parts")
        if parts:
            lines += [f"One generation at {r['rows']:,} rows, bytes per transition: "
                      + ", ".join(f"{k} {v / r['rows']:.2f}" for k, v in parts.items())
                      + f" (total {sum(parts.values()) / r['rows']:.2f}; Dopamine's files "
                      f"{dop['dopamine_bytes_per_transition']:.2f}).", ""]
    if lms_run:
        n = lms_run["lms_rows"]
        lines += [f"LazyMemmapStorage of the first {n:,} rows, built and sampled the same way: "
                  f"{lms_run['lms_disk_bytes'] / n:,.0f} B/transition on disk, build {lms_run['lms_build_rows_per_s']:,.0f} "
                  f"rows/s, sample B=256 warm {lms_run['lms_sample_warm_per_s']:,.0f}/s, cold "
                  f"{lms_run['lms_sample_cold_per_s']:,.0f}/s."]
        for r in results:
            lines.append(f"tiered at {r['rows']:,} rows against it: {lms_run['lms_disk_bytes'] / n / (r['disk_all'] / r['rows']):,.0f}x "
                         f"fewer bytes per transition, sample warm {r['sample_warm_per_s'] / lms_run['lms_sample_warm_per_s']:.2f}x, "
                         f"cold {r['sample_cold_per_s'] / lms_run['lms_sample_cold_per_s']:.2f}x.")
        lines.append("")
    if len(results) > 1:
        a, b = results[0], results[-1]
        lines.append(f"Commit after {args.commit_rows:,} new rows: {b['commit_s'] / a['commit_s']:.2f}x as long "
                     f"at {b['rows']:,} rows as at {a['rows']:,} (the goal is within 1.5x)"
                     + (f"; from the third of {args.commit_rounds} in a row on (each also rewrites what the two "
                        f"before it changed), median {steady(b):.3f} s against {steady(a):.3f} s: "
                        f"{steady(b) / steady(a):.2f}x." if args.commit_rounds > 2 else "."))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1_000_000])
    p.add_argument("--workdir", help="where to build the stores (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the stores")
    p.add_argument("--slice", type=int, default=5_000, help="rows per extend while building (the slice itself takes 56 KB a row)")
    p.add_argument("--commit-rows", type=int, default=10_000)
    p.add_argument("--commit-rounds", type=int, default=6,
                   help="commits of --commit-rows new rows each, in one open (default: %(default)s)")
    p.add_argument("--chunk-frames", type=int, default=8, help="the stores' chunk_frames (K; default: %(default)s)")
    p.add_argument("--codec", default="zstd", help="the stores' codec, e.g. zstd:9 (default: %(default)s)")
    p.add_argument("--flush-every", type=int, default=1_000_000,
                   help="rows between flush() calls while building, as an importer commits per checkpoint "
                        "(0: none before close; default: %(default)s)")
    p.add_argument("--batches", type=int, default=20, help="B=256 batches per sample mode")
    p.add_argument("--warmup-batches", type=int, default=1,
                   help="untimed B=256 batches before the warm ones (a fresh open checks each page of the per-row "
                        "arrays at its first use: many batches leave the steady state; default: %(default)s)")
    p.add_argument("--dense-dtypes", default="", metavar="KEY=DTYPE,...",
                   help="store dense columns narrower (dense_dtypes; nested keys with dots), e.g. "
                        "action=uint8,collector.traj_ids=int32,next.reward=int8")
    p.add_argument("--dopamine-rows", type=int, default=100_000)
    p.add_argument("--lms-rows", type=int, default=0,
                   help="also build TorchRL's LazyMemmapStorage of this many rows (56 KB each on disk) and sample it")
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--step-args", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dopamine_rows < 1:  # the report compares every figure with Dopamine's files
        p.error(f"--dopamine-rows must be at least 1, got {args.dopamine_rows}")
    if args.step:
        kw = json.loads(args.step_args)
        kw = {k: Path(v) if k == "path" else v for k, v in kw.items()}
        print(json.dumps(STEPS[args.step](**kw)))
        return 0
    before = load_snapshot()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_scale_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = [measure(n, workdir, args) for n in args.rows]
    lms_run = None
    if args.lms_rows:
        lms_path = workdir / f"lms_{args.lms_rows}"
        print(f"LazyMemmapStorage, {args.lms_rows:,} rows: building {lms_path}", file=sys.stderr, flush=True)
        lms_run = run_step("lms", path=lms_path, rows=args.lms_rows, slice_rows=args.slice, batches=args.batches,
                           batch=256)
        shutil.rmtree(lms_path, ignore_errors=True)
    dop = run_step("dopamine", rows=args.dopamine_rows)
    text = report(results, dop, machine_facts(), describe_load(before), args, lms_run)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "bench_scale.json").write_text(json.dumps({"results": results, "dopamine": dop, "lms": lms_run},
                                                         indent=1))
    (OUT_DIR / "bench_scale.md").write_text(text)
    print(text)
    if not args.workdir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
