"""Shared pytest configuration: markers and real Atari data fixtures.

The Atari fixtures are played once per machine with ale-py and then read from the cache
(``$TIERED_CACHE`` or ``~/.cache/tiered/atari``, see :func:`tiered.atari.cached_rollout`), so a
clean machine builds them in a few seconds and later runs load them in well under a second.
Without ale-py and without a cache file, tests that use them are skipped with the install hint.
"""

from __future__ import annotations

import pytest
import torch
from _commit_check import check_commits
from tensordict import TensorDict

from tiered.atari import cached_rollout, concat_rollouts

# every commit of the tests checks that its incremental writes left each array file equal to memory
check_commits()

# Arguments of each fixture, kept here so tests can check properties against them.
PONG_ARGS = {"game": "Pong", "steps": 2000, "seed": 0, "max_episode_steps": 500}
# MsPacman has no time limit here: with a random policy it loses its three lives in ~500 steps,
# so 2000 steps hold several natural game overs (`terminated`), unlike the truncated Pong ones.
MSPACMAN_ARGS = {"game": "MsPacman", "steps": 2000, "seed": 1}
RAW_ARGS = {"game": "Pong", "steps": 300, "seed": 0, "raw": True}


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated so the markers exist under any rootdir/ini.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running; excluded from CI with -m 'not slow'")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


def _atari(**kwargs: object) -> TensorDict:
    try:
        return cached_rollout(**kwargs)  # type: ignore[arg-type]
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def atari_pong() -> TensorDict:
    """Pong, 2000 transitions, seed 0, episodes truncated every 500 steps."""
    return _atari(**PONG_ARGS)


@pytest.fixture(scope="session")
def atari_mspacman() -> TensorDict:
    """MsPacman, 2000 transitions, seed 1, episodes end by game over (terminated)."""
    return _atari(**MSPACMAN_ARGS)


@pytest.fixture(scope="session")
def atari_raw() -> TensorDict:
    """Pong, 300 transitions, with raw 210x160x3 RGB ``pixels`` and ``("next", "pixels")``."""
    return _atari(**RAW_ARGS)


@pytest.fixture(scope="session")
def atari_mixed(atari_pong: TensorDict, atari_mspacman: TensorDict) -> TensorDict:
    """Pong then MsPacman, 4000 transitions, episode ids distinct across the two games."""
    return concat_rollouts([atari_pong, atari_mspacman])
