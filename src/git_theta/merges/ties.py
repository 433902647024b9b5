"""TIES and DARE: sparsified task vectors, combined linearly or by sign election."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from git_theta.merges._floats import add_left
from git_theta.merges.base import Blocks, MergeStrategy, Param, ParamValue
from git_theta.merges.linear import LAMBDA, WEIGHTS, as_float, finish

_CHUNK = 1 << 20  # elements per block of random draws in keep_masks


@dataclass(frozen=True)
class Cut:
    """Which elements of a task vector TIES keeps: magnitude above ``magnitude``, or
    equal to it at an index up to ``last`` (so exactly k are kept)."""

    magnitude: float
    last: int

    def keep(self, delta: np.ndarray, start: int) -> np.ndarray:
        """Return the keep mask of the block of ``delta`` starting at element ``start``."""
        magnitude = np.abs(delta)
        keep: np.ndarray = magnitude > magnitude.dtype.type(self.magnitude)
        if self.last >= start:
            equal = np.flatnonzero(magnitude == magnitude.dtype.type(self.magnitude))
            keep[equal[equal <= self.last - start]] = True
        return keep


def _task_magnitudes(blocks: Blocks, side: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (start, |side - base|) block by block (side 1 ours, 2 theirs)."""
    for start, *arrays in blocks():
        base, part = arrays[0], arrays[side]
        assert base is not None and part is not None
        part -= base
        yield start, np.abs(part, out=part)


def _count(values: np.ndarray, test: np.ufunc, cut: np.floating) -> int:
    """How many of ``values`` pass ``test(value, cut)``, a block at a time (a mask of the
    whole tensor would be a quarter of it again)."""
    return sum(
        int(np.count_nonzero(test(values[i : i + _COUNT_BLOCK], cut)))
        for i in range(0, values.size, _COUNT_BLOCK)
    )


_COUNT_BLOCK = 1 << 20


