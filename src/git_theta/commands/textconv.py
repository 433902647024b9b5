"""``git-theta textconv``: one line per tensor, for ``git show`` and ``git log -p``.

git runs textconv on each side separately (and on the checked-out form of the file), so
the lines carry what one version can say: dtype, shape, L2 norm and content hash. A
changed tensor shows up as a -/+ pair. ``git diff`` uses the richer diff driver instead.
"""

from __future__ import annotations

import sys

import numpy as np

from git_theta.commands.diff import file_side
from git_theta.repo import Repo
from git_theta.values import as_float64


def textconv(path: str) -> int:
    sides = file_side(path, Repo().store)
    out = [f"{len(sides)} tensors"]
    for name in sorted(sides):
        side = sides[name]
        norm = ""
        if side.load is not None:
            values = as_float64(side.load(), side.dtype)
            if values is not None:
                finite = values[np.isfinite(values)]
                norm = f"  L2 {float(np.sqrt(np.dot(finite, finite))):.6g}"
        shape = ", ".join(map(str, side.shape))
        out.append(f"{name}  {side.dtype} [{shape}]{norm}  {side.hash[:12]}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0
