"""git-theta: version ML model checkpoints in Git, one tensor at a time.

Kept import-free on purpose: the filter process starts once per git command and
should not pay for anything it does not use. The Python API (``git_theta.save``,
``git_theta.open``, ``git_theta.history``, ``save_to_git``, ``load_from_git``) lives
in ``git_theta.api`` and is loaded on first attribute access.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "Revision",
    "Saved",
    "TensorChange",
    "__version__",
    "history",
    "load_from_git",
    "open",
    "save",
    "save_to_git",
]
_API = frozenset(__all__) - {"__version__"}

if TYPE_CHECKING:
    from git_theta.api import (
        Checkpoint,
        Revision,
        Saved,
        TensorChange,
        history,
        load_from_git,
        open,
        save,
        save_to_git,
    )


def __getattr__(name: str) -> Any:
    if name in _API:
        from git_theta import api

        return getattr(api, name)
    raise AttributeError(f"module 'git_theta' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


class _Package(type(sys)):  # type: ignore[misc]
    """The package module, whose API names are never replaced by a submodule of the same
    name: importing ``git_theta.history`` (the manifest walker every command uses) would
    otherwise make ``git_theta.history(...)`` a TypeError for the rest of the process."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, type(sys)):
            return  # the submodule stays reachable through sys.modules and `from ... import`
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
