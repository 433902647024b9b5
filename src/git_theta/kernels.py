"""The one switch between the C kernel and its NumPy twins.

``native`` is the C kernel (``_planes``, built by setup.py) or None, and every module
that has a fast path asks it here, at call time: None means the NumPy definition runs,
which gives the same bytes. It is None when the kernel was not built (no C compiler at
install time) or when ``GIT_THETA_KERNELS=numpy`` asks for the NumPy side, as CI does to
keep the path an install without a compiler takes tested. ``merge`` is the merge step's
kernel (``_merge``), chosen the same way on first use (the filter never merges, so its
start does not load it).
"""

from __future__ import annotations

import os
from types import ModuleType

from git_theta.errors import UsageError

ENV = "GIT_THETA_KERNELS"
CHOICES = ("native", "numpy")


def choose(name: str = "_planes") -> ModuleType | None:
    """Return C kernel module ``name`` of git_theta when the environment asks for the
    native kernels and it is built, else None.

    Raises UsageError for a value other than native or numpy."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted and wanted not in CHOICES:
        raise UsageError(f"{ENV}={wanted!r}: use native or numpy")
    if wanted == "numpy":
        return None
    import importlib

    try:
        return importlib.import_module(f"git_theta.{name}")
    except ImportError:  # pragma: no cover - depends on the install
        return None


native: ModuleType | None = choose()
# Set by commands.filter.for_one_command once malloc keeps and reuses freed memory at
# any size (_planes.keep_freed_memory): codec's same-size spare buffers then only hold
# memory back from it, and recycle keeps none.
malloc_keeps_freed = False


def __getattr__(name: str) -> ModuleType | None:
    """``merge``: the merge kernel (or None), chosen once, on first use."""
    if name != "merge":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    kernel = choose("_merge")
    globals()["merge"] = kernel
    return kernel
