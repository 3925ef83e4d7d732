"""Single-thread cost of the zstd decode paths on real Atari chunks: batch vs straight-into-output,
and what decoding only a chunk's first frames (a prefix) would save.

Run: ``python benchmarks/bench_zstd_decode_paths.py [--reps 5] [--rounds 3] [--chunks 400]``

Data: the committed real Atari rows (``benchmarks/data/atari_frames.npz``: Pong, MsPacman,
Breakout), the newest 84x84 frame of each row, cut into chunks of K consecutive frames and
compressed as the store writes them (``ZstdCodec``'s compressor: one zstd frame per chunk, level 3,
content size in the header). Costs are ``time.thread_time`` of the calling thread (what a busy
machine disturbs least), in microseconds per chunk, the best of ``--rounds`` rounds of ``--reps``
passes over ``--chunks`` chunks.

1. **paths**, for K = 1, 2, 4, 8, 16: ``multi_decompress_to_buffer`` plus one copy per chunk into
   the output (``batch``, what ``ZstdCodec.decode`` does for small frames) against one
   ``ZstdDecompressionReader.readinto`` per chunk straight into the output (``direct``); the
   codec's ``_MIN_FRAME_BYTES_FOR_DIRECT`` is set from this.
2. **prefix**, K=8: ``readinto`` of only the first ``j + 1`` frames of each chunk (j = 0..7), for
   the store's chunks (``one block``: libzstd writes a 56 KB chunk as a single block) and for the
   same chunks written with one block per frame (``compressobj`` flushed with
   ``COMPRESSOBJ_FLUSH_BLOCK`` after each frame; not what the store writes), with the compressed
   bytes of each. A decoder can stop only at a block boundary, so a prefix of a one-block chunk
   decodes the whole chunk (and goes through libzstd's streaming buffer: one more copy).
3. **expected**: the mean prefix cost per touched chunk for uniform B=32 samples of 4-frame stacks
   (frames ``r-3..r`` of each sampled row; trajectory ends ignored), from the last slot each
   touched chunk needs, against decoding whole chunks.

Not part of CI; prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tiered

FIXTURE = Path(__file__).resolve().parent / "data" / "atari_frames.npz"


def _frames() -> np.ndarray:
    from tiered.atari import load_fixture

    obs = load_fixture(FIXTURE)["observation"].numpy()
    return np.ascontiguousarray(obs[:, -1].reshape(obs.shape[0], -1))


def _best(fn, rounds: int) -> float:
    return min(fn() for _ in range(rounds))


def _batch(dctx, data, offs, sizes, omv, cb: int, reps: int) -> float:
    from tiered.codecs.zstd import _segments

    dsizes = np.full(sizes.size, cb, np.uint64).tobytes()
    t0 = time.thread_time()
    for _ in range(reps):
        seg = zstandard.BufferWithSegments(data, _segments(offs, sizes))
        res = dctx.multi_decompress_to_buffer(seg, decompressed_sizes=dsizes, threads=1)
        for i, s in enumerate(res):
            omv[i * cb:(i + 1) * cb] = s
    return (time.thread_time() - t0) / reps / sizes.size * 1e6


def _direct(dctx, comp: list[bytes], omv, cb: int, reps: int) -> float:
    t0 = time.thread_time()
    for _ in range(reps):
        for i, c in enumerate(comp):
            dctx.stream_reader(c).readinto(omv[i * cb:(i + 1) * cb])
    return (time.thread_time() - t0) / reps / len(comp) * 1e6


def _paths(frames: np.ndarray, cctx, dctx, ks, n_chunks: int, reps: int, rounds: int) -> None:
    fnb = frames.shape[1]
    print("| K | chunk bytes | batch + copy us/chunk | direct us/chunk | direct / batch |")
    print("| --- | --- | --- | --- | --- |")
    for k in ks:
        cb = k * fnb
        chunks = frames[: frames.shape[0] // k * k].reshape(-1, cb)[:n_chunks]
        comp = [cctx.compress(c.tobytes()) for c in chunks]
        data = np.frombuffer(b"".join(comp), np.uint8)
        sizes = np.array([len(c) for c in comp], np.int64)
        offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(len(comp) * cb, np.uint8)
        omv = memoryview(out)

        tb = _best(partial(_batch, dctx, data, offs, sizes, omv, cb, reps), rounds)
        td = _best(partial(_direct, dctx, comp, omv, cb, reps), rounds)
        assert out[:cb].tobytes() == chunks[0].tobytes()
        print(f"| {k} | {cb} | {tb:.1f} | {td:.1f} | {td / tb:.2f} |")


def _one_block_per_frame(cctx, chunk: bytes, k: int, fnb: int) -> bytes:
    o = cctx.compressobj(size=len(chunk))
    parts = []
    for j in range(k):
        parts.append(o.compress(chunk[j * fnb:(j + 1) * fnb]))
        parts.append(o.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    parts.append(o.flush())
    return b"".join(parts)


def _prefix(frames: np.ndarray, cctx, dctx, n_chunks: int, reps: int, rounds: int, batch: int) -> None:
    k, fnb = 8, frames.shape[1]
    chunks = frames[: frames.shape[0] // k * k].reshape(-1, k * fnb)[:n_chunks]
    layouts = {
        "one block (store)": [cctx.compress(c.tobytes()) for c in chunks],
        "one block per frame": [_one_block_per_frame(cctx, c.tobytes(), k, fnb) for c in chunks],
    }
    out = bytearray(k * fnb)
    mv = memoryview(out)
    # which last slot each touched chunk needs, for uniform B=batch samples of 4-frame stacks
    rng = np.random.default_rng(0)
    n = chunks.shape[0] * k
    last = []
    for _ in range(200):
        rows = rng.integers(3, n, batch)
        f = (rows[:, None] - np.arange(4)[None, :]).reshape(-1)
        blob, slot = f // k, f % k
        key = np.unique(blob * k + slot)
        ub, first = np.unique(key // k, return_index=True)
        ends = np.append(first[1:], key.size) - 1
        last.append(key[ends] % k)
    last = np.concatenate(last)
    share = np.bincount(last, minlength=k) / last.size
    shares = " ".join(f"{s:.2f}" for s in share)
    print(f"\nlast needed slot of a touched chunk, uniform B={batch} stacks of 4: {shares} (mean {last.mean():.2f})")
    print("\n| layout | compressed bytes | " + " | ".join(f"j={j}" for j in range(k))
          + " | expected prefix / whole |")
    print("| --- | --- | " + " | ".join("---" for _ in range(k)) + " | --- |")
    for name, comp in layouts.items():
        assert all(dctx.decompress(c) == x.tobytes() for c, x in zip(comp[:20], chunks[:20], strict=True))

        def pref(j: int, comp=comp) -> float:
            want = (j + 1) * fnb
            t0 = time.thread_time()
            for _ in range(reps):
                for c in comp:
                    if dctx.stream_reader(c).readinto(mv[:want]) != want:
                        raise AssertionError("short prefix")
            return (time.thread_time() - t0) / reps / len(comp) * 1e6

        costs = np.array([_best(lambda j=j: pref(j), rounds) for j in range(k)])
        expected = float((share * costs).sum())
        print(f"| {name} | {sum(map(len, comp))} | " + " | ".join(f"{c:.1f}" for c in costs)
              + f" | {expected / costs[-1]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    from tiered.codecs.zstd import ZstdCodec

    frames = _frames()
    cctx = ZstdCodec(threads=1)._cctx()
    dctx = zstandard.ZstdDecompressor()
    print(f"zstandard {zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}), "
          f"{frames.shape[0]} frames of {frames.shape[1]} bytes; us per chunk, thread CPU, best of {args.rounds}\n")
    _paths(frames, cctx, dctx, (1, 2, 4, 8, 16), args.chunks, args.reps, args.rounds)
    _prefix(frames, cctx, dctx, args.chunks, args.reps, args.rounds, args.batch)


if __name__ == "__main__":
    main()
