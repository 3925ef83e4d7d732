"""Import speed and memory of ``tiered import`` on a large Atari-frame dataset, in every format.

Run: ``python benchmarks/bench_import.py [--size-gb 2] [--keep] [--write-docs]``

For each format (d4rl, minari, torchrl, npz) it builds a dataset of about ``--size-gb`` GB of
4x84x84 uint8 frame stacks, tiled from a real ALE Pong rollout (``tiered.atari.cached_rollout``)
and perturbed per tile (XOR with the tile number, so tiles do not deduplicate against each
other while every frame stays a real, equally compressible screen). Each dataset is written in
slices, so building it needs little memory. Then each is imported with
``tiered.formats.import_dataset(..., frames={"observation": 0})`` in a **fresh subprocess**
that samples its own memory every 10 ms (psutil RSS and ``RssAnon`` from ``/proc``), and the
script prints one table: rows, source size, store size, seconds, rows/s, source MB/s, and the
peak growth of resident memory over the process's baseline (after ``import tiered``).

Results go to ``benchmarks/out/bench_import.json`` and ``benchmarks/out/bench_import.md``; with
``--write-docs`` the report also replaces the section of docs/benchmarks.md between
``<!-- bench_import:begin -->`` and ``<!-- bench_import:end -->`` (other sections are left alone).

Not part of CI (minutes and several GB of disk at the default size).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import plots  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    OUT_DIR,
    add_output_arguments,
    describe_load,
    dir_bytes,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    load_snapshot,
    machine_facts,
    markdown_table,
    wants_docs,
    write_doc_section,
    write_output,
)

BEGIN, END = "<!-- bench_import:begin -->", "<!-- bench_import:end -->"
FORMATS = ("d4rl", "minari", "torchrl", "npz")
SLICE = 1000  # rows written per slice while building a dataset


def load_rollout() -> dict[str, np.ndarray]:
    from tiered.atari import cached_rollout

    td = cached_rollout("Pong", steps=2000, seed=0, max_episode_steps=500)
    return {
        "observation": td["observation"].numpy(),
        "next_observation": td["next", "observation"].numpy(),
        "action": td["action"].numpy(),
        "reward": td["next", "reward"].reshape(-1).numpy(),
        "terminated": td["next", "terminated"].reshape(-1).numpy(),
        "truncated": td["next", "truncated"].reshape(-1).numpy(),
        "traj": td["collector", "traj_ids"].numpy(),
    }


def tiled(base: dict[str, np.ndarray], lo: int, hi: int, key: str) -> np.ndarray:
    """Rows ``lo:hi`` of the tiled dataset; tile ``r`` has its frames XORed with ``r``."""
    n = base["observation"].shape[0]
    idx = np.arange(lo, hi)
    tile, pos = idx // n, idx % n
    a = base[key][pos]
    if a.dtype == np.uint8:
        a ^= (tile % 251).astype(np.uint8).reshape(-1, *([1] * (a.ndim - 1)))
    return a


# D4RL array name -> key of the base rollout, shared by the D4RL and npz sources
D4RL_COLUMNS = {
    "observations": "observation",
    "actions": "action",
    "rewards": "reward",
    "terminals": "terminated",
    "timeouts": "truncated",
}


def build_d4rl(base, rows: int, path: Path) -> None:
    with h5py.File(path, "w") as f:
        ds = {
            name: f.create_dataset(name, shape=(rows, *base[k].shape[1:]), dtype=base[k].dtype)
            for name, k in D4RL_COLUMNS.items()
        }
        for lo in range(0, rows, SLICE):
            hi = min(rows, lo + SLICE)
            for name, k in D4RL_COLUMNS.items():
                ds[name][lo:hi] = tiled(base, lo, hi, k)


def build_npz(base, rows: int, path: Path) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, k in D4RL_COLUMNS.items():
            a = base[k]
            head = io.BytesIO()
            np.lib.format.write_array_header_2_0(
                head,
                {
                    "descr": np.lib.format.dtype_to_descr(a.dtype),
                    "fortran_order": False,
                    "shape": (rows, *a.shape[1:]),
                },
            )
            with zf.open(name + ".npy", "w", force_zip64=True) as w:
                w.write(head.getvalue())
                for lo in range(0, rows, SLICE):
                    w.write(np.ascontiguousarray(tiled(base, lo, min(rows, lo + SLICE), k)).tobytes())


def build_torchrl(base, rows: int, path: Path) -> None:
    import torch
    from tensordict import TensorDict

    keys = {
        "observation": ("observation",),
        "next_observation": ("next", "observation"),
        "action": ("action",),
        "reward": ("next", "reward"),
        "terminated": ("next", "terminated"),
        "truncated": ("next", "truncated"),
        "traj": ("collector", "traj_ids"),
    }
    template = TensorDict({}, batch_size=[rows])
    for k, key in keys.items():
        a = torch.from_numpy(base[k][:1])
        template.set(key, a.expand(rows, *a.shape[1:]))
    mm = template.memmap_like(str(path))
    n = base["observation"].shape[0]
    for lo in range(0, rows, SLICE):
        hi = min(rows, lo + SLICE)
        for k, key in keys.items():
            a = tiled(base, lo, hi, k)
            if k == "traj":
                a = a + (np.arange(lo, hi) // n) * (int(base["traj"].max()) + 1)
            mm.get(key)[lo:hi] = torch.from_numpy(np.ascontiguousarray(a))
    del mm


def build_minari(base, rows: int, path: Path) -> None:
    """A minari dataset directory (HDF5 storage, raw frames) with the rollout's episodes."""
    n = base["observation"].shape[0]
    traj = base["traj"]
    starts = np.flatnonzero(np.r_[True, traj[1:] != traj[:-1]])
    ends = np.r_[starts[1:], n]
    (path / "data").mkdir(parents=True)
    episodes = 0
    with h5py.File(path / "data" / "main_data.hdf5", "w", track_order=True) as f:
        done = 0
        while done < rows:
            tile = done // n
            for s, e in zip(starts, ends, strict=True):
                if done >= rows:
                    break
                T = int(min(e - s, rows - done))
                g = f.create_group(f"episode_{episodes}")
                g.attrs.update({"id": episodes, "total_steps": T})
                lo = tile * n + s
                obs = g.create_dataset("observations", shape=(T + 1, 4, 84, 84), dtype=np.uint8)
                for a in range(0, T, SLICE):
                    b = min(T, a + SLICE)
                    obs[a:b] = tiled(base, lo + a, lo + b, "observation")
                last = tiled(base, lo + T - 1, lo + T, "next_observation")
                obs[T] = last[0]
                for name, k in (
                    ("actions", "action"),
                    ("rewards", "reward"),
                    ("terminations", "terminated"),
                    ("truncations", "truncated"),
                ):
                    g[name] = tiled(base, lo, lo + T, k)
                g.create_group("infos")
                episodes += 1
                done += T
    box = {
        "type": "Box",
        "dtype": "uint8",
        "shape": [4, 84, 84],
        "low": np.zeros((4, 84, 84), int).tolist(),
        "high": np.full((4, 84, 84), 255).tolist(),
    }
    meta = {
        "total_episodes": episodes,
        "total_steps": rows,
        "data_format": "hdf5",
        "jpeg_encoding": False,
        "observation_space": json.dumps(box),
        "action_space": json.dumps({"type": "Discrete", "dtype": "int64", "start": 0, "n": 6}),
        "dataset_id": "bench/pong-tiled-v0",
        "minari_version": "0.5.4",
        "algorithm_name": "random",
    }
    (path / "data" / "metadata.json").write_text(json.dumps(meta))


