"""delta: the difference of each element's bit pattern from its previous value, as an
integer, zigzag-folded so small changes either way become small numbers, in byte planes.

A small change to a float leaves its sign and exponent alone and moves the mantissa a
little, so the difference of the bit patterns is a small integer: the high planes are
zeros and compress to almost nothing. Measured on MiniLM FP32 with every weight scaled
by (1 + 1e-3 noise): 0.493x of raw (an XOR delta gave 0.542x; the data's entropy ~0.49x).
Wrapping arithmetic makes it exact for every bit pattern, NaNs included.
"""

from __future__ import annotations

import numpy as np

from git_theta import codec
from git_theta.errors import ObjectCorruptError
from git_theta.parallel import chunk_pool
from git_theta.updates.base import Buffer, UpdateType
from git_theta.updates.layout import itemsize

_UNSIGNED = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
_SIGNED = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}


def _size(dtype: str) -> int:
    size = itemsize(dtype)
    return size if size in _UNSIGNED else 1


def _zigzag(new: Buffer, old: Buffer, size: int) -> np.ndarray:
    a = np.frombuffer(old, dtype=_UNSIGNED[size])
    b = np.frombuffer(new, dtype=_UNSIGNED[size])
    d = (b - a).view(_SIGNED[size])  # wraps modulo 2**bits
    out: np.ndarray = ((d << 1) ^ (d >> (size * 8 - 1))).view(_UNSIGNED[size])
    return out


def _unzigzag(z: np.ndarray, old: Buffer, size: int) -> bytearray:
    signed = z.view(_SIGNED[size])
    d = ((z >> 1).view(_SIGNED[size]) ^ -(signed & 1)).view(_UNSIGNED[size])
    a = np.frombuffer(old, dtype=_UNSIGNED[size])
    return bytearray((a + d).tobytes())


class Delta(UpdateType):
    key = "delta"
    codec = "gtho1"

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        if prev is None or len(prev) != len(new):
            return None
        size = _size(dtype)
        z = _zigzag(new, prev, size)
        return codec.encode(z.tobytes(), codec.Layout(size), pool=chunk_pool())

    def apply(self, prev: bytearray | None, payload: bytes, dtype: str) -> bytearray:
        size = _size(dtype)
        raw = codec.decode(payload, pool=chunk_pool())
        if prev is None or len(prev) != len(raw):
            raise ObjectCorruptError("delta does not match the size of the previous value")
        return _unzigzag(np.frombuffer(raw, dtype=_UNSIGNED[size]), prev, size)
