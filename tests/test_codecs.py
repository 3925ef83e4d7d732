"""Conformance suite of the codecs, the checksum and the codec registry.

Every codec of tiered.codecs runs the same parametrized tests (zarr's ``StoreTests`` pattern):
bit-exact round trips on random and compressible data, 0-byte cells, one cell and 1000 cells,
decode into preallocated outputs at scattered offsets, checksums against a plain-Python
reference, and corruption detected with the blob index in the message. Nothing is mocked: the
real zstandard, lz4, numpy and torch run on real bytes.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import threading

import lz4.block
import numpy as np
import pytest
import torch
import zstandard

import tiered.codecs as codecs
from tiered.codecs import (
    Codec,
    EncodedBatch,
    Lz4Codec,
    RawCodec,
    ZstdCodec,
    available_codecs,
    codec_for_format_id,
    get_codec,
    register_codec,
    segment_checksums,
)
from tiered.codecs import checksum as checksum_mod
from tiered.codecs.checksum import checksum_reference, segment_checksums_torch, verify
from tiered.errors import CodecUnavailableError, CorruptionError, TieredError, UnknownCodecError

CODEC_SPECS = ["raw", "lz4", "zstd:1", "zstd:3", "zstd:19"]
COMPRESSING = ["lz4", "zstd:1", "zstd:3", "zstd:19"]


# -- helpers ----------------------------------------------------------------------------------


def packed_batch(sizes: np.ndarray, rng: np.random.Generator, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Cells of ``sizes`` back to back; ``kind`` is "random" (incompressible) or "compressible"."""
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.zeros(sizes.size, dtype=np.int64)
    if sizes.size > 1:
        np.cumsum(sizes[:-1], out=offsets[1:])
    total = int(sizes.sum())
    if kind == "random":
        data = rng.integers(0, 256, total, dtype=np.uint8)
    else:
        # Long runs of a few values, like the flat backgrounds of game frames.
        runs = rng.integers(1, 200, total // 50 + 2)
        values = rng.integers(0, 4, runs.size, dtype=np.uint8) * 60
        data = np.repeat(values, runs)[:total]
        if data.size < total:
            data = np.concatenate([data, np.zeros(total - data.size, np.uint8)])
    return data, offsets


def scattered_offsets(sizes: np.ndarray, rng: np.random.Generator, gap: int = 7) -> tuple[np.ndarray, int]:
    """Output offsets in a shuffled order with gaps between cells; returns (offsets, buffer size)."""
    n = sizes.size
    order = rng.permutation(n)
    padded = sizes[order] + gap
    pos = np.zeros(n, dtype=np.int64)
    if n > 1:
        np.cumsum(padded[:-1], out=pos[1:])
    out_offsets = np.empty(n, dtype=np.int64)
    out_offsets[order] = pos + gap
    return out_offsets, int(padded.sum()) + gap


def blob(enc: EncodedBatch, i: int) -> bytes:
    return enc.data[enc.offsets[i] : enc.offsets[i] + enc.sizes[i]].tobytes()


def cells(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[bytes]:
    return [data[o : o + s].tobytes() for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)]


def roundtrip(codec: Codec, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> EncodedBatch:
    enc = codec.encode(data, offsets, sizes)
    out = np.full(int(sizes.sum()), 0xAB, dtype=np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets - (offsets[0] if offsets.size else 0), sizes)
    assert out.tobytes() == b"".join(cells(data, offsets, sizes))
    return enc


@pytest.fixture(params=CODEC_SPECS)
def codec(request: pytest.FixtureRequest) -> Codec:
    return get_codec(request.param)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# -- conformance: every codec -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "compressible"])
@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([4096], id="one-cell"),
        pytest.param([0], id="one-empty-cell"),
        pytest.param([0, 0, 0], id="only-empty-cells"),
        pytest.param([1, 0, 2, 0, 7056, 0], id="mixed-with-empties"),
        pytest.param("many", id="1000-cells"),
    ],
)
def test_roundtrip_is_bit_exact(codec: Codec, sizes: object, kind: str, rng: np.random.Generator) -> None:
    if sizes == "many":
        sizes = rng.integers(0, 3000, 1000)
        sizes[::17] = 0
    sizes = np.asarray(sizes, dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, kind)
    enc = roundtrip(codec, data, offsets, sizes)
    assert len(enc) == sizes.size
    assert enc.data.dtype == np.uint8 and enc.data.ndim == 1
    assert enc.offsets.dtype == np.int64 and enc.sizes.dtype == np.int64 and enc.checksums.dtype == np.int64
    # Blobs are packed back to back in order.
    assert enc.offsets.tolist() == np.concatenate([[0], np.cumsum(enc.sizes)[:-1]]).tolist()
    assert int(enc.sizes.sum()) == enc.data.size
    if kind == "compressible" and codec.format != "raw" and sizes.sum() > 10_000:
        assert enc.data.size < sizes.sum() / 4


