"""Settings read from the environment, parsed one way everywhere."""

from __future__ import annotations

import os

from git_theta.errors import UsageError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def env_flag(name: str, default: bool = False) -> bool:
    """Return a boolean environment variable; 'False', '0', 'no', 'off' and '' are false.

    Raises UsageError for any other value rather than guessing.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UsageError(f"{name}={raw!r} is not a boolean: use 1/0, true/false, yes/no or on/off")
