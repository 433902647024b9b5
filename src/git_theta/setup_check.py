"""Is git set up to run git-theta here? Checked before any command that would otherwise
let git store a checkpoint's raw bytes, and reported in full by ``git theta doctor``.

Without ``filter.theta.*`` in git's config, git ignores the ``filter=theta`` attribute
and commits the weights as an ordinary blob (into history for good); with a configured
program that no longer exists (a moved or deleted virtualenv), every command touching a
checkpoint fails with the shell's "not found" and no hint.
"""

from __future__ import annotations

import os
import shlex
import shutil

from git_theta.errors import ThetaError
from git_theta.proc import run

FILTER_KEYS = ("filter.theta.process", "filter.theta.clean", "filter.theta.smudge")
INSTALL = "run `git theta install` (or `git theta install --local` for this repository only)"


class NotSetUpError(ThetaError):
    """git-theta's filter is not configured, or its program is gone."""


def theta_config(cwd: str | None = None) -> dict[str, str]:
    """Return every ``filter.theta.*``, ``diff.theta.*``, ``merge.theta.*`` and ``theta.*``
    setting in effect (all scopes), last one winning as git reads them."""
    done = run(
        "git", "config", "--get-regexp", r"^(filter|diff|merge)\.theta\.|^theta\.",
        check=False, cwd=cwd,
    )  # fmt: skip
    out: dict[str, str] = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def program_problem(command: str) -> str | None:
    """Why the program a configured command runs cannot start, or None when it can."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return f"cannot be parsed ({command!r})"
    if not argv:
        return "is empty"
    if argv[:2] == ["[", "-x"] and len(argv) > 2:
        argv = argv[2:]  # install's guard: `[ -x PYTHON ] || {...}; exec PYTHON ...`
    program = argv[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            return f"runs {program}, which no longer exists (a moved or deleted virtualenv?)"
        return None
    if shutil.which(program) is None:
        return f"runs {program}, which is not on PATH"
    return None


def filter_problem(cwd: str | None = None) -> str | None:
    """One line saying why git would not run git-theta's filter here, or None."""
    config = theta_config(cwd)
    keys = [k for k in FILTER_KEYS if config.get(k)]
    if not keys:
        return f"git-theta's filter is not configured for this repository: {INSTALL} first"
    for key in keys:
        problem = program_problem(config[key])
        if problem:
            return f"{key} {problem}: run `git theta install` again"
    return None


def require_filter(cwd: str | None = None) -> None:
    """Raise NotSetUpError (one line, with the command to run) unless the filter is set up."""
    problem = filter_problem(cwd)
    if problem:
        raise NotSetUpError(problem)
