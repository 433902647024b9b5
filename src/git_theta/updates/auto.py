"""auto: per tensor, the smallest lossless form among dense, sparse and xor-delta."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from git_theta.updates.base import Buffer, UpdateType
from git_theta.updates.dense import Dense
from git_theta.updates.layout import itemsize
from git_theta.updates.sparse import Sparse, _elements
from git_theta.updates.xor_delta import XorDelta

SPARSE_MAX = 0.5  # above this fraction of changed elements sparse cannot win


class Auto(UpdateType):
    key = "auto"
    codec = ""

    def pick(
        self, new: Buffer, prev: Buffer | None, dtype: str, dense: Callable[[], list[bytes]]
    ) -> tuple[str, list[bytes] | None]:
        best: tuple[str, list[bytes]] = ("dense", dense())
        if prev is None or len(prev) != len(new):
            return best
        size = itemsize(dtype)
        changed = np.count_nonzero(_elements(prev, size) != _elements(new, size))
        candidates: list[UpdateType] = [XorDelta()]
        if changed <= SPARSE_MAX * (len(new) // size):
            candidates.insert(0, Sparse())
        for plugin in candidates:
            parts = plugin.encode(new, prev, dtype)
            if parts is not None and sum(map(len, parts)) < sum(map(len, best[1])):
                best = (plugin.key, parts)
        return best

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        dense = Dense()
        return self.pick(new, prev, dtype, lambda: dense.encode(new, None, dtype))[1]

    def apply(self, prev: bytearray | None, payload: bytes, dtype: str) -> bytearray:
        raise NotImplementedError("auto is never recorded in a manifest")