BUILDERS = {
    "d4rl": (build_d4rl, "pong.hdf5"),
    "npz": (build_npz, "pong.npz"),
    "torchrl": (build_torchrl, "pong-td"),
    "minari": (build_minari, "pong-minari"),
}
# bytes of one row of the source (the frames dominate): torchrl holds next observations too
ROW_BYTES = {"d4rl": 28224, "npz": 28224, "minari": 28224, "torchrl": 2 * 28224}

CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import psutil
    import tiered
    from tiered.formats import import_dataset
    proc = psutil.Process()
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    base_rss, base_anon = proc.memory_info().rss, anon()
    peak = {"rss": base_rss, "anon": base_anon}
    timeline = []  # (seconds since the import started, RSS growth, RssAnon growth), for the plot
    stop = False
    def watch():
        while not stop:
            rss, an = proc.memory_info().rss, anon()
            peak["rss"] = max(peak["rss"], rss)
            peak["anon"] = max(peak["anon"], an)
            timeline.append((time.perf_counter() - t0, rss - base_rss, an - base_anon))
            time.sleep(0.01)
    fmt, src, dst = sys.argv[1:4]
    t0 = time.perf_counter()
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    rep = import_dataset(fmt, src, dst, frames={"observation": 0})
    secs = time.perf_counter() - t0
    stop = True
    t.join()
    print(json.dumps({"rows": rep.rows, "seconds": secs, "rss_growth": peak["rss"] - base_rss,
                      "anon_growth": peak["anon"] - base_anon, "store_bytes": rep.store_bytes,
                      "timeline": timeline}))
