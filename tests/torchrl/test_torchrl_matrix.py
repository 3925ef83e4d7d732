"""TieredStorage against TorchRL's LazyTensorStorage: buffers x samplers x writers x sizes.

The oracle is ``LazyTensorStorage``: two buffers that differ only in their storage get the same
writes (with wrap-around) and the same seeds, and every sample, every ``rb[:]``, every length and
cursor must be identical. The data are real Atari transitions (4x84x84 frame stacks with next
observations) cut around an episode boundary, so slice samplers see two trajectories and the
frames that come back have to be the right ones.

The matrix is the style of TorchRL's ``test/rb/test_composable.py``:
{ReplayBuffer, TensorDictReplayBuffer, TensorDictPrioritizedReplayBuffer} x {RandomSampler,
SamplerWithoutReplacement, PrioritizedSampler, SliceSampler, SliceSamplerWithoutReplacement,
PrioritizedSliceSampler} x {RoundRobinWriter, TensorDictMaxValueWriter} x sizes {3, 5, 100}.

Combinations TorchRL itself rejects are not run; they are listed in ``EXCLUDED`` with the reason,
and ``test_excluded_combinations_are_rejected_by_torchrl`` checks that TorchRL does reject them.
Adapted configurations (``ADAPTED``) say how a combination is made runnable.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tensordict import TensorDictBase
from torchrl.data import (
    LazyTensorStorage,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictMaxValueWriter,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

from tiered.torchrl import TieredStorage

BUFFERS = ("ReplayBuffer", "TensorDictReplayBuffer", "TensorDictPrioritizedReplayBuffer")
SAMPLERS = ("RandomSampler", "SamplerWithoutReplacement", "PrioritizedSampler", "SliceSampler",
            "SliceSamplerWithoutReplacement", "PrioritizedSliceSampler")
WRITERS = ("RoundRobinWriter", "TensorDictMaxValueWriter")
SIZES = (3, 5, 100)
SLICE_SAMPLERS = {"SliceSampler", "SliceSamplerWithoutReplacement", "PrioritizedSliceSampler"}

# (buffer, sampler or None for all, writer or None for all) -> why TorchRL rejects it
_TDPRB = "TensorDictPrioritizedReplayBuffer"
_OWN_SAMPLER = "TensorDictPrioritizedReplayBuffer builds its own PrioritizedSampler (no sampler= argument)"
EXCLUDED = {
    **{(_TDPRB, s, None): _OWN_SAMPLER for s in SAMPLERS if s != "PrioritizedSampler"},
    (_TDPRB, None, "TensorDictMaxValueWriter"):
        "TensorDictPrioritizedReplayBuffer takes no writer= argument (it uses TensorDictRoundRobinWriter)",
}
ADAPTED = {
    "TensorDictPrioritizedReplayBuffer x PrioritizedSampler":
        "the buffer's own PrioritizedSampler (alpha=0.7, beta=0.9); priorities come from a td_error entry "
        "through update_tensordict_priority",
    "slice samplers": "slice_len 2 and batch 4 for sizes 3 and 5, slice_len 4 and batch 16 for size 100; "
        "strict_length=False, since a 3-row ring holds trajectories shorter than any useful slice; "
        "trajectories come from ('collector', 'traj_ids')",
    "TensorDictMaxValueWriter": "ranks by its default rank_key ('next', 'reward'), present in the Atari "
        "data; rows are written with extend only (add() stores an 'index' entry that extend() does not, "
        "so LazyTensorStorage would hold uninitialised 'index' values for the extended rows)",
    "prioritized samplers": "max_capacity = size; priorities updated after every sample with the same values",
}


def _excluded(buffer: str, sampler: str, writer: str) -> str | None:
    for (b, s, w), why in EXCLUDED.items():
        if b == buffer and s in (None, sampler) and w in (None, writer):
            return why
    return None


CASES = [c for c in itertools.product(BUFFERS, SAMPLERS, WRITERS, SIZES) if _excluded(*c[:3]) is None]


# ----------------------------------------------------------------------------------------
# Building twin buffers
# ----------------------------------------------------------------------------------------
def _slice_len(size: int) -> int:
    return 2 if size < 10 else 4


def _batch(size: int) -> int:
    return 4 if size < 10 else 16


def _make_sampler(name: str, size: int):
    sl = _slice_len(size)
    if name == "RandomSampler":
        return RandomSampler()
    if name == "SamplerWithoutReplacement":
        return SamplerWithoutReplacement()
    if name == "PrioritizedSampler":
        return PrioritizedSampler(max_capacity=size, alpha=0.7, beta=0.9)
    if name == "SliceSampler":
        return SliceSampler(slice_len=sl, strict_length=False, traj_key=("collector", "traj_ids"))
    if name == "SliceSamplerWithoutReplacement":
        return SliceSamplerWithoutReplacement(slice_len=sl, strict_length=False,
                                              traj_key=("collector", "traj_ids"))
    if name == "PrioritizedSliceSampler":
        return PrioritizedSliceSampler(max_capacity=size, alpha=0.7, beta=0.9, slice_len=sl,
                                       strict_length=False, traj_key=("collector", "traj_ids"))
    raise AssertionError(name)


def _make_writer(name: str):
    return RoundRobinWriter() if name == "RoundRobinWriter" else TensorDictMaxValueWriter()


def _make_rb(buffer: str, sampler: str, writer: str, size: int, storage):
    gen = torch.Generator().manual_seed(1234)
    if buffer == "TensorDictPrioritizedReplayBuffer":
        return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.9, storage=storage,
                                                 batch_size=_batch(size), generator=gen)
    cls = ReplayBuffer if buffer == "ReplayBuffer" else TensorDictReplayBuffer
    return cls(storage=storage, sampler=_make_sampler(sampler, size), writer=_make_writer(writer),
               batch_size=_batch(size), generator=gen)


# ----------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------
def _key_names(td: TensorDictBase) -> list[str]:
    return sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))


def assert_same(got, want, what: str) -> None:
    """Same keys and bit-identical leaves (or equal tensors)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), what
        return
    assert _key_names(got) == _key_names(want), f"{what}: keys differ"
    assert got.batch_size == want.batch_size, f"{what}: batch {got.batch_size} != {want.batch_size}"
    for key in want.keys(include_nested=True, leaves_only=True):
        a, b = got.get(key), want.get(key)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{what}: {key} is {a.dtype}{list(a.shape)}"
        assert torch.equal(a, b), f"{what}: values of {key} differ"


