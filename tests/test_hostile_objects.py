"""Content objects from a hostile repository: decoding never allocates more than the
manifest's shape x dtype, and every lie in a header fails before it costs memory."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest

from git_theta import chains, codec
from git_theta.content import content_hash
from git_theta.errors import ObjectCorruptError
from git_theta.manifest import Link, TensorEntry
from git_theta.store import ObjectStore
from git_theta.updates import UPDATES
from git_theta.updates.layout import layout_for

HEAD = struct.Struct("<4sBBBBQI")
PLANE = struct.Struct("<BI")


def bomb(length: int, chunk: int = 1 << 20) -> bytes:
    """A real plain object of ``length`` zero bytes, its chunks zstd'd: ~40 B per MiB."""
    import zstandard

    zeros = zstandard.ZstdCompressor(level=19).compress(bytes(chunk))
    parts = [HEAD.pack(b"GTHO", 1, 1, 0, 0, length, chunk)]
    for _ in range(length // chunk):
        parts += [PLANE.pack(1, len(zeros)), zeros]
    return b"".join(parts)


def test_a_bomb_object_is_refused_before_it_is_allocated() -> None:
    obj = bomb(2 << 30)  # 2 GiB of zeros in about 110 kB
    assert len(obj) < 120_000
    with pytest.raises(codec.LengthError, match="declares 2,147,483,648 bytes, more than the 32"):
        codec.decode(obj, limit=32)
    with pytest.raises(codec.LengthError):
        codec.decode_each(obj, lambda at, chunk: None, limit=32)
    with pytest.raises(codec.LengthError):
        next(codec.decode_stream(io.BytesIO(obj).read, limit=32))


def test_a_length_the_object_cannot_hold_fails_before_allocating() -> None:
    # 1 TiB in one-word chunks: 2^40 chunk headers cannot fit in 30 bytes.
    obj = HEAD.pack(b"GTHO", 1, 1, 0, 0, 1 << 40, 1) + PLANE.pack(0, 1) + b"x"
    with pytest.raises(ObjectCorruptError, match="truncated"):
        codec.decode(obj)


def test_a_plane_longer_than_its_data_is_refused() -> None:
    obj = HEAD.pack(b"GTHO", 1, 1, 0, 0, 4, 1 << 20) + PLANE.pack(1, 100) + bytes(100)
    with pytest.raises(ObjectCorruptError, match="a plane is longer than its data"):
        codec.decode(obj)
    stream = iter([obj[:20], obj[20:25], obj[25:]]).__next__
    with pytest.raises(ObjectCorruptError, match="a plane is longer than its data"):
        list(codec.decode_stream(lambda n: stream()))


def entry_for(store: ObjectStore, dtype: str, shape: tuple[int, ...], obj: bytes) -> TensorEntry:
    ref = store.put([obj])
    return TensorEntry(dtype, shape, "0" * 64, (Link("dense", "gtho1", ref),))


def test_rebuild_refuses_an_object_larger_than_shape_times_dtype(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    entry = entry_for(store, "F32", (8,), bomb(2 << 30))
    oid = entry.chain[0].ref.oid
    with pytest.raises(ObjectCorruptError) as info:
        chains.rebuild("w", entry, store)
    assert str(info.value) == (
        f"tensor 'w': object {oid}: content object declares 2,147,483,648 bytes, "
        "more than the 32 expected"
    )


def test_rebuild_refuses_an_object_shorter_than_the_manifest_says(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    raw = bytes(16)
    entry = entry_for(store, "F32", (8,), b"".join(codec.encode(raw)))
    entry = entry._replace(hash=content_hash(raw))
    oid = entry.chain[0].ref.oid
    with pytest.raises(ObjectCorruptError) as info:
        chains.rebuild("w", entry, store)
    assert str(info.value) == f"tensor 'w': object {oid} gives 16 bytes; the manifest expects 32"


def test_a_manifest_lying_about_an_intact_objects_size_says_so(tmp_path: Path) -> None:
    """The object hashes to its oid, so it is not damaged: the manifest's size is what is
    wrong, and nothing is moved aside (it used to say 'its sha256 does not match')."""
    store = ObjectStore(tmp_path)
    raw = bytes(32)
    entry = entry_for(store, "F32", (8,), b"".join(codec.encode(raw)))
    ref = entry.chain[0].ref
    lying = entry._replace(
        hash=content_hash(raw), chain=(Link("dense", "gtho1", ref._replace(size=ref.size + 1)),)
    )
    with pytest.raises(ObjectCorruptError) as info:
        chains.rebuild("w", lying, store)
    assert str(info.value) == (
        f"tensor 'w': object {ref.oid} has {ref.size:,} bytes; the manifest says "
        f"{ref.size + 1:,}: this version's manifest is wrong (check out another commit, or "
        "add the file again)"
    )
    assert store.has(ref) and not (tmp_path / "theta" / "corrupt").exists()


def test_a_streamed_tensor_is_capped_too(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    # 16 MiB as the manifest says: streamed, in chunks; the object declares 2 GiB.
    entry = entry_for(store, "U8", (16 << 20,), bomb(2 << 30))
    assert chains.streamable(entry)
    with pytest.raises(ObjectCorruptError, match="declares 2,147,483,648 bytes"):
        next(chains.stream("w", entry, store))


def test_an_opaque_dtype_is_capped_by_the_given_limit(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    entry = entry_for(store, "np:str256", (4,), bomb(2 << 30))
    with pytest.raises(ObjectCorruptError, match="more than the 1,000 expected"):
        chains.rebuild("w", entry, store, limit=1000)


def test_a_link_recorded_with_another_codec_is_refused(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    raw = bytes(32)
    entry = entry_for(store, "F32", (8,), b"".join(codec.encode(raw)))
    link = entry.chain[0]._replace(codec="gtsp1")
    entry = entry._replace(hash=content_hash(raw), chain=(link,))
    with pytest.raises(ObjectCorruptError, match="recorded with codec 'gtsp1', but dense"):
        chains.rebuild("w", entry, store)


SPARSE = struct.Struct("<4sBQQ")


def test_a_sparse_count_beyond_the_tensor_is_refused_before_decoding() -> None:
    prev = bytearray(64)  # 16 F32 elements
    positions = b"".join(codec.encode(bytes(8 << 20), codec.Layout(8)))
    payload = SPARSE.pack(b"GTSP", 4, 1 << 20, len(positions)) + positions
    with pytest.raises(ObjectCorruptError, match="1,048,576 4-byte elements does not fit"):
        UPDATES.get("sparse").apply(prev, payload, "F32")


def test_sparse_parts_may_not_declare_more_than_the_count() -> None:
    prev = bytearray(64)
    positions = bomb(1 << 30)
    payload = SPARSE.pack(b"GTSP", 4, 2, len(positions)) + positions + bomb(8, 8)
    with pytest.raises(codec.LengthError, match="more than the 16 expected"):
        UPDATES.get("sparse").apply(prev, payload, "F32")


@pytest.mark.parametrize("payload", [b"", b"GTSP", b"GTSP" + bytes(10)])
def test_a_truncated_sparse_payload_is_corrupt_not_a_crash(payload: bytes) -> None:
    with pytest.raises(ObjectCorruptError):
        UPDATES.get("sparse").apply(bytearray(64), payload, "F32")
    assert UPDATES.get("sparse").summary(payload) == ""


def test_a_delta_longer_than_the_previous_value_is_refused_before_decoding() -> None:
    with pytest.raises(codec.LengthError, match="more than the 64 expected"):
        UPDATES.get("delta").apply(bytearray(64), bomb(1 << 30), "F32")


def factored(header: dict[str, object], *blobs: bytes) -> bytes:
    text = json.dumps(header).encode()
    return b"GTFX" + struct.pack("<I", len(text)) + text + b"".join(blobs)


def low_rank(rows: int, cols: int, rank: int, r_blob: bytes, c_blob: bytes) -> bytes:
    return factored(
        {
            "kind": "low-rank",
            "scale": 1.0,
            "shape": [rows, cols],
            "factors": [
                {"dtype": "F32", "shape": [rows, rank], "size": len(r_blob)},
                {"dtype": "F32", "shape": [rank, cols], "size": len(c_blob)},
            ],
        },
        r_blob,
        c_blob,
    )


def test_low_rank_factors_larger_than_the_tensor_allows_are_refused() -> None:
    prev = bytearray(4 * 4 * 4)  # a 4 x 4 F32 tensor
    # rank 1 << 20: a million times the useful rank, a hostile number of multiplies
    payload = low_rank(4, 4, 1 << 20, bomb(16 << 20), bomb(16 << 20))
    with pytest.raises(ObjectCorruptError, match="factors do not fit the tensor"):
        UPDATES.get("low-rank").apply(prev, payload, "F32")


def test_a_factor_declaring_more_than_its_shape_is_refused() -> None:
    prev = bytearray(4 * 4 * 4)
    payload = low_rank(4, 4, 2, bomb(1 << 30), b"".join(codec.encode(bytes(32))))
    with pytest.raises(codec.LengthError, match="more than the 32 expected"):
        UPDATES.get("low-rank").apply(prev, payload, "F32")


@pytest.mark.parametrize(
    "payload",
    [
        b"GTFX",
        b"GTFX" + struct.pack("<I", 1 << 31),
        factored({"kind": "ia3"}),
        b"GTFX" + struct.pack("<I", 4000) + b"[" * 4000,
        factored({"kind": "low-rank", "scale": 1.0, "shape": [4, -4], "factors": []}),
        factored({"kind": "low-rank", "scale": 1.0, "shape": [4, 4.0], "factors": []}),
        factored({"kind": "low-rank", "scale": "x", "shape": [4, 4], "factors": []}),
    ],
)
def test_a_malformed_factored_payload_is_corrupt_not_a_crash(payload: bytes) -> None:
    with pytest.raises(ObjectCorruptError):
        UPDATES.get("low-rank").apply(bytearray(64), payload, "F32")
    assert UPDATES.get("low-rank").summary(payload) == ""


def test_factored_payloads_the_writer_makes_still_apply() -> None:
    import numpy as np

    from git_theta.updates.factored import Factor, Inputs, LowRank

    rng = np.random.default_rng(3)
    prev = rng.standard_normal((6, 5)).astype(np.float32)
    r = rng.standard_normal((6, 2)).astype(np.float32)
    c = rng.standard_normal((2, 5)).astype(np.float32)
    new = (prev + r @ c).astype(np.float32)
    plugin = LowRank({"w": Inputs("low-rank", (Factor("F32", (6, 2), r.tobytes()),
                                               Factor("F32", (2, 5), c.tobytes())))})  # fmt: skip
    key, parts = plugin.pick(new.tobytes(), prev.tobytes(), "F32", lambda: [], None, "w", (6, 5))
    assert key == "low-rank" and parts is not None
    payload = b"".join(parts)
    out = plugin.apply(bytearray(prev.tobytes()), payload, "F32", limit=120)
    assert bytes(out) == new.tobytes()
    assert plugin.summary(payload, 120).startswith("low-rank update: rank 2")
    assert layout_for("F32").word == 4
