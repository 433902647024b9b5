"""The one place git-theta starts a subprocess."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from typing import BinaryIO

from git_theta.errors import CommandError


def run(
    *argv: str,
    stdin: bytes | BinaryIO | None = None,
    check: bool = True,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` (never through a shell) and return the finished process; ``stdin`` is
    bytes to feed it or an open file it reads itself. Past ``timeout`` seconds the
    process is killed and subprocess.TimeoutExpired raised.

    Raises CommandError with the command, exit code and last stderr line when ``check``
    is set and the command fails, or FileNotFoundError's message when it is not installed.
    """
    try:
        feed, fh = (stdin, None) if isinstance(stdin, bytes) or stdin is None else (None, stdin)
        done = subprocess.run(
            argv,
            input=feed,
            stdin=fh,
            capture_output=True,
            cwd=cwd,
            env=None if env is None else dict(env),
            check=False,
            timeout=timeout,
        )
    except FileNotFoundError as exc:
        raise CommandError(argv, 127, b"", f"{argv[0]}: command not found".encode()) from exc
    if check and done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stdout, done.stderr)
    return done


def run_attached(*argv: str) -> int:
    """Run ``argv`` with the terminal attached (its output is the user's); return its code."""
    try:
        return subprocess.run(argv, check=False).returncode
    except FileNotFoundError:
        raise CommandError(argv, 127, b"", f"{argv[0]}: command not found".encode()) from None


def start(
    *argv: str, cwd: str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with pipes on stdin and stdout (stderr stays the user's), for the
    long-running helpers we talk to (``git cat-file --batch``, ``git lfs filter-process``)."""
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=cwd,
            env=None if env is None else dict(env),
        )
    except FileNotFoundError:
        raise CommandError(argv, 127, b"", f"{argv[0]}: command not found".encode()) from None
