"""The GPU sample path: blobs from every tier decoded on the GPU in one batched nvCOMP call.

:class:`GpuReadPipeline` (set up by a :class:`GpuDecoder`) replaces the CPU read pipeline of
:meth:`TieredStore.get` for stores whose ``device`` is CUDA. For the unique blobs of a sample::

      hot arena (CUDA)         warm arena (pinned)      cold files (memmap/HDF5)     open chunks (raw)
            |                        |                          |                          |
            |                        +---- tier.read ----+------+                          |
            |                                            v                                 v
            |                         pinned staging: [tables | raw rows | staged blobs | filler]
            |                                            |  one async H2D copy (side stream)
            v                                            v
      word gather (D2D) ------------------> device block: [tables | raw rows | staged | filler | hot]
                                                         |
                           checksums of every blob on the GPU (fused prefix sums), one flag to the host
                                                         |  (nothing corrupt ever reaches nvCOMP)
                           one nvCOMP decode: as_arrays(block) -> as_arrays(out), cached config
                                                         |
                           consumer stream waits on an event; rows gathered with index_select

Everything runs on a per-thread non-default CUDA stream (``side``): it first waits for the
caller's current stream and for the last hot-tier write (:meth:`GpuDecoder.fence_writes`), and
the caller's stream waits on an event recorded after the decode, so no host synchronization is
needed except the one-flag checksum verdict (verification is never skipped: nvCOMP's decoders
have undefined behaviour on corrupt input). Outputs are fresh blocks of PyTorch's caching
allocator (``record_stream`` ties them to the consumer), nvCOMP's scratch comes from the same
pool, the pinned staging buffer is reused per thread.

Sizes that vary from batch to batch would defeat nvCOMP's config cache, so the batch is padded
with a tiny *filler* frame up to a size bucket (8 per octave, <= 12.5% padding) and decoded with
a config built from a uniform output capacity; nvCOMP's one-time probe decides whether this is
bit-exact, otherwise exact sizes are used.

Out of GPU memory never gives wrong data: the batch is split in halves and retried, and below
``min_split`` blobs the decoder falls back to the CPU pipeline (:class:`~tiered.engine.read.CpuReadPipeline`); each event
is counted in :meth:`GpuDecoder.stats`. Every allocation of the decoder goes through the arenas'
``new_buffer``, so tests make them fail with :func:`tiered.tiers.arena.inject_oom` (GPU
out-of-memory cannot be produced on demand).

The decoder also runs with ``device="cpu"`` and the CPU codecs standing in for nvCOMP: every
step above but the nvCOMP call and the CUDA streams is then exercised on CPU-only CI.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> from tiered.engine.gpu_read import GpuDecoder
    >>> store = TieredStore(64, frames={"obs": 0}, hot_device="cpu", hot_bytes="1MiB")
    >>> td = TensorDict({"obs": torch.randint(0, 3, (16, 4, 32, 32), dtype=torch.uint8)}, [16])
    >>> _ = store.extend(td); store.flush()
    >>> dec = GpuDecoder("cpu").attach(store)     # "cuda" on a GPU machine
    >>> bool((store.get([3, 9])["obs"] == td["obs"][[3, 9]]).all())
    True
    >>> dec.stats()["batches"] > 0
    True
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..codecs import codec_for_format_id, segment_checksums_torch
from ..codecs.nvcomp import (
    BASE_CHUNK,
    check_device,
    filler_frame,
    import_nvcomp,
    note_allocation_failure,
    take_allocation_failure,
    use_torch_allocator,
)
from ..errors import ChecksumError, CodecUnavailableError, TieredError
from ..schema import Field, Key
from ..tiers.arena import cuda_usable, new_buffer
from ..util.batch import exclusive_cumsum
from ..util.buffers import is_out_of_memory
from ..util.copy import copy_blobs
from ..util.units import align  # the arenas' alignment: the hot gather reads aligned extents
from .blob_index import COLD, HOT, OPEN, WARM, BlobIndex
from .frames import FrameFamily
from .layout import FieldLayout
from .placement import Placement
from .read import CpuReadPipeline, ReadPipeline, blob_frames

if TYPE_CHECKING:
    from ..store import TieredStore

__all__ = ["GpuDecoder", "GpuReadPipeline", "maybe_gpu_decoder", "fused_checksums", "bucket_size",
           "describe_choice"]

_OPEN_KIND = 3  # kinds 0, 1, 2 are the tier constants HOT, WARM, COLD
_FORMAT_NAMES = {1: "zstd", 2: "lz4", 3: "deflate"}
_RAW_FORMAT = 0
_MASK32 = 0xFFFFFFFF
# The fused checksum keeps int64 prefix sums exact below 2**26 bytes per batch (255 * T**2 / 2 <
# 2**63); larger batches use the chunked reference implementation.
_FUSED_MAX = 1 << 26


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the current one (arenas keep ``cuda``)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    cur = torch.cuda.current_device() if (a.index is None or b.index is None) else 0
    return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)


def bucket_size(n: int) -> int:
    """Round a batch size up to one of 8 sizes per octave (at most 12.5% padding)."""
    if n <= 16:
        return n
    step = 1 << (int(n).bit_length() - 4)
    return -(-n // step) * step


# ---------------------------------------------------------------------------------------------
# Allocation: through the arenas' new_buffer, where tests inject out-of-memory (inject_oom)
# ---------------------------------------------------------------------------------------------

_tls = threading.local()


def _device_empty(nbytes: int, device: torch.device, kind: str = "batch") -> torch.Tensor:
    try:
        return new_buffer(int(nbytes), device, False, kind)
    except torch.OutOfMemoryError:
        _tls.oom = True
        raise


def _scratch(nbytes: int, device: torch.device) -> torch.Tensor:
    """nvCOMP's scratch memory (its allocator callback lands here).

    A failure is recorded (:func:`~tiered.codecs.nvcomp.note_allocation_failure`) before it is
    raised into nvCOMP, so the codec raises it, not what nvCOMP makes of it, once nvCOMP's call
    returns; the decoder then splits the batch (out of memory) or decodes it on the CPU.
    nvCOMP never runs on a block that was refused.
    """
    try:
        return _device_empty(nbytes, device, "scratch")
    except BaseException as e:
        note_allocation_failure(e)
        raise


def _nvcomp_alloc(nbytes: int, stream: torch.cuda.Stream) -> torch.Tensor:
    return _scratch(nbytes, stream.device)


def _stand_in_scratch(out_sizes: np.ndarray) -> int:
    """Scratch bytes the CPU stand-in asks for per decode call (nvCOMP's grows with the batch too)."""
    return 64 * int(out_sizes.size) + int(out_sizes.sum()) // 16


def _is_oom(e: BaseException) -> bool:
    return getattr(_tls, "oom", False) or is_out_of_memory(e)


class _Fallback(Exception):
    """Internal: give up on the GPU for this batch (the reason is counted)."""


class _CodecFailure(Exception):
    """Internal: the decode call itself failed, not for lack of memory (nvCOMP's error, a CUDA
    runtime error): the batch is decoded on the CPU, once the device is known to still work."""


# ---------------------------------------------------------------------------------------------
# Checksums on the device
# ---------------------------------------------------------------------------------------------


def _prefix_pairs(data: torch.Tensor, starts_ends: torch.Tensor, m: int,
                  weights: torch.Tensor) -> torch.Tensor:
    """``[2, m]``: per blob, the byte sum and ``sum(g * b[g])`` over ``[start, end)`` (exact int64)."""
    n = data.numel()
    xx = torch.empty((2, n + 1), dtype=torch.int64, device=data.device)
    xx[:, 0] = 0
    xx[0, 1:].copy_(data)
    torch.mul(xx[0, 1:], weights[:n], out=xx[1, 1:])
    xx.cumsum_(1)
    g = xx[:, starts_ends]
    return g[:, m:] - g[:, :m]


def fused_checksums(data: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The blob checksums of :mod:`tiered.codecs.checksum` in about ten kernels (any device).

    Same values as :func:`~tiered.codecs.checksum.segment_checksums_torch` (one pass of int64
    prefix sums instead of chunked ones; exact while ``data`` is under 64 MiB, delegated above).

    Example:
        >>> d = torch.arange(4, dtype=torch.uint8)
        >>> fused_checksums(d, torch.tensor([0, 1]), torch.tensor([4, 0])).tolist()
        [85899345926, 0]
    """
    data = data.reshape(-1)
    offsets = offsets.to(device=data.device, dtype=torch.int64).reshape(-1)
    sizes = sizes.to(device=data.device, dtype=torch.int64).reshape(-1)
    if data.numel() >= _FUSED_MAX:
        return segment_checksums_torch(data, offsets, sizes, check_bounds=False)
    m = offsets.numel()
    w = torch.arange(data.numel(), dtype=torch.int64, device=data.device)
    d = _prefix_pairs(data, torch.cat([offsets, offsets + sizes]), m, w)
    s1 = d[0] & _MASK32
    s2 = (d[1] - (offsets - 1) * d[0]) & _MASK32
    return (s2 << 32) | s1


# ---------------------------------------------------------------------------------------------
# Decode backends: nvCOMP on CUDA; the CPU codecs standing in for it on CPU-only machines
# ---------------------------------------------------------------------------------------------


class _CpuBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._codecs: dict[int, Any] = {}

    def supports(self, fmt: int) -> bool:
        return fmt in (0, 1, 2)

    def capacity_ok(self, fmt: int, nbytes: int) -> bool:
        return True

    def fits(self, fmt: int, nbytes: int) -> bool:
        return True

    def decode(self, fmt: int, data: torch.Tensor, offs: np.ndarray, csz: np.ndarray, out: torch.Tensor,
               ooff: np.ndarray, osz: np.ndarray, cap: int | None, stream: Any) -> None:
        codec = self._codecs.get(fmt)
        if codec is None:
            codec = self._codecs[fmt] = codec_for_format_id(fmt)
        # Scratch as nvCOMP takes it, inside the call, through the allocator callback: the
        # codec raises the recorded failure (the path an out-of-memory inside nvCOMP takes).
        take_allocation_failure()
        try:
            scratch = _scratch(_stand_in_scratch(osz), out.device)
            # CPU codecs need exact sizes: the filler frames decode to exactly 1 byte
            codec.decode(data.numpy(), offs, csz, out.numpy(), ooff, osz)
            del scratch
        except BaseException as e:
            failure = take_allocation_failure()
            if failure is not None and failure is not e:
                raise failure from e
            raise

    def why_not(self, fmt: int) -> str:
        return f"format id {fmt} not decodable by the CPU stand-in"

    def info(self) -> dict[str, Any]:
        return {"backend": "cpu", "chosen": {name: "the CPU codec (stand-in for nvCOMP)"
                                             for name in ("zstd", "lz4")}}


class _NvcompBackend:
    name = "nvcomp"

    def __init__(self, device: torch.device, torch_allocator: bool) -> None:
        import_nvcomp()
        if not torch.cuda.is_available():
            raise CodecUnavailableError("the GPU decoder needs CUDA; torch.cuda.is_available() is False")
        self.device = device
        self._codecs: dict[int, Any] = {}
        self._told: set[int] = set()  # formats whose slower choice was reported
        self.torch_allocator = torch_allocator
        if torch_allocator:
            use_torch_allocator(_nvcomp_alloc)

    def codec(self, fmt: int) -> Any:
        c = self._codecs.get(fmt)
        if c is None:
            from ..codecs.nvcomp import NvcompCodec

            c = self._codecs[fmt] = NvcompCodec(_FORMAT_NAMES[fmt], self.device)
        return c

    def supports(self, fmt: int) -> bool:
        if fmt == _RAW_FORMAT:
            return True
        if fmt not in _FORMAT_NAMES:
            return False
        probe = self.codec(fmt).probe()
        if fmt not in self._told and not (probe["exact"] == "cc" and probe["capacity"] and probe["large"]):
            # not the fast path: say so once, with the probe's errors (never a silent slow mode)
            self._told.add(fmt)
            warnings.warn(f"nvCOMP {_FORMAT_NAMES[fmt]} on {self.device}: {describe_choice(probe)} "
                          f"(probe errors: {'; '.join(probe['errors']) or 'none'})", stacklevel=2)
        return probe["exact"] is not None

    def why_not(self, fmt: int) -> str:
        """Why :meth:`supports` said no (the CPU-fallback reason :meth:`GpuDecoder.stats` counts)."""
        if fmt not in _FORMAT_NAMES:
            return f"format id {fmt} not decodable by nvCOMP"
        probe = self.codec(fmt).probe()
        if probe.get("oom") and not probe.get("cached"):
            return f"nvCOMP {_FORMAT_NAMES[fmt]} probe ran out of GPU memory (retried later)"
        return f"nvCOMP {_FORMAT_NAMES[fmt]} failed its probe"

    def capacity_ok(self, fmt: int, nbytes: int) -> bool:
        """Whether a capacity config of ``nbytes`` per slot decodes bit-exactly (batch buckets)."""
        if fmt == _RAW_FORMAT:
            return False
        probe = self.codec(fmt).probe()
        return bool(probe["capacity"] and (nbytes <= BASE_CHUNK or probe["large_capacity"]))

    def fits(self, fmt: int, nbytes: int) -> bool:
        """Whether cells of ``nbytes`` decode here (over 64 KiB only if the probe verified it)."""
        return fmt == _RAW_FORMAT or nbytes <= BASE_CHUNK or bool(self.codec(fmt).probe()["large"])

    def decode(self, fmt: int, data: torch.Tensor, offs: np.ndarray, csz: np.ndarray, out: torch.Tensor,
               ooff: np.ndarray, osz: np.ndarray, cap: int | None, stream: Any) -> None:
        # the decoder built these layouts itself (16-aligned, in bounds): skip the argument checks
        self.codec(fmt).decode_device(data, offs, csz, out, ooff, osz, stream=stream, out_capacity=cap,
                                      check=False)

    def info(self) -> dict[str, Any]:
        nv = import_nvcomp()
        probes = {_FORMAT_NAMES[f]: c.probe() for f, c in self._codecs.items()}
        return {
            "backend": "nvcomp",
            "nvcomp_version": str(getattr(nv, "__version__", "?")),
            "torch_allocator": self.torch_allocator,
            "probes": probes,
            "chosen": {name: describe_choice(p) for name, p in probes.items()},
            "config_cache": {_FORMAT_NAMES[f]: c.counters() for f, c in self._codecs.items()},
        }


def describe_choice(probe: dict[str, Any]) -> str:
    """What the decoder does with a format, given its nvCOMP probe result (for reports).

    Example:
        >>> describe_choice({"exact": "src", "capacity": False, "large": True})
        'nvCOMP, config parsed from the buffers (one host sync per call); exact sizes (no batch buckets); cells over 64 KiB on the GPU'
    """
    mode = {"cc": "nvCOMP, sync-free config built from sizes",
            "src": "nvCOMP, config parsed from the buffers (one host sync per call)"}.get(probe.get("exact"))
    if mode is None:
        return "the CPU codec for every batch (no nvCOMP decode mode passed the probe)"
    buckets = "batch-size buckets (capacity config)" if probe.get("capacity") else "exact sizes (no batch buckets)"
    large = "cells over 64 KiB on the GPU" if probe.get("large") else "cells over 64 KiB on the CPU"
    return f"{mode}; {buckets}; {large}"


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    """One decode call: what every attempt (whole batch or split part) needs."""

    layout: FieldLayout
    fam: FrameFamily
    uniq: np.ndarray
    kind: np.ndarray
    fmt: int
    stride: int
    out: torch.Tensor
    bucket: bool
    pads: int
    side: Any
    hot_words: torch.Tensor | None


class GpuDecoder:
    """The GPU decode settings, backend and counters for a :class:`~tiered.store.TieredStore`.

    :meth:`attach` makes a store read through a :class:`GpuReadPipeline` built on this decoder.

    Args:
        device: the CUDA device samples are returned on (default: the current one);
            ``"cpu"`` runs the same pipeline with the CPU codecs standing in for nvCOMP.
        bucket: pad batches to size buckets so nvCOMP's decode configs are reused (used only
            when nvCOMP's probe shows capacity configs decode bit-exactly).
        torch_allocator: route nvCOMP's scratch allocations through PyTorch's caching allocator.
        min_split: after an out-of-memory error, batches are halved down to this many blobs;
            below it the batch is decoded on the CPU.
        checksum: ``"fused"`` (about ten kernels) or ``"reference"``
            (:func:`~tiered.codecs.checksum.segment_checksums_torch`). Same values.

    Raises:
        CodecUnavailableError: CUDA device but ``nvidia.nvcomp`` is missing (names the install
            command) or CUDA is not available.

    Example:
        >>> dec = GpuDecoder("cpu")
        >>> dec.stats()["backend"]
        'cpu'
    """

    def __init__(self, device: str | torch.device | None = None, *, bucket: bool = True,
                 torch_allocator: bool = True, min_split: int = 8, checksum: str = "fused") -> None:
        if device is None:
            if not torch.cuda.is_available():
                raise CodecUnavailableError("GpuDecoder() needs CUDA; pass device='cpu' for the CPU stand-in")
            device = torch.device("cuda", torch.cuda.current_device())
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"GpuDecoder runs on a CUDA device (or 'cpu' for tests), got {dev}")
        if checksum not in ("fused", "reference"):
            raise ValueError(f"checksum must be 'fused' or 'reference', got {checksum!r}")
        self.device = dev
        #: False for the CPU stand-in (no streams, CPU codecs instead of nvCOMP)
        self.is_cuda = dev.type == "cuda"
        self.backend: _CpuBackend | _NvcompBackend = (
            _NvcompBackend(dev, torch_allocator) if self.is_cuda else _CpuBackend())
        self.bucket = bool(bucket)
        self.min_split = max(1, int(min_split))
        self.checksum = checksum
        self._lock = threading.Lock()
        #: the event recorded after the last hot-tier write (decodes wait for it)
        self.fence: torch.cuda.Event | None = None
        self._counters: dict[str, int] = {
            "batches": 0, "blobs": 0, "hot": 0, "warm": 0, "cold": 0, "open": 0, "hot_on_device": 0,
            "h2d_bytes": 0, "pads": 0, "oom_events": 0, "splits": 0, "cpu_fallbacks": 0,
            "checksum_failures": 0,
        }
        self._reasons: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"GpuDecoder(device={str(self.device)!r}, backend={self.backend.name!r})"

    def stats(self) -> dict[str, Any]:
        """Counters: batches, blobs per tier, H2D bytes, padding, OOM events, splits, CPU fallbacks.

        ``hot_on_device`` counts hot blobs gathered on the device (the others were staged through
        the host: an arena on another device).

        Example:
            >>> sorted(GpuDecoder("cpu").stats())[:3]
            ['backend', 'batches', 'blobs']
        """
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["fallback_reasons"] = dict(self._reasons)
        out["device"] = str(self.device)
        out.update(self.backend.info())
        return out

    def attach(self, store: TieredStore) -> GpuDecoder:
        """Make ``store.get`` decode blob fields with this decoder; returns ``self``."""
        store.use_gpu_decoder(self)
        return self

    def detach(self, store: TieredStore) -> None:
        """Undo :meth:`attach` (the store goes back to its CPU pipeline)."""
        store.use_gpu_decoder(None)

    def fence_writes(self) -> None:
        """Record that the current stream wrote the hot tier: later decodes wait for it.

        The store's placement calls this after writing blobs; the pipeline calls it after its own
        promotions. Needed because a prefetch thread decodes on another stream than the one
        ``extend`` wrote the arena on.
        """
        if self.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.fence = ev

    def count(self, **kw: int) -> None:
        """Add to the counters :meth:`stats` reports (thread-safe)."""
        with self._lock:
            for k, v in kw.items():
                self._counters[k] = self._counters.get(k, 0) + int(v)

    def first_failure(self, why: str) -> bool:
        """Whether no batch fell back for this reason yet (warn once per reason)."""
        with self._lock:
            return why not in self._reasons

    def note_fallback(self, why: str) -> None:
        """Count a batch decoded on the CPU, and why."""
        with self._lock:
            self._counters["cpu_fallbacks"] += 1
            self._reasons[why] = self._reasons.get(why, 0) + 1


class GpuReadPipeline(ReadPipeline):
    """The read pipeline that decodes on the GPU (see the module docstring).

    Gets its parts by constructor, like every part: the blob index, the placement (tiers and the
    policy's read bookkeeping), the store's counters and a CPU pipeline to fall back to.

    Args:
        decoder: the settings, backend and counters.
        fallback: decodes a batch on the CPU when the GPU cannot (out of memory, mixed codecs).
        promote: copy blobs read from slower tiers up, as the policy decides.
    """

    def __init__(self, decoder: GpuDecoder, index: BlobIndex, placement: Placement, counters: dict[str, int],
                 fallback: CpuReadPipeline, *, promote: bool = True,
                 stale: Callable[[], tuple[int, int] | None] | None = None) -> None:
        super().__init__(index, placement, counters, stale)
        self.decoder = decoder
        self.device = decoder.device
        self.fallback = fallback
        self.promote = bool(promote)
        self._cuda = decoder.is_cuda
        self._local = threading.local()

    def read_family(self, layout: FieldLayout, family_id: int, fields: list[Field], rows: np.ndarray,
                    out: dict[Key, torch.Tensor]) -> None:
        with self._device_errors():
            self._read_family(layout, family_id, fields, rows, out)

    def _read_family(self, layout: FieldLayout, family_id: int, fields: list[Field], rows: np.ndarray,
                     out: dict[Key, torch.Tensor]) -> None:
        fam = layout.families[family_id]
        n = rows.size
        uniq, frame_idx = blob_frames(layout, fam, fields, rows)
        # field-major, so each field's frame indices are one contiguous slice on the device
        spans, parts, col = [], [], 0
        for f in fields:
            width = f.frames_per_row
            parts.append(frame_idx[:, col:col + width].reshape(-1))
            spans.append((col * n, (col + width) * n))
            col += width
        extra = np.concatenate(parts) if len(parts) > 1 else parts[0]
        flat, extra_t = self._decode(layout, fam, uniq, extra)
        if extra_t is None:  # CPU fallback: gather on the host, get() moves the result
            extra_t = torch.from_numpy(extra)
        frames = flat.reshape(-1, fam.frame_nbytes)
        for f, (a, b) in zip(fields, spans, strict=True):
            out[f.key] = f.cells_from_frames(frames.index_select(0, extra_t[a:b]), n)

    def decode_blobs(self, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray) -> torch.Tensor:
        """Raw frames ``[len(uniq), chunk_frames, frame_nbytes]`` (uint8) of these blobs, decoded on
        the decoder's device.

        The GPU twin of :meth:`CpuReadPipeline.decode_blobs`: same bookkeeping (tier hits, policy
        access, promotions). Safe to use on the caller's current stream right away (ordered by an
        event). After a CPU fallback the result is a CPU tensor.

        Raises:
            ChecksumError: a blob's bytes do not match its checksum (nothing was decoded).
        """
        with self._device_errors():
            flat, _ = self._decode(layout, fam, np.asarray(uniq, dtype=np.int64), None)
        return flat

    def describe(self) -> dict[str, Any]:
        return self.decoder.stats()

    # -- per-thread state -----------------------------------------------------------------

    def _thread(self) -> dict[str, Any]:
        t = self._local.__dict__
        if "side" not in t:
            t["side"] = torch.cuda.Stream(self.device) if self._cuda else None
            t["staging"] = None
            t["h2d"] = torch.cuda.Event() if self._cuda else None
            t["h2d_pending"] = False
            t["done"] = torch.cuda.Event() if self._cuda else None
            t["flag_ev"] = torch.cuda.Event() if self._cuda else None
            t["flag"] = torch.zeros(1, dtype=torch.bool, pin_memory=self._cuda)
            t["arange"] = torch.zeros(0, dtype=torch.int64, device=self.device)
        return t

    def _staging(self, t: dict[str, Any], nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        if t["h2d_pending"]:
            t["h2d"].synchronize()  # the previous H2D copy may still read the staging buffer
            t["h2d_pending"] = False
        buf = t["staging"]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, int(buf.numel() * 1.5) if buf is not None else 0, 1 << 16)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
            t["staging"] = buf
        return buf, buf.numpy()

    def _arange(self, t: dict[str, Any], n: int) -> torch.Tensor:
        ar = t["arange"]
        if ar.numel() < n:
            ar = t["arange"] = torch.arange(max(n, 2 * ar.numel(), 1 << 16), dtype=torch.int64,
                                            device=self.device)
        return ar

    # -- the pipeline -----------------------------------------------------------------------

    def _classify(self, uniq: np.ndarray) -> np.ndarray:
        """Where each blob is read from: HOT, WARM or COLD (the fastest tier holding it, as on the
        CPU path), or _OPEN_KIND for an open chunk."""
        self.index.check_ids(uniq)  # a read-only open checks the index pages of these ids at first use
        state = self.index.state[uniq]
        if not state.all():
            raise AssertionError("a row references a freed blob: index is inconsistent")
        is_open = state == OPEN
        kind = np.full(uniq.size, _OPEN_KIND, dtype=np.int8)
        kind[~is_open] = self.placement.locate(uniq[~is_open])
        return kind

    @contextlib.contextmanager
    def _device_errors(self) -> Iterator[None]:
        """A sticky CUDA error fails every later call: say so (DeviceFailedError), not with the
        first call's RuntimeError."""
        try:
            yield
        except RuntimeError as e:
            if self._cuda and not isinstance(e, TieredError):
                check_device(self.device, "the GPU decoder")
            raise

    def _decode(self, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray,
                extra: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = int(uniq.size)
        row = fam.chunk_frames * fam.frame_nbytes
        stride = int(align(row))
        kind = self._classify(uniq)
        stored = kind != _OPEN_KIND
        fmts = self.index.codec[uniq[stored]]
        fmt = int(fmts[0]) if fmts.size else 1
        backend = self.decoder.backend
        if fmts.size and (fmts != fmt).any():
            return self._fallback(layout, fam, uniq, "mixed codecs in one batch")
        if not backend.supports(fmt):
            return self._fallback(layout, fam, uniq, backend.why_not(fmt))
        if not backend.fits(fmt, stride):
            return self._fallback(layout, fam, uniq, f"cells over {BASE_CHUNK} bytes: not verified by the probe")
        m = int(stored.sum())
        bucket = self.decoder.bucket and fmt != _RAW_FORMAT and m > 0 and backend.capacity_ok(fmt, stride)
        pads = bucket_size(m) - m if bucket else 0
        t = self._thread()
        side = t["side"]
        hot = self.placement.tiers[HOT]
        hot_words = None
        if hot is not None and _same_device(hot.device, self.device) and hot.capacity:
            buf = hot.buffer
            hot_words = buf[: buf.numel() // 8 * 8].view(torch.int64)
            if self._cuda:
                # `side` reads the arena: if the arena grows meanwhile, the caching allocator must not
                # hand the old block to anyone before this stream is done with it
                hot_words.record_stream(side)
        _tls.oom = False
        cur = torch.cuda.current_stream(self.device) if self._cuda else None
        stream_ctx = torch.cuda.stream(side) if self._cuda else contextlib.nullcontext()
        if self._cuda:
            side.wait_stream(cur)  # the caller's pending work (e.g. arena writes) comes first
            if self.decoder.fence is not None:
                side.wait_event(self.decoder.fence)
        if hot_words is not None:
            hot.order.wait(side)  # writes other threads' streams queued on the arena (CPU: counted)
        result_extra: torch.Tensor | None = None
        blk: torch.Tensor | None = None
        try:
            with stream_ctx:
                try:
                    out = _device_empty((n + pads) * stride, self.device, "output")
                except BaseException as e:
                    if not _is_oom(e):
                        raise
                    self.decoder.count(oom_events=1)
                    return self._fallback(layout, fam, uniq, "out of memory for the output")
                ctx = _Ctx(layout, fam, uniq, kind, fmt, stride, out, bucket, pads, side, hot_words)
                try:
                    result_extra, blk = self._attempt(ctx, np.arange(n, dtype=np.int64), extra, promote=True)
                except (ChecksumError, _CodecFailure):
                    raise
                except BaseException as e:
                    if not _is_oom(e):
                        raise
                    self.decoder.count(oom_events=1)
                    if self._cuda:
                        torch.cuda.empty_cache()
                    try:
                        self._split(ctx)
                    except _Fallback:
                        return self._fallback(layout, fam, uniq, "out of memory below min_split blobs")
                    blk = None
                    if extra is not None:
                        try:
                            result_extra = _device_empty(extra.size * 8, self.device, "index").view(torch.int64)
                            result_extra.copy_(torch.from_numpy(extra))
                        except BaseException as e2:
                            if not _is_oom(e2):
                                raise
                            return self._fallback(layout, fam, uniq, "out of memory for the frame indices")
        except _CodecFailure as e:
            return self._codec_fallback(layout, fam, uniq, fmt, e.__cause__ or e)
        finally:
            if self._cuda:
                t["done"].record(side)
                cur.wait_event(t["done"])  # the consumer reads only after the decode
        if self._cuda:
            # fresh blocks of the caching allocator, allocated on `side`, read on `cur`
            for tensor in (out, blk, result_extra):
                if tensor is not None:
                    tensor.record_stream(cur)
        self._bookkeeping(uniq, kind)
        flat = out[: n * stride].view(n, stride)[:, :row].reshape(n, fam.chunk_frames, fam.frame_nbytes)
        return flat, result_extra

    def _split(self, ctx: _Ctx) -> None:
        """Decode the batch in parts after an out-of-memory error; _Fallback below min_split."""
        n = ctx.uniq.size
        ctx.bucket, ctx.pads = False, 0
        size = max(n // 2, 1)
        i = 0
        while i < n:  # parts of `size` blobs; a part that runs out of memory again halves `size`
            part = np.arange(i, min(i + size, n), dtype=np.int64)
            _tls.oom = False
            try:
                self._attempt(ctx, part, None, promote=False)
            except (ChecksumError, _CodecFailure):
                raise
            except BaseException as e:
                if not _is_oom(e):
                    raise
                self.decoder.count(oom_events=1)
                if size <= self.decoder.min_split:
                    raise _Fallback from e
                size = max(size // 2, self.decoder.min_split)
                continue
            self.decoder.count(splits=1)
            i += part.size

    def _attempt(self, c: _Ctx, sel: np.ndarray, extra: np.ndarray | None,
                 promote: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Stage, upload, gather, verify and decode the blobs ``uniq[sel]`` into their output rows."""
        idx = self.index
        t = self._thread()
        plan = _AttemptLayout(c, sel, extra, idx)
        stg_t, stg = self._staging(t, plan.prefix)
        plan.fill_host(stg, self.placement, idx)
        blk = _device_empty(plan.total, self.device, "batch")
        blk[:plan.prefix].copy_(stg_t[:plan.prefix], non_blocking=True)
        if self._cuda:
            t["h2d"].record(c.side)
            t["h2d_pending"] = True
        tab_d = blk[: 8 * plan.n_tab].view(torch.int64)
        out2d = c.out.view(-1, c.stride)
        h, k, m = plan.h, plan.k, plan.m
        comp0, after_fill = plan.comp0, plan.after_fill
        if h:  # hot blobs: an 8-byte-word gather straight from the device arena
            words = int(plan.hot_a.sum()) // 8
            ar = self._arange(t, words)
            which = torch.repeat_interleave(tab_d[h:2 * h], output_size=words)
            src = ar[:words] + tab_d[:h].index_select(0, which)
            dst = blk[comp0 + after_fill:comp0 + plan.comp_bytes].view(torch.int64)
            torch.index_select(c.hot_words, 0, src, out=dst)
        if k:  # open chunks: raw frames, copied into their output rows
            out2d.index_copy_(0, tab_d[plan.p_open:plan.p_open + k],
                              blk[plan.tb:plan.tb + plan.raw_bytes].view(k, c.stride))
        if m:
            self._verify(t, c.layout, blk[comp0:plan.total], tab_d[plan.p_ck:plan.p_ck + 5 * m], m, plan.s_ids)
            dec_off = comp0 + plan.rel
            ooff = plan.s_pos * c.stride
            if c.fmt == _RAW_FORMAT:
                copy_blobs(blk, dec_off, c.out, ooff, plan.csz)
            else:
                osz = idx.raw_nbytes[plan.s_ids]
                csz_d = plan.csz
                if c.pads:
                    dec_off = np.concatenate([dec_off, np.full(c.pads, comp0 + plan.fill_rel, np.int64)])
                    csz_d = np.concatenate([plan.csz, np.full(c.pads, len(plan.filler), np.int64)])
                    pad_rows = c.uniq.size + np.arange(c.pads, dtype=np.int64)
                    ooff = np.concatenate([ooff, pad_rows * c.stride])
                    osz = np.concatenate([osz, np.ones(c.pads, np.int64)])
                try:
                    self.decoder.backend.decode(c.fmt, blk, dec_off, csz_d, c.out, ooff, osz,
                                                c.stride if c.bucket else None, c.side)
                except BaseException as e:
                    if _is_oom(e) or not isinstance(e, Exception):
                        raise  # out of memory: split; KeyboardInterrupt and the like: the caller's
                    raise _CodecFailure(str(e)) from e
        self.decoder.count(h2d_bytes=plan.prefix, pads=c.pads, hot_on_device=h)
        if promote and self.promote and m:
            self.placement.promote(plan.s_ids, plan.s_kind.astype(np.int8), stg, comp0 + plan.rel, plan.csz)
            self.decoder.fence_writes()
        p_extra = plan.p_extra
        return (tab_d[p_extra:p_extra + plan.e] if extra is not None else None), blk

    def _verify(self, t: dict[str, Any], layout: FieldLayout, comp: torch.Tensor, tab: torch.Tensor, m: int,
                s_ids: np.ndarray) -> None:
        """Check every blob against its stored checksum before any byte reaches the decoder."""
        starts_ends, start_m1, expected = tab[: 2 * m], tab[2 * m:3 * m], tab[3 * m:5 * m].view(2, m)
        if self.decoder.checksum == "fused" and comp.numel() < _FUSED_MAX:
            d = _prefix_pairs(comp, starts_ends, m, self._arange(t, comp.numel()))
            d[1] -= start_m1 * d[0]
            d &= _MASK32
        else:
            got = segment_checksums_torch(comp, starts_ends[:m], starts_ends[m:] - starts_ends[:m],
                                          check_bounds=False)
            d = torch.stack([got & _MASK32, (got >> 32) & _MASK32])
        bad = (d != expected).any(0)
        if self._cuda:
            flag = t["flag"]
            flag.copy_(bad.any().view(1), non_blocking=True)
            t["flag_ev"].record()
            t["flag_ev"].synchronize()  # the one host sync: the verdict decides whether to decode
            failed = bool(flag[0])
        else:
            failed = bool(bad.any())
        if failed:
            which = np.flatnonzero(bad.cpu().numpy())
            self.decoder.count(checksum_failures=int(which.size))
            raise self.checksum_error(layout, s_ids[which])

    def _bookkeeping(self, uniq: np.ndarray, kind: np.ndarray) -> None:
        counts = np.bincount(kind.astype(np.int64), minlength=4)
        stored = kind != _OPEN_KIND
        self.placement.note_reads(uniq[stored], kind[stored])
        self.counters["blobs_decoded"] += int(stored.sum())
        self.decoder.count(batches=1, blobs=int(uniq.size), hot=int(counts[HOT]), warm=int(counts[WARM]),
                           cold=int(counts[COLD]), open=int(counts[_OPEN_KIND]))

    def _codec_fallback(self, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray, fmt: int,
                        error: BaseException) -> tuple[torch.Tensor, None]:
        """The decode call failed, not for lack of memory: on the CPU if the device still works.

        The blobs passed their checksums, so the data is sound: nvCOMP met a shape its probe
        never tried (a chunk class, a batch size), or CUDA failed. A sticky CUDA error leaves
        nothing to fall back to (the result must reach the device): DeviceFailedError.
        """
        check_device(self.device, f"nvCOMP's decode of a batch of {uniq.size} blobs")
        name = _FORMAT_NAMES.get(fmt, str(fmt))
        why = f"nvCOMP {name} decode error: {type(error).__name__}"
        if self.decoder.first_failure(why):
            warnings.warn(f"nvCOMP could not decode a batch of {uniq.size} {name} blobs on {self.device} "
                          f"({type(error).__name__}: {error}); it was decoded on the CPU, as later such "
                          "batches will be (counted in GpuDecoder.stats()['fallback_reasons'])", stacklevel=2)
        return self._fallback(layout, fam, uniq, why)

    def _fallback(self, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray,
                  why: str) -> tuple[torch.Tensor, None]:
        """Decode on the CPU (the CPU pipeline, with its own bookkeeping)."""
        self.decoder.note_fallback(why)
        frames = torch.from_numpy(self.fallback.decode_blobs(layout, fam, uniq))
        self.decoder.fence_writes()  # the CPU path may have promoted blobs into the hot arena
        return frames, None


class _AttemptLayout:
    """Where every part of one attempt goes in the pinned staging buffer and the device block::

        [tables | raw rows of open chunks | staged compressed blobs | filler | hot blobs]

    The tables (int64) hold, in order: hot word offsets and counts, open-chunk output rows, per
    stored blob its start, end, start-1 and the two halves of its checksum, then the frame
    indices the caller wants uploaded. Offsets of compressed blobs are 16-aligned and relative to
    the compressed region.
    """

    def __init__(self, c: _Ctx, sel: np.ndarray, extra: np.ndarray | None, idx: BlobIndex) -> None:
        self.c = c
        kinds = c.kind[sel]
        is_open = kinds == _OPEN_KIND
        self.open_pos = sel[is_open]
        self.s_pos = sel[~is_open]
        self.s_ids = c.uniq[self.s_pos]
        self.s_kind = kinds[~is_open]
        self.csz = idx.nbytes[self.s_ids]
        a = align(self.csz)
        self.m, self.k = int(self.s_ids.size), int(self.open_pos.size)
        hot_m = (self.s_kind == HOT) & (c.hot_words is not None)
        if hot_m.any():
            ends = (idx.loc[self.s_ids[hot_m], HOT] + a[hot_m]) // 8
            if int(ends.max()) > c.hot_words.numel():  # never for arena blobs; stage them if it happens
                hot_m[:] = False
        self.hot_m, self.stg_m = hot_m, ~hot_m
        self.h = int(hot_m.sum())
        self.filler = filler_frame(_FORMAT_NAMES[c.fmt]) if c.pads else b""
        self.rel = np.empty(self.m, dtype=np.int64)
        self.rel[self.stg_m] = exclusive_cumsum(a[self.stg_m])
        staged_bytes = int(a[self.stg_m].sum())
        self.fill_rel = staged_bytes
        self.after_fill = staged_bytes + int(align(len(self.filler))) if self.filler else staged_bytes
        self.hot_a = a[hot_m]
        self.rel[hot_m] = self.after_fill + exclusive_cumsum(self.hot_a)
        self.comp_bytes = self.after_fill + int(self.hot_a.sum())
        self.extra = extra
        self.e = 0 if extra is None else int(extra.size)
        self.n_tab = 2 * self.h + self.k + 5 * self.m + self.e
        self.tb = int(align(8 * self.n_tab))
        self.raw_bytes = self.k * c.stride
        self.comp0 = self.tb + self.raw_bytes
        self.prefix = self.comp0 + self.after_fill
        self.total = self.comp0 + self.comp_bytes
        self.p_open = 2 * self.h
        self.p_ck = self.p_open + self.k
        self.p_extra = self.p_ck + 5 * self.m

    def fill_host(self, stg: np.ndarray, placement: Placement, idx: BlobIndex) -> None:
        """Write the tables, the open chunks' raw frames, the staged blobs and the filler."""
        c, h, k, m = self.c, self.h, self.k, self.m
        tab = stg[: 8 * self.n_tab].view(np.int64)
        if h:
            nw = self.hot_a // 8
            tab[:h] = idx.loc[self.s_ids[self.hot_m], HOT] // 8 - exclusive_cumsum(nw)
            tab[h:2 * h] = nw
        if k:
            tab[self.p_open:self.p_open + k] = self.open_pos
        if m:
            p, rel = self.p_ck, self.rel
            tab[p:p + m] = rel
            tab[p + m:p + 2 * m] = rel + self.csz
            tab[p + 2 * m:p + 3 * m] = rel - 1
            ck = idx.checksum[self.s_ids].view(np.uint64)
            tab[p + 3 * m:p + 4 * m] = (ck & np.uint64(_MASK32)).astype(np.int64)
            tab[p + 4 * m:p + 5 * m] = (ck >> np.uint64(32)).astype(np.int64)
        if self.e:
            tab[self.p_extra:self.p_extra + self.e] = self.extra
        if k:
            raw = c.fam.open_raw(c.uniq[self.open_pos], idx)
            stg[self.tb:self.tb + self.raw_bytes].reshape(k, c.stride)[:, : raw.shape[1] * raw.shape[2]] = \
                raw.reshape(k, -1)
        # HOT lands here only when its arena is not on this device
        placement.read(self.s_ids, self.csz, stg, self.comp0 + self.rel, self.s_kind, skip=self.hot_m)
        if self.filler:
            stg[self.comp0 + self.fill_rel:self.comp0 + self.fill_rel + len(self.filler)] = \
                np.frombuffer(self.filler, np.uint8)


def maybe_gpu_decoder(device: torch.device, option: bool | None = None) -> GpuDecoder | None:
    """The decoder a store returning data on ``device`` should use.

    Args:
        device: where the store returns data.
        option: ``None`` (auto): a decoder when ``device`` is CUDA and nvCOMP is importable, else
            None with a warning naming the install command (or saying that CUDA cannot start in
            a process forked after its parent started it); ``True``: require it; ``False``:
            never (CPU decode, then a copy to ``device``).

    Raises:
        CodecUnavailableError: ``option=True`` and nvCOMP or CUDA is missing, or this process
            was forked after its parent started CUDA.
        ValueError: ``option=True`` with a CPU ``device``.

    Example:
        >>> maybe_gpu_decoder(torch.device("cpu")) is None      # the CPU path
        True
    """
    if option is False:
        return None
    if device.type != "cuda":
        if option:
            raise ValueError(f"gpu_decode=True needs a CUDA device, but the store returns data on {device}; "
                             "pass device='cuda'")
        return None
    try:
        if torch.cuda.is_available() and not cuda_usable():
            # torch's own error here is a RuntimeError ("Cannot re-initialize CUDA in forked subprocess")
            raise CodecUnavailableError(
                f"CUDA cannot start in this process: it was forked after its parent started CUDA; "
                f"decode on {device} from the parent, or start workers with the 'spawn' method")
        return GpuDecoder(device)
    except CodecUnavailableError as e:
        if option:
            raise
        warnings.warn(f"tiered samples on {device} but decodes on the CPU: {e}", stacklevel=4)
        return None
