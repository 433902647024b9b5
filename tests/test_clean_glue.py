"""Re-cleaning an unchanged file keeps the staged glue object (the file's header and
padding), whatever bytes this version's encoder would give it, but only when that object
really holds the glue: a clone's staged manifest may lie."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import test_golden_manifests as golden

from git_theta import codec
from git_theta.clean import clean
from git_theta.manifest import Glue, Manifest, parse
from git_theta.store import ObjectRef, ObjectStore


def _golden(name: str, tmp_path: Path) -> tuple[bytes, Manifest, ObjectStore]:
    """The golden checkpoint's bytes, its manifest (written by the release before the
    new Huffman coder) and a store holding that manifest's objects."""
    data = golden.check_out(name, golden.golden_store(tmp_path / "golden"))
    store = ObjectStore(tmp_path / "store")
    for _, ref in golden.needed_objects(golden.manifest(name)):
        store.copy_in(ObjectStore(golden.LFS).lfs_path(ref.oid), ref)
    return data, golden.manifest(name), store


def _clean(data: bytes, store: ObjectStore, previous: Manifest) -> bytes:
    out = io.BytesIO()
    clean(io.BytesIO(data), out, "model.safetensors", store, previous, False)
    return out.getvalue()


def test_an_unchanged_file_re_cleans_to_its_staged_manifest(tmp_path: Path) -> None:
    data, staged, store = _golden("safetensors", tmp_path)
    fresh = parse(_clean(data, store, staged._replace(glue=Glue("0" * 64, staged.glue.ref))))
    assert fresh.glue.ref != staged.glue.ref  # this coder writes the header otherwise
    assert _clean(data, store, staged) == golden.manifest_bytes("safetensors")


def test_a_staged_glue_object_that_holds_other_bytes_is_not_reused(tmp_path: Path) -> None:
    """The staged entry names the right glue hash but another object (a valid one, of
    another file's header): reusing it would commit a file that never checks out."""
    data, staged, store = _golden("safetensors", tmp_path)
    other = store.put(codec.encode(b'{"__metadata__": {"other": "header"}}' + b" " * 300))
    lying = staged._replace(glue=Glue(staged.glue.hash, other))
    written = parse(_clean(data, store, lying))
    assert written.glue.ref != other
    assert written.glue.hash == staged.glue.hash
    assert codec.decode(store.get(written.glue.ref)) == codec.decode(store.get(staged.glue.ref))


def test_a_staged_glue_object_far_larger_than_the_glue_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A present object far larger than the glue (a clone may bring any object and name
    it as the glue) is not read whole to find out it is not the glue."""
    data, staged, store = _golden("safetensors", tmp_path)
    big = store.put(codec.encode(os.urandom(200_000)))
    assert store.has(big)
    read: list[str] = []
    real_get = ObjectStore.get

    def get(self: ObjectStore, ref: ObjectRef) -> object:
        read.append(ref.oid)
        return real_get(self, ref)

    monkeypatch.setattr(ObjectStore, "get", get)
    written = parse(_clean(data, store, staged._replace(glue=Glue(staged.glue.hash, big))))
    assert big.oid not in read
    assert written.glue.ref != big and written.glue.hash == staged.glue.hash
