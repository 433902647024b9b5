"""sparse: the positions of the elements whose bits changed, and their new bits.

Positions are compared bit for bit, so -0.0 vs 0.0, NaN payloads and changes of any size
are kept. Positions are stored as gaps (small numbers, compressed in byte planes).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from git_theta import codec, kernels
from git_theta.errors import ObjectCorruptError
from git_theta.updates.base import Buffer, Payload, UpdateType
from git_theta.updates.layout import itemsize, layout_for

_HEAD = struct.Struct("<4sBQQ")  # magic, itemsize, count, length of the positions object
MAGIC = b"GTSP"
_KINDS = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}

if TYPE_CHECKING:
    import numpy as np


def _elements(data: Buffer, size: int) -> np.ndarray:
    import numpy as np  # NumPy costs 0.12 s to import; checkouts apply in C instead

    if size in _KINDS:
        return np.frombuffer(data, dtype=_KINDS[size])
    return np.frombuffer(data, dtype=np.dtype((np.void, size)))


class Sparse(UpdateType):
    key = "sparse"
    codec = "gtsp1"

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        if prev is None or len(prev) != len(new):
            return None
        size = itemsize(dtype)
        if kernels.native is not None:
            gaps, changed = kernels.native.sparse_diff(prev, new, size)
        else:
            import numpy as np

            a, b = _elements(prev, size), _elements(new, size)
            where = np.flatnonzero(a != b).astype(np.uint64)
            gaps = np.diff(where, prepend=np.uint64(0)).astype("<u8").tobytes()
            changed = b[where.astype(np.intp)].tobytes()
        positions = b"".join(codec.encode(gaps, codec.Layout(8)))
        values = codec.encode(changed, layout_for(dtype))
        count = len(gaps) // 8
        return [_HEAD.pack(MAGIC, size, count, len(positions)), positions, *values]

    def apply(
        self, prev: bytearray | None, payload: Payload, dtype: str, limit: int | None = None
    ) -> bytearray:
        if prev is None:
            raise ObjectCorruptError("a sparse update needs a previous value")
        size, count, plen = _read_head(payload)
        if size != itemsize(dtype) or count > len(prev) // size:
            raise ObjectCorruptError(
                f"sparse update of {count:,} {size}-byte elements does not fit a "
                f"{len(prev):,}-byte {dtype} value"
            )
        view = memoryview(payload)[_HEAD.size :]
        # Each part may decode to exactly what the count says, and no more.
        gaps = codec.decode(view[:plen], limit=8 * count)
        values = codec.decode(view[plen:], limit=count * size)
        if len(gaps) != 8 * count or len(values) != count * size:
            raise ObjectCorruptError("sparse update object is inconsistent")
        if kernels.native is not None:  # in place: the caller owns prev
            try:
                kernels.native.scatter(prev, gaps, values, size)
            except (ValueError, IndexError) as exc:
                raise ObjectCorruptError(str(exc)) from None
            return prev
        import numpy as np

        out = prev
        where = np.cumsum(np.frombuffer(gaps, dtype="<u8"), dtype=np.uint64).astype(np.intp)
        target = _elements(out, size)
        if count and int(where[-1]) >= len(target):
            raise ObjectCorruptError("sparse update touches elements past the tensor's end")
        target[where] = _elements(values, size)
        return out

    def summary(self, payload: Payload, limit: int | None = None) -> str:
        try:
            _, count, _ = _read_head(payload)
        except ObjectCorruptError:
            return ""
        return f"sparse update of {count:,} elements"


def _read_head(payload: Payload) -> tuple[int, int, int]:
    """Return (itemsize, count, positions length) from a sparse payload's header.

    Raises ObjectCorruptError when it is not one, or its lengths exceed the payload.
    """
    if len(payload) < _HEAD.size:
        raise ObjectCorruptError("sparse update object is truncated")
    magic, size, count, plen = _HEAD.unpack_from(payload)
    if magic != MAGIC:
        raise ObjectCorruptError("not a sparse update object")
    if size == 0 or plen > len(payload) - _HEAD.size:
        raise ObjectCorruptError("sparse update object header is corrupt")
    return int(size), int(count), int(plen)
