"""``git theta uninstall``: remove what ``git theta install`` wrote, hooks included."""

from __future__ import annotations

import sys

from git_theta import git
from git_theta.commands.install import settings
from git_theta.hooks import HooksElsewhereError, remove_hooks
from git_theta.proc import run


def _keys_left(section: str, scope: str) -> list[str]:
    """The keys ``section`` still holds in ``scope`` (names only, in file order)."""
    pattern = "^" + section.replace(".", r"\.") + r"\."
    done = run("git", "config", f"--{scope}", "--name-only", "--get-regexp", pattern,
               check=False)  # fmt: skip
    return done.stdout.decode(errors="replace").split() if done.returncode == 0 else []


def remove_config(scope: str) -> tuple[int, list[str]]:
    """Unset, in ``scope``, exactly the keys install writes, then remove each of their
    sections that is left empty (so a config file install only added to comes back byte
    for byte); return how many keys were removed and the other keys left in those
    sections (a user's own, such as ``diff.theta.xfuncname``)."""
    keys = [key for key, _ in settings()]
    removed = 0
    for key in keys:
        # --unset-all: a key set twice (by hand, or by two installs of old) goes entirely.
        done = run("git", "config", f"--{scope}", "--unset-all", key, check=False)
        removed += done.returncode == 0
    kept: list[str] = []
    for section in dict.fromkeys(key.rsplit(".", 1)[0] for key in keys):
        left = _keys_left(section, scope)
        if left:
            kept += left
        else:  # git may leave the header of an emptied section behind
            run("git", "config", f"--{scope}", "--remove-section", section, check=False)
    return removed, kept


def uninstall(scope: str) -> int:
    """Remove the config keys git-theta's install writes from ``scope`` and, inside a
    repository, its hooks (chained hooks are put back); stop running warm filter servers.
    Checkpoints already committed stay manifests: reinstall to check them out. Returns 0."""
    removed, kept = remove_config(scope)
    total = len(settings())
    what = "the" if removed == total else f"{removed} of the"
    what = f"{what} {total} keys git-theta install writes" if removed else "nothing"
    also = f" (kept {', '.join(kept)}, which it does not write)" if kept else ""
    sys.stderr.write(f"git-theta: removed {what} from the {scope} git config{also}\n")
    from git_theta.commands.server import stop

    stop()  # a running warm server would keep serving the filter just removed
    if git.inside_work_tree():
        try:
            for line in remove_hooks():
                sys.stderr.write(f"git-theta: {line}\n")
        except HooksElsewhereError:
            pass
    return 0
