"""Hostile cases, generated deterministically from (seed, index): a case is a small spec
(format, kind, number) that ``build`` turns into bytes in the worker that runs it.

Kinds, for every format:
- ``truncate``: the file cut at a point, mostly inside its header;
- ``flip``: 1-8 bits flipped, mostly inside the header;
- ``field``: one length, count or offset field the format's parser reads (found by
  walking the sample's structure) set to an edge value (0, max, 2^31, size+1...);
- ``splice``: bytes inserted into or deleted from the header region;
- ``structure``: a file written from scratch to break one rule (lying shapes, huge
  claims, deep nesting, shared memo pickles, many entries...), see ``STRUCTURE``.
``manifest`` cases clean a good sample, then hand smudge a mutated manifest.
"""

from __future__ import annotations

import json
import pickletools
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hostile import files as F

FORMATS = ("safetensors", "npy", "npz", "torch", "gguf", "flax", "hdf5")
EXTENSION = {
    "safetensors": "safetensors", "npy": "npy", "npz": "npz", "torch": "pt", "gguf": "gguf",
    "flax": "msgpack", "hdf5": "h5", "manifest": "safetensors",
}  # fmt: skip
KINDS = ("truncate", "flip", "field", "splice", "structure")
# Share of the cases per format: hdf5 runs h5py in a child per case (~0.3 s), so it gets
# fewer; manifests are someone else's validator's to test in depth.
WEIGHTS = {
    "safetensors": 15, "npy": 13, "npz": 12, "torch": 16, "gguf": 14, "flax": 12,
    "hdf5": 6, "manifest": 12,
}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    id: str  # "<format>/<kind>/<n>"
    fmt: str
    kind: str
    seed: int


@dataclass
class Built:
    name: str  # the path clean is told (detection is by content)
    data: bytes  # the checkpoint, or for manifest cases the manifest
    prepare: bytes | None = None  # manifest cases: the checkpoint cleaned into the store first


def defect(name: str) -> Spec:
    """The spec of the reproduced defect ``name`` (a key of files.DEFECTS)."""
    return Spec(f"defect/{name}", F.DEFECTS[name][0].rsplit(".", 1)[1], "defect", 0)


def plan(count: int, seed: int = 0) -> list[Spec]:
    """Return ``count`` specs spread over formats by WEIGHTS and evenly over kinds."""
    total = sum(WEIGHTS.values())
    specs = []
    for fmt, weight in WEIGHTS.items():
        n = max(len(KINDS), round(count * weight / total))
        kinds = ("truncate", "flip", "field", "manifest") if fmt == "manifest" else KINDS
        for i in range(n):
            kind = kinds[i % len(kinds)]
            specs.append(Spec(f"{fmt}/{kind}/{i}", fmt, kind, seed * 1_000_003 + i))
    random.Random(seed).shuffle(specs)  # mix slow and fast formats across workers
    return specs


def build(spec: Spec, samples: dict[str, list[bytes]]) -> Built:
    """Return the case ``spec`` describes (``samples``: good files per format)."""
    if spec.kind == "defect":  # id "defect/<name>": one of the reproduced defects
        path, maker = F.DEFECTS[spec.id.split("/", 1)[1]]
        return Built(path, maker())
    rng = random.Random(f"{spec.id}/{spec.seed}")
    name = f"m.{EXTENSION[spec.fmt]}"
    if spec.fmt == "manifest":
        return Built(name, b"", prepare=rng.choice(samples["safetensors"]))  # see mutate_manifest
    if spec.kind == "structure":
        builders = STRUCTURE[spec.fmt]
        maker = builders[spec.seed % len(builders)]
        return Built(name, maker(rng))
    data = bytearray(rng.choice(samples[spec.fmt]))
    head = _header_end(spec.fmt, bytes(data))
    if spec.kind == "truncate":
        cut = rng.randrange(head) if rng.random() < 0.7 else rng.randrange(len(data))
        del data[cut:]
    elif spec.kind == "flip":
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(head) if rng.random() < 0.8 else rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
    elif spec.kind == "field" and spec.fmt in VALUES and rng.random() < 0.5:
        return Built(name, VALUES[spec.fmt](bytes(data), rng))
    elif spec.kind == "field":
        fields = FIELDS[spec.fmt](bytes(data))
        for _ in range(1 if rng.random() < 0.8 else 2):
            at, width, order = rng.choice(fields)
            _set_field(data, at, width, order, rng)
    elif spec.kind == "splice":
        at = rng.randrange(head)
        if rng.random() < 0.5:
            del data[at : at + rng.randint(1, 16)]
        else:
            data[at:at] = rng.choice([b"\0", b"\xff" * 8, b"[", b"{", b"(", b"\x90", b"PK"])
    return Built(name, bytes(data))


