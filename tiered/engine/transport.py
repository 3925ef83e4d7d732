"""Rows in their compressed form, to decode in another process: compressed transport.

:func:`export_rows` gathers what a read of some rows needs *before* decoding: the dense cells,
and per frame family the compressed bytes of the blobs the rows use (each blob once) plus the
row -> frame table into them (:class:`CompressedRows`). Rows still in the store's write stage
travel raw (the store is not flushed for a read). With ``repack`` the store decodes those blobs,
keeps only the frames the rows use (each once, in stored order) and compresses them again in
blobs of :data:`REPACK_FRAMES` frames: a sampled row uses a few frames of each time chunk it
touches, so this moves fewer bytes for one more encode on the sending side. Every blob, stored or
repacked, travels with its checksum and is checked before it is decoded.

:func:`decode_rows` turns that into the TensorDict :meth:`tiered.TieredStore.get` would have
returned, with the same code the store's own CPU read pipeline uses
(:func:`~tiered.engine.read.decode_gathered`, :func:`~tiered.engine.read.assemble_cells`): there
is one decoder, not two. :func:`decode_batch` decodes the pieces of one batch (one per shard)
into one TensorDict in request order, each cell written once.

A batch of Atari frame stacks sampled from a large buffer crosses a process boundary in a small
fraction of its decoded size (the frames compress well and a stack's frames are shared).

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> from tiered.engine.transport import decode_rows
    >>> store = TieredStore(64, frames={"obs": 0})
    >>> td = TensorDict({"obs": torch.randint(0, 2, (16, 4, 32, 32), dtype=torch.uint8),
    ...                  "a": torch.arange(16)}, [16])
    >>> _ = store.extend(td)
    >>> packed = store.get_compressed([3, 9, 3])
    >>> out = decode_rows(packed)
    >>> bool((out["obs"] == td["obs"][[3, 9, 3]]).all()), out["a"].tolist()
    (True, [3, 9, 3])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from .. import codecs
from ..errors import ChecksumError, InvalidArgumentError
from ..schema import Field, Key, as_bits
from ..util.batch import exclusive_cumsum
from .read import GatheredBlobs, as_tensordict, assemble_cells, blob_frames, decode_gathered

if TYPE_CHECKING:
    from .frames import FrameFamily
    from .layout import FieldLayout
    from .read import CpuReadPipeline
    from .rows import RowSpace
    from .write import WritePath

__all__ = ["CompressedRows", "FamilyBlobs", "REPACK_FRAMES", "export_rows", "decode_rows", "decode_batch"]

#: frames per blob of a repacked batch (the needed frames of a batch, re-encoded in groups this large)
REPACK_FRAMES = 64


@dataclass
class FamilyBlobs:
    """One frame family's part of :class:`CompressedRows`: its fields, the gathered blobs and
    ``frame_idx`` ``[rows, frames]``, each row's frames as positions in the decoded frames
    (0 for rows that travel raw in ``CompressedRows.staged``)."""

    fields: list[Field]
    frame_idx: np.ndarray
    blobs: GatheredBlobs


@dataclass
class CompressedRows:
    """Rows of a store before their blob fields are decoded (see the module docstring).

    Attributes:
        rows: the store rows, in the order asked for.
        order: every field's key, in the order :meth:`tiered.TieredStore.get` returns them.
        dense: the dense cells ``[len(rows), ...]``.
        families: per frame family, its compressed blobs and row -> frame table.
        codec: the store codec's name (blobs of another format name their own).
        staged_pos: positions (among ``rows``) of rows still in the store's write stage: their
            blob cells travel raw in ``staged`` (the store is not flushed for a read).
        staged: the raw blob cells of those rows, ``[len(staged_pos), ...]`` per blob field.
    """

    rows: np.ndarray
    order: list[Key]
    dense: dict[Key, torch.Tensor]
    families: list[FamilyBlobs] = field(default_factory=list)
    codec: str = "zstd"
    staged_pos: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    staged: dict[Key, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.rows.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays and tensors held: what crossing a process boundary moves."""
        cells = [*self.dense.values(), *self.staged.values()]
        tensors = sum(int(v.numel() * v.element_size()) for v in cells)
        return (int(self.rows.nbytes) + int(self.staged_pos.nbytes) + tensors
                + sum(int(f.frame_idx.nbytes) + f.blobs.nbytes for f in self.families))

    @property
    def blob_nbytes(self) -> int:
        """Compressed bytes of the blobs alone (the rest are tables, dense and staged cells)."""
        return sum(int(f.blobs.comp.nbytes) for f in self.families)

    # Crossing a process (pickle, as Ray moves it), the dense cells and the row -> frame tables
    # travel as one zstd buffer with a checksum instead of many small tensors and arrays.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        arrays = [*(torch.from_numpy(f.frame_idx) for f in self.families), *self.dense.values()]
        state["dense"] = (list(self.dense), _pack([a.contiguous() for a in arrays]))
        state["families"] = [FamilyBlobs(f.fields, np.empty(0, f.frame_idx.dtype), f.blobs) for f in self.families]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        keys, packed = state["dense"]
        arrays = _unpack(*packed)
        if arrays is None:
            raise ChecksumError("the dense cells and frame tables of compressed rows failed their checksum after "
                                "transport: the bytes were damaged on the way")
        families = state["families"]
        state["families"] = [FamilyBlobs(f.fields, a.numpy(), f.blobs) for f, a in zip(families, arrays, strict=False)]
        state["dense"] = dict(zip(keys, arrays[len(families):], strict=True))
        self.__dict__.update(state)


