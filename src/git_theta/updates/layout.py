"""How a dtype's bytes are split into planes for the codec."""

from __future__ import annotations

from git_theta.codec import Layout
from git_theta.dtypes import lookup


def layout_for(dtype: str) -> Layout:
    """Return how to split a tensor of ``dtype`` into byte planes."""
    known = lookup(dtype)
    if known is None or known.bits % 8 or known.word == 1:
        return Layout()
    return Layout(known.word, known.is_float)


def itemsize(dtype: str) -> int:
    """Bytes per element (1 for sub-byte and unknown types: they change byte by byte)."""
    known = lookup(dtype)
    return known.bits // 8 if known is not None and known.bits % 8 == 0 else 1
