"""The read pipeline: rows -> blob ids -> gather compressed bytes per tier -> verify -> decode -> assemble.

:class:`ReadPipeline` is the interface, with the steps every implementation shares (turning rows
into unique blob ids, serving staged rows, assembling cells from decoded frames, describing
damage). :class:`CpuReadPipeline` decodes with the CPU codecs (multi-threaded zstd); the GPU
pipeline (:class:`tiered.engine.gpu_read.GpuReadPipeline`) is its sibling and decodes with nvCOMP.

Neither path loops over rows or blobs in Python: per call there is one gather per field, one
``np.unique``, one batched read per tier, one checksum call and one batched decode per family.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> store = TieredStore(16, frames={"obs": 0})
    >>> td = TensorDict({"obs": torch.randint(0, 4, (8, 4, 16, 16), dtype=torch.uint8)}, [8])
    >>> _ = store.extend(td)
    >>> bool((store.get([2, 7])["obs"] == td["obs"][[2, 7]]).all())   # CpuReadPipeline
    True
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from .. import codecs
from ..codecs.checked import decode_cells_checked, decode_checked
from ..errors import ChecksumError
from ..schema import Field, Key, as_bits
from ..util.batch import exclusive_cumsum
from ..util.pool import run_parallel
from ..util.scratch import ScratchBuffers
from .blob_index import FREE, OPEN, STORED, BlobIndex
from .frames import FrameFamily
from .layout import FieldLayout
from .placement import TIER_NAMES, Placement
from .rows import RowSpace, index_shape
from .stage import WriteStage

if TYPE_CHECKING:
    from .write import WritePath

__all__ = ["ReadPipeline", "CpuReadPipeline", "GatheredBlobs", "describe_bad_blobs", "as_tensordict", "contiguous_span",
           "codec_for", "decode_gathered", "blob_frames", "assemble_cells", "cell_cuts", "ReadPlan", "plan_key",
           "MIN_GATHER_SPLIT_BYTES"]


def contiguous_span(index: Any, rows: np.ndarray) -> tuple[int, int] | None:
    """``(start, n)`` when ``index`` is a step-1 slice (its dense cells can be views), else None.

    TorchRL's ``TensorStorage`` returns views for ``storage[:]``, and its SliceSampler reads
    ``storage[:]`` on every sample: a copy there would grow with the buffer.
    """
    n = rows.size
    if isinstance(index, slice) and n and rows[-1] - rows[0] == n - 1:
        return int(rows[0]), n
    return None


# TensorDict's unchecked constructor, when this tensordict has it: a read builds every leaf
# itself (batch dimension and device known), so the per-leaf validation of the public
# constructor (~15 Python calls a leaf) checks nothing; older or newer tensordicts without it
# take the public constructor.
_UNCHECKED_TD = getattr(TensorDict, "_new_unsafe", None)


def _make_td(source: dict[str, Any], batch_size: torch.Size) -> TensorDict:
    if _UNCHECKED_TD is not None:
        return _UNCHECKED_TD(source, batch_size=batch_size)
    return TensorDict(source, batch_size=batch_size)


class ReadPlan:
    """What a read of some keys of one schema does, worked out once (per schema and keys), not
    per call: the fields, the dense ones, the blob ones by family, and the nesting of the result.

    Args:
        schema: the store's schema.
        fields: the fields read (``schema.select(keys)``).
        by_family: the blob fields among them per frame family (``FieldLayout.by_family``).

    Example:
        >>> from tiered.schema import Schema, Field
        >>> s = Schema([Field(("next", "x"), torch.float32, (), "dense"), Field(("y",), torch.float32, (), "dense")])
        >>> plan = ReadPlan(s, s.select(None), {})
        >>> [f.key for f in plan.dense], plan.levels
        ([('next', 'x'), ('y',)], [(('next',), ['x']), ((), ['next', 'y'])])
    """

    def __init__(self, schema: Any, fields: list[Field], by_family: dict[int, list[Field]]) -> None:
        self.schema = schema
        self.fields = fields
        self.dense = [f for f in fields if f.kind == "dense"]
        self.by_family = by_family
        # the result's key order, as a get has always built it (and compressed transport's
        # decode_rows does): the dense fields in schema order, then the blob fields by family
        order = self.dense + [f for fs in by_family.values() for f in fs]
        names: dict[Key, list[str]] = {(): []}
        for f in order:  # once per plan: the names at each nesting level, in that order
            for depth in range(len(f.key)):
                level = names.setdefault(f.key[:depth], [])
                if f.key[depth] not in level:
                    level.append(f.key[depth])
        #: ``(prefix, names)`` per nesting level, deepest first (children are built before parents)
        self.levels = sorted(names.items(), key=lambda kv: -len(kv[0]))
        self.leaves = [(f.key[:-1], f.key[-1], f.key) for f in order]

    def assemble(self, cells: dict[Key, torch.Tensor], n: int) -> TensorDict:
        """The ``[n]`` TensorDict of ``cells`` (every field of the plan), nested as the keys are,
        dense fields first: one constructor call per nesting level."""
        batch = torch.Size([n])
        levels = {prefix: dict.fromkeys(names) for prefix, names in self.levels}
        for prefix, name, key in self.leaves:
            levels[prefix][name] = cells[key]
        for prefix, _ in self.levels[:-1]:  # nested levels, deepest first
            levels[prefix[:-1]][prefix[-1]] = _make_td(levels[prefix], batch)
        return _make_td(levels[()], batch)


def plan_key(keys: Any) -> Any:
    """A hashable form of ``keys`` to look a :class:`ReadPlan` up by (None for unhashable ones).

    Example:
        >>> plan_key(None), plan_key("obs"), plan_key([("next", "obs"), "done"])
        (('all',), ('key', 'obs'), ('keys', ('next', 'obs'), 'done'))
    """
    if keys is None:
        return ("all",)
    if isinstance(keys, str) or (isinstance(keys, tuple) and all(isinstance(k, str) for k in keys)):
        return ("key", keys)
    try:
        return ("keys", *(k if isinstance(k, str) else tuple(k) for k in keys))
    except TypeError:
        return None


def as_tensordict(cells: dict[Key, torch.Tensor], rows: np.ndarray, index_key: str | None,
                  device: torch.device, plan: ReadPlan | None = None) -> TensorDict:
    """The ``[len(rows)]`` TensorDict a read returns (with the row positions under ``index_key``)."""
    if plan is not None:
        td = plan.assemble(cells, rows.size)
    else:
        td = TensorDict({}, batch_size=[rows.size])
        for k, v in cells.items():
            td.set(k, v)
    if index_key is not None:
        td.set(index_key, torch.from_numpy(rows))
    if device.type != "cpu":
        td = td.to(device, non_blocking=True)
    return td


def describe_bad_blobs(layout: FieldLayout, index: BlobIndex, bad_ids: np.ndarray,
                       stale: tuple[int, int] | None = None) -> str:
    """The message of a :class:`~tiered.errors.ChecksumError`: which blobs, where, used by which rows.

    Args:
        stale: ``(opened_generation, newer_generation)`` when a read-only store is two or more
            commits behind its writer (the writer reused the space: the files are not damaged).
    """
    lines = []
    for b, used_by in zip(bad_ids[:5], layout.rows_using(bad_ids), strict=False):
        where = ", ".join(f"{TIER_NAMES[t]} offset {int(index.loc[b, t])}" for t in range(3) if index.loc[b, t] >= 0)
        lines.append(f"  blob {int(b)} ({where}; used by {used_by})")
    if stale is not None:
        opened, newer = stale
        # a read-only open outlived its commit: the writer reused the space of blobs only that
        # commit still used, so the bytes are not damaged, they are someone else's
        return (f"{bad_ids.size} blob(s) failed their checksum:\n" + "\n".join(lines)
                + f"\nThis store was opened read-only at commit {opened}; a writer has since "
                f"committed generation {newer} and reused the space of blobs that only older commits "
                "used. The files are most likely not damaged: reopen the store (tiered.open(path)) to "
                "read the latest commit, and run `tiered verify` if the error stays after that.")
    return (f"{bad_ids.size} blob(s) failed their checksum (stored bytes are damaged):\n" + "\n".join(lines)
            + "\nOther rows are still readable. Run `tiered verify` on the store to list all damage.")


@dataclass
class GatheredBlobs:
    """The bytes of one frame family's blobs for one read, before decoding: what a shard ships
    to a learner in compressed transport, and what :meth:`CpuReadPipeline.decode_blobs` decodes.

    Attributes:
        n_blobs: the read's unique blobs (decoded, they fill ``[n_blobs, chunk_frames, frame_nbytes]``).
        ids: blob ids of the stored (compressed) ones; ``pos``: their positions among the ``n_blobs``.
        comp, offsets, sizes: their compressed bytes back to back, where each starts, its size.
        raw_nbytes, checksums, formats: per stored blob, its decoded size, checksum and codec format id.
        open_pos, open_raw: positions of open time chunks (raw in memory) and their raw frames.
    """

    n_blobs: int
    chunk_frames: int
    frame_nbytes: int
    ids: np.ndarray
    pos: np.ndarray
    comp: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    raw_nbytes: np.ndarray
    checksums: np.ndarray
    formats: np.ndarray
    open_pos: np.ndarray
    open_raw: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of every array held (what crossing a process boundary costs)."""
        arrays = (self.ids, self.pos, self.comp, self.offsets, self.sizes, self.raw_nbytes, self.checksums,
                  self.formats, self.open_pos, self.open_raw)
        return sum(int(a.nbytes) for a in arrays)

    def compact(self) -> GatheredBlobs:
        """The same blobs with narrower tables, to send elsewhere: positions and sizes as int32
        (a blob holds less than 2 GiB), offsets left out when the blobs lie back to back."""
        i32 = np.int32
        packed = self.offsets.size == self.sizes.size and np.array_equal(self.offsets, exclusive_cumsum(self.sizes))
        return GatheredBlobs(
            n_blobs=self.n_blobs, chunk_frames=self.chunk_frames, frame_nbytes=self.frame_nbytes, ids=self.ids,
            pos=self.pos.astype(i32), comp=self.comp, offsets=np.empty(0, np.int64) if packed else self.offsets,
            sizes=self.sizes.astype(i32), raw_nbytes=self.raw_nbytes.astype(i32), checksums=self.checksums,
            formats=self.formats, open_pos=self.open_pos.astype(i32), open_raw=self.open_raw)

    def sealed(self, codec: codecs.Codec) -> GatheredBlobs:
        """The same blobs with the open time chunks compressed too (one batched encode), so that
        no raw frames are sent; they get blob id -1 and a checksum like the others."""
        k = int(self.open_pos.size)
        if k == 0:
            return self
        codec = codec_for(codec, self.formats[:1])  # the family's own codec (raw when it stores raw)
        row_bytes = self.chunk_frames * self.frame_nbytes
        enc = codec.encode(np.ascontiguousarray(self.open_raw).reshape(-1),
                           np.arange(k, dtype=np.int64) * row_bytes, np.full(k, row_bytes, dtype=np.int64))
        offsets = self.offsets if self.offsets.size == self.sizes.size else exclusive_cumsum(self.sizes)
        return GatheredBlobs(
            n_blobs=self.n_blobs, chunk_frames=self.chunk_frames, frame_nbytes=self.frame_nbytes,
            ids=np.concatenate([self.ids, np.full(k, -1, dtype=self.ids.dtype)]),
            pos=np.concatenate([self.pos, self.open_pos]), comp=np.concatenate([self.comp, enc.data]),
            offsets=np.concatenate([offsets, self.comp.size + enc.offsets]),
            sizes=np.concatenate([self.sizes, enc.sizes]),
            raw_nbytes=np.concatenate([self.raw_nbytes, np.full(k, row_bytes, dtype=self.raw_nbytes.dtype)]),
            checksums=np.concatenate([self.checksums, enc.checksums.astype(self.checksums.dtype)]),
            formats=np.concatenate([self.formats, np.full(k, codec.format_id, dtype=self.formats.dtype)]),
            open_pos=self.open_pos[:0], open_raw=self.open_raw[:0])


