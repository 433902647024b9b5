"""The three-way step and its common strategies in one C pass (``_merge.c``).

``run`` is the fast path of ``_threeway.merge``: the built-in side picks (ours, theirs,
base) on units of 1, 2, 4 or 8 bytes, and average, task arithmetic and TIES on F32, F16,
BF16 and F64. It gives the same bits as the NumPy definition in this package, which
runs for everything else and under GIT_THETA_KERNELS=numpy.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from git_theta.merges import linear, sides, ties
from git_theta.merges.base import MergeError, MergeStrategy, ParamValue

if TYPE_CHECKING:
    from git_theta.merges._threeway import _Widened

KINDS = {"F32": 1, "F16": 2, "BF16": 3, "F64": 4}
# Exact types: a plugin subclassing one of these may change what it computes.
_PICKS: dict[type, int] = {sides.Ours: 0, sides.Theirs: 1, sides.Base: 2}
_COMPUTES: dict[type, int] = {linear.Average: 3, linear.TaskArithmetic: 4, ties.Ties: 5}

LITTLE = sys.byteorder == "little"
Counts = tuple[int, int, int, int, int]
Params = tuple[float, float, float, float, bool, bool, int, float, int, int, float, int]


def run(
    kernel: ModuleType,
    strategy: MergeStrategy,
    params: Mapping[str, ParamValue],
    widened: _Widened,
    result: np.ndarray,
    tensor: str,
) -> Counts | None:
    """Fill ``result`` (the units of the tensor, as ``widened``'s sides) by the three-way
    rule with ``strategy`` and return the five TensorMerge counts; None when the kernel
    does not cover this strategy, dtype or unit (the caller runs the NumPy definition).

    Raises MergeError when the strategy made inf or NaN from finite versions (the NumPy
    definition's message and count)."""
    b, o, t, dtype = widened.b, widened.o, widened.t, widened.dtype
    if not LITTLE:
        return None  # the kernel reads the little-endian bytes as native words
    pick = _PICKS.get(type(strategy))
    if pick is not None:
        if o.ndim != 1 or (pick == 2 and b is None):
            return None  # a unit of 3 or 16 bytes, or a base that is not there
        counts, _ = kernel.threeway(result, b, o, t, 0, o.itemsize, pick, None)
        return tuple(counts)
    code = _COMPUTES.get(type(strategy))
    kind = KINDS.get(dtype)
    if code is None or kind is None or (strategy.needs_base and b is None):
        return None  # the NumPy definition raises what it raises, when it needs to
    cuts: tuple[ties.Cut | None, ties.Cut | None] = (None, None)
    if code == 5 and linear.as_float(params, "density") < 1:
        # TIES's cut reads the whole tensor twice: only when some element needs it.
        if not kernel.conflicts(b, o, t, o.itemsize):
            counts, _ = kernel.threeway(result, b, o, t, 0, o.itemsize, 0, None)
            return tuple(counts)
        state = strategy.prepare(widened, params)
        assert isinstance(state, tuple)
        cuts = state
    args = _params(code, params, np.float64 if dtype == "F64" else np.float32, cuts)
    counts, bad = kernel.threeway(result, b, o, t, kind, o.itemsize, code, args)
    if bad:
        raise MergeError(
            f"tensor {tensor}: {strategy.name} gives values that are not finite "
            f"for {bad:,} elements whose versions are (check its params)"
        )
    return tuple(counts)


def _params(
    code: int,
    params: Mapping[str, ParamValue],
    kind: type[np.floating],
    cuts: tuple[ties.Cut | None, ties.Cut | None],
) -> Params:
    """The kernel's params tuple: weights rounded to the working type ``kind`` exactly
    as the NumPy strategies round them."""
    as_float = linear.as_float
    divisor, has_divisor = 1.0, False
    if code == 3:
        weight = as_float(params, "weight")
        wo, wt = float(kind(1.0 - weight)), float(kind(weight))
    else:
        a, b = kind(as_float(params, "ours_weight")), kind(as_float(params, "theirs_weight"))
        wo, wt = float(a), float(b)
        if code == 4 and params["normalize"]:
            total = a + b
            divisor, has_divisor = float(total if abs(total) >= 1e-8 else kind(1.0)), True
    lam = as_float(params, "lambda") if code != 3 else 1.0
    normalize = code == 5 and bool(params["normalize"])
    co, ct = cuts
    return (
        wo,
        wt,
        divisor,
        lam,
        has_divisor,
        normalize,
        co is not None,
        0.0 if co is None else co.magnitude,
        -1 if co is None else co.last,
        ct is not None,
        0.0 if ct is None else ct.magnitude,
        -1 if ct is None else ct.last,
    )
