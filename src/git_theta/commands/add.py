"""``git theta add``: ``git add`` with an update type for the changed tensors."""

from __future__ import annotations

import os

from git_theta.errors import UnknownPluginError, UsageError
from git_theta.proc import run_attached
from git_theta.update_rules import ENV, check_type


def add(paths: list[str], update_type: str | None) -> int:
    """Run ``git add`` on ``paths`` (with GIT_THETA_UPDATE_TYPE when a type is given)."""
    if update_type is not None:
        try:
            os.environ[ENV] = check_type(update_type, "--update-type")
        except UnknownPluginError as exc:
            raise UsageError(str(exc)) from None
    return run_attached("git", "add", "--", *paths)
