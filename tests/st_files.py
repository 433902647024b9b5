"""Writing safetensors files byte by byte, so tests control every header detail."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np


def st_bytes(
    tensors: Mapping[str, tuple[str, tuple[int, ...], bytes]],
    metadata: Mapping[str, str] | None = None,
    pad_to: int = 8,
) -> bytes:
    """Return a safetensors file holding ``tensors`` (name -> (dtype, shape, raw bytes))."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % pad_to)
    return struct.pack("<Q", len(text)) + text + b"".join(raw for _, _, raw in tensors.values())


def f32(name_shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in name_shapes.items()}


def st_from_arrays(
    arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> bytes:
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}
    return st_bytes(
        {k: (names[a.dtype], a.shape, a.tobytes()) for k, a in arrays.items()}, metadata
    )
