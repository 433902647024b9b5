"""``git theta uninstall``: remove what ``git theta install`` wrote, hooks included."""

from __future__ import annotations

import sys

from git_theta import git
from git_theta.hooks import HooksElsewhereError, remove_hooks
from git_theta.proc import run

SECTIONS = ("filter.theta", "diff.theta", "merge.theta", "theta")


def uninstall(scope: str) -> int:
    """Remove git-theta's config sections from ``scope`` and, inside a repository, its
    hooks (chained hooks are put back); stop running warm filter servers. Checkpoints
    already committed stay manifests: reinstall to check them out. Returns 0."""
    removed = []
    for section in SECTIONS:
        done = run("git", "config", f"--{scope}", "--remove-section", section, check=False)
        if done.returncode == 0:
            removed.append(section)
    what = ", ".join(f"[{s}]" for s in removed) if removed else "nothing"
    sys.stderr.write(f"git-theta: removed {what} from the {scope} git config\n")
    from git_theta.commands.server import stop

    stop()  # a running warm server would keep serving the filter just removed
    if git.inside_work_tree():
        try:
            for line in remove_hooks():
                sys.stderr.write(f"git-theta: {line}\n")
        except HooksElsewhereError:
            pass
    return 0
