"""A store's directory: creating and opening it, its commits, the consistency checks of an open,
readers' staleness checks.

A store with a path is a directory (docs/format.md): ``manifest.json`` (schema, options, format
version, generation, each array's file with its size and page checksums), one ``.npy`` file per
array under ``arrays/`` (blob index columns, row tables, dense columns, the written mask, the
cold tier's allocator state, the policy's state) with the before-images of the last two commits,
and the cold segments under ``cold/``. What a commit writes, in what order, what a crash leaves
and what readers see: the design note of :mod:`tiered.durable`. A writer's open first undoes a
commit that died after its intent; opening picks the last complete commit and checks that its
arrays agree with the manifest before anything is trusted.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> d = tempfile.mkdtemp() + "/s"
    >>> with TieredStore(10, d) as s:
    ...     _ = s.extend(TensorDict({"x": torch.arange(4.0)}, [4]))
    >>> from tiered.durable.manifest import read_manifest
    >>> read_manifest(d)["generation"] >= 2 and read_manifest(d)["len"]
    4
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import mmap
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from ..engine.blob_index import (
    BLOB_DTYPE,
    COLD,
    FREE,
    HOT,
    SLOT_DTYPE,
    STORED,
    WARM,
    BlobIndex,
    free_pool_problem,
    impossible_raw_sizes,
)
from ..engine.layout import FieldLayout
from ..engine.placement import Placement
from ..engine.row_tables import NextRowTable, RowTable, ShiftedRowTable
from ..engine.rows import RowSpace
from ..engine.write import WriteOptions, WritePath
from ..errors import (
    CorruptionError,
    NotSharedError,
    SchemaMismatchError,
    StaleReadError,
    StoreExistsError,
    TieredError,
)
from ..policy import Policy
from ..schema import Schema, key_to_str
from ..tiers import HDF5Tier, MemmapTier, Tier
from ..util import fileio, filemap
from ..util.batch import extents_overlap
from ..util.dirty import union
from ..util.units import align
from .array_files import (
    ARRAYS_DIR,
    FileState,
    Pending,
    UndoChain,
    array_file,
    kind_of,
    plan_in_place,
    read_intent,
    read_intent_token,
    read_runs,
    remove_obsolete,
    roll_back,
    stale_error,
    stamp_of,
    sync_files,
    write_in_place,
    write_intent,
    write_new,
    write_undo,
)
from .checked_maps import (
    IdCheck,
    PageChecks,
    Rebuild,
    RowCheck,
    forget_memory_tiers,
    load_checked,
    map_checked,
    map_verified,
    rebuilt_header,
)
from .commit_arrays import (
    CHECKSUMS,
    EXCEPTION_SUFFIXES,
    array_path,
    derived_tables,
    page_checksums_of,
    shifted_tables,
    table_file,
)
from .lock import acquire_writer_lock, release
from .manifest import MANIFEST, PAGE_BYTES, load_npy, read_manifest, read_npy_header, write_manifest

T = TypeVar("T")

__all__ = ["StoreFiles", "BACKENDS", "read_fresh", "open_commit", "restore_commit", "commit_parts", "snapshot_arrays",
           "check_consistency", "check_bounds", "schema_of", "options_of", "check_table_rows", "unpin"]

#: Called with ``(files, arrays, written, generation)`` once a commit's manifest is in place, before
#: the writer's state moves on: the tests' check that every array file written equals memory
#: (the test suite's ``tests/_commit_check.py``) is installed here; nothing else is.
AFTER_COMMIT: list[Callable[[StoreFiles, dict[str, np.ndarray], dict[str, FileState], int], None]] = []

# Every StoreFiles of this process: a fork privatizes the array pages its writers map (_before_fork)
_ALL_FILES: weakref.WeakSet[StoreFiles] = weakref.WeakSet()


def _before_fork() -> None:
    """Before this process forks: the child must keep the arrays it inherits as they are now.

    A writer's arrays are partly private memory maps of its array files (pages a commit mapped
    back, pages opened lazily): a page never written since shows the file's bytes, in the child
    as well, and the writer's later commits rewrite those files in place. Giving every such page
    an anonymous copy first makes the child's arrays its own (copy-on-write, shared with the
    parent until either writes), whatever the parent commits next."""
    pid = os.getpid()
    for files in list(_ALL_FILES):  # the stores of this process: a few
        if not files.read_only and files.writer_lock is not None and files.writer_lock.pid == pid:
            files.fork_private = False  # inherited by the child as it is when the fork happens
            try:
                filemap.privatize_files(os.path.join(files.path, ARRAYS_DIR))
                files.fork_private = True
            except Exception:  # noqa: BLE001 - a fork hook must go on to the other stores
                # the child's arrays may still show the files: its reads then refuse as soon as
                # the writer commits again (check_fresh), never return rows that changed under it
                pass


os.register_at_fork(before=_before_fork)


class OpenRaced(CorruptionError):
    """A read-only open read arrays mapped from files that a commit started meanwhile changes in
    place: :func:`open_commit` opens again, with those arrays copied private (:data:`_COPY_WHOLE`)."""


#: Set while :func:`open_commit` opens again after :class:`OpenRaced`: a read-only open copies the
#: arrays it reads whole private (checked as copied, rebuilt where a commit changed them), as it
#: does when a commit is under way at open, instead of leaving them mapped from their files.
_COPY_WHOLE: contextvars.ContextVar[bool] = contextvars.ContextVar("tiered_copy_whole", default=False)


#: Arrays a read-only open maps whole without reading a byte of them (no consistency check of an
#: open looks at blobs' checksums or open-chunk slots): their pages are checked at their first use
#: (:class:`~tiered.durable.checked_maps.IdCheck`), not also at open.
UNREAD_AT_OPEN = frozenset({"index.checksum", "index.aux"})

BACKENDS: dict[str, type[MemmapTier]] = {"memmap": MemmapTier, "hdf5": HDF5Tier}
ArrayLoader = Callable[[str], np.ndarray]


class StoreFiles:
    """A store directory: its lock, its cold tier's files and its commits.

    Args:
        path: the store directory.
        backend: ``"memmap"`` or ``"hdf5"`` (the cold segments' file kind).
        read_only: a read-only open: its pages are copied private when first checked, and rebuilt
            from the writer's before-images where the writer changed them since
            (:mod:`tiered.durable.array_files`).
    """

    def __init__(self, path: str, backend: str, read_only: bool = False) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
        self.path = path
        self.backend = backend
        self.generation = 0
        self.read_only = read_only
        self.writer_lock: Any = None
        #: per array: its file and what it holds (the last commit; empty: a new store, whose arrays
        #: the next commit writes to new files)
        self.array_files: dict[str, FileState] = {}
        self._adopted: dict[str, Any] | None = None
        #: a read-only open's before-images of the writer's later commits (read when needed)
        self.undo: UndoChain | None = None
        #: a commit failed after its intent and could not write its before-images back: the next
        #: commit does first
        self.rollback_pending = False
        #: bytes of array pages the last commit wrote
        self.last_commit_bytes = 0
        #: per array opened lazily: its page checks and the address of its first element
        self.lazy: dict[str, tuple[PageChecks, int]] = {}
        self._sums: tuple[dict[str, Any], dict[str, list[int]]] | None = None
        #: per-row arrays some of whose pages are mapped from their files (map_back)
        self.mapped: dict[str, filemap.FileLayout] = {}
        #: a read-only open: the writer's intent when it started reading the arrays
        #: (:func:`~tiered.durable.array_files.read_intent_token`; None: none written yet), and
        #: whether the arrays it reads whole are left mapped from their files (each page checked
        #: now, copied private at first use): unless a commit was under way
        self.opened_intent: tuple[int, int] | None = None
        self.map_whole = False
        #: a read-only open's check of its blob-indexed arrays' pages (blob index, policy state)
        self.id_check: IdCheck | None = None
        #: a read-only open's arrays read whole at open and mapped from files changed in place
        #: (blob index, policy state, written mask), by name: the pages of each
        self.whole_pages: dict[str, PageChecks] = {}
        #: a read-only open's checks of rows that include the written mask's pages (its own and
        #: the row tables'): a page of the mask given back (:meth:`borrowed_pages`) is checked again
        self.written_checks: list[RowCheck] = []
        #: whether the last fork made the writer's mapped array pages private (:func:`_before_fork`)
        self.fork_private = True
        _ALL_FILES.add(self)

    @property
    def forked(self) -> bool:
        """Whether this is a copy, in a process forked from it, of a writer's files: it reads the
        writer's state at the fork (its arrays were made private then, :func:`_before_fork`) and
        never commits."""
        lock = self.writer_lock
        return lock is not None and lock.pid != os.getpid()

    # -- creating and opening -----------------------------------------------------------------
    def create(self) -> Tier:
        """Take a new directory (refusing one that holds a store), its writer lock, a cold tier."""
        if os.path.exists(os.path.join(self.path, MANIFEST)):
            raise StoreExistsError(
                f"{self.path!r} already holds a tiered store; open it with tiered.open(path, mode='r+'), "
                "or choose another path")
        os.makedirs(self.path, exist_ok=True)
        self.writer_lock = acquire_writer_lock(self.path)  # one writer at a time
        try:
            return self.cold_tier()
        except BaseException:
            self.release_lock()
            raise

    def cold_tier(self, state: dict[str, Any] | None = None, mode: str = "w") -> MemmapTier:
        """A new cold tier (``state=None``) or the one a commit describes, opened in ``mode``."""
        cls = BACKENDS[self.backend]
        directory = os.path.join(self.path, "cold")
        return cls(directory) if state is None else cls.open(directory, state, mode)

    def arrays(self, body: dict[str, Any]) -> ArrayLoader:
        """A loader of the arrays the commit ``body`` lists (memory-mapped, sizes checked, every
        page's checksum checked before the loader returns; a read-only open's pages copied
        private and rebuilt where a writer changed them since, :meth:`rebuilder`)."""
        files = body["files"]
        sums = self.page_checksums(body)
        self.adopt_files(body)

        def load(name: str) -> np.ndarray:
            if name not in files:
                raise CorruptionError(f"{self.path}: the manifest lists no {name!r} array; the store is damaged")
            rebuild = self.rebuilder(name)
            kind = kind_of(name)
            path = array_path(self.path, body, name)
            if rebuild is None or kind == "whole":
                # a writer's, or a file never written again once made (a change goes to a new file)
                return load_npy(path, files[name], pages=sums.get(name))
            if not self.map_whole:  # a commit was under way at open: private copies, checked now
                return load_checked(path, files[name], sums.get(name), rebuild)
            # the open's own checks read these arrays whole, so it checks their pages first; the
            # columns they read nothing of are checked at first use only, as every page is again
            mapped = map_checked if name in UNREAD_AT_OPEN else map_verified
            arr, pages = mapped(path, files[name], sums.get(name), self.check_fresh, rebuild)
            if name == "index.loc" and arr.ndim == 2 and arr.shape[1] > WARM:
                # the writer's memory-tier locations, forgotten page by page as each becomes this
                # reader's own (not at open, which would copy every page holding one)
                pages.on_own = functools.partial(forget_memory_tiers, arr, pages, slice(HOT, WARM + 1))
                for page in np.flatnonzero(pages.checked).tolist():  # pages rebuilt at open (few, or none)
                    pages.on_own(page * PAGE_BYTES, min(pages.size, (page + 1) * PAGE_BYTES))
            self.whole_pages[name] = pages
            if kind == "blobs" and self.id_check is not None:
                self.id_check.add(pages)
            return arr

        return load

    def page_checksums(self, body: dict[str, Any]) -> dict[str, list[int]]:
        """:func:`page_checksums_of` the commit ``body``, checked once per body (an open asks
        for them once per array)."""
        if self._sums is None or self._sums[0] is not body:
            self._sums = (body, page_checksums_of(body))
        return self._sums[1]

    def lazy_array(self, body: dict[str, Any], name: str) -> tuple[np.ndarray, PageChecks]:
        """A per-row array of the commit ``body``, memory-mapped, whose pages are checked on first
        use (:mod:`tiered.durable.checked_maps`); a commit checks the pages it copies that no use checked."""
        files = body["files"]
        if name not in files:
            raise CorruptionError(f"{self.path}: the manifest lists no {name!r} array; the store is damaged")
        self.adopt_files(body)
        arr, pages = map_checked(array_path(self.path, body, name), files[name], self.page_checksums(body).get(name),
                                 stale=self.check_fresh, rebuild=self.rebuilder(name))
        self.lazy[name] = (pages, arr.__array_interface__["data"][0])
        if name in self.array_files and not self.read_only and isinstance(pages.view.obj, mmap.mmap):
            # mapped from its file, laid out as it: a commit maps the pages it writes back too
            filemap.adopt(pages.view.obj, arr, 0)
        return arr, pages

    def adopt_files(self, body: dict[str, Any]) -> None:
        """Learn the file of each array of the commit ``body`` and what it holds (once per body)."""
        if self._adopted is body:
            return
        self._adopted = body
        self.generation = int(body["generation"])
        self.array_files, self.undo = {}, None
        if self.read_only:
            # before any array is read: a commit that starts after this changes the files in place,
            # which the end of the open finds (check_unmoved)
            self.opened_intent = read_intent_token(self.path)
            self.map_whole = not _COPY_WHOLE.get() and (self.opened_intent is None
                                                        or self.opened_intent[0] <= self.generation)
            self.id_check, self.whole_pages = IdCheck(), {}
        entry = body.get("array_files")
        if not isinstance(entry, dict):
            return
        sums = self.page_checksums(body)
        for name, f in entry.items():
            if isinstance(f, int) and name in body["files"]:
                self.array_files[name] = FileState(f, int(body["files"][name]), list(sums.get(name, [])))
        if not self.read_only:
            self.stamp_files()

    def rebuilder(self, name: str) -> Rebuild | None:
        """For a read-only open: what rebuilds a page of array ``name``'s file that a writer
        changed since this store's commit (:meth:`~tiered.durable.array_files.UndoChain.rebuild`); None
        for a writer, whose files no one else writes.

        Raises (from the returned function):
            StaleReadError: the writer is more than :data:`~tiered.durable.array_files.KEEP` commits
                ahead (the before-images of the commits after this one are gone).
        """
        state = self.array_files.get(name)
        if not self.read_only or state is None:
            return None

        if self.undo is None:
            self.undo = UndoChain(self.path, self.generation)
        return functools.partial(self.undo.page, name, state.file)

    def own_entries(self, name: str, ids: np.ndarray) -> None:
        """For a read-only open: make the pages holding the entries of ``ids`` (valid ids) in the
        array ``name`` it read whole its own, checked (:meth:`PageChecks.check`), before it writes
        them; nothing for an array it holds as its own already."""
        pages = self.whole_pages.get(name)
        if pages is not None and ids.size:
            pages.check(pages.rows_pages(ids, ids + 1))

    @contextlib.contextmanager
    def borrowed_pages(self) -> Iterator[None]:
        """For a read-only open that left what it reads by blob id (blob index, policy state)
        mapped from its files: the pages of those arrays that the block makes its own (checked,
        copied private) are given back at its end, their copies dropped and counted unchecked
        again, so a later use copies and checks them as a first use does. A use of every entry that
        writes nothing a later use needs (``stats()``) then costs memory while it runs, not after.

        Only while the writer has not started a commit since the open (:meth:`moved`): the files
        then hold this commit's bytes, so nothing given back needed rebuilding; otherwise the
        copies are kept (rebuilding them again would need before-images the writer's next
        commits remove)."""
        check = self.id_check
        if not (self.read_only and self.map_whole and check is not None):
            yield
            return
        pages = [p for group in check.groups.values() for p in group]  # a dozen arrays
        mask = self.whole_pages.get("written")
        before = [p.checked.copy() for p in pages]
        mask_before = mask.checked.copy() if mask is not None else None
        try:
            yield
        finally:
            if not self.moved():
                for p, old in zip(pages, before, strict=True):
                    _give_back(p, p.checked & ~old)
                check.done = all(p.done for p in pages)
                if mask is not None and mask_before is not None:
                    back = _give_back(mask, mask.checked & ~mask_before)
                    for rows in self.written_checks:  # its own check and the row tables': a few
                        rows.forget(mask, back)

    def moved(self) -> bool:
        """For a read-only open: whether the writer may have changed, since the open checked them,
        the pages it left mapped from their files (it started a commit since: its intent moved)."""
        return not self.map_whole or read_intent_token(self.path) != self.opened_intent

    def check_unmoved(self) -> None:
        """At the end of a read-only open that read arrays mapped from their files: raise
        :class:`OpenRaced` if the writer started a commit meanwhile (its in-place writes may have
        reached pages the open checked and then read again)."""
        if self.read_only and self.map_whole and read_intent_token(self.path) != self.opened_intent:
            raise OpenRaced(f"{self.path}: a writer started a commit while the store was being opened")

    def stamp_files(self) -> None:
        """Note what each array file known to a writer is now (:func:`~tiered.durable.array_files.stamp_of`),
        so that a commit can tell a file another program changed since (:meth:`check_untouched`)."""
        for name, state in self.array_files.items():
            try:
                state.stamp = stamp_of(os.stat(array_file(self.path, name, state.file)))
            except OSError:
                state.stamp = None

    def check_untouched(self) -> None:
        """Before a commit reads a byte of its arrays: check that it is the writer's (not a forked
        copy's) and that no array file it knows was changed by another program since this writer
        wrote or opened it.

        The writer's arrays are partly private maps of these files (pages never written since
        show the file's bytes), and pages are checked against their checksums once, when first
        used: a file changed afterwards would have its changed bytes copied into the new commit
        with fresh checksums (and a truncated one would end the writer with ``SIGBUS``). Its
        inode, size and time stamps tell (a few dozen ``stat`` calls).

        Raises:
            NotSharedError: this is a forked copy of the writer's files (:attr:`forked`).
            CorruptionError: naming the file; nothing was written.
        """
        if self.forked:
            raise NotSharedError(
                f"{self.path}: this process was forked from the store's writer and cannot commit to it (its "
                "writes would mix with the writer's). Share the store before forking (store.share(), "
                "or TieredStorage(..., shared=True)), or open it in this process once the writer closed it.")
        for name, state in self.array_files.items():
            if state.stamp is None:
                continue
            path = array_file(self.path, name, state.file)
            try:
                now = stamp_of(os.stat(path))
            except OSError:
                now = None
            if now != state.stamp:
                raise CorruptionError(
                    f"{path}: another program changed this file while the store was open for writing "
                    f"(inode, size, times {state.stamp} when this writer last wrote or opened it, now {now}); "
                    "this writer's arrays map it, so nothing was committed rather than its bytes being "
                    "stamped with new checksums. Reopen the store (tiered.open(path, mode='r+'), which "
                    "checks every page it uses) and run `tiered verify`; restore it from a copy if that "
                    "reports damage.")

    def check_fresh(self, blobs: bool = False) -> None:
        """For a reader that does not hold the writer lock (a read-only open, a process forked from
        the writer): raise if the writer may have rewritten files it read (docs/durability.md).

        The writer writes its intent (the generation it is committing) before it overwrites a
        byte of an array file, so checking it *after* a read tells whether anything the read used
        may have changed. A read-only open's array pages are its own once checked, and rebuilt
        where the writer changed them (:meth:`rebuilder`); a forked process has private arrays
        (:func:`_before_fork`). Both read blobs from the cold files, where the writer reuses the
        space of rows it overwrote once its second commit after the reader's lands.

        Args:
            blobs: also raise once blob space may have been reused (for a read that failed, or
                one whose blob bytes were not checked against their checksums).

        Raises:
            StaleReadError: saying to reopen the store.
        """
        forked = self.forked
        if not (self.read_only or forked):
            return
        intent = read_intent(self.path)
        if intent is None:
            return
        # a forked copy whose pages the fork could not make private reads the writer's array
        # files, which its next commit rewrites in place
        unprotected = forked and not self.fork_private
        if (intent >= self.generation + 2 and blobs) or (unprotected and intent > self.generation):
            if forked:
                raise StaleReadError(
                    f"{self.path}: this process was forked from the store's writer at commit {self.generation}; "
                    f"the writer has since committed up to generation {intent} and may reuse the space of rows "
                    "it overwrote. Nothing that may be another commit's rows is returned: open the store in "
                    "this process (tiered.open(path), read-only) to read the latest commit, or share it "
                    "before forking (store.share()).")
            raise stale_error(self.path, self.generation, intent)

    def blob_index(self, body: dict[str, Any]) -> BlobIndex:
        """The blob index the commit ``body`` saved (its ``index.*`` arrays)."""
        load = self.arrays(body)
        return BlobIndex.from_arrays({k.split(".", 1)[1]: load(k) for k in body["files"] if k.startswith("index.")})

    @staticmethod
    def cold_state(body: dict[str, Any], load: ArrayLoader) -> dict[str, Any]:
        state = dict(body["cold"])
        for k in body["files"]:
            if k.startswith("cold."):
                state[k.split(".", 1)[1]] = load(k)
        return state

    # -- committing ---------------------------------------------------------------------------
    def commit(self, cold: Tier, arrays: dict[str, np.ndarray], body: dict[str, Any],
               dirty: tuple[np.ndarray, np.ndarray], keep_anonymous: frozenset[str] = frozenset()) -> None:
        """Durably publish a new generation (the order of writes: :mod:`tiered.durable`);
        then map the pages it wrote of the per-row arrays back from their files (:meth:`map_back`).

        Args:
            dirty: bitmaps of the row blocks and blob-id blocks changed since the last commit.
            keep_anonymous: arrays not to map back (dense columns a caller holds views of).
        """
        if self.rollback_pending and not self.forked:  # a failed commit's in-place writes are undone first
            roll_back(self.path, self.generation)
            self.stamp_files()
            self.rollback_pending = False
        self.check_untouched()
        self.release_mapped(arrays)
        cold.flush()
        g = self.generation + 1
        adir = os.path.join(self.path, ARRAYS_DIR)
        if not os.path.isdir(adir):
            fileio.makedirs(adir)
            fileio.fsync_dir(self.path)
        cold_state = cold.state()
        arrays = {**arrays, **{f"cold.{k}": v for k, v in cold_state.items() if isinstance(v, np.ndarray)}}
        # what each array's file gets: byte runs written in place (None: a new file)
        plans: dict[str, np.ndarray | None] = {}
        images = []
        for name, arr in arrays.items():
            base = self.array_files.get(name)
            kind = kind_of(name)
            if base is None:
                plans[name] = None
                continue
            path = array_file(self.path, name, base.file)
            plans[name] = runs = plan_in_place(path, arr, None if kind == "whole" else dirty[1 if kind == "blobs" else 0], base)
            if runs is not None and runs.size:
                # the old bytes: those of the file as it is (a grown array's tail has none)
                old = np.minimum(runs, base.size)
                old = old[old[:, 1] > old[:, 0]]
                images.append((name, base.file, base.size, old, read_runs(path, old)))
        written: dict[str, FileState] = {}
        # files fsynced together (sync_files), then renamed where they wait for it
        pending: Pending = []
        in_place = False
        try:
            # before the intent: files no commit names yet (a crash leaves them to remove)
            for name, arr in arrays.items():
                if plans[name] is None:
                    written[name] = write_new(array_file(self.path, name, g), arr, g, self.unchecked_pages(name, arr),
                                              pending)
            undo_bytes = write_undo(self.path, g, images, pending)
            sync_files(pending)  # the before-images complete and durable, then renamed into place
            fileio.fsync_dir(adir)
            write_intent(self.path, g)  # from here on, the array files change in place
            in_place = True
            for name, arr in arrays.items():
                runs = plans[name]
                if runs is not None:
                    base = self.array_files[name]
                    written[name] = write_in_place(array_file(self.path, name, base.file), arr, runs, base,
                                                   self.unchecked_pages(name, arr), pending)
            sync_files(pending)
        except BaseException:
            for fd, _ in pending:  # left by an error before sync_files
                fileio.close(fd)
            if in_place:
                self.undo_failed(arrays)
            raise
        try:
            write_manifest(self.path, {
                **body, "generation": g, "backend": self.backend,
                "cold": {k: v for k, v in cold_state.items() if not isinstance(v, np.ndarray)},
                "files": {name: a.size for name, a in written.items()},
                CHECKSUMS: {"algorithm": "crc32", "page_bytes": PAGE_BYTES,
                            "files": {name: a.crcs for name, a in written.items()}},
                "array_files": {name: a.file for name, a in written.items()}})
        except BaseException:
            if not self.published(g):
                self.undo_failed(arrays)
                raise
            self.committed(cold, arrays, written, g, undo_bytes, keep_anonymous)  # renamed, not synced
            raise
        self.committed(cold, arrays, written, g, undo_bytes, keep_anonymous)

    def committed(self, cold: Tier, arrays: dict[str, np.ndarray], written: dict[str, FileState], g: int,
                  undo_bytes: int, keep_anonymous: frozenset[str]) -> None:
        """After the manifest of commit ``g`` was renamed into place: the writer's state is the
        commit's, the pages written are mapped back, and what no reader needs goes."""
        for check in AFTER_COMMIT:
            check(self, arrays, written, g)
        self.array_files = written
        self.map_back({n: a for n, a in arrays.items() if n not in keep_anonymous}, written)
        self.last_commit_bytes = sum(a.written for a in written.values()) + undo_bytes
        self.generation = g
        self._adopted = None
        try:
            remove_obsolete(self.path, g, {name: a.file for name, a in written.items()})
        except OSError:  # left for the next commit to remove
            pass
        # Space freed by overwritten rows before the previous commit is reusable only now: a
        # read-only open of the commit before that one may read it until this commit lands.
        cold.release_deferred(hold_last=True)

    def published(self, g: int) -> bool:
        """Whether the manifest of commit ``g`` is in place (its write failed after the rename)."""
        try:
            return int(read_manifest(self.path)["generation"]) == g
        except Exception:  # noqa: BLE001 - unreadable: not published
            return False

    def undo_failed(self, arrays: dict[str, np.ndarray]) -> None:
        """A commit failed after its intent, before its manifest: write its before-images back
        (:func:`~tiered.durable.array_files.roll_back`), so the files hold the last commit again. The
        writer's pages mapped from them get an anonymous copy first (their bytes are the failed
        commit's, which the arrays in memory keep). If that fails too, the next commit (or the
        next writer open) rolls back first."""
        try:
            for arr in arrays.values():
                filemap.privatize(arr)
            roll_back(self.path, self.generation)
            self.stamp_files()  # written by this writer: what the files are now
        except BaseException:  # noqa: BLE001 - the commit's own error is the one raised
            self.rollback_pending = True

    def map_back(self, arrays: dict[str, np.ndarray], written: dict[str, FileState]) -> None:
        """After a commit was published: map the pages it wrote of each per-row array laid out as
        its file (:func:`~tiered.util.filemap.file_array`) from its file, so they are no longer
        anonymous memory (docs/durability.md). Only a store that holds the writer lock does: no
        other process writes its files meanwhile.

        Why a mapped page never changes under the array: a page mapped clean from the file of
        array ``A`` holds the bytes of that file's page. Only this writer writes the file while it
        holds the lock, only from ``A`` itself (same layout, same address; :meth:`release_mapped`
        gives the pages back an anonymous copy first if ``A`` was replaced or resized), so a later
        commit that rewrites the page writes it from that very page: the same bytes, at the same
        size (no truncation). A roll-back of a failed commit writes other bytes: it makes the
        pages anonymous first (:meth:`undo_failed`). A page written since is anonymous again
        (copy-on-write) and no longer follows the file.
        """
        if self.writer_lock is None or not filemap.supported():
            return
        for name, arr in arrays.items():
            state = written[name]
            if kind_of(name) == "rows" and state.ranges and filemap.remap(
                    arr, array_file(self.path, name, state.file), 0, state.ranges):
                self.mapped[name] = filemap.layout_of(arr)

    def release_mapped(self, arrays: dict[str, np.ndarray]) -> None:
        """Before a commit writes array files: give the pages mapped from them back an anonymous copy
        of their bytes, for each array whose mapping is no longer the one the commit writes (a
        replaced or resized array: its file will be written with other bytes, or replaced)."""
        for name, layout in list(self.mapped.items()):
            arr = arrays.get(name)
            if layout.alive and arr is not None and filemap.layout_of(arr) is layout:
                continue  # written from the mapping itself: the same bytes
            lazy = self.lazy.get(name)
            if lazy is not None and (arr is None or lazy[1] != arr.__array_interface__["data"][0]):
                del self.lazy[name]  # the page checks of a replaced array: they keep its mapping alive
            filemap.privatize(layout)  # nothing to do once unmapped
            del self.mapped[name]

    def unchecked_pages(self, name: str, arr: np.ndarray) -> Callable[[int, int], None] | None:
        """What checks the pages of ``arr`` a commit copies (array bytes ``[lo, hi)``), when it is
        the memory map of an array opened lazily: a page no use checked is checked before its
        bytes are written with a new checksum."""
        entry = self.lazy.get(name)
        if entry is None or entry[1] != arr.__array_interface__["data"][0]:
            return None
        pages = entry[0]
        return lambda lo, hi: pages.check_bytes(pages.offset + lo, pages.offset + hi)

    def newer_generation(self) -> tuple[int, int] | None:
        """For a read-only store: ``(opened, newer)`` when a writer has committed at least twice
        since it opened (it may have reused space this store still reads), else None."""
        if not self.read_only:
            return None
        try:
            g = int(read_manifest(self.path)["generation"])
        except Exception:  # noqa: BLE001 - only a hint for an error message
            return None
        return (self.generation, g) if g >= self.generation + 2 else None

    def release_lock(self) -> None:
        release(self.writer_lock)
        self.writer_lock = None


def _give_back(pages: PageChecks, which: np.ndarray) -> np.ndarray:
    """Drop the private copies of the pages ``which`` (a bool per page) of a read-only open's
    mapped array and count them unchecked (:meth:`StoreFiles.borrowed_pages`); returns the pages
    given back (a bool per page)."""
    back = np.zeros_like(which)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], which.astype(np.int8), [0]]))).reshape(-1, 2)
    for p0, p1 in edges.tolist():  # runs of pages: a few
        if filemap.discard_private(pages.view, p0 * PAGE_BYTES, min(pages.size, p1 * PAGE_BYTES)):
            pages.checked[p0:p1] = False
            pages.done = False
            back[p0:p1] = True
    return back


