"""Assertions shared by the test modules."""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from tiered import TieredStore
from tiered.engine.blob_index import HOT, WARM
from tiered.testing import parts


def assert_td_equal(a: TensorDict, b: TensorDict) -> None:
    ka = set(a.keys(include_nested=True, leaves_only=True))
    kb = set(b.keys(include_nested=True, leaves_only=True))
    assert ka == kb, (ka ^ kb)
    for k in ka:
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x, y), f"field {k} differs"


def flip_blob_byte(store: TieredStore, blob: int, tier: int | None = None) -> None:
    """Flip one bit (0x20) of the middle byte of ``blob`` where ``store`` keeps it: in ``tier``, or
    the hot tier when it holds the blob, else the warm one."""
    p = parts(store)
    if tier is None:
        tier = HOT if p.index.loc[blob, HOT] >= 0 else WARM
    at = int(p.index.loc[blob, tier]) + int(p.index.nbytes[blob]) // 2
    byte = np.empty(1, np.uint8)
    p.tiers[tier].read(np.array([at]), np.array([1]), byte, np.array([0]))
    p.tiers[tier].write(np.array([at]), byte ^ 0x20, np.array([0]), np.array([1]))


def edit_manifest(path: Path, fn) -> None:
    """Change the manifest body in place (``fn(body)``) and recompute its digest: a self-consistent
    lie, as damage a digest cannot catch. The format version is left as it was."""
    doc = json.loads((Path(path) / "manifest.json").read_text())
    fn(doc["body"])
    doc["sha256"] = hashlib.sha256(json.dumps(doc["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (Path(path) / "manifest.json").write_text(json.dumps(doc))


def restamp(path: Path) -> None:
    """Record in the manifest the page checksums of every array file of the last commit as the
    files are now (and the digest; sizes are left as recorded): edits made to the files become a
    self-consistent lie, so what is tested is the checks behind the page checksums (a writer bug
    would look so)."""
    from tiered.durable.commit_arrays import array_path
    from tiered.durable.manifest import page_checksums

    def stamp(body: dict) -> None:
        for name in body["files"]:  # a loop over a commit's array files (a few dozen)
            data = Path(array_path(str(path), body, name)).read_bytes()
            body["checksums"]["files"][name] = page_checksums([memoryview(data)])

    edit_manifest(path, stamp)


def schema_entry(body: dict, key: list[str]) -> dict:
    """The manifest schema entry of the field ``key`` (a list of strings)."""
    return next(f for f in body["schema"] if f["key"] == key)


def manifest_body(path: Path) -> dict:
    """The body of the manifest of the store at ``path`` (its last commit)."""
    return json.loads((Path(path) / "manifest.json").read_text())["body"]


def check_refcounts(store: TieredStore) -> None:
    idx = parts(store).index
    refs = [t.blob[parts(store).rows.written].reshape(-1) for t in parts(store).layout.tables.values()]
    refs += [f.tail_blob for f in parts(store).layout.families]
    refs = np.concatenate(refs) if refs else np.empty(0, np.int64)
    refs = refs[refs >= 0]
    counts = np.bincount(refs, minlength=idx.size)[: idx.size]
    live = idx.state[: idx.size] != 0
    assert np.array_equal(counts[live], idx.refcount[: idx.size][live])
    assert (counts[~live] == 0).all(), "a row references a freed blob"
    assert (counts[live] > 0).all(), "a live blob is referenced by nothing (leak)"


class GenFiles:
    """The array files of a store's last commit, addressed as ``files / "name.npy"``: the copy
    ``arrays/name.<c>.npy`` the manifest names."""

    def __init__(self, path, body=None) -> None:
        import json
        from pathlib import Path

        self.path = Path(path)
        self.body = body if body is not None else json.loads((self.path / "manifest.json").read_text())["body"]

    def __truediv__(self, fname: str):
        from pathlib import Path

        from tiered.durable.commit_arrays import array_path

        assert fname.endswith(".npy"), fname
        return Path(array_path(str(self.path), self.body, fname[:-4]))


def gen_files(path, body=None) -> GenFiles:
    """:class:`GenFiles` of the store at ``path`` (its manifest's ``body`` unless given)."""
    return GenFiles(path, body)


def fork_child(fn) -> int:
    """Run ``fn`` in a forked child (exit code 0, or 3 with the traceback printed if it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            torch.set_num_threads(1)  # as DataLoader workers do: no OpenMP pool inherited from the parent
            fn()
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    return pid


def wait_child(pid: int) -> tuple[str, int]:
    """``("killed", signal)`` or ``("exited", code)`` of a forked child."""
    _, status = os.waitpid(pid, 0)
    return ("killed", os.WTERMSIG(status)) if os.WIFSIGNALED(status) else ("exited", os.WEXITSTATUS(status))
