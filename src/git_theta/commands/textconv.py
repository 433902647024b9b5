"""``git-theta textconv``: one line per tensor, for ``git show`` and ``git log -p``.

git runs textconv on each side separately (and on the checked-out form of the file), so
the lines carry what one version can say: dtype, shape, L2 norm and content hash. A
changed tensor shows up as a -/+ pair. ``git diff`` uses the richer diff driver instead.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from git_theta.commands.diff import file_side
from git_theta.diffing import DEFLATED, from_file
from git_theta.display import escape
from git_theta.files import open_regular
from git_theta.manifest import is_manifest
from git_theta.repo import Repo
from git_theta.values import as_float64

_SLICE = 8 << 20  # bytes widened at a time (a multiple of every item size)


def _l2(data: bytes | bytearray, dtype: str) -> str:
    """The tensor's L2 norm over its finite values, widened a slice at a time: a large
    (or a crafted, inflated) tensor costs its bytes, not 5x them in float64 copies."""
    from git_theta.diffing import _l2_norm

    view = memoryview(data)
    norm = 0.0
    for at in range(0, max(len(view), 1), _SLICE):
        values = as_float64(view[at : at + _SLICE], dtype)
        if values is None:
            return ""
        # Slices combined by hypot, each scaled when its squares overflow (F64 near 1e300)
        norm = math.hypot(norm, _l2_norm(values[np.isfinite(values)]))
    return f"  L2 {norm:.6g}"


def textconv(path: str) -> int:
    norms: dict[str, str] = {}
    with open_regular(path) as fh:  # git's temporary or a work-tree file: never a FIFO
        placeholder = is_manifest(fh.read(64))
    if placeholder:  # a manifest left by a skipped smudge: values come from objects
        sides = file_side(path, Repo().store)
        for name, side in sides.items():
            readable = side.load is not None and not side.unreadable
            norms[name] = _l2(side.load(), side.dtype) if readable and side.load else ""
    else:  # one read per tensor: hashed and measured together
        sides = from_file(path, lambda name, dtype, data: norms.__setitem__(name, _l2(data, dtype)))
        for name, side in sides.items():  # compressed npz members: inflated to measure
            if side.update == DEFLATED and side.load is not None and not side.unreadable:
                norms[name] = _l2(side.load(), side.dtype)
    out = [f"{len(sides)} tensors"]
    for name in sorted(sides):
        side = sides[name]
        shape = ", ".join(map(str, side.shape))
        line = f"{name}  {side.dtype} [{shape}]{norms.get(name, '')}  {side.hash[:12]}"
        out.append(escape(line))  # names and dtypes come from the repository
    sys.stdout.write("\n".join(out) + "\n")
    return 0
