"""Work that a kill cut short is finished by the next run: an interrupted
`git theta checkout`, and temporaries of a writer that died but was never reaped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import git, sha256
from st_files import f32, st_from_arrays

from git_theta.files import writer_alive


def test_checkout_killed_before_its_index_refresh_is_finished_by_the_next(
    repo: Path, tmp_path: Path
) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32({"w": (64, 64)}, 1)))
    weights = (repo / "model.safetensors").read_bytes()
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    lazy = tmp_path / "lazy"
    done = subprocess.run(
        ["git", "clone", "-q", str(repo), str(lazy)],
        env={**os.environ, "GIT_THETA_SKIP_SMUDGE": "1"},
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr.decode()
    # What a checkout killed after its rename and before `git update-index` leaves: its
    # objects fetched, the right bytes in place, the index still holding the placeholder's
    # stat data.
    assert subprocess.run(["git", "theta", "fetch"], cwd=lazy, capture_output=True).returncode == 0
    (lazy / "model.safetensors").write_bytes(weights)
    assert git(lazy, "status", "--porcelain").stdout != b""
    done = subprocess.run(["git", "theta", "checkout"], cwd=lazy, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(lazy / "model.safetensors") == sha256(repo / "model.safetensors")
    assert git(lazy, "status", "--porcelain").stdout == b""
    # A file the user changed is theirs: never staged by a checkout.
    staged = git(lazy, "ls-files", "-s").stdout
    (lazy / "model.safetensors").write_bytes(st_from_arrays(f32({"w": (64, 64)}, 2)))
    done = subprocess.run(["git", "theta", "checkout"], cwd=lazy, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert git(lazy, "ls-files", "-s").stdout == staged
    assert git(lazy, "status", "--porcelain").stdout == b" M model.safetensors\n"


def test_a_killed_writer_that_was_never_reaped_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not writer_alive(child.pid)
    child.wait()
    assert writer_alive(os.getpid())
