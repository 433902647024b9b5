"""The merge-strategy contract: how two changed versions of one tensor become one.

A strategy only computes values (``combine``). What every strategy shares lives here:
``parse_params`` checks a user's ``k=v`` settings against the strategy's ``params``, and
``merge_tensor`` runs the element-wise three-way step, widens the tensor's dtype to a
working float type, and rounds the strategy's values back once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from git_theta.errors import ThetaError

ParamValue = float | int | str  # bool is an int: kind=bool params hold True/False


class MergeError(ThetaError, ValueError):
    """Two versions of a tensor cannot be merged as asked."""


class MergeTypeError(MergeError, TypeError):
    """The strategy cannot compute with the tensor's dtype (integers, bool, quantized)."""


class MergeBaseMissingError(MergeError):
    """The strategy needs the common ancestor's tensor and there is none."""


class MergeShapeError(MergeError):
    """The versions differ in byte size, so no element-wise merge is defined."""


@dataclass(frozen=True)
class Param:
    """One setting of a strategy, given as ``--param name=value``."""

    name: str
    kind: type  # float, int, str or bool
    default: ParamValue | None  # None = required (except a uses_seed strategy's "seed")
    help: str
    low: float | None = None  # inclusive bounds for float/int params
    high: float | None = None
    low_open: bool = False  # True: ``low`` itself is not allowed (density > 0)
    choices: tuple[str, ...] = ()  # allowed values of a str param


class MergeStrategy(ABC):
    """A way to combine two changed versions of a tensor. Subclasses set the ClassVars
    and implement ``combine``; the registry key is ``name``."""

    name: ClassVar[str]  # entry-point key: "ours", "average", "ties", ...
    description: ClassVar[str]  # one line, shown by the prompt and `git theta merge --help`
    params: ClassVar[tuple[Param, ...]] = ()
    needs_base: ClassVar[bool] = False  # task arithmetic, TIES, DARE, base: the ancestor
    picks_side: ClassVar[bool] = False  # ours/theirs/base: any dtype, bytes copied exactly
    uses_seed: ClassVar[bool] = False  # DARE: a seed is drawn if not given, and recorded
    # False: combine ignores ``base`` (average, slerp), so the merge does not widen it.
    reads_base: ClassVar[bool] = True
    # True when, given prepare's whole-tensor statistics, element i of the result depends
    # only on element i of the inputs (and on i): merge_tensor then runs prepare once and
    # combine on consecutive blocks, in order, so memory stays at a few blocks. False
    # (the simple plugin): combine gets the whole tensors in one call.
    blockwise: ClassVar[bool] = False

    def prepare(self, blocks: Blocks, params: Mapping[str, ParamValue]) -> object:
        """Return what ``combine`` needs from the whole tensors (norms, a magnitude cut,
        random generators), read through ``blocks``; passed to every combine call as
        ``state``. Only called for blockwise strategies; the default needs nothing."""
        return None

    @abstractmethod
    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return the merged values, same shape as ``ours``.

        Arrays are float32 (float64 for F64 tensors): the whole flattened tensors, or
        for a blockwise strategy the block starting at element ``start``. ``base`` is
        None only when ``needs_base`` is false and the tensor was added on both sides.
        ``params`` is complete (defaults filled, a seed drawn); ``state`` is prepare's
        result. picks_side strategies get the raw arrays and return one of them. May
        return (or overwrite) one of its inputs."""


class Blocks(Protocol):
    """The widened tensors, as prepare reads them."""

    @property
    def size(self) -> int:
        """The number of elements in the tensor."""
        ...

    @property
    def has_base(self) -> bool:
        """Whether there is a common ancestor's tensor (``base`` is not None)."""
        ...

    def __call__(self) -> Iterator[tuple[int, np.ndarray | None, np.ndarray, np.ndarray]]:
        """Yield (start, base, ours, theirs) for consecutive blocks, float32 (float64
        for F64), fresh arrays the caller may overwrite; every call starts over."""
        ...


@dataclass
class TensorMerge:
    """The result of merging one tensor.

    ``data`` holds the merged tensor's bytes (little-endian, in the tensor's dtype) as
    an array of the ``ours`` input's NumPy dtype and shape (a uint16 view in, a uint16
    view out; ml_dtypes bfloat16 in, bfloat16 out). The counts are in elements (in blocks for
    block-quantized types, bytes for packed sub-byte types, one for an opaque dtype)
    and add up to the total: ``unchanged`` equal on all three sides, ``from_ours`` /
    ``from_theirs`` changed on that side only, ``same`` changed identically on both,
    ``merged`` changed differently on both (the strategy's values)."""

    data: np.ndarray
    unchanged: int
    from_ours: int
    from_theirs: int
    same: int
    merged: int
    params: dict[str, ParamValue] = field(default_factory=dict)  # as used, seed included


def parse_params(strategy: MergeStrategy, raw: Mapping[str, str]) -> dict[str, ParamValue]:
    """Return ``raw`` (name -> text, as given on a command line or in a rules file)
    converted to each param's kind, with defaults filled in.

    Raises UsageError (one line naming the param and what is allowed) for an unknown
    name, a value of the wrong kind or out of range, or a missing required param."""
    from git_theta.merges._params import parse

    return parse(strategy, raw)


def merge_tensor(
    strategy: MergeStrategy,
    params: Mapping[str, ParamValue],
    base: np.ndarray | None,
    ours: np.ndarray,
    theirs: np.ndarray,
    dtype: str,
    *,
    tensor: str = "?",
    overwrite_theirs: bool = False,
) -> TensorMerge:
    """Merge one tensor three-way, element by element; ``tensor`` (its name) is only
    used in messages.

    The arrays are any NumPy views of the three versions' bytes in ``dtype`` (a
    git-theta dtype name, e.g. "BF16"); ``base`` is None when the tensor is new on both
    sides. ``params`` comes from ``parse_params``. Elements are compared by their bits
    (NaN and -0.0 are exact): an element changed on one side only comes from that side,
    one changed identically on both is taken, and only elements changed differently on
    both get the strategy's value, computed in float32 (float64 for F64) and rounded
    once to ``dtype`` (round to nearest even). A strategy is consulted (and its dtype
    and base checked) only when some element needs it, so a merge with no conflicting
    element succeeds under any strategy and dtype. Returns a TensorMerge. With
    ``overwrite_theirs`` (``theirs`` writable and read by nothing else afterwards) the
    result may be written over ``theirs`` instead of a new buffer, when the C kernel
    merges it: the merge then holds three tensor-sized buffers, not four. ``theirs`` is
    unspecified after a MergeError then.

    Raises MergeTypeError when a computing strategy meets a dtype it cannot combine
    (see ``combinable``), MergeBaseMissingError when the strategy needs a base and there
    is none, and MergeShapeError when the versions differ in size (a shape or dtype
    change is for the caller to resolve by taking one side whole)."""
    from git_theta.merges._threeway import merge

    return merge(strategy, params, base, ours, theirs, dtype, tensor, overwrite_theirs)


def combinable(dtype: str) -> bool:
    """Return True when computing strategies (average, TIES, ...) can merge tensors of
    git-theta dtype ``dtype``: F16, BF16, F32, F64 and the FP8 types E4M3, E5M2 and
    their FNUZ variants. Others are resolved only by ours, theirs or base."""
    from git_theta.merges._floats import combinable as check

    return check(dtype)
