"""``git theta install``: register the filter and drivers in git config.

Every command line written here runs this interpreter with ``interpreter.FLAGS``: git
runs them in the work tree of repositories anyone may have written, so nothing in
``PYTHONPATH`` or the working directory may supply a module.
"""

from __future__ import annotations

import os
import shlex
import sys

from git_theta import filter_client, git
from git_theta.errors import ThetaError, UsageError
from git_theta.hooks import HooksElsewhereError, install_hooks
from git_theta.interpreter import python_argv
from git_theta.proc import run

GUARD = "[ -x {python} ] || {{ echo {message} >&2; exit 1; }}; exec "


def command(*args: str) -> str:
    """The shell command (git runs these with sh) that runs ``git-theta ARGS...``: this
    interpreter, isolated, behind a check that it still exists, so that a moved or
    deleted virtualenv says what to do instead of the shell's "not found" and git's "the
    remote end hung up unexpectedly"."""
    argv = python_argv("-m", "git_theta", *args)
    message = (
        f"git-theta: error: {argv[0]}, the Python git-theta was installed with, is gone "
        "(a moved or deleted virtualenv?): reinstall git-theta and run `git theta install` "
        "again"
    )
    guard = GUARD.format(python=shlex.quote(argv[0]), message=shlex.quote(message))
    return guard + shlex.join(argv)


def process_command(server: bool = False) -> str:
    """What git runs as the long-running filter: the filter itself, or with ``server``
    the client that hands git's pipes to a warm filter server (this interpreter without
    site-packages: 10 ms to start)."""
    if server:
        return shlex.join([sys.executable, "-I", "-S", filter_client.__file__])
    return command("filter-process")


def settings(server: bool = False) -> list[tuple[str, str]]:
    """Every key install writes, with its value. git appends its arguments to the diff
    driver and textconv, and substitutes the %-placeholders (quoted) itself."""
    return [
        ("filter.theta.process", process_command(server)),
        ("filter.theta.clean", command("clean", "--") + " %f"),
        ("filter.theta.smudge", command("smudge", "--") + " %f"),
        ("filter.theta.required", "true"),
        ("diff.theta.command", command("diff-driver")),
        ("diff.theta.textconv", command("textconv")),
        ("diff.theta.cachetextconv", "true"),
        ("merge.theta.name", "git-theta: merge checkpoints tensor by tensor"),
        ("merge.theta.driver", command("merge-driver", "--") + " %O %A %B %P"),
    ]


LFS_MISSING = (
    "git-lfs is not installed; git-theta stores tensors as Git LFS objects. Install it "
    "(Debian/Ubuntu: `apt-get install git-lfs`, macOS: `brew install git-lfs`) and run "
    "`git theta install` again"
)


class NotImportableError(ThetaError):
    """The configured commands would not find this git-theta."""


_importable: list[bool] = []


def check_importable() -> None:
    """Raise NotImportableError unless this interpreter, started as the configured
    commands start it, imports this very copy of git-theta."""
    from git_theta.commands import cli

    if _importable:
        return
    probe = "import git_theta.commands.cli as m, sys; sys.stdout.write(m.__file__)"
    done = run(*python_argv("-c", probe), check=False)
    theirs = os.fsdecode(done.stdout)
    try:
        if done.returncode == 0 and os.path.samefile(theirs, cli.__file__):
            _importable.append(True)  # it stays so for this process's life
            return
    except OSError:
        pass
    how = f"{sys.executable}, started as git will start it (-E: ignoring PYTHONPATH"
    fix = "install git-theta with pip (in a virtualenv, or --user), then run `git theta install`"
    if done.returncode == 0 and theirs:
        raise NotImportableError(
            f"{how}), imports another git-theta ({_package(theirs)}) than this one "
            f"({_package(cli.__file__)}): {fix}"
        )
    raise NotImportableError(
        f"{how} and every PYTHON* variable, so that a cloned repository cannot supply "
        f"modules) does not find git-theta: {fix}"
    )


def _package(cli_file: str) -> str:
    return os.path.dirname(os.path.dirname(cli_file))  # the git_theta directory


def install(scope: str, server: bool = False) -> int:
    """Write git-theta's config in ``scope`` (the warm filter server's client as the
    filter with ``server``); return 0. Raises ThetaError when git-lfs is missing or the
    configured commands would not import git-theta, before writing anything."""
    if scope == "local" and not git.inside_work_tree():
        from git_theta.errors import NOT_A_REPOSITORY

        raise UsageError(f"--local: {NOT_A_REPOSITORY}; or install for your user without it")
    if git.lfs_version() is None:
        raise ThetaError(LFS_MISSING)
    check_importable()
    for key, value in settings(server):
        git.config_set(key, value, scope)
    mode = "; filter server on" if server else ""
    sys.stderr.write(f"git-theta: configured git ({scope}{mode})\n")
    if scope != "local":
        # A per-user install must not change whichever repository the shell is in; each
        # repository gets its hooks when it is first set up (track, migrate).
        sys.stderr.write(
            "git-theta: hooks are per repository: `git theta track PATTERN` installs the "
            "pre-push hook that uploads tensors (or run `git theta install --local` there)\n"
        )
    elif git.inside_work_tree():
        try:
            hook = install_hooks()
            sys.stderr.write(f"git-theta: installed {hook}\n")
        except HooksElsewhereError as exc:
            sys.stderr.write(f"git-theta: warning: {exc}\n")
    return 0
