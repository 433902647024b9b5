"""The one switch between the C kernel and its NumPy twins.

``native`` is the C kernel (``_planes``, built by setup.py) or None, and every module
that has a fast path asks it here, at call time: None means the NumPy definition runs,
which gives the same bytes. It is None when the kernel was not built (no C compiler at
install time) or when ``GIT_THETA_KERNELS=numpy`` asks for the NumPy side, as CI does to
keep the path an install without a compiler takes tested.
"""

from __future__ import annotations

import os
from types import ModuleType

from git_theta.errors import UsageError

ENV = "GIT_THETA_KERNELS"
CHOICES = ("native", "numpy")


def choose() -> ModuleType | None:
    """Return the kernel the environment asks for (the C one when it is built).

    Raises UsageError for a value other than native or numpy."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted and wanted not in CHOICES:
        raise UsageError(f"{ENV}={wanted!r}: use native or numpy")
    if wanted == "numpy":
        return None
    try:
        from git_theta import _planes
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return _planes


native: ModuleType | None = choose()
