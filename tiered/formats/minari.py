"""Minari: a dataset directory as the ``minari`` package writes it (HDF5 storage).

Layout read and written (minari 0.4-0.5, ``data_format: "hdf5"``)::

    DATASET/data/metadata.json        total_episodes, total_steps, observation_space, ...
    DATASET/data/main_data.hdf5
        episode_{i}/                  attrs: id, total_steps, seed, rewards_* ...
            observations              [T + 1, ...]   (or a group, for Dict/Tuple spaces)
            actions                   [T, ...]       (or a group)
            rewards                   [T]
            terminations              [T] bool
            truncations               [T] bool
            infos/<name>              [T + 1, ...]   (any depth)

Each episode of ``T`` steps becomes ``T`` rows: ``observation = observations[:-1]``,
``("next", "observation") = observations[1:]`` (exact, nothing is derived), the episode number
in ``("collector", "traj_ids")``. Infos with ``T + 1`` entries go to ``("info", name)``
(``[:-1]``) and ``("next", "info", name)`` (``[1:]``), so export rebuilds all ``T + 1``.

Image observations that minari stored JPEG-encoded (its default for ``uint8`` image spaces)
are decoded on import (with Pillow, as minari does); exports are always written raw
(``jpeg_encoding: false``), so they are lossless and load with :class:`minari.MinariDataset`
exactly as the decoded source does. The ``minari`` package itself is not needed to import or
export (only ``h5py``; Pillow for JPEG-encoded sources).

Example:
    >>> from tiered.formats.minari import MinariSource
    >>> src = MinariSource("~/.minari/datasets/D4RL/door/human-v2")  # doctest: +SKIP
    >>> src.num_rows, src.num_episodes  # doctest: +SKIP
    (6729, 25)
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import h5py
import numpy as np
from tensordict import TensorDict

from ..errors import UnsupportedFormatError
from ..util import fileio
from .common import (
    chunk_rows_for,
    hdf5_datasets,
    iter_store,
    json_safe,
    np_to_torch,
    numpy_dtype,
    open_hdf5,
    refuse_foreign_storage,
    row_nbytes,
    to_numpy,
    writing,
)
from .keymap import (
    DONE,
    INFO,
    MINARI_NAMES,
    NEXT_INFO,
    NEXT_OBS,
    OBS,
    TERMINATED,
    TRAJ,
    TRUNCATED,
    Key,
    flat_cell,
    key_str,
    step_column,
    to_flag,
)

__all__ = ["MinariSource", "write_minari", "resolve_minari_path", "MINARI_VERSION"]

MAIN_FILE = "main_data.hdf5"
METADATA_FILE = "metadata.json"
#: minari_version written into the metadata of exports made from stores not imported from
#: minari (one that every minari >= 0.5 reads).
MINARI_VERSION = "0.5.0"
# per-episode attributes are kept in the sidecar for at most this many episodes
_MAX_EPISODE_ATTRS = 200_000

_EPISODE = re.compile(r"^episode_(\d+)$")


def resolve_minari_path(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(main_data.hdf5, metadata.json)`` of a dataset dir, its ``data/`` dir, or the HDF5 file."""
    path = os.path.expanduser(os.fspath(path))
    for d in (os.path.join(path, "data"), path):
        if os.path.isfile(os.path.join(d, MAIN_FILE)):
            return os.path.join(d, MAIN_FILE), os.path.join(d, METADATA_FILE)
    if os.path.isfile(path) and path.endswith((".hdf5", ".h5")):
        return path, os.path.join(os.path.dirname(path), METADATA_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    raise UnsupportedFormatError(
        f"{path} is not a minari dataset: expected {os.path.join('data', MAIN_FILE)} inside it "
        "(a directory as minari writes it, e.g. ~/.minari/datasets/NAMESPACE/NAME-v0)"
    )


def _is_image_space(space: Any) -> bool:
    """minari's ``is_image_space`` on the JSON form of a space (uint8 Box, HxW(xC), H, W >= 32)."""
    if not isinstance(space, dict) or space.get("type") != "Box" or space.get("dtype") != "uint8":
        return False
    shape = space.get("shape") or []
    if len(shape) not in (2, 3) or shape[0] < 32 or shape[1] < 32:
        return False
    low, high = np.asarray(space.get("low", 0)), np.asarray(space.get("high", 255))
    return bool((low == 0).all() and (high == 255).all())


def _image_leaves(sp: Any, sub: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Paths of the image leaves of a space's JSON form (Dict and Tuple spaces are walked)."""
    if not isinstance(sp, dict):
        return
    if sp.get("type") == "Dict":
        for k, v in (sp.get("subspaces") or {}).items():
            yield from _image_leaves(v, (*sub, k))
    elif sp.get("type") == "Tuple":
        for i, v in enumerate(sp.get("subspaces") or []):
            yield from _image_leaves(v, (*sub, f"_index_{i}"))
    elif _is_image_space(sp):
        yield sub


def _jpeg_spaces(meta: dict[str, Any]) -> dict[tuple[str, ...], bool]:
    """Which leaves of observations/actions minari stored JPEG-encoded."""
    out: dict[tuple[str, ...], bool] = {}
    if not meta.get("jpeg_encoding", False):
        return out
    for top in ("observation_space", "action_space"):
        raw = meta.get(top)
        try:
            space = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            continue
        name = "observations" if top == "observation_space" else "actions"

        for sub in _image_leaves(space):
            out[(name, *sub)] = True
    return out


def _decode_jpeg(data: np.ndarray) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            "this minari dataset stores JPEG-encoded images; decoding them needs Pillow: pip install pillow"
        ) from e
    frames = [
        np.asarray(Image.open(io.BytesIO(np.asarray(b, dtype=np.uint8).tobytes())), dtype=np.uint8)
        for b in data
    ]
    return np.stack(frames) if frames else np.empty((0,), np.uint8)


class _Leaf(NamedTuple):
    """One dataset of the episode groups, and the store field its rows go to (import) or come from
    (export)."""

    path: tuple[str, ...]  # in the episode group, e.g. ("observations",) or ("infos", "success")
    key: Key  # the store field
    kind: str  # "obs" / "info1": T + 1 entries (the field, then its next field's last row); "step": T
    dtype: np.dtype
    shape: tuple[int, ...]  # cell shape
    jpeg: bool = False  # import: minari stored the images JPEG-encoded

    @property
    def next_key(self) -> Key:
        """The store field holding entries 1..T of an ``obs`` or ``info1`` leaf."""
        return (NEXT_OBS if self.kind == "obs" else NEXT_INFO) + self.key[1:]


class MinariSource:
    """A minari dataset (HDF5 storage) as a source of rows (see the module docstring).

    Args:
        path: the dataset directory (holding ``data/``), its ``data/`` directory, or
            ``main_data.hdf5``.
    """

    fmt = "minari"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.main, self.meta_path = resolve_minari_path(path)
        self.origin = os.path.dirname(os.path.dirname(self.main))
        self.meta: dict[str, Any] = {}
        if os.path.isfile(self.meta_path):
            try:
                with open(self.meta_path) as f:
                    self.meta = json.load(f)
            except ValueError as e:
                raise UnsupportedFormatError(f"{self.meta_path} is not valid JSON ({e})") from None
        if self.meta.get("data_format", "hdf5") != "hdf5":
            raise UnsupportedFormatError(
                f"{self.origin}: data_format {self.meta.get('data_format')!r}; only minari's 'hdf5' "
                "storage is "
                "supported (convert arrow datasets with minari first)"
            )
        self._file = open_hdf5(self.main)
        try:
            self._scan()
        except BaseException:
            self._file.close()
            raise

    def _scan(self) -> None:
        eps = sorted((int(m.group(1)), name) for name in self._file
                     if (m := _EPISODE.match(name)) and isinstance(self._file[name], h5py.Group))
        if not eps:
            raise UnsupportedFormatError(f"{self.main}: no episode_<i> groups; not a minari dataset")
        self.episode_ids = np.array([e[0] for e in eps], dtype=np.int64)
        self.groups = [self._file[e[1]] for e in eps]
        self.lengths = np.array([g["rewards"].shape[0] for g in self.groups], dtype=np.int64)
        self.num_episodes = len(eps)
        self.num_rows = int(self.lengths.sum())
        jpeg = _jpeg_spaces(self.meta)
        g0 = self.groups[0]
        T0 = int(self.lengths[0])
        missing = [k for k in MINARI_NAMES if k not in g0]
        if missing:
            raise UnsupportedFormatError(f"{self.main}: episode group {g0.name} lacks {missing}")
        leaves: list[_Leaf] = []
        for top, prefix in MINARI_NAMES.items():
            for sub, d in hdf5_datasets(g0[top]):
                path = (top, *sub)
                is_jpeg = jpeg.get(path, False)
                if d.dtype.kind not in "biuf" and not (is_jpeg or d.dtype.kind == "O"):
                    raise UnsupportedFormatError(
                        f"{self.main}: {'/'.join(path)} has dtype {d.dtype} (text spaces are not supported)"
                    )
                cell = tuple(d.shape[1:])
                dtype = d.dtype
                if is_jpeg:
                    sample = _decode_jpeg(d[:1])
                    cell, dtype = tuple(sample.shape[1:]), sample.dtype
                if top in ("rewards", "terminations", "truncations") and cell == ():
                    cell = (1,)
                if top in ("terminations", "truncations"):
                    dtype = np.dtype(bool)
                leaves.append(
                    _Leaf(
                        path,
                        prefix + sub,
                        "obs" if top == "observations" else "step",
                        np.dtype(dtype),
                        cell,
                        is_jpeg,
                    )
                )
        if "infos" in g0:
            for sub, d in hdf5_datasets(g0["infos"]):
                if d.dtype.kind not in "biuf":
                    raise UnsupportedFormatError(
                        f"{self.main}: infos/{'/'.join(sub)} has dtype {d.dtype}; "
                        "only numeric infos are supported"
                    )
                n = d.shape[0] if d.shape else 0
                kind = "obs" if n == T0 + 1 else "step" if n == T0 else None
                if kind is None:
                    raise UnsupportedFormatError(
                        f"{self.main}: infos/{'/'.join(sub)} of {g0.name} has {n} entries for {T0} steps "
                        "(expected T or T + 1)"
                    )
                leaves.append(
                    _Leaf(
                        ("infos", *sub),
                        INFO + sub,
                        "info1" if kind == "obs" else "step",
                        d.dtype,
                        tuple(d.shape[1:]),
                    )
                )
        self.leaves = leaves
        self.derived: list[Key] = [DONE, TRAJ]

    @property
    def row_bytes(self) -> int:
        total = row_nbytes({lf.path: (lf.shape, lf.dtype) for lf in self.leaves})
        total += row_nbytes({lf.path: (lf.shape, lf.dtype) for lf in self.leaves if lf.kind != "step"})
        return total + 9

    def attrs(self) -> dict[str, Any]:
        """The import sidecar content."""
        ep_attrs: dict[str, list[Any]] = {}
        if self.num_episodes <= _MAX_EPISODE_ATTRS:
            names = dict.fromkeys(k for g in self.groups for k in g.attrs)  # each once, in first-seen order
            ep_attrs = {k: [json_safe(g.attrs[k]) if k in g.attrs else None for g in self.groups] for k in names}
        return {
            "format": "minari",
            "origin": self.origin,
            "rows": self.num_rows,
            "metadata": self.meta,
            "episode_ids": self.episode_ids.tolist() if self.num_episodes <= _MAX_EPISODE_ATTRS else None,
            "episode_attrs": ep_attrs,
            "columns": [
                {
                    "path": list(lf.path),
                    "key": list(lf.key),
                    "kind": lf.kind,
                    "dtype": lf.dtype.str,
                    "shape": list(lf.shape),
                }
                for lf in self.leaves
            ],
            "derived": [list(k) for k in self.derived],
        }

    def _read(self, g: h5py.Group, lf: _Leaf, lo: int, hi: int) -> np.ndarray:
        try:
            d = g["/".join(lf.path)]
        except KeyError:
            raise UnsupportedFormatError(f"{self.main}: {g.name} lacks {'/'.join(lf.path)}") from None
        refuse_foreign_storage(d, f"{g.name}/{'/'.join(lf.path)}")  # any episode's, not only the first's
        a = _decode_jpeg(d[lo:hi]) if lf.jpeg else np.asarray(d[lo:hi])
        if a.shape[1:] != lf.shape and not (a.ndim == 1 and lf.shape == (1,)):
            raise UnsupportedFormatError(
                f"{self.main}: {g.name}/{'/'.join(lf.path)} has cells of shape {a.shape[1:]}, but the first "
                f"episode's are {lf.shape}; every episode must have the same shapes"
            )
        return a

    def chunks(self, chunk_rows: int | None = None) -> Iterator[TensorDict]:
        """Yield rows in the store's (TED) layout, about ``chunk_rows`` at a time."""
        step = chunk_rows_for(self.row_bytes, chunk_rows)
        parts: dict[Key, list[np.ndarray]] = {}
        have = 0

        def emit() -> TensorDict:
            nonlocal parts, have
            td = TensorDict({k: np_to_torch(np.concatenate(v) if len(v) > 1 else v[0]) for k, v in parts.items()},
                            batch_size=[have])
            parts, have = {}, 0
            return td

        for e, g in enumerate(self.groups):
            T = int(self.lengths[e])
            for lo in range(0, T, step):
                hi = min(T, lo + step)
                m = hi - lo
                term = trunc = None
                for lf in self.leaves:
                    if lf.kind == "step":
                        a = self._read(g, lf, lo, hi)
                        if lf.key in (TERMINATED, TRUNCATED):
                            a = to_flag(a, "/".join(lf.path))
                        a = step_column(lf.key, a)
                        if lf.key == TERMINATED:
                            term = a
                        elif lf.key == TRUNCATED:
                            trunc = a
                        parts.setdefault(lf.key, []).append(a)
                    else:
                        a = self._read(g, lf, lo, hi + 1)
                        parts.setdefault(lf.key, []).append(a[:m])
                        parts.setdefault(lf.next_key, []).append(a[1 : m + 1])
                done = np.zeros((m, 1), dtype=bool)
                if term is not None:
                    done |= term.reshape(m, -1).any(-1, keepdims=True)
                if trunc is not None:
                    done |= trunc.reshape(m, -1).any(-1, keepdims=True)
                parts.setdefault(DONE, []).append(done)
                parts.setdefault(TRAJ, []).append(np.full(m, self.episode_ids[e], dtype=np.int64))
                have += m
                if have >= step:
                    yield emit()
        if have:
            yield emit()

    def close(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _episodes(store: Any, rows: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Episode boundaries ``(starts, ids)`` in export order, from traj ids or done flags."""
    keys = [f.key for f in store.schema.values()]
    if rows.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    prev_id, prev_done, count = None, True, 0
    if TRAJ in keys:
        for lo, _hi, td in iter_store(store, rows, step, keys=[TRAJ]):
            t = td.get(TRAJ).reshape(-1).numpy()
            prev = np.concatenate([[t[0] - 1 if prev_id is None else prev_id], t[:-1]])
            s = np.flatnonzero(t != prev)
            starts.append(lo + s)
            ids.append(t[s])
            prev_id = int(t[-1])
        return np.concatenate(starts).astype(np.int64), np.concatenate(ids).astype(np.int64)
    flag = DONE if DONE in keys else TERMINATED if TERMINATED in keys else None
    if flag is None:
        return np.zeros(1 if rows.size else 0, np.int64), np.zeros(1 if rows.size else 0, np.int64)
    for lo, _hi, td in iter_store(store, rows, step, keys=[flag]):
        d = td.get(flag).reshape(td.shape[0], -1).any(-1).numpy()
        prev = np.concatenate([[prev_done], d[:-1]])
        s = np.flatnonzero(prev)
        starts.append(lo + s)
        ids.append(count + np.arange(s.size))
        count += s.size
        prev_done = bool(d[-1])
    return np.concatenate(starts).astype(np.int64), np.concatenate(ids).astype(np.int64)


def _box_json(dtype: np.dtype, shape: tuple[int, ...]) -> dict[str, Any]:
    if dtype.kind == "f":
        lo, hi = -math.inf, math.inf
    elif dtype.kind == "b":
        lo, hi = 0, 1
    else:
        info = np.iinfo(dtype)
        lo, hi = int(info.min), int(info.max)
    if dtype == np.uint8 and len(shape) in (2, 3):
        lo, hi = 0, 255
    return {
        "type": "Box",
        "dtype": str(dtype),
        "shape": list(shape),
        "low": np.full(shape, lo).tolist(),
        "high": np.full(shape, hi).tolist(),
    }


@dataclass
class _EpisodeFiles:
    """The exported episodes: their export rows and the HDF5 objects created for them."""

    starts: np.ndarray  # first export row of each episode
    ends: np.ndarray  # end (exclusive) of each episode
    groups: list[h5py.Group] = field(default_factory=list)
    datasets: list[dict[tuple[str, ...], h5py.Dataset]] = field(default_factory=list)  # by leaf path


def write_minari(
    store: Any,
    rows: np.ndarray,
    tmp: str,
    source: dict[str, Any] | None,
    chunk_rows: int | None,
    progress: Any,
    dataset_id: str | None = None,
) -> dict[str, Any]:
    """Write a store's rows as a minari dataset directory at ``tmp`` (through :mod:`tiered.util.fileio`).

    Returns:
        ``{"episodes": n, "rows": n, "dropped": [keys not representable in minari]}``.
    """
    schema = store.schema
    fields = {f.key: f for f in schema.values()} if schema is not None else {}
    from_minari = source is not None and source.get("format") == "minari"
    leaves = _leaves_as_imported(source, fields) if from_minari else _leaves_for_schema(fields)
    used = {lf.key for lf in leaves} | {lf.next_key for lf in leaves if lf.kind != "step"}
    derived = {tuple(k) for k in source.get("derived", [])} if from_minari else set()
    dropped = sorted(
        key_str(k) for k in fields if k not in used and k not in derived and k not in (DONE, TRAJ)
    )
    n = int(rows.size)
    read_keys = sorted(used)
    step = chunk_rows_for(row_nbytes({k: (fields[k].shape, fields[k].dtype) for k in read_keys}), chunk_rows)
    starts, ids = _episodes(store, rows, step)
    episodes = _EpisodeFiles(starts, np.append(starts[1:], n))
    ep_attrs = _source_episode_attrs(source if from_minari else None, n, episodes.ends - starts)
    fileio.makedirs(os.path.join(tmp, "data"))  # fsyncs the new directories, like every export
    main = os.path.join(tmp, "data", MAIN_FILE)
    f = fileio.WritableFile(main)
    with writing(f), h5py.File(f, "w", track_order=True) as h:
        _create_episodes(h, leaves, episodes, ep_attrs)
        # the source's reward statistics no longer hold: recompute them from the rows
        reward_stats = {e: [] for e in range(ids.size)} if not ep_attrs else None
        for lo, hi, td in iter_store(store, rows, step, keys=read_keys):
            _write_slice(lo, hi, td, leaves, episodes, reward_stats)
            progress.update(hi - lo)
        if reward_stats is not None:
            _write_reward_stats(episodes.groups, reward_stats)
    meta = _metadata(source if from_minari else None, leaves, dataset_id)
    meta.update(
        {
            "total_episodes": int(ids.size),
            "total_steps": n,
            "data_format": "hdf5",
            "jpeg_encoding": False,
            "dataset_size": round(os.path.getsize(main) / 1e6, 1),
        }
    )
    fileio.write_file_atomic(os.path.join(tmp, "data", METADATA_FILE), json.dumps(json_safe(meta)).encode())
    return {"episodes": int(ids.size), "rows": n, "dropped": dropped}


def _leaves_as_imported(source: dict[str, Any], fields: dict[Key, Any]) -> list[_Leaf]:
    """The datasets of a store imported from minari: the source's own, for the fields still there."""
    leaves = []
    for c in source["columns"]:
        key = tuple(c["key"])
        if key not in fields:
            continue
        shape = flat_cell(key, tuple(c["shape"]))
        leaves.append(_Leaf(tuple(c["path"]), key, c["kind"], np.dtype(c["dtype"]), shape))
    return leaves


def _leaves_for_schema(fields: dict[Key, Any]) -> list[_Leaf]:
    """The datasets of a store not imported from minari, by TorchRL key (see the key mapping).

    Raises:
        UnsupportedFormatError: the store lacks observations, actions, rewards or done flags.
    """
    tops = {key: name for name, key in MINARI_NAMES.items()}
    leaves = []
    for key, f in fields.items():
        np_dtype = numpy_dtype(f.dtype, key_str(key), "minari (HDF5)")
        shape = flat_cell(key, tuple(f.shape))
        for prefix, top in tops.items():
            if key[: len(prefix)] == prefix:
                kind = "obs" if prefix == OBS and NEXT_OBS + key[1:] in fields else "step"
                leaves.append(_Leaf((top, *key[len(prefix) :]), key, kind, np_dtype, shape))
                break
        else:
            if key[:1] == INFO and len(key) > 1:
                kind = "info1" if NEXT_INFO + key[1:] in fields else "step"
                leaves.append(_Leaf(("infos", *key[1:]), key, kind, np_dtype, shape))
    have = {lf.path[0] for lf in leaves}
    if "terminations" not in have and DONE in fields:
        leaves.append(_Leaf(("terminations",), DONE, "step", np.dtype(bool), ()))
    for top in ("observations", "actions", "rewards"):
        if top not in have:
            raise UnsupportedFormatError(
                f"the store has no field for minari's {top!r} (keys: "
                f"{sorted(key_str(k) for k in fields)}); see docs/cli.md for the key mapping"
            )
    if "terminations" not in {lf.path[0] for lf in leaves}:
        raise UnsupportedFormatError("the store has no terminated or done flags, which minari needs")
    return leaves


def _source_episode_attrs(source: dict[str, Any] | None, n: int, lengths: np.ndarray) -> dict[str, list[Any]]:
    """Per-episode attributes of a minari source, if the exported episodes are still the source's.

    Not when the rows differ (e.g. a smaller capacity cut the first episode short, leaving the same
    episode count): ``{}``, and the reward statistics are recomputed from the rows.
    """
    ep_attrs = (source or {}).get("episode_attrs") or {} if source is not None else {}
    src_steps = ep_attrs.get("total_steps")
    if (
        n != (source or {}).get("rows")
        or any(len(v) != lengths.size for v in ep_attrs.values())
        or (src_steps is not None and src_steps != lengths.tolist())
    ):
        return {}
    return ep_attrs


def _create_episodes(
    h: h5py.File, leaves: list[_Leaf], episodes: _EpisodeFiles, ep_attrs: dict[str, list[Any]]
) -> None:
    """One group per episode with its datasets (created once, kept in ``episodes``) and attributes.

    Traj ids imported from minari are its episode numbers, but minari needs groups named
    ``episode_0`` .. ``episode_{n-1}``: the groups are numbered in export order.
    """
    lengths = episodes.ends - episodes.starts
    for e in range(lengths.size):
        g = h.create_group(f"episode_{e}", track_order=True)
        T = int(lengths[e])
        ds = {}
        for lf in leaves:
            size = T + 1 if lf.kind != "step" else T
            ds[lf.path] = g.create_dataset(
                "/".join(lf.path), shape=(size, *lf.shape), dtype=lf.dtype, fill_time="never"
            )
        episodes.datasets.append(ds)
        if "infos" not in g:
            g.create_group("infos")
        attrs = {k: v[e] for k, v in ep_attrs.items() if e < len(v) and v[e] is not None}
        attrs.setdefault("id", e)
        attrs["total_steps"] = T
        for k, v in attrs.items():
            g.attrs[k] = v
        episodes.groups.append(g)


def _write_slice(
    lo: int,
    hi: int,
    td: Any,
    leaves: list[_Leaf],
    episodes: _EpisodeFiles,
    reward_stats: dict[int, list[np.ndarray]] | None,
) -> None:
    """Write export rows ``lo:hi`` (``td``) into the episodes they belong to."""
    starts, ends = episodes.starts, episodes.ends
    e0 = int(np.searchsorted(starts, lo, side="right") - 1)
    e1 = int(np.searchsorted(starts, hi - 1, side="right") - 1)
    cols = {}
    for lf in leaves:
        cols[lf.path] = to_numpy(td.get(lf.key), lf.dtype, lf.shape)
        if lf.kind != "step":
            cols[("next",) + lf.path] = to_numpy(td.get(lf.next_key), lf.dtype, lf.shape)
    for e in range(e0, e1 + 1):  # each episode is its own HDF5 group: one slice write per dataset
        a, b = max(lo, int(starts[e])), min(hi, int(ends[e]))
        off = a - int(starts[e])
        ds = episodes.datasets[e]
        for lf in leaves:
            d = ds[lf.path]
            d[off : off + b - a] = cols[lf.path][a - lo : b - lo]
            if lf.kind != "step" and b == int(ends[e]):  # the episode's last entry: its last next row
                d[off + b - a] = cols[("next",) + lf.path][b - 1 - lo]
        if reward_stats is not None:
            r = cols[("rewards",)][a - lo : b - lo] if ("rewards",) in cols else None
            if r is not None:
                reward_stats[e].append(np.asarray(r, dtype=np.float64).reshape(-1))


def _write_reward_stats(groups: list[h5py.Group], reward_stats: dict[int, list[np.ndarray]]) -> None:
    for e, parts in reward_stats.items():
        r = np.concatenate(parts) if parts else np.zeros(0)
        if r.size:
            groups[e].attrs.update(
                {
                    "rewards_max": r.max(),
                    "rewards_mean": r.mean(),
                    "rewards_min": r.min(),
                    "rewards_std": r.std(),
                    "rewards_sum": r.sum(),
                }
            )


def _metadata(source: dict[str, Any] | None, leaves: list[_Leaf], dataset_id: str | None) -> dict[str, Any]:
    """``metadata.json`` but its totals: a minari source's own, else spaces built from the leaves."""
    meta = dict(source["metadata"]) if source is not None and isinstance(source.get("metadata"), dict) else {}
    if not meta:
        meta = {
            "dataset_id": dataset_id or "tiered/export-v0",
            "minari_version": MINARI_VERSION,
            "algorithm_name": "unknown",
            "observation_space": json.dumps(_space_json([lf for lf in leaves if lf.path[0] == "observations"])),
            "action_space": json.dumps(_space_json([lf for lf in leaves if lf.path[0] == "actions"])),
        }
        try:
            import minari

            meta["minari_version"] = minari.__version__
        except ImportError:
            pass
    if dataset_id:
        meta["dataset_id"] = dataset_id
    return meta


def _space_json(group: list[_Leaf]) -> dict[str, Any]:
    """The JSON form of the space of ``group``'s leaves: a Box, or a Dict of Boxes."""
    if len(group) == 1 and len(group[0].path) == 1:
        return _box_json(group[0].dtype, group[0].shape)
    return {
        "type": "Dict",
        "subspaces": {"/".join(lf.path[1:]): _box_json(lf.dtype, lf.shape) for lf in group},
    }
