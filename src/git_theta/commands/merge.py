"""git's merge driver (``merge.theta.driver``): merge manifests tensor by tensor."""

from __future__ import annotations

import sys
from pathlib import Path

from git_theta.errors import ManifestError
from git_theta.files import atomic_write
from git_theta.manifest import Manifest, is_manifest, parse
from git_theta.merging import merge3


def _read(path: str) -> Manifest | None:
    data = Path(path).read_bytes()
    if not data:
        return None  # the file did not exist on that side
    if not is_manifest(data):
        raise ManifestError(f"{path} is not a git-theta manifest")
    return parse(data)


def merge_driver(base: str, ours: str, theirs: str, path: str) -> int:
    """Write the merge into ``ours``; exit 0 when clean, 1 with the conflicts listed."""
    o, t = _read(ours), _read(theirs)
    if o is None or t is None:
        sys.stderr.write(f"git-theta: {path}: deleted on one side and changed on the other\n")
        return 1
    result = merge3(_read(base), o, t)
    atomic_write(ours, result.manifest.to_bytes())
    if result.conflicts:
        names = ", ".join(result.conflicts[:10])
        more = f" and {len(result.conflicts) - 10} more" if len(result.conflicts) > 10 else ""
        sys.stderr.write(
            f"git-theta: {path}: tensors changed on both sides: {names}{more}; the merge keeps "
            "ours for them. Edit the checkpoint and `git add` it to resolve.\n"
        )
        return 1
    return 0
