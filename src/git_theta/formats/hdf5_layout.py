"""Child process of the HDF5 format: print the tensor spans of the HDF5 file on stdin.

Output: a JSON list of ``[name, dtype, shape, start, end]``. Exit 3 when h5py is missing,
1 with one line on stderr when the file is not valid HDF5.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from git_theta.dtypes import from_numpy_name, lookup
from git_theta.formats.base import MAX_TENSORS

# The HDF5 library parses a file we did not write: it runs with its own limits, so a
# hostile file costs at most this much memory (h5py itself peaks at ~150 MB of address
# space) and CPU time, then fails as one error line.
MEMORY_LIMIT = 512 << 20  # bytes of address space
CPU_LIMIT = 60  # seconds


def _dtype(dataset: Any) -> str | None:
    """Our dtype name for a dataset whose raw bytes are a plain array, else None (glue)."""
    dt = dataset.dtype
    if dt.kind == "V" and dt.names is None and dt.subdtype is None:
        # Keras stores bfloat16 & co. as opaque bytes with the real type in an attribute.
        tagged = dataset.attrs.get("dtype")
        if isinstance(tagged, bytes):
            tagged = tagged.decode("ascii", errors="replace")
        if not isinstance(tagged, str):
            return None
        name = from_numpy_name(tagged)
        known = lookup(name)
        return name if known is not None and known.bits == dt.itemsize * 8 else None
    if dt.kind not in "biufc" or dt.byteorder == ">" or dt.names is not None:
        return None
    name = from_numpy_name(dt.name)
    return name if lookup(name) is not None else None


def spans(fh: Any) -> list[list[Any]]:
    import h5py

    out: list[list[Any]] = []
    with h5py.File(fh, "r") as f:

        def visit(name: str | bytes, obj: Any) -> None:
            if not isinstance(obj, h5py.Dataset) or not isinstance(name, str):
                return  # groups; and names that are not UTF-8 stay glue
            plist = obj.id.get_create_plist()
            if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters():
                return
            offset = obj.id.get_offset()
            dtype = _dtype(obj)
            if offset is None or dtype is None:
                return  # not written yet (fill value only) or not a plain array
            nbytes = obj.id.get_storage_size()
            if nbytes == 0 or nbytes != obj.size * obj.dtype.itemsize:
                return
            if len(out) >= MAX_TENSORS:
                raise ValueError(f"more than {MAX_TENSORS} datasets (git-theta's limit)")
            out.append([name, dtype, list(obj.shape), offset, offset + nbytes])

        f.visititems(visit)
    return out


def _limit_resources() -> None:
    import resource

    for which, value in ((resource.RLIMIT_AS, MEMORY_LIMIT), (resource.RLIMIT_CPU, CPU_LIMIT)):
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, hard))


def main() -> int:
    _limit_resources()
    try:
        import h5py  # noqa: F401
    except ImportError:
        return 3
    try:
        rows = spans(os.fdopen(0, "rb", closefd=False))
    except Exception as exc:  # h5py raises OSError, KeyError, ValueError... on bad files
        detail = str(exc).strip().splitlines()
        sys.stderr.write(f"{type(exc).__name__}: {detail[0][:200] if detail else ''}\n")
        return 1
    sys.stdout.write(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