def _same_outcome(fn_tiered, fn_oracle, what: str):
    """Run both; they must both succeed (returning results) or raise the same error."""
    try:
        want = fn_oracle()
    except Exception as e:  # noqa: BLE001 - the oracle decides what is an error
        with pytest.raises(type(e)):
            fn_tiered()
        return None, None
    return fn_tiered(), want


def _window(data: TensorDictBase, center: int, n: int) -> TensorDictBase:
    lo = max(0, min(center - n // 2, data.shape[0] - n))
    return data[lo:lo + n]


def _first_boundary(data: TensorDictBase) -> int:
    done = data.get(("next", "done")).reshape(-1)
    return int(done.nonzero()[0, 0]) + 1


@pytest.fixture(scope="module")
def windows(atari_pong, atari_mspacman, atari_mixed):
    """Per size, 2*size+2 real transitions spanning an episode boundary (so the ring wraps)."""
    return {
        3: _window(atari_pong, _first_boundary(atari_pong), 2 * 3 + 2),          # truncated episode
        5: _window(atari_mspacman, _first_boundary(atari_mspacman), 2 * 5 + 2),  # game over
        100: _window(atari_mixed, atari_pong.shape[0], 2 * 100 + 2),            # Pong -> MsPacman
    }


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    sched = [1, 3, 2, 4] if size < 10 else [7, 30, 1, 64, 13, 50, 37]
    out, lo = [], 0
    for step in itertools.cycle(sched):
        if lo >= n:
            return out
        out.append((lo, min(n, lo + step)))
        lo += step


def _update_priorities(rb, sample, info, buffer: str) -> None:
    # deterministic priorities derived from the sample, identical for both buffers
    idx = info["index"] if isinstance(info["index"], torch.Tensor) else info["index"][0]
    idx = idx.reshape(-1)
    prio = (idx % 7).float() * 0.3 + 0.05
    if buffer == "TensorDictPrioritizedReplayBuffer":
        sample.set("td_error", prio)
        rb.update_tensordict_priority(sample)
    else:
        rb.update_priority(idx, prio)


# ----------------------------------------------------------------------------------------
# The matrix
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("buffer,sampler,writer,size", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_matches_lazy_tensor_storage(windows, buffer, sampler, writer, size):
    data = windows[size]
    tiered_rb = _make_rb(buffer, sampler, writer, size, TieredStorage(size, frames={"observation": 0}))
    oracle_rb = _make_rb(buffer, sampler, writer, size, LazyTensorStorage(size))
    prioritized = "Prioritized" in sampler or buffer == "TensorDictPrioritizedReplayBuffer"
    n_samples = 0
    for step, (lo, hi) in enumerate(_chunks(data.shape[0], size)):
        if step == 0 and writer == "RoundRobinWriter":
            # one row through add(): an int cursor
            assert tiered_rb.add(data[lo]) == oracle_rb.add(data[lo])
            lo += 1
            if lo == hi:
                continue
        got_idx = tiered_rb.extend(data[lo:hi])
        want_idx = oracle_rb.extend(data[lo:hi])
        assert torch.equal(torch.as_tensor(got_idx), torch.as_tensor(want_idx))
        assert len(tiered_rb) == len(oracle_rb)
        assert tiered_rb.storage._last_cursor_index == oracle_rb.storage._last_cursor_index
        assert tiered_rb.storage.shape == oracle_rb.storage.shape
        if len(oracle_rb) < 2:
            continue
        for k in range(2):
            torch.manual_seed(100 * step + k)
            got, want = _same_outcome(lambda: tiered_rb.sample(return_info=True),
                                      lambda: oracle_rb.sample(return_info=True), f"sample {step}.{k}")
            if want is None:
                continue
            assert_same(got[0], want[0], f"sample {step}.{k} ({buffer}, {sampler}, {writer}, {size})")
            n_samples += 1
            if prioritized:
                _update_priorities(tiered_rb, got[0], got[1], buffer)
                _update_priorities(oracle_rb, want[0], want[1], buffer)
    assert n_samples > 0, "no sample was compared"
    assert len(tiered_rb) == len(oracle_rb) == size  # wrapped around
    assert tiered_rb.write_count == oracle_rb.write_count
    assert_same(tiered_rb[:], oracle_rb[:], "rb[:]")
    assert_same(tiered_rb[1], oracle_rb[1], "rb[1]")


def test_matrix_shape():
    """The matrix runs every combination TorchRL accepts; each left out one has a stated reason."""
    all_cases = list(itertools.product(BUFFERS, SAMPLERS, WRITERS, SIZES))
    excluded = [c for c in all_cases if _excluded(*c[:3])]
    assert len(CASES) + len(excluded) == len(all_cases) == 108
    assert len(CASES) == 75
    assert all(_excluded(*c[:3]) for c in excluded)


@pytest.mark.parametrize("buffer,sampler,writer", sorted({c[:3] for c in itertools.product(
    BUFFERS, SAMPLERS, WRITERS) if _excluded(*c)}))
def test_excluded_combinations_are_rejected_by_torchrl(buffer, sampler, writer):
    """Every exclusion is a combination TorchRL's own constructor refuses, whatever the storage."""
    assert buffer == "TensorDictPrioritizedReplayBuffer"
    kwargs = {}
    if sampler != "PrioritizedSampler":
        kwargs["sampler"] = _make_sampler(sampler, 5)
    if writer != "RoundRobinWriter":
        kwargs["writer"] = _make_writer(writer)
    for storage in (LazyTensorStorage(5), TieredStorage(5)):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.9, storage=storage, **kwargs)


def test_prioritized_buffer_unsynced_sampler(windows):
    """Adapted configuration: TensorDictPrioritizedReplayBuffer(sync=False) samples with RandomSampler."""
    data = windows[100]
    rbs = [TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.9, storage=s, batch_size=16, sync=False,
                                             generator=torch.Generator().manual_seed(3))
           for s in (TieredStorage(100), LazyTensorStorage(100))]
    for lo, hi in _chunks(data.shape[0], 100):
        for rb in rbs:
            rb.extend(data[lo:hi])
        torch.manual_seed(lo)
        got = rbs[0].sample()
        torch.manual_seed(lo)
        want = rbs[1].sample()
        assert_same(got, want, f"sample after row {hi}")
