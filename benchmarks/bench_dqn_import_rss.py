"""Peak resident memory of importing a dqn-replay source of large frames (memory bound check).

Run: ``python benchmarks/bench_dqn_import_rss.py [--side 4096] [--slots 20]``

Builds a Dopamine replay checkpoint (``tiered.formats.dopamine``: six gzipped ``np.save`` files)
of ``--slots`` all-zero frames of ``--side`` x ``--side`` pixels (4096 x 4096 x 20 slots: 320 MiB
of frames in a source of about 0.33 MB), then imports it with ``tiered import --format
dqn-replay`` in a fresh process run under ``/usr/bin/time -v`` and prints that process's peak
resident set ("Maximum resident set size"), next to the peak of a process that only imports
``tiered`` (the floor every import pays). Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiered.formats.dopamine import buffer_checkpoint, save_checkpoint  # noqa: E402


def build_source(root: str, side: int, slots: int) -> int:
    """A one-checkpoint dqn-replay run of ``slots`` zero frames; returns the source's bytes."""
    logs = os.path.join(root, "Big", "1", "replay_logs")
    stream = {"observation": np.zeros((slots, side, side), np.uint8), "action": np.zeros(slots, np.int32),
              "reward": np.zeros(slots, np.float32), "terminal": np.zeros(slots, np.uint8)}
    save_checkpoint(logs, 0, buffer_checkpoint(stream, slots, slots))
    return sum(os.path.getsize(os.path.join(logs, f)) for f in os.listdir(logs))


def peak_rss(argv: list[str]) -> tuple[int, int]:
    """(exit status, peak RSS in KiB) of ``argv`` run under ``/usr/bin/time -v``."""
    p = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True, cwd=ROOT)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
    return p.returncode, int(m.group(1)) if m else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        nbytes = build_source(src, args.side, args.slots)
        floor_rc, floor = peak_rss([sys.executable, "-c", "import tiered, tiered.formats, tiered.cli"])
        cmd = [sys.executable, "-m", "tiered", "import", src, os.path.join(tmp, "s.tiered"), "--format", "dqn-replay"]
        rc, peak = peak_rss(cmd)
    frame = args.side * args.side
    print(f"source: {args.slots} slots of {args.side}x{args.side} zero frames, {nbytes / 1e6:.2f} MB on disk, "
          f"{args.slots * frame / 2**20:.0f} MiB of frames")
    print("| process | exit | peak RSS (MiB) |\n| --- | --- | --- |")
    print(f"| import tiered only (floor) | {floor_rc} | {floor / 1024:.0f} |")
    print(f"| tiered import --format dqn-replay | {rc} | {peak / 1024:.0f} |")


if __name__ == "__main__":
    main()
