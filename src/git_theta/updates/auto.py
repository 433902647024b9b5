"""auto: per tensor, the smallest lossless form among dense, sparse and delta."""

from __future__ import annotations

from collections.abc import Callable

from git_theta import kernels
from git_theta.updates.base import CLEAR_WIN, Buffer, Payload, UpdateType
from git_theta.updates.dense import Dense
from git_theta.updates.layout import itemsize

SPARSE_MAX = 0.5  # above this fraction of changed elements sparse cannot win
DELTA_MIN = 0.01  # below it sparse always beats delta (measured on MiniLM), so skip it
# PEFT's factor tensors are stored whole, never as a change on their previous version:
# a low-rank or ia3 link stores its factors as dense objects of their bytes, so the
# committed adapter file shares those objects only while its tensors are dense too. They
# are small (rank x width), and a fresh adapter's change is rarely sparse anyway.
PEFT_FACTORS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B", ".ia3_l")


def _size(parts: list[bytes]) -> int:
    return sum(map(len, parts))


class Auto(UpdateType):
    key = "auto"
    codec = ""

    def pick(
        self,
        new: Buffer,
        prev: Buffer | None,
        dtype: str,
        dense: Callable[[], list[bytes]],
        dense_estimate: int | None = None,
        name: str = "",
        shape: tuple[int, ...] = (),
    ) -> tuple[str, list[bytes] | None]:
        if prev is None or len(prev) != len(new) or any(p in name for p in PEFT_FACTORS):
            return "dense", dense()
        from git_theta.updates.delta import Delta
        from git_theta.updates.sparse import Sparse, _elements

        size = itemsize(dtype)
        if kernels.native is not None:
            changed = kernels.native.count_changed(prev, new, size)
        else:  # NumPy only here: importing it costs 0.12 s of every add's CPU
            import numpy as np

            changed = int(np.count_nonzero(_elements(prev, size) != _elements(new, size)))
        count = max(1, len(new) // size)
        candidates: list[UpdateType] = []
        if changed <= SPARSE_MAX * count:
            candidates.append(Sparse())
        if changed > DELTA_MIN * count:
            candidates.append(Delta())
        best: tuple[str, list[bytes]] | None = None
        for plugin in candidates:
            parts = plugin.encode(new, prev, dtype)
            if parts is not None and (best is None or _size(parts) < _size(best[1])):
                best = (plugin.key, parts)
        # A clear win over the previous dense size needs no dense encode to compare with.
        if best is not None and dense_estimate and _size(best[1]) < CLEAR_WIN * dense_estimate:
            return best
        if best is None or _size(dense()) <= _size(best[1]):
            return "dense", dense()
        return best

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        dense = Dense()
        return self.pick(new, prev, dtype, lambda: dense.encode(new, None, dtype))[1]

    def apply(
        self, prev: bytearray | None, payload: Payload, dtype: str, limit: int | None = None
    ) -> bytearray:
        raise NotImplementedError("auto is never recorded in a manifest")
