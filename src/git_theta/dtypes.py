"""Element types: their size and how their bytes are laid out for compression.

Names are the safetensors spellings, which the manifest records; other formats map their
own names onto these.
"""

from __future__ import annotations

import math

from git_theta.records import NamedTuple


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


# Block-quantized types (GGUF's ggml types, kept as raw blocks): name -> (elements per
# block, bytes per block), from the GGUF spec. A tensor holds whole blocks along its
# innermost dimension. They are opaque bytes to the codec, so they are not in DTYPES.
BLOCKS: dict[str, tuple[int, int]] = {
    "GGML_Q4_0": (32, 18), "GGML_Q4_1": (32, 20), "GGML_Q5_0": (32, 22),
    "GGML_Q5_1": (32, 24), "GGML_Q8_0": (32, 34), "GGML_Q8_1": (32, 36),
    "GGML_Q2_K": (256, 84), "GGML_Q3_K": (256, 110), "GGML_Q4_K": (256, 144),
    "GGML_Q5_K": (256, 176), "GGML_Q6_K": (256, 210), "GGML_Q8_K": (256, 292),
    "GGML_IQ2_XXS": (256, 66), "GGML_IQ2_XS": (256, 74), "GGML_IQ3_XXS": (256, 98),
    "GGML_IQ1_S": (256, 50), "GGML_IQ4_NL": (32, 18), "GGML_IQ3_S": (256, 110),
    "GGML_IQ2_S": (256, 82), "GGML_IQ4_XS": (256, 136), "GGML_IQ1_M": (256, 56),
    "GGML_TQ1_0": (256, 54), "GGML_TQ2_0": (256, 66),
    # gpt-oss's MXFP4 (an E8M0 scale and 32 FP4 values), NVFP4 and the 1-bit Q1_0
    "GGML_MXFP4": (32, 17), "GGML_NVFP4": (64, 36), "GGML_Q1_0": (128, 18),
}  # fmt: skip


def expected_nbytes(name: str, shape: tuple[int, ...]) -> int | None:
    """Return the bytes a tensor of type ``name`` and ``shape`` takes: None for a type
    whose element size we do not know, -1 when ``shape`` is not whole blocks of a
    block-quantized type."""
    known = DTYPES.get(name)
    if known is not None:
        return known.nbytes(shape)
    if name in BLOCKS:
        elements, nbytes = BLOCKS[name]
        if not shape or shape[-1] % elements:
            return -1
        return math.prod(shape) // elements * nbytes
    return None


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