def codec_for(default: codecs.Codec, format_ids: np.ndarray) -> codecs.Codec:
    """The codec that decodes blobs of these format ids (all must be one format): ``default``
    when it reads their format."""
    fmt = int(format_ids[0]) if format_ids.size else default.format_id
    same = bool(np.logical_and.reduce(format_ids == fmt))  # (a ufunc reduction: no Python wrapper)
    if fmt == default.format_id and same:
        return default
    if not same:
        raise NotImplementedError("blobs of several codecs in one batch are not supported yet")
    return codecs.codec_for_format_id(fmt)


def decode_gathered(g: GatheredBlobs, dst: np.ndarray, codec: codecs.Codec, *, verify: bool) -> np.ndarray:
    """Decode gathered blobs into ``dst`` (uint8, at least ``n_blobs * chunk_frames * frame_nbytes``):
    one batched decode for the stored blobs (checked first when ``verify``, on the decode
    threads: :func:`tiered.codecs.checked.decode_checked`), one copy for the open ones.

    Returns:
        The positions (into ``g.ids``) of blobs whose checksum failed when ``verify`` (then
        ``dst`` holds no meaningful bytes), else an empty array.
    """
    row_bytes = g.chunk_frames * g.frame_nbytes
    sizes = g.sizes.astype(np.int64, copy=False)
    # compact() leaves the offsets out: the blobs lie back to back
    offsets = g.offsets if g.offsets.size == sizes.size else exclusive_cumsum(sizes)
    use = codec_for(codec, g.formats)
    # each decode thread checks the blobs it then decodes (one handoff for both)
    bad = decode_checked(use, g.comp, offsets, sizes, g.checksums if verify else None, dst,
                         np.multiply(g.pos, row_bytes, dtype=np.int64), g.raw_nbytes.astype(np.int64, copy=False),
                         threads=getattr(use, "threads", 1))
    if bad.size == 0 and g.open_pos.size:  # (a read of stored chunks only skips the copy's calls)
        dst[: g.n_blobs * row_bytes].reshape(g.n_blobs, g.chunk_frames, g.frame_nbytes)[g.open_pos] = g.open_raw
    return bad


