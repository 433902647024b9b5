"""rawf32: ``RAWF32\\0\\0``, a little-endian u64 element count, then that many float32s.

A whole format plugin: it says where the tensor lies; git-theta does the rest.
"""

from __future__ import annotations

import struct

from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat, ReadExact, TensorSpan

MAGIC = b"RAWF32\0\0"


class RawF32Format(CheckpointFormat):
    key = "rawf32"
    head_size = 8

    def sniff(self, head: bytes, path: str) -> bool:
        return head.startswith(MAGIC)

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        if read(8) != MAGIC:
            raise CheckpointError("not a rawf32 file")
        (count,) = struct.unpack("<Q", read(8))
        return [TensorSpan("values", "F32", (count,), 16, 16 + 4 * count)]