@functools.cache
def _pack_codec() -> codecs.Codec:
    return codecs.get_codec("zstd")


def _pack(arrays: list[torch.Tensor]) -> tuple[list[tuple[torch.dtype, tuple[int, ...]]], np.ndarray, int]:
    """Tensors as one compressed buffer: ``(dtype and shape of each, bytes, checksum)``; each
    tensor's bytes start at a multiple of 8 (so they can be viewed as their dtype again)."""
    nbytes = np.array([a.numel() * a.element_size() for a in arrays], dtype=np.int64)
    starts = exclusive_cumsum(-(-nbytes // 8) * 8)
    raw = np.zeros(int(starts[-1] + nbytes[-1]) if arrays else 0, dtype=np.uint8)
    for a, lo, n in zip(arrays, starts.tolist(), nbytes.tolist(), strict=True):
        raw[lo:lo + n] = a.reshape(-1).view(torch.uint8).numpy()
    enc = _pack_codec().encode(raw, np.zeros(1, dtype=np.int64), np.array([raw.size], dtype=np.int64))
    return [(a.dtype, tuple(a.shape)) for a in arrays], enc.data, int(enc.checksums[0])


def _unpack(spec: list[tuple[torch.dtype, tuple[int, ...]]], data: np.ndarray,
            checksum: int) -> list[torch.Tensor] | None:
    """The tensors :func:`_pack` packed (views of one buffer), or None when the checksum fails."""
    one = np.zeros(1, dtype=np.int64)
    size = np.array([data.size], dtype=np.int64)
    if int(codecs.segment_checksums(data, one, size)[0]) != checksum:
        return None
    dtypes = [torch.empty(0, dtype=d).element_size() for d, _ in spec]
    nbytes = np.array([int(np.prod(shape)) * w for (_, shape), w in zip(spec, dtypes, strict=True)], dtype=np.int64)
    starts = exclusive_cumsum(-(-nbytes // 8) * 8)
    raw = np.empty(int(starts[-1] + nbytes[-1]) if spec else 0, dtype=np.uint8)
    _pack_codec().decode(data, one, size, raw, one, np.array([raw.size], dtype=np.int64))
    buf = torch.from_numpy(raw)
    return [buf[lo:lo + n].view(d).reshape(shape)
            for (d, shape), lo, n in zip(spec, starts.tolist(), nbytes.tolist(), strict=True)]


def export_rows(reader: CpuReadPipeline, space: RowSpace, write: WritePath, rows: np.ndarray,
                keys: Any = None, *, repack: bool = False, repack_frames: int = REPACK_FRAMES) -> CompressedRows:
    """Gather ``rows`` (resolved positions) without decoding their blob fields for the caller.

    Rows waiting in the write stage travel raw (the stage is left as it is); open time chunks
    are compressed for the trip (the store keeps them open). With ``repack``, the store decodes
    the rows' blobs, keeps only the frames the rows use (each once) and compresses them again,
    ``repack_frames`` frames per blob, with the store's codec: fewer bytes to move (a sampled row
    uses a few frames of each blob it touches) for one more encode on this side.

    Args:
        reader: the store's CPU read pipeline (reads, checks and decodes stored blobs).
        space: the store's rows (dense columns).
        write: the store's write path (layout and write stage).
        rows: resolved row positions, in the order the caller wants them.
        keys: the fields to send (default: all).
        repack: send only the frames the rows use, compressed again.
        repack_frames: frames per repacked blob.

    Raises:
        InvalidArgumentError: ``repack_frames`` below 1.
        ChecksumError: a stored blob fails its checksum (with ``verify`` on).
    """
    if repack and (isinstance(repack_frames, bool) or not isinstance(repack_frames, int) or repack_frames < 1):
        raise InvalidArgumentError(f"repack_frames must be an int >= 1 (frames per repacked blob), "
                                   f"got {repack_frames!r}")
    rows = np.asarray(rows, dtype=np.int64)
    layout = write.layout
    out = CompressedRows(rows=rows, order=[], dense={}, codec=reader.codec.name)
    if layout is None:
        return out
    fields = layout.schema.select(keys)
    out.order = [f.key for f in fields]
    for f in fields:
        if f.kind == "dense":
            out.dense[f.key] = space.read_dense(f.key, rows)
    slots = write.staged_slots(rows)
    stored = np.ones(rows.size, dtype=bool) if slots is None else slots < 0
    if not stored.all():
        out.staged_pos = np.flatnonzero(~stored).astype(np.int32)
        staged_slots = torch.from_numpy(slots[~stored].astype(np.int64))
        out.staged = {f.key: write.stage.cells[f.key].index_select(0, staged_slots)
                      for f in fields if f.kind != "dense"}
    for fid, fs in layout.by_family(fields).items():
        fam = layout.families[fid]
        uniq, idx = blob_frames(layout, fam, fs, rows[stored])
        if repack:
            blobs, idx = _repacked(reader, layout, fam, uniq, idx, int(repack_frames))
        else:
            blobs = reader.gather_blobs(layout, fam, uniq, copy=True).sealed(reader.codec)
        frame_idx = np.zeros((rows.size, idx.shape[1]), dtype=_narrowest(blobs.n_blobs * blobs.chunk_frames))
        frame_idx[stored] = idx
        out.families.append(FamilyBlobs(fs, frame_idx, blobs.compact()))
    return out


def _narrowest(count: int) -> type:
    """The smallest unsigned integer type that holds positions in ``[0, count)``."""
    return np.uint16 if count <= 1 << 16 else np.uint32 if count <= 1 << 32 else np.int64


def _repacked(reader: CpuReadPipeline, layout: FieldLayout, fam: FrameFamily, uniq: np.ndarray, frame_idx: np.ndarray,
              group: int) -> tuple[GatheredBlobs, np.ndarray]:
    """The frames ``frame_idx`` uses, decoded from blobs ``uniq``, each once, compressed again in
    blobs of ``group`` frames (in stored order: neighbouring frames compress together); and
    ``frame_idx`` pointing into them."""
    raw = reader.decode_blobs(layout, fam, uniq).reshape(-1, fam.frame_nbytes)  # checked as read
    need, inv = np.unique(frame_idx, return_inverse=True)
    frames = raw[need]  # one gather of the needed frames
    k, fnb = int(need.size), fam.frame_nbytes
    n_blobs = -(-k // group)
    starts = np.arange(n_blobs, dtype=np.int64) * group
    raw_nbytes = (np.minimum(starts + group, k) - starts) * fnb
    codec = reader.codec
    enc = codec.encode(frames.reshape(-1), starts * fnb, raw_nbytes)
    index = reader.index
    blobs = GatheredBlobs(
        n_blobs=n_blobs, chunk_frames=group, frame_nbytes=fnb, ids=np.full(n_blobs, -1, dtype=np.int64),
        pos=np.arange(n_blobs, dtype=np.int64), comp=enc.data, offsets=enc.offsets, sizes=enc.sizes,
        raw_nbytes=raw_nbytes, checksums=enc.checksums.astype(index.checksum.dtype),
        formats=np.full(n_blobs, codec.format_id, dtype=index.codec.dtype),
        open_pos=np.empty(0, dtype=np.int64), open_raw=np.empty((0, group, fnb), dtype=np.uint8))
    return blobs, inv.reshape(frame_idx.shape)


def decode_rows(packed: CompressedRows, *, index_key: str | None = None, device: str | torch.device = "cpu",
                verify: bool = True, codec: codecs.Codec | None = None) -> TensorDict:
    """Decode :class:`CompressedRows` into the TensorDict the store's ``get`` returns.

    Args:
        packed: what :func:`export_rows` (``TieredStore.get_compressed``) gave.
        index_key: also return the store rows under this key.
        device: where the result goes.
        verify: check each blob's checksum first (bytes damaged on the way are caught here).
        codec: the codec to decode with (default: ``packed.codec``, multi-threaded).

    Raises:
        ChecksumError: a blob's bytes do not match their checksum (nothing is returned).
    """
    return decode_batch([packed], None, index_key=index_key, device=device, verify=verify, codec=codec)


def decode_batch(parts: Sequence[CompressedRows], positions: Sequence[np.ndarray] | None, *,
                 index_key: str | None = None, device: str | torch.device = "cpu", verify: bool = True,
                 codec: codecs.Codec | None = None) -> TensorDict:
    """Decode the pieces of one batch (e.g. one per shard) into one TensorDict, in request order.

    Each frame family's blobs of every piece are decoded into one buffer and the cells gathered
    from it once, straight into the batch's order; dense cells are written once into the batch.

    Args:
        parts: pieces exported by stores with the same schema (and the same ``keys``).
        positions: where each piece's rows go in the batch (together a permutation of
            ``range(total rows)``); None: one after the other.
        index_key, device, verify, codec: as :func:`decode_rows`.

    Raises:
        ChecksumError: a blob's bytes do not match their checksum (nothing is returned).
    """
    if positions is None:
        ends = np.cumsum([len(p) for p in parts])
        positions = [np.arange(e - len(p), e) for p, e in zip(parts, ends, strict=True)]
    if not parts or len(positions) != len(parts):
        raise InvalidArgumentError(f"decode_batch needs one positions array per piece (and at least one piece), "
                                   f"got {len(parts)} piece(s) and {len(positions)} positions array(s)")
    n = int(sum(len(p) for p in parts))
    at = [torch.from_numpy(np.asarray(pos, dtype=np.int64)) for pos in positions]
    single = len(parts) == 1 and torch.equal(at[0], torch.arange(n))
    first = parts[0]
    rows = np.empty(n, dtype=np.int64)
    for p, pos in zip(parts, positions, strict=True):  # each piece's rows back where the caller asked for them
        rows[pos] = p.rows
    cells: dict[Key, torch.Tensor] = {}
    for key, col in first.dense.items():
        if single:
            cells[key] = col
            continue
        cells[key] = out = torch.empty((n, *col.shape[1:]), dtype=col.dtype)
        for p, a in zip(parts, at, strict=True):
            out[a] = p.dense[key]
    for j, fam in enumerate(first.families):
        _decode_family(j, fam, parts, at, n, cells, verify, codec)
    # as get() builds it: dense fields in schema order, then the blob fields family by family
    ordered = {k: cells[k] for k in first.order if k in first.dense}
    ordered.update((f.key, cells[f.key]) for fam in first.families for f in fam.fields)
    return as_tensordict(ordered, rows, index_key, torch.device(device))


def _decode_family(j: int, fam: FamilyBlobs, parts: Sequence[CompressedRows], at: list[torch.Tensor], n: int,
                   cells: dict[Key, torch.Tensor], verify: bool, codec: codecs.Codec | None) -> None:
    """Decode family ``j`` of every piece into one frame buffer, then gather its cells in batch order."""
    fnb = fam.blobs.frame_nbytes
    counts = [p.families[j].blobs.n_blobs * p.families[j].blobs.chunk_frames for p in parts]
    base = np.concatenate([[0], np.cumsum(counts)])
    flat = np.empty(max(int(base[-1]), 1) * fnb, dtype=np.uint8)  # >= 1 frame: rows sent raw point at 0
    frame_idx = np.empty((n, fam.frame_idx.shape[1]), dtype=np.int64)
    for p, a, lo, hi in zip(parts, at, base[:-1], base[1:], strict=True):
        piece = p.families[j]
        g = piece.blobs
        use = codec if codec is not None else codecs.get_codec(p.codec)
        bad = decode_gathered(g, flat[lo * fnb: hi * fnb], use, verify=verify)
        if bad.size:
            raise ChecksumError(
                f"{bad.size} blob(s) failed their checksum after transport (blob ids {g.ids[bad][:5].tolist()}, "
                f"-1: compressed for the trip); the bytes were damaged on the way or in the sending store: run "
                "`tiered verify` on its directory")
        frame_idx[a.numpy()] = piece.frame_idx.astype(np.int64) + lo
    assemble_cells(fam.fields, flat.reshape(-1, fnb), frame_idx, n, cells)
    for p, a in zip(parts, at, strict=True):  # rows still staged in the sending store: their raw cells
        if p.staged_pos.size:
            dst = a[torch.from_numpy(p.staged_pos.astype(np.int64))]
            for f in fam.fields:
                # as same-size integers: torch cannot index_put uint16/32/64 and float8
                as_bits(cells[f.key])[dst] = as_bits(p.staged[f.key])
