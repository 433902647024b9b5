"""Which update type each tensor gets: GIT_THETA_UPDATE_TYPE, else the repository's rules
file (``.theta-updates``: lines of ``TENSOR_GLOB UPDATE_TYPE``, first match wins), else
``auto``."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from pathlib import Path

from git_theta.errors import ThetaError, UnknownPluginError

RULES_FILE = ".theta-updates"
ENV = "GIT_THETA_UPDATE_TYPE"
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
            raise ThetaError(f"{source}:{number}: expected 'TENSOR_GLOB UPDATE_TYPE', got {raw!r}")
        rules.append((fields[0], check_type(fields[1], f"{source}:{number}")))
    return rules


def load_policy(top: Path) -> Callable[[str], str]:
    """Return a function mapping a tensor name to its update type."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        key = check_type(forced, ENV)
        return lambda _name: key
    path = top / RULES_FILE
    rules = parse_rules(path.read_text(), RULES_FILE) if path.exists() else []

    def policy(name: str) -> str:
        for pattern, key in rules:
            if fnmatch.fnmatchcase(name, pattern):
                return key
        return DEFAULT

    return policy
