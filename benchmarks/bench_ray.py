"""tiered.ray: bytes per batch across the actor boundary and samples/s with 1, 2 and 4 shards.

Data: real Atari rows (``benchmarks/data/atari_frames.npz``: Pong, MsPacman, Breakout, 4x84x84
uint8 stacks plus the next stacks), tiled ``--copies`` times (each copy's frames XOR-ed with its
copy number so copies do not deduplicate). A local Ray cluster with ``--cpus`` CPUs (loopback,
no dashboard) runs the shard actors.

1. **Bytes per batch**: B=256 rows drawn uniformly; each shard's reply to a sample call is
   pickled (protocol 5, what Ray's serializer moves for numpy arrays and tensors, out-of-band
   buffers included) in the three transports: ``decoded`` (a TensorDict), ``compressed`` (the
   stored blobs the rows touch, :class:`~tiered.engine.transport.CompressedRows`) and
   ``repacked`` (only the frames the rows use, compressed again by the shard). Summed over
   shards, averaged over batches; the compressed blob bytes are given apart from the rest
   (row -> frame tables, checksums, dense columns, pickle framing).
2. **Samples/s**: ``ShardedStore.sample(256)`` (uniform and prioritized, every transport) timed
   over ``--batches`` batches after a warm-up, with 1, 2 and 4 shards. Anchors in the driver's
   process, no Ray: one :class:`~tiered.TieredStore` (``get`` of 256 random rows) and TorchRL's
   ``LazyTensorStorage`` (``ReplayBuffer.sample``) holding the same rows.

Usage:
    python benchmarks/bench_ray.py            # default (~3-6 min on 2 loaded cores)
    python benchmarks/bench_ray.py --quick    # a short check that the script works
    python benchmarks/bench_ray.py --codec zstd:9 --chunk-frames 8   # smaller blobs per batch

What limits scaling on a small machine: every shard is a process, and the driver is one more.
Per batch a shard gathers its rows (decoded transport: decodes them; repacked: decodes them and
encodes the frames used again) and serializes the reply; the driver sends one call per shard,
waits, and decodes compressed replies into the batch. With 2 cores, more shards only add
processes, calls and copies competing for the same cores, so 1 shard is fastest; shards pay off
when each has its own cores (or node).

Results: a table on stdout and ``benchmarks/out/bench_ray.json`` / ``bench_ray.md`` (with a
``_<codec>_k<chunk frames>`` suffix for other settings). Goal
(printed PASS/FAIL, never the exit status): a compressed transport moves >= 50x fewer bytes.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    describe_load,
    ensure_repo_on_path,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    load_snapshot,
    machine_facts,
    markdown_table,
    median,
    tiled_atari_rows,
    write_output,
)

ensure_repo_on_path()

from tiered.engine.write import DEFAULT_CHUNK_FRAMES  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "atari_frames.npz"
FRAMES = {"observation": 0}
B = 256


TRANSPORTS = ("decoded", "compressed", "repacked")


def reply_bytes(store: Any, rng: np.random.Generator, transport: str) -> tuple[int, int]:
    """Pickled bytes of every shard's reply to one uniform B=256 sample call, and the compressed
    blob bytes among them (0 for decoded transport)."""
    import ray

    sizes = np.array(store.shard_rows())
    shard = np.searchsorted(np.cumsum(sizes), rng.integers(0, sizes.sum(), B), side="right")
    total = blobs = 0
    for s in np.unique(shard).tolist():
        rows = rng.integers(0, sizes[s], int((shard == s).sum()))
        reply = ray.get(store.actors[s].sample.remote(None, rows, None, transport))
        total += len(pickle.dumps(reply, protocol=5))
        blobs += getattr(reply[2], "blob_nbytes", 0)
    return total, blobs


def mean_bytes(store: Any, rng: np.random.Generator, transport: str, batches: int) -> tuple[float, float]:
    sizes = np.array([reply_bytes(store, rng, transport) for _ in range(batches)], dtype=np.float64)
    return float(sizes[:, 0].mean()), float(sizes[:, 1].mean())


def rate(fn: Any, batches: int, repeats: int = 3) -> float:
    """Samples/s of ``fn`` (one B=256 batch per call): the median of ``repeats`` timings."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batches):
            fn()
        times.append(time.perf_counter() - t0)
    return B * batches / median(times)


