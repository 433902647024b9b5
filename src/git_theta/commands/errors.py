"""Turning exceptions into one line on stderr (and a private log for the unexpected).

Expected failures (ThetaError) and the operating system's (a full disk, a permission, a
read-only or foreign file system, too many open files) are one line naming the file and
what to do next, exit 1. A closed stdout (``| head``, a pager quit) is silent, exit 0;
another peer that went away (git killed) is one short line, exit 1. Anything else is an
internal error: one line, exit 70, and the traceback in
``files.state_dir()/errors.log``.
"""

from __future__ import annotations

import errno
import os
import sys

from git_theta.display import escape
from git_theta.errors import ThetaError

INTERNAL = 70
_MEMORY_NEXT = "free some memory (or raise `ulimit -v`) and retry"

# errno -> (what happened, what to do next). "{file}" is the file the error names.
_OS_ERRORS = {
    errno.ENOSPC: ("no space left on device writing {file}", "free some space and retry"),
    errno.EDQUOT: ("disk quota exceeded writing {file}", "free some space and retry"),
    errno.EFBIG: (
        "file too large for this process's size limit writing {file}",
        "raise the limit (`ulimit -f`) and retry",
    ),
    errno.EACCES: (
        "permission denied on {file}",
        "check the owner and mode of it and its directory",
    ),
    errno.EPERM: (
        "operation not permitted on {file}",
        "check the owner and mode of it and its directory",
    ),
    errno.EROFS: ("read-only file system at {file}", "work in a writable clone or remount it"),
    errno.EXDEV: (
        "cannot rename {file} to {file2}: they are on different file systems",
        "keep the Git LFS directory (.git/lfs, or lfs.storage) on one file system",
    ),
    errno.EMFILE: ("too many open files{at}", "raise the limit (`ulimit -n`) and retry"),
    errno.ENFILE: ("the system has too many open files{at}", "close some programs and retry"),
    errno.ENOMEM: ("out of memory{at}", "free some memory and retry"),
    errno.EIO: ("input/output error on {file}", "check the disk (`dmesg`) and retry"),
    errno.ENOENT: (
        "no such file or directory: {file}",
        "check the path; was it removed meanwhile?",
    ),
    errno.ENOTDIR: ("a component of {file} is not a directory", "move that file aside"),
    errno.EISDIR: ("{file} is a directory", "give a file"),
    errno.ENAMETOOLONG: ("file name too long: {file}", "use a shorter path"),
    errno.ELOOP: ("too many symbolic links in {file}", "check the links on that path"),
    errno.EBUSY: ("{file} is busy", "retry when whatever holds it is done"),
    errno.ETXTBSY: ("{file} is busy", "retry when whatever holds it is done"),
}


def os_error_line(exc: OSError) -> str | None:
    """Return one line for an OSError the environment caused, or None for another."""
    known = _OS_ERRORS.get(exc.errno or 0)
    if known is None:
        return None
    what, next_step = known
    file = os.fsdecode(exc.filename) if exc.filename is not None else "a file"
    file2 = os.fsdecode(exc.filename2) if exc.filename2 is not None else "its destination"
    at = f" at {file}" if exc.filename is not None else ""
    return f"{what.format(file=file, file2=file2, at=at)}: {next_step}"


def _stdout_is_broken() -> bool:
    """True when stdout is a pipe whose reader is gone (poll says POLLERR); it is then
    pointed at /dev/null, so the interpreter's own flush at exit stays quiet."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        broken = any(events & select.POLLERR for _, events in poller.poll(0))
        if broken:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout: cannot be that pipe
        return False
    return broken


def _log_traceback(exc: BaseException) -> str:
    """Append ``exc``'s traceback, with the version, to the private log; return the
    words that point at it, or that say why there is none."""
    import time
    import traceback

    from git_theta import __version__
    from git_theta.files import open_log

    try:
        log, path = open_log()
        with log:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"--- {stamp} git-theta {__version__} pid {os.getpid()} {sys.argv!r}\n")
            traceback.print_exception(exc, file=log)
    except (ThetaError, OSError) as why:
        return f"no traceback log: {why}"
    return f"traceback in {path}"


def _say(line: str) -> None:
    # Messages quote names and paths from repositories, which may hold escape sequences:
    # every line goes out with its non-printable characters escaped.
    try:
        sys.stderr.write(escape(line) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr is gone too: the exit code still tells
        pass


def report(exc: BaseException, path: str = "") -> int:
    """Print one line about ``exc`` to stderr and return the exit code to use."""
    where = f"{path}: " if path else ""
    if isinstance(exc, ThetaError):
        _say(f"git-theta: error: {where}{exc}")
        return exc.exit_code
    if isinstance(exc, EOFError):  # git or git-lfs killed mid-stream, a truncated read
        detail = f" ({exc})" if str(exc) else ""
        _say(f"git-theta: error: {where}input ended early{detail}; stopped")
        return 1
    if isinstance(exc, BrokenPipeError | ConnectionResetError):
        if _stdout_is_broken():
            # Our reader (a pager, `head`) stopped reading: nothing to say, and exit 0, so
            # that git does not call its external diff driver "died" (git itself then
            # stops quietly on the same closed pipe).
            return 0
        _say(f"git-theta: error: {where}a pipe closed early (the program reading it exited)")
        return 1
    if isinstance(exc, OSError) and (line := os_error_line(exc)) is not None:
        _say(f"git-theta: error: {where}{line}")
        return 1
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and str(exc) == "can't start new thread"
    ):  # the machine's or `ulimit -v`'s limit: nothing the repository did wrong
        _say(f"git-theta: error: {where}out of memory: {_MEMORY_NEXT}")
        return 1
    _say(f"git-theta: internal error: {where}{type(exc).__name__}: {exc} ({_log_traceback(exc)})")
    return INTERNAL
