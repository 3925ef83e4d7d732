"""The cost of ``TieredStore.extend`` on frame fields, in the calling thread's CPU time.

Run: ``python benchmarks/bench_extend_frames.py [--repeat 5]`` (on two revisions, one after the
other, to compare them: the script measures the code it imports).

Cases (real Pong frames, ``tiered.atari.cached_rollout``; a fresh store each repeat):

* ``stacks``: 4 extends of 400 rows of 4x84x84 uint8 stacks (no next observation: one frame
  field, the stacks shared row to row), the DQN recipe's collector batch;
* ``large frames``: one extend of 1,024 rows of one 210x160x3 uint8 frame a row (100 KB, every
  frame new), the shape of the raw ``pixels_int`` TorchRL's PPO Atari pipeline keeps, built from
  Pong's 84x84 frames placed in the three channels.

Medians over ``--repeat`` of the mean time per extend, printed and written to
``benchmarks/out/bench_extend_frames.md`` / ``.json``. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from tiered import TieredStore  # noqa: E402


def cases(pong: TensorDict) -> dict[str, tuple[list[TensorDict], dict]]:
    stacks = TensorDict({"observation": pong["observation"][:1600].clone(),
                         "reward": pong["next", "reward"][:1600].clone()}, [1600])
    obs = pong["observation"][:1024, 0]
    big = torch.zeros(1024, 210, 160, 3, dtype=torch.uint8)
    big[:, :84, :84, 0] = obs
    big[:, 100:184, 50:134, 1] = obs.flip(-1)
    big[:, 120:204, 70:154, 2] = obs
    large = TensorDict({"pixels_int": big, "reward": pong["next", "reward"][:1024].clone()}, [1024])
    return {"stacks: extend of 400 rows of 4x84x84": (list(stacks.split(400)), {"frames": {"observation": 0}}),
            "large frames: extend of 1,024 rows of 210x160x3": ([large], {"blob_keys": ["pixels_int"]})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    pong = H.load_atari(["Pong"], 1600, 2000)
    results = {}
    for name, (batches, options) in cases(pong).items():
        per = []
        for _ in range(args.repeat):
            store = TieredStore(20_000, **options)
            t0 = time.thread_time()
            for td in batches:
                store.extend(td)
            per.append((time.thread_time() - t0) / len(batches))
            store.close()
        results[name] = float(np.median(per)) * 1e3
    rev = subprocess.run(["git", "-C", str(H.REPO), "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip()
    text = (f"# TieredStore.extend on frame fields (thread CPU ms per extend, median of {args.repeat}); "
            f"revision {rev}\n\n{H.describe_load(H.load_snapshot())}\n\n"
            + H.markdown_table(["case", "ms per extend"], [[k, f"{v:.1f}"] for k, v in results.items()]) + "\n")
    print(text)
    H.write_output("bench_extend_frames.md", text)
    H.write_output("bench_extend_frames.json", json.dumps({"machine": H.machine_facts(argv), "revision": rev,
                                                          "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
