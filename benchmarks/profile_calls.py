"""Per-call cost of tiered's small operations against LazyTensorStorage: time, Python call count
and a cProfile breakdown of each, on real Atari stacks with next observations.

Operations (each on ``TieredStore(N)`` / ``TieredStorage(N)`` with no options, and the same
TorchRL calls on ``LazyTensorStorage(N)``): ``TieredStore.get`` / ``storage.get`` /
``rb.sample()`` at B=1, 8, 32, 256; ``rb.add`` of one transition; ``rb.extend`` of 16 rows.
Times are medians (writes: means, which count the stage's compression) over calls alternating between the storages on the same indices; the call
count is the number of Python-level calls (``sys.setprofile``: Python and C functions) of one call.

Usage:
    python benchmarks/profile_calls.py                 # table of us/call and calls/call
    python benchmarks/profile_calls.py --profile get32 # + cProfile of one operation (tiered)
    python benchmarks/profile_calls.py --threads 1
    python benchmarks/profile_calls.py --threads 1 --cpu   # thread CPU time: steadier on a busy host
    python benchmarks/profile_calls.py --only --breakdown store.get32 rb.add1   # calls per tiered function
    python benchmarks/profile_calls.py --only --stages store.get32 rb.add1 rb.extend16  # us per stage
    python benchmarks/profile_calls.py --only --stages rb.extend16 --cpu --threads 1  # in thread CPU time
    python benchmarks/profile_calls.py --pool /tmp/dqn_pool/uint8_400 --cpu --threads 1  # TorchRL's DQN rows
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402

H.ensure_repo_on_path()

import torch  # noqa: E402

from tiered.testing import count_calls, run_profiled  # noqa: E402


def breakdown(fn) -> tuple[int, int, collections.Counter]:
    """``(all calls, Python-level calls, calls per issuer)`` of one ``fn()``: each call is charged
    to the innermost tiered function on the stack that issued it (numpy, torch and tensordict
    work included), "<outside tiered>" for TorchRL's own."""
    per: collections.Counter = collections.Counter()
    python = 0

    def owner(frame) -> str:
        while frame is not None:
            name = frame.f_code.co_filename
            if "/tiered/" in name and "site-packages" not in name:
                return name.split("/tiered/")[-1] + ":" + frame.f_code.co_name
            frame = frame.f_back
        return "<outside tiered>"

    def prof(frame, event, arg):
        nonlocal python
        if event == "call":
            python += 1
            per[owner(frame.f_back)] += 1
        elif event == "c_call":
            per[owner(frame)] += 1

    run_profiled(fn, prof)
    return sum(per.values()), python, per


