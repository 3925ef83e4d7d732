"""Readers against a committing writer, for minutes: every row read is its reader's commit's, or
the read says to reopen; never another commit's row, a raw exception or a signal.

One process writes a store (a blob field and dense fields, every row's cells a function of the
row's write number ``seq``), committing every few hundred rows, overwriting rows as the ring
wraps (so blob space is freed and reused, free lists and exception lists grow and shrink).
Alongside it run, started again as they finish:

- **forked readers**: children ``fork``ed from the writer (no ``share()``), which read the
  writer's store object as it was at the fork (``--forked`` at a time);
- **stale readers**: children that open the store read-only and read on while the writer
  commits, reopening when told to (``StaleReadError``) (``--stale`` at a time).

Each reader takes a snapshot of its rows' ``seq`` when it starts (at the fork, or at each open)
and checks every row it reads: its ``seq`` must be the snapshot's and its cells the function of
it, bit for bit. Counted: rows checked, wrong rows, raw exceptions (any exception but
``StaleReadError``), signals (a reader killed by one), and ``StaleReadError``s. The exit status
is 1 if a wrong row, raw exception or signal was seen.

Run: ``nice python benchmarks/readers_long.py --minutes 10`` (``--minutes 2`` for a short run;
``--capacity``, ``--forked``, ``--stale``, ``--warm-bytes`` and ``--verify off`` vary it). Timings on a shared
machine vary; the counts are what it reports.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tiered  # noqa: E402
from tiered.errors import StaleReadError  # noqa: E402

OBS = (4, 24, 24)  # a blob cell (2,304 bytes)
FORK = mp.get_context("fork")


def rows_of(seq: np.ndarray) -> TensorDict:
    """The rows whose write numbers are ``seq``: every cell a function of its row's ``seq``."""
    seq = np.asarray(seq, dtype=np.int64)
    n = seq.shape[0]
    cells = np.arange(int(np.prod(OBS)), dtype=np.int64)
    obs = ((seq[:, None] * 2654435761 + cells[None, :] * (seq[:, None] % 17 + 1)) >> 5) % 251
    return TensorDict({
        "seq": torch.from_numpy(seq.copy()),
        "reward": torch.from_numpy(seq.astype(np.float64) * 0.25),
        "action": torch.from_numpy((seq % 7).astype(np.int64)),
        "done": torch.from_numpy(seq % 13 == 0),
        "observation": torch.from_numpy(obs.astype(np.uint8).reshape(n, *OBS)),
    }, [n])


def check(got: TensorDict, snapshot: np.ndarray, rows: np.ndarray) -> int:
    """Rows of ``got`` (read at ``rows``) that are not the reader's: a ``seq`` other than the
    snapshot's, or a cell that is not the function of its ``seq``."""
    seq = got["seq"].numpy()
    want = rows_of(seq)
    bad = seq != snapshot[rows]
    for key in ("reward", "action", "done", "observation"):  # a few fields
        a, b = got[key], want[key]
        bad |= ~(a == b).reshape(a.shape[0], -1).all(dim=1).numpy()
    return int(bad.sum())


def read_loop(store: tiered.TieredStore, snapshot: np.ndarray, until: float, counts: dict, rng: random.Random,
              batch: int) -> bool:
    """Read random rows and slices of ``store`` until ``until`` or a StaleReadError (returns True
    then), counting into ``counts``."""
    n = snapshot.shape[0]
    while time.monotonic() < until:
        if rng.random() < 0.5:
            rows = np.array(rng.sample(range(n), min(batch, n)), dtype=np.int64)
            index = torch.from_numpy(rows)
        else:
            lo = rng.randrange(n)
            rows = np.arange(lo, min(n, lo + batch), dtype=np.int64)
            index = slice(int(rows[0]), int(rows[-1]) + 1)
        try:
            got = store.get(index)
        except StaleReadError:
            counts["stale"] += 1
            return True
        counts["rows"] += rows.size
        counts["wrong"] += check(got, snapshot, rows)
    return False


def forked_reader(store: tiered.TieredStore, snapshot: np.ndarray, seconds: float, out, seed: int,
                  batch: int) -> None:
    torch.set_num_threads(1)  # forked: PyTorch's OpenMP threads do not survive a fork
    counts = {"rows": 0, "wrong": 0, "raw": 0, "stale": 0, "reopens": 0}
    try:
        read_loop(store, snapshot, time.monotonic() + seconds, counts, random.Random(seed), batch)
    except Exception as e:  # noqa: BLE001 - counted, and printed once
        counts["raw"] += 1
        counts["error"] = f"{type(e).__name__}: {e}"[:300]
    out.put(("forked", counts))


