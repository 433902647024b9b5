"""The one place git-theta starts a subprocess.

Short calls with captured output (most are git's, several per filter process) are spawned
with ``os.posix_spawnp`` and read with ``select.poll``: the subprocess module costs 4 ms to
import (selectors, locale, signal's enums), a tenth of a small file's add. Calls with a
working directory, an environment, a timeout or a file on stdin go through subprocess.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable, Mapping
from typing import IO, BinaryIO, Protocol

from git_theta.errors import CommandError, command_error
from git_theta.records import NamedTuple

_READ = 1 << 16


class Finished(NamedTuple):
    """A finished command: its exit code (negative: killed by that signal) and output."""

    returncode: int
    stdout: bytes
    stderr: bytes


def not_found(argv: tuple[str, ...]) -> CommandError:
    return CommandError(argv, 127, b"", f"{argv[0]}: command not found".encode())


def run(
    *argv: str,
    stdin: bytes | BinaryIO | None = None,
    check: bool = True,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    limit: int | None = None,
) -> Finished:
    """Run ``argv`` (never through a shell) and return the finished process; ``stdin`` is
    bytes to feed it or an open file it reads itself (nothing: it reads /dev/null). Past
    ``timeout`` seconds the process is killed and subprocess.TimeoutExpired raised. Past
    ``limit`` bytes of output (only without cwd, env, timeout or a file as stdin) it is
    killed too, and its exit code is -SIGKILL.

    Raises CommandError with the command, exit code and last stderr line when ``check``
    is set and the command fails, or FileNotFoundError's message when it is not installed.
    """
    try:
        if cwd is None and env is None and timeout is None and not hasattr(stdin, "fileno"):
            done = _spawn(argv, stdin, limit)
        else:
            assert limit is None, "limit needs the posix_spawn path"
            done = _subprocess_run(argv, stdin, cwd, env, timeout)
    except FileNotFoundError:
        raise not_found(argv) from None
    if check and done.returncode != 0:
        raise command_error(argv, done.returncode, done.stdout, done.stderr)
    return done


def run_soon(*argv: str) -> Callable[[int | None], Finished]:
    """Start ``argv`` now (stdin /dev/null, outputs captured) and return the function
    that waits for it and returns it finished, whatever its exit code, given ``limit`` as
    for ``run``. Call that once: the caller works (imports) meanwhile, while the command
    runs on another core. Raises CommandError (127) when the command is not installed."""
    try:
        started = _start(argv, None)
    except FileNotFoundError:
        raise not_found(argv) from None
    return lambda limit: _collect(*started, None, limit)


def _spawn(argv: tuple[str, ...], feed: bytes | None, limit: int | None = None) -> Finished:
    """posix_spawn ``argv`` with pipes on all three streams; feed ``feed`` and collect
    both outputs through one poll loop (so no pipe can fill up and stall the child);
    kill it once its output passes ``limit`` bytes."""
    return _collect(*_start(argv, feed), feed, limit)


def _start(argv: tuple[str, ...], feed: bytes | None) -> tuple[int, int, int, int]:
    """posix_spawn ``argv`` with pipes on all three streams; return its pid and our ends
    of its stdin (-1 without ``feed``: /dev/null), stdout and stderr."""
    child_in, to_child = os.pipe() if feed else (os.open(os.devnull, os.O_RDONLY), -1)
    from_out, child_out = os.pipe()
    from_err, child_err = os.pipe()
    try:
        pid = os.posix_spawnp(
            argv[0], argv, os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, child_in, 0),
                (os.POSIX_SPAWN_DUP2, child_out, 1),
                (os.POSIX_SPAWN_DUP2, child_err, 2),
            ],
            # Python ignores SIGPIPE; an exec'd child would inherit that (subprocess resets
            # it too), and git relies on SIGPIPE to stop writing to a closed pipe.
            setsigdef=(signal.SIGPIPE,),
        )  # fmt: skip
    except BaseException:
        for fd in (child_in, to_child, from_out, child_out, from_err, child_err):
            if fd >= 0:
                os.close(fd)
        raise
    for fd in (child_in, child_out, child_err):
        os.close(fd)
    return pid, to_child, from_out, from_err


def _collect(
    pid: int, to_child: int, from_out: int, from_err: int, feed: bytes | None, limit: int | None
) -> Finished:
    """Feed ``feed`` to the started child and read both its outputs through one poll
    loop; kill it once its output passes ``limit`` bytes; return it finished."""
    chunks: dict[int, list[bytes]] = {from_out: [], from_err: []}
    poll = select.poll()
    for fd in chunks:
        poll.register(fd, select.POLLIN)
    pending = memoryview(feed or b"")
    if to_child >= 0:
        # Non-blocking: a write that waited for the child to read could wait forever while
        # the child waits for us to read its output.
        os.set_blocking(to_child, False)
        poll.register(to_child, select.POLLOUT)
    out_size = 0
    try:
        open_fds = len(chunks) + (to_child >= 0)
        while open_fds:
            for fd, _event in poll.poll():
                if fd == to_child:
                    try:
                        pending = pending[os.write(fd, pending[:_READ]) :]
                    except BlockingIOError:  # full after all: poll again
                        continue
                    except BrokenPipeError:  # the child stopped reading: it sees EOF anyway
                        pending = pending[:0]
                    if not pending:
                        poll.unregister(fd)
                        os.close(fd)
                        to_child = -1
                        open_fds -= 1
                    continue
                data = os.read(fd, _READ)
                if data:
                    chunks[fd].append(data)
                    if fd == from_out and limit is not None:
                        out_size += len(data)
                        if out_size > limit:
                            os.kill(pid, signal.SIGKILL)
                            open_fds = 0
                            break
                else:
                    poll.unregister(fd)
                    open_fds -= 1
    finally:
        for fd in (to_child, from_out, from_err):
            if fd >= 0:
                os.close(fd)
        _, status = os.waitpid(pid, 0)
    return Finished(
        os.waitstatus_to_exitcode(status), b"".join(chunks[from_out]), b"".join(chunks[from_err])
    )


def _subprocess_run(
    argv: tuple[str, ...],
    stdin: bytes | BinaryIO | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    timeout: float | None,
) -> Finished:
    import subprocess

    feed, fh = (stdin, None) if isinstance(stdin, bytes) or stdin is None else (None, stdin)
    done = subprocess.run(
        argv,
        input=feed,
        stdin=fh if fh is not None or feed is not None else subprocess.DEVNULL,
        capture_output=True,
        cwd=cwd,
        env=None if env is None else dict(env),
        check=False,
        timeout=timeout,
    )
    return Finished(done.returncode, done.stdout, done.stderr)


def run_attached(*argv: str, env: dict[str, str] | None = None) -> int:
    """Run ``argv`` with the terminal attached (its output is the user's) and ``env`` (by
    default this process's environment); return its code."""
    import subprocess

    try:
        return subprocess.run(argv, check=False, env=env).returncode
    except FileNotFoundError:
        raise not_found(argv) from None


def run_shown(*argv: str, stdin: bytes, cwd: str | None = None) -> int:
    """Run ``argv`` fed ``stdin``, its output going straight to the user's terminal (a
    progress meter of its own); return its exit code."""
    import subprocess

    try:
        return subprocess.run(argv, input=stdin, cwd=cwd, check=False).returncode
    except FileNotFoundError:
        raise not_found(argv) from None


class Helper(Protocol):
    """A started helper: what callers of ``start`` use of a ``subprocess.Popen``."""

    @property
    def stdin(self) -> IO[bytes] | None: ...
    @property
    def stdout(self) -> IO[bytes] | None: ...
    def wait(self) -> int: ...


# Starts helpers that may prompt the user (git-lfs asks git for credentials, ssh for a
# passphrase) where the terminal is: set in a warm server's worker, which has none.
spawner: Callable[[tuple[str, ...], str | None, Mapping[str, str] | None], Helper] | None = None


def start(
    *argv: str,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    may_prompt: bool = False,
    stderr: int | None = None,
) -> Helper:
    """Start ``argv`` with pipes on stdin and stdout (stderr stays the user's unless
    ``stderr``, a file descriptor, is given), for the long-running helpers we talk to
    (``git cat-file --batch``, ``git lfs filter-process``). ``may_prompt``: the helper may
    ask the user something on the terminal (prompts go to /dev/tty, not stderr)."""
    if may_prompt and spawner is not None:
        return spawner(argv, cwd, env)
    try:
        if cwd is None and env is None:  # a clean's cat-file --batch: no subprocess import
            return _start_helper(argv, stderr)
    except FileNotFoundError:
        raise not_found(argv) from None
    import subprocess

    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=cwd,
            env=None if env is None else dict(env),
        )
    except FileNotFoundError:
        raise not_found(argv) from None


