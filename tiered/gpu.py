"""The GPU sample path: blobs from every tier decoded on the GPU in one batched nvCOMP call.

:class:`GpuDecoder` replaces the CPU decode of :meth:`TieredStore.get` for stores whose
``device`` is CUDA. For the unique blobs of a sample (DESIGN.md section 4)::

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
``min_split`` blobs the decoder falls back to the CPU path (``store._materialize``); each event
is counted in :meth:`GpuDecoder.stats`. :func:`inject_device_oom` is the allocation-failure
seam for tests (DESIGN.md section 9); ``tiered.tiers.arena.inject_oom`` also reaches every
allocation of the decoder.

The decoder also runs with ``device="cpu"`` and the CPU codecs standing in for nvCOMP: every
step above but the nvCOMP call and the CUDA streams is then exercised on CPU-only CI.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> from tiered.gpu import GpuDecoder
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .codecs import codec_for_format_id, segment_checksums_torch
from .codecs.nvcomp import filler_frame, import_nvcomp, use_torch_allocator
from .errors import ChecksumError, CodecUnavailableError
from .index import COLD, HOT, OPEN, WARM
from .tiers import arena as _arena
from .util.batch import exclusive_cumsum
from .util.copy import copy_blobs
from .util.units import align  # the arenas' alignment: the hot gather reads aligned extents

if TYPE_CHECKING:
    from .engine.frames import FrameFamily
    from .schema import Field
    from .store import TieredStore

__all__ = ["GpuDecoder", "maybe_gpu_decoder", "inject_device_oom", "fused_checksums", "ALLOCATION_KINDS"]

_OPEN_KIND = 3  # kinds 0, 1, 2 are the tier constants HOT, WARM, COLD
_TIER_NAMES = ("hot", "warm", "cold")
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


def _bucket_size(n: int) -> int:
    """Round a batch size up to one of 8 sizes per octave (at most 12.5% padding)."""
    if n <= 16:
        return n
    step = 1 << (int(n).bit_length() - 4)
    return -(-n // step) * step


# ---------------------------------------------------------------------------------------------
# Allocation seam (DESIGN.md section 9)
# ---------------------------------------------------------------------------------------------

_limits: list[tuple[int, frozenset[str] | None]] = []
_tls = threading.local()
#: What the decoder allocates on the device: the decoded batch, the per-attempt block (tables and
#: compressed bytes), nvCOMP's scratch, the frame indices re-uploaded after a split.
ALLOCATION_KINDS = ("output", "batch", "scratch", "index")


@contextlib.contextmanager
def inject_device_oom(max_bytes: int = 0, only: str | tuple[str, ...] | None = None) -> Iterator[None]:
    """Make GPU-decoder allocations larger than ``max_bytes`` raise ``torch.OutOfMemoryError`` (tests).

    Covers the decoder's own buffers and nvCOMP's scratch (routed through PyTorch's allocator).
    ``max_bytes=0`` fails every allocation (forcing the CPU fallback); restricting ``only`` to
    ``"batch"``/``"scratch"`` with a size between a whole batch and its halves forces a split.

    Args:
        max_bytes: allocations above this size fail.
        only: fail only these kinds (see :data:`ALLOCATION_KINDS`); default all.

    Example:
        >>> with inject_device_oom(0):
        ...     try:
        ...         _device_empty(16, torch.device("cpu"))
        ...     except torch.OutOfMemoryError:
        ...         print("injected")
        injected
    """
    kinds = None if only is None else frozenset([only] if isinstance(only, str) else only)
    if kinds is not None and not kinds <= set(ALLOCATION_KINDS):
        raise ValueError(f"only must name kinds among {ALLOCATION_KINDS}, got {only!r}")
    _limits.append((int(max_bytes), kinds))
    try:
        yield
    finally:
        _limits.pop()


def _device_empty(nbytes: int, device: torch.device, kind: str = "batch") -> torch.Tensor:
    if _limits:
        limit, kinds = _limits[-1]
        if nbytes > limit and (kinds is None or kind in kinds):
            _tls.oom = True
            raise torch.OutOfMemoryError(
                f"injected: the GPU decoder cannot allocate {nbytes} bytes ({kind}) on {device} "
                f"(limit {limit})")
    try:
        # the arenas' seam too: tiered.tiers.arena.inject_oom fails these allocations as well
        return _arena.new_buffer(int(nbytes), device, False)
    except torch.OutOfMemoryError:
        _tls.oom = True
        raise


def _nvcomp_alloc(nbytes: int, stream: torch.cuda.Stream) -> torch.Tensor:
    return _device_empty(nbytes, stream.device, "scratch")


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or getattr(_tls, "oom", False):
        return True
    msg = str(e).lower()
    return "out of memory" in msg or "cudaerrormemoryallocation" in msg or "outofmemory" in msg


class _Fallback(Exception):
    """Internal: give up on the GPU for this batch (the reason is counted)."""


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

    def capacity_ok(self, fmt: int) -> bool:
        return True

    def decode(self, fmt: int, data: torch.Tensor, offs: np.ndarray, csz: np.ndarray, out: torch.Tensor,
               ooff: np.ndarray, osz: np.ndarray, cap: int | None, stream: Any) -> None:
        codec = self._codecs.get(fmt)
        if codec is None:
            codec = self._codecs[fmt] = codec_for_format_id(fmt)
        # CPU codecs need exact sizes: the filler frames decode to exactly 1 byte
        codec.decode(data.numpy(), offs, csz, out.numpy(), ooff, osz)

    def info(self) -> dict[str, Any]:
        return {"backend": "cpu"}


class _NvcompBackend:
    name = "nvcomp"

    def __init__(self, device: torch.device, torch_allocator: bool) -> None:
        import_nvcomp()
        if not torch.cuda.is_available():
            raise CodecUnavailableError("the GPU decoder needs CUDA; torch.cuda.is_available() is False")
        self.device = device
        self._codecs: dict[int, Any] = {}
        self.torch_allocator = torch_allocator
        if torch_allocator:
            use_torch_allocator(_nvcomp_alloc)

    def codec(self, fmt: int) -> Any:
        c = self._codecs.get(fmt)
        if c is None:
            from .codecs.nvcomp import NvcompCodec

            c = self._codecs[fmt] = NvcompCodec(_FORMAT_NAMES[fmt], self.device)
        return c

    def supports(self, fmt: int) -> bool:
        if fmt == _RAW_FORMAT:
            return True
        return fmt in _FORMAT_NAMES and self.codec(fmt).probe()["exact"] is not None

    def capacity_ok(self, fmt: int) -> bool:
        return fmt != _RAW_FORMAT and bool(self.codec(fmt).probe()["capacity"])

    def decode(self, fmt: int, data: torch.Tensor, offs: np.ndarray, csz: np.ndarray, out: torch.Tensor,
               ooff: np.ndarray, osz: np.ndarray, cap: int | None, stream: Any) -> None:
        # the decoder built these layouts itself (16-aligned, in bounds): skip the argument checks
        self.codec(fmt).decode_device(data, offs, csz, out, ooff, osz, stream=stream, out_capacity=cap,
                                      check=False)

    def info(self) -> dict[str, Any]:
        nv = import_nvcomp()
        return {
            "backend": "nvcomp",
            "nvcomp_version": str(getattr(nv, "__version__", "?")),
            "torch_allocator": self.torch_allocator,
            "probes": {_FORMAT_NAMES[f]: c.probe() for f, c in self._codecs.items()},
            "config_cache": {_FORMAT_NAMES[f]: c.counters() for f, c in self._codecs.items()},
        }


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    """One materialize call: what every attempt (whole batch or split part) needs."""

    store: TieredStore
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
    """Decodes the blobs of a sample on the GPU for a :class:`~tiered.store.TieredStore`.

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
        self._cuda = dev.type == "cuda"
        self._backend: _CpuBackend | _NvcompBackend = (
            _NvcompBackend(dev, torch_allocator) if self._cuda else _CpuBackend())
        self.bucket = bool(bucket)
        self.min_split = max(1, int(min_split))
        self.checksum = checksum
        self._local = threading.local()
        self._lock = threading.Lock()
        self._fence: torch.cuda.Event | None = None
        self._counters: dict[str, int] = {
            "batches": 0, "blobs": 0, "hot": 0, "warm": 0, "cold": 0, "open": 0, "hot_on_device": 0,
            "h2d_bytes": 0, "pads": 0, "oom_events": 0, "splits": 0, "cpu_fallbacks": 0,
            "checksum_failures": 0,
        }
        self._reasons: dict[str, int] = {}

    # -- public API -------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"GpuDecoder(device={str(self.device)!r}, backend={self._backend.name!r})"

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
        out.update(self._backend.info())
        return out

    def attach(self, store: TieredStore) -> GpuDecoder:
        """Make ``store.get`` decode blob fields with this decoder (it sets the store's
        ``_gpu`` hook); returns ``self``."""
        store._gpu = self  # type: ignore[attr-defined]
        return self

    def detach(self, store: TieredStore) -> None:
        """Undo :meth:`attach`."""
        if vars(store).get("_gpu") is self:
            store._gpu = None  # type: ignore[attr-defined]

    def fence_writes(self) -> None:
        """Record that the current stream wrote the hot tier: later decodes wait for it.

        The store calls this after placing blobs (``_store_chunks``); the decoder calls it after
        its own promotions. Needed because a prefetch thread decodes on another stream than the
        one ``extend`` wrote the arena on.
        """
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._fence = ev

    def materialize(self, store: TieredStore, fam: FrameFamily, uniq: np.ndarray) -> torch.Tensor:
        """Raw frames ``[len(uniq), K, nbytes]`` (uint8) of these blobs, decoded on :attr:`device`.

        The GPU twin of ``store._materialize``: same bookkeeping (tier hits, policy access,
        promotions). Safe to use on the caller's current stream right away (ordered by an
        event). After a CPU fallback the result is a CPU tensor.

        Raises:
            ChecksumError: a blob's bytes do not match its checksum (nothing was decoded).
        """
        flat, _ = self._materialize(store, fam, np.asarray(uniq, dtype=np.int64), None)
        return flat

    def get_family(self, store: TieredStore, fid: int, fields: list[Field], rows: np.ndarray,
                   out: dict) -> None:
        """Drop-in for ``TieredStore._get_family``: decode a family's blobs and gather its fields."""
        fam = store._families[fid]
        n = rows.size
        blobs = np.concatenate([store._tables[f.key].blob[rows] for f in fields], axis=1)
        slots = np.concatenate([store._tables[f.key].slot[rows] for f in fields], axis=1)
        uniq, inv = self._unique(blobs.reshape(-1), store._index.size)
        frame_idx = inv.reshape(blobs.shape) * fam.K + slots
        # field-major, so each field's frame indices are one contiguous slice on the device
        spans, parts, col = [], [], 0
        for f in fields:
            F = f.frames_per_row
            parts.append(frame_idx[:, col:col + F].reshape(-1))
            spans.append((col * n, (col + F) * n))
            col += F
        extra = np.concatenate(parts) if len(parts) > 1 else parts[0]
        flat, extra_t = self._materialize(store, fam, uniq, extra)
        if extra_t is None:  # CPU fallback: gather on the host, get() moves the result
            flat_np = flat.numpy().reshape(-1, fam.nbytes)
        else:
            flat2 = flat.reshape(-1, fam.nbytes)
        for f, (a, b) in zip(fields, spans, strict=True):  # a loop over fields, not rows
            if extra_t is None:
                part = torch.from_numpy(flat_np[extra[a:b]])
            else:
                part = flat2.index_select(0, extra_t[a:b])
            out[f.key] = f.cells_from_frames(part, n)

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
            t["mark"] = np.zeros(0, dtype=bool)
            t["pos"] = np.zeros(0, dtype=np.int64)
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

    def _unique(self, flat: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """``np.unique(flat, return_inverse=True)``; a bitmap over blob ids when that is cheaper."""
        if size > 16 * flat.size + 4096:
            u, inv = np.unique(flat, return_inverse=True)
            return u, inv.reshape(-1)
        t = self._thread()
        if t["mark"].size < size:
            t["mark"] = np.zeros(max(size, 2 * t["mark"].size), dtype=bool)
            t["pos"] = np.empty(t["mark"].size, dtype=np.int64)
        mark, pos = t["mark"], t["pos"]
        mark[flat] = True
        uniq = np.flatnonzero(mark[:size])
        mark[uniq] = False  # keep the bitmap all-False between calls: O(batch), not O(index)
        pos[uniq] = np.arange(uniq.size, dtype=np.int64)
        return uniq, pos[flat]

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counters[k] = self._counters.get(k, 0) + int(v)

    def _reason(self, why: str) -> None:
        with self._lock:
            self._counters["cpu_fallbacks"] += 1
            self._reasons[why] = self._reasons.get(why, 0) + 1

    # -- the pipeline -----------------------------------------------------------------------

    def _classify(self, store: TieredStore, uniq: np.ndarray) -> np.ndarray:
        """Where each blob is read from: HOT, WARM or COLD (the fastest tier holding it, as on the
        CPU path), or _OPEN_KIND for an open chunk."""
        idx = store._index
        state = idx.state[uniq]
        if not state.all():
            raise AssertionError("a row references a freed blob: index is inconsistent")
        has = idx.loc[uniq] >= 0
        has &= np.array([t is not None for t in store._tiers])
        kind = has.argmax(1).astype(np.int8)  # first True column: HOT before WARM before COLD
        is_open = state == OPEN
        kind[is_open] = _OPEN_KIND
        missing = ~has.any(1) & ~is_open
        if missing.any():
            raise AssertionError(f"{int(missing.sum())} blobs have no location: index is inconsistent")
        return kind

    def _materialize(self, store: TieredStore, fam: FrameFamily, uniq: np.ndarray,
                     extra: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = int(uniq.size)
        K, nb = fam.K, fam.nbytes
        row = K * nb
        stride = int(align(row))
        kind = self._classify(store, uniq)
        stored = kind != _OPEN_KIND
        fmts = store._index.codec[uniq[stored]]
        fmt = int(fmts[0]) if fmts.size else 1
        if fmts.size and (fmts != fmt).any():
            return self._fallback(store, fam, uniq, "mixed codecs in one batch")
        if not self._backend.supports(fmt):
            return self._fallback(store, fam, uniq, f"format id {fmt} not decodable by {self._backend.name}")
        m = int(stored.sum())
        bucket = self.bucket and fmt != _RAW_FORMAT and m > 0 and self._backend.capacity_ok(fmt)
        pads = _bucket_size(m) - m if bucket else 0
        t = self._thread()
        side = t["side"]
        hot = store._tiers[HOT]
        hot_words = None
        if hot is not None and _same_device(hot.device, self.device) and hot.capacity:
            buf = hot.buffer
            hot_words = buf[: buf.numel() // 8 * 8].view(torch.int64)
        _tls.oom = False
        cur = torch.cuda.current_stream(self.device) if self._cuda else None
        stream_ctx = torch.cuda.stream(side) if self._cuda else contextlib.nullcontext()
        if self._cuda:
            side.wait_stream(cur)  # the caller's pending work (e.g. arena writes) comes first
            if self._fence is not None:
                side.wait_event(self._fence)
            ev = getattr(hot, "write_event", None)
            if ev is not None:
                side.wait_event(ev)
        result_extra: torch.Tensor | None = None
        blk: torch.Tensor | None = None
        try:
            with stream_ctx:
                try:
                    out = _device_empty((n + pads) * stride, self.device, "output")
                except BaseException as e:
                    if not _is_oom(e):
                        raise
                    self._count(oom_events=1)
                    return self._fallback(store, fam, uniq, "out of memory for the output")
                ctx = _Ctx(store, fam, uniq, kind, fmt, stride, out, bucket, pads, side, hot_words)
                try:
                    result_extra, blk = self._attempt(ctx, np.arange(n, dtype=np.int64), extra, promote=True)
                except ChecksumError:
                    raise
                except BaseException as e:
                    if not _is_oom(e):
                        raise
                    self._count(oom_events=1)
                    if self._cuda:
                        torch.cuda.empty_cache()
                    try:
                        self._split(ctx)
                    except _Fallback:
                        return self._fallback(store, fam, uniq, "out of memory below min_split blobs")
                    blk = None
                    if extra is not None:
                        try:
                            result_extra = _device_empty(extra.size * 8, self.device, "index")
                            result_extra = result_extra.view(torch.int64)
                            result_extra.copy_(torch.from_numpy(extra))
                        except BaseException as e2:
                            if not _is_oom(e2):
                                raise
                            return self._fallback(store, fam, uniq, "out of memory for the frame indices")
        finally:
            if self._cuda:
                t["done"].record(side)
                cur.wait_event(t["done"])  # the consumer reads only after the decode
        if self._cuda:
            # fresh blocks of the caching allocator, allocated on `side`, read on `cur`
            out.record_stream(cur)
            if blk is not None:
                blk.record_stream(cur)
            if result_extra is not None:
                result_extra.record_stream(cur)
        self._bookkeeping(store, uniq, kind)
        flat = out[: n * stride].view(n, stride)[:, :row].reshape(n, K, nb)
        return flat, result_extra

    def _split(self, ctx: _Ctx) -> None:
        """Decode the batch in parts after an out-of-memory error; _Fallback below min_split."""
        n = ctx.uniq.size
        ctx.bucket, ctx.pads = False, 0
        size = max(n // 2, 1)
        i = 0
        while i < n:
            part = np.arange(i, min(i + size, n), dtype=np.int64)
            _tls.oom = False
            try:
                self._attempt(ctx, part, None, promote=False)
            except ChecksumError:
                raise
            except BaseException as e:
                if not _is_oom(e):
                    raise
                self._count(oom_events=1)
                if size <= self.min_split:
                    raise _Fallback from e
                size = max(size // 2, self.min_split)
                continue
            self._count(splits=1)
            i += part.size

    def _attempt(self, c: _Ctx, sel: np.ndarray, extra: np.ndarray | None,
                 promote: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Stage, upload, gather, verify and decode the blobs ``uniq[sel]`` into their output rows."""
        store = c.store
        idx = store._index
        t = self._thread()
        kinds = c.kind[sel]
        is_open = kinds == _OPEN_KIND
        open_pos = sel[is_open]
        s_pos = sel[~is_open]
        s_ids = c.uniq[s_pos]
        s_kind = kinds[~is_open]
        csz = idx.nbytes[s_ids]
        a = align(csz)
        m, k = int(s_ids.size), int(open_pos.size)
        hot_m = (s_kind == HOT) & (c.hot_words is not None)
        if hot_m.any():
            ends = (idx.loc[s_ids[hot_m], HOT] + a[hot_m]) // 8
            if int(ends.max()) > c.hot_words.numel():  # never for arena blobs; stage them if it happens
                hot_m[:] = False
        stg_m = ~hot_m
        h = int(hot_m.sum())
        filler = filler_frame(_FORMAT_NAMES[c.fmt]) if c.pads else b""
        # comp region: staged blobs, the filler, then hot blobs; 16-aligned offsets relative to it
        rel = np.empty(m, dtype=np.int64)
        rel[stg_m] = exclusive_cumsum(a[stg_m])
        staged_bytes = int(a[stg_m].sum())
        fill_rel = staged_bytes
        after_fill = staged_bytes + int(align(len(filler))) if filler else staged_bytes
        hot_a = a[hot_m]
        rel[hot_m] = after_fill + exclusive_cumsum(hot_a)
        comp_bytes = after_fill + int(hot_a.sum())
        e = 0 if extra is None else int(extra.size)
        n_tab = 2 * h + k + 5 * m + e
        tb = int(align(8 * n_tab))
        raw_bytes = k * c.stride
        comp0 = tb + raw_bytes
        prefix = comp0 + after_fill
        total = comp0 + comp_bytes
        stg_t, stg = self._staging(t, prefix)
        tab = stg[: 8 * n_tab].view(np.int64)
        p = 0
        if h:
            nw = hot_a // 8
            tab[p:p + h] = idx.loc[s_ids[hot_m], HOT] // 8 - exclusive_cumsum(nw)
            tab[p + h:p + 2 * h] = nw
            p += 2 * h
        p_open = p
        if k:
            tab[p:p + k] = open_pos
            p += k
        p_ck = p
        if m:
            tab[p:p + m] = rel
            tab[p + m:p + 2 * m] = rel + csz
            tab[p + 2 * m:p + 3 * m] = rel - 1
            ck = idx.checksum[s_ids].view(np.uint64)
            tab[p + 3 * m:p + 4 * m] = (ck & np.uint64(_MASK32)).astype(np.int64)
            tab[p + 4 * m:p + 5 * m] = (ck >> np.uint64(32)).astype(np.int64)
            p += 5 * m
        p_extra = p
        if e:
            tab[p:p + e] = extra
        if k:
            raw = c.fam.open_raw(c.uniq[open_pos], idx)
            stg[tb:tb + raw_bytes].reshape(k, c.stride)[:, : raw.shape[1] * raw.shape[2]] = raw.reshape(k, -1)
        for tier_id in (WARM, COLD, HOT):  # HOT lands here only when its arena is not on this device
            sel_t = stg_m & (s_kind == tier_id)
            if sel_t.any():
                tier = store._tiers[tier_id]
                tier.read(idx.loc[s_ids[sel_t], tier_id], csz[sel_t], stg, comp0 + rel[sel_t])
        if filler:
            stg[comp0 + fill_rel:comp0 + fill_rel + len(filler)] = np.frombuffer(filler, np.uint8)

        blk = _device_empty(total, self.device, "batch")
        blk[:prefix].copy_(stg_t[:prefix], non_blocking=True)
        if self._cuda:
            t["h2d"].record(c.side)
            t["h2d_pending"] = True
        tab_d = blk[: 8 * n_tab].view(torch.int64)
        out2d = c.out.view(-1, c.stride)
        if h:
            words = int(hot_a.sum()) // 8
            ar = self._arange(t, words)
            which = torch.repeat_interleave(tab_d[h:2 * h], output_size=words)
            src = ar[:words] + tab_d[:h].index_select(0, which)
            dst = blk[comp0 + after_fill:comp0 + comp_bytes].view(torch.int64)
            torch.index_select(c.hot_words, 0, src, out=dst)
        if k:
            out2d.index_copy_(0, tab_d[p_open:p_open + k], blk[tb:tb + raw_bytes].view(k, c.stride))
        if m:
            self._verify(t, store, blk[comp0:total], tab_d[p_ck:p_ck + 5 * m], m, s_ids)
            dec_off = comp0 + rel
            ooff = s_pos * c.stride
            if c.fmt == _RAW_FORMAT:
                copy_blobs(blk, dec_off, c.out, ooff, csz)
            else:
                osz = idx.raw_nbytes[s_ids]
                if c.pads:
                    dec_off = np.concatenate([dec_off, np.full(c.pads, comp0 + fill_rel, np.int64)])
                    csz_d = np.concatenate([csz, np.full(c.pads, len(filler), np.int64)])
                    pad_rows = c.uniq.size + np.arange(c.pads, dtype=np.int64)
                    ooff = np.concatenate([ooff, pad_rows * c.stride])
                    osz = np.concatenate([osz, np.ones(c.pads, np.int64)])
                else:
                    csz_d = csz
                self._backend.decode(c.fmt, blk, dec_off, csz_d, c.out, ooff, osz,
                                     c.stride if c.bucket else None, c.side)
        self._count(h2d_bytes=prefix, pads=c.pads, hot_on_device=h)
        if promote and store._promote and m:
            store._promote_blobs(s_ids, s_kind.astype(np.int8), stg, comp0 + rel, csz)
            self.fence_writes()
        return (tab_d[p_extra:p_extra + e] if extra is not None else None), blk

    def _verify(self, t: dict[str, Any], store: TieredStore, comp: torch.Tensor, tab: torch.Tensor, m: int,
                s_ids: np.ndarray) -> None:
        """Check every blob against its stored checksum before any byte reaches the decoder."""
        starts_ends, start_m1, expected = tab[: 2 * m], tab[2 * m:3 * m], tab[3 * m:5 * m].view(2, m)
        if self.checksum == "fused" and comp.numel() < _FUSED_MAX:
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
            self._count(checksum_failures=int(which.size))
            raise ChecksumError(store._describe_bad_blobs(s_ids[which]))

    def _bookkeeping(self, store: TieredStore, uniq: np.ndarray, kind: np.ndarray) -> None:
        counts = np.bincount(kind.astype(np.int64), minlength=4)
        stored_ids = uniq[kind != _OPEN_KIND]
        for tier_id in (HOT, WARM, COLD):
            if counts[tier_id]:
                store._stats[_TIER_NAMES[tier_id]]["hits"] += int(counts[tier_id])
        store._counters["blobs_decoded"] += int(stored_ids.size)
        store._policy.on_access(stored_ids)
        self._count(batches=1, blobs=int(uniq.size), hot=int(counts[HOT]), warm=int(counts[WARM]),
                    cold=int(counts[COLD]), open=int(counts[_OPEN_KIND]))

    def _fallback(self, store: TieredStore, fam: FrameFamily, uniq: np.ndarray,
                  why: str) -> tuple[torch.Tensor, None]:
        """Decode on the CPU (the store's own path, with its own bookkeeping)."""
        self._reason(why)
        frames = torch.from_numpy(store._materialize(fam, uniq))
        self.fence_writes()  # the CPU path may have promoted blobs into the hot arena
        return frames, None


def maybe_gpu_decoder(store: TieredStore, option: bool | None = None) -> GpuDecoder | None:
    """The decoder a store should use: the store hook calls this from ``TieredStore.__init__``.

    Args:
        store: the store (its ``device`` decides).
        option: ``None`` (auto): a decoder when ``store.device`` is CUDA and nvCOMP is
            importable, else None with a warning naming the install command; ``True``: require
            it; ``False``: never (CPU decode, then a copy to ``device``).

    Raises:
        CodecUnavailableError: ``option=True`` and nvCOMP or CUDA is missing.
        ValueError: ``option=True`` with a CPU ``device``.

    Example:
        >>> from tiered import TieredStore
        >>> maybe_gpu_decoder(TieredStore(8)) is None      # device="cpu": the CPU path
        True
    """
    if option is False:
        return None
    dev = store.device
    if dev.type != "cuda":
        if option:
            raise ValueError(f"gpu_decode=True needs a CUDA device, but the store returns data on {dev}; "
                             "pass device='cuda'")
        return None
    if option:
        return GpuDecoder(dev)
    try:
        return GpuDecoder(dev)
    except CodecUnavailableError as e:
        warnings.warn(f"tiered samples on {dev} but decodes on the CPU: {e}", stacklevel=3)
        return None
