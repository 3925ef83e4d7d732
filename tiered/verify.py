"""Check a store on disk: every file the manifest names, and every blob's checksum.

:func:`verify_store` reads the store the way docs/format.md describes it, independently of the
code that wrote it (the verifier must not share the writer's bugs):

1. ``manifest.json``: present, valid JSON, its SHA-256, its format name and version;
2. every ``.npy`` file of the current commit: a regular file, present, the size the manifest
   records, a valid ``.npy`` header that accounts for the file's size, and the CRC-32 of each
   1 MiB page;
3. every cold segment: present and at least as long as the manifest says (HDF5 segments: an
   HDF5 file whose ``blobs`` dataset sits at the recorded offset);
4. every live blob: its compressed bytes are read from the cold tier in large sequential reads
   (about 64 MiB at a time) and their checksums computed in one vectorized call per read and
   compared with the index; with ``decode=True`` they are also decompressed;
5. the index: ``free_ids`` lists exactly the free ids; no free or deferred cold extent
   overlaps a stored blob or another extent; row tables saved as another's shifted by one expand;
6. the row tables: every written row points at stored blobs of its field's family, at a slot
   inside the blob; stored reference counts are at least a recount (one bincount);
7. finally, with ``open_check=True`` (the default; ``tiered verify --open``), the store is opened
   read-only through :func:`tiered.open`, as a user would (the array pages checked in step 2 are
   not checksummed a second time). Steps 1-6 need numpy and zstandard only; this one imports
   torch, so the ``tiered verify`` command runs it only when asked.

A damaged blob is reported with the field and rows that use it, the segment file and the byte
offset of the blob in that file.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> from tiered.verify import verify_store
    >>> d = tempfile.mkdtemp() + "/s"
    >>> with TieredStore(10, d) as s:
    ...     _ = s.extend(TensorDict({"x": torch.arange(4.0).view(4, 1, 1).expand(4, 64, 64)}, [4]))
    >>> report = verify_store(d, progress=False)
    >>> report.ok, report.blobs_checked  # the four frames of one write share one compressed chunk
    (True, 1)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .durable.array_files import ARRAYS_DIR, UndoChain, read_intent
from .durable.checked_maps import load_checked
from .durable.commit_arrays import array_path, expand_derived, page_checksums_of
from .durable.manifest import MANIFEST, arrays_verified, load_npy, read_manifest
from .engine.blob_index import free_pool_problem, impossible_raw_sizes
from .errors import ChecksumError, CorruptionError, FormatVersionError, NotATieredStoreError, TieredError
from .util import fileio
from .util.batch import extents_overlap
from .util.progress import progress_bar
from .util.segments import hdf5_segment_problem, segment_name, segment_problem

__all__ = ["Problem", "Report", "verify_store"]

_STORED = 2  # index.state of a blob whose bytes are in the cold tier (docs/format.md)
_COLD = 2  # column of index.loc holding the cold offset
_BATCH_BYTES = 64 << 20  # bytes of one read of a segment file
_MAX_ROWS_LISTED = 20


@dataclass
class Problem:
    """One thing wrong with a store.

    Attributes:
        kind: ``"manifest"``, ``"missing"``, ``"truncated"``, ``"file"``, ``"index"``,
            ``"checksum"``, ``"decode"`` or ``"open"``.
        message: what is wrong, in words.
        file: the file concerned.
        offset: byte offset in ``file`` (damaged blobs).
        field: the field whose data is affected.
        rows: the first affected rows (at most 20); ``n_rows`` counts all of them.
        blob: the blob id.
    """

    kind: str
    message: str
    file: str | None = None
    offset: int | None = None
    field: str | None = None
    rows: list[int] = dataclasses.field(default_factory=list)
    n_rows: int = 0
    blob: int | None = None

    def __str__(self) -> str:
        parts = [self.message]
        if self.file is not None:
            parts.append(f"file {self.file}" + (f" at byte {self.offset}" if self.offset is not None else ""))
        if self.field is not None:
            more = f" (+{self.n_rows - len(self.rows)} more)" if self.n_rows > len(self.rows) else ""
            parts.append(f"field {self.field!r} rows {self.rows}{more}")
        return "; ".join(parts)


@dataclass
class Report:
    """Result of :func:`verify_store`. ``ok`` is true when no problem was found."""

    path: str
    format_version: int | None = None
    generation: int | None = None
    rows: int | None = None
    capacity: int | None = None
    codec: str | None = None
    files_checked: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    problems: list[Problem] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, kind: str, message: str, **kw: Any) -> None:
        self.problems.append(Problem(kind, message, **kw))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def summary(self) -> str:
        """A few human lines: what was checked, then one line per problem."""
        head = (
            f"{self.path}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'}; checked "
            f"{self.files_checked} files, {self.blobs_checked} blobs ({self.bytes_checked:,} bytes) "
            f"in {self.seconds:.2f} s"
        )
        return "\n".join([head, *(f"  {p.kind}: {p}" for p in self.problems)])


def verify_store(
    path: str | os.PathLike[str],
    progress: bool | None = True,
    *,
    decode: bool = False,
    open_check: bool = True,
) -> Report:
    """Check every file and every blob checksum of a store (read-only; see the module docstring).

    Args:
        path: the store directory.
        progress: show a progress bar over the blob bytes (``None``: only on a terminal).
        decode: also decompress every blob (slower; checks the codec's framing too).
        open_check: last, open the store read-only through :func:`tiered.open` (step 7; imports
            torch); only when steps 1-6 found nothing.

    Returns:
        A :class:`Report`; ``report.ok`` is true when nothing is wrong.

    Raises:
        NotATieredStoreError: ``path`` is not a store at all (no manifest and no store files).
        FormatVersionError: the store was written in a format this tiered cannot read.
    """
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    for _attempt in range(8):  # a writer committing in a loop can move on under a few checks in a row
        report = Report(path)
        try:
            _StoreCheck(path, report, progress, decode, open_check).run()
        except (NotATieredStoreError, FormatVersionError):
            raise
        except (TieredError, ValueError, TypeError, KeyError, IndexError, ArithmeticError, MemoryError,
                RecursionError, AssertionError, OSError) as e:
            # damage no step foresaw: still a finding, never a raw error out of verify
            report.add("file", f"verify stopped on {type(e).__name__}: {str(e)[:300]}")
        finally:
            report.seconds = time.perf_counter() - t0
        # A writer may commit while we read (it then removes the old generation and reuses space
        # the new one freed): problems seen under a generation that is no longer current are
        # checked again against the new one.
        if report.ok or report.generation is None or _current_generation(path) == report.generation:
            break
    return report


def _current_generation(path: str) -> int | None:
    try:
        return int(read_manifest(path)["generation"])
    except (TieredError, KeyError, TypeError, ValueError):
        return None


@dataclass
class _Segments:
    """The cold segments as the manifest describes them, and which of them can be read."""

    dir: str
    backend: str
    segment_bytes: int
    sizes: list[int]
    data_offsets: list[int]
    ok: list[bool] = dataclasses.field(default_factory=list)

    def file(self, i: int) -> str:
        return os.path.join(self.dir, segment_name(self.backend, i))


@dataclass
class _Blobs:
    """The live blobs whose cold location lies inside the segments, in file order."""

    ids: np.ndarray
    size: np.ndarray
    segment: np.ndarray
    in_segment: np.ndarray  # byte offset inside the segment's data


def _family_key(spec: dict[str, Any]) -> tuple[Any, tuple[int, ...]]:
    """A blob field's frame family as its schema entry gives it: (dtype, shape of one frame)."""
    shape = tuple(spec.get("shape", ()))
    fd = spec.get("frame_dim")
    return spec.get("dtype"), shape[:fd] + shape[fd + 1:] if isinstance(fd, int) and 0 <= fd < len(shape) else shape


class _StoreCheck:
    """The steps of one :func:`verify_store` pass, in order (see the module docstring).

    Each step records what it finds in ``report``; a step returns ``False`` when what it found
    leaves nothing for the later steps to check.
    """

    def __init__(self, path: str, report: Report, progress: bool | None, decode: bool, open_check: bool):
        self.path, self.report = path, report
        self.progress, self.decode, self.open_check = progress, decode, open_check
        self.manifest_file = os.path.join(path, MANIFEST)
        self.body: dict[str, Any] = {}
        self.files: dict[str, int] = {}
        self.cold: dict[str, Any] = {}
        self.schema: list[dict[str, Any]] = []
        self.arrays_dir = os.path.join(self.path, ARRAYS_DIR)
        self.arrays: dict[str, np.ndarray] = {}
        # index columns, read by check_blob_locations
        self.state = np.empty(0)
        self.live = np.empty(0, np.int64)  # ids of the stored blobs
        self.sums = np.empty(0)
        self.codecs_col = np.empty(0)
        self.raw_col = np.empty(0)
        self.bad_ids: dict[int, tuple[str, str, int | None]] = {}  # blob -> (kind, file, offset)
        self.listed: set[int] = set()  # damaged blobs reported with the rows that use them
        self.verified_files: list[str] = []  # array files whose page checksums matched

    def run(self) -> None:
        """The checks, in the order they run; one that returns ``False`` leaves nothing for the
        later ones to check."""
        if not self.check_manifest():
            return
        if not self.check_array_files():
            return
        segments = self.check_segments()
        blobs = self.check_blob_locations(segments)
        if blobs is None:
            return
        self.check_checksums(blobs, segments)
        self.check_raw_sizes()
        self.check_index_pools()
        self.check_derived_tables()
        if not self.check_row_tables():
            return
        self.check_references()
        self.report_damage_no_row_uses()
        if self.report.ok and self.open_check:
            self.check_open()

    def file_of(self, name: str) -> str:
        """The file of array ``name`` in the commit verified."""
        try:
            return array_path(self.path, self.body, name)
        except CorruptionError:
            return os.path.join(self.arrays_dir, name + ".npy")

    # 1. the manifest ---------------------------------------------------------------------------
    def check_manifest(self) -> bool:
        report, path = self.report, self.path
        try:
            body = read_manifest(path)
        except FormatVersionError:
            raise
        except NotATieredStoreError:
            looks_like_store = os.path.isdir(path) and any(n in ("cold", ARRAYS_DIR) for n in os.listdir(path))
            if not looks_like_store:
                raise
            report.add(
                "manifest",
                f"{MANIFEST} is missing but the directory holds store files ({ARRAYS_DIR}/, cold/): "
                "the store's commit record is lost",
                file=self.manifest_file,
            )
            return False
        except CorruptionError as e:
            report.add("manifest", str(e), file=self.manifest_file)
            return False
        report.files_checked += 1
        try:
            report.format_version = int(body["format_version"])
            report.generation = int(body["generation"])
            report.capacity = int(body["capacity"])
            report.rows = int(body["len"])
            report.codec = str(body.get("codec"))
            self.files = dict(body["files"])
            self.cold = dict(body["cold"])
            self.schema = body.get("schema") or []  # [] before the first write
            if not isinstance(self.schema, list) or not all(isinstance(f, dict) for f in self.schema):
                raise TypeError("the schema is not a list of field entries")
        except (KeyError, TypeError, ValueError) as e:
            report.add(
                "manifest",
                f"the manifest body lacks or garbles a required entry ({type(e).__name__}: {e})",
                file=self.manifest_file,
            )
            return False
        self.body = body
        if not (0 <= report.rows <= report.capacity) or not 0 <= int(body.get("cursor", 0)) < max(
            report.capacity, 1
        ):
            report.add(
                "manifest",
                f"the manifest says len {report.rows}, cursor {body.get('cursor')} for capacity "
                f"{report.capacity}",
                file=self.manifest_file,
            )
        return True

    # 2. the array files ------------------------------------------------------------------------
    def check_array_files(self) -> bool:
        """Every array file: present, regular, its recorded size, a valid header that accounts for
        the file's size, and its page checksums."""
        report = self.report
        try:
            sums = page_checksums_of(self.body)
        except CorruptionError as e:
            report.add("manifest", str(e), file=self.manifest_file)
            sums = {}
        # a writer may change the arrays in place while they are checked (or have died doing so):
        # each page is copied private, and one it changed is checked as this commit left it, from
        # the writer's before-images
        g = self.body.get("generation")
        chain = UndoChain(self.path, g) if isinstance(g, int) else None
        for name, size in sorted(self.files.items()):
            f = self.file_of(name)
            try:
                actual = os.path.getsize(f)
            except OSError:  # missing, a dangling symlink or a symlink loop
                report.add("missing", f"array {name!r} named by the manifest is missing or unreachable", file=f)
                continue
            report.files_checked += 1
            grown = actual > size and (read_intent(self.path) or -1) > self.body.get("generation", -1)
            if actual != size and not grown:  # grown in place by a newer commit: read as this one left it
                report.add("truncated", f"array {name!r} is {actual} bytes, the manifest says {size}", file=f)
                continue
            try:
                made = self.body.get("array_files", {}).get(name)
                if chain is not None and isinstance(made, int):
                    self.arrays[name] = load_checked(f, size, sums.get(name), functools.partial(chain.page, name, made))
                else:
                    self.arrays[name] = load_npy(f, size, pages=sums.get(name))
                    self.verified_files.append(f)
            except ChecksumError as e:
                report.add("checksum", f"array {name!r}: {e}", file=f)
            except CorruptionError as e:
                report.add("file", f"array {name!r}: {e}", file=f)
        # every array the format writes that these checks read (a store of one format has them all)
        need = ["index.state", "index.nbytes", "index.checksum", "index.loc", "index.codec", "index.raw_nbytes",
                "index.family", "index.refcount", "index.free_ids", "cold.free_offsets", "cold.free_sizes",
                "cold.pending_offsets", "cold.pending_sizes", "written"]
        if all(n in self.arrays for n in need):
            return True
        missing = [
            n
            for n in need
            if n not in self.arrays and not any(p.file == self.file_of(n) for p in report.problems)
        ]
        if missing:
            report.add("manifest", f"the manifest lists no {missing} arrays", file=self.manifest_file)
        return False

    # 3. the cold segments ----------------------------------------------------------------------
    def check_segments(self) -> _Segments:
        cold, report = self.cold, self.report
        sizes = [int(x) for x in cold.get("segment_sizes", [])]
        segments = _Segments(
            dir=os.path.join(self.path, "cold"),
            backend=str(cold.get("format", self.body.get("backend", "memmap"))),
            segment_bytes=int(cold.get("segment_bytes", 0)),
            sizes=sizes,
            data_offsets=[int(x) for x in cold.get("data_offsets", [0] * len(sizes))],
        )
        for i, size in enumerate(sizes):
            f = segments.file(i)
            problem = segment_problem(f, segments.data_offsets[i] + size)
            if problem is None or problem[0] != "missing":
                report.files_checked += 1
            if problem is not None:
                report.add(problem[0], f"cold segment {i} {problem[1]}", file=f)
                segments.ok.append(False)
                continue
            if segments.backend == "hdf5":
                why = hdf5_segment_problem(f, segments.data_offsets[i], segments.segment_bytes)
                if why:
                    report.add("file", f"cold segment {i} {why}", file=f)
                    segments.ok.append(False)
                    continue
            segments.ok.append(True)
        return segments

    # 4. the blobs ------------------------------------------------------------------------------
    def check_blob_locations(self, segments: _Segments) -> _Blobs | None:
        """The live blobs inside the segments, in file order; those the index places outside are
        reported. ``None``: the index columns cannot be read together."""
        arrays, report = self.arrays, self.report
        state = np.asarray(arrays["index.state"])
        live = np.flatnonzero(state == _STORED)
        nbytes = np.asarray(arrays["index.nbytes"])
        sums = np.asarray(arrays["index.checksum"])
        loc = np.asarray(arrays["index.loc"])
        if (
            loc.ndim != 2
            or loc.shape[0] != state.shape[0]
            or nbytes.shape != state.shape
            or sums.shape != state.shape
        ):
            report.add(
                "index",
                f"index columns disagree in shape: state {state.shape}, nbytes {nbytes.shape}, "
                f"checksum {sums.shape}, loc {loc.shape}",
                file=self.arrays_dir,
            )
            return None
        self.state, self.live, self.sums = state, live, sums
        off = loc[live, _COLD].astype(np.int64)
        size = nbytes[live].astype(np.int64)
        seg_bytes, n_segments = segments.segment_bytes, len(segments.sizes)
        if seg_bytes <= 0 and live.size:
            report.add("manifest", f"cold segment_bytes is {seg_bytes}", file=self.manifest_file)
            return None
        seg = off // max(seg_bytes, 1)
        in_seg = off - seg * max(seg_bytes, 1)
        sizes_arr = np.asarray(segments.sizes + [0], dtype=np.int64)
        outside = (
            (off < 0)
            | (size < 0)
            | (seg >= n_segments)
            | (in_seg + size > sizes_arr[np.minimum(seg, n_segments)])
        )
        for b, o in zip(live[outside].tolist()[:1000], off[outside].tolist()[:1000], strict=True):
            self.bad_ids[b] = ("index", "the index places the blob outside the cold segments", None)
            report.add(
                "index",
                f"blob {b} has cold offset {o}, outside the {n_segments} segments of the manifest",
                blob=b,
            )
        self.codecs_col = np.asarray(arrays["index.codec"])
        self.raw_col = np.asarray(arrays["index.raw_nbytes"])
        keep = ~outside
        ids, size, seg, in_seg = live[keep], size[keep], seg[keep], in_seg[keep]
        order = np.lexsort((in_seg, seg))
        return _Blobs(ids[order], size[order], seg[order], in_seg[order])

    def check_checksums(self, blobs: _Blobs, segments: _Segments) -> None:
        """Read the blobs in large sequential reads and compare their checksums with the index."""
        bar = progress_bar(int(blobs.size.sum()), "verify", unit="B", enabled=self.progress)
        try:
            i = 0
            n = blobs.ids.size
            ends = blobs.in_segment + blobs.size
            seg_stop = np.searchsorted(blobs.segment, blobs.segment, side="right")  # end of each blob's segment run
            while i < n:
                j = _batch_end(blobs.in_segment[i : int(seg_stop[i])], ends, i, _BATCH_BYTES)
                if self._check_batch(blobs, segments, i, j):
                    bar.update(int(blobs.size[i:j].sum()))
                i = j
        finally:
            bar.close()

    def _check_batch(self, blobs: _Blobs, segments: _Segments, i: int, j: int) -> bool:
        """Checksum (and decode) blobs ``i:j`` of one segment; ``False``: they could not be read."""
        from .codecs import segment_checksums

        report = self.report
        s = int(blobs.segment[i])
        f = segments.file(s)
        if not segments.ok[s]:
            for b in blobs.ids[i:j].tolist():
                self.bad_ids[b] = ("file", f, None)
            return False
        in_seg, size = blobs.in_segment[i:j], blobs.size[i:j]
        start = int(in_seg[0])
        end = int((in_seg + size).max())
        data_offset = segments.data_offsets[s]
        fd = fileio.open_for_read(f)
        try:
            buf = np.frombuffer(os.pread(fd, end - start, data_offset + start), dtype=np.uint8)
        finally:
            fileio.close(fd)
        rel = (in_seg - start).astype(np.int64)
        if buf.size < end - start:  # the file shrank under us
            report.add("truncated", f"cold segment {s} ends before byte {data_offset + end}", file=f)
            return False
        ids = blobs.ids[i:j]
        got = segment_checksums(buf, rel, size)
        bad = np.flatnonzero(got != self.sums[ids])
        for k in bad.tolist():
            self.bad_ids[int(ids[k])] = ("checksum", f, data_offset + int(in_seg[k]))
        if self.decode:
            self._decode_batch(buf, rel, size, ids, set(bad.tolist()), f, data_offset + in_seg)
        report.blobs_checked += j - i
        report.bytes_checked += int(size.sum())
        return True

    def _decode_batch(self, buf: np.ndarray, rel: np.ndarray, size: np.ndarray, blobs: np.ndarray, skip: set[int],
                      file: str, file_off: np.ndarray) -> None:
        """Decompress a batch but its ``skip`` positions (one call per codec); on failure find the
        failing blobs one by one."""
        from .codecs import codec_for_format_id

        codecs_col, raw_col = self.codecs_col, self.raw_col
        ok_mask = np.ones(blobs.size, bool)
        ok_mask[list(skip)] = False
        for fmt in np.unique(codecs_col[blobs]).tolist():
            sel = np.flatnonzero(ok_mask & (codecs_col[blobs] == fmt))
            if sel.size == 0:
                continue
            codec = codec_for_format_id(int(fmt))
            raw = raw_col[blobs[sel]].astype(np.int64)
            out = np.empty(int(raw.sum()), dtype=np.uint8)
            out_off = np.concatenate([[0], np.cumsum(raw)[:-1]]).astype(np.int64)
            try:
                codec.decode(buf, rel[sel], size[sel], out, out_off, raw)
                continue
            except Exception:  # noqa: BLE001 - find which blob fails, below
                pass
            for k in sel.tolist():
                r = int(raw_col[blobs[k]])
                one = np.empty(r, dtype=np.uint8)
                try:
                    codec.decode(buf, rel[k : k + 1], size[k : k + 1], one, np.zeros(1, np.int64), np.array([r]))
                except Exception:  # noqa: BLE001
                    self.bad_ids[int(blobs[k])] = ("decode", file, int(file_off[k]))

    def check_raw_sizes(self) -> None:
        """A blob holds 1..chunk_frames whole frames of its family (a size lie would make a decoder
        allocate or write past its output)."""
        families = self.body.get("families") or []
        live, raw_col = self.live, self.raw_col
        if not families:
            return
        family = np.asarray(self.arrays["index.family"])[live].astype(np.int64)
        raw_nbytes = raw_col[live].astype(np.int64)
        wrong = impossible_raw_sizes(
            family, raw_nbytes, [(int(f.get("frame_nbytes", 0)), int(f.get("chunk_frames", 1))) for f in families])
        for b in live[wrong].tolist()[:1000]:
            self.bad_ids.setdefault(b, ("index", "", None))
        if wrong.any():
            self.report.add(
                "index",
                f"{int(wrong.sum())} blobs record an impossible raw size or frame family "
                f"(first: blob {int(live[wrong][0])}, raw size {int(raw_nbytes[wrong][0])})",
                file=self.file_of("index.raw_nbytes"),
            )

    # 5. the index ------------------------------------------------------------------------------
    def check_index_pools(self) -> None:
        """The free-id pool lists exactly the free ids, and the cold tier's free and deferred extents
        overlap neither the stored blobs nor each other (a write would overwrite them)."""
        a, report, n = self.arrays, self.report, self.state.shape[0]
        file = self.file_of("index.free_ids")
        free = np.asarray(a["index.free_ids"])
        is_free = self.state == 0
        pool = free_pool_problem(free, is_free)
        if pool == "range":
            report.add("index", f"index.free_ids holds ids outside [0, {n})", file=file)
        elif pool is not None:
            report.add("index", f"index.free_ids lists {free.size} ids, the index has {int(is_free.sum())} "
                       "free ids (an id listed twice, a stored id listed, or a free id missing)", file=file)
        names = ["cold.free_offsets", "cold.free_sizes", "cold.pending_offsets", "cold.pending_sizes"]
        loc = np.asarray(a["index.loc"])[self.live, _COLD].astype(np.int64)
        size = np.asarray(a["index.nbytes"])[self.live].astype(np.int64)
        ext = [np.asarray(a[k]).astype(np.int64).reshape(-1) for k in names]
        off = np.concatenate([loc, ext[0], ext[2]])
        ln = np.concatenate([(size + 15) // 16 * 16, ext[1], ext[3]])
        if off.shape != ln.shape or (ln < 0).any() or (off < 0).any():
            report.add("index", "the cold tier's free extents are malformed", file=self.arrays_dir)
            return
        if extents_overlap(off, ln):
            report.add("index", "the cold tier's free or deferred extents overlap stored blobs or each other",
                       file=self.file_of("cold.free_offsets"))

    def check_derived_tables(self) -> None:
        """Each row table saved as another's shifted by one (plus exceptions) expands from its saved
        arrays into a whole table, which the row-table checks read."""
        for problem in expand_derived(self.body, [spec.get("kind") for spec in self.schema], self.arrays):
            self.report.add("index", problem, file=self.manifest_file)

    # 6. the row tables -------------------------------------------------------------------------
    def check_row_tables(self) -> bool:
        """Every written row of every row table points at stored blobs; damaged blobs are reported
        with the field and rows that use them. ``False``: the written mask is unreadable."""
        report = self.report
        written = np.asarray(self.arrays["written"]).astype(bool)
        if written.shape != (report.capacity,):
            report.add(
                "index",
                f"'written' has shape {written.shape}, expected ({report.capacity},)",
                file=self.file_of("written"),
            )
            return False
        for fi, spec in enumerate(self.schema):
            name = f"rows.{fi}.blob"
            if spec.get("kind") != "blob" or name not in self.arrays:
                continue
            fname = "/".join(spec.get("key", [f"field{fi}"]))
            file = self.file_of(name)
            table = np.asarray(self.arrays[name])
            if table.ndim != 2 or table.shape[0] != written.shape[0]:
                report.add(
                    "index",
                    f"row table of {fname!r} has shape {table.shape}, expected [{written.shape[0]}, F]",
                    file=file,
                )
                continue
            t = table[written]
            rows_w = np.flatnonzero(written)
            self._report_dangling(t, rows_w, fname, file)
            if self.bad_ids:
                self._report_damaged_rows(t, rows_w, fname)
        return True

    def _report_dangling(self, t: np.ndarray, rows_w: np.ndarray, fname: str, file: str) -> None:
        """Written rows (``rows_w``, their table entries ``t``) that point at no stored blob."""
        state = self.state
        valid = (t >= 0) & (t < state.shape[0])
        dangling = (
            ~valid | (state[np.clip(t, 0, max(state.shape[0] - 1, 0))] != _STORED) if state.size else ~valid
        )
        dangling &= t >= 0
        unset = t < 0
        if dangling.any() or unset.any():
            r = rows_w[(dangling | unset).any(1)]
            self.report.add(
                "index",
                f"{r.size} written rows of {fname!r} point at no stored blob",
                field=fname,
                rows=r[:_MAX_ROWS_LISTED].tolist(),
                n_rows=int(r.size),
                file=file,
            )

    def _report_damaged_rows(self, t: np.ndarray, rows_w: np.ndarray, fname: str) -> None:
        """One problem per damaged blob that written rows of field ``fname`` use, with those rows."""
        bad = np.fromiter(self.bad_ids, dtype=np.int64)
        hit = np.isin(t, bad)
        r_idx, c_idx = np.nonzero(hit)
        if not r_idx.size:
            return
        blob_of = t[r_idx, c_idx]
        order = np.argsort(blob_of, kind="stable")
        blob_of, r_idx = blob_of[order], r_idx[order]
        cuts = np.flatnonzero(np.r_[True, blob_of[1:] != blob_of[:-1]])
        for a, b in zip(cuts.tolist(), [*cuts[1:].tolist(), blob_of.size], strict=True):
            bid = int(blob_of[a])
            rows = np.unique(rows_w[r_idx[a:b]])
            kind, file, offset = self.bad_ids[bid]
            what = {
                "checksum": "checksum mismatch (the stored bytes are damaged)",
                "decode": "the blob does not decompress to its recorded size",
                "file": "its segment file is missing or damaged",
                "index": "its index entry is inconsistent (see the index problems)",
            }[kind]
            self.report.add(
                kind if kind != "file" else "checksum",
                f"blob {bid}: {what}",
                file=file,
                offset=offset,
                field=fname,
                rows=rows[:_MAX_ROWS_LISTED].tolist(),
                n_rows=int(rows.size),
                blob=bid,
            )
            self.listed.add(bid)

    def check_references(self) -> None:
        """Every written row's frames name a stored blob of the field's family, at a slot inside
        the blob; the stored reference counts are at least the recount (the writer's tail pins
        may add to it) and zero for free ids. Vectorized (one bincount over every table)."""
        a, report = self.arrays, self.report
        written = np.asarray(a["written"]).astype(bool)
        n = self.state.shape[0]
        families = self.body.get("families") or []
        family_col = np.asarray(a["index.family"])
        raw_col = self.raw_col
        counts = np.zeros(n, np.int64)
        fam_id: dict[tuple[Any, tuple[int, ...]], int] = {}
        for spec in self.schema:  # family ids in first-appearance order (as Schema.families)
            if spec.get("kind") == "blob":
                fam_id.setdefault(_family_key(spec), len(fam_id))
        for fi, spec in enumerate(self.schema):
            name, slot_name = f"rows.{fi}.blob", f"rows.{fi}.slot"
            if spec.get("kind") != "blob" or name not in a or slot_name not in a:
                continue
            table, slots = np.asarray(a[name]), np.asarray(a[slot_name])
            if table.shape != slots.shape or table.ndim != 2 or table.shape[0] != written.shape[0]:
                continue  # reported by check_row_tables
            fname = "/".join(spec.get("key", [f"field{fi}"]))
            if table.size and (int(table.min()) < -1 or int(table.max()) >= n):
                report.add("index", f"row table of {fname!r} names blob ids outside [-1, {n})",
                           file=self.file_of(name))
                continue
            ids = table[written]
            ok = ids >= 0
            counts += np.bincount(ids[ok], minlength=n)[:n]
            fam = fam_id.get(_family_key(spec), -1)
            if not 0 <= fam < len(families):
                continue
            frame_nbytes = max(int(families[fam].get("frame_nbytes", 1)), 1)
            safe = np.where(ok, ids, 0)
            s = slots[written]
            bad = ok & ((family_col[safe] != fam) | (s < 0) | (s >= raw_col[safe] // frame_nbytes))
            if bad.any():
                r = np.flatnonzero(written)[bad.any(1)]
                report.add("index", f"{r.size} written rows of {fname!r} name a frame outside their blob or a "
                           "blob of another field", field=fname, rows=r[:_MAX_ROWS_LISTED].tolist(),
                           n_rows=int(r.size), file=self.file_of(slot_name))
        stored = np.asarray(a["index.refcount"]).astype(np.int64)
        live = self.state == _STORED
        if stored.shape == counts.shape and ((stored[live] < counts[live]).any() or (stored[~live] != 0).any()):
            b = int(np.flatnonzero((live & (stored < counts)) | (~live & (stored != 0)))[0])
            report.add("index", f"reference counts disagree with a recount of the row tables (first: blob {b}, "
                       f"stored {int(stored[b])}, counted {int(counts[b])})",
                       file=self.file_of("index.refcount"), blob=b)

    def report_damage_no_row_uses(self) -> None:
        """Damaged blobs that no written row uses (index problems were reported already)."""
        for bid, (kind, file, offset) in self.bad_ids.items():
            if bid not in self.listed and kind != "index":
                self.report.add(
                    kind if kind != "file" else "checksum",
                    f"blob {bid} is damaged (no written row uses it)",
                    file=file,
                    offset=offset,
                    blob=bid,
                )

    # 7. the open --------------------------------------------------------------------------------
    def check_open(self) -> None:
        """The store opens read-only through :func:`tiered.open`, as a user opens it (the array
        pages checked already are not read a second time)."""
        # here, not at the top: the facade imports torch, which the steps before do without
        from .store import TieredStore

        try:
            with arrays_verified(self.verified_files):
                store = TieredStore.open(self.path, mode="r", warm_bytes=0, hot_bytes=0)
            store.close()
        except TieredError as e:
            self.report.add("open", f"tiered.open(mode='r') fails: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - a raw error here is a bug of the store, report it as such
            self.report.add(
                "open",
                f"tiered.open(mode='r') fails with a raw {type(e).__name__} (a tiered bug; "
                f"please report it): {e}",
            )


def _batch_end(run_starts: np.ndarray, ends: np.ndarray, i: int, batch_bytes: int) -> int:
    """End of the batch that starts at blob ``i``: one sequential read.

    ``run_starts``: the offsets of blob ``i`` and the blobs after it in its segment; ``ends``: the
    end offsets of all blobs. The batch takes the blobs after blob ``i`` whose ends, and those of
    all blobs before them, stay within ``batch_bytes`` of its start (the running maximum keeps
    overlapping blobs in order), found by search instead of a per-blob loop.
    """
    limit = int(run_starts[0]) + batch_bytes
    w = i + int(np.searchsorted(run_starts, limit, side="right"))
    return i + 1 + int(np.searchsorted(np.maximum.accumulate(ends[i + 1 : w]), limit, side="right"))
