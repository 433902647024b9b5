"""A hostile file system: committed symlinks where we write temporaries, FIFOs where we
read, a log path another user prepared, full disks, killed processes. Real git throughout.

And a scan of the package that fails when a new path writes a file without files.py.
"""

from __future__ import annotations

import ast
import errno
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import git, sha256
from st_files import f32, st_from_arrays

import git_theta
from git_theta import __version__
from git_theta.commands.errors import report
from git_theta.files import DEAD_WRITER_GRACE

SHAPES = {"emb": (256, 64), "head": (64, 16)}  # ~70 KB of float32
BIG = {"w": (512, 512)}  # 1 MiB of float32: more than the small file systems below hold
VICTIM = b"the user's own file, outside the repository\n"
TIMEOUT = 60  # seconds: a hang (a FIFO opened blocking) fails instead of stalling the run


def write_model(repo: Path, seed: int = 1, shapes: dict[str, tuple[int, ...]] = SHAPES) -> str:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(shapes, seed)))
    return sha256(repo / "model.safetensors")


def victim(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    path = outside / "victim"
    path.write_bytes(VICTIM)
    return path


def run(
    cwd: Path,
    *argv: str,
    env: dict[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
    input: bytes | None = None,
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        list(argv),
        cwd=cwd,
        input=input,
        capture_output=True,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec,
        timeout=TIMEOUT,
    )


def theta_lines(done: subprocess.CompletedProcess[bytes]) -> list[str]:
    """git-theta's own lines on stderr (git adds its own about a failed filter)."""
    text = done.stderr.decode()
    assert "Traceback" not in text and "internal error" not in text, text
    return [line for line in text.splitlines() if line.startswith("git-theta:")]


def clone_of(repo: Path, tmp_path: Path, name: str = "clone", **env: str) -> Path:
    """Push ``repo`` to a file:// remote and clone it, as a stranger's repository is."""
    remote = tmp_path / "origin.git"
    if not remote.exists():
        git(tmp_path, "init", "-q", "--bare", str(remote))
        git(repo, "remote", "add", "origin", f"file://{remote}")
    git(repo, "push", "-q", "origin", "main")
    dest = tmp_path / name
    done = run(tmp_path, "git", "clone", "-q", f"file://{remote}", str(dest), env=env)
    assert done.returncode == 0, done.stderr.decode()
    return dest


def theta_temporaries(repo: Path) -> list[str]:
    tmp = repo / ".git" / "lfs" / "tmp"
    return (
        sorted(p.name for p in tmp.iterdir() if p.name.startswith("theta-")) if tmp.exists() else []
    )


# -- writes through committed symlinks ------------------------------------------------


def test_checkout_never_writes_through_a_committed_symlink(repo: Path, tmp_path: Path) -> None:
    target = victim(tmp_path)
    sha = write_model(repo)
    # The name the old checkout used for its temporary, pointing outside the repository.
    (repo / ".model.safetensors.theta-tmp").symlink_to(target)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "model and a trap")
    clone = clone_of(repo, tmp_path, GIT_THETA_SKIP_SMUDGE="1")
    assert (clone / "model.safetensors").read_bytes().startswith(b"{")  # a placeholder

    done = run(clone, "git", "theta", "checkout")

    assert done.returncode == 0, done.stderr.decode()
    assert theta_lines(done) == []  # GIT_THETA_QUIET (conftest) silences "checked out"
    assert target.read_bytes() == VICTIM
    assert sha256(clone / "model.safetensors") == sha
    assert not (clone / "model.safetensors").is_symlink()
    assert os.readlink(clone / ".model.safetensors.theta-tmp") == str(target)
    assert sorted(p.name for p in clone.iterdir()) == [
        ".git",
        ".gitattributes",
        ".model.safetensors.theta-tmp",
        "model.safetensors",
    ]


def test_checkout_refuses_a_fifo_at_the_path_without_hanging(repo: Path) -> None:
    write_model(repo)
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "model")
    (repo / "model.safetensors").unlink()
    os.mkfifo(repo / "model.safetensors")

    done = run(repo, "git", "theta", "checkout", "model.safetensors")

    assert done.returncode == 1
    assert theta_lines(done) == [
        f"git-theta: error: {repo}/model.safetensors is a FIFO, not a regular file; "
        "git-theta does not read it (replace it, or move it aside)"
    ]
    assert stat.S_ISFIFO(os.lstat(repo / "model.safetensors").st_mode)


