"""What git stores must not drift: clean output is byte-identical to committed fixtures,
and committed fixtures (manifest + objects) keep checking out byte for byte."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

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
    stored = {p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()}
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
