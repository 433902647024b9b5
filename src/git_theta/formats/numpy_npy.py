"""NumPy ``.npy``: a magic string, a version, a Python-literal header, then the array.

The header is parsed as NumPy does: refused over 10,000 characters (``literal_eval``
is not safe on large input: a 2 MB header cost 950 MB), then ``ast.literal_eval`` (no
code runs) and the dtype with ``numpy.dtype`` on the descr; object arrays (which hold
pickles) are refused.
"""

from __future__ import annotations

import struct

from git_theta.errors import CheckpointError
from git_theta.formats.base import (
    MAX_RANK,
    CheckpointFormat,
    LimitExceeded,
    ReadExact,
    TensorSpan,
)

MAGIC = b"\x93NUMPY"
# Characters in the header dict: numpy.lib.format refuses more (its _MAX_HEADER_SIZE)
# unless told to trust the file. Real headers are one padded line of ~118 characters.
MAX_HEADER = 10_000
_NAMES = {
    "<f2": "F16", "<f4": "F32", "<f8": "F64", "|i1": "I8", "<i2": "I16", "<i4": "I32",
    "<i8": "I64", "|u1": "U8", "<u2": "U16", "<u4": "U32", "<u8": "U64", "|b1": "BOOL",
    "<c8": "C64", "<c16": "C128",
}  # fmt: skip
_KEYS = {"descr", "fortran_order", "shape"}


class NpyFormat(CheckpointFormat):
    key = "npy"
    head_size = 6

    def sniff(self, head: bytes, path: str) -> bool:
        return head.startswith(MAGIC)

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        import ast  # here, not at the top: sniffing every added file loads this module

        import numpy as np

        magic, major, _minor = struct.unpack("<6sBB", read(8))
        if magic != MAGIC or major not in (1, 2, 3):
            raise CheckpointError(f"unsupported .npy version {major}")
        width = 2 if major == 1 else 4
        (size,) = struct.unpack("<H" if major == 1 else "<I", read(width))
        # Refused before reading: version 3 is UTF-8, at most 4 bytes a character.
        if size > MAX_HEADER * (4 if major == 3 else 1):
            raise LimitExceeded(".npy header", size, MAX_HEADER, "bytes")
        try:
            text = read(size).decode("latin1" if major < 3 else "utf8")
        except UnicodeDecodeError:
            raise CheckpointError(".npy header is not UTF-8") from None
        if len(text) > MAX_HEADER:
            raise LimitExceeded(".npy header", len(text), MAX_HEADER, "characters")
        try:
            header = ast.literal_eval(text)
        except (SyntaxError, MemoryError, RecursionError) as exc:
            raise CheckpointError(f".npy header is malformed: {_first_line(exc)}") from None
        except (ValueError, TypeError):  # a name, a call: anything but a literal
            raise CheckpointError(".npy header is not a Python literal") from None
        if not isinstance(header, dict) or set(header) != _KEYS:
            raise CheckpointError(".npy header is not a dict of descr, fortran_order, shape")
        shape = header["shape"]
        if not (
            isinstance(shape, tuple)
            and len(shape) <= MAX_RANK
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise CheckpointError(
                f".npy shape {str(shape)[:60]} is not a tuple of non-negative integers"
            )
        if not isinstance(header["fortran_order"], bool):
            raise CheckpointError(".npy header's fortran_order is not True or False")
        try:
            dtype = np.dtype(header["descr"])
        except (ValueError, TypeError, OverflowError) as exc:
            raise CheckpointError(f".npy dtype is not valid: {_first_line(exc)}") from None
        if dtype.hasobject:
            raise CheckpointError(".npy object arrays are pickles; git-theta does not read them")
        start = 8 + width + size
        if dtype.itemsize == 0:
            return []  # elements of no bytes (V0, S0): the whole file is glue
        count = 1
        for d in shape:
            count *= d
        name = _NAMES.get(dtype.str, f"NPY{dtype.str}")
        return [TensorSpan("array", name, shape, start, start + count * dtype.itemsize)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
