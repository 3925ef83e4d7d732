"""Choosing the default ``chunk_frames`` (K): bytes and sample rate at K in {2, 4, 8, 16}.

On real Atari transitions (``tiered.atari`` rollouts of several games, 4x84x84 uint8 stacks with
next stacks, TorchRL's layout), for each K one store is filled with no options
(``TieredStore(N, chunk_frames=K)``: the frame stacks are detected) and one with the explicit
``frames={"observation": 0}``; then every store answers the same random indices at B=32 and B=256,
round by round in a fresh shuffled order, next to TorchRL's ``LazyTensorStorage`` (the anchor
of the rate ratios).

Measured per store: bytes held per transition (blob bytes in the tiers plus the store's own
memory: index, row tables, dense columns, open chunks; as ``TieredStore.stats()`` reports them;
the open chunks, at most K-1 raw frames per trajectory, weigh more in a short run than at 1M),
compressed bytes per unique frame, fill rate (extend in chunks of 256), and ``get`` rate at B=32
and B=256 (median over rounds; first round is a warm-up whose output is checked against the
source rows).

Usage:
    python benchmarks/bench_chunk_frames.py                 # 10k transitions, 30 rounds (~2 min)
    python benchmarks/bench_chunk_frames.py --steps 2000 --rounds 5   # quick check

Results: a table on stdout and in ``benchmarks/out/bench_chunk_frames.md`` (raw numbers in
``benchmarks/out/bench_chunk_frames.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import torch  # noqa: E402

KS = (2, 4, 8, 16)
BATCHES = (32, 256)
CHUNK = 256
ROLLOUT = 8000  # steps per game played and cached (the cache files benchmarks share)


def held_bytes(store: Any) -> tuple[int, int, int]:
    """(blob bytes in the tiers, store memory outside the tiers, compressed bytes per unique frame)."""
    st = store.stats()
    tiers = sum(int(t.get("bytes_used") or 0) for t in st["tiers"].values())
    mem = sum(int(v) for v in st["memory"].values())
    blob = [f for f in st["fields"].values() if f["kind"] == "blob"]
    per_frame = blob[0]["stored_bytes"] / max(blob[0]["unique_frames"], 1) if blob else float("nan")
    return tiers, mem, per_frame


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000, help="transitions (default 10000)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per batch size (default 30)")
    p.add_argument("--games", nargs="+", default=H.DEFAULT_GAMES)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from torchrl.data import LazyTensorStorage

    import tiered

    n = args.steps
    data = H.load_atari(args.games, n, max(ROLLOUT, -(-n // len(args.games))))
    n = data.batch_size[0]
    row_bytes = H.row_bytes(data)
    load = H.load_snapshot()
    print(f"data: {n:,} transitions of {', '.join(args.games)}, {row_bytes:,} B each; {H.describe_load(load)}")

    stores: dict[str, Any] = {}
    for k in KS:
        stores[f"auto K={k}"] = tiered.TieredStore(n, chunk_frames=k)
        stores[f"frames= K={k}"] = tiered.TieredStore(n, chunk_frames=k, frames={"observation": 0})
    lts = LazyTensorStorage(n)
    fill: dict[str, list[float]] = {name: [] for name in [*stores, "LazyTensorStorage"]}
    for r, s in enumerate(range(0, n, CHUNK)):
        chunk = data[s:s + CHUNK]
        for name in random.Random(r).sample(list(fill), len(fill)):
            t0 = time.perf_counter()
            if name == "LazyTensorStorage":
                lts.set(torch.arange(s, s + chunk.batch_size[0]), chunk)
            else:
                stores[name].extend(chunk)
            fill[name].append(time.perf_counter() - t0)
    detected = {name: st.options["frames"] for name, st in stores.items()}

    def get(name: str, idx: torch.Tensor) -> Any:
        return lts.get(idx) if name == "LazyTensorStorage" else stores[name].get(idx)

    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCHES} for name in fill}
    checks: dict[str, str] = {}
    meter = H.CpuMeter()
    for b in BATCHES:
        for r in range(args.rounds + 1):
            idx = torch.randint(0, n, (b,), generator=torch.Generator().manual_seed(1000 * b + r))
            for name in random.Random(r).sample(list(fill), len(fill)):
                t0 = time.perf_counter()
                out = get(name, idx)
                dt = time.perf_counter() - t0
                if r == 0:
                    ok = all(torch.equal(out.get(key), data.get(key)[idx])
                             for key in ("observation", ("next", "observation"), "action"))
                    checks[name] = checks.get(name, "ok") if ok else "MISMATCH"
                else:
                    times[name][b].append(dt)
    cpu = meter.stop()

    def rate(name: str, b: int) -> float:
        return b / H.median(times[name][b])

    rows, raw = [], {}
    for name in fill:
        if name == "LazyTensorStorage":
            tiers, mem, per_frame = n * row_bytes, 0, float("nan")
        else:
            tiers, mem, per_frame = held_bytes(stores[name])
        per_tr = (tiers + mem) / n
        r32, r256 = rate(name, 32), rate(name, 256)
        fill_rate = n / sum(fill[name])
        raw[name] = {"held_bytes_per_transition": per_tr, "tier_bytes": tiers, "store_memory": mem,
                     "bytes_per_unique_frame": per_frame, "get32_per_s": r32, "get256_per_s": r256,
                     "fill_per_s": fill_rate, "check": checks.get(name), "frames": str(detected.get(name))}
        rows.append([name, f"{per_tr:,.0f}", f"{tiers / n:,.0f}", H.fmt_ratio(n * row_bytes / (tiers + mem)),
                     "-" if per_frame != per_frame else f"{per_frame:,.0f}",
                     H.fmt_rate(fill_rate), H.fmt_rate(r32), H.fmt_ratio(r32 / rate("LazyTensorStorage", 32)),
                     H.fmt_rate(r256), H.fmt_ratio(r256 / rate("LazyTensorStorage", 256)), checks.get(name)])
    table = H.markdown_table(
        ["store", "B/transition held", "of which blobs", "LTS bytes / held", "B/unique frame", "fill /s", "get B=32 /s",
         "vs LTS", "get B=256 /s", "vs LTS", "content"], rows)
    facts = H.machine_facts(sys.argv)
    text = "\n".join([
        f"# bench_chunk_frames.py ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
        f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}`".rstrip(), "",
        f"Data: {n:,} real Atari transitions ({', '.join(args.games)}), {row_bytes:,} B each.",
        f"Machine: {facts.get('cpu_model', '?')}; torch threads {torch.get_num_threads()}; before: "
        f"{H.describe_load(load)}; during sampling other processes used {cpu['other_cores']:.2f} cores.",
        f"Detected frames (no options): {detected[f'auto K={KS[0]}']}.", "",
        f"Rates: transitions/s, median of {args.rounds} rounds per batch size, each round in a fresh "
        "order; `get` through each storage's own API.", "", table, ""])
    print(text)
    path = H.write_output("bench_chunk_frames.md", text)
    H.write_output("bench_chunk_frames.json", json.dumps({"args": vars(args), "n": n, "row_bytes": row_bytes,
                                                           "load": load, "cpu": cpu, "stores": raw}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
