"""A warm filter: a process that has imported the filter and forks a copy per git command.

``git_theta.filter_client`` (what git runs) connects, passes git's pipes, its working
directory, umask, signals and environment; the server forks, and the copy becomes what
``git-theta filter-process`` would have been after its imports (docs/architecture.md
lists what still differs): it takes all of those, serves git, and sends back its exit
code. The server itself never filters, so every copy starts from the same untouched
state; it is single threaded, so forking is safe.

It refuses (and exits) when any module it has loaded changed on disk since it started
(an upgrade), serves only its own user (the socket's directory is private; the peer's uid
is checked too), and exits after ``GIT_THETA_SERVER_IDLE`` seconds without a request
(default 900) or when its socket is removed or taken over.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO

from git_theta import proc, progress
from git_theta.filter_client import (
    ACCEPTED,
    DECLINED,
    EXIT,
    FDS,
    FORWARDED,
    GO,
    PATH_VARIABLES,
    PROTOCOL,
    REFUSED,
    SPAWN,
    STARTING,
    WAIT,
    groups,
)

SERVER_NAME = "git-theta-srv"
IDLE = 900.0  # seconds without a request before the server exits
_CHECK = 5.0  # how often an idle server checks that its socket is still its own
_PEERCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def _warm() -> None:
    """Import what adds and checkouts of safetensors files use (not NumPy: it is large, and
    only low-rank adds and a few formats load it)."""
    import zstandard  # noqa: F401

    import git_theta.chains
    import git_theta.clean
    import git_theta.commands.cli
    import git_theta.commands.filter
    import git_theta.formats.safetensors
    import git_theta.smudge
    import git_theta.update_rules
    import git_theta.updates.auto
    import git_theta.updates.delta
    import git_theta.updates.sparse  # noqa: F401


def _loaded_files() -> list[str]:
    """The files of every module loaded now (what the workers run)."""
    files = (getattr(module, "__file__", None) for module in list(sys.modules.values()))
    return sorted({path for path in files if isinstance(path, str)})


def _fingerprint(paths: list[str]) -> list[tuple[int, int]]:
    """(mtime, size) of each file: what an upgrade changes."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append((-1, -1))
        else:
            out.append((st.st_mtime_ns, st.st_size))
    return out


class Server:
    def __init__(self, path: str, idle: float = IDLE):
        self.path = path
        self.idle = idle
        self._files = _loaded_files()
        self._python_env = {key: os.environb.get(key) for key in PATH_VARIABLES}
        self._fingerprint = _fingerprint(self._files)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a private name, then renamed over the path: a client never meets a
        # half-made socket, and of two servers started at once the last one wins.
        tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):  # left by a crash under this pid
            os.unlink(tmp)
        self._listener.bind(tmp)
        os.chmod(tmp, 0o600)
        self._listener.listen(64)
        os.rename(tmp, path)
        self._inode = os.stat(path).st_ino

    def _ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def serve(self) -> None:
        last = time.monotonic()
        try:
            while True:
                ready, _, _ = select.select([self._listener], [], [], min(_CHECK, self.idle))
                _reap()
                if not ready:
                    if time.monotonic() - last > self.idle or not self._ours():
                        return
                    continue
                conn, _ = self._listener.accept()
                outcome = self._handle(conn)
                if outcome == "stale":
                    return
                if outcome == "served":  # not a declined caller: that keeps no server alive
                    last = time.monotonic()
        finally:
            if self._ours():
                os.unlink(self.path)
            self._listener.close()

    def _handle(self, conn: socket.socket) -> str:
        """Serve one client: "served", "stale" (this server must stop) or "ignored"."""
        fds: list[int] = []
        try:
            peer = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            if peer[1] != os.getuid():
                return "ignored"
            conn.settimeout(WAIT)  # a client stuck mid-request must not stall the rest
            data, ancillary, _, _ = conn.recvmsg(
                1 << 16, socket.CMSG_SPACE(4 * len(FDS)), socket.MSG_CMSG_CLOEXEC
            )
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % 4
                    fds += struct.unpack(f"{usable // 4}i", payload[:usable])
            while data and (len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little")):
                more = conn.recv(1 << 16)
                if not more:
                    return "ignored"
                data += more
            if len(fds) != len(FDS) or len(data) != 4 + int.from_bytes(data[:4], "little"):
                return "ignored"
            fields = data[4:].split(b"\0")
            if fields[0] != PROTOCOL or _fingerprint(self._files) != self._fingerprint:
                conn.sendall(REFUSED)  # another version of git-theta: make way
                return "stale"
            if len(fields) < 6 or not self._like_us(fields[5], fields[6:]):
                conn.sendall(DECLINED)
                return "ignored"
            try:
                pid = os.fork()
            except OSError:
                conn.sendall(DECLINED)
                return "ignored"
            if pid == 0:
                try:
                    self._listener.close()
                    _child(conn, fds, fields)  # never returns
                finally:
                    os._exit(1)
            return "served"
        except Exception:  # a client that breaks off or sends nonsense; serve the next
            return "ignored"
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            conn.close()

    def _like_us(self, theirs_groups: bytes, env: list[bytes]) -> bool:
        """Whether a worker of ours can act for this caller: the same groups (a worker's
        files and permissions are the server's), the same module search path."""
        theirs = dict(entry.partition(b"=")[::2] for entry in env if b"=" in entry)
        return theirs_groups == groups() and all(
            theirs.get(key) == self._python_env.get(key) for key in PATH_VARIABLES
        )


def _name(name: str) -> None:
    """Set the process name ps and top show (Linux; 15 characters at most)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as fh:
        fh.write(name)


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


class _Started:
    """A helper the client started for us: not our child, so it is done when its output
    ends (the callers close its input first), and its exit status is the client's to
    collect: ``wait`` returns 0. The one caller, the downloader, checks the objects."""

    def __init__(self, stdin: int, stdout: int):
        self.stdin: IO[bytes] | None = os.fdopen(stdin, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(stdout, "rb")

    def wait(self) -> int:
        assert self.stdout is not None
        while self.stdout.read(1 << 16):
            pass
        self.stdout.close()
        return 0


class _Caller:
    """Has the client start the helpers that may prompt: it is in git's session, with the
    terminal; a worker is in the server's, without one."""

    def __init__(self, conn: socket.socket):
        self._conn = conn
        self._lock = threading.Lock()

    def start(
        self, argv: tuple[str, ...], cwd: str | None, env: Mapping[str, str] | None
    ) -> proc.Helper:
        fields = [os.fsencode(cwd or ""), b"%d" % len(argv), *map(os.fsencode, argv)]
        if env is None:
            fields.append(b"0")
        else:
            fields += [b"1", *(os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items())]
        body = b"\0".join(fields)
        with self._lock:
            self._conn.sendall(SPAWN + len(body).to_bytes(4, "little") + body)
            data, ancillary, _, _ = self._conn.recvmsg(
                5, socket.CMSG_SPACE(8), socket.MSG_CMSG_CLOEXEC
            )
            while 0 < len(data) < 5:
                more = self._conn.recv(5 - len(data))
                if not more:
                    break
                data += more
        fds = [
            fd
            for level, kind, payload in ancillary
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4])
        ]
        if len(data) != 5 or data[:1] != SPAWN or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise proc.not_found(argv)  # the client could not start it
        return _Started(fds[0], fds[1])


