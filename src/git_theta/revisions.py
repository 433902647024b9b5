"""Checking the revisions users type, with git's exit code and a line that names them.

Every command that takes a revision (diff, show, ls-files, fetch, fsck, upload, migrate)
reads trees through ``git.tree_blobs`` / ``git.new_blobs``, which call ``require`` when
git refuses a revision, so none of them can turn a typo into an empty answer or a raw
git error.
"""

from __future__ import annotations

from git_theta.errors import ThetaError
from git_theta.proc import run

BAD_REVISION_EXIT = 128  # what git exits with for an unknown revision
# rev-list's options that stand for sets of revisions: the only words starting with '-'
# taken where a revision goes (any other may be an option: --output=FILE writes FILE).
REV_SETS = frozenset({"--all", "--branches", "--tags", "--remotes", "--reflog",
                      "--indexed-objects"})  # fmt: skip


class BadRevisionError(ThetaError, LookupError):
    """A revision the user gave names no commit or tree."""

    exit_code = BAD_REVISION_EXIT


def resolves(rev: str, cwd: str | None = None) -> bool:
    """Return True when ``rev`` names a commit or a tree in the repository at ``cwd``."""
    probe = run(
        "git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{tree}}",
        check=False, cwd=cwd,
    )  # fmt: skip
    return probe.returncode == 0


def has_commits(cwd: str | None = None) -> bool:
    """Return True when HEAD names a commit (False on an unborn branch)."""
    return resolves("HEAD", cwd)


def bad_revision(rev: str, cwd: str | None = None) -> BadRevisionError:
    """Return the error that says what is wrong with ``rev``, which git refused. Raises
    NotARepositoryError when there is no repository at all."""
    run("git", "rev-parse", "--git-dir", cwd=cwd)  # outside a repository: that error
    base = rev.split(":", 1)[0]
    for mark in ("~", "^", "@{"):
        base = base.split(mark, 1)[0]
    if rev.startswith("-"):
        return BadRevisionError(f"{rev!r} is not a revision: give options before revisions")
    if base in ("HEAD", "") and not has_commits(cwd):
        return BadRevisionError(
            f"unknown revision {rev!r}: this repository has no commits yet; commit first "
            "(or compare the index with the work tree: `git theta diff`)"
        )
    if base and base != rev and resolves(base, cwd):
        return BadRevisionError(
            f"unknown revision {rev!r}: {base} exists, but its history is shorter than that "
            "or it has no such parent; see `git log --oneline " + base + "`"
        )
    return BadRevisionError(
        f"unknown revision {rev!r}: no branch, tag or commit has that name; see "
        "`git branch -a` and `git log --oneline`"
    )


def require(revs: list[str], cwd: str | None = None, *, sets: bool = False) -> None:
    """Raise BadRevisionError (exit 128) for the first of ``revs`` that names no commit
    or tree; ``^REV`` (an exclusion) is checked as the revision it holds, REV_SETS are
    taken when ``sets`` (rev-list's arguments), any other word starting with '-' is
    refused."""
    for rev in revs:
        plain = rev.removeprefix("^")
        if sets and plain in REV_SETS:
            continue
        if plain.startswith("-") or not resolves(plain, cwd):
            raise bad_revision(plain, cwd)
