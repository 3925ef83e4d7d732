"""Prepare the next sample while the caller trains on this one.

:class:`Prefetcher` runs ``indices = sampler_fn()`` and ``store.get(indices)`` (index lookups,
tier gathers, copies, decode) on a background thread, ``depth`` batches ahead. On a GPU the
worker runs on its own CUDA stream; each batch carries an event recorded after it was
produced, and :meth:`Prefetcher.__next__` makes the consumer's current stream wait on that
event and ties every CUDA tensor of the batch to the consumer stream (``record_stream``), so
the caching allocator never hands their memory to another stream too early. No host
synchronization is added. On a CPU the same code runs without streams: the overlap then
comes from the parts of ``get`` that release the GIL (zstd decode, memcpy, file reads).

Semantics:

* batches come in the order the sampler produced them, bit-exact what ``store.get`` returns;
  at most ``depth`` batches exist ahead of the consumer (they may predate the latest
  ``extend``: prefetching trades freshness for overlap);
* an exception raised by ``sampler_fn`` or ``get`` is re-raised by the next ``next()`` (the
  same exception object, with the worker's traceback); the worker then stops. A
  ``StopIteration`` from ``sampler_fn`` ends the iteration;
* :meth:`Prefetcher.close` (also on ``with`` exit and garbage collection) stops and joins the
  worker, even when it is blocked waiting for the consumer.

Example:
    >>> import numpy as np, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> store = TieredStore(100)
    >>> _ = store.extend(TensorDict({"x": torch.arange(100.0)}, batch_size=[100]))
    >>> rng = np.random.default_rng(0)
    >>> with Prefetcher(store, lambda: rng.integers(0, 100, 8), depth=2) as pf:
    ...     idx, batch = next(pf)
    ...     bool((batch["x"] == torch.from_numpy(idx).float()).all())
    True
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Prefetcher"]

# How often a blocked worker or consumer re-checks for shutdown (seconds).
_POLL_S = 0.05


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class _Shared:
    """What the worker thread uses. It holds no reference to the Prefetcher, so an abandoned
    Prefetcher is garbage-collected and its ``__del__`` stops the worker."""

    def __init__(self, store: Any, sampler: Callable[[], Any], keys: list | None,
                 device: torch.device | None, cuda_device: torch.device | None, depth: int) -> None:
        self.store = store
        self.sampler = sampler
        self.keys = keys
        self.device = device
        self.cuda_device = cuda_device
        # `slots` bounds the batches in flight (queued or being built) to `depth`.
        self.slots = threading.Semaphore(depth)
        self.queue: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.produce_s = 0.0


def _worker(sh: _Shared) -> None:
    dev = sh.cuda_device
    stream = torch.cuda.Stream(dev) if dev is not None else None
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        while not sh.stop.is_set():
            if not sh.slots.acquire(timeout=_POLL_S):
                continue  # no slot yet: check for shutdown, then wait again
            t0 = time.perf_counter()
            try:
                indices = sh.sampler()
                batch = sh.store.get(indices) if sh.keys is None else sh.store.get(indices, keys=sh.keys)
                if sh.device is not None and batch.device != sh.device:
                    if sh.device.type == "cuda" and batch.device in (None, torch.device("cpu")):
                        batch = batch.pin_memory()  # a truly asynchronous copy needs pinned memory
                    batch = batch.to(sh.device, non_blocking=True)
                event = None
                if stream is not None:
                    # recorded after every kernel of this batch: the consumer waits on it
                    event = torch.cuda.Event()
                    event.record(stream)
            except StopIteration:
                sh.queue.put(_END)
                return
            except BaseException as e:  # re-raised on the consumer thread
                sh.queue.put(_Failure(e))
                return
            sh.produce_s += time.perf_counter() - t0
            sh.queue.put((indices, batch, event))


class Prefetcher(Iterator):
    """Background producer of ``(indices, store.get(indices))`` batches.

    Args:
        store: a :class:`~tiered.store.TieredStore` (or anything with ``get(indices, keys=...)``).
        sampler_fn: called with no argument on the worker thread; returns the row indices of
            the next batch (raise ``StopIteration`` to end).
        depth: batches prepared ahead of the consumer (>= 1).
        keys: passed to ``store.get`` (only these fields are read and decoded).
        device: move each batch there on the worker (pinned staging, non-blocking copy) when
            ``get`` returns it elsewhere, e.g. a CPU-decoding store feeding a GPU learner.
        name: the worker thread's name.

    Example:
        >>> import numpy as np, torch
        >>> from tensordict import TensorDict
        >>> from tiered import TieredStore
        >>> store = TieredStore(10)
        >>> _ = store.extend(TensorDict({"x": torch.arange(10)}, batch_size=[10]))
        >>> batches = iter([np.array([1, 2]), np.array([3])])
        >>> pf = Prefetcher(store, lambda: next(batches))
        >>> [b["x"].tolist() for _, b in pf]
        [[1, 2], [3]]
        >>> pf.close()
    """

    def __init__(self, store: Any, sampler_fn: Callable[[], Any], depth: int = 1, *,
                 keys: list | None = None, device: str | torch.device | None = None,
                 name: str = "tiered-prefetch") -> None:
        self._finished = True  # until the worker starts (keeps close()/__del__ safe)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        if not callable(sampler_fn):
            raise TypeError(f"sampler_fn must be callable, got {type(sampler_fn).__name__}")
        self.depth = depth
        dev = torch.device(device) if device is not None else None
        self._sh = _Shared(store, sampler_fn, keys, dev, _cuda_device_of(dev, store), depth)
        self._stats = {"batches": 0, "consumer_wait_s": 0.0}
        self._thread = threading.Thread(target=_worker, args=(self._sh,), name=name, daemon=True)
        self._sh_open = self._sh  # dropped by close(): a second close (or __del__) does nothing
        self._finished = False
        self._thread.start()

    # -- consumer -----------------------------------------------------------------------------

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[Any, Any]:
        """The next ``(indices, batch)``; the batch is ready to use on the current CUDA stream."""
        if self._finished:
            raise StopIteration
        sh = self._sh
        t0 = time.perf_counter()
        while True:
            try:
                item = sh.queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and sh.queue.empty():
                    self._finished = True
                    raise StopIteration from None
        self._stats["consumer_wait_s"] += time.perf_counter() - t0
        if item is _END:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            self._thread.join()
            raise item.error
        sh.slots.release()
        indices, batch, event = item
        if event is not None:
            cur = torch.cuda.current_stream(sh.cuda_device)
            cur.wait_event(event)  # GPU-side ordering: no host sync
            _record_stream(batch, cur)
        self._stats["batches"] += 1
        return indices, batch

    def stats(self) -> dict[str, float]:
        """``batches`` delivered, seconds the consumer waited, seconds the worker spent producing."""
        return {**self._stats, "produce_s": self._sh.produce_s}

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the worker and wait for it (idempotent). Batches not yet consumed are dropped."""
        sh = self.__dict__.pop("_sh_open", None)
        self._finished = True
        if sh is None:
            return
        sh.stop.set()
        sh.slots.release()  # unblock a worker waiting for a slot
        with contextlib.suppress(queue.Empty):
            while True:
                sh.queue.get_nowait()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the worker thread is still running."""
        return self._thread.is_alive()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self.__dict__.get("_sh_open") is not None:
            with contextlib.suppress(Exception):
                self.close(timeout=1.0)


def _cuda_device_of(device: torch.device | None, store: Any) -> torch.device | None:
    """The CUDA device whose streams order the batches (None: no CUDA work to order)."""
    if not torch.cuda.is_available():
        return None
    for dev in (device, getattr(store, "device", None)):
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    return None


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    tensors = batch.values(include_nested=True, leaves_only=True) if hasattr(batch, "values") else \
        (batch if isinstance(batch, (list, tuple)) else [batch])
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)