""")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="frames per dataset, in GB (default 2)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--workdir", help="where to build the datasets (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the datasets and stores")
    add_output_arguments(p)
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_import-"))
    work.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    load_before = load_snapshot()
    base = load_rollout()
    results = []
    try:
        for fmt in args.formats:
            rows = max(1, int(args.size_gb * 1e9 / ROW_BYTES[fmt]))
            build, name = BUILDERS[fmt]
            src = work / name
            t = time.perf_counter()
            build(base, rows, src)
            built = time.perf_counter() - t
            size = dir_bytes(src)["apparent"] if src.is_dir() else src.stat().st_size
            print(f"{fmt}: built {rows:,} rows, {fmt_bytes(size)} in {built:.1f} s; importing...", flush=True)
            dst = work / f"{fmt}.tiered"
            out = subprocess.run(
                [sys.executable, "-c", CHILD, fmt, str(src), str(dst)],
                capture_output=True,
                text=True,
                cwd=str(Path(__file__).resolve().parents[1]),
            )
            if out.returncode != 0:
                raise SystemExit(f"import of {fmt} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r.update(fmt=fmt, source_bytes=size)
            results.append(r)
            print(
                f"  {r['rows']:,} rows in {r['seconds']:.1f} s, "
                f"peak anon growth {fmt_bytes(r['anon_growth'])}",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(src, ignore_errors=True) if src.is_dir() else src.unlink()
                shutil.rmtree(dst, ignore_errors=True)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    load_after = load_snapshot()

    headers = [
        "format",
        "rows",
        "source",
        "store",
        "ratio",
        "seconds",
        "rows/s",
        "source MB/s",
        "peak anon RSS growth",
        "peak RSS growth",
    ]
    table = markdown_table(
        headers,
        [
            [
                r["fmt"],
                f"{r['rows']:,}",
                fmt_bytes(r["source_bytes"]),
                fmt_bytes(r["store_bytes"]),
                fmt_ratio(r["source_bytes"] / r["store_bytes"]) if r["store_bytes"] else "n/a",
                f"{r['seconds']:.1f}",
                fmt_rate(r["rows"] / r["seconds"]),
                f"{r['source_bytes'] / 1e6 / r['seconds']:.0f}",
                fmt_bytes(r["anon_growth"]),
                fmt_bytes(r["rss_growth"]),
            ]
            for r in results
        ],
    )
    print()
    print(table)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out_path = OUT_DIR / "bench_import.json"
    out_path.write_text(json.dumps({"facts": facts, "args": vars(args), "results": results,
                                    "load_before": load_before, "load_after": load_after}, default=str))
    print(f"raw results: {out_path}")
    plots.plot_import(out_path, plots.plot_dir(args.write_docs))
    machine = (
        f"{facts['cpu_model']}, {facts['logical_cores']} logical cores, {fmt_bytes(facts['ram_bytes'])} RAM, "
        f"{facts['os']}"
    )
    versions = (
        f"Python {facts['python']}, torch {facts['torch']}, tensordict {facts['tensordict']}, "
        f"tiered {facts['tiered']}, h5py {h5py.__version__}"
    )
    body = f"""## Import (bench_import.py)

Written by `benchmarks/bench_import.py`; rerun it to refresh this section.

- Machine: {machine}
- {versions}
- Date: {facts["date"]}
- Command: `{facts["command"]}`
- Data: about {args.size_gb:g} GB of 4x84x84 uint8 frame stacks per format, tiled from a real ALE Pong rollout
  (2,000 transitions, random policy), each tile XORed with its number so tiles do not deduplicate against
  each other; d4rl/npz/minari hold observations only (next observations are derived or shifted), torchrl
  holds observations and next observations.
  Import: `import_dataset(fmt, src, dst, frames={{"observation": 0}})`, defaults otherwise (zstd level 3,
  4-frame chunks, slices of at most 32 MiB), one fresh process per format.
- Memory: peak growth over the importer's baseline after `import tiered`, sampled every 10 ms; "anon" is
  `RssAnon` (heap), "RSS" also counts file pages mapped by the process.
- Store: the store directory's disk usage (allocated blocks): compressed blobs, the cold segment's
  reserved growth (at most the data again, in steps of up to 16 MiB), and the row tables of the last commit and of the one before it
  (kept for readers that opened it), so the ratio is lower than the blobs' own compression.
- Background load before: {describe_load(load_before)}
- Background load after: {describe_load(load_after)}

{table}
"""
    write_output("bench_import.json", json.dumps({"facts": facts, "size_gb": args.size_gb, "results": results,
                                                  "load_before": load_before, "load_after": load_after},
                                                 indent=1, default=str))
    print(f"\nwrote {write_output('bench_import.md', body)} and bench_import.json beside it")
    if wants_docs(args):
        write_doc_section(body, BEGIN, END)
        print("\nwrote the section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
