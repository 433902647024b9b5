"""ours, theirs, base: take one version's bytes as they are (any dtype, bit-exact)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from git_theta.merges.base import MergeStrategy, ParamValue


class Ours(MergeStrategy):
    """Keep our version of every element both sides changed differently.

    Elements only theirs changed still come from theirs (the three-way step runs
    first); to keep our whole tensor, resolve the tensor rather than its elements."""

    name: ClassVar[str] = "ours"
    description: ClassVar[str] = "keep our value where both sides changed an element"
    picks_side: ClassVar[bool] = True

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return ``ours``."""
        return ours


class Theirs(MergeStrategy):
    """Take their version of every element both sides changed differently."""

    name: ClassVar[str] = "theirs"
    description: ClassVar[str] = "take their value where both sides changed an element"
    picks_side: ClassVar[bool] = True

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return ``theirs``."""
        return theirs


class Base(MergeStrategy):
    """Go back to the common ancestor's value for every element both sides changed
    differently. Fails when the tensor has no ancestor (added on both sides)."""

    name: ClassVar[str] = "base"
    description: ClassVar[str] = "keep the common ancestor's value where both sides changed it"
    picks_side: ClassVar[bool] = True
    needs_base: ClassVar[bool] = True

    def combine(
        self,
        base: np.ndarray | None,
        ours: np.ndarray,
        theirs: np.ndarray,
        params: Mapping[str, ParamValue],
        state: object = None,
        start: int = 0,
    ) -> np.ndarray:
        """Return ``base`` (merge_tensor never calls this without one)."""
        assert base is not None
        return base
