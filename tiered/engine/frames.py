"""Frame deduplication and time chunking for one frame family (private to the store).

A *family* is the set of blob fields whose frames have one dtype and shape (e.g.
``observation`` and ``("next", "observation")`` split into 84x84 frames). For each batch
written, :meth:`FrameFamily.plan` decides, without mutating anything, which incoming frames
are new and where every frame lives:

1. **Dedup, exact.** Frames the layout predicts to repeat (a stacked frame and the previous
   row's, a next observation and the next row's observation) are compared in place first.
   The frames left, preceded by a small *tail* of raw frames kept from the previous write (so
   sharing works across two ``extend`` calls), are hashed with a 64-bit multiply-add hash over
   their 8-byte words (numpy ``uint64`` arithmetic wraps by definition). Each frame's
   representative is the first frame with the same hash; every match is then confirmed byte
   for byte (one numpy comparison over the batch). A hash collision is therefore only a missed
   dedup, never wrong data.
2. **Time chunks.** New unique frames are grouped per trajectory, in write order, into blobs
   of ``chunk_frames`` frames. The last, partial chunk of a trajectory stays *open* (raw, in
   a per-family buffer) until it fills, the trajectory ends (a done flag), or ``flush()``.
   Closed chunks are returned for one batched encode.

Everything is vectorized over frames: the Python call count does not grow with the batch.
:meth:`commit` applies a plan once the store has placed the encoded blobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..util.batch import exclusive_cumsum, isin, ranges
from .blob_index import OPEN, BlobIndex

__all__ = ["FrameFamily", "FramePlan", "FrameColumns", "layout_rules", "rule_runs", "auto_chunk_frames", "CHUNK_TARGET_BYTES",
           "TAIL_ROWS"]

#: The raw bytes a time chunk holds at most when the store picks ``chunk_frames`` per family: a
#: sampled row decodes its whole chunk, so a family of large frames (a 113 kB float32 stack that
#: shares no frame with its neighbours) gets chunks of one frame, while 84x84 uint8 frames keep 8
#: (65,536 // 7,056 = 9, capped at the default).
CHUNK_TARGET_BYTES = 64 << 10
#: Rows of a write whose frames stay raw as the next write's tail (rows a stack or a next
#: observation of the next write can share frames with).
TAIL_ROWS = 8


def auto_chunk_frames(frame_nbytes: int, most: int) -> int:
    """Frames per time chunk for a family of ``frame_nbytes``-byte frames when the store chooses:
    as many as fit :data:`CHUNK_TARGET_BYTES`, at least 1 and at most ``most``.

    Example:
        >>> auto_chunk_frames(84 * 84, 8), auto_chunk_frames(4 * 84 * 84 * 4, 8), auto_chunk_frames(84 * 84 * 4, 8)
        (8, 1, 2)
    """
    return max(1, min(int(most), CHUNK_TARGET_BYTES // max(int(frame_nbytes), 1)))

#: The largest temporary a family keeps for reuse (:meth:`FrameFamily.scratch`); the write
#: stage's flushes need far less (128 rows of 2 x 4-frame Atari stacks: ~340 kB).
SCRATCH_MAX_BYTES = 8 << 20

_HASH_SEED = 0x9E3779B97F4A7C15


def _hash_coeffs(n_words: int) -> np.ndarray:
    rng = np.random.default_rng(12345)
    return rng.integers(1, 2**63, size=n_words, dtype=np.uint64) | np.uint64(1)


def frame_hashes(frames: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """64-bit hash of each row of a ``[n, frame_nbytes]`` uint8 array (used only to find candidates).

    ``sum(word[i] * coeff[i])`` over the row's 8-byte words with odd random coefficients, in
    uint64 arithmetic (wraps by definition): a change in any single word changes the hash.
    """
    n, frame_nbytes = frames.shape
    n_words = frame_nbytes // 8
    h = np.zeros(n, dtype=np.uint64)
    if n_words:
        h = frames[:, : n_words * 8].view(np.uint64) @ coeffs[:n_words]
    rest = frame_nbytes - n_words * 8
    if rest:
        tail = frames[:, n_words * 8:].astype(np.uint64)
        h = h * np.uint64(_HASH_SEED) + tail @ coeffs[n_words: n_words + rest]
    return h


def layout_rules(columns: list[tuple[tuple[str, ...], int, bool]]) -> np.ndarray | None:
    """Neighbour rules of a family's frame layout (see :meth:`FrameFamily.plan`).

    Args:
        columns: per field of the family, in layout order: (key, frames per row, stacked).

    Returns:
        ``[per_row, 2]`` rules, or ``None`` when the layout has no neighbours to compare.

    Example:
        >>> layout_rules([(("observation",), 2, True), (("next", "observation"), 2, True)]).tolist()
        [[1, 1], [1, 3], [0, 1], [-1, 0]]
    """
    offsets, total = {}, 0
    for key, width, _ in columns:
        offsets[key] = total
        total += width
    rules = np.full((total, 2), -1, dtype=np.int64)
    rules[:, 1] = 0
    for key, width, stacked in columns:
        first = offsets[key]
        is_next = len(key) > 1 and key[0] == "next"
        partner = key[1:] if is_next else ("next",) + key
        partner_first = offsets.get(partner)
        if is_next and partner_first is not None:
            if stacked:  # next[t][j] == obs[t][j + 1]
                rules[first:first + width - 1] = np.stack(
                    [np.zeros(width - 1, np.int64), partner_first + np.arange(1, width)], 1)
            continue
        if stacked:  # obs[t][j] == obs[t - 1][j + 1]
            rules[first:first + width - 1] = np.stack(
                [np.ones(width - 1, np.int64), first + np.arange(1, width)], 1)
        if partner_first is not None:  # newest frame: obs[t][-1] == next[t - 1][-1]
            rules[first + width - 1] = (1, partner_first + width - 1)
    return rules if (rules[:, 0] >= 0).any() else None


def rule_runs(rules: np.ndarray, offsets: np.ndarray) -> list[tuple[int, ...]]:
    """The rules of :func:`layout_rules` grouped into runs that one comparison covers.

    A run is consecutive frame columns ``p, p + 1, ...`` of one field whose partners are
    consecutive columns of one field, with the same row delta.

    Args:
        rules: ``[per_row, 2]`` rules (row delta, partner column).
        offsets: first column of each field, then ``per_row``.

    Returns:
        ``(row delta, field, first column in it, partner field, partner's first column in it,
        length, p, partner column)`` per run.

    Example:
        >>> rules = layout_rules([(("observation",), 2, True), (("next", "observation"), 2, True)])
        >>> rule_runs(rules, np.array([0, 2, 4]))
        [(1, 0, 0, 0, 1, 1, 0, 1), (1, 0, 1, 1, 1, 1, 1, 3), (0, 1, 0, 0, 1, 1, 2, 1)]
    """
    field_of = np.searchsorted(offsets, np.arange(rules.shape[0]), side="right") - 1
    runs: list[list[int]] = []
    for p, (row_delta, q) in enumerate(rules.tolist()):
        if row_delta < 0:
            continue
        f, g = int(field_of[p]), int(field_of[q])
        last = runs[-1] if runs else None
        if last is not None and (last[0], last[1], last[3]) == (row_delta, f, g) \
                and p == last[6] + last[5] and q == last[7] + last[5]:
            last[5] += 1
        else:
            runs.append([row_delta, f, p - int(offsets[f]), g, q - int(offsets[g]), 1, p, q])
    return [tuple(r) for r in runs]


class FrameColumns:
    """The incoming frames of one family as ``n_rows`` rows of ``per_row`` columns, without copying them.

    Each field contributes ``[n_rows, width, frame_nbytes]`` (a view of the caller's tensor);
    frame position ``q = row * per_row + column`` addresses the virtual row-major
    concatenation. Only the frames that are actually needed (new unique frames, the tail) are
    ever gathered.
    """

    def __init__(self, cells: list[np.ndarray]):
        self.cells = cells
        self.n_rows = int(cells[0].shape[0])
        self.frame_nbytes = int(cells[0].shape[2])
        widths = [int(c.shape[1]) for c in cells]
        self.per_row = sum(widths)
        self.offsets = np.cumsum([0] + widths)
        self.n_frames = self.n_rows * self.per_row

    def col(self, p: int) -> np.ndarray:
        """Column ``p`` as an ``[n_rows, frame_nbytes]`` view."""
        f = int(self.offsets.searchsorted(p, side="right")) - 1
        return self.cells[f][:, p - self.offsets[f]]

    def take(self, q: np.ndarray) -> np.ndarray:
        """Frames at positions ``q`` (a copy, ``[len(q), frame_nbytes]``); one gather per field."""
        out = np.empty((q.size, self.frame_nbytes), dtype=np.uint8)
        c = self.cells[0]
        if len(self.cells) == 1 and c.flags.c_contiguous:
            # one field whose frames lie back to back (a contiguous tensor): positions are its
            # frame rows, gathered straight into ``out`` (a fancy gather copies twice: into a
            # temporary, then into ``out``); positions are in range by construction, so clip
            # never changes one
            np.take(c.reshape(-1, self.frame_nbytes), q, axis=0, out=out, mode="clip")
            return out
        row, column = np.divmod(q, self.per_row)
        for f, c in enumerate(self.cells):  # each field holds the frame columns of its own range
            sel = ((column >= self.offsets[f]) & (column < self.offsets[f + 1])).ravel().nonzero()[0]
            out[sel] = c[row[sel], column[sel] - self.offsets[f]]
        return out


@dataclass
class FramePlan:
    """Where every incoming frame goes, and which chunks are ready to encode."""

    blob: np.ndarray            # [n_frames] blob id of each incoming frame (new ids already allocated)
    slot: np.ndarray            # [n_frames] slot of the frame inside its blob
    new_ids: np.ndarray         # blob ids allocated by this plan (closed and open)
    closed_ids: np.ndarray      # blob ids to encode now
    closed_raw: np.ndarray      # [sum frames, frame_nbytes] raw frames of the closed chunks, chunk-major
    closed_nframes: np.ndarray  # frames per closed chunk
    # open-chunk bookkeeping applied by commit()
    open_traj: np.ndarray
    open_blob: np.ndarray
    open_fill: np.ndarray
    open_writes_blob: np.ndarray   # blob id of each frame written into an open chunk's buffer
    open_writes_slot: np.ndarray
    open_writes_frame: np.ndarray
    reopened_closed: np.ndarray    # previously open blobs that this plan closes
    tail_frames: np.ndarray
    tail_hash: np.ndarray
    tail_blob: np.ndarray
    tail_slot: np.ndarray


@dataclass
class _Chunks:
    """The time chunks that a plan's new unique frames go to (see :meth:`FrameFamily._assign_chunks`).

    A *group* is one trajectory's new unique frames, groups sorted by trajectory id; a group
    fills its trajectory's open chunk first (if it has one), then new chunks.
    """

    traj: np.ndarray         # [groups] trajectory id of each group
    has_open: np.ndarray     # [groups] the trajectory has an open chunk that the group continues
    open_pos: np.ndarray     # [groups] position of that chunk in FrameFamily.open_traj
    old_fill: np.ndarray     # [groups] frames already in that chunk (0 without one)
    group: np.ndarray        # [chunks] group of each chunk, chunks group-major
    blob: np.ndarray         # [chunks] blob id of each chunk
    fill: np.ndarray         # [chunks] frames in each chunk once the plan is applied
    reuse: np.ndarray        # [chunks] the chunk is its trajectory's open chunk, continued
    closes: np.ndarray       # [chunks] the chunk closes (is encoded) in this plan
    new_ids: np.ndarray      # blob ids allocated for the chunks not reused
    frame_chunk: np.ndarray  # [unique] chunk of each new unique frame, in write order
    frame_slot: np.ndarray   # [unique] slot of each new unique frame inside its chunk


class FrameFamily:
    """Dedup and chunking state of one frame family. See the module docstring."""

    def __init__(self, family_id: int, frame_nbytes: int, chunk_frames: int, dedup: bool = True,
                 stored_raw: bool | None = False):
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.family_id = family_id
        #: whether the family's blobs are stored raw (its data did not compress), not with the
        #: store's codec; None: decided by the family's first encode (saved with each commit)
        self.stored_raw = stored_raw
        self.frame_nbytes = int(frame_nbytes)
        self.chunk_frames = int(chunk_frames)
        self.dedup = dedup
        self._coeffs = _hash_coeffs(self.frame_nbytes // 8 + 8)
        # Open chunks, sorted by trajectory id.
        self.open_traj = np.empty(0, dtype=np.int64)
        self.open_blob = np.empty(0, dtype=np.int64)
        self.open_fill = np.empty(0, dtype=np.int64)
        # Raw frames of open chunks: open_frames[s] holds chunk_frames frames; index.open_slot[blob] = s.
        # one open chunk per live trajectory; starts with room for one environment's and grows
        # (doubling) with the number of environments
        self.open_frames = np.empty((1 if self.chunk_frames > 1 else 0, self.chunk_frames, self.frame_nbytes),
                                    dtype=np.uint8)
        self._free_open_slots = np.arange(self.open_frames.shape[0], dtype=np.int64)
        # Raw frames of the previous write's last rows (pins their blobs in the index).
        self.tail_frames = np.empty((0, self.frame_nbytes), dtype=np.uint8)
        self.tail_hash = np.empty(0, dtype=np.uint64)
        self._scratch: dict[str, np.ndarray] = {}
        self._runs: dict[tuple, list[tuple[int, ...]]] = {}  # rule runs per (rules, field offsets)
        self.tail_blob = np.empty(0, dtype=np.int64)
        self.tail_slot = np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------------------------------
    def plan(self, frames: FrameColumns, frame_traj: np.ndarray, ended_traj: np.ndarray,
             tail_mask: np.ndarray, index: BlobIndex, close_all: bool = False,
             rules: np.ndarray | None = None) -> FramePlan:
        """Plan the storage of ``frames`` (``n_rows`` rows of ``per_row`` frames, in write order).

        Dedup, then chunk assignment of the new unique frames, then where every incoming frame
        lives, then the raw frames of the chunks that close, then the open chunks left.

        Args:
            frames: incoming frames, row-major in time order (``n_rows`` rows of ``per_row`` frames).
            frame_traj: trajectory id of each frame.
            ended_traj: sorted trajectory ids that end in this batch (their chunks close).
            tail_mask: frames to keep raw as the tail for the next write.
            index: the blob index (ids for new chunks are allocated here; the caller releases
                ``plan.new_ids`` if placement fails).
            close_all: close every chunk, open ones included (used by ``flush``).
            rules: ``[per_row, 2]`` int array: frame column ``p`` of a row is expected to equal
                column ``rules[p, 1]`` of the previous row of its trajectory (``rules[p, 0] == 1``)
                or of its own row (``0``); ``-1``: no expectation. See :func:`layout_rules`.
        """
        n_tail = self.tail_frames.shape[0]
        representative, roots, root_frames = self._dedup(frames, frame_traj, rules)
        rep_new = representative[n_tail:]  # of each incoming frame, a position in [tail; frames]
        unique_pos = (rep_new == np.arange(n_tail, n_tail + frames.n_frames)).ravel().nonzero()[0]
        chunks = self._assign_chunks(frame_traj[unique_pos], ended_traj, close_all, index)
        blob, slot = self._resolve(rep_new, unique_pos, chunks)
        # new unique frames are all dedup roots: their bytes are taken from root_frames
        unique_root = roots.searchsorted(unique_pos)
        closed_ids, closed_nframes, closed_raw, reopened_closed = self._closed_chunks(
            chunks, root_frames, unique_root, index)
        untouched = np.ones(self.open_traj.size, dtype=bool)  # open chunks no new frame went to
        untouched[chunks.open_pos[chunks.has_open]] = False
        if close_all:  # flush: every other open chunk closes too
            extra_ids, extra_fill = self.open_blob[untouched], self.open_fill[untouched]
            if extra_ids.size:
                open_rows = self._open_rows(extra_ids, extra_fill, index)
                closed_raw = np.concatenate([closed_raw, self.open_frames.reshape(-1, self.frame_nbytes)[open_rows]])
                closed_ids = np.concatenate([closed_ids, extra_ids])
                closed_nframes = np.concatenate([closed_nframes, extra_fill])
                reopened_closed = np.concatenate([reopened_closed, extra_ids])
            open_traj, open_blob, open_fill = (np.empty(0, np.int64) for _ in range(3))
        else:
            open_traj, open_blob, open_fill = self._open_after(chunks, untouched)
        to_open = (~chunks.closes[chunks.frame_chunk]).ravel().nonzero()[0]  # new frames of open chunks
        tail_frames, tail_blob, tail_slot = self._next_tail(rep_new, tail_mask, roots, root_frames, blob, slot)
        return FramePlan(
            blob=blob, slot=slot, new_ids=chunks.new_ids, closed_ids=closed_ids, closed_raw=closed_raw,
            closed_nframes=closed_nframes.astype(np.int64),
            open_traj=open_traj, open_blob=open_blob, open_fill=open_fill.astype(np.int64),
            open_writes_blob=chunks.blob[chunks.frame_chunk[to_open]],
            open_writes_slot=chunks.frame_slot[to_open],
            open_writes_frame=root_frames[unique_root[to_open]],
            reopened_closed=reopened_closed,
            tail_frames=tail_frames, tail_hash=frame_hashes(tail_frames, self._coeffs),
            tail_blob=tail_blob, tail_slot=tail_slot,
        )

    def _next_tail(self, rep_new: np.ndarray, tail_mask: np.ndarray, roots: np.ndarray, root_frames: np.ndarray,
                   blob: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(frames, blob ids, slots)`` of the next write's tail: the distinct frames of the
        incoming frames ``tail_mask`` marks, each once (the tail only serves hash matches, so
        the 8 rows of 2 x 4-frame stacks it covers keep ~11 frames, not 64)."""
        n_tail = self.tail_frames.shape[0]
        keep = np.unique(rep_new[np.asarray(tail_mask, dtype=bool).ravel().nonzero()[0]])  # in [tail; frames]
        old = keep < n_tail
        new = keep[~old] - n_tail  # incoming dedup roots
        frames = np.empty((keep.size, self.frame_nbytes), dtype=np.uint8)
        frames[old] = self.tail_frames[keep[old]]
        frames[~old] = root_frames[roots.searchsorted(new)]
        tail_blob = np.empty(keep.size, dtype=np.int64)
        tail_slot = np.empty(keep.size, dtype=np.int64)
        tail_blob[old], tail_slot[old] = self.tail_blob[keep[old]], self.tail_slot[keep[old]]
        tail_blob[~old], tail_slot[~old] = blob[new], slot[new]
        return frames, tail_blob, tail_slot

    def _assign_chunks(self, unique_traj: np.ndarray, ended_traj: np.ndarray, close_all: bool,
                       index: BlobIndex) -> _Chunks:
        """Chunk and slot of each new unique frame (trajectory ``unique_traj``), in write order.

        A trajectory's frames continue its open chunk, then fill new chunks of ``chunk_frames``;
        a chunk closes when full, when it is not its trajectory's last, when the trajectory
        ended, or on flush. Allocates the ids of the new chunks in ``index``.
        """
        chunk_frames = self.chunk_frames
        n_unique = unique_traj.size
        order = np.argsort(unique_traj, kind="stable")
        traj, group_start, group_count = np.unique(unique_traj[order], return_index=True, return_counts=True)
        rank = np.arange(n_unique) - np.repeat(group_start, group_count)  # place in its group
        open_pos, has_open, old_fill, old_blob = self._continued_open_chunks(traj)
        group_of = np.repeat(np.arange(traj.size), group_count)
        place = old_fill[group_of] + rank  # place in the trajectory's frames from its open chunk on
        # chunks: (group, chunk number in the group); chunk 0 of a group with an open chunk reuses its blob
        group_chunks = (old_fill + group_count + chunk_frames - 1) // chunk_frames if traj.size \
            else np.zeros(0, np.int64)
        chunk_base = exclusive_cumsum(group_chunks)
        n_chunks = int(group_chunks.sum()) if traj.size else 0
        group = np.repeat(np.arange(traj.size), group_chunks)
        number = np.arange(n_chunks) - np.repeat(chunk_base, group_chunks)
        reuse = (number == 0) & has_open[group] if n_chunks else np.zeros(0, bool)
        new_ids = index.allocate(int((~reuse).sum()))
        blob = np.empty(n_chunks, dtype=np.int64)
        blob[reuse] = old_blob[group[reuse]]
        blob[~reuse] = new_ids
        fill = np.minimum(chunk_frames, old_fill[group] + group_count[group] - number * chunk_frames) \
            if n_chunks else np.zeros(0, np.int64)
        last_of_group = number == (group_chunks[group] - 1) if n_chunks else np.zeros(0, bool)
        ended = isin(traj, ended_traj)
        closes = (fill == chunk_frames) | ~last_of_group | ended[group] | close_all if n_chunks \
            else np.zeros(0, bool)
        frame_chunk = np.empty(n_unique, dtype=np.int64)
        frame_chunk[order] = chunk_base[group_of] + place // chunk_frames
        frame_slot = np.empty(n_unique, dtype=np.int64)
        frame_slot[order] = place % chunk_frames
        return _Chunks(traj=traj, has_open=has_open, open_pos=open_pos, old_fill=old_fill, group=group,
                       blob=blob, fill=fill, reuse=reuse, closes=closes, new_ids=new_ids,
                       frame_chunk=frame_chunk, frame_slot=frame_slot)

    def _continued_open_chunks(self, traj: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per trajectory of ``traj`` (sorted): its open chunk's position in ``open_traj``, whether
        it has one, and that chunk's fill (0) and blob id (-1 without one)."""
        if self.open_traj.size and traj.size:
            open_pos = np.minimum(self.open_traj.searchsorted(traj), self.open_traj.size - 1)
            has_open = self.open_traj[open_pos] == traj
            old_fill = np.where(has_open, self.open_fill[open_pos], 0)
            old_blob = np.where(has_open, self.open_blob[open_pos], -1)
            return open_pos, has_open, old_fill, old_blob
        return (np.zeros(traj.size, dtype=np.int64), np.zeros(traj.size, dtype=bool),
                np.zeros(traj.size, dtype=np.int64), np.full(traj.size, -1, dtype=np.int64))

    def _resolve(self, rep_new: np.ndarray, unique_pos: np.ndarray,
                 chunks: _Chunks) -> tuple[np.ndarray, np.ndarray]:
        """Blob id and slot of every incoming frame: its representative's, in the tail or in a chunk."""
        n_tail = self.tail_frames.shape[0]
        n_frames = rep_new.size
        blob = np.empty(n_frames, dtype=np.int64)
        slot = np.empty(n_frames, dtype=np.int64)
        unique_ordinal = np.full(n_frames, -1, dtype=np.int64)  # incoming position -> unique ordinal
        unique_ordinal[unique_pos] = np.arange(unique_pos.size)
        from_tail = rep_new < n_tail
        blob[from_tail] = self.tail_blob[rep_new[from_tail]]
        slot[from_tail] = self.tail_slot[rep_new[from_tail]]
        incoming = ~from_tail
        ords = unique_ordinal[rep_new[incoming] - n_tail]
        blob[incoming] = chunks.blob[chunks.frame_chunk[ords]]
        slot[incoming] = chunks.frame_slot[ords]
        return blob, slot

    def _closed_chunks(self, chunks: _Chunks, root_frames: np.ndarray, unique_root: np.ndarray,
                       index: BlobIndex) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, frames per chunk, raw frames chunk-major, reopened ids)`` of the chunks that close.

        A closed chunk holds slots 0..fill-1 (its old open frames first, then new ones), so frame
        ``slot`` of closed chunk ``c`` goes to row ``start[c] + slot``: one scatter per source
        (the open buffer, the new frames) into a preallocated output, no sort, no intermediate copy.
        """
        frame_nbytes = self.frame_nbytes
        closed = chunks.closes.ravel().nonzero()[0]
        closed_ids = chunks.blob[closed]
        closed_nframes = chunks.fill[closed]
        reopened = closed[chunks.reuse[closed]]  # open chunks that close now
        reopened_ids = chunks.blob[reopened]
        old_fill = chunks.old_fill[chunks.group[reopened]]
        start = exclusive_cumsum(closed_nframes)
        total = int(closed_nframes.sum())
        new_closed = chunks.closes[chunks.frame_chunk].ravel().nonzero()[0]  # new frames of closed chunks
        dst = start[closed.searchsorted(chunks.frame_chunk[new_closed])] + chunks.frame_slot[new_closed]
        src = unique_root[new_closed]
        if self.chunk_frames == 1:
            # chunks of one frame (large frames): no chunk was open and each new frame closes
            # one, so ``dst`` is a permutation; one gather in chunk order instead of a gather and
            # a scatter (a batch of 400 113 kB stacks: one 45 MB copy fewer)
            order = np.empty(total, dtype=np.int64)
            order[dst] = np.arange(total)
            return closed_ids, closed_nframes, root_frames[src[order]], reopened_ids
        # the new frames gathered straight into chunk order (a gather and a scatter would copy
        # each twice), the slots of frames already in reopened chunks pointing at frame 0 for
        # now; those few are then copied from the open chunks over it
        pick = np.zeros(total, dtype=np.int64)
        pick[dst] = src
        closed_raw = np.empty((total, frame_nbytes), dtype=np.uint8)
        if total and root_frames.shape[0]:
            np.take(root_frames, pick, axis=0, out=closed_raw, mode="clip")  # (src is in range)
        closed_raw[ranges(start[closed.searchsorted(reopened)], old_fill)] = \
            self.open_frames.reshape(-1, frame_nbytes)[self._open_rows(reopened_ids, old_fill, index)]
        return closed_ids, closed_nframes, closed_raw, reopened_ids

    def _open_after(self, chunks: _Chunks, untouched: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(traj, blob, fill)`` of the open chunks once the plan is applied, sorted by trajectory:
        those no new frame went to, and the chunks of this plan that stay open."""
        still_open = (~chunks.closes).ravel().nonzero()[0]
        traj = np.concatenate([self.open_traj[untouched], chunks.traj[chunks.group[still_open]]])
        blob = np.concatenate([self.open_blob[untouched], chunks.blob[still_open]])
        fill = np.concatenate([self.open_fill[untouched], chunks.fill[still_open]])
        order = np.argsort(traj, kind="stable")
        return traj[order], blob[order], fill[order]

    def _open_rows(self, ids: np.ndarray, fill: np.ndarray, index: BlobIndex) -> np.ndarray:
        """Rows of ``open_frames.reshape(-1, frame_nbytes)`` holding the first ``fill`` frames of
        open blobs ``ids``."""
        return ranges(index.open_slot[ids] * self.chunk_frames, fill)

    def _dedup(self, frames: FrameColumns, frame_traj: np.ndarray,
               rules: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Representatives in the space ``[tail; frames]`` (equal bytes, exact), the dedup roots
        (positions of frames equal to nothing earlier) and the roots' bytes."""
        n_tail, n_frames, frame_nbytes = self.tail_frames.shape[0], frames.n_frames, self.frame_nbytes
        representative = np.arange(n_tail + n_frames)
        if not self.dedup:
            roots = np.arange(n_frames)
            return representative, roots, frames.take(roots)
        if rules is not None and n_frames:
            representative = self._dedup_neighbours(frames, frame_traj, rules, representative)
        roots = (representative[n_tail:] == np.arange(n_tail, n_tail + n_frames)).ravel().nonzero()[0]
        root_frames = frames.take(roots)
        # 2. Everything still unmatched (new frames, the first row of each trajectory, static
        #    screens, interleaved environments) against each other and the tail: a 64-bit hash
        #    finds candidates; every match is then confirmed byte for byte, so a collision only
        #    misses a dedup, never shares wrong data.
        n_roots = roots.size
        hashes = np.concatenate([self.tail_hash, frame_hashes(root_frames, self._coeffs)])
        _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        root_rep = first[inverse.reshape(-1)]  # in [tail; roots]: the first frame of the same hash
        # only incoming roots are resolved: duplicates inside the tail (its stacks overlap) were
        # resolved by the write that kept them, and root_rep[:n_tail] is never read
        dup = n_tail + (root_rep[n_tail:] != np.arange(n_tail, n_tail + n_roots)).ravel().nonzero()[0]
        # fresh temporaries (not kept scratch): they are a few MB that a store should not hold
        a, b = self._take(root_frames, dup), self._take(root_frames, root_rep[dup])
        if frame_nbytes % 8 == 0:
            a, b = a.view(np.uint64), b.view(np.uint64)
        confirmed = (a == b).all(1)
        collided = dup[~confirmed]
        root_rep[collided] = collided
        position = np.concatenate([np.arange(n_tail, dtype=np.int64), n_tail + roots])  # [tail; roots] -> [tail; frames]
        representative[n_tail + roots] = position[root_rep[n_tail:]]
        return representative[representative], roots, root_frames

    def _rule_runs(self, rules: np.ndarray, offsets: np.ndarray) -> list[tuple[int, ...]]:
        """:func:`rule_runs` of a layout, worked out once per (rules, field offsets)."""
        key = (rules.tobytes(), tuple(offsets.tolist()))
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = rule_runs(rules, offsets)
        return runs

    def neighbour_hits(self, frames: FrameColumns, rules: np.ndarray, out: np.ndarray) -> None:
        """Compare the frames of every row of ``frames`` with their layout neighbours, in place
        as strided views (no gathers): ``out[r, p]`` is whether frame column ``p`` of row ``r``
        equals its rule partner (``rules[p]``: in row ``r`` or ``r - 1``) bit for bit, whatever the
        trajectories (:meth:`plan` cuts those); False where there is no partner (rule ``-1``, or
        row 0 for a previous-row rule). ``out``: bool ``[n_rows, per_row]``.

        The rules come in runs (see :func:`rule_runs`): one comparison of 8-byte words per run (a
        4-frame stack with its next observation: 3 comparisons, not 7), never a loop over rows.

        Example:
            >>> frames = np.arange(5, dtype=np.uint8).repeat(8).reshape(5, 8)   # a rollout's frames 0..4
            >>> stacks = np.stack([frames[t:t + 2] for t in range(4)])          # 4 rows, stacks of 2
            >>> fam = FrameFamily(0, 8, chunk_frames=4)
            >>> hits = np.zeros((4, 2), bool)
            >>> fam.neighbour_hits(FrameColumns([stacks]), layout_rules([(("obs",), 2, True)]), hits)
            >>> hits.tolist()   # frame 0 of each row after the first is frame 1 of the row before
            [[False, False], [True, False], [True, False], [True, False]]
        """
        hi = frames.n_rows
        runs = self._rule_runs(rules, frames.offsets)
        words = self.frame_nbytes % 8 == 0
        width = self.frame_nbytes // 8 if words else self.frame_nbytes
        eq = self.scratch("rule_eq", (hi, max(r[5] for r in runs), width), bool)
        out[:hi] = False
        cells = frames.cells
        for row_delta, f, c, g, e, length, p, _q in runs:
            # a previous-row rule (row_delta 1) starts at row 1, comparing with the row before
            x = cells[f][row_delta:hi, c:c + length]
            y = cells[g][:hi - row_delta, e:e + length]
            if words:
                x, y = x.view(np.uint64), y.view(np.uint64)
            np.equal(x, y, out=eq[:hi - row_delta, :length]).all(-1, out=out[row_delta:hi, p:p + length])

    def _dedup_neighbours(self, frames: FrameColumns, frame_traj: np.ndarray, rules: np.ndarray,
                          representative: np.ndarray) -> np.ndarray:
        """1. The layout's own neighbours: a stacked frame equals the next frame of the previous
        row's stack, and a next observation's frames equal the observation's. Bit-exact equality
        (:meth:`neighbour_hits`) inside one trajectory is the criterion. Returns ``representative`` with the matches applied.
        """
        n_tail = self.tail_frames.shape[0]
        per_row, n_rows = frames.per_row, frames.n_rows
        hits = self.scratch("rule_hits", (n_rows, per_row), bool)
        self.neighbour_hits(frames, rules, hits)
        delta, partner = rules[:, 0], rules[:, 1]
        row_traj = frame_traj[::per_row]
        # a previous-row match counts inside one trajectory only (row r continues row r - 1's)
        cut = np.concatenate([[True], row_traj[1:] != row_traj[:-1]])
        rows, p = (hits & ~(cut[:, None] & (delta == 1))).nonzero()
        base = n_tail + rows * per_row
        representative[base + p] = base - delta[p] * per_row + partner[p]
        # chains (a frame -> its neighbour -> ...) are at most per_row long: pointer jumping
        for _ in range(int(np.ceil(np.log2(per_row + 1))) + 1):
            representative = representative[representative]
        return representative

    def scratch(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A reused buffer: fresh multi-MB temporaries cost page faults on every write. Past
        :data:`SCRATCH_MAX_BYTES` (a large batched write) a fresh array: a family does not keep
        holding a buffer sized for its largest write."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if n > SCRATCH_MAX_BYTES:
            return np.empty(shape, dtype=dtype)
        buf = self._scratch.get(name)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, int(buf.size * 1.5) if buf is not None else 0), dtype=np.uint8)
            self._scratch[name] = buf
        return buf[:n].view(dtype).reshape(shape)

    @property
    def scratch_nbytes(self) -> int:
        """Bytes of the reused buffers this family holds (at most :data:`SCRATCH_MAX_BYTES` each)."""
        return sum(int(b.nbytes) for b in self._scratch.values())

    def _take(self, frames: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of the virtual concatenation ``[tail; frames]`` without building it."""
        n_tail = self.tail_frames.shape[0]
        out = np.empty((idx.size, self.frame_nbytes), dtype=np.uint8)
        if frames.shape[0]:
            np.take(frames, np.maximum(idx - n_tail, 0), axis=0, out=out, mode="clip")
        m = idx < n_tail
        out[m] = self.tail_frames[idx[m]]
        return out

    def commit(self, plan: FramePlan, index: BlobIndex) -> np.ndarray:
        """Apply a plan after its closed chunks were placed; return blob ids to delete (tail unpins)."""
        # free open-buffer slots of chunks that closed
        index.dirty.mark(plan.reopened_closed)
        index.dirty.mark(plan.open_blob)
        slots = index.open_slot[plan.reopened_closed]
        self._free_open_slots = np.concatenate([self._free_open_slots, slots])
        index.open_slot[plan.reopened_closed] = -1
        # open chunks: newly opened blobs need a buffer slot
        new_open = plan.open_blob[index.state[plan.open_blob] != OPEN] if plan.open_blob.size else plan.open_blob
        if new_open.size:
            need = new_open.size - self._free_open_slots.size
            if need > 0:
                old = self.open_frames.shape[0]
                grow = max(need, old)
                self.open_frames = np.concatenate(
                    [self.open_frames, np.empty((grow, self.chunk_frames, self.frame_nbytes), dtype=np.uint8)])
                self._free_open_slots = np.concatenate([self._free_open_slots, np.arange(old, old + grow)])
            index.open_slot[new_open] = self._free_open_slots[: new_open.size]
            self._free_open_slots = self._free_open_slots[new_open.size:]
            index.state[new_open] = OPEN
        rows = index.open_slot[plan.open_writes_blob] * self.chunk_frames + plan.open_writes_slot
        self.open_frames.reshape(-1, self.frame_nbytes)[rows] = plan.open_writes_frame
        self.open_traj, self.open_blob, self.open_fill = plan.open_traj, plan.open_blob, plan.open_fill
        index.raw_nbytes[plan.open_blob] = plan.open_fill * self.frame_nbytes
        # tail: pin new, unpin old
        index.incref(plan.tail_blob)
        dead = index.decref(self.tail_blob)
        self.tail_frames, self.tail_blob, self.tail_slot = plan.tail_frames, plan.tail_blob, plan.tail_slot
        self.tail_hash = plan.tail_hash
        return dead

    def drop_open(self, ids: np.ndarray, index: BlobIndex) -> None:
        """Forget open chunks whose blobs were deleted (no row references them any more)."""
        ids = ids[index.state[ids] == OPEN]
        self._free_open_slots = np.concatenate([self._free_open_slots, index.open_slot[ids]])
        keep = ~isin(self.open_blob, ids)
        self.open_traj, self.open_blob, self.open_fill = (
            self.open_traj[keep], self.open_blob[keep], self.open_fill[keep])

    def open_raw(self, ids: np.ndarray, index: BlobIndex) -> np.ndarray:
        """Raw frames ``[len(ids), chunk_frames, frame_nbytes]`` of open blobs."""
        if not ids.size:  # (most sampled batches read stored chunks only: no gathers)
            return self.open_frames[:0]
        return self.open_frames[index.open_slot[ids]]

    def release_tail(self, index: BlobIndex) -> np.ndarray:
        dead = index.decref(self.tail_blob)
        self.tail_frames = self.tail_frames[:0]
        self.tail_hash = self.tail_hash[:0]
        self.tail_blob = self.tail_blob[:0]
        self.tail_slot = self.tail_slot[:0]
        return dead
