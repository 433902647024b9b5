"""sparse: the positions of the elements whose bits changed, and their new bits.

Positions are compared bit for bit, so -0.0 vs 0.0, NaN payloads and changes of any size
are kept. Positions are stored as gaps (small numbers, compressed in byte planes).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from functools import partial
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
        if prev is None:
            return None
        new, prev = memoryview(new).cast("B"), memoryview(prev).cast("B")  # bytes, not items
        size = itemsize(dtype)
        if len(prev) != len(new) or len(new) % size:
            return None  # not whole elements of dtype
        count = _count_changed(prev, new, size)
        # The positions and the values are encoded from one scan of the tensor, a window
        # at a time, the two objects in step: held whole, they were 8 + size bytes per
        # changed element beside the new and previous values (268 MB more for a 256 MiB
        # tensor a third of whose elements changed, past the threat model's bound).
        scan = _Scan(_diffs(prev, new, size))
        streams = (
            codec.encode_stream(8 * count, codec.Layout(8), chunk_of=partial(scan.take, 0)),
            codec.encode_stream(size * count, layout_for(dtype), chunk_of=partial(scan.take, 1)),
        )
        parts: tuple[list[bytes], list[bytes]] = ([], [])
        done = [False, False]
        while not all(done):
            # The object that has taken fewer changed elements goes next: each part's
            # buffer then holds about one chunk of the other's.
            k = 1 if done[0] else 0 if done[1] else int(scan.taken[0] // 8 > scan.taken[1] // size)
            part = next(streams[k], None)
            if part is None:
                done[k] = True
            else:
                parts[k].append(part)
        positions = b"".join(parts[0])
        return [_HEAD.pack(MAGIC, size, count, len(positions)), positions, *parts[1]]

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


WINDOW = 1 << 20  # elements compared per step of an encode's scan


def _count_changed(prev: Buffer, new: Buffer, size: int) -> int:
    if kernels.native is not None:
        counted: int = kernels.native.count_changed(prev, new, size)
        return counted
    import numpy as np

    total = 0
    n = len(new) // size
    a, b = _elements(prev, size), _elements(new, size)
    for start in range(0, n, WINDOW):  # windows: no tensor-sized mask
        total += int(np.count_nonzero(a[start : start + WINDOW] != b[start : start + WINDOW]))
    return total


def _diffs(prev: Buffer, new: Buffer, size: int) -> Iterator[tuple[bytes, bytes]]:
    """The tensor's changed elements window by window: their gaps (u64 LE, the first from
    0, each from the previous changed element) and their new bytes."""
    n = len(new) // size
    last = 0
    native = kernels.native
    for start in range(0, n, WINDOW):
        stop = min(n, start + WINDOW)
        if native is not None:
            gaps, values, last = native.sparse_diff(prev, new, size, start, stop, last)
        else:
            gaps, values, last = _diff_numpy(prev, new, size, start, stop, last)
        yield gaps, values


def _diff_numpy(
    prev: Buffer, new: Buffer, size: int, start: int, stop: int, last: int
) -> tuple[bytes, bytes, int]:
    """NumPy version of ``_planes.sparse_diff`` (the same bytes)."""
    import numpy as np

    a, b = _elements(prev, size)[start:stop], _elements(new, size)[start:stop]
    local = np.flatnonzero(a != b)
    if not len(local):
        return b"", b"", last
    where = local.astype(np.uint64) + np.uint64(start)
    gaps = np.diff(where, prepend=np.uint64(last)).astype("<u8").tobytes()
    return gaps, b[local].tobytes(), int(where[-1])


class _Scan:
    """One scan of a tensor's windows, handing out exact spans, in order, of its gaps
    (part 0) and of its values (part 1), as codec's ``chunk_of`` asks for them when it
    encodes on one thread. Nothing in it refers back to it: a cycle would keep the
    tensor's new and previous values alive until the cyclic collector ran."""

    def __init__(self, windows: Iterator[tuple[bytes, bytes]]):
        self._windows = windows
        self._held = (bytearray(), bytearray())
        self.taken = [0, 0]  # bytes of each part handed out

    def take(self, part: int, start: int, end: int) -> bytes:
        held = self._held[part]
        if start != self.taken[part]:
            raise ValueError("spans of the changed elements must be taken in order")
        while len(held) < end - start:
            got = next(self._windows, None)
            if got is None:
                raise ValueError("the changed elements ended early")
            self._held[0].extend(got[0])
            self._held[1].extend(got[1])
        out = bytes(held[: end - start])
        del held[: end - start]
        self.taken[part] = end
        return out


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
