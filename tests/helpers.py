"""Assertions shared by the test modules."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from tiered import TieredStore
from tiered.testing import parts


def assert_td_equal(a: TensorDict, b: TensorDict) -> None:
    ka = set(a.keys(include_nested=True, leaves_only=True))
    kb = set(b.keys(include_nested=True, leaves_only=True))
    assert ka == kb, (ka ^ kb)
    for k in ka:
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x, y), f"field {k} differs"


def open_golden_pong(tar_path: Path, tmp_path: Path, atari_pong: TensorDict) -> tuple[Path, TensorDict]:
    """Extract a golden Pong fixture store (``tests/fixtures/format<N>/pong_format<N>.tar.xz``,
    all written by the same recipe: rows 400:600 of the cached rollout, row 20's next
    observation replaced by row 90's, rows 30 and 150 swapped) into ``tmp_path``: its path and
    the 200 rows it must read back."""
    import tarfile

    with tarfile.open(tar_path) as tar:
        tar.extractall(tmp_path, filter="data")
    path = tmp_path / Path(tar_path).name.removesuffix(".tar.xz")
    data = atari_pong[400:600].clone()
    data["next", "observation"][20] = data["next", "observation"][90]
    order = torch.arange(200)
    order[150], order[30] = 30, 150
    return path, data[order]


def edit_manifest(path: Path, fn) -> None:
    """Change the manifest body in place (``fn(body)``) and recompute its digest: a self-consistent
    lie, as damage a digest cannot catch. The format version is left as it was."""
    doc = json.loads((Path(path) / "manifest.json").read_text())
    fn(doc["body"])
    doc["sha256"] = hashlib.sha256(json.dumps(doc["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (Path(path) / "manifest.json").write_text(json.dumps(doc))


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
    """The array files of a store's last commit, addressed as ``files / "name.npy"`` whatever the
    format: ``gen-<g>/name.npy`` (format 1) or the copy ``arrays/name.<c>.npy`` (format 2)."""

    def __init__(self, path, body=None) -> None:
        import json
        from pathlib import Path

        self.path = Path(path)
        self.body = body if body is not None else json.loads((self.path / "manifest.json").read_text())["body"]

    def __truediv__(self, fname: str):
        from pathlib import Path

        from tiered.engine.persistence import array_path

        assert fname.endswith(".npy"), fname
        return Path(array_path(str(self.path), self.body, fname[:-4]))


def gen_files(path, body=None) -> GenFiles:
    """:class:`GenFiles` of the store at ``path`` (its manifest's ``body`` unless given)."""
    return GenFiles(path, body)
