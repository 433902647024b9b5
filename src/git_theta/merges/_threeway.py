"""The element-wise three-way step every strategy shares (see base.merge_tensor).

The tensors are walked in blocks of BLOCK units: for each, which units each side
changed, the result assembled from the sides, and the strategy's values for the units
both sides changed differently. Scratch memory is a few blocks; only the result is
tensor-sized (and whatever a strategy's prepare keeps, e.g. TIES's magnitudes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from git_theta.merges import _floats
from git_theta.merges.base import (
    MergeBaseMissingError,
    MergeError,
    MergeShapeError,
    MergeStrategy,
    MergeTypeError,
    ParamValue,
    TensorMerge,
)

BLOCK = 1 << 15  # units per block: 128 KB of float32 per array, in cache
_IEEE = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}


def draw_seed() -> int:
    """Return a fresh seed for a strategy that ``uses_seed`` (63 bits from the OS)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def tensor_seed(seed: int, tensor: str) -> int:
    """Return the seed of ``tensor``'s own random stream in a merge seeded with ``seed``.

    One seed is given (or drawn) for a whole merge; were it used as it is, every tensor
    of the same size would drop the same positions (all of a model's q, k and v
    projections alike). Mixing in the name keeps a merge reproducible from its record."""
    import hashlib

    digest = hashlib.sha256(f"{seed}\0{tensor}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return a bool per unit: do the bits of ``a`` and ``b`` differ?"""
    differ = np.not_equal(a, b)
    return np.asarray(differ if a.ndim == 1 else differ.any(axis=1))


@dataclass
class _Widened:
    """base.Blocks over unit views of a combinable dtype."""

    b: np.ndarray | None
    o: np.ndarray
    t: np.ndarray
    dtype: str

    @property
    def size(self) -> int:
        return int(self.o.shape[0])

    @property
    def has_base(self) -> bool:
        return self.b is not None

    def __call__(self) -> Iterator[tuple[int, np.ndarray | None, np.ndarray, np.ndarray]]:
        for start in range(0, self.size, BLOCK):
            yield (start, *self.block(start, min(start + BLOCK, self.size)))

    def task_cut(self, side: int, k: int) -> object:
        """ties.find_cut's Cut keeping the ``k`` largest of |side - base| (side 1 ours,
        2 theirs), found by the C kernel without a tensor-sized copy; None without the
        kernel or a base, or for F64 and FP8 (find_cut then partitions a copy)."""
        from git_theta import kernels
        from git_theta.merges import _native
        from git_theta.merges.ties import Cut

        kernel, kind = kernels.merge, _native.KINDS.get(self.dtype)
        if kernel is None or kind in (None, _native.KINDS["F64"]) or self.b is None:
            return None
        if not _native.LITTLE:
            return None
        magnitude, last = kernel.cut(self.b, (self.o, self.t)[side - 1], kind, k)
        return Cut(magnitude, last)

    def block(
        self, start: int, end: int, with_base: bool = True
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """The block's values, widened (new arrays); the base only ``with_base``."""
        b = None
        if self.b is not None and with_base:
            b = _floats.widen(self.b[start:end], self.dtype)
        return (
            b,
            _floats.widen(self.o[start:end], self.dtype),
            _floats.widen(self.t[start:end], self.dtype),
        )


def merge(
    strategy: MergeStrategy,
    params: Mapping[str, ParamValue],
    base: np.ndarray | None,
    ours: np.ndarray,
    theirs: np.ndarray,
    dtype: str,
    tensor: str,
    overwrite_theirs: bool = False,
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
    # The kernel reads each unit of theirs before it writes that unit of the result.
    in_theirs = overwrite_theirs and t.flags.writeable and t.flags.c_contiguous
    result = t if in_theirs else _result_like(o)
    counts = np.zeros(5, dtype=np.int64)  # unchanged, ours only, theirs only, same, merged
    stream = dict(used)
    if strategy.uses_seed:
        seed = used["seed"]
        assert isinstance(seed, int)
        stream["seed"] = tensor_seed(seed, tensor)
    # NaN and inf are values like any other here (a diverged fine-tune): no warnings on
    # the merge's stderr for inf - inf or 0 * inf.
    with np.errstate(all="ignore"):
        fast = _native_counts(strategy, stream, _Widened(b, o, t, dtype), result, tensor)
        if fast is not None:
            counts[:] = fast
        else:
            if result is t:  # the NumPy definition reads theirs after writing results
                result = _result_like(o)
            combine = _Combiner(strategy, stream, b, o, t, dtype, tensor)
            for start in range(0, o.shape[0], BLOCK):
                end = min(start + BLOCK, o.shape[0])
                conflict = _assemble(b, o, t, result, start, end, counts)
                if conflict is not None:
                    combine(result, conflict, start, end)
    data = result.reshape(-1).view(np.uint8).view(ours.dtype).reshape(ours.shape)
    unchanged, from_ours, from_theirs, same, merged = (int(c) for c in counts)
    return TensorMerge(data, unchanged, from_ours, from_theirs, same, merged, used)


def _result_like(units: np.ndarray) -> np.ndarray:
    """An uninitialised array like ``units`` (the merge writes every unit), in a recycled
    buffer when the codec has one of that size: fresh memory is a page fault per 4 KiB."""
    from git_theta import codec

    buffer = codec.new_buffer(units.nbytes)
    return np.frombuffer(buffer, dtype=units.dtype).reshape(units.shape)


def _native_counts(
    strategy: MergeStrategy,
    params: Mapping[str, ParamValue],
    widened: _Widened,
    result: np.ndarray,
    tensor: str,
) -> tuple[int, int, int, int, int] | None:
    """The C kernel's pass (merges/_native.py) when it is built and covers this merge:
    ``result`` filled and the counts returned; else None."""
    from git_theta import kernels

    kernel = kernels.merge
    if kernel is None:
        return None
    from git_theta.merges import _native

    return _native.run(kernel, strategy, params, widened, result, tensor)


def _assemble(
    b: np.ndarray | None,
    o: np.ndarray,
    t: np.ndarray,
    result: np.ndarray,
    start: int,
    end: int,
    counts: np.ndarray,
) -> np.ndarray | None:
    """Fill result[start:end] from the sides by the three-way rule, add to ``counts``,
    and return the mask of units both sides changed differently (None if there is none)."""
    ob, tb = o[start:end], t[start:end]
    out = result[start:end]
    if b is None:
        conflict = _differ(ob, tb)
        n_conflict = int(np.count_nonzero(conflict))
        out[...] = ob
        counts[3] += (end - start) - n_conflict
        counts[4] += n_conflict
        return conflict if n_conflict else None
    bb = b[start:end]
    ours_changed, theirs_changed = _differ(ob, bb), _differ(tb, bb)
    # Start from ours and take every unit theirs changed; of those, only the ones ours
    # changed differently still need the strategy.
    out[...] = ob
    np.copyto(out, tb, where=theirs_changed if out.ndim == 1 else theirs_changed[:, None])
    n_ours, n_theirs = int(np.count_nonzero(ours_changed)), int(np.count_nonzero(theirs_changed))
    conflict = ours_changed
    conflict &= theirs_changed
    n_both = int(np.count_nonzero(conflict))
    if n_both:
        conflict &= _differ(ob, tb)
    n_conflict = int(np.count_nonzero(conflict)) if n_both else 0
    counts[0] += (end - start) - n_ours - n_theirs + n_both
    counts[1] += n_ours - n_both
    counts[2] += n_theirs - n_both
    counts[3] += n_both - n_conflict
    counts[4] += n_conflict
    return conflict if n_conflict else None


class _Combiner:
    """Writes the strategy's values into the result where both sides changed a unit
    differently; checks, on first need, that the strategy can do it."""

    def __init__(
        self,
        strategy: MergeStrategy,
        params: Mapping[str, ParamValue],
        b: np.ndarray | None,
        o: np.ndarray,
        t: np.ndarray,
        dtype: str,
        tensor: str,
    ):
        self.strategy, self.params, self.dtype, self.tensor = strategy, params, dtype, tensor
        self.b, self.o, self.t = b, o, t
        self.ready = False
        self.state: object = None
        self.whole: np.ndarray | None = None  # a non-blockwise strategy's full result

    def _check(self) -> None:
        strategy, tensor = self.strategy, self.tensor
        if strategy.needs_base and self.b is None:
            raise MergeBaseMissingError(
                f"tensor {tensor}: {strategy.name} needs the common ancestor's tensor and it "
                "has none (added on both sides); use ours, theirs, average or slerp"
            )
        if strategy.picks_side:
            return
        if not _floats.combinable(self.dtype):
            raise MergeTypeError(
                f"tensor {tensor}: {strategy.name} cannot combine {self.dtype} tensors; "
                "use ours, theirs or base"
            )
        widened = _Widened(self.b, self.o, self.t, self.dtype)
        if strategy.blockwise:
            self.state = strategy.prepare(widened, self.params)
        else:  # a simple plugin: one call on the whole tensors
            b, o, t = widened.block(0, widened.size)
            values = strategy.combine(b, o, t, self.params)
            self.whole = _floats.narrow(values, self.dtype).view(self.o.dtype)

    def __call__(self, result: np.ndarray, conflict: np.ndarray, start: int, end: int) -> None:
        if not self.ready:
            self._check()
            self.ready = True
        out = result[start:end]
        if self.strategy.picks_side:
            b = None if self.b is None else self.b[start:end]
            side = self.strategy.combine(b, self.o[start:end], self.t[start:end], self.params)
            np.copyto(out, side, where=conflict if out.ndim == 1 else conflict[:, None])
            return
        if self.whole is not None:
            np.copyto(out, self.whole[start:end], where=conflict)
        else:
            widened = _Widened(self.b, self.o, self.t, self.dtype)
            b, o, t = widened.block(start, end, self.strategy.reads_base)
            values = self.strategy.combine(b, o, t, self.params, self.state, start)
            np.copyto(out, _floats.narrow(values, self.dtype).view(out.dtype), where=conflict)
        if not self._all_finite(out):
            self._check_finite(out, conflict, start, end)

    def _all_finite(self, out: np.ndarray) -> bool:
        """True when every value of the block is finite (then no conflicting one can be
        inf or NaN): two reductions, no temporaries; False says look closer."""
        if self.dtype not in ("F16", "F32", "F64"):
            return False
        values = out.view(_IEEE[self.dtype])
        return bool(np.isfinite(values.min()) and np.isfinite(values.max()))

    def _check_finite(self, out: np.ndarray, conflict: np.ndarray, start: int, end: int) -> None:
        """Raise MergeError when the strategy made inf or NaN from finite inputs: params
        from a committed rules file (lambda=1e300) must not turn a model into inf
        silently. NaN or inf already in an input stays a value like any other."""
        bad = ~np.isfinite(_floats.widen(out[conflict], self.dtype, copy=False))
        if not bad.any():
            return
        for side in (self.b, self.o, self.t):
            if side is not None:
                bad &= np.isfinite(_floats.widen(side[start:end][conflict], self.dtype, False))
        count = int(np.count_nonzero(bad))
        if count:
            raise MergeError(
                f"tensor {self.tensor}: {self.strategy.name} gives values that are not finite "
                f"for {count:,} elements whose versions are (check its params)"
            )
