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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from git_theta import codec, kernels
from git_theta.display import escape
from git_theta.dtypes import FLOAT_KINDS, lookup
from git_theta.errors import ObjectCorruptError, UsageError
from git_theta.records import NamedTuple
from git_theta.updates.base import Buffer, Payload, Picked, UpdateType, factor_objects
from git_theta.updates.delta import _UNSIGNED, _size, _unzigzag, _zigzag
from git_theta.updates.dense import Dense
from git_theta.updates.layout import layout_for

if TYPE_CHECKING:  # NumPy loads when needed: a checkout through the C kernel never does
    import numpy as np

    from git_theta.updates.peft_adapter import Found

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
    """One update described by factors: low-rank ``(R, C)`` or ia3 ``(vector,)``.

    ``transpose``: the change is ``(R @ C).T`` (PEFT's fan_in_fan_out; for ia3 the
    vector's 2-D shape is transposed). ``broadcast``: an ia3 vector broadcasts to the
    tensor by its own shape (NumPy's rule) rather than by its length. ``rounding``:
    how the new value is computed from the factors (``ROUNDINGS``). The defaults are
    what a payload without these keys means, so older objects read as they were written.
    """

    kind: str  # "low-rank" or "ia3"
    factors: tuple[Factor, ...]  # (R, C) or (vector,)
    scale: float = 1.0
    transpose: bool = False
    broadcast: bool = False
    rounding: str = "f64"


# How a value is computed from its factors; both are exact, deterministic definitions
# (elementwise IEEE operations only, no BLAS), so every machine rebuilds the same bits:
# - "f64": the change summed in float64 one rank at a time, added to the previous value
#   in float64, rounded once to the tensor's dtype (the first definition);
# - "steps": the way torch computes ``W += (B @ A) * scale`` (peft's merge) and NumPy
#   ``W + scale * (R @ C)`` in float32: the product accumulated rank by rank as fused
#   multiply-adds rounded to float32 (torch's CPU matmul for LoRA ranks), times the scale
#   rounded to float32, rounded to the tensor's dtype when the factors have it (peft
#   casts a 16-bit delta back), added in float32 and rounded to the tensor's dtype.
ROUNDINGS = ("f64", "steps")


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


def _plain(inputs: Inputs) -> bool:
    """True when ``inputs`` use the first definition (what the C kernel computes)."""
    return not (inputs.transpose or inputs.broadcast) and inputs.rounding == "f64"


def matrix_shape(
    kind: str, factor_shapes: list[tuple[int, ...]], shape: tuple[int, ...], transpose: bool,
    broadcast: bool,
) -> tuple[int, int, int] | None:  # fmt: skip
    """How factors of ``factor_shapes`` apply to a tensor of ``shape``: (stack, rows, cols)
    of the matrices they change (the tensor viewed as ``stack`` matrices of rows x cols,
    in C order), or None when they do not fit it.

    Low-rank: 2-D ``R`` (m, k) and ``C`` (k, n) change the tensor viewed as (shape[0],
    the rest), so a conv kernel (out, in, kh, kw) takes PEFT's (out, r) @ (r, in*kh*kw);
    with ``transpose`` the tensor is (n, m). Factors of 3+ dimensions are a stack of
    matrices over the leading dimensions, as git-theta's predecessor applied ``R @ C``:
    ``R`` (*lead, m, k), ``C`` (*lead, k, n) for a tensor (*lead, m, n). Ia3: a vector of
    the rows' or the columns' length of a 2-D tensor, or with ``broadcast`` a shape that
    broadcasts to the tensor's (of a 1-D tensor: its length).
    """
    size = math.prod(shape)
    if kind == "ia3":
        if len(factor_shapes) != 1:
            return None
        f = factor_shapes[0]
        if not broadcast:
            if len(shape) == 2 and math.prod(f) in shape:
                return 1, shape[0], shape[1]
            return None
        if len(shape) == 1:  # a vector of its length, or one scale (NumPy broadcasting)
            return (1, 1, shape[0]) if math.prod(f) in (shape[0], 1) else None
        if transpose:
            if len(f) != 2:
                return None
            f = (f[1], f[0])
        while len(f) > len(shape) and f[0] == 1:
            f = f[1:]
        if len(f) > len(shape) or not shape:
            return None
        if not all(d in (1, t) for d, t in zip(reversed(f), reversed(shape), strict=False)):
            return None
        return 1, shape[0], size // shape[0] if shape[0] else 0
    if len(factor_shapes) != 2 or len(shape) < 2:
        return None
    r, c = factor_shapes
    if len(r) != len(c) or len(r) < 2 or r[-1] != c[-2] or r[-1] == 0:
        return None
    m, n = r[-2], c[-1]
    rank = r[-1]
    if len(r) == 2:
        if transpose:
            fits = len(shape) == 2 and shape == (n, m)
            rows, cols = n, m
        else:
            fits = shape[0] == m and size == m * n
            rows, cols = m, n
        stack = 1
    else:
        fits = not transpose and r[:-2] == c[:-2] == shape[:-2] and shape[-2:] == (m, n)
        stack, rows, cols = math.prod(shape[:-2]), m, n
    if not fits or rank > max(min(rows, cols), _RANK_SLACK) or rank > _MAX_RANK:
        return None
    return stack, rows, cols