def mutate_manifest(manifest: bytes, spec: Spec) -> bytes:
    """A hostile variant of a real ``manifest`` (the store holds its objects)."""
    rng = random.Random(f"{spec.id}/{spec.seed}")
    data = bytearray(manifest)
    if spec.kind == "truncate":
        return bytes(data[: rng.randrange(len(data))])
    if spec.kind == "flip":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    raw = json.loads(manifest)
    if spec.kind == "field":
        paths = list(_json_paths(raw))
        path = rng.choice(paths)
        _json_set(raw, path, rng.choice(_HOSTILE_JSON))
    else:  # a hand-made lie
        lie = rng.randrange(8)
        tensor = next(iter(raw["tensors"].values()))
        if lie == 0:
            raw["tensors"] = []
        elif lie == 1:
            tensor["chain"][0]["oid"] = "/dev/zero".ljust(64, "/")
        elif lie == 2:
            tensor["shape"] = [10**12]
        elif lie == 3:
            raw["layout"] = [-5, *raw["layout"][1:]]
        elif lie == 4:
            raw["size"] = 1 << 60
        elif lie == 5:
            tensor["chain"] = tensor["chain"] * 1000
        elif lie == 6:
            raw["glue"]["size"] = -1
        else:
            tensor["dtype"] = "F64"
    text = json.dumps(raw, indent=1).encode()
    return text if text.startswith(b'{\n "git-theta"') else b'{\n "git-theta": 1,' + text[1:]


_HOSTILE_JSON: list[Any] = [
    -1, 0, 2**63, 2**64 + 1, 1.5, True, None, "", "x" * 100, [], {}, [[[[[]]]]],
    "0" * 64, "../../etc/passwd", "\x1b[31m", 10**30,
]  # fmt: skip


def _json_paths(value: Any, path: tuple[Any, ...] = ()) -> Any:
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*path, k)
            yield from _json_paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield (*path, i)
            yield from _json_paths(v, (*path, i))