def test_track_never_writes_through_a_committed_symlink(repo: Path, tmp_path: Path) -> None:
    target = victim(tmp_path)
    (repo / ".gitattributes.theta-tmp").symlink_to(target)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a trap")
    clone = clone_of(repo, tmp_path)

    done = run(clone, "git", "theta", "track", "*.bin")

    assert done.returncode == 0, done.stderr.decode()
    assert target.read_bytes() == VICTIM
    attributes = clone / ".gitattributes"
    assert not attributes.is_symlink()
    assert (
        attributes.read_text().splitlines()[-1] == "*.bin filter=theta diff=theta merge=theta -text"
    )
    assert os.readlink(clone / ".gitattributes.theta-tmp") == str(target)


def test_track_refuses_a_symlinked_gitattributes_in_one_line(repo: Path, tmp_path: Path) -> None:
    target = victim(tmp_path)
    (repo / ".gitattributes").unlink()
    (repo / ".gitattributes").symlink_to(target)

    done = run(repo, "git", "theta", "track", "*.bin")

    assert done.returncode == 1
    assert theta_lines(done) == [
        f"git-theta: error: {repo}/.gitattributes is a symbolic link, not a regular file; "
        "git-theta does not go through it (replace it, or move it aside)"
    ]
    assert target.read_bytes() == VICTIM
    assert (repo / ".gitattributes").is_symlink()


# -- reads that must not hang or explode ----------------------------------------------


@pytest.mark.parametrize("command", ["textconv", "diff-driver"])
def test_driver_given_a_fifo_fails_fast_in_one_line(repo: Path, command: str) -> None:
    fifo = repo / "model.safetensors"
    os.mkfifo(fifo)
    args = [str(fifo)] if command == "textconv" else [
        "model.safetensors", "/dev/null", ".", "100644", str(fifo), ".", "100644"
    ]  # fmt: skip

    done = run(repo, "git-theta", command, *args)  # as git runs them

    assert done.returncode == 1
    assert theta_lines(done) == [
        f"git-theta: error: {fifo} is a FIFO, not a regular file; git-theta does not read it "
        "(replace it, or move it aside)"
    ]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_rules_file_symlinked_to_dev_zero_is_refused_in_one_line(repo: Path) -> None:
    (repo / ".theta-updates").symlink_to("/dev/zero")
    write_model(repo)
    # Direct filter (no warm server), so the memory limit reaches the filter: the old
    # code read /dev/zero until the limit stopped it.
    done = run(
        repo,
        "git",
        "add",
        "model.safetensors",
        env={"GIT_THETA_SERVER": "0"},
        preexec=_limit_memory,
    )

    assert done.returncode != 0
    assert theta_lines(done) == [
        f"git-theta: error: model.safetensors: {repo}/.theta-updates is a symbolic link, not a "
        "regular file; git-theta does not go through it (replace it, or move it aside)"
    ]


def test_rules_file_over_its_cap_is_refused_in_one_line(repo: Path) -> None:
    (repo / ".theta-updates").write_text("# a comment line, repeated\n" * 50_000)  # 1.35 MB
    write_model(repo)

    done = run(repo, "git", "add", "model.safetensors")

    assert done.returncode != 0
    assert theta_lines(done) == [
        f"git-theta: error: model.safetensors: {repo}/.theta-updates is over 1,048,576 bytes, "
        "more than such a file needs; refused (check what it holds)"
    ]


# -- the log another local user could prepare -----------------------------------------


@pytest.fixture
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "state"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    return home