# The stages of a read and a small write, as (module, qualified name) of the function that does
# each; --stages wraps them with a timer (a wrapper costs ~0.3 us a call: stage totals, not tiny
# functions). Inner stages are timed inside outer ones: each line is inclusive.
STAGES = [
    ("tiered.store", "TieredStore.get"),
    ("tiered.store", "TieredStore._resolve_read"),
    ("tiered.engine.read", "ReadPipeline.get_rows"),
    ("tiered.engine.read", "ReadPipeline.plan"),
    ("tiered.engine.rows", "RowSpace.read_dense_fields"),
    ("tiered.engine.write", "WritePath.staged_slots"),
    ("tiered.engine.read", "blob_frames"),
    ("tiered.engine.layout", "FieldLayout.blob_refs"),
    ("tiered.engine.row_tables", "ShiftedRowTable.refs"),
    ("tiered.engine.row_tables", "NextRowTable.refs"),
    ("tiered.engine.read", "CpuReadPipeline.gather_blobs"),
    ("tiered.engine.placement", "Placement.locate_and_read"),
    ("tiered.engine.placement", "Placement.locate"),
    ("tiered.engine.placement", "Placement.read"),
    ("tiered.tiers.arena", "ArenaTier.read"),
    ("tiered.util.copy", "copy_blobs"),
    ("tiered.codecs", "segment_checksums"),
    ("tiered.engine.placement", "Placement.note_reads"),
    ("tiered.engine.placement", "Placement.promote"),
    ("tiered.engine.frames", "FrameFamily.open_raw"),
    ("tiered.engine.read", "decode_gathered"),
    ("tiered.codecs.zstd", "ZstdCodec.decode"),
    ("tiered.util.pool", "run_parallel"),
    ("tiered.codecs.zstd", "ZstdCodec._decompress_slice"),
    ("tiered.engine.read", "assemble_cells"),
    ("tiered.engine.read", "as_tensordict"),
    ("tiered.engine.rows", "RowSpace.resolve_read"),
    ("tiered.torchrl.storage", "TieredStorage.get"),
    ("tiered.torchrl.storage", "TieredStorage._set"),
    ("tiered.engine.write", "WritePath.append"),
    ("tiered.engine.write", "WritePath.overwrite"),
    ("tiered.engine.write", "WritePath.small_write"),
    ("tiered.engine.write", "WritePath.stage_write"),
    ("tiered.engine.write", "WritePath.flush_stage"),
    ("tiered.engine.write", "WritePath.write_rows"),
    ("tiered.engine.write", "check_cells_readable"),
    ("tiered.engine.rows", "RowSpace.trajectory_ids"),
    ("tiered.engine.frames", "FrameFamily.plan"),
    ("tiered.engine.frames", "FrameFamily._dedup_neighbours"),
    ("tiered.engine.frames", "FrameFamily._assign_chunks"),
    ("tiered.engine.write", "WritePath.encode_and_place"),
    ("tiered.codecs.zstd", "ZstdCodec.encode"),
    ("tiered.engine.placement", "Placement.place"),
    ("tiered.engine.layout", "FieldLayout.put_family"),
    ("tiered.engine.rows", "RowSpace.write_dense"),
    ("tiered.engine.write", "WritePath.release_blobs"),
    ("tiered.engine.rows", "RowSpace.write_dense_cells"),
    ("tiered.engine.stage", "WriteStage.put"),
    ("tiered.engine.layout", "FieldLayout.check_rows"),
    ("tiered.engine.rows", "RowSpace.check_dense"),
    ("tiered.engine.rows", "RowSpace.resolve_write"),
    ("tiered.engine.write", "WritePath.prepare_widening"),
    ("tiered.engine.write", "WritePath.validate_values"),
    ("tiered.schema", "Schema.match"),
    ("tiered.engine.placement", "Placement.rows_staged"),
    # the stage flush, step by step
    ("tiered.engine.stage", "WriteStage.batch"),
    ("tiered.engine.frames", "FrameFamily._dedup"),
    ("tiered.engine.frames", "FrameFamily.neighbour_hits"),
    ("tiered.engine.frames", "FrameColumns.take"),
    ("tiered.engine.frames", "frame_hashes"),
    ("tiered.engine.frames", "FrameFamily._resolve"),
    ("tiered.engine.frames", "FrameFamily._closed_chunks"),
    ("tiered.engine.frames", "FrameFamily._next_tail"),
    ("tiered.engine.frames", "FrameFamily.commit"),
    ("tiered.engine.row_tables", "ShiftedRowTable.put"),
    ("tiered.engine.row_tables", "NextRowTable.put"),
    ("tiered.engine.row_tables", "NextRowTable.hold"),
    ("tiered.engine.blob_index", "BlobIndex.incref"),
    ("tiered.engine.blob_index", "BlobIndex.decref"),
    ("tiered.engine.placement", "Placement.rows_written"),
    ("tiered.engine.placement", "Placement.free_in_tiers"),
]


@contextlib.contextmanager
def stage_timers(clock, package: str = "tiered"):
    """Every function of STAGES wrapped in a timer while the block runs; yields ``acc``
    ``[len(STAGES) + 1, 2]``: per stage, the ns and calls counted since the caller last zeroed it
    (the last row is the caller's). ``package``: the name the tiered package was imported under
    (``ab_get.py``'s other version is ``tiered_base``; a stage it does not have is left out)."""
    import functools
    import importlib

    import numpy as np

    acc = np.zeros((len(STAGES) + 1, 2))
    undo = []
    for i, (mod_name, qual) in enumerate(STAGES):
        owner, _, attr = qual.rpartition(".")
        try:
            mod = importlib.import_module(package + mod_name[len("tiered"):])
            holder = getattr(mod, owner) if owner else mod
            orig = holder.__dict__[attr] if owner else getattr(mod, attr)
        except (ImportError, AttributeError, KeyError):
            if package == "tiered":
                raise
            continue  # a stage the other version does not have

        def wrapped(*a, _orig=orig, _row=acc[i], **k):
            t0 = clock()
            try:
                return _orig(*a, **k)
            finally:
                _row[0] += clock() - t0
                _row[1] += 1

        functools.update_wrapper(wrapped, orig)
        setattr(holder, attr, wrapped)
        undo.append((holder, attr, orig))
        if not owner:  # module-level functions are also called through the modules importing them
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith(package) and other.__dict__.get(attr) is orig:
                    setattr(other, attr, wrapped)
                    undo.append((other, attr, orig))
    try:
        yield acc
    finally:
        for holder, attr, orig in reversed(undo):
            setattr(holder, attr, orig)


