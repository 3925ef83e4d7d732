"""Rows in their compressed form, to decode in another process: compressed transport.

:func:`export_rows` gathers what a read of some rows needs *before* decoding: the dense cells,
and per frame family the compressed bytes of the blobs the rows use (each blob once) plus the
row -> frame table into them (:class:`CompressedRows`). :func:`decode_rows` turns that into
the TensorDict :meth:`tiered.TieredStore.get` would have returned, with the same code the
store's own CPU read pipeline uses (:func:`~tiered.engine.read.decode_gathered`,
:func:`~tiered.engine.read.assemble_cells`): there is one decoder, not two.

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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from .. import codecs
from ..errors import ChecksumError
from ..schema import Field, Key
from .read import GatheredBlobs, as_tensordict, assemble_cells, blob_frames, decode_gathered

if TYPE_CHECKING:
    from .read import CpuReadPipeline
    from .rows import RowSpace
    from .write import WritePath

__all__ = ["CompressedRows", "FamilyBlobs", "export_rows", "decode_rows"]


@dataclass
class FamilyBlobs:
    """One frame family's part of :class:`CompressedRows`: its fields, the gathered blobs and
    ``frame_idx`` ``[rows, frames]``, each row's frames as positions in the decoded frames."""

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
    """

    rows: np.ndarray
    order: list[Key]
    dense: dict[Key, torch.Tensor]
    families: list[FamilyBlobs] = field(default_factory=list)
    codec: str = "zstd"

    def __len__(self) -> int:
        return int(self.rows.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays and tensors held: what crossing a process boundary moves."""
        dense = sum(int(v.numel() * v.element_size()) for v in self.dense.values())
        return int(self.rows.nbytes) + dense + sum(int(f.frame_idx.nbytes) + f.blobs.nbytes for f in self.families)


def export_rows(reader: CpuReadPipeline, space: RowSpace, write: WritePath, rows: np.ndarray,
                keys: Any = None) -> CompressedRows:
    """Gather ``rows`` (resolved positions) without decoding their blob fields. Rows waiting in
    the write stage are compressed first (as a flush does), so every blob field is a blob, and
    open time chunks are compressed for the trip (the store keeps them open).

    Raises:
        ChecksumError: a stored blob fails its checksum (with ``verify`` on).
    """
    if write.staged_slots(rows) is not None:
        write.flush_stage()
    layout = write.layout
    out = CompressedRows(rows=np.asarray(rows, dtype=np.int64), order=[], dense={},
                         codec=reader.codec.name)
    if layout is None:
        return out
    fields = layout.schema.select(keys)
    out.order = [f.key for f in fields]
    for f in fields:
        if f.kind == "dense":
            out.dense[f.key] = space.read_dense(f.key, rows)
    for fid, fs in layout.by_family(fields).items():
        fam = layout.families[fid]
        uniq, frame_idx = blob_frames(layout, fam, fs, rows)
        if uniq.size * fam.chunk_frames < 1 << 31:
            frame_idx = frame_idx.astype(np.int32)
        out.families.append(FamilyBlobs(fs, frame_idx, reader.gather_blobs(layout, fam, uniq, copy=True)
                                        .sealed(reader.codec).compact()))
    return out


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
    codec = codec if codec is not None else codecs.get_codec(packed.codec)
    n = len(packed)
    cells: dict[Key, torch.Tensor] = dict(packed.dense)
    for fam in packed.families:
        g = fam.blobs
        dst = np.empty(g.n_blobs * g.chunk_frames * g.frame_nbytes, dtype=np.uint8)
        bad = decode_gathered(g, dst, codec, verify=verify)
        if bad.size:
            raise ChecksumError(
                f"{bad.size} blob(s) failed their checksum after transport (blob ids {g.ids[bad][:5].tolist()}); "
                "the bytes were damaged on the way or in the sending store: run `tiered verify` on its directory")
        assemble_cells(fam.fields, dst.reshape(-1, g.frame_nbytes), fam.frame_idx, n, cells)
    # as get() builds it: dense fields in schema order, then the blob fields family by family
    ordered = {k: cells[k] for k in packed.order if k in packed.dense}
    ordered.update((f.key, cells[f.key]) for fam in packed.families for f in fam.fields)
    return as_tensordict(ordered, packed.rows, index_key, torch.device(device))
