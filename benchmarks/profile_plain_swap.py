"""Where one ``rb.sample()`` of TorchRL's DQN pipeline with the storage swapped ("plain swap":
VecNorm'd float32 4x84x84 stacks, one blob per cell) spends its time, part by part.

Run: ``python benchmarks/profile_plain_swap.py --pool-cache /tmp/dqn_pool [--rows 20000]
[--samples 300] [--threads N]``. The frames are the float pool ``benchmarks/bench_torchrl_dqn.py`` collects
(``--pool-cache DIR`` reuses its ``float_<pool>`` directory; without one, ``--pool`` transitions
are collected first, which takes minutes on a small CPU). A ``TensorDictReplayBuffer`` with
``TieredStorage(rows)`` and batch size 32 is filled with them in 400-row extends, then:

1. ``--samples`` calls of ``rb.sample()``: wall time, the calling thread's CPU time
   (``time.thread_time``: less sensitive to other processes than wall time) and the process's
   CPU time (``time.process_time``: every thread; a batch of float stacks of 5 MiB or more
   decoded is checked and decoded on the store's threads, see ``tiered.codecs.checked``), medians;
2. the same number of calls under cProfile (the calling thread's CPU clock): the cumulative time
   of each step of the read path (gather, checksums, decode, assembling cells, dense columns) per
   sample, on the calling thread only (the share a pool thread does is not in it). cProfile adds
   its own cost per Python call, so the parts are for comparing runs, not for adding up to the
   time of step 1.

Output: a table, and ``benchmarks/out/profile_plain_swap.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

#: (label, defining file suffix, function name): the steps of a CPU read, as cumulative times
PARTS = [
    ("read path (all blob fields)", "engine/read.py", "read"),
    ("  gather: tiers -> compressed bytes", "engine/placement.py", "read"),
    ("  checksums of the compressed bytes", "codecs/checksum.py", "segment_checksums"),
    ("  zstd decode", "codecs/zstd.py", "decode"),
    ("  frames -> cells copy", "engine/read.py", "assemble_cells"),
    ("dense columns", "engine/rows.py", "read_dense_fields"),
    ("TieredStorage.get (all of tiered)", "torchrl/storage.py", "get"),
]


def load_pool(args: argparse.Namespace) -> list[TensorDict]:
    cache = Path(args.pool_cache) / f"float_{args.pool}" if args.pool_cache else None
    if cache is not None and cache.exists():
        return list(TensorDict.load_memmap(cache).to_tensordict().split(400))
    import bench_torchrl_dqn as B

    pool = B.collect_pool(B.load_example(), False, args.pool)
    if cache is not None:
        torch.cat(pool).memmap(cache)
    return pool


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20_000, help="rows the buffer is filled to")
    p.add_argument("--pool", type=int, default=400, help="real transitions of the float pipeline")
    p.add_argument("--pool-cache", default=None, help="bench_torchrl_dqn.py's pool directory")
    p.add_argument("--samples", type=int, default=300, help="timed rb.sample() calls")
    p.add_argument("--threads", type=int, default=None, help="tiered's decode threads (default: its choice)")
    args = p.parse_args(argv)
    from torchrl.data import TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    warnings.simplefilter("ignore")  # the plain swap's LowCompressionWarning is expected here
    pool = load_pool(args)
    storage = TieredStorage(args.rows, threads=args.threads)
    rb = TensorDictReplayBuffer(pin_memory=False, storage=storage, batch_size=32)
    filled = 0
    while filled < args.rows:
        rb.extend(pool[(filled // 400) % len(pool)])
        filled += 400
    for _ in range(20):  # buffers and arenas grown, thread pool started
        rb.sample()
    wall, cpu, proc = [], [], []
    for _ in range(args.samples):
        c, p_, t = time.thread_time(), time.process_time(), time.perf_counter()
        rb.sample()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        proc.append(time.process_time() - p_)
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(args.samples):
        rb.sample()
    prof.disable()
    stats = pstats.Stats(prof).stats
    parts: dict[str, float] = {}
    for label, suffix, name in PARTS:
        parts[label] = sum(v[3] for (fn, _, fname), v in stats.items()
                           if fname == name and fn.replace("\\", "/").endswith(suffix)) / args.samples * 1e3
    s = storage.stats()["fields"]["pixels"]
    data: dict[str, Any] = {
        "facts": H.machine_facts(argv), "rows": len(rb),
        "sample_wall_ms_median": sorted(wall)[len(wall) // 2] * 1e3,
        "sample_thread_cpu_ms_median": sorted(cpu)[len(cpu) // 2] * 1e3,
        "sample_process_cpu_ms_median": sorted(proc)[len(proc) // 2] * 1e3,
        "parts_ms_under_cprofile": parts, "pixels_ratio": s["ratio"],
    }
    print(f"{len(rb):,} rows of VecNorm'd float32 stacks (pixels stored at {s['ratio']:.1f}x); "
          f"rb.sample() of 32: {data['sample_wall_ms_median']:.2f} ms wall, "
          f"{data['sample_thread_cpu_ms_median']:.2f} ms thread CPU, {data['sample_process_cpu_ms_median']:.2f} ms "
          f"process CPU (medians of {args.samples})")
    print(H.markdown_table(["part (cumulative, cProfile, thread CPU)", "ms per sample"],
                           [[label, f"{ms:.2f}"] for label, ms in parts.items()]))
    out = H.write_output("profile_plain_swap.json", json.dumps(data, indent=1, default=str))
    print(f"wrote {out.relative_to(H.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
