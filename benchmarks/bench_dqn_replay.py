"""Bytes per frame: Dopamine's replay checkpoint (gz) against tiered stores of the same frames.

Run: ``python benchmarks/bench_dqn_replay.py [--steps 20000] [--games Pong,MsPacman] [--quick] [--write-docs]``

Plays ``--steps`` transitions of each ALE game (seeded random policy, ``tiered.atari``; cached
after the first run), writes them as one Dopamine replay checkpoint exactly as Dopamine's
``OutOfGraphReplayBuffer.save`` does (``tiered.formats.dopamine``: zero padding before each
episode, ``np.save`` into ``gzip.GzipFile`` at its default level 9), then imports that
checkpoint with ``tiered import --format dqn-replay`` at the default settings and at
``chunk_frames`` K in {4, 8, 16} x zstd level in {3, 9, 19}. Every configuration is zstd, which
the GPU path (nvCOMP) decodes at any level: the level changes only the encoder's work.

Printed per configuration: bytes per frame of the frame blobs, bytes per slot of the whole
store on disk (all files: blobs, row tables, dense columns, index, manifest), both as a ratio to
the Dopamine gz file of the same frames, import rows/s, and for the default configuration the
peak resident memory of the import (a fresh subprocess, ``VmHWM``) and a check that the
export gives back the same decompressed bytes. Also printed for reference: the same ``.npy``
at gzip level 6 and one zstd-3 stream over the whole array (not randomly accessible).

Results go to ``benchmarks/out/bench_dqn_replay.json`` and ``.md``; with ``--write-docs`` also
to its section of docs/benchmarks.md. Not part of CI.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks._harness import (  # noqa: E402
    add_output_arguments,
    dir_bytes,
    machine_facts,
    markdown_table,
    wants_docs,
    write_doc_section,
    write_output,
)
from tiered.engine.write import DEFAULT_CHUNK_FRAMES  # noqa: E402

BEGIN, END = "<!-- bench_dqn_replay:begin -->", "<!-- bench_dqn_replay:end -->"

_PEAK = """
import sys, time
import tiered.store, tiered.formats.dqn_replay
from tiered.formats import import_dataset

def status(key):  # kB lines of /proc/self/status; VmHWM is this process's peak (reset by exec)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

