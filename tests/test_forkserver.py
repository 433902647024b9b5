"""The warm filter server, through real git: off by default; when on, what it serves, as
whom, and when it steps aside."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import _kill_servers, git, sha256
from hostile_modules import markers_left, plant
from lfs_server import LfsServer
from st_files import f32, st_from_arrays

import git_theta
from git_theta import filter_client
from git_theta.commands.cli import main
from git_theta.forkserver import REQUEST_TIME, find_servers, running_servers, stop_servers

# One worker runs every test that starts a filter server: two of them touch a module of
# the package to play an upgrade, which makes any server running meanwhile step aside.
pytestmark = pytest.mark.xdist_group("filter-server")

SHAPES = {"a.weight": (64, 32), "b.weight": (32, 16), "c.bias": (16,)}
SERVED = "git-theta: served by filter server"
_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private socket directory of this test's own, its servers stopped afterwards."""
    path = tmp_path / "servers"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("GIT_THETA_SERVER_DIR", str(path))
    monkeypatch.setenv("GIT_THETA_SERVER_TRACE", "1")
    yield path
    _kill_servers(path)


@pytest.fixture
def repo(repo: Path, servers: Path) -> Path:
    """conftest's ``repo`` with the warm server turned on, as users turn it on (it is off
    by default: tests/test_server_setting.py)."""
    assert main(["install", "--server"]) == 0
    return repo


def sock_path(servers: Path) -> Path:
    return Path(filter_client.socket_path(str(servers)))


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def wait_for_server(servers: Path, path: Path | None = None, timeout: float = 20.0) -> None:
    """Wait until a server listens on ``path`` (this directory's socket by default),
    woken by the directory's changes (a server renames its socket into place)."""
    path = path or sock_path(servers)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
    assert fd >= 0
    try:
        assert libc.inotify_add_watch(fd, os.fsencode(path.parent), _IN_CREATE | _IN_MOVED_TO) >= 0
        deadline = time.monotonic() + timeout
        while not _listening(path):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([fd], [], [], left)[0], "no filter server came up"
            with contextlib.suppress(BlockingIOError):
                os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def server_argv(path: Path) -> list[str]:
    return [sys.executable, "-E", "-P", "-m", "git_theta", "filter-server", str(path)]


def start_server(servers: Path, **env: str) -> subprocess.Popen[bytes]:
    """Start a server as the client does (in a session of its own) and return once it
    listens: it lets go of its standard output then."""
    proc = subprocess.Popen(
        server_argv(sock_path(servers)),
        env={**os.environ, **env},
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.read() == b""
    proc.stdout.close()
    assert proc.poll() is None, "the server did not start"
    return proc


def add(repo: Path, *paths: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "add", *paths], cwd=repo, env={**os.environ, **env}, capture_output=True, text=True
    )


def chain_updates(repo: Path, name: str) -> list[str]:
    manifest = json.loads(git(repo, "show", ":model.safetensors").stdout)
    return [link["update"] for link in manifest["tensors"][name]["chain"]]


def test_server_serves_adds_and_checkouts_with_the_callers_environment(
    repo: Path, servers: Path
) -> None:
    arrays = f32(SHAPES, seed=3)
    model = repo / "model.safetensors"
    model.write_bytes(st_from_arrays(arrays))
    first = add(repo, "model.safetensors")
    assert first.returncode == 0, first.stderr
    assert SERVED not in first.stderr  # none yet: this command filtered itself...
    wait_for_server(servers)  # ...and started one for the next
    git(repo, "commit", "-q", "-m", "v1")
    v1 = sha256(model)

    arrays["a.weight"][0, :4] += 1.0  # a sparse change, which auto would store sparse
    model.write_bytes(st_from_arrays(arrays))
    v2 = sha256(model)
    second = add(repo, "model.safetensors", GIT_THETA_UPDATE_TYPE="dense")
    assert second.returncode == 0, second.stderr
    assert SERVED in second.stderr
    assert chain_updates(repo, "a.weight") == ["dense"]  # the caller's variable reached it
    git(repo, "commit", "-q", "-m", "v2")

    checkout = subprocess.run(
        ["git", "checkout", "-q", "HEAD~1", "--", "model.safetensors"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert checkout.returncode == 0, checkout.stderr
    assert SERVED in checkout.stderr
    assert sha256(model) == v1
    git(repo, "checkout", "-q", "HEAD", "--", "model.safetensors")
    assert sha256(model) == v2


def test_a_failing_add_reports_the_same_through_the_server(repo: Path, servers: Path) -> None:
    start_server(servers)
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=4))[:-5])
    served = add(repo, "model.safetensors")
    direct = add(repo, "model.safetensors", GIT_THETA_SERVER="0")
    assert SERVED in served.stderr
    assert SERVED not in direct.stderr
    assert served.returncode == direct.returncode != 0
    assert served.stderr.replace(served.stderr.splitlines()[0] + "\n", "") == direct.stderr
    assert "model.safetensors: file is truncated at byte" in direct.stderr
    assert git(repo, "diff", "--cached", "--name-only").stdout == b""


