"""nvCOMP GPU codecs: batched decode (and encode) of the same bitstreams the CPU codecs write.

``NvcompCodec("zstd")`` decodes the very bytes :class:`~tiered.codecs.zstd.ZstdCodec` writes (one
standard zstd frame per blob, ``BitstreamKind.RAW``), ``NvcompCodec("lz4")`` the raw LZ4 blocks of
:class:`~tiered.codecs.lz4.Lz4Codec`, so a store written on a CPU-only machine samples on a GPU and
back. Both carry the format id of their CPU twin (1 and 2). ``"deflate"`` (raw RFC 1951, format id
3) is GPU-only here: no CPU codec of tiered reads it yet, so never persist it.

Two faces:

* the :class:`~tiered.codecs.base.Codec` contract on host (numpy) buffers: one H2D copy, one
  batched nvCOMP call, one D2H copy. Handy for interop checks; not the sample path.
* the GPU-native methods :meth:`NvcompCodec.decode_device` / :meth:`NvcompCodec.encode_device`
  on uint8 CUDA tensors laid out as ``(buffer, offsets, sizes)``, exactly like a tier arena.
  ``decode_device`` builds two zero-copy ``nvcomp.as_arrays`` views (source blobs and output
  slots) and makes one ``Codec.decode`` call with a cached, sync-free
  ``decompression_config(compression_config(sizes))``: no Python object per blob, no host sync.

nvCOMP facts this module relies on (nvCOMP 6.0's Python API): the batch type is
``BatchArray`` (a Python list is not accepted); a config built from sizes never synchronizes,
one built from the compressed buffers does; ``Codec`` objects and configs are thread-local and
bound to one CUDA stream; stream ``0`` is ambiguous (nvCOMP reads it as "not given"), so a
non-default stream is always passed; decoders have undefined behaviour on corrupt input, so
callers verify checksums first (the store always does, on the GPU).

Whether a sizes-built config also decodes CPU-written frames is not documented; the first
decode on a device runs :meth:`NvcompCodec.probe` once (CPU-made frames, bit-exact compare) and
picks the mode that works: ``"cc"`` (config from sizes, sync-free), else ``"src"`` (config from
the buffers, one sync per call). The probe also tells whether a config built from a uniform
*capacity* (larger than the real sizes) works, which lets callers reuse one config per batch
size bucket, and whether cells larger than nvCOMP's default 64 KiB chunk decode (``"large"``).

Every nvCOMP ``Codec`` is built with an ``uncomp_chunk_size`` at least as large as the cells it
decodes (a power of two from 64 KiB up, see :func:`chunk_class`): how RAW streams treat cells
larger than the chunk size is not documented, so no cell ever is.

nvCOMP calls the device allocator (:func:`use_torch_allocator`, which says how a failed
allocation is reported) from C++. Whether a Python exception unwinds cleanly through nvCOMP's C++
frames is not documented: the ``@pytest.mark.cuda`` test of such a failure runs in a child process.

``nvidia.nvcomp`` is imported lazily; when it is missing, constructing a codec raises
:class:`~tiered.errors.CodecUnavailableError` with the install command.

Example:
    >>> from tiered.codecs import get_codec
    >>> try:
    ...     codec = get_codec("nvcomp:zstd")   # needs nvidia-nvcomp and a CUDA GPU
    ... except ImportError as e:                # CodecUnavailableError names the install command
    ...     codec = None
    >>> codec is None or (codec.name, codec.format_id) == ("nvcomp:zstd", 1)
    True
"""

from __future__ import annotations

import atexit
import functools
import importlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CodecUnavailableError, CorruptionError, DeviceFailedError, UnknownCodecError
from ..util.batch import exclusive_cumsum
from ..util.buffers import check_bounds, is_out_of_memory
from ..util.copy import copy_blobs
from ..util.hostcopy import copy_host_blobs
from ..util.units import ALIGNMENT, align  # 16: the largest alignment an nvCOMP format needs (ANS)
from . import get_codec
from .base import Codec, EncodedBatch
from .checksum import segment_checksums
from .raw import as_batch, check_out

if TYPE_CHECKING:
    import torch

__all__ = [
    "NvcompCodec",
    "DeviceBatch",
    "codec_factory",
    "import_nvcomp",
    "filler_frame",
    "empty_frame",
    "use_torch_allocator",
    "INSTALL_HINT",
    "chunk_class",
    "note_allocation_failure",
    "take_allocation_failure",
    "probe_is_final",
    "ProbeResults",
    "RetryGate",
    "check_device",
]

#: Install command named by every "nvCOMP missing" error.
INSTALL_HINT = (
    "pip install 'tiered[gpu-cu12]' (CUDA 12) or pip install 'tiered[gpu-cu13]' (CUDA 13), "
    "which install nvidia-nvcomp-cu12/-cu13 >= 6.0"
)
_MIN_VERSION = (6, 0)
# Configs kept per nvCOMP Codec object (per thread and stream). A batch-size bucket scheme needs
# about 8 per octave of batch sizes; exact-size keys churn, so the cache is an LRU.
_CONFIG_CACHE = 256
#: nvCOMP's default uncompressed chunk size, and the smallest chunk size a Codec is built with.
BASE_CHUNK = 1 << 16


@dataclass(frozen=True)
class _Format:
    """One nvCOMP format; the numbers are the ``nvcomp<Algo>*`` constants of nvCOMP 6.0's headers."""

    algorithm: str  # nvCOMP's algorithm name
    format_id: int  # shared with the CPU codec of the same bitstream
    decode_align: int  # RequiredDecompressionAlignment: every decode buffer
    compress_align: int  # RequiredCompressionAlignment: every encode buffer
    max_decode_chunk: int  # DecompressionMaxAllowedChunkSize
    max_encode_chunk: int  # CompressionMaxAllowedChunkSize
    options: tuple[tuple[str, Any], ...] = ()


_FORMATS: dict[str, _Format] = {
    "zstd": _Format("Zstd", 1, 8, 4, (1 << 31) - 1, (1 << 31) - 1),
    "lz4": _Format("LZ4", 2, 4, 4, (1 << 32) - 1, 1 << 24, (("data_type", "|u1"),)),
    # Format id 3 is not in tiered.codecs' registry: deflate blobs are GPU-only (see module doc).
    "deflate": _Format("Deflate", 3, 4, 8, (1 << 32) - 1, 1 << 31),
}


