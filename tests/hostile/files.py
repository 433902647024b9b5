"""Byte-level writers for every checkpoint format, and the hostile files of issue 13.

No library is needed here (the worker that runs cases imports none): each writer puts
the bytes down itself, so a test controls every length, count and offset. ``DEFECTS``
holds one builder per defect reproduced against git-theta, by name.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# --- safetensors ---------------------------------------------------------------------


def safetensors(header: Mapping[str, Any] | bytes, data: bytes = b"") -> bytes:
    """A safetensors file: ``header`` (a dict, or raw JSON bytes) and ``data``."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def safetensors_many(n: int) -> bytes:
    """``n`` one-byte U8 tensors: a header of ~58 bytes an entry (1.5M: 87 MB)."""
    parts = [f'"{i:x}":{{"dtype":"U8","shape":[],"data_offsets":[{i},{i + 1}]}}' for i in range(n)]
    return safetensors(("{" + ",".join(parts) + "}").encode(), b"\x01" * n)


# --- .npy -----------------------------------------------------------------------------


def npy(header: str, body: bytes = b"", version: int = 1) -> bytes:
    """An .npy file with the literal ``header`` text, unpadded."""
    raw = header.encode("latin1" if version < 3 else "utf8")
    length = struct.pack("<H", len(raw)) if version == 1 else struct.pack("<I", len(raw))
    return b"\x93NUMPY" + bytes([version, 0]) + length + raw + body


def npy_shape(shape: str, descr: str = "<f4", body: bytes = b"") -> bytes:
    return npy(f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}\n", body)


def npy_big_header(size: int) -> bytes:
    """A version 2 .npy whose header is a ``size``-byte shape tuple (the literal parser
    took 950 MB for 2 MB)."""
    ones = "1, " * ((size - 60) // 3)
    return npy(f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({ones}), }}", version=2)


# --- zip (torch, npz) -----------------------------------------------------------------