base = status("VmHWM")
t0 = time.perf_counter()
r = import_dataset("dqn-replay", sys.argv[1], sys.argv[2])
print(status("VmHWM"), r.rows / (time.perf_counter() - t0), base)
"""


NOTE = """\
"B/frame (frames)": bytes of the compressed frame blobs (all tiers) per buffer slot; "B/slot (all
files)": everything under the store directory as `du` counts it (row tables, dense columns, index,
the first generation, the cold segment's preallocated step), per slot. Every tiered
configuration is zstd, decoded by the GPU path at any level. Import rates are of one run on a
shared 2-core machine and vary by tens of percent between runs. "Import memory by checkpoint
size": one checkpoint of that many slots (the rollout tiled, each tile XORed with its number;
written at gzip level 1 to save time, which does not change what the reader holds), imported at
default settings in a fresh process; peak RSS growth is its VmHWM minus its VmHWM before the
import. The observation array is never held whole (it would show as GBs); the growth with the
number of slots was not broken down here (the store keeps per-row tables in memory, O(capacity)).
"""


def _frames(game: str, steps: int) -> dict[str, np.ndarray]:
    """The Dopamine slots of a rollout (cached under the tiered cache directory)."""
    from tiered.atari import AtariFrames, default_cache_dir, rollout_frames
    from tiered.formats.dopamine import padded_stream

    path = default_cache_dir() / f"dqn-bench-{game}-{steps}-s0.npz"
    if path.exists():
        with np.load(path) as data:
            fr = AtariFrames.from_npz(data)
    else:
        fr = rollout_frames(game, steps=steps, seed=0, progress=None)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **fr.to_npz_dict())
    obs = fr.frames[fr.first_frame + fr.step]
    return padded_stream(obs, fr.action.astype(np.int32), fr.reward, fr.terminated.astype(np.uint8), fr.step == 0)


def _gz_bytes(a: np.ndarray, level: int) -> int:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=level) as f:
        np.save(f, a, allow_pickle=False)
    return buf.tell()


def _import(root: str, dst: str, codec: str, k: int) -> dict[str, float]:
    from tiered import TieredStore
    from tiered.formats import import_dataset

    t0 = time.perf_counter()
    rep = import_dataset("dqn-replay", root, dst, codec=codec, chunk_frames=k)
    seconds = time.perf_counter() - t0
    with TieredStore.open(dst, mode="r") as store:
        blobs = sum(t["bytes_used"] for t in store.stats()["tiers"].values())  # the frame blobs, all tiers
    return {"rows": rep.rows, "seconds": seconds, "blob_bytes": blobs, "disk_bytes": dir_bytes(dst)["allocated"],
            "apparent_bytes": dir_bytes(dst)["apparent"]}


def _exact(root: str, store: str, tmp: str) -> bool:
    from tiered.formats import export_dataset

    export_dataset(store, os.path.join(tmp, "back"), "dqn-replay")
    logs, back = os.path.join(root, "replay_logs"), os.path.join(tmp, "back", "replay_logs")
    for name in os.listdir(logs):
        with gzip.open(os.path.join(logs, name)) as a, gzip.open(os.path.join(back, name)) as b:
            if a.read() != b.read():
                return False
    return True


def _measure(game: str, steps: int, quick: bool) -> dict:
    """Write one checkpoint of ``game`` as Dopamine does; import it in every configuration."""
    from tiered.formats.dopamine import buffer_checkpoint, save_checkpoint

    slots = _frames(game, steps)
    n = slots["observation"].shape[0]
    tmp = tempfile.mkdtemp(prefix="bench-dqn-")
    try:
        root = os.path.join(tmp, "run")
        save_checkpoint(os.path.join(root, "replay_logs"), 0, buffer_checkpoint(slots, n, n))
        logs = os.path.join(root, "replay_logs")
        import zstandard

        ref = {"dopamine_gz9_obs": os.path.getsize(os.path.join(logs, "$store$_observation_ckpt.0.gz")),
               "dopamine_gz9_all": sum(os.path.getsize(os.path.join(logs, f)) for f in os.listdir(logs)),
               "gz6_obs": _gz_bytes(slots["observation"], 6),
               "zstd3_stream_obs": len(zstandard.ZstdCompressor(level=3).compress(slots["observation"].tobytes()))}
        ks, levels = ((4, 16), (3, 19)) if quick else ((4, 8, 16), (3, 9, 19))
        configs = [(f"default (zstd, K={DEFAULT_CHUNK_FRAMES})", "zstd", DEFAULT_CHUNK_FRAMES)] + [(f"K={k} zstd:{lv}", f"zstd:{lv}", k)
                                                          for k in ks for lv in levels]
        results: list[dict] = []
        for label, codec, k in configs:
            dst = os.path.join(tmp, f"s-{k}-{codec.replace(':', '')}")
            same_as_default = (k, codec) == (DEFAULT_CHUNK_FRAMES, "zstd:3") and results  # zstd is zstd:3: measured once
            r = results[0] if same_as_default else _import(root, dst, codec, k)
            results.append(dict(r, label=label, codec=codec, k=k))
        out = subprocess.run([sys.executable, "-c", _PEAK, root, os.path.join(tmp, "peak")], check=True,
                             capture_output=True, text=True).stdout.split()
        exact = _exact(root, os.path.join(tmp, "peak"), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"game": game, "steps": steps, "slots": n, "reference": ref, "results": results, "peak_rss": int(out[0]),
            "peak_rows_per_s": float(out[1]), "base_rss": int(out[2]), "export_exact": exact}


def _write_tiled(logs: str, slots: dict[str, np.ndarray], total: int, level: int) -> None:
    """One checkpoint of ``total`` slots, written as a stream: ``slots`` tiled, each tile's frames XORed
    with the tile number (tiles neither dedup nor compress against each other)."""
    from tiered.formats.dopamine import STORE_NAMES, save_checkpoint

    n = slots["observation"].shape[0]
    os.makedirs(logs, exist_ok=True)
    for name in STORE_NAMES:
        a = slots[name]
        head = np.lib.format.header_data_from_array_1_0(a[:1])
        head["shape"] = (total, *a.shape[1:])
        path = os.path.join(logs, f"$store$_{name}_ckpt.0.gz")
        with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=level) as out:
            np.lib.format.write_array_header_1_0(out, head)
            for lo in range(0, total, n):
                tile = a[: min(n, total - lo)]
                out.write((tile ^ np.uint8((lo // n) % 251)).tobytes() if name == "observation" else tile.tobytes())
    small = {"add_count": np.array(total), "invalid_range": np.array([(0 - 1 + j) % total for j in range(5)])}
    save_checkpoint(logs, 0, small)


def _scale(game: str, steps: int, total: int) -> dict:
    """Import memory and rate on one checkpoint of ``total`` slots (tiled real frames), in a fresh process."""
    slots = _frames(game, steps)
    tmp = tempfile.mkdtemp(prefix="bench-dqn-scale-")
    try:
        root = os.path.join(tmp, "run")
        t0 = time.perf_counter()
        _write_tiled(os.path.join(root, "replay_logs"), slots, total, level=1)
        write_s = time.perf_counter() - t0
        out = subprocess.run([sys.executable, "-c", _PEAK, root, os.path.join(tmp, "s")], check=True,
                             capture_output=True, text=True).stdout.split()
        store_bytes = dir_bytes(os.path.join(tmp, "s"))["allocated"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"slots": total, "raw_observation_bytes": total * 84 * 84, "write_s": write_s, "peak_rss": int(out[0]),
            "base_rss": int(out[2]), "rows_per_s": float(out[1]), "store_bytes": store_bytes}


def _report(m: dict) -> str:
    n, ref, gz = m["slots"], m["reference"], m["reference"]["dopamine_gz9_obs"]
    rows = [["Dopamine gz-9 (observation file)", f"{gz / n:.1f}", f"{ref['dopamine_gz9_all'] / n:.1f}", "1.00x",
             "-", "no"],
            ["same .npy, gzip-6", f"{ref['gz6_obs'] / n:.1f}", "-", f"{ref['gz6_obs'] / gz:.2f}x", "-", "no"],
            ["one zstd-3 stream", f"{ref['zstd3_stream_obs'] / n:.1f}", "-", f"{ref['zstd3_stream_obs'] / gz:.2f}x",
             "-", "no"]]
    for r in m["results"]:
        rows.append([f"tiered {r['label']}", f"{r['blob_bytes'] / n:.1f}", f"{r['disk_bytes'] / n:.1f}",
                     f"{r['blob_bytes'] / gz:.2f}x", f"{r['rows'] / r['seconds']:,.0f}", "yes"])
    headers = ["storage", "B/frame (frames)", "B/slot (all files)", "frames vs gz-9", "import rows/s",
               "random access"]
    return (f"### {m['game']}: {n:,} slots ({m['steps']:,} transitions + Dopamine's zero padding), 84x84 uint8 "
            f"frames (7,056 B raw)\n\n{markdown_table(headers, rows)}\n\nImport at default settings in a fresh "
            f"process: peak RSS {m['peak_rss'] / 2**20:.0f} MiB ({m['base_rss'] / 2**20:.0f} MiB after importing "
            f"the modules, before the import), {m['peak_rows_per_s']:,.0f} rows/s. Export gives back the same "
            f"decompressed bytes: {m['export_exact']}.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--games", default="Pong", help="comma-separated ALE games (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="K=4 and 16, zstd 3 and 19 only")
    p.add_argument("--scale", type=str, default="",
                   help="comma-separated slot counts: also import one checkpoint of each size (tiled frames, "
                        "gzip level 1 to write it faster) and report the import's peak RSS, e.g. 20000,200000")
    add_output_arguments(p)
    args = p.parse_args(argv)
    runs = [_measure(g, args.steps, args.quick) for g in args.games.split(",")]
    scale = [_scale(args.games.split(",")[0], args.steps, int(x)) for x in args.scale.split(",") if x]
    facts = machine_facts(argv)
    text = "\n".join(_report(m) for m in runs)
    if scale:
        rows = [[f"{r['slots']:,}", f"{r['raw_observation_bytes'] / 2**20:,.0f} MiB",
                 f"{(r['peak_rss'] - r['base_rss']) / 2**20:,.0f} MiB", f"{r['rows_per_s']:,.0f}",
                 f"{r['store_bytes'] / r['slots']:.1f}"] for r in scale]
        text += ("\n### Import memory by checkpoint size (one checkpoint, tiled frames, fresh process)\n\n"
                 + markdown_table(["slots", "observation array", "peak RSS growth", "rows/s", "store B/slot"], rows)
                 + "\n")
    text += f"\n{facts['date']} · {facts['cpu_model']} · `{facts['command']}`\n"
    print(text)
    write_output("bench_dqn_replay.md", text)
    write_output("bench_dqn_replay.json", json.dumps({"runs": runs, "scale": scale, "machine": facts}, indent=1))
    if wants_docs(args):
        write_doc_section("## DQN Replay: Dopamine's gz files and stores of the same frames (bench_dqn_replay.py)"
                          f"\n\n{text}\n{NOTE}", BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
