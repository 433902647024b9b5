"""Framework arrays <-> (dtype name, shape, raw little-endian bytes).

Names are git-theta's (the safetensors spellings, ``dtypes.DTYPES``). torch, NumPy and
JAX are imported only when a value of theirs is seen or asked for.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from git_theta.errors import UsageError

# torch dtype attribute name -> ours. Looked up with getattr: older torch lacks some.
_TORCH_NAMES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16",
    "bfloat16": "BF16", "float32": "F32", "float64": "F64", "complex64": "C64",
    "complex128": "C128", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}  # fmt: skip

# ours -> NumPy / ml_dtypes dtype name
_NUMPY_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "C128": "complex128", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip


class RawTensor(NamedTuple):
    """One tensor as git-theta stores it: its bytes are C-ordered, little-endian."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # format "B", len = shape x dtype
    owner: Any  # keeps the memory ``data`` points into alive


def is_torch(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_array(value: object) -> bool:
    """Whether ``value`` is a tensor git-theta can store (torch, NumPy, JAX)."""
    if is_torch(value):
        return True
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray | np.generic):
        return True
    return hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape")


def numpy_dtype(dtype: str) -> Any:
    """The NumPy dtype of our ``dtype`` (ml_dtypes for bf16 and fp8), or None."""
    import numpy as np

    name = _NUMPY_NAMES.get(dtype)
    if name is None:
        return None
    try:
        return np.dtype(name).newbyteorder("<")
    except TypeError:
        import ml_dtypes  # registers bfloat16 and the float8 types with NumPy

        return np.dtype(getattr(ml_dtypes, name))


def raw(value: Any, name: str) -> RawTensor:
    """``value`` (torch tensor, NumPy or JAX array) as raw bytes; raises UsageError for
    anything else or a dtype git-theta cannot name."""
    if is_torch(value):
        import torch

        key = str(value.dtype).removeprefix("torch.")
        dtype = _TORCH_NAMES.get(key)
        if dtype is None:
            raise UsageError(f"tensor {name!r}: torch dtype {key} is not one git-theta stores")
        # conj and neg views are lazy flags over the same memory: resolve them first
        t = value.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        shape = tuple(int(d) for d in t.shape)
        if t.numel() == 0:
            return RawTensor(dtype, shape, memoryview(b""), None)
        flat = t.reshape(-1).view(torch.uint8)  # every dtype: its bytes, no copy
        array = flat.numpy()
        return RawTensor(dtype, shape, memoryview(array).cast("B"), (t, array))
    if not is_array(value):
        raise UsageError(
            f"{name!r} is a {type(value).__name__}, not a tensor (torch, NumPy or JAX array)"
        )
    import numpy as np

    array = np.asarray(value)  # JAX arrays: copied to the host once
    from git_theta.dtypes import from_numpy_name

    dtype = from_numpy_name(array.dtype.name)
    if dtype.startswith("np:"):
        raise UsageError(f"tensor {name!r}: NumPy dtype {array.dtype} is not one git-theta stores")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    shape = tuple(int(d) for d in array.shape)  # before: ascontiguousarray makes 0-d 1-d
    array = np.ascontiguousarray(array)
    as_bytes: Any = array.reshape(-1).view(np.uint8)
    return RawTensor(dtype, shape, memoryview(as_bytes), array)


def to_numpy(data: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> Any:
    """A NumPy array over ``data`` (not copied); a dtype NumPy has no type for comes back
    as its raw bytes (uint8)."""
    import numpy as np

    np_dtype = numpy_dtype(dtype)
    if np_dtype is None:
        return np.frombuffer(data, dtype=np.uint8)
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)


def to_torch(data: bytearray, dtype: str, shape: tuple[int, ...]) -> Any:
    """A torch tensor over ``data`` (not copied; writable); raises UsageError for a dtype
    torch has no type for."""
    import torch

    names = {ours: theirs for theirs, ours in _TORCH_NAMES.items()}
    t_dtype = getattr(torch, names.get(dtype, "-"), None)
    if t_dtype is None:
        raise UsageError(f"dtype {dtype} has no torch type; read it as NumPy instead")
    if not data:
        return torch.empty(shape, dtype=t_dtype)
    return torch.frombuffer(data, dtype=t_dtype).reshape(shape)


def to_jax(data: bytearray, dtype: str, shape: tuple[int, ...]) -> Any:
    import jax.numpy as jnp

    return jnp.asarray(to_numpy(data, dtype, shape))
