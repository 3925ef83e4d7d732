"""Codecs, the checksum and the codec registry.

Every codec of tiered.codecs runs the CodecTests conformance suite (tiered.testing): bit-exact
round trips on random and compressible data, 0-byte cells, one cell and 1000 cells, decode into
preallocated outputs at scattered offsets, checksums against a plain-Python reference,
corruption detected with the blob index in the message, thread count options. Below the suite
classes: what is particular to one codec (the bitstreams other decoders read, zstd's Python-level
work), the checksum and the registry. Nothing is mocked: the real zstandard, lz4, numpy and torch
run on real bytes.
"""

from __future__ import annotations

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
from tiered.codecs.checksum import checksum_reference, segment_checksums_torch
from tiered.errors import CodecUnavailableError, CorruptionError, UnknownCodecError
from tiered.testing import CodecTests, count_calls
from tiered.util.batch import exclusive_cumsum

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


def blob(enc: EncodedBatch, i: int) -> bytes:
    return enc.data[enc.offsets[i] : enc.offsets[i] + enc.sizes[i]].tobytes()


def cells(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[bytes]:
    return [data[o : o + s].tobytes() for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# -- conformance: every codec runs the suite --------------------------------------------------


class TestRawCodec(CodecTests):
    compresses = False
    detects_garbage = False  # any bytes of the right length are valid raw bytes

    def make_codec(self) -> Codec:
        return RawCodec()


class TestLz4Codec(CodecTests):
    def make_codec(self) -> Codec:
        return Lz4Codec()

    def make_codec_with_threads(self, threads: int) -> Codec:
        return Lz4Codec(threads=threads)


class ZstdLevelTests(CodecTests):
    level = 3

    def make_codec(self) -> Codec:
        return ZstdCodec(self.level)

    def make_codec_with_threads(self, threads: int) -> Codec:
        return ZstdCodec(self.level, threads=threads)


class TestZstdLevel1(ZstdLevelTests):
    level = 1


class TestZstdLevel3(ZstdLevelTests):
    level = 3


class TestZstdLevel19(ZstdLevelTests):
    level = 19


class TestZstdFastLevel(ZstdLevelTests):
    level = -5


# nvCOMP decoders report a damaged batch as a whole when the GPU call fails, and have no defined
# behaviour on junk bytes they cannot screen on the host (lz4 has no header to check).
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestNvcompZstdCodec(CodecTests):
    names_bad_blob = False

    def make_codec(self) -> Codec:
        from tiered.codecs.nvcomp import NvcompCodec

        return NvcompCodec("zstd")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestNvcompLz4Codec(CodecTests):
    names_bad_blob = False
    detects_garbage = False

    def make_codec(self) -> Codec:
        from tiered.codecs.nvcomp import NvcompCodec

        return NvcompCodec("lz4")


# -- particular codecs ------------------------------------------------------------------------


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


def test_codec_threads_keep_no_batch_after_returning(rng: np.random.Generator) -> None:
    # The worker threads must not hold the caller's buffers between batches (a write's raw
    # frames, a sample's output): they would stay in memory until the next batch.
    import weakref

    sizes = rng.integers(1000, 9000, 64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    codec = ZstdCodec(3, threads=2)
    enc = codec.encode(data, offsets, sizes)
    out = np.empty(int(sizes.sum()), np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
    assert out.tobytes() == data.tobytes()
    refs = [weakref.ref(a) for a in (data, out, enc.data)]
    del data, out, enc
    assert [r() is None for r in refs] == [True, True, True]


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


@pytest.mark.parametrize("threads", [1, 2])
def test_zstd_large_decode_writes_exactly_its_slices(threads: int, rng: np.random.Generator) -> None:
    # Frames of 16 KiB of output and more are each decoded straight into its slice of `out` (readinto):
    # every cell comes back, the bytes between the slices are left as they were.
    sizes = rng.integers(100_000, 200_000, 48)
    data, offsets = packed_batch(sizes, rng, "compressible")
    enc = ZstdCodec(-1, threads=threads).encode(data, offsets, sizes)
    gap = 7
    out_offsets = offsets + gap * np.arange(1, sizes.size + 1)
    out = np.full(int(out_offsets[-1] + sizes[-1] + gap), 0xAB, np.uint8)
    ZstdCodec(-1, threads=threads).decode(enc.data, enc.offsets, enc.sizes, out, out_offsets, sizes)
    assert int(sizes.min()) >= 16 << 10
    for i, cell in enumerate(cells(data, offsets, sizes)):
        o = int(out_offsets[i])
        assert out[o:o + len(cell)].tobytes() == cell
    covered = np.zeros(out.size, bool)
    for o, n in zip(out_offsets.tolist(), sizes.tolist(), strict=True):
        covered[o:o + n] = True
    assert (out[~covered] == 0xAB).all()


def large_frames(rng: np.random.Generator, n: int = 48) -> tuple[np.ndarray, np.ndarray, list[bytes], np.ndarray]:
    """``(cells, their offsets, one zstd frame per cell, cell sizes)``: 96 kB frames."""
    sizes = np.full(n, 96_000, dtype=np.int64)
    data, offsets = packed_batch(sizes, rng, "compressible")
    frames = [zstandard.ZstdCompressor(level=1).compress(c) for c in cells(data, offsets, sizes)]
    return data, offsets, frames, sizes


def pack_frames(frames: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    comp_sizes = np.array([len(f) for f in frames], dtype=np.int64)
    return np.frombuffer(b"".join(frames), np.uint8), np.concatenate([[0], np.cumsum(comp_sizes)[:-1]]), comp_sizes


def test_zstd_large_decode_names_a_truncated_frame(rng: np.random.Generator) -> None:
    data, offsets, frames, sizes = large_frames(rng)
    frames[5] = frames[5][: len(frames[5]) // 2]  # the header still declares the full size
    comp, comp_offsets, comp_sizes = pack_frames(frames)
    out = np.empty(int(sizes.sum()), np.uint8)
    with pytest.raises(CorruptionError, match=r"zstd blob 5 of this batch"):
        ZstdCodec(threads=1).decode(comp, comp_offsets, comp_sizes, out, offsets, sizes)


def test_zstd_large_decode_refuses_a_frame_declaring_another_size(rng: np.random.Generator) -> None:
    # A frame longer than its slot would fill the slot and stop there: the headers are checked
    # first and such a batch takes the batch decoder, which refuses it by name.
    data, offsets, frames, sizes = large_frames(rng)
    frames[3] = zstandard.ZstdCompressor(level=1).compress(bytes(int(sizes[3]) + 100))
    comp, comp_offsets, comp_sizes = pack_frames(frames)
    out = np.empty(int(sizes.sum()), np.uint8)
    with pytest.raises(CorruptionError, match=r"zstd blob 3 of this batch"):
        ZstdCodec(threads=1).decode(comp, comp_offsets, comp_sizes, out, offsets, sizes)


def test_zstd_large_decode_reads_frames_without_a_content_size(rng: np.random.Generator) -> None:
    # A GPU encoder may leave the size out of the header; such frames decode (batch path).
    data, offsets, frames, sizes = large_frames(rng)
    plain = zstandard.ZstdCompressor(level=1, write_content_size=False)
    frames[::2] = [plain.compress(c) for c in cells(data, offsets, sizes)[::2]]
    assert zstandard.get_frame_parameters(frames[0]).content_size == zstandard.CONTENTSIZE_UNKNOWN
    comp, comp_offsets, comp_sizes = pack_frames(frames)
    out = np.empty(int(sizes.sum()), np.uint8)
    ZstdCodec(threads=1).decode(comp, comp_offsets, comp_sizes, out, offsets, sizes)
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
            count_calls(codec.encode, data, offsets, sizes).all,
            count_calls(codec.decode, enc.data, enc.offsets, enc.sizes, out, offsets, sizes).all,
        )
        assert out.tobytes() == data.tobytes()
    assert counts[80] == counts[1024]
    assert counts[80][0] > 0 and counts[80][1] > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_zstd_large_decode_python_calls_do_not_grow_with_batch(threads: int, rng: np.random.Generator) -> None:
    # The readinto path (frames of 16 KiB of output and more) creates and runs one reader per frame inside
    # C iteration: the same calls for 24 frames as for 240 (both split over the threads at 2).
    codec = ZstdCodec(-1, threads=threads)
    counts = {}
    for n in (24, 240):
        sizes = np.full(n, 400_000, dtype=np.int64)
        data, offsets = packed_batch(sizes, rng, "compressible")
        enc = codec.encode(data, offsets, sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)  # warm up
        counts[n] = count_calls(codec.decode, enc.data, enc.offsets, enc.sizes, out, offsets, sizes).all
        assert out.tobytes() == data.tobytes()
    assert counts[24] == counts[240] > 0


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


@pytest.mark.parametrize("chunk", [None, 40_000, 9_000])
@pytest.mark.parametrize("fill", ["random", "255"])
def test_segment_checksums_of_large_blobs_match_reference(
    chunk: int | None, fill: str, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    # Blobs of 2 KiB and more on average are summed by 256-byte blocks: lengths and offsets off
    # the block grid, empties among them, passes cut inside the batch (chunk) and blobs longer
    # than a pass; all-255 bytes give the largest sums.
    if chunk is not None:
        monkeypatch.setattr(checksum_mod, "_NP_CHUNK", chunk)
        monkeypatch.setattr(checksum_mod, "_ARANGE32", None)
    sizes = rng.integers(2_000, 30_000, 40)
    sizes[[3, 17]] = 0
    sizes[5] = 70_001
    offsets = 131 + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = int(offsets[-1] + sizes[-1]) + 77
    data = rng.integers(0, 256, total, dtype=np.uint8) if fill == "random" else np.full(total, 255, np.uint8)
    assert int(sizes.sum()) >= checksum_mod._BLOCK_MIN_MEAN_BYTES * sizes.size
    assert segment_checksums(data, offsets, sizes).tolist() == reference_checksums(data, offsets, sizes)
    one = np.array([offsets[5]]), np.array([sizes[5]])
    assert segment_checksums(data, *one).tolist() == reference_checksums(data, *one)


@pytest.mark.parametrize("fill", ["random", "255"])
def test_large_blob_checksums_at_the_block_edges(fill: str, rng: np.random.Generator) -> None:
    # Large blobs are summed by 256-byte blocks in float32: blobs that start and end on a block
    # edge, one byte off it, inside one block, and end at the last byte of the data (a tail block
    # of 0, 1 and 255 bytes); all-255 bytes give the largest block sums.
    for tail in (0, 1, 255):
        sizes = np.array([4096, 2303, 2305, 256, 3000, 9 * 256 + tail], dtype=np.int64)
        offsets = 512 + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        total = int(offsets[-1] + sizes[-1])
        data = rng.integers(0, 256, total, dtype=np.uint8) if fill == "random" else np.full(total, 255, np.uint8)
        assert int(sizes.sum()) >= checksum_mod._BLOCK_MIN_MEAN_BYTES * sizes.size
        assert segment_checksums(data, offsets, sizes).tolist() == reference_checksums(data, offsets, sizes)
        for k in range(sizes.size):  # each alone: a span that is one blob
            one = offsets[k:k + 1], sizes[k:k + 1]
            assert segment_checksums(data, *one).tolist() == reference_checksums(data, *one)


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


@pytest.mark.parametrize("fill", ["random", "255"])
def test_checksums_of_a_sampled_batch_as_a_read_lays_it_out(fill: str, rng: np.random.Generator) -> None:
    # int64 offsets and sizes, small blobs back to back from offset 0 (or further on) as a
    # store's read gathers them: the short path; and the batches next to it that must not take
    # it (an empty blob, a gap, blobs out of order) still give the reference's checksums
    total = 5000
    data = rng.integers(0, 256, total, dtype=np.uint8) if fill == "random" else np.full(total, 255, np.uint8)
    sizes = rng.integers(1, 1500, 3).astype(np.int64)
    for offsets, sizes_ in [
        (np.zeros(1, np.int64), np.array([total], np.int64)),  # one blob: the whole buffer
        (np.array([0, 700], np.int64), np.array([700, 1], np.int64)),
        (exclusive_cumsum(sizes) + 11, sizes),
        (np.array([0, 5, 5], np.int64), np.array([5, 0, 9], np.int64)),  # an empty blob
        (np.array([0, 9], np.int64), np.array([5, 9], np.int64)),  # a gap
        (np.array([9, 0], np.int64), np.array([5, 9], np.int64)),  # out of order
    ]:
        assert segment_checksums(data, offsets, sizes_).tolist() == reference_checksums(data, offsets, sizes_)
    for offsets, sizes_ in [(np.array([0, 3000]), np.array([3000, 2001])), (np.array([-1, 2]), np.array([3, 4]))]:
        with pytest.raises(ValueError, match="inside the buffer"):  # past the end, before the start
            segment_checksums(data, offsets.astype(np.int64), sizes_.astype(np.int64))


def test_segment_checksums_reject_out_of_range_blobs() -> None:
    data = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="inside the buffer"):
        segment_checksums(data, np.array([5]), np.array([6]))
    with pytest.raises(ValueError, match="inside the buffer"):
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
