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


def env_int(name: str, default: int) -> int:
    """Return a non-negative integer environment variable (``default`` when unset or
    empty). Raises UsageError for anything else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or len(raw) > 18:
        raise UsageError(f"{name}={raw!r} is not a non-negative integer")
    return int(raw)