def stale_reader(path: str, seconds: float, out, seed: int, batch: int, verify: bool) -> None:
    torch.set_num_threads(1)
    counts = {"rows": 0, "wrong": 0, "raw": 0, "stale": 0, "reopens": 0}
    until = time.monotonic() + seconds
    rng = random.Random(seed)
    try:
        while time.monotonic() < until:
            store = tiered.open(path, verify=verify, warm_bytes=0, hot_bytes=0)
            try:
                snapshot = store.get(slice(0, len(store)), keys=["seq"])["seq"].numpy()
            except StaleReadError:  # the writer went on while this read: open again
                counts["stale"] += 1
                store.close()
                continue
            stale = read_loop(store, snapshot, until, counts, rng, batch)
            store.close()
            counts["reopens"] += stale
    except Exception as e:  # noqa: BLE001 - counted, and printed once
        counts["raw"] += 1
        counts["error"] = f"{type(e).__name__}: {e}"[:300]
    out.put(("stale", counts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--commit-rows", type=int, nargs=2, default=(200, 600), help="rows per commit: min max")
    ap.add_argument("--forked", type=int, default=2, help="forked readers at a time")
    ap.add_argument("--stale", type=int, default=1, help="read-only readers at a time")
    ap.add_argument("--reader-seconds", type=float, default=20.0, help="how long each reader reads")
    ap.add_argument("--batch", type=int, default=256, help="rows per read")
    ap.add_argument("--verify", choices=["on", "off"], default="on", help="blob checksums on reads")
    ap.add_argument("--warm-bytes", default="0",
                    help="the writer's warm tier (default 0: reads go to the cold files, where space is reused)")
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temp directory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    verify = args.verify == "on"
    rng = random.Random(args.seed)
    path = os.path.join(args.dir or tempfile.mkdtemp(prefix="readers-long-"), "store")
    store = tiered.TieredStore(args.capacity, path, verify=verify, stage_rows=0, warm_bytes=args.warm_bytes, hot_bytes=0)
    seq = 0
    while seq < args.capacity:  # full before the readers start
        n = min(args.capacity - seq, 2000)
        store.extend(rows_of(np.arange(seq, seq + n)))
        seq += n
    store.flush()
    out = FORK.Queue()
    live: list[tuple[str, mp.Process]] = []
    totals = {kind: {"readers": 0, "rows": 0, "wrong": 0, "raw": 0, "stale": 0, "reopens": 0, "signals": 0}
              for kind in ("forked", "stale")}
    errors: list[str] = []
    commits = 0
    start = time.monotonic()
    end = start + args.minutes * 60

    def collect(block: bool) -> None:
        while True:
            try:
                kind, counts = out.get(timeout=5 if block else 0.01)
            except queue.Empty:
                return
            for k, v in counts.items():
                if k == "error":
                    errors.append(f"{kind}: {v}")
                else:
                    totals[kind][k] += v
            block = False

    while time.monotonic() < end:
        for kind, p in list(live):  # a few readers
            if not p.is_alive():
                p.join()
                live.remove((kind, p))
                if p.exitcode and p.exitcode < 0:
                    totals[kind]["signals"] += 1
                    errors.append(f"{kind}: killed by signal {-p.exitcode}")
        seconds = min(args.reader_seconds, max(1.0, end - time.monotonic()))
        for _ in range(args.forked - sum(k == "forked" for k, _ in live)):
            snapshot = store.get(slice(0, len(store)), keys=["seq"])["seq"].numpy()
            p = FORK.Process(target=forked_reader, args=(store, snapshot, seconds, out, rng.getrandbits(32), args.batch))
            p.start()
            live.append(("forked", p))
            totals["forked"]["readers"] += 1
        for _ in range(args.stale - sum(k == "stale" for k, _ in live)):
            p = FORK.Process(target=stale_reader, args=(path, seconds, out, rng.getrandbits(32), args.batch, verify))
            p.start()
            live.append(("stale", p))
            totals["stale"]["readers"] += 1
        n = rng.randint(*args.commit_rows)
        if rng.random() < 0.3:  # some commits overwrite scattered rows instead of the next ones
            where = torch.tensor(rng.sample(range(args.capacity), n))
            store.set(where, rows_of(np.arange(seq, seq + n)))
        else:
            store.extend(rows_of(np.arange(seq, seq + n)))
        seq += n
        store.flush()
        commits += 1
        collect(block=False)
    for kind, p in live:
        p.join(timeout=args.reader_seconds + 120)
        if p.exitcode is None:
            p.kill()
            errors.append(f"{kind}: did not finish")
        elif p.exitcode < 0:
            totals[kind]["signals"] += 1
            errors.append(f"{kind}: killed by signal {-p.exitcode}")
    collect(block=True)
    store.close()
    bad = sum(t["wrong"] + t["raw"] + t["signals"] for t in totals.values())
    print(json.dumps({"minutes": round((time.monotonic() - start) / 60, 2), "capacity": args.capacity,
                      "commits": commits, "rows_written": seq, "verify": verify, "readers": totals,
                      "errors": errors[:10], "ok": bad == 0 and not errors}, indent=1))
    return 0 if bad == 0 and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
