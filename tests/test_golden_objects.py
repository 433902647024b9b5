"""Content objects written once (tests/golden/objects/) must decode to the recorded bytes
forever, whatever the encoder does; the encoder is checked separately against them.

The decode tests are never updated to follow the code: a failure there means repositories
written by an earlier git-theta no longer check out (see tests/golden/README.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib
from typing import Any

import pytest
from golden_fixtures import (
    CODEC_MAGIC,
    HEAD,
    HUFFMAN,
    OBJECTS,
    PINS,
    PLANE,
    RAW,
    ZSTD,
    fixtures,
    kernels,
    parse_object,
)

from git_theta import codec
from git_theta.errors import ObjectCorruptError
from git_theta.parallel import chunk_pool
from git_theta.updates import UPDATES

VALUES = fixtures(OBJECTS, "value")
UPDATE_FIXTURES = fixtures(OBJECTS, "update")
FUTURE = fixtures(OBJECTS, "future")
KERNELS = ["native", "numpy"]


def sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def load(name: str, meta: dict[str, Any]) -> bytes:
    """The fixture's object bytes, checked against its recorded sha256."""
    data = (OBJECTS / f"{name}.gtho").read_bytes()
    assert sha256(data) == meta["object_sha256"], f"fixture {name} was changed: restore it"
    return data


def base_value(name: str) -> bytearray:
    """The decoded value of value fixture ``name`` (an update's previous value)."""
    meta = VALUES[name]
    value = codec.decode(load(name, meta))
    assert sha256(value) == meta["raw_sha256"]
    return value


@pytest.mark.parametrize("name", sorted(VALUES))
def test_object_layout_is_what_the_fixture_records(name: str) -> None:
    meta = VALUES[name]
    obj = load(name, meta)
    head = parse_object(obj)
    assert head.version == 1
    assert head.length == meta["raw_size"]
    assert head.chunk_words == meta["encode"]["chunk_words"]
    assert head.methods == meta["methods"]
    assert head.end == len(obj)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", sorted(VALUES))