def read_fresh(files: StoreFiles | None, read: Callable[[], T], *, verify: bool = True) -> T:
    """``read()``, once known to be read from the commit the reader started from
    (:meth:`StoreFiles.check_fresh`): a reader never returns what the writer may have rewritten
    during or before the read, and an exception a rewrite may have caused (an index out of a
    shrunk array, a blob failing its checksum) becomes the error that says to reopen.

    Args:
        verify: the read checks every blob's bytes against its checksum (False: the read is
            refused as soon as blob space may have been reused).

    Raises:
        StaleReadError: a writer may have rewritten what the read used (reopen the store).
    """
    if files is None:
        return read()
    try:
        out = read()
    except StaleReadError:
        raise
    except Exception as e:
        files.check_fresh(blobs=True)  # raises StaleReadError from here, chained to e
        raise e
    files.check_fresh(blobs=not verify)
    return out


def open_commit(path: str, mode: str, build: Callable[[dict[str, Any], Any], T], *, take_lock: bool = True) -> T:
    """Open the last complete commit of ``path``: ``build(body, lock)`` makes the store from it.

    ``mode="r+"`` takes the writer lock first (``build`` hands it to the store's files once the
    store is whole); with ``take_lock=False`` the caller holds it (a store shared by processes takes
    it per operation, :class:`~tiered.durable.lock.SharedWriterLock`). A writer may commit twice between our read of the manifest and of its arrays
    (its old generation is then gone): the newer manifest is read and tried again; damage that
    persists is raised.

    Raises:
        NotATieredStoreError, FormatVersionError, StoreLockedError: as their names say.
        CorruptionError: the manifest and its arrays disagree, naming the store.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    read_manifest(path)  # "not a store" before touching the directory (no lock file)
    lock = acquire_writer_lock(path) if mode == "r+" and take_lock else None
    try:
        body = read_manifest(path)  # under the lock: the last complete commit
        if mode == "r+":
            recover(path, body)
        token = None
        try:
            for attempt in range(3):
                try:
                    check_bounds(path, body)  # before anything sized by the manifest is allocated
                    return build(body, lock)
                except CorruptionError as e:
                    newer = read_manifest(path)
                    if attempt == 2 or (newer.get("generation") == body.get("generation")
                                        and not isinstance(e, OpenRaced)):
                        raise
                    if isinstance(e, OpenRaced) and token is None:
                        token = _COPY_WHOLE.set(True)
                    body = newer
            raise CorruptionError(f"{path}: unreachable")
        except TieredError:
            raise
        except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError, OverflowError,
                ArithmeticError, AssertionError, MemoryError, RecursionError) as e:
            # whatever slipped past the checks: a damaged store, said so, never a raw error
            raise CorruptionError(
                f"{path}: the manifest and its arrays are inconsistent ({type(e).__name__}: {str(e)[:300]}); "
                f"the store is damaged. Run `tiered verify {path}` for details.") from e
        finally:
            if token is not None:
                _COPY_WHOLE.reset(token)
    except BaseException:
        release(lock)
        raise


def recover(path: str, body: dict[str, Any]) -> None:
    """(A writer's open, under the lock) undo what a commit that died after its intent wrote in
    place, and remove what a dead commit left and what no reader needs any more
    (:mod:`tiered.durable.array_files`)."""
    g = body.get("generation")
    if not isinstance(g, int) or isinstance(g, bool):
        return  # a damaged manifest: check_bounds says so
    roll_back(path, g)
    current = body.get("array_files")
    if isinstance(current, dict) and all(isinstance(f, int) for f in current.values()):
        remove_obsolete(path, g, current)


def restore_commit(files: StoreFiles, body: dict[str, Any], mode: str, rows: RowSpace, write: WritePath,
                   placement: Placement) -> None:
    """Point freshly built parts at the commit ``body``'s arrays (memory-mapped) and open its cold tier.

    The blob index must already be the commit's (``BlobIndex.from_arrays``). The row tables and
    dense columns are checked page by page on first use (:mod:`tiered.durable.checked_maps`). Reference
    counts are the saved ones less the writer's tail pins; blobs that only the previous writer's
    tail pinned are freed (``r+``) or forgotten (``r``).

    A read-only open reads its blob index, policy state and written mask whole (every page checked)
    through maps of files that the writer changes in place at its next commits, and checks their
    pages again, copying them private, at first use (:attr:`StoreFiles.map_whole`): a commit
    started while it read them makes it open again (:class:`OpenRaced`).
    """
    try:
        _restore(files, body, mode, rows, write, placement)
    except Exception:
        files.check_unmoved()  # what failed may have read bytes the writer was changing: a race, not damage
        raise
    files.check_unmoved()


def _restore(files: StoreFiles, body: dict[str, Any], mode: str, rows: RowSpace, write: WritePath,
             placement: Placement) -> None:
    """:func:`restore_commit`'s work."""
    load = files.arrays(body)
    index = write.index
    files.adopt_files(body)
    if files.read_only and files.id_check is not None:
        index.guard = files.id_check.ids
    if "index.loc" not in files.whole_pages:  # else forgotten as its pages become the open's own
        placement.drop_memory_copies()
    written = load("written")
    written_pages = files.whole_pages.get("written")
    files.written_checks = [RowCheck([written_pages], rows.capacity)] if written_pages is not None else []
    rows.load_state(body, written, files.written_checks[0] if files.written_checks else None)
    live = index.live_ids()
    dead = np.empty(0, np.int64)
    if body["schema"] is not None:
        layout = write.adopt_schema(schema_of(body), allocate=False, families=body.get("families"))
        fields = list(layout.schema.values())
        derived = derived_tables(body, [f.kind for f in fields])
        shifted = shifted_tables(body, [f.kind for f in fields])
        if any(layout.derived_from.get(fields[i].key) != fields[j].key for i, j in derived.items()):
            raise CorruptionError(f"{files.path}: the manifest's derived_tables {body.get('derived_tables')} do not "
                                  "fit the schema; the store is damaged")
        if any(fields[i].key not in layout.shifted for i in shifted):
            raise CorruptionError(f"{files.path}: the manifest's shifted_tables {body.get('shifted_tables')} do not "
                                  "fit the schema; the store is damaged")
        # the per-row arrays are memory-mapped and checked on first use: a page's checksum, then
        # the references of its rows, before any of their bytes is used (docs/durability.md)
        if layout.schema.flag_fields:
            col, pages = files.lazy_array(body, "flags")
            rows.load_flags(layout.schema, col, RowCheck([pages], rows.capacity))
        for i, f in enumerate(fields):
            if f.kind == "dense":
                if f.flag_bit is None and not f.row_number:  # else a bit of the flags byte (above), or the rows
                    col, pages = files.lazy_array(body, f"dense.{i}")
                    rows.load_dense(f, col, RowCheck([pages], rows.capacity))
            elif i not in derived:
                blob, blob_pages = files.lazy_array(body, f"rows.{i}.blob")
                slot, slot_pages = files.lazy_array(body, f"rows.{i}.slot")
                if i in shifted:
                    table = _compact_table(files, body, i, True, lambda p, f=f: ShiftedRowTable.from_state(
                        rows.capacity, f.frames_per_row, p), blob, slot)
                else:
                    table = RowTable.from_arrays(blob, slot)
                # the written mask's pages too: the reference checks of a unit read it
                table.guard = RowCheck([blob_pages, slot_pages, *([written_pages] if written_pages else [])],
                                       rows.capacity,
                                       functools.partial(check_table_rows, files.path, f.key, rows, layout, index,
                                                         moved=files.moved if files.read_only else None))
                if written_pages is not None:
                    files.written_checks.append(table.guard)
                layout.tables[f.key] = table
        for i, j in derived.items():  # no per-row arrays: the exception list, read (checked) whole
            base = layout.tables[fields[j].key]
            layout.tables[fields[i].key] = table = _compact_table(
                files, body, i, False, functools.partial(NextRowTable.from_state, base))
            _check_row_entries(files.path, fields[i].key, rows, layout, index, table.exc_rows, table.exc_blob,
                               table.exc_slot, rows.written[table.exc_rows])
        problems = check_index(index, [(f.frame_nbytes, f.chunk_frames) for f in layout.families])
        # saved counts, less the pins of the writer's tail (gone now)
        # a read-only open's counts too: its stats and checks see the row tables' references; the
        # pages holding the pinned entries (the tail's few blobs) become its own first
        problems += unpin(index, np.asarray(load("pins")),
                          own=functools.partial(files.own_entries, "index.refcount") if files.read_only else None)
        if problems:
            raise CorruptionError(f"{files.path}: the store is damaged: " + "; ".join(problems[:5])
                                  + f". Run `tiered verify {files.path}` for details.")
        load_policy(placement.policy, body, load, live)
        for name, pages in files.whole_pages.items():
            if name.startswith("policy.") and (pages.size - pages.offset) // pages.row_bytes < index.size:
                pages.check(np.arange(pages.checked.size))  # a use of an id past its end copies it whole
        dead = live[index.refcount[live] == 0]
    cold = placement.tiers[COLD] = files.cold_tier(files.cold_state(body, load), mode)
    if dead.size and mode == "r+":
        write.release_blobs(dead)
    elif files.read_only and "index.state" in files.whole_pages:
        # forgotten: marked free in its state only (no row of this commit names them, and it never
        # allocates), so that of their entries, only the state's page becomes its own
        files.own_entries("index.state", dead)
        index.state[dead] = FREE
    else:
        index.release(dead)
    load_priorities(placement, body, load, write, files.path)
    files.read_only = mode == "r"
    check_consistency(files.path, rows, write.layout, index, cold, extents=mode == "r+")


def options_of(body: dict[str, Any]) -> WriteOptions:
    """The layout options a manifest names; options this code cannot read are damage.

    Raises:
        CorruptionError: naming what could not be read.

    Example:
        >>> options_of({"options": {"blob_min_bytes": 1024, "blob_keys": [], "dense_keys": [], "frames": {},
        ...                         "chunk_frames": 8, "dedup": True}}).chunk_frames
        8
    """
    return _manifest_entry("options", lambda: WriteOptions.from_json(body["options"]))


def schema_of(body: dict[str, Any]) -> Schema:
    """The schema a manifest names (not None). A schema this code cannot read (an unknown dtype,
    a missing entry) is damage to the store, never a mismatch with data.

    Raises:
        CorruptionError: naming what could not be read.

    Example:
        >>> schema_of({"schema": [{"key": ["x"], "dtype": "int64", "shape": [], "kind": "dense"}]})["x"].dtype
        torch.int64
    """
    return _manifest_entry("schema", lambda: Schema.from_json(body["schema"]))


def _manifest_entry(name: str, parse: Callable[[], T]) -> T:
    """``parse()`` of a manifest entry; what this code cannot read in it is damage to the store."""
    try:
        return parse()
    except (SchemaMismatchError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptionError(f"the manifest's {name} cannot be read: {e}") from None


def commit_parts(files: StoreFiles, rows: RowSpace, write: WritePath, placement: Placement, codec: str) -> None:
    """Durably publish the parts' state as a new generation (no-op for a read-only store)."""
    if files.read_only:
        return
    layout = write.layout
    body = {
        "capacity": rows.capacity,
        **rows.state(),
        "codec": codec,
        "options": write.options.to_json(),
        "policy": placement.policy.name,
        "schema": layout.schema.to_json() if layout is not None else None,
        "families": [{"frame_nbytes": f.frame_nbytes, "chunk_frames": f.chunk_frames, "stored_raw": f.stored_raw}
                     for f in (layout.families if layout is not None else [])],
    }
    if layout is not None:
        index_of = {key: i for i, key in enumerate(layout.schema)}
        body["derived_tables"] = {str(index_of[key]): index_of[layout.derived_from[key]]
                                  for key, t in layout.tables.items() if t.derived}
        body["shifted_tables"] = sorted(index_of[key] for key, t in layout.tables.items() if t.shifted)
    arrays = snapshot_arrays(rows, layout, write.index, placement.policy)
    priorities = placement.priorities
    if priorities is not None:
        arrays.update({f"priority.{k}": v for k, v in priorities.state_arrays().items()})
    rows.mark_views()
    row_bits = [rows.dirty.take()] + ([priorities.dirty.take()] if priorities is not None else [])
    blob_bits = [write.index.dirty.take(), placement.policy.take_dirty()]
    # dense columns a caller holds views of (get(copy=False)) stay anonymous: a write through a
    # view while the commit runs must not be replaced by the file's page
    keep = frozenset(n for n in arrays if n.startswith("dense.")) if rows.live_views() else frozenset()
    try:
        files.commit(placement.cold, arrays, body, (union(row_bits), union(blob_bits)), keep)
    except BaseException:  # what this commit should have written is still to be written
        rows.dirty.merge(row_bits[0])
        if priorities is not None:
            priorities.dirty.merge(row_bits[1])
        write.index.dirty.merge(blob_bits[0])
        placement.policy.merge_dirty(blob_bits[1])
        raise


def snapshot_arrays(rows: RowSpace, layout: FieldLayout | None, index: BlobIndex,
                    policy: Policy) -> dict[str, np.ndarray]:
    """The arrays of a commit, by file name (docs/format.md; the cold tier adds ``cold.*``)."""
    arrays = {f"index.{k}": v for k, v in index.state_arrays().items()}
    arrays.update({f"policy.{policy.name}.{k}": v for k, v in policy.state_views().items()})
    arrays["written"] = rows.written
    if layout is not None:
        if rows.flags is not None:
            arrays["flags"] = rows.flags_array()
        for i, f in enumerate(layout.schema.values()):
            if f.flag_bit is not None or f.row_number:
                continue  # a bit of the flags byte, or the rows themselves
            if f.kind == "dense":
                arrays[f"dense.{i}"] = rows.dense_array(f.key)
            else:
                table = layout.tables[f.key]
                for suffix, arr in table.state_arrays().items():
                    arrays[table_file(i, suffix, table.shifted)] = arr
        # the blobs the writer's tails pin, once per pin: the saved reference counts include
        # them, an open takes them off (no row table is read to recount)
        arrays["pins"] = np.concatenate([np.empty(0, np.int64), *(f.tail_blob for f in layout.families)])
    return arrays


def _compact_table(files: StoreFiles, body: dict[str, Any], i: int, shifted: bool,
                   make: Callable[[dict[str, np.ndarray]], T], blob: np.ndarray | None = None,
                   slot: np.ndarray | None = None) -> T:
    """Field ``i``'s next or shifted table over its mapped last column (a next table has none) and
    its exception lists, read (page-checked) whole and checked before use.

    Raises:
        CorruptionError: naming the exception file.
    """
    load = files.arrays(body)
    parts = {s: load(table_file(i, s, shifted)) for s in EXCEPTION_SUFFIXES}
    if blob is not None:
        parts.update(blob=blob, slot=slot)
    try:
        return make(parts)
    except ValueError as e:
        raise CorruptionError(f"{array_path(files.path, body, table_file(i, 'exc_rows', shifted))}: {e}; the store "
                              f"is damaged. Run `tiered verify {files.path}` for details.") from None


def load_policy(policy: Policy, body: dict[str, Any], load: ArrayLoader, live: np.ndarray) -> None:
    """Restore the policy's state saved by the commit, or start it over the live blobs."""
    prefix = f"policy.{policy.name}."
    names = [k for k in body["files"] if k.startswith(prefix)]
    if names:
        # the private memory maps, used as they are (their pages were checked when mapped)
        policy.load_state_arrays({k[len(prefix):]: load(k) for k in names}, copy=False)
    else:  # a store reopened with another policy: every live blob counts as just inserted
        policy.on_insert(live)


def load_priorities(placement: Placement, body: dict[str, Any], load: ArrayLoader, write: WritePath,
                    path: str) -> None:
    """Restore the saved row priorities (none saved: no row was ever given one, all keep the default)
    and, when blob maxima are tracked, recount every blob from them."""
    priorities = placement.priorities
    if priorities is None:
        return
    names = [k for k in body["files"] if k.startswith("priority.")]
    if names:
        priorities.load_state_arrays({k[len("priority."):]: np.array(load(k)) for k in names}, where=path)
        priorities.active = True  # someone set them (only then does a commit save them)
    if priorities.active and write.layout is not None:
        placement.tell_policy(*priorities.recount_all(write.layout, None))


def unpin(index: BlobIndex, pins: np.ndarray, own: Callable[[np.ndarray], None] | None = None) -> list[str]:
    """Take the writer's tail pins (blob ids, once per pin) off the saved reference counts.

    Args:
        own: called with the pinned ids before their counts are written (a read-only open makes
            the pages holding them its own: :meth:`StoreFiles.own_entries`).

    Returns:
        The problems found, in words (empty: the counts are now the row tables' references).
    """
    n = index.size
    if pins.ndim != 1 or pins.dtype.kind not in "iu" or (pins.size and (int(pins.min()) < 0 or int(pins.max()) >= n)):
        return [f"the tail pins hold {pins.dtype}{list(pins.shape)} values outside the blob ids [0, {n})"]
    pinned, times = np.unique(pins.astype(np.int64), return_counts=True)
    if own is not None:
        # before the counts are read for the new ones: the pages then hold this commit's counts
        # (rebuilt where the writer changed them since). Only the counts' pages: the pins' entries
        # in the other columns are not touched here, and a use of them checks their pages then
        # (copying every column's page of the tail here cost a read-only open about 1 MiB per column)
        own(pinned)
    left = index.refcount[pinned] - times
    if (left < 0).any() or (index.refcount[:n][index.state[:n] != STORED] != 0).any() or (index.refcount[:n] < 0).any():
        return ["reference counts of the blob index are negative or name free blobs"]
    index.refcount[pinned] = left  # only those: pages of a mapped index stay unwritten
    index.dirty.mark(pinned)  # the file still counts the pins: the next commit writes these counts
    return []


def check_table_rows(path: str, key: Any, rows: RowSpace, layout: FieldLayout, index: BlobIndex,
                     at: np.ndarray, moved: Callable[[], bool] | None = None) -> None:
    """Check the row table entries of field ``key`` at rows ``at`` (sorted): every written row
    points at stored blobs of its field's family, at a frame inside the blob. Called when their
    pages are first checked (a next table has no per-row pages: its exceptions are checked when
    the store opens). A
    shifted table checks the whole stacks of the written rows (their first frames are the last
    frames of the rows before, which a read of them checks first).

    Args:
        moved: for a read-only open whose index pages are still mapped from their files
            (:meth:`StoreFiles.moved`): whether the writer may have changed them since the open
            checked them. Only then are the index pages these entries name made the open's own
            (copied and checked) before they are read: the entries are read, never written, here.

    Raises:
        CorruptionError: naming the store, the field and the first bad row.
    """
    t = layout.tables[key]
    whole = at.size and int(at[-1]) - int(at[0]) + 1 == at.size  # one run of rows: slices, no gathers
    pick = slice(int(at[0]), int(at[-1]) + 1) if whole else at
    if t.shifted:  # every written row's whole stack: its first frames are the rows' before
        blob, slot = t.refs(at)
        _check_row_entries(path, key, rows, layout, index, at, blob, slot, rows.written[pick], moved)
        return
    _check_row_entries(path, key, rows, layout, index, at, t.blob[pick], t.slot[pick], rows.written[pick], moved)


def _check_row_entries(path: str, key: Any, rows: RowSpace, layout: FieldLayout, index: BlobIndex, at: np.ndarray,
                       ids: np.ndarray, slots: np.ndarray, w: np.ndarray,
                       moved: Callable[[], bool] | None = None) -> None:
    """Check ``[len(at), k]`` entries ``ids``/``slots`` of rows ``at`` (``w``: which are written);
    ``moved``: as :func:`check_table_rows` takes it."""
    n = index.size
    if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= n):
        r = int(at[((ids < -1) | (ids >= n)).any(1)][0])
        raise CorruptionError(f"{path}: the store is damaged: row table of {key_to_str(key)!r} names blob ids "
                              f"outside [-1, {n}) (first: row {r}). Run `tiered verify {path}` for details.")
    every = bool(w.all())
    ids, slots = (ids, slots) if every else (ids[w], slots[w])
    fam = layout.family_of[key]
    safe = np.maximum(ids, 0)
    frame_nbytes = max(layout.families[fam].frame_nbytes, 1)
    for attempt in range(2):  # again only where the index pages read may have changed meanwhile
        if ids.size > n:  # frames each blob may hold, then one gather per entry
            frames_in = np.where((index.state[:n] == STORED) & (index.family[:n] == fam),
                                 index.raw_nbytes[:n] // frame_nbytes, 0)[safe]
        else:
            frames_in = np.where((index.state[safe] == STORED) & (index.family[safe] == fam),
                                 index.raw_nbytes[safe] // frame_nbytes, 0)
        bad = (ids < 0) | (slots < 0) | (slots >= frames_in)
        if attempt or moved is None or not moved():
            break
        index.check_ids(None if ids.size > n else safe)  # the pages as this commit left them, the open's own
    if bad.any():
        r = at[w][bad.any(1)]
        raise CorruptionError(
            f"{path}: the store is damaged: {r.size} written rows of {key_to_str(key)!r} point at no stored blob "
            f"of their field or at a frame outside it (first: row {int(r[0])}). Run `tiered verify {path}` "
            "for details.")


def check_consistency(path: str, rows: RowSpace, layout: FieldLayout | None, index: BlobIndex,
                      cold: MemmapTier, *, extents: bool = True) -> None:
    """Cheap, vectorized checks that a commit's arrays agree with its manifest.

    Args:
        extents: also check that no free or deferred cold extent overlaps a stored blob or another
            extent, and no two stored blobs overlap (a writer's open: its allocations would
            overwrite live bytes). A read-only store allocates nothing, and every blob it reads is
            checked against its checksum before it is decoded, so it checks only that every blob
            lies inside the cold segments.

    Raises:
        CorruptionError: naming what disagrees.
    """
    cap = rows.capacity
    problems = []
    if rows.written.shape != (cap,):
        problems.append(f"written has shape {rows.written.shape}, expected ({cap},)")
    if not (0 <= rows.length <= cap and 0 <= rows.cursor < cap):
        problems.append(f"len {rows.length} / cursor {rows.cursor} do not fit capacity {cap}")
    if layout is not None:
        for key, t in layout.tables.items():
            ids = [a for name, a in t.state_arrays().items() if name in ("blob", "exc_blob") and a.size]
            if (t.capacity, t.frames) != (cap, layout.schema[key].frames_per_row):
                problems.append(f"row table of {key_to_str(key)!r} has shape {(t.capacity, t.frames)}")
            elif t.guard is None and ids and max(int(a.max()) for a in ids) >= index.size:
                problems.append(f"row table of {key_to_str(key)!r} names blob {max(int(a.max()) for a in ids)} "
                                f"of an index of {index.size}")
        for key, col in rows.dense.items():
            if tuple(col.shape) != (cap, *layout.schema[key].shape):
                problems.append(f"dense column {key_to_str(key)!r} has shape {tuple(col.shape)}")
        if layout.schema.flag_fields and (rows.flags is None or tuple(rows.flags.shape) != (cap,)):
            problems.append(f"the flags column has shape {None if rows.flags is None else tuple(rows.flags.shape)}")
    problems += _check_cold_bounds(cold, index)
    if extents and not problems:
        problems += _check_cold_extents(cold, index)
    if problems:
        raise CorruptionError(f"{path}: the store is damaged: " + "; ".join(problems[:5])
                              + f". Run `tiered verify {path}` for details.")


def _int(body: dict[str, Any], key: str, low: int, high: int | None = None) -> int:
    v = body.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
        raise CorruptionError(f"the manifest's {key!r} is {v!r}, expected an int >= {low}"
                              + (f" and <= {high}" if high is not None else ""))
    return v


def _header(store: str, body: dict[str, Any], name: str, files: dict[str, Any]) -> Any:
    """The checked ``.npy`` header of array ``name`` (no data read)."""
    path = array_path(store, body, name)
    if name not in files:
        raise CorruptionError(f"{path}: the manifest lists no {name!r} array; the store is damaged")
    try:
        fd = fileio.open_for_read(path)
    except FileNotFoundError:
        raise CorruptionError(f"{path}: file named by the manifest is missing; the store is damaged") from None
    try:
        size = os.fstat(fd).st_size
        first_page = None
        if isinstance(body.get("array_files"), dict):
            def first_page() -> Any:  # the commit's first page, asked for only when the header disagrees
                return UndoChain(store, int(body["generation"])).page(
                    name, body["array_files"].get(name), 0, min(PAGE_BYTES, files[name]),
                    page_checksums_of(body).get(name, [None])[0])
        if size == files[name]:
            try:
                return read_npy_header(fd, path, size)
            except CorruptionError:
                if (head := rebuilt_header(size, path, files[name], first_page)) is None:
                    raise
                return head
        if (head := rebuilt_header(size, path, files[name], first_page)) is not None:
            return head  # grown in place by a newer commit since
        raise CorruptionError(f"{path}: expected {files[name]} bytes, found {size} (truncated or overwritten)")
    finally:
        os.close(fd)


def check_bounds(path: str, body: dict[str, Any]) -> None:
    """Check every size the manifest gives against what its files hold, before anything sized by
    them is allocated: a lie (capacity 5e7 for a 100-row store, an index of 1e9 blobs) is refused
    here with the memory of a few ``.npy`` headers.

    Raises:
        CorruptionError: naming the manifest or the file whose size disagrees.
    """
    manifest = os.path.join(path, MANIFEST)
    try:
        _int(body, "generation", 0)
        capacity = _int(body, "capacity", 1)
        _int(body, "len", 0, capacity)
        _int(body, "cursor", 0, capacity - 1)
        files = body.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in files.items()):
            raise CorruptionError("the manifest's 'files' is not a map of array names to sizes")
        for key, kind in (("cold", dict), ("options", dict)):
            if not isinstance(body.get(key), kind):
                raise CorruptionError(f"the manifest's {key!r} is {type(body.get(key)).__name__}, expected {kind.__name__}")
        page_checksums_of(body)
    except CorruptionError as e:
        raise CorruptionError(f"{manifest}: {e}. The store is damaged; run `tiered verify {path}`.") from None
    problems = []

    def expect(name: str, shape: tuple[int, ...], dtype: Any = None) -> Any:
        h = _header(path, body, name, files)
        if h.shape != shape or (dtype is not None and h.dtype != np.dtype(dtype)):
            problems.append(f"{array_path(path, body, name)} holds {h.dtype}{list(h.shape)}, the manifest "
                            f"implies {np.dtype(dtype) if dtype is not None else h.dtype}{list(shape)}")
        return h

    expect("written", (capacity,), np.bool_)
    state = _header(path, body, "index.state", files)
    n_blobs = state.shape[0] if len(state.shape) == 1 else -1
    for name in [k for k in files if k.startswith("index.") and k not in ("index.free_ids", "index.meta")]:
        h = _header(path, body, name, files)
        if not h.shape or h.shape[0] != n_blobs:
            problems.append(f"{name} has shape {list(h.shape)}, index.state has {n_blobs} entries")
    meta = expect("index.meta", (2,), np.int64)
    if meta.shape == (2,) and meta.dtype == np.dtype(np.int64):
        fd = fileio.open_for_read(array_path(path, body, "index.meta"))
        try:
            size = int(np.frombuffer(os.pread(fd, 8, meta.offset), dtype=meta.dtype)[0])
        finally:
            os.close(fd)
        if not 0 <= size <= max(n_blobs, 0):
            problems.append(f"index.meta says {size} blob ids, index.state holds {n_blobs}")
    free = _header(path, body, "index.free_ids", files)
    if len(free.shape) != 1 or free.shape[0] > max(n_blobs, 0):
        problems.append(f"index.free_ids has shape {list(free.shape)} for an index of {n_blobs} blobs")
    if body.get("schema") is not None:
        if not isinstance(body["schema"], list):
            problems.append("the manifest's schema is not a list of fields")
        else:
            try:
                fields = list(schema_of(body).values())
            except CorruptionError as e:
                problems.append(str(e))
                fields = []
            try:
                derived = derived_tables(body, [f.kind for f in fields])
                shifted = shifted_tables(body, [f.kind for f in fields])
            except CorruptionError as e:
                problems.append(str(e))
                derived, shifted = {}, set()
            if any(f.flag_bit is not None for f in fields):
                expect("flags", (capacity,), np.dtype(np.uint8))
            for i, f in enumerate(fields):
                if f.flag_bit is not None or f.row_number:
                    continue  # a bit of the flags byte, or the rows themselves (no file)
                if f.kind == "dense":
                    expect(f"dense.{i}", (capacity, *f.shape), f.column_file_dtype)
                elif i not in derived:  # a next table keeps no per-row arrays
                    width = 1 if i in shifted else f.frames_per_row
                    expect(f"rows.{i}.blob", (capacity, width), BLOB_DTYPE)
                    expect(f"rows.{i}.slot", (capacity, width), SLOT_DTYPE)
            for i in [*derived, *sorted(shifted)]:
                exc = _header(path, body, table_file(i, "exc_rows", i in shifted), files)
                k = exc.shape[0] if len(exc.shape) == 1 else -1
                width = fields[i].frames_per_row - (1 if i in shifted else 0)  # next: whole stacks
                expect(table_file(i, "exc_rows", i in shifted), (k,), np.int64)
                expect(table_file(i, "exc_blob", i in shifted), (k, width), BLOB_DTYPE)
                expect(table_file(i, "exc_slot", i in shifted), (k, width), SLOT_DTYPE)
    if problems:
        raise CorruptionError(f"{path}: the store is damaged: " + "; ".join(problems[:5])
                              + f". Run `tiered verify {path}` for details.")


def check_index(index: BlobIndex, families: list[tuple[int, int]]) -> list[str]:
    """Vectorized checks of the blob index on its own: states, the free-id pool, and for every
    stored blob a known codec and family and a raw size of 1..chunk_frames whole frames.

    One pass over whole columns (no gathers of the stored ids; free ids are masked out).

    Args:
        index: the index of a commit.
        families: ``(frame_nbytes, chunk_frames)`` per frame family.
    """
    problems = []
    n = index.size
    state = index.state[:n]
    stored = state == STORED
    is_free = state == FREE
    n_stored, n_free = int(np.count_nonzero(stored)), int(np.count_nonzero(is_free))
    if n_stored + n_free != n:
        problems.append("index.state holds values other than free (0) and stored (2)")
    free = index.free_ids
    pool = free_pool_problem(free, is_free)
    if pool == "range":
        problems.append(f"index.free_ids holds ids outside [0, {n})")
    elif pool == "listing":
        problems.append("index.free_ids lists an id twice or an id that is not free")
    elif pool == "count":
        problems.append(f"index.free_ids lists {free.size} ids but {n_free} are free")
    if not n_stored:
        return problems
    bad = impossible_raw_sizes(index.family[:n], index.raw_nbytes[:n], families)
    bad |= index.nbytes[:n] < 0
    bad |= index.codec[:n].view(np.uint8) > 2  # codec ids 0, 1, 2 (a negative int8 reads as > 127)
    if n_free:
        bad &= stored
    if bad.any():
        b = int(np.argmax(bad))
        problems.append(f"{int(np.count_nonzero(bad))} stored blobs have an impossible family, codec or size in "
                        f"the index (first: blob {b}, family {int(index.family[b])}, codec {int(index.codec[b])}, "
                        f"raw size {int(index.raw_nbytes[b])})")
    return problems


def _check_cold_bounds(cold: MemmapTier, index: BlobIndex) -> list[str]:
    """Every live blob has a plausible raw size and lies inside one cold segment's reserved bytes
    and below the allocator's high water: a few passes over whole columns, no gathers."""
    n = index.size
    live = index.state[:n] != FREE
    n_live = int(np.count_nonzero(live))
    if not n_live:
        return []
    dead = None if n_live == n else np.flatnonzero(~live)
    problems = []
    raw = index.raw_nbytes[:n]
    if int(raw.min()) < 0 or int(raw.max()) > (1 << 34):  # free ids hold 0: look closer only then
        bad = (raw < 0) | (raw > (1 << 34))
        if (bad if dead is None else bad & live).any():
            problems.append("blob sizes are impossible")
    loc = np.ascontiguousarray(index.loc[:n, COLD])  # a copy: free ids' entries are zeroed below
    nbytes = index.nbytes[:n]
    end = loc + nbytes
    if dead is not None:
        loc[dead] = 0
        end[dead] = 0
    bad = bool(int(loc.min()) < 0 or (end < loc).any())  # a negative offset or size
    if not bad:
        alloc, state = cold.allocator, cold.state()
        seg_bytes = int(state["segment_bytes"])
        sizes = [int(x) for x in state["segment_sizes"]]
        if int(end.max()) > min(int(alloc.high_water), (len(sizes) - 1) * seg_bytes + (sizes[-1] if sizes else 0)):
            bad = True  # past the high water or the last segment's reserved bytes
        else:  # each blob inside the segment it starts in (its last byte's segment is its first's)
            pow2 = seg_bytes > 0 and seg_bytes & (seg_bytes - 1) == 0
            first = loc >> (seg_bytes.bit_length() - 1) if pow2 else loc // max(seg_bytes, 1)
            end -= 1
            last = end >> (seg_bytes.bit_length() - 1) if pow2 else end // max(seg_bytes, 1)
            bad = bool((last > first).any())
            for i in [i for i, size in enumerate(sizes[:-1]) if size < seg_bytes]:  # short segments (rare)
                bad = bad or bool((end[first == i] >= i * seg_bytes + sizes[i]).any())
    if bad:
        problems.append("blob locations fall outside the cold segments' reserved bytes")
    return problems


def _check_cold_extents(cold: MemmapTier, index: BlobIndex) -> list[str]:
    """No free or deferred extent of the cold allocator overlaps a stored blob or another extent,
    and no two stored blobs overlap (a write would overwrite live bytes)."""
    live = index.live_ids()
    alloc = cold.allocator.state()
    off = np.concatenate([index.loc[live, COLD], alloc["free_offsets"], alloc["pending_offsets"]]).astype(np.int64)
    ln = np.concatenate([align(index.nbytes[live]), alloc["free_sizes"], alloc["pending_sizes"]]).astype(np.int64)
    if (ln < 0).any() or (off < 0).any():
        return ["the cold tier's free extents are negative"]
    if extents_overlap(off, ln):
        return ["the cold tier's free extents overlap stored blobs or each other"]
    return []
