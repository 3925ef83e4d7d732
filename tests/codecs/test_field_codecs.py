"""Per frame family: the time-chunk length follows the frame size, and data that does not compress
is stored raw.

TorchRL's DQN Atari example stores float32 ``[4, 84, 84]`` stacks normalized after stacking
(VecNorm after CatFrames): no two stacks share a frame, so a whole 113 kB stack is one frame, and
chunks of 8 such frames made a sampled row decode 8 stacks. With ``chunk_frames`` left to the
store, a family takes as many frames per chunk as fit 64 KiB (at most 8): 8 for 84x84 uint8
frames, 1 for such stacks. A family whose first encoded chunks compress less than 1.5x (noise,
already-compressed bytes) is stored raw from then on. These tests show that:

* the chunk lengths and codec choices are what the frames ask for, saved in the manifest's
  ``families`` and kept at reopen (an explicit ``chunk_frames`` is honoured);
* real Atari frames and VecNorm'd stacks of them stay compressed; noise is stored raw, and reads,
  transport (open chunks sealed with the family's codec) and verify work on it;
* the choice is part of the write that makes it (a failed first write leaves it to be made);
* a family entry that does not fit the schema is damage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_td_equal, edit_manifest, flip_blob_byte, manifest_body
from tensordict import TensorDict

import tiered
from tiered import TieredStore
from tiered.codecs import RawCodec
from tiered.engine.transport import decode_rows
from tiered.errors import CorruptionError, StorageFullError
from tiered.testing import parts
from tiered.testing.faults import inject_faults
from tiered.verify import verify_store


def normalized_stacks(atari: TensorDict, n: int) -> TensorDict:
    """Real frames as TorchRL's DQN buffer gets them: float stacks normalized after stacking with
    statistics that change every step (no two stacks share a frame's bytes)."""
    obs = atari["observation"][:n + 1].float() / 255.0
    scale = 1.0 + torch.arange(n + 1, dtype=torch.float32).reshape(-1, 1, 1, 1) * 1e-3
    norm = (obs - 0.3) / scale
    return TensorDict({"pixels": norm[:n], ("next", "pixels"): norm[1:n + 1], "action": atari["action"][:n],
                       ("next", "done"): atari["next", "done"][:n]}, [n])


def test_chunk_length_follows_the_frame_size(atari_pong, tmp_path):
    data = normalized_stacks(atari_pong, 64)
    with TieredStore(128, tmp_path / "f", stage_rows=0) as s:
        s.extend(data)
        assert_td_equal(s.get(slice(0, 64)), data)
        assert s.stats()["fields"]["pixels"]["compression_factor"] > 1.5  # compressed, not raw
    [family] = manifest_body(tmp_path / "f")["families"]
    assert family == {"frame_nbytes": 4 * 84 * 84 * 4, "chunk_frames": 1, "stored_raw": False}
    assert manifest_body(tmp_path / "f")["options"]["chunk_frames_auto"] is True
    with TieredStore(128, tmp_path / "u", stage_rows=0) as s:  # uint8 stacks: frames found, 8 per chunk
        s.extend(atari_pong[:64])
    assert manifest_body(tmp_path / "u")["families"] == [{"frame_nbytes": 84 * 84, "chunk_frames": 8,
                                                         "stored_raw": False}]
    with TieredStore(128, tmp_path / "k", stage_rows=0, chunk_frames=4) as s:  # asked for: honoured
        s.extend(data)
    assert manifest_body(tmp_path / "k")["families"][0]["chunk_frames"] == 4
    with tiered.open(tmp_path / "f", mode="r+") as s:  # reopened: the saved length, for new rows too
        assert parts(s).layout.families[0].chunk_frames == 1
        s.extend(data[:8])
        assert_td_equal(s.get(slice(64, 72)), data[:8])
    assert verify_store(tmp_path / "f", progress=False).ok


def test_noise_is_stored_raw_and_read_back_everywhere(tmp_path):
    rng = np.random.default_rng(1)
    n = 40
    x = torch.from_numpy(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))  # 3 KiB cells, no stacks
    data = TensorDict({"x": x, "a": torch.arange(n)}, [n])
    path = tmp_path / "s"
    with TieredStore(64, path, stage_rows=0, frames={}) as s:
        s.extend(data)
        p = parts(s)
        fam = p.layout.families[0]
        assert fam.stored_raw is True and fam.chunk_frames == 8
        ids = p.index.live_ids()
        stored = ids[p.index.state[ids] == 2]
        assert stored.size and (p.index.codec[stored] == RawCodec.format_id).all()
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:16]
        assert_td_equal(s.get(idx), data[idx])
        assert_td_equal(s.get(slice(0, n)), data)
        # an open chunk (no episode end yet) is sealed with the family's codec for transport
        packed = s.get_compressed(np.arange(n))
        assert_td_equal(decode_rows(packed), data)
    assert manifest_body(path)["families"][0]["stored_raw"] is True
    with tiered.open(path, mode="r") as s:
        assert_td_equal(s.get(slice(0, n)), data)
    assert verify_store(path, progress=False).ok


