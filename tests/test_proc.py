"""Running commands: the posix_spawn path and the subprocess path behave alike."""

from __future__ import annotations

import os

import pytest

from git_theta.errors import CommandError
from git_theta.proc import run


def test_output_and_exit_code_are_captured_separately() -> None:
    done = run("sh", "-c", "printf out; printf err >&2; exit 3", check=False)
    assert done == (3, b"out", b"err")


def test_failure_names_the_program_and_its_last_stderr_line() -> None:
    """The whole command line is internal: the message names the program only."""
    with pytest.raises(CommandError) as info:
        run("sh", "-c", "echo first >&2; echo 'the reason' >&2; exit 5")
    assert info.value.returncode == 5
    assert str(info.value) == "sh failed: the reason"
    with pytest.raises(CommandError) as info:
        run("git", "-c", "filter.theta.process=", "-c", "x.y=1", "frobnicate")
    assert str(info.value).startswith("git frobnicate failed: ")
    assert "filter.theta" not in str(info.value)


def test_a_missing_program_is_exit_code_127() -> None:
    with pytest.raises(CommandError) as info:
        run("git-theta-no-such-program", "x")
    assert info.value.returncode == 127
    assert str(info.value).endswith("git-theta-no-such-program: command not found")


@pytest.mark.parametrize("cwd", [None, "/"])
def test_large_input_and_both_outputs_cannot_deadlock(cwd: str | None) -> None:
    """8 MB in, 8 MB out on stdout and on stderr: far past any pipe buffer, so a reader
    that drained one stream at a time would hang."""
    data = os.urandom(8 << 20)
    done = run("sh", "-c", "tee /dev/stderr", stdin=data, cwd=cwd)
    assert done.returncode == 0
    assert done.stdout == data
    assert done.stderr == data


def test_a_child_writing_more_than_it_reads_cannot_deadlock() -> None:
    """The child answers each 4 KiB it reads with 1 MiB of output before reading on: a
    blocking write of our input would wait on it while it waits on us."""
    import sys
    import threading

    amplify = (
        "import sys\n"
        "while chunk := sys.stdin.buffer.read1(4096):\n"
        "    sys.stdout.buffer.write(chunk * 256); sys.stdout.buffer.flush()\n"
    )
    data = os.urandom(256 << 10)
    done: list[object] = []
    worker = threading.Thread(
        target=lambda: done.append(run(sys.executable, "-c", amplify, stdin=data)), daemon=True
    )
    worker.start()
    worker.join(30)
    assert done, "run() deadlocked"
    assert len(done[0].stdout) == 256 * len(data)  # type: ignore[attr-defined]


def test_without_input_the_child_reads_nothing() -> None:
    """The filter's own stdin is git's pipe: a child must never read from it."""
    assert run("cat").stdout == b""


def test_the_child_gets_default_sigpipe() -> None:
    """Python ignores SIGPIPE; the child must not inherit that (git relies on it)."""
    done = run("sh", "-c", "yes | head -c 1")
    # With SIGPIPE ignored, `yes` would carry on and say "Broken pipe" on stderr.
    assert done == (0, b"y", b"")


def test_a_child_killed_by_a_signal_reports_it() -> None:
    done = run("sh", "-c", "kill -TERM $$", check=False)
    assert done.returncode == -15