def _json_set(root: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


# --- fields a parser reads (offset, width, byte order) --------------------------------

Field = tuple[int, int, str]


def _set_field(data: bytearray, at: int, width: int, order: str, rng: random.Random) -> None:
    if at + width > len(data):
        return
    fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[width]
    code = ("<" if order == "little" else ">") + fmt
    (old,) = struct.unpack_from(code, data, at)
    top = (1 << (8 * width)) - 1
    value = rng.choice(
        [0, 1, 2, 7, 255, 256, top, top - 1, top >> 1, (top >> 1) + 1, old + 1, old - 1,
         old * 2, old + 4096, len(data), len(data) + 1, len(data) // 2, rng.randrange(top + 1)]
    )  # fmt: skip
    struct.pack_into(code, data, at, value & top)


def _safetensors_fields(data: bytes) -> list[Field]:
    fields: list[Field] = [(0, 8, "little")]
    (size,) = struct.unpack_from("<Q", data)
    # Digits in the JSON header: overwrite a digit run's first bytes as a number field.
    text = data[8 : 8 + size]
    fields += [(8 + i, 1, "little") for i, c in enumerate(text) if c in b'0123456789[]{}":,']
    return fields


def _npy_fields(data: bytes) -> list[Field]:
    width = 2 if data[6] == 1 else 4
    fields: list[Field] = [(6, 1, "little"), (8, width, "little")]
    (size,) = struct.unpack_from("<H" if width == 2 else "<I", data, 8)
    text = data[8 + width : 8 + width + size]
    fields += [(8 + width + i, 1, "little") for i, c in enumerate(text) if c in b"0123456789(),'<|"]
    return fields


def _zip_fields(data: bytes) -> list[Field]:
    fields: list[Field] = []
    for sig, offsets in (
        (b"PK\x03\x04", ((8, 2), (18, 4), (22, 4), (26, 2), (28, 2))),
        (b"PK\x01\x02", ((10, 2), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (42, 4))),
        (b"PK\x05\x06", ((8, 2), (10, 2), (12, 4), (16, 4), (20, 2))),
        (b"PK\x06\x06", ((24, 8), (32, 8), (40, 8), (48, 8))),
        (b"PK\x06\x07", ((8, 8),)),
    ):
        at = data.find(sig)
        while at >= 0:
            fields += [(at + o, w, "little") for o, w in offsets]
            at = data.find(sig, at + 1)
    return fields or [(0, 4, "little")]


def _torch_fields(data: bytes) -> list[Field]:
    fields = _zip_fields(data)
    start = data.find(b"data.pkl")
    if start >= 0:
        # The local header's name is followed by its extra field, then the pickle.
        header = data.rfind(b"PK\x03\x04", 0, start)
        n_name, n_extra = struct.unpack_from("<HH", data, header + 26)
        begin = header + 30 + n_name + n_extra
        prefixed = {"BINUNICODE": 4, "BINBYTES": 4, "SHORT_BINUNICODE": 1,
                    "SHORT_BINBYTES": 1, "SHORT_BINSTRING": 1, "LONG1": 1}  # fmt: skip
        try:
            for op, _arg, pos in pickletools.genops(data[begin:]):
                fields.append((begin + pos, 1, "little"))  # the opcode itself
                if op.arg is not None and op.arg.n in (1, 2, 4, 8):
                    fields.append((begin + pos + 1, op.arg.n, "little"))
                elif op.name in prefixed:
                    fields.append((begin + pos + 1, prefixed[op.name], "little"))
        except (ValueError, struct.error):
            pass
    return fields


def _gguf_fields(data: bytes) -> list[Field]:
    """Every count, length, type and offset in a GGUF header, found by walking it."""
    fields: list[Field] = [(4, 4, "little"), (8, 8, "little"), (16, 8, "little")]
    pos = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def u(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return int(value)

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8, "little"))
        pos += u("<Q")

    def value(kind: int) -> None:
        nonlocal pos
        if kind in sizes:
            pos += sizes[kind]
        elif kind == 8:
            string()
        elif kind == 9:
            fields.append((pos, 4, "little"))
            fields.append((pos + 4, 8, "little"))
            inner, count = u("<I"), u("<Q")
            if inner in sizes:
                pos += sizes[inner] * count
            else:
                for _ in range(min(count, 64)):
                    value(inner)
                if count > 64:
                    raise ValueError("long array")  # fields after it are not needed

    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
        for _ in range(n_kv):
            string()
            fields.append((pos, 4, "little"))
            value(u("<I"))
        for _ in range(n_tensors):
            string()
            fields.append((pos, 4, "little"))
            n_dims = u("<I")
            fields += [(pos + 8 * i, 8, "little") for i in range(n_dims)]
            pos += 8 * n_dims
            fields += [(pos, 4, "little"), (pos + 4, 8, "little")]
            pos += 12
    except (ValueError, struct.error):
        pass
    return fields


def _flax_fields(data: bytes) -> list[Field]:
    """Every marker, length and count in the msgpack structure (its first 4 KB)."""
    fields: list[Field] = []
    pos = 0
    lengths = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
    counts = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
    scalars = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
    while pos < min(len(data), 4096):
        m = data[pos]
        fields.append((pos, 1, "big"))
        if m in lengths:
            w = lengths[m]
            fields.append((pos + 1, w, "big"))
            n = int.from_bytes(data[pos + 1 : pos + 1 + w], "big")
            extra = 1 if m >= 0xC7 and m <= 0xC9 else 0
            # Step over bin/str payloads but into ext payloads (the array's structure).
            pos += 1 + w + extra + (0 if extra else n)
        elif m in counts:
            fields.append((pos + 1, counts[m], "big"))
            pos += 1 + counts[m]
        elif m in scalars:
            fields.append((pos + 1, scalars[m], "big"))
            pos += 1 + scalars[m]
        elif 0xA0 <= m <= 0xBF:
            pos += 1 + (m & 0x1F)
        elif 0xD4 <= m <= 0xD8:
            pos += 2
        else:
            pos += 1
    return fields


def _hdf5_fields(data: bytes) -> list[Field]:
    # The superblock's addresses and sizes, then 8-byte words of the object headers.
    return [(i, w, "little") for i in range(8, min(len(data), 2048), 4) for w in (4, 8)]


FIELDS: dict[str, Callable[[bytes], list[Field]]] = {
    "safetensors": _safetensors_fields,
    "npy": _npy_fields,
    "npz": _zip_fields,
    "torch": _torch_fields,
    "gguf": _gguf_fields,
    "flax": _flax_fields,
    "hdf5": _hdf5_fields,
}


def _safetensors_value(data: bytes, rng: random.Random) -> bytes:
    """One value of the JSON header replaced by a hostile one, the length kept right."""
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + size])
    path = rng.choice(list(_json_paths(header)))
    _json_set(header, path, rng.choice([*_HOSTILE_JSON, *_BAD_DIMS, [-1], [2**40, 2**40]]))
    return F.safetensors(json.dumps(header).encode(), data[8 + size :])


