"""Turning exceptions into one line on stderr (and a log file for the unexpected)."""

from __future__ import annotations

import os
import sys

from git_theta.errors import ThetaError


def log_path() -> str:
    import tempfile  # only on the error path: start-up time counts on every git command

    return os.path.join(tempfile.gettempdir(), f"git-theta-{os.getuid()}.log")


def report(exc: BaseException, path: str = "") -> int:
    """Print one line about ``exc`` to stderr and return the exit code to use."""
    where = f"{path}: " if path else ""
    if isinstance(exc, ThetaError):
        sys.stderr.write(f"git-theta: error: {where}{exc}\n")
        return exc.exit_code
    import traceback

    with open(log_path(), "a") as fh:
        traceback.print_exception(exc, file=fh)
    sys.stderr.write(
        f"git-theta: internal error: {where}{type(exc).__name__}: {exc} "
        f"(traceback in {log_path()})\n"
    )
    return 70
