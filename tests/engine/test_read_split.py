"""A large read's frame gather is split over the decode threads (tiered.engine.read.assemble_cells).

A B=256 sample of Atari stacks with next observations gathers ~14 MB of frames into its cells;
from ``MIN_GATHER_SPLIT_BYTES`` the gather is cut into one slice of rows per thread. These tests
show that the cells are the same bits split or not (stacked and single-frame fields, uint8 and
wider dtypes, repeated rows), through a store's ``get`` and through ``assemble_cells`` itself, and
that a frame index past the decoded frames is refused rather than clipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_td_equal

from tiered import TieredStore
from tiered.engine import read
from tiered.schema import Field


@pytest.mark.parametrize("split", [False, True])
def test_a_store_get_is_the_same_split_or_not(atari_mixed, split, monkeypatch):
    monkeypatch.setattr(read, "MIN_GATHER_SPLIT_BYTES", 0 if split else 1 << 62)
    data = atari_mixed[:1500]
    s = TieredStore(2048, threads=2)
    s.extend(data)
    rows = torch.randint(0, 1500, (300,), generator=torch.Generator().manual_seed(0))
    rows[:10] = rows[10]  # repeated rows
    assert_td_equal(s.get(rows), data[rows])
    assert_td_equal(s.get(torch.tensor([7])), data[torch.tensor([7])])  # fewer rows than threads


def test_assemble_cells_splits_to_the_same_bits(monkeypatch):
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 256, (50, 64), dtype=np.uint8)
    fields = [Field(("stack",), torch.uint8, (4, 8, 8), "blob", frame_dim=0),
              Field(("wide",), torch.float32, (4, 4), "blob", frame_dim=None)]
    assert [f.frames_per_row for f in fields] == [4, 1]
    frame_idx = rng.integers(0, 50, (9, 5))
    want: dict = {}
    read.assemble_cells(fields, flat, frame_idx, 9, want)
    monkeypatch.setattr(read, "MIN_GATHER_SPLIT_BYTES", 0)
    for threads in (2, 3, 16):
        got: dict = {}
        read.assemble_cells(fields, flat, frame_idx, 9, got, threads=threads)
        for f in fields:
            assert got[f.key].dtype == want[f.key].dtype and got[f.key].shape == want[f.key].shape
            assert torch.equal(got[f.key].view(torch.uint8) if f.dtype != torch.uint8 else got[f.key],
                               want[f.key].view(torch.uint8) if f.dtype != torch.uint8 else want[f.key])
    frame_idx[4, 2] = 50  # one past the decoded frames
    with pytest.raises(AssertionError, match="frame index"):
        read.assemble_cells(fields, flat, frame_idx, 9, {}, threads=2)