def test_an_upgraded_server_steps_aside(repo: Path, servers: Path) -> None:
    old = start_server(servers)
    module = Path(git_theta.__file__).with_name("registry.py")  # loaded by the server
    before = module.stat()
    try:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        model = repo / "model.safetensors"
        model.write_bytes(st_from_arrays(f32(SHAPES, seed=5)))
        done = add(repo, "model.safetensors")
        assert done.returncode == 0, done.stderr
        assert SERVED not in done.stderr  # refused: this command filtered itself
        assert old.wait(timeout=20) == 0  # and the stale server left
        wait_for_server(servers)  # a current one replaced it
        git(repo, "commit", "-q", "-m", "v1")
        sha = sha256(model)
        model.unlink()
        again = subprocess.run(
            ["git", "checkout", "--", "model.safetensors"], cwd=repo, capture_output=True, text=True
        )
        assert SERVED in again.stderr
        assert sha256(model) == sha
    finally:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_change_to_a_module_the_server_never_loaded_makes_it_step_aside(
    repo: Path, servers: Path
) -> None:
    # A worker imports prune.py, say, from disk as it is then: a server that served on
    # would mix an old and a new git-theta in one process.
    old = start_server(servers)
    module = Path(git_theta.__file__).parent / "commands" / "prune.py"  # not in _warm()
    before = module.stat()
    try:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=25)))
        done = add(repo, "model.safetensors")
        assert done.returncode == 0, done.stderr
        assert SERVED not in done.stderr
        assert old.wait(timeout=20) == 0
    finally:
        os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("mode", [0o755, 0o701])
def test_a_socket_directory_others_can_enter_is_not_used(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv("GIT_THETA_SERVER_DIR", str(shared))
    monkeypatch.setenv("GIT_THETA_SERVER_TRACE", "1")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=6)))
    try:
        for _ in range(2):
            done = add(repo, "model.safetensors")
            assert done.returncode == 0, done.stderr
            assert SERVED not in done.stderr
        time.sleep(0.5)  # a server wrongly started would have made its socket by now
        assert list(shared.iterdir()) == []
    finally:
        _kill_servers(shared)


def test_server_off_by_variable(repo: Path, servers: Path) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=7)))
    for _ in range(2):
        done = add(repo, "model.safetensors", GIT_THETA_SERVER="0")
        assert done.returncode == 0, done.stderr
        assert SERVED not in done.stderr
    time.sleep(0.5)
    assert list(servers.iterdir()) == []


def test_an_idle_server_exits_and_removes_its_socket(servers: Path) -> None:
    proc = start_server(servers, GIT_THETA_SERVER_IDLE="2")
    assert proc.wait(timeout=20) == 0
    assert not sock_path(servers).exists()


def test_a_dead_servers_socket_is_replaced(repo: Path, servers: Path) -> None:
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock_path(servers)))
    dead.close()  # the file stays, nobody listens: as after a server was killed
    model = repo / "model.safetensors"
    model.write_bytes(st_from_arrays(f32(SHAPES, seed=8)))
    done = add(repo, "model.safetensors")
    assert done.returncode == 0, done.stderr
    assert SERVED not in done.stderr
    wait_for_server(servers)
    arrays = f32(SHAPES, seed=9)
    model.write_bytes(st_from_arrays(arrays))
    assert SERVED in add(repo, "model.safetensors").stderr


