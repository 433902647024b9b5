"""slerp: spherical linear interpolation between the two sides, the tensor as one vector."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from git_theta.merges.base import Blocks, MergeStrategy, Param, ParamValue
from git_theta.merges.linear import as_float

_EPS = 1e-8  # norms at or below this count as 1, as mergekit's


def coefficients(blocks: Blocks, t: float, threshold: float) -> tuple[float, float]:
    """Return (c0, c1) with slerp = c0 * ours + c1 * theirs.

    With theta the angle between the flattened tensors (norms and dot product summed in
    float64), c0 = sin((1-t) theta)/sin(theta) and c1 = sin(t theta)/sin(theta); when
    |cos(theta)| > ``threshold`` (nearly colinear, or antipodal) the plain lerp
    coefficients 1 - t and t."""
    oo = tt = ot = 0.0
    for _, _, ours, theirs in blocks():
        # Products and sums in float64, by einsum rather than BLAS (whose threads only
        # contend on a busy machine).
        oo += float(np.einsum("i,i->", ours, ours, dtype=np.float64))
        tt += float(np.einsum("i,i->", theirs, theirs, dtype=np.float64))
        ot += float(np.einsum("i,i->", ours, theirs, dtype=np.float64))
    norm_o = math.sqrt(oo) if math.sqrt(oo) > _EPS else 1.0
    norm_t = math.sqrt(tt) if math.sqrt(tt) > _EPS else 1.0
    cos = min(1.0, max(-1.0, ot / norm_o / norm_t))
    if abs(cos) > threshold:
        return 1.0 - t, t
    theta = math.acos(cos)
    sin = math.sin(theta)
    return math.sin((1.0 - t) * theta) / sin, math.sin(t * theta) / sin


class Slerp(MergeStrategy):
    """SLERP between ours (t = 0) and theirs (t = 1), the whole tensor as one vector.

    ``sin((1-t) theta)/sin(theta) * ours + sin(t theta)/sin(theta) * theirs``, theta the
    angle between them; falls back to ``(1-t) * ours + t * theirs`` when the cosine's
    magnitude exceeds ``dot_threshold`` (mergekit's DOT_THRESHOLD, 0.9995). Needs no
    common ancestor. mergekit: ``slerp`` with ours as the base model."""

    name: ClassVar[str] = "slerp"
    description: ClassVar[str] = "spherical interpolation from ours (t=0) to theirs (t=1)"
    params: ClassVar[tuple[Param, ...]] = (
        Param("t", float, 0.5, "position between ours (0) and theirs (1)", low=0.0, high=1.0),
        Param(
            "dot_threshold",
            float,
            0.9995,
            "above this |cosine| the tensors count as colinear: plain interpolation",
            low=0.0,
            high=1.0,
        ),
    )

    blockwise: ClassVar[bool] = True
    reads_base: ClassVar[bool] = False

    def prepare(self, blocks: Blocks, params: Mapping[str, ParamValue]) -> object:
        """Return the interpolation's two coefficients."""
        return coefficients(blocks, as_float(params, "t"), as_float(params, "dot_threshold"))

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return the interpolation of one block (computed in ``ours``' buffer)."""
        assert isinstance(state, tuple)
        kind = ours.dtype.type
        ours *= kind(state[0])
        theirs *= kind(state[1])
        ours += theirs
        return ours
