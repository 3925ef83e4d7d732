"""Float frame stacks as TorchRL's DQN Atari pipeline stores them, tiered against LazyMemmapStorage.

TorchRL's DQN example normalizes pixels with ``VecNorm`` *after* ``CatFrames``: the buffer gets
float32 ``[4, 84, 84]`` stacks whose frames differ in value from one stack to the next (no two
stacks share a frame; ``("next", "pixels")[t]`` still equals ``pixels[t + 1]``), plus the dense
columns TorchRL's collector writes (int64 ``step_count``, ``traj_ids``, ``lives``, float32
``action_value``, bool flags). This script makes such data without the environment: real ALE
frames (``tiered.atari.cached_rollout``), scaled to [0, 1], normalized per pixel with running
statistics updated every step (VecNorm's exponential moving mean and variance), and runs
TorchRL's DQN buffer loop shape on it: ``rb.extend`` of 400 rows, then ``rb.sample()`` of 32,
for ``TensorDictReplayBuffer(LazyMemmapStorage(N))`` and ``TensorDictReplayBuffer(TieredStorage(N))``
side by side in one run (same rows, interleaved rounds).

Printed per storage: bytes per transition (LazyMemmapStorage: its files; tiered: blob bytes plus
dense columns and row tables, from ``stats()``), extend time per 400 rows and sample time per
batch of 32 (medians), and the ratios the issue sets (sample >= 0.8x LazyMemmapStorage's rate,
extend >= 1.0x, bytes <= 1.0x); dense bytes per row (integer + bool columns, all dense columns).

Usage:
    python benchmarks/bench_float_stacks.py                   # 2000 rows, 200 samples
    python benchmarks/bench_float_stacks.py --quick           # 600 rows, checks that it runs
    python benchmarks/bench_float_stacks.py --profile         # + cProfile of tiered's batch-32 get
    python benchmarks/bench_float_stacks.py --threads 1       # torch.set_num_threads(1)
    python benchmarks/bench_float_stacks.py --levels          # zstd levels on 400 such stacks
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict


def float_stacks(steps: int, game: str = "Pong", seed: int = 0, decay: float = 0.9999) -> TensorDict:
    """TorchRL's DQN buffer rows for ``steps`` transitions of real ALE frames (see the docstring)."""
    from tiered.atari import cached_rollout

    td = cached_rollout(game, steps=steps, seed=seed)
    obs = td["observation"].numpy()
    nxt = td["next", "observation"].numpy()
    eps = 1e-4
    mean = np.zeros(obs.shape[1:], np.float64)
    sq = np.zeros(obs.shape[1:], np.float64)
    weight = 0.0
    pixels = np.empty(obs.shape, np.float32)
    next_pixels = np.empty(obs.shape, np.float32)
    traj = td["collector", "traj_ids"].numpy()
    # VecNorm normalizes each step's observation with the statistics of the steps before it and
    # then folds it in: the same frame gets other values in each later stack (data generation
    # only: a loop over steps is fine here)
    for t in range(obs.shape[0]):
        if t == 0 or traj[t] != traj[t - 1]:
            x = obs[t] / 255.0
            std = np.sqrt(np.maximum(sq / max(weight, 1e-12) - (mean / max(weight, 1e-12)) ** 2, 0) + eps)
            pixels[t] = ((x - mean / max(weight, 1e-12)) / std) if weight else x
        else:
            pixels[t] = next_pixels[t - 1]
        x = nxt[t] / 255.0
        mean = decay * mean + x
        sq = decay * sq + x * x
        weight = decay * weight + 1.0
        m = mean / weight
        std = np.sqrt(np.maximum(sq / weight - m * m, 0) + eps)
        next_pixels[t] = (x - m) / std
    n = obs.shape[0]
    rng = np.random.default_rng(seed)
    done = td["next", "done"]
    step = np.zeros(n, np.int64)
    for t in range(1, n):  # data generation only
        step[t] = 0 if traj[t] != traj[t - 1] else step[t - 1] + 1
    reward = torch.sign(td["next", "reward"])
    out = TensorDict({
        "pixels": torch.from_numpy(pixels),
        "action": td["action"],
        "action_value": torch.from_numpy(rng.normal(size=(n, 6)).astype(np.float32) * 0.1),
        "chosen_action_value": torch.from_numpy(rng.normal(size=(n, 1)).astype(np.float32) * 0.1),
        "step_count": torch.from_numpy(step).reshape(n, 1),
        "lives": torch.full((n, 1), 0, dtype=torch.int64),
        "done": td["done"], "terminated": td["terminated"], "truncated": td["truncated"],
        "collector": {"traj_ids": td["collector", "traj_ids"]},
        "next": {
            "pixels": torch.from_numpy(next_pixels),
            "reward": reward,
            "episode_reward": torch.cumsum(reward.reshape(-1), 0).reshape(n, 1),
            "step_count": torch.from_numpy(step + 1).reshape(n, 1),
            "lives": torch.full((n, 1), 0, dtype=torch.int64),
            "end-of-life": done.clone(),
            "done": done, "terminated": td["next", "terminated"], "truncated": td["next", "truncated"],
        },
    }, [n])
    return out


def tiered_bytes(store) -> dict[str, float]:
    """Bytes the tiered store holds per row: blob fields, dense columns (at the current length's
    share of the capacity-sized columns: rows * per-row bytes), row tables."""
    s = store.stats()
    n = max(s["rows"], 1)
    blobs = sum(f["stored_bytes"] for f in s["fields"].values() if f["kind"] == "blob")
    dense_row = sum(f["stored_bytes"] for f in s["fields"].values() if f["kind"] == "dense") / s["capacity"]
    schema = store.schema
    int_bool = 0.0
    flags = len(schema.flag_fields)
    for f in schema.dense_fields:
        if f.flag_bit is not None:
            int_bool += 1 / flags
        elif not f.dtype.is_floating_point:
            int_bool += f.column_nbytes
    tables = s["memory"]["row_tables"] / s["capacity"]
    return {"blob": blobs / n, "dense": dense_row, "int_bool": int_bool, "tables": tables,
            "total": blobs / n + dense_row + tables}