def test_atari_frames_stay_compressed(atari_pong):
    s = TieredStore(256, stage_rows=0)
    s.extend(atari_pong[:200])
    assert parts(s).layout.families[0].stored_raw is False
    assert s.stats()["fields"]["observation"]["compression_factor"] > 4


def test_the_choice_is_part_of_the_write_that_makes_it(tmp_path):
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.integers(0, 256, (16, 4096), dtype=np.uint8))
    data = TensorDict({"x": x}, [16])
    s = TieredStore(32, tmp_path / "s", stage_rows=0, warm_bytes=0, hot_bytes=0)
    with inject_faults(enospc_on=1), pytest.raises(StorageFullError):
        s.extend(data)  # the blobs cannot be written
    assert len(s) == 0 and parts(s).layout.families[0].stored_raw is None
    s.extend(data)
    assert parts(s).layout.families[0].stored_raw is True
    assert_td_equal(s.get(slice(0, 16)), data)
    s.close()


@pytest.mark.parametrize("entry, value", [("stored_raw", "yes"), ("chunk_frames", 0), ("frame_nbytes", 3)])
def test_a_family_entry_that_does_not_fit_is_damage(atari_pong, tmp_path, entry, value):
    path = tmp_path / "s"
    with TieredStore(64, path, stage_rows=0) as s:
        s.extend(atari_pong[:16])
    edit_manifest(path, lambda body: body["families"][0].__setitem__(entry, value))
    for mode in ("r", "r+"):
        with pytest.raises(CorruptionError, match="family entry"):
            tiered.open(path, mode=mode)


def test_one_blob_cells_decode_straight_into_new_results(atari_pong):
    # Stacks that share no frame are one blob per cell (chunk length 1): a get decodes each cell
    # straight into its result. Results are exact with repeated rows and with rows whose
    # ("next", "pixels") is the next row's "pixels" (one blob, decoded for both), never reused
    # by a later get, and staged rows are merged in.
    data = normalized_stacks(atari_pong, 48)
    s = TieredStore(64, stage_rows=4)
    s.extend(data[:40])
    p = parts(s)
    assert p.layout.families[0].chunk_frames == 1 and p.layout.schema["pixels"].frames_per_row == 1
    idx = torch.tensor([5, 6, 6, 39, 0, 5, 38])
    first = s.get(idx)
    assert_td_equal(first, data[idx])
    assert_td_equal(s.get(torch.tensor([1, 2, 3, 4, 7, 8, 9])), data[torch.tensor([1, 2, 3, 4, 7, 8, 9])])
    assert_td_equal(first, data[idx])  # the second get wrote somewhere else
    s.extend(data[40:41])  # a small write: staged
    mixed = torch.tensor([40, 3, 40, 39])
    assert_td_equal(s.get(mixed), data[mixed])
    assert_td_equal(s.get(slice(0, 41)), data[:41])


def test_one_blob_cells_are_checked_before_use(atari_pong):
    from tiered.engine.blob_index import WARM
    from tiered.errors import ChecksumError

    data = normalized_stacks(atari_pong, 16)
    s = TieredStore(32, stage_rows=0)
    s.extend(data)
    p = parts(s)
    blob = int(p.layout.blob_refs([p.layout.schema["pixels"]], np.array([3]))[0][0, 0])
    assert p.index.loc[blob, WARM] >= 0
    flip_blob_byte(s, blob, WARM)
    with pytest.raises(ChecksumError):
        s.get([3])
    assert_td_equal(s.get([0, 8, 15]), data[torch.tensor([0, 8, 15])])


def test_one_blob_cells_of_a_raw_family_decode_straight_into_new_results():
    # Noise in cells too large to share a chunk: stored raw, one blob per cell, read with the
    # raw codec straight into the result.
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.integers(0, 256, (24, 70_000), dtype=np.uint8))
    data = TensorDict({"x": x, "a": torch.arange(24)}, [24])
    s = TieredStore(32, stage_rows=0, frames={})
    s.extend(data)
    fam = parts(s).layout.families[0]
    assert fam.stored_raw is True and fam.chunk_frames == 1
    idx = torch.tensor([7, 0, 23, 7, 12])
    assert_td_equal(s.get(idx), data[idx])
