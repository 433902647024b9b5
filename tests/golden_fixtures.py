"""Reading the golden fixtures of tests/golden/ (see its README): their metadata, and an
object parser of our own, written from the format's documentation rather than from codec.py,
so a change to both encoder and decoder cannot pass unnoticed."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest

GOLDEN = Path(__file__).parent / "golden"
OBJECTS = GOLDEN / "objects"
MANIFESTS = GOLDEN / "manifests"
# What the current encoder writes for the fixtures' contents (sha256 of each object and
# manifest). Unlike the fixtures, these are updated when the encoder changes on purpose:
# `pytest tests/test_golden_objects.py tests/test_golden_manifests.py` then names every
# pin that moved, and encoder_pins.json is edited to match (see golden/README.md).
PINS: dict[str, dict[str, str]] = json.loads((GOLDEN / "encoder_pins.json").read_text())

HEAD = struct.Struct("<4sBBBBQI")  # magic, version, word, flags, reserved, length, chunk
PLANE = struct.Struct("<BI")  # method, payload length
RAW, ZSTD, HUFFMAN = 0, 1, 2
# What each per-link "codec" names: the object's leading bytes.
CODEC_MAGIC = {"gtho1": b"GTHO\x01", "gtsp1": b"GTSP", "gtfx1": b"GTFX"}


def fixtures(directory: Path, kind: str | None = None) -> dict[str, dict[str, Any]]:
    """name -> metadata of every fixture in ``directory`` (of ``kind``, when given)."""
    out = {}
    for path in sorted(directory.glob("*.json")):
        meta: dict[str, Any] = json.loads(path.read_text())
        if kind is None or meta.get("kind") == kind:
            out[path.stem] = meta
    return out


class ObjectHead(NamedTuple):
    version: int
    word: int
    rotated: bool
    length: int
    chunk_words: int
    methods: list[list[int]]  # per chunk, per plane
    end: int  # where the object's last plane ends


def parse_object(obj: bytes, pos: int = 0) -> ObjectHead:
    """The header and the plane methods of the GTHO object starting at ``obj[pos]``."""
    magic, version, word, flags, _, length, chunk_words = HEAD.unpack_from(obj, pos)
    assert magic == b"GTHO"
    pos += HEAD.size
    methods = []
    for _ in range(0, length, chunk_words * word):
        row = []
        for _ in range(word):
            method, n = PLANE.unpack_from(obj, pos)
            row.append(method)
            pos += PLANE.size + n
        methods.append(row)
    return ObjectHead(version, word, bool(flags & 1), length, chunk_words, methods, pos)


@contextmanager
def kernels(name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the block with the C kernel ("native") or its NumPy twins ("numpy")."""
    from git_theta import kernels as switch

    if name == "numpy":
        monkeypatch.setattr(switch, "native", None)
    yield
