"""Bytes per frame and random-sample decode cost of per-chunk frame codecs, against Dopamine's gz.

Run: ``python benchmarks/bench_frame_codecs.py [--rows 40000] [--ks 8 16 32 64] [--levels 3 9 19]``

A store compresses each chunk of K consecutive frames of one trajectory into one blob
(``chunk_frames=K``), so that a sample decodes only the blobs it touches. This script measures,
on the per-step newest frames (``td["observation"][:, -1]``, one 84x84 uint8 frame per
transition, as Dopamine stores them):

- **tiled**: the frames ``benchmarks/bench_scale.py`` builds its stores from (its
  ``base_rollout`` and ``perturb``: a 2000-step Pong rollout, tile ``t`` XORed with ``t % 251``
  and stamped in 4 pixels), the first ``--rows`` rows;
- **real**: untiled ALE rollouts of Pong, Breakout and MsPacman (``tiered.atari.cached_rollout``,
  ``--game-steps`` each).

For each K in ``--ks`` and zstd level in ``--levels``, up to three blob layouts (``--filters``):

- ``none`` (``zstd``): the K frames back to back, one zstd frame per blob (what the store writes
  today);
- ``xor`` (``zstd+xor``): frame i of a chunk stored as ``frame[i] ^ frame[i-1]`` (the first raw),
  then zstd; decoding is zstd followed by a cumulative XOR along each chunk
  (``np.bitwise_xor.accumulate`` over the whole decoded batch, corrected at blob starts);
- ``ref`` (``zstd+ref``): every frame XORed with one reference frame of the whole set (the
  per-pixel most frequent value of its first ``--ref-frames`` frames, kept once beside the blobs),
  then zstd; decoding is zstd followed by one XOR of the decoded batch with the reference (what
  a GPU can do with one elementwise op). The first frame of a chunk, otherwise compressed with
  nothing to match, then costs little where the screen's background is static.

Columns: compressed bytes per frame (blob bytes only, no index or row tables); the ratio to
Dopamine's layout (gzip level 9, ``gzip.GzipFile``'s default, of ``np.save`` of the same frames
over the whole stream: not randomly accessible); and the single-thread cost of decoding the
blobs of one uniform random B=256 sample of 4-frame stacks (the blobs holding frames ``r-3..r``
of each sampled row ``r``, within its trajectory; ``--batches`` samples, the same rows for every
setting, into one reused output buffer): MB decoded per sample (the cost that does not depend on
the machine's load), CPU milliseconds of the decoding thread per sample
(``time.thread_time``, which a busy machine disturbs less than wall time; the wall time is in the
JSON), its ratio to K=16 zstd:9, and decoded MB/s; and the encode rate (MB/s of raw frames, on ``--threads`` threads; the gzip anchor
on one).

Results go to ``benchmarks/out/bench_frame_codecs.json`` and ``.md`` (``--out`` renames them). Not part of CI.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks._harness import OUT_DIR, describe_load, load_snapshot, machine_facts, markdown_table  # noqa: E402
from benchmarks.bench_scale import FRAME, base_rollout, perturb  # noqa: E402

STACK = 4


def tiled_frames(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The newest frame and trajectory id of the first ``rows`` rows of bench_scale's tiled data."""
    base = base_rollout()
    n = base["observation"].shape[0]
    idx = np.arange(rows)
    tile, pos = idx // n, idx % n
    frames = perturb(base["observation"][pos, -1], tile)
    traj = base["traj"][pos] + tile * (int(base["traj"].max()) + 1)
    return np.ascontiguousarray(frames).reshape(rows, FRAME), traj


