"""The interactive prompt of a merge run in a terminal (a real pty: git runs the driver
through sh, which reads answers from /dev/tty)."""

from __future__ import annotations

import os
import pty
import select
from pathlib import Path

import numpy as np
import pytest
from conftest import git
from st_files import st_from_arrays

M = "m.safetensors"
TIMEOUT = 60.0  # seconds without output: the prompt hung


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(9)
    return {n: (rng.standard_normal((8, 8)) * 0.02).astype(np.float32) for n in "abcd"}


def commit(repo: Path, values: dict[str, np.ndarray], message: str) -> None:
    (repo / M).write_bytes(st_from_arrays(values))
    git(repo, "add", M)
    git(repo, "commit", "-q", "-m", message)


def in_terminal(repo: Path, argv: list[str], answers: list[bytes]) -> tuple[int, str]:
    """Run ``argv`` in ``repo`` on a new pty; send the next answer at each prompt."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal and stdio
        os.chdir(repo)
        os.execvp(argv[0], argv)
    seen = b""
    pending = list(answers)
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], TIMEOUT)
            assert ready, f"no output for {TIMEOUT} s; so far: {seen.decode(errors='replace')}"
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if seen.endswith(b"> ") and pending:
                os.write(fd, pending.pop(0) + b"\n")
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), seen.decode(errors="replace").replace("\r", "")


def test_prompt_shows_both_sides_and_applies_an_answer_to_all_remaining(repo: Path) -> None:
    base = arrays()
    commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    theirs = {**base, "c": base["c"] + np.float32(1), "d": base["d"] + np.float32(1)}
    commit(repo, theirs, "left")
    git(repo, "checkout", "-q", "main")
    commit(repo, {**base, "c": base["c"] + np.float32(2), "d": base["d"] * np.float32(3)}, "r")
    code, out = in_terminal(
        repo, ["git", "merge", "--no-edit", "left"], [b"averge", b"all theirs", b"quit"]
    )
    assert code == 0, out
    assert "git-theta: m.safetensors: tensor c [8, 8] F32: changed on both sides" in out
    assert "  ours:   64 elements changed (100%), relative change" in out
    assert "  changed differently on both sides: 64 elements" in out
    assert "unknown merge strategy 'averge'" in out
    assert "tensor d" not in out  # "all" answered it
    from safetensors.numpy import load_file

    got = load_file(str(repo / M))
    assert got["c"].tobytes() == theirs["c"].tobytes()
    assert got["d"].tobytes() == theirs["d"].tobytes()
    assert git(repo, "status", "--porcelain").stdout == b""


def test_git_theta_merge_accepts_the_file_the_prompt_left(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One tensor answered, one skipped: the file git leaves is the driver's result (c
    # averaged, d ours), neither ours nor what the settings alone give. It is not the
    # user's own work, so `git theta merge --strategy` resolves it instead of refusing.
    from git_theta.commands.cli import main

    base = arrays()
    commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    theirs = {**base, "c": base["c"] + np.float32(1), "d": base["d"] + np.float32(1)}
    commit(repo, theirs, "left")
    git(repo, "checkout", "-q", "main")
    commit(repo, {**base, "c": base["c"] + np.float32(2), "d": base["d"] * np.float32(3)}, "r")
    code, out = in_terminal(repo, ["git", "merge", "--no-edit", "left"], [b"average", b"skip"])
    assert code == 1, out
    assert "CONFLICT" in out
    assert main(["merge", "--strategy", "theirs", M]) == 0, capsys.readouterr().err
    from safetensors.numpy import load_file

    got = load_file(str(repo / M))
    for name, value in theirs.items():
        assert got[name].tobytes() == value.tobytes(), name
    assert git(repo, "status", "--porcelain").stdout == b"M  m.safetensors\n"
    # Resolved: the driver's record of it is gone.
    assert not list((repo / ".git" / "lfs" / "theta" / "driver-results").iterdir())