class _Spawned:
    """A helper ``_start_helper`` started: what Helper names of a subprocess.Popen."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]):
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self._code: int | None = None

    def wait(self) -> int:
        """Wait for the helper to exit; return its code (negative: killed by a signal)."""
        if self._code is None:
            _, status = os.waitpid(self.pid, 0)
            self._code = os.waitstatus_to_exitcode(status)
        return self._code


def _start_helper(argv: tuple[str, ...], stderr: int | None) -> _Spawned:
    """posix_spawn ``argv`` as subprocess.Popen would with pipes on stdin and stdout
    (buffered file objects; SIGPIPE and SIGXFSZ, which Python ignores, back to their
    defaults) and ``stderr`` (a descriptor, else ours). Raises FileNotFoundError when it
    is not installed."""
    child_in, to_child = os.pipe()
    from_child, child_out = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, child_in, 0), (os.POSIX_SPAWN_DUP2, child_out, 1)]
    if stderr is not None:
        actions.append((os.POSIX_SPAWN_DUP2, stderr, 2))
    try:
        pid = os.posix_spawnp(
            argv[0], argv, os.environ, file_actions=actions,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )  # fmt: skip
    except BaseException:
        os.close(to_child)
        os.close(from_child)
        raise
    finally:
        os.close(child_in)
        os.close(child_out)
    return _Spawned(pid, os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb"))
