"""The Atari fixtures hold real ALE frames in TorchRL's layout.

Everything else in the test suite trusts these fixtures to look like a TorchRL collector's
output on Atari (frame stacks that share frames, next observations equal to the following
observations, episode boundaries with reset stacks), so these tests pin that down.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tiered.atari import (
    AtariFrames,
    cached_rollout,
    concat_rollouts,
    load_fixture,
    rollout,
    rollout_frames,
    save_fixture,
)

FIXTURE_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "atari_frames.npz"
# The arguments the fixtures in conftest.py are built with (kept in sync by test_fixture_sizes).
PONG_ARGS = {"game": "Pong", "steps": 2000, "seed": 0, "max_episode_steps": 500}
MSPACMAN_ARGS = {"game": "MsPacman", "steps": 2000, "seed": 1}
RAW_ARGS = {"game": "Pong", "steps": 300, "seed": 0, "raw": True}


def _same_episode_as_next(td: TensorDict) -> torch.Tensor:
    """Bool [n - 1]: transition t and t + 1 belong to the same episode."""
    ids = td["collector", "traj_ids"]
    return ids[1:] == ids[:-1]


def _episode_starts(td: TensorDict) -> torch.Tensor:
    """Indices of the first transition of each episode."""
    ids = td["collector", "traj_ids"]
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    return first.nonzero().squeeze(1)


@pytest.fixture(scope="module", params=["atari_pong", "atari_mspacman", "atari_raw", "atari_mixed"])
def any_atari(request: pytest.FixtureRequest) -> TensorDict:
    return request.getfixturevalue(request.param)


def test_layout_shapes_and_dtypes(any_atari: TensorDict) -> None:
    td = any_atari
    n = td.batch_size[0]
    expected = {
        "observation": (torch.uint8, (n, 4, 84, 84)),
        ("next", "observation"): (torch.uint8, (n, 4, 84, 84)),
        "action": (torch.int64, (n,)),
        ("collector", "traj_ids"): (torch.int64, (n,)),
        ("next", "reward"): (torch.float32, (n, 1)),
    }
    for flag in ("done", "terminated", "truncated"):
        expected[flag] = (torch.bool, (n, 1))
        expected[("next", flag)] = (torch.bool, (n, 1))
    for key, (dtype, shape) in expected.items():
        assert td[key].dtype == dtype, key
        assert tuple(td[key].shape) == shape, key


def test_fixture_sizes(atari_pong, atari_mspacman, atari_raw, atari_mixed) -> None:
    assert atari_pong.batch_size == torch.Size([PONG_ARGS["steps"]])
    assert atari_mspacman.batch_size == torch.Size([MSPACMAN_ARGS["steps"]])
    assert atari_raw.batch_size == torch.Size([RAW_ARGS["steps"]])
    assert atari_mixed.batch_size == torch.Size([PONG_ARGS["steps"] + MSPACMAN_ARGS["steps"]])


def test_frames_are_real_and_change(any_atari: TensorDict) -> None:
    newest = any_atari["observation"][:, -1]
    # Real screens use many grey levels and are not blank.
    assert newest.unique().numel() >= 8
    assert newest.float().std() > 5
    # The ball / sprites move: most consecutive screens differ.
    changed = (newest[1:] != newest[:-1]).flatten(1).any(1)
    assert changed.float().mean() > 0.5


def test_next_observation_is_following_observation(any_atari: TensorDict) -> None:
    td = any_atari
    same = _same_episode_as_next(td)
    assert torch.equal(td["next", "observation"][:-1][same], td["observation"][1:][same])
    # Across an episode boundary the next state is the final screen, not the reset stack.
    nxt_end = td["next", "observation"][:-1][~same]
    obs_start = td["observation"][1:][~same]
    assert (nxt_end != obs_start).flatten(1).any(1).all()


def test_stacks_share_frames(any_atari: TensorDict) -> None:
    td = any_atari
    obs, nxt = td["observation"], td["next", "observation"]
    # A next stack is the current one shifted by one frame, with the new screen appended.
    assert torch.equal(nxt[:, :-1], obs[:, 1:])
    same = _same_episode_as_next(td)
    assert torch.equal(obs[1:][same][:, :-1], obs[:-1][same][:, 1:])


def test_stacks_restart_at_episode_start(any_atari: TensorDict) -> None:
    td = any_atari
    starts = _episode_starts(td)
    assert starts[0] == 0
    if td.batch_size[0] > 1000:
        assert starts.numel() >= 2, "expected several episodes in the 2000-step fixtures"
    first = td["observation"][starts]
    # The reset stack is four copies of the reset screen (padding_type="reset").
    assert torch.equal(first, first[:, :1].expand_as(first))
    # After the first step, three copies of the reset screen and the new screen.
    nxt = td["next", "observation"][starts]
    assert torch.equal(nxt[:, :3], first[:, :3])
    # Further into an episode, stacks hold distinct screens again.
    later = td["observation"][starts[starts + 10 < td.batch_size[0]] + 10]
    assert (later[:, 0] != later[:, -1]).flatten(1).any(1).all()


def test_done_flags_match_episode_boundaries(any_atari: TensorDict) -> None:
    td = any_atari
    done = td["next", "done"].squeeze(1)
    assert torch.equal(done, (td["next", "terminated"] | td["next", "truncated"]).squeeze(1))
    # A done step is always followed by a new episode. A new episode is preceded by a done
    # step, except where two rollouts were concatenated (atari_mixed): there the first game's
    # last episode was cut by the step budget, as a collector's batch cuts trajectories.
    change = ~_same_episode_as_next(td)
    assert not (done[:-1] & ~change).any()
    assert int((change & ~done[:-1]).sum()) <= 1
    # TorchRL's root flags are False on stored steps.
    for flag in ("done", "terminated", "truncated"):
        assert not td[flag].any()


def test_single_game_episodes_end_with_done(atari_pong: TensorDict, atari_mspacman: TensorDict) -> None:
    for td in (atari_pong, atari_mspacman):
        assert torch.equal(td["next", "done"].squeeze(1)[:-1], ~_same_episode_as_next(td))


def test_pong_truncates_at_time_limit(atari_pong: TensorDict) -> None:
    truncated = atari_pong["next", "truncated"].squeeze(1)
    assert truncated.any()
    # Each truncation ends an episode of exactly max_episode_steps transitions.
    ends = truncated.nonzero().squeeze(1)
    lengths = torch.bincount(atari_pong["collector", "traj_ids"])
    ids = atari_pong["collector", "traj_ids"][ends]
    assert (lengths[ids] == PONG_ARGS["max_episode_steps"]).all()


def test_mspacman_terminates_by_game_over(atari_mspacman: TensorDict) -> None:
    assert atari_mspacman["next", "terminated"].any()
    assert not atari_mspacman["next", "truncated"].any()


def test_terminated_and_truncated_both_present(atari_mixed: TensorDict) -> None:
    assert atari_mixed["next", "terminated"].any()
    assert atari_mixed["next", "truncated"].any()


def test_rewards_are_game_scores(atari_pong: TensorDict, atari_mspacman: TensorDict) -> None:
    pong = atari_pong["next", "reward"]
    assert set(pong.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert (pong == -1).any(), "a random Pong player concedes points"
    assert (atari_mspacman["next", "reward"] > 0).any(), "MsPacman eats pellets"


def test_actions_cover_action_space(atari_pong: TensorDict, atari_mspacman: TensorDict) -> None:
    assert set(atari_pong["action"].unique().tolist()) == set(range(6))
    assert set(atari_mspacman["action"].unique().tolist()) == set(range(9))


def test_mixed_keeps_episode_ids_distinct(atari_mixed, atari_pong, atari_mspacman) -> None:
    n = atari_pong.batch_size[0]
    ids = atari_mixed["collector", "traj_ids"]
    assert set(ids[:n].tolist()).isdisjoint(ids[n:].tolist())
    assert ids.unique().numel() == (
        atari_pong["collector", "traj_ids"].unique().numel()
        + atari_mspacman["collector", "traj_ids"].unique().numel()
    )
    assert torch.equal(atari_mixed["observation"][n:], atari_mspacman["observation"])
    # The second game's ids are shifted past the first's; the input fixtures are not modified.
    shift = int(atari_pong["collector", "traj_ids"].max()) + 1
    assert torch.equal(ids[n:], atari_mspacman["collector", "traj_ids"] + shift)
    assert atari_mspacman["collector", "traj_ids"][0] == 0


def test_raw_pixels(atari_raw: TensorDict, atari_pong: TensorDict) -> None:
    n = atari_raw.batch_size[0]
    pixels, nxt = atari_raw["pixels"], atari_raw["next", "pixels"]
    assert pixels.dtype == torch.uint8 and tuple(pixels.shape) == (n, 210, 160, 3)
    assert tuple(nxt.shape) == (n, 210, 160, 3)
    same = _same_episode_as_next(atari_raw)
    assert torch.equal(nxt[:-1][same], pixels[1:][same])
    # Colour screens: the channels are not all equal.
    assert (pixels[..., 0] != pixels[..., 1]).any()
    # Recording raw screens does not change the grayscale stacks (same seed, no episode end
    # within 300 steps for either), and those are the luminance of the raw screens.
    assert torch.equal(atari_raw["observation"], atari_pong["observation"][:n])
    lum = (pixels.float() * torch.tensor([0.299, 0.587, 0.114])).sum(-1)
    small = torch.nn.functional.interpolate(lum.unsqueeze(1), size=(84, 84), mode="area").squeeze(1)
    diff = (small - atari_raw["observation"][:, -1].float()).abs()
    assert diff.max() <= 2


def test_same_seed_same_data_other_seed_other_data(atari_pong: TensorDict) -> None:
    a = rollout("Pong", steps=120, seed=0, max_episode_steps=PONG_ARGS["max_episode_steps"])
    b = rollout("Pong", steps=120, seed=0, max_episode_steps=PONG_ARGS["max_episode_steps"])
    assert (a == b).all()
    # A fresh replay matches the cached fixture, so the cache serves what the emulator plays.
    assert (a == atari_pong[:120]).all()
    c = rollout("Pong", steps=120, seed=7, max_episode_steps=PONG_ARGS["max_episode_steps"])
    assert not torch.equal(a["action"], c["action"])
    assert not torch.equal(a["observation"], c["observation"])


def test_stack_and_size_arguments() -> None:
    td = rollout("Breakout", steps=60, seed=3, stack=2, size=64, max_episode_steps=25)
    assert tuple(td["observation"].shape) == (60, 2, 64, 64)
    assert torch.equal(td["next", "observation"][:, :1], td["observation"][:, 1:])
    assert td["next", "truncated"].squeeze(1).nonzero().squeeze(1).tolist() == [24, 49]


def test_compact_frames_store_each_screen_once() -> None:
    fr = rollout_frames("Pong", steps=50, seed=0, max_episode_steps=20)
    # One screen per transition plus one reset screen per episode after the first.
    assert fr.frames.shape == (50 + 3, 84, 84)
    assert fr.traj_ids.tolist() == [0] * 20 + [1] * 20 + [2] * 10
    assert fr.first_frame.tolist() == [0] * 20 + [21] * 20 + [42] * 10
    obs_index, next_index = fr.stack_index(4)
    assert obs_index[0].tolist() == [0, 0, 0, 0]
    assert obs_index[21].tolist() == [21, 21, 21, 22]
    assert next_index[19].tolist() == [17, 18, 19, 20]


def test_cached_rollout_roundtrip(tmp_path: Path) -> None:
    args = {"game": "Pong", "steps": 80, "seed": 2, "max_episode_steps": 30}
    first = cached_rollout(**args, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))
    mtime = files[0].stat().st_mtime_ns
    second = cached_rollout(**args, cache_dir=tmp_path)
    assert files[0].stat().st_mtime_ns == mtime, "second call must read, not rewrite"
    assert (first == second).all()
    assert (second == rollout(**args)).all()
    # Another stack size is served from the same file (stacks are rebuilt at load).
    two = cached_rollout(**args, stack=2, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    assert torch.equal(two["observation"], first["observation"][:, 2:])
    # Other arguments get another file.
    cached_rollout(**{**args, "seed": 3}, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 2


def test_cached_rollout_replaces_damaged_file(tmp_path: Path) -> None:
    args = {"game": "Pong", "steps": 40, "seed": 0}
    good = cached_rollout(**args, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"not an npz")
    again = cached_rollout(**args, cache_dir=tmp_path)
    assert (again == good).all()
    with np.load(path) as data:
        assert "frames" in data.files


def test_save_and_load_fixture(tmp_path: Path) -> None:
    pong = rollout_frames("Pong", steps=40, seed=0, raw=True)
    pac = rollout_frames("MsPacman", steps=30, seed=1, max_episode_steps=12, raw=True)
    path = tmp_path / "fx.npz"
    save_fixture(path, {"Pong": pong, "MsPacman": pac})
    td = load_fixture(path, pixels=True)
    expected = concat_rollouts([pong.to_tensordict(), pac.to_tensordict()])
    assert (td == expected).all()
    assert tuple(td["pixels"].shape) == (70, 210, 160, 3)
    assert "pixels" not in load_fixture(path).keys(), "raw screens are opt-in"
    only = load_fixture(path, games=["MsPacman"], stack=3)
    assert "pixels" not in only.keys()
    assert (only == pac.to_tensordict(3).exclude("pixels", ("next", "pixels"))).all()
    with pytest.raises(KeyError, match="Breakout"):
        load_fixture(path, games=["Breakout"])


def test_frames_roundtrip_through_npz_dict() -> None:
    fr = rollout_frames("Pong", steps=10, seed=0)
    back = AtariFrames.from_npz(fr.to_npz_dict(prefix="x/"), prefix="x/")
    assert back.pixels is None
    assert (back.to_tensordict() == fr.to_tensordict()).all()
    with pytest.raises(KeyError, match="frames"):
        AtariFrames.from_npz({"x/action": fr.action}, prefix="x/")


def test_benchmark_fixture_file_loads_without_replaying() -> None:
    if not FIXTURE_FILE.exists():
        pytest.skip(f"{FIXTURE_FILE} not generated; run benchmarks/make_fixture.py")
    td = load_fixture(FIXTURE_FILE)
    assert td["observation"].dtype == torch.uint8 and td["observation"].shape[1:] == (4, 84, 84)
    ids = td["collector", "traj_ids"]
    done = td["next", "done"].squeeze(1)
    assert not (done[:-1] & (ids[1:] == ids[:-1])).any()
    assert td["next", "terminated"].any()
    # Each game's rollout is played from a reset: stacks start as four reset screens.
    assert torch.equal(td["observation"][0], td["observation"][0, :1].expand(4, 84, 84))


def test_missing_ale_py_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import ale_py` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, "ale_py", None)
    with pytest.raises(ImportError, match=r"pip install 'tiered\[atari\]'"):
        rollout("Pong", steps=5)