def lmm_bytes(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> None:
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    if args.threads:
        torch.set_num_threads(args.threads)
    data = float_stacks(args.steps)
    n = data.batch_size[0]
    print(f"data: {n} transitions, pixels float32 {list(data['pixels'].shape[1:])}, "
          f"next == following row: {bool((data['next', 'pixels'][:-1] == data['pixels'][1:]).all(-1).all(-1).all(-1).float().mean() > 0.9)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_float_"))
    rbs = {
        "LazyMemmapStorage": TensorDictReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=tmp / "lmm"),
                                                    batch_size=32),
        "TieredStorage": TensorDictReplayBuffer(storage=TieredStorage(n), batch_size=32),
    }
    ext = {k: [] for k in rbs}
    smp = {k: [] for k in rbs}
    chunk = 400
    torch.manual_seed(0)
    for start in range(0, n, chunk):  # the DQN loop: 400 new rows, then updates of batch 32
        part = data[start:start + chunk]
        for name, rb in rbs.items():
            t0 = time.perf_counter()
            rb.extend(part)
            ext[name].append(time.perf_counter() - t0)
        for name, rb in rbs.items():
            for _ in range(args.samples // max(1, n // chunk)):
                t0 = time.perf_counter()
                rb.sample()
                smp[name].append(time.perf_counter() - t0)
    store = rbs["TieredStorage"].storage.store
    tb = tiered_bytes(store)
    lb = lmm_bytes(tmp / "lmm") / n
    med = {k: statistics.median(v) * 1e3 for k, v in ext.items()}
    meds = {k: statistics.median(v) * 1e3 for k, v in smp.items()}
    print("\n| storage | bytes/transition | extend 400 (ms, median) | sample 32 (ms, median) |")
    print("| --- | --- | --- | --- |")
    print(f"| LazyMemmapStorage | {lb:,.0f} | {med['LazyMemmapStorage']:.1f} | {meds['LazyMemmapStorage']:.2f} |")
    print(f"| TieredStorage | {tb['total']:,.0f} | {med['TieredStorage']:.1f} | {meds['TieredStorage']:.2f} |")
    print(f"\ntiered per row: blobs {tb['blob']:,.0f} B, dense columns {tb['dense']:.1f} B "
          f"(integer and bool {tb['int_bool']:.1f} B), row tables {tb['tables']:.1f} B")
    for f, s in store.stats()["fields"].items():
        if s["kind"] == "dense":
            print(f"  dense {f}: {store.schema[f.split('/')].describe()} stored as "
                  f"{s.get('stored_dtype', 'flag bit' if 'flag_bit' in s else 'given dtype')}")
        else:
            print(f"  blob {f}: ratio {s['ratio']:.2f}, compression {s['compression_factor']:.2f}")
    print(f"\nsample rate vs LazyMemmapStorage: {meds['LazyMemmapStorage'] / meds['TieredStorage']:.2f}x (target >= 0.8)")
    print(f"extend rate vs LazyMemmapStorage: {med['LazyMemmapStorage'] / med['TieredStorage']:.2f}x (target >= 1.0)")
    print(f"bytes vs LazyMemmapStorage: {tb['total'] / lb:.3f}x (target <= 1.0)")
    print(f"background load: {os.getloadavg()}  (noisy machine: rerun on a quiet one)")
    if args.profile:
        rows = torch.randint(0, n, (32,))
        store.get(rows)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            store.get(torch.randint(0, n, (32,)))
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        print("\ncProfile of 50 x store.get(32 random rows), by own time:\n" + text.getvalue())


def levels(args: argparse.Namespace) -> None:
    """zstd levels on 400 stacks of this data, one per blob (what the store encodes per extend):
    ratio, and the fastest of 5 interleaved rounds of encode and decode."""
    from tiered.codecs import get_codec

    data = float_stacks(max(args.steps, 600))
    x = data["next", "pixels"][-400:].numpy().reshape(400, -1).view(np.uint8)
    flat, fnb = np.ascontiguousarray(x).reshape(-1), x.shape[1]
    offsets, sizes = np.arange(400, dtype=np.int64) * fnb, np.full(400, fnb, np.int64)
    out = np.empty_like(flat)
    res: dict[str, list[float]] = {}
    for _ in range(5):
        for spec in ("zstd:3", "zstd:1", "zstd:-1", "zstd:-3", "lz4"):
            codec = get_codec(spec)
            t0 = time.perf_counter()
            enc = codec.encode(flat, offsets, sizes)
            t1 = time.perf_counter()
            codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
            t2 = time.perf_counter()
            r = res.setdefault(spec, [flat.size / int(enc.sizes.sum()), 1e9, 1e9])
            r[1], r[2] = min(r[1], t1 - t0), min(r[2], t2 - t1)
    print("| codec | ratio | encode 400 stacks (ms) | decode (ms) |\n| --- | --- | --- | --- |")
    for spec, (ratio, e, d) in res.items():
        print(f"| {spec} | {ratio:.2f} | {e * 1e3:.0f} | {d * 1e3:.0f} |")
    print(f"background load: {os.getloadavg()}  (noisy machine: rerun on a quiet one)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--levels", action="store_true")
    args = p.parse_args()
    if args.levels:
        levels(args)
        return
    if args.quick:
        args.steps, args.samples = 600, 30
    run(args)


if __name__ == "__main__":
    main()