def test_commands_in_parallel_each_get_their_own_worker(
    tmp_path: Path, repo: Path, servers: Path
) -> None:
    start_server(servers)
    repos = [repo]
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / ".gitattributes").write_text(
        "*.safetensors filter=theta diff=theta merge=theta -text\n"
    )
    repos.append(other)
    shas = []
    for i, r in enumerate(repos):
        arrays = {k: np.full(s, i + 1, np.float32) for k, s in SHAPES.items()}
        (r / "model.safetensors").write_bytes(st_from_arrays(arrays))
        shas.append(sha256(r / "model.safetensors"))
    procs = [
        subprocess.Popen(
            ["git", "add", "-A"], cwd=r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in repos
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert SERVED in err
    for r, sha in zip(repos, shas, strict=True):
        git(r, "commit", "-q", "-m", "v1")
        (r / "model.safetensors").unlink()
        git(r, "checkout", "--", "model.safetensors")
        assert sha256(r / "model.safetensors") == sha


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_signal_to_the_client_reaches_the_worker(servers: Path) -> None:
    start_server(servers)
    # A client whose git never speaks: its worker waits for the handshake forever.
    client = subprocess.Popen(
        [sys.executable, "-I", "-S", filter_client.__file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert client.stderr is not None
    try:
        ready, _, _ = select.select([client.stderr], [], [], 20)
        assert ready, "the client was not served"
        assert SERVED in client.stderr.readline().decode()
        deadline = time.monotonic() + 20
        while not catches(client.pid, signal.SIGTERM):  # forwarding is set up
            assert time.monotonic() < deadline, "the client never forwarded signals"
            time.sleep(0.01)
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=20) == 1  # the worker was terminated, so no exit status
        assert b"worker ended without an exit status" in client.stderr.read()
    finally:
        client.kill()
        client.wait()
        assert client.stdin is not None
        client.stdin.close()  # a worker still waiting for git's handshake sees its end


@pytest.mark.parametrize("pythonpath", ["", ":"])
def test_a_work_tree_never_supplies_the_filters_modules(
    repo: Path, servers: Path, tmp_path: Path, pythonpath: str
) -> None:
    # git runs the filter, and so starts the server, in the work tree of a cloned repo;
    # with PYTHONPATH=":" a json.py there stayed loaded in the server, for every command.
    markers = tmp_path / "markers"
    markers.mkdir()
    plant(repo, markers, "repo")
    model = repo / "model.safetensors"
    model.write_bytes(st_from_arrays(f32(SHAPES, seed=10)))
    first = add(repo, "model.safetensors", PYTHONPATH=pythonpath)  # starts a server
    assert first.returncode == 0, first.stderr
    wait_for_server(servers)
    model.write_bytes(st_from_arrays(f32(SHAPES, seed=11)))
    again = add(repo, "model.safetensors", PYTHONPATH=pythonpath)
    assert again.returncode == 0, again.stderr
    assert SERVED in again.stderr
    assert markers_left(markers) == []


def test_git_lfs_files_beside_theta_files_do_not_hang_git(repo: Path, servers: Path) -> None:
    # git-lfs's filter starts first (its file sorts first), and the server started by our
    # filter must not keep git's pipes to it open: git waits for git-lfs to see their end.
    git(repo, "lfs", "install", "--local", "--skip-repo")
    attributes = repo / ".gitattributes"
    attributes.write_text(attributes.read_text() + "*.bin filter=lfs diff=lfs merge=lfs -text\n")
    (repo / "a.bin").write_bytes(os.urandom(1000))
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=12)))
    done = subprocess.run(
        ["git", "add", "-A"], cwd=repo, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    wait_for_server(servers)
    git(repo, "commit", "-q", "-m", "both")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=13)))
    (repo / "a.bin").write_bytes(os.urandom(1000))
    done = subprocess.run(
        ["git", "add", "-A"], cwd=repo, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert SERVED in done.stderr


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_objects_are_written_under_the_callers_umask(repo: Path, servers: Path, umask: int) -> None:
    start_server(servers)
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=14 + umask)))
    done = subprocess.run(  # a shell sets the umask: no fork of this threaded process
        ["sh", "-c", f"umask {umask:03o} && exec git add model.safetensors"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert SERVED in done.stderr
    objects = [p for p in (repo / ".git" / "lfs" / "theta" / "objects").rglob("*") if p.is_file()]
    assert objects
    assert {p.stat().st_mode & 0o777 for p in objects} == {0o666 & ~umask}


def test_a_callers_module_path_is_ignored_as_the_filter_ignores_it(
    repo: Path, servers: Path, tmp_path: Path
) -> None:
    start_server(servers)
    markers = tmp_path / "markers"
    markers.mkdir()
    plant(tmp_path / "lib", markers, "lib")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=15)))
    done = add(repo, "model.safetensors", PYTHONPATH=str(tmp_path / "lib"))
    assert done.returncode == 0, done.stderr
    assert SERVED in done.stderr  # as a filter git starts, its worker ignores PYTHON*
    git(repo, "commit", "-q", "-m", "v1")
    assert git(repo, "show", "HEAD:model.safetensors").stdout.startswith(b"{")
    assert markers_left(markers) == []