def find_cut(blocks: Blocks, side: int, density: float, scratch: list[np.ndarray]) -> Cut | None:
    """Return the Cut keeping the ``max(1, int(density * n))`` largest magnitudes of task
    vector ``side`` (1 ours, 2 theirs); among equal magnitudes at the cut, the lowest
    indices. None when everything is kept (density 1). ``scratch`` holds the one
    tensor-sized buffer, reused from side to side."""
    n = blocks.size
    k = max(1, int(density * n))
    if density >= 1 or k >= n:
        return None
    # The merge's own blocks find it in C, without the scratch (_threeway._Widened).
    fast = getattr(blocks, "task_cut", None)
    found = None if fast is None else fast(side, k)
    if found is not None:
        assert isinstance(found, Cut)
        return found
    for start, magnitude in _task_magnitudes(blocks, side):
        if not scratch:
            scratch.append(np.empty(n, dtype=magnitude.dtype))
        scratch[0][start : start + magnitude.size] = magnitude
    scratch[0].partition(n - k)  # in place: only the k-th largest magnitude is needed
    cut = scratch[0][n - k]
    # Partitioned, everything before n - k is at most the cut and everything from it at
    # least: how many lie above it, and how many equal it, without another pass.
    above = _count(scratch[0][n - k :], np.greater, cut)
    equal = _count(scratch[0], np.equal, cut)
    missing = k - above  # equal magnitudes to keep, lowest indices first (>= 1)
    if missing > equal:  # a NaN cut: none equal
        return Cut(float(cut), -1)
    if missing == equal:  # every equal one is kept
        return Cut(float(cut), n - 1)
    # Where the missing-th equal one is: one pass, stopping there.
    for start, magnitude in _task_magnitudes(blocks, side):
        hits = np.flatnonzero(magnitude == cut)
        if missing <= hits.size:
            return Cut(float(cut), start + int(hits[missing - 1]))
        missing -= hits.size
    return Cut(float(cut), -1)  # not reached: the equal ones were counted above


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
    positive = np.add(ours, theirs) >= 0
    negative = ~positive
    kind = ours.dtype.type
    divisor: np.ndarray | None = None
    for delta, weight in ((ours, weights[0]), (theirs, weights[1])):
        # Plain comparisons (a zero or NaN delta agrees with neither sign); np.where on
        # bools and ufuncs with where= are several times slower.
        agrees = delta > 0
        agrees &= positive
        agrees |= (delta < 0) & negative
        delta *= agrees
        if normalize:
            share = agrees * kind(weight)
            divisor = share if divisor is None else np.add(divisor, share, out=divisor)
    add_left(ours, theirs)
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
    blockwise: ClassVar[bool] = True

    def prepare(self, blocks: Blocks, params: Mapping[str, ParamValue]) -> object:
        """Return each task vector's Cut (None: keep all)."""
        density = as_float(params, "density")
        scratch: list[np.ndarray] = []
        return find_cut(blocks, 1, density, scratch), find_cut(blocks, 2, density, scratch)

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return the TIES merge of one block (computed in the inputs' buffers)."""
        assert base is not None and isinstance(state, tuple)
        weights = (as_float(params, "ours_weight"), as_float(params, "theirs_weight"))
        kind = ours.dtype.type
        for side, weight, cut in zip((ours, theirs), weights, state, strict=True):
            side -= base
            if cut is not None:
                side *= cut.keep(side, start)
            side *= kind(weight)
        return elect(base, ours, theirs, weights, bool(params["normalize"]), params)


def _draws(seed: int, position: int, count: int, density: float) -> np.ndarray:
    """Return the keep decisions for draws ``position`` .. ``position + count - 1`` of
    the PCG64 stream of ``seed`` (see keep_masks)."""
    bits = np.random.PCG64(seed)
    bits.advance(position)
    # (r >> 11) * 2**-53 < density  <=>  (r >> 11) < ceil(density * 2**53)  (an integer
    # compared with a real)  <=>  r < ceil(density * 2**53) << 11: one comparison.
    below = np.uint64(math.ceil(density * 2.0**53) << 11)
    keep = np.empty(count, dtype=bool)
    for start in range(0, count, _CHUNK):
        raw = bits.random_raw(min(_CHUNK, count - start))
        np.less(raw, below, out=keep[start : start + raw.size])
    return keep


def keep_masks(n: int, density: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return DARE's keep masks for our and their task vector of ``n`` elements.

    The draws are the 64-bit outputs ``r`` of NumPy's PCG64 bit generator seeded with
    ``seed``: the first ``n`` for ours, the next ``n`` for theirs; element i is kept when
    ``(r >> 11) * 2**-53 < density``. PCG64 is a fixed algorithm, so a seed gives the
    same masks on every machine and NumPy version."""
    return _draws(seed, 0, n, density), _draws(seed, n, n, density)


@dataclass(frozen=True)
class _DareState:
    size: int
    scales: tuple[float, float]  # rescaling of the kept elements, per side


class Dare(MergeStrategy):
    """DARE (Yu et al. 2023): drop and rescale each task vector, then combine them.

    Each element of ``side - base`` is kept with probability ``density`` (masks from
    ``seed``, see keep_masks) and the kept ones are rescaled (``rescale``: by
    ``1/density`` as in the paper, ``l1`` to the task vector's L1 norm as mergekit, not
    when either norm is below 1e-7, or ``none``); the vectors are weighted and combined
    by ``combine``: ``linear`` (task arithmetic, mergekit's ``dare_linear``) or ``ties``
    (sign election, ``dare_ties``); ``base + lambda * that``, divided by the (agreeing)
    weights when ``normalize``."""

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
    blockwise: ClassVar[bool] = True

    def prepare(self, blocks: Blocks, params: Mapping[str, ParamValue]) -> object:
        """Return the tensor size and each side's rescaling factor."""
        density = as_float(params, "density")
        rescale = params["rescale"]
        if rescale != "l1" or density >= 1:
            scale = 1.0 / density if rescale == "density" and density < 1 else 1.0
            return _DareState(blocks.size, (scale, scale))
        seed = params["seed"]
        assert isinstance(seed, int)
        sums = np.zeros((2, 2))  # per side: L1 before and after dropping
        for start, base, ours, theirs in blocks():
            assert base is not None
            for index, side in enumerate((ours, theirs)):
                side -= base
                np.abs(side, out=side)
                sums[index, 0] += np.sum(side, dtype=np.float64)
                side *= _draws(seed, index * blocks.size + start, side.size, density)
                sums[index, 1] += np.sum(side, dtype=np.float64)
        scales = tuple(float(b / a) if b >= 1e-7 and a >= 1e-7 else 1.0 for b, a in sums.tolist())
        return _DareState(blocks.size, (scales[0], scales[1]))

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return the DARE merge of one block (computed in the inputs' buffers)."""
        assert base is not None and isinstance(state, _DareState)
        density = as_float(params, "density")
        weights = (as_float(params, "ours_weight"), as_float(params, "theirs_weight"))
        seed = params["seed"]
        assert isinstance(seed, int)
        kind = ours.dtype.type
        for index, (side, weight) in enumerate(zip((ours, theirs), weights, strict=True)):
            side -= base
            if density < 1:
                side *= _draws(seed, index * state.size + start, side.size, density)
                if params["rescale"] == "density":
                    side /= kind(density)
                elif state.scales[index] != 1.0:
                    side *= kind(state.scales[index])
            side *= kind(weight)
        normalize = bool(params["normalize"])
        if params["combine"] == "ties":
            return elect(base, ours, theirs, weights, normalize, params)
        ours += theirs
        divisor = None
        if normalize:
            total = kind(weights[0]) + kind(weights[1])
            divisor = total if abs(total) >= 1e-8 else kind(1.0)
        return finish(base, ours, divisor, params)
