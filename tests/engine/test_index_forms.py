"""Index forms TorchRL's storages take: a uint8 mask, ``None``, ``...``, a bool, and a meta index.

``TieredStorage.get`` gives what ``LazyTensorStorage.get`` gives (run side by side); an index
tensor on the meta device (no values) is a ``tiered.errors`` exception, for the storage and the
store alike.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict

import tiered
from tiered import errors as E

pytest.importorskip("torchrl")
from torchrl.data import LazyTensorStorage  # noqa: E402

from tiered.torchrl import TieredStorage  # noqa: E402


def _pair():
    out = []
    for storage in (LazyTensorStorage(8), TieredStorage(8)):
        storage.set(range(4), TensorDict({"a": torch.arange(4.0), "b": torch.ones(4, 2)}, [4]))
        out.append(storage)
    return out


def _plain(td) -> tuple:
    return tuple(td.batch_size), td["a"].tolist(), td["b"].tolist()


@pytest.mark.parametrize("index", [None, ..., True, False], ids=["None", "Ellipsis", "True", "False"])
def test_whole_storage_indices_match_lazy_tensor_storage(index):
    lazy, ours = _pair()
    assert _plain(ours.get(index)) == _plain(lazy.get(index))


def test_a_uint8_index_is_a_mask_as_torch_takes_it():
    lazy, ours = _pair()
    mask = torch.tensor([1, 0, 1, 0], dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _plain(lazy.get(mask))
    with pytest.warns(DeprecationWarning, match="uint8"):
        assert _plain(ours.get(mask)) == expected == ((2,), [0.0, 2.0], [[1.0, 1.0], [1.0, 1.0]])
    store = tiered.TieredStore(8)
    store.extend(TensorDict({"a": torch.arange(4.0)}, [4]))
    with pytest.warns(DeprecationWarning):
        assert store.get(mask)["a"].tolist() == [0.0, 2.0]
    with pytest.warns(DeprecationWarning), pytest.raises(E.IndexOutOfRangeError, match="mask"):
        store.get(torch.tensor([3, 1], dtype=torch.uint8))  # not row numbers: a mask of the wrong length


def test_a_meta_index_is_a_tiered_error():
    _, ours = _pair()
    meta = torch.tensor([1, 2], device="meta")
    with pytest.raises(E.IndexOutOfRangeError, match="meta device"):
        ours.get(meta)
    store = tiered.TieredStore(8)
    store.extend(TensorDict({"a": torch.arange(4.0)}, [4]))
    for call in (store.get, store.rows_of, lambda i: store.set(i, TensorDict({"a": torch.zeros(2)}, [2]))):
        with pytest.raises(E.IndexOutOfRangeError, match="meta device"):
            call(meta)
    assert store.get(slice(None))["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("index", [torch.tensor([3, 0, 3]), torch.tensor([2, 1], dtype=torch.int32),
                                   torch.tensor([], dtype=torch.long), torch.tensor([[0, 1], [3, 2]])],
                         ids=["int64", "int32", "empty", "2-D"])
def test_tensor_indices_match_lazy_tensor_storage(index):
    """A sampler's index tensor (read by the store in one call) gives what LazyTensorStorage gives."""
    lazy, ours = _pair()
    assert _plain(ours.get(index)) == _plain(lazy.get(index))


def test_a_tensor_index_resolves_and_refuses_as_a_list_does():
    _, ours = _pair()
    assert _plain(ours.get(torch.tensor([-1, -4]))) == _plain(ours.get([-1, -4])) == ((2,), [3.0, 0.0], [[1.0] * 2] * 2)
    for index in (torch.tensor([4]), [4]):
        with pytest.raises(E.IndexOutOfRangeError):
            ours.get(index)
