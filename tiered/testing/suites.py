"""Conformance suites: the contracts of codecs, tiers and policies as reusable pytest classes.

Each suite is a base class holding ``test_*`` methods (zarr's ``StoreTests`` pattern). A test
module subclasses it under a name pytest collects (``Test...``) and provides a factory; pytest
then runs every check of the contract on that implementation. A new codec, tier or policy gets
its conformance tests from one short class:

* :class:`CodecTests`: ``make_codec(self)``; the contract of :mod:`tiered.codecs.base`.
* :class:`TierTests`: ``make_tier(self, tmp_path, budget)``; the contract of
  :mod:`tiered.tiers.base`.
* :class:`PolicyTests`: ``make_policy(self)`` and ``eviction_key(self, blob)``; the contract of
  :class:`tiered.policy.Policy`, checked against a reference model that records each blob's
  :class:`BlobHistory` and evicts by ``eviction_key``.

The suites need pytest (imported with this module, not with :mod:`tiered.testing`).

Example:
    >>> from tiered.codecs import ZstdCodec
    >>> from tiered.testing import CodecTests
    >>> class TestZstdFast(CodecTests):      # in a test module, e.g. tests/test_my_codec.py
    ...     def make_codec(self):
    ...         return ZstdCodec(-5)
    ...     def make_codec_with_threads(self, threads):
    ...         return ZstdCodec(-5, threads=threads)
    >>> TestZstdFast().make_codec().name
    'zstd:-5'
    >>> "test_roundtrip_is_bit_exact" in dir(TestZstdFast)
    True
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from ..codecs import Codec, EncodedBatch, codec_for_format_id, get_codec, segment_checksums
from ..codecs.checksum import checksum_reference, segment_checksums_torch, verify
from ..errors import CorruptionError, InvalidPriorityError, StorageFullError, TieredError, UnknownCodecError
from ..policy import Policy, TierState
from ..tiers import Tier
from ..util.units import ALIGNMENT, align

__all__ = ["CodecTests", "TierTests", "PolicyTests", "BlobHistory", "recounted_blob_priorities"]


# =============================================================================== codecs


def _packed_batch(sizes: np.ndarray, rng: np.random.Generator, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Cells of ``sizes`` back to back; ``kind`` is "random" (incompressible) or "compressible"."""
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes
    total = int(sizes.sum())
    if kind == "random":
        return rng.integers(0, 256, total, dtype=np.uint8), offsets
    # Long runs of a few values, like the flat backgrounds of game frames.
    runs = rng.integers(1, 200, total // 50 + 2)
    values = rng.integers(0, 4, runs.size, dtype=np.uint8) * 60
    data = np.repeat(values, runs)[:total]
    return np.concatenate([data, np.zeros(total - data.size, np.uint8)]), offsets


def _scattered_offsets(sizes: np.ndarray, rng: np.random.Generator, gap: int = 7) -> tuple[np.ndarray, int]:
    """Output offsets in a shuffled order with gaps between cells; returns (offsets, buffer size)."""
    order = rng.permutation(sizes.size)
    padded = sizes[order] + gap
    out_offsets = np.empty(sizes.size, dtype=np.int64)
    out_offsets[order] = np.cumsum(padded) - padded + gap
    return out_offsets, int(padded.sum()) + gap


def _cells(data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[bytes]:
    return [data[o : o + s].tobytes() for o, s in zip(np.asarray(offsets).tolist(), np.asarray(sizes).tolist(),
                                                      strict=True)]


def _roundtrip(codec: Codec, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> EncodedBatch:
    enc = codec.encode(data, offsets, sizes)
    out = np.full(int(sizes.sum()), 0xAB, dtype=np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, np.cumsum(sizes) - sizes, sizes)
    assert out.tobytes() == b"".join(_cells(data, offsets, sizes))
    return enc


def _roundtrip_in_child(codec: Codec, queue: Any) -> None:
    sizes = np.full(64, 3000, dtype=np.int64)
    data, offsets = _packed_batch(sizes, np.random.default_rng(5), "compressible")
    enc = codec.encode(data, offsets, sizes)
    out = np.empty(int(sizes.sum()), np.uint8)
    codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
    queue.put(out.tobytes() == data.tobytes())


class CodecTests:
    """The codec contract (:mod:`tiered.codecs.base`). Subclass it and define :meth:`make_codec`.

    Class attributes a subclass may change:

    * ``compresses``: ``False`` for codecs that store bytes as they are (no ratio check).
    * ``detects_garbage``: ``False`` for codecs that decode any bytes of the right length.
    * ``names_bad_blob``: ``False`` when a decoder can only report a damaged batch, not which
      blob of it is damaged (GPU decoders).
    """

    compresses: bool = True
    detects_garbage: bool = True
    names_bad_blob: bool = True

    def make_codec(self) -> Codec:
        """The codec under test."""
        raise NotImplementedError(f"{type(self).__name__} must define make_codec(self)")

    def make_codec_with_threads(self, threads: int) -> Codec | None:
        """The codec with a thread count option set (None: the codec has no such option)."""
        return None

    @pytest.fixture
    def codec(self) -> Codec:
        return self.make_codec()

    @pytest.fixture
    def rng(self) -> np.random.Generator:
        return np.random.default_rng(1234)

    def _threaded(self, threads: int) -> Codec:
        codec = self.make_codec_with_threads(threads)
        if codec is None:
            pytest.skip(f"{type(self).__name__}: the codec has no thread count option")
        return codec

    # -- round trips ----------------------------------------------------------------------

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
    def test_roundtrip_is_bit_exact(self, codec: Codec, sizes: object, kind: str, rng: np.random.Generator) -> None:
        if sizes == "many":
            sizes = rng.integers(0, 3000, 1000)
            sizes[::17] = 0
        sizes = np.asarray(sizes, dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, kind)
        enc = _roundtrip(codec, data, offsets, sizes)
        assert len(enc) == sizes.size
        assert enc.data.dtype == np.uint8 and enc.data.ndim == 1
        assert enc.offsets.dtype == np.int64 and enc.sizes.dtype == np.int64 and enc.checksums.dtype == np.int64
        # Blobs are packed back to back in order.
        assert enc.offsets.tolist() == (np.cumsum(enc.sizes) - enc.sizes).tolist()
        assert int(enc.sizes.sum()) == enc.data.size
        if kind == "compressible" and self.compresses and sizes.sum() > 10_000:
            assert enc.data.size < sizes.sum() / 4

    def test_empty_batch(self, codec: Codec) -> None:
        empty = np.zeros(0, dtype=np.int64)
        enc = codec.encode(np.zeros(0, np.uint8), empty, empty)
        assert len(enc) == 0 and enc.data.size == 0 and enc.checksums.size == 0
        out = np.zeros(3, np.uint8)
        codec.decode(enc.data, enc.offsets, enc.sizes, out, empty, empty)
        assert out.tolist() == [0, 0, 0]

    @pytest.mark.parametrize("cell_size", [40, 3000], ids=["small-cells", "large-cells"])
    def test_decode_into_scattered_preallocated_output(self, codec: Codec, cell_size: int,
                                                       rng: np.random.Generator) -> None:
        sizes = rng.integers(0, 2 * cell_size, 300)
        sizes[::11] = 0
        data, offsets = _packed_batch(sizes, rng, "compressible")
        enc = codec.encode(data, offsets, sizes)
        out_offsets, total = _scattered_offsets(sizes, rng)
        out = np.full(total, 0xEE, dtype=np.uint8)
        codec.decode(enc.data, enc.offsets, enc.sizes, out, out_offsets, sizes)
        assert _cells(out, out_offsets, sizes) == _cells(data, offsets, sizes)
        # Bytes outside the cells (the gaps) are untouched: decode writes only where it is told to.
        written = np.zeros(total, dtype=bool)
        for o, s in zip(out_offsets.tolist(), sizes.tolist(), strict=True):
            written[o : o + s] = True
        assert (out[~written] == 0xEE).all()

    def test_decode_into_rows_of_a_larger_array(self, codec: Codec, rng: np.random.Generator) -> None:
        # Cells of one size written at a constant stride: rows of a 2-D array with padding.
        n, size, stride = 64, 500, 640
        sizes = np.full(n, size, dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        enc = codec.encode(data, offsets, sizes)
        out = np.zeros((n, stride), dtype=np.uint8)
        codec.decode(enc.data, enc.offsets, enc.sizes, out, np.arange(n) * stride, sizes)
        assert (out[:, :size] == data.reshape(n, size)).all()
        assert (out[:, size:] == 0).all()

    def test_encode_reads_unpacked_input_and_copies_it(self, codec: Codec, rng: np.random.Generator) -> None:
        # Input cells in any order with gaps; the caller may reuse its buffer right after encode.
        buf = rng.integers(0, 3, 10_000, dtype=np.uint8)
        offsets = np.array([5000, 10, 7000, 9999, 300], dtype=np.int64)
        sizes = np.array([1500, 200, 0, 1, 4000], dtype=np.int64)
        expected = _cells(buf, offsets, sizes)
        enc = codec.encode(buf, offsets, sizes)
        buf[:] = 0xFF
        out = np.empty(int(sizes.sum()), np.uint8)
        out_offsets = np.cumsum(sizes) - sizes
        codec.decode(enc.data, enc.offsets, enc.sizes, out, out_offsets, sizes)
        assert _cells(out, out_offsets, sizes) == expected

    # -- checksums ------------------------------------------------------------------------

    def test_checksums_are_those_of_the_compressed_bytes(self, codec: Codec, rng: np.random.Generator) -> None:
        sizes = rng.integers(0, 5000, 200)
        sizes[::9] = 0
        data, offsets = _packed_batch(sizes, rng, "compressible")
        enc = codec.encode(data, offsets, sizes)
        assert enc.checksums.tolist() == segment_checksums(enc.data, enc.offsets, enc.sizes).tolist()
        reference = [checksum_reference(b) for b in _cells(enc.data, enc.offsets, enc.sizes)]
        assert enc.checksums.tolist() == reference
        torch_values = segment_checksums_torch(
            torch.from_numpy(enc.data), torch.from_numpy(enc.offsets), torch.from_numpy(enc.sizes)
        )
        assert torch_values.tolist() == reference
        assert verify(enc.data, enc.offsets, enc.sizes, enc.checksums).tolist() == []

    def test_checksum_catches_a_flipped_bit(self, codec: Codec, rng: np.random.Generator) -> None:
        sizes = np.full(50, 2000, dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        enc = codec.encode(data, offsets, sizes)
        damaged = enc.data.copy()
        damaged[enc.offsets[17] + enc.sizes[17] // 2] ^= 0x10
        assert verify(damaged, enc.offsets, enc.sizes, enc.checksums).tolist() == [17]
        on_torch = verify(
            torch.from_numpy(damaged), torch.from_numpy(enc.offsets), torch.from_numpy(enc.sizes), enc.checksums
        )
        assert on_torch.tolist() == [17]

    # -- errors ---------------------------------------------------------------------------

    def test_wrong_expected_size_is_corruption(self, codec: Codec, rng: np.random.Generator) -> None:
        sizes = np.array([1000, 2000, 3000], dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        enc = codec.encode(data, offsets, sizes)
        wrong = sizes.copy()
        wrong[1] += 5
        out = np.empty(int(wrong.sum()), np.uint8)
        with pytest.raises(CorruptionError, match=r"blob 1\b" if self.names_bad_blob else ""):
            codec.decode(enc.data, enc.offsets, enc.sizes, out, np.cumsum(wrong) - wrong, wrong)

    @pytest.mark.parametrize("damage", ["truncated", "garbage"])
    def test_corrupt_blob_raises_a_tiered_error(self, codec: Codec, damage: str, rng: np.random.Generator) -> None:
        if damage == "garbage" and not self.detects_garbage:
            pytest.skip(f"{type(self).__name__}: the codec decodes any bytes of the right length")
        sizes = np.full(40, 3000, dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        enc = codec.encode(data, offsets, sizes)
        bad = 23
        comp_sizes = enc.sizes.copy()
        comp = enc.data.copy()
        if damage == "truncated":
            comp_sizes[bad] -= 3
        else:
            comp[enc.offsets[bad] : enc.offsets[bad] + enc.sizes[bad]] = 0xFF
        out = np.empty(int(sizes.sum()), np.uint8)
        with pytest.raises(TieredError) as info:
            codec.decode(comp, enc.offsets, comp_sizes, out, offsets, sizes)
        assert isinstance(info.value, CorruptionError)
        if self.names_bad_blob:
            assert f"blob {bad}" in str(info.value)
            assert "tiered verify" in str(info.value)

    def test_decode_rejects_a_bad_destination(self, codec: Codec, rng: np.random.Generator) -> None:
        sizes = np.array([100, 100], dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "random")
        enc = codec.encode(data, offsets, sizes)
        with pytest.raises(ValueError, match="inside the buffer"):
            codec.decode(enc.data, enc.offsets, enc.sizes, np.empty(150, np.uint8), offsets, sizes)
        with pytest.raises(ValueError, match="one per blob"):
            codec.decode(enc.data, enc.offsets, enc.sizes, np.empty(200, np.uint8), offsets[:1], sizes[:1])
        read_only = np.empty(200, np.uint8)
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            codec.decode(enc.data, enc.offsets, enc.sizes, read_only, offsets, sizes)

    # -- identity -------------------------------------------------------------------------

    def test_name_round_trips_and_codec_pickles(self, codec: Codec, rng: np.random.Generator) -> None:
        assert get_codec(codec.name) == codec
        assert hash(get_codec(codec.name)) == hash(codec)
        assert get_codec(codec) is codec
        # stores travel to DataLoader workers pickled: the codec must serialize, and rebuild from the
        # reduce protocol pickle uses (deepcopy runs it without reading bytes back: nothing is unpickled)
        assert pickle.dumps(codec)
        clone = copy.deepcopy(codec)
        assert clone == codec and type(clone) is type(codec)
        sizes = np.array([300, 0, 500], dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        _roundtrip(clone, data, offsets, sizes)

    def test_format_id_names_a_decoder_of_the_same_bitstream(self, codec: Codec, rng: np.random.Generator) -> None:
        assert isinstance(codec.format, str) and codec.format
        assert isinstance(codec.format_id, int) and not isinstance(codec.format_id, bool)
        try:
            twin = codec_for_format_id(codec.format_id)
        except UnknownCodecError:
            pytest.skip(f"format id {codec.format_id} ({codec.format}) has no registered decoder")
        assert twin.format == codec.format and twin.format_id == codec.format_id
        # Two codecs of one format decode each other's blobs.
        sizes = rng.integers(0, 4000, 50)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        for writer, reader in ((codec, twin), (twin, codec)):
            enc = writer.encode(data, offsets, sizes)
            out = np.empty(int(sizes.sum()), np.uint8)
            reader.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
            assert out.tobytes() == data.tobytes()

    # -- threads --------------------------------------------------------------------------

    def test_concurrent_calls_on_one_codec(self, codec: Codec, rng: np.random.Generator) -> None:
        # A store may encode one field while a reader thread decodes another with the same codec.
        batches = []
        for _ in range(4):
            sizes = rng.integers(1, 3000, 64)
            batches.append((sizes, *_packed_batch(sizes, rng, "compressible")))
        errors: list[BaseException] = []

        def work(k: int) -> None:
            sizes, data, offsets = batches[k]
            try:
                for _ in range(5):
                    _roundtrip(codec, data, offsets, sizes)
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []

    def test_thread_count_does_not_change_the_bytes(self, rng: np.random.Generator) -> None:
        # Blob bytes are a function of the cells only, so stores written on any machine match.
        one, many = self._threaded(1), self._threaded(4)
        assert one == many
        sizes = rng.integers(0, 9000, 300)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        a, b = one.encode(data, offsets, sizes), many.encode(data, offsets, sizes)
        assert a.data.tobytes() == b.data.tobytes() and a.checksums.tolist() == b.checksums.tolist()
        for codec in (one, many):
            _roundtrip(codec, data, offsets, sizes)
        for bad in (0, -1, True, 1.5):
            with pytest.raises(ValueError, match="threads"):
                self.make_codec_with_threads(bad)  # type: ignore[arg-type]

    def test_threads_1_starts_no_thread(self, rng: np.random.Generator) -> None:
        codec = self._threaded(1)
        sizes = np.full(400, 2000, dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        out = np.empty(int(sizes.sum()), np.uint8)
        before = {t.ident for t in threading.enumerate()}
        enc = codec.encode(data, offsets, sizes)
        codec.decode(enc.data, enc.offsets, enc.sizes, out, offsets, sizes)
        assert out.tobytes() == data.tobytes()
        assert {t.ident for t in threading.enumerate()} == before

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
    def test_threaded_codec_works_in_a_forked_child(self, rng: np.random.Generator) -> None:
        # DataLoader workers are forked after the parent already used the codec thread pool; the
        # child inherits no threads, so the pool must be rebuilt there instead of deadlocking.
        codec = self._threaded(4)
        sizes = np.full(64, 3000, dtype=np.int64)
        data, offsets = _packed_batch(sizes, rng, "compressible")
        _roundtrip(codec, data, offsets, sizes)
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_roundtrip_in_child, args=(codec, queue))
        child.start()
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
            pytest.fail("the forked child hung: the codec thread pool was not rebuilt after fork")
        assert child.exitcode == 0
        assert queue.get(timeout=10) is True


# =============================================================================== tiers


def _batch(rng: np.random.Generator, n: int, lo: int = 0, hi: int = 3000) -> tuple[np.ndarray, ...]:
    """A codec-style batch: random blobs packed back to back in one buffer."""
    sizes = rng.integers(lo, hi, n).astype(np.int64)
    data = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    return data, np.cumsum(sizes) - sizes, sizes


def _read_back(tier: Tier, offsets: np.ndarray, sizes: np.ndarray, out_kind: str = "numpy",
               order: np.ndarray | None = None) -> list[bytes]:
    """Read blobs into a packed output (optionally in another order); return their bytes."""
    offsets, sizes = np.asarray(offsets), np.asarray(sizes)
    order = np.arange(len(sizes)) if order is None else order
    o, s = offsets[order], sizes[order]
    out_off = np.cumsum(s) - s
    if out_kind == "numpy":
        out = np.full(int(s.sum()), 0xAB, dtype=np.uint8)
    else:
        out = torch.full((int(s.sum()),), 0xAB, dtype=torch.uint8)
    tier.read(o, s, out, out_off)
    got = _cells(out if isinstance(out, np.ndarray) else out.numpy(), out_off, s)
    result: list[bytes] = [b""] * len(sizes)
    for k, i in enumerate(order.tolist()):
        result[i] = got[k]
    return result


class TierTests:
    """The tier contract (:mod:`tiered.tiers.base`). Subclass it and define :meth:`make_tier`.

    Class attributes a subclass may change:

    * ``durable``: ``True`` for tiers whose bytes outlive the process (files). Their ``free``
      defers reuse until the next durable commit (:meth:`settle`); memory tiers reuse at once.
    """

    durable: bool = False

    def make_tier(self, tmp_path: Any, budget: int | None) -> Tier:
        """A new, empty tier under ``budget`` bytes (``None``: the tier's default or unbounded);
        file tiers keep their files under ``tmp_path`` (a :class:`pathlib.Path`)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_tier(self, tmp_path, budget)")

    def settle(self, tier: Tier) -> None:
        """Make freed space reusable, as a store's durable commit does: flush, then (durable
        tiers) ``release_deferred()``."""
        tier.flush()
        if self.durable:
            tier.release_deferred()  # type: ignore[attr-defined]

    def _free_now(self, tier: Tier, offsets: np.ndarray, sizes: np.ndarray) -> None:
        """Free space no durable commit references (reusable at once on every tier)."""
        tier.free(offsets, sizes, defer=False)

    @pytest.fixture
    def tier(self, tmp_path: Any) -> Any:
        t = self.make_tier(tmp_path, None)
        yield t
        t.close()

    @pytest.fixture
    def small_tier(self, tmp_path: Any) -> Any:
        t = self.make_tier(tmp_path, 8192)
        yield t
        t.close()

    # -- the interface --------------------------------------------------------------------

    def test_is_a_tier(self, tier: Tier) -> None:
        assert isinstance(tier, Tier)
        assert tier.name in ("hot", "warm", "cold")
        assert isinstance(tier.device, torch.device)
        st = tier.stats()
        assert {"bytes_used", "budget", "fragmentation"} <= set(st)
        assert st["bytes_used"] == tier.bytes_used == 0 and st["budget"] == tier.budget
        assert 0.0 <= st["fragmentation"] <= 1.0

    # -- bytes in, bytes out --------------------------------------------------------------

    @pytest.mark.parametrize("out_kind", ["numpy", "torch"])
    def test_round_trip_bit_exact(self, tier: Tier, out_kind: str) -> None:
        rng = np.random.default_rng(0)
        written = []
        for n in (1, 7, 64, 256):
            data, src_off, sizes = _batch(rng, n)
            offsets = tier.allocate(sizes)
            assert offsets.dtype == np.int64 and offsets.shape == (n,)
            tier.write(offsets, data, src_off, sizes)
            written.append((offsets, sizes, _cells(data, src_off, sizes)))
        tier.flush()
        for offsets, sizes, expect in written:
            assert _read_back(tier, offsets, sizes, out_kind) == expect
            order = rng.permutation(len(sizes))
            assert _read_back(tier, offsets, sizes, out_kind, order) == expect

    def test_write_from_torch_and_scattered_source(self, tier: Tier) -> None:
        rng = np.random.default_rng(1)
        data, src_off, sizes = _batch(rng, 50)
        # the source blobs in reverse order with 7-byte gaps: nothing is contiguous
        rev = sizes[::-1] + 7
        src_off2 = (np.cumsum(rev) - rev)[::-1] + 5
        src = torch.zeros(int(rev.sum()) + 10, dtype=torch.uint8)
        for a, b, n in zip(src_off, src_off2, sizes, strict=True):
            src[b:b + n] = torch.from_numpy(data[a:a + n])
        offsets = tier.allocate(sizes)
        tier.write(offsets, src, src_off2, sizes)
        assert _read_back(tier, offsets, sizes) == _cells(data, src_off, sizes)

    def test_zero_size_and_empty_batches(self, tier: Tier) -> None:
        off = tier.allocate(np.array([], dtype=np.int64))
        assert off.shape == (0,)
        tier.write(off, np.zeros(0, np.uint8), off, off)
        tier.read(off, off, np.zeros(0, np.uint8), off)
        data = np.arange(20, dtype=np.uint8)
        sizes = np.array([0, 20, 0])
        off = tier.allocate(sizes)
        tier.write(off, data, np.array([0, 0, 20]), sizes)
        assert _read_back(tier, off, sizes) == [b"", data.tobytes(), b""]

    def test_offsets_aligned(self, tier: Tier) -> None:
        rng = np.random.default_rng(2)
        for _ in range(5):
            sizes = rng.integers(1, 5000, 40)
            off = tier.allocate(sizes)
            assert (off % ALIGNMENT == 0).all()
            # live ranges never overlap
            o = np.sort(off)
            s = align(sizes)[np.argsort(off)]
            assert (o[1:] >= o[:-1] + s[:-1]).all()

    # -- accounting -----------------------------------------------------------------------

    def test_bytes_used_counts_aligned_sizes(self, tier: Tier) -> None:
        sizes = np.array([1, 16, 17, 100])
        off = tier.allocate(sizes)
        assert tier.bytes_used == int(align(sizes).sum()) == 16 + 16 + 32 + 112
        self._free_now(tier, off[:2], sizes[:2])
        assert tier.bytes_used == 32 + 112
        assert tier.stats()["bytes_used"] == 32 + 112

    def test_fragmentation_in_unit_interval(self, tier: Tier) -> None:
        rng = np.random.default_rng(5)
        assert tier.stats()["fragmentation"] == 0.0
        sizes = rng.integers(16, 400, 200)
        off = tier.allocate(sizes)
        sel = rng.random(200) < 0.5
        sel[-1] = False
        tier.free(off[sel], sizes[sel])
        self.settle(tier)
        f = tier.stats()["fragmentation"]
        assert 0.0 < f < 1.0
        tier.free(off[~sel], sizes[~sel])
        self.settle(tier)
        assert tier.stats()["fragmentation"] == 0.0
        assert tier.bytes_used == 0

    # -- freeing --------------------------------------------------------------------------

    def test_free_then_reuse(self, tier: Tier) -> None:
        rng = np.random.default_rng(3)
        data, src_off, sizes = _batch(rng, 30, 100, 2000)
        a = tier.allocate(sizes)
        tier.write(a, data, src_off, sizes)
        keep = tier.allocate(np.array([64]))  # something after `a`, so `a` stays a hole
        tier.free(a, sizes)
        if self.durable:
            # deferred: the space of `a` is not reused before the freeing commit is durable
            b = tier.allocate(sizes)
            assert not np.isin(b, a).any()
            assert _read_back(tier, a, sizes) == _cells(data, src_off, sizes)  # still intact
            self._free_now(tier, b, sizes)
            self.settle(tier)
        c = tier.allocate(sizes)
        assert int(c.min()) == int(a.min())  # the hole is reused
        assert tier.bytes_used == int(align(sizes).sum()) + 64
        assert keep.shape == (1,)

    def test_defer_follows_durability(self, tier: Tier) -> None:
        sizes = np.array([512, 512])
        off = tier.allocate(sizes)
        tier.free(off[:1], sizes[:1], defer=True)
        again = tier.allocate(sizes[:1])
        assert tier.bytes_used == 2 * 512  # a freed range is not a live blob, deferred or not
        if self.durable:
            # the freed range still belongs to the last durable commit: the batch gets new space
            assert again[0] != off[0]
            self.settle(tier)
            self._free_now(tier, again, sizes[:1])
            assert tier.allocate(sizes[:1]).tolist() == [off[0]]
        else:
            # memory does not outlive the process: nothing to defer, the range is reused at once
            assert again.tolist() == [off[0]]

    # -- the budget -----------------------------------------------------------------------

    def test_storage_full_is_all_or_nothing(self, small_tier: Tier) -> None:
        t, budget = small_tier, 8192
        rng = np.random.default_rng(4)
        data, src_off, sizes = _batch(rng, 4, 1000, 1500)
        off = t.allocate(sizes)
        t.write(off, data, src_off, sizes)
        used, stats = t.bytes_used, t.stats()
        big = np.array([1000, 1000, 1000, 1000])
        with pytest.raises(StorageFullError) as e:
            t.allocate(big)
        msg = str(e.value)
        assert str(int(align(big).sum())) in msg and str(budget) in msg and str(used) in msg
        assert t.bytes_used == used and t.stats() == stats
        assert _read_back(t, off, sizes) == _cells(data, src_off, sizes)
        # what does fit still goes in, where the failed batch would have gone
        more = t.allocate(np.array([budget - used]))
        assert t.bytes_used == budget
        with pytest.raises(StorageFullError):
            t.allocate(np.array([1]))
        self._free_now(t, more, np.array([budget - used]))
        assert t.bytes_used == used

    def test_blob_larger_than_budget_is_a_value_error(self, tmp_path: Any) -> None:
        t = self.make_tier(tmp_path, 4096)
        with pytest.raises(ValueError, match="4112 bytes.*4096") as e:
            t.allocate(np.array([10, 4100]))
        assert not isinstance(e.value, StorageFullError)
        assert t.bytes_used == 0
        t.allocate(np.array([4096]))  # exactly the budget fits
        assert t.bytes_used == 4096
        t.close()

    # -- a long random run ----------------------------------------------------------------

    def test_random_operations_match_a_model(self, tier: Tier) -> None:
        """2000 random allocate/write/free/read operations checked against a dict."""
        rng = np.random.default_rng(6)
        model: dict[int, bytes] = {}  # offset -> bytes
        for step in range(2000):
            op = rng.random()
            if op < 0.4 or not model:
                data, src_off, sizes = _batch(rng, int(rng.integers(1, 9)), 0, 1500)
                try:
                    off = tier.allocate(sizes)
                except StorageFullError:
                    continue
                tier.write(off, data, src_off, sizes)
                for o, b in zip(off.tolist(), _cells(data, src_off, sizes), strict=True):
                    if b:
                        assert o not in model
                        model[o] = b
            elif op < 0.7:
                keys = list(model)
                pick = rng.choice(len(keys), size=min(len(keys), int(rng.integers(1, 9))), replace=False)
                off = np.array([keys[i] for i in pick], dtype=np.int64)
                tier.free(off, np.array([len(model[o]) for o in off.tolist()]))
                for o in off.tolist():
                    del model[o]
            else:
                keys = list(model)
                pick = rng.choice(len(keys), size=min(len(keys), int(rng.integers(1, 33))), replace=False)
                off = np.array([keys[i] for i in pick], dtype=np.int64)
                sizes = np.array([len(model[o]) for o in off.tolist()])
                out_kind = "torch" if step % 2 else "numpy"
                assert _read_back(tier, off, sizes, out_kind) == [model[o] for o in off.tolist()]
            if self.durable and step % 50 == 0:
                self.settle(tier)
            # live blobs never overlap
            if step % 100 == 0 and model:
                o = np.array(sorted(model))
                s = align(np.array([len(model[k]) for k in o.tolist()]))
                assert (o[1:] >= o[:-1] + s[:-1]).all()
        assert tier.bytes_used == sum(int(align(np.array([len(b)]))[0]) for b in model.values())
        off = np.array(list(model), dtype=np.int64)
        assert _read_back(tier, off, np.array([len(model[o]) for o in model])) == list(model.values())

    # -- closing --------------------------------------------------------------------------

    def test_close_twice(self, tmp_path: Any) -> None:
        t = self.make_tier(tmp_path, None)
        data = np.arange(100, dtype=np.uint8)
        off = t.allocate(np.array([100]))
        t.write(off, data, np.array([0]), np.array([100]))
        t.flush()
        assert _read_back(t, off, np.array([100])) == [data.tobytes()]
        t.close()
        t.close()  # a second close (an exit path after an error path) is harmless


# =============================================================================== policies


@dataclass
class BlobHistory:
    """What happened to one live blob, as :class:`PolicyTests`' reference model records it.

    Every policy call (``on_insert``, ``on_access``, ``set_priority``, ``on_release``) is one
    event, numbered from 1 in call order.

    Attributes:
        inserted_at: the event that inserted the blob (its age: smaller is older).
        last_used_at: the last ``on_insert`` or ``on_access`` event naming the blob.
        priority: the largest priority the last ``set_priority`` naming it gave it (the
            suite's ``default_priority`` before that).

    Example:
        >>> BlobHistory(inserted_at=1, last_used_at=4, priority=1.0)
        BlobHistory(inserted_at=1, last_used_at=4, priority=1.0)
    """

    inserted_at: int
    last_used_at: int
    priority: float


class _Reference:
    """The reference model: per live blob its :class:`BlobHistory`; evicts by a key function."""

    def __init__(self, key: Callable[[BlobHistory], tuple], default_priority: float) -> None:
        self.key = key
        self.default_priority = default_priority
        self.blobs: dict[int, BlobHistory] = {}
        self.events = 0

    def apply(self, policy: Policy, event: str, ids: np.ndarray, values: np.ndarray | None = None) -> None:
        """Send one event to ``policy`` and record it here."""
        self.events += 1
        if event == "insert":
            policy.on_insert(ids)
            for i in ids.tolist():
                self.blobs[i] = BlobHistory(self.events, self.events, self.default_priority)
        elif event == "access":
            policy.on_access(ids)
            for i in ids.tolist():
                self.blobs[i].last_used_at = self.events
        elif event == "priority":
            policy.set_priority(ids, values)
            best: dict[int, float] = {}
            for i, v in zip(ids.tolist(), np.asarray(values).tolist(), strict=True):
                best[i] = max(best.get(i, -np.inf), v)
            for i, v in best.items():
                self.blobs[i].priority = v
        else:
            policy.on_release(ids)
            for i in ids.tolist():
                del self.blobs[i]

    def order(self, ids: np.ndarray) -> list[int]:
        """Eviction order of ``ids``: by key, then by position in ``ids`` (a stable sort)."""
        return [int(ids[p]) for p in sorted(range(ids.size), key=lambda p: (*self.key(self.blobs[int(ids[p])]), p))]

    def victims(self, ids: np.ndarray, sizes: np.ndarray, need: int) -> list[int]:
        """The shortest prefix of the order holding ``need`` bytes (all when they hold less)."""
        if need <= 0:
            return []
        size_of = dict(zip(ids.tolist(), sizes.tolist(), strict=True))
        taken, total = [], 0
        for i in self.order(ids):
            if total >= need:
                break
            taken.append(i)
            total += size_of[i]
        return taken


def _random_history(rng: np.random.Generator, steps: int) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
    """Inserts (ids reused after release, or new), reads, priorities with ties, releases."""
    events: list[tuple[str, np.ndarray, np.ndarray | None]] = []
    live: list[int] = []
    released: list[int] = []
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or len(live) < 4:
            n = int(rng.integers(1, 5))
            reuse = [released.pop(int(rng.integers(len(released)))) for _ in range(min(n // 2, len(released)))]
            fresh = list(range(next_id, next_id + n - len(reuse)))
            next_id += len(fresh)
            ids = np.array(reuse + fresh, dtype=np.int64)
            live += ids.tolist()
            events.append(("insert", ids, None))
        elif op < 0.65:
            events.append(("access", rng.choice(live, int(rng.integers(1, 4))).astype(np.int64), None))
        elif op < 0.85:
            ids = rng.choice(live, int(rng.integers(1, 5))).astype(np.int64)  # duplicates: the max wins
            events.append(("priority", ids, rng.choice([0.0, 0.5, 1.0, 2.0], ids.size)))
        else:
            gone = rng.choice(live, int(rng.integers(1, 3)), replace=False).astype(np.int64)
            live = [i for i in live if i not in set(gone.tolist())]
            released += gone.tolist()
            events.append(("release", gone, None))
    return events


def recounted_blob_priorities(store: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(live blob ids, expected priorities)`` of a store, recounted the slow, obvious way: for each
    live blob the max of the priorities of the unstaged rows whose table entries name it (0 when
    none does). The reference the store's incremental bookkeeping is checked against.

    Example:
        >>> from tiered import TieredStore
        >>> recounted_blob_priorities(TieredStore(4))[0].tolist()
        []
    """
    from .inspection import parts

    p = parts(store)
    live = p.index.live_ids()
    expected = np.zeros(live.size)
    layout, stage = p.layout, p.write.stage
    if layout is None:
        return live, expected
    rows = np.flatnonzero(p.rows.written)
    if stage is not None and stage.count:
        rows = rows[stage.staged(rows) < 0]
    position = {int(b): i for i, b in enumerate(live.tolist())}
    priority = store.priorities(rows) if rows.size else np.empty(0)
    for table in layout.tables.values():  # the reference is a plain loop on purpose
        ids = table.ids(rows).tolist()
        for r_ids, p_row in zip(ids, priority.tolist(), strict=True):
            for b in r_ids:
                if b >= 0:
                    expected[position[b]] = max(expected[position[b]], p_row)
    return live, expected


def _stacked_frames(n: int, seed: int, start: int = 0) -> Any:
    """``n`` rows of 4-frame stacks over one frame sequence (row t shows frames t..t+3) with next
    stacks: every frame is shared by up to 8 row entries, the sharing dedup turns into blob refs."""
    from tensordict import TensorDict

    frames = torch.from_numpy(np.random.default_rng(seed).integers(0, 8, (n + 4, 24, 24), dtype=np.uint8))
    obs = torch.stack([frames[t:t + 4] for t in range(n)])
    nxt = torch.stack([frames[t + 1:t + 5] for t in range(n)])
    return TensorDict({"observation": obs, ("next", "observation"): nxt,
                       ("collector", "traj_ids"): torch.full((n,), start)}, [n])


class PolicyTests:
    """The policy contract (:class:`tiered.policy.Policy`). Subclass it and define
    :meth:`make_policy` and :meth:`eviction_key`.

    ``eviction_key(blob)`` states the policy's rule: blobs with the smaller key leave first
    (ties: the order of the ids the store passed). The suite replays scripted and random
    histories on the policy and on a reference model keyed by it, and checks that both pick the
    same victims, in the same order. ``default_priority`` is the priority of a blob no
    ``set_priority`` call has named.
    """

    default_priority: float = 1.0

    def make_policy(self) -> Policy:
        """A new policy that has seen nothing."""
        raise NotImplementedError(f"{type(self).__name__} must define make_policy(self)")

    def eviction_key(self, blob: BlobHistory) -> tuple:
        """The policy's rule: the sort key of a blob (smaller leaves first)."""
        raise NotImplementedError(f"{type(self).__name__} must define eviction_key(self, blob)")

    def _reference(self) -> _Reference:
        return _Reference(self.eviction_key, self.default_priority)

    def _check(self, policy: Policy, ref: _Reference, rng: np.random.Generator) -> None:
        """The policy's order and victims over the live blobs (in a random order) match the model."""
        ids = rng.permutation(np.array(sorted(ref.blobs), dtype=np.int64))
        assert policy.order(ids).tolist() == ref.order(ids)
        sizes = rng.integers(0, 6, ids.size) * ALIGNMENT
        need = int(rng.integers(-16, int(sizes.sum()) + 32))
        got = policy.victims(ids, sizes, need)
        assert got.dtype == np.int64
        assert got.tolist() == ref.victims(ids, sizes, need)

    # -- which blobs leave ----------------------------------------------------------------

    def test_scripted_history_evicts_by_the_rule(self) -> None:
        policy, ref = self.make_policy(), self._reference()
        rng = np.random.default_rng(0)
        ref.apply(policy, "insert", np.array([0, 1, 2]))
        ref.apply(policy, "insert", np.array([3]))
        ref.apply(policy, "insert", np.array([4, 5]))
        self._check(policy, ref, rng)
        ref.apply(policy, "access", np.array([1]))  # read order matters: 1, then 0, then 4 and 2 together
        ref.apply(policy, "access", np.array([0]))
        ref.apply(policy, "access", np.array([4, 2]))
        self._check(policy, ref, rng)
        ref.apply(policy, "priority", np.array([5, 3, 3]), np.array([0.5, 2.0, 0.0]))  # 3 gets 2.0
        ref.apply(policy, "priority", np.array([0, 1]), np.array([0.5, 0.5]))  # ties: the older first
        for _ in range(5):
            self._check(policy, ref, rng)
        ids = np.arange(6, dtype=np.int64)
        assert policy.order(ids).tolist() == ref.order(ids)

    @pytest.mark.parametrize("seed", range(4))
    def test_random_history_evicts_by_the_rule(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        policy, ref = self.make_policy(), self._reference()
        for event, ids, values in _random_history(rng, 300):
            ref.apply(policy, event, ids, values)
            if ref.blobs:
                self._check(policy, ref, rng)

    def test_order_is_a_permutation_of_the_ids(self) -> None:
        policy = self.make_policy()
        policy.on_insert(np.arange(10))
        policy.on_access(np.array([3, 7]))
        ids = np.array([9, 2, 7, 3, 0], dtype=np.int64)
        got = policy.order(ids)
        assert got.dtype == np.int64 and sorted(got.tolist()) == sorted(ids.tolist())
        assert policy.order(np.empty(0, np.int64)).tolist() == []

    def test_victims_are_the_shortest_prefix_covering_need(self) -> None:
        policy = self.make_policy()
        for i in range(6):
            policy.on_insert(np.array([i]))
        ids = np.array([4, 0, 5, 1, 3, 2], dtype=np.int64)
        sizes = np.array([16, 0, 32, 48, 16, 64], dtype=np.int64)
        order = policy.order(ids).tolist()
        size_of = dict(zip(ids.tolist(), sizes.tolist(), strict=True))
        ends = np.cumsum([size_of[i] for i in order])
        for need in range(1, int(sizes.sum()) + 40):
            k = int(np.argmax(ends >= need)) + 1 if ends[-1] >= need else len(order)
            assert policy.victims(ids, sizes, need).tolist() == order[:k], need
            # exactly enough: one blob fewer would not cover `need`
            if ends[-1] >= need:
                assert k == 1 or ends[k - 2] < need

    def test_victims_of_nothing(self) -> None:
        policy = self.make_policy()
        policy.on_insert(np.array([0, 1]))
        ids, sizes = np.array([0, 1]), np.array([16, 16])
        for got in (policy.victims(ids, sizes, 0), policy.victims(ids, sizes, -5),
                    policy.victims(np.empty(0, np.int64), np.empty(0, np.int64), 100)):
            assert got.dtype == np.int64 and got.tolist() == []
        assert sorted(policy.victims(ids, sizes, 10**9).tolist()) == [0, 1]  # not enough: all

    def test_reused_ids_behave_as_new_blobs(self) -> None:
        # One policy reuses id 2 after releasing it, the other gets a never-seen id 99 instead:
        # both must then decide alike, whatever id 2 went through before.
        reused, fresh = self.make_policy(), self.make_policy()
        for policy, new_id in ((reused, 2), (fresh, 99)):
            policy.on_insert(np.array([0, 1, 2]))
            policy.on_insert(np.array([3]))
            policy.on_access(np.array([2]))
            policy.set_priority(np.array([2, 0]), np.array([5.0, 0.5]))
            policy.on_release(np.array([2]))
            policy.on_access(np.array([1]))
            policy.on_insert(np.array([new_id]))
            policy.on_access(np.array([0]))
        for ids in ([0, 1, "new", 3], ["new", 3, 1, 0]):
            got = reused.order(np.array([2 if i == "new" else i for i in ids])).tolist()
            expect = fresh.order(np.array([99 if i == "new" else i for i in ids])).tolist()
            assert got == [2 if i == 99 else i for i in expect]

    # -- priorities -----------------------------------------------------------------------

    def test_set_priority_rejects_non_finite_values(self) -> None:
        policy = self.make_policy()
        policy.on_insert(np.array([0, 1]))
        before = policy.order(np.array([0, 1])).tolist()
        for bad in (np.nan, np.inf, -np.inf):
            with pytest.raises(InvalidPriorityError):
                policy.set_priority(np.array([0, 1]), np.array([1.0, bad]))
        assert policy.order(np.array([0, 1])).tolist() == before  # a rejected call changes nothing
        policy.set_priority(np.array([0, 1]), np.array([3.0, 0.0]))  # finite values are accepted

    # -- admission and promotion ----------------------------------------------------------

    def _default_decision(self, method: str) -> Policy:
        policy = self.make_policy()
        if getattr(type(policy), method) is not getattr(Policy, method):
            pytest.skip(f"{type(policy).__name__} decides {method} itself; its own tests check it")
        return policy

    @pytest.mark.parametrize("exclusive", [True, False], ids=["exclusive", "cache"])
    @pytest.mark.parametrize("budget", [None, 0, 4096])
    def test_admit_by_default_takes_every_new_blob(self, exclusive: bool, budget: int | None) -> None:
        policy = self._default_decision("admit")
        tier = TierState("warm", budget=budget, bytes_used=0, exclusive=exclusive)
        mask = policy.admit(np.array([4, 9, 2]), np.array([16, 4096, 32]), tier)
        assert mask.dtype == bool and mask.tolist() == [True, True, True]
        assert policy.admit(np.empty(0, np.int64), np.empty(0, np.int64), tier).tolist() == []

    @pytest.mark.parametrize(("exclusive", "limit"), [(True, 400 // 4), (False, 400 // 2)],
                             ids=["exclusive-quarter", "cache-half"])
    def test_promote_by_default_takes_a_prefix_under_a_share_of_the_budget(self, exclusive: bool,
                                                                           limit: int) -> None:
        policy = self._default_decision("promote")
        tier = TierState("hot", budget=400, bytes_used=300, exclusive=exclusive)
        ids = np.array([7, 3, 5, 1, 8, 6], dtype=np.int64)
        sizes = np.array([16, 32, 48, 16, 64, 16], dtype=np.int64)  # running total 16 48 96 112 176 192
        mask = policy.promote(ids, sizes, tier)
        assert mask.dtype == bool and mask.shape == ids.shape
        expect = (np.cumsum(sizes) <= limit).tolist()
        assert mask.tolist() == expect
        # a prefix in the order given, not the smallest blobs: a later small blob stays out
        assert expect == ([True, True, True, False, False, False] if exclusive else [True] * 6)
        # sizes count aligned: 16 one-byte blobs take 16 * 16 bytes
        ones = policy.promote(np.arange(16), np.ones(16, np.int64), tier)
        assert int(ones.sum()) == limit // ALIGNMENT
        assert policy.promote(np.empty(0, np.int64), np.empty(0, np.int64), tier).tolist() == []

    @pytest.mark.parametrize("exclusive", [True, False], ids=["exclusive", "cache"])
    @pytest.mark.parametrize("budget", [None, 0, 3], ids=["unbounded", "zero", "smaller-than-a-blob"])
    def test_promote_nothing_without_a_budget(self, exclusive: bool, budget: int | None) -> None:
        policy = self._default_decision("promote")
        tier = TierState("warm", budget=budget, bytes_used=0, exclusive=exclusive)
        assert policy.promote(np.array([0, 1]), np.array([16, 16]), tier).tolist() == [False, False]

    # -- the store: a blob's priority is the max over the rows that reference it --------------

    def _store(self, path: Any = None, **options: Any) -> Any:
        from ..store import TieredStore

        options = {"frames": {"observation": 0}, "chunk_frames": 2, "stage_rows": 64, **options}
        return TieredStore(32, path, policy=self.make_policy(), **options)

    def _check_store(self, store: Any) -> None:
        from .inspection import parts

        live, expected = recounted_blob_priorities(store)
        priorities = parts(store).placement.priorities
        assert priorities.blob_priorities(live).tolist() == expected.tolist()
        if hasattr(parts(store).placement.policy, "priorities"):
            assert parts(store).placement.policy.priorities(live).tolist() == expected.tolist()

    def test_store_blob_priority_is_the_max_over_sharing_rows_across_calls(self) -> None:
        store = self._store(stage_rows=0)
        store.extend(_stacked_frames(20, seed=0))
        store.set_priority(np.arange(20), np.linspace(0.1, 2.0, 20))
        self._check_store(store)
        store.set_priority([5], 9.0)        # one row up: its blobs go up, shared ones included
        self._check_store(store)
        store.set_priority([5, 5, 6], [0.0, 0.2, 0.3])  # down again (duplicates: the last wins)
        self._check_store(store)
        assert store.priorities([5, 6]).tolist() == [0.2, 0.3]
        store.extend(_stacked_frames(16, seed=1, start=1))  # overwrites rows 20..31 and 0..3
        self._check_store(store)
        store.set(np.array([7, 8]), _stacked_frames(2, seed=2, start=2))
        self._check_store(store)
        assert store.priorities([0, 7, 8]).tolist() == [1.0, 1.0, 1.0]  # rewritten: the default
        assert store.priorities([10]).tolist() == [np.linspace(0.1, 2.0, 20)[10]]  # untouched

    def test_store_priority_of_a_staged_row_lands_on_its_own_blobs(self) -> None:
        store = self._store()
        store.extend(_stacked_frames(24, seed=3))
        store.flush()
        store.set_priority(np.arange(24), 0.5)
        store.set_priority([2], 7.0)
        self._check_store(store)
        # a small write is staged: row 2's table entries still name the old frames' blobs, which
        # lose row 2 (and its 7.0) now; the 8.0 set while staged lands on the new blobs at the flush
        store.set(2, _stacked_frames(1, seed=4, start=5)[0])
        assert store.stats()["staged_rows"] == 1
        self._check_store(store)
        store.set_priority([2], 8.0)
        self._check_store(store)
        store.flush()
        assert store.stats()["staged_rows"] == 0
        self._check_store(store)
        live, expected = recounted_blob_priorities(store)
        assert 8.0 in expected.tolist() and 7.0 not in expected.tolist()

    def test_store_priorities_survive_reopen(self, tmp_path: Any) -> None:
        from ..store import TieredStore

        path = tmp_path / "store"
        store = self._store(path)
        store.extend(_stacked_frames(24, seed=5))
        rng = np.random.default_rng(0)
        store.set_priority(np.arange(24), rng.pareto(1.5, 24))
        rows_before = store.priorities(np.arange(24)).tolist()
        live_before, expected_before = recounted_blob_priorities(store)
        store.close()
        reopened = TieredStore.open(path, mode="r+", policy=self.make_policy())
        assert reopened.priorities(np.arange(24)).tolist() == rows_before
        live, expected = recounted_blob_priorities(reopened)
        assert live.tolist() == live_before.tolist() and expected.tolist() == expected_before.tolist()
        self._check_store(reopened)
        reopened.close()

    # -- saved state ----------------------------------------------------------------------

    def _policy_with_history(self, seed: int = 0, steps: int = 120) -> tuple[Policy, _Reference]:
        policy, ref = self.make_policy(), self._reference()
        for event, ids, values in _random_history(np.random.default_rng(seed), steps):
            ref.apply(policy, event, ids, values)
        return policy, ref

    def test_state_arrays_are_plain_numpy(self, tmp_path: Any) -> None:
        policy, _ = self._policy_with_history()
        arrays = policy.state_arrays()
        assert arrays and all(isinstance(k, str) for k in arrays)
        for key, value in arrays.items():
            assert isinstance(value, np.ndarray) and value.dtype != object, key
        path = tmp_path / "policy.npz"
        np.savez(path, **arrays)
        with np.load(path, allow_pickle=False) as loaded:
            assert sorted(loaded.files) == sorted(arrays)
            assert all(np.array_equal(loaded[k], arrays[k]) for k in arrays)

    @pytest.mark.parametrize("seed", range(3))
    def test_restored_state_makes_the_same_decisions(self, seed: int, tmp_path: Any) -> None:
        rng = np.random.default_rng(seed)
        history = _random_history(rng, 400)
        policy, ref = self.make_policy(), self._reference()
        for event, ids, values in history[:200]:
            ref.apply(policy, event, ids, values)
        path = tmp_path / "policy.npz"
        np.savez(path, **policy.state_arrays())
        restored = self.make_policy()
        with np.load(path, allow_pickle=False) as loaded:
            restored.load_state_arrays({k: loaded[k] for k in loaded.files})
        assert {k: v.tolist() for k, v in restored.state_arrays().items()} == \
            {k: v.tolist() for k, v in policy.state_arrays().items()}
        twin = _Reference(self.eviction_key, self.default_priority)
        twin.blobs, twin.events = {k: BlobHistory(**vars(v)) for k, v in ref.blobs.items()}, ref.events
        for event, ids, values in history[200:]:
            ref.apply(policy, event, ids, values)
            twin.apply(restored, event, ids, values)
            if ref.blobs:
                live = rng.permutation(np.array(sorted(ref.blobs), dtype=np.int64))
                sizes = rng.integers(0, 6, live.size) * ALIGNMENT
                need = int(rng.integers(1, int(sizes.sum()) + 32))
                assert restored.order(live).tolist() == policy.order(live).tolist() == ref.order(live)
                assert restored.victims(live, sizes, need).tolist() == policy.victims(live, sizes, need).tolist()

    def test_state_with_missing_or_unknown_keys_is_corruption(self) -> None:
        policy, _ = self._policy_with_history()
        arrays = policy.state_arrays()
        for key in arrays:
            with pytest.raises(CorruptionError, match=repr(key)):
                self.make_policy().load_state_arrays({k: v for k, v in arrays.items() if k != key})
        with pytest.raises(CorruptionError, match="'surprise'"):
            self.make_policy().load_state_arrays({**arrays, "surprise": np.zeros(3)})
        with pytest.raises(CorruptionError, match="mapping"):
            self.make_policy().load_state_arrays(list(arrays.values()))  # type: ignore[arg-type]

    def test_state_with_wrong_dtypes_or_shapes_is_corruption(self) -> None:
        policy, _ = self._policy_with_history()
        arrays = policy.state_arrays()
        for key, value in arrays.items():
            other_dtype = value.astype(np.float32 if value.dtype.kind != "f" else np.int64)
            for bad in (other_dtype, value.astype(object), value[None], value.tolist()):
                with pytest.raises(CorruptionError, match=repr(key)):
                    self.make_policy().load_state_arrays({**arrays, key: bad})

    def test_state_with_bad_values_is_corruption(self) -> None:
        policy, _ = self._policy_with_history()
        arrays = policy.state_arrays()
        clock = int(arrays["clock"]) if "clock" in arrays else None
        cases: list[tuple[str, dict[str, np.ndarray]]] = []
        for key, value in arrays.items():
            if value.ndim != 1 or value.size == 0:
                continue
            for bad in ([np.nan, np.inf, -1.0] if value.dtype.kind == "f" else
                        [-1] + ([clock + 1] if clock is not None else [])):
                damaged = value.copy()
                damaged[value.size // 2] = bad
                cases.append((key, {**arrays, key: damaged}))
        if clock is not None:
            cases.append(("clock", {**arrays, "clock": np.array(-1, dtype=arrays["clock"].dtype)}))
        columns = [k for k, v in arrays.items() if v.ndim == 1]
        if len(columns) > 1:
            cases.append(("length", {**arrays, columns[-1]: arrays[columns[-1]][:-1]}))
        assert cases
        for what, damaged_arrays in cases:
            with pytest.raises(CorruptionError, match=repr(what) if what != "length" else "length"):
                self.make_policy().load_state_arrays(damaged_arrays)

    def test_failed_load_leaves_the_policy_unchanged(self) -> None:
        policy, ref = self._policy_with_history(seed=1)
        before = {k: v.copy() for k, v in policy.state_arrays().items()}
        other, _ = self._policy_with_history(seed=2)
        damaged = {**other.state_arrays(), "surprise": np.zeros(1)}
        with pytest.raises(CorruptionError):
            policy.load_state_arrays(damaged)
        after = policy.state_arrays()
        assert sorted(after) == sorted(before) and all(np.array_equal(after[k], before[k]) for k in before)
        self._check(policy, ref, np.random.default_rng(0))