def time_stages(fn, calls: int, before=None, *, median: bool = True, cpu: bool = False) -> dict[str, tuple[float, float]]:
    """``{stage: (us per call of fn, calls of the stage per call of fn)}`` over ``calls`` calls of
    ``fn`` (``before()`` runs untimed ahead of each), every function of STAGES wrapped in a timer.

    ``median``: each stage's median over the calls (a read: robust to other processes' bursts on a
    shared machine); else its mean (a write: the mean counts the stage compressions that only some
    calls make, as the table's write rates do). ``cpu``: the calling thread's CPU time
    (``time.thread_time_ns``), not wall time."""
    import numpy as np

    clock = time.thread_time_ns if cpu else time.perf_counter_ns
    per_call = np.zeros((calls, len(STAGES) + 1, 2))
    with stage_timers(clock) as acc:
        for c in range(calls):
            if before is not None:
                before()
            acc[:] = 0
            t0 = clock()
            fn()
            acc[-1] = clock() - t0, 1
            per_call[c] = acc
    us = (np.median(per_call[:, :, 0], axis=0) if median else per_call[:, :, 0].mean(axis=0)) / 1e3
    count = per_call[:, :, 1].mean(axis=0)
    out = {"(whole call)": (float(us[-1]), 1.0)}
    out.update({q: (float(us[i]), float(count[i])) for i, (_, q) in enumerate(STAGES) if count[i]})
    return out


def build(n: int, data):
    from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

    import tiered
    from tiered.torchrl import TieredStorage

    def rb(storage, b):
        return TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=b)

    store = tiered.TieredStore(n)
    store.extend(data)
    ts, lts = TieredStorage(n), LazyTensorStorage(n)
    rbs = {"tiered": rb(ts, 32), "lts": rb(lts, 32)}
    for r in rbs.values():
        r.extend(data)
    return store, ts, lts, rbs


