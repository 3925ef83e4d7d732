"""The durable store: the cold tier's files, commits, opening, consistency checks, the writer lock.

A store with a path is a directory (docs/format.md): ``manifest.json`` (schema, options, format
version, generation, the list of array files with their sizes), one ``gen-<g>/`` directory of
``.npy`` arrays per commit (blob index columns, row tables, dense columns, the written mask, the
cold tier's allocator state, the policy's state), and the cold segments under ``cold/``.

A commit writes the blob bytes first (the cold tier's ``flush``), then the new generation's
arrays, each fsynced, then the manifest through a temp file, fsync, rename and fsync of the
directory (:mod:`tiered.engine.manifest`). Only then is the previous-but-one generation removed
and the cold space freed by overwritten rows made reusable. Opening picks the last complete
commit and checks that its arrays agree with the manifest before anything is trusted.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from tiered import TieredStore
    >>> d = tempfile.mkdtemp() + "/s"
    >>> with TieredStore(10, d) as s:
    ...     _ = s.extend(TensorDict({"x": torch.arange(4.0)}, [4]))
    >>> from tiered.engine.manifest import read_manifest
    >>> read_manifest(d)["generation"] >= 2 and read_manifest(d)["len"]
    4
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from .. import fileio
from ..errors import CorruptionError, StoreExistsError, TieredError
from ..index import COLD, BlobIndex, RowTable
from ..policy import Policy
from ..schema import Schema, key_to_str
from ..tiers import HDF5Tier, MemmapTier, Tier
from .layout import FieldLayout
from .lock import acquire_writer_lock, release
from .manifest import MANIFEST, gen_dir_name, load_npy, read_manifest, save_npy, write_manifest
from .placement import Placement
from .rows import RowSpace
from .write import WritePath

T = TypeVar("T")

__all__ = ["StoreFiles", "BACKENDS", "open_commit", "restore_commit", "commit_parts", "snapshot_arrays",
           "check_consistency"]

BACKENDS: dict[str, type[MemmapTier]] = {"memmap": MemmapTier, "hdf5": HDF5Tier}
ArrayLoader = Callable[[str], np.ndarray]


class StoreFiles:
    """A store directory: its lock, its cold tier's files and its commits.

    Args:
        path: the store directory.
        backend: ``"memmap"`` or ``"hdf5"`` (the cold segments' file kind).
    """

    def __init__(self, path: str, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
        self.path = path
        self.backend = backend
        self.generation = 0
        self.read_only = False
        self.writer_lock: Any = None

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

    def cold_tier(self, state: dict[str, Any] | None = None, mode: str = "w") -> Tier:
        """A new cold tier (``state=None``) or the one a commit describes, opened in ``mode``."""
        cls = BACKENDS[self.backend]
        directory = os.path.join(self.path, "cold")
        return cls(directory) if state is None else cls.open(directory, state, mode)

    def arrays(self, body: dict[str, Any]) -> ArrayLoader:
        """A loader of the arrays the commit ``body`` lists (memory-mapped, sizes checked)."""
        gdir = os.path.join(self.path, gen_dir_name(body["generation"]))
        files = body["files"]

        def load(name: str) -> np.ndarray:
            if name not in files:
                raise CorruptionError(f"{self.path}: the manifest lists no {name!r} array; the store is damaged")
            return load_npy(os.path.join(gdir, name + ".npy"), files[name])

        return load

    @staticmethod
    def cold_state(body: dict[str, Any], load: ArrayLoader) -> dict[str, Any]:
        state = dict(body["cold"])
        for k in body["files"]:
            if k.startswith("cold."):
                state[k.split(".", 1)[1]] = load(k)
        return state

    # -- committing ---------------------------------------------------------------------------
    def commit(self, cold: Tier, arrays: dict[str, np.ndarray], body: dict[str, Any]) -> None:
        """Durably publish a new generation (see the module docstring for the order of writes)."""
        cold.flush()
        g = self.generation + 1
        gdir = os.path.join(self.path, gen_dir_name(g))
        if os.path.isdir(gdir):  # left over by a crash before its manifest was published
            for name in os.listdir(gdir):
                fileio.remove(os.path.join(gdir, name))
        os.makedirs(gdir, exist_ok=True)
        cold_state = cold.state()
        arrays = {**arrays, **{f"cold.{k}": v for k, v in cold_state.items() if isinstance(v, np.ndarray)}}
        files = {name: save_npy(os.path.join(gdir, name + ".npy"), arr) for name, arr in arrays.items()}
        fileio.fsync_dir(gdir)
        fileio.fsync_dir(self.path)
        write_manifest(self.path, {
            **body, "generation": g, "backend": self.backend,
            "cold": {k: v for k, v in cold_state.items() if not isinstance(v, np.ndarray)}, "files": files})
        # Keep the previous generation one commit longer: a reader (or `tiered verify`) that read
        # the old manifest an instant ago can still load its arrays.
        old = os.path.join(self.path, gen_dir_name(self.generation - 1))
        self.generation = g
        if os.path.isdir(old):
            for name in os.listdir(old):
                fileio.remove(os.path.join(old, name))
            os.rmdir(old)
        # space freed by overwritten rows is reusable only now that the commit is durable
        cold.release_deferred()

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


def open_commit(path: str, mode: str, build: Callable[[dict[str, Any], Any], T]) -> T:
    """Open the last complete commit of ``path``: ``build(body, lock)`` makes the store from it.

    ``mode="r+"`` takes the writer lock first (``build`` hands it to the store's files once the
    store is whole). A writer may commit twice between our read of the manifest and of its arrays
    (its old generation is then gone): the newer manifest is read and tried again; damage that
    persists is raised.

    Raises:
        NotATieredStoreError, FormatVersionError, StoreLockedError: as their names say.
        CorruptionError: the manifest and its arrays disagree, naming the store.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    read_manifest(path)  # "not a store" before touching the directory (no lock file)
    lock = acquire_writer_lock(path) if mode == "r+" else None
    try:
        body = read_manifest(path)  # under the lock: the last complete commit
        try:
            for attempt in range(3):
                try:
                    return build(body, lock)
                except CorruptionError:
                    newer = read_manifest(path)
                    if attempt == 2 or newer["generation"] == body["generation"]:
                        raise
                    body = newer
            raise AssertionError("unreachable")
        except TieredError:
            raise
        except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
            raise CorruptionError(
                f"{path}: the manifest and its arrays are inconsistent ({type(e).__name__}: {e}); "
                f"the store is damaged. Run `tiered verify {path}` for details.") from e
    except BaseException:
        release(lock)
        raise


def restore_commit(files: StoreFiles, body: dict[str, Any], mode: str, rows: RowSpace, write: WritePath,
                   placement: Placement) -> None:
    """Point freshly built parts at the commit ``body``'s arrays (memory-mapped) and open its cold tier.

    The blob index must already be the commit's (``BlobIndex.from_arrays``). Reference counts are
    recomputed from the row tables; blobs that only the previous writer's tail pinned are freed
    (``r+``) or forgotten (``r``).
    """
    load = files.arrays(body)
    index = write.index
    files.generation = int(body["generation"])
    placement.drop_memory_copies()
    rows.load_state(body, load("written"))
    live = index.live_ids()
    dead = np.empty(0, np.int64)
    if body["schema"] is not None:
        layout = write.adopt_schema(Schema.from_json(body["schema"]))
        for i, f in enumerate(layout.schema.values()):
            if f.kind == "dense":
                rows.dense[f.key] = torch.from_numpy(load(f"dense.{i}"))
            else:
                layout.tables[f.key] = RowTable.from_arrays(load(f"rows.{i}.blob"), load(f"rows.{i}.slot"))
        refs = layout.referenced(rows.written)
        index.refcount[: index.size] = np.bincount(refs, minlength=index.size)[: index.size].astype(np.int32)
        load_policy(placement.policy, body, load, live)
        dead = live[index.refcount[live] == 0]
    placement.tiers[COLD] = files.cold_tier(files.cold_state(body, load), mode)
    if dead.size and mode == "r+":
        write.release_blobs(dead)
    else:
        index.release(dead)
    load_priorities(placement, body, load, write, files.path)
    files.read_only = mode == "r"
    check_consistency(files.path, rows, write.layout, index, placement.cold)


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
        "families": [{"frame_nbytes": f.frame_nbytes, "chunk_frames": f.chunk_frames}
                     for f in (layout.families if layout is not None else [])],
    }
    arrays = snapshot_arrays(rows, layout, write.index, placement.policy)
    if placement.priorities is not None:
        arrays.update({f"priority.{k}": v for k, v in placement.priorities.state_arrays().items()})
    files.commit(placement.cold, arrays, body)


