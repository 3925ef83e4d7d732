"""A ``TieredStorage(1_000_000)`` without a path fills past the machine's RAM by spilling to disk.

TorchRL's DQN Atari example stores float32 4x84x84 frame stacks (112,896 bytes each) in
``LazyMemmapStorage(1_000_000)``, which keeps its rows in a scratch directory under the temp dir.
Here the same buffer is a ``TensorDictReplayBuffer(storage=TieredStorage(1_000_000), batch_size=32)``
with no path: once its memory budget (``--warm-bytes``) is full, blobs spill to a private temporary
directory. The rows are float data that compresses little (``--data noise``: normal noise, about
1.1x; ``--data vecnorm``: real Pong frames normalized with drifting running statistics, as VecNorm
after CatFrames leaves them), so the bytes on disk are close to the raw bytes.

Phases, in one run:

1. **fill**: ``--rows`` rows (default: enough raw bytes to exceed this machine's RAM by 5%) in
   extends of ``--chunk`` rows; every ``--report-every`` rows, the RSS, the spilled bytes and the
   free disk are printed. Nothing may raise.
2. **sample**: ``--samples`` calls of ``rb.sample()`` (batch 32), timed, with every sampled row
   checked bit for bit against the row it must be (the data is regenerated from its seed).
3. **close**: ``storage.close()``; the spill directory must be gone.
4. **kill**: a child process fills a spilling storage (``--kill-rows`` rows) and is SIGKILLed; its
   spill directory stays. The next process that spills (a second child) removes it, and never
   the directory of a live owner.

Peak RSS of this process is reported from ``getrusage`` (run under ``/usr/bin/time -v`` for an
outside view). Everything is written under ``--spill-dir`` (default: the temp dir).

Usage:
    /usr/bin/time -v python benchmarks/bench_spill.py                  # past RAM: ~22 GB on a 24 GB box
    python benchmarks/bench_spill.py --rows 20000 --warm-bytes 256MiB  # quick check, ~2.3 GB on disk

Results: a summary on stdout and in ``benchmarks/out/bench_spill.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import psutil  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

STACK = (4, 84, 84)
ROW_BYTES = 4 * 84 * 84 * 4  # float32 observation; action, reward and done add 10 bytes


class Rows:
    """Deterministic rows: chunk ``c`` (rows ``c * chunk ...``) is regenerated from seed ``c``."""

    def __init__(self, kind: str, chunk: int) -> None:
        self.kind, self.chunk = kind, chunk
        self.frames = None
        if kind == "vecnorm":
            from tiered.atari import cached_rollout

            obs = cached_rollout("Pong", steps=2000, seed=0, max_episode_steps=500)["observation"]
            self.frames = obs.float().div_(255.0)  # ToTensorImage's float pixels, [2000, 4, 84, 84]

    def chunk_td(self, c: int) -> TensorDict:
        n, g = self.chunk, torch.Generator().manual_seed(c)
        if self.kind == "noise":
            obs = torch.randn(n, *STACK, generator=g)
        else:  # VecNorm after CatFrames: running statistics that drift from row to row
            rows = torch.arange(c * n, (c + 1) * n)
            obs = self.frames[rows % self.frames.shape[0]]
            mean = (0.3 + 0.05 * torch.sin(rows / 977.0)).view(n, 1, 1, 1)
            std = (0.2 + 0.01 * torch.cos(rows / 331.0)).view(n, 1, 1, 1)
            obs = (obs - mean) / std
        return TensorDict({"observation": obs, "action": torch.randint(0, 6, (n,), generator=g),
                           "reward": torch.randn(n, generator=g),
                           "done": torch.rand(n, generator=g) < 0.001}, batch_size=[n])


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def free_disk(path: str) -> int:
    return shutil.disk_usage(path).free


def spill_figures(storage: Any) -> dict[str, Any]:
    t = storage.stats()["tiers"]
    spill = t.get("spill", {})
    return {"warm_bytes": t.get("warm", {}).get("bytes_used", 0), "spill_bytes": spill.get("bytes_used", 0),
            "spill_blobs": spill.get("blobs", 0), "spill_dir": spill.get("dir")}


def fill_and_sample(args: argparse.Namespace, root: str) -> dict[str, Any]:
    from torchrl.data import TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    rows = Rows(args.data, args.chunk)
    storage = TieredStorage(args.capacity, warm_bytes=args.warm_bytes, spill_dir=root, hot_bytes=0,
                            promote=not args.no_promote)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=32)
    disk0 = free_disk(root)
    proc = psutil.Process()
    chunks = -(-args.rows // args.chunk)
    log, t0, extend_s = [], time.perf_counter(), 0.0
    for c in range(chunks):
        td = rows.chunk_td(c)
        t = time.perf_counter()
        rb.extend(td)
        extend_s += time.perf_counter() - t
        done = (c + 1) * args.chunk
        if done % args.report_every < args.chunk or c == chunks - 1:
            f = spill_figures(storage)
            entry = {"rows": done, "logical_gb": done * ROW_BYTES / 1e9, "rss_gb": proc.memory_info().rss / 1e9,
                     "spill_gb": f["spill_bytes"] / 1e9, "warm_gb": f["warm_bytes"] / 1e9,
                     "disk_used_gb": (disk0 - free_disk(root)) / 1e9, "elapsed_s": time.perf_counter() - t0}
            log.append(entry)
            print("  ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in entry.items()),
                  flush=True)
    fill_s = time.perf_counter() - t0
    figures = spill_figures(storage)
    spill_dir = figures["spill_dir"]
    from tiered.tiers.spill import describe

    on_disk = describe(spill_dir)["bytes"] if spill_dir else 0
    # sample: timed, every sampled row checked against its regenerated chunk
    n = len(storage)
    times, checked = [], 0
    cache: dict[int, TensorDict] = {}
    for _ in range(args.samples):
        t = time.perf_counter()
        batch, info = rb.sample(return_info=True)
        times.append(time.perf_counter() - t)
        index = torch.as_tensor(info["index"]).reshape(-1)
        if n < chunks * args.chunk:  # the ring wrapped: rows no longer map to chunks by position
            continue
        for j, i in enumerate(index[:4].tolist()):  # a few per batch: regenerating a chunk costs more
            c = i // args.chunk
            if c not in cache:
                cache.clear()
                cache[c] = rows.chunk_td(c)
            assert torch.equal(batch["observation"][j], cache[c]["observation"][i - c * args.chunk]), i
            checked += 1
    sample_stats = storage.stats()["tiers"]
    storage.close()
    gone = spill_dir is not None and not os.path.exists(spill_dir)
    return {"rows": n, "logical_bytes": n * ROW_BYTES, "fill_s": fill_s, "extend_s": extend_s,
            "rows_per_s": n / extend_s, "spill_bytes": figures["spill_bytes"], "spill_on_disk": on_disk,
            "warm_bytes": figures["warm_bytes"], "spill_dir": spill_dir, "log": log,
            "sample_ms_median": 1e3 * H.median(times), "sample_ms_p90": 1e3 * H.quantile(times, 0.9),
            "samples": len(times), "rows_checked": checked,
            "tiers_after_sampling": {k: {x: v[x] for x in ("bytes_used", "blobs", "hits", "promotions", "demotions")}
                                     for k, v in sample_stats.items()},
            "spill_dir_removed_on_close": gone, "disk_used_after_close": (disk0 - free_disk(root)),
            "peak_rss": peak_rss()}


CHILD = """
import sys, time, torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from tiered.torchrl import TieredStorage
rb = TensorDictReplayBuffer(storage=TieredStorage(int(sys.argv[2]), warm_bytes="64MiB", spill_dir=sys.argv[1]),
                            batch_size=32)
