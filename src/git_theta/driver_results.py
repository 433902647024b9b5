"""The manifest the merge driver last wrote for a conflicted path, so that `git theta
merge` knows the work-tree file as the driver's own result.

With the prompt answered for some tensors, the file git checks out after a conflict is
neither ours nor anything the settings alone give, and `git theta merge --strategy`
refused it as the user's own work. The driver leaves the manifest it wrote in
``LFS_DIR/theta/driver-results/KEY`` (KEY: a hash of the work tree's top and the path,
so two work trees of one repository do not share one); `git theta merge` accepts a file
that matches it, tensor hash by tensor hash, and removes it when the path is resolved.
It is a hint only: a missing, stale or unreadable one just means the file is compared
with the other candidates. Failures here are silent.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from git_theta.manifest import Manifest
    from git_theta.store import ObjectStore

DIR = "driver-results"


def _path(store: ObjectStore, top: str, path: str) -> str:
    key = hashlib.sha256(f"{os.path.abspath(top)}\0{path}".encode("utf-8", "surrogateescape"))
    return os.path.join(store.own, DIR, key.hexdigest())


def save(store: ObjectStore, top: str, path: str, data: bytes) -> None:
    """Remember ``data``, the manifest the driver wrote for ``path``."""
    from git_theta.errors import ThetaError
    from git_theta.files import AtomicWriter

    dest = _path(store, top, path)
    with contextlib.suppress(OSError, ThetaError):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with AtomicWriter(dest) as fh:
            fh.write(data)


def load(store: ObjectStore, top: str, path: str) -> Manifest | None:
    """The manifest the driver last wrote for ``path``, or None (none, or not readable
    as a manifest)."""
    from git_theta.errors import ThetaError
    from git_theta.files import read_capped
    from git_theta.manifest import MAX_BYTES, parse

    try:
        return parse(read_capped(_path(store, top, path), MAX_BYTES))
    except (OSError, ThetaError, ValueError):
        return None


def drop(store: ObjectStore, top: str, path: str) -> None:
    """Forget what the driver wrote for ``path`` (resolved, or merged cleanly)."""
    with contextlib.suppress(OSError):
        os.unlink(_path(store, top, path))
