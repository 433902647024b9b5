"""xor-delta: the bitwise XOR with the previous value, compressed in byte planes.

A small change to a float leaves its sign, exponent and top mantissa bits alone, so the
XOR is mostly zero bytes in the high planes: a full fine-tune that nudges every weight
stores a fraction of a dense copy, losslessly.
"""

from __future__ import annotations

import numpy as np

from git_theta import codec
from git_theta.errors import ObjectCorruptError
from git_theta.parallel import chunk_pool
from git_theta.updates.base import Buffer, UpdateType
from git_theta.updates.layout import layout_for


def _xor(a: Buffer, b: Buffer) -> bytearray:
    out = bytearray(len(a))
    np.bitwise_xor(
        np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8), out=np.frombuffer(out, np.uint8)
    )
    return out


class XorDelta(UpdateType):
    key = "xor-delta"
    codec = "gtho1"

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        if prev is None or len(prev) != len(new):
            return None
        return codec.encode(_xor(new, prev), layout_for(dtype), pool=chunk_pool())

    def apply(self, prev: bytearray | None, payload: bytes, dtype: str) -> bytearray:
        delta = codec.decode(payload, pool=chunk_pool())
        if prev is None or len(prev) != len(delta):
            raise ObjectCorruptError("xor-delta does not match the size of the previous value")
        return _xor(prev, delta)
