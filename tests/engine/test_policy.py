"""The residency policies: every policy runs the PolicyTests conformance suite (tiered.testing),
which replays scripted and random histories against a reference model of the policy's rule, plus
literal checks of each rule and of the priority policy's validation.

Nothing is mocked: the policies are plain numpy objects driven through their public methods.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiered.errors import CorruptionError, InvalidPriorityError
from tiered.policy import POLICIES, FifoPolicy, LruPolicy, Policy, PriorityPolicy, TierState, get_policy
from tiered.testing import BlobHistory, PolicyTests


def order(policy: Policy, *ids: int) -> list[int]:
    return policy.order(np.array(ids, dtype=np.int64)).tolist()


class TestFifoPolicy(PolicyTests):
    def make_policy(self) -> Policy:
        return FifoPolicy()

    def eviction_key(self, blob: BlobHistory) -> tuple:
        return (blob.inserted_at,)

    def test_oldest_insert_leaves_first_whatever_was_read(self) -> None:
        p = self.make_policy()
        p.on_insert(np.array([10, 11]))
        p.on_insert(np.array([3]))
        p.on_insert(np.array([7]))
        p.on_access(np.array([10]))
        p.set_priority(np.array([3]), np.array([0.0]))
        assert order(p, 7, 3, 11, 10) == [11, 10, 3, 7]  # one batch keeps the order it was passed in
        assert p.victims(np.array([7, 3, 11, 10]), np.array([16, 16, 16, 16]), 40).tolist() == [11, 10, 3]


class TestLruPolicy(PolicyTests):
    def make_policy(self) -> Policy:
        return LruPolicy()

    def eviction_key(self, blob: BlobHistory) -> tuple:
        return (blob.last_used_at, blob.inserted_at)

    def test_read_blobs_leave_last_in_read_order(self) -> None:
        p = self.make_policy()
        for i in range(5):
            p.on_insert(np.array([i]))
        p.on_access(np.array([3]))
        p.on_access(np.array([0]))
        p.on_access(np.array([3]))  # read again: now the most recent
        assert order(p, 0, 1, 2, 3, 4) == [1, 2, 4, 0, 3]
        assert p.victims(np.arange(5), np.full(5, 16), 16 * 4).tolist() == [1, 2, 4, 0]

    def test_blobs_read_in_one_call_leave_oldest_first(self) -> None:
        p = self.make_policy()
        p.on_insert(np.array([5]))
        p.on_insert(np.array([6]))
        p.on_insert(np.array([7]))
        p.on_access(np.array([7, 5]))  # one get: one epoch for both
        assert order(p, 7, 6, 5) == [6, 5, 7]


class TestPriorityPolicy(PolicyTests):
    def make_policy(self) -> Policy:
        return PriorityPolicy()

    def eviction_key(self, blob: BlobHistory) -> tuple:
        return (blob.priority, blob.inserted_at)

    def test_lowest_priority_leaves_first_ties_by_age(self) -> None:
        p = self.make_policy()
        for i in range(5):
            p.on_insert(np.array([i]))
        p.set_priority(np.array([4, 0, 2, 1]), np.array([0.5, 2.0, 0.5, 0.5]))
        p.on_access(np.array([1]))  # reads do not matter
        # 1, 2, 4 share 0.5 (1 is the oldest); 3 keeps the default 1.0; 0 has 2.0
        assert order(p, 0, 1, 2, 3, 4) == [1, 2, 4, 3, 0]

    def test_a_blob_named_twice_gets_the_larger_priority_and_a_new_call_replaces_it(self) -> None:
        p = self.make_policy()
        p.on_insert(np.array([0]))
        p.on_insert(np.array([1]))
        p.set_priority(np.array([0, 0, 1]), np.array([5.0, 0.1, 1.0]))
        assert order(p, 0, 1) == [1, 0]
        p.set_priority(np.array([0]), np.array([0.2]))  # replaces 5.0, not a running max
        assert order(p, 0, 1) == [0, 1]
        p.set_priority(np.array([0, 1]), 3.0)  # one priority for all
        assert order(p, 1, 0) == [0, 1]  # equal: the older first

    def test_a_new_blob_gets_the_default_priority(self) -> None:
        p = PriorityPolicy(default=0.25)
        p.on_insert(np.array([0]))
        p.set_priority(np.array([0]), np.array([0.5]))
        p.on_insert(np.array([1]))
        assert order(p, 0, 1) == [1, 0]
        assert p.state_arrays()["priority"].tolist() == [0.5, 0.25]

    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -0.5])
    def test_invalid_priorities_are_rejected_and_change_nothing(self, bad: float) -> None:
        p = self.make_policy()
        p.on_insert(np.array([0, 1]))
        p.set_priority(np.array([0, 1]), np.array([2.0, 1.0]))
        with pytest.raises(InvalidPriorityError, match="finite and >= 0"):
            p.set_priority(np.array([0, 1]), np.array([0.0, bad]))
        assert order(p, 0, 1) == [1, 0]

    def test_blobs_rank_by_sampling_weight_per_byte_when_the_store_tells_sizes_and_masses(self) -> None:
        p = self.make_policy()
        p.on_insert(np.arange(4))
        p.set_priority(np.arange(4), np.array([4.0, 1.0, 1.0, 2.0]))
        assert order(p, 0, 1, 2, 3) == [1, 2, 3, 0]  # nothing told: by priority, ties by age
        p.alpha = 0.5
        p.set_sizes(np.arange(4), np.array([64, 16, 32, 16]))  # 2/64, 1/16, 1/32, 1.41/16
        assert order(p, 0, 1, 2, 3) == [0, 2, 1, 3]
        p.set_mass(np.array([0, 2]), np.array([8.0, 0.1]))  # told masses replace priority ** alpha
        assert order(p, 0, 1, 2, 3) == [2, 1, 3, 0]  # 0.1/32, 1/16, 1.41/16, 8/64
        assert p.priorities(np.arange(4)).tolist() == [4.0, 1.0, 1.0, 2.0]  # priorities stay the max
        with pytest.raises(InvalidPriorityError, match="masses"):
            p.set_mass(np.array([1]), np.array([np.nan]))
        p.on_release(np.array([0]))  # a released id forgets its size and mass
        p.on_insert(np.array([0]))
        p.set_priority(np.array([0]), 4.0)
        assert p.priorities(np.array([0])).tolist() == [4.0] and order(p, 0, 1, 2, 3)[-1] == 0  # 2/1 byte

    @pytest.mark.parametrize("bad", [np.nan, -1.0])
    def test_the_default_priority_is_validated(self, bad: float) -> None:
        with pytest.raises(InvalidPriorityError, match="default priority"):
            PriorityPolicy(default=bad)


# -- the registry, the tier state and the state format ------------------------------------------


def test_get_policy_resolves_names_and_passes_policies_through() -> None:
    for name, cls in POLICIES.items():
        assert type(get_policy(name)) is cls and get_policy(name.upper()).name == name
    p = LruPolicy()
    assert get_policy(p) is p
    with pytest.raises(ValueError, match="unknown policy 'random'; known policies: fifo, lru, priority"):
        get_policy("random")


def test_tier_state_is_frozen() -> None:
    state = TierState("hot", budget=1024, bytes_used=16, exclusive=True)
    with pytest.raises(AttributeError):
        state.budget = 0  # type: ignore[misc]
    assert state == TierState("hot", 1024, 16, True)


def test_state_arrays_name_their_columns() -> None:
    p = PriorityPolicy()
    p.on_insert(np.array([2, 0]))
    p.on_insert(np.array([1]))
    p.set_priority(np.array([0]), np.array([4.0]))
    arrays = p.state_arrays()
    assert sorted(arrays) == ["birth", "clock", "priority"]
    assert arrays["clock"].shape == () and int(arrays["clock"]) == 2
    assert arrays["birth"].tolist() == [1, 2, 1] and arrays["priority"].tolist() == [4.0, 1.0, 1.0]
    lru = LruPolicy()
    lru.on_insert(np.array([0]))
    lru.on_access(np.array([0]))
    assert {k: v.tolist() for k, v in lru.state_arrays().items()} == {"clock": 2, "birth": [1], "last_access": [2]}
    assert {k: v.tolist() for k, v in FifoPolicy().state_arrays().items()} == {"clock": 0, "birth": []}


def test_released_blobs_are_forgotten_in_the_state() -> None:
    p = LruPolicy()
    p.on_insert(np.array([0, 1, 2]))
    p.on_access(np.array([1]))
    p.on_release(np.array([1]))
    arrays = p.state_arrays()
    assert arrays["birth"].tolist() == [1, 0, 1] and arrays["last_access"].tolist() == [1, 0, 1]


def test_another_policys_state_is_rejected() -> None:
    lru = LruPolicy()
    lru.on_insert(np.array([0, 1]))
    with pytest.raises(CorruptionError, match=r"fifo policy state: unknown 'last_access'"):
        FifoPolicy().load_state_arrays(lru.state_arrays())
    with pytest.raises(CorruptionError, match=r"priority policy state: missing 'priority'"):
        PriorityPolicy().load_state_arrays(lru.state_arrays())


def test_a_restored_policy_keeps_counting_from_the_saved_clock() -> None:
    # a blob inserted after the reopen is younger than every blob of the saved state
    p = FifoPolicy()
    for i in range(3):
        p.on_insert(np.array([i]))
    q = FifoPolicy()
    q.load_state_arrays(p.state_arrays())
    q.on_insert(np.array([3]))
    assert order(q, 3, 2, 1, 0) == [0, 1, 2, 3]
    assert q.state_arrays()["birth"].tolist() == [1, 2, 3, 4]


def test_lru_reads_mark_the_blocks_a_commit_saves():
    # a get's ids (flat int64) take the column's short path (set_read, mark_known): the same
    # dirty blocks, size and values as the general set, across blocks and past the column's end
    from tiered.util.dirty import BLOCK, DirtyBlocks

    p = LruPolicy()
    p.on_insert(np.arange(10))
    p.take_dirty()
    read = np.array([3, BLOCK + 1, 5 * BLOCK + 2, 3], dtype=np.int64)
    p.on_access(read)
    want = DirtyBlocks()
    want.mark(read)
    assert p.take_dirty().nonzero()[0].tolist() == want.blocks().tolist() == [0, 1, 5]
    last = p.state_arrays()["last_access"]
    assert last.shape[0] == 5 * BLOCK + 3 and last[read].tolist() == [2, 2, 2, 2] and last[4] == 1
    p.on_access([7])  # any other form of ids: the general path
    assert p.state_arrays()["last_access"][7] == 3
