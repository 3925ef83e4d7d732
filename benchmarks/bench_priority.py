"""Prioritized replay decides what stays hot: fifo, lru and priority residency side by side.

A PER workload on real Atari rows (``benchmarks/data/atari_frames.npz``: Pong, MsPacman,
Breakout; tiled ``--copies`` times, each copy's frames XOR-ed with its copy number so copies do
not deduplicate): one store is built on disk, then opened three times (``policy`` = fifo, lru,
priority) with a warm tier holding ``--cache`` (10%) of the compressed blobs, no hot tier, and the
cold tier on disk. Every batch:

1. rows are sampled with probability ``priority ** alpha`` (alpha 0.6, B=256), the same rows for
   the three stores;
2. for each store: the page cache of its files is dropped (``posix_fadvise(DONTNEED)`` after an
   fsync, as ``bench_tiers.py`` does: no root needed), then ``get(rows)`` is timed, and the
   ``read_bytes`` delta of ``/proc/self/io`` (block-device reads) is taken around it;
3. the sampled rows' priorities are updated, as TD errors are after a learning step: each row
   has a heavy-tailed "difficulty" (Pareto, shape 1.2) that shrinks by 10% when it is sampled, and
   its priority is the difficulty times a log-normal jitter (sigma 0.3) redrawn at every update;
   256 random rows also get a fresh difficulty (new surprises), so the high-priority set moves.
   The new priorities go to all three stores (``set_priority``), each timed, with the page
   cache dropped first and the ``read_bytes`` delta taken: the priority policy reads blobs up
   from the cold tier there when their priority changed.

Reported per policy, over the batches after the first quarter (warm-up): the memory-tier hit
rate (blobs served by the warm tier / blobs read, from ``stats()``), the compressed bytes of the
blobs ``get`` asked of the cold tier, disk bytes per batch (in ``get`` and in ``set_priority``:
block-device reads, whole pages, so a missed blob of a few hundred bytes costs a page or more), samples per second (``get`` alone, and ``get`` + ``set_priority``), and the warm tier's ``probability_mass`` at the end. The oracle: per batch,
the best set of blobs that fits the same budget for the current priorities (blobs ranked by
their sampling mass per byte: the mass of a blob is the probability that a sampled row's frame
comes from it); its hit rate on the batch's blobs, and its share of the mass. And the oracle as the
issue states it: the top 10% of the bytes ranked by blob priority (the max over the rows).

Usage:
    python benchmarks/bench_priority.py              # default run (~2-3 min on 2 loaded cores)
    python benchmarks/bench_priority.py --quick      # a short check that the script works

Results: a table on stdout and ``benchmarks/out/bench_priority.json``. Goals (printed
PASS/FAIL, never the exit status): priority hit rate >= 2x LRU's and >= 0.8x the oracle's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ensure_repo_on_path, machine_facts, markdown_table, tiled_atari_rows  # noqa: E402

ensure_repo_on_path()

FIXTURE = Path(__file__).resolve().parent / "data" / "atari_frames.npz"
OUT = Path(__file__).resolve().parent / "out"
FRAMES = {"observation": 0}
POLICIES = ("fifo", "lru", "priority")


def read_io() -> dict[str, int]:
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {"read_bytes": 0, "rchar": 0}
    return {k.strip(): int(v) for k, _, v in (line.partition(":") for line in text.splitlines())}


def drop_page_cache(path: str) -> None:
    """fsync, then ``posix_fadvise(DONTNEED)`` every file of the store (as bench_tiers does)."""
    for root, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def build(data: Any, path: str) -> int:
    """The store on disk; returns its compressed blob bytes."""
    from tiered import TieredStore

    n = data.batch_size[0]
    store = TieredStore(n, path, frames=FRAMES, hot_bytes=0, warm_bytes=0)
    for i in range(0, n, 1024):
        store.extend(data[i:i + 1024])
    store.flush()
    stats = store.stats()
    store.close()
    return sum(f["stored_bytes"] for f in stats["fields"].values() if f["kind"] == "blob")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tiered import TieredStore
    from tiered.testing import parts

    rng = np.random.default_rng(args.seed)
    data = tiled_atari_rows(args.copies, FIXTURE)
    n = data.batch_size[0]
    tmp = tempfile.mkdtemp(prefix="bench-priority-", dir=args.tmp)
    path = os.path.join(tmp, "store")
    t0 = time.perf_counter()
    compressed = build(data, path)
    del data
    build_s = time.perf_counter() - t0
    budget = int(compressed * args.cache)
    stores = {p: TieredStore.open(path, mode="r", policy=p, hot_bytes=0, warm_bytes=budget) for p in POLICIES}
    for s in stores.values():
        s.priority_alpha = args.alpha
    view = parts(stores["priority"])
    refs = np.concatenate([t.blob[:n] for t in view.layout.tables.values()], axis=1)  # [n, frames]
    nbytes = view.index.nbytes

    difficulty = rng.pareto(1.2, n) + 0.01
    priority = difficulty * rng.lognormal(0, 0.3, n)
    for s in stores.values():
        s.set_priority(np.arange(n), priority)
    per = {p: {"hits": [], "reads": [], "disk": [], "missed_bytes": [], "seconds": [], "update_disk": [],
               "update_seconds": []} for p in POLICIES}
    warm_col = 1  # the blob index's location column of the warm tier
    oracle_hits, oracle_mass, by_prio_hits, by_prio_mass = [], [], [], []
    policy_view = view.placement.policy
    warmup = args.batches // 4
    for b in range(args.batches):
        weight = priority ** args.alpha
        rows = rng.choice(n, args.batch, p=weight / weight.sum())
        if b >= warmup:  # the oracle: best blobs by mass per byte that fit the budget, for this batch
            mass = np.bincount(refs.reshape(-1), weights=np.repeat(weight / weight.sum() / refs.shape[1],
                                                                    refs.shape[1]), minlength=nbytes.size)
            blobs = np.flatnonzero(mass)
            best = blobs[np.argsort(-mass[blobs] / nbytes[blobs], kind="stable")]
            chosen = best[: int(np.searchsorted(np.cumsum(nbytes[best]), budget, side="right"))]
            in_oracle = np.zeros(nbytes.size, dtype=bool)
            in_oracle[chosen] = True
            batch_blobs = np.unique(refs[rows])
            oracle_hits.append(float(in_oracle[batch_blobs].mean()))
            oracle_mass.append(float(mass[chosen].sum() / mass.sum()))
            # the oracle: the best 10% of the bytes ranked by blob priority (max over rows)
            ranked = blobs[np.argsort(-policy_view.priorities(blobs), kind="stable")]
            top = ranked[: int(np.searchsorted(np.cumsum(nbytes[ranked]), budget, side="right"))]
            in_top = np.zeros(nbytes.size, dtype=bool)
            in_top[top] = True
            by_prio_hits.append(float(in_top[batch_blobs].mean()))
            by_prio_mass.append(float(mass[top].sum() / mass.sum()))
        for p in (POLICIES if b % 2 else POLICIES[::-1]):  # alternate the order: no store always first
            store = stores[p]
            batch_blobs = np.unique(refs[rows])
            missed = batch_blobs[parts(store).index.loc[batch_blobs, warm_col] < 0]
            drop_page_cache(path)
            before = store.stats()["tiers"]
            io0 = read_io()
            t = time.perf_counter()
            store.get(rows)
            seconds = time.perf_counter() - t
            io1 = read_io()
            after = store.stats()["tiers"]
            if b >= warmup:
                warm = after["warm"]["hits"] - before["warm"]["hits"]
                cold = after["cold"]["hits"] - before["cold"]["hits"]
                per[p]["hits"].append(warm)
                per[p]["reads"].append(warm + cold)
                per[p]["disk"].append(io1.get("read_bytes", 0) - io0.get("read_bytes", 0))
                per[p]["missed_bytes"].append(int(nbytes[missed].sum()))
                per[p]["seconds"].append(seconds)
        # TD-error-like update: sampled rows were learned from (difficulty shrinks), priorities jitter
        difficulty[rows] *= 0.9
        fresh = rng.choice(n, args.batch, replace=False)
        difficulty[fresh] = rng.pareto(1.2, fresh.size) + 0.01
        touched = np.concatenate([rows, fresh])
        priority[touched] = difficulty[touched] * rng.lognormal(0, 0.3, touched.size)
        for p in (POLICIES if b % 2 else POLICIES[::-1]):  # a policy may read blobs up here: count it
            drop_page_cache(path)
            io0 = read_io()
            t = time.perf_counter()
            stores[p].set_priority(touched, priority[touched])
            seconds = time.perf_counter() - t
            io1 = read_io()
            if b >= warmup:
                per[p]["update_disk"].append(io1.get("read_bytes", 0) - io0.get("read_bytes", 0))
                per[p]["update_seconds"].append(seconds)
    results = {}
    for p in POLICIES:
        r = per[p]
        stats = stores[p].stats()
        results[p] = {
            "hit_rate": sum(r["hits"]) / max(sum(r["reads"]), 1),
            "disk_bytes_per_batch": float(np.mean(r["disk"])),
            "cold_blob_bytes_per_batch": float(np.mean(r["missed_bytes"])),
            "update_disk_bytes_per_batch": float(np.mean(r["update_disk"])),
            "samples_per_s": args.batch * len(r["seconds"]) / sum(r["seconds"]),
            "samples_per_s_with_update": args.batch * len(r["seconds"]) / (sum(r["seconds"]) + sum(r["update_seconds"])),
            "warm_probability_mass": stats["tiers"]["warm"]["probability_mass"],
            "warm_bytes_used": stats["tiers"]["warm"]["bytes_used"],
            "promotions": stats["tiers"]["warm"]["promotions"],
            "compactions": parts(stores[p]).placement.compactions,
        }
        stores[p].close()
    return {
        "rows": n, "compressed_bytes": compressed, "warm_budget": budget, "build_s": build_s,
        "batches": args.batches, "measured_batches": args.batches - warmup, "batch": args.batch,
        "alpha": args.alpha, "policies": results,
        "oracle": {"hit_rate": float(np.mean(oracle_hits)), "mass": float(np.mean(oracle_mass))},
        "oracle_by_priority": {"hit_rate": float(np.mean(by_prio_hits)), "mass": float(np.mean(by_prio_mass))},
        "tmp": tmp,
    }


def report(res: dict[str, Any]) -> str:
    pol, oracle = res["policies"], res["oracle"]
    rows = [[p, f"{pol[p]['hit_rate']:.1%}", f"{pol[p]['cold_blob_bytes_per_batch'] / 1024:.0f} KiB",
             f"{pol[p]['disk_bytes_per_batch'] / 1024:.0f} KiB",
             f"{pol[p]['update_disk_bytes_per_batch'] / 1024:.0f} KiB",
             f"{pol[p]['samples_per_s']:.0f}", f"{pol[p]['samples_per_s_with_update']:.0f}",
             f"{pol[p]['warm_probability_mass']:.1%}", pol[p]["promotions"]]
            for p in POLICIES]
    by_prio = res["oracle_by_priority"]
    rows.append(["oracle: top 10% of bytes by blob priority", f"{by_prio['hit_rate']:.1%}", "", "", "", "", "",
                 f"{by_prio['mass']:.1%}", ""])
    rows.append(["oracle: best 10% by sampling mass per byte", f"{oracle['hit_rate']:.1%}", "", "", "", "", "",
                 f"{oracle['mass']:.1%}", ""])
    table = markdown_table(["policy", "warm hit rate", "blob bytes from cold / batch (get)",
                            "disk bytes / batch (get)", "disk bytes / batch "
                            "(set_priority)", "samples/s (get)", "samples/s (get + set_priority)",
                            "warm probability mass", "promotions"], rows)
    pr, lru = pol["priority"]["hit_rate"], pol["lru"]["hit_rate"]
    goals = [
        f"priority hit rate >= 2x LRU's: {pr:.1%} vs {lru:.1%} ({pr / max(lru, 1e-9):.2f}x) "
        f"{'PASS' if pr >= 2 * lru else 'FAIL'}",
        f"priority hit rate >= 0.8x the oracle's (top 10% by priority): {pr:.1%} vs {by_prio['hit_rate']:.1%} "
        f"({pr / max(by_prio['hit_rate'], 1e-9):.2f}x) {'PASS' if pr >= 0.8 * by_prio['hit_rate'] else 'FAIL'}",
        f"priority hit rate >= 0.8x the oracle's (best by mass per byte): {pr:.1%} vs {oracle['hit_rate']:.1%} "
        f"({pr / max(oracle['hit_rate'], 1e-9):.2f}x) {'PASS' if pr >= 0.8 * oracle['hit_rate'] else 'FAIL'}",
    ]
    head = (f"{res['rows']} rows, {res['compressed_bytes'] / 2**20:.1f} MiB of blobs, warm budget "
            f"{res['warm_budget'] / 2**20:.2f} MiB; B={res['batch']}, alpha={res['alpha']}, "
            f"{res['measured_batches']} measured batches of {res['batches']}")
    return "\n".join([head, "", table, "", *goals])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=3, help="tiles of the 6000 real rows")
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--cache", type=float, default=0.10, help="warm budget / compressed blob bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default=None, help="directory for the store (default: the system temp dir)")
    ap.add_argument("--quick", action="store_true", help="1 copy, 24 batches")
    args = ap.parse_args(argv)
    if args.quick:
        args.copies, args.batches = 1, 24
    t0 = time.perf_counter()
    res = run(args)
    res["seconds"] = time.perf_counter() - t0
    res["machine"] = machine_facts(argv)
    text = report(res)
    print(text)
    print(f"\n({res['seconds']:.0f} s, build {res['build_s']:.0f} s)")
    OUT.mkdir(parents=True, exist_ok=True)
    name = "bench_priority_quick.json" if args.quick else "bench_priority.json"
    (OUT / name).write_text(json.dumps(res, indent=2, default=str))
    import shutil
    shutil.rmtree(res["tmp"], ignore_errors=True)


if __name__ == "__main__":
    main()