def _npy_value(data: bytes, rng: random.Random) -> bytes:
    """The header's shape, descr or fortran_order replaced by a hostile literal."""
    import ast

    width = 2 if data[6] == 1 else 4
    (size,) = struct.unpack_from("<H" if width == 2 else "<I", data, 8)
    header = ast.literal_eval(data[8 + width : 8 + width + size].decode("latin1"))
    key = rng.choice(["shape", "descr", "fortran_order"])
    header[key] = rng.choice(
        [(-1,), (2.5,), (True,), ("3",), (10**12,), (2**64,), (1,) * 65, [2], None, 1,
         "<f8", "|O", "V0", "<U99999999", (0,), ((2,),), "", {"names": [], "formats": []}]
    )  # fmt: skip
    return F.npy(repr(header), data[8 + width + size :], version=max(1, data[6]))


VALUES: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "safetensors": _safetensors_value,
    "npy": _npy_value,
}


def _header_end(fmt: str, data: bytes) -> int:
    """Roughly where the parser's part of the file ends (mutations aim before it)."""
    if fmt == "safetensors":
        return min(len(data), 8 + struct.unpack_from("<Q", data)[0])
    if fmt == "npy":
        return min(len(data), 128)
    if fmt in ("npz", "torch"):
        return len(data)  # headers are everywhere, the directory at the end
    return min(len(data), 4096)


# --- structure: files written to break one rule ----------------------------------------

R = random.Random
_BAD_DIMS: list[Any] = [-1, -(2**63), 1.5, True, "3", None, [2], 10**12, 2**64, 2**40 + 1]


def _st_entry(rng: R) -> bytes:
    choice = rng.randrange(12)
    entry: dict[str, Any] = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    if choice == 0:
        entry["shape"] = [rng.choice(_BAD_DIMS), 2]
    elif choice == 1:
        entry["dtype"] = rng.choice(["F33", 5, None, "", "GGML_Q4_0", "U8" * 40])
    elif choice == 2:
        entry["data_offsets"] = rng.choice([[16, 0], [0], [0, 2**64], [-8, 8], [0.0, 16], "0-16"])
    elif choice == 3:
        entry["shape"] = [1] * rng.choice([65, 1000])
    elif choice == 4:
        del entry[rng.choice(list(entry))]
    elif choice == 5:
        entry = rng.choice([[], "x", 3, None])  # type: ignore[assignment]
    elif choice == 6:
        entry["shape"] = [10**6, 10**6]
        entry["data_offsets"] = [0, 4 * 10**12]
    header: dict[str, Any] = {"w": entry}
    if choice == 7:
        header["v"] = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}  # overlaps
    elif choice == 8:
        header["__metadata__"] = rng.choice([{"a": 1}, ["x"], {"a": {"b": "c"}}, "s"])
    elif choice == 9:
        return F.safetensors(
            json.dumps(header).encode()[:-1] + b',"w":' + json.dumps(entry).encode() + b"}",
            bytes(16),
        )
    elif choice == 10:
        header = {"\x00\x1b[2J": entry}
    elif choice == 11:
        header = {"": entry, "__metadata__": {"format": "pt"}}
    return F.safetensors(header, bytes(16))


