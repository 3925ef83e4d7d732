"""Timing of the byte-copy engine (:mod:`tiered.util.copy`, :mod:`tiered.util.hostcopy`) on the batches tiers and codecs copy.

Run: ``python benchmarks/bench_copy.py [--blobs 256 4096] [--repeat 300]``

Each case is a batch of blobs of 150-700 bytes (compressed Atari chunks are ~320 B median)
unless it says otherwise, laid out as its caller lays it out:

* ``arena read``: sampled blobs at aligned offsets of a CPU-tensor arena four times larger,
  into a packed numpy buffer (``ArenaTier.read``, via :func:`copy_blobs`);
* ``arena write``: a packed numpy batch into consecutive aligned slots of the arena
  (``ArenaTier.write``);
* ``codec pack`` / ``codec unpack``: scattered cells into a packed buffer and back
  (``RawCodec.encode``/``decode``, via :func:`copy_host_blobs`);
* ``packed``, ``strided``, ``small (20-100 B)``, ``large (2-20 KB)``, ``mixed (20 B-20 KB)``:
  one case per path and per size class of the ``"runs"`` path;
* ``tensor words``: the CUDA path (:func:`copy_tensor_blobs`) on CPU tensors, for reference.

It prints the path each case takes and the CPU time of the calling thread for the fastest decile
of ``--repeat`` calls (on a shared machine, wall time mostly measures the neighbours), and writes
the same numbers to ``benchmarks/out/bench_copy.json``. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._harness import machine_facts, write_output  # noqa: E402
from tiered.util.copy import copy_blobs, copy_tensor_blobs  # noqa: E402
from tiered.util.hostcopy import copy_host_blobs, host_copy_path  # noqa: E402
from tiered.util.units import align  # noqa: E402


def fastest_decile_us(fn: Callable[[], None], repeat: int) -> float:
    # CPU time of this thread: time spent descheduled by other processes does not count
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t0)
    times.sort()
    return times[len(times) // 10] / 1e3


def packed_offsets(sizes: np.ndarray) -> np.ndarray:
    return np.cumsum(sizes) - sizes


def cases(n: int, rng: np.random.Generator) -> dict[str, tuple]:
    """name -> (src, src_offsets, dst, dst_offsets, sizes, function)."""
    out = {}
    sizes = rng.integers(150, 700, n).astype(np.int64)
    arena_sizes = rng.integers(150, 700, 4 * n).astype(np.int64)
    slots = packed_offsets(align(arena_sizes))
    arena = torch.from_numpy(rng.integers(0, 256, int(align(arena_sizes).sum()), dtype=np.uint8))
    pick = rng.choice(4 * n, n, replace=False)
    read_sizes = arena_sizes[pick]
    out["arena read"] = (arena, slots[pick], np.zeros(int(read_sizes.sum()), np.uint8),
                         packed_offsets(read_sizes), read_sizes, copy_blobs)
    data = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    out["arena write"] = (data, packed_offsets(sizes), torch.zeros(int(align(sizes).sum()), dtype=torch.uint8),
                          packed_offsets(align(sizes)), sizes, copy_blobs)
    perm = rng.permutation(n)
    scattered = packed_offsets(sizes[perm])[np.argsort(perm)]
    out["codec pack"] = (data, scattered, np.zeros(data.size, np.uint8), packed_offsets(sizes), sizes,
                         copy_host_blobs)
    out["codec unpack"] = (data, packed_offsets(sizes), np.zeros(data.size, np.uint8), scattered, sizes,
                           copy_host_blobs)
    out["packed"] = (data, packed_offsets(sizes), np.zeros(data.size, np.uint8), packed_offsets(sizes), sizes,
                     copy_host_blobs)
    equal = np.full(n, 512, np.int64)
    out["strided"] = (np.zeros(n * 528, np.uint8), np.arange(n) * 528, np.zeros(n * 512, np.uint8),
                      np.arange(n) * 512, equal, copy_host_blobs)
    for name, lo, hi in (("small (20-100 B)", 20, 100), ("large (2-20 KB)", 2000, 20000),
                         ("mixed (20 B-20 KB)", 20, 20000)):
        s = rng.integers(lo, hi, n).astype(np.int64)
        p = rng.permutation(n)
        buf = rng.integers(0, 256, int(s.sum()), dtype=np.uint8)
        out[name] = (buf, packed_offsets(s[p])[np.argsort(p)], np.zeros(buf.size, np.uint8), packed_offsets(s), s,
                     copy_host_blobs)
    out["tensor words"] = (arena, slots[pick], torch.zeros(int(align(read_sizes).sum()), dtype=torch.uint8),
                           packed_offsets(align(read_sizes)), read_sizes, copy_tensor_blobs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blobs", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--repeat", type=int, default=300)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'case':18s} {'blobs':>6s} {'path':>8s} {'us':>10s}")
    rows = []
    for n in args.blobs:
        for name, (src, so, dst, do, sizes, fn) in cases(n, rng).items():
            so, do, sizes = so.astype(np.int64), do.astype(np.int64), sizes.astype(np.int64)
            path = "tensor" if fn is copy_tensor_blobs else host_copy_path(so, do, sizes)
            us = fastest_decile_us(lambda: fn(src, so, dst, do, sizes), args.repeat)  # noqa: B023
            print(f"{name:18s} {n:6d} {path:>8s} {us:10.1f}", flush=True)
            rows.append({"case": name, "blobs": n, "path": path, "fastest_decile_us": us})
    out = write_output("bench_copy.json", json.dumps({"facts": machine_facts(), "repeat": args.repeat,
                                                       "results": rows}, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
