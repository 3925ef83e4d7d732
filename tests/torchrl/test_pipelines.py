"""TorchRL's own DQN Atari pipeline (examples/torchrl_dqn_atari.py) on TieredStorage: the recipe's
uint8 frames are found as stacks and stored small; TorchRL's float pipeline as shipped gets the
warning. Real ALE frames through TorchRL's real transforms."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrl")
pytest.importorskip("torchvision", reason="TorchRL's Resize needs torchvision: pip install 'tiered[pipelines]'")
pytest.importorskip("ale_py")

from torchrl.data import TensorDictReplayBuffer  # noqa: E402

from tiered.errors import LowCompressionWarning  # noqa: E402
from tiered.torchrl import TieredStorage  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrl_dqn_atari.py"
STEPS = 48


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("torchrl_dqn_atari", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rollout(example, uint8: bool):
    torch.manual_seed(0)
    env = example.make_env(uint8=uint8)
    env.set_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # VecNorm's deprecation notice
        data = env.rollout(STEPS, break_when_any_done=False)
    env.close()
    return data


def _fill(data) -> tuple[TensorDictReplayBuffer, list[warnings.WarningMessage]]:
    rb = TensorDictReplayBuffer(storage=TieredStorage(4 * STEPS), batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rb.extend(data[: STEPS // 2])
        rb.extend(data[STEPS // 2:])
    return rb, [w for w in caught if issubclass(w.category, LowCompressionWarning)]


def test_the_recipe_stores_uint8_stacks_frame_by_frame_without_a_warning(example):
    data = _rollout(example, uint8=True)
    assert data["pixels"].dtype == torch.uint8 and data["pixels"].shape[-3:] == (4, 84, 84)
    rb, caught = _fill(data)
    assert caught == []
    assert rb.storage.store.options["frames"] == {("pixels",): 0}
    assert torch.equal(rb.storage.get(torch.arange(STEPS))["pixels"], data["pixels"])
    # the network scales the frames itself: it takes the sampled uint8 batch as it is
    proof = example.make_env(uint8=True)
    model = example.make_dqn_model(proof, "cpu", uint8=True)
    proof.close()
    out = model(rb.sample())
    assert out["action_value"].dtype == torch.float32 and out["action_value"].shape[0] == 8


def test_torchrl_float_pipeline_as_shipped_warns_once(example):
    data = _rollout(example, uint8=False)
    assert data["pixels"].dtype == torch.float32
    rb, caught = _fill(data)
    assert len(caught) == 1 and "'pixels'" in str(caught[0].message) and "VecNorm" in str(caught[0].message)
    assert rb.storage.store.options["frames"] == {}
    assert torch.equal(rb.storage.get(torch.arange(STEPS))["pixels"], data["pixels"])


@pytest.mark.slow
def test_the_example_runs_its_loop_and_reports_bytes_per_transition(example, capsys):
    assert example.main(["--frames", "3200", "--init-random-frames", "1600", "--num-updates", "2",
                         "--buffer-size", "2000"]) == 0
    out = capsys.readouterr().out
    assert "bytes per transition" in out and "800 transitions" in out
