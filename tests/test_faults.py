"""A few faults injected at fixed points, for every run (the seeded suite of hundreds at
random points is `make faults`: tests/faults/run.py). After each: no corrupt object,
nothing staged by a failed command, the retry succeeds, no temporary outlives prune."""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import git, sha256
from faults.harness import (
    MODEL,
    age,
    can_mount,
    corrupt_objects,
    fill,
    read_only,
    temporaries,
    tmpfs,
)
from faults.world import model_bytes

MOUNTABLE = can_mount()


@pytest.fixture(autouse=True)
def direct_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_THETA_SERVER", "0")  # git's own child: limits and kills reach it


def objects(repo: Path) -> Path:
    return repo / ".git" / "lfs"


def write(repo: Path, version: int, branch: str = "main") -> str:
    (repo / MODEL).write_bytes(model_bytes(5, branch, version, shrink=4))  # 1.3 MB
    return sha256(repo / MODEL)


def commit(repo: Path, version: int) -> str:
    git(repo, "commit", "-q", "-m", f"v{version}")
    return git(repo, "rev-parse", "HEAD").stdout.decode().strip()


def checks_out(repo: Path, rev: str, sha: str) -> bool:
    git(repo, "checkout", "-q", "-f", "--detach", rev)
    clean = git(repo, "status", "--porcelain", "--untracked-files=no").stdout == b""
    return clean and sha256(repo / MODEL) == sha


def staged(repo: Path) -> bytes:
    return git(repo, "diff", "--cached", "--name-only").stdout


