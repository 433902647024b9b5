"""Element types: their size and how their bytes are laid out for compression.

Names are the safetensors spellings, which the manifest records; other formats map their
own names onto these.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class DType(NamedTuple):
    name: str
    bits: int  # bits per element
    word: int  # bytes per float/int word whose bytes are grouped into planes (1 = no grouping)
    is_float: bool  # sign bit on top of ``word``: rotate it below the exponent before grouping

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Return the byte size of a tensor of this type and ``shape``."""
        return (math.prod(shape) * self.bits + 7) // 8


_TABLE = [
    DType("BOOL", 8, 1, False),
    DType("U8", 8, 1, False),
    DType("I8", 8, 1, False),
    DType("F8_E5M2", 8, 1, False),
    DType("F8_E4M3", 8, 1, False),
    DType("F8_E4M3FNUZ", 8, 1, False),
    DType("F8_E5M2FNUZ", 8, 1, False),
    DType("F8_E8M0", 8, 1, False),
    DType("F4", 4, 1, False),
    DType("F6_E2M3", 6, 1, False),
    DType("F6_E3M2", 6, 1, False),
    DType("I16", 16, 2, False),
    DType("U16", 16, 2, False),
    DType("F16", 16, 2, True),
    DType("BF16", 16, 2, True),
    DType("I32", 32, 4, False),
    DType("U32", 32, 4, False),
    DType("F32", 32, 4, True),
    DType("I64", 64, 8, False),
    DType("U64", 64, 8, False),
    DType("F64", 64, 8, True),
    DType("C64", 64, 4, True),  # two F32 words
    DType("C128", 128, 8, True),  # two F64 words
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}


def lookup(name: str) -> DType | None:
    """Return the DType called ``name``, or None for a type we do not know."""
    return DTYPES.get(name)


# NumPy / ml_dtypes names (``dtype.name``) of the types above, for formats that record them.
_NUMPY_NAMES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "int16": "I16",
    "uint16": "U16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32",
    "float32": "F32", "int64": "I64", "uint64": "U64", "float64": "F64",
    "complex64": "C64", "complex128": "C128",
}  # fmt: skip


def from_numpy_name(name: str) -> str:
    """Return our name for NumPy dtype ``name``, or ``np:<name>`` for one we do not know
    (its bytes are still kept exactly, as plain bytes)."""
    return _NUMPY_NAMES.get(name, f"np:{name}")


# Float dtypes the C kernel widens to double exactly (_planes.c's widen()): the codes
# diff_stats and factored take.
FLOAT_KINDS = {"F32": 0, "F64": 1, "F16": 2, "BF16": 3}