def test_download_helpers_run_where_the_terminal_is(
    repo: Path, servers: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # git-lfs may prompt for credentials; a worker has no terminal, the client does (it is
    # in git's session), so the client starts git-lfs for the worker.
    server = LfsServer(tmp_path)
    server.start()
    try:
        remote = tmp_path / "origin.git"
        git(tmp_path, "init", "-q", "--bare", str(remote))
        git(repo, "remote", "add", "origin", f"file://{remote}")
        (repo / ".lfsconfig").write_text(f'[lfs]\n\turl = "{server.url("model")}"\n')
        (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=16)))
        sha = sha256(repo / "model.safetensors")
        monkeypatch.setenv("GIT_THETA_SERVER", "0")  # the one server: the one started below
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "v1")
        git(repo, "push", "-q", "origin", "main")
        monkeypatch.delenv("GIT_THETA_SERVER")
        wrappers = tmp_path / "bin"
        wrappers.mkdir()
        log, fds_log = tmp_path / "sessions.log", tmp_path / "fds.log"
        real = shutil.which("git-lfs")
        (wrappers / "git-lfs").write_text(
            f'#!/bin/sh\necho "$* $(cut -d" " -f6 /proc/$$/stat)" >> {log}\n'
            f'readlink /proc/$$/fd/* >> {fds_log}\nexec {real} "$@"\n'
        )
        (wrappers / "git-lfs").chmod(0o755)
        theta_server = start_server(servers)
        # A pipe git does not know of (as another filter's would be): no helper gets it.
        stray_r, stray_w = os.pipe()
        done = subprocess.run(
            ["git", "clone", f"file://{remote}", str(tmp_path / "clone")],
            capture_output=True,
            text=True,
            env={**os.environ, "PATH": f"{wrappers}{os.pathsep}{os.environ['PATH']}"},
            pass_fds=(stray_w,),
        )
        stray = f"pipe:[{os.fstat(stray_w).st_ino}]"
        os.close(stray_r)
        os.close(stray_w)
        assert done.returncode == 0, done.stderr
        assert SERVED in done.stderr
        assert sha256(tmp_path / "clone" / "model.safetensors") == sha
        helpers = [ln for ln in log.read_text().splitlines() if "filter-process" in ln]
        assert helpers, log.read_text()
        assert os.getsid(theta_server.pid) != os.getsid(0)  # its workers: no terminal
        assert {ln.rsplit(" ", 1)[1] for ln in helpers} == {str(os.getsid(0))}
        assert stray not in fds_log.read_text()
    finally:
        server.stop()


def test_stop_servers_stops_only_the_servers_of_a_directory(servers: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    ours, theirs = start_server(servers), start_server(other)
    try:
        assert stop_servers(str(servers)) == 1
        assert ours.wait(timeout=20) == 0  # it left as it should, socket removed
        assert not sock_path(servers).exists()
        assert theirs.poll() is None
    finally:
        theirs.terminate()
        theirs.wait()


def test_commands_started_at_once_start_one_server(
    repo: Path, tmp_path: Path, servers: Path
) -> None:
    repos = []  # beside ``repo``, whose fixture installed git-theta in the global config
    for i in range(4):
        r = tmp_path / f"r{i}"
        r.mkdir()
        git(r, "init", "-q")
        (r / ".gitattributes").write_text("*.safetensors filter=theta -text\n")
        (r / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=20 + i)))
        repos.append(r)
    procs = [subprocess.Popen(["git", "add", "-A"], cwd=r, stderr=subprocess.PIPE) for r in repos]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    wait_for_server(servers)
    assert len(running_servers(str(servers))) == 1
    assert not Path(str(sock_path(servers)) + filter_client.STARTING).exists()


