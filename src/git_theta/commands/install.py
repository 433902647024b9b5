"""``git theta install``: register the filter and drivers in git config."""

from __future__ import annotations

import sys

from git_theta import git
from git_theta.errors import ThetaError
from git_theta.hooks import HooksElsewhereError, install_hooks

SETTINGS = (
    ("filter.theta.process", "git-theta filter-process"),
    ("filter.theta.clean", "git-theta clean -- %f"),
    ("filter.theta.smudge", "git-theta smudge -- %f"),
    ("filter.theta.required", "true"),
    ("diff.theta.command", "git-theta diff-driver"),
    ("diff.theta.textconv", "git-theta textconv"),
    ("diff.theta.cachetextconv", "true"),
    ("merge.theta.name", "git-theta: merge checkpoints tensor by tensor"),
    ("merge.theta.driver", "git-theta merge-driver %O %A %B %P"),
)

LFS_MISSING = (
    "git-lfs is not installed; git-theta stores tensors as Git LFS objects. Install it "
    "(Debian/Ubuntu: `apt-get install git-lfs`, macOS: `brew install git-lfs`) and run "
    "`git theta install` again"
)


def install(scope: str) -> int:
    """Write git-theta's config in ``scope``; fail when git-lfs is missing."""
    if git.lfs_version() is None:
        raise ThetaError(LFS_MISSING)
    for key, value in SETTINGS:
        git.config_set(key, value, scope)
    sys.stderr.write(f"git-theta: configured git ({scope})\n")
    if git.inside_work_tree():
        try:
            hook = install_hooks()
            sys.stderr.write(f"git-theta: installed {hook}\n")
        except HooksElsewhereError as exc:
            sys.stderr.write(f"git-theta: warning: {exc}\n")
    return 0