def chunk_class(nbytes: int) -> int:
    """The ``uncomp_chunk_size`` a Codec decoding cells of up to ``nbytes`` is built with.

    A power of two, at least nvCOMP's default 64 KiB, so a handful of Codec objects per thread
    and stream cover every cell size.

    Example:
        >>> chunk_class(7056), chunk_class(65536), chunk_class(100800)
        (65536, 65536, 131072)
    """
    n = max(int(nbytes), BASE_CHUNK)
    return 1 << (n - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Import, version guard, allocator
# ---------------------------------------------------------------------------------------------


def import_nvcomp() -> ModuleType:
    """Import ``nvidia.nvcomp`` (>= 6.0 with the ``BatchArray`` API) or explain how to install it.

    Raises:
        CodecUnavailableError: the package is missing, or older than 6.0 (no ``BatchArray``
            API); the message names the install command.

    Example:
        >>> try:
        ...     nv = import_nvcomp()
        ... except ImportError as e:
        ...     assert "tiered[gpu-cu12]" in str(e)
    """
    try:
        nv = importlib.import_module("nvidia.nvcomp")
    except ImportError as e:
        raise CodecUnavailableError(
            f"nvCOMP GPU codecs need the nvidia-nvcomp package, which cannot be imported here ({e}); "
            f"install it with: {INSTALL_HINT}. The CPU codecs ('zstd', 'lz4') read and write the same bytes."
        ) from e
    version = str(getattr(nv, "__version__", "0"))
    try:
        parsed = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        parsed = (0, 0)
    if parsed < _MIN_VERSION:
        raise CodecUnavailableError(
            f"nvidia-nvcomp {version} is too old: tiered needs >= 6.0 (BatchArray API: as_arrays, "
            f"compression_config, decompression_config); upgrade with: {INSTALL_HINT}"
        )
    return nv


_allocator_lock = threading.Lock()
# [whether ours is installed, the `allocate` it wraps]
_allocator_installed: list[Any] = [False, None]
_alloc_failure = threading.local()


def note_allocation_failure(error: BaseException) -> None:
    """Record that an allocation made for nvCOMP (inside its C++ call) failed on this thread.

    The allocator callback records the error here before raising it into nvCOMP (see the
    module docstring), and the codec raises this one, not what nvCOMP made of it, once the
    nvCOMP call returns (:func:`take_allocation_failure`). The first failure of a call is kept.

    Example:
        >>> note_allocation_failure(MemoryError("no room"))
        >>> take_allocation_failure()
        MemoryError('no room')
        >>> take_allocation_failure() is None
        True
    """
    if getattr(_alloc_failure, "error", None) is None:
        _alloc_failure.error = error


def take_allocation_failure() -> BaseException | None:
    """The allocation failure recorded on this thread since the last call (and clear it)."""
    error = getattr(_alloc_failure, "error", None)
    _alloc_failure.error = None
    return error


class _TorchBlock:
    """A device block owned by torch's caching allocator, exposing ``ptr`` as nvCOMP expects."""

    __slots__ = ("tensor", "ptr")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.ptr = tensor.data_ptr()


def use_torch_allocator(allocate: Callable[[int, Any], torch.Tensor] | None = None) -> None:
    """Route nvCOMP's device allocations (decode scratch) through PyTorch's caching allocator.

    nvCOMP's Zstd scratch grows with the batch (NVIDIA/nvcomp#77); inside torch's pool it is
    reused, counted by ``torch.cuda.memory_allocated`` and freed stream-ordered. The setting is
    process-wide; the first call wins unless ``allocate`` differs.

    A failure in ``allocate`` (an exception, or None returned) is recorded with
    :func:`note_allocation_failure` and raised into nvCOMP, which gives up the call; the codec
    then raises the recorded error (a ``torch.OutOfMemoryError`` the GPU decoder handles by
    splitting the batch). nvCOMP never gets a null block: its headers allow NULL scratch only
    when none is needed, and its kernels writing through a null pointer would end the process's
    CUDA context. The callback is reset at interpreter exit (``atexit``), before nvCOMP's and
    torch's teardown.

    Args:
        allocate: ``allocate(nbytes, torch_stream) -> uint8 CUDA tensor | None``; default
            ``torch.empty`` on that stream. The GPU decoder passes its own to add its
            allocation-failure seam (tests).
    """
    import torch

    nv = import_nvcomp()
    from nvidia.nvcomp.external_memory import ExternalMemory  # type: ignore[import-not-found]

    streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def _default(nbytes: int, stream: Any) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=stream.device)

    alloc = allocate or _default

    def torch_stream(stream: Any) -> torch.cuda.Stream:
        dev = stream.device if stream.device >= 0 else torch.cuda.current_device()
        if stream.ptr and not stream.is_special:
            key = (dev, stream.ptr)
            ts = streams.get(key)
            if ts is None:
                ts = streams.setdefault(key, torch.cuda.ExternalStream(stream.ptr, device=dev))
            return ts
        return torch.cuda.current_stream(dev)

    def nvcomp_alloc(nbytes: int, stream: Any) -> Any:
        try:
            ts = torch_stream(stream)
            # Allocated while `ts` is current: the block is stream-ordered on the stream nvCOMP uses.
            with torch.cuda.stream(ts):
                t = alloc(max(int(nbytes), 1), ts)
            if t is None:
                raise torch.OutOfMemoryError(f"nvCOMP scratch: cannot allocate {int(nbytes)} bytes")
        except BaseException as e:
            # recorded first: what nvCOMP makes of the exception (its own RuntimeError, perhaps)
            # is not what the codec raises after the call
            note_allocation_failure(e)
            raise
        # ExternalMemory keeps the nvCOMP stream alive until the block is released.
        return ExternalMemory(_TorchBlock(t), stream)

    with _allocator_lock:
        if _allocator_installed[0] and _allocator_installed[1] is allocate:
            return
        nv.set_device_allocator(nvcomp_alloc)
        if not _allocator_installed[0]:
            # a Python callback left installed would be called by nvCOMP's static teardown, after
            # the interpreter (or torch's allocator) is gone
            atexit.register(_reset_allocator)
        _allocator_installed[:] = [True, allocate]