def blob_frames(layout: FieldLayout, fam: FrameFamily, fields: list[Field],
                rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique blob ids, frame index)`` of ``rows`` over one family's ``fields``: the frame
    index ``[len(rows), frames]`` points into the decoded ``[len(uniq) * chunk_frames]`` frames."""
    blobs, slots = layout.blob_refs(fields, rows)
    # np.unique(return_inverse=True) by hand: one sort, a mask of firsts, a cumsum (np.unique's
    # own wrappers cost ~20 Python-level calls per read)
    flat = blobs.reshape(-1)
    order = flat.argsort(kind="stable")
    ordered = flat[order]
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inv = np.empty(flat.size, dtype=np.int64)
    inv[order] = first.cumsum() - 1
    return ordered[first], inv.reshape(blobs.shape) * fam.chunk_frames + slots


#: Bytes of frames a read gathers into its cells from which the gather is cut into one slice of
#: rows per decode thread (a B=256 sample of Atari stacks with next observations gathers ~14 MB
#: into fresh memory, ~1.5 ms on one thread, where LazyTensorStorage's gather uses torch's two
#: intra-op threads); below it the calling thread gathers alone (a B=64 sample: ~3.6 MB, which
#: was slower split on a quiet 2-core VM: ``bench_storages.py --quick --threads 2``).
MIN_GATHER_SPLIT_BYTES = 8 << 20


def cell_cuts(fields: list[Field]) -> list[tuple[Field, Key, int, int, tuple[int, ...] | None]]:
    """Per field, what :func:`assemble_cells` needs of it, worked out once per read plan: ``(field,
    key, first frame column, end column, cell shape)``; the shape is None where the cells are not
    a plain reshape of the frames (a frame axis other than the first, a dtype other than uint8).

    Example:
        >>> from tiered.schema import Field
        >>> f = Field(("obs",), torch.uint8, (4, 8, 8), "blob", frame_dim=0)
        >>> cell_cuts([f, f])[1][1:]
        (('obs',), 4, 8, (4, 8, 8))
    """
    cuts, col = [], 0
    for f in fields:
        width = f.frames_per_row
        plain = f.dtype == torch.uint8 and f.frame_dim in (None, 0)
        cuts.append((f, f.key, col, col + width, tuple(f.shape) if plain else None))
        col += width
    return cuts


def assemble_cells(fields: list[Field], flat: np.ndarray, frame_idx: np.ndarray, n: int,
                   out: dict[Key, torch.Tensor], *, threads: int = 1,
                   cuts: list[tuple[Field, Key, int, int, tuple[int, ...] | None]] | None = None) -> None:
    """Rebuild ``n`` rows' cells of ``fields`` from decoded frames ``flat`` ``[frames, frame_nbytes]``,
    on up to ``threads`` threads when the gather is large (:data:`MIN_GATHER_SPLIT_BYTES`);
    ``cuts``: :func:`cell_cuts` of ``fields`` when the caller keeps them."""
    cuts = cell_cuts(fields) if cuts is None else cuts
    if threads < 2 or frame_idx.size * flat.shape[1] < MIN_GATHER_SPLIT_BYTES:
        for f, key, a, b, shape in cuts:
            # numpy row gathers run at memcpy speed (torch's uint8 index_select is ~8x slower here)
            cells = torch.from_numpy(flat[frame_idx[:, a:b].reshape(-1)])
            out[key] = cells.reshape(n, *shape) if shape is not None else f.cells_from_frames(cells, n)
        return
    # one gather of every field's frames into one buffer (each field's cells a view of its rows),
    # cut into one slice of rows per thread: np.take(mode="clip") into a preallocated output is as
    # fast as the fancy gather (mode "raise" with an output buffers it) and releases the GIL; the
    # indices are bounded here once, so clipping never changes one
    if int(np.minimum.reduce(frame_idx, axis=None)) < 0 or int(np.maximum.reduce(frame_idx, axis=None)) >= flat.shape[0]:
        raise AssertionError("a frame index past the decoded frames: the row tables are inconsistent")
    # field by field, each one's frames row-major: the order the one-thread gather gives each field
    order = frame_idx.T.reshape(-1) if frame_idx.shape[1] == len(cuts) else np.concatenate(
        [frame_idx[:, a:b].reshape(-1) for _, _, a, b, _ in cuts])
    dst = np.empty((order.size, flat.shape[1]), np.uint8)
    rows = order.size
    run_parallel(_take_rows, [(flat, order[rows * k // threads:rows * (k + 1) // threads],
                               dst[rows * k // threads:rows * (k + 1) // threads]) for k in range(threads)],
                 threads, claim=True)
    frames = torch.from_numpy(dst)
    for f, key, a, b, shape in cuts:
        cells = frames[n * a:n * b]  # (field by field: a field's frames start at n times its first column)
        out[key] = cells.reshape(n, *shape) if shape is not None else f.cells_from_frames(cells, n)


def _take_rows(src: np.ndarray, idx: np.ndarray, dst: np.ndarray) -> None:
    np.take(src, idx, axis=0, out=dst, mode="clip")


class ReadPipeline(ABC):
    """Decodes the blob fields of rows (see the module docstring).

    Args:
        index: the blob index.
        placement: the tiers and the policy's bookkeeping of reads.
        counters: the store's counters (``blobs_decoded`` is incremented here).
        stale: gives ``(opened, newer)`` generations when a read-only store fell behind its
            writer, else None (used only to word checksum errors).
    """

    def __init__(self, index: BlobIndex, placement: Placement, counters: dict[str, int],
                 stale: Callable[[], tuple[int, int] | None] | None = None) -> None:
        self.index = index
        self.placement = placement
        self.counters = counters
        self.stale = stale or (lambda: None)
        self._plans: dict[Any, ReadPlan] = {}

    def plan(self, layout: FieldLayout, keys: Any) -> ReadPlan:
        """The :class:`ReadPlan` of ``keys`` over ``layout``, made once per layout and keys.

        Raises:
            SchemaMismatchError: a key that names no field.
        """
        hkey = plan_key(keys)
        plan = self._plans.get(hkey) if hkey is not None else None
        if plan is None or plan.schema is not layout.schema:
            fields = layout.schema.select(keys)
            plan = ReadPlan(layout.schema, fields, layout.by_family(fields))
            if hkey is not None:
                if len(self._plans) >= 64:  # a caller cycling through many key sets
                    self._plans.clear()
                self._plans[hkey] = plan
        return plan

    def read(self, layout: FieldLayout, fields: list[Field], rows: np.ndarray, out: dict[Key, torch.Tensor],
             stage: WriteStage | None, slots: np.ndarray | None,
             by_family: dict[int, list[Field]] | None = None) -> None:
        """Decode the blob fields among ``fields`` for ``rows`` into ``out`` (staged rows included)."""
        if by_family is None:
            by_family = layout.by_family(fields)
        if slots is None or not np.logical_or.reduce(slots >= 0):
            for fid, fs in by_family.items():
                self.read_family(layout, fid, fs, rows, out)
            return
        hit = slots >= 0
        miss = np.flatnonzero(~hit)
        if miss.size:
            # decode at full size with staged rows pointing at a stored row (its blobs are
            # decoded anyway), then overwrite them: no second [n, ...] buffer and copy
            read = np.where(hit, rows[miss[0]], rows)
            for fid, fs in by_family.items():
                self.read_family(layout, fid, fs, read, out)
        hit_pos = torch.from_numpy(np.flatnonzero(hit))
        hit_slots = torch.from_numpy(slots[hit].astype(np.int64))
        for fs in by_family.values():
            for f in fs:
                staged = stage.cells[f.key].index_select(0, hit_slots)
                if miss.size:
                    cells = out[f.key]
                    # as same-size integers: torch cannot index_put uint16/32/64 and float8
                    as_bits(cells)[hit_pos.to(cells.device)] = as_bits(staged.to(cells.device))
                else:
                    out[f.key] = staged

    def get_rows(self, space: RowSpace, write: WritePath, index: Any, rows: np.ndarray,
                 keys: Any, index_key: str | None, copy: bool, device: torch.device) -> TensorDict:
        """Everything :meth:`tiered.TieredStore.get` returns for resolved ``rows``: the dense
        cells (views of the columns for a step-1 slice when ``copy`` is False), the blob fields
        decoded, ``index_key`` added, on ``device``, in the index's batch shape."""
        layout = write.layout
        out: dict[Key, torch.Tensor] = {}
        plan = span = None
        if layout is not None:
            plan = self.plan(layout, keys)
            span = None if copy else contiguous_span(index, rows)
            space.read_dense_fields(plan.dense, rows, out, span, device)
            self.read(layout, plan.fields, rows, out, write.stage, write.staged_slots(rows), plan.by_family)
            self.counters["gets"] += 1
        td = as_tensordict(out, rows, index_key, device, plan)
        shape = index_shape(index)
        td = td if shape is None else td.reshape(shape)
        if plan is not None and span is not None:
            for f in plan.dense:
                if space.is_view(f.key):
                    space.remember_view(td.get(f.key), *span)
        return td

    @abstractmethod
    def read_family(self, layout: FieldLayout, family_id: int, fields: list[Field], rows: np.ndarray,
                    out: dict[Key, torch.Tensor]) -> None:
        """Decode one frame family's ``fields`` for ``rows`` (none staged) into ``out``."""

    def checksum_error(self, layout: FieldLayout, bad_ids: np.ndarray) -> ChecksumError:
        return ChecksumError(describe_bad_blobs(layout, self.index, bad_ids, self.stale()))


