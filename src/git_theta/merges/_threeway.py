"""The element-wise three-way step every strategy shares (see base.merge_tensor)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from git_theta.merges import _floats
from git_theta.merges.base import (
    MergeBaseMissingError,
    MergeShapeError,
    MergeStrategy,
    MergeTypeError,
    ParamValue,
    TensorMerge,
)


def draw_seed() -> int:
    """Return a fresh seed for a strategy that ``uses_seed`` (63 bits from the OS)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return a bool per unit: do the bits of ``a`` and ``b`` differ?"""
    differ = np.not_equal(a, b)
    return np.asarray(differ if a.ndim == 1 else differ.any(axis=1))


def merge(
    strategy: MergeStrategy,
    params: Mapping[str, ParamValue],
    base: np.ndarray | None,
    ours: np.ndarray,
    theirs: np.ndarray,
    dtype: str,
    tensor: str,
) -> TensorMerge:
    """See base.merge_tensor."""
    used = dict(params)
    if strategy.uses_seed and "seed" not in used:
        used["seed"] = draw_seed()
    o_bytes, t_bytes = _bytes(ours), _bytes(theirs)
    b_bytes = None if base is None else _bytes(base)
    sizes = {o_bytes.size, t_bytes.size} | ({b_bytes.size} if b_bytes is not None else set())
    if len(sizes) != 1:
        raise MergeShapeError(
            f"tensor {tensor}: its versions differ in size, so no element-wise merge "
            "exists; take one side whole (ours or theirs)"
        )
    size = _floats.unit_bytes(dtype, o_bytes.size)
    o, t = _floats.units(o_bytes, size), _floats.units(t_bytes, size)
    b = None if b_bytes is None else _floats.units(b_bytes, size)
    total = o.shape[0]

    # Start from ours and take every unit theirs changed; of those, only the ones ours
    # changed differently still need the strategy.
    result = o.copy()
    if b is None:
        conflict = _differ(o, t)
        unchanged = from_ours = from_theirs = 0
        merged = int(np.count_nonzero(conflict))
        same = total - merged
    else:
        ours_changed = _differ(o, b)
        theirs_changed = _differ(t, b)
        np.copyto(result, t, where=theirs_changed if result.ndim == 1 else theirs_changed[:, None])
        n_ours, n_theirs = np.count_nonzero(ours_changed), np.count_nonzero(theirs_changed)
        conflict = ours_changed
        conflict &= theirs_changed  # ours_changed is not needed again
        del theirs_changed
        n_both = int(np.count_nonzero(conflict))
        if n_both:
            conflict &= _differ(o, t)
        merged = int(np.count_nonzero(conflict))
        unchanged = total - int(n_ours) - int(n_theirs) + n_both
        from_ours, from_theirs = int(n_ours) - n_both, int(n_theirs) - n_both
        same = n_both - merged

    if merged:
        _resolve(strategy, used, b, o, t, result, conflict, dtype, tensor)
    data = result.reshape(-1).view(np.uint8).view(ours.dtype).reshape(ours.shape)
    return TensorMerge(data, unchanged, from_ours, from_theirs, same, merged, used)


def _resolve(
    strategy: MergeStrategy,
    params: Mapping[str, ParamValue],
    b: np.ndarray | None,
    o: np.ndarray,
    t: np.ndarray,
    result: np.ndarray,
    conflict: np.ndarray,
    dtype: str,
    tensor: str,
) -> None:
    """Write the strategy's values into ``result`` where ``conflict`` is set."""
    if strategy.needs_base and b is None:
        raise MergeBaseMissingError(
            f"tensor {tensor}: {strategy.name} needs the common ancestor's tensor and it has "
            "none (added on both sides); use ours, theirs, average or slerp"
        )
    if strategy.picks_side:
        side = strategy.combine(b, o, t, params)
        np.copyto(result, side, where=conflict if result.ndim == 1 else conflict[:, None])
        return
    if not _floats.combinable(dtype):
        raise MergeTypeError(
            f"tensor {tensor}: {strategy.name} cannot combine {dtype} tensors; "
            "use ours, theirs or base"
        )
    # An element-wise strategy computes only the conflicting elements, unless they are
    # most of the tensor: then gathering them costs more than computing the rest.
    if strategy.elementwise and int(np.count_nonzero(conflict)) * 2 < conflict.size:
        # The gathered elements are fresh copies: F32/F64 ones are used in place.
        part_b = None if b is None else _floats.widen(b[conflict], dtype, copy=False)
        part_o = _floats.widen(o[conflict], dtype, copy=False)
        part_t = _floats.widen(t[conflict], dtype, copy=False)
        values = strategy.combine(part_b, part_o, part_t, params)
        result[conflict] = _floats.narrow(values, dtype).view(result.dtype)
        return
    wide_b = None if b is None else _floats.widen(b, dtype)
    values = strategy.combine(wide_b, _floats.widen(o, dtype), _floats.widen(t, dtype), params)
    np.copyto(result, _floats.narrow(values, dtype).view(result.dtype), where=conflict)