def _reset_allocator() -> None:
    """Give nvCOMP back its own device allocator (at exit, or in tests)."""
    with _allocator_lock:
        if not _allocator_installed[0]:
            return
        _allocator_installed[:] = [False, None]
        import_nvcomp().set_device_allocator()


# ---------------------------------------------------------------------------------------------
# Small frames every format needs
# ---------------------------------------------------------------------------------------------


def _cpu_compress(fmt: str, raw: bytes) -> bytes:
    """The frame the CPU codec of ``fmt`` writes for ``raw`` (deflate, GPU-only, has none: zlib's
    raw deflate, as nvCOMP writes it)."""
    if fmt == "deflate":
        import zlib

        c = zlib.compressobj(6, zlib.DEFLATED, -15)
        return c.compress(raw) + c.flush()
    enc = get_codec(fmt).encode(np.frombuffer(raw, np.uint8), np.zeros(1, np.int64), np.array([len(raw)]))
    return enc.data.tobytes()


@functools.cache
def empty_frame(fmt: str) -> bytes:
    """The blob a 0-byte cell is stored as, identical to the CPU codec's (zstd: a 9-byte frame).

    Example:
        >>> empty_frame("lz4"), len(empty_frame("zstd"))
        (b'\\x00', 9)
    """
    return _cpu_compress(fmt, b"")


@functools.cache
def filler_frame(fmt: str) -> bytes:
    """A tiny valid frame that decodes to one zero byte (pads a batch to a cached config size).

    Example:
        >>> filler_frame("lz4")
        b'\\x10\\x00'
    """
    return _cpu_compress(fmt, b"\x00")


# ---------------------------------------------------------------------------------------------
# Batches, checks and per-thread state the codec is built from
# ---------------------------------------------------------------------------------------------


@dataclass
class DeviceBatch:
    """Compressed blobs in one uint8 CUDA tensor, at 16-aligned offsets (ready for decode_device).

    Attributes:
        data: uint8 CUDA tensor holding every blob.
        offsets: int64 numpy array, start of each blob in ``data`` (multiples of 16).
        sizes: int64 numpy array, compressed size of each blob.
    """

    data: torch.Tensor
    offsets: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    def to_host(self) -> EncodedBatch:
        """Pack the blobs back to back on the host, with their checksums (the Codec contract)."""
        host = self.data.cpu().numpy()
        offsets = exclusive_cumsum(self.sizes)
        packed = np.empty(int(self.sizes.sum()), dtype=np.uint8)
        copy_host_blobs(host, self.offsets, packed, offsets, self.sizes)
        checksums = segment_checksums(packed, offsets, self.sizes)
        return EncodedBatch(packed, offsets, self.sizes.copy(), checksums)


class _Entry:
    """One nvCOMP ``Codec`` bound to one thread and one CUDA stream, with its config cache."""

    __slots__ = ("codec", "configs", "stream_ptr")

    def __init__(self, codec: Any, stream_ptr: int) -> None:
        self.codec = codec
        self.configs: OrderedDict[Any, Any] = OrderedDict()
        self.stream_ptr = stream_ptr

    def decompression_config(self, key: Any, sizes: list[int]) -> tuple[Any, bool]:
        """The sync-free decode config for output ``sizes`` cached under ``key``, and whether it was cached."""
        cfg = self.configs.get(key)
        if cfg is None:
            codec = self.codec
            cfg = codec.decompression_config(codec.compression_config(sizes))
            self.configs[key] = cfg
            if len(self.configs) > _CONFIG_CACHE:
                self.configs.popitem(last=False)
            return cfg, False
        self.configs.move_to_end(key)
        return cfg, True


def _check_device_batch(data: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, what: str,
                        device: torch.device, spec: _Format, span: np.ndarray | None = None,
                        encode: bool = False) -> None:
    """Raise unless ``data`` is a uint8 CUDA tensor of ``device`` holding the blobs, each aligned for ``spec``."""
    import torch

    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1 \
            or not data.is_contiguous():
        raise TypeError(f"{what} must be a contiguous 1-D uint8 CUDA tensor, got "
                        f"{type(data).__name__} {getattr(data, 'dtype', '')} "
                        f"{tuple(getattr(data, 'shape', ()))}")
    if data.device != device:
        raise ValueError(f"{what} is on {data.device}, this codec runs on {device}")
    check_bounds(offsets, sizes if span is None else span, data.numel(), f"{what}'s")
    need = spec.compress_align if encode else spec.decode_align
    misaligned = (data.data_ptr() + offsets) % need
    if offsets.size and misaligned.any():
        i = int(np.flatnonzero(misaligned)[0])
        raise ValueError(
            f"{what}: entry {i} starts at offset {int(offsets[i])}, which is not aligned to the "
            f"{need} bytes nvCOMP's {spec.algorithm} needs; lay blobs out at "
            f"multiples of {ALIGNMENT} (tier arenas already do)")


def _check_headers(fmt: str, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                   out_sizes: np.ndarray) -> None:
    """Cheap host checks before bytes reach a GPU decoder (it has no defined behaviour on junk)."""
    if fmt == "zstd":
        from .zstd import declared_content_sizes

        declared = declared_content_sizes(data, offsets, sizes)
        bad = np.flatnonzero((declared == -2) | ((declared >= 0) & (declared != out_sizes)))
        if bad.size:
            i = int(bad[0])
            raise CorruptionError(
                f"zstd blob {i} of this batch ({int(sizes[i])} bytes at offset {int(offsets[i])}) "
                + ("is not a valid zstd frame" if declared[i] == -2 else
                   f"declares {int(declared[i])} decompressed bytes, expected {int(out_sizes[i])}")
                + "; its bytes or the blob index are damaged: run `tiered verify`")
        return
    zero = np.flatnonzero(out_sizes == 0)
    if zero.size:
        e = np.frombuffer(empty_frame(fmt), np.uint8)
        ok = sizes[zero] == e.size
        if ok.any():
            take = data[offsets[zero[ok]][:, None] + np.arange(e.size)]
            ok[ok] = (take == e).all(axis=1)
        if not ok.all():
            i = int(zero[np.flatnonzero(~ok)[0]])
            raise CorruptionError(f"{fmt} blob {i} of this batch should be the empty block of a "
                                  "0-byte cell; its bytes or the blob index are damaged")


# ---------------------------------------------------------------------------------------------
# The codec
# ---------------------------------------------------------------------------------------------


