"""``git theta add``: ``git add`` with an update type for the changed tensors."""

from __future__ import annotations

import os

from git_theta.errors import UnknownPluginError, UsageError
from git_theta.proc import run_attached
from git_theta.update_rules import ENV, PATH_ENV, check_type


def add(
    paths: list[str],
    update_type: str | None,
    update_path: str | None = None,
    update_data: str | None = None,
) -> int:
    """Run ``git add`` on ``paths`` with GIT_THETA_UPDATE_TYPE / _PATH when given.
    ``update_data`` (or GIT_THETA_UPDATE_DATA_PATH): an update applied to the staged
    version (side_load.py).

    Raises NotSetUpError when git-theta's filter is not configured (git would store the
    raw bytes).
    """
    from git_theta.setup_check import require_filter

    require_filter()
    # --update-data (side_load.py): an update applied to the staged version.
    from git_theta.side_load import DATA_ENV, add_with_update_data

    update_data = update_data or os.environ.get(DATA_ENV, "").strip() or None
    if update_data is not None:
        if update_path is not None:
            raise UsageError("--update-data and --update-path: give one of them")
        return add_with_update_data(paths, update_type, update_data)
    # end --update-data
    # The settings reach `git add`'s filter through its environment, not this process's:
    # an in-process caller (the API, tests) keeps its own environment unchanged.
    env = dict(os.environ)
    if update_path is not None:
        if update_type not in ("low-rank", "ia3"):
            raise UsageError("--update-path needs --update-type low-rank or ia3")
        if not os.path.exists(update_path):  # a file, or a PEFT adapter directory
            raise UsageError(f"--update-path {update_path}: no such file")
        env[PATH_ENV] = os.path.abspath(update_path)
    if update_type is not None:
        try:
            env[ENV] = check_type(update_type, "--update-type")
        except UnknownPluginError as exc:
            raise UsageError(str(exc)) from None
    if update_type is None:
        return run_attached("git", "add", "--", *paths, env=env)
    return _add_afresh(paths, update_type, env)


class _AddFailed(Exception):
    """git add exited non-zero: the private index is dropped (never leaves here)."""


def _add_afresh(paths: list[str], update_type: str, env: dict[str, str]) -> int:
    """``git add`` with an update type that really applies (restage.py): a file git-theta
    does not track is refused, and staged versions are cleaned again against HEAD's, in a
    private copy of the index that replaces it only when the add succeeded."""
    from git_theta.restage import INDEX_ENV, check_tracked, private_index, staged_entries, unstage

    check_tracked(paths, f"--update-type {update_type}")
    try:
        with private_index() as private:
            unstage(staged_entries(paths))
            code = run_attached("git", "add", "--", *paths, env={**env, INDEX_ENV: private})
            if code != 0:
                raise _AddFailed
    except _AddFailed:
        return code
    return 0
