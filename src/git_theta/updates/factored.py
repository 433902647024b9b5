"""low-rank and ia3: changes described by user-supplied factors, stored exactly.

``low-rank`` takes ``R`` and ``C`` (the change is ``scale * R @ C``) and ``ia3`` takes a
scale vector per tensor, from the file given with ``--update-path``. What is stored is the
factors plus a correction: the difference between the user's file and what the factors
reproduce. So the committed tensor is exactly the user's file (git status stays clean, and
a checkout anywhere gives the same bytes); when the file was made from the factors, the
correction is almost all zeros and costs little. How far the factors alone are from the
file (max abs error) is reported on stderr.

The reproduction is computed in float64, one rank at a time, with elementwise operations
only, so it is bit-identical on every machine (no BLAS reduction order involved).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from git_theta import codec, kernels
from git_theta.dtypes import FLOAT_KINDS, lookup
from git_theta.errors import ObjectCorruptError, UsageError
from git_theta.updates.base import Buffer, Payload, UpdateType
from git_theta.updates.delta import _UNSIGNED, _size, _unzigzag, _zigzag
from git_theta.updates.layout import layout_for

if TYPE_CHECKING:  # NumPy loads when needed: a checkout through the C kernel never does
    from pathlib import Path

    import numpy as np

MAGIC = b"GTFX"
_LEN = struct.Struct("<I")
FLOATS = ("F64", "F32", "F16", "BF16")


class Factor(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    raw: bytes  # as given, stored as is

    def values(self) -> np.ndarray:
        from git_theta.values import as_float64

        out = as_float64(self.raw, self.dtype)
        if out is None:
            raise UsageError(f"factors of dtype {self.dtype} are not supported")
        return out.reshape(self.shape)


class Inputs(NamedTuple):
    kind: str  # "low-rank" or "ia3"
    factors: tuple[Factor, ...]  # (R, C) or (vector,)
    scale: float = 1.0


def _to_dtype(values: np.ndarray, dtype: str) -> bytes:
    """Round float64 values to ``dtype`` (round to nearest even), deterministically."""
    import numpy as np

    if dtype == "F64":
        return values.astype("<f8").tobytes()
    if dtype == "F16":
        return values.astype("<f2").tobytes()
    bits = values.astype("<f4").view("<u4")
    if dtype == "F32":
        return bits.tobytes()
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> 16
    return rounded.astype("<u2").tobytes()


_CODES = FLOAT_KINDS  # _planes.factored's dtype codes
_SIZES = (4, 8, 2, 2)  # bytes per value, by code


def reproduce(prev: Buffer, dtype: str, shape: tuple[int, ...], inputs: Inputs) -> bytes | None:
    """The new value the factors describe, or None when they do not fit the tensor.

    The C kernel computes it where it can (float dtypes, no NaN among the inputs), with
    the same operations in the same order as ``reproduce_numpy``, the definition.
    """
    native = kernels.native
    if native is not None and len(shape) == 2 and dtype in _CODES:
        codes = [_CODES.get(f.dtype) for f in inputs.factors]
        rows, cols = shape
        a = inputs.factors[0]
        guess: bytes | None = None
        try:
            if inputs.kind == "low-rank" and len(a.shape) == 2 and a.shape[1] > 0:
                b = inputs.factors[1]
                # The shapes the definition accepts, not just element counts that fit.
                if None not in codes and a.shape[0] == rows and b.shape == (a.shape[1], cols):
                    guess = native.factored(
                        prev, _CODES[dtype], rows, cols, a.raw, codes[0], b.raw, codes[1],
                        a.shape[1], inputs.scale,
                    )  # fmt: skip
            elif (
                inputs.kind == "ia3"
                and codes[0] is not None
                and math.prod(a.shape) * _SIZES[codes[0]] == len(a.raw)  # as declared
            ):
                guess = native.factored(
                    prev, _CODES[dtype], rows, cols, a.raw, codes[0], b"", 0, 0, 1.0
                )
        except (ValueError, OverflowError):
            pass  # shapes that do not fit: the definition decides what that means
        if guess is not None:
            return guess
    return reproduce_numpy(prev, dtype, shape, inputs)


def reproduce_numpy(
    prev: Buffer, dtype: str, shape: tuple[int, ...], inputs: Inputs
) -> bytes | None:
    """The definition of ``reproduce``, in NumPy float64."""
    import numpy as np

    from git_theta.values import as_float64

    base = as_float64(prev, dtype)
    if base is None or len(shape) != 2:
        return None
    rows, cols = shape
    base = base.reshape(rows, cols)
    if inputs.kind == "low-rank":
        r, c = (f.values() for f in inputs.factors)
        if r.ndim != 2 or c.ndim != 2 or r.shape[0] != rows or c.shape[1] != cols:
            return None
        if r.shape[1] != c.shape[0]:
            return None
        change = np.zeros((rows, cols))
        for k in range(r.shape[1]):  # one rank at a time: elementwise, so exact everywhere
            change += np.multiply.outer(r[:, k], c[k, :])
        return _to_dtype(base + inputs.scale * change, dtype)
    vector = inputs.factors[0].values().reshape(-1)
    if vector.size == rows:
        return _to_dtype(base * vector[:, None], dtype)
    if vector.size == cols:
        return _to_dtype(base * vector[None, :], dtype)
    return None


class Factored(UpdateType):
    """Shared by low-rank and ia3; ``inputs`` maps tensor names to their factors."""

    codec = "gtfx1"
    kind = ""

    def __init__(self, inputs: dict[str, Inputs] | None = None):
        self.inputs = inputs or {}

    def with_inputs(self, path: str) -> UpdateType:
        from pathlib import Path  # an add with factors; checkouts of these chains skip it

        found = {k: v for k, v in load_inputs(Path(path)).items() if v.kind == self.kind}
        if not found:
            raise UsageError(f"{path}: no {self.kind} factors found")
        return type(self)(found)

    def _find(self, name: str) -> Inputs | None:
        if name in self.inputs:
            return self.inputs[name]
        for key, value in self.inputs.items():  # adapters often add or drop a prefix
            if key.endswith("." + name) or name.endswith("." + key):
                return value
        return None

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        return None  # needs the tensor's name: see pick

    def pick(
        self,
        new: Buffer,
        prev: Buffer | None,
        dtype: str,
        dense: Callable[[], list[bytes]],
        dense_estimate: int | None = None,
        name: str = "",
        shape: tuple[int, ...] = (),
    ) -> tuple[str, list[bytes] | None]:
        from git_theta.updates.auto import Auto

        inputs = self._find(name)
        guess = None
        if inputs is not None and prev is not None and dtype in FLOATS:
            guess = reproduce(prev, dtype, shape, inputs)
        if guess is None or len(guess) != len(new):
            # No factors for this tensor (or they do not fit it): store it the best way.
            return Auto().pick(new, prev, dtype, dense, dense_estimate, name, shape)
        error = _max_error(new, guess, dtype)
        sys.stderr.write(
            f"git-theta: {name}: {self.kind} factors reproduce the file within {error:.3g} "
            "(max abs); the rest is stored exactly as a correction\n"
        )
        assert inputs is not None
        size = _size(dtype)
        correction = codec.encode(_zigzag(new, guess, size).tobytes(), codec.Layout(size))
        blobs = [b"".join(codec.encode(f.raw, layout_for(f.dtype))) for f in inputs.factors]
        header = {
            "kind": self.kind,
            "scale": inputs.scale,
            "factors": [
                {"dtype": f.dtype, "shape": list(f.shape), "size": len(blob)}
                for f, blob in zip(inputs.factors, blobs, strict=True)
            ],
            "shape": list(shape),
        }
        text = json.dumps(header, sort_keys=True).encode()
        return self.key, [MAGIC, _LEN.pack(len(text)), text, *blobs, *correction]

    def summary(self, payload: Payload, limit: int | None = None) -> str:
        try:
            inputs, _, _ = _read_payload(payload, self.kind, limit)
        except ObjectCorruptError:
            return ""
        return _summary(inputs)

    def apply(
        self, prev: bytearray | None, payload: Payload, dtype: str, limit: int | None = None
    ) -> bytearray:
        if prev is None:
            raise ObjectCorruptError(f"a {self.kind} update needs a previous value")
        inputs, shape, pos = _read_payload(payload, self.kind, len(prev))
        if dtype not in FLOATS or math.prod(shape) * _size(dtype) != len(prev):
            raise ObjectCorruptError(f"{self.kind} update does not fit the previous value")
        guess = reproduce(prev, dtype, shape, inputs)
        correction = codec.decode(memoryview(payload)[pos:], limit=len(prev))
        if guess is None or len(guess) != len(correction):
            raise ObjectCorruptError(f"{self.kind} update does not fit the previous value")
        size = _size(dtype)
        if kernels.native is not None:
            value = bytearray(guess)
            kernels.native.unzigzag_add(value, correction, size)
            return value
        import numpy as np

        return _unzigzag(np.frombuffer(correction, dtype=_UNSIGNED[size]), guess, size)


_MAX_HEADER = 1 << 16  # the JSON header of a payload is a few hundred bytes
# A rank beyond the smaller side of the tensor adds nothing; a little slack beyond it
# keeps factors for a small head (2 x 768 with r = 8) while bounding what a hostile
# payload can make a checkout compute (rows x cols x rank) and hold.
_RANK_SLACK = 256


def _read_payload(
    payload: Payload, kind: str, limit: int | None
) -> tuple[Inputs, tuple[int, ...], int]:
    """Return (factors, the tensor's shape, where the correction starts) of a payload for
    a value of at most ``limit`` bytes; every length is checked before it is decoded.

    Raises ObjectCorruptError when the payload is malformed or does not fit.
    """

    def corrupt(why: str) -> ObjectCorruptError:
        return ObjectCorruptError(f"{kind} update object is corrupt: {why}")

    if len(payload) < 8 or payload[:4] != MAGIC:
        raise ObjectCorruptError(f"not a {kind} update object")
    (length,) = _LEN.unpack_from(payload, 4)
    if length > min(_MAX_HEADER, len(payload) - 8):
        raise corrupt("its header length is wrong")
    try:
        header = json.loads(bytes(payload[8 : 8 + length]))
    except (ValueError, RecursionError):
        raise corrupt("its header is not JSON") from None
    if not isinstance(header, dict) or header.get("kind") != kind:
        raise corrupt(f"it is not a {kind} header")
    shape = _dims(header.get("shape"))
    scale, found = header.get("scale"), header.get("factors")
    if len(shape) != 2 or not isinstance(scale, int | float) or not isinstance(found, list):
        raise corrupt("its header is malformed")
    rows, cols = shape
    if limit is not None and rows * cols > limit:  # every float dtype takes 2+ bytes
        raise corrupt(f"shape {list(shape)} is larger than the value")
    pos = 8 + length
    factors = []
    for f in found:
        if not isinstance(f, dict):
            raise corrupt("a factor is malformed")
        known, f_shape, size = lookup(f.get("dtype", "")), _dims(f.get("shape")), f.get("size")
        if known is None or known.bits % 8 or known.name in ("C64", "C128"):
            raise corrupt("a factor has a dtype factors cannot have")
        if type(size) is not int or size < 0:
            raise corrupt("a factor is malformed")
        factors.append((known, f_shape, size))
    if kind == "low-rank":
        rank = factors[0][1][-1] if len(factors) == 2 and len(factors[0][1]) == 2 else -1
        fits = [f[1] for f in factors] == [(rows, rank), (rank, cols)]
        fits = fits and rank <= max(min(rows, cols), _RANK_SLACK)
    else:
        fits = len(factors) == 1 and math.prod(factors[0][1]) in (rows, cols)
    if not fits:
        raise corrupt("its factors do not fit the tensor")
    out = []
    for known, f_shape, size in factors:
        if pos + size > len(payload):
            raise corrupt("it is truncated")
        nbytes = known.nbytes(f_shape)
        raw = codec.decode(memoryview(payload)[pos : pos + size], limit=nbytes)
        if len(raw) != nbytes:
            raise corrupt("a factor has the wrong length")
        out.append(Factor(known.name, f_shape, bytes(raw)))
        pos += size
    return Inputs(kind, tuple(out), float(scale)), shape, pos


def _dims(value: object) -> tuple[int, ...]:
    """A shape from a payload header: a list of at most 8 non-negative integers."""
    if not isinstance(value, list) or len(value) > 8:
        raise ObjectCorruptError("update object has a malformed shape")
    if not all(type(d) is int and 0 <= d < 1 << 40 for d in value):
        raise ObjectCorruptError("update object has a malformed shape")
    return tuple(value)


def _summary(inputs: Inputs) -> str:
    import numpy as np

    norms = []
    for f in inputs.factors:
        values = f.values()
        norms.append(float(np.sqrt(np.sum(values * values))))
    if inputs.kind == "low-rank":
        rank = inputs.factors[0].shape[-1]
        return (
            f"low-rank update: rank {rank}, scale {inputs.scale:.4g}, "
            f"|R| {norms[0]:.4g}, |C| {norms[1]:.4g}"
        )
    return f"ia3 update: {list(inputs.factors[0].shape)} scales, |v| {norms[0]:.4g}"


def _max_error(new: Buffer, guess: bytes, dtype: str) -> float:
    import numpy as np

    from git_theta.values import as_float64

    a, b = as_float64(new, dtype), as_float64(guess, dtype)
    if a is None or b is None:
        return math.nan
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    finite = diff[np.isfinite(diff)]
    return float(finite.max()) if finite.size else 0.0


class LowRank(Factored):
    key = "low-rank"
    kind = "low-rank"


class IA3(Factored):
    key = "ia3"
    kind = "ia3"


def _read_safetensors(path: Path) -> dict[str, Factor]:
    from git_theta.formats import header_spans
    from git_theta.formats.safetensors import SafetensorsFormat

    data = path.read_bytes()
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise UsageError(f"{path}: truncated safetensors file")
        pos += n
        return data[pos - n : pos]

    spans = header_spans(SafetensorsFormat(), read)
    return {s.name: Factor(s.dtype, s.shape, data[s.start : s.end]) for s in spans}


def load_inputs(path: Path) -> dict[str, Inputs]:
    """Read factors from a safetensors file: ``T/R`` + ``T/C`` (low-rank), ``T/ia3`` (ia3),
    or a PEFT adapter (``lora_A``/``lora_B``, ``ia3_l``; LoRA scaled by lora_alpha / r)."""
    if not path.is_file():
        raise UsageError(f"--update-path {path}: no such file")
    tensors = _read_safetensors(path)
    out: dict[str, Inputs] = {}
    for key, factor in tensors.items():
        if key.endswith("/R") and key[:-2] + "/C" in tensors:
            out[key[:-2]] = Inputs("low-rank", (factor, tensors[key[:-2] + "/C"]))
        elif key.endswith("/ia3"):
            out[key[:-4]] = Inputs("ia3", (factor,))
    lora = {k: v for k, v in tensors.items() if ".lora_A." in k}
    if lora:
        config_path = path.with_name("adapter_config.json")
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        for key, a in lora.items():
            b = tensors.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                continue
            rank = a.shape[0]
            alpha = float(config.get("lora_alpha", rank))
            scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            target = key.removeprefix("base_model.model.").replace(".lora_A.", ".")
            out[target] = Inputs("low-rank", (b, a), scale)
    for key, factor in tensors.items():
        if ".ia3_l." in key:
            target = key.removeprefix("base_model.model.").replace(".ia3_l.", ".")
            out[target] = Inputs("ia3", (factor,))
    return out