def _child(conn: socket.socket, fds: list[int], fields: list[bytes]) -> None:
    """Become the filter for the client's git command, then exit with its code."""
    code = 1
    try:
        conn.sendall(ACCEPTED + os.getpid().to_bytes(4, "little"))
        # No timeout: a client that gives up closes the connection, and that ends us here.
        conn.settimeout(None)
        if conn.recv(1) != GO:  # the client gave up waiting and filters by itself
            os._exit(0)
        _name("git-theta")  # what git's own filter process would be called
        for target, fd in zip(FDS, fds, strict=True):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        _, cwd, umask, git_pid, ignored, _, *env = fields
        os.chdir(cwd)
        os.umask(int(umask))
        skip = {int(s) for s in ignored.split(b",") if s}
        for signum in FORWARDED:  # as the filter would have them: the caller's, not ours
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, signal.SIG_IGN if signum in skip else default)
        os.environb.clear()
        for entry in env:
            key, sep, value = entry.partition(b"=")
            if sep and key:
                os.environb[key] = value
        progress.git_pid = int(git_pid)
        proc.spawner = _Caller(conn).start
        # Fresh streams on the new descriptors, buffered as a filter's own would be.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")  # noqa: SIM115
        if os.environ.get("GIT_THETA_SERVER_TRACE") == "1":
            sys.stderr.write(f"git-theta: served by filter server {os.getppid()}\n")
        from git_theta.commands.cli import filter_process_command

        code = filter_process_command()
    except BaseException:  # a copy must never return into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        try:
            conn.sendall(EXIT + code.to_bytes(4, "little", signed=True))
        finally:
            os._exit(code)


def running_servers(directory: str) -> list[int]:
    """The pids of the servers whose sockets are in ``directory`` (Linux)."""
    pids = []
    where = os.fsencode(os.path.abspath(directory)) + b"/"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"git_theta.forkserver" in argv and argv[-2].startswith(where):
            pids.append(int(entry.name))
    return pids


def stop_servers(directory: str) -> int:
    """Terminate the servers whose sockets are in ``directory``; return how many."""
    stopped = 0
    for pid in running_servers(directory):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            stopped += 1
    return stopped


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m git_theta.forkserver SOCKET\n")
        return 2
    # Nothing git left open (a git-lfs filter's pipes: git would wait for their end).
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir("/")  # hold no repository's directory
    _name(SERVER_NAME)
    try:
        idle = float(os.environ.get("GIT_THETA_SERVER_IDLE") or IDLE)
    except ValueError:
        idle = IDLE
    if not 0 <= idle < float("inf"):
        idle = IDLE
    _warm()
    # Everything imported so far lives as long as the server: out of the collector's
    # sight, a worker's collections neither walk nor write to it (a tiny checkout's
    # worker: ~20 -> ~13 ms of CPU).
    gc.freeze()
    try:
        server = Server(argv[0], idle)
    except OSError as exc:  # the claim stays: no new start for a while
        sys.stderr.write(f"git-theta: filter server: {exc}\n")
        return 1
    with contextlib.suppress(FileNotFoundError):  # started: the next may claim a start
        os.unlink(argv[0] + STARTING)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
