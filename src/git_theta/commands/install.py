"""``git theta install``: register the filter and drivers in git config."""

from __future__ import annotations

import shlex
import sys

from git_theta import filter_client, git
from git_theta.errors import ThetaError
from git_theta.hooks import HooksElsewhereError, install_hooks


def process_command() -> str:
    """What git runs as the long-running filter: this interpreter, without site-packages
    (10 ms to start), on the client that hands git's pipes to a warm filter server."""
    return shlex.join([sys.executable, "-I", "-S", filter_client.__file__])


SETTINGS = (
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
    for key, value in (("filter.theta.process", process_command()), *SETTINGS):
        git.config_set(key, value, scope)
    sys.stderr.write(f"git-theta: configured git ({scope})\n")
    if git.inside_work_tree():
        try:
            hook = install_hooks()
            sys.stderr.write(f"git-theta: installed {hook}\n")
        except HooksElsewhereError as exc:
            sys.stderr.write(f"git-theta: warning: {exc}\n")
    return 0