def snapshot_arrays(rows: RowSpace, layout: FieldLayout | None, index: BlobIndex,
                    policy: Policy) -> dict[str, np.ndarray]:
    """The arrays of a commit, by file name (format v1 names; the cold tier adds ``cold.*``)."""
    arrays = {f"index.{k}": v for k, v in index.state_arrays().items()}
    arrays["written"] = rows.written
    if layout is not None:
        for i, f in enumerate(layout.schema.values()):
            if f.kind == "dense":
                arrays[f"dense.{i}"] = rows.dense[f.key].numpy()
            else:
                arrays[f"rows.{i}.blob"] = layout.tables[f.key].blob
                arrays[f"rows.{i}.slot"] = layout.tables[f.key].slot
    arrays.update({f"policy.{policy.name}.{k}": v for k, v in policy.state_arrays().items()})
    return arrays


def load_policy(policy: Policy, body: dict[str, Any], load: ArrayLoader, live: np.ndarray) -> None:
    """Restore the policy's state saved by the commit, or start it over the live blobs."""
    prefix = f"policy.{policy.name}."
    names = [k for k in body["files"] if k.startswith(prefix)]
    if names:
        policy.load_state_arrays({k[len(prefix):]: np.array(load(k)) for k in names})
    else:  # an older commit, or another policy: every live blob counts as just inserted
        policy.on_insert(live)


