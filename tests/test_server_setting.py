"""The warm filter server is off by default; `install --server` turns it on, and
`git theta server status|stop` shows and stops the running servers."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DIRECT, _kill_servers, git
from st_files import f32, st_from_arrays
from test_forkserver import SERVED, SHAPES, server_argv, sock_path, start_server

from git_theta import filter_client
from git_theta.commands.cli import main
from git_theta.forkserver import find_servers

# One worker runs every test that starts a filter server: two of them touch a module of
# the package to play an upgrade, which makes any server running meanwhile step aside.
pytestmark = pytest.mark.xdist_group("filter-server")

CLIENT = shlex.join([sys.executable, "-I", "-S", filter_client.__file__])


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "servers"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("GIT_THETA_SERVER_DIR", str(path))
    monkeypatch.setenv("GIT_THETA_SERVER_TRACE", "1")
    yield path
    _kill_servers(path)


def process_setting() -> str:
    return git(Path.cwd(), "config", "--global", "filter.theta.process").stdout.decode().strip()


def add(repo: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["git", "add", "model.safetensors"], cwd=repo, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done


def test_install_leaves_the_server_off(repo: Path, servers: Path) -> None:
    assert process_setting() == DIRECT
    for seed in (1, 2):
        (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=seed)))
        assert SERVED not in add(repo).stderr
    assert list(servers.iterdir()) == []  # none was started either
    assert find_servers([str(servers)]) == []


def test_install_server_turns_it_on_and_install_off_again(repo: Path, servers: Path) -> None:
    assert main(["install", "--server"]) == 0
    assert process_setting() == CLIENT
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=3)))
    assert SERVED not in add(repo).stderr  # the first filters itself and starts one
    [started] = find_servers([str(servers)])
    assert started.socket == str(sock_path(servers))
    assert main(["install"]) == 0
    assert process_setting() == DIRECT


def test_status_lists_servers_and_stop_stops_them(
    repo: Path, servers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["server", "status"]) == 0
    assert capsys.readouterr().out == (
        "filter server: off here: git runs the filter itself "
        "(`git theta install --server` turns it on)\n"
        "no filter server is running\n"
    )
    assert main(["install", "--server"]) == 0
    proc = start_server(servers)
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=4)))
    assert f"{SERVED} {proc.pid}" in add(repo).stderr
    capsys.readouterr()
    assert main(["server", "status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "filter server: on here: git's filter hands its work to a server "
        "(`git theta install` turns it off)"
    )
    pattern = (
        rf"pid {proc.pid}  socket {re.escape(str(sock_path(servers)))}  "
        r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d  up (\d+h )?\d+m \d+s  served 1"
    )
    assert len(out) == 2 and re.fullmatch(pattern, out[1]), out

    assert main(["server", "stop"]) == 0
    assert capsys.readouterr().err == (
        f"git-theta: stopped filter server {proc.pid} ({sock_path(servers)})\n"
    )
    assert proc.wait(timeout=20) == 0  # it exited, removing its socket
    assert list(servers.iterdir()) == []
    assert main(["server", "stop"]) == 0
    assert capsys.readouterr().err == "git-theta: no filter server is running\n"


def test_stop_stops_an_older_git_thetas_server_too(servers: Path) -> None:
    # Servers of an earlier git-theta ran as `python -P -m git_theta.forkserver SOCKET`
    # (with the work tree's modules in reach): stop must find those as well.
    code = "import time; print('up', flush=True); time.sleep(600)"
    old = subprocess.Popen(
        [sys.executable, "-c", code, "-m", "git_theta.forkserver",
         str(servers / "0123456789abcdef.sock")],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert old.stdout is not None and old.stdout.readline() == b"up\n"  # it runs
        assert [s.pid for s in find_servers([str(servers)])] == [old.pid]
        assert main(["server", "stop"]) == 0
        assert old.wait(timeout=20) == -15
    finally:
        old.kill()
        old.wait()


def test_a_server_started_by_hand_serves_as_one_the_client_started(
    repo: Path, servers: Path
) -> None:
    assert main(["install", "--server"]) == 0
    proc = subprocess.Popen(server_argv(sock_path(servers)), stdout=subprocess.PIPE, env=os.environ)
    assert proc.stdout is not None
    assert proc.stdout.read() == b""
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=5)))
    assert f"{SERVED} {proc.pid}" in add(repo).stderr
