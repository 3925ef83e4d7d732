"""HDF5 sources holding links, or datasets kept in other files: refused, never walked forever,
nothing left behind.

Real D4RL files (a CartPole rollout) and real minari datasets (written by minari's own
DataCollector), copied and given one link with h5py: a soft link back to its own group or to the
root (a loop), an external link to a file the user never named, a hard link from a group to itself
(a cycle). Each goes through the real readers, the ``import_dataset`` API and the CLI. Virtual
datasets and datasets with external raw storage read other files too: refused as well.
"""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
import torch
from _datasets import cartpole_rollout, minari_dataset, write_d4rl

import tiered
from tiered.cli import main
from tiered.errors import UnsupportedFormatError
from tiered.formats import import_dataset

LINKS = ("soft-loop", "soft-to-root", "external", "hard-cycle")


@pytest.fixture(scope="module")
def d4rl_src(tmp_path_factory):
    arrays = {k: v for k, v in cartpole_rollout(400, seed=0).items() if k != "next_observations"}
    infos = {"step": np.arange(400, dtype=np.int32)}
    return write_d4rl(tmp_path_factory.mktemp("d4rl") / "cartpole.hdf5", arrays, infos=infos)


@pytest.fixture(scope="module")
def minari_src(tmp_path_factory):
    pytest.importorskip("minari", reason="minari is needed: pip install 'minari[create,hdf5]' (extra 'minari')")
    return minari_dataset(tmp_path_factory.mktemp("minari"), "CartPole-v1", episodes=6, seed=0)


def _secret(tmp_path, rows: int) -> str:
    """A file the user never names: the external link's target (rows of the right length, so a
    reader following the link would import its numbers silently)."""
    path = str(tmp_path / "elsewhere" / "secret.h5")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with h5py.File(path, "w") as f:
        f["rows"] = np.full(rows, 7.0, np.float32)
    return path


def _add_link(f: h5py.File, group: str, kind: str, secret: str) -> tuple[str, str]:
    """Give ``group`` of ``f`` one link of ``kind``; return the link's path and what the error names as its target."""
    g = f.require_group(group)
    if kind == "soft-loop":
        g["loop"] = h5py.SoftLink(g.name)
        return f"{g.name}/loop", f"a soft link to {g.name}"
    if kind == "soft-to-root":
        g["up"] = h5py.SoftLink("/")
        return f"{g.name}/up", "a soft link to /"
    if kind == "external":
        g["leak"] = h5py.ExternalLink(secret, "/rows")
        return f"{g.name}/leak", f"an external link to /rows in the file {secret}"
    g["back"] = g  # a hard link from the group to itself: group/back/back/back/...
    return f"{g.name}/back", f"a hard link to the group {g.name}"


def _linked_d4rl(src, tmp_path, kind):
    dst = tmp_path / "linked.hdf5"
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        where, what = _add_link(f, "infos", kind, _secret(tmp_path, f["observations"].shape[0]))
    return dst, where, what


def _linked_minari(src, tmp_path, kind):
    dst = tmp_path / "linked-minari"
    shutil.copytree(src, dst)
    with h5py.File(dst / "data" / "main_data.hdf5", "r+") as f:
        rows = f["episode_0/rewards"].shape[0]
        where, what = _add_link(f, "episode_0/infos", kind, _secret(tmp_path, rows))
    return dst, where, what


def _check_refusal(err: str, where: str, what: str, kind: str) -> None:
    if kind == "hard-cycle":
        # the walk meets the group again under the new name: that name and the group's first one
        assert f"{where} is {what}" in err and "already part of the walk" in err, err
    else:
        assert f"{where} is {what}" in err, err
        assert "does not follow HDF5 links" in err and "delete the link or replace it" in err, err
    assert "Nothing was imported" in err


def _nothing_left(tmp_path) -> None:
    assert not (tmp_path / "store").exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]


@pytest.mark.parametrize("kind", LINKS)
@pytest.mark.parametrize("fmt", ["d4rl", "minari"])
def test_a_source_with_a_link_is_refused_through_the_api(fmt, kind, d4rl_src, request, tmp_path):
    make = _linked_d4rl if fmt == "d4rl" else _linked_minari
    src, where, what = make(request.getfixturevalue(f"{fmt}_src"), tmp_path, kind)
    with pytest.raises(UnsupportedFormatError) as e:
        import_dataset(fmt, src, tmp_path / "store")
    _check_refusal(str(e.value), where, what, kind)
    _nothing_left(tmp_path)


