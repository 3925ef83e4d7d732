"""The cells of a read are rebuilt from their frames by per-field cuts worked out once per read
plan (tiered.engine.read.cell_cuts): a plain reshape where the cells are one, the field's own
``cells_from_frames`` elsewhere (frames stacked on another axis, wider dtypes). These tests show
the cut path gives each field's reference cells, and a store's repeated gets (the kept cuts) of
several key sets and stack axes read back what was written.
"""

from __future__ import annotations

import numpy as np
import torch
from helpers import assert_td_equal
from tensordict import TensorDict

from tiered import TieredStore
from tiered.engine import read
from tiered.schema import Field


def test_cell_cuts_give_each_fields_reference_cells():
    rng = np.random.default_rng(1)
    flat = rng.integers(0, 256, (40, 64), dtype=np.uint8)
    fields = [Field(("stack",), torch.uint8, (4, 8, 8), "blob", frame_dim=0),
              Field(("late",), torch.uint8, (8, 3, 8), "blob", frame_dim=1),  # frames on axis 1
              Field(("wide",), torch.float32, (4, 4), "blob", frame_dim=None),
              Field(("one",), torch.uint8, (8, 8), "blob", frame_dim=None)]
    cuts = read.cell_cuts(fields)
    assert [(a, b) for _, _, a, b, _ in cuts] == [(0, 4), (4, 7), (7, 8), (8, 9)]
    assert [shape for *_, shape in cuts] == [(4, 8, 8), None, None, (8, 8)]
    frame_idx = rng.integers(0, 40, (6, 9))
    got: dict = {}
    read.assemble_cells(fields, flat, frame_idx, 6, got, cuts=cuts)
    for f, _, a, b, _ in cuts:
        want = f.cells_from_frames(torch.from_numpy(flat[frame_idx[:, a:b].reshape(-1)]), 6)
        assert got[f.key].dtype == want.dtype and got[f.key].shape == want.shape == (6, *f.shape)
        assert torch.equal(got[f.key].view(torch.uint8), want.view(torch.uint8))


def test_repeated_gets_of_several_key_sets_read_back_what_was_written():
    g = torch.Generator().manual_seed(0)
    n = 64
    data = TensorDict({"obs": torch.randint(0, 4, (n, 3, 4, 12, 12), dtype=torch.uint8, generator=g),
                       "pix": torch.randint(0, 4, (n, 12, 12), dtype=torch.uint8, generator=g),
                       "act": torch.arange(n)}, [n])
    store = TieredStore(n, frames={"obs": 1})  # stacks on axis 1: not a plain reshape
    store.extend(data)
    for rep in range(3):  # the cuts are worked out on the first get of a key set, kept after
        for keys in (None, ["obs"], ["pix", "act"], ["obs", "pix"]):
            rows = torch.randint(0, n, (1 + 7 * rep,), generator=g)
            want = data[rows] if keys is None else data.select(*keys)[rows]
            assert_td_equal(store.get(rows, keys=keys), want)
