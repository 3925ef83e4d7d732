"""The first write's warning about fields stored far larger than they need to be
(:class:`tiered.errors.LowCompressionWarning`), on real Atari frames."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from tiered import TieredStore
from tiered.engine.advice import ADVICE_MIN_RATIO, DOCS_PAGE
from tiered.errors import LowCompressionWarning, TieredWarning
from tiered.torchrl import TieredStorage

ROWS = 256


def _caught(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, TieredWarning)]


def _normalized_after_stacking(td: TensorDict) -> TensorDict:
    """Float stacks scaled per row after stacking, as VecNorm after CatFrames gives them: the same
    frame differs bit for bit between consecutive stacks, and ("next", X) is X one row later."""
    obs = td["observation"].float() / 255
    scale = 1 + torch.arange(obs.shape[0] + 1, dtype=torch.float32)[:, None, None, None] * 1e-3
    nxt = torch.cat([obs[1:], td["next", "observation"][-1:].float() / 255])
    out = td.clone()
    out["observation"] = obs / scale[:-1]
    out["next", "observation"] = nxt / scale[1:]
    return out


def test_float_stacks_normalized_after_stacking_warn_once_naming_field_ratio_and_page(atari_pong):
    td = _normalized_after_stacking(atari_pong[:ROWS])
    store = TieredStore(2 * ROWS)
    caught = _caught(lambda: store.extend(td))
    assert [w.category for w in caught] == [LowCompressionWarning]
    message = str(caught[0].message)
    assert "'observation'" in message and DOCS_PAGE in message and "VecNorm" in message
    assert "x (measured on the last 32 rows of the first write" in message
    assert store.options["frames"] == {}  # indeed not detected
    # the warning changes nothing: the rows read back exactly, and later writes are quiet
    assert torch.equal(store.get(torch.arange(ROWS))["observation"], td["observation"])
    assert _caught(lambda: store.extend(_normalized_after_stacking(atari_pong[ROWS:2 * ROWS]))) == []


def test_the_torchrl_plain_swap_warns_once(atari_pong):
    rb = TensorDictReplayBuffer(storage=TieredStorage(4 * ROWS), batch_size=32)
    caught = _caught(lambda: [rb.extend(_normalized_after_stacking(atari_pong[s:s + ROWS]))
                              for s in range(0, 3 * ROWS, ROWS)])
    assert len(caught) == 1 and "'observation'" in str(caught[0].message)
    # it points at the caller's line, not at TorchRL's or tiered's
    assert caught[0].filename == __file__
    assert rb.sample()["observation"].dtype == torch.float32


def test_incompressible_large_field_warns_with_its_ratio():
    noise = TensorDict({"x": torch.randint(0, 256, (64, 4096), dtype=torch.uint8),
                        "r": torch.zeros(64)}, [64])
    caught = _caught(lambda: TieredStore(64).extend(noise))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'x'" in message and "4,096 bytes per row" in message and "codec='raw'" in message
    ratio = float(message.split(" is stored at ")[1].split("x")[0])
    assert 0.9 < ratio < ADVICE_MIN_RATIO


def test_network_features_stored_beside_the_frames_are_advised_to_be_left_out(atari_pong):
    """TorchRL's PPO Atari example stores what its collector's actor-critic wrote: besides the
    frames, the shared trunk's ReLU features ("common_features", float32 [512]), which
    ClipPPOLoss recomputes from the pixels. They compress about 2x: the warning names the remedy
    that fits a float vector (leave it out of what is stored), not the pixel or noise advice."""
    from torchrl.modules import MLP, ConvNet

    torch.manual_seed(0)
    td = atari_pong[:ROWS]
    trunk = torch.nn.Sequential(
        ConvNet(activation_class=torch.nn.ReLU, num_cells=[32, 64, 64], kernel_sizes=[8, 4, 3], strides=[4, 2, 1]),
        MLP(in_features=3136, out_features=512, num_cells=[], activation_class=torch.nn.ReLU, activate_last_layer=True))
    with torch.no_grad():
        td["common_features"] = trunk(td["observation"].float() / 255)
    rb = TensorDictReplayBuffer(storage=TieredStorage(2 * ROWS), batch_size=32)
    caught = _caught(lambda: rb.extend(td))
    assert [w.category for w in caught] == [LowCompressionWarning]
    message = str(caught[0].message)
    assert "'common_features'" in message and "2,048 bytes per row" in message
    assert "Pixels:" not in message  # not pixels: uint8 frames scaled in the network do not apply
    assert "exclude('common_features')" in message  # what to do: leave it out if nothing reads it
    assert caught[0].filename == __file__
    assert torch.equal(rb[:]["common_features"], td["common_features"])


def test_uint8_atari_stacks_do_not_warn(atari_pong):
    assert _caught(lambda: TieredStore(ROWS).extend(atari_pong[:ROWS])) == []


def test_float_stacks_that_still_share_frames_do_not_warn(atari_pong):
    td = atari_pong[:ROWS].clone()
    td["observation"] = td["observation"].float() / 255  # scaled per frame: stacks still shift
    td["next", "observation"] = td["next", "observation"].float() / 255
    store = TieredStore(ROWS)
    assert _caught(lambda: store.extend(td)) == []
    assert store.options["frames"] == {("observation",): 0}


def test_random_data_declared_raw_does_not_warn():
    noise = TensorDict({"x": torch.randint(0, 256, (64, 4096), dtype=torch.uint8)}, [64])
    assert _caught(lambda: TieredStore(64, codec="raw").extend(noise)) == []


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_small_fields_do_not_warn(dtype):
    cells = torch.randint(0, 256, (64, 255), dtype=torch.uint8).to(dtype)  # < 1 KiB per row either way
    td = TensorDict({"x": cells, "next": {"x": torch.cat([cells[1:], cells[:1]])}}, [64])
    assert _caught(lambda: TieredStore(64, blob_min_bytes=128).extend(td)) == []



def test_an_empty_first_write_is_not_judged():
    store = TieredStore(8)
    assert _caught(lambda: store.extend(TensorDict({"x": torch.zeros(0, 4096, dtype=torch.uint8)}, [0]))) == []
    assert len(store) == 0
