"""Every write validates everything it will write before the first byte changes.

TieredStore: a write whose later field is a meta or sparse tensor is refused with a
``tiered.errors`` exception and leaves the store (and, with a path, the next commit) exactly as it
was. TieredStorage's TorchRL paths: where TorchRL itself raises (a cursor it cannot record), the
result is LazyTensorStorage's, run side by side; bad priorities (a NaN ``td_error`` on a
prioritized extend, ``update_priority`` of rows the buffer does not hold) are refused before the
rows, the sampler or the store change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered import errors as E

torchrl = pytest.importorskip("torchrl")
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer  # noqa: E402

from tiered.torchrl import TieredStorage  # noqa: E402


def _rows(n: int, start: float = 0.0, last: torch.Tensor | None = None) -> TensorDict:
    """Rows with a dense field, a blob field (frames) and, last, ``z``."""
    g = torch.Generator().manual_seed(int(start))
    return TensorDict({
        "a": torch.arange(n, dtype=torch.float32) + start,
        "obs": torch.randint(0, 255, (n, 32, 32), dtype=torch.uint8, generator=g),
        "z": torch.full((n, 3), start) if last is None else last,
    }, [n])


def _bad(kind: str, n: int) -> torch.Tensor:
    if kind == "meta":
        return torch.zeros(n, 3, device="meta")
    if kind == "sparse":
        return torch.zeros(n, 3).to_sparse()
    return torch.zeros(n, 3).to_sparse_csr()


def _snapshot(store: tiered.TieredStore) -> tuple:
    td = store.get(slice(None)) if len(store) else None
    return len(store), store.cursor, td


def _same(a: tuple, b: tuple) -> bool:
    if a[:2] != b[:2] or (a[2] is None) != (b[2] is None):
        return False
    return a[2] is None or all(torch.equal(a[2][k], b[2][k]) for k in a[2].keys(True, True))


@pytest.mark.parametrize("kind", ["meta", "sparse", "sparse_csr"])
@pytest.mark.parametrize("op", ["extend", "set"])
@pytest.mark.parametrize("stage_rows", [0, 64])
@pytest.mark.parametrize("with_path", [False, True])
def test_a_later_unreadable_field_writes_nothing(tmp_path, kind, op, stage_rows, with_path):
    path = tmp_path / "s" if with_path else None
    store = tiered.TieredStore(16, path, stage_rows=stage_rows)
    store.extend(_rows(4))
    before = _snapshot(store)
    for n in (1, 2, 12):  # staged (small) and batched writes
        bad = _rows(n, 7.0, last=_bad(kind, n))
        with pytest.raises(E.SchemaMismatchError, match="'z' is a .*(meta|sparse).*nothing was written"):
            store.extend(bad) if op == "extend" else store.set(list(range(n)), bad)
        assert _same(_snapshot(store), before)
    store.close()  # commits: nothing of the refused writes may be in it
    if with_path:
        with tiered.open(path) as again:
            assert _same(_snapshot(again), before)


def test_a_first_write_with_a_meta_field_is_refused_before_the_schema():
    store = tiered.TieredStore(8)
    with pytest.raises(E.SchemaMismatchError, match="meta device"):
        store.extend(_rows(2, last=_bad("meta", 2)))
    assert store.schema is None and len(store) == 0
    store.extend(_rows(2))  # the store is still usable, and takes the first schema from this write
    assert len(store) == 2


# -------------------------------------------------------------------------------- TorchRL paths


def _lazy_and_tiered():
    return LazyTensorStorage(8), TieredStorage(8)


def _state(storage) -> tuple:
    n = len(storage)
    return n, storage[:n]["a"].tolist() if n else [], storage._last_cursor_index


@pytest.mark.parametrize("cursor", [
    np.array([1, 2]),                                    # a numpy index array
    np.array([0, 1, 1, 0, 0, 0, 0, 0], dtype=bool),      # a numpy bool mask
    np.array([5, 6]),                                    # numpy indices past the length
])
def test_set_with_a_cursor_torchrl_cannot_record_matches_lazy_tensor_storage(cursor):
    results = []
    for storage in _lazy_and_tiered():
        storage.set(range(4), TensorDict({"a": torch.arange(4.0)}, [4]))
        with pytest.raises(TypeError) as err:
            storage.set(cursor, TensorDict({"a": torch.tensor([10.0, 11.0])}, [2]))
        results.append((type(err.value), _state(storage)))
    assert results[0] == results[1]
    assert results[1][1] == (4, [0.0, 1.0, 2.0, 3.0], 3)
    # rb[index] = ... (set_cursor=False) takes numpy indices, as LazyTensorStorage does
    lazy, tiered_storage = _lazy_and_tiered()
    for storage in (lazy, tiered_storage):
        storage.set(range(4), TensorDict({"a": torch.arange(4.0)}, [4]))
        storage.set(np.array([1, 2]), TensorDict({"a": torch.tensor([10.0, 11.0])}, [2]), set_cursor=False)
    assert _state(lazy) == _state(tiered_storage) == (4, [0.0, 10.0, 11.0, 3.0], 3)


def test_a_refused_write_puts_the_last_cursor_back():
    storage = TieredStorage(8)
    storage.set(range(4), TensorDict({"a": torch.arange(4.0)}, [4]))
    with pytest.raises(E.SchemaMismatchError):
        storage.set(torch.tensor([4, 5]), TensorDict({"a": torch.zeros(2, dtype=torch.int64)}, [2]))
    assert _state(storage) == (4, [0.0, 1.0, 2.0, 3.0], 3)


def _prioritized(storage) -> TensorDictPrioritizedReplayBuffer:
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=2)
    rb.extend(TensorDict({"a": torch.arange(3.0), "td_error": torch.ones(3)}, [3]))
    return rb


def _tree(rb) -> list[float]:
    return [float(rb.sampler._sum_tree[i]) for i in range(8)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_prioritized_extend_with_a_bad_td_error_writes_nothing(bad):
    rb = _prioritized(TieredStorage(8))
    tree = _tree(rb)
    td = TensorDict({"a": torch.tensor([10.0, 11.0]), "td_error": torch.tensor([1.0, bad])}, [2])
    with pytest.raises(E.InvalidPriorityError, match=r"'td_error' as its priority.*row 4.*not written"):
        rb.extend(td)
    store = rb.storage.store
    assert len(rb) == 3 and rb.storage[:3]["a"].tolist() == [0.0, 1.0, 2.0]
    assert _tree(rb) == tree and store.priorities([0, 1, 2]).tolist() == [1.0, 1.0, 1.0]


def test_rb_add_with_a_bad_td_error_writes_nothing():
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=TieredStorage(8), batch_size=2)
    rb.add(TensorDict({"a": torch.tensor(10.0), "td_error": torch.tensor(2.0)}, []))
    for bad in (float("nan"), -1.0, float("inf")):
        # (TorchRL's writer moves its cursor before the storage sees the row: each try names the next)
        with pytest.raises(E.InvalidPriorityError, match=r"row \d got"):
            rb.add(TensorDict({"a": torch.tensor(11.0), "td_error": torch.tensor(bad)}, []))
    assert len(rb) == 1 and rb.storage[:1]["a"].tolist() == [10.0]
    assert rb.storage.store.priorities([0]).tolist() == [2.0]


def test_update_priority_of_rows_the_buffer_does_not_hold_changes_nothing():
    rb = _prioritized(TieredStorage(8))
    rb.update_priority(torch.tensor([1]), torch.tensor([4.0]))
    tree, max_priority = _tree(rb), rb.sampler._max_priority
    with pytest.raises(E.IndexOutOfRangeError, match="20"):
        rb.update_priority(torch.tensor([1, 20]), torch.tensor([5.0, 6.0]))
    assert _tree(rb) == tree and rb.sampler._max_priority == max_priority
    assert rb.storage.store.priorities([0, 1, 2]).tolist() == [1.0, 4.0, 1.0]
    with pytest.raises(E.IndexOutOfRangeError):  # a row of the capacity, not written yet
        rb.update_priority(torch.tensor([5]), torch.tensor([5.0]))
    assert _tree(rb) == tree


@pytest.mark.parametrize("new", ["meta", "sparse", "shape"])
def test_a_bad_new_field_beside_the_store_writes_nothing(new):
    """Fields that appear after the first write live beside the store; checked before the store's."""
    storage = TieredStorage(8)
    storage.set(range(2), TensorDict({"a": torch.arange(2.0)}, [2]))
    storage.set(torch.tensor([2, 3]), TensorDict({"a": torch.tensor([5.0, 6.0]), "new": torch.ones(2, 3)}, [2]))
    value = {"meta": torch.zeros(2, 3, device="meta"), "sparse": torch.zeros(2, 3).to_sparse(),
             "shape": torch.zeros(2, 4)}[new]
    with pytest.raises(E.SchemaMismatchError, match="'new'"):
        storage.set(torch.tensor([4, 5]), TensorDict({"a": torch.tensor([7.0, 8.0]), "new": value}, [2]))
    assert len(storage) == 4 and storage.store.get(slice(None))["a"].tolist() == [0.0, 1.0, 5.0, 6.0]
    assert storage[:4]["new"].tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
