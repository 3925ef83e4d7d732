"""Per-thread scratch buffers (tiered.util.scratch): reuse, growth, the temporary rule, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tiered.util.scratch import ScratchBuffers


def test_a_buffer_is_reused_and_grows_by_doubling_from_the_floor():
    s = ScratchBuffers(floor=1000, keep_max=100_000)
    a = s.get("x", 10)
    assert a.size == 10 and a.dtype == np.uint8 and s.kept_bytes("x") == 1000
    b = s.get("x", 1000)
    assert np.shares_memory(a, b) and s.kept_bytes("x") == 1000
    c = s.get("x", 1001)  # grows: twice the old size, at least the request
    assert s.kept_bytes("x") == 2000 and c.size == 1001 and not np.shares_memory(b, c)
    s.get("x", 5000)
    assert s.kept_bytes("x") == 5000
    s.get("x", 5001)
    assert s.kept_bytes("x") == 10_000
    s.get("x", 15_000)
    assert s.kept_bytes("x") == 20_000
    s.get("x", 50_000)  # more than twice: the request itself
    assert s.kept_bytes("x") == 50_000
    s.get("x", 60_000)  # doubling would pass keep_max: capped there
    assert s.kept_bytes("x") == 100_000
    assert np.shares_memory(s.get("x", 100_000), s.get("x", 1))


def test_requests_over_keep_max_get_a_temporary():
    s = ScratchBuffers(floor=64, keep_max=1 << 20)
    kept = s.get("stage", 100)
    big = s.get("stage", (1 << 20) + 1)
    big2 = s.get("stage", 3 << 20)
    assert big.size == (1 << 20) + 1 and big2.size == 3 << 20
    assert not np.shares_memory(big, kept) and not np.shares_memory(big, big2)
    assert s.kept_bytes("stage") == 100 and s.kept_bytes() == 100
    big[:] = 7  # writable, and writing it leaves the kept buffer alone
    s.get("stage", 64)[:] = 1
    assert (big == 7).all()


def test_without_keep_max_every_buffer_is_kept():
    s = ScratchBuffers(floor=0, keep_max=None)
    s.get("raw", 20 << 20)
    assert s.kept_bytes("raw") == 20 << 20


def test_names_are_independent_buffers():
    s = ScratchBuffers(floor=16)
    a, b = s.get("a", 16), s.get("b", 16)
    a[:] = 1
    b[:] = 2
    assert (a == 1).all() and not np.shares_memory(a, b)
    assert s.kept_bytes() == 32 and s.kept_bytes("c") == 0
    assert s.get("zero", 0).size == 0


def test_each_thread_gets_its_own_buffers():
    s = ScratchBuffers(floor=4096)
    mine = s.get("x", 100)
    seen = {}

    def work():
        theirs = s.get("x", 50_000)
        seen["shares"] = np.shares_memory(theirs, mine)
        seen["kept"] = s.kept_bytes("x")
        seen["floor"] = s.floor

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == {"shares": False, "kept": 50_000, "floor": 4096}
    assert s.kept_bytes("x") == 4096  # the other thread's growth is not ours


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="floor <= keep_max"):
        ScratchBuffers(floor=1 << 20, keep_max=1 << 10)
    with pytest.raises(ValueError, match="floor"):
        ScratchBuffers(floor=-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_buffers_are_page_locked():
    s = ScratchBuffers(pinned=True, keep_max=1 << 20)
    buf = s.get("h2d", 1000)
    assert torch.from_numpy(buf).is_pinned()
    assert not torch.from_numpy(s.get("h2d", 2 << 20)).is_pinned()  # temporaries are not
