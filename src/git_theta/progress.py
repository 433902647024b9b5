"""Progress lines on stderr for work that takes more than a second."""

from __future__ import annotations

import sys
import time

from git_theta.settings import env_flag

DELAY = 1.0
INTERVAL = 0.2


def _git_is_quiet() -> bool:
    """True when the git command that started us was given -q/--quiet (git_parent.py)."""
    from git_theta import git_parent

    return git_parent.git_is_quiet()


def quiet() -> bool:
    """True when the user asked for quiet: GIT_THETA_QUIET, ``git theta -q``, or git's -q."""
    from git_theta.errors import UsageError

    global _warned
    try:
        asked = env_flag("GIT_THETA_QUIET")
    except UsageError as exc:
        # It only changes what is printed: no checkout or add fails on it; said once.
        if not _warned:
            _warned = True
            sys.stderr.write(f"git-theta: warning: {exc}; showing progress\n")
        asked = False
    return asked or _git_is_quiet()


_warned = False


def enabled() -> bool:
    """Return True when progress should be shown: a terminal, and nobody asked for quiet."""
    return sys.stderr.isatty() and not quiet()


def summary(line: str) -> None:
    """Print a "what happened" line (counts) on stderr, unless the user asked for quiet;
    unlike progress it is also written to a pipe, as git's own summaries are."""
    if not quiet():
        from git_theta.display import escape  # lines name repository paths

        sys.stderr.write(f"git-theta: {escape(line)}\n")
        sys.stderr.flush()


class Progress:
    """Counts tensors and bytes; prints at most every INTERVAL once DELAY has passed."""

    def __init__(
        self,
        label: str,
        total_bytes: int,
        total_items: int,
        show: bool | None = None,
        unit: str = "tensors",
    ):
        from git_theta.display import escape

        self.label = escape(label)  # a repository's path may hold terminal escapes
        self.unit = unit
        self.total_bytes = total_bytes
        self.total_items = total_items
        self.done_bytes = 0
        self.done_items = 0
        self.show = enabled() if show is None else show
        self.start = time.monotonic()
        self._last = 0.0
        self._printed = False

    def advance(self, nbytes: int, items: int = 1) -> None:
        self.done_bytes += nbytes
        self.done_items += items
        if not self.show:
            return
        now = time.monotonic()
        if now - self.start >= DELAY and now - self._last >= INTERVAL:
            self._last = now
            self._print(now)

    def _print(self, now: float) -> None:
        rate = self.done_bytes / max(now - self.start, 1e-9) / 1e6
        if not self.total_items:  # a walk whose size is not known in advance (prune)
            counts = f"{self.done_items} {self.unit}, {self.done_bytes / 1e6:.1f} MB"
        elif not self.total_bytes:  # counted, not weighed (files compared)
            counts = f"{self.done_items}/{self.total_items} {self.unit}"
        else:
            counts = f"{self.done_items}/{self.total_items} {self.unit}, "
            counts += f"{self.done_bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB"
        speed = f", {rate:.0f} MB/s" if self.total_bytes or not self.total_items else ""
        sys.stderr.write(f"\rgit-theta: {self.label}: {counts}{speed}")
        sys.stderr.flush()
        self._printed = True

    def close(self) -> None:
        if self._printed:
            self._print(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
