"""GGUF (llama.cpp): a header of typed key/values and tensor infos, then aligned data.

Quantized tensors are kept as their raw blocks (dtype ``GGML_<TYPE>``); metadata is glue,
kept verbatim, so checkout is byte for byte. Metadata values are skipped, not built: an
array of scalars is one read of count x size bytes (checked against the header cap
first), so a claimed 200M-element array costs nothing.
"""

from __future__ import annotations

import struct

from git_theta.dtypes import BLOCKS
from git_theta.errors import CheckpointError
from git_theta.formats.base import (
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    CheckpointFormat,
    LimitExceeded,
    ReadExact,
    TensorSpan,
    shown,
)

# ggml type id -> our dtype name (block sizes of the quantized ones: dtypes.BLOCKS).
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "GGML_Q4_0", 3: "GGML_Q4_1", 6: "GGML_Q5_0", 7: "GGML_Q5_1",
    8: "GGML_Q8_0", 9: "GGML_Q8_1", 10: "GGML_Q2_K", 11: "GGML_Q3_K", 12: "GGML_Q4_K",
    13: "GGML_Q5_K", 14: "GGML_Q6_K", 15: "GGML_Q8_K", 16: "GGML_IQ2_XXS",
    17: "GGML_IQ2_XS", 18: "GGML_IQ3_XXS", 19: "GGML_IQ1_S", 20: "GGML_IQ4_NL",
    21: "GGML_IQ3_S", 22: "GGML_IQ2_S", 23: "GGML_IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "GGML_IQ1_M", 30: "BF16", 34: "GGML_TQ1_0", 35: "GGML_TQ2_0",
    39: "GGML_MXFP4", 40: "GGML_NVFP4", 41: "GGML_Q1_0",
}  # fmt: skip
_PLAIN = {"F32": 4, "F16": 2, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F64": 8, "BF16": 2}
# value type id -> struct format for scalars (8: string, 9: array are special)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_INTS = {0, 2, 4, 10}  # unsigned scalar types general.alignment may have
MAX_KV = 1 << 16  # metadata keys: real files have ~40
MAX_DIMS = 8  # ggml tensors have at most 4
MAX_ALIGNMENT = 1 << 16  # bytes; files use 32, llama.cpp demands a power of 2
MAX_NAME = 1 << 16  # bytes in a key or tensor name
_CHUNK = 1 << 16  # bytes read at a time through an array of strings
_U64 = struct.Struct("<Q")


class GgufFormat(CheckpointFormat):
    key = "gguf"
    head_size = 4

    def sniff(self, head: bytes, path: str) -> bool:
        return head.startswith(b"GGUF")

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            if pos + n > MAX_HEADER_BYTES:  # refused before the bytes are read
                raise LimitExceeded("GGUF header", pos + n, MAX_HEADER_BYTES, "bytes")
            pos += n
            return read(n)

        def u(fmt: str) -> int:
            value: int = struct.unpack(fmt, take(struct.calcsize(fmt)))[0]
            return value

        def string(what: str) -> bytes:
            length = u("<Q")
            if length > MAX_HEADER_BYTES:
                raise LimitExceeded(f"GGUF {what} length", length, MAX_HEADER_BYTES, "bytes")
            return take(length)

        def name(what: str) -> str:
            length = u("<Q")
            if length > MAX_NAME:
                raise LimitExceeded(f"GGUF {what} length", length, MAX_NAME, "bytes")
            return take(length).decode("utf-8", errors="replace")

        def skip_strings(count: int) -> None:
            """Read past ``count`` strings (a vocabulary: 250k of them) in large reads,
            never past the array: what is left of it is at least 8 bytes a string."""
            buf, at = b"", 0
            for left in range(count, 0, -1):
                if len(buf) - at < 8:
                    buf, at = buf[at:] + take(min(8 * left, _CHUNK) - (len(buf) - at)), 0
                (length,) = _U64.unpack_from(buf, at)
                if length > MAX_HEADER_BYTES:
                    raise LimitExceeded("GGUF string length", length, MAX_HEADER_BYTES, "bytes")
                end = at + 8 + length
                if end > len(buf):
                    known = end - len(buf)  # the rest of this string, then the others
                    buf = buf[at:] + take(max(known, min(known + 8 * (left - 1), _CHUNK)))
                    end = 8 + length
                at = end

        def skip_value(kind: int, depth: int) -> int | None:
            """Read past one value of type ``kind``; return it when it is an integer."""
            if kind in _SCALARS:
                value = struct.unpack(_SCALARS[kind], take(struct.calcsize(_SCALARS[kind])))[0]
                return value if kind in _INTS else None
            if kind == 8:
                string("string")
                return None
            if kind != 9:
                raise CheckpointError(f"GGUF metadata has unknown value type {kind}")
            if depth >= MAX_DEPTH:
                raise LimitExceeded("GGUF metadata array nesting", depth + 1, MAX_DEPTH, "levels")
            inner, count = u("<I"), u("<Q")
            # Every element takes at least one byte (a string eight): a count the header
            # cannot hold is refused before anything is read.
            least = struct.calcsize(_SCALARS[inner]) if inner in _SCALARS else 8
            if count * least > MAX_HEADER_BYTES - pos:
                raise LimitExceeded(
                    f"GGUF metadata array ({count} elements)", count * least,
                    MAX_HEADER_BYTES, "bytes",
                )  # fmt: skip
            if inner in _SCALARS:
                take(count * least)  # one read, no value built
            elif inner == 8:
                skip_strings(count)
            else:
                for _ in range(count):
                    skip_value(inner, depth + 1)
            return None

        if take(4) != b"GGUF":
            raise CheckpointError("not a GGUF file")
        version = u("<I")
        if version not in (2, 3):
            raise CheckpointError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = u("<Q"), u("<Q")
        if n_tensors > MAX_TENSORS:
            raise LimitExceeded("GGUF tensor count", n_tensors, MAX_TENSORS)
        if n_kv > MAX_KV:
            raise LimitExceeded("GGUF metadata key count", n_kv, MAX_KV)
        alignment = 32
        for _ in range(n_kv):
            key = name("key")
            item = skip_value(u("<I"), 0)
            if key == "general.alignment" and item is not None:
                if not 0 < item <= MAX_ALIGNMENT or item & (item - 1):
                    raise CheckpointError(
                        f"GGUF general.alignment {item} is not a power of 2 up to {MAX_ALIGNMENT}"
                    )
                alignment = item
        infos = []
        for _ in range(n_tensors):
            tensor = name("tensor name")
            n_dims = u("<I")
            if n_dims > MAX_DIMS:
                raise CheckpointError(f"GGUF tensor {shown(tensor)} has {n_dims} dimensions")
            dims = tuple(u("<Q") for _ in range(n_dims))
            kind, offset = u("<I"), u("<Q")
            infos.append((tensor, dims, kind, offset))
        data_start = -(-pos // alignment) * alignment
        spans = []
        for tensor, dims, kind, offset in infos:
            if kind not in GGML_TYPES:
                raise CheckpointError(f"GGUF tensor {shown(tensor)} has unknown type {kind}")
            dtype = GGML_TYPES[kind]
            elements, size = BLOCKS.get(dtype) or (1, _PLAIN[dtype])
            if dims and dims[0] % elements:  # blocks run along the innermost dimension
                raise CheckpointError(
                    f"GGUF tensor {shown(tensor)} is not a whole number of blocks"
                )
            count = 1
            for d in dims:
                count *= d
            start = data_start + offset
            # GGUF lists dims innermost first; record them outermost first, like the others.
            spans.append(
                TensorSpan(tensor, dtype, dims[::-1], start, start + count // elements * size)
            )
        return spans