def _st_claims(rng: R) -> bytes:
    choice = rng.randrange(9)
    if choice == 0:
        return struct.pack("<Q", rng.choice([2**63, 2**64 - 1, 100_000_000])) + b"{}"
    if choice == 1:
        return F.safetensors(b"{" + b'"a":' * 0 + b"[" * rng.choice([1000, 100_000]) + b"}")
    if choice == 2:
        return F.safetensors(b'{"__metadata__":{"a":"' + b"\xff\xfe" * 100 + b'"}}')
    if choice == 3:
        return F.safetensors(b'{"x":[' + b"[]," * 400_000 + b"[]]}")
    if choice == 4:
        return F.safetensors_many(rng.choice([2000, 70_000]))
    if choice == 5:
        meta = {"a": "a" * rng.choice([1 << 20, (16 << 20) - 200]) + "\U0001f600"}
        return F.safetensors(json.dumps({"__metadata__": meta}, ensure_ascii=False).encode())
    if choice == 6:
        return F.safetensors(b'{"x":{' + b'"a":{},' * 80_000 + b'"b":{}}}')
    if choice == 7:
        return F.safetensors(b"\xef\xbb\xbf{}")
    return F.safetensors(b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', b"\0" * 8)


def _npy(rng: R) -> bytes:
    choice = rng.randrange(14)
    if choice == 0:
        return F.npy_big_header(rng.choice([10_001, 65_000, 2 << 20]))
    if choice == 1:
        return F.npy_shape(repr((rng.choice(_BAD_DIMS), 3)))
    if choice == 2:
        descr = rng.choice(["O", "<U1000000000", "|V0", "S0", "|O8", ">f4", "zz", "(2,3)<f4",
                            "[('a','O')]", "{'names':['a'],'formats':['<f4'],'offsets':[2**62]}",
                            "[('a','<f4',(10**6,10**6))]", "<M8[D]", "<f4" * 100])  # fmt: skip
        return F.npy(f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': (2,), }}", bytes(8))
    if choice == 3:
        return F.npy("{'descr': '<f4', 'fortran_order': 1, 'shape': (2,), }", bytes(8))
    if choice == 4:
        return F.npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 300 + ")" * 300 + "}"
        )
    if choice == 5:
        return F.npy("{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",)}")
    if choice == 6:
        return F.npy("__import__('os').system('echo pwned')")
    if choice == 7:
        return F.npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", bytes(8))
    if choice == 8:
        return F.npy("[1, 2, 3]")
    if choice == 9:
        return (
            F.npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", bytes(8), version=3)[
                :-9
            ]
            + b"\xff"
            + bytes(8)
        )
    if choice == 10:
        return b"\x93NUMPY\x04\x00" + bytes(64)
    if choice == 11:
        return b"\x93NUMPY\x02\x00" + struct.pack("<I", 50 << 20) + b"{"
    if choice == 12:
        return F.npy_shape("(" + "1, " * 65 + ")")
    return F.npy_shape("(10**12,)")


