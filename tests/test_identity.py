"""Tensor identity across the files of a checkpoint set (real git): a tensor that moves to
another shard or file is not stored again, and one that moves and changes is stored as a
change against its value in the file it left."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import git, lfs_objects, sha256, track
from st_files import f32, st_from_arrays

SHAPES = {f"layer{i}.weight": (64, 48) for i in range(8)}


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def manifest(repo: Path, path: str, rev: str = "HEAD") -> dict[str, object]:
    data: dict[str, object] = json.loads(git(repo, "show", f"{rev}:{path}").stdout)
    return data


def chains(repo: Path, path: str, rev: str = "HEAD") -> dict[str, list[dict[str, object]]]:
    tensors = manifest(repo, path, rev)["tensors"]
    assert isinstance(tensors, dict)
    return {name: entry["chain"] for name, entry in tensors.items()}


def glue_oids(repo: Path, *paths: str) -> set[str]:
    out = set()
    for path in paths:
        glue = manifest(repo, path)["glue"]
        assert isinstance(glue, dict)
        out.add(glue["oid"])
    return out


def shard(arrays: dict[str, np.ndarray], names: list[str]) -> bytes:
    return st_from_arrays({n: arrays[n] for n in names})


def check_out_all(repo: Path) -> None:
    """Every tracked checkpoint comes back byte for byte after deleting it."""
    files = [p for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts]
    expected = {p: sha256(p) for p in files}
    for p in files:
        p.unlink()
    git(repo, "checkout", "--", ".")
    assert {p: sha256(p) for p in files} == expected


def index_json(shards: dict[str, list[str]]) -> bytes:
    weight_map = {n: f for f, names in shards.items() for n in names}
    return json.dumps({"metadata": {}, "weight_map": weight_map}, sort_keys=True).encode()


def save_sharded(repo: Path, arrays: dict[str, np.ndarray], shards: dict[str, list[str]]) -> None:
    for old in repo.glob("model-*.safetensors"):
        old.unlink()
    for name, names in shards.items():
        (repo / name).write_bytes(shard(arrays, names))
    (repo / "model.safetensors.index.json").write_bytes(index_json(shards))


NAMES = list(SHAPES)


def nudge(arrays: dict[str, np.ndarray]) -> None:
    """Change a few elements of every tensor, so each has a chain of a base and a sparse
    update: a tensor re-stored from its bytes alone would come back as one dense link."""
    for value in arrays.values():
        value.reshape(-1)[::101] += np.float32(1e-3)


def test_resharding_stores_no_tensor_again(repo: Path) -> None:
    arrays = f32(SHAPES, seed=1)
    first = {"model-00001-of-00002.safetensors": NAMES[:4],
             "model-00002-of-00002.safetensors": NAMES[4:]}  # fmt: skip
    save_sharded(repo, arrays, first)
    commit(repo, "v1")
    nudge(arrays)
    save_sharded(repo, arrays, first)
    commit(repo, "v2 in place")
    before = lfs_objects(repo)
    # Re-sharded with another max_shard_size: three shards, every tensor moved or renamed.
    second = {"model-00001-of-00003.safetensors": NAMES[:3],
              "model-00002-of-00003.safetensors": NAMES[3:6],
              "model-00003-of-00003.safetensors": NAMES[6:]}  # fmt: skip
    save_sharded(repo, arrays, second)
    commit(repo, "v3 re-sharded")
    new = lfs_objects(repo) - before
    assert new <= glue_oids(repo, *second)  # headers only: no tensor object
    old_chains: dict[str, list[dict[str, object]]] = {}
    for path in first:
        old_chains.update(chains(repo, path, "HEAD~1"))
    for path in second:
        for name, chain in chains(repo, path).items():
            assert chain == old_chains[name]
            assert len(chain) == 2
    check_out_all(repo)


def test_a_moved_and_changed_tensor_is_stored_as_a_change(repo: Path) -> None:
    arrays = f32(SHAPES, seed=2)
    first = {"model-00001-of-00002.safetensors": NAMES[:4],
             "model-00002-of-00002.safetensors": NAMES[4:]}  # fmt: skip
    save_sharded(repo, arrays, first)
    commit(repo, "v1")
    old = chains(repo, "model-00002-of-00002.safetensors")["layer5.weight"]
    # layer5 moves to the first shard and a few of its elements change.
    arrays["layer5.weight"].reshape(-1)[::97] += 1e-3
    second = {"model-00001-of-00002.safetensors": NAMES[:6],
              "model-00002-of-00002.safetensors": NAMES[6:]}  # fmt: skip
    save_sharded(repo, arrays, second)
    before = lfs_objects(repo)
    commit(repo, "v2")
    chain = chains(repo, "model-00001-of-00002.safetensors")["layer5.weight"]
    assert chain[:-1] == old
    assert chain[-1]["update"] != "dense"
    assert chain[-1]["size"] < 0.25 * old[0]["size"]  # type: ignore[operator]
    new = lfs_objects(repo) - before
    assert new - glue_oids(repo, *second) == {chain[-1]["oid"]}
    check_out_all(repo)


def test_bin_then_safetensors_of_one_model_stores_nothing_new(repo: Path) -> None:
    torch = pytest.importorskip("torch")
    track(repo, "*.bin")
    arrays = f32(SHAPES, seed=3)
    for step in ("bin", "bin, changed"):
        if step != "bin":
            nudge(arrays)
        torch.save({n: torch.from_numpy(a) for n, a in arrays.items()}, repo / "pytorch_model.bin")
        commit(repo, step)
    before = lfs_objects(repo)
    (repo / "pytorch_model.bin").unlink()
    (repo / "model.safetensors").write_bytes(st_from_arrays(arrays))
    commit(repo, "safetensors instead")
    assert lfs_objects(repo) - before <= glue_oids(repo, "model.safetensors")
    assert chains(repo, "model.safetensors") == chains(repo, "pytorch_model.bin", "HEAD~1")
    check_out_all(repo)


def test_one_add_of_two_files_with_the_same_tensors_stores_them_once(repo: Path) -> None:
    arrays = f32(SHAPES, seed=4)
    (repo / "a.safetensors").write_bytes(st_from_arrays(arrays))
    commit(repo, "a")
    nudge(arrays)
    (repo / "a.safetensors").write_bytes(st_from_arrays(arrays))
    (repo / "b.safetensors").write_bytes(st_from_arrays(dict(reversed(arrays.items()))))
    before = lfs_objects(repo)
    commit(repo, "a changed, b a copy of it")
    new = lfs_objects(repo) - before - glue_oids(repo, "a.safetensors", "b.safetensors")
    assert len(new) == len(SHAPES)  # one update each, for a; b shares them
    assert chains(repo, "a.safetensors") == chains(repo, "b.safetensors")
    check_out_all(repo)


def test_same_name_in_two_models_prefers_the_same_directory(repo: Path) -> None:
    a = f32(SHAPES, seed=5)
    b = f32(SHAPES, seed=6)  # another model, the same tensor names
    for d, arrays in (("a", a), ("b", b)):
        (repo / d).mkdir()
        (repo / d / "model.safetensors").write_bytes(st_from_arrays(arrays))
    commit(repo, "two models")
    # Model b re-saved under a new name with one tensor changed: its previous value is
    # b's, never a's, although both directories have the name.
    b["layer1.weight"].reshape(-1)[::50] += 1e-3
    (repo / "b" / "model.safetensors").unlink()
    (repo / "b" / "renamed.safetensors").write_bytes(st_from_arrays(b))
    commit(repo, "b renamed, one change")
    old_b = chains(repo, "b/model.safetensors", "HEAD~1")
    new_b = chains(repo, "b/renamed.safetensors")
    assert new_b["layer1.weight"][:-1] == old_b["layer1.weight"]
    assert new_b["layer1.weight"][-1]["update"] != "dense"
    assert {n: c for n, c in new_b.items() if n != "layer1.weight"} == {
        n: c for n, c in old_b.items() if n != "layer1.weight"
    }
    check_out_all(repo)


def test_a_previous_value_from_an_unrelated_model_is_still_exact(repo: Path) -> None:
    # Only model a is known; c is a different model whose names collide with a's. Its
    # tensors may be stored as changes against a's (a wrong previous costs size only).
    a = f32(SHAPES, seed=7)
    (repo / "a").mkdir()
    (repo / "a" / "model.safetensors").write_bytes(st_from_arrays(a))
    commit(repo, "a")
    c = {n: v + np.float32(1e-4) * (i % 3) for i, (n, v) in enumerate(a.items())}
    c["layer2.weight"] = f32({"x": (64, 48)}, seed=8)["x"]  # unrelated values entirely
    (repo / "c").mkdir()
    (repo / "c" / "model.safetensors").write_bytes(st_from_arrays(c))
    commit(repo, "c")
    check_out_all(repo)
    got = chains(repo, "c/model.safetensors")
    assert got["layer0.weight"] == chains(repo, "a/model.safetensors")["layer0.weight"]


def _stage_blob(repo: Path, path: str, data: bytes) -> None:
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--add", "--cacheinfo", f"100644,{oid},{path}")


def test_a_hostile_manifest_in_the_index_is_ignored(repo: Path) -> None:
    arrays = f32(SHAPES, seed=9)
    (repo / "a.safetensors").write_bytes(st_from_arrays(arrays))
    commit(repo, "a")
    good = manifest(repo, "a.safetensors")
    tensors = good["tensors"]
    assert isinstance(tensors, dict)
    # Invalid: fails parse, so it is never used.
    _stage_blob(repo, "bad.safetensors", b'{\n "git-theta": 1, "tensors": {"x": 1}\n}\n')
    # Valid but lying: names the hash of a tensor the next file holds with the objects of
    # another tensor (present locally). Reusing it unchecked would commit wrong bytes.
    new = f32({"fresh": (64, 48)}, seed=10)["fresh"]
    new_hash = __import__("blake3").blake3(new.tobytes()).hexdigest()
    liar = json.loads(json.dumps(good))
    liar["tensors"]["layer0.weight"]["hash"] = new_hash
    liar_bytes = git(repo, "show", "HEAD:a.safetensors").stdout.replace(
        tensors["layer0.weight"]["hash"].encode(), new_hash.encode()
    )
    assert json.loads(liar_bytes) == liar
    _stage_blob(repo, "liar.safetensors", liar_bytes)
    (repo / "n.safetensors").write_bytes(st_from_arrays({"layer0.weight": new}))
    sha = sha256(repo / "n.safetensors")
    git(repo, "add", "n.safetensors")
    git(repo, "commit", "-q", "-m", "n")
    stored = chains(repo, "n.safetensors")["layer0.weight"]
    assert stored != tensors["layer0.weight"]["chain"]
    (repo / "n.safetensors").unlink()
    git(repo, "checkout", "--", "n.safetensors")
    assert sha256(repo / "n.safetensors") == sha
    assert hashlib.sha256((repo / "n.safetensors").read_bytes()).hexdigest() == sha


def _clean_in_process(data: bytes, store: object, previous: object, known: object) -> object:
    import io

    from git_theta.clean import clean

    return clean(io.BytesIO(data), io.BytesIO(), "m.safetensors", store, previous,  # type: ignore[arg-type]
                 show_progress=False, known=known)  # type: ignore[arg-type]  # fmt: skip


def test_an_in_place_change_never_reads_the_other_manifests(tmp_path: Path) -> None:
    """The common add (some tensors of a file changed where they are) costs no git call
    for identity: the other manifests are read only for a name the path's own lacks."""
    from git_theta.identity import Known
    from git_theta.store import ObjectStore

    def refuse(near: str) -> list[tuple[int, str, object]]:
        raise AssertionError("the index and HEAD were read")

    store = ObjectStore(tmp_path)
    arrays = f32(SHAPES, seed=11)
    first = _clean_in_process(st_from_arrays(arrays), store, None, Known(lambda near: []))
    arrays["layer3.weight"].reshape(-1)[::7] += np.float32(1e-3)
    again = _clean_in_process(st_from_arrays(arrays), store, first, Known(refuse))
    assert again.tensors["layer3.weight"].chain[:-1] == first.tensors["layer3.weight"].chain  # type: ignore[attr-defined]


def test_reading_other_manifests_is_capped(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    history = importlib.import_module("git_theta.history")  # the package exports a history()
    arrays = f32({"w": (8, 8)}, seed=12)
    for i in range(4):
        (repo / f"m{i}.safetensors").write_bytes(st_from_arrays(arrays))
    commit(repo, "four")
    _stage_blob(repo, "big.safetensors", b'{\n "git-theta": ' + b" " * 5000 + b"1}\n")
    monkeypatch.setattr(history, "IDENTITY_MAX_MANIFESTS", 2)
    found = history.identity_blobs("", str(repo))
    assert len({oid for _, _, oid, _ in found}) <= 2
    monkeypatch.setattr(history, "IDENTITY_MAX_MANIFESTS", 100)
    monkeypatch.setattr(history, "IDENTITY_MAX_BYTES", 4000)  # the big blob is not read
    found = history.identity_blobs("", str(repo))
    assert {path for _, path, _, _ in found} == {f"m{i}.safetensors" for i in range(4)}
