"""Tensor bytes as working floats and back, without ml_dtypes (not a runtime dependency).

A merge computes in float32 (float64 for F64) and rounds once to the tensor's dtype,
round to nearest, ties to even, as torch and ml_dtypes do. This module also says which
bytes make one "unit" of the element-wise three-way step for every dtype.
"""

from __future__ import annotations

import numpy as np

from git_theta.dtypes import BLOCKS, DTYPES

# The small float types: (exponent bits, mantissa bits, bias, kind). "ieee" has inf and
# NaN at the top exponent; "fn" has no inf and NaN only at all-ones; "fnuz" has no inf,
# no -0.0, and NaN at 0x80.
_FP8 = {
    "F8_E4M3": (4, 3, 7, "fn"),
    "F8_E5M2": (5, 2, 15, "ieee"),
    "F8_E4M3FNUZ": (4, 3, 8, "fnuz"),
    "F8_E5M2FNUZ": (5, 2, 16, "fnuz"),
}
_STORAGE = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "BF16": "<u2"}
_UINT = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def add_left(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a += b``, where both are NaN giving ``a``'s NaN (quieted) wherever the element
    is, and return ``a``. NumPy's SIMD loop returns the left operand's NaN but its scalar
    tail the right one's (the last elements of a tensor), and the C merge kernel always
    the left one's (x86's rule): the definition pins it, so a merge's bytes do not depend
    on the kernel or on where a NaN sits."""
    left = np.isnan(a)
    if not left.any():
        a += b
        return a
    keep = a[left]
    a += b
    a[left] = keep + a.dtype.type(0)  # the one NaN of this add: quieted, in any order
    return a


def combinable(dtype: str) -> bool:
    """Return True when computing strategies (average, TIES, ...) can merge ``dtype``:
    F16, BF16, F32, F64 and the FP8 types. Integers, bool, complex, block-quantized and
    unknown dtypes are resolved only by ours, theirs or base."""
    return dtype in _STORAGE or dtype in _FP8


def unit_bytes(dtype: str, nbytes: int) -> int:
    """Return the size in bytes of one unit the three-way step compares: an element, a
    quantization block, the bytes holding whole packed sub-byte elements, or the whole
    tensor for a dtype we do not know (always divides ``nbytes``)."""
    known = DTYPES.get(dtype)
    if known is not None:
        size = known.bits // 8 if known.bits % 8 == 0 else known.bits  # F4: 1 byte, F6: 3
        size = 1 if known.bits == 4 else size
    elif dtype in BLOCKS:
        size = BLOCKS[dtype][1]
    else:
        size = nbytes
    return size if size and nbytes % size == 0 else max(nbytes, 1)


def units(data: np.ndarray, size: int) -> np.ndarray:
    """Return a view of contiguous bytes ``data`` with one row (or unsigned int) per unit."""
    flat = data.reshape(-1).view(np.uint8)
    if size in _UINT:
        return flat.view(_UINT[size])
    return flat.reshape(-1, size)


def _fp8_table(dtype: str) -> np.ndarray:
    """Return the float32 value of each of the 256 codes of FP8 type ``dtype``."""
    ebits, mbits, bias, kind = _FP8[dtype]
    codes = np.arange(256, dtype=np.int64)
    exp = (codes >> mbits) & ((1 << ebits) - 1)
    man = codes & ((1 << mbits) - 1)
    normal = (1.0 + man / (1 << mbits)) * np.exp2(exp - bias)
    sub = man / (1 << mbits) * np.exp2(1 - bias)
    mag = np.where(exp == 0, sub, normal)
    values = np.where(codes >> 7, -mag, mag)
    if kind == "ieee":
        top = exp == (1 << ebits) - 1
        values = np.where(top & (man == 0), np.copysign(np.inf, values), values)
        values[top & (man != 0)] = np.nan
    elif kind == "fn":
        values[(codes & 0x7F) == 0x7F] = np.nan
    else:
        values[0x80] = np.nan
    table: np.ndarray = values.astype(np.float32)
    return table


def widen(data: np.ndarray, dtype: str, copy: bool = True) -> np.ndarray:
    """Return the values of contiguous tensor bytes ``data`` (any view) as a 1-D float32
    array (float64 for F64), only for a ``combinable`` dtype: a new array, or for F32
    and F64 with ``copy`` false a view of ``data`` (for a caller's own scratch copy)."""
    flat = data.reshape(-1).view(np.uint8)
    if dtype == "F64":
        return flat.view("<f8").astype(np.float64, copy=copy)
    if dtype == "F32":
        return flat.view("<f4").astype(np.float32, copy=copy)
    if dtype == "F16":
        return flat.view("<f2").astype(np.float32)
    if dtype == "BF16":  # the top half of a float32
        wide = flat.view("<u2").astype(np.uint32)
        wide <<= np.uint32(16)
        return wide.view(np.float32)
    return _fp8_table(dtype)[flat]


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """Return float32 ``values`` rounded to BF16 bit patterns (nearest, ties to even; a
    NaN stays a quiet NaN with its sign)."""
    bits = values.view(np.uint32)
    out = bits >> np.uint32(16)
    out &= np.uint32(1)
    out += np.uint32(0x7FFF)
    out += bits  # a carry out of the mantissa correctly rounds up the exponent
    out >>= np.uint32(16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)
    return out.astype("<u2")


def _fp8_codes(values: np.ndarray, dtype: str) -> np.ndarray:
    """Return float32 ``values`` rounded to FP8 codes (nearest, ties to even code; past
    the largest value, inf for E5M2 and NaN for the types without inf, as ml_dtypes)."""
    kind = _FP8[dtype][3]
    table = _fp8_table(dtype).astype(np.float64)
    top = 0x7B if kind == "ieee" else (0x7E if kind == "fn" else 0x7F)  # largest finite
    ulp = table[top] - table[top - 1]
    # Magnitudes of codes 0..top in increasing order, plus the first value past the top
    # (standing for overflow: its code is top + 1, odd, so a tie there rounds down).
    grid = np.append(table[: top + 1], table[top] + ulp)
    mag = np.abs(values.astype(np.float64))
    hi = np.minimum(np.searchsorted(grid, mag, side="left"), top + 1)
    lo = np.maximum(hi - 1, 0)
    down = mag - grid[lo]
    up = grid[hi] - mag
    pick_lo = (down < up) | ((down == up) & (lo % 2 == 0))
    code = np.where(pick_lo, lo, hi).astype(np.int64)
    code = np.where(mag > grid[-1], top + 1, code)  # beyond the overflow point
    overflow = code > top
    nan_code = 0x80 if kind == "fnuz" else (0x7F if kind == "fn" else 0x7E)
    if kind == "ieee":
        code[overflow] = 0x7C  # inf
    else:
        code[overflow] = nan_code
    negative = np.signbit(values)
    if kind == "fnuz":
        code = np.where(negative & (code != 0) & (code != 0x80), code | 0x80, code)
    else:
        code = np.where(negative, code | 0x80, code)
    nan = np.isnan(values)
    code[nan] = nan_code if kind == "fnuz" else nan_code | (np.signbit(values[nan]) * 0x80)
    return code.astype(np.uint8)


def narrow(values: np.ndarray, dtype: str) -> np.ndarray:
    """Return float32 (float64 for F64) ``values`` rounded once to ``dtype``, as a
    contiguous 1-D array of its storage type (``<u2`` for BF16, ``u1`` for FP8)."""
    flat = values.reshape(-1)
    if dtype == "F64":
        return flat.astype("<f8", copy=False)
    if dtype == "F32":
        return flat.astype("<f4", copy=False)
    if dtype == "F16":
        return flat.astype("<f2")  # NumPy rounds float32 -> float16 to nearest even
    if dtype == "BF16":
        return _bf16_bits(np.ascontiguousarray(flat, dtype=np.float32))
    return _fp8_codes(flat, dtype)
