"""Typed wrappers for every git and git-lfs call git-theta makes.

Our own reads of blobs never run our filter (``NO_FILTER``), so they cannot recurse.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

from git_theta.errors import CommandError
from git_theta.proc import run, run_soon, start

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

# Switch our filter off for git calls we make from inside the filter.
NO_FILTER = (
    "-c", "filter.theta.process=",
    "-c", "filter.theta.clean=",
    "-c", "filter.theta.smudge=",
    "-c", "filter.theta.required=false",
)  # fmt: skip


def git(
    *args: str, check: bool = True, cwd: str | None = None, stdin: bytes | None = None
) -> bytes:
    """Run ``git ARGS`` with our filter disabled and return its stdout."""
    return run("git", *NO_FILTER, *args, check=check, cwd=cwd, stdin=stdin).stdout


def inside_work_tree(cwd: str | None = None) -> bool:
    """Return True when ``cwd`` is inside a git work tree."""
    done = run("git", "rev-parse", "--is-inside-work-tree", check=False, cwd=cwd)
    return done.stdout.strip() == b"true"


def toplevel(cwd: str | None = None) -> Path:
    """Return the work tree root of the repository containing ``cwd``."""
    from pathlib import Path  # commands only; the filter keeps paths as strings

    return Path(git("rev-parse", "--show-toplevel", cwd=cwd).decode().strip())


def show_prefix(cwd: str | None = None) -> str:
    """Return the path of ``cwd`` relative to the work tree root ('' at the root)."""
    return git("rev-parse", "--show-prefix", cwd=cwd).decode().strip()


_dirs: dict[tuple[str | None, str], tuple[str, str]] = {}


def _repo_dirs(cwd: str | None) -> tuple[str, str]:
    """(common dir, hooks dir), absolute, from one git call per process and directory:
    every git command that touches a checkpoint pays for the filter's git calls."""
    key = (cwd, os.getcwd())
    if key not in _dirs:
        out = git("rev-parse", "--path-format=absolute", "--git-common-dir",
                  "--git-path", "hooks", cwd=cwd)  # fmt: skip
        common, hooks = out.decode().splitlines()[:2]
        _dirs[key] = (common, hooks)
    return _dirs[key]


def common_dir(cwd: str | None = None) -> str:
    """Return the absolute git common directory (shared by all worktrees)."""
    return _repo_dirs(cwd)[0]


def hooks_dir(cwd: str | None = None) -> str:
    """Return the directory git runs hooks from (honours core.hooksPath)."""
    return _repo_dirs(cwd)[1]


def config_get(key: str, cwd: str | None = None) -> str | None:
    """Return the value of a git config key, or None when it is unset."""
    done = run("git", "config", "--get", key, check=False, cwd=cwd)
    return done.stdout.decode().strip() if done.returncode == 0 else None


def config_set(key: str, value: str, scope: str, cwd: str | None = None) -> None:
    """Set a git config key in ``scope`` ('global', 'local' or 'system')."""
    run("git", "config", f"--{scope}", key, value, cwd=cwd)


def index_blob(path: str, cwd: str | None = None, limit: int | None = None) -> bytes | None:
    """Return the staged (stage 0) blob of ``path``, or None when it is not in the index
    or (given ``limit``) larger than ``limit`` bytes, which is then never read whole (a
    committed blob of gigabytes may be a few kB in the pack)."""
    return index_blob_soon(path, cwd)(limit)


def index_blob_soon(path: str, cwd: str | None = None) -> Callable[[int | None], bytes | None]:
    """Start reading the staged blob of ``path`` and return the function that, given the
    ``limit``, returns it as ``index_blob`` does: git reads it while the caller works."""
    where = () if cwd is None else ("-C", cwd)  # posix_spawn, which stops at the limit
    finish = run_soon("git", *where, *NO_FILTER, "cat-file", "blob", f":{path}")

    def blob(limit: int | None) -> bytes | None:
        done = finish(limit)
        return done.stdout if done.returncode == 0 else None

    return blob


def lfs_version() -> str | None:
    """Return git-lfs's version line, or None when git-lfs is not installed."""
    done = run("git", "lfs", "version", check=False)
    return done.stdout.decode().strip() if done.returncode == 0 else None


def lfs_storage_dir(cwd: str | None = None) -> str:
    """Return the directory git-lfs keeps objects in (``lfs.storage`` or GIT_COMMON_DIR/lfs)."""
    base = common_dir(cwd)
    configured = config_get("lfs.storage", cwd)
    if configured:  # a relative path is relative to the common dir (join keeps absolute ones)
        return os.path.join(base, os.path.expanduser(configured))
    return os.path.join(base, "lfs")


