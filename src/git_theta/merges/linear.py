"""average and task-arithmetic: weighted sums, element by element."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from git_theta.merges._floats import add_left
from git_theta.merges.base import MergeStrategy, Param, ParamValue

# Shared by task-arithmetic, TIES and DARE (mergekit's names in parentheses).
WEIGHTS = (
    Param("ours_weight", float, 1.0, "scale of our task vector (mergekit: weight)"),
    Param("theirs_weight", float, 1.0, "scale of their task vector (mergekit: weight)"),
)
LAMBDA = Param("lambda", float, 1.0, "scale of the combined task vector (mergekit: lambda)")


def as_float(params: Mapping[str, ParamValue], name: str) -> float:
    """Return param ``name`` as a float (parse_params has checked its kind)."""
    value = params[name]
    assert not isinstance(value, str)
    return float(value)


def finish(
    base: np.ndarray,
    mixed: np.ndarray,
    divisor: float | np.ndarray | None,
    params: Mapping[str, ParamValue],
) -> np.ndarray:
    """Return ``base + lambda * mixed / divisor`` (no division when ``divisor`` is None),
    in mergekit's order of operations so float32 results agree to the last bit or so.
    Overwrites ``mixed`` and ``base``."""
    if divisor is not None:
        mixed /= divisor
    scale = as_float(params, "lambda")
    if scale != 1:
        mixed *= mixed.dtype.type(scale)
    return add_left(base, mixed)


class Average(MergeStrategy):
    """Weighted average: ``(1 - weight) * ours + weight * theirs``.

    ``weight`` is their share, in [0, 1]; 0.5 (the default) is the plain mean. Needs no
    common ancestor. mergekit: ``linear`` with weights ``1 - weight`` and ``weight``."""

    name: ClassVar[str] = "average"
    description: ClassVar[str] = "weighted mean: (1 - weight) * ours + weight * theirs"
    params: ClassVar[tuple[Param, ...]] = (
        Param("weight", float, 0.5, "their share of the mean", low=0.0, high=1.0),
    )
    blockwise: ClassVar[bool] = True
    reads_base: ClassVar[bool] = False

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return the weighted mean (computed in ``ours``' buffer)."""
        weight = as_float(params, "weight")
        kind = ours.dtype.type
        ours *= kind(1.0 - weight)
        theirs *= kind(weight)
        return add_left(ours, theirs)


class TaskArithmetic(MergeStrategy):
    """Task arithmetic (Ilharco et al. 2023): add both sides' task vectors to the base.

    ``base + lambda * (ours_weight * (ours - base) + theirs_weight * (theirs - base))``,
    divided by ``ours_weight + theirs_weight`` when ``normalize`` is true (default false,
    as mergekit's ``task_arithmetic``)."""

    name: ClassVar[str] = "task-arithmetic"
    description: ClassVar[str] = "base + ours_weight*(ours-base) + theirs_weight*(theirs-base)"
    params: ClassVar[tuple[Param, ...]] = (
        *WEIGHTS,
        Param("normalize", bool, False, "divide by the sum of the weights"),
        LAMBDA,
    )
    needs_base: ClassVar[bool] = True
    blockwise: ClassVar[bool] = True

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return the merged values (computed in the inputs' buffers)."""
        assert base is not None
        kind = ours.dtype.type
        a, b = kind(as_float(params, "ours_weight")), kind(as_float(params, "theirs_weight"))
        ours -= base
        ours *= a
        theirs -= base
        theirs *= b
        add_left(ours, theirs)
        divisor = None
        if params["normalize"]:
            total = a + b
            divisor = total if abs(total) >= 1e-8 else kind(1.0)  # mergekit's guard
        return finish(base, ours, divisor, params)
