"""Stage a checkpoint given as a byte stream: clean it in this process, store the
manifest as a blob and point the index at it. The work-tree file is written only when
asked, from the same stream (teed), so the tensors are read once."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from git_theta import git
from git_theta.errors import ThetaError, UsageError

if TYPE_CHECKING:
    from git_theta.manifest import Manifest
    from git_theta.protocol.filter_process import Source
    from git_theta.repo import Repo
    from git_theta.updates.base import UpdateType


class NotTrackedError(UsageError):
    """The path is not tracked by git-theta (git would store it as a plain blob)."""


class Where:
    """A path inside a repository: the work tree's top and the path relative to it."""

    def __init__(self, repo: str | os.PathLike[str], path: str | os.PathLike[str]):
        base = os.path.abspath(os.fspath(repo))
        if not git.inside_work_tree(base):
            raise UsageError(f"{base} is not inside a git work tree (run `git init` there first)")
        self.top = str(git.toplevel(base))  # git gives it with every link resolved
        # The user's own links to the repository (repo=, an absolute path through one)
        # are theirs to follow; links inside the work tree are refused by require_tracked.
        full = os.path.normpath(os.path.join(os.path.realpath(base), os.fspath(path)))
        rel = os.path.relpath(full, self.top)
        if rel.startswith(".." + os.sep) and os.path.isabs(os.fspath(path)):
            head, name = os.path.split(full)
            full = os.path.join(os.path.realpath(head), name)
            rel = os.path.relpath(full, self.top)
        if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
            raise UsageError(f"{os.fspath(path)} is outside the repository at {self.top}")
        self.path = rel.replace(os.sep, "/")
        self.full = full


def is_tracked(where: Where) -> bool:
    """Whether .gitattributes gives ``where`` git-theta's filter."""
    out = git.git("check-attr", "filter", "--", where.path, cwd=where.top)
    return out.decode(errors="replace").rstrip("\n").endswith(": filter: theta")


def require_no_links(where: Where) -> None:
    """Raise UnsafeFileError when a directory on the way from the work tree's top to
    ``where`` is a symlink: git does not add a path beyond one, and what lies behind it
    may be outside the repository (read, or written, there). Missing ones are fine."""
    import stat

    from git_theta.files import UnsafeFileError

    here = where.top
    for part in where.path.split("/")[:-1]:
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeFileError(
                f"{os.path.relpath(here, where.top)} is a symbolic link; git-theta does not "
                f"save {where.path} through it (replace it with a directory, or move it aside)"
            )


def require_replaceable(where: Where) -> None:
    """Raise UnsafeFileError, before anything is staged, when what is at ``where`` in the
    work tree is not a regular file (a symlink, planted or not, a directory): the file
    could not be written over it, and the index would no longer match the work tree."""
    import stat

    from git_theta.files import UnsafeFileError, kind_of

    try:
        st = os.lstat(where.full)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(
            f"{where.path} is {kind_of(st.st_mode)}; git-theta replaces only regular files "
            "(move it aside and retry)"
        )


def require_tracked(where: Where) -> None:
    """Raise NotSetUpError when the filter is not configured, UnsafeFileError when the path
    goes through a symlinked directory, NotTrackedError when the path is not tracked: the
    checks ``git theta add`` makes, as one line each."""
    from git_theta.setup_check import require_filter

    require_filter(where.top)
    require_no_links(where)
    if not is_tracked(where):
        raise NotTrackedError(
            f"{where.path} is not tracked by git-theta: run `git theta track {where.path}` first"
        )


def policy(top: str, update_type: str | None) -> Callable[[str], UpdateType]:
    """The update type of each tensor: ``update_type`` for all, else what ``git add``
    would use (GIT_THETA_UPDATE_TYPE, .theta-updates, auto)."""
    from git_theta.update_rules import check_type, load_policy

    if update_type is None:
        return load_policy(top)
    from git_theta.updates import UPDATES

    plugin = UPDATES.get(check_type(update_type, "update_type"))
    return lambda _name: plugin