class CpuReadPipeline(ReadPipeline):
    """Decodes with the CPU codecs into per-thread reused buffers.

    Args:
        codec: the store's codec (blobs of other formats are decoded with their format's codec).
        verify: check blob checksums before decoding.
        promote: copy blobs read from a slower tier up, as the policy decides.
        (the others as :class:`ReadPipeline`)
    """

    def __init__(self, index: BlobIndex, placement: Placement, counters: dict[str, int], codec: codecs.Codec, *,
                 verify: bool = True, promote: bool = True,
                 stale: Callable[[], tuple[int, int] | None] | None = None) -> None:
        super().__init__(index, placement, counters, stale)
        self.codec = codec
        self.verify = bool(verify)
        self.promote = bool(promote)
        # at least 4 MiB, then doubling, kept: small batches never regrow it and fresh allocations
        # would cost page faults on every sample
        self._scratch = ScratchBuffers(floor=4 << 20, keep_max=None)
        self._cuts: dict[int, tuple[list[Field], list[Any]]] = {}

    def read_family(self, layout: FieldLayout, family_id: int, fields: list[Field], rows: np.ndarray,
                    out: dict[Key, torch.Tensor]) -> None:
        fam = layout.families[family_id]
        uniq, frame_idx = blob_frames(layout, fam, fields, rows)
        if fam.chunk_frames == 1 and frame_idx.shape[1] == len(fields) and 4 * (frame_idx.size - uniq.size) <= frame_idx.size:
            # every cell is one blob (large frames, no stacks: float observations): decode each
            # straight into the result, no reused buffer and no second copy of every byte. Not
            # when many cells share blobs (consecutive rows: X[t + 1] is ("next", X)[t]): a copy
            # costs less than decoding a shared blob again
            self.decode_cells(layout, fam, uniq, fields, frame_idx, out)
            return
        flat = self.decode_blobs(layout, fam, uniq).reshape(-1, fam.frame_nbytes)  # reused buffer
        # the cuts of these fields, kept while the plan that holds the list does (an identity test)
        kept = self._cuts.get(id(fields))
        if kept is None or kept[0] is not fields:
            if len(self._cuts) >= 64:  # a caller cycling through many key sets
                self._cuts.clear()
            kept = self._cuts[id(fields)] = (fields, cell_cuts(fields))
        assemble_cells(fields, flat, frame_idx, rows.size, out, threads=getattr(self.codec, "threads", 1),
                       cuts=kept[1])

    def decode_cells(self, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray, fields: list[Field],
                     frame_idx: np.ndarray, out: dict[Key, torch.Tensor]) -> None:
        """Decode the cells of ``fields`` (one stored blob each, ``frame_idx`` ``[rows, fields]``
        into blobs ``uniq``) into one new tensor per field: a blob two cells share is decoded twice.

        A batch of megabytes is checked and decoded on the store's threads, each thread checking
        the blobs it then decodes (:func:`tiered.codecs.checked.decode_cells_checked`).

        Raises:
            ChecksumError: a blob's stored bytes do not match their checksum.
        """
        g, from_tier = self.read_blobs(fam, uniq)
        if g.open_pos.size:  # a chunk of one frame closes as it is written
            raise AssertionError("an open time chunk of one frame: the blob index is inconsistent")
        n, nb = frame_idx.shape[0], g.frame_nbytes
        cells = torch.empty((len(fields), n, nb), dtype=torch.uint8)
        bad = decode_cells_checked(codec_for(self.codec, g.formats), g.comp, g.offsets, g.sizes,
                                   g.checksums if self.verify else None, frame_idx.T.reshape(-1),
                                   cells.numpy().reshape(-1), nb, threads=getattr(self.codec, "threads", 1))
        if bad.size:
            raise self.checksum_error(layout, g.ids[bad])
        self.settle_reads(g, from_tier)
        self.counters["blobs_decoded"] += int(g.ids.size)
        for k, f in enumerate(fields):
            out[f.key] = f.cells_from_frames(cells[k], n)

    def gather_blobs(self, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray, *,
                     copy: bool = False) -> GatheredBlobs:
        """The bytes of blobs ``uniq`` of family ``fam``: compressed for stored blobs (read from
        their tiers, checked when ``verify``), raw frames for open time chunks. The policy sees
        the reads and may promote. ``copy=False`` leaves the compressed bytes in a reused buffer.

        Raises:
            ChecksumError: a blob's stored bytes do not match their checksum.
        """
        g, from_tier = self.read_blobs(fam, uniq)
        if self.verify:
            bad = (codecs.segment_checksums(g.comp, g.offsets, g.sizes) != g.checksums).nonzero()[0]
            if bad.size:
                raise self.checksum_error(layout, g.ids[bad])
        self.settle_reads(g, from_tier)
        if copy:
            g.comp = g.comp.copy()
        return g

    def read_blobs(self, fam: FrameFamily, uniq: np.ndarray) -> tuple[GatheredBlobs, np.ndarray]:
        """:meth:`gather_blobs` before its checks: the bytes of blobs ``uniq`` as read (unchecked,
        in a reused buffer) and the tier each stored blob was read from. The caller checks them,
        then calls :meth:`settle_reads`."""
        idx = self.index
        idx.check_ids(uniq)  # a read-only open checks the index pages of these ids at first use
        state = idx.state[uniq]
        if np.minimum.reduce(state, initial=STORED) <= FREE:  # (one reduction: FREE is the least state)
            raise AssertionError("a row references a freed blob: index is inconsistent")
        is_open = state == OPEN
        # no early exits on empty groups: the call count of get must not depend on the batch
        # (array methods, not np.flatnonzero & co: those add ~10 Python-level wrapper calls each)
        open_pos = is_open.nonzero()[0]
        pos = (~is_open).nonzero()[0]
        ids = uniq[pos]
        sizes = idx.nbytes[ids]
        ends = sizes.cumsum()
        src_off = ends - sizes  # back to back from 0 (exclusive_cumsum's calls less)
        comp = self._scratch.get("comp", int(ends[-1]) if ends.size else 0)
        from_tier = self.placement.locate_and_read(ids, sizes, comp, src_off)
        return GatheredBlobs(
            n_blobs=uniq.size, chunk_frames=fam.chunk_frames, frame_nbytes=fam.frame_nbytes,
            ids=ids, pos=pos, comp=comp, offsets=src_off, sizes=sizes,
            raw_nbytes=idx.raw_nbytes[ids], checksums=idx.checksum[ids], formats=idx.codec[ids],
            open_pos=open_pos, open_raw=fam.open_raw(uniq[open_pos], idx)), from_tier

    def settle_reads(self, g: GatheredBlobs, from_tier: np.ndarray) -> None:
        """After blobs read by :meth:`read_blobs` passed their checks: the policy sees the reads
        and may promote the (checked) bytes to a faster tier."""
        self.placement.note_reads(g.ids, from_tier)
        if self.promote:
            self.placement.promote(g.ids, from_tier, g.comp, g.offsets, g.sizes)

    def decode_blobs(self, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray) -> np.ndarray:
        """Raw frames ``[len(uniq), chunk_frames, frame_nbytes]`` of the given blobs, in a reused buffer.

        Raises:
            ChecksumError: a blob's stored bytes do not match their checksum (nothing decoded).
        """
        gathered, from_tier = self.read_blobs(fam, uniq)
        dst = self._scratch.get(f"raw{fam.family_id}", uniq.size * fam.chunk_frames * fam.frame_nbytes)
        bad = decode_gathered(gathered, dst, self.codec, verify=self.verify)
        if bad.size:
            raise self.checksum_error(layout, gathered.ids[bad])
        self.settle_reads(gathered, from_tier)  # the policy sees only checked reads
        self.counters["blobs_decoded"] += int(gathered.ids.size)
        return dst.reshape(uniq.size, fam.chunk_frames, fam.frame_nbytes)

    def describe(self) -> dict[str, Any]:
        return {"backend": "cpu", "codec": self.codec.name}