def anchors(data: Any, batches: int) -> dict[str, float]:
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from tiered import TieredStore

    n = data.batch_size[0]
    store = TieredStore(n, frames=FRAMES, hot_bytes=0)
    for i in range(0, n, 1024):
        store.extend(data[i:i + 1024])
    rng = np.random.default_rng(0)
    rb = ReplayBuffer(storage=LazyTensorStorage(n), batch_size=B)
    rb.extend(data)
    return {"TieredStore (local)": rate(lambda: store.get(rng.integers(0, n, B)), batches),
            "LazyTensorStorage (local)": rate(rb.sample, batches)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from tiered.ray import ShardedStore

    data = tiled_atari_rows(args.copies, FIXTURE)
    n = data.batch_size[0]
    ray.init(num_cpus=args.cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    results: dict[str, Any] = {"rows": n, "codec": args.codec, "chunk_frames": args.chunk_frames, "shards": {}}
    try:
        for k in args.shards:
            store = ShardedStore(k, -(-n // k) + 1024, seed=0, actor_options={"num_cpus": 0}, frames=FRAMES,
                                 hot_bytes=0, threads=args.threads, codec=args.codec, chunk_frames=args.chunk_frames)
            for i in range(0, n, 2048):
                store.extend(data[i:i + 2048])
            rng = np.random.default_rng(1)
            entry: dict[str, Any] = {"shard_rows": store.shard_rows()}
            for transport in TRANSPORTS:
                entry[f"bytes_{transport}"], entry[f"blob_bytes_{transport}"] = mean_bytes(
                    store, rng, transport, args.byte_batches)
                for prioritized in (False, True):
                    name = f"{'per' if prioritized else 'uniform'}_{transport}"
                    entry[name] = rate(lambda p=prioritized, t=transport, s=store: s.sample(B, prioritized=p, transport=t),
                                       args.batches)
            store.flush()  # closes the open time chunks: what a buffer between collector writes looks like
            for transport in ("compressed", "repacked"):
                entry[f"bytes_{transport}_flushed"] = mean_bytes(store, rng, transport, args.byte_batches)[0]
            results["shards"][k] = entry
            print(f"{k} shard(s): {json.dumps(entry)}", flush=True)
            store.close()
    finally:
        ray.shutdown()
    results["anchors"] = anchors(data, args.batches)
    return results


def report(res: dict[str, Any], facts: dict[str, Any], load: str) -> str:
    one = res["shards"][min(res["shards"])]
    rows, speed = [], []
    for k, e in res["shards"].items():
        dec = e["bytes_decoded"]
        rows.append([k, fmt_bytes(dec)] + [
            f"{fmt_bytes(e[f'bytes_{t}'])} ({fmt_bytes(e[f'blob_bytes_{t}'])} blobs)" for t in ("compressed", "repacked")]
            + [fmt_ratio(dec / e[f"bytes_{t}"]) for t in ("compressed", "repacked")]
            + [fmt_ratio(dec / e[f"bytes_{t}_flushed"]) for t in ("compressed", "repacked")])
        speed.append([k] + [f"{fmt_rate(e[c])} ({fmt_ratio(e[c] / one[c])})" for c in
                            [f"{m}_{t}" for m in ("uniform", "per") for t in TRANSPORTS]])
    table = markdown_table(["shards", "bytes/batch decoded", "compressed (of which blobs)", "repacked (of which blobs)",
                            "less, compressed", "less, repacked", "less, compressed (flushed)",
                            "less, repacked (flushed)"], rows)
    rates = markdown_table(["shards"] + [f"{m} {t} /s" for m in ("uniform", "PER") for t in TRANSPORTS], speed)
    anchor = markdown_table(["anchor (same rows, in-process, no Ray)", "samples/s", "1 shard repacked uniform vs it"],
                            [[name, fmt_rate(v), fmt_ratio(one["uniform_repacked"] / v)]
                             for name, v in res["anchors"].items()])
    goal = []
    for t in ("compressed", "repacked"):
        ratio = min(e["bytes_decoded"] / e[f"bytes_{t}"] for e in res["shards"].values())
        goal.append(f"goal: {t} transport >= 50x fewer bytes than decoded: {'PASS' if ratio >= 50 else 'FAIL'} "
                    f"({ratio:.1f}x)")
    return (f"{facts['date']}: `{facts['command']}`; {res['rows']} rows; {facts['cpu_model']}, "
            f"{facts['logical_cores']} cores; load before: {load}\n\n"
            f"B={B}; codec {res['codec']}, chunk_frames {res['chunk_frames']}; bytes: pickled shard replies "
            "summed over shards (open time chunks compressed for the trip; 'flushed': after closing them).\n\n"
            f"{table}\n\nsamples/s (in brackets: ratio to 1 shard)\n\n{rates}\n\n{anchor}\n\n"
            + "\n".join(goal) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--byte-batches", type=int, default=5)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="codec threads of each shard's store")
    parser.add_argument("--codec", default="zstd", help="the shards' codec (zstd:9 compresses more)")
    parser.add_argument("--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES,
                        help="frames per blob in the shards (default: the store's)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.copies, args.batches, args.byte_batches, args.shards = 1, 2, 1, [1, 2]
    facts = machine_facts()
    load = describe_load(load_snapshot())
    res = run(args)
    text = report(res, facts, load)
    print(text)
    tag = "" if (args.codec, args.chunk_frames) == ("zstd", DEFAULT_CHUNK_FRAMES) else f"_{args.codec.replace(':', '')}_k{args.chunk_frames}"
    write_output(f"bench_ray{tag}.json", json.dumps({"facts": facts, "load": load, **res}, indent=1, default=str))
    write_output(f"bench_ray{tag}.md", text)


if __name__ == "__main__":
    main()
