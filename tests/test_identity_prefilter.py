"""The identity read's prefilter (identity.py): of the index's and HEAD's manifests, only
those whose text holds a hash or name looked up are parsed, and what they give is still
parsed, checked and verified before use."""

from __future__ import annotations

import io
import json
from pathlib import Path

import blake3
import numpy as np
import pytest
from conftest import git
from st_files import f32, st_from_arrays

from git_theta.manifest import Glue, Link, Manifest, TensorEntry
from git_theta.repo import Repo
from git_theta.store import ObjectRef

FILLERS = 30


def _filler(rng: np.random.Generator, i: int) -> bytes:
    """A valid manifest of 16 tensors with random hashes and objects (nothing matches)."""

    def hex64() -> str:
        return rng.bytes(32).hex()

    tensors = {
        f"filler{i}.layer{j}.weight": TensorEntry(
            "F32", (8, 8), hex64(), (Link("dense", "zstd", ObjectRef(hex64(), 100)),)
        )
        for j in range(16)
    }
    return Manifest(
        format="safetensors",
        size=8 + 256 * len(tensors),
        glue=Glue(hex64(), ObjectRef(hex64(), 8)),
        layout=(8, *sorted(tensors)),
        tensors=tensors,
    ).to_bytes()


def _stage(repo: Path, path: str, data: bytes) -> str:
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--add", "--cacheinfo", f"100644,{oid},{path}")
    return oid


def test_only_manifests_holding_a_looked_up_hash_or_name_are_parsed(repo: Path) -> None:
    arrays = f32({"shared.weight": (32, 32), "héllo.weight": (32, 32)}, seed=21)
    (repo / "a").mkdir()
    (repo / "a" / "model.safetensors").write_bytes(st_from_arrays(arrays))
    git(repo, "add", "a/model.safetensors")
    rng = np.random.default_rng(22)
    for i in range(FILLERS):
        _stage(repo, f"fill/m{i:02d}.safetensors", _filler(rng, i))
    # Holds the copied tensor's hash where the prefilter looks, but is no valid manifest.
    digest = blake3.blake3(arrays["shared.weight"].tobytes()).hexdigest()
    bad = b'{\n "git-theta": 1, "tensors": {"copy": {"hash": "' + digest.encode() + b'"}}}\n'
    bad_oid = _stage(repo, "fill/bad.safetensors", bad)
    git(repo, "commit", "-q", "-m", "many")
    a_oid = git(repo, "rev-parse", "HEAD:a/model.safetensors").stdout.decode().strip()
    a = json.loads(git(repo, "show", "HEAD:a/model.safetensors").stdout)["tensors"]

    # A new file: a copy of one tensor under a new name (found by content) and a tensor
    # whose escaped JSON name moved and changed (found by name, as a change).
    changed = arrays["héllo.weight"].copy()
    changed.reshape(-1)[::97] += np.float32(1e-3)
    new = st_from_arrays({"copy.weight": arrays["shared.weight"], "héllo.weight": changed})
    where = Repo(str(repo))
    from git_theta.clean import clean

    got = clean(io.BytesIO(new), io.BytesIO(), "b/model.safetensors", where.store, None,
                show_progress=False, known=where.known)  # fmt: skip
    assert got is not None
    assert [ln.ref.oid for ln in got.tensors["copy.weight"].chain] == [
        ln["oid"] for ln in a["shared.weight"]["chain"]
    ]
    moved = got.tensors["héllo.weight"].chain
    assert len(moved) == 2 and moved[0].ref.oid == a["héllo.weight"]["chain"][0]["oid"]
    # Parsed: the manifest that holds both, and the invalid one (refused by parse).
    assert set(where._parsed) == {a_oid, bad_oid}
    assert where._parsed[bad_oid] is None


def test_a_prefiltered_manifest_listed_at_several_paths_is_parsed_once(repo: Path) -> None:
    """The index and HEAD usually hold the same blob: one parse, every path indexed."""
    arrays = f32({"w": (16, 16)}, seed=23)
    for name in ("x", "y"):
        (repo / f"{name}.safetensors").write_bytes(st_from_arrays(arrays))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "two")
    where = Repo(str(repo))
    digest = blake3.blake3(arrays["w"].tobytes()).hexdigest()
    cands = where.known.same_content(digest, "F32", arrays["w"].nbytes, "z.safetensors")
    assert {(c.path, c.rank[1]) for c in cands} == {
        (p, s) for p in ("x.safetensors", "y.safetensors") for s in (1, 2)
    }
    assert len(where._parsed) == 1  # x and y hold the same manifest


@pytest.mark.parametrize("searches", [0, 100])
def test_the_prefilter_finds_every_tensor_of_what_to_bytes_writes(
    monkeypatch: pytest.MonkeyPatch, searches: int
) -> None:
    """If the serialization changes, the prefilter must change with it: every name
    (escaped ones included, searched for or indexed) and every hash of a written manifest
    is found in its text."""
    from git_theta import identity
    from git_theta.identity import INDEX, Blob, _Unparsed

    monkeypatch.setattr(identity, "_SEARCHES_BEFORE_INDEX", searches)

    rng = np.random.default_rng(24)
    names = ["a.weight", 'q"uote', "héllo", "back\\slash", "日本.bias", "x" * 300, "a"]
    tensors = {
        name: TensorEntry(
            "BF16", (2, 3), rng.bytes(32).hex(), (Link("dense", "zstd", ObjectRef("0" * 64, 9)),)
        )
        for name in names
    }
    data = Manifest("safetensors", 8 + 12 * len(names), Glue("1" * 64, ObjectRef("2" * 64, 8)),
                    (8, *sorted(tensors)), tensors).to_bytes()  # fmt: skip
    other = _filler(rng, 0)
    unparsed = _Unparsed([Blob(INDEX, "m", "m" * 40, data), Blob(INDEX, "o", "o" * 40, other)])
    for name, entry in tensors.items():
        assert unparsed.with_name(name) == ["m" * 40], name
        assert unparsed.with_hash(entry.hash) == ["m" * 40], name
    assert unparsed.with_name("a.weigh") == [] and unparsed.with_name("weight") == []
    assert unparsed.with_name("héll") == [] and unparsed.with_name('q"') == []


def test_a_hash_repeated_in_one_blob_is_indexed_once_for_it() -> None:
    """The prefilter's index of hashes (built on the first look-up, kept for the process)
    holds each blob once per hash it contains: a manifest repeating one hash 20,000 times
    must not leave 20,000 references to itself behind."""
    import tracemalloc

    from git_theta.identity import INDEX, Blob, Known
    from git_theta.manifest import parse

    common = "c" * 64
    link = (Link("dense", "zstd", ObjectRef("0" * 64, 9)),)
    tensors = {f"t{i}": TensorEntry("F32", (768,), common, link) for i in range(20_000)}
    hostile = Manifest("safetensors", 8 + 3072 * len(tensors),
                       Glue("1" * 64, ObjectRef("2" * 64, 8)), (8, *sorted(tensors)),
                       tensors).to_bytes()  # fmt: skip
    known = Known(blobs=lambda near: [Blob(INDEX, "h.safetensors", "h" * 40, hostile)],
                  parse=lambda oid, data: parse(data))  # fmt: skip
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # Another hash: the blob is scanned, not admitted (it does not hold it).
        assert known.same_content("d" * 64, "F32", 3072, "x.safetensors") == []
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 32 << 10  # was 20,000 list slots (160 KB) for the one common hash