def internal_error(capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        code = report(exc)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    return code, lines[0]


def test_internal_error_log_is_private_and_records_the_version(
    state_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = internal_error(capsys)
    log = state_home / "git-theta" / "errors.log"
    assert code == 70
    assert line == f"git-theta: internal error: RuntimeError: boom (traceback in {log})"
    assert stat.S_IMODE((state_home / "git-theta").stat().st_mode) == 0o700
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    text = log.read_text()
    assert f"git-theta {__version__}" in text and "RuntimeError: boom" in text


def test_log_dir_symlinked_elsewhere_is_not_written(
    state_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (state_home / "git-theta").symlink_to(elsewhere)

    code, line = internal_error(capsys)

    assert code == 70
    assert line == (
        f"git-theta: internal error: RuntimeError: boom (no traceback log: {state_home}/git-theta "
        "is a symbolic link, not a directory; git-theta does not go through it (replace it, or "
        "move it aside))"
    )
    assert list(elsewhere.iterdir()) == []


def test_log_file_symlinked_elsewhere_is_not_written(
    state_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = victim(tmp_path)
    (state_home / "git-theta").mkdir(mode=0o700)
    (state_home / "git-theta" / "errors.log").symlink_to(target)

    code, line = internal_error(capsys)

    assert code == 70 and line.endswith(
        "errors.log is a symbolic link, not a regular file; "
        "git-theta does not go through it (replace it, or move it aside))"
    )
    assert target.read_bytes() == VICTIM


def test_log_that_is_a_fifo_does_not_hang(state_home: Path) -> None:
    (state_home / "git-theta").mkdir(mode=0o700)
    os.mkfifo(state_home / "git-theta" / "errors.log")
    code = (
        "from git_theta.commands.errors import report\nraise SystemExit(report(RuntimeError('x')))"
    )

    done = run(state_home, sys.executable, "-c", code)  # in a child: a hang fails the timeout

    assert done.returncode == 70
    assert done.stderr.decode().endswith(
        "errors.log is a FIFO, not a regular file; git-theta does not go through it (replace "
        "it, or move it aside))\n"
    )


def test_log_dir_of_another_user_or_open_to_others_is_not_used(
    state_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = state_home / "git-theta"
    directory.mkdir()
    directory.chmod(0o777)  # what another user would have made it, to read our tracebacks
    _, line = internal_error(capsys)
    assert line.endswith(
        f"(no traceback log: {directory} is open to other users (mode 777): chmod 700 it)"
    )
    if os.getuid() == 0:  # only root can give a directory away
        directory.chmod(0o700)
        os.chown(directory, 4242, 4242)
        _, line = internal_error(capsys)
        assert line.endswith(f"(no traceback log: {directory} belongs to uid 4242, not to us)")
    assert list(directory.iterdir()) == []


# -- the operating system's errors are one line ---------------------------------------


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_file_size_limit_is_one_line_and_leaves_no_temporary(repo: Path) -> None:
    write_model(repo, shapes=BIG)
    # The direct filter, so that it runs under the limit given to git.
    done = run(
        repo,
        "git",
        "add",
        "model.safetensors",
        env={"GIT_THETA_SERVER": "0"},
        preexec=_limit_file_size,
    )
    assert done.returncode != 0
    lines = theta_lines(done)
    assert len(lines) == 1, lines
    prefix = (
        "git-theta: error: model.safetensors: file too large for this process's size limit "
        f"writing {repo}/.git/lfs/tmp/theta-"
    )
    assert lines[0].startswith(prefix) and lines[0].endswith(
        ": raise the limit (`ulimit -f`) and retry"
    )
    assert theta_temporaries(repo) == []
    assert run(repo, "git", "add", "model.safetensors").returncode == 0  # the retry succeeds


@pytest.fixture
def small_fs() -> Iterator[Callable[[Path, str], None]]:
    """Mount a tmpfs of a given size over a directory (root only); unmounted at the end."""
    mounted: list[Path] = []

    def mount(where: Path, size: str) -> None:
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)

    if os.getuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small file system")
    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], check=True)


def test_full_disk_is_one_line_and_the_retry_succeeds(
    repo: Path, small_fs: Callable[[Path, str], None]
) -> None:
    lfs = repo / ".git" / "lfs"
    small_fs(lfs, "256k")
    write_model(repo, shapes=BIG)

    done = run(repo, "git", "add", "model.safetensors")

    assert done.returncode != 0
    lines = theta_lines(done)
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"git-theta: error: model.safetensors: no space left on device writing {lfs}/tmp/theta-"
    )
    assert lines[0].endswith(": free some space and retry")
    assert theta_temporaries(repo) == []
    subprocess.run(["mount", "-o", "remount,size=16m", str(lfs)], check=True)  # space freed
    assert run(repo, "git", "add", "model.safetensors").returncode == 0


def test_store_across_file_systems_is_one_line(
    repo: Path, small_fs: Callable[[Path, str], None]
) -> None:
    tmp = repo / ".git" / "lfs" / "tmp"
    small_fs(tmp, "16m")  # temporaries here, objects on the disk: a rename cannot join them
    write_model(repo)

    done = run(repo, "git", "add", "model.safetensors")

    assert done.returncode != 0
    lines = theta_lines(done)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"git-theta: error: model.safetensors: cannot rename {tmp}/theta-")
    assert lines[0].endswith(
        ": they are on different file systems: keep the Git LFS directory (.git/lfs, or "
        "lfs.storage) on one file system"
    )
    assert theta_temporaries(repo) == []