def _npz(rng: R) -> bytes:
    choice = rng.randrange(7)
    if choice == 0:
        return F.zip_stored(
            [
                (f"a{i}.npy", F.npy_shape("(1,)", "|u1", b"\1"))
                for i in range(rng.choice([10, 2000]))
            ]
        )
    if choice == 1:
        return F.zip64_offset(rng.choice([1 << 63, 2**64 - 1, 0, 10**9]))
    if choice == 2:
        return F.zip_stored([("a.npy", rng.choice([_npy(rng), b"not npy", b""]))])
    if choice == 3:
        return F.zip_stored(
            [
                ("a.npy", F.npy_shape("(2,)", body=bytes(8))),
                ("a.npy", F.npy_shape("(3,)", body=bytes(12))),
            ]
        )
    if choice == 4:
        data = bytearray(F.zip_stored([("a.npy", F.npy_shape("(2,)", body=bytes(8)))]))
        at = data.rfind(b"PK\x05\x06")
        struct.pack_into("<HHII", data, at + 8, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
        return bytes(data)
    if choice == 5:
        return F.zip_stored([("../../x.npy", F.npy_shape("(2,)", body=bytes(8)))])
    return F.zip_stored([("a.npy", F.npy_shape("(4,)", body=bytes(8)))])  # member too short


def _pickle_case(rng: R) -> bytes:
    choice = rng.randrange(16)
    s, tp = F._str, F.tensor_pickle
    if choice == 0:
        return F.torch_with_pickle(F.shared_memo_pickle(rng.choice([20, 40, 60])))
    if choice == 1:
        return F.torch_with_pickle(F.nested_pickle(rng.choice([150, 10_000, 300_000])))
    if choice == 2:
        return F.torch_with_pickle(F.nested_pickle(rng.choice([100, 100_000]), "key"))
    if choice == 3:
        module, name = rng.choice(
            [("os", "system"), ("builtins", "eval"), ("posix", "system"),
             ("torch._utils", "_rebuild_qtensor"), ("__main__", "X")]
        )  # fmt: skip
        return F.torch_with_pickle(f"\x80\x02c{module}\n{name}\n".encode() + s("id") + b"\x85R.")
    if choice == 4:
        return F.torch_with_pickle(b"\x80\x02]q\x00h\x00a.")  # a list inside itself
    if choice == 5:
        dims = [
            rng.choice([s("x"), b"G" + struct.pack(">d", 1.5), b"N", F._int(-3), F._int(10**20)]),
            F._int(2),
        ]
        return F.torch_with_pickle(b"\x80\x02}" + s("w") + tp("0", "FloatStorage", dims, 2) + b"s.")
    if choice == 6:
        numel = rng.choice([-1, 10**12, 2**64, 0])
        return F.torch_with_pickle(
            b"\x80\x02}" + s("w") + tp("0", "FloatStorage", (2,), numel) + b"s."
        )
    if choice == 7:
        return F.torch_with_pickle(b"\x80\x02}" + s("w") + tp("9", "FloatStorage", (2,), 2) + b"s.")
    if choice == 8:
        return F.torch_with_pickle(
            b"\x80\x02" + b"\x94" * 0 + b"N" + b"\x94" * rng.choice([1000, 2_000_000]) + b"."
        )
    if choice == 9:
        return F.torch_with_pickle(b"\x80\x02" + b"(" * rng.choice([1000, 3_000_000]) + b"N.")
    if choice == 10:
        return F.torch_with_pickle(b"\x80\x02X" + struct.pack("<I", 0xFFFFFFFF) + b"abc.")
    if choice == 11:
        return F.torch_with_pickle(
            b"\x80\x02" + rng.choice([b"i", b"o", b"P1\n", b"\x8b", b"\x82\x01", b"\x92"]) + b"."
        )
    if choice == 12:
        n = rng.choice([100, 3000])
        body = b"".join(s(f"t{i}") + tp(str(i), "FloatStorage", (2,), 2) for i in range(n))
        return F.torch_file(b"\x80\x02}(" + body + b"u.", {str(i): bytes(8) for i in range(n)})
    if choice == 13:
        return F.torch_with_pickle(b"\x80\x02]" + b"]" * 2_000_000 + b"e" * 0 + b".")
    if choice == 14:
        return F.zip_stored(
            [("archive/data.pkl", b"\x80\x02}."), ("other/data.pkl", b"\x80\x02}.")]
        )
    return F.torch_with_pickle(b"\x80\x02}" + s("w") + tp("0", "UntypedStorage", (3,), 8) + b"s.")


def _gguf(rng: R) -> bytes:
    choice = rng.randrange(12)
    t = [("t", [8], 0, 0)]
    if choice == 0:
        count = rng.choice([200_000_000, 2**63, 2**64 - 1])
        return F.gguf(
            [F.gguf_kv("a", 9, F.gguf_array(rng.choice([0, 8, 9, 12]), count))], t, bytes(32)
        )
    if choice == 1:
        return F.gguf_nested(rng.choice([50, 101, 100_000]))
    if choice == 2:
        return F.gguf(
            [F.gguf_kv("s", 8, struct.pack("<Q", rng.choice([2**63, 1 << 30, 1 << 27])))], t
        )
    if choice == 3:
        data = bytearray(F.gguf([], t, bytes(32)))
        struct.pack_into(
            "<QQ", data, 8, rng.choice([2**63, 1 << 20, 0]), rng.choice([2**63, 1 << 20, 0])
        )
        return bytes(data)
    if choice == 4:
        dims = rng.choice([[2**63], [10**6, 10**7], [0, 2**64 - 1], [8] * 9, []])
        return F.gguf([], [("t", dims, 0, 0)], bytes(64))
    if choice == 5:
        return F.gguf([], [("t", [8], rng.choice([4, 5, 99, 2**32 - 1]), 0)], bytes(64))
    if choice == 6:
        kind, value = rng.choice([(4, 0), (4, 3), (4, 2**31), (10, 2**40), (8, None)])
        payload = (
            F._gguf_str("x") if value is None else struct.pack("<I" if kind == 4 else "<Q", value)
        )
        return F.gguf([F.gguf_kv("general.alignment", kind, payload)], t, bytes(64))
    if choice == 7:
        return F.gguf([], [("a", [8], 0, 0), ("b", [8], 0, 16)], bytes(64))  # overlap
    if choice == 8:
        return F.gguf([], [("a", [8], 0, 0), ("a", [8], 0, 32)], bytes(64))
    if choice == 9:
        return F.gguf([], [("q", [33], 8, 0)], bytes(64))  # Q8_0 of 33: not whole blocks
    if choice == 10:
        n = rng.choice([100, 2000])
        strings = b"".join(F._gguf_str(f"tok{i}") for i in range(n))
        kv = [F.gguf_kv("tokens", 9, F.gguf_array(8, n, strings))]
        return F.gguf(kv, [(f"t{i}", [8], 0, 32 * i) for i in range(n)], bytes(32 * n))
    return F.gguf(
        [F.gguf_kv("a", 9, F.gguf_array(8, 3, F._gguf_str("x") + struct.pack("<Q", 2**62)))],
        t,
        bytes(32),
    )


def _flax(rng: R) -> bytes:
    choice = rng.randrange(10)
    ok = {"k": F.flax_array([2], "float32", bytes(8))}
    if choice == 0:
        return F.flax_nested(rng.choice([50, 101, 100_000]))
    if choice == 1:
        shape = [rng.choice([*_BAD_DIMS[:2], 10**12, 2**63])]
        return F.mp({"p": {"k": F.flax_array(shape, "float32", bytes(8))}})
    if choice == 2:
        return F.mp(
            {"p": {"k": F.flax_array([10**12], rng.choice(["bfloat8", "<U5", "object"]), b"")}}
        )
    if choice == 3:
        return F.mp({"p": ok}) + b"\xdf" + struct.pack(">I", 2**32 - 1)
    if choice == 4:
        return F.mp({"p": ok, "x": list(range(rng.choice([1000, 2_200_000])))})
    if choice == 5:
        return F.mp({"p": {"k": F.Ext(1, F.mp([[2], "float32", bytes(8)])[:-2])}})
    if choice == 6:
        return F.mp({"p": {"k": F.flax_array([1] * 65, "float32", bytes(4))}})
    if choice == 7:
        return b"\x81\xa1p\x81\xa1k\xc9" + struct.pack(">I", 2**32 - 1) + b"\x01\x93"
    if choice == 8:
        return F.mp({"p": ok, "q": {"k": F.flax_array([3], "float32", bytes(8))}})
    return F.mp({"p": ok, "x": [{}] * 10}) + b"trailing"


def _hdf5(rng: R) -> bytes:
    # Written from scratch an HDF5 file is mostly a truncated one: the signature, then junk.
    return b"\x89HDF\r\n\x1a\n" + bytes([rng.randrange(4)]) + rng.randbytes(rng.choice([16, 600]))


STRUCTURE: dict[str, list[Callable[[R], bytes]]] = {
    "safetensors": [_st_entry, _st_claims],
    "npy": [_npy],
    "npz": [_npz],
    "torch": [_pickle_case],
    "gguf": [_gguf],
    "flax": [_flax],
    "hdf5": [_hdf5],
}