def prune_removes(repo: Path, stale: list[str]) -> None:
    """Once old enough that no running command can own them, prune removes them all."""
    age([repo / p for p in stale], 7200)
    done = subprocess.run(["git-theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert temporaries(repo) == []


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to kill at a syscall")
def test_kill_9_at_the_first_object_rename_of_an_add_then_the_retry_commits(repo: Path) -> None:
    first = write(repo, 1)
    git(repo, "add", MODEL)
    commit(repo, 1)
    sha = write(repo, 2)
    # The filter is SIGKILLed as it renames its first object into the store: the object is
    # written in full under a temporary name, and the process dies.
    filter_process = shlex.join([sys.executable, "-E", "-P", "-m", "git_theta", "filter-process"])
    kill = (
        "strace -qq -f -o /dev/null -e trace=rename,renameat,renameat2 "
        "-e inject=rename,renameat,renameat2:signal=KILL:when=1 "
    )
    killed = f"filter.theta.process={kill}{filter_process}"
    done = git(repo, "-c", killed, "add", MODEL, check=False)
    assert done.returncode == 128
    assert "clean filter 'theta' failed" in done.stderr.decode()
    assert staged(repo) == b""
    stale = temporaries(repo)
    # The object being renamed, and any another worker thread was writing.
    assert stale and all("/tmp/theta-" in path for path in stale), stale
    assert corrupt_objects(objects(repo)) == []

    git(repo, "add", MODEL)
    second = commit(repo, 2)
    assert corrupt_objects(objects(repo)) == []
    assert checks_out(repo, second, sha)
    assert checks_out(repo, "HEAD~", first)
    prune_removes(repo, temporaries(repo))


# ------------------------------------------------------------------ a full disk


def _limited(max_bytes: int) -> Callable[[], None]:
    def limit() -> None:  # in the child: writes past max_bytes fail (EFBIG), no SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


class Full:
    """Makes the next command's writes fail for want of space: a full tmpfs the repository
    lives on (root), or a file-size limit on the command (anyone)."""

    def __init__(self, how: str, base: Path):
        self.how = how
        self.base = base
        self.repo = base / "repo"

    def run(self, argv: list[str], leave: int) -> subprocess.CompletedProcess[bytes]:
        if self.how == "tmpfs":
            pin = self.base / "pin"  # the old file stays allocated, as while a process reads it
            os.link(self.repo / MODEL, pin)
            filler = fill(self.base, leave)
            try:
                return subprocess.run(argv, cwd=self.repo, capture_output=True)
            finally:
                filler.unlink()
                pin.unlink()
        return subprocess.run(argv, cwd=self.repo, capture_output=True, preexec_fn=_limited(leave))


@pytest.fixture(params=["tmpfs", "rlimit"])
def full(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Full]:
    how = str(request.param)
    if how == "tmpfs" and not MOUNTABLE:
        pytest.skip("mounting a small file system needs root")
    base = tmp_path / "small"
    base.mkdir()
    with tmpfs(base, 48) if how == "tmpfs" else contextlib.nullcontext():
        repo = base / "repo"
        subprocess.run(["git-theta", "install"], check=True, capture_output=True)
        git(base, "init", "-q", str(repo))
        subprocess.run(["git-theta", "track", "*.safetensors"], cwd=repo, check=True)
        git(repo, "add", ".gitattributes")
        write(repo, 1)
        git(repo, "add", MODEL)
        commit(repo, 1)
        yield Full(how, base)
        os.chdir(tmp_path)


def _one_error_line(stderr: bytes, words: str) -> None:
    ours = [line for line in stderr.decode().splitlines() if line.startswith("git-theta:")]
    assert len(ours) == 1, stderr.decode()
    assert ours[0].startswith("git-theta: error: ") and words in ours[0], ours[0]
    assert "Traceback" not in stderr.decode()


def test_no_space_during_add_stages_nothing_and_the_retry_commits(full: Full) -> None:
    repo = full.repo
    sha = write(repo, 2)
    done = full.run(["git", "add", MODEL], leave=256 << 10)
    assert done.returncode == 128
    _one_error_line(done.stderr, "no space" if full.how == "tmpfs" else "too large")
    assert staged(repo) == b""
    assert temporaries(repo) == []  # the failed write's temporary is removed at once
    assert corrupt_objects(objects(repo)) == []
    git(repo, "add", MODEL)
    assert checks_out(repo, commit(repo, 2), sha)


def test_no_space_during_theta_checkout_leaves_the_file_untouched(full: Full) -> None:
    repo = full.repo
    sha = sha256(repo / MODEL)
    # The checkpoint left as its manifest (a skipped smudge), then written in place.
    (repo / MODEL).unlink()
    env = {**os.environ, "GIT_THETA_SKIP_SMUDGE": "1"}
    subprocess.run(["git", "checkout", "--", MODEL], cwd=repo, env=env, check=True)
    placeholder = (repo / MODEL).read_bytes()
    done = full.run(["git-theta", "checkout"], leave=256 << 10)
    assert done.returncode == 1
    _one_error_line(done.stderr, str(repo / MODEL))
    assert (repo / MODEL).read_bytes() == placeholder  # all or nothing
    assert temporaries(repo) == []
    subprocess.run(["git-theta", "checkout"], cwd=repo, check=True)
    assert sha256(repo / MODEL) == sha


# ------------------------------------------------------------------ read-only, concurrency


class _frozen:
    """``path`` read-only: a read-only mount as root (who ignores permission bits), else
    the permission bits of the directories."""

    def __init__(self, path: Path):
        self.path = path
        self.mount = read_only(path) if MOUNTABLE else None

    def __enter__(self) -> None:
        if self.mount is not None:
            self.mount.__enter__()
        else:
            for d in [self.path, *(p for p in self.path.rglob("*") if p.is_dir())]:
                d.chmod(0o555)

    def __exit__(self, *exc: object) -> None:
        if self.mount is not None:
            self.mount.__exit__(None, None, None)
        else:
            for d in [self.path, *(p for p in self.path.rglob("*") if p.is_dir())]:
                d.chmod(0o755)


@pytest.mark.skipif(os.geteuid() == 0 and not MOUNTABLE, reason="root cannot freeze a directory")
def test_read_only_store_add_fails_in_one_line_and_stages_nothing(repo: Path) -> None:
    write(repo, 1)
    git(repo, "add", MODEL)
    commit(repo, 1)
    sha = write(repo, 2)
    (repo / ".git" / "lfs" / "tmp").mkdir(exist_ok=True)
    with _frozen(repo / ".git" / "lfs"):
        done = git(repo, "add", MODEL, check=False)
    assert done.returncode == 128
    _one_error_line(done.stderr, "read-only" if MOUNTABLE else "ermission denied")
    assert staged(repo) == b""
    git(repo, "add", MODEL)
    assert checks_out(repo, commit(repo, 2), sha)


@pytest.mark.skipif(os.geteuid() == 0 and not MOUNTABLE, reason="root cannot freeze a directory")
def test_read_only_store_still_serves_status_and_checkout(repo: Path) -> None:
    first = write(repo, 1)
    git(repo, "add", MODEL)
    commit(repo, 1)
    write(repo, 2)
    git(repo, "add", MODEL)
    commit(repo, 2)
    (repo / ".git" / "lfs" / "tmp").mkdir(exist_ok=True)
    with _frozen(repo / ".git" / "lfs"):
        os.utime(repo / MODEL)  # stat-dirty: git asks the filter to clean it again
        status = git(repo, "status", "--porcelain", check=False)
        checkout = git(repo, "checkout", "-q", "--detach", "HEAD~", check=False)
    assert status.returncode == 0, status.stderr.decode()
    assert checkout.returncode == 0, checkout.stderr.decode()
    assert sha256(repo / MODEL) == first


def test_concurrent_adds_in_two_worktrees_both_commit(repo: Path) -> None:
    write(repo, 1)
    git(repo, "add", MODEL)
    commit(repo, 1)
    side = repo.parent / "side"
    git(repo, "worktree", "add", "-q", "-b", "side", str(side))
    shas = {repo: write(repo, 2), side: write(side, 2, "side")}
    done: dict[Path, subprocess.CompletedProcess[bytes]] = {}

    def add(tree: Path) -> None:
        done[tree] = git(tree, "add", MODEL, check=False)

    threads = [threading.Thread(target=add, args=(t,)) for t in shas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(d.returncode == 0 for d in done.values()), [d.stderr for d in done.values()]
    assert corrupt_objects(objects(repo)) == []
    for tree, sha in shas.items():
        assert checks_out(tree, commit(tree, 2), sha)
    assert temporaries(repo) == []
