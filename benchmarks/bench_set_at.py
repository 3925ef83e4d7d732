"""``rb.set_at_`` of one field on rows already written (an advantage written back, a relabeled
flag): TieredStorage against LazyTensorStorage, on real Pong stacks with next observations.

Run: ``python benchmarks/bench_set_at.py [--rows 1024] [--repeat 21]``

Cases, each ``rb.set_at_(key, values, index)`` over every row of a ``TensorDictReplayBuffer``
of ``--rows`` rows (``TieredStorage(rows)`` with no options, ``LazyTensorStorage(rows)``):

* ``advantage`` (float32, one value a row): a dense field with a column of its own, written in
  its column alone (``TieredStore.set_columns``): the frames are not decoded or compressed again;
* ``next/terminated`` (bool): a flag bit (the flags share one byte a row), which TieredStorage
  still writes as whole rows: every frame field of those rows is decoded and compressed again.

Medians of ``--repeat`` calls (wall time), printed as a table and written to
``benchmarks/out/bench_set_at.md`` and ``.json``. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import torch  # noqa: E402

CASES = {"advantage (float32 column)": ("advantage", lambda n: torch.randn(n)),
         "next/terminated (bool flag)": (("next", "terminated"), lambda n: torch.rand(n, 1) < 0.01)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=21)
    args = p.parse_args(argv)
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    warnings.simplefilter("ignore")  # TorchRL's deprecation notices
    data = H.load_atari(["Pong"], args.rows, args.rows)[: args.rows].clone()
    data["advantage"] = torch.zeros(args.rows)
    buffers = {"TieredStorage": TensorDictReplayBuffer(storage=TieredStorage(args.rows)),
               "LazyTensorStorage": TensorDictReplayBuffer(storage=LazyTensorStorage(args.rows))}
    for rb in buffers.values():
        rb.extend(data)
    index = torch.arange(args.rows)
    results: dict[str, dict[str, float]] = {}
    for case, (key, make) in CASES.items():
        times: dict[str, list[float]] = {name: [] for name in buffers}
        for _ in range(args.repeat):
            values = make(args.rows)
            for name, rb in buffers.items():  # alternating: the machine's drift falls on both
                t0 = time.perf_counter()
                rb.set_at_(key, values, index)
                times[name].append(time.perf_counter() - t0)
        results[case] = {name: H.median(ts) * 1e3 for name, ts in times.items()}
    rows = [[case, f"{r['TieredStorage']:.2f}", f"{r['LazyTensorStorage']:.2f}",
             f"{r['TieredStorage'] / r['LazyTensorStorage']:.0f}x"] for case, r in results.items()]
    text = (f"# rb.set_at_ on {args.rows:,} rows of Pong stacks (medians of {args.repeat}, ms)\n\n"
            f"Command: `python benchmarks/bench_set_at.py --rows {args.rows} --repeat {args.repeat}`; "
            f"{H.describe_load(H.load_snapshot())}\n\n"
            + H.markdown_table(["field written", "TieredStorage ms", "LazyTensorStorage ms", "ratio"], rows) + "\n")
    print(text)
    H.write_output("bench_set_at.md", text)
    H.write_output("bench_set_at.json", json.dumps({"machine": H.machine_facts(argv), "rows": args.rows,
                                                   "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
