"""GGUF (llama.cpp): a header of typed key/values and tensor infos, then aligned data.

Quantized tensors are kept as their raw blocks (dtype ``GGML_<TYPE>``); metadata is glue,
kept verbatim, so checkout is byte for byte.
"""

from __future__ import annotations

import math
import struct

from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat, ReadExact, TensorSpan

# ggml type id -> (name, elements per block, bytes per block), from the GGUF spec.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("GGML_Q4_0", 32, 18), 3: ("GGML_Q4_1", 32, 20),
    6: ("GGML_Q5_0", 32, 22), 7: ("GGML_Q5_1", 32, 24), 8: ("GGML_Q8_0", 32, 34),
    9: ("GGML_Q8_1", 32, 36), 10: ("GGML_Q2_K", 256, 84), 11: ("GGML_Q3_K", 256, 110),
    12: ("GGML_Q4_K", 256, 144), 13: ("GGML_Q5_K", 256, 176), 14: ("GGML_Q6_K", 256, 210),
    15: ("GGML_Q8_K", 256, 292), 16: ("GGML_IQ2_XXS", 256, 66), 17: ("GGML_IQ2_XS", 256, 74),
    18: ("GGML_IQ3_XXS", 256, 98), 19: ("GGML_IQ1_S", 256, 50), 20: ("GGML_IQ4_NL", 32, 18),
    21: ("GGML_IQ3_S", 256, 110), 22: ("GGML_IQ2_S", 256, 82), 23: ("GGML_IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("GGML_IQ1_M", 256, 56), 30: ("BF16", 1, 2),
    34: ("GGML_TQ1_0", 256, 54), 35: ("GGML_TQ2_0", 256, 66),
}  # fmt: skip
# value type id -> struct format for scalars (8: string, 9: array are special)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
MAX_COUNT = 1 << 32  # larger counts or lengths are corruption, not data


class GgufFormat(CheckpointFormat):
    key = "gguf"
    head_size = 4

    def sniff(self, head: bytes, path: str) -> bool:
        return head.startswith(b"GGUF")

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            pos += n
            return read(n)

        def u(fmt: str) -> int:
            value: int = struct.unpack(fmt, take(struct.calcsize(fmt)))[0]
            return value

        def string() -> str:
            length = u("<Q")
            if length > MAX_COUNT:
                raise CheckpointError("GGUF string length is corrupt")
            return take(length).decode("utf-8", errors="replace")

        def value(kind: int) -> object:
            if kind in _SCALARS:
                return struct.unpack(_SCALARS[kind], take(struct.calcsize(_SCALARS[kind])))[0]
            if kind == 8:
                return string()
            if kind == 9:
                inner, count = u("<I"), u("<Q")
                if count > MAX_COUNT:
                    raise CheckpointError("GGUF array length is corrupt")
                return [value(inner) for _ in range(count)]
            raise CheckpointError(f"GGUF metadata has unknown value type {kind}")

        if take(4) != b"GGUF":
            raise CheckpointError("not a GGUF file")
        version = u("<I")
        if version not in (2, 3):
            raise CheckpointError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = u("<Q"), u("<Q")
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise CheckpointError("GGUF header counts are corrupt")
        alignment = 32
        for _ in range(n_kv):
            key = string()
            item = value(u("<I"))
            if key == "general.alignment" and isinstance(item, int) and item > 0:
                alignment = item
        infos = []
        for _ in range(n_tensors):
            name = string()
            n_dims = u("<I")
            if n_dims > 8:
                raise CheckpointError(f"GGUF tensor {name!r} has {n_dims} dimensions")
            dims = tuple(u("<Q") for _ in range(n_dims))
            kind, offset = u("<I"), u("<Q")
            infos.append((name, dims, kind, offset))
        data_start = -(-pos // alignment) * alignment
        spans = []
        for name, dims, kind, offset in infos:
            if kind not in GGML_TYPES:
                raise CheckpointError(f"GGUF tensor {name!r} has unknown type {kind}")
            dtype, block, size = GGML_TYPES[kind]
            count = math.prod(dims)
            if count % block:
                raise CheckpointError(f"GGUF tensor {name!r} is not a whole number of blocks")
            start = data_start + offset
            # GGUF lists dims innermost first; record them outermost first, like the others.
            spans.append(TensorSpan(name, dtype, dims[::-1], start, start + count // block * size))
        return spans
