"""Write the golden object and manifest fixtures (kept for the record; see README.md).

Fixtures are append-only: this script only ever writes fixtures that do not exist yet and
leaves every existing file alone, so running it again changes nothing. To pin a new kind
of object, add a recipe under a new name and run it; never edit or delete an old one.

    .venv/bin/python tests/golden/make_fixtures.py
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).parent
OBJECTS = HERE / "objects"
MANIFESTS = HERE / "manifests"
sys.path.insert(0, str(HERE.parent))

from st_files import st_bytes  # noqa: E402

from git_theta import codec  # noqa: E402
from git_theta.clean import clean  # noqa: E402
from git_theta.manifest import parse  # noqa: E402
from git_theta.store import ObjectStore  # noqa: E402
from git_theta.updates import UPDATES  # noqa: E402
from git_theta.updates.factored import IA3, Factor, Inputs, LowRank  # noqa: E402

Json = dict[str, Any]


def sha256(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def methods(obj: bytes) -> list[list[int]]:
    """Per chunk, per plane: the method byte of a GTHO object."""
    _, _, word, _, _, length, chunk_words = struct.unpack_from("<4sBBBBQI", obj)
    pos, out = struct.calcsize("<4sBBBBQI"), []
    for _ in range(0, length, chunk_words * word):
        row = []
        for _ in range(word):
            method, n = struct.unpack_from("<BI", obj, pos)
            row.append(method)
            pos += 5 + n
        out.append(row)
    return out


# ---------------------------------------------------------------- content objects

rng = np.random.default_rng(20260113)


def normal(n: int, scale: float = 0.02) -> np.ndarray:
    return rng.standard_normal(n) * scale


def bf16(values: np.ndarray) -> bytes:
    """Round-to-nearest-even BF16 bits of ``values``."""
    bits = values.astype("<f4").view("<u4")
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


def geometric_bytes(n: int) -> bytes:
    """Skewed but unrepeating bytes (entropy ~2-3 bits): what the Huffman method is for."""
    return np.minimum(rng.geometric(0.3, n) - 1, 255).astype(np.uint8).tobytes()


def cycle_bytes(n: int) -> bytes:
    """251 byte values in turn: ~8 bits of order-0 entropy (a prime period, so the method's
    evenly spaced sample sees them all), yet zstd packs it to almost nothing."""
    return (bytes(range(251)) * (n // 251 + 1))[:n]


def value(dtype: str, raw: bytes, note: str, shape: list[int] | None = None) -> Json:
    return {"kind": "value", "dtype": dtype, "raw": raw, "note": note, "shape": shape}


def f32_bf16_derived(n: int) -> bytes:
    """F32 values that are BF16 values widened: two zero mantissa bytes (zstd), an
    exponent byte (Huffman) and a full-entropy mantissa byte (raw)."""
    wide = np.frombuffer(bf16(normal(n)), "<u2").astype("<u4") << 16
    low = rng.integers(0, 256, n, dtype=np.uint32) << 16  # re-randomise one mantissa byte
    return (wide | low).astype("<u4").tobytes()


def value_recipes() -> dict[str, Json]:
    big_u8 = cycle_bytes(codec.CHUNK_WORDS) + geometric_bytes(4096)
    # A first chunk whose planes both repeat (zstd), then a short one of real values.
    pattern = np.arange(codec.CHUNK_WORDS, dtype="<u4") % 251 * 257
    big_bf16 = pattern.astype("<u2").tobytes() + bf16(normal(3000))
    return {
        "u8-zstd": value("U8", cycle_bytes(4096), "word 1, one zstd plane"),
        "u8-huffman": value("U8", geometric_bytes(4096), "word 1, one Huffman plane"),
        "u8-raw": value("U8", rng.bytes(4096), "word 1, random: kept raw"),
        "i8-tiny": value("I8", rng.bytes(40), "under 64 bytes: raw whatever it holds"),
        "bool-flags": value("BOOL", bytes([1, 0, 1, 1, 0]), "word 1, five bytes"),
        "f16-empty": value("F16", b"", "no elements: a header and no chunk", [0, 3]),
        "bf16-planes": value("BF16", bf16(normal(2048)), "word 2 rotated"),
        "f16-planes": value("F16", normal(2048).astype("<f2").tobytes(), "word 2 rotated"),
        "i16-planes": value(
            "I16", rng.integers(-300, 300, 2048).astype("<i2").tobytes(), "word 2, not rotated"
        ),
        "f32-planes": value(
            "F32", f32_bf16_derived(2048), "word 4 rotated: raw, zstd and Huffman planes"
        ),
        "i32-planes": value(
            "I32", rng.integers(-5000, 5000, 1024).astype("<i4").tobytes(), "word 4, not rotated"
        ),
        "f64-planes": value("F64", normal(1024).astype("<f8").tobytes(), "word 8 rotated"),
        "i64-planes": value(
            "I64", rng.integers(-(10**6), 10**6, 512).astype("<i8").tobytes(), "word 8"
        ),
        "u8-multichunk": value(
            "U8", big_u8, "two chunks of 1 Mi words: a zstd chunk, then a short Huffman one"
        ),
        "bf16-multichunk": value("BF16", big_bf16, "two chunks of 1 Mi words, word 2"),
        "f32-small-chunks": {
            **value("F32", normal(1000).astype("<f4").tobytes(), "4 chunks of 256 words"),
            "chunk_words": 256,
        },
        "odd-length-plain": {
            "kind": "value",
            "raw": normal(1025).astype("<f4").tobytes()[:4097],
            "layout": [4, True],
            "note": "asked for word 4, not whole words: stored as plain bytes",
        },
        "glue-safetensors-header": {
            "kind": "value",
            "raw": st_header(64),
            "level": 9,
            "note": "glue as clean stores it (plain bytes, level 9)",
        },
        "glue-zero-padded": {
            "kind": "value",
            "raw": st_header(4) + bytes(8192),
            "level": 9,
            "note": "glue that is mostly padding: zstd at level 9",
        },
    }


def st_header(count: int) -> bytes:
    raw = st_bytes({f"layer.{i}.weight": ("F32", (4, 4), bytes(64)) for i in range(count)})
    (n,) = struct.unpack_from("<Q", raw)
    return raw[: 8 + n]


def update_recipes(values: dict[str, Json]) -> dict[str, Json]:
    """Updates on base values (which are value fixtures of their own)."""
    f32 = normal(16 * 12).astype("<f4")
    values["f32-base-16x12"] = value("F32", f32.tobytes(), "a base for updates", [16, 12])
    b16 = bf16(normal(16 * 12))
    values["bf16-base-16x12"] = value("BF16", b16, "a base for updates", [16, 12])
    f16 = normal(8 * 24).astype("<f2")
    values["f16-base-8x24"] = value("F16", f16.tobytes(), "a base for updates", [8, 24])
    i64 = rng.integers(-100, 100, 64).astype("<i8")
    values["i64-base"] = value("I64", i64.tobytes(), "a base for updates", [64])
    u8 = rng.bytes(300)
    values["u8-base"] = value("U8", u8, "a base for updates", [300])

    def changed(base: np.ndarray, where: list[int], to: list[float]) -> bytes:
        out = base.copy()
        out[where] = to
        return out.tobytes()

    sparse_f32 = f32.copy()
    sparse_f32[[0, 5, 77, 191]] = [np.float32(-0.0), np.float32(1.5), np.nan, np.float32(1e-30)]
    nan_payload = sparse_f32.view("<u4")
    nan_payload[77] = 0x7FC01234  # a NaN with a payload: kept bit for bit
    b16_arr = np.frombuffer(b16, "<u2").copy()
    b16_arr[[3, 4, 100]] ^= 0x8001
    delta_f32 = (f32 * (1 + normal(f32.size, 1e-3))).astype("<f4")
    u8_new = bytearray(u8)
    for i in range(0, 300, 3):
        u8_new[i] = (u8_new[i] + 1) % 256

    ups: dict[str, Json] = {
        "sparse-f32": {"update": "sparse", "prev": "f32-base-16x12", "new": nan_payload.tobytes()},
        "sparse-bf16": {"update": "sparse", "prev": "bf16-base-16x12", "new": b16_arr.tobytes()},
        "sparse-i64": {"update": "sparse", "prev": "i64-base", "new": changed(i64, [9], [-1])},
        "delta-f32": {"update": "delta", "prev": "f32-base-16x12", "new": delta_f32.tobytes()},
        "delta-u8": {"update": "delta", "prev": "u8-base", "new": bytes(u8_new)},
    }
    # Factors: the new value is what they reproduce, plus a few elements set by hand, so
    # the stored correction is not all zeros.
    r = normal(16 * 2, 1.0).astype("<f4").reshape(16, 2)
    c = normal(2 * 12, 1.0).astype("<f4").reshape(2, 12)
    pair = (Factor("F32", (16, 2), r.tobytes()), Factor("F32", (2, 12), c.tobytes()))
    lr = Inputs("low-rank", pair, 0.5)
    col = (1 + normal(12, 0.1)).astype("<f4")
    ia3_cols = Inputs("ia3", (Factor("F32", (12,), col.tobytes()),))
    row = (1 + normal(8, 0.1)).astype("<f2")
    ia3_rows = Inputs("ia3", (Factor("F16", (8,), row.tobytes()),))
    r16 = bf16(normal(16 * 3, 1.0))
    c16 = bf16(normal(3 * 12, 1.0))
    lr16 = Inputs("low-rank", (Factor("BF16", (16, 3), r16), Factor("BF16", (3, 12), c16)), 1.0)
    from git_theta.updates.factored import reproduce

    for name, key, base, dtype, shape, inputs in (
        ("low-rank-f32", "low-rank", "f32-base-16x12", "F32", (16, 12), lr),
        ("low-rank-bf16", "low-rank", "bf16-base-16x12", "BF16", (16, 12), lr16),
        ("ia3-f32-cols", "ia3", "f32-base-16x12", "F32", (16, 12), ia3_cols),
        ("ia3-f16-rows", "ia3", "f16-base-8x24", "F16", (8, 24), ia3_rows),
    ):
        guess = reproduce(values[base]["raw"], dtype, shape, inputs)
        assert guess is not None
        new = bytearray(guess)
        new[0] ^= 1
        new[-1] ^= 4
        ups[name] = {"update": key, "prev": base, "new": bytes(new), "inputs": inputs}
    # A delta with planes grouped by the old exponent (method bit 7): an Adam-like step,
    # about the same size for every weight. Its own generator: the draws above stay put.
    adam = np.random.default_rng(20261201)
    old = (adam.standard_normal(64 * 128) * 0.02).astype("<f4")
    old[:1024] += 1  # layer-norm-like weights: another exponent
    step = 6e-5 * adam.uniform(0.5, 1.5, old.size) * adam.choice([-1.0, 1.0], old.size)
    values["f32-base-64x128"] = value("F32", old.tobytes(), "a base for updates", [64, 128])
    ups["delta-f32-grouped"] = {
        "update": "delta",
        "prev": "f32-base-64x128",
        "new": (old + step).astype("<f4").tobytes(),
    }
    # The same delta as codec writes it since grouped planes mark the object version 3
    # (delta-f32-grouped above was written as version 1, before that).
    ups["delta-f32-grouped-v3"] = dict(ups["delta-f32-grouped"])
    return ups


def encode_value(recipe: Json) -> bytes:
    from git_theta.updates.layout import layout_for

    layout = codec.Layout(*recipe["layout"]) if "layout" in recipe else None
    if "dtype" in recipe:
        layout = layout_for(recipe["dtype"])
    saved = codec.CHUNK_WORDS
    codec.CHUNK_WORDS = recipe.get("chunk_words", saved)
    try:
        return b"".join(codec.encode(recipe["raw"], layout or codec.PLAIN, recipe.get("level", 1)))
    finally:
        codec.CHUNK_WORDS = saved


def encode_update(recipe: Json, prev: bytes, dtype: str, shape: list[int]) -> bytes:
    new = recipe["new"]
    plugin = UPDATES.get(recipe["update"])
    if "inputs" in recipe:
        plugin = (LowRank if recipe["update"] == "low-rank" else IA3)({"t": recipe["inputs"]})
    dense = UPDATES.get("dense")
    key, parts = plugin.pick(
        new, prev, dtype, lambda: dense.encode(new, None, dtype) or [], None, "t", tuple(shape)
    )
    assert key == recipe["update"] and parts is not None, (key, recipe["update"])
    return b"".join(parts)


def write_new(path: Path, data: bytes) -> bool:
    """Write ``data`` at ``path`` unless it exists (fixtures are never rewritten)."""
    try:
        with open(path, "xb") as fh:
            fh.write(data)
    except FileExistsError:
        return False
    return True


def dump(meta: Json) -> bytes:
    return (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode()


def make_objects() -> None:
    OBJECTS.mkdir(exist_ok=True)
    values = value_recipes()
    updates = update_recipes(values)
    for name, recipe in values.items():
        obj = encode_value(recipe)
        meta: Json = {
            "kind": "value",
            "note": recipe["note"],
            "object_sha256": sha256(obj),
            "raw_sha256": sha256(recipe["raw"]),
            "raw_size": len(recipe["raw"]),
            "methods": methods(obj),
            "encode": {
                "dtype": recipe.get("dtype"),
                "layout": recipe.get("layout"),
                "level": recipe.get("level", 1),
                "chunk_words": recipe.get("chunk_words", codec.CHUNK_WORDS),
            },
        }
        if recipe.get("shape") is not None:
            meta["shape"] = recipe["shape"]
        report(name, write_new(OBJECTS / f"{name}.gtho", obj))
        write_new(OBJECTS / f"{name}.json", dump(meta))
    for name, recipe in updates.items():
        base = values[recipe["prev"]]
        shape = base.get("shape") or [len(base["raw"])]
        payload = encode_update(recipe, base["raw"], base["dtype"], shape)
        applied = UPDATES.get(recipe["update"]).apply(
            bytearray(base["raw"]), payload, base["dtype"]
        )
        assert bytes(applied) == recipe["new"], name
        meta = {
            "kind": "update",
            "update": recipe["update"],
            "codec": UPDATES.get(recipe["update"]).codec,
            "dtype": base["dtype"],
            "shape": shape,
            "prev": recipe["prev"],
            "object_sha256": sha256(payload),
            "new_sha256": sha256(recipe["new"]),
        }
        report(name, write_new(OBJECTS / f"{name}.gtho", payload))
        write_new(OBJECTS / f"{name}.json", dump(meta))


def report(name: str, written: bool) -> None:
    print(f"{'wrote' if written else 'kept '} {name}")


# ---------------------------------------------------------------- manifests


def ckpt_safetensors() -> bytes:
    w = normal(32).astype("<f4")
    return st_bytes(
        {
            "w": ("F32", (4, 8), w.tobytes()),
            "e": ("BF16", (8, 4), bf16(normal(32))),
            "n": ("I64", (3,), np.array([1, -2, 3], "<i8").tobytes()),
            "z": ("F16", (0,), b""),
        },
        metadata={"format": "pt", "b": "2", "a": "1"},
    )


def ckpt_npy() -> bytes:
    out = io.BytesIO()
    np.save(out, normal(24).astype("<f4").reshape(4, 6))
    return out.getvalue()


def ckpt_npz() -> bytes:
    out = io.BytesIO()
    np.savez(out, w=normal(12).astype("<f4"), i=np.arange(5, dtype="<i2"), f=np.ones(3, bool))
    return out.getvalue()


def ckpt_torch() -> bytes:
    import torch

    gen = torch.Generator().manual_seed(7)
    state = {
        "layer.weight": torch.randn(6, 4, generator=gen),
        "layer.bias": torch.zeros(6, dtype=torch.bfloat16),
        "steps": torch.tensor([3], dtype=torch.int64),
    }
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


def ckpt_gguf(tmp: Path) -> bytes:
    import gguf

    path = tmp / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "golden")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>"])
    writer.add_tensor("tok_embd.weight", normal(8 * 16).astype(np.float32).reshape(8, 16))
    writer.add_tensor("blk.0.attn_q.weight", normal(16 * 16).astype(np.float16).reshape(16, 16))
    blocks = rng.integers(0, 256, (4, 34), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def ckpt_flax() -> bytes:
    from flax import serialization

    state = {
        "params": {"Dense_0": {"kernel": normal(8 * 4).astype("<f4").reshape(8, 4),
                               "bias": np.zeros(4, "<f2")}},
        "step": 7,
        "name": "golden",
    }  # fmt: skip
    return serialization.to_bytes(state)


def ckpt_hdf5(tmp: Path) -> bytes:
    import h5py

    path = tmp / "m.h5"
    with h5py.File(path, "w", track_order=True) as f:
        f["dense/kernel"] = normal(8 * 4).astype("<f4").reshape(8, 4)
        f["dense/bias"] = np.arange(4, dtype="<f8")
        f.attrs["name"] = "golden"
    return path.read_bytes()


def chain_versions() -> tuple[bytes, bytes, bytes, bytes]:
    """Three versions of one file whose tensors take every update type, and the factors
    file that the low-rank and ia3 updates of the second version read."""
    from git_theta.updates.factored import reproduce

    shape = (32, 32)
    base = {n: normal(32 * 32).astype("<f4") for n in "abcde"}
    r = normal(32 * 2, 0.1).astype("<f4").reshape(32, 2)
    c = normal(2 * 32, 0.1).astype("<f4").reshape(2, 32)
    scales = (1 + normal(32, 0.05)).astype("<f4")
    lr = Inputs(
        "low-rank", (Factor("F32", (32, 2), r.tobytes()), Factor("F32", (2, 32), c.tobytes()))
    )
    ia3 = Inputs("ia3", (Factor("F32", (32,), scales.tobytes()),))
    v2 = {n: a.copy() for n, a in base.items()}
    v2["a"][[1, 100, 1000]] = [0.5, -0.0, 2.0]  # sparse
    v2["b"] = (base["b"] * (1 + normal(1024, 1e-3))).astype("<f4")  # delta
    lr_new = reproduce(base["c"].tobytes(), "F32", shape, lr)
    ia3_new = reproduce(base["d"].tobytes(), "F32", shape, ia3)
    assert lr_new is not None and ia3_new is not None
    v2["c"] = np.frombuffer(lr_new, "<f4").copy()
    v2["d"] = np.frombuffer(ia3_new, "<f4").copy()
    v3 = {n: a.copy() for n, a in v2.items()}
    v3["a"] = (v2["a"] * (1 + normal(1024, 1e-3))).astype("<f4")  # a delta on the sparse

    def file(arrays: dict[str, np.ndarray]) -> bytes:
        return st_bytes({f"{n}.weight": ("F32", shape, a.tobytes()) for n, a in arrays.items()})

    factors = st_bytes(
        {
            "c.weight/R": ("F32", (32, 2), r.tobytes()),
            "c.weight/C": ("F32", (2, 32), c.tobytes()),
            "d.weight/ia3": ("F32", (32,), scales.tobytes()),
        }
    )
    return file(base), file(v2), file(v3), factors


CHAIN_UPDATES = {
    "chains-v2": {"a.weight": "sparse", "b.weight": "delta", "c.weight": "low-rank",
                  "d.weight": "ia3"},
    "chains-v3": {"a.weight": "delta"},
    # chains-v2 as clean writes it since factors are operand links (manifest version 3)
    "linked-v2": {"a.weight": "sparse", "b.weight": "delta", "c.weight": "low-rank",
                  "d.weight": "ia3"},
}  # fmt: skip


def update_for(name: str, factors: Path) -> Callable[[str], Any]:
    wanted = CHAIN_UPDATES.get(name, {})

    def pick(tensor: str) -> Any:
        key = wanted.get(tensor, "auto")
        if key in ("low-rank", "ia3"):
            return UPDATES.get(key).with_inputs(str(factors))
        return key

    return pick


def make_manifests(tmp: Path) -> None:
    MANIFESTS.mkdir(exist_ok=True)
    store = ObjectStore(MANIFESTS / "lfs")
    v1, v2, v3, factors = chain_versions()
    factors_path = MANIFESTS / "chains-factors.safetensors"
    write_new(factors_path, factors)
    recipes: dict[str, tuple[str, Callable[[], bytes], str | None]] = {
        "safetensors": ("model.safetensors", ckpt_safetensors, None),
        "npy": ("w.npy", ckpt_npy, None),
        "npz": ("w.npz", ckpt_npz, None),
        "torch": ("model.pt", ckpt_torch, None),
        "gguf": ("model.gguf", lambda: ckpt_gguf(tmp), None),
        "flax": ("model.msgpack", ckpt_flax, None),
        "hdf5": ("model.weights.h5", lambda: ckpt_hdf5(tmp), None),
        "chains-v1": ("chains.safetensors", lambda: v1, None),
        "chains-v2": ("chains.safetensors", lambda: v2, "chains-v1"),
        "chains-v3": ("chains.safetensors", lambda: v3, "chains-v2"),
        "linked-v2": ("chains.safetensors", lambda: v2, "chains-v1"),
    }
    for name, (path, make, previous) in recipes.items():
        if (MANIFESTS / f"{name}.manifest").exists():
            report(name, False)
            continue
        data = make()
        prev = parse((MANIFESTS / f"{previous}.manifest").read_bytes()) if previous else None
        out = io.BytesIO()
        clean(io.BytesIO(data), out, path, store, prev, False, update_for(name, factors_path))
        meta: Json = {
            "path": path,
            "checkpoint_sha256": sha256(data),
            "checkpoint_size": len(data),
            "previous": previous,
            "updates": CHAIN_UPDATES.get(name, {}),
            "factors": factors_path.name if name in CHAIN_UPDATES else None,
        }
        report(name, write_new(MANIFESTS / f"{name}.manifest", out.getvalue()))
        write_new(MANIFESTS / f"{name}.json", dump(meta))
    theta = MANIFESTS / "lfs" / "theta"  # clean writes to LFS_DIR/theta/objects
    if theta.exists():  # the fixtures keep git-lfs's layout (objects/aa/bb/OID)
        for obj in (theta / "objects").rglob("*"):
            dest = MANIFESTS / "lfs" / "objects" / obj.name[:2] / obj.name[2:4] / obj.name
            if obj.is_file() and not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(obj, dest)
        shutil.rmtree(theta)
    tmpdir = MANIFESTS / "lfs" / "tmp"
    if tmpdir.exists():
        for leftover in tmpdir.iterdir():
            leftover.unlink()
        tmpdir.rmdir()


def make_future() -> None:
    """An object and a manifest as a newer git-theta would write them: version 2."""
    obj = (OBJECTS / "u8-zstd.gtho").read_bytes()
    future = obj[:4] + bytes([2]) + obj[5:]
    if write_new(OBJECTS / "future-version.gtho", future):
        note = "u8-zstd with version byte 2: a newer git-theta wrote it"
        meta = {"kind": "future", "note": note, "object_sha256": sha256(future), "error": "newer"}
        write_new(OBJECTS / "future-version.json", dump(meta))
    manifest = (MANIFESTS / "safetensors.manifest").read_bytes()
    if write_new(
        MANIFESTS / "future-version.manifest",
        manifest.replace(b'"git-theta": 1,', b'"git-theta": 2,', 1),
    ):
        note = 'safetensors.manifest with "git-theta": 2: a newer git-theta wrote it'
        write_new(
            MANIFESTS / "future-version.json",
            dump({"kind": "future", "note": note, "error": "newer"}),
        )


if __name__ == "__main__":
    import tempfile

    os.environ.setdefault("KERAS_BACKEND", "jax")
    make_objects()
    with tempfile.TemporaryDirectory() as scratch:
        make_manifests(Path(scratch))
    make_future()
