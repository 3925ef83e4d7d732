"""HDF5 sources holding links: refused before a byte is written, never walked forever.

Real D4RL files (a CartPole rollout) and real minari datasets (written by minari's own
DataCollector), copied and given one link with h5py: a soft link back to its own group or to the
root (a loop), an external link to a file the user never named, a hard link from a group to its
ancestor (a cycle). Each goes through the real readers, the ``import_dataset`` API and the CLI.
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