def ops(store, ts, lts, rbs, data, n):
    """name -> {storage: zero-arg callable} with per-call fresh arguments drawn from shared state."""
    from torchrl.data import RandomSampler, TensorDictReplayBuffer

    state = {"idx": None, "row": 0}
    out = {}
    for b in (1, 8, 32, 256):
        samplers = {k: TensorDictReplayBuffer(storage=r.storage, sampler=RandomSampler(), batch_size=b)
                    for k, r in rbs.items()}
        out[f"store.get{b}"] = {"tiered": lambda: store.get(state["idx"])}
        out[f"storage.get{b}"] = {"tiered": lambda: ts.get(state["idx"]), "lts": lambda: lts.get(state["idx"])}
        out[f"rb.sample{b}"] = {k: s.sample for k, s in samplers.items()}
    add_rows = [data[i] for i in range(512)]
    ext_rows = [data[i:i + 16] for i in range(0, 4096, 16)]
    ext_rows = [e for e in ext_rows if e.batch_size[0] == 16]
    out["rb.add1"] = {k: (lambda r=r: r.add(add_rows[state["row"] % len(add_rows)])) for k, r in rbs.items()}
    out["rb.extend16"] = {k: (lambda r=r: r.extend(ext_rows[state["row"] % len(ext_rows)])) for k, r in rbs.items()}
    out["store.extend16"] = {"tiered": lambda: store.extend(ext_rows[state["row"] % len(ext_rows)])}
    return out, state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--games", nargs="+", default=["Pong", "MsPacman"])
    p.add_argument("--pool", default=None,
                   help="rows from a bench_torchrl_dqn.py --pool-cache directory (e.g. /tmp/dqn_pool/uint8_400: "
                        "TorchRL's DQN pipeline with the recipe) instead of the Atari rollouts")
    p.add_argument("--calls", type=int, default=60, help="timed calls per operation and storage")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--profile", nargs="*", default=[], help="operations to cProfile (tiered)")
    p.add_argument("--only", nargs="*", default=None, help="operations to time")
    p.add_argument("--breakdown", nargs="*", default=[],
                   help="operations whose calls to print per tiered function (tiered and lts)")
    p.add_argument("--stages", nargs="*", default=[],
                   help="operations to time stage by stage (tiered; us per call, inclusive)")
    p.add_argument("--stage-calls", type=int, default=2000, help="calls per operation for --stages")
    p.add_argument("--cpu", action="store_true",
                   help="time the table with the calling thread's CPU time (time.thread_time), not wall "
                        "time: steadier on a shared machine; excludes decode/encode pool threads and "
                        "torch's intra-op threads (compare at --threads 1)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.steps
    if args.pool:
        # TorchRL's DQN pipeline rows (bench_torchrl_dqn.py's cache: ~20 fields, a dozen dense
        # columns TorchRL's collector writes), tiled to --steps
        from tensordict import TensorDict

        pool = TensorDict.load_memmap(args.pool).clone()
        data = torch.cat([pool] * -(-n // pool.batch_size[0]))[:n].clone()
    else:
        data = H.load_atari(args.games, n, 2000)
    n = data.batch_size[0]
    store, ts, lts, rbs = build(n, data)
    table, state = ops(store, ts, lts, rbs, data, n)
    gen = torch.Generator().manual_seed(0)
    clock = time.thread_time if args.cpu else time.perf_counter
    print(f"{'operation':16} {'tiered us':>10} {'lts us':>10} {'ratio':>7} {'tiered calls':>13} {'lts calls':>10}")
    for name, fns in table.items():
        if args.only is not None and name not in args.only:
            continue
        b = int("".join(c for c in name.split(".")[-1] if c.isdigit()) or 1)
        times = {k: [] for k in fns}
        counts = {}
        for c in range(args.calls + 3):
            state["idx"] = torch.randint(0, n, (b,), generator=gen)
            state["row"] += 1
            for k in (list(fns) if c % 2 else list(fns)[::-1]):
                t0 = clock()
                fns[k]()
                dt = clock() - t0
                if c >= 3:
                    times[k].append(dt)
        for k, fn in fns.items():
            state["row"] += 1
            counts[k] = count_calls(fn).all
        # writes: the mean (every few small writes one compresses the write stage: a median
        # would hide it); reads: the median
        if "add" in name or "extend" in name:
            med = {k: sum(v) / len(v) * 1e6 for k, v in times.items()}
        else:
            med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
        lt = med.get("lts")
        ratio = f"{lt / med['tiered']:.2f}x" if lt else ""
        print(f"{name:16} {med['tiered']:10.0f} {lt if lt else float('nan'):10.0f} {ratio:>7} "
              f"{counts['tiered']:13d} {counts.get('lts', 0):10d}", flush=True)
    for name in args.breakdown:
        b = int("".join(c for c in name.split(".")[-1] if c.isdigit()) or 1)
        for k, fn in table[name].items():
            state["idx"] = torch.randint(0, n, (b,), generator=gen)
            state["row"] += 1
            fn()  # warm: plans, buffers
            state["row"] += 1
            total, python, per = breakdown(fn)
            print(f"### {name} ({k}): {total} calls, {python} of them Python functions")
            for who, c in per.most_common(25):
                print(f"  {c:5d} {who}")
    for name in args.stages:
        fn = table[name]["tiered"]
        b = int("".join(c for c in name.split(".")[-1] if c.isdigit()) or 1)

        def before(b=b):
            state["idx"] = torch.randint(0, n, (b,), generator=gen)
            state["row"] += 1

        for _ in range(20):  # warm: plans, buffers
            before()
            fn()
        write = "add" in name or "extend" in name
        print(f"### stages of tiered {name}, {args.stage_calls} calls (us per call, inclusive, "
              f"{'mean' if write else 'median'}{', thread CPU time' if args.cpu else ''}; calls per call)")
        for q, (us, c) in time_stages(fn, args.stage_calls, before, median=not write, cpu=args.cpu).items():
            print(f"  {us:9.1f} us  {c:5.2f}x  {q}")
    for name in args.profile:
        fn = table[name]["tiered"]
        b = int("".join(c for c in name.split(".")[-1] if c.isdigit()) or 1)
        prof = cProfile.Profile()
        for _ in range(200):
            state["idx"] = torch.randint(0, n, (b,), generator=gen)
            state["row"] += 1
            prof.enable()
            fn()
            prof.disable()
        buf = io.StringIO()
        buf.write(f"### cProfile tiered {name}, 200 calls\n")
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(30)
        print(buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
