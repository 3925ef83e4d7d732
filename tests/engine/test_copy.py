"""The byte-copy engine (tiered.util.copy) and the buffer checks it runs (tiered.util.buffers).

Every path of the engine is checked against a plain-Python reference copy on real numpy arrays
and torch tensors: the host paths (slice, strided, bytes, rows, map), the tensor path (8-byte
words and byte tails), edge cases (no blobs, 0-byte blobs, misaligned offsets and views, random
layouts) and the errors a caller gets for buffers and batches it cannot copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered.testing import count_calls
from tiered.util.buffers import check_buffer, host_view
from tiered.util.copy import copy_blobs, copy_tensor_blobs
from tiered.util.hostcopy import HOST_COPY_PATHS, copy_host_blobs, host_copy_path, merge_runs, pack_blobs


def reference(src: np.ndarray, src_offsets, dst: np.ndarray, dst_offsets, sizes) -> np.ndarray:
    """What any copy must produce: ``dst`` with each blob copied in, one slice at a time."""
    out = dst.copy()
    for a, b, n in zip(np.asarray(src_offsets).tolist(), np.asarray(dst_offsets).tolist(),
                       np.asarray(sizes).tolist(), strict=True):
        out[b:b + n] = src[a:a + n]
    return out


def scattered(rng: np.random.Generator, sizes: np.ndarray, gap: int = 0, align_to: int = 1) -> tuple[np.ndarray, int]:
    """Offsets of non-overlapping blobs in a random order, ``gap`` bytes at most between them
    (rounded up to ``align_to``), and the buffer length they need."""
    n = sizes.size
    order = rng.permutation(n)
    gaps = rng.integers(0, gap + 1, n) if gap else np.zeros(n, np.int64)
    slot = (sizes[order] + gaps + align_to - 1) // align_to * align_to
    starts = np.cumsum(slot) - slot
    offsets = np.empty(n, np.int64)
    offsets[order] = starts
    return offsets, int(slot.sum())


def run_all(src: np.ndarray, so, dst_len: int, do, sizes, rng) -> None:
    """Copy with every entry point, on numpy arrays and CPU tensors, and compare with the reference."""
    so, do, sizes = (np.asarray(x, np.int64) for x in (so, do, sizes))
    dst0 = rng.integers(0, 256, dst_len, dtype=np.uint8)  # untouched bytes must stay as they were
    want = reference(src, so, dst0, do, sizes)
    out = dst0.copy()
    copy_blobs(src, so, out, do, sizes)
    assert np.array_equal(out, want)
    out = dst0.copy()
    copy_host_blobs(src, so, out, do, sizes)
    assert np.array_equal(out, want)
    out_t = torch.from_numpy(dst0.copy())
    copy_blobs(torch.from_numpy(src.copy()), so, out_t, do, sizes)
    assert np.array_equal(out_t.numpy(), want)
    out_t = torch.from_numpy(dst0.copy())
    copy_tensor_blobs(torch.from_numpy(src.copy()), so, out_t, do, sizes)
    assert np.array_equal(out_t.numpy(), want)


# ------------------------------------------------------------------------------- every path


def test_every_host_path_is_taken_and_copies_right():
    rng = np.random.default_rng(1)
    n = 300
    # slice: a packed batch into a packed buffer
    sizes = rng.integers(0, 700, n)
    packed = np.cumsum(sizes) - sizes
    src = rng.integers(0, 256, int(sizes.sum()) + 40, dtype=np.uint8)
    cases = [("slice", src, packed, int(sizes.sum()) + 5, packed + 5, sizes)]
    # strided: equal blobs at constant strides (rows of a larger array)
    eq = np.full(n, 24)
    cases.append(("strided", np.arange(n * 40, dtype=np.uint8), np.arange(n) * 40 + 3, n * 32, np.arange(n) * 32, eq))
    # runs: random layouts of small (bytes), mid-sized (128-byte rows), large (memcpy) and mixed blobs
    for lo, hi in ((0, 128), (128, 2048), (2048, 9000), (0, 5000)):
        sizes = rng.integers(lo, hi, n)
        so, src_len = scattered(rng, sizes, gap=50)
        do, dst_len = scattered(rng, sizes, gap=50)
        cases.append(("runs", rng.integers(0, 256, src_len, dtype=np.uint8), so, dst_len, do, sizes))
    # runs that merge into one: a slice again
    sizes = np.array([5, 0, 7, 3])
    cases.append(("runs", np.arange(40, dtype=np.uint8), np.array([2, 30, 7, 14]), 20, np.array([1, 0, 6, 13]), sizes))
    for path, src, so, dst_len, do, sizes in cases:
        assert host_copy_path(so, do, sizes) == path
        run_all(src, so, dst_len, do, sizes, rng)
    assert {c[0] for c in cases} == set(HOST_COPY_PATHS) - {"none"}


def test_run_sizes_at_the_class_edges():
    """Runs of 1, 127, 128, 129, 2047, 2048 and 2049 bytes: each class and its neighbours."""
    rng = np.random.default_rng(8)
    sizes = np.repeat([1, 127, 128, 129, 255, 256, 2047, 2048, 2049], 7)
    rng.shuffle(sizes)
    so, src_len = scattered(rng, sizes, gap=3)
    do, dst_len = scattered(rng, sizes, gap=1)
    run_all(rng.integers(0, 256, src_len, dtype=np.uint8), so, dst_len, do, sizes, rng)


def test_random_layouts_agree_with_the_reference():
    rng = np.random.default_rng(2)
    for trial in range(80):
        n = int(rng.integers(1, 400))
        hi = int(rng.choice([2, 64, 300, 2000, 12000]))
        sizes = rng.integers(0, hi, n)
        align_to = int(rng.choice([1, 8, 16]))
        so, src_len = scattered(rng, sizes, gap=int(rng.choice([0, 3, 64])), align_to=align_to)
        do, dst_len = scattered(rng, sizes, gap=int(rng.choice([0, 5])), align_to=int(rng.choice([1, 8])))
        base = int(rng.integers(0, 9))  # misaligns every offset by the same amount
        src = rng.integers(0, 256, src_len + base, dtype=np.uint8)
        run_all(src, so + base, dst_len + 3, do + trial % 3, sizes, rng)


def test_sources_may_overlap():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 100, dtype=np.uint8)
    so = np.array([0, 0, 10, 5])  # the same bytes copied to several places
    sizes = np.array([20, 20, 30, 30])
    do = np.array([0, 20, 40, 70])
    run_all(src, so, 100, do, sizes, rng)


def test_tensor_path_on_misaligned_views_and_offsets():
    """8-byte words only when both tensors and every offset allow them; byte tails otherwise."""
    rng = np.random.default_rng(4)
    base = torch.from_numpy(rng.integers(0, 256, 5000, dtype=np.uint8))
    sizes = rng.integers(1, 200, 20)
    so, src_len = scattered(rng, sizes, align_to=8)
    do, dst_len = scattered(rng, sizes, align_to=8)
    for src_start, extra in ((0, 0), (3, 0), (0, 5), (8, 8)):
        src = base[src_start:src_start + src_len]
        dst = torch.zeros(dst_len + 16, dtype=torch.uint8)[extra:extra + dst_len]
        want = reference(src.numpy(), so, dst.numpy(), do, sizes)
        copy_tensor_blobs(src, so, dst, do, sizes)
        assert np.array_equal(dst.numpy(), want)


# ------------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("fn", [copy_blobs, copy_host_blobs])
def test_no_blobs_and_empty_blobs(fn):
    src = np.arange(10, dtype=np.uint8)
    dst = np.zeros(10, np.uint8)
    empty = np.zeros(0, np.int64)
    fn(src, empty, dst, empty, empty)
    fn(src, np.array([3, 9, 10]), dst, np.array([10, 0, 4]), np.array([0, 0, 0]))
    assert not dst.any()
    # 0-byte blobs between real ones, at offsets that are not where a run would continue
    fn(src, np.array([0, 7, 2, 5]), dst, np.array([0, 3, 2, 9]), np.array([2, 0, 3, 1]))
    assert dst.tolist() == [0, 1, 2, 3, 4, 0, 0, 0, 0, 5]
    t = torch.zeros(4, dtype=torch.uint8)
    copy_tensor_blobs(torch.arange(4, dtype=torch.uint8), empty, t, empty, empty)
    copy_tensor_blobs(torch.arange(4, dtype=torch.uint8), np.array([1, 3]), t, np.array([0, 4]), np.array([3, 0]))
    assert t.tolist() == [1, 2, 3, 0]
    assert host_copy_path(empty, empty, empty) == "none"
    assert pack_blobs(src, empty, empty)[0].size == 0


def test_one_blob_and_whole_buffers():
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    run_all(src, [0], 4096, [0], [4096], rng)
    run_all(src, [100], 50, [7], [43], rng)
    run_all(src[:1], [0], 1, [0], [1], rng)


def test_read_only_sources_are_copied_from():
    src = np.frombuffer(b"abcdefgh", dtype=np.uint8)  # read-only
    dst = np.zeros(8, np.uint8)
    copy_blobs(src, np.array([4, 0]), dst, np.array([0, 4]), np.array([4, 4]))
    assert dst.tobytes() == b"efghabcd"
    t = torch.zeros(8, dtype=torch.uint8)
    copy_blobs(src, np.array([4, 0]), t, np.array([0, 4]), np.array([4, 4]))
    assert bytes(t.tolist()) == b"efghabcd"


def test_pack_blobs_and_merge_runs():
    data = np.arange(20, dtype=np.uint8)
    packed, offsets = pack_blobs(data, np.array([15, 0, 4, 5]), np.array([5, 2, 1, 0]))
    assert packed.tolist() == [15, 16, 17, 18, 19, 0, 1, 4] and offsets.tolist() == [0, 5, 7, 8]
    s, d, n = merge_runs(np.array([0, 3, 5, 9]), np.array([10, 13, 15, 40]), np.array([3, 2, 4, 1]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 9], [10, 40], [9, 1])
    s, d, n = merge_runs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert s.size == d.size == n.size == 0


# ------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [
    np.zeros(20, np.uint8)[::2],            # strided view
    np.zeros((2, 5), np.uint8),             # 2-D
    np.zeros(10, np.float32),               # not bytes
    torch.zeros(20, dtype=torch.uint8)[::2],
    torch.zeros(10, dtype=torch.int16),
    b"0123456789",                          # not an array
])
def test_buffers_that_cannot_be_copied_are_rejected(bad):
    good = np.zeros(10, np.uint8)
    one = np.array([0])
    with pytest.raises(TypeError, match="contiguous 1-D uint8 numpy array or torch tensor"):
        copy_blobs(bad, one, good, one, np.array([1]))
    with pytest.raises(TypeError, match="the destination buffer must be a contiguous 1-D uint8"):
        copy_blobs(good, one, bad, one, np.array([1]))
    with pytest.raises(TypeError, match="out must be"):
        check_buffer(bad, "out")


def test_batches_that_do_not_fit_are_rejected():
    src, dst = np.zeros(10, np.uint8), np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match=r"source buffer's ranges \[5, 11\) fall outside its 10 bytes"):
        copy_blobs(src, np.array([5]), dst, np.array([0]), np.array([6]))
    with pytest.raises(ValueError, match="destination buffer's ranges"):
        copy_blobs(src, np.array([0]), dst, np.array([-1]), np.array([2]))
    with pytest.raises(ValueError, match="differ in length: 2, 1, 1"):
        copy_blobs(src, np.array([0, 1]), dst, np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        copy_blobs(src, np.array([0]), dst, np.array([0]), np.array([-1]))
    assert not dst.any()


def test_host_view_of_each_kind_of_buffer():
    a = np.arange(3, dtype=np.uint8)
    assert host_view(a) is a
    t = torch.arange(3, dtype=torch.uint8)
    v = host_view(t)
    v[0] = 9
    assert int(t[0]) == 9  # a view, not a copy


# ------------------------------------------------------------------------------- Python-level work




@pytest.mark.parametrize("small,large", [((1, 100), (1, 100)), ((150, 700), (150, 700)),
                                         ((3000, 9000), (3000, 9000)), ((1, 100), (1, 20000))])
def test_python_calls_do_not_grow_with_the_batch(small, large):
    """The same calls for 100 and 2048 blobs, whatever their sizes (the last case puts the 100 in
    one size class and spreads the 2048 over all of them); a batch of up to 64 runs (a small
    sample) is one memcpy per run, with the same calls for 2 and 64 blobs, and no more than the
    size classes make."""
    rng = np.random.default_rng(6)
    counts = {}
    for n, (lo, hi) in ((2, small), (64, small), (100, small), (2048, large)):
        sizes = rng.integers(lo, hi, n)
        so, src_len = scattered(rng, sizes, align_to=16)
        do, dst_len = scattered(rng, sizes)
        src = rng.integers(0, 256, src_len, dtype=np.uint8)
        dst = np.zeros(dst_len, np.uint8)
        assert host_copy_path(so, do, sizes) == "runs"
        copy_blobs(src, so, dst, do, sizes)
        counts[n] = count_calls(copy_blobs, src, so, dst, do, sizes).all
        assert np.array_equal(dst, reference(src, so, np.zeros(dst_len, np.uint8), do, sizes))
    assert counts[2] == counts[64] > 0
    assert counts[100] == counts[2048] > counts[64]


# ------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["cuda->cuda", "cpu->cuda", "cuda->cpu", "numpy->cuda"])
def test_copies_on_and_across_cuda(where):
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 3000, 200)
    so, src_len = scattered(rng, sizes, gap=20, align_to=8)
    do, dst_len = scattered(rng, sizes, align_to=16)
    src_np = rng.integers(0, 256, src_len, dtype=np.uint8)
    want = reference(src_np, so, np.zeros(dst_len, np.uint8), do, sizes)
    src_kind, dst_kind = where.split("->")
    src = src_np if src_kind == "numpy" else torch.from_numpy(src_np).to(src_kind)
    dst = torch.zeros(dst_len, dtype=torch.uint8, device=dst_kind)
    copy_blobs(src, so, dst, do, sizes)
    assert np.array_equal(dst.cpu().numpy(), want)
