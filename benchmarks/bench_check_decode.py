"""Checking and decoding one-blob cells on one thread or split over two, by batch size: where
:data:`tiered.codecs.checked.MIN_SPLIT_BYTES` should be.

Run: ``python benchmarks/bench_check_decode.py --pool-cache /tmp/dqn_pool [--rows 6000]
[--rounds 9] [--reps 40]``. The cells are real VecNorm'd float32 ``[4, 84, 84]`` stacks of
TorchRL's DQN Atari pipeline (the float pool ``benchmarks/bench_torchrl_dqn.py`` collects;
``--pool-cache DIR`` reuses its ``float_<pool>`` directory), stored in a ``TieredStore`` (one blob
per stack, 113 kB decoded). For each batch size (rows; each row reads ``pixels`` and
``("next", "pixels")``), ``store.get`` of random rows runs ``--reps`` times with the split forced
on, then forced off, alternating over ``--rounds`` rounds (so background load hits both alike);
per mode it reports the medians of wall time, of the calling thread's CPU time and of the
process's CPU time (both threads). The split pays where its wall time is lower on an idle machine;
on a loaded one, the process CPU column says what the handoff costs (split minus single).

A second table gives the floor on this machine: zstd's own decode of one batch of 32 rows
(64 stacks, 7.2 MB) on one thread and split over two (``ZstdCodec.decode`` with the batch path's
threshold lowered), the checksums of its compressed bytes, and a memcpy of 7.2 MB into a fresh
buffer (what an uncompressed storage's gather costs at least).

Output: the tables, and ``benchmarks/out/bench_check_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

BATCHES = [2, 4, 8, 16, 32, 64, 128]


def load_pool(args: argparse.Namespace) -> TensorDict:
    cache = Path(args.pool_cache) / f"float_{args.pool}" if args.pool_cache else None
    if cache is not None and cache.exists():
        return TensorDict.load_memmap(cache).to_tensordict()
    import bench_torchrl_dqn as B

    pool = torch.cat(B.collect_pool(B.load_example(), False, args.pool))
    if cache is not None:
        pool.memmap(cache)
    return pool


def timed(fn: Any, reps: int) -> tuple[list[float], list[float], list[float]]:
    wall, thread, proc = [], [], []
    for _ in range(reps):
        c, p, t = time.thread_time(), time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t)
        thread.append(time.thread_time() - c)
        proc.append(time.process_time() - p)
    return wall, thread, proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=6_000, help="rows stored")
    p.add_argument("--pool", type=int, default=400, help="real transitions of the float pipeline")
    p.add_argument("--pool-cache", default=None, help="bench_torchrl_dqn.py's pool directory")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds per batch size")
    p.add_argument("--reps", type=int, default=40, help="gets per mode and round")
    args = p.parse_args(argv)
    from tiered import TieredStore
    from tiered.codecs import ZstdCodec, checked, segment_checksums
    from tiered.codecs import zstd as zstd_module
    from tiered.testing import parts

    warnings.simplefilter("ignore")  # the float stacks' LowCompressionWarning is expected here
    pool = load_pool(args).select("pixels", ("next", "pixels"))
    store = TieredStore(args.rows, threads=2)
    filled = 0
    while filled < args.rows:
        store.extend(pool[: min(pool.shape[0], args.rows - filled)])
        filled += pool.shape[0]
    rng = np.random.default_rng(0)
    keep = checked.MIN_SPLIT_BYTES
    rows_out: list[list[Any]] = []
    data: dict[str, Any] = {"facts": H.machine_facts(argv), "load_before": H.describe_load(H.load_snapshot()),
                            "batches": {}}
    try:
        for b in BATCHES:
            res: dict[str, list[list[float]]] = {"split": [[], [], []], "single": [[], [], []]}
            for _ in range(3):
                store.get(rng.integers(0, args.rows, b))  # warm buffers and threads
            for _ in range(args.rounds):
                for mode, threshold in (("split", 0), ("single", 1 << 62)):
                    checked.MIN_SPLIT_BYTES = threshold
                    got = timed(lambda: store.get(rng.integers(0, args.rows, b)), args.reps)  # noqa: B023
                    for acc, xs in zip(res[mode], got, strict=True):
                        acc.extend(xs)
            med = {m: [H.median(x) * 1e3 for x in v] for m, v in res.items()}
            data["batches"][b] = med
            mb = 2 * b * 4 * 84 * 84 * 4 / 1e6
            rows_out.append([b, f"{mb:.1f}", *(f"{x:.3f}" for x in med["single"]), *(f"{x:.3f}" for x in med["split"])])
    finally:
        checked.MIN_SPLIT_BYTES = keep
    print(f"store.get of float32 [4, 84, 84] stacks (pixels and next pixels), medians of "
          f"{args.rounds} x {args.reps} per mode; load before: {data['load_before']}")
    print(H.markdown_table(["rows", "MB decoded", "1 thread: wall ms", "thread CPU", "process CPU",
                            "split in 2: wall ms", "thread CPU", "process CPU"], rows_out))

    # the floor: zstd alone, the checksums, a memcpy of the decoded bytes
    p_ = parts(store)
    rows = rng.integers(0, args.rows, 32)
    from tiered.engine.read import blob_frames

    layout = p_.layout
    fields = layout.schema.select(None)
    (fid, fs), = layout.by_family(fields).items()
    fam = layout.families[fid]
    uniq, frame_idx = blob_frames(layout, fam, fs, rows)
    g = p_.cpu_reader.gather_blobs(layout, fam, uniq, copy=True)
    which = frame_idx.T.reshape(-1)
    nb = fam.frame_nbytes
    out = np.empty(which.size * nb, np.uint8)
    out_off = np.arange(which.size, dtype=np.int64) * nb
    out_sizes = np.full(which.size, nb, dtype=np.int64)
    floor: dict[str, float] = {}
    keep_z = zstd_module._MIN_BYTES_FOR_THREADS
    try:
        for label, threads in (("zstd decode, 1 thread", 1), ("zstd decode, split over 2", 2)):
            codec = ZstdCodec(3, threads=threads)
            zstd_module._MIN_BYTES_FOR_THREADS = 0
            wall, _, proc = timed(lambda: codec.decode(g.comp, g.offsets[which], g.sizes[which], out,  # noqa: B023
                                                       out_off, out_sizes), args.reps * 5)
            floor[label + ": wall"] = H.median(wall) * 1e3
            floor[label + ": process CPU"] = H.median(proc) * 1e3
    finally:
        zstd_module._MIN_BYTES_FOR_THREADS = keep_z
    _, thread, _ = timed(lambda: segment_checksums(g.comp, g.offsets, g.sizes), args.reps * 5)
    floor["checksums of the compressed bytes (1 thread)"] = H.median(thread) * 1e3
    src = np.ones(which.size * nb, np.uint8)
    _, thread, _ = timed(lambda: torch.empty(src.size, dtype=torch.uint8).numpy().__setitem__(slice(None), src),
                         args.reps * 5)
    floor["memcpy of the decoded bytes into a fresh buffer (1 thread)"] = H.median(thread) * 1e3
    data["floor_ms"] = floor
    data["floor_batch"] = {"compressed_bytes": int(g.comp.size), "decoded_bytes": int(which.size * nb)}
    print(f"\none batch of 32 rows: {g.comp.size:,} compressed bytes, {which.size * nb:,} decoded")
    print(H.markdown_table(["part", "ms"], [[k, f"{v:.3f}"] for k, v in floor.items()]))
    out_path = H.write_output("bench_check_decode.json", json.dumps(data, indent=1, default=str))
    print(f"wrote {out_path.relative_to(H.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
