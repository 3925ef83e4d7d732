"""Import -> export round trips for every format, on real rollouts; key mapping; streaming.

Sources are real: CartPole-v1 rollouts (gymnasium) for vector observations, ALE Pong frames for
images, minari datasets written by minari's own DataCollector, TensorDict memmap directories
written by tensordict, archives written by numpy. Every round trip must give back the source
arrays bit for bit (names, dtypes, shapes, values).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import h5py
import numpy as np
import pytest
import torch
from _datasets import (
    assert_arrays_equal,
    cartpole_rollout,
    h5_datasets,
    minari_dataset,
    pong_d4rl_arrays,
    td_leaves,
    write_d4rl,
)
from tensordict import TensorDict

import tiered
from tiered.cli import main
from tiered.errors import PickledDataError, StorageFullError, UnsupportedFormatError
from tiered.formats import export_dataset, import_dataset
from tiered.formats.keymap import DONE, NEXT_OBS, TRAJ
from tiered.testing import faults


def _minari():
    """The minari package (its DataCollector makes the fixtures; MinariDataset reads exports)."""
    return pytest.importorskip(
        "minari", reason="minari is needed: pip install 'minari[create,hdf5]' pillow (extra 'minari')"
    )


def run(*argv: str) -> int:
    return main([*argv, "-q"] if argv[0] in ("import", "export", "verify") else list(argv))


@pytest.fixture(scope="module")
def cartpole() -> dict[str, np.ndarray]:
    return cartpole_rollout(3000, seed=0)


@pytest.fixture(scope="module")
def d4rl_cartpole(cartpole, tmp_path_factory):
    arrays = {k: v for k, v in cartpole.items() if k != "next_observations"}
    infos = {
        "step": np.arange(3000, dtype=np.int32),
        "qpos": cartpole["observations"][:, :2].astype(np.float64),
    }
    return write_d4rl(tmp_path_factory.mktemp("d4rl") / "cartpole.hdf5", arrays, infos=infos)


@pytest.fixture(scope="module")
def minari_root(tmp_path_factory):
    _minari()
    return tmp_path_factory.mktemp("minari")


@pytest.fixture(scope="module")
def minari_cartpole(minari_root):
    return minari_dataset(minari_root, "CartPole-v1", episodes=12, seed=0)


@pytest.fixture(scope="module")
def minari_frozenlake(minari_root):
    # FrozenLake's step infos ({"prob": ...}) exercise minari's T + 1 infos
    return minari_dataset(minari_root, "FrozenLake-v1", episodes=30, seed=3, dataset_id="test/frozenlake-v0")


@pytest.fixture(scope="module")
def minari_pong(minari_root):
    # grayscale 210x160 uint8 screens: minari stores them JPEG-encoded (its default)
    return minari_dataset(
        minari_root,
        "ALE/Pong-v5",
        episodes=2,
        seed=0,
        dataset_id="test/pong-v0",
        record_infos=False,
        obs_type="grayscale",
        max_episode_steps=60,
    )


def _episodes(path):
    ds = _minari().MinariDataset(str(path / "data"))
    return ds, list(ds.iterate_episodes())


def _assert_minari_equal(src, dst):
    a, ea = _episodes(src)
    b, eb = _episodes(dst)
    assert (a.total_episodes, a.total_steps) == (b.total_episodes, b.total_steps)
    assert a.observation_space == b.observation_space and a.action_space == b.action_space
    for x, y in zip(ea, eb, strict=True):
        assert x.id == y.id
        for k in ("observations", "actions", "rewards", "terminations", "truncations"):
            u, v = getattr(x, k), getattr(y, k)
            assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v), (x.id, k)
        assert sorted(x.infos) == sorted(y.infos)
        for k in x.infos:
            assert np.array_equal(x.infos[k], y.infos[k]) and x.infos[k].dtype == y.infos[k].dtype
    ma, mb = a.storage.metadata, b.storage.metadata
    for k in set(ma) | set(mb):
        if k not in ("dataset_size", "jpeg_encoding"):
            assert ma.get(k) == mb.get(k), k
    assert list(a.storage.get_episode_metadata(range(a.total_episodes))) == list(
        b.storage.get_episode_metadata(range(b.total_episodes))
    )


# ------------------------------------------------------------------------------------------------ d4rl


def test_d4rl_round_trip_is_exact(d4rl_cartpole, tmp_path):
    assert run("import", str(d4rl_cartpole), str(tmp_path / "s"), "--format", "d4rl") == 0
    assert run("export", str(tmp_path / "s"), str(tmp_path / "out.hdf5"), "--format", "d4rl") == 0
    assert_arrays_equal(h5_datasets(d4rl_cartpole), h5_datasets(tmp_path / "out.hdf5"))
    with h5py.File(tmp_path / "out.hdf5") as f:
        assert f.attrs["env_name"] == "CartPole-v1"
        # read back under the D4RL names, as d4rl.qlearning_dataset does
        assert f["observations"].shape == (3000, 4) and f["terminals"].dtype == bool
        assert f["rewards"].shape == (3000,)


def test_d4rl_import_maps_keys_to_torchrl_layout(d4rl_cartpole, cartpole, tmp_path):
    import_dataset("d4rl", d4rl_cartpole, tmp_path / "s")
    store = tiered.open(tmp_path / "s")
    td = store.get(slice(None))
    obs, term, trunc = cartpole["observations"], cartpole["terminals"], cartpole["timeouts"]
    assert torch.equal(td["observation"], torch.from_numpy(obs))
    assert torch.equal(td["next", "reward"], torch.from_numpy(cartpole["rewards"]).unsqueeze(-1))
    assert torch.equal(td["next", "terminated"], torch.from_numpy(term).unsqueeze(-1))
    assert torch.equal(td["next", "truncated"], torch.from_numpy(trunc).unsqueeze(-1))
    done = term | trunc
    assert torch.equal(td[DONE], torch.from_numpy(done).unsqueeze(-1))
    # episode ids count the ends of episodes before each row
    assert torch.equal(td[TRAJ], torch.from_numpy(np.concatenate([[0], np.cumsum(done)[:-1]])))
    # next observations derived inside episodes equal the real ones; the last step of an
    # episode repeats its observation (D4RL does not hold the real one)
    nxt = td[NEXT_OBS].numpy()
    inside = ~done
    inside[-1] = False
    assert np.array_equal(nxt[inside], cartpole["next_observations"][inside])
    assert np.array_equal(nxt[~inside], obs[~inside])
    assert td["info", "step"].dtype == torch.int32 and td["info", "qpos"].shape == (3000, 2)
    store.close()


def test_d4rl_frames_with_next_observations_round_trip_and_dedup(atari_pong, tmp_path):
    src = write_d4rl(tmp_path / "pong.hdf5", pong_d4rl_arrays(atari_pong, next_obs=True), metadata=False)
    assert (
        run(
            "import",
            str(src),
            str(tmp_path / "s"),
            "--format",
            "d4rl",
            "--frames",
            "observation=0",
            "--chunk-rows",
            "300",
        )
        == 0
    )
    st = tiered.open(tmp_path / "s").stats()
    # every frame of next_observations is also a frame of observations: stored once
    assert st["fields"]["observation"]["dedup_factor"] > 3
    assert run("verify", str(tmp_path / "s")) == 0
    assert run("export", str(tmp_path / "s"), str(tmp_path / "out.hdf5"), "--format", "d4rl") == 0
    assert_arrays_equal(h5_datasets(src), h5_datasets(tmp_path / "out.hdf5"))


def test_d4rl_derived_next_observations_match_the_rollout(atari_pong, tmp_path):
    src = write_d4rl(tmp_path / "pong.hdf5", pong_d4rl_arrays(atari_pong), metadata=False)
    import_dataset("d4rl", src, tmp_path / "s", frames={"observation": 0}, chunk_rows=128)
    with tiered.open(tmp_path / "s") as store:
        td = store.get(slice(None))
    done = atari_pong["next", "done"].reshape(-1)
    assert torch.equal(td[NEXT_OBS][~done][:-1], atari_pong["next", "observation"][~done][:-1])
    assert torch.equal(td[TRAJ], atari_pong["collector", "traj_ids"] - atari_pong["collector", "traj_ids"][0])
    export_dataset(tmp_path / "s", tmp_path / "out.hdf5", "d4rl")
    assert_arrays_equal(h5_datasets(src), h5_datasets(tmp_path / "out.hdf5"))


def test_d4rl_float_terminals_come_back_as_floats(cartpole, tmp_path):
    arrays = {k: v for k, v in cartpole.items() if k not in ("next_observations", "timeouts")}
    arrays["terminals"] = arrays["terminals"].astype(np.float32)
    src = write_d4rl(tmp_path / "old.hdf5", arrays, metadata=False)
    import_dataset("d4rl", src, tmp_path / "s")
    export_dataset(tmp_path / "s", tmp_path / "out.hdf5", "d4rl")
    assert_arrays_equal(h5_datasets(src), h5_datasets(tmp_path / "out.hdf5"))
    arrays["terminals"][3] = 0.5
    bad = write_d4rl(tmp_path / "bad.hdf5", arrays, metadata=False)
    with pytest.raises(UnsupportedFormatError, match="0/1"):
        import_dataset("d4rl", bad, tmp_path / "s2")
    assert not (tmp_path / "s2").exists()


# ---------------------------------------------------------------------------------------------- minari


def test_minari_round_trip_is_exact(minari_cartpole, tmp_path):
    assert run("import", str(minari_cartpole), str(tmp_path / "s"), "--format", "minari") == 0
    assert run("export", str(tmp_path / "s"), str(tmp_path / "out"), "--format", "minari") == 0
    _assert_minari_equal(minari_cartpole, tmp_path / "out")
    # vector observations are stored raw by minari too: the HDF5 arrays are identical
    assert_arrays_equal(
        h5_datasets(minari_cartpole / "data" / "main_data.hdf5"),
        h5_datasets(tmp_path / "out" / "data" / "main_data.hdf5"),
    )


def test_minari_export_of_a_cut_first_episode_recomputes_its_stats(minari_cartpole, tmp_path):
    """A smaller capacity cuts the first episode short but keeps the episode count: the source's
    per-episode attributes no longer describe it, so the export must recompute them."""
    with h5py.File(minari_cartpole / "data" / "main_data.hdf5") as h:
        lengths = [int(h[f"episode_{e}"]["rewards"].shape[0]) for e in range(len(h))]
    capacity = sum(lengths) - lengths[0] // 2
    import_dataset("minari", minari_cartpole, tmp_path / "s", capacity=capacity)
    assert run("export", str(tmp_path / "s"), str(tmp_path / "out"), "--format", "minari") == 0
    with h5py.File(tmp_path / "out" / "data" / "main_data.hdf5") as h:
        assert len(h) == len(lengths)
        for e in range(len(h)):
            g = h[f"episode_{e}"]
            r = g["rewards"][()]
            assert g.attrs["total_steps"] == r.shape[0]
            assert g.attrs["rewards_sum"] == pytest.approx(r.sum()), e
        assert h["episode_0"]["rewards"].shape[0] == lengths[0] - lengths[0] // 2


def test_minari_infos_with_t_plus_one_entries(minari_frozenlake, tmp_path):
    import_dataset("minari", minari_frozenlake, tmp_path / "s")
    with tiered.open(tmp_path / "s") as store:
        td = store.get(slice(None))
    ds, eps = _episodes(minari_frozenlake)
    first = eps[0]
    T = first.actions.shape[0]
    assert torch.equal(td["info", "prob"][:T], torch.from_numpy(first.infos["prob"][:-1]))
    assert torch.equal(td["next", "info", "prob"][:T], torch.from_numpy(first.infos["prob"][1:]))
    assert torch.equal(td["observation"][:T], torch.from_numpy(first.observations[:-1]))
    assert torch.equal(td[NEXT_OBS][:T], torch.from_numpy(first.observations[1:]))
    export_dataset(tmp_path / "s", tmp_path / "out", "minari")
    _assert_minari_equal(minari_frozenlake, tmp_path / "out")


def test_minari_jpeg_frames_import_decoded_and_export_lossless(minari_pong, tmp_path):
    assert json.loads((minari_pong / "data" / "metadata.json").read_text())["jpeg_encoding"] is True
    assert run("import", str(minari_pong), str(tmp_path / "s"), "--format", "minari", "--chunk-frames", "8") == 0
    ds, eps = _episodes(minari_pong)
    with tiered.open(tmp_path / "s") as store:
        td = store.get(slice(None))
    decoded = np.concatenate([e.observations[:-1] for e in eps])
    assert torch.equal(td["observation"], torch.from_numpy(decoded))
    assert run("export", str(tmp_path / "s"), str(tmp_path / "out"), "--format", "minari") == 0
    assert json.loads((tmp_path / "out" / "data" / "metadata.json").read_text())["jpeg_encoding"] is False
    _assert_minari_equal(minari_pong, tmp_path / "out")


def test_minari_export_from_a_torchrl_store_loads_in_minari(atari_pong, tmp_path):
    td = atari_pong[:600]
    td.memmap(tmp_path / "td")
    import_dataset("torchrl", tmp_path / "td", tmp_path / "s", frames={"observation": 0})
    rep = export_dataset(tmp_path / "s", tmp_path / "out", "minari", dataset_id="tiered/pong-v0")
    ds, eps = _episodes(tmp_path / "out")
    ids = td["collector", "traj_ids"]
    assert ds.total_steps == 600 and ds.total_episodes == len(torch.unique(ids))
    first = eps[0]
    T = int((ids == ids[0]).sum())
    assert np.array_equal(first.observations[:-1], td["observation"][:T].numpy())
    assert np.array_equal(first.observations[-1], td["next", "observation"][T - 1].numpy())
    assert np.array_equal(first.rewards, td["next", "reward"][:T, 0].numpy())
    assert "done" in rep.details["dropped"]  # TorchRL's root flags have no place in minari


# --------------------------------------------------------------------------------------------- torchrl


def test_torchrl_memmap_round_trip_is_exact(atari_pong, tmp_path):
    atari_pong.memmap(tmp_path / "td")
    assert (
        run("import", str(tmp_path / "td"), str(tmp_path / "s"), "--format", "torchrl", "--frames", "observation=0") == 0
    )
    assert run("export", str(tmp_path / "s"), str(tmp_path / "out"), "--format", "torchrl") == 0
    back = TensorDict.load_memmap(tmp_path / "out")
    assert back.batch_size == atari_pong.batch_size
    a, b = td_leaves(atari_pong), td_leaves(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_exported_torchrl_dir_serves_a_torchrl_replay_buffer(d4rl_cartpole, tmp_path):
    from torchrl.data import ReplayBuffer, SliceSampler, TensorStorage

    import_dataset("d4rl", d4rl_cartpole, tmp_path / "s")
    export_dataset(tmp_path / "s", tmp_path / "td", "torchrl")
    data = TensorDict.load_memmap(tmp_path / "td")
    rb = ReplayBuffer(
        storage=TensorStorage(data), sampler=SliceSampler(slice_len=8, traj_key=TRAJ), batch_size=64
    )
    s = rb.sample()
    traj = s[TRAJ].reshape(-1, 8)
    assert (traj == traj[:, :1]).all()


def test_torchrl_replay_buffer_checkpoint_imports(atari_pong, tmp_path):
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000))
    rb.extend(atari_pong[:300])
    rb.dumps(tmp_path / "ckpt")
    rep = import_dataset("torchrl", tmp_path / "ckpt", tmp_path / "s", frames={"observation": 0})
    assert rep.rows == 300
    with tiered.open(tmp_path / "s") as store:
        got = store.get(slice(None))
        assert "index" not in got.keys()  # TorchRL's bookkeeping column is not data
        for k, v in td_leaves(atari_pong[:300]).items():
            assert torch.equal(got.get(k), v), k


# ------------------------------------------------------------------------------------------------- npz


def test_npz_d4rl_names_round_trip(cartpole, tmp_path):
    np.savez(tmp_path / "a.npz", **{k: v for k, v in cartpole.items() if k != "next_observations"})
    assert run("import", str(tmp_path / "a.npz"), str(tmp_path / "s"), "--format", "npz") == 0
    assert run("export", str(tmp_path / "s"), str(tmp_path / "b.npz"), "--format", "npz") == 0
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        assert_arrays_equal(dict(a), dict(b))


def test_npz_compressed_ted_names_round_trip(atari_pong, tmp_path):
    src = {"/".join(k): v.numpy() for k, v in td_leaves(atari_pong[:500]).items()}
    np.savez_compressed(tmp_path / "a.npz", **src)
    assert zipfile.ZipFile(tmp_path / "a.npz").infolist()[0].compress_type == zipfile.ZIP_DEFLATED
    import_dataset("npz", tmp_path / "a.npz", tmp_path / "s", frames={"observation": 0}, chunk_rows=64)
    export_dataset(tmp_path / "s", tmp_path / "b.npz", "npz")
    with np.load(tmp_path / "b.npz") as b:
        assert_arrays_equal(src, dict(b))
    export_dataset(tmp_path / "s", tmp_path / "c.npz", "npz", layout="d4rl")
    with np.load(tmp_path / "c.npz") as c:
        assert np.array_equal(c["observations"], src["observation"])
        assert np.array_equal(c["rewards"], src["next/reward"][:, 0])


def test_npz_member_of_python_objects_is_refused_unread(tmp_path):
    # numpy's header parser is shared with dqn-replay: an object array is refused from its header,
    # before any byte of its pickle is read
    np.savez(tmp_path / "a.npz", observation=np.zeros((4, 3), np.float32),
             info=np.array([{"a": 1}] * 4, dtype=object))
    with pytest.raises(PickledDataError, match=r"a\.npz: info\.npy: the array holds Python objects"):
        import_dataset("npz", tmp_path / "a.npz", tmp_path / "s")
    assert not (tmp_path / "s").exists()


# -------------------------------------------------------------------------------------- across formats


def test_minari_to_d4rl_reads_under_d4rl_names(minari_cartpole, tmp_path):
    import_dataset("minari", minari_cartpole, tmp_path / "s")
    export_dataset(tmp_path / "s", tmp_path / "d.hdf5", "d4rl")
    ds, eps = _episodes(minari_cartpole)
    with h5py.File(tmp_path / "d.hdf5") as f:
        assert np.array_equal(f["observations"][:], np.concatenate([e.observations[:-1] for e in eps]))
        assert np.array_equal(f["next_observations"][:], np.concatenate([e.observations[1:] for e in eps]))
        assert np.array_equal(f["terminals"][:], np.concatenate([e.terminations for e in eps]))
        assert np.array_equal(f["timeouts"][:], np.concatenate([e.truncations for e in eps]))
        assert np.array_equal(f["rewards"][:], np.concatenate([e.rewards for e in eps]))
    # and back: the D4RL file imports with the real next observations (nothing derived)
    rep = import_dataset("d4rl", tmp_path / "d.hdf5", tmp_path / "s2")
    assert "next/observation" not in rep.derived


def test_import_of_a_wrapped_capacity_exports_oldest_first(d4rl_cartpole, cartpole, tmp_path):
    import_dataset("d4rl", d4rl_cartpole, tmp_path / "s", capacity=1000, chunk_rows=333)
    export_dataset(tmp_path / "s", tmp_path / "out.npz", "npz", layout="d4rl")
    with np.load(tmp_path / "out.npz") as out:
        assert np.array_equal(out["observations"], cartpole["observations"][-1000:])


# --------------------------------------------------------------------------------- errors and atomicity


def test_import_errors_exit_2_and_leave_nothing(d4rl_cartpole, tmp_path, capsys):
    (tmp_path / "junk.hdf5").write_bytes(b"not hdf5 at all")
    assert run("import", str(tmp_path / "junk.hdf5"), str(tmp_path / "s"), "--format", "d4rl") == 2
    assert run("import", str(tmp_path / "missing.hdf5"), str(tmp_path / "s"), "--format", "d4rl") == 2
    assert run("import", str(d4rl_cartpole), str(tmp_path / "s"), "--format", "minari") == 2
    assert run("import", str(tmp_path), str(tmp_path / "s"), "--format", "torchrl") == 2
    with h5py.File(tmp_path / "other.hdf5", "w") as f:
        f["x"] = np.zeros(3)
    assert run("import", str(tmp_path / "other.hdf5"), str(tmp_path / "s"), "--format", "d4rl") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("tiered: error:") == 5
    assert not (tmp_path / "s").exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial" in p]
    (tmp_path / "taken").mkdir()
    assert run("import", str(d4rl_cartpole), str(tmp_path / "taken"), "--format", "d4rl") == 2
    assert "already exists" in capsys.readouterr().err


def test_export_on_a_full_disk_exits_4_and_leaves_no_output(d4rl_cartpole, tmp_path, capsys):

    import_dataset("d4rl", d4rl_cartpole, tmp_path / "s")
    for fmt, dst in (("d4rl", "o.hdf5"), ("torchrl", "o-td"), ("npz", "o.npz"), ("minari", "o-m")):
        with faults.inject_faults(quota_bytes=20_000):
            assert run("export", str(tmp_path / "s"), str(tmp_path / dst), "--format", fmt) == 4, fmt
        assert not (tmp_path / dst).exists()
    assert "no space left" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_import_on_a_full_disk_raises_storage_full(d4rl_cartpole, tmp_path):

    with faults.inject_faults(quota_bytes=50_000), pytest.raises(StorageFullError):
        import_dataset("d4rl", d4rl_cartpole, tmp_path / "s")
    assert os.listdir(tmp_path) == []


def test_import_memory_is_bounded_and_flat(atari_pong, tmp_path):
    """Importing 3x more data does not take more memory, and the peak stays far below the data."""
    arrays = pong_d4rl_arrays(atari_pong)

    def make(reps: int):
        path = tmp_path / f"big{reps}.hdf5"
        with h5py.File(path, "w") as f:
            n = 2000 * reps
            for k, v in arrays.items():
                # lzf-compressed chunks keep the file small on disk (the CI temp dir is small);
                # the importer still reads and holds the full uncompressed slices
                d = f.create_dataset(k, shape=(n, *v.shape[1:]), dtype=v.dtype,
                                     chunks=(min(n, 64), *v.shape[1:]), compression="lzf")
                for r in range(reps):
                    # perturbed per repetition so the frames do not dedup across repetitions
                    d[r * 2000 : (r + 1) * 2000] = v ^ np.uint8(r) if v.dtype == np.uint8 else v
        return path

    # One fresh process per size; each file and its store are deleted once measured, so the
    # test holds at most one of them on disk.
    script = textwrap.dedent("""
        import json, sys, threading, time
        from tiered.formats import import_dataset
        def anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        base = anon(); peak = [base]; stop = [False]
        def watch():
            while not stop[0]:
                peak[0] = max(peak[0], anon()); time.sleep(0.005)
        t = threading.Thread(target=watch, daemon=True); t.start()
        import_dataset("d4rl", sys.argv[1], sys.argv[2], frames={"observation": 0})
        stop[0] = True; t.join()
        print(json.dumps(peak[0] - base))
    """)
    res, data_bytes = {}, {}
    for name, reps in (("small", 3), ("big", 9)):
        path = make(reps)
        data_bytes[name] = reps * sum(v.nbytes for v in arrays.values())  # 170 MB and 510 MB
        out = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / f"s-{name}")],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        path.unlink()
        shutil.rmtree(tmp_path / f"s-{name}")
    assert res["big"] < 400 << 20, res  # measured 117 MB here: a few copies of one 32 MiB slice
    assert res["big"] - res["small"] < 64 << 20, res
    assert res["big"] < data_bytes["big"] * 0.8, res


# ------------------------------------------------------------------------------------- TorchRL sampling


@pytest.mark.parametrize("fmt", ["d4rl", "minari"])
def test_imported_dataset_samples_episode_slices_through_torchrl(fmt, request, tmp_path):
    pytest.importorskip("torchrl")
    from torchrl.data import SliceSampler, TensorDictReplayBuffer

    from tiered.torchrl import TieredStorage

    src = request.getfixturevalue("d4rl_cartpole" if fmt == "d4rl" else "minari_pong")
    import_dataset(fmt, src, tmp_path / "s")
    with tiered.open(tmp_path / "s") as full:
        everything = full.get(slice(None))
    storage = TieredStorage.from_store(tiered.open(tmp_path / "s", mode="r"))
    rb = TensorDictReplayBuffer(
        storage=storage, batch_size=64, sampler=SliceSampler(slice_len=8, traj_key=TRAJ, strict_length=True)
    )
    for seed in range(3):
        torch.manual_seed(seed)
        s = rb.sample()
        index = s["index"].reshape(-1, 8)
        assert ((index[:, 1:] - index[:, :-1]) == 1).all(), "slices are not consecutive rows"
        traj = s[TRAJ].reshape(-1, 8)
        assert (traj == traj[:, :1]).all(), "a slice crosses episodes"
        assert torch.equal(s["observation"], everything["observation"][index.reshape(-1)])
        assert torch.equal(s[NEXT_OBS], everything[NEXT_OBS][index.reshape(-1)])


def test_import_into_the_hdf5_backend(d4rl_cartpole, atari_pong, tmp_path):
    src = write_d4rl(tmp_path / "pong.hdf5", pong_d4rl_arrays(atari_pong[:400]), metadata=False)
    args = ("--backend", "hdf5", "--frames", "observation=0")
    assert run("import", str(src), str(tmp_path / "s"), "--format", "d4rl", *args) == 0
    assert sorted(p.suffix for p in (tmp_path / "s" / "cold").iterdir()) == [".h5"]
    assert run("verify", str(tmp_path / "s")) == 0
    assert run("export", str(tmp_path / "s"), str(tmp_path / "out.hdf5"), "--format", "d4rl") == 0
    assert_arrays_equal(h5_datasets(src), h5_datasets(tmp_path / "out.hdf5"))