for i in range(0, int(sys.argv[2]), 500):
    rb.extend(TensorDict({"observation": torch.randn(500, 4, 84, 84)}, [500]))
rb.sample()
print(rb.storage.stats()["tiers"]["spill"]["dir"], flush=True)
time.sleep(600)
"""


def kill_phase(args: argparse.Namespace, root: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(H.REPO), os.environ.get("PYTHONPATH", "")])}

    def spawn() -> tuple[subprocess.Popen, str]:
        p = subprocess.Popen([sys.executable, "-c", CHILD, root, str(args.kill_rows)], stdout=subprocess.PIPE,
                             text=True, env=env)
        return p, p.stdout.readline().strip()

    killed, killed_dir = spawn()
    killed_bytes = H.dir_bytes(killed_dir)["allocated"]
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    left_after_kill = os.path.isdir(killed_dir)
    nxt, nxt_dir = spawn()  # the next process that spills
    try:
        removed_by_next = not os.path.exists(killed_dir)
        live_kept = os.path.isdir(nxt_dir)
    finally:
        nxt.send_signal(signal.SIGKILL)
        nxt.wait()
    from tiered.tiers.spill import remove_abandoned

    cleaned = remove_abandoned(root)  # this process cleans up after the second child
    return {"killed_dir": killed_dir, "killed_dir_bytes": killed_bytes, "left_after_sigkill": left_after_kill,
            "removed_by_next_process": removed_by_next, "next_process_dir_kept_while_it_lives": live_kept,
            "cleaned_after": cleaned}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ram = psutil.virtual_memory().total
    p.add_argument("--rows", type=int, default=None,
                   help=f"rows to write (default: 1.05x this machine's RAM in raw bytes: "
                        f"{int(1.05 * ram / ROW_BYTES):,} rows here)")
    p.add_argument("--capacity", type=int, default=1_000_000, help="the storage's max_size (default 1,000,000)")
    p.add_argument("--warm-bytes", default="1GiB", help="the memory budget (default 1GiB; 'default': 25%% of "
                   "available memory, the store's own default)")
    p.add_argument("--data", choices=("noise", "vecnorm"), default="noise")
    p.add_argument("--chunk", type=int, default=400, help="rows per extend (TorchRL's DQN: 400)")
    p.add_argument("--report-every", type=int, default=20_000)
    p.add_argument("--samples", type=int, default=50, help="timed rb.sample() calls (batch 32)")
    p.add_argument("--kill-rows", type=int, default=2_000, help="rows the SIGKILLed child spills")
    p.add_argument("--spill-dir", default=None, help="where spill directories go (default: the temp dir)")
    p.add_argument("--no-promote", action="store_true", help="promote=False: sampled spilled blobs stay on disk")
    p.add_argument("--skip-fill", action="store_true", help="only the kill phase")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = int(1.05 * ram / ROW_BYTES)
    if args.warm_bytes == "default":
        args.warm_bytes = None
    root = os.path.abspath(args.spill_dir or tempfile.gettempdir())
    need = args.rows * ROW_BYTES * 1.2
    if not args.skip_fill and free_disk(root) < need:
        print(f"{root} has {free_disk(root) / 1e9:.1f} GB free; {args.rows:,} rows need about {need / 1e9:.1f} GB. "
              "Pass --spill-dir on a larger disk or fewer --rows", file=sys.stderr)
        return 2
    load = H.load_snapshot()
    print(f"{args.rows:,} rows of float32 {'x'.join(map(str, STACK))} ({args.data}), "
          f"{args.rows * ROW_BYTES / 1e9:.1f} GB raw, RAM {ram / 1e9:.1f} GB, warm budget {args.warm_bytes}, "
          f"spill under {root}; {H.describe_load(load)}", flush=True)
    out: dict[str, Any] = {"machine": H.machine_facts(argv), "load": load, "args": vars(args), "ram": ram}
    if not args.skip_fill:
        out["fill"] = fill_and_sample(args, root)
        f = out["fill"]
        print(f"\nfilled {f['rows']:,} rows ({f['logical_bytes'] / 1e9:.1f} GB raw, {f['logical_bytes'] / ram:.2f}x RAM) "
              f"in {f['fill_s']:.0f} s ({f['rows_per_s']:,.0f} rows/s in extend); spilled "
              f"{f['spill_bytes'] / 1e9:.1f} GB ({f['spill_on_disk'] / 1e9:.1f} GB on disk), warm {f['warm_bytes'] / 1e9:.2f} GB")
        print(f"rb.sample() of 32: median {f['sample_ms_median']:.1f} ms, p90 {f['sample_ms_p90']:.1f} ms over "
              f"{f['samples']} calls; {f['rows_checked']} sampled rows checked bit for bit")
        print(f"close(): spill directory removed: {f['spill_dir_removed_on_close']}; disk used after close "
              f"{f['disk_used_after_close'] / 1e9:+.2f} GB; peak RSS {f['peak_rss'] / 1e9:.2f} GB")
    out["kill"] = k = kill_phase(args, root)
    print(f"SIGKILLed owner: its directory ({k['killed_dir_bytes'] / 1e6:.0f} MB) left after the kill: "
          f"{k['left_after_sigkill']}; removed by the next process that spilled: {k['removed_by_next_process']}; "
          f"that process's own directory kept while it lived: {k['next_process_dir_kept_while_it_lives']}")
    path = H.write_output("bench_spill.json", json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")
    ok = k["left_after_sigkill"] and k["removed_by_next_process"] and k["next_process_dir_kept_while_it_lives"]
    if "fill" in out:
        ok = ok and out["fill"]["spill_dir_removed_on_close"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
