"""Typed wrappers for every git and git-lfs call git-theta makes.

Our own reads of blobs never run our filter (``NO_FILTER``), so they cannot recurse.
"""

from __future__ import annotations

import os
from pathlib import Path

from git_theta.proc import run

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


def toplevel(cwd: str | None = None) -> Path:
    """Return the work tree root of the repository containing ``cwd``."""
    return Path(git("rev-parse", "--show-toplevel", cwd=cwd).decode().strip())


def show_prefix(cwd: str | None = None) -> str:
    """Return the path of ``cwd`` relative to the work tree root ('' at the root)."""
    return git("rev-parse", "--show-prefix", cwd=cwd).decode().strip()


def common_dir(cwd: str | None = None) -> Path:
    """Return the absolute git common directory (shared by all worktrees)."""
    out = git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=cwd)
    return Path(out.decode().strip())


def config_get(key: str, cwd: str | None = None) -> str | None:
    """Return the value of a git config key, or None when it is unset."""
    done = run("git", "config", "--get", key, check=False, cwd=cwd)
    return done.stdout.decode().strip() if done.returncode == 0 else None


def config_set(key: str, value: str, scope: str, cwd: str | None = None) -> None:
    """Set a git config key in ``scope`` ('global', 'local' or 'system')."""
    run("git", "config", f"--{scope}", key, value, cwd=cwd)


def index_blob(path: str, cwd: str | None = None) -> bytes | None:
    """Return the staged (stage 0) blob of ``path``, or None when it is not in the index."""
    done = run("git", *NO_FILTER, "cat-file", "blob", f":{path}", check=False, cwd=cwd)
    return done.stdout if done.returncode == 0 else None


def lfs_version() -> str | None:
    """Return git-lfs's version line, or None when git-lfs is not installed."""
    done = run("git", "lfs", "version", check=False)
    return done.stdout.decode().strip() if done.returncode == 0 else None


def lfs_storage_dir(cwd: str | None = None) -> Path:
    """Return the directory git-lfs keeps objects in (``lfs.storage`` or GIT_COMMON_DIR/lfs)."""
    base = common_dir(cwd)
    configured = config_get("lfs.storage", cwd)
    if configured:
        path = Path(os.path.expanduser(configured))
        return path if path.is_absolute() else base / path
    return base / "lfs"
