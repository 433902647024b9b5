"""What git stores must not drift: clean output is byte-identical to committed fixtures,
and committed fixtures (manifest + objects) keep checking out byte for byte."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from pytest import MonkeyPatch

from git_theta.clean import clean
from git_theta.manifest import parse
from git_theta.smudge import smudge
from git_theta.store import ObjectStore

GOLDEN = Path(__file__).parent / "golden"


def test_clean_matches_golden_manifest(tmp_path: Path) -> None:
    out = io.BytesIO()
    data = (GOLDEN / "v1.safetensors").read_bytes()
    clean(io.BytesIO(data), out, "v1.safetensors", ObjectStore(tmp_path), None, False)
    assert out.getvalue() == (GOLDEN / "v1.manifest").read_bytes()
    stored = {p.name for p in (tmp_path / "theta" / "objects").rglob("*") if p.is_file()}
    golden = {p.name for p in (GOLDEN / "v1-lfs" / "objects").rglob("*") if p.is_file()}
    assert stored == golden


def test_golden_manifest_checks_out_byte_exact(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN / "v1-lfs", tmp_path / "lfs")
    out = io.BytesIO()
    manifest = (GOLDEN / "v1.manifest").read_bytes()
    smudge(io.BytesIO(manifest), out, "v1.safetensors", ObjectStore(tmp_path / "lfs"), False)
    assert out.getvalue() == (GOLDEN / "v1.safetensors").read_bytes()


def test_manifest_serialization_round_trips() -> None:
    data = (GOLDEN / "v1.manifest").read_bytes()
    assert parse(data).to_bytes() == data


def test_large_tensors_stream_and_still_verify(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    import numpy as np
    from st_files import st_bytes

    from git_theta import chains, codec
    from git_theta.errors import ObjectCorruptError

    monkeypatch.setattr(chains, "STREAM_MIN", 1)  # every tensor takes the streaming path
    monkeypatch.setattr(codec, "CHUNK_WORDS", 1000)  # and has many chunks
    rng = np.random.default_rng(8)
    data = st_bytes(
        {
            "big": (
                "F32",
                (100, 77),
                (rng.standard_normal(7700) * 0.02).astype(np.float32).tobytes(),
            ),
            "small": ("BF16", (3,), b"\x01\x02\x03\x04\x05\x06"),
        }
    )
    store = ObjectStore(tmp_path)
    manifest = io.BytesIO()
    clean(io.BytesIO(data), manifest, "m.safetensors", store, None, False)
    out = io.BytesIO()
    smudge(io.BytesIO(manifest.getvalue()), out, "m.safetensors", store, False)
    assert out.getvalue() == data

    oid = parse(manifest.getvalue()).tensors["big"].chain[0].ref.oid
    path = Path(store.path(oid))
    corrupt = bytearray(path.read_bytes())
    corrupt[-3] ^= 0x40
    path.write_bytes(bytes(corrupt))
    with pytest.raises(ObjectCorruptError, match=f"tensor 'big': .*{oid}"):
        smudge(io.BytesIO(manifest.getvalue()), io.BytesIO(), "m.safetensors", store, False)


def test_objects_read_without_mmap_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects are mapped, not copied; where a file system cannot map a file, they are
    read, and checkout is the same."""
    import mmap

    from git_theta import store as store_module

    data = (GOLDEN / "v1.safetensors").read_bytes()
    manifest = io.BytesIO()
    clean(io.BytesIO(data), manifest, "v1.safetensors", ObjectStore(tmp_path), None, False)

    def refuse(*_args: object, **_kwargs: object) -> mmap.mmap:
        raise OSError(19, "No such device")

    for mapped in (True, False):
        if not mapped:
            monkeypatch.setattr(store_module.mmap, "mmap", refuse)
        out = io.BytesIO()
        smudge(io.BytesIO(manifest.getvalue()), out, "v1.safetensors", ObjectStore(tmp_path), False)
        assert out.getvalue() == data