def test_value_objects_decode_to_the_recorded_bytes(
    name: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = VALUES[name]
    obj = load(name, meta)
    with kernels(kernel, monkeypatch):
        assert sha256(codec.decode(obj)) == meta["raw_sha256"]
        assert sha256(codec.decode(obj, pool=chunk_pool())) == meta["raw_sha256"]

        streamed = hashlib.sha256()
        for piece in codec.decode_stream(io.BytesIO(obj).read, chunk_pool()):
            streamed.update(piece)
        assert streamed.hexdigest() == meta["raw_sha256"]

        pieces: dict[int, bytes] = {}
        length = codec.decode_each(obj, lambda at, chunk: pieces.update({at: bytes(chunk)}))
        assert length == meta["raw_size"]
        assert sha256(b"".join(pieces[k] for k in sorted(pieces))) == meta["raw_sha256"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", sorted(UPDATE_FIXTURES))
def test_update_objects_apply_to_the_recorded_bytes(
    name: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = UPDATE_FIXTURES[name]
    payload = load(name, meta)
    with kernels(kernel, monkeypatch):
        prev = base_value(meta["prev"])
        new = UPDATES.get(meta["update"]).apply(prev, payload, meta["dtype"])
        assert sha256(new) == meta["new_sha256"]


def _grouped(obj: bytes) -> bool:
    """Whether a GTHO object has a plane stored grouped (method bit 7)."""
    return any(m & 0x80 for row in parse_object(obj).methods for m in row)


@pytest.mark.parametrize("name", sorted(UPDATE_FIXTURES))
def test_update_objects_start_with_what_their_codec_names(name: str) -> None:
    """The manifest records a codec per link; it must name the object's actual format
    (gtho1's version byte is 3 in an object with a grouped plane, or 1 as first written)."""
    meta = UPDATE_FIXTURES[name]
    assert UPDATES.get(meta["update"]).codec == meta["codec"]
    magic = CODEC_MAGIC[meta["codec"]]
    obj = load(name, meta)
    if meta["codec"] == "gtho1" and _grouped(obj):
        assert obj[: len(magic)] in (magic, magic[:4] + b"\x03")
    else:
        assert obj[: len(magic)] == magic


@pytest.mark.parametrize("name", sorted(FUTURE))
def test_an_object_from_a_newer_git_theta_says_so(name: str) -> None:
    meta = FUTURE[name]
    with pytest.raises(ObjectCorruptError, match=meta["error"]):
        codec.decode(load(name, meta))


# ------------------------------------------------------------------------------------------
# The encoder: on the same input it still writes the same bytes (clean is deterministic).
# Unlike the tests above, these are updated when the encoder changes on purpose; the
# fixtures themselves never are.


def _same_but_coder(got: bytes, fixture: bytes) -> None:
    """``got`` has the fixture's header and plane methods, holds the same planes (each
    Huffman plane decoded by zlib, an inflater of its own) and is at most 0.2% larger:
    only the Huffman coder's bytes may differ from what an earlier encoder wrote."""
    new, old = parse_object(got), parse_object(fixture)
    assert new._replace(end=0) == old._replace(end=0)
    assert len(got) <= len(fixture) * 1.002 + 64
    assert _planes(got) == _planes(fixture)


def _planes(obj: bytes) -> list[bytes]:
    """Each plane's stored bytes, Huffman payloads inflated by zlib."""
    head = parse_object(obj)
    pos, out = HEAD.size, []
    for row in head.methods:
        for method in row:
            kind, length = PLANE.unpack_from(obj, pos)
            payload = obj[pos + PLANE.size : pos + PLANE.size + length]
            out.append(zlib.decompress(payload, -15) if kind & 0x7F == HUFFMAN else payload)
            pos += PLANE.size + length
            assert kind == method
    return out


def _encode_value(meta: dict[str, Any], raw: bytes) -> bytes:
    from git_theta.updates.layout import layout_for

    recipe = meta["encode"]
    if recipe["dtype"] is not None:
        layout = layout_for(recipe["dtype"])
    elif recipe["layout"] is not None:
        layout = codec.Layout(*recipe["layout"])
    else:
        layout = codec.PLAIN
    return b"".join(codec.encode(raw, layout, recipe["level"], chunk_pool()))


@pytest.mark.parametrize("name", sorted(VALUES))
def test_encoder_still_writes_the_value_objects(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    meta = VALUES[name]
    obj = load(name, meta)
    monkeypatch.setattr(codec, "CHUNK_WORDS", meta["encode"]["chunk_words"])
    got = _encode_value(meta, bytes(codec.decode(obj)))
    _same_but_coder(got, obj)
    assert sha256(got) == PINS["objects"][name], name  # deterministic, and pinned


def _factored_inputs(payload: bytes) -> Any:
    """The factors a low-rank or ia3 object was made from (parsed from its header)."""
    from git_theta.updates.factored import Factor, Inputs

    (length,) = struct.unpack_from("<I", payload, 4)
    header = json.loads(payload[8 : 8 + length])
    pos, factors = 8 + length, []
    for f in header["factors"]:
        raw = bytes(codec.decode(payload[pos : pos + f["size"]]))
        factors.append(Factor(f["dtype"], tuple(f["shape"]), raw))
        pos += f["size"]
    return Inputs(header["kind"], tuple(factors), header["scale"])


@pytest.mark.parametrize("name", sorted(UPDATE_FIXTURES))
def test_encoder_still_writes_the_update_objects(name: str) -> None:
    meta = UPDATE_FIXTURES[name]
    payload = load(name, meta)
    prev = bytes(base_value(meta["prev"]))
    dtype, shape = meta["dtype"], tuple(meta["shape"])
    new = bytes(UPDATES.get(meta["update"]).apply(bytearray(prev), payload, dtype))
    plugin = UPDATES.get(meta["update"])
    if meta["codec"] == "gtfx1":
        plugin = type(plugin)({"t": _factored_inputs(payload)})  # LowRank or IA3, with factors
    dense = UPDATES.get("dense")
    key, parts = plugin.pick(
        new, prev, dtype, lambda: dense.encode(new, None, dtype) or [], None, "t", shape
    )
    assert key == meta["update"]
    assert parts is not None
    got = b"".join(parts)
    if meta["codec"] == "gtho1":
        if payload[4] == 1 and _grouped(payload):
            payload = payload[:4] + b"\x03" + payload[5:]  # grouped planes now mark version 3
        _same_but_coder(got, payload)
    assert sha256(got) == PINS["updates"][name], name


def test_fixtures_cover_every_kind_of_object() -> None:
    """What README.md promises the fixtures pin (a fixture removed would leave a gap)."""
    heads = {name: parse_object(load(name, meta)) for name, meta in VALUES.items()}
    words = {h.word for h in heads.values()}
    assert words == {1, 2, 4, 8}
    for word in (2, 4, 8):
        assert {h.rotated for h in heads.values() if h.word == word} == {True, False}
    every = {RAW, ZSTD, HUFFMAN}
    for word_set in ({1}, {2, 4, 8}):
        found = {m for h in heads.values() if h.word in word_set for row in h.methods for m in row}
        assert found == every, word_set
    many = [h for h in heads.values() if len(h.methods) > 1]
    assert {h.chunk_words for h in many} >= {1 << 20, 256}  # the real chunk size, and another
    assert any(h.length == 0 for h in heads.values())
    assert any(VALUES[n]["encode"]["level"] == 9 for n in VALUES)  # glue as clean stores it
    assert {m["update"] for m in UPDATE_FIXTURES.values()} == {"sparse", "delta", "low-rank", "ia3"}
    grouped = [  # a delta's plane ordered by the previous value's exponent (method bit 7)
        name
        for name, meta in UPDATE_FIXTURES.items()
        if meta["update"] == "delta"
        and any(m & 0x80 for row in parse_object(load(name, meta)).methods for m in row)
    ]
    assert grouped
    assert FUTURE
    total = sum(p.stat().st_size for p in OBJECTS.iterdir())
    assert total < 256 << 10  # fixtures stay small
