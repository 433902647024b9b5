"""NumPy ``.npy``: a magic string, a version, a Python-literal header, then the array.

The header is parsed with ``ast.literal_eval`` (no code runs) and the dtype with
``numpy.dtype`` on the descr string; object arrays (which hold pickles) are refused.
"""

from __future__ import annotations

import math
import struct

from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat, ReadExact, TensorSpan

MAGIC = b"\x93NUMPY"
_NAMES = {
    "<f2": "F16", "<f4": "F32", "<f8": "F64", "|i1": "I8", "<i2": "I16", "<i4": "I32",
    "<i8": "I64", "|u1": "U8", "<u2": "U16", "<u4": "U32", "<u8": "U64", "|b1": "BOOL",
    "<c8": "C64", "<c16": "C128",
}  # fmt: skip


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
        (size,) = struct.unpack("<H" if major == 1 else "<I", read(2 if major == 1 else 4))
        text = read(size).decode("latin1" if major < 3 else "utf8")
        try:
            header = ast.literal_eval(text)
            dtype = np.dtype(header["descr"])
            shape = tuple(int(x) for x in header["shape"])
        except (ValueError, SyntaxError, KeyError, TypeError) as exc:
            raise CheckpointError(f".npy header is malformed: {exc}") from None
        if dtype.hasobject:
            raise CheckpointError(".npy object arrays are pickles; git-theta does not read them")
        start = 8 + (2 if major == 1 else 4) + size
        name = _NAMES.get(dtype.str, f"NPY{dtype.str}")
        return [TensorSpan("array", name, shape, start, start + math.prod(shape) * dtype.itemsize)]
