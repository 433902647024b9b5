"""Which git command started us: the nearest git among our ancestors (Linux /proc).

git starts filters and drivers through ``sh -c`` (and the ``git-theta`` command is a shell
script), so the parent is often a shell: the nearest ancestor that is git is what the user
typed. Used for git's ``-q`` (progress.py) and to tell a command that only looks
(``git status``, ``git diff``) from one that stores (``git add``): the first may degrade
when git-theta's own settings or an optional dependency fail, the second must not.
"""

from __future__ import annotations

import os

git_pid: int | None = None  # the git command we serve, when it is not an ancestor (forkserver)
# Set by the clean filter while it serves git: only there may a file be stored another way
# (a diff driver reading the same file must not describe it as something else).
in_clean_filter = False
_MAX_HOPS = 6  # git -> sh -> git-theta's script -> python: a few levels at most

# git commands that run the clean filter only to compare a file with the index: nothing
# they compute is stored as a commit's content.
LOOKING = frozenset(
    {
        "status", "diff", "diff-files", "diff-index", "difftool", "show", "log",
        "whatchanged", "grep", "describe", "blame", "ls-files", "checkout", "switch",
        "restore", "reset", "pull", "merge", "rebase", "cherry-pick", "revert",
    }
)  # fmt: skip

_TAKES_VALUE = frozenset({b"-c", b"-C", b"--git-dir", b"--work-tree", b"--namespace",
                          b"--exec-path", b"--config-env"})  # fmt: skip


def _parent_of(pid: int) -> int:
    """Return ``pid``'s parent (0 when unknown), from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def nearest_git_argv() -> list[bytes] | None:
    """Return the argv of the nearest git ancestor, or None (not started by git)."""
    pid = git_pid or os.getppid()
    for _ in range(_MAX_HOPS):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
        except OSError:
            return None
        if os.path.basename(args[0]) == b"git":
            return [a for a in args if a] or None
        pid = _parent_of(pid)
    return None


def subcommand(argv: list[bytes]) -> str | None:
    """Return git's subcommand in ``argv`` ("add" of ``git -c x=y add f``), or None."""
    rest = iter(argv[1:])
    for word in rest:
        if word in _TAKES_VALUE:
            next(rest, None)
        elif not word.startswith(b"-"):
            return os.fsdecode(word)
    return None


def git_is_quiet() -> bool:
    """True when the git command that started us was given -q/--quiet."""
    argv = nearest_git_argv()
    return argv is not None and (b"--quiet" in argv or b"-q" in argv)


def git_only_looks() -> bool:
    """True in the clean filter when the git command that started us only compares files
    (status, diff, checkout...); False when it may store what we return (add, commit,
    stash...), when no git started us, or outside the clean filter."""
    if not in_clean_filter:
        return False
    argv = nearest_git_argv()
    return argv is not None and subcommand(argv) in LOOKING
