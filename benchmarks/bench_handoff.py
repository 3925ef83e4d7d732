"""What handing half a decode to a pool thread costs and saves: the break-even of a split decode.

Run: ``python benchmarks/bench_handoff.py [--reps 200] [--chunks 5 10 20 30 45 90 180] [--quiet-only]``

Data: the committed real Atari rows (``benchmarks/data/atari_frames.npz``), the newest 84x84 frame
of each row cut into time chunks of K=8 frames and compressed as the store writes them (one zstd
frame per chunk, checksums from the encode). A B=32 sample of stacks with next observations
touches ~45 such chunks (~2.5 MB decoded), B=8 ~15, B=256 ~180.

For each batch of ``n`` random chunks, :func:`tiered.codecs.checked.decode_checked` (check, then
decode, what a ``get`` runs per frame family) on one thread (``one``) against split over two
(``split``: one slice per thread, the calling thread claiming a slice no pool thread has
started), alternating on the same chunks. Per batch: wall time, the calling thread's CPU time
(``time.thread_time``) and the process's CPU time (both threads), medians in microseconds.
``saved`` is one's wall over split's: above 1.0 the split pays. On a machine where another process
holds the second core, the split's wall time is the one-thread time plus the handoff (the calling
thread claims the slice the late pool thread did not start); only a quiet machine shows the gain.

``--quiet-only`` (for a shared machine): batches are timed in bursts of 20, and a burst counts
only when other processes used under 0.1 cores while it ran (before it, the script waits for such
a moment); it stops at ``--reps`` counted batches per size or after ``--max-seconds``.

Then ``idle``: the pool threads' CPU time (``time.pthread_getcpuclockid``) over 0.5 s after the
last batch: a thread that kept spinning after its batch would show here (it must be ~0).

Prints the machine's background load first. Not part of CI; prints a table.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

FIXTURE = Path(__file__).resolve().parent / "data" / "atari_frames.npz"
K = 8


def _chunks():
    from tiered.atari import load_fixture
    from tiered.codecs.zstd import ZstdCodec

    obs = load_fixture(FIXTURE)["observation"].numpy()
    frames = np.ascontiguousarray(obs[:, -1].reshape(obs.shape[0], -1))
    cb = K * frames.shape[1]
    n = frames.shape[0] // K
    raw = frames[: n * K].reshape(-1)
    enc = ZstdCodec(3, threads=1).encode(raw, np.arange(n, dtype=np.int64) * cb, np.full(n, cb, dtype=np.int64))
    return enc, cb


def _pool_cpu() -> float:
    """CPU seconds of the pool's threads so far."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("tiered-codec") and t.ident is not None:
            total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total


def _burst(codecs, enc, rng, n, reps, out, oo, os_, warm):
    """Time ``reps`` batches of ``n`` random chunks with each codec, alternating (the first
    ``warm`` batches untimed)."""
    from tiered.codecs.checked import decode_checked

    res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in codecs}
    for rep in range(reps + warm):
        pick = rng.choice(enc.sizes.size, n, replace=False)
        # back to back, as a read gathers them from its tier (untimed)
        comp = np.concatenate([enc.data[o:o + s] for o, s in zip(enc.offsets[pick], enc.sizes[pick], strict=True)])
        sizes, sums = enc.sizes[pick], enc.checksums[pick]
        offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        for k in (list(codecs) if rep % 2 else list(codecs)[::-1]):
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            bad = decode_checked(codecs[k], comp, offs, sizes, sums, out, oo, os_, threads=codecs[k].threads)
            dt = (time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0)
            assert bad.size == 0
            if rep >= warm:
                res[k].append(dt)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--chunks", type=int, nargs="+", default=[5, 10, 20, 30, 45, 90, 180])
    p.add_argument("--quiet-only", action="store_true", help="count only bursts run while other processes were idle")
    p.add_argument("--max-seconds", type=float, default=600.0, help="with --quiet-only: give up after this long")
    args = p.parse_args(argv)
    from tiered.codecs import checked
    from tiered.codecs.zstd import ZstdCodec

    print(H.describe_load(H.load_snapshot()))
    enc, cb = _chunks()
    codecs = {"one": ZstdCodec(3, threads=1), "split": ZstdCodec(3, threads=2)}
    checked.MIN_CHUNK_SPLIT_BYTES = 0  # split whatever the size: the point is to find where it pays
    rng = np.random.default_rng(0)
    print(f"{enc.sizes.size} chunks of {K} frames, {cb} bytes decoded, {enc.sizes.mean():.0f} compressed on average")
    print("| chunks | MB decoded | one wall | split wall | saved | one CPU | split caller CPU | split process CPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    notes: list[str] = []
    for n in args.chunks:
        out = np.empty(n * cb, np.uint8)
        oo = np.arange(n, dtype=np.int64) * cb
        os_ = np.full(n, cb, dtype=np.int64)
        res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in codecs}
        burst = 20 if args.quiet_only else args.reps + 5
        deadline = time.monotonic() + args.max_seconds
        skipped = 0
        while len(res["one"]) < args.reps and time.monotonic() < deadline:
            if args.quiet_only:
                before = H.CpuMeter()
                time.sleep(0.3)
                if before.stop()["other_cores"] > 0.1:  # wait for a quiet moment
                    skipped += 1
                    time.sleep(1.0)
                    continue
            meter = H.CpuMeter()
            got = _burst(codecs, enc, rng, n, burst, out, oo, os_, warm=0 if args.quiet_only else 5)
            if args.quiet_only and meter.stop()["other_cores"] > 0.1:
                skipped += 1
                continue
            for k, v in got.items():
                res[k] += v
        if not res["one"]:
            print(f"| {n} | no quiet burst in {args.max_seconds:.0f} s | | | | | | |", flush=True)
            continue
        if args.quiet_only:
            notes.append(f"{n} chunks: {len(res['one'])} batches from quiet bursts, {skipped} bursts or waits skipped")
        m = {k: np.median(np.array(v), axis=0) * 1e6 for k, v in res.items()}
        print(f"| {n} | {n * cb / 1e6:.2f} | {m['one'][0]:.0f} | {m['split'][0]:.0f} | "
              f"{m['one'][0] / m['split'][0]:.2f}x | {m['one'][1]:.0f} | {m['split'][1]:.0f} | {m['split'][2]:.0f} |",
              flush=True)
    for note in notes:
        print(note)
    before = _pool_cpu()
    time.sleep(0.5)
    print(f"idle: the pool threads used {(_pool_cpu() - before) * 1e6:.0f} us of CPU in the 0.5 s after the last batch")
    print(H.describe_load(H.load_snapshot()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
