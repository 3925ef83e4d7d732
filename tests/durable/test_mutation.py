"""The mutation sweep, CI-sized: every file of a committed store (memmap and HDF5 backends) is
truncated, extended, has a page zeroed and bits flipped, is swapped with another file and put
back to its previous generation's copy, and the manifest is rolled back to the previous commit;
every outcome must be detected (a :mod:`tiered.errors` exception or a failing verify, naming the
file) or harmless (identical rows read back) -- never silent wrong data, never a raw exception.
The long version is ``benchmarks/mutation_sweep.py`` (tests/_mutation.py holds the machinery).
"""

from __future__ import annotations

import pytest
from _mutation import Mutation, build_store, file_kind, mutations, run_case, sweep

from tiered.cli import main

FLIPS = 4


@pytest.fixture(scope="module")
def rows(atari_pong):
    return atari_pong[:100].clone()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_every_mutation_of_every_file_is_detected_or_harmless(rows, tmp_path, backend):
    store = build_store(tmp_path / "s", backend, rows)
    kinds = {file_kind(f) for f in store.files}
    assert {"manifest.json", "cold segment", "rows.*.blob", "rows.*.slot", "dense.*", "index.state",
            "index.free_ids", "index.meta", "written"} <= kinds, kinds
    tally = sweep(store, flips=FLIPS, seed=0)
    print(f"\n{backend}: {tally.cases} cases\n{tally.table()}")
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert not tally.unnamed, f"detected without naming the file: {dict(tally.unnamed)}"
    detected = sum(v for (_, o), v in tally.counts.items() if o == "detected")
    assert tally.cases > 300 and detected > 0.8 * tally.cases, tally.table()
    # every file kind had damage detected (none is left unchecked)
    # (the lock and commit.intent are hints for writers: damage to them is harmless by design)
    assert {k for (k, o) in tally.counts if o == "detected"} >= kinds - {"lock", "commit.intent"}, tally.table()
    # the store is back to its committed state after the sweep
    assert main(["verify", str(store.path), "-q"]) == 0


@pytest.mark.parametrize("backend", ["memmap", "hdf5"])
def test_tiered_verify_exits_3_for_damage_of_each_file_kind(rows, tmp_path, backend, capsys):
    """The CLI's exit code for one damaging case per file kind (a flipped bit mid-file)."""
    store = build_store(tmp_path / "s", backend, rows)
    seen = set()
    for m in mutations(store, flips=FLIPS, seed=1, thorough=False):
        kind = file_kind(m.file)
        if m.kind != "zero-page" or m.arg != 0 or kind in seen or kind in ("lock", "commit.intent"):
            continue
        seen.add(kind)
        from _mutation import apply
        saved = apply(store, m)
        try:
            capsys.readouterr()
            assert main(["verify", str(store.path), "-q"]) == 3, m.label()
            out = capsys.readouterr()
            assert "Traceback" not in out.err, out.err
        finally:
            for s in reversed(saved):
                s.restore()
    assert len(seen) >= 15, seen
    assert run_case(store, Mutation(store.files[0], "append", 3))[0] in ("detected", "harmless")
