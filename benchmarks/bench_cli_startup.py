"""Wall time of the read-only commands on a small store: ``tiered info`` and ``tiered verify``.

Run: ``python benchmarks/bench_cli_startup.py [--repeat 3] [--rows 10]``

Makes a store of ``--rows`` rows (84x84 uint8 frames, a float reward) in a temporary directory,
then runs each command ``--repeat`` times as a fresh ``python -m tiered`` process (what a user
types: interpreter start, imports, the command) and prints the median and the spread of the
wall times, and which of torch and tensordict the command's process imported (from
``-X importtime``). Most of a command's time on a small store is its imports, so the numbers
move with the machine's load and its file cache: compare runs made side by side. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = (["info"], ["verify", "-q"], ["verify", "-q", "--decode"])
HEAVY = ("torch", "tensordict")


def make_store(path: str, rows: int) -> None:
    import torch
    from tensordict import TensorDict

    from tiered import TieredStore

    with TieredStore(max(rows, 1) * 10, path) as store:
        store.extend(TensorDict({"pixels": torch.zeros(rows, 84, 84, dtype=torch.uint8),
                                 "reward": torch.arange(float(rows))}, [rows]))


def heavy_imports(argv: list[str], store: str) -> list[str]:
    err = subprocess.run([sys.executable, "-X", "importtime", "-m", "tiered", *argv, store],
                         capture_output=True, text=True, check=True).stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    return [m for m in HEAVY if m in loaded]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "s")
        make_store(store, args.rows)
        print(f"store: {args.rows} rows; {args.repeat} runs per command; python {sys.version.split()[0]}")
        for argv in COMMANDS:
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                run = subprocess.run([sys.executable, "-m", "tiered", *argv, store], capture_output=True, text=True)
                times.append(time.perf_counter() - t0)
                if run.returncode:
                    sys.exit(f"tiered {' '.join(argv)} exited {run.returncode}: {run.stderr.strip()}")
            heavy = heavy_imports(argv, store)
            print(f"tiered {' '.join(argv):24} median {statistics.median(times):6.2f} s "
                  f"(min {min(times):.2f}, max {max(times):.2f}); imports: {', '.join(heavy) or 'neither torch nor tensordict'}")


if __name__ == "__main__":
    main()
