"""Tensor bytes as numbers, for reports: every dtype we can widen to float64 exactly."""

from __future__ import annotations

import numpy as np

_NUMPY = {
    "BOOL": "u1", "U8": "u1", "I8": "i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
    "I32": "<i4", "U32": "<u4", "F32": "<f4", "I64": "<i8", "U64": "<u8", "F64": "<f8",
}  # fmt: skip
_ML_DTYPES = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def as_float64(data: bytes | bytearray | memoryview, dtype: str) -> np.ndarray | None:
    """Return the tensor's values as float64, or None for a dtype we cannot widen."""
    if dtype in _NUMPY:
        return np.frombuffer(data, dtype=_NUMPY[dtype]).astype(np.float64)
    if dtype == "BF16":  # the top half of a float32
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(np.float64)
    if dtype in ("C64", "C128"):
        return None
    if dtype in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.frombuffer(data, dtype=getattr(ml_dtypes, _ML_DTYPES[dtype])).astype(np.float64)
    return None


def elements_changed(old: bytes | bytearray, new: bytes | bytearray, itemsize: int) -> int:
    """Count elements whose bits differ (so -0.0 vs 0.0 counts, an equal NaN does not)."""
    if itemsize in (1, 2, 4, 8):
        kind = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}[itemsize]
        a = np.frombuffer(old, dtype=kind)
        b = np.frombuffer(new, dtype=kind)
        return int(np.count_nonzero(a != b))
    a8 = np.frombuffer(old, dtype=np.uint8).reshape(-1, itemsize)
    b8 = np.frombuffer(new, dtype=np.uint8).reshape(-1, itemsize)
    return int(np.count_nonzero((a8 != b8).any(axis=1)))