def load_priorities(placement: Placement, body: dict[str, Any], load: ArrayLoader, write: WritePath,
                    path: str) -> None:
    """Restore the saved row priorities (older commits have none: every row keeps the default)
    and, when blob maxima are tracked, recount every blob from them."""
    priorities = placement.priorities
    if priorities is None:
        return
    names = [k for k in body["files"] if k.startswith("priority.")]
    if names:
        priorities.load_state_arrays({k[len("priority."):]: np.array(load(k)) for k in names}, where=path)
        priorities.active |= bool((priorities.row != priorities.default).any())  # someone set them
    if priorities.active and write.layout is not None:
        placement.policy.set_priority(*priorities.recount_all(write.layout, None))


def check_consistency(path: str, rows: RowSpace, layout: FieldLayout | None, index: BlobIndex,
                      cold: Tier | None) -> None:
    """Cheap, vectorized checks that a commit's arrays agree with its manifest.

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
            if t.blob.shape != (cap, layout.schema[key].frames_per_row) or t.slot.shape != t.blob.shape:
                problems.append(f"row table of {key_to_str(key)!r} has shape {t.blob.shape}")
            elif t.blob.size and int(t.blob.max()) >= index.size:
                problems.append(f"row table of {key_to_str(key)!r} names blob {int(t.blob.max())} "
                                f"of an index of {index.size}")
        for key, col in rows.dense.items():
            if tuple(col.shape) != (cap, *layout.schema[key].shape):
                problems.append(f"dense column {key_to_str(key)!r} has shape {tuple(col.shape)}")
    live = index.live_ids()
    if live.size and cold is not None:
        loc = index.loc[live, COLD]
        end = loc + index.nbytes[live]
        high = getattr(getattr(cold, "allocator", None), "high_water", None)
        if (loc < 0).any() or (high is not None and int(end.max()) > high):
            problems.append("blob locations fall outside the cold segments")
        if (index.raw_nbytes[live] < 0).any() or (index.raw_nbytes[live] > (1 << 34)).any():
            problems.append("blob sizes are impossible")
    if problems:
        raise CorruptionError(f"{path}: the store is damaged: " + "; ".join(problems[:5])
                              + f". Run `tiered verify {path}` for details.")
