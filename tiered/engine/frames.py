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
   of ``chunk_frames`` (K) frames. The last, partial chunk of a trajectory stays *open* (raw, in
   a per-family buffer) until it fills, the trajectory ends (a done flag), or ``flush()``.
   Closed chunks are returned for one batched encode.

Everything is vectorized over frames: the Python call count does not grow with the batch.
:meth:`commit` applies a plan once the store has placed the encoded blobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..index import OPEN, BlobIndex
from ..util.batch import exclusive_cumsum, isin, ranges

__all__ = ["FrameFamily", "FramePlan", "FrameColumns", "layout_rules"]

_HASH_SEED = 0x9E3779B97F4A7C15


def _hash_coeffs(n_words: int) -> np.ndarray:
    rng = np.random.default_rng(12345)
    return rng.integers(1, 2**63, size=n_words, dtype=np.uint64) | np.uint64(1)


def frame_hashes(frames: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """64-bit hash of each row of a ``[n, nbytes]`` uint8 array (used only to find candidates).

    ``sum(word[i] * coeff[i])`` over the row's 8-byte words with odd random coefficients, in
    uint64 arithmetic (wraps by definition): a change in any single word changes the hash.
    """
    n, nbytes = frames.shape
    n_words = nbytes // 8
    h = np.zeros(n, dtype=np.uint64)
    if n_words:
        h = frames[:, : n_words * 8].view(np.uint64) @ coeffs[:n_words]
    rest = nbytes - n_words * 8
    if rest:
        tail = frames[:, n_words * 8:].astype(np.uint64)
        h = h * np.uint64(_HASH_SEED) + tail @ coeffs[n_words: n_words + rest]
    return h


def layout_rules(columns: list[tuple[tuple[str, ...], int, bool]]) -> np.ndarray | None:
    """Neighbour rules of a family's frame layout (see :meth:`FrameFamily.plan`).

    Args:
        columns: per field of the family, in layout order: (key, frames per row, stacked).

    Returns:
        ``[P, 2]`` rules, or ``None`` when the layout has no neighbours to compare.

    Example:
        >>> layout_rules([(("observation",), 2, True), (("next", "observation"), 2, True)]).tolist()
        [[1, 1], [1, 3], [0, 1], [-1, 0]]
    """
    offsets, total = {}, 0
    for key, F, _ in columns:
        offsets[key] = total
        total += F
    rules = np.full((total, 2), -1, dtype=np.int64)
    rules[:, 1] = 0
    for key, F, stacked in columns:
        o = offsets[key]
        is_next = len(key) > 1 and key[0] == "next"
        partner = key[1:] if is_next else ("next",) + key
        po = offsets.get(partner)
        if is_next and po is not None:
            if stacked:  # next[t][j] == obs[t][j + 1]
                rules[o:o + F - 1] = np.stack([np.zeros(F - 1, np.int64), po + np.arange(1, F)], 1)
            continue
        if stacked:  # obs[t][j] == obs[t - 1][j + 1]
            rules[o:o + F - 1] = np.stack([np.ones(F - 1, np.int64), o + np.arange(1, F)], 1)
        if po is not None:  # newest frame: obs[t][-1] == next[t - 1][-1]
            rules[o + F - 1] = (1, po + F - 1)
    return rules if (rules[:, 0] >= 0).any() else None


class FrameColumns:
    """The incoming frames of one family as ``n`` rows of ``P`` columns, without copying them.

    Each field contributes ``[n, F, nbytes]`` (a view of the caller's tensor); frame position
    ``q = row * P + column`` addresses the virtual row-major concatenation. Only the frames that
    are actually needed (new unique frames, the tail) are ever gathered.
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
        """Column ``p`` as an ``[n, nbytes]`` view."""
        f = int(np.searchsorted(self.offsets, p, side="right")) - 1
        return self.cells[f][:, p - self.offsets[f]]

    def take(self, q: np.ndarray) -> np.ndarray:
        """Frames at positions ``q`` (a copy, ``[len(q), nbytes]``); one gather per field."""
        out = np.empty((q.size, self.frame_nbytes), dtype=np.uint8)
        row, colp = np.divmod(q, self.per_row)
        for f, c in enumerate(self.cells):  # a loop over the family's fields, not over frames
            sel = np.flatnonzero((colp >= self.offsets[f]) & (colp < self.offsets[f + 1]))
            out[sel] = c[row[sel], colp[sel] - self.offsets[f]]
        return out


@dataclass
class FramePlan:
    """Where every incoming frame goes, and which chunks are ready to encode."""

    blob: np.ndarray            # [M] blob id of each incoming frame (new ids already allocated)
    slot: np.ndarray            # [M] slot of the frame inside its blob
    new_ids: np.ndarray         # blob ids allocated by this plan (closed and open)
    closed_ids: np.ndarray      # blob ids to encode now
    closed_raw: np.ndarray      # [sum frames, nbytes] raw frames of the closed chunks, chunk-major
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
    unique_new: int = 0


class FrameFamily:
    """Dedup and chunking state of one frame family. See the module docstring."""

    def __init__(self, family_id: int, frame_nbytes: int, chunk_frames: int, tail_rows: int = 8,
                 dedup: bool = True):
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.family_id = family_id
        self.frame_nbytes = int(frame_nbytes)
        self.chunk_frames = int(chunk_frames)
        self.tail_rows = int(tail_rows)
        self.dedup = dedup
        self._coeffs = _hash_coeffs(self.frame_nbytes // 8 + 8)
        # Open chunks, sorted by trajectory id.
        self.open_traj = np.empty(0, dtype=np.int64)
        self.open_blob = np.empty(0, dtype=np.int64)
        self.open_fill = np.empty(0, dtype=np.int64)
        # Raw frames of open chunks: pend[slot] holds K frames; index.open_slot[blob] = slot.
        # one open chunk per live trajectory; grows (doubling) with the number of environments
        self.open_frames = np.empty((8 if self.chunk_frames > 1 else 0, self.chunk_frames, self.frame_nbytes), dtype=np.uint8)
        self._pend_free = np.arange(self.open_frames.shape[0], dtype=np.int64)
        # Raw frames of the previous write's last rows (pins their blobs in the index).
        self.tail_frames = np.empty((0, self.frame_nbytes), dtype=np.uint8)
        self.tail_hash = np.empty(0, dtype=np.uint64)
        self._scratch: dict[str, np.ndarray] = {}
        self.tail_blob = np.empty(0, dtype=np.int64)
        self.tail_slot = np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------------------------------
    def plan(self, frames: FrameColumns, frame_traj: np.ndarray, ended_traj: np.ndarray,
             tail_mask: np.ndarray, index: BlobIndex, close_all: bool = False,
             rules: np.ndarray | None = None) -> FramePlan:
        """Plan the storage of ``frames`` (``n`` rows of ``P`` frames, in write order).

        Args:
            frames: incoming frames, row-major in time order (``n`` rows of ``P`` frames).
            frame_traj: trajectory id of each frame.
            ended_traj: sorted trajectory ids that end in this batch (their chunks close).
            tail_mask: frames to keep raw as the tail for the next write.
            index: the blob index (ids for new chunks are allocated here; the caller releases
                ``plan.new_ids`` if placement fails).
            close_all: close every chunk, open ones included (used by ``flush``).
            rules: ``[P, 2]`` int array: frame column ``p`` of a row is expected to equal column
                ``rules[p, 1]`` of the previous row of its trajectory (``rules[p, 0] == 1``) or of
                its own row (``0``); ``-1``: no expectation. See :func:`layout_rules`.
        """
        M = frames.n_frames
        T = self.tail_frames.shape[0]
        nb = self.frame_nbytes
        rep, roots, root_frames = self._dedup(frames, frame_traj, rules)
        rep_new = rep[T:]
        own = rep_new == np.arange(T, T + M)
        u_idx = np.flatnonzero(own)                    # incoming positions of new unique frames
        U = u_idx.size

        # -- chunk assignment of the new unique frames, per trajectory, in write order --------
        u_traj = frame_traj[u_idx]
        order = np.argsort(u_traj, kind="stable")
        st = u_traj[order]
        g_traj, g_start, g_count = np.unique(st, return_index=True, return_counts=True)
        rank = np.arange(U) - np.repeat(g_start, g_count)
        # existing open chunk per group
        if self.open_traj.size and g_traj.size:
            pos_in_open_c = np.minimum(np.searchsorted(self.open_traj, g_traj), self.open_traj.size - 1)
            has_open = self.open_traj[pos_in_open_c] == g_traj
            fill0 = np.where(has_open, self.open_fill[pos_in_open_c], 0)
            blob0 = np.where(has_open, self.open_blob[pos_in_open_c], -1)
        else:
            pos_in_open_c = np.zeros(g_traj.size, dtype=np.int64)
            has_open = np.zeros(g_traj.size, dtype=bool)
            fill0 = np.zeros(g_traj.size, dtype=np.int64)
            blob0 = np.full(g_traj.size, -1, dtype=np.int64)
        g_of = np.repeat(np.arange(g_traj.size), g_count)
        p = fill0[g_of] + rank
        chunk_no = p // self.chunk_frames
        slot_sorted = p % self.chunk_frames
        # chunks: (group, chunk_no); chunk 0 of a group with an open chunk reuses its blob
        n_chunks_g = (fill0 + g_count + self.chunk_frames - 1) // self.chunk_frames if g_traj.size else np.zeros(0, np.int64)
        chunk_base = exclusive_cumsum(n_chunks_g)
        total_chunks = int(n_chunks_g.sum()) if g_traj.size else 0
        chunk_group = np.repeat(np.arange(g_traj.size), n_chunks_g)
        chunk_local = np.arange(total_chunks) - np.repeat(chunk_base, n_chunks_g)
        reuse = (chunk_local == 0) & has_open[chunk_group] if total_chunks else np.zeros(0, bool)
        new_ids = index.allocate(int((~reuse).sum()))
        chunk_blob = np.empty(total_chunks, dtype=np.int64)
        chunk_blob[reuse] = blob0[chunk_group[reuse]]
        chunk_blob[~reuse] = new_ids
        chunk_fill = np.minimum(self.chunk_frames, fill0[chunk_group] + g_count[chunk_group] - chunk_local * self.chunk_frames) \
            if total_chunks else np.zeros(0, np.int64)
        # a chunk closes when full, when its trajectory ended, when it is not the group's last one,
        # or on flush
        last_of_group = chunk_local == (n_chunks_g[chunk_group] - 1) if total_chunks else np.zeros(0, bool)
        ended = isin(g_traj, ended_traj)
        closes = (chunk_fill == self.chunk_frames) | ~last_of_group | ended[chunk_group] | close_all if total_chunks \
            else np.zeros(0, bool)

        # blob/slot of each new unique frame (in u order)
        u_chunk = np.empty(U, dtype=np.int64)
        u_chunk[order] = chunk_base[g_of] + chunk_no
        u_slot = np.empty(U, dtype=np.int64)
        u_slot[order] = slot_sorted

        # -- resolve every incoming frame ------------------------------------------------------
        blob = np.empty(M, dtype=np.int64)
        slot = np.empty(M, dtype=np.int64)
        # map incoming position -> its unique ordinal
        ord_of_pos = np.full(M, -1, dtype=np.int64)
        ord_of_pos[u_idx] = np.arange(U)
        from_tail = rep_new < T
        blob[from_tail] = self.tail_blob[rep_new[from_tail]]
        slot[from_tail] = self.tail_slot[rep_new[from_tail]]
        inb = ~from_tail
        ords = ord_of_pos[rep_new[inb] - T]
        blob[inb] = chunk_blob[u_chunk[ords]]
        slot[inb] = u_slot[ords]

        # -- raw frames of closed chunks, chunk-major -----------------------------------------
        closed = np.flatnonzero(closes)
        closed_ids = chunk_blob[closed]
        closed_nframes = chunk_fill[closed]
        # frames from the open buffer (slots < fill0 of reused chunks) ...
        reo = closed[reuse[closed]]
        reopened_closed = chunk_blob[reo]
        old_fill = fill0[chunk_group[reo]]
        pend_slot = index.open_slot[chunk_blob[reo]]
        pend_rows = ranges(pend_slot * self.chunk_frames, old_fill)
        # A closed chunk holds slots 0..fill-1 (its old open frames first, then new ones), so
        # frame `slot` of closed chunk `c` goes to row start[c] + slot, chunk-major: one scatter
        # per source into a preallocated output, no sort and no intermediate copy.
        start = exclusive_cumsum(closed_nframes)
        closed_raw = np.empty((int(closed_nframes.sum()), nb), dtype=np.uint8)
        closed_raw[ranges(start[np.searchsorted(closed, reo)], old_fill)] = self.open_frames.reshape(-1, nb)[pend_rows]
        # ... and new frames (new unique frames are all dedup roots: take them from the roots)
        u_closed = isin(u_chunk, closed)
        u_sel = np.flatnonzero(u_closed)
        u_root = np.searchsorted(roots, u_idx)
        closed_raw[start[np.searchsorted(closed, u_chunk[u_sel])] + u_slot[u_sel]] = root_frames[u_root[u_sel]]

        # -- open chunks after this plan -------------------------------------------------------
        still_open = np.flatnonzero(~closes)
        keep_old = np.ones(self.open_traj.size, dtype=bool)
        touched = pos_in_open_c[has_open]
        keep_old[touched] = False  # re-listed below if still open
        o_traj = np.concatenate([self.open_traj[keep_old], g_traj[chunk_group[still_open]]])
        o_blob = np.concatenate([self.open_blob[keep_old], chunk_blob[still_open]])
        o_fill = np.concatenate([self.open_fill[keep_old], chunk_fill[still_open]])
        if close_all:
            # every other open chunk closes too: add their raw frames
            extra_ids = self.open_blob[keep_old]
            extra_fill = self.open_fill[keep_old]
            if extra_ids.size:
                rows = ranges(index.open_slot[extra_ids] * self.chunk_frames, extra_fill)
                closed_raw = np.concatenate([closed_raw, self.open_frames.reshape(-1, nb)[rows]])
                closed_ids = np.concatenate([closed_ids, extra_ids])
                closed_nframes = np.concatenate([closed_nframes, extra_fill])
                reopened_closed = np.concatenate([reopened_closed, extra_ids])
            o_traj, o_blob, o_fill = (np.empty(0, np.int64),) * 3
        srt = np.argsort(o_traj, kind="stable")
        # frames that go into open buffers
        u_open = np.flatnonzero(~u_closed)
        # -- tail for the next write: raw frames + their blob refs --------------------------
        tmask = np.asarray(tail_mask, dtype=bool)
        tpos = np.flatnonzero(tmask)
        tail_frames = frames.take(tpos)
        return FramePlan(
            blob=blob, slot=slot, new_ids=new_ids, closed_ids=closed_ids, closed_raw=closed_raw,
            closed_nframes=closed_nframes.astype(np.int64),
            open_traj=o_traj[srt], open_blob=o_blob[srt], open_fill=o_fill[srt].astype(np.int64),
            open_writes_blob=chunk_blob[u_chunk[u_open]], open_writes_slot=u_slot[u_open],
            open_writes_frame=root_frames[u_root[u_open]],
            reopened_closed=reopened_closed,
            tail_frames=tail_frames, tail_hash=frame_hashes(tail_frames, self._coeffs),
            tail_blob=blob[tpos], tail_slot=slot[tpos], unique_new=U,
        )

    def _dedup(self, frames: FrameColumns, frame_traj: np.ndarray,
               rules: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Representatives in the space ``[tail; frames]`` (equal bytes, exact), the dedup roots
        (positions of frames equal to nothing earlier) and the roots' bytes."""
        T, M, nb = self.tail_frames.shape[0], frames.n_frames, self.frame_nbytes
        rep = np.arange(T + M)
        if not self.dedup:
            roots = np.arange(M)
            return rep, roots, frames.take(roots)
        if rules is not None and M:
            # 1. The layout's own neighbours, compared in place as strided views (no gathers):
            #    a stacked frame equals the next frame of the previous row's stack, and a next
            #    observation's frames equal the observation's. A loop over the P frame columns of
            #    the layout, never over rows.
            P, n = frames.per_row, frames.n_rows
            row_traj = frame_traj[::P]
            same_prev = np.zeros(n, dtype=bool)
            same_prev[1:] = row_traj[1:] == row_traj[:-1]
            base = T + np.arange(n, dtype=np.int64) * P
            words = nb // 8 if nb % 8 == 0 else nb
            eq = self.scratch("rule_eq", (n, words), bool)

            def col(p: int) -> np.ndarray:
                c = frames.col(p)
                return c.view(np.uint64) if nb % 8 == 0 else c

            for p in range(P):
                dr, c = int(rules[p, 0]), int(rules[p, 1])
                if dr == 0:
                    hit = np.equal(col(p), col(c), out=eq).all(-1)
                    rep[base[hit] + p] = base[hit] + c
                elif dr == 1:
                    hit = np.zeros(n, dtype=bool)
                    hit[1:] = np.equal(col(p)[1:], col(c)[:-1], out=eq[1:]).all(-1)
                    hit &= same_prev
                    rep[base[hit] + p] = base[hit] - P + c
            # chains (a frame -> its neighbour -> ...) are at most P long: pointer jumping
            for _ in range(int(np.ceil(np.log2(P + 1))) + 1):
                rep = rep[rep]
        roots = np.flatnonzero(rep[T:] == np.arange(T, T + M))
        root_frames = frames.take(roots)
        # 2. Everything still unmatched (new frames, the first row of each trajectory, static
        #    screens, interleaved environments) against each other and the tail: a 64-bit hash
        #    finds candidates; every match is then confirmed byte for byte, so a collision only
        #    misses a dedup, never shares wrong data.
        R = roots.size
        h = np.concatenate([self.tail_hash, frame_hashes(root_frames, self._coeffs)])
        _, first, inv = np.unique(h, return_index=True, return_inverse=True)
        rrep = first[inv.reshape(-1)]
        # only incoming roots are resolved: duplicates inside the tail (its stacks overlap) were
        # resolved by the write that kept them, and rrep[:T] is never read
        dup = T + np.flatnonzero(rrep[T:] != np.arange(T, T + R))
        # fresh temporaries (not kept scratch): they are a few MB that a store should not hold
        a, b = self._take(root_frames, dup), self._take(root_frames, rrep[dup])
        if nb % 8 == 0:
            a, b = a.view(np.uint64), b.view(np.uint64)
        ok = (a == b).all(1)
        bad = dup[~ok]
        rrep[bad] = bad
        glob = np.concatenate([np.arange(T, dtype=np.int64), T + roots])
        rep[T + roots] = glob[rrep[T:]]
        return rep[rep], roots, root_frames

    def scratch(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A reused buffer: fresh multi-MB temporaries cost page faults on every write."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buf = self._scratch.get(name)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, int(buf.size * 1.5) if buf is not None else 0), dtype=np.uint8)
            self._scratch[name] = buf
        return buf[:n].view(dtype).reshape(shape)

    def _take(self, frames: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of the virtual concatenation ``[tail; frames]`` without building it."""
        T = self.tail_frames.shape[0]
        out = np.empty((idx.size, self.frame_nbytes), dtype=np.uint8)
        if frames.shape[0]:
            np.take(frames, np.maximum(idx - T, 0), axis=0, out=out, mode="clip")
        m = idx < T
        out[m] = self.tail_frames[idx[m]]
        return out

    def commit(self, plan: FramePlan, index: BlobIndex) -> np.ndarray:
        """Apply a plan after its closed chunks were placed; return blob ids to delete (tail unpins)."""
        # free open-buffer slots of chunks that closed
        slots = index.open_slot[plan.reopened_closed]
        self._pend_free = np.concatenate([self._pend_free, slots])
        index.open_slot[plan.reopened_closed] = -1
        # open chunks: newly opened blobs need a buffer slot
        new_open = plan.open_blob[index.state[plan.open_blob] != OPEN] if plan.open_blob.size else plan.open_blob
        if new_open.size:
            need = new_open.size - self._pend_free.size
            if need > 0:
                old = self.open_frames.shape[0]
                grow = max(need, old)
                self.open_frames = np.concatenate([self.open_frames, np.empty((grow, self.chunk_frames, self.frame_nbytes), dtype=np.uint8)])
                self._pend_free = np.concatenate([self._pend_free, np.arange(old, old + grow)])
            index.open_slot[new_open] = self._pend_free[: new_open.size]
            self._pend_free = self._pend_free[new_open.size:]
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
        self._pend_free = np.concatenate([self._pend_free, index.open_slot[ids]])
        keep = ~isin(self.open_blob, ids)
        self.open_traj, self.open_blob, self.open_fill = (
            self.open_traj[keep], self.open_blob[keep], self.open_fill[keep])

    def open_raw(self, ids: np.ndarray, index: BlobIndex) -> np.ndarray:
        """Raw frames ``[len(ids), K, nbytes]`` of open blobs."""
        return self.open_frames[index.open_slot[ids]]

    def release_tail(self, index: BlobIndex) -> np.ndarray:
        dead = index.decref(self.tail_blob)
        self.tail_frames = self.tail_frames[:0]
        self.tail_hash = self.tail_hash[:0]
        self.tail_blob = self.tail_blob[:0]
        self.tail_slot = self.tail_slot[:0]
        return dead
