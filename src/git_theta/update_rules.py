"""Which update type each tensor gets: GIT_THETA_UPDATE_TYPE, else the repository's rules
file (``.theta-updates``: lines of ``TENSOR_GLOB UPDATE_TYPE``, first match wins), else
``auto``. GIT_THETA_UPDATE_PATH names the factors file of ``low-rank`` and ``ia3``."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from git_theta.errors import ThetaError, UnknownPluginError, UsageError

if TYPE_CHECKING:
    from git_theta.updates.base import UpdateType

RULES_FILE = ".theta-updates"
RULES_CAP = 1 << 20  # bytes: a rules file is a few lines; a committed one is untrusted
ENV = "GIT_THETA_UPDATE_TYPE"
PATH_ENV = "GIT_THETA_UPDATE_PATH"
DEFAULT = "auto"


def check_type(key: str, where: str) -> str:
    from git_theta.updates import UPDATES

    try:
        UPDATES.get(key)
    except UnknownPluginError as exc:
        raise UnknownPluginError(f"{where}: {exc}") from None
    return key


def parse_rules(text: str, source: str) -> list[tuple[str, str]]:
    """Parse a rules file; raises ThetaError naming the line of any bad entry."""
    rules = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ThetaError(
                f"{source}:{number}: expected 'TENSOR_GLOB UPDATE_TYPE', got {raw!r}: fix that line"
            )
        rules.append((fields[0], check_type(fields[1], f"{source}:{number}")))
    return rules


def load_policy(top: str) -> Callable[[str], UpdateType]:
    """Return a function mapping a tensor name to its (configured) update type.

    Raises ThetaError for unknown types, bad rules or an unusable factors file, except in
    a clean filter serving a git command that only looks (status, diff: git_parent.py),
    which warns and uses auto: the update type changes how a change is stored, never what
    is stored, so the answer stays exact and the user can still see the repository.
    """
    try:
        return _configured_policy(top)
    except ThetaError as exc:
        from git_theta import git_parent

        if not git_parent.git_only_looks():
            raise
        import sys

        from git_theta.updates import UPDATES

        sys.stderr.write(
            f"git-theta: warning: {exc}; using {DEFAULT} until it is fixed (git add refuses it)\n"
        )
        plugin = UPDATES.get(DEFAULT)
        return lambda _name: plugin


def _configured_policy(top: str) -> Callable[[str], UpdateType]:
    """The policy the environment and the rules file configure; raises ThetaError."""
    from git_theta.updates import UPDATES

    if os.environ.get("GIT_THETA_UPDATE_DATA_PATH", "").strip():  # see side_load.py
        return _refuse_update_data
    forced = os.environ.get(ENV, "").strip()
    inputs = os.environ.get(PATH_ENV, "").strip()
    if forced:
        plugin = UPDATES.get(check_type(forced, ENV))
        if inputs:
            plugin = plugin.with_inputs(inputs)
        return lambda _name: plugin
    if inputs:
        raise UsageError(f"{PATH_ENV} needs {ENV} (low-rank or ia3) as well")
    return _rules_policy(top)


def _refuse_update_data(_name: str) -> UpdateType:
    """The policy while GIT_THETA_UPDATE_DATA_PATH is set: refuse to store a changed
    tensor (plain `git add` cannot apply the update), asked only when one would be
    stored. So the `git commit` or `git status` after `git theta add`, which clean the
    unchanged file again (git's racy-timestamp check), still work with it set; a command
    that only looks stores nothing and uses auto."""
    from git_theta import git_parent

    if git_parent.git_only_looks():
        from git_theta.updates import UPDATES

        return UPDATES.get(DEFAULT)
    raise UsageError(
        "GIT_THETA_UPDATE_DATA_PATH is applied by `git theta add PATH --update-type TYPE`, "
        "which also rewrites PATH to the result; plain `git add` cannot: use that"
    )


def _rules_policy(top: str) -> Callable[[str], UpdateType]:
    """Return the policy of ``top``'s rules file (auto for what no rule names)."""
    from git_theta.files import read_capped
    from git_theta.updates import UPDATES

    try:  # a regular file of at most RULES_CAP (a symlink to /dev/zero is refused)
        data = read_capped(os.path.join(top, RULES_FILE), RULES_CAP)
    except FileNotFoundError:
        data = b""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ThetaError(
            f"{RULES_FILE}: not UTF-8 text (byte {exc.start}); fix the file and retry"
        ) from None
    rules = parse_rules(text, RULES_FILE)
    plugins = {key: UPDATES.get(key) for key in {DEFAULT, *(key for _, key in rules)}}

    def policy(name: str) -> UpdateType:
        for pattern, key in rules:
            if fnmatch.fnmatchcase(name, pattern):
                return plugins[key]
        return plugins[DEFAULT]

    return policy