def real_frames(game: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    from tiered.atari import cached_rollout

    td = cached_rollout(game, steps=steps, seed=0)
    frames = td["observation"][:, -1].numpy()
    return np.ascontiguousarray(frames).reshape(-1, FRAME), td["collector", "traj_ids"].numpy()


def chunk_starts(traj: np.ndarray, k: int) -> np.ndarray:
    """First frame of every chunk: K consecutive frames of one trajectory per chunk."""
    n = traj.size
    new_run = np.r_[True, traj[1:] != traj[:-1]]
    run_start = np.flatnonzero(new_run)
    pos = np.arange(n) - np.repeat(run_start, np.diff(np.r_[run_start, n]))
    return np.flatnonzero(pos % k == 0)


def xor_delta(frames: np.ndarray, starts: np.ndarray) -> np.ndarray:
    out = frames.copy()
    out[1:] ^= frames[:-1]
    out[starts] = frames[starts]
    return out


def undo_xor(out: np.ndarray, blob_frame_starts: np.ndarray) -> None:
    """In place: cumulative XOR along every blob of ``out`` ([frames, FRAME]), blobs back to back."""
    out = out.view(np.uint64)  # 8 bytes per lane: ~5x faster than uint8 lanes
    np.bitwise_xor.accumulate(out, axis=0, out=out)
    s = blob_frame_starts[1:]
    if s.size:
        fix = out[s - 1]  # the running XOR of every earlier blob, to cancel from this blob
        lengths = np.diff(np.r_[blob_frame_starts, out.shape[0]])[1:]
        out[s[0]:] ^= np.repeat(fix, lengths, axis=0)


def dopamine_gz(frames: np.ndarray) -> tuple[int, float, float]:
    t = time.perf_counter()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as f:  # level 9, as Dopamine writes its checkpoints
        np.save(f, frames.reshape(-1, 84, 84), allow_pickle=False)
    raw = buf.getvalue()
    encode_mb_s = frames.nbytes / (time.perf_counter() - t) / 1e6
    t = time.perf_counter()
    gzip.decompress(raw)
    return len(raw), frames.nbytes / (time.perf_counter() - t) / 1e6, encode_mb_s


def sample_blobs(traj: np.ndarray, chunk_of: np.ndarray, batches: int, batch: int, seed: int) -> list[np.ndarray]:
    """Blob ids each random B-row sample of 4-frame stacks decodes (frames r-3..r in r's trajectory)."""
    rng = np.random.default_rng(seed)
    n = traj.size
    out = []
    for _ in range(batches):
        rows = rng.integers(0, n, batch)
        lo = np.maximum(rows - (STACK - 1), 0)
        lo = np.where(traj[lo] == traj[rows], lo, rows)  # a stack does not reach into another trajectory
        out.append(np.unique(np.r_[chunk_of[lo], chunk_of[rows]]))
    return out


def reference_frame(frames: np.ndarray, count: int) -> np.ndarray:
    """The per-pixel most frequent value of the first ``count`` frames (``[n, FRAME]`` uint8)."""
    head = frames[:count].astype(np.int64)
    votes = np.bincount((np.arange(FRAME) * 256 + head).reshape(-1), minlength=FRAME * 256)
    return votes.reshape(FRAME, 256).argmax(1).astype(np.uint8)


def measure(frames: np.ndarray, traj: np.ndarray, k: int, level: int, filt: str, samples_seed: int,
            batches: int, threads: int, ref_frames: int = 2000) -> dict[str, Any]:
    from tiered.codecs import ZstdCodec

    n = frames.shape[0]
    starts = chunk_starts(traj, k)
    nframes = np.diff(np.r_[starts, n])
    ref = reference_frame(frames, ref_frames) if filt == "ref" else None  # once per store: not timed
    t = time.perf_counter()
    data = xor_delta(frames, starts) if filt == "xor" else frames ^ ref if ref is not None else frames
    enc = ZstdCodec(level, threads=threads).encode(data.reshape(-1), starts * FRAME, nframes * FRAME)
    encode_s = time.perf_counter() - t
    chunk_of = np.repeat(np.arange(starts.size), nframes)
    codec = ZstdCodec(level, threads=1)
    samples = sample_blobs(traj, chunk_of, batches, 256, samples_seed)
    # one output buffer, touched before timing, so that page faults are not counted as decode
    buf = np.ones(max(int(nframes[ids].sum()) for ids in samples) * FRAME, np.uint8)
    spent, cpu, decoded = 0.0, 0.0, 0
    for ids in samples:
        sizes = nframes[ids] * FRAME
        out_off = np.r_[0, np.cumsum(sizes)[:-1]]
        out = buf[: int(sizes.sum())]
        t, c = time.perf_counter(), time.thread_time()
        codec.decode(enc.data, enc.offsets[ids], enc.sizes[ids], out, out_off, sizes)
        if filt == "xor":
            undo_xor(out.reshape(-1, FRAME), out_off // FRAME)
        elif ref is not None:
            np.bitwise_xor(out.reshape(-1, FRAME), ref, out=out.reshape(-1, FRAME))
        spent += time.perf_counter() - t
        cpu += time.thread_time() - c
        decoded += out.size
        # check the round trip of this sample (untimed)
        want = np.concatenate([frames[starts[i]:starts[i] + nframes[i]] for i in ids[:8]]).reshape(-1)
        assert np.array_equal(out[:want.size], want), "decode mismatch"
    return {"k": k, "level": level, "filter": filt, "delta": filt == "xor", "bytes_per_frame": int(enc.sizes.sum()) / n,
            "encode_mb_s": frames.nbytes / encode_s / 1e6, "sample_ms": cpu / batches * 1e3,
            "sample_wall_ms": spent / batches * 1e3, "decode_mb_s": decoded / cpu / 1e6,
            "sample_decoded_mb": decoded / batches / 1e6}


def run_set(name: str, frames: np.ndarray, traj: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    gz, gz_mb_s, gz_enc = dopamine_gz(frames)
    rows = []
    for k in args.ks:
        for level in args.levels:
            for filt in args.filters:
                r = measure(frames, traj, k, level, filt, 1, args.batches, args.threads, args.ref_frames)
                rows.append(r)
                print(f"  {name} K={k} {_label(r)}: {r['bytes_per_frame']:.1f} B/frame, "
                      f"{r['sample_ms']:.2f} ms/sample", file=sys.stderr, flush=True)
    return {"set": name, "frames": int(frames.shape[0]), "dopamine_gz_bytes_per_frame": gz / frames.shape[0],
            "dopamine_gz_stream_decode_mb_s": gz_mb_s, "dopamine_gz_encode_mb_s": gz_enc, "results": rows}


def _label(r: dict[str, Any]) -> str:
    return f"zstd:{r['level']}" + ("" if r["filter"] == "none" else f"+{r['filter']}")


def table(s: dict[str, Any]) -> str:
    gz = s["dopamine_gz_bytes_per_frame"]
    ref = next((r for r in s["results"] if r["k"] == 16 and r["level"] == 9 and r["filter"] == "none"), None)
    head = ["K", "codec", "B/frame", "vs Dopamine gz", "vs zstd alone", "MB decoded per sample", "sample B=256 decode (CPU)", "vs K=16 zstd:9", "decode MB/s", "encode MB/s"]
    plain = {(r["k"], r["level"]): r for r in s["results"] if r["filter"] == "none"}
    body = []
    for r in s["results"]:
        alone = plain.get((r["k"], r["level"]))
        gain = "" if r["filter"] == "none" or alone is None else \
            f"{r['bytes_per_frame'] / alone['bytes_per_frame'] - 1:+.0%}"
        body.append([str(r["k"]), _label(r), f"{r['bytes_per_frame']:.1f}",
                     f"{r['bytes_per_frame'] / gz:.2f}x", gain, f"{r['sample_decoded_mb']:.1f}", f"{r['sample_ms']:.2f} ms",
                     f"{r['sample_ms'] / ref['sample_ms']:.2f}x" if ref else "", f"{r['decode_mb_s']:,.0f}", f"{r['encode_mb_s']:,.1f}"])
    body.append(["stream", "gzip-9 np.save (Dopamine)", f"{gz:.1f}", "1.00x", "", "", "not random access", "",
                 f"{s['dopamine_gz_stream_decode_mb_s']:,.0f}", f"{s['dopamine_gz_encode_mb_s']:,.1f}"])
    return f"### {s['set']} ({s['frames']:,} frames)\n\n" + markdown_table(head, body) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=40_000, help="tiled rows (default: %(default)s)")
    p.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--levels", type=int, nargs="+", default=[3, 9, 19])
    p.add_argument("--games", nargs="*", default=["Pong", "Breakout", "MsPacman"])
    p.add_argument("--game-steps", type=int, default=5000)
    p.add_argument("--batches", type=int, default=20, help="random B=256 samples per setting")
    p.add_argument("--threads", type=int, default=2, help="encode threads (decode is timed on one)")
    p.add_argument("--filters", nargs="+", choices=["none", "xor", "ref"], default=["none", "xor", "ref"],
                   help="blob layouts to measure (default: all three)")
    p.add_argument("--ref-frames", type=int, default=2000,
                   help="frames the reference frame of --filters ref is the per-pixel mode of (default: %(default)s)")
    p.add_argument("--out", default="bench_frame_codecs", help="name of the files under benchmarks/out/")
    args = p.parse_args(argv)
    before = load_snapshot()
    sets = [run_set(f"tiled Pong (bench_scale), {args.rows:,} rows", *tiled_frames(args.rows), args)]
    for game in args.games:
        sets.append(run_set(f"real {game}, untiled", *real_frames(game, args.game_steps), args))
    facts = machine_facts()
    text = "\n".join([f"# bench_frame_codecs ({time.strftime('%Y-%m-%d')})", "",
                      f"Machine: {facts['cpu_model']}, {facts['logical_cores']} cores; `{facts['command']}`; "
                      f"background load at the start: {describe_load(before)}.", "",
                      "Blob bytes only (no index, row tables or other columns). Sample decode: CPU time of one thread, "
                      "the blobs of a uniform random B=256 sample of 4-frame stacks, mean of "
                      f"{args.batches} samples.", ""] + [table(s) for s in sets])
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"{args.out}.json").write_text(json.dumps({"facts": facts, "sets": sets}, indent=1))
    (OUT_DIR / f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