def reproduce(prev: Buffer, dtype: str, shape: tuple[int, ...], inputs: Inputs) -> bytes | None:
    """The new value the factors describe, or None when they do not fit the tensor.

    The C kernel computes the first definition where it can (2-D, float dtypes, no NaN
    among the inputs), and "steps" for 2-D F32 and BF16 tensors with finite inputs,
    with the same roundings in the same order as ``reproduce_numpy``, the definition.
    """
    native = kernels.native
    if native is not None and len(shape) == 2 and dtype in _CODES and _plain(inputs):
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
    elif native is not None and len(shape) == 2 and _steps_native(inputs, dtype):
        # The "steps" definition for F32 and BF16 tensors: also what keeps NumPy's import
        # (~100 ms) off a `git add` whose previous value came through a torch-rounded LoRA.
        steps = getattr(native, "factored_steps", None)  # None: a kernel built before it
        a, b = inputs.factors
        rows, cols = shape
        if steps is not None and a.shape[0] == rows and b.shape == (a.shape[1], cols):
            try:
                guess = steps(
                    prev, _CODES[dtype], rows, cols, a.raw, _CODES[a.dtype], b.raw,
                    _CODES[b.dtype], a.shape[1], inputs.scale,
                )  # fmt: skip
            except (ValueError, OverflowError):
                guess = None  # shapes that do not fit: the definition decides
            if guess is not None:
                return guess
    return reproduce_numpy(prev, dtype, shape, inputs)


def _steps_native(inputs: Inputs, dtype: str) -> bool:
    """True when the C kernel computes ``inputs``' "steps" rounding (low-rank, 2-D
    factors, an F32 or BF16 tensor, factors of at most 32 bits)."""
    return (
        inputs.kind == "low-rank"
        and inputs.rounding == "steps"
        and not (inputs.transpose or inputs.broadcast)
        and dtype in ("F32", "BF16")
        and len(inputs.factors) == 2
        and all(f.dtype in ("F32", "F16", "BF16") and len(f.shape) == 2 for f in inputs.factors)
        and inputs.factors[0].shape[1] > 0
    )


