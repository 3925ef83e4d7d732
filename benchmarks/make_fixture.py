"""Build ``benchmarks/data/atari_frames.npz``: real Atari transitions for machines without ale-py.

The GPU checks and benchmarks run on machines where ale-py may not be installed, yet they must
measure compression on real screens. This script plays each game once with a seeded random
policy (see :func:`tiered.atari.rollout_frames`) and stores the rollouts in compact form (each
screen once, grayscale 84x84 plus, by default, the raw 210x160 RGB screens), compressed with
``np.savez_compressed``. :func:`tiered.atari.load_fixture` rebuilds 4x84x84 stacks and next
stacks from it with numpy, torch and tensordict only.

The tracked file is replaced only on request (``--update-fixture``): by default the new fixture
goes to ``benchmarks/out/atari_frames.npz``, to compare with the tracked one before replacing it.

Usage:
    python benchmarks/make_fixture.py                      # Pong, MsPacman, Breakout; 2000 steps each
    python benchmarks/make_fixture.py --update-fixture     # ... and replace benchmarks/data/atari_frames.npz
    python benchmarks/make_fixture.py --steps 1000 --no-raw --out /tmp/fx.npz

Example (reading it back):
    >>> from tiered.atari import load_fixture
    >>> td = load_fixture("benchmarks/data/atari_frames.npz")  # doctest: +SKIP
    >>> td["observation"].shape  # doctest: +SKIP
    torch.Size([6000, 4, 84, 84])
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the package.
sys.path.insert(0, str(REPO))

from tiered.atari import AtariFrames, load_fixture, rollout_frames, save_fixture  # noqa: E402

TRACKED = REPO / "benchmarks" / "data" / "atari_frames.npz"
DEFAULT_OUT = REPO / "benchmarks" / "out" / "atari_frames.npz"
# One seed per game so the games do not share a policy's action sequence.
DEFAULT_GAMES = {"Pong": 0, "MsPacman": 1, "Breakout": 2}
# A budget, not a target: the fixture travels with the repository and to the GPU machine.
MAX_BYTES = 15 * 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"npz file to write (default {DEFAULT_OUT.relative_to(REPO)})")
    parser.add_argument("--update-fixture", action="store_true",
                        help=f"replace the tracked fixture {TRACKED.relative_to(REPO)} (tests and GPU checks read it)")
    parser.add_argument("--games", nargs="+", default=list(DEFAULT_GAMES), help="ALE game names")
    parser.add_argument("--steps", type=int, default=2000, help="transitions per game")
    parser.add_argument("--size", type=int, default=84, help="side of the grayscale frames")
    parser.add_argument("--no-raw", action="store_true", help="leave out the raw 210x160 RGB screens")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = TRACKED if args.update_fixture else DEFAULT_OUT
    if args.out.resolve() == TRACKED and TRACKED.exists() and not args.update_fixture:
        print(f"refusing to overwrite the tracked fixture {TRACKED}; pass --update-fixture to replace it",
              file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)

    rollouts: dict[str, AtariFrames] = {}
    for i, game in enumerate(args.games):
        seed = DEFAULT_GAMES.get(game, i)
        start = time.perf_counter()
        try:
            frames = rollout_frames(game, args.steps, seed, size=args.size, raw=not args.no_raw)
        except ImportError:
            raise
        except Exception as e:  # noqa: BLE001 - a ROM missing from this ale-py build: skip the game
            print(f"skipping {game}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        rollouts[game] = frames
        print(
            f"{game:10s} seed={seed} transitions={len(frames)} screens={frames.frames.shape[0]} "
            f"episodes={int(frames.traj_ids.max()) + 1} terminated={int(frames.terminated.sum())} "
            f"truncated={int(frames.truncated.sum())} in {time.perf_counter() - start:.1f}s"
        )
    if not rollouts:
        print("no game could be played", file=sys.stderr)
        return 1

    save_fixture(args.out, rollouts)
    size = args.out.stat().st_size
    start = time.perf_counter()
    td = load_fixture(args.out)
    print(
        f"wrote {args.out} ({size / 2**20:.2f} MiB); load_fixture -> batch {tuple(td.batch_size)} "
        f"in {time.perf_counter() - start:.2f}s"
    )
    if size > MAX_BYTES:
        print(
            f"warning: {size} bytes is over the {MAX_BYTES}-byte budget; use --steps or --no-raw",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
