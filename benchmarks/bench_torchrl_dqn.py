"""TorchRL's own DQN Atari pipeline, four replay storages side by side, in the DQN loop's shape.

Run: ``python benchmarks/bench_torchrl_dqn.py [--rows 100000] [--pool 1600] [--rounds 5]
[--threads N] [--storages lmm,plain,recipe,lts] [--write-docs]``; ``--rows 5000 --rounds 2 --updates 5``
is a quick run (minutes).

What it does:

1. **Real frames through TorchRL's own transforms.** ``GymEnv("ALE/Pong-v5", from_pixels=True)``
   with the transforms of TorchRL's ``sota-implementations/dqn/utils_atari.make_env`` and its
   Nature-CNN Q-network and epsilon-greedy policy (eps 1.0: the start of training), collected by
   a TorchRL ``Collector`` in batches of 400 transitions (``frames_per_batch`` 1600 at frame
   skip 4) -- twice: as shipped (float32 stacks, ``VecNorm``) and with the recipe
   (``examples/torchrl_dqn_atari.py``: uint8 stacks, no VecNorm, ``/255`` in the network).
   Collecting is slow on a small CPU, so ``--pool`` transitions are collected per pipeline and
   the buffers are filled with them repeatedly (``--pool-cache DIR`` keeps them for reruns);
   every frame is a real frame of the pipeline. The output says so.
2. **Storages, one run, side by side:** ``LazyMemmapStorage`` with the float32 stacks (the
   example as shipped), ``TieredStorage`` plain swap (same float32 data, storage swapped and
   nothing else), ``TieredStorage`` with the recipe (uint8), and ``LazyTensorStorage`` with the
   recipe's uint8 data. All are filled first, each to its rows in 400-row extends (``fill_s``;
   the process RSS is printed after each), so all buffers exist at once. Then ``--rounds``
   rounds of the DQN loop, **interleaved**: round r runs each storage's round in turn --
   forward on even rounds, reversed on odd ones, so no storage always follows the same one --
   and the drift of a shared machine's speed over minutes falls on all storages alike.
   A storage's round is one ``rb.extend`` of 400 new transitions, then 100 ``rb.sample()`` of
   32, each followed by TorchRL's DQN update (DQNLoss, Adam, gradient clipping, hard target
   update) for the first ``--updates`` of them (all 100 by default), timed with TorchRL's own
   ``timeit`` and its example's names ("rb - extend", "rb - sample", "update"): erased before
   each storage's round, its totals added to that storage's. Reported per call: the means
   (TorchRL's timers, as the example prints them; the issue's ratios are computed from them)
   and the medians (every ``rb.sample()`` timed with ``perf_counter`` too; the rounds'
   extends), with the ratios from the medians and each round's ratio beside them. Each
   storage's rounds have their own CPU meter (what other processes used meanwhile).
3. **Bytes per transition** at the rows held: tiered's ``stats()["bytes_per_row"]`` (what the
   process holds, each blob once, dense columns and metadata included); ``LazyMemmapStorage``:
   the size of its files; ``LazyTensorStorage``: its tensors. Per-row costs do not depend on the
   capacity, so x 1M is the figure of the example's 1M buffer. The two uncompressed baselines are
   filled to ``--baseline-rows`` (default: ``min(rows, 20000)``; 20k float stacks are 4.5 GB) and
   their bytes scaled by row, exactly: their size is capacity x row bytes.

Output: a table, the targets of issue 30 checked, ``benchmarks/out/bench_torchrl_dqn.json``,
the plot ``benchmarks/out/plots/torchrl_dqn.png`` (``benchmarks/plots.py``), and with ``--write-docs``
the plot in ``docs/plots/`` and the section between ``<!-- bench_torchrl_dqn:begin -->`` / ``<!-- bench_torchrl_dqn:end -->`` of
docs/benchmarks.md. Needs ``pip install 'tiered[pipelines]'`` (TorchRL, ale-py, torchvision).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import plots  # noqa: E402

H.ensure_repo_on_path()

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

BEGIN = "<!-- bench_torchrl_dqn:begin -->"
END = "<!-- bench_torchrl_dqn:end -->"
BATCH_ROWS = 400  # frames_per_batch 1600 at frame skip 4
UPDATES_PER_BATCH = 100  # num_updates
TARGET_ROWS = 1_000_000  # the example's buffer_size
TIMERS = ("rb - extend", "rb - sample", "update")  # TorchRL's example's timer names

#: key -> (label, pipeline); the order of the table
STORAGES = {
    "lmm_float": ("LazyMemmapStorage, float32 (as shipped)", "float"),
    "tiered_plain": ("TieredStorage, plain swap (float32)", "float"),
    "tiered_recipe": ("TieredStorage, recipe (uint8)", "uint8"),
    "lts_uint8": ("LazyTensorStorage, uint8", "uint8"),
}
#: short names --stores takes
SHORT = {"lmm": "lmm_float", "plain": "tiered_plain", "recipe": "tiered_recipe", "lts": "lts_uint8"}


def load_example() -> Any:
    """``examples/torchrl_dqn_atari.py`` as a module: the pipeline is defined once, there."""
    path = H.REPO / "examples" / "torchrl_dqn_atari.py"
    spec = importlib.util.spec_from_file_location("torchrl_dqn_atari", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collect_pool(ex: Any, uint8: bool, transitions: int) -> list[TensorDict]:
    """``transitions`` real transitions of the pipeline, as the Collector gives them (400 a batch)."""
    from tensordict.nn import TensorDictSequential
    from torchrl.collectors import Collector

    proof = ex.make_env(uint8=uint8)
    model = ex.make_dqn_model(proof, "cpu", uint8)
    proof.close()
    _, greedy = ex.make_update(model)
    policy = TensorDictSequential(model, greedy)
    total = max(BATCH_ROWS, transitions // BATCH_ROWS * BATCH_ROWS)
    collector = Collector(create_env_fn=ex.make_env(uint8=uint8), policy=policy, frames_per_batch=BATCH_ROWS,
                          total_frames=total, device="cpu", storing_device="cpu", max_frames_per_traj=-1)
    pool = [batch.reshape(-1).clone() for batch in collector]
    collector.shutdown()
    return pool


def batches(pool: list[TensorDict]):
    """The pool's batches, over and over. The trajectory ids are kept: the pool's first rows
    continue its last trajectory, as a collector's next batch continues the episodes of the
    last one (a seam once per pool, like an episode's end)."""
    i = 0
    while True:
        yield pool[i % len(pool)]
        i += 1


def make_storage(key: str, rows: int, scratch: str, threads: int | None) -> Any:
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage

    from tiered.torchrl import TieredStorage

    if key == "lmm_float":
        return LazyMemmapStorage(rows, scratch_dir=scratch)
    if key == "lts_uint8":
        return LazyTensorStorage(rows)
    return TieredStorage(rows, threads=threads)


def row_nbytes(td: TensorDict) -> int:
    """Bytes of one row of ``td`` (every leaf)."""
    return sum(v[0].numel() * v[0].element_size() for v in td.values(True, True))


class Contender:
    """One storage in the race: its buffer, its own DQN model and update, what its rounds measured.

    The timed rounds of all storages are interleaved, so the machine's drift is shared by all of
    them; each storage's round segment is timed with TorchRL's ``timeit`` (erased before the
    segment, its totals added here after it), and each ``rb.sample()`` also with ``perf_counter``
    for the median.
    """

    def __init__(self, key: str, pool: list[TensorDict], rows: int, args: argparse.Namespace, ex: Any,
                 scratch: str) -> None:
        from torchrl.data import TensorDictReplayBuffer

        self.key, self.pool, self.rows, self.args, self.scratch = key, pool, rows, args, scratch
        self.label, self.pipeline = STORAGES[key]
        uint8 = self.pipeline == "uint8"
        self.storage = make_storage(key, rows, scratch, args.threads)
        self.rb = TensorDictReplayBuffer(pin_memory=False, storage=self.storage, batch_size=32)
        proof = ex.make_env(uint8=uint8)
        model = ex.make_dqn_model(proof, "cpu", uint8)
        proof.close()
        self.update, _ = ex.make_update(model)
        self.source = batches(pool)
        self.warned: list[str] = []
        self.fill_s = 0.0
        self.rss_after_fill = 0
        self.totals = {name: 0.0 for name in TIMERS}  # seconds, summed over the rounds
        self.calls = {name: 0 for name in TIMERS}
        self.sample_s: list[float] = []  # every rb.sample(), perf_counter
        self.rounds: list[dict[str, float]] = []  # per round: its means (ms) and its CPU meter

    @contextlib.contextmanager
    def _caught(self) -> Iterator[None]:
        """Record the LowCompressionWarnings raised meanwhile as this storage's (each one, not once)."""
        from tiered.errors import LowCompressionWarning

        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always", LowCompressionWarning)
            try:
                yield
            finally:
                self.warned += [str(w.message) for w in log if issubclass(w.category, LowCompressionWarning)]

    def fill(self) -> None:
        """Fill to the rows in 400-row extends, as the collector would."""
        with self._caught():
            t0 = time.perf_counter()
            filled = 0
            while filled < self.rows:
                self.rb.extend(next(self.source))
                filled += BATCH_ROWS
            self.fill_s = time.perf_counter() - t0
        # the process's RSS with this storage and the ones filled before it
        self.rss_after_fill = H.proc_status_bytes().get("VmRSS", 0)

    def play_round(self) -> None:
        """One round of the DQN loop: 400 new transitions, then 100 samples of 32 (+ updates)."""
        from torchrl._utils import timeit

        rb, update, updates = self.rb, self.update, min(self.args.updates, UPDATES_PER_BATCH)
        samples: list[float] = []
        with self._caught():
            timeit.erase()
            meter = H.CpuMeter()
            with timeit("rb - extend"):
                rb.extend(next(self.source))
            for j in range(UPDATES_PER_BATCH):
                with timeit("rb - sample"):
                    t0 = time.perf_counter()
                    sampled = rb.sample()
                    samples.append(time.perf_counter() - t0)
                if j < updates:
                    with timeit("update"):
                        update(sampled)
            load = meter.stop()
        # timeit 0.14 reports totals and means, not call counts; the calls are the loop's
        totals = timeit.todict(percall=False)
        calls = {"rb - extend": 1, "rb - sample": UPDATES_PER_BATCH, "update": updates}
        for name in TIMERS:
            self.totals[name] += totals.get(name, 0.0)
            self.calls[name] += calls[name]
        self.sample_s += samples
        self.rounds.append({"extend_ms": totals.get("rb - extend", 0.0) * 1e3,
                            "sample_ms": totals.get("rb - sample", 0.0) / UPDATES_PER_BATCH * 1e3,
                            "sample_median_ms": H.median(samples) * 1e3, **load})

    def result(self) -> dict[str, Any]:
        """The storage's figures: bytes per transition at the rows held, and its rounds' times."""
        storage, held = self.storage, len(self.rb)
        fixed, parts = 0, {}
        if self.key.startswith("tiered"):
            s = storage.stats()
            per_row, resident = s["bytes_per_row"], s["resident_bytes"]
            # raw frames waiting (open time chunks, tails, stage): bounded by the trajectories, not the rows
            fixed = s["resident"]["raw"]
            parts = {name: nbytes / held for name, nbytes in s["resident"].items()}  # what each row costs, by part
            pixels = s["fields"]["pixels"]
            stacks = ("pixels",) in storage.store.options["frames"]
            dense = sum(f["stored_bytes"] for f in s["fields"].values() if f["kind"] == "dense") / s["capacity"]
            note = (f"pixels {pixels['logical_bytes'] / max(pixels['stored_bytes'], 1):,.1f}x; frame stacks "
                    f"{'found' if stacks else 'not found'}; dense columns {dense:,.0f} B/row")
        elif self.key == "lmm_float":
            per_row = H.dir_bytes(self.scratch)["apparent"] / held
            resident, note = None, "files (disk-backed memmap)"
        else:
            per_row = float(row_nbytes(self.pool[0]))
            resident, note = per_row * held, "tensors in RAM"
        mean = {name: self.totals[name] / self.calls[name] if self.calls[name] else 0.0 for name in TIMERS}
        extend_s, sample_s = mean["rb - extend"], mean["rb - sample"]
        extend_med = H.median([r["extend_ms"] for r in self.rounds]) if self.rounds else 0.0
        sample_med = H.median(self.sample_s) * 1e3 if self.sample_s else 0.0
        return {
            "label": self.label, "pipeline": self.pipeline, "rows": held, "fill_s": self.fill_s,
            "bytes_per_transition": per_row, "resident_bytes": resident, "fixed_bytes": fixed,
            # per-row costs times 1M, plus what does not grow with the rows
            "bytes_per_transition_at_1m": (per_row * held - fixed) / held + fixed / TARGET_ROWS,
            "bytes_at_1m": per_row * held - fixed + (per_row * held - fixed) / held * (TARGET_ROWS - held) + fixed,
            # means per call, from TorchRL's timeit, as the example reports them
            "extend_ms": extend_s * 1e3, "sample_ms": sample_s * 1e3, "update_ms": mean["update"] * 1e3,
            # per update: its share of the 400-row extend, plus its sample
            "replay_ms_per_update": (extend_s / UPDATES_PER_BATCH + sample_s) * 1e3,
            # medians: every sample, and the rounds' extends
            "extend_median_ms": extend_med, "sample_median_ms": sample_med,
            "replay_median_ms_per_update": extend_med / UPDATES_PER_BATCH + sample_med,
            "calls": dict(self.calls), "rounds": self.rounds,
            "warnings": self.warned, "note": note, "load": _load(self.rounds),
            "bytes_per_transition_by_part": parts, "rss_after_fill_bytes": self.rss_after_fill,
        }


def _load(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The CPU meters of a storage's round segments, over their whole time (and the worst one)."""
    wall = sum(r["wall_s"] for r in rounds) or 1e-9
    return {"wall_s": wall,
            "own_cores": sum(r["own_cores"] * r["wall_s"] for r in rounds) / wall,
            "other_cores": sum(r["other_cores"] * r["wall_s"] for r in rounds) / wall,
            "other_cores_max": max((r["other_cores"] for r in rounds), default=0.0),
            "steal_pct": sum(r["steal_pct"] * r["wall_s"] for r in rounds) / wall}


def play_rounds(contenders: list[Contender], rounds: int) -> list[list[str]]:
    """The timed rounds, interleaved: round r plays every storage's round, forward on even rounds
    and reversed on odd ones, so the machine's drift falls on all storages alike and no storage
    always follows the same one. Returns each round's order."""
    orders = []
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for c in order:
            c.play_round()
        orders.append([c.key for c in order])
    return orders


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, checked on this run's numbers (means, as TorchRL's timers give them),
    and the same time ratios from the medians."""
    out: dict[str, Any] = {}
    lmm, plain = results.get("lmm_float"), results.get("tiered_plain")
    recipe, lts = results.get("tiered_recipe"), results.get("lts_uint8")
    if recipe:
        out["recipe_bytes_at_1m_per_transition"] = recipe["bytes_per_transition_at_1m"]
        out["recipe_le_100_bytes"] = recipe["bytes_per_transition_at_1m"] <= 100
    if recipe and lts:
        out["recipe_replay_vs_lts"] = recipe["replay_ms_per_update"] / lts["replay_ms_per_update"]
        out["recipe_replay_le_1x_lts"] = out["recipe_replay_vs_lts"] <= 1.0
        out["recipe_replay_vs_lts_median"] = (recipe["replay_median_ms_per_update"]
                                              / lts["replay_median_ms_per_update"])
        out["recipe_replay_vs_lts_by_round"] = _by_round(recipe, lts, _replay_ms)
    if plain and lmm:
        out["plain_sample_rate_vs_lmm"] = lmm["sample_ms"] / plain["sample_ms"]
        out["plain_sample_ge_0.8x_lmm"] = out["plain_sample_rate_vs_lmm"] >= 0.8
        out["plain_bytes_vs_lmm"] = plain["bytes_per_transition"] / lmm["bytes_per_transition"]
        out["plain_bytes_le_1x_lmm"] = out["plain_bytes_vs_lmm"] <= 1.0
        out["plain_extend_rate_vs_lmm"] = lmm["extend_ms"] / plain["extend_ms"]
        out["plain_sample_rate_vs_lmm_median"] = lmm["sample_median_ms"] / plain["sample_median_ms"]
        out["plain_extend_rate_vs_lmm_median"] = lmm["extend_median_ms"] / plain["extend_median_ms"]
        out["plain_sample_rate_vs_lmm_by_round"] = _by_round(lmm, plain, lambda r: r["sample_ms"])
    if plain:
        out["plain_warnings"] = len(plain["warnings"])
        out["plain_warns_once"] = len(plain["warnings"]) == 1
    if recipe and lmm:
        out["recipe_bytes_less_than_shipped"] = lmm["bytes_per_transition_at_1m"] / recipe["bytes_per_transition_at_1m"]
    return out


def _replay_ms(r: dict[str, float]) -> float:
    return r["extend_ms"] / UPDATES_PER_BATCH + r["sample_ms"]


def _by_round(a: dict[str, Any], b: dict[str, Any], measure: Callable[[dict[str, float]], float]) -> list[float]:
    """``measure(a) / measure(b)`` in each round: the rounds ran side by side, so their spread is
    how far one round's conditions moved the ratio."""
    return [measure(ra) / measure(rb) for ra, rb in zip(a["rounds"], b["rounds"], strict=True)]


def report(data: dict[str, Any]) -> str:
    results, r, a = data["results"], data["ratios"], data["args"]
    rows = []
    for res in results.values():
        rows.append([res["label"], f"{res['rows']:,}", H.fmt_bytes(res["bytes_per_transition"]),
                     H.fmt_bytes(res["bytes_per_transition_at_1m"]), f"{res['bytes_at_1m'] / 2**30:,.2f} GiB",
                     f"{res['extend_ms']:.1f}", f"{res['sample_ms']:.2f}", f"{res['sample_median_ms']:.2f}",
                     f"{res['replay_ms_per_update']:.2f}", f"{res['replay_median_ms_per_update']:.2f}",
                     f"{res['update_ms']:.1f}", len(res["warnings"]), res["note"]])
    table = H.markdown_table(["storage", "rows", "bytes/transition", "at 1M", "1M buffer", "rb - extend (400) ms",
                              "rb - sample (32) ms", "sample median ms", "replay ms/update",
                              "replay median ms/update", "update ms", "warnings", "note"], rows)
    loads = [res["load"] for res in results.values()]
    lines = [
        table, "",
        f"Frames: {a['pool']:,} real transitions per pipeline through TorchRL's DQN env transforms (ALE/Pong-v5, "
        f"Collector, 400 per batch), extended over and over to fill the buffers. "
        f"Loop: all buffers filled first, then {a['rounds']} rounds, interleaved: each round runs every storage's "
        f"round in turn (forward on even rounds, reversed on odd ones), one 400-row extend + 100 samples of 32, "
        f"{a['updates']} of them followed by TorchRL's DQN update on the CPU, so the machine's drift falls on all "
        "storages alike. Times per call: means from torchrl's timeit (as the example reports them; the targets "
        "use these) and medians (every sample; the rounds' extends). 'replay ms/update' is extend/100 + sample. "
        "LazyMemmapStorage and LazyTensorStorage bytes are capacity x row bytes; tiered's "
        "are stats()['bytes_per_row'] (what the process holds, dense columns and metadata included); 'at 1M' "
        "scales the per-row part to 1,000,000 rows and keeps the raw frames waiting in open time chunks "
        "(bounded by the trajectories, not the rows) as they are.",
        "",
        "Targets (issue 30): " + "; ".join(_target_lines(r)),
        "",
        "Other processes used {} cores of {} during each storage's timed rounds (CpuMeter; worst round {}): {}."
        .format(", ".join(f"{x['other_cores']:.2f}" for x in loads), data["facts"].get("logical_cores"),
                ", ".join(f"{x.get('other_cores_max', x['other_cores']):.2f}" for x in loads),
                "times are indicative only, rerun on a quiet machine" if any(
                    x["other_cores"] > 0.25 for x in loads) else "a quiet machine"),
    ]
    return "\n".join(lines)


def _spread(xs: list[float]) -> str:
    return f" (rounds {min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else ""


def _target_lines(r: dict[str, Any]) -> list[str]:
    out = []
    if "recipe_le_100_bytes" in r:
        out.append(f"recipe {r['recipe_bytes_at_1m_per_transition']:,.0f} B/transition <= 100: "
                   f"{'yes' if r['recipe_le_100_bytes'] else 'NO'}")
    if "recipe_replay_vs_lts" in r:
        out.append(f"recipe replay time {r['recipe_replay_vs_lts']:.2f}x LazyTensorStorage uint8 <= 1.0: "
                   f"{'yes' if r['recipe_replay_le_1x_lts'] else 'NO'} (medians "
                   f"{r['recipe_replay_vs_lts_median']:.2f}x{_spread(r['recipe_replay_vs_lts_by_round'])})")
    if "plain_sample_rate_vs_lmm" in r:
        out.append(f"plain swap sample rate {r['plain_sample_rate_vs_lmm']:.2f}x LazyMemmapStorage >= 0.8: "
                   f"{'yes' if r['plain_sample_ge_0.8x_lmm'] else 'NO'} (medians "
                   f"{r['plain_sample_rate_vs_lmm_median']:.2f}x{_spread(r['plain_sample_rate_vs_lmm_by_round'])})")
        out.append(f"plain swap bytes {r['plain_bytes_vs_lmm']:.3f}x LazyMemmapStorage <= 1.0: "
                   f"{'yes' if r['plain_bytes_le_1x_lmm'] else 'NO'}")
        out.append(f"plain swap extend rate {r['plain_extend_rate_vs_lmm']:.2f}x LazyMemmapStorage (medians "
                   f"{r['plain_extend_rate_vs_lmm_median']:.2f}x)")
    if "plain_warnings" in r:
        out.append(f"plain swap warned {r['plain_warnings']} time(s) (target: once)")
    if "recipe_bytes_less_than_shipped" in r:
        out.append(f"recipe holds {r['recipe_bytes_less_than_shipped']:,.0f}x fewer bytes than the example as shipped")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows each tiered buffer is filled to")
    p.add_argument("--baseline-rows", type=int, default=None,
                   help="rows of the uncompressed baselines (default min(rows, 20000))")
    p.add_argument("--pool", type=int, default=1600, help="real transitions collected per pipeline")
    p.add_argument("--rounds", type=int, default=5, help="DQN loop rounds timed (400 rows + 100 updates each)")
    p.add_argument("--updates", type=int, default=UPDATES_PER_BATCH,
                   help="of the 100 samples per round, how many are followed by the DQN update (all: 100)")
    p.add_argument("--threads", type=int, default=None, help="tiered's decode threads (default: its choice)")
    p.add_argument("--storages", "--stores", default=",".join(STORAGES),
                   help="comma-separated subset of " + ",".join(STORAGES) + " (or their short names "
                   + ",".join(SHORT) + ")")
    p.add_argument("--pool-cache", default=None,
                   help="directory keeping the collected transitions for reruns (collected once per --pool)")
    p.add_argument("--scratch", default=None, help="directory for LazyMemmapStorage's files (default: a temp dir)")
    H.add_output_arguments(p)
    args = p.parse_args(argv)
    keys = [SHORT.get(k.strip(), k.strip()) for k in args.storages.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(STORAGES))
    if unknown:
        p.error(f"unknown storages {unknown}; choose from {list(STORAGES)}")
    if not keys:
        p.error(f"--storages names no storage; choose from {list(STORAGES)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1 (the times come from the rounds), got {args.rounds}")
    baseline_rows = args.baseline_rows or min(args.rows, 20_000)
    # TorchRL's deprecation notices (VecNorm, the collector's InitTracker) and INFO lines are not results
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torchrl  # noqa: F401  (importing it sets its logger's level: ours must come after)

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    ex = load_example()
    facts = H.machine_facts(argv)
    pools: dict[str, list[TensorDict]] = {}
    for pipeline in dict.fromkeys(STORAGES[k][1] for k in keys):
        t0 = time.perf_counter()
        cache = Path(args.pool_cache) / f"{pipeline}_{args.pool}" if args.pool_cache else None
        if cache is not None and cache.exists():
            whole = TensorDict.load_memmap(cache).to_tensordict()
            pools[pipeline] = list(whole.split(BATCH_ROWS))
            how = f"loaded from {cache} (collected earlier by this script)"
        else:
            pools[pipeline] = collect_pool(ex, pipeline == "uint8", args.pool)
            if cache is not None:
                torch.cat(pools[pipeline]).memmap(cache)
            how = "collected"
        if pipeline == "uint8":  # the recipe stores what the loss reads (examples/torchrl_dqn_atari.py)
            pools[pipeline] = [td.exclude(*ex.Q_VALUE_KEYS) for td in pools[pipeline]]
        n = sum(len(b) for b in pools[pipeline])
        print(f"{n:,} real transitions through TorchRL's DQN env ({pipeline} pipeline) {how} in "
              f"{time.perf_counter() - t0:.0f} s; buffers are filled with them repeatedly", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as scratches:
        contenders = []
        for key in keys:  # all buffers exist at once: the rounds below run them side by side
            rows = baseline_rows if key in ("lmm_float", "lts_uint8") else args.rows
            scratch = scratches.enter_context(tempfile.TemporaryDirectory(dir=args.scratch))
            c = Contender(key, pools[STORAGES[key][1]], rows, args, ex, scratch)
            c.fill()
            contenders.append(c)
            print(f"{c.label}: {len(c.rb):,} rows filled in {c.fill_s:.0f} s; process RSS now "
                  f"{H.fmt_bytes(c.rss_after_fill)}", flush=True)
        rss = H.proc_status_bytes()
        print(f"all {len(contenders)} buffers filled: process RSS {H.fmt_bytes(rss.get('VmRSS'))} "
              f"(anonymous {H.fmt_bytes(rss.get('RssAnon'))}, file-backed {H.fmt_bytes(rss.get('RssFile'))}); "
              f"{args.rounds} rounds interleaved", flush=True)
        orders = play_rounds(contenders, args.rounds)
        for c in contenders:
            results[c.key] = res = c.result()
            print(f"{res['label']}: {res['bytes_per_transition']:,.0f} B/transition, extend {res['extend_ms']:.1f} ms, "
                  f"sample {res['sample_ms']:.2f} ms (median {res['sample_median_ms']:.2f}), update "
                  f"{res['update_ms']:.1f} ms; other processes used {res['load']['other_cores']:.2f} cores "
                  f"(worst round {res['load']['other_cores_max']:.2f})", flush=True)
            if res["bytes_per_transition_by_part"]:
                print("  bytes per transition by part: " + ", ".join(
                    f"{name} {b:,.1f}" for name, b in res["bytes_per_transition_by_part"].items()))
            for w in res["warnings"]:
                print(f"  warning: {w}")
        del contenders, c
    data = {"facts": facts, "args": {**vars(args), "baseline_rows": baseline_rows, "quick": args.rows < 100_000},
            "results": results, "ratios": ratios(results), "round_orders": orders,
            "rss_after_fill_bytes": rss}
    text = report(data)
    print()
    print(text)
    out = H.write_output("bench_torchrl_dqn.json", json.dumps(data, indent=1, default=str))
    print(f"\nwrote {out.relative_to(H.REPO)}")
    plots.plot_torchrl_dqn(out, plots.plot_dir(args.write_docs))
    if H.wants_docs(args):
        body = ("## CPU: TorchRL's DQN Atari pipeline, four storages (bench_torchrl_dqn.py)\n\n"
                "Written by `benchmarks/bench_torchrl_dqn.py`; rerun it to refresh this section. The recipe and "
                "what it changes: [TorchRL pipelines](torchrl-pipelines.md).\n\n"
                f"Command: `{facts['command']}` ({facts['date'][:16]}, {facts['logical_cores']} cores, "
                f"{facts['cpu_model']}).\n\n{text}\n\n![TorchRL's DQN pipeline: bytes per transition and replay time per update](plots/torchrl_dqn.svg)")
        H.write_doc_section(body, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