class NvcompCodec(Codec):
    """Batched GPU (de)compression of zstd frames, raw LZ4 blocks or raw deflate with nvCOMP 6.

    Args:
        format: ``"zstd"`` (default; reads :class:`~tiered.codecs.zstd.ZstdCodec` blobs),
            ``"lz4"`` (reads :class:`~tiered.codecs.lz4.Lz4Codec` blobs) or ``"deflate"``
            (GPU-only).
        device: CUDA device (default: the current one).
        execution_policy: ``"concurrency"`` (nvCOMP's default) or ``"latency"``.

    Raises:
        CodecUnavailableError: ``nvidia.nvcomp`` is missing or too old (the message names
            ``pip install 'tiered[gpu-cu12]'`` / ``'tiered[gpu-cu13]'``), or there is no CUDA GPU.
        UnknownCodecError: an unknown format.

    Thread safety: nvCOMP ``Codec`` objects are thread-local, so this object keeps one per
    thread and CUDA stream; share the ``NvcompCodec`` freely.

    Example:
        >>> import numpy as np, torch
        >>> from tiered.codecs import ZstdCodec
        >>> codec = NvcompCodec("zstd")                                   # doctest: +SKIP
        >>> enc = ZstdCodec().encode(np.zeros(7056, np.uint8), np.array([0]), np.array([7056]))
        >>> out = np.empty(7056, np.uint8)
        >>> codec.decode(enc.data, enc.offsets, enc.sizes, out, [0], [7056])  # doctest: +SKIP
        >>> bool((out == 0).all())                                        # doctest: +SKIP
        True
    """

    def __init__(self, format: str = "zstd", device: str | int | torch.device | None = None, *,
                 execution_policy: str = "concurrency") -> None:
        fmt = str(format).strip().lower()
        if fmt not in _FORMATS:
            raise UnknownCodecError(f"unknown nvCOMP format {format!r}; known: {', '.join(_FORMATS)}")
        if execution_policy not in ("concurrency", "latency"):
            raise ValueError(f"execution_policy must be 'concurrency' or 'latency', got {execution_policy!r}")
        self._nv = import_nvcomp()
        import torch

        if not torch.cuda.is_available():
            raise CodecUnavailableError(
                "nvCOMP codecs need a CUDA GPU, and torch.cuda.is_available() is False on this machine; "
                "use the CPU codec of the same format ('zstd' or 'lz4'), which reads the same bytes")
        self._spec = _FORMATS[fmt]
        self.format = fmt
        self.format_id = self._spec.format_id
        self.name = f"nvcomp:{fmt}"
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"NvcompCodec runs on a CUDA device, got {dev}")
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.execution_policy = execution_policy
        self._local = threading.local()
        #: Which path the last encode_device took ("out" or "loop"); for gpu_check.
        self.last_encode_path = ""

    def __reduce__(self) -> tuple:
        return (type(self), (self.format, str(self.device)), {"execution_policy": self.execution_policy})

    def __setstate__(self, state: dict) -> None:
        self.__init__(self.format, self.device, **state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"NvcompCodec({self.format!r}, device={str(self.device)!r})"

    # -- per-thread nvCOMP objects ------------------------------------------------------------

    def _side_stream(self) -> torch.cuda.Stream:
        import torch

        s = getattr(self._local, "side", None)
        if s is None:
            s = self._local.side = torch.cuda.Stream(self.device)
        return s

    def _entry(self, stream: torch.cuda.Stream, largest: int = 0, encode: bool = False) -> _Entry:
        """The nvCOMP Codec of this thread and ``stream`` whose chunk size fits cells of ``largest`` bytes."""
        chunk = chunk_class(largest)
        limit = self._spec.max_encode_chunk if encode else self._spec.max_decode_chunk
        if chunk > limit:
            verb = "encode" if encode else "decode"
            raise CodecUnavailableError(
                f"a {largest}-byte cell needs a {chunk}-byte chunk, more than the {limit} bytes nvCOMP's "
                f"{self._spec.algorithm} takes per chunk to {verb}; {verb} it with the CPU codec")
        entries = self._local.__dict__.setdefault("entries", {})
        ptr = int(stream.cuda_stream)
        e = entries.get((ptr, chunk))
        if e is None:
            nv = self._nv
            policy = nv.ExecutionPolicy.LATENCY if self.execution_policy == "latency" else \
                nv.ExecutionPolicy.CONCURRENCY
            codec = nv.Codec(
                algorithm=self._spec.algorithm,
                device_id=int(self.device.index),
                cuda_stream=ptr,
                uncomp_chunk_size=chunk,
                bitstream_kind=nv.BitstreamKind.RAW,
                execution_policy=policy,
                **dict(self._spec.options),
            )
            e = entries[(ptr, chunk)] = _Entry(codec, ptr)
        return e

    @contextmanager
    def _on(self, stream: torch.cuda.Stream | None, *tensors: torch.Tensor) -> Iterator[torch.cuda.Stream]:
        """Run nvCOMP work on ``stream``; with None (or the legacy default stream, ptr 0, which nvCOMP
        reads as "no stream") on this thread's side stream, ordered after and before the current one."""
        import torch

        if stream is not None and int(stream.cuda_stream) != 0:
            with torch.cuda.stream(stream):
                yield stream
            return
        cur = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(cur)
        try:
            with torch.cuda.stream(side):
                yield side
        finally:
            cur.wait_stream(side)
            for t in tensors:
                t.record_stream(side)  # the caller may free them right away; side may still use them

    def _count(self, name: str) -> None:
        counters = self._local.__dict__.setdefault("counters", {})
        counters[name] = counters.get(name, 0) + 1

    def counters(self) -> dict[str, int]:
        """This thread's config-cache hits/misses and probe/decode counts."""
        return dict(self._local.__dict__.get("counters", {}))

    # -- probe --------------------------------------------------------------------------------

    def probe(self) -> dict[str, Any]:
        """Find, once per device and format, which decode configs give bit-exact output.

        Decodes CPU-written frames (the store's bytes) of several sizes and compares bytes:

        * ``exact``: ``"cc"`` when a config built from the exact sizes works (sync-free),
          else ``"src"`` (config parsed from the buffers: one stream sync per call), else None.
        * ``capacity``: True when a config built from a uniform size *larger* than the real
          ones also works (then one config serves a whole batch-size bucket).

        * ``large``: True when cells larger than nvCOMP's default 64 KiB chunk decode too
          (with a Codec whose ``uncomp_chunk_size`` fits them); otherwise batches with such
          cells are refused with CodecUnavailableError (the GPU decoder decodes them on the CPU);
          ``large_capacity``: the same with a capacity config (buckets of large cells).

        Every probe cell is within the chunk size of the Codec decoding it. A result spoiled
        by an out-of-memory error is not kept: a later call probes again, after 1, 2, 4, ...
        up to 256 calls that reuse it (:class:`ProbeResults`). Results are kept per format,
        device and execution policy.

        Raises:
            DeviceFailedError: a probed mode failed with a CUDA error that ended the process's
                CUDA context (see :func:`check_device`).

        Returns:
            ``{"exact": ..., "capacity": bool, "large": bool, "large_capacity": bool,
            "errors": [str, ...], "oom": bool,
            "cached": bool, "sizes": [...], "large_sizes": [...]}``.
        """
        key = (self.format, int(self.device.index), self.execution_policy)
        try:
            return _PROBES.result(key, lambda: _find_decode_modes(self))
        except RuntimeError as e:
            if not isinstance(e, DeviceFailedError):
                check_device(self.device, "nvCOMP's probe")  # its streams and buffers, not a mode
            raise

    # -- GPU-native API -------------------------------------------------------------------------

    def decode_device(
        self,
        data: torch.Tensor,
        offsets: np.ndarray,
        sizes: np.ndarray,
        out: torch.Tensor,
        out_offsets: np.ndarray,
        out_sizes: np.ndarray,
        *,
        stream: torch.cuda.Stream | None = None,
        out_capacity: int | None = None,
        check: bool = True,
    ) -> None:
        """Decode blobs of a CUDA buffer into a preallocated CUDA output, in one nvCOMP call.

        Blob ``i`` is ``data[offsets[i]:+sizes[i]]`` and decodes to ``out_sizes[i]`` bytes at
        ``out[out_offsets[i]:]``. No host synchronization in the ``"cc"`` mode (see
        :meth:`probe`), no allocation but nvCOMP's scratch, no Python object per blob.

        Args:
            data, offsets, sizes: the compressed batch (offsets aligned to the format's
                decode alignment; 16 is always safe).
            out, out_offsets, out_sizes: where each blob decodes, and its exact size. 0-byte
                entries are skipped.
            stream: run on this CUDA stream; the caller orders it (inputs ready before, outputs
                read after). None: this thread's side stream, ordered after the current stream's
                pending work and before its later work.
            out_capacity: every output slot has at least this many bytes (>= each out size):
                then the config is built from ``[out_capacity] * n`` and cached per ``n``, which
                needs ``probe()["capacity"]``; the exact sizes are used otherwise.
            check: validate devices, bounds and alignment (a few host operations). Callers
                that laid the buffers out themselves (the GPU decoder) pass False.

        Raises:
            TypeError, ValueError: buffers not uint8 CUDA tensors of this device, ranges out of
                bounds or misaligned.
            CodecUnavailableError: no decode mode of this nvCOMP passed the probe.

        nvCOMP's decoders have undefined behaviour on corrupt input: verify checksums first.
        """
        offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
        out_offsets, out_sizes = np.asarray(out_offsets, np.int64), np.asarray(out_sizes, np.int64)
        if check:
            if not (offsets.shape == sizes.shape == out_offsets.shape == out_sizes.shape):
                raise ValueError("offsets, sizes, out_offsets and out_sizes must have one entry per blob")
            span = out_sizes if out_capacity is None else np.full_like(out_sizes, int(out_capacity))
            if out_capacity is not None and out_sizes.size and int(out_sizes.max()) > out_capacity:
                raise ValueError(f"out_capacity {out_capacity} < out size {int(out_sizes.max())}")
            _check_device_batch(data, offsets, sizes, "data", self.device, self._spec)
            _check_device_batch(out, out_offsets, out_sizes, "out", self.device, self._spec, span=span)
        # 0-byte outputs have nothing to write and nvCOMP must not see them, checked or not
        keep = out_sizes > 0
        if not keep.all():
            offsets, sizes = offsets[keep], sizes[keep]
            out_offsets, out_sizes = out_offsets[keep], out_sizes[keep]
        if out_sizes.size == 0:
            return
        mode, cap = self._mode(out_sizes, out_capacity)
        with self._on(stream, data, out) as on:
            self._decode(on, data, offsets, sizes, out, out_offsets, out_sizes, mode=mode, cap=cap)

    def _mode(self, out_sizes: np.ndarray, out_capacity: int | None) -> tuple[str, int | None]:
        """The config mode and the capacity (None: exact sizes) the probe allows for these cells."""
        probe = self.probe()
        if probe["exact"] is None:
            raise CodecUnavailableError(
                f"nvCOMP {getattr(self._nv, '__version__', '?')} failed to decode CPU-written {self.format} "
                f"frames bit-exactly in every mode ({'; '.join(probe['errors'])}); use the CPU codec")
        cap = out_capacity if (out_capacity is not None and probe["capacity"] and (
            out_capacity <= BASE_CHUNK or probe["large_capacity"])) else None
        largest = int(out_capacity) if cap is not None else int(out_sizes.max())
        if largest > BASE_CHUNK and not probe.get("large", False):
            raise CodecUnavailableError(
                f"nvCOMP's probe could not decode {self.format} cells larger than {BASE_CHUNK} bytes "
                f"bit-exactly ({'; '.join(probe['errors'])}); this batch has {largest}-byte cells: "
                "use the CPU codec")
        return ("cc" if cap is not None else probe["exact"]), cap

    def _decode(self, stream: torch.cuda.Stream, data: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray,
                out: torch.Tensor, out_offsets: np.ndarray, out_sizes: np.ndarray, *, mode: str,
                cap: int | None, want_sizes: bool = False) -> list[int] | None:
        nv = self._nv
        n = int(sizes.size)
        dst_sizes = out_sizes.tolist() if cap is None else [int(cap)] * n
        entry = self._entry(stream, int(cap) if cap is not None else int(out_sizes.max()))
        ptr = entry.stream_ptr
        codec = entry.codec
        take_allocation_failure()  # a stale record must not be blamed on this call
        try:
            src = nv.as_arrays(data, offsets.tolist(), sizes.tolist(), cuda_stream=ptr)
            dst = nv.as_arrays(out, out_offsets.tolist(), dst_sizes, cuda_stream=ptr)
            if mode == "cc":
                key = ("cap", n, int(cap)) if cap is not None else ("exact", out_sizes.tobytes())
                cfg, hit = entry.decompression_config(key, dst_sizes)
                self._count("config_hits" if hit else "config_misses")
                res = codec.decode(src, out=dst, decompression_config=cfg)
            else:  # "src"
                res = codec.decode(src, out=dst, decompression_config=codec.decompression_config(src))
            sizes_out = list(res.buffer_sizes) if want_sizes else None  # waits for the decode
        except BaseException as e:
            failure = take_allocation_failure()
            if failure is not None:
                raise failure from e  # nvCOMP failed because its scratch could not be allocated
            raise
        failure = take_allocation_failure()
        if failure is not None:  # nvCOMP returned although its allocator failed: never trust the output
            raise failure
        self._count("decodes")
        return sizes_out

    def encode_device(self, data: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, *,
                      stream: torch.cuda.Stream | None = None) -> DeviceBatch:
        """Compress cells of a CUDA buffer; returns the blobs at 16-aligned offsets of a new tensor.

        GPU-encoded zstd frames are valid standard frames (``zstandard`` reads them) but not the
        same bytes ``zstandard`` writes. Waits for the encode (the compressed sizes are needed
        on the host). Not a sample path: fine to call per batch of writes.

        Args:
            data, offsets, sizes: the raw cells (offsets aligned to the format's encode alignment;
                16 is always safe).
            stream: as in :meth:`decode_device`.

        Returns:
            A :class:`DeviceBatch`; 0-byte cells get the CPU codec's empty frame.
        """
        import torch

        offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
        if offsets.shape != sizes.shape:
            raise ValueError("offsets and sizes must have one entry per cell")
        _check_device_batch(data, offsets, sizes, "data", self.device, self._spec, encode=True)
        n = int(sizes.size)
        nz = np.flatnonzero(sizes > 0)
        csz = np.zeros(n, dtype=np.int64)
        empty = empty_frame(self.format)
        csz[sizes == 0] = len(empty)
        with self._on(stream, data) as on:
            tmp = None
            tmp_off = np.zeros(0, np.int64)
            if nz.size:
                tmp, tmp_off, got = self._encode_nonzero(self._entry(on, int(sizes.max()), encode=True), data,
                                                         offsets[nz], sizes[nz])
                csz[nz] = got
            out_off = exclusive_cumsum(align(csz))
            out = torch.zeros(int(align(csz).sum()), dtype=torch.uint8, device=self.device)
            if nz.size:
                copy_blobs(tmp, tmp_off, out, out_off[nz], csz[nz])
            zero = np.flatnonzero(sizes == 0)
            if zero.size:
                e = torch.frombuffer(bytearray(empty), dtype=torch.uint8).to(self.device)
                copy_blobs(e, np.zeros(zero.size, np.int64), out, out_off[zero],
                           np.full(zero.size, len(empty), np.int64))
        if stream is None or int(stream.cuda_stream) == 0:
            # allocated on this thread's side stream, read by the caller on its current stream
            out.record_stream(torch.cuda.current_stream(self.device))
        return DeviceBatch(out, out_off, csz)

    def _encode_nonzero(self, entry: _Entry, data: torch.Tensor, offsets: np.ndarray,
                        sizes: np.ndarray) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        import torch

        nv = self._nv
        codec = entry.codec
        ptr = entry.stream_ptr
        bounds_by_size = self._local.__dict__.setdefault("bounds", {})
        uniq, first = np.unique(sizes, return_index=True)
        for s, i in zip(uniq.tolist(), first.tolist(), strict=True):  # one query per distinct size
            if s not in bounds_by_size:
                o = int(offsets[i])
                bounds_by_size[s] = int(codec.get_max_comp_buffer_size(nv.as_array(data[o:o + s],
                                                                                     cuda_stream=ptr)))
        bounds = np.array([bounds_by_size[s] for s in uniq.tolist()], np.int64)[np.searchsorted(uniq, sizes)]
        src = nv.as_arrays(data, offsets.tolist(), sizes.tolist(), cuda_stream=ptr)
        cfg = codec.compression_config(sizes.tolist())
        slot_off = exclusive_cumsum(align(bounds))
        tmp = torch.empty(int(align(bounds).sum()), dtype=torch.uint8, device=self.device)
        try:
            dst = nv.as_arrays(tmp, slot_off.tolist(), bounds.tolist(), cuda_stream=ptr)
            res = codec.encode(src, out=dst, compression_config=cfg)
            got = np.asarray(res.buffer_sizes, dtype=np.int64)
            # An API that reported capacities instead of compressed sizes would return the bounds.
            plausible = got.shape == sizes.shape and (got > 0).all() and (got <= bounds).all()
            if plausible and (got < bounds).any():
                self.last_encode_path = "out"
                return tmp, slot_off, got
        except (TypeError, ValueError, RuntimeError):
            pass
        # Fallback: nvCOMP allocates each output; one copy per blob (encode is not a sample path).
        res = codec.encode(src, compression_config=cfg)
        got = np.asarray(res.buffer_sizes, dtype=np.int64)
        slot_off = exclusive_cumsum(align(got))
        tmp = torch.empty(int(align(got).sum()), dtype=torch.uint8, device=self.device)
        for k in range(len(res)):  # BatchArray: len() and indexing (indexing waits for the encode)
            part = torch.from_dlpack(res[k]).reshape(-1).view(torch.uint8)
            tmp[int(slot_off[k]):int(slot_off[k]) + int(got[k])].copy_(part[: int(got[k])])
        torch.cuda.current_stream(self.device).synchronize()  # `res` owns the sources of those copies
        self.last_encode_path = "loop"
        return tmp, slot_off, got

    # -- Codec contract on host buffers ---------------------------------------------------------

    def encode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> EncodedBatch:
        """Compress host cells on the GPU (one H2D, one nvCOMP call, one D2H); see the Codec contract."""
        import torch

        data, offsets, sizes = as_batch(data, offsets, sizes)
        if sizes.size == 0:
            return EncodedBatch.empty()
        a_off = exclusive_cumsum(align(sizes))
        host = np.zeros(max(int(align(sizes).sum()), ALIGNMENT), dtype=np.uint8)
        copy_host_blobs(data, offsets, host, a_off, sizes)
        dev = torch.from_numpy(host).to(self.device)
        batch = self.encode_device(dev, a_off, sizes)
        return batch.to_host()

    def decode(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, out: np.ndarray,
               out_offsets: np.ndarray, out_sizes: np.ndarray) -> None:
        """Decompress host blobs on the GPU into ``out`` (one H2D, one nvCOMP call, one D2H).

        Raises:
            CorruptionError: a 0-byte entry is not the empty frame, a zstd frame declares
                another size than expected, nvCOMP reports an error, or a blob decodes to
                another size; the message names the blob.
        """
        import torch

        data, offsets, sizes = as_batch(data, offsets, sizes)
        out, out_offsets, out_sizes = check_out(out, out_offsets, out_sizes, sizes.size)
        n = sizes.size
        if n == 0:
            return
        _check_headers(self.format, data, offsets, sizes, out_sizes)
        nz = np.flatnonzero(out_sizes > 0)
        if nz.size == 0:
            return
        offsets, sizes, out_offsets_nz, out_sizes_nz = offsets[nz], sizes[nz], out_offsets[nz], out_sizes[nz]
        a_off = exclusive_cumsum(align(sizes))
        host = np.zeros(int(align(sizes).sum()), dtype=np.uint8)
        copy_host_blobs(data, offsets, host, a_off, sizes)
        o_off = exclusive_cumsum(align(out_sizes_nz))
        dev_in = torch.from_numpy(host).to(self.device)
        dev_out = torch.empty(int(align(out_sizes_nz).sum()), dtype=torch.uint8, device=self.device)
        mode, _ = self._mode(out_sizes_nz, None)
        try:
            with self._on(None, dev_in, dev_out) as on:
                got = self._decode(on, dev_in, a_off, sizes, dev_out, o_off, out_sizes_nz,
                                   mode=mode, cap=None, want_sizes=True)
        except (RuntimeError, ValueError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise CorruptionError(
                f"nvCOMP could not decode this batch of {nz.size} {self.format} blobs ({e}); their bytes or "
                "the blob index are damaged: run `tiered verify`") from e
        got_a = np.asarray(got, dtype=np.int64)
        if got_a.shape != out_sizes_nz.shape:
            raise CorruptionError(f"nvCOMP returned {got_a.size} sizes for {out_sizes_nz.size} blobs")
        bad = np.flatnonzero(got_a != out_sizes_nz)
        if bad.size:
            i = int(nz[bad[0]])
            raise CorruptionError(
                f"{self.format} blob {i} of this batch decoded to {int(got_a[bad[0]])} bytes on the GPU, "
                f"expected {int(out_sizes[i])}; its bytes or the blob index are damaged: run `tiered verify`")
        host_out = dev_out.cpu().numpy()
        copy_host_blobs(host_out, o_off, out, out_offsets_nz, out_sizes_nz)


# ---------------------------------------------------------------------------------------------
# The one-time probe of the decode modes
# ---------------------------------------------------------------------------------------------


def _probe_cells(codec: NvcompCodec, sizes: list[int], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """CPU-written frames of cells of ``sizes``: (host buffer, offsets, sizes, the raw bytes)."""
    rng = np.random.default_rng(seed)
    cells = []
    for s in sizes:
        # Flat runs with sparse noise: compresses like a game frame, exercises real sequences.
        base = np.repeat(rng.integers(0, 8, s // 64 + 1, dtype=np.uint8) * 30, 64)[:s]
        noise = rng.random(s) < 0.02
        base[noise] = rng.integers(0, 256, int(noise.sum()), dtype=np.uint8)
        cells.append(base.tobytes())
    frames = [_cpu_compress(codec.format, c) for c in cells]
    csz = np.array([len(f) for f in frames], dtype=np.int64)
    coff = exclusive_cumsum(align(csz))
    host = np.zeros(int(align(csz).sum()), dtype=np.uint8)
    for f, o in zip(frames, coff.tolist(), strict=True):  # probe only: a few frames
        host[o:o + len(f)] = np.frombuffer(f, np.uint8)
    return host, coff, csz, b"".join(cells)


def _probe_decode(codec: NvcompCodec, side: Any, sizes: list[int], seed: int, mode: str,
                  cap: int | None) -> bool:
    """Decode CPU-written frames of ``sizes`` in ``mode`` and compare every byte."""
    import torch

    host, coff, csz, want = _probe_cells(codec, sizes, seed)
    osz = np.asarray(sizes, dtype=np.int64)
    with torch.cuda.stream(side):
        src = torch.from_numpy(host).to(codec.device)
        if cap is None:
            ooff = exclusive_cumsum(align(osz))
            out = torch.zeros(int(align(osz).sum()), dtype=torch.uint8, device=codec.device)
        else:
            ooff = np.arange(osz.size, dtype=np.int64) * cap
            out = torch.zeros(cap * osz.size, dtype=torch.uint8, device=codec.device)
        codec._decode(side, src, coff, csz, out, ooff, osz, mode=mode, cap=cap)
        side.synchronize()
        got = torch.cat([out[o:o + n] for o, n in zip(ooff.tolist(), sizes, strict=True)]).cpu()
    return bool(np.array_equal(got.numpy(), np.frombuffer(want, np.uint8)))


#: Cells of the probe: all within nvCOMP's default 64 KiB chunk (the sizes of a gray 84x84
#: frame, a stack of 4, odd sizes, exactly one chunk, one byte) ...
PROBE_SIZES = [7056, 28224, 1000, 4099, BASE_CHUNK, 1]
#: ... and cells above it (an RGB 210x160 frame), decoded by a Codec whose chunk size fits them.
PROBE_LARGE_SIZES = [100800, 7056]


def _find_decode_modes(codec: NvcompCodec) -> dict[str, Any]:
    """Decode CPU-written frames in each config mode and compare the bytes (see NvcompCodec.probe)."""
    errors: list[str] = []
    result: dict[str, Any] = {"exact": None, "capacity": False, "large": False, "large_capacity": False,
                              "errors": errors, "oom": False, "sizes": PROBE_SIZES,
                              "large_sizes": PROBE_LARGE_SIZES}
    side = codec._side_stream()

    def attempt(what: str, sizes: list[int], mode: str, cap: int | None) -> bool:
        try:
            if _probe_decode(codec, side, sizes, 7, mode, cap):
                return True
            errors.append(f"{what}: decoded bytes differ")
        except Exception as e:  # a probe records why a mode fails, then tries the next
            errors.append(f"{what}: {type(e).__name__}: {e}")
            if is_out_of_memory(e):
                result["oom"] = True
            else:
                # a mode that ends the CUDA context must not pass for "decode on the CPU"
                check_device(codec.device, f"nvCOMP's probe ({what})")
        return False

    for mode in ("cc", "src"):
        if attempt(f"exact/{mode}", PROBE_SIZES, mode, None):
            result["exact"] = mode
            break
    if result["exact"] is not None:
        # a capacity above every cell, still within the 64 KiB chunk (as for the decoder's buckets)
        small = [n for n in PROBE_SIZES if n < BASE_CHUNK // 2]
        result["capacity"] = attempt("capacity", small, "cc", int(align(max(small) + 1)))
        result["large"] = attempt(f"large/{result['exact']}", PROBE_LARGE_SIZES, result["exact"], None)
        if result["capacity"] and result["large"]:
            result["large_capacity"] = attempt("large/capacity", PROBE_LARGE_SIZES, "cc",
                                               int(align(max(PROBE_LARGE_SIZES) + 1)))
    codec._count("probes")
    return result


def probe_is_final(result: dict[str, Any]) -> bool:
    """Whether a probe result may be kept for the process: everything passed, or what failed did
    not fail for lack of memory (an out-of-memory failure says nothing about nvCOMP: probe again).

    Example:
        >>> probe_is_final({"exact": "cc", "capacity": True, "large": True, "large_capacity": True, "oom": True})
        True
        >>> probe_is_final({"exact": None, "capacity": False, "large": False, "oom": True})
        False
    """
    passed = result.get("exact") is not None and all(result.get(k) for k in ("capacity", "large", "large_capacity"))
    return bool(passed or not result.get("oom"))


class RetryGate:
    """When to try again what failed for a passing reason: after 1, 2, 4, ... refusals, at most ``cap``.

    :class:`ProbeResults` keeps one per probe key, so a probe spoiled by a lack of memory is
    not run again (eight decodes and their syncs) before every batch that falls back.

    Example:
        >>> gate = RetryGate(cap=4)
        >>> gate.failed()
        >>> [gate.ready() for _ in range(3)]
        [False, True, True]
        >>> gate.failed(); gate.failed(); [gate.ready() for _ in range(5)]
        [False, False, False, False, True]
    """

    def __init__(self, cap: int = 256) -> None:
        self.cap = max(1, int(cap))
        self._wait = 0
        self._left = 0

    def ready(self) -> bool:
        """Whether to try now (each refusal counts toward the next try)."""
        if self._left > 0:
            self._left -= 1
            return False
        return True

    def failed(self) -> None:
        """The try failed again: wait twice as long (up to ``cap``) before the next."""
        self._wait = min(max(1, 2 * self._wait), self.cap)
        self._left = self._wait

    def succeeded(self) -> None:
        self._wait = self._left = 0


class ProbeResults:
    """Probe results, found once per key (format, device, execution policy) and shared by every
    codec object of the process.

    A result spoiled by an out-of-memory error (:func:`probe_is_final`) is not kept for good:
    it is returned as is while its :class:`RetryGate` refuses (1, 2, 4, ... up to 256 calls),
    then the probe runs again.

    Example:
        >>> spoiled = {"exact": None, "capacity": False, "large": False, "oom": True}
        >>> runs = []
        >>> probes = ProbeResults()
        >>> for _ in range(4):
        ...     _ = probes.result(("zstd", 0, "concurrency"), lambda: runs.append(1) or dict(spoiled))
        >>> len(runs)   # probed on calls 1 and 3
        2
    """

    def __init__(self, cap: int = 256) -> None:
        self._results: dict[Any, dict[str, Any]] = {}
        self._spoiled: dict[Any, dict[str, Any]] = {}
        self._gates: dict[Any, RetryGate] = {}
        self._cap = cap
        self._lock = threading.Lock()

    def result(self, key: Any, find: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The kept result for ``key``, else ``find()``'s (when the retry gate lets it run)."""
        with self._lock:
            if key in self._results:
                return self._results[key]
            gate = self._gates.setdefault(key, RetryGate(self._cap))
            if key in self._spoiled and not gate.ready():
                return self._spoiled[key]
            found = find()
            found["cached"] = probe_is_final(found)
            if found["cached"]:
                self._results[key] = found
                self._spoiled.pop(key, None)
                gate.succeeded()
            else:
                self._spoiled[key] = found
                gate.failed()
            return found


_PROBES = ProbeResults()


def check_device(device: Any, what: str) -> None:
    """Raise :class:`~tiered.errors.DeviceFailedError` when ``device``'s CUDA context is dead.

    Called after a CUDA or nvCOMP call failed with anything but out-of-memory: a sticky error
    (an illegal address) fails every later call, including this small synchronizing one.
    Nothing happens on a CPU device.

    Example:
        >>> import torch
        >>> check_device(torch.device("cpu"), "a decode")
    """
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return
    try:
        torch.cuda.synchronize(dev)
        torch.ones(1, device=dev).add_(1).cpu()
    except RuntimeError as e:
        raise DeviceFailedError(
            f"{what} failed and left CUDA unusable in this process ({type(e).__name__}: {e}); no data "
            "can be returned on the GPU any more: restart the process, or pass gpu_decode=False "
            "to decode on the CPU") from e


def codec_factory(arg: str | None) -> NvcompCodec:
    """Registry factory: ``"nvcomp"`` -> zstd, ``"nvcomp:lz4"``, ``"nvcomp:deflate"``.

    :func:`tiered.codecs.get_codec` finds it here when it first meets an ``"nvcomp..."`` spec
    (the module does not register itself on import, so importing it changes no global state).
    The argument is checked before nvCOMP is imported, so a typo gives UnknownCodecError on any
    machine.
    """
    fmt = "zstd" if arg is None or not arg.strip() else arg.strip().lower()
    if fmt not in _FORMATS:
        raise UnknownCodecError(
            f"unknown nvCOMP format {arg!r}; write 'nvcomp' (zstd), 'nvcomp:zstd', 'nvcomp:lz4' "
            "or 'nvcomp:deflate'")
    return NvcompCodec(fmt)