def _round32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b`` rounded once to float32, for float64 ``a`` exact products of float32
    values and ``b`` float32 values (of either width): a fused multiply-add.

    The float64 sum may itself be rounded, and rounding it again to float32 is wrong only
    where it landed exactly on a float32 tie (its low 29 bits are 1 followed by zeros) or
    where float32 is subnormal; for those few elements the sum's exact error (TwoSum)
    settles the tie."""
    import numpy as np

    s = a + b
    t: np.ndarray = s.astype(np.float32)
    low = s.view(np.uint64) & np.uint64((1 << 29) - 1)
    suspect = np.flatnonzero((low == np.uint64(1 << 28)) | (np.abs(s) < 2.0**-125))
    if suspect.size:
        sa, ss = a.reshape(-1)[suspect], s.reshape(-1)[suspect]
        sb = b.reshape(-1)[suspect].astype(np.float64)
        bb = ss - sa
        err = (sa - (ss - bb)) + (sb - bb)
        near = t.reshape(-1)[suspect]
        up = np.nextafter(near, np.float32(np.inf))
        down = np.nextafter(near, np.float32(-np.inf))
        mid = near.astype(np.float64)
        near = np.where((ss == (mid + up) / 2) & (err > 0), up, near)
        near = np.where((ss == (mid + down) / 2) & (err < 0), down, near)
        t.reshape(-1)[suspect] = near
    return t


def _product(r: np.ndarray, c: np.ndarray, rounding: str) -> np.ndarray:
    """``r @ c`` (2-D float64 arrays of float32-or-narrower values) by ``rounding``."""
    import numpy as np

    if rounding == "steps":  # the accumulator is float32, as torch's
        acc = np.zeros((r.shape[0], c.shape[1]), np.float32)
        for k in range(r.shape[1]):
            acc = _round32(np.multiply.outer(r[:, k], c[k, :]), acc)
        return acc.astype(np.float64)
    out = np.zeros((r.shape[0], c.shape[1]))
    for k in range(r.shape[1]):  # one rank at a time: elementwise, so exact everywhere
        out += np.multiply.outer(r[:, k], c[k, :])
    return out


def _widened(prev: Buffer, dtype: str) -> np.ndarray:
    from git_theta.values import as_float64

    values = as_float64(prev, dtype)
    assert values is not None  # callers pass float dtypes
    return values


def reproduce_numpy(
    prev: Buffer, dtype: str, shape: tuple[int, ...], inputs: Inputs
) -> bytes | None:
    """The definition of ``reproduce``, in NumPy (see ``ROUNDINGS``): the new value, or
    None when the factors do not fit the tensor."""
    import numpy as np

    # Overflow and NaN are defined results (an object's hash then says whether they are
    # right): a hostile object's NaN factors must not print NumPy's RuntimeWarnings.
    with np.errstate(all="ignore"):
        return _reproduce_numpy(prev, dtype, shape, inputs)


def _reproduce_numpy(
    prev: Buffer, dtype: str, shape: tuple[int, ...], inputs: Inputs
) -> bytes | None:
    import numpy as np

    from git_theta.values import as_float64

    if dtype not in FLOATS or not shape or inputs.rounding not in ROUNDINGS:
        return None
    if len(prev) != math.prod(shape) * _size(dtype):
        return None
    steps = inputs.rounding == "steps"
    if steps and (dtype == "F64" or any(f.dtype == "F64" for f in inputs.factors)):
        return None  # float32 arithmetic cannot hold these values
    if inputs.kind == "ia3" and not inputs.broadcast:
        if len(shape) != 2:
            return None
        rows, cols = shape
        base = _widened(prev, dtype).reshape(rows, cols)
        vector = inputs.factors[0].values().reshape(-1)
        if vector.size == rows:
            return _to_dtype(base * vector[:, None], dtype)
        if vector.size == cols:
            return _to_dtype(base * vector[None, :], dtype)
        return None
    view = matrix_shape(
        inputs.kind, [f.shape for f in inputs.factors], shape, inputs.transpose,
        inputs.broadcast,
    )  # fmt: skip
    if view is None:
        return None
    if inputs.kind == "ia3":
        vector = inputs.factors[0].values()
        if len(shape) == 1:
            vector = vector.reshape(-1)
        elif inputs.transpose:
            vector = vector.T
        scaled = _widened(prev, dtype).reshape(shape) * vector  # exact: one rounding below
        if steps:
            scaled = scaled.astype(np.float32).astype(np.float64)
        return _to_dtype(scaled.reshape(-1), dtype)
    stack, rows, cols = view
    r, c = (f.values() for f in inputs.factors)
    r = r.reshape(stack, r.shape[-2], r.shape[-1])
    c = c.reshape(stack, c.shape[-2], c.shape[-1])
    size = _size(dtype)
    view_prev = memoryview(prev).cast("B")
    # Block by block of output rows (about 256 Ki elements each): the float64
    # temporaries stay small whatever the tensor's size; every operation is elementwise,
    # so the blocks give the same bits as the whole.
    step = max(1, (1 << 18) // max(cols, 1))
    out = []
    for i in range(stack):
        for top in range(0, rows, step):
            end = min(rows, top + step)
            if inputs.transpose:  # output rows are C's columns
                change = _product(r[i], c[i][:, top:end], inputs.rounding).T
            else:
                change = _product(r[i][top:end], c[i], inputs.rounding)
            first = (i * rows + top) * cols * size
            block = as_float64(view_prev[first : first + (end - top) * cols * size], dtype)
            assert block is not None  # a float dtype (checked above)
            out.append(_combine(block, change.reshape(-1), inputs, dtype))
    return b"".join(out)


def _combine(base: np.ndarray, change: np.ndarray, inputs: Inputs, dtype: str) -> bytes:
    """The new values of ``base`` changed by ``change`` (``R @ C``), rounded as
    ``inputs.rounding`` says, as bytes of ``dtype``."""
    import numpy as np

    from git_theta.values import as_float64

    if inputs.rounding != "steps":
        return _to_dtype(base + inputs.scale * change, dtype)
    scale = float(np.float32(inputs.scale))
    delta = (change * scale).astype(np.float32).astype(np.float64)  # exact product, one rounding
    if dtype in ("F16", "BF16") and all(f.dtype == dtype for f in inputs.factors):
        narrowed = as_float64(_to_dtype(delta, dtype), dtype)
        assert narrowed is not None  # F16 and BF16 widen
        delta = narrowed
    return _to_dtype(_round32(base, delta), dtype)


class Factored(UpdateType):
    """Shared by low-rank and ia3; ``inputs`` maps tensor names to their factors (one
    ``Inputs``, or several candidates of which the one reproducing the file best is
    stored), ``refused`` tensor names to why their factors are not used."""

    codec = "gtfx1"
    kind = ""
    takes_operands = True

    def __init__(
        self,
        inputs: Mapping[str, Inputs | Sequence[Inputs]] | None = None,
        refused: Mapping[str, str] | None = None,
    ):
        self.inputs = dict(inputs or {})
        self.refused = dict(refused or {})

    def with_inputs(self, path: str) -> UpdateType:
        found = load_factors(path)
        inputs = {
            name: [c for c in options if c.kind == self.kind]
            for name, options in found.candidates.items()
        }
        inputs = {name: options for name, options in inputs.items() if options}
        if not inputs and not found.refused:
            raise UsageError(f"--update-path {path}: no {self.kind} factors found in it")
        return type(self)(inputs, found.refused)

    def _find(self, name: str) -> tuple[str, list[Inputs]]:
        return candidates_for(self.inputs, name)

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
        # The factors inside the payload (how objects were first written, and what
        # ``apply`` reads without a chain).
        picked = self._pick(new, prev, dtype, dense, dense_estimate, name, shape, False)
        return picked.key, picked.parts

    def pick_linked(
        self,
        new: Buffer,
        prev: Buffer | None,
        dtype: str,
        dense: Callable[[], list[bytes]],
        dense_estimate: int | None = None,
        name: str = "",
        shape: tuple[int, ...] = (),
    ) -> Picked:
        # Each factor an operand object: the dense object of its bytes, which the adapter
        # file the factors come from stores too when it is committed (one object for both).
        return self._pick(new, prev, dtype, dense, dense_estimate, name, shape, True)

    def _pick(
        self,
        new: Buffer,
        prev: Buffer | None,
        dtype: str,
        dense: Callable[[], list[bytes]],
        dense_estimate: int | None,
        name: str,
        shape: tuple[int, ...],
        linked: bool,
    ) -> Picked:
        from git_theta.updates.auto import Auto

        def as_auto() -> Picked:
            return Picked(*Auto().pick(new, prev, dtype, dense, dense_estimate, name, shape))

        shown = escape(name)
        key, candidates = self._find(name)
        if not candidates:
            why = self.refused.get(key) or next(
                (v for k, v in self.refused.items() if k.endswith("." + name)), None
            )
            if why is not None:
                sys.stderr.write(f"git-theta: {shown}: {why}\n")
            return as_auto()  # no factors for this tensor: store it the best way
        if prev is None or dtype not in FLOATS:
            return as_auto()
        best = best_fit(new, prev, dtype, shape, candidates)
        if best is None:
            given = " or ".join(
                dict.fromkeys(" x ".join(str(list(f.shape)) for f in c.factors) for c in candidates)
            )
            sys.stderr.write(
                f"git-theta: warning: {shown}: {self.kind} factors {given} do not fit the "
                f"tensor {list(shape)} {dtype}; stored as auto would\n"
            )
            return as_auto()
        inputs, guess = best
        error = _max_error(new, guess, dtype)
        sys.stderr.write(
            f"git-theta: {shown}: {self.kind} factors reproduce the file within {error:.3g} "
            "(max abs); the rest is stored exactly as a correction\n"
        )
        size = _size(dtype)
        correction = codec.encode(_zigzag(new, guess, size).tobytes(), codec.Layout(size))
        factors: list[dict[str, object]] = [
            {"dtype": f.dtype, "shape": list(f.shape)} for f in inputs.factors
        ]
        blobs: list[bytes] = []
        operands: tuple[list[bytes], ...] = ()
        if linked:
            dense_of = Dense()
            operands = tuple(dense_of.encode(f.raw, None, f.dtype) for f in inputs.factors)
        else:
            blobs = [b"".join(codec.encode(f.raw, layout_for(f.dtype))) for f in inputs.factors]
            for f, blob in zip(factors, blobs, strict=True):
                f["size"] = len(blob)
        header: dict[str, object] = {
            "kind": self.kind,
            "scale": inputs.scale,
            "factors": factors,
            "shape": list(shape),
        }
        if linked:
            header["linked"] = True
        # Written only when not the default: objects of the first definition keep their bytes.
        if inputs.transpose:
            header["transpose"] = True
        if inputs.broadcast:
            header["broadcast"] = True
        if inputs.rounding != "f64":
            header["rounding"] = inputs.rounding
        text = json.dumps(header, sort_keys=True).encode()
        parts = [MAGIC, _LEN.pack(len(text)), text, *blobs, *correction]
        return Picked(self.key, parts, operands)

    def summary(self, payload: Payload, limit: int | None = None) -> str:
        return self.summary_with(payload, (), limit)

    def summary_with(
        self, payload: Payload, operands: Sequence[Payload], limit: int | None = None
    ) -> str:
        try:
            inputs, _, _ = _read_payload(payload, self.kind, limit, operands)
        except ObjectCorruptError:
            return ""
        return _summary(inputs)

    def apply(
        self, prev: bytearray | None, payload: Payload, dtype: str, limit: int | None = None
    ) -> bytearray:
        return self.apply_with(prev, payload, (), dtype, limit)

    def apply_with(
        self,
        prev: bytearray | None,
        payload: Payload,
        operands: Sequence[Payload],
        dtype: str,
        limit: int | None = None,
    ) -> bytearray:
        if prev is None:
            raise ObjectCorruptError(f"a {self.kind} update needs a previous value")
        inputs, shape, pos = _read_payload(payload, self.kind, len(prev), operands)
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


def candidates_for(
    inputs: Mapping[str, Inputs | Sequence[Inputs]], name: str
) -> tuple[str, list[Inputs]]:
    """(the key the factors are filed under, the candidates) for the tensor ``name`` in
    ``inputs`` (as ``load_factors(path).candidates``): its own entry, else one whose name
    adds or drops a dotted prefix (adapters often do); ``(name, [])`` when none."""
    found = inputs.get(name)
    key = name
    if found is None:
        for other, value in inputs.items():
            if other.endswith("." + name) or name.endswith("." + other):
                key, found = other, value
                break
    if found is None:
        return name, []
    return key, [found] if isinstance(found, Inputs) else list(found)


def best_fit(
    new: Buffer, prev: Buffer, dtype: str, shape: tuple[int, ...], candidates: Sequence[Inputs]
) -> tuple[Inputs, bytes] | None:
    """The candidate (with the rounding) whose reproduction of ``new`` from ``prev``
    differs from it in the fewest elements, and that reproduction; None when none fits.
    Ties go to the earlier candidate and to the first definition, so what was stored
    before is stored the same way again."""
    import numpy as np

    word = _UNSIGNED[_size(dtype)]
    target = np.frombuffer(new, dtype=word)
    # At most one reproduction is held at a time (memory stays new + prev + one value):
    # the best is computed again at the end when a later candidate was tried after it.
    best: tuple[int, Inputs] | None = None
    last: tuple[Inputs, bytes] | None = None
    for candidate in candidates:
        for rounding in ROUNDINGS:
            inputs = candidate._replace(rounding=rounding)
            last = None
            guess = reproduce(prev, dtype, shape, inputs)
            if guess is None or len(guess) != len(new):
                continue
            misses = int(np.count_nonzero(np.frombuffer(guess, dtype=word) != target))
            if misses == 0:
                return inputs, guess
            last = (inputs, guess)
            if best is None or misses < best[0]:
                best = (misses, inputs)
            del guess
    if best is None:
        return None
    if last is not None and last[0] == best[1]:
        return last
    value = reproduce(prev, dtype, shape, best[1])
    assert value is not None  # it was computed before
    return best[1], value


def apply_update(
    prev: Buffer, dtype: str, shape: tuple[int, ...], candidates: Inputs | Sequence[Inputs]
) -> bytes:
    """Previous value + update: the new value of a tensor of ``dtype`` and ``shape``
    whose previous bytes are ``prev``, changed by low-rank factors or ia3 scales (for
    side-loaded updates, ``--update-data``). It is computed as torch computes a merge
    (rounding "steps", see ``ROUNDINGS``), so a later add of the result with the same
    factors stores them with an empty correction; F64 tensors use the first definition.
    ``candidates`` are an ``Inputs`` or a list of them (the first that fits is used: the
    order peft's settings give), e.g. for a side-loaded update file::

        found = load_factors(path)                  # any format, or a PEFT directory
        _, options = candidates_for(found.candidates, name)
        options = [o for o in options if o.kind == "low-rank"]  # or "ia3"
        if options: new = apply_update(prev, dtype, shape, options)
        # found.refused[name] says why a tensor's factors are not usable (DoRA)

    Raises UsageError when none fits the tensor.
    """
    options = [candidates] if isinstance(candidates, Inputs) else list(candidates)
    roundings = ("f64",) if dtype == "F64" else ("steps", "f64")
    for option in options:
        for rounding in roundings:
            value = reproduce(prev, dtype, shape, option._replace(rounding=rounding))
            if value is not None and len(value) == len(prev):
                return value
    given = " or ".join(" x ".join(str(list(f.shape)) for f in o.factors) for o in options)
    raise UsageError(f"factors {given} do not fit a tensor of {dtype} {list(shape)}")


_MAX_HEADER = 1 << 16  # the JSON header of a payload is a few hundred bytes
# A rank beyond the smaller side of the tensor adds nothing; a little slack beyond it
# keeps factors for a small head (2 x 768 with r = 8) while bounding what a hostile
# payload can make a checkout compute (rows x cols x rank) and hold.
_RANK_SLACK = 256
# And a checkout does rank multiply-adds per element: a stranger's 4096 x 4096 object at
# rank 4096 took minutes. LoRA ranks are 4-256; past 1024, factors are stored as auto would.
_MAX_RANK = 1024


def _read_payload(
    payload: Payload, kind: str, limit: int | None, operands: Sequence[Payload] = ()
) -> tuple[Inputs, tuple[int, ...], int]:
    """Return (factors, the tensor's shape, where the correction starts) of a payload for
    a value of at most ``limit`` bytes; every length is checked before it is decoded.
    A payload whose header says ``linked`` has no factors inside: they are ``operands``
    (the objects of the operand links before it, in order), one per declared factor.

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
    transpose, broadcast = header.get("transpose", False), header.get("broadcast", False)
    rounding = header.get("rounding", "f64")
    linked = header.get("linked", False)
    if (
        type(linked) is not bool
        or not shape
        or not isinstance(scale, int | float)
        or not isinstance(found, list)
        or type(transpose) is not bool
        or type(broadcast) is not bool
        or rounding not in ROUNDINGS
    ):
        raise corrupt("its header is malformed")
    try:  # JSON integers are unbounded: one of 400 digits has no float
        factor_scale = float(scale)
    except OverflowError:
        raise corrupt("its scale is out of range") from None
    if limit is not None and math.prod(shape) > limit:  # every float dtype takes 2+ bytes
        raise corrupt(f"shape {list(shape)} is larger than the value")
    pos = 8 + length
    factors = []
    for f in found:
        if not isinstance(f, dict):
            raise corrupt("a factor is malformed")
        known, f_shape, size = lookup(f.get("dtype", "")), _dims(f.get("shape")), f.get("size")
        if known is None or known.bits % 8 or known.name in ("C64", "C128"):
            raise corrupt("a factor has a dtype factors cannot have")
        # A linked factor is an object of its own: its size is that object's, not here.
        malformed = "size" in f if linked else type(size) is not int or size < 0
        if malformed:
            raise corrupt("a factor is malformed")
        factors.append((known, f_shape, size))
    fits = matrix_shape(kind, [f[1] for f in factors], shape, transpose, broadcast)
    if fits is None or (not broadcast and kind == "ia3" and len(shape) != 2):
        raise corrupt("its factors do not fit the tensor")
    if len(operands) != (len(factors) if linked else 0):
        verb = "precedes" if len(operands) == 1 else "precede"
        raise corrupt(
            f"it takes {factor_objects(len(factors) if linked else 0)}, but {len(operands)} "
            f"{verb} it"
        )
    out = []
    for i, (known, f_shape, size) in enumerate(factors):
        nbytes = known.nbytes(f_shape)  # the decode's cap, whoever holds the factor
        if linked:
            raw = codec.decode(operands[i], limit=nbytes)
        else:
            if pos + size > len(payload):
                raise corrupt("it is truncated")
            raw = codec.decode(memoryview(payload)[pos : pos + size], limit=nbytes)
            pos += size
        if len(raw) != nbytes:
            raise corrupt("a factor has the wrong length")
        out.append(Factor(known.name, f_shape, bytes(raw)))
    return Inputs(kind, tuple(out), factor_scale, transpose, broadcast, rounding), shape, pos


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


def load_factors(path: str) -> Found:
    """Read the factors ``--update-path`` names: a file in any format git-theta reads
    (safetensors, torch ``.pt``/``.bin``, npz, ...) or a PEFT adapter directory.

    Returns, per tensor name, the candidate inputs (``T/R`` + ``T/C`` low-rank, ``T/ia3``
    ia3, PEFT LoRA and IA3 modules as ``peft_adapter`` reads them with the
    ``adapter_config.json`` beside the file) and the tensors whose factors are refused.
    Raises UsageError naming the file when it cannot be read.
    """
    from git_theta.updates.factor_files import read_tensors, resolve
    from git_theta.updates.peft_adapter import Found, read_adapter, read_config

    where = resolve(path)

    def wanted(name: str) -> bool:
        return name.endswith(("/R", "/C", "/ia3")) or ".lora_" in name or ".ia3_l" in name

    tensors = {
        name: Factor(dtype, shape, raw)
        for name, (dtype, shape, raw) in read_tensors(where, wanted).items()
    }
    found = Found()
    for key, factor in tensors.items():
        if key.endswith("/R") and key[:-2] + "/C" in tensors:
            found.candidates.setdefault(key[:-2], []).append(
                Inputs("low-rank", (factor, tensors[key[:-2] + "/C"]))
            )
        elif key.endswith("/ia3"):
            # A vector with its dimensions (the predecessor kept them: (out, 1), (1, in),
            # (out, 1, 1, 1)) broadcasts by its shape; a flat one scales rows or columns.
            # One scale (shape (1,)) broadcasts to any tensor too.
            alone = math.prod(factor.shape) == 1
            vector = Inputs("ia3", (factor,), broadcast=len(factor.shape) >= 2 or alone)
            found.candidates.setdefault(key[:-4], []).append(vector)
    if any(".lora_" in k or ".ia3_l" in k for k in tensors):
        read_adapter(tensors, read_config(where), found)
    return found
