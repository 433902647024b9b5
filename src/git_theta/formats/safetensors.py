"""safetensors: an 8-byte little-endian header length, a JSON header, then the data."""

from __future__ import annotations

import json
import struct

from git_theta.dtypes import lookup
from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat, ReadExact, TensorSpan

MAX_HEADER = 100_000_000  # the safetensors library's own limit


class SafetensorsFormat(CheckpointFormat):
    key = "safetensors"
    head_size = 9

    def sniff(self, head: bytes, path: str) -> bool:
        if len(head) < 9:
            return False
        (size,) = struct.unpack_from("<Q", head)
        return 2 <= size <= MAX_HEADER and head[8:9] == b"{"

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        (size,) = struct.unpack("<Q", read(8))
        if size > MAX_HEADER:
            raise CheckpointError(f"safetensors header of {size} bytes is larger than allowed")
        try:
            header = json.loads(read(size))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"safetensors header is not valid JSON: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointError("safetensors header is not a JSON object")
        base = 8 + size
        spans = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
                ok = (
                    isinstance(dtype, str)
                    and all(isinstance(x, int) and x >= 0 for x in [*shape, start, end])
                    and start <= end
                )
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointError(f"safetensors header entry {name!r} is malformed")
            known = lookup(dtype)
            if known is not None and known.nbytes(tuple(shape)) != end - start:
                raise CheckpointError(
                    f"safetensors header lies about tensor {name!r}: {dtype} {shape} needs "
                    f"{known.nbytes(tuple(shape))} bytes but data_offsets span {end - start}"
                )
            spans.append(TensorSpan(name, dtype, tuple(shape), base + start, base + end))
        return spans
