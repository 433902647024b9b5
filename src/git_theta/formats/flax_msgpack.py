"""Flax/JAX msgpack checkpoints (``flax.serialization.to_bytes``, ``msgpack_serialize``).

The file is one msgpack value: nested maps of the state dict whose array leaves are
msgpack extensions (type 1) holding ``(shape, dtype name, raw bytes)``. Each array's raw
bytes are a tensor named by its key path (``params/Dense_0/kernel``); everything else,
structure, scalars and the extension headers, is glue kept verbatim, so checkout is byte
for byte. Flax splits arrays over 1 GiB into ``chunks/0``, ``chunks/1``... maps; each
chunk is then a tensor of its own. Parsing only walks the structure: no object is built
and no code runs.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Callable
from typing import BinaryIO

from git_theta.dtypes import from_numpy_name, lookup
from git_theta.errors import CheckpointError
from git_theta.formats.base import (
    MAX_DEPTH,
    MAX_TENSORS,
    CheckpointFormat,
    LimitExceeded,
    ReadExact,
    TensorSpan,
    shown,
)

NDARRAY_EXT = 1  # flax's extension code for an ndarray (2 is a complex, 3 a numpy scalar)
MAX_KEY = 1 << 16  # bytes in one key: a name, not data
# msgpack values walked (~2 us each): an array leaf takes 8, so this is 2x MAX_TENSORS.
MAX_VALUES = 16 * MAX_TENSORS


class _Truncated(CheckpointError):
    pass


# Fixed-size scalars: marker -> (struct format or None for nil/bools)
_SCALARS: dict[int, str | None] = {
    0xC0: None, 0xC2: None, 0xC3: None, 0xCA: ">f", 0xCB: ">d",
    0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
    0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
}  # fmt: skip
_LENGTH = {1: ">B", 2: ">H", 4: ">I"}


class _Walker:
    """Walks one msgpack value, recording the raw-bytes span of every ndarray leaf."""

    def __init__(self, read: Callable[[int], bytes], seek: Callable[[int], object], size: int):
        self._read = read
        self._seek = seek
        self.size = size
        self.pos = 0
        self.ext_length = 0  # payload length of the extension ``head`` just read
        self.spans: list[TensorSpan] = []
        self.values = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > self.size:
            raise _Truncated("Flax msgpack file is truncated")
        data = self._read(n)
        if len(data) != n:
            raise _Truncated("Flax msgpack file is truncated")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if self.pos + n > self.size:
            raise _Truncated("Flax msgpack file is truncated")
        self.pos += n
        self._seek(self.pos)

    def number(self, fmt: str) -> int:
        value: int = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def head(self) -> tuple[str, int]:
        """Read a marker; return (kind, n): a count, length, int value or ext code."""
        self.values += 1
        if self.values > MAX_VALUES:
            raise LimitExceeded("Flax msgpack value count", None, MAX_VALUES)
        m = self.take(1)[0]
        if m <= 0x7F:
            return "int", m
        if m >= 0xE0:
            return "int", m - 0x100
        if m <= 0x8F:
            return "map", m & 0x0F
        if m <= 0x9F:
            return "array", m & 0x0F
        if m <= 0xBF:
            return "str", m & 0x1F
        if m in _SCALARS:
            fmt = _SCALARS[m]
            if fmt is None:
                return "scalar", 0
            value = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
            return ("int", value) if isinstance(value, int) else ("scalar", 0)
        if 0xC4 <= m <= 0xC6:
            return "bin", self.number(_LENGTH[1 << (m - 0xC4)])
        if 0xD9 <= m <= 0xDB:
            return "str", self.number(_LENGTH[1 << (m - 0xD9)])
        if m in (0xDC, 0xDD):
            return "array", self.number(">H" if m == 0xDC else ">I")
        if m in (0xDE, 0xDF):
            return "map", self.number(">H" if m == 0xDE else ">I")
        if 0xC7 <= m <= 0xC9:
            length = self.number(_LENGTH[1 << (m - 0xC7)])
            self.ext_length = length
            return "ext", self.take(1)[0]
        if 0xD4 <= m <= 0xD8:
            self.ext_length = 1 << (m - 0xD4)
            return "ext", self.take(1)[0]
        raise CheckpointError(f"Flax msgpack file has an invalid marker 0x{m:02x}")

    def value(self, path: list[str]) -> None:
        """Walk one value at key ``path`` (appended to and restored, never copied: a
        copy per value would cost depth x values)."""
        if len(path) > MAX_DEPTH:
            raise LimitExceeded("Flax msgpack nesting", len(path), MAX_DEPTH, "levels")
        kind, n = self.head()
        if kind == "map":
            for _ in range(n):
                path.append(self.key())
                self.value(path)
                path.pop()
        elif kind == "array":
            for i in range(n):
                path.append(str(i))
                self.value(path)
                path.pop()
        elif kind in ("str", "bin"):
            self.skip(n)
        elif kind == "ext":
            end = self.pos + self.ext_length
            if n == NDARRAY_EXT:
                self.ndarray("/".join(path) or "value", end)
            else:
                self.skip(self.ext_length)  # complex and numpy scalars stay glue
            if self.pos != end:
                raise CheckpointError(f"Flax array {shown('/'.join(path))} is malformed")

    def key(self) -> str:
        kind, n = self.head()
        if kind == "str":
            if n > MAX_KEY:
                raise CheckpointError("Flax msgpack map key is longer than 64 KiB")
            try:
                return self.take(n).decode("utf-8")
            except UnicodeDecodeError:
                raise CheckpointError("Flax msgpack key is not UTF-8") from None
        if kind == "int":
            return str(n)
        raise CheckpointError("Flax msgpack map key is not a string")

    def ndarray(self, name: str, end: int) -> None:
        """Parse ``(shape, dtype name, bytes)`` inside an ndarray extension."""
        kind, n = self.head()
        if kind != "array" or n != 3:
            raise CheckpointError(f"Flax array {shown(name)} is malformed")
        kind, rank = self.head()
        if kind != "array" or rank > 64:
            raise CheckpointError(f"Flax array {shown(name)} has a malformed shape")
        shape = []
        for _ in range(rank):
            kind, dim = self.head()
            if kind != "int" or dim < 0:
                raise CheckpointError(f"Flax array {shown(name)} has a malformed shape")
            shape.append(dim)
        kind, n = self.head()
        if kind != "str" or n > 64:
            raise CheckpointError(f"Flax array {shown(name)} has a malformed dtype")
        dtype = from_numpy_name(self.take(n).decode("ascii", errors="replace"))
        kind, n = self.head()
        if kind != "bin" or self.pos + n > end:
            raise CheckpointError(f"Flax array {shown(name)} is malformed")
        if len(self.spans) >= MAX_TENSORS:
            raise LimitExceeded("Flax msgpack array count", None, MAX_TENSORS)
        known = lookup(dtype)
        if known is not None and known.nbytes(tuple(shape)) != n:
            raise CheckpointError(
                f"Flax array {shown(name)}: {n} bytes for shape {tuple(shape)} of {dtype}"
            )
        if known is None and n % max(1, math.prod(shape)):
            raise CheckpointError(f"Flax array {shown(name)}: {n} bytes for shape {tuple(shape)}")
        self.spans.append(TensorSpan(name, dtype, tuple(shape), self.pos, self.pos + n))
        self.skip(n)


def _looks_like_state_dict(head: bytes) -> bool:
    """A top-level map with non-empty string keys, nested maps and lists, whose first
    extension within ``head`` is an ndarray."""
    walker = _Walker(io.BytesIO(head).read, lambda _: None, len(head))
    try:
        kind, n = walker.head()
        if kind != "map" or n == 0:
            return False
        stack = [[n, True]]  # per open container: entries left, whether entries have keys
        while stack:
            top = stack[-1]
            if top[0] == 0:
                stack.pop()
                continue
            top[0] -= 1
            if top[1]:
                kind, n = walker.head()
                if kind != "str" or n == 0:
                    return False
                walker.take(n)
            kind, n = walker.head()
            if kind in ("map", "array"):
                stack.append([n, kind == "map"])
            elif kind == "ext":
                if n == NDARRAY_EXT:
                    return True
                walker.take(walker.ext_length)
            elif kind in ("str", "bin"):
                walker.take(n)
    except CheckpointError:  # truncated head or an invalid marker
        return False
    return False


class FlaxMsgpackFormat(CheckpointFormat):
    key = "flax"
    head_size = 4096  # the first array must start within it (see _looks_like_state_dict)
    weak_sniff = True
    needs_seek = True  # array headers sit between the arrays: walk a seekable copy

    def sniff(self, head: bytes, path: str) -> bool:
        return _looks_like_state_dict(head)

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        raise CheckpointError("Flax msgpack files are read from a seekable copy")

    def read_spans(self, fh: BinaryIO, size: int) -> list[TensorSpan]:
        fh.seek(0)
        walker = _Walker(fh.read, fh.seek, size)
        walker.value([])
        if walker.pos != size:
            raise CheckpointError("Flax msgpack file has trailing bytes after its state dict")
        return walker.spans
