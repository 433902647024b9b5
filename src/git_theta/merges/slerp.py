"""slerp: spherical linear interpolation between the two sides, the tensor as one vector."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from git_theta.merges.base import MergeStrategy, Param, ParamValue
from git_theta.merges.linear import as_float

_CHUNK = 1 << 20  # elements widened to float64 at a time for the norms and the dot
_EPS = 1e-8  # norms at or below this count as 1, as mergekit's


def _norm_and_dot(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """Return ||a||, ||b|| and a.b, accumulated in float64 a chunk at a time."""
    aa = bb = ab = 0.0
    for start in range(0, a.size, _CHUNK):
        x = a[start : start + _CHUNK].astype(np.float64)
        y = b[start : start + _CHUNK].astype(np.float64)
        aa += float(np.dot(x, x))
        bb += float(np.dot(y, y))
        ab += float(np.dot(x, y))
    return math.sqrt(aa), math.sqrt(bb), ab


def coefficients(
    t: float, ours: np.ndarray, theirs: np.ndarray, threshold: float
) -> tuple[float, float]:
    """Return (c0, c1) with slerp = c0 * ours + c1 * theirs.

    With theta the angle between the flattened tensors, c0 = sin((1-t) theta)/sin(theta)
    and c1 = sin(t theta)/sin(theta); when |cos(theta)| > ``threshold`` (nearly
    colinear, or antipodal) the plain lerp coefficients 1 - t and t."""
    norm_o, norm_t, dot = _norm_and_dot(ours.reshape(-1), theirs.reshape(-1))
    norm_o = norm_o if norm_o > _EPS else 1.0
    norm_t = norm_t if norm_t > _EPS else 1.0
    cos = min(1.0, max(-1.0, dot / norm_o / norm_t))
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

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
    ) -> np.ndarray:
        """Return the interpolation (computed in ``ours``' buffer)."""
        c0, c1 = coefficients(
            as_float(params, "t"), ours, theirs, as_float(params, "dot_threshold")
        )
        kind = ours.dtype.type
        ours *= kind(c0)
        theirs *= kind(c1)
        ours += theirs
        return ours