def limited(repo: Path, limit: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``git ARGS`` under the shell's ``ulimit LIMIT`` (a shell: no fork of this process)."""
    command = (
        f"ulimit {limit} && exec git {shlex.join(args)}" if limit else shlex.join(["git", *args])
    )
    return subprocess.run(
        ["sh", "-c", command], cwd=repo, env={**os.environ, **env}, capture_output=True, text=True
    )


def without_trace(stderr: str) -> str:
    """``stderr`` without the server's trace line, temporary files' names made equal."""
    lines = (ln for ln in stderr.splitlines(keepends=True) if not ln.startswith(SERVED))
    return re.sub(r"theta-\d+-[0-9a-f]+", "theta-TMP", "".join(lines))


def test_a_worker_has_exactly_its_callers_resource_limits(repo: Path, servers: Path) -> None:
    # 1 MB of incompressible floats: its object is past a 64-block file size limit.
    big = {"w": (256, 1024)}
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(big, seed=30)))
    done = limited(repo, "-f 64", "add", "model.safetensors", GIT_THETA_SERVER="0")
    direct = subprocess.CompletedProcess(done.args, done.returncode, "", without_trace(done.stderr))
    assert direct.returncode != 0
    assert "file too large for this process's size limit" in direct.stderr

    # The first command of all starts the server, under its limit (hard and soft): the
    # server is that caller's, and a later caller without the limit never meets it.
    first = limited(repo, "-f 64", "add", "model.safetensors")
    assert (first.returncode, without_trace(first.stderr)) == (direct.returncode, direct.stderr)
    [small] = find_servers([str(servers)])
    wait_for_server(servers, Path(small.socket))
    free = add(repo, "model.safetensors")
    assert free.returncode == 0, free.stderr
    assert SERVED not in free.stderr  # none for it yet: it filtered itself, started one
    assert Path(small.socket) != sock_path(servers)
    wait_for_server(servers)
    git(repo, "reset", "-q")
    free = add(repo, "model.safetensors")
    assert free.returncode == 0, free.stderr
    assert SERVED in free.stderr and f"{SERVED} {small.pid}" not in free.stderr
    git(repo, "reset", "-q")

    again = limited(repo, "-f 64", "add", "model.safetensors")
    assert f"{SERVED} {small.pid}" in again.stderr  # limited exactly like the caller
    assert (again.returncode, without_trace(again.stderr)) == (direct.returncode, direct.stderr)

    # A soft limit alone is the caller's to set: the unlimited server's worker takes it.
    soft = limited(repo, "-S -f 64", "add", "model.safetensors")
    assert SERVED in soft.stderr and f"{SERVED} {small.pid}" not in soft.stderr
    assert (soft.returncode, without_trace(soft.stderr)) == (direct.returncode, direct.stderr)
    assert add(repo, "model.safetensors").returncode == 0  # and the next one has none


def test_a_caller_with_another_nice_value_meets_a_server_of_its_own(
    repo: Path, servers: Path
) -> None:
    ours = start_server(servers)
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=31)))
    niced = subprocess.run(
        ["nice", "-n", "5", "git", "add", "model.safetensors"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert niced.returncode == 0, niced.stderr
    assert SERVED not in niced.stderr  # ours would run its work at our priority
    [other] = [s for s in find_servers([str(servers)]) if s.pid != ours.pid]
    assert os.getpriority(os.PRIO_PROCESS, other.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
    wait_for_server(servers, Path(other.socket))
    git(repo, "reset", "-q")
    again = subprocess.run(
        ["nice", "-n", "5", "git", "add", "model.safetensors"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert f"{SERVED} {other.pid}" in again.stderr


def test_a_caller_in_another_cgroup_namespace_meets_a_server_of_its_own(
    repo: Path, servers: Path
) -> None:
    # What a cluster job's cgroup does (its work must stay in it), shown with a cgroup
    # namespace, which needs no change to the machine's cgroup tree.
    if subprocess.run(["unshare", "-C", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a cgroup namespace here")
    ours = start_server(servers)
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=33)))
    done = subprocess.run(
        ["unshare", "-C", "git", "add", "model.safetensors"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert SERVED not in done.stderr  # not ours: its worker would be in our namespace
    others = [s for s in find_servers([str(servers)]) if s.pid != ours.pid]
    assert len(others) == 1  # it started one of its own, in its namespace
    assert os.readlink(f"/proc/{others[0].pid}/ns/cgroup") != os.readlink("/proc/self/ns/cgroup")


def test_a_silent_client_does_not_hold_up_others(repo: Path, servers: Path) -> None:
    start_server(servers)
    path = str(sock_path(servers))
    silent, half = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        silent.connect(path)  # connects, never sends
        half.connect(path)
        half.sendall((1000).to_bytes(4, "little") + b"2\0")  # a request cut short
        (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=32)))
        began = time.monotonic()
        done = add(repo, "model.safetensors")
        took = time.monotonic() - began
        assert done.returncode == 0, done.stderr
        assert SERVED in done.stderr
        # A server that waited for them would have made the client give up after WAIT
        # seconds (10) and filter by itself.
        assert took < filter_client.WAIT / 2, took
        silent.settimeout(REQUEST_TIME * 5)
        assert silent.recv(1) == b""  # they are dropped after REQUEST_TIME
    finally:
        silent.close()
        half.close()
