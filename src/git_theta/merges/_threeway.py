"""The element-wise three-way step every strategy shares (being written)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from git_theta.merges.base import MergeStrategy, ParamValue, TensorMerge


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
    raise NotImplementedError("merge_tensor is being written")
