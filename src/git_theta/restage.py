"""``git theta add --update-type``: make the update type apply to what it names.

Two things stood in the way. git runs no clean filter for a file whose index entry's stat
still matches (a plain ``git add`` of the same file a moment ago), and the filter reuses a
tensor's staged chain when its bytes are the staged ones. So for each git-theta path
whose staged manifest differs from HEAD's, the index entry is first put back to HEAD's;
the ``git add`` that follows then cleans the file against HEAD's version, with the type
asked for. Both happen in a copy of the index, as git's own ``git commit PATH`` works:
the index is locked (``index.lock``), the copy changed, and renamed over the index only
when the add succeeded. A failed, interrupted or killed add leaves the index as it was.

And a path git-theta does not track would be staged as a plain blob with the update
type silently ignored: ``check_tracked`` refuses it before anything is staged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from git_theta import git
from git_theta.errors import ThetaError, UsageError
from git_theta.files import TempFile

INDEX_ENV = "GIT_INDEX_FILE"


class IndexBusyError(ThetaError):
    """Another git command holds the index lock."""


@contextlib.contextmanager
def private_index() -> Iterator[str]:
    """Lock the index and yield the path of a copy of it (for ``GIT_INDEX_FILE``); the
    copy replaces the index when the block ends without an exception, else it is dropped.
    This process's git calls use the copy meanwhile (``GIT_INDEX_FILE``, put back after).

    Raises IndexBusyError when another git command holds the index lock.
    """
    index = os.path.abspath(os.fsdecode(git.git("rev-parse", "--git-path", "index").strip()))
    lock = index + ".lock"
    # SIGTERM and SIGHUP wait while the lock is taken and while it is released: one
    # arriving in between would end the process with the lock left, and every later git
    # command would fail. In the main thread only (where Python runs handlers).
    held = threading.current_thread() is threading.main_thread()
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    terminated = False
    try:
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            raise IndexBusyError(
                f"{lock} exists: another git command is running in this repository; let "
                "it finish, then try again (if none is, remove that file)"
            ) from None
        os.close(fd)
        handlers = _exit_on_signals() if held else {}
        given = os.environ.get(INDEX_ENV)
        try:
            if held:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
            with TempFile(os.path.dirname(index), "index.theta-") as copy:
                _copy_index(index, copy)
                os.environ[INDEX_ENV] = copy.path
                try:
                    yield copy.path
                    # git wrote the copy by its own lock-and-rename: the name is what counts
                    if os.path.lexists(copy.path):
                        copy.commit(index)
                finally:  # a git add killed with us (subprocess kills it) leaves its lock
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(copy.name + ".lock", dir_fd=copy.dir_fd)
        except _Terminated:
            terminated = True
            raise
        finally:
            try:
                if held:  # the handler blocked them already when it ran
                    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
            finally:
                if given is None:
                    os.environ.pop(INDEX_ENV, None)
                else:
                    os.environ[INDEX_ENV] = given
                with contextlib.suppress(FileNotFoundError):  # removed by hand meanwhile
                    os.unlink(lock)
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
    finally:
        if held:
            # Already ending for one: a second changes nothing (no sigtimedwait on macOS:
            # there a second one ends the process by its default action, the lock gone).
            if terminated and hasattr(signal, "sigtimedwait"):
                while signal.sigtimedwait(_SIGNALS, 0) is not None:
                    pass
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def _copy_index(index: str, copy: TempFile) -> None:
    """Write ``index``'s bytes to ``copy`` with the index's own mtime: git trusts an
    entry's stat data only when the file changed after the index was written (racy git),
    and a fresh mtime on the copy made a file rewritten in the second of the last commit
    look unchanged. No index yet: the copy is removed, and git starts one at its name."""
    try:
        src = open(index, "rb")  # noqa: SIM115 - closed below; absent is normal
    except FileNotFoundError:
        os.unlink(copy.name, dir_fd=copy.dir_fd)
        return
    with src:
        while chunk := src.read(1 << 20):
            copy.file.write(chunk)
        copy.file.flush()
        st = os.fstat(src.fileno())
        os.utime(copy.file.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))


_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class _Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived: the process ends, through its finally blocks."""


def _exit(signum: int, _frame: object) -> None:
    # Blocked from here on: a second signal must not cut the clean-up short.
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    raise _Terminated(128 + signum)  # as a shell reports it


def _exit_on_signals() -> dict[int, Any]:
    """Make SIGTERM and SIGHUP (a CI job cancelled, `timeout`, the terminal closed) end
    this process through its finally blocks, as Ctrl-C does, so the index lock does not
    outlive it (git removes its own lock files on them too); return the handlers to put
    back. A signal the caller ignores (nohup) stays ignored; only the main thread can."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers: dict[int, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(signum)
        if previous is not signal.SIG_IGN:
            handlers[signum] = signal.signal(signum, _exit)
    return handlers


def _theta_paths(paths: list[str]) -> list[str]:
    """Return which of ``paths`` (relative to the cwd) have ``filter=theta``."""
    if not paths:
        return []
    feed = b"".join(os.fsencode(p) + b"\0" for p in paths)
    out = git.git("check-attr", "-z", "--stdin", "filter", stdin=feed)
    fields = out.split(b"\0")
    return [
        os.fsdecode(fields[i]) for i in range(0, len(fields) - 2, 3) if fields[i + 2] == b"theta"
    ]


def check_tracked(paths: list[str], option: str) -> None:
    """Raise UsageError when a file in ``paths`` is not tracked by git-theta, since
    ``option`` would not apply to it; directories and pathspecs are left to git."""
    files = [p for p in paths if os.path.isfile(p)]
    theta = set(_theta_paths(files))
    for path in files:
        if path not in theta:
            raise UsageError(
                f"{path} is not tracked by git-theta (no filter=theta attribute), so "
                f"{option} does not apply to it; run `git theta track {path}` first, or "
                f"stage it with `git add {path}`"
            )


def staged_entries(paths: list[str]) -> list[bytes]:
    """Return the ``git ls-files -s`` lines (mode, blob, stage, path) of the git-theta
    files under ``paths`` whose staged blob differs from HEAD's."""
    out = git.git("ls-files", "-s", "-z", "--", *paths)
    entries = [e for e in out.split(b"\0") if e]
    by_path = {os.fsdecode(e.split(b"\t", 1)[1]): e for e in entries}
    prefix = git.show_prefix()
    theta = _theta_paths(list(by_path))
    changed = []
    for path in theta:
        entry = by_path[path]
        blob = entry.split()[1].decode()
        done = git.git("rev-parse", "--verify", "-q", f"HEAD:{prefix}{path}", check=False)
        if done.strip().decode() != blob:
            changed.append(entry)
    return changed


def unstage(entries: list[bytes]) -> None:
    """Put the index entries of ``entries`` back to HEAD's version (or drop them when
    HEAD has none), so the next ``git add`` cleans them afresh."""
    paths = [os.fsdecode(e.split(b"\t", 1)[1]) for e in entries]
    if paths:
        has_head = git.git("rev-parse", "--verify", "-q", "HEAD", check=False).strip()
        if has_head:
            git.git("reset", "-q", "HEAD", "--", *paths)
        else:
            git.git("rm", "-q", "--cached", "--", *paths)
