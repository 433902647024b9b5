"""TIES and DARE: sparsified task vectors, combined linearly or by sign election."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from git_theta.merges.base import MergeStrategy, Param, ParamValue
from git_theta.merges.linear import LAMBDA, WEIGHTS, as_float, finish

_CHUNK = 1 << 20  # elements per block of random draws (bounds the uint64 scratch)


def trim(delta: np.ndarray, density: float) -> np.ndarray:
    """Zero all but the ``max(1, int(density * n))`` largest-magnitude elements of
    ``delta`` (in place; returned). Among equal magnitudes at the cut, the lowest indices
    are kept, so the result does not depend on the sort algorithm."""
    n = delta.size
    if density >= 1 or n == 0:
        return delta
    k = max(1, int(density * n))
    magnitude = np.abs(delta)
    magnitude.partition(n - k)  # in place: only the k-th largest magnitude is needed
    cut = magnitude[n - k]
    np.abs(delta, out=magnitude)
    keep = magnitude > cut
    missing = k - int(np.count_nonzero(keep))
    if missing > 0:
        keep[np.flatnonzero(magnitude == cut)[:missing]] = True
    del magnitude
    delta *= keep
    return delta


def elect(
    base: np.ndarray,
    ours: np.ndarray,
    theirs: np.ndarray,
    weights: tuple[float, float],
    normalize: bool,
    params: Mapping[str, ParamValue],
) -> np.ndarray:
    """TIES's sign election and disjoint merge of the weighted task vectors ``ours`` and
    ``theirs``: the elected sign of each element is that of their sum (+ for 0); only
    the vectors with that sign contribute; with ``normalize`` their sum is divided by the
    sum of their weights (the disjoint mean). Overwrites the inputs; returns the result."""
    scratch = np.add(ours, theirs)
    positive = scratch >= 0
    kind = ours.dtype.type
    divisor = None
    if normalize:  # the scratch buffer becomes the sum of the agreeing weights
        divisor = scratch
        divisor.fill(0)
    else:
        del scratch
    for delta, weight in ((ours, weights[0]), (theirs, weights[1])):
        agrees = np.where(positive, delta > 0, delta < 0)
        delta *= agrees
        if divisor is not None:
            np.add(divisor, kind(weight), out=divisor, where=agrees)
    del positive, agrees
    ours += theirs
    if divisor is not None:
        divisor[divisor == 0] = 1
    return finish(base, ours, divisor, params)


class Ties(MergeStrategy):
    """TIES merging (Yadav et al. 2023), per tensor, as mergekit's ``ties``.

    Each task vector ``side - base`` is trimmed to its ``density`` share of largest
    magnitudes, scaled by its weight; each element's sign is elected by the sum of the
    trimmed vectors; the vectors agreeing with it are summed and, with ``normalize``
    (default), divided by the sum of their weights; ``base + lambda * that``."""

    name: ClassVar[str] = "ties"
    description: ClassVar[str] = "trim task vectors to a density, elect signs, disjoint mean"
    params: ClassVar[tuple[Param, ...]] = (
        Param(
            "density",
            float,
            1.0,
            "share of each task vector kept (largest magnitudes); the paper uses 0.2",
            low=0.0,
            high=1.0,
            low_open=True,
        ),
        *WEIGHTS,
        Param("normalize", bool, True, "divide by the agreeing sides' summed weights"),
        LAMBDA,
    )
    needs_base: ClassVar[bool] = True

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
    ) -> np.ndarray:
        """Return the TIES merge (computed in the inputs' buffers)."""
        assert base is not None
        density = as_float(params, "density")
        weights = (as_float(params, "ours_weight"), as_float(params, "theirs_weight"))
        kind = ours.dtype.type
        for side, weight in zip((ours, theirs), weights, strict=True):
            side -= base
            trim(side, density)
            side *= kind(weight)
        return elect(base, ours, theirs, weights, bool(params["normalize"]), params)


def keep_masks(n: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return DARE's keep masks for our and their task vector of ``n`` elements.

    The draws are the 64-bit outputs ``r`` of NumPy's PCG64 bit generator seeded with
    ``seed``: the first ``n`` for ours, the next ``n`` for theirs; element i is kept when
    ``(r >> 11) * 2**-53 < density``. PCG64 is a fixed algorithm, so a seed gives the
    same masks on every machine and NumPy version."""
    bits = np.random.PCG64(seed)
    masks = []
    for _ in range(2):
        keep = np.empty(n, dtype=bool)
        for start in range(0, n, _CHUNK):
            raw = bits.random_raw(min(_CHUNK, n - start))
            raw >>= np.uint64(11)
            keep[start : start + raw.size] = raw.astype(np.float64) * 2.0**-53 < density
        masks.append(keep)
    return masks[0], masks[1]


def drop(delta: np.ndarray, keep: np.ndarray, density: float, rescale: str) -> np.ndarray:
    """Zero ``delta`` where ``keep`` is false and rescale the rest (in place; returned):
    by ``1 / density`` (the paper), to the original L1 norm (mergekit's ``rescale``;
    not when either norm is below 1e-7), or not at all."""
    if rescale == "l1":
        before = float(np.sum(np.abs(delta), dtype=np.float64))
    delta *= keep
    if rescale == "density":
        delta /= delta.dtype.type(density)
    elif rescale == "l1":
        after = float(np.sum(np.abs(delta), dtype=np.float64))
        if before >= 1e-7 and after >= 1e-7:
            delta *= delta.dtype.type(before / after)
    return delta


class Dare(MergeStrategy):
    """DARE (Yu et al. 2023): drop and rescale each task vector, then combine them.

    Each element of ``side - base`` is kept with probability ``density`` (masks from
    ``seed``, see keep_masks) and the kept ones are rescaled (``rescale``: by
    ``1/density`` as in the paper, ``l1`` as mergekit, or ``none``); the vectors are
    weighted and combined by ``combine``: ``linear`` (task arithmetic, mergekit's
    ``dare_linear``) or ``ties`` (sign election, ``dare_ties``); ``base + lambda * that``,
    divided by the (agreeing) weights when ``normalize``."""

    name: ClassVar[str] = "dare"
    description: ClassVar[str] = "drop task-vector elements at random and rescale, then combine"
    params: ClassVar[tuple[Param, ...]] = (
        Param(
            "density",
            float,
            1.0,
            "probability an element of a task vector is kept; the paper uses 0.1",
            low=0.0,
            high=1.0,
            low_open=True,
        ),
        *WEIGHTS,
        Param("combine", str, "linear", "how the vectors are combined", choices=("linear", "ties")),
        Param(
            "rescale",
            str,
            "density",
            "how kept elements are scaled",
            choices=("density", "l1", "none"),
        ),
        Param("normalize", bool, False, "divide by the (agreeing) sides' summed weights"),
        LAMBDA,
        Param("seed", int, None, "seed of the drop masks (drawn when not given)", 0, 2**63 - 1),
    )
    needs_base: ClassVar[bool] = True
    uses_seed: ClassVar[bool] = True

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
    ) -> np.ndarray:
        """Return the DARE merge (computed in the inputs' buffers)."""
        assert base is not None
        density = as_float(params, "density")
        weights = (as_float(params, "ours_weight"), as_float(params, "theirs_weight"))
        seed = params["seed"]
        assert isinstance(seed, int)
        kind = ours.dtype.type
        keep = keep_masks(ours.size, density, seed) if density < 1 else None
        for index, (side, weight) in enumerate(zip((ours, theirs), weights, strict=True)):
            side -= base
            if keep is not None:
                drop(side, keep[index], density, str(params["rescale"]))
            side *= kind(weight)
        del keep
        normalize = bool(params["normalize"])
        if params["combine"] == "ties":
            return elect(base, ours, theirs, weights, normalize, params)
        ours += theirs
        divisor = None
        if normalize:
            total = kind(weights[0]) + kind(weights[1])
            divisor = total if abs(total) >= 1e-8 else kind(1.0)
        return finish(base, ours, divisor, params)