def test_empty_batch(codec: Codec) -> None:
    empty = np.zeros(0, dtype=np.int64)
    enc = codec.encode(np.zeros(0, np.uint8), empty, empty)
    assert len(enc) == 0 and enc.data.size == 0 and enc.checksums.size == 0
    out = np.zeros(3, np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, empty, empty)
    assert out.tolist() == [0, 0, 0]


@pytest.mark.parametrize("cell_size", [40, 3000], ids=["small-cells", "large-cells"])
def test_decode_into_scattered_preallocated_output(
    codec: Codec, cell_size: int, rng: np.random.Generator
) -> None:
    sizes = rng.integers(0, 2 * cell_size, 300)
    sizes[::11] = 0
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    out_offsets, total = scattered_offsets(sizes, rng)
    out = np.full(total, 0xEE, dtype=np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, out_offsets, sizes)
    assert cells(out, out_offsets, sizes) == cells(data, offsets, sizes)
    # Bytes outside the cells (the gaps) are untouched: decode writes only where it is told to.
    written = np.zeros(total, dtype=bool)
    for o, s in zip(out_offsets.tolist(), sizes.tolist(), strict=True):
        written[o : o + s] = True
    assert (out[~written] == 0xEE).all()


def test_decode_into_rows_of_a_larger_array(codec: Codec, rng: np.random.Generator) -> None:
    # Cells of one size written at a constant stride: rows of a 2-D array with padding.
    n, size, stride = 64, 500, 640
    sizes = np.full(n, size, dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    out = np.zeros((n, stride), dtype=np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, np.arange(n) * stride, sizes)
    assert (out[:, :size] == data.reshape(n, size)).all()
    assert (out[:, size:] == 0).all()


def test_encode_reads_unpacked_input_and_copies_it(codec: Codec, rng: np.random.Generator) -> None:
    # Input cells in any order with gaps; the caller may reuse its buffer right after encode.
    buf = rng.integers(0, 3, 10_000, dtype=np.uint8)
    offsets = np.array([5000, 10, 7000, 9999, 300], dtype=np.int64)
    sizes = np.array([1500, 200, 0, 1, 4000], dtype=np.int64)
    expected = cells(buf, offsets, sizes)
    enc = codec.encode(buf, offsets, sizes)
    buf[:] = 0xFF
    out = np.empty(int(sizes.sum()), np.uint8)
    out_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    codec.decode(enc.data, enc.offsets, enc.sizes, out, out_offsets, sizes)
    assert cells(out, out_offsets, sizes) == expected


def test_checksums_match_the_reference(codec: Codec, rng: np.random.Generator) -> None:
    sizes = rng.integers(0, 5000, 200)
    sizes[::9] = 0
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    reference = [checksum_reference(blob(enc, i)) for i in range(len(enc))]
    assert enc.checksums.tolist() == reference
    torch_values = segment_checksums_torch(
        torch.from_numpy(enc.data), torch.from_numpy(enc.offsets), torch.from_numpy(enc.sizes)
    )
    assert torch_values.tolist() == reference
    assert verify(enc.data, enc.offsets, enc.sizes, enc.checksums).tolist() == []


def test_checksum_catches_a_flipped_bit(codec: Codec, rng: np.random.Generator) -> None:
    sizes = np.full(50, 2000, dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    damaged = enc.data.copy()
    damaged[enc.offsets[17] + enc.sizes[17] // 2] ^= 0x10
    assert verify(damaged, enc.offsets, enc.sizes, enc.checksums).tolist() == [17]
    on_torch = verify(
        torch.from_numpy(damaged), torch.from_numpy(enc.offsets), torch.from_numpy(enc.sizes), enc.checksums
    )
    assert on_torch.tolist() == [17]


def test_wrong_expected_size_is_corruption(codec: Codec, rng: np.random.Generator) -> None:
    sizes = np.array([1000, 2000, 3000], dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    wrong = sizes.copy()
    wrong[1] += 5
    out = np.empty(int(wrong.sum()), np.uint8)
    with pytest.raises(CorruptionError, match=r"blob 1\b"):
        codec.decode(
            enc.data, enc.offsets, enc.sizes, out, np.concatenate([[0], np.cumsum(wrong)[:-1]]), wrong
        )


def test_decode_rejects_a_bad_destination(codec: Codec, rng: np.random.Generator) -> None:
    sizes = np.array([100, 100], dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "random")
    enc = codec.encode(data, offsets, sizes)
    with pytest.raises(ValueError, match="inside the buffer"):
        codec.decode(enc.data, enc.offsets, enc.sizes, np.empty(150, np.uint8), offsets, sizes)
    with pytest.raises(ValueError, match="one per blob"):
        codec.decode(enc.data, enc.offsets, enc.sizes, np.empty(200, np.uint8), offsets[:1], sizes[:1])
    read_only = np.empty(200, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        codec.decode(enc.data, enc.offsets, enc.sizes, read_only, offsets, sizes)


def test_name_round_trips_and_codec_pickles(codec: Codec, rng: np.random.Generator) -> None:
    assert get_codec(codec.name) == codec
    assert hash(get_codec(codec.name)) == hash(codec)
    assert get_codec(codec) is codec
    clone = pickle.loads(pickle.dumps(codec))
    assert clone == codec and type(clone) is type(codec)
    sizes = np.array([300, 0, 500], dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    roundtrip(clone, data, offsets, sizes)


def test_concurrent_calls_on_one_codec(codec: Codec, rng: np.random.Generator) -> None:
    # A store may encode one field while a reader thread decodes another with the same codec.
    batches = []
    for _ in range(4):
        sizes = rng.integers(1, 3000, 64)
        batches.append((sizes, *packed_batch(sizes, rng, "compressible")))
    errors: list[BaseException] = []

    def work(k: int) -> None:
        sizes, data, offsets = batches[k]
        try:
            for _ in range(5):
                roundtrip(codec, data, offsets, sizes)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- corruption -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["lz4", "zstd:3"])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_blob_raises_corruption_error_naming_it(
    spec: str, damage: str, rng: np.random.Generator
) -> None:
    codec = get_codec(spec)
    sizes = np.full(40, 3000, dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    bad = 23
    comp_sizes = enc.sizes.copy()
    comp = enc.data.copy()
    if damage == "truncated":
        comp_sizes[bad] -= 3
    else:
        comp[enc.offsets[bad] : enc.offsets[bad] + enc.sizes[bad]] = 0xFF
    out = np.empty(int(sizes.sum()), np.uint8)
    with pytest.raises(CorruptionError, match=rf"blob {bad}\b") as info:
        codec.decode(comp, enc.offsets, comp_sizes, out, offsets, sizes)
    assert "tiered verify" in str(info.value)
    assert isinstance(info.value, TieredError)


def test_zstd_empty_cell_must_be_an_empty_frame(rng: np.random.Generator) -> None:
    codec = ZstdCodec(3)
    sizes = np.array([500, 700], dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    claimed = np.array([500, 0], dtype=np.int64)
    with pytest.raises(CorruptionError, match=r"blob 1\b.*declares 700"):
        codec.decode(enc.data, enc.offsets, enc.sizes, np.empty(500, np.uint8), np.array([0, 500]), claimed)


# -- bitstreams: what other decoders (nvCOMP, plain zstd/lz4) read ----------------------------


@pytest.mark.parametrize("level", [1, 3, 19, -5])
def test_zstd_blobs_are_standard_frames_with_content_size(level: int, rng: np.random.Generator) -> None:
    codec = ZstdCodec(level)
    sizes = rng.integers(0, 20_000, 60)
    sizes[[0, 7]] = 0
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = codec.encode(data, offsets, sizes)
    plain = zstandard.ZstdDecompressor()
    for i, cell in enumerate(cells(data, offsets, sizes)):
        frame = blob(enc, i)
        assert zstandard.frame_content_size(frame) == len(cell)
        params = zstandard.get_frame_parameters(frame)
        assert params.dict_id == 0 and not params.has_checksum
        assert plain.decompress(frame) == cell
        # Exactly one frame per blob: the frame ends where the blob ends.
        assert plain.decompressobj().decompress(frame) == cell


def test_zstd_output_does_not_depend_on_threads(rng: np.random.Generator) -> None:
    # Frame bytes are a function of (level, cell) only, so stores written on any machine match.
    sizes = rng.integers(0, 9000, 300)
    data, offsets = packed_batch(sizes, rng, "compressible")
    one = ZstdCodec(3, threads=1).encode(data, offsets, sizes)
    many = ZstdCodec(3, threads=4).encode(data, offsets, sizes)
    assert one.data.tobytes() == many.data.tobytes()
    assert one.checksums.tolist() == many.checksums.tolist()
    assert one.data.tobytes() == b"".join(
        zstandard.ZstdCompressor(level=3, write_checksum=False).compress(c)
        for c in cells(data, offsets, sizes)
    )


def test_zstd_decodes_frames_from_a_plain_compressor(rng: np.random.Generator) -> None:
    sizes = rng.integers(1, 5000, 30)
    data, offsets = packed_batch(sizes, rng, "compressible")
    frames = [zstandard.ZstdCompressor(level=7).compress(c) for c in cells(data, offsets, sizes)]
    comp = np.frombuffer(b"".join(frames), np.uint8)
    comp_sizes = np.array([len(f) for f in frames], dtype=np.int64)
    comp_offsets = np.concatenate([[0], np.cumsum(comp_sizes)[:-1]])
    out = np.empty(int(sizes.sum()), np.uint8)
    ZstdCodec(3).decode(comp, comp_offsets, comp_sizes, out, offsets, sizes)
    assert out.tobytes() == data.tobytes()


def test_lz4_blobs_are_raw_blocks_without_size_prefix(rng: np.random.Generator) -> None:
    sizes = rng.integers(1, 9000, 40)
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = Lz4Codec().encode(data, offsets, sizes)
    for i, cell in enumerate(cells(data, offsets, sizes)):
        assert blob(enc, i) == lz4.block.compress(cell, store_size=False)
        assert lz4.block.decompress(blob(enc, i), uncompressed_size=len(cell)) == cell


def test_raw_blobs_are_the_cells(rng: np.random.Generator) -> None:
    sizes = rng.integers(0, 900, 40)
    data, offsets = packed_batch(sizes, rng, "random")
    enc = RawCodec().encode(data, offsets, sizes)
    assert [blob(enc, i) for i in range(len(enc))] == cells(data, offsets, sizes)


# -- Python-level work does not grow with the batch -------------------------------------------


def count_calls(fn: object, *args: object) -> int:
    """Python-level calls ("call" and "c_call" profiler events) made by ``fn(*args)`` in this thread."""
    count = 0

    def profiler(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profiler)
    try:
        fn(*args)  # type: ignore[operator]
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("threads", [1, 2])
def test_zstd_python_calls_do_not_grow_with_batch(threads: int, rng: np.random.Generator) -> None:
    codec = ZstdCodec(3, threads=threads)
    counts = {}
    for n in (80, 1024):
        # Same layout at both sizes (one empty cell, the rest 1 KB); the compressed batch stays
        # under one checksum pass (256 KiB), which is the only work that grows with bytes. Both
        # decode at least 64 KiB: smaller decodes stay on the calling thread (a fixed difference).
        sizes = np.full(n, 1024, dtype=np.int64)
        sizes[3] = 0
        data, offsets = packed_batch(sizes, rng, "compressible")
        out = np.empty(int(sizes.sum()), np.uint8)
        enc = codec.encode(data, offsets, sizes)  # warm up: thread pool, per-thread contexts
        codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
        assert enc.data.size < 1 << 18
        counts[n] = (
            count_calls(codec.encode, data, offsets, sizes),
            count_calls(codec.decode, enc.data, enc.offsets, enc.sizes, out, offsets, sizes),
        )
        assert out.tobytes() == data.tobytes()
    assert counts[80] == counts[1024]
    assert counts[80][0] > 0 and counts[80][1] > 0


def test_threads_1_starts_no_thread(rng: np.random.Generator) -> None:
    sizes = np.full(400, 2000, dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    out = np.empty(int(sizes.sum()), np.uint8)
    before = {t.ident for t in threading.enumerate()}
    for codec in (ZstdCodec(3, threads=1), Lz4Codec(threads=1)):
        enc = codec.encode(data, offsets, sizes)
        codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
        assert out.tobytes() == data.tobytes()
    assert {t.ident for t in threading.enumerate()} == before


def _child_roundtrip(spec: str, queue: object) -> None:
    codec = get_codec(spec)
    sizes = np.full(64, 3000, dtype=np.int64)
    data, offsets = packed_batch(sizes, np.random.default_rng(5), "compressible")
    enc = codec.encode(data, offsets, sizes)
    out = np.empty(int(sizes.sum()), np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
    queue.put(out.tobytes() == data.tobytes())  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("spec", ["zstd:3", "lz4"])
def test_threaded_codec_works_in_a_forked_child(spec: str, rng: np.random.Generator) -> None:
    # DataLoader workers are forked after the parent already used the codec thread pool; the
    # child inherits no threads, so the pool must be rebuilt there instead of deadlocking.
    codec = get_codec(spec)
    sizes = np.full(64, 3000, dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    roundtrip(codec, data, offsets, sizes)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_roundtrip, args=(spec, queue))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung: the codec thread pool was not rebuilt after fork")
    assert child.exitcode == 0
    assert queue.get(timeout=10) is True


# -- checksum ---------------------------------------------------------------------------------


def reference_checksums(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[int]:
    return [checksum_reference(c) for c in cells(data, offsets, sizes)]


@pytest.mark.parametrize("layout", ["packed", "packed-with-empties", "shuffled", "overlapping", "gaps"])
def test_segment_checksums_match_reference_on_any_layout(layout: str, rng: np.random.Generator) -> None:
    data = rng.integers(0, 256, 20_000, dtype=np.uint8)
    n = 120
    if layout.startswith("packed"):
        sizes = rng.integers(1, 160, n)
        if layout == "packed-with-empties":
            sizes[::4] = 0
        offsets = 37 + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    elif layout == "gaps":
        sizes = rng.integers(0, 100, n)
        offsets = np.concatenate([[0], np.cumsum(sizes + 3)[:-1]])
    else:
        offsets = rng.integers(0, data.size - 500, n)
        sizes = rng.integers(0, 500, n)
        if layout == "shuffled":
            sizes = np.minimum(sizes, 100)
            offsets = rng.permutation(np.arange(n) * 150)
    expected = reference_checksums(data, offsets, sizes)
    assert segment_checksums(data, offsets, sizes).tolist() == expected
    got = segment_checksums_torch(torch.from_numpy(data), torch.from_numpy(offsets), torch.from_numpy(sizes))
    assert got.dtype == torch.int64 and got.tolist() == expected


def test_segment_checksums_across_chunk_boundaries(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    # Tiny chunks make every blob straddle several passes of both implementations.
    monkeypatch.setattr(checksum_mod, "_NP_CHUNK", 13)
    monkeypatch.setattr(checksum_mod, "_TORCH_CHUNK", 11)
    monkeypatch.setattr(checksum_mod, "_ARANGE32", None)
    data = rng.integers(0, 256, 3000, dtype=np.uint8)
    for offsets, sizes in [
        (np.array([0, 100, 100, 700]), np.array([100, 0, 600, 2300])),  # packed
        (np.array([2999, 5, 17, 3000]), np.array([1, 2900, 40, 0])),  # general
    ]:
        expected = reference_checksums(data, offsets, sizes)
        assert segment_checksums(data, offsets, sizes).tolist() == expected
        assert segment_checksums_torch(
            torch.from_numpy(data), torch.tensor(offsets), torch.tensor(sizes)
        ).tolist() == (expected)


def test_checksum_formula_and_edge_values() -> None:
    assert checksum_reference(b"") == 0
    # s1 = 97 + 98 + 99 = 294, s2 = 97 + 2*98 + 3*99 = 590.
    assert checksum_reference(b"abc") == (590 << 32) | 294
    # Position sensitivity: same bytes, other order.
    assert checksum_reference(b"ab") != checksum_reference(b"ba")
    # s2 >= 2**31 gives a negative int64; numpy and torch agree with the reference.
    big = bytes([255]) * 5000
    value = checksum_reference(big)
    assert value < 0
    arr = np.frombuffer(big, np.uint8)
    assert segment_checksums(arr, np.array([0]), np.array([5000])).tolist() == [value]
    assert segment_checksums_torch(
        torch.from_numpy(arr.copy()), torch.tensor([0]), torch.tensor([5000])
    ).tolist() == [value]
    empty = segment_checksums(np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty.dtype == np.int64 and empty.size == 0


def test_segment_checksums_reject_out_of_range_blobs() -> None:
    data = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="inside the data buffer"):
        segment_checksums(data, np.array([5]), np.array([6]))
    with pytest.raises(ValueError, match="inside the data buffer"):
        segment_checksums_torch(torch.from_numpy(data), torch.tensor([-1]), torch.tensor([2]))


@pytest.mark.cuda
def test_segment_checksums_on_cuda(rng: np.random.Generator) -> None:
    sizes = rng.integers(0, 3000, 500)
    data, offsets = packed_batch(sizes, rng, "random")
    expected = segment_checksums(data, offsets, sizes)
    got = segment_checksums_torch(
        torch.from_numpy(data).cuda(), torch.from_numpy(offsets).cuda(), torch.from_numpy(sizes).cuda()
    )
    assert got.device.type == "cuda"
    assert got.cpu().tolist() == expected.tolist()


# -- registry ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "cls", "name"),
    [
        ("zstd", ZstdCodec, "zstd:3"),
        ("ZSTD", ZstdCodec, "zstd:3"),
        ("zstd:9", ZstdCodec, "zstd:9"),
        (" Zstd:-5 ", ZstdCodec, "zstd:-5"),
        ("zstd:22", ZstdCodec, "zstd:22"),
        ("lz4", Lz4Codec, "lz4"),
        ("LZ4", Lz4Codec, "lz4"),
        ("raw", RawCodec, "raw"),
    ],
)
def test_get_codec_resolves_specs(spec: str, cls: type, name: str) -> None:
    codec = get_codec(spec)
    assert type(codec) is cls and codec.name == name
    assert {"raw": 0, "zstd": 1, "lz4": 2}[codec.format] == codec.format_id


def test_unknown_codec_lists_the_known_ones() -> None:
    with pytest.raises(UnknownCodecError) as info:
        get_codec("zsdt")
    assert str(info.value) == (
        "unknown codec 'zsdt'; known codecs: raw, lz4, zstd[:level] (e.g. 'zstd:9'); "
        "for GPU decode the same 'zstd' bytes are read by nvCOMP"
    )
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "spec", ["zstd:0", "zstd:23", "zstd:abc", "zstd:", "zstd:-200000", "zstd:3.5", "lz4:1", "raw:x"]
)
def test_bad_codec_arguments_are_unknown_codec_errors(spec: str) -> None:
    with pytest.raises(UnknownCodecError, match="zstd|lz4|raw"):
        get_codec(spec)


def test_non_string_spec_is_rejected() -> None:
    with pytest.raises(UnknownCodecError, match="string or a Codec"):
        get_codec(3)  # type: ignore[arg-type]


def test_register_codec_and_available_codecs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "_FACTORIES", dict(codecs._FACTORIES))
    seen = []

    def factory(arg: str | None) -> Codec:
        seen.append(arg)
        return ZstdCodec(int(arg or 3))

    register_codec("Fancy", factory)
    assert get_codec("fancy:5").name == "zstd:5"
    assert seen == ["5"]
    assert available_codecs()[:3] == ["raw", "lz4", "zstd"]
    assert "fancy" in available_codecs()
    with pytest.raises(ValueError, match="without ':'"):
        register_codec("a:b", factory)


def test_codec_for_format_id() -> None:
    assert codec_for_format_id(0) == RawCodec()
    assert codec_for_format_id(1) == ZstdCodec(3)
    assert codec_for_format_id(1, level=9).name == "zstd:9"
    assert codec_for_format_id(2) == Lz4Codec()
    with pytest.raises(UnknownCodecError, match="unknown codec format id 7"):
        codec_for_format_id(7)


def test_codec_constructor_arguments() -> None:
    assert ZstdCodec().threads >= 1
    assert ZstdCodec(threads=3).threads == 3
    with pytest.raises(ValueError, match="threads"):
        ZstdCodec(threads=0)
    with pytest.raises(UnknownCodecError, match="level"):
        ZstdCodec(level=True)  # type: ignore[arg-type]
    assert ZstdCodec(5) != ZstdCodec(6) and ZstdCodec(5, threads=1) == ZstdCodec(5, threads=2)
    # CodecUnavailableError is what a missing optional package raises (and an ImportError).
    assert issubclass(CodecUnavailableError, ImportError)