class _Collect:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.parts.append(bytes(data))
        return len(data)


def clean_to_manifest(
    repo: Repo,
    where: Where,
    source: Source,
    update_for: Callable[[str], UpdateType],
    previous: Manifest | None = None,
) -> bytes:
    """Clean ``source`` as ``git add`` would, against ``previous`` (default: the staged
    manifest) and, for tensors it does not explain, the repository's other manifests
    (identity.py: a tensor moved from another file is not stored again); return the
    manifest's bytes."""
    from git_theta.clean import clean

    if previous is None:
        previous = repo.staged_manifest(where.path)
    sink = _Collect()
    clean(source, sink, where.path, repo.store, previous, show_progress=False,
          update_for=update_for, known=repo.known)  # fmt: skip
    return b"".join(sink.parts)


def stage_manifest(where: Where, manifest: bytes) -> str:
    """Write ``manifest`` as a blob and stage it at ``where``; return the blob id."""
    blob = git.git("hash-object", "-w", "--stdin", cwd=where.top, stdin=manifest)
    oid = blob.decode().strip()
    mode = "100644"
    staged = git.git("ls-files", "-s", "-z", "--", where.path, cwd=where.top).split(b"\0")[0]
    if staged[:6] in (b"100755", b"100644"):
        mode = staged[:6].decode()
    git.git("update-index", "--add", "--cacheinfo", f"{mode},{oid},{where.path}", cwd=where.top)
    return oid


def refresh(where: Where) -> None:
    """Let the index learn the work-tree file's stat data (git checks its content once,
    with our filter), so ``git status`` and ``git diff-index`` see it as unchanged."""
    from git_theta.proc import run

    run("git", "update-index", "-q", "--refresh", "--", where.path, check=False, cwd=where.top)


def install_hooks_quietly(top: str) -> None:
    """Install the pre-push hook as the filter does on its first run: a save that never
    ran the filter must still upload its objects on push. A warning, never a failure."""
    import sys

    from git_theta.hooks import HooksElsewhereError, install_hooks, runs_theta

    try:
        install_hooks(top)
    except HooksElsewhereError as exc:
        if not runs_theta(os.path.join(git.hooks_dir(top), "pre-push")):
            sys.stderr.write(f"git-theta: warning: {exc}\n")
    except ThetaError as exc:
        sys.stderr.write(f"git-theta: warning: {exc}\n")


def commit(top: str, message: str) -> str:
    """``git commit -m message`` (the whole index, hooks run); return the new commit id.
    A save of unchanged weights still makes its commit (``--allow-empty``), as the
    predecessor's save_to_git did: one commit per save, always."""
    from git_theta.proc import run

    done = run("git", "commit", "-q", "--allow-empty", "-m", message, check=False, cwd=top)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        raise ThetaError(f"git commit failed: {why[-1] if why else 'no output'}")
    return git.git("rev-parse", "HEAD", cwd=top).decode().strip()


def check_tag(top: str, name: str) -> None:
    """Raise UsageError, before anything is staged or committed, when ``name`` is not a
    valid tag name or the tag exists."""
    from git_theta.proc import run

    if run("git", "check-ref-format", f"refs/tags/{name}", check=False).returncode != 0:
        raise UsageError(f"tag {name!r} is not a valid tag name")
    done = run("git", "rev-parse", "-q", "--verify", f"refs/tags/{name}", check=False, cwd=top)
    if done.returncode == 0:
        raise UsageError(f"tag {name!r} already exists; pick another name (tags are not moved)")


def tag(top: str, name: str, commit_id: str) -> None:
    """Create the lightweight tag ``name`` at ``commit_id``; raises UsageError when it
    exists (a tag is never moved silently)."""
    from git_theta.proc import run

    done = run("git", "tag", name, commit_id, check=False, cwd=top)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise UsageError(f"tag {name!r}: {why[-1] if why else 'git tag failed'}")