@pytest.mark.parametrize("kind", LINKS)
@pytest.mark.parametrize("fmt", ["d4rl", "minari"])
def test_a_source_with_a_link_is_refused_by_the_cli(fmt, kind, request, tmp_path, capsys):
    make = _linked_d4rl if fmt == "d4rl" else _linked_minari
    src, where, what = make(request.getfixturevalue(f"{fmt}_src"), tmp_path, kind)
    assert main(["import", str(src), str(tmp_path / "store"), "--format", fmt, "-q"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("tiered: error:") == 1
    _check_refusal(err, where, what, kind)
    _nothing_left(tmp_path)


def test_a_link_outside_the_datasets_read_is_refused_too(minari_src, tmp_path):
    # an external link in place of a later episode's rewards: minari's reader walks only the
    # first episode's groups, so only the check of the whole file at open sees it
    src = tmp_path / "linked-minari"
    shutil.copytree(minari_src, src)
    secret = _secret(tmp_path, 1)
    with h5py.File(src / "data" / "main_data.hdf5", "r+") as f:
        last = max(int(n.split("_")[1]) for n in f if n.startswith("episode_"))
        rows = f[f"episode_{last}/rewards"].shape[0]
        del f[f"episode_{last}/rewards"]
        with h5py.File(secret, "r+") as s:
            del s["rows"]
            s["rows"] = np.full(rows, 7.0, np.float64)
        f[f"episode_{last}/rewards"] = h5py.ExternalLink(secret, "/rows")
    with pytest.raises(UnsupportedFormatError, match=f"/episode_{last}/rewards is an external link to /rows"):
        import_dataset("minari", src, tmp_path / "store")
    _nothing_left(tmp_path)


def test_hard_links_to_datasets_are_ordinary_members(d4rl_src, tmp_path):
    # a dataset under two names is no loop: both names import, with the same numbers
    src = tmp_path / "twice.hdf5"
    shutil.copyfile(d4rl_src, src)
    with h5py.File(src, "r+") as f:
        f["infos/step_again"] = f["infos/step"]
        step = f["infos/step"][()]
    import_dataset("d4rl", src, tmp_path / "store")
    with tiered.open(tmp_path / "store") as store:
        td = store.get(slice(None))
        assert torch.equal(td["info", "step_again"], torch.from_numpy(step))
        assert torch.equal(td["info", "step"], torch.from_numpy(step))


def test_hdf5_datasets_refuses_links_in_a_file_opened_without_the_check(tmp_path):
    # the walk itself never follows a link, whoever opened the file
    from tiered.formats.common import hdf5_datasets

    with h5py.File(tmp_path / "f.h5", "w") as f:
        f["a/data"] = np.arange(3)
        f["a/loop"] = h5py.SoftLink("/a")
    with h5py.File(tmp_path / "f.h5", "r") as f:
        walk = hdf5_datasets(f)
        assert next(walk)[0] == ("a", "data")  # name order: the dataset before the link
        with pytest.raises(UnsupportedFormatError, match="/a/loop is a soft link to /a"):
            next(walk)


def _foreign(f: h5py.File, where: str, kind: str, tmp_path, like: np.ndarray) -> str:
    """Put at ``where`` of ``f`` a dataset of ``like``'s shape and dtype whose values are in another
    file: a virtual dataset over it, or external raw storage. Returns that file's name."""
    if kind == "virtual":
        other = str(tmp_path / "elsewhere.h5")
        with h5py.File(other, "w") as o:
            o["values"] = like
        layout = h5py.VirtualLayout(shape=like.shape, dtype=like.dtype)
        layout[...] = h5py.VirtualSource(other, "values", shape=like.shape)
        f.create_virtual_dataset(where, layout)
        return other
    other = str(tmp_path / "elsewhere.bin")
    with open(other, "wb") as o:
        o.write(np.ascontiguousarray(like).tobytes())
    f.create_dataset(where, shape=like.shape, dtype=like.dtype, external=[(other, 0, like.nbytes)])
    return other


@pytest.mark.parametrize("kind", ["virtual", "external-storage"])
def test_a_d4rl_dataset_stored_in_another_file_is_refused(kind, d4rl_src, tmp_path, capsys):
    src = tmp_path / "foreign.hdf5"
    shutil.copyfile(d4rl_src, src)
    with h5py.File(src, "r+") as f:
        other = _foreign(f, "infos/leak", kind, tmp_path, np.full(f["observations"].shape[0], 7.0, np.float32))
    assert h5py.File(src, "r")["infos/leak"][0] == 7.0  # h5py itself reads the other file
    with pytest.raises(UnsupportedFormatError, match=f"/infos/leak keeps its values in other files \\({other}\\)"):
        import_dataset("d4rl", src, tmp_path / "store")
    assert main(["import", str(src), str(tmp_path / "store"), "--format", "d4rl", "-q"]) == 2
    assert "/infos/leak keeps its values in other files" in capsys.readouterr().err
    _nothing_left(tmp_path)


@pytest.mark.parametrize("kind", ["virtual", "external-storage"])
def test_a_minari_episode_stored_in_another_file_is_refused(kind, minari_src, tmp_path):
    # the last episode's rewards: read only when the import reaches it, after the first rows were
    # written into the new store, which then goes
    src = tmp_path / "foreign-minari"
    shutil.copytree(minari_src, src)
    with h5py.File(src / "data" / "main_data.hdf5", "r+") as f:
        last = max(int(n.split("_")[1]) for n in f if n.startswith("episode_"))
        rewards = f[f"episode_{last}/rewards"][()]
        del f[f"episode_{last}/rewards"]
        _foreign(f, f"episode_{last}/rewards", kind, tmp_path, rewards)
    with pytest.raises(UnsupportedFormatError, match=f"/episode_{last}/rewards keeps its values in other files"):
        import_dataset("minari", src, tmp_path / "store", chunk_rows=16)
    _nothing_left(tmp_path)
