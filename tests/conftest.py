"""Hermetic git: every test gets its own HOME and global config, and repos under tmp_path."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lfs_server import LfsServer

from git_theta.commands.cli import main
from git_theta.forkserver import stop_servers

BIN = str(Path(sys.executable).parent)

# What `git theta install` writes as the filter: the filter itself (the warm server is
# opt-in), isolated from PYTHONPATH and the cwd, behind a check that says what to do when
# its interpreter is gone.
DIRECT = (
    f"[ -x {shlex.quote(sys.executable)} ] || {{ echo "
    + shlex.quote(
        f"git-theta: error: {sys.executable}, the Python git-theta was installed with, is "
        "gone (a moved or deleted virtualenv?): reinstall git-theta and run "
        "`git theta install` again"
    )
    + " >&2; exit 1; }; exec "
    + shlex.join([sys.executable, "-E", "-P", "-m", "git_theta", "filter-process"])
)


def _kill_servers(directory: Path) -> None:
    """Stop the warm filter servers whose sockets live in ``directory``."""
    stop_servers(str(directory))


@pytest.fixture(scope="session")
def server_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One private socket directory for the whole run, so that a test that turns the warm
    filter server on never meets the user's: its servers are stopped at the end."""
    path = tmp_path_factory.mktemp("servers")
    path.chmod(0o700)
    yield path
    _kill_servers(path)


@pytest.fixture(autouse=True)
def hermetic_git(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, server_dir: Path
) -> Path:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home / ".gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "Theta Test")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "theta@example.com")
        monkeypatch.setenv(f"GIT_{who}_DATE", "2026-01-01T00:00:00Z")
    monkeypatch.setenv("PATH", BIN + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("GIT_THETA_QUIET", "1")
    # Users do not run git with Python's output unbuffered: a filter that forgets a
    # flush must hang here as it would for them (this machine's shell sets it).
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    # The filter runs directly, as `git theta install` sets it up for users; the warm
    # server is opt-in (tests/test_forkserver.py), its sockets in this run's directory.
    monkeypatch.setenv("GIT_THETA_SERVER_DIR", str(server_dir))
    monkeypatch.setenv("GIT_THETA_SERVER_IDLE", "300")
    monkeypatch.delenv("GIT_THETA_SERVER", raising=False)
    monkeypatch.delenv("GIT_THETA_SERVER_TRACE", raising=False)
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.delenv("GIT_WORK_TREE", raising=False)
    (home / ".gitconfig").write_text("[init]\n\tdefaultBranch = main\n")
    monkeypatch.chdir(home)  # never run inside the project's own repository
    return home


def git(
    repo: Path, *args: str, check: bool = True, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run real git in ``repo``; on failure show its stderr."""
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, input=stdin)
    if check and done.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {done.stderr.decode()}")
    return done


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lfs_objects(repo: Path) -> set[str]:
    root = repo / ".git" / "lfs" / "theta" / "objects"
    return {p.name for p in root.rglob("*") if p.is_file()} if root.exists() else set()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LfsServer]:
    """A real Git LFS server (giftless) on 127.0.0.1, stopped after the test."""
    srv = LfsServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh repository with git-theta installed globally and *.safetensors tracked."""
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    assert main(["install"]) == 0
    monkeypatch.chdir(path)
    assert main(["track", "*.safetensors"]) == 0
    # Remote tests push with short retries so a stopped server fails fast.
    git(path, "config", "lfs.transfer.maxretries", "1")
    git(path, "add", ".gitattributes")
    git(path, "commit", "-q", "-m", "track")
    yield path


def track(repo: Path, *patterns: str) -> Path:
    """Track ``patterns`` with git theta and commit the attributes; return ``repo``."""
    assert main(["track", *patterns]) == 0
    git(repo, "add", ".gitattributes")
    git(repo, "commit", "-q", "-m", f"track {' '.join(patterns)}")
    return repo


def commit_and_check_out(repo: Path, name: str) -> dict[str, object]:
    """Commit ``name``, delete it, check it out; return its manifest after a sha256 check."""
    sha = sha256(repo / name)
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", name)
    (repo / name).unlink()
    git(repo, "checkout", "--", name)
    assert sha256(repo / name) == sha
    manifest: dict[str, object] = json.loads(git(repo, "show", f"HEAD:{name}").stdout)
    return manifest


def measure_filter_peaks(repo: Path, peaks: Path) -> None:
    """Make ``repo``'s filter the real one run under /usr/bin/time, which appends each
    filter process's peak RSS (KiB) to ``peaks``; skips the test where there is none."""
    import shutil

    time = shutil.which("time") or "/usr/bin/time"
    if not Path(time).is_file():
        pytest.skip("needs /usr/bin/time")
    filt = shlex.join(
        [time, "-f", "%M", "-a", "-o", str(peaks), sys.executable, "-E", "-P", "-m", "git_theta",
         "filter-process"]
    )  # fmt: skip
    git(repo, "config", "filter.theta.process", filt)


def peak_mib(peaks: Path) -> float:
    """The largest peak ``measure_filter_peaks`` recorded, in MiB."""
    return max(int(line) for line in peaks.read_text().split()) / 1024