def zip_stored(members: Sequence[tuple[str, bytes]]) -> bytes:
    """A zip of uncompressed members, in order (as torch.save and np.savez write)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


def torch_file(pickle: bytes, records: Mapping[str, bytes] | None = None) -> bytes:
    """A torch.save-like zip: ``archive/data.pkl`` and ``archive/data/<key>`` records."""
    members = [("archive/data.pkl", pickle)]
    members += [(f"archive/data/{k}", v) for k, v in (records or {}).items()]
    members.append(("archive/version", b"3\n"))
    return zip_stored(members)


def zip64_offset(offset: int) -> bytes:
    """An .npz whose zip64 end-of-directory locator points at ``offset``."""
    data = bytearray(zip_stored([("a.npy", npy_shape("(2,)", body=b"\0" * 8))]))
    at = data.rfind(b"PK\x05\x06")
    struct.pack_into("<H", data, at + 10, 0xFFFF)  # count: "see the zip64 record"
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, offset, 1)
    return bytes(data[:at] + locator + data[at:])


# --- pickles (what torch.save writes, and worse) ---------------------------------------


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(i: int) -> bytes:
    if 0 <= i < 256:
        return b"K" + bytes([i])
    if 0 <= i < 65536:
        return b"M" + struct.pack("<H", i)
    if -(2**31) <= i < 2**31:
        return b"J" + struct.pack("<i", i)
    raw = i.to_bytes((i.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple(items: Sequence[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def tensor_pickle(
    storage_key: str, kind: str, shape: Sequence[Any], numel: int, dtype: str = ""
) -> bytes:
    """The opcodes of one ``_rebuild_tensor_v2`` call (v3, naming ``dtype``, when given),
    shape items given as opcodes or ints (so a test can put a string or a float there)."""
    dims = [d if isinstance(d, bytes) else _int(d) for d in shape]
    stride = [_int(1) for _ in shape]
    module = b"torch.storage" if kind == "UntypedStorage" else b"torch"
    pid = _tuple(
        [_str("storage"), b"c" + module + b"\n" + kind.encode() + b"\n", _str(storage_key),
         _str("cpu"), _int(numel)]
    )  # fmt: skip
    args = [pid + b"Q", _int(0), _tuple(dims), _tuple(stride), b"\x89", b"}"]
    if dtype:
        args.append(b"ctorch\n" + dtype.encode() + b"\n")
    version = b"3" if dtype else b"2"
    return b"ctorch._utils\n_rebuild_tensor_v" + version + b"\n" + _tuple(args) + b"R"


def _state_pickle(tensors: Mapping[str, tuple[str, str, Sequence[Any]]]) -> bytes:
    """A pickled dict name -> tensor (storage key, storage kind, shape)."""
    body = b"".join(
        _str(name) + tensor_pickle(key, kind, shape, _prod(shape))
        for name, (key, kind, shape) in tensors.items()
    )
    return b"\x80\x02}(" + body + b"u."


def _prod(shape: Sequence[Any]) -> int:
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return n


def shared_memo_pickle(levels: int = 40) -> bytes:
    """A dict holding a tensor and a list L40, where Li = [L(i-1), L(i-1)] through the
    memo: 250 bytes of pickle, 2^levels paths for a walk that does not share."""
    value = b"]q\x00"
    for i in range(1, levels + 1):
        value = b"](" + value + b"h" + bytes([i - 1]) + b"eq" + bytes([i])
    tensor = _str("w") + tensor_pickle("0", "FloatStorage", (2,), 2)
    return b"\x80\x02}(" + tensor + _str("deep") + value + b"u."


def nested_pickle(depth: int, kind: str = "list") -> bytes:
    """A value nesting ``depth`` lists (or 1-tuples used as a dict key: hashing a deep
    tuple overflows CPython's C stack)."""
    if kind == "list":
        return b"\x80\x02]" + b"]" * depth + b"a" * depth + b"."
    return b"\x80\x02}" + b")" + b"\x85" * depth + b"Ns."


def torch_with_pickle(pickle: bytes) -> bytes:
    return torch_file(pickle, {"0": b"\0" * 8})


# --- GGUF -----------------------------------------------------------------------------


def _gguf_str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf(
    kv: Sequence[bytes],
    tensors: Sequence[tuple[str, Sequence[int], int, int]],
    data: bytes = b"",
    alignment: int = 32,
) -> bytes:
    """A GGUF v3 file: ``kv`` are encoded key/values (``gguf_kv``), tensors are (name,
    dims innermost first, ggml type, offset)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv)
    for name, dims, kind, offset in tensors:
        out += _gguf_str(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + data


def gguf_kv(key: str, kind: int, value: bytes) -> bytes:
    """One key/value: ``value`` is the already-encoded payload of type ``kind``."""
    return _gguf_str(key) + struct.pack("<I", kind) + value


def gguf_array(inner: int, count: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IQ", inner, count) + payload


def gguf_big_array(count: int = 200_000_000) -> bytes:
    """A metadata array claiming ``count`` u8 (the parser built each as an int: >60 s)."""
    kv = [gguf_kv("big", 9, gguf_array(0, count, bytes(count)))]
    return gguf(kv, [("t", [8], 0, 0)], b"\0" * 32)


def gguf_nested(depth: int) -> bytes:
    """Metadata arrays nested ``depth`` deep (each holding one array)."""
    value = gguf_array(0, 0)
    for _ in range(depth):
        value = gguf_array(9, 1, value)
    return gguf([gguf_kv("deep", 9, value)], [("t", [8], 0, 0)], b"\0" * 32)


# --- msgpack (Flax) --------------------------------------------------------------------


def mp(value: Any) -> bytes:
    """msgpack bytes of ``value``: dict, list, str, bytes, int, or ``Ext(code, data)``."""
    if isinstance(value, Ext):
        return b"\xc7" + struct.pack(">BB", len(value.data), value.code) + value.data
    if isinstance(value, dict):
        return _mp_len(0x80, 0xDE, len(value)) + b"".join(mp(k) + mp(v) for k, v in value.items())
    if isinstance(value, list):
        return _mp_len(0x90, 0xDC, len(value)) + b"".join(mp(v) for v in value)
    if isinstance(value, str):
        raw = value.encode()
        return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw
    if isinstance(value, bytes):
        return b"\xc6" + struct.pack(">I", len(value)) + value
    if isinstance(value, bool) or value is None:
        return {None: b"\xc0", False: b"\xc2", True: b"\xc3"}[value]
    if 0 <= value < 128:
        return bytes([value])
    if -32 <= value < 0:
        return bytes([value & 0xFF])
    return b"\xd3" + struct.pack(">q", value) if value < 0 else b"\xcf" + struct.pack(">Q", value)


def _mp_len(fix: int, big: int, n: int) -> bytes:
    return bytes([fix | n]) if n < 16 else bytes([big + 1]) + struct.pack(">I", n)


class Ext:
    def __init__(self, code: int, data: bytes):
        self.code = code
        self.data = data


def flax_array(shape: Sequence[Any], dtype: str, raw: bytes) -> Ext:
    return Ext(1, mp([list(shape), dtype, raw]))


def flax_nested(depth: int) -> bytes:
    """A state dict whose first key holds an array, then ``depth`` nested maps."""
    leaf = mp({"w": flax_array([2], "float32", b"\0" * 8)})
    deep = b"\x81\xa1a" * depth + leaf  # {"a": {"a": ... leaf}}
    return b"\x82" + mp("p") + mp({"k": flax_array([2], "float32", b"\0" * 8)}) + mp("deep") + deep


# --- the defects reproduced against git-theta (issue 13) -------------------------------

DEFECTS: dict[str, tuple[str, Callable[[], bytes]]] = {
    # name: (file name, builder)
    "npy_header_2mb": ("a.npy", lambda: npy_big_header(2 << 20)),
    "npy_header_50mb": ("a.npy", lambda: npy_big_header(50 << 20)),
    "npy_negative_shape": ("a.npy", lambda: npy_shape("(-4,)")),
    "npy_float_shape": ("a.npy", lambda: npy_shape("(2.5,)", body=b"\0" * 8)),
    "torch_shared_memo": ("m.pt", lambda: torch_with_pickle(shared_memo_pickle(40))),
    "torch_deep_nesting": ("m.pt", lambda: torch_with_pickle(nested_pickle(100_000))),
    "torch_deep_tuple_key": ("m.pt", lambda: torch_with_pickle(nested_pickle(1_000_000, "key"))),
    "torch_string_shape": (
        "m.pt",
        lambda: torch_with_pickle(
            b"\x80\x02}" + _str("w") + tensor_pickle("0", "FloatStorage", [_str("x"), 2], 2) + b"s."
        ),
    ),
    "torch_10e12_elements": (
        "m.pt",
        lambda: torch_with_pickle(
            b"\x80\x02}"
            + _str("w")
            + tensor_pickle("0", "UntypedStorage", (4,), 10**12, "float32")
            + b"s."
        ),
    ),
    "torch_negative_shape": (
        "m.pt",
        lambda: torch_file(
            b"\x80\x02}" + _str("w") + tensor_pickle("0", "FloatStorage", (-2, -3), 6) + b"s.",
            {"0": b"\0" * 24},
        ),
    ),
    "zip64_offset": ("a.npz", lambda: zip64_offset(1 << 63)),
    "safetensors_1_5m_entries": ("m.safetensors", lambda: safetensors_many(1_500_000)),
    "safetensors_200k_entries": ("m.safetensors", lambda: safetensors_many(200_000)),
    "safetensors_deep_json": (
        "m.safetensors",
        lambda: safetensors(b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ),
    "gguf_200m_array": ("m.gguf", lambda: gguf_big_array(200_000_000)),
    "gguf_deep_arrays": ("m.gguf", lambda: gguf_nested(100_000)),
    "flax_deep_nesting": ("m.msgpack", lambda: flax_nested(100_000)),
    "flax_lying_shape": (
        "m.msgpack",
        lambda: mp({"p": {"k": flax_array([10**12], "bfloat8", b"")}}),
    ),
}
