"""``git theta add``: stage paths through git (update-type options arrive here later)."""

from __future__ import annotations

from git_theta.proc import run_attached


def add(paths: list[str]) -> int:
    """Run ``git add`` on ``paths`` with git's own output; return its exit code."""
    return run_attached("git", "add", "--", *paths)