def _refuse_options(revs: list[str], cwd: str | None) -> None:
    """Raise BadRevisionError for the first of ``revs`` (``^REV`` too) that starts with
    '-' and is not one of revisions.REV_SETS (``--output=FILE`` makes rev-list write FILE)."""
    for rev in revs:
        plain = rev.removeprefix("^")
        if plain.startswith("-"):
            from git_theta.revisions import REV_SETS, bad_revision

            if plain not in REV_SETS:
                raise bad_revision(plain, cwd)


def tree_blobs(rev: str, cwd: str | None = None) -> list[tuple[str, str]]:
    """Return (blob id, path) for every file in ``rev``'s tree. Raises BadRevisionError
    (exit 128, naming ``rev``) when it names no commit or tree."""
    _refuse_options([rev], cwd)
    try:
        out = git("ls-tree", "-r", "-z", "--full-tree", "--end-of-options", rev, cwd=cwd)
    except CommandError:
        from git_theta.revisions import require

        require([rev], cwd)  # raises the error that names it
        raise
    blobs = []
    for entry in out.split(b"\0"):
        if not entry:
            continue
        meta, path = entry.split(b"\t", 1)
        _, kind, oid = meta.split()
        if kind == b"blob":
            blobs.append((oid.decode(), os.fsdecode(path)))
    return blobs


def new_blobs(
    include: list[str], exclude: list[str], cwd: str | None = None
) -> list[tuple[str, str]]:
    """Return (blob id, path) of blobs reachable from ``include`` but not ``exclude``.
    Raises BadRevisionError for a revision git refuses or one that looks like an option
    (other than revisions.REV_SETS)."""
    _refuse_options(include + exclude, cwd)
    args = ["rev-list", "--objects", *include, "--not", *exclude, "--"]
    try:
        out = os.fsdecode(git(*args, cwd=cwd))
    except CommandError:
        from git_theta.revisions import require

        require(include + exclude, cwd, sets=True)  # raises the error naming a bad one
        raise
    blobs = []
    for line in out.splitlines():
        oid, _, path = line.partition(" ")
        if path:
            blobs.append((oid, path))
    return blobs


def remote_tracking_refs(remote: str, cwd: str | None = None) -> list[str]:
    """Return the remote-tracking refs of ``remote`` (what we know the remote has)."""
    out = git("for-each-ref", "--format=%(refname)", f"refs/remotes/{remote}/", cwd=cwd)
    return out.decode().split()


def object_exists(rev: str, cwd: str | None = None) -> bool:
    """Return True when ``rev`` names an object in the local repository."""
    return run("git", "cat-file", "-e", rev, check=False, cwd=cwd).returncode == 0


def blob_sizes(oids: list[str], cwd: str | None = None) -> dict[str, int]:
    """Return the size of each of ``oids`` that is a blob."""
    if not oids:
        return {}
    out = git(
        "cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize)",
        cwd=cwd, stdin="".join(f"{o}\n" for o in oids).encode(),
    )  # fmt: skip
    sizes = {}
    for line in out.decode().splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == "blob":
            sizes[fields[0]] = int(fields[2])
    return sizes


def index_blobs(cwd: str | None = None) -> list[tuple[str, str]]:
    """Return (blob id, path) for every staged entry in the index (all stages)."""
    out = git("ls-files", "-s", "-z", cwd=cwd)
    blobs = []
    for entry in out.split(b"\0"):
        if entry:
            meta, path = entry.split(b"\t", 1)
            blobs.append((meta.split()[1].decode(), os.fsdecode(path)))
    return blobs


def blobs_starting_with(oids: list[str], prefix: bytes, cwd: str | None = None) -> dict[str, bytes]:
    """Return the content of those blobs that start with ``prefix``, streaming through one
    ``git cat-file --batch`` so other blobs are skipped, never held in memory."""
    if not oids:
        return {}
    proc = start("git", "cat-file", "--batch", cwd=cwd)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, out = proc.stdin, proc.stdout

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError):
            stdin.write("".join(f"{o}\n" for o in oids).encode())
        stdin.close()

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    found: dict[str, bytes] = {}
    for _ in oids:
        header = out.readline().split()
        if len(header) != 3:
            continue  # "<oid> missing"
        size = int(header[2])
        head = out.read(min(size, len(prefix)))
        if head == prefix:
            found[header[0].decode()] = head + out.read(size - len(head))
        else:
            left = size - len(head)
            while left > 0:
                left -= len(out.read(min(left, 1 << 20)))
        out.read(1)  # the newline after the content
    writer.join()
    code = proc.wait()
    if code != 0:
        raise CommandError(("git", "cat-file", "--batch"), code, b"", b"")
    return found