@pytest.mark.parametrize(
    ("number", "line"),
    [
        (
            errno.EACCES,
            "permission denied on /r/x: check the owner and mode of it and its directory",
        ),
        (errno.EROFS, "read-only file system at /r/x: work in a writable clone or remount it"),
        (errno.EMFILE, "too many open files at /r/x: raise the limit (`ulimit -n`) and retry"),
    ],
)
def test_os_errors_are_one_line_naming_the_file(
    number: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report(OSError(number, os.strerror(number), "/r/x"), "model.safetensors") == 1
    assert capsys.readouterr().err == f"git-theta: error: model.safetensors: {line}\n"


@pytest.mark.parametrize(
    "exc", [MemoryError(), RuntimeError("can't start new thread")], ids=["malloc", "thread"]
)
def test_running_out_of_memory_is_one_line_saying_so(
    exc: BaseException, capsys: pytest.CaptureFixture[str]
) -> None:
    """A machine's or `ulimit -v`'s limit is not git-theta's internal error: one line,
    exit 1, no traceback to report (review R1: a 256 MiB tensor under `ulimit -v 300000`
    said `internal error: m.safetensors: MemoryError`)."""
    assert report(exc, "model.safetensors") == 1
    assert capsys.readouterr().err == (
        "git-theta: error: model.safetensors: out of memory: free some memory (or raise "
        "`ulimit -v`) and retry\n"
    )


def pkt(text: str) -> bytes:
    return b"%04x" % (len(text) + 5) + text.encode() + b"\n"


HANDSHAKE = (
    pkt("git-filter-client") + pkt("version=2") + b"0000"
    + pkt("capability=clean") + pkt("capability=smudge") + b"0000"
)  # fmt: skip


def clean_request(path: str, content: bytes) -> bytes:
    out = pkt("command=clean") + pkt(f"pathname={path}") + b"0000"
    for start in range(0, len(content), 65516):
        part = content[start : start + 65516]
        out += b"%04x" % (len(part) + 4) + part
    return out + b"0000"


def test_an_os_error_fails_that_file_only_and_the_filter_serves_on(repo: Path) -> None:
    big = st_from_arrays(f32(BIG, 1))
    small = st_from_arrays(f32({"b": (16,)}, 2))
    request = (
        HANDSHAKE + clean_request("big.safetensors", big) + clean_request("s.safetensors", small)
    )
    done = run(repo, "git-theta", "filter-process", preexec=_limit_file_size, input=request)

    assert done.returncode == 0
    answers = re.findall(rb"status=(\w+)", done.stdout)
    assert answers == [b"error", b"success"]  # the second file's content follows its status
    lines = theta_lines(done)
    assert len(lines) == 1 and lines[0].startswith(
        "git-theta: error: big.safetensors: file too large for this process's size limit"
    )


def test_git_closing_our_output_ends_the_filter_in_one_line(repo: Path) -> None:
    filter_process = subprocess.Popen(
        ["git-theta", "filter-process"],
        cwd=repo,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert filter_process.stdout is not None
    filter_process.stdout.close()  # git is gone: nobody reads what the filter answers
    _, err = filter_process.communicate(HANDSHAKE, timeout=TIMEOUT)
    assert filter_process.returncode == 1
    assert err == b"git-theta: error: git closed the filter's pipes (was it killed?); stopped\n"


def test_git_dying_mid_file_ends_the_filter_in_one_line(repo: Path) -> None:
    request = (
        HANDSHAKE
        + pkt("command=clean") + pkt("pathname=model.safetensors") + b"0000"
        + b"0104" + b"\0" * 100  # a packet of 256 bytes, cut after 100: git was killed
    )  # fmt: skip
    done = subprocess.run(
        ["git-theta", "filter-process"],
        cwd=repo,
        input=request,
        capture_output=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 1
    assert done.stderr.decode() == (
        "git-theta: error: git closed the filter's pipes while filtering model.safetensors "
        "(was it killed?); stopped\n"
    )


# -- temporaries of killed processes --------------------------------------------------

_WRITER = """
import sys
from git_theta.store import ObjectStore

def parts():
    yield b"x" * 100_000
    print("writing", flush=True)
    sys.stdin.read()  # until killed
    yield b""

ObjectStore(sys.argv[1]).put(parts())
"""


def killed_writer_temporary(repo: Path) -> Path:
    """Kill -9 a process in the middle of storing an object; return its temporary, aged
    past the grace a dead writer's temporary gets."""
    lfs = repo / ".git" / "lfs"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(lfs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert writer.stdout is not None and writer.stdout.readline() == b"writing\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    (name,) = theta_temporaries(repo)
    assert name.startswith(f"theta-{writer.pid}-")
    path = lfs / "tmp" / name
    aged = time.time() - DEAD_WRITER_GRACE - 1
    os.utime(path, (aged, aged))
    return path


def test_the_next_add_removes_a_killed_writers_temporary(repo: Path) -> None:
    stale = killed_writer_temporary(repo)
    live = stale.with_name(f"theta-{os.getpid()}-{'0' * 16}")  # a writer still running: kept
    live.write_bytes(b"")
    theirs = stale.with_name("lfs-object-tmp")  # git-lfs's: not ours to judge
    theirs.write_bytes(b"")
    write_model(repo)

    assert run(repo, "git", "add", "model.safetensors").returncode == 0

    assert not stale.exists()
    assert live.exists() and theirs.exists()


def test_prune_removes_a_killed_writers_temporary(repo: Path) -> None:
    stale = killed_writer_temporary(repo)

    dry = run(repo, "git", "theta", "prune", "--dry-run")
    assert stale.exists()
    done = run(repo, "git", "theta", "prune")

    assert dry.stderr.decode().splitlines()[-1] == (
        "git-theta: would remove 1 temporary files of killed git-theta processes (0.1 MB)"
    )
    assert done.stderr.decode().splitlines()[-1] == (
        "git-theta: removed 1 temporary files of killed git-theta processes (0.1 MB)"
    )
    assert not stale.exists()


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def aged(path: Path, data: bytes = b"partial") -> Path:
    path.write_bytes(data)
    then = time.time() - DEAD_WRITER_GRACE - 1
    os.utime(path, (then, then))
    return path


def test_temporaries_of_a_killed_checkout_are_removed(repo: Path) -> None:
    sha = write_model(repo)
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "model")
    (repo / "sub").mkdir()
    (repo / "sub" / "model.safetensors").write_bytes((repo / "model.safetensors").read_bytes())
    git(repo, "add", "sub/model.safetensors")
    pid = dead_pid()
    beside = aged(repo / f".model.safetensors.theta-{pid}-{'a' * 16}")
    deeper = aged(repo / "sub" / f".model.safetensors.theta-{pid}-{'b' * 16}")
    users = aged(repo / f".notes.theta-{pid}-mine")  # looks alike, is not ours: kept

    # The next write of that file removes its own stale temporary; prune the others.
    assert run(repo, "git", "theta", "checkout", "--force", "model.safetensors").returncode == 0
    assert not beside.exists() and deeper.exists()
    done = run(repo, "git", "theta", "prune")

    assert done.stderr.decode().splitlines()[-1] == (
        "git-theta: removed 1 temporary files of killed git-theta processes (0.0 MB)"
    )
    assert not deeper.exists() and users.exists()
    assert sha256(repo / "model.safetensors") == sha


def test_a_temporary_untouched_for_a_day_is_removed_whatever_its_pid(repo: Path) -> None:
    tmp = repo / ".git" / "lfs" / "tmp"
    tmp.mkdir(parents=True)
    old = tmp / f"theta-{os.getpid()}-{'0' * 16}"  # a live pid, perhaps reused
    old.write_bytes(b"x")
    aged = time.time() - 2 * 86400
    os.utime(old, (aged, aged))

    run(repo, "git", "theta", "prune")

    assert not old.exists()


def test_a_symlinked_store_tmp_dir_is_refused(repo: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (repo / ".git" / "lfs").mkdir(exist_ok=True)
    (repo / ".git" / "lfs" / "tmp").symlink_to(elsewhere)
    write_model(repo)

    done = run(repo, "git", "add", "model.safetensors")

    assert done.returncode != 0
    assert theta_lines(done) == [
        f"git-theta: error: model.safetensors: {repo}/.git/lfs/tmp is not a directory (a "
        "symbolic link?); git-theta keeps its temporary files only in a real directory: "
        "remove it and retry"
    ]
    assert list(elsewhere.iterdir()) == []


# -- no path writes a file any other way -----------------------------------------------

PACKAGE = Path(git_theta.__file__).parent
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}
_OS_CALLS = {"replace", "rename", "renames", "link", "symlink", "mkfifo", "truncate"}
_PATH_METHODS = {"write_text", "write_bytes", "touch", "symlink_to", "hardlink_to", "rename"}
# Modules that read work-tree or committed paths: every open goes through files.py.
UNTRUSTED_READERS = {
    "commands/diff.py", "commands/textconv.py", "diffing.py", "commands/remote.py",
    "commands/prune.py", "update_rules.py", "commands/track.py",
}  # fmt: skip

_STORE_LINK = (
    "a hard link of a regular object file (lstat-checked, named by its sha256) between "
    "git-lfs's object directory and ours, never over an existing name: no bytes written"
)
_HOOK_MOVE = (
    "moves another tool's hook (a file or a symlink, renamed as it is, never followed) to "
    "or from its chained name: no bytes are written through it"
)
# (module, function, what) -> why it may write without files.py. Keep each reason true.
ALLOWED = {
    ("forkserver.py", "Server.__init__", "os.rename"):
        "a Unix socket bound under a private name in our 0700 socket directory, renamed "
        "over the path: not a file's content",
    ("forkserver.py", "_name", "open-write"): "/proc/self/comm, the kernel's, not a file",
    ("filter_client.py", "_may_start", "os.open-write"):
        "the O_CREAT|O_EXCL start claim, an empty file in our 0700 socket directory",
    ("store.py", "_link", "os.link"): _STORE_LINK,
    ("store.py", "_move", "os.replace"):
        "renames an object file inside the LFS directory (aside when corrupt, to and from "
        "prune's holding directory): a name moved, no bytes written through it",
    ("restage.py", "private_index", "os.open-write"):
        "git's own index lock, taken as git takes it: an empty file created O_EXCL",
    ("hooks.py", "_install", "os.replace"): _HOOK_MOVE,
    ("hooks.py", "remove_hooks", "os.replace"): _HOOK_MOVE,
}  # fmt: skip


def _mode_writes(node: ast.expr | None) -> bool:
    if node is None:
        return False  # the default mode reads
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return any(c in node.value for c in "wax+")
    return True  # a computed mode: cannot tell, so it counts


def _mode_arg(call: ast.Call, position: int) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == "mode":
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _names(node: ast.AST) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(node) if isinstance(n, ast.Attribute | ast.Name)}  # fmt: skip


def _call_kind(call: ast.Call, module: str) -> str | None:
    """What a call does to the file system that files.py should do instead, if anything."""
    func = call.func
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Constant) and isinstance(first.value, int):
        return None  # a file descriptor already open (stdio), not a path
    if isinstance(first, ast.Attribute) and first.attr == "devnull":
        return None
    if isinstance(func, ast.Name) and func.id == "open":
        if _mode_writes(_mode_arg(call, 1)):
            return "open-write"
        return "open-read" if module in UNTRUSTED_READERS else None
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value.id if isinstance(func.value, ast.Name) else ""
    if owner == "os" and func.attr in _OS_CALLS:
        return f"os.{func.attr}"
    if owner == "os" and func.attr == "open" and len(call.args) > 1:
        return "os.open-write" if _names(call.args[1]) & _WRITE_FLAGS else None
    if owner == "shutil" and func.attr.startswith(("move", "copy")):
        return f"shutil.{func.attr}"
    if func.attr in _PATH_METHODS:
        return f".{func.attr}"
    if func.attr == "replace" and len(call.args) == 1 and not call.keywords:
        return ".replace"  # Path.replace(target); str.replace takes two arguments
    mode = _mode_arg(call, 0)
    if func.attr == "open" and isinstance(mode, ast.Constant) and _mode_writes(mode):
        return ".open-write"  # Path.open("w"); a store's open(ref) is not a mode
    if func.attr in ("read_bytes", "read_text") and module in UNTRUSTED_READERS:
        return f".{func.attr}"
    return None


def _writes(module: str, tree: ast.AST) -> Iterator[tuple[str, str, int]]:
    """(function, what, line) for every call in ``tree`` that writes a file directly."""

    def visit(node: ast.AST, scope: list[str]) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = [*scope, child.name]
            if isinstance(child, ast.Call) and (kind := _call_kind(child, module)):
                yield ".".join(scope) or "<module>", kind, child.lineno
            yield from visit(child, inner)

    yield from visit(tree, [])


def test_every_file_write_goes_through_files_py() -> None:
    found: dict[tuple[str, str, str], int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "files.py":
            continue
        for function, kind, line in _writes(module, ast.parse(path.read_text(), str(path))):
            found.setdefault((module, function, kind), line)
    unexpected = {
        f"{m}:{line} {f}: {k}" for (m, f, k), line in found.items() if (m, f, k) not in ALLOWED
    }
    assert not unexpected, (
        "write files with git_theta.files (atomic_write, AtomicWriter, TempFile), read "
        "work-tree paths with files.open_regular, or allow-list with a reason: "
        f"{sorted(unexpected)}"
    )
    stale = set(ALLOWED) - set(found)
    assert not stale, f"allow-list entries no longer needed (remove them): {sorted(stale)}"


@pytest.mark.parametrize(
    "source",
    [
        'open(p, "w")',
        'open(p, mode="ab")',
        "open(p, m)",
        "os.replace(a, b)",
        "os.rename(a, b)",
        'Path(p).write_bytes(b"")',
        "p.write_text(t)",
        "shutil.move(a, b)",
        "shutil.copyfile(a, b)",
        "p.replace(q)",
        "os.open(p, os.O_WRONLY | os.O_CREAT)",
        'p.open("x")',
    ],
)
def test_the_scan_sees_each_way_to_write(source: str) -> None:
    assert len(list(_writes("any.py", ast.parse(source)))) == 1
    assert list(_writes("any.py", ast.parse('s.replace("a", "b"); open(p); store.open(ref)'))) == []


def test_a_reader_that_quit_is_silent_and_exits_0(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom git_theta.commands.errors import report\n"
        "try:\n    print('x' * 1_000_000)\nexcept BrokenPipeError as exc:\n"
        "    raise SystemExit(report(exc))\n"
    )
    read_end, write_end = os.pipe()
    os.close(read_end)  # `git theta diff | head`, once head has had enough
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE, timeout=TIMEOUT
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (0, b"")  # as git's driver needs (tests/test_ux.py)
