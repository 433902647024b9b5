"""A warm filter: a process that has imported the filter and forks a copy per git command.

Off unless ``git theta install --server`` made ``git_theta.filter_client`` git's filter.
The client connects and passes git's pipes, its working directory, umask, signals, soft
resource limits, CPU affinity and environment; the server forks, and the copy becomes
what ``git-theta filter-process`` would have been after its imports (docs/architecture.md
lists what still differs): it takes all of those, serves git, and sends back its exit
code. The server itself never filters, so every copy starts from the same untouched
state; it is single threaded, so forking is safe.

What a copy cannot take from its caller (``filter_client.attributes()``: groups, hard
limits, nice value, cgroup...) it has from the server, so the server serves only callers
whose attributes equal its own (they are in the socket's name) and declines others. It
reads every request without blocking, so a client that connects and sends nothing, or
half a request, delays no one. It refuses (and exits) when any module it has loaded, any
file of git-theta's package or a directory it loaded modules from changed since it
started (an upgrade); serves only its own user (the socket's directory is private; the
peer's uid is checked too); and exits on SIGTERM (``git theta server stop``), after
``GIT_THETA_SERVER_IDLE`` seconds without a request (default 900), or when its socket is
removed or taken over.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, NamedTuple

import git_theta
from git_theta import git_parent, proc
from git_theta.filter_client import (
    ACCEPTED,
    DECLINED,
    EXIT,
    FDS,
    FORWARDED,
    GO,
    LIMITS,
    PROTOCOL,
    PYTHON_FLAGS,
    REFUSED,
    SERVER_COMMAND,
    SPAWN,
    STARTING,
    STATUS,
    attributes,
)

SERVER_NAME = "git-theta-srv"
IDLE = 900.0  # seconds without a request before the server exits
_CHECK = 5.0  # how often an idle server checks that its socket is still its own
REQUEST_TIME = 2.0  # seconds a client has to send its whole request once connected
_MAX_PENDING = 64  # connections still sending; past this the oldest is dropped
_MAX_REQUEST = 1 << 20  # bytes: a request is mostly the caller's environment
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


def _watched_files() -> list[str]:
    """What an upgrade changes: the file of every module loaded now (what the workers
    run), the directories they came from (an install adds and renames files there), and
    every module file of git-theta's package, loaded or not (a worker may import it)."""
    files = (getattr(module, "__file__", None) for module in list(sys.modules.values()))
    paths = {path for path in files if isinstance(path, str)}
    paths |= {os.path.dirname(path) for path in paths}
    for base, dirs, names in os.walk(os.path.dirname(git_theta.__file__)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        paths.update(os.path.join(base, n) for n in names if n.endswith((".py", ".so")))
    return sorted(paths)


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


class _Pending:
    """A connection whose request has not all arrived yet."""

    def __init__(self, conn: socket.socket, deadline: float):
        self.conn = conn
        self.deadline = deadline
        self.data = b""
        self.fds: list[int] = []

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.conn.close()


class Server:
    def __init__(self, path: str, idle: float = IDLE):
        self.path = path
        self.idle = idle
        self.started = time.time()
        self.served = 0
        self._attributes = attributes()
        self._files = _watched_files()
        self._fingerprint = _fingerprint(self._files)
        self._pending: dict[int, _Pending] = {}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a private name, then renamed over the path: a client never meets a
        # half-made socket, and of two servers started at once the last one wins.
        tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):  # left by a crash under this pid
            os.unlink(tmp)
        self._listener.bind(tmp)
        os.chmod(tmp, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)
        os.rename(tmp, path)
        self._inode = os.stat(path).st_ino

    def _ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def serve(self) -> None:
        """Answer clients until idle, stale, replaced or terminated."""
        last = time.monotonic()
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        try:
            while True:
                now = time.monotonic()
                wait = min([_CHECK, self.idle, *(p.deadline - now for p in self._pending.values())])
                ready = poller.poll(max(wait, 0.0) * 1000)
                _reap()
                if not ready and not self._pending:
                    if time.monotonic() - last > self.idle or not self._ours():
                        return
                    continue
                for fd, _ in ready:
                    if fd == self._listener.fileno():
                        self._accept(poller)
                        continue
                    pending = self._pending.get(fd)
                    if pending is None:
                        continue
                    outcome = self._read(pending)
                    if outcome is None:
                        continue  # more to come
                    poller.unregister(fd)
                    del self._pending[fd]
                    pending.close()
                    if outcome == "stale":
                        return
                    if outcome == "served":  # not a declined caller: none keeps us alive
                        last = time.monotonic()
                now = time.monotonic()
                for fd, pending in list(self._pending.items()):
                    if pending.deadline <= now:  # silent or slow: it must not hold anyone up
                        poller.unregister(fd)
                        del self._pending[fd]
                        pending.close()
        finally:
            if self._ours():
                os.unlink(self.path)
            self._listener.close()
            for pending in self._pending.values():
                pending.close()

    def _accept(self, poller: select.poll) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, say: try again on the next wake-up
                return
            try:
                peer = _PEERCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                )
            except OSError:
                conn.close()
                continue
            if peer[1] != os.getuid():
                conn.close()
                continue
            conn.setblocking(False)
            if len(self._pending) >= _MAX_PENDING:
                oldest = min(self._pending, key=lambda fd: self._pending[fd].deadline)
                poller.unregister(oldest)
                self._pending.pop(oldest).close()
            self._pending[conn.fileno()] = _Pending(conn, time.monotonic() + REQUEST_TIME)
            poller.register(conn, select.POLLIN)

    def _read(self, pending: _Pending) -> str | None:
        """Take what has arrived; once the request is whole, answer it. Return None while
        it is incomplete, else "served", "stale" (this server must stop) or "ignored"."""
        try:
            data, ancillary, flags, _ = pending.conn.recvmsg(
                1 << 16, socket.CMSG_SPACE(4 * len(FDS)), socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return "ignored"
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                pending.fds += struct.unpack(f"{usable // 4}i", payload[:usable])
        if not data or flags & socket.MSG_CTRUNC:
            return "ignored"
        pending.data += data
        if len(pending.data) < 4:
            return None
        size = int.from_bytes(pending.data[:4], "little")
        if size > _MAX_REQUEST or len(pending.data) > 4 + size:
            return "ignored"
        if len(pending.data) < 4 + size:
            return None
        try:
            return self._answer(pending.conn, pending.fds, pending.data[4:].split(b"\0"))
        except Exception:  # a client that breaks off or sends nonsense; serve the next
            return "ignored"

    def _answer(self, conn: socket.socket, fds: list[int], fields: list[bytes]) -> str:
        """Answer a whole request (answers are a few bytes on an empty socket buffer, so
        sending them never blocks): "served", "stale" or "ignored"."""
        if fields == [STATUS]:
            conn.send(b"%d %d %.3f" % (os.getpid(), self.served, self.started))
            return "ignored"
        stale = fields[0] != PROTOCOL or _fingerprint(self._files) != self._fingerprint
        if stale or attributes() != self._attributes:  # an upgrade; or moved, reniced...
            conn.send(REFUSED)
            return "stale"
        if len(fds) != len(FDS) or len(fields) < 8:
            return "ignored"
        count = int(fields[7])
        if fields[8 : 8 + count] != self._attributes:
            conn.send(DECLINED)  # a worker of ours could not act as this caller
            return "ignored"
        try:
            pid = os.fork()
        except OSError:
            conn.send(DECLINED)
            return "ignored"
        if pid == 0:
            try:
                self._listener.close()
                for other in self._pending.values():  # other clients' pipes are not ours
                    if other.conn is not conn:
                        other.close()
                conn.setblocking(True)
                _child(conn, fds, fields[:7], fields[8 + count :])  # never returns
            finally:
                os._exit(1)
        self.served += 1
        return "served"


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


def _take_limits(soft: bytes, affinity: bytes) -> None:
    """Take the caller's soft resource limits and CPU affinity (the hard limits are ours
    already: they are among the attributes we share). Raises OSError or ValueError when
    one cannot be taken."""
    limits = dict(item.split(b"=") for item in soft.split(b",") if item)
    if sorted(int(r) for r in limits) != sorted(LIMITS):
        raise ValueError("another set of resource limits")
    for r, value in limits.items():
        hard = resource.getrlimit(int(r))[1]
        resource.setrlimit(int(r), (int(value), hard))
    os.sched_setaffinity(0, {int(cpu) for cpu in affinity.split(b",") if cpu})


def _child(conn: socket.socket, fds: list[int], fields: list[bytes], env: list[bytes]) -> None:
    """Become the filter for the client's git command, then exit with its code."""
    code = 1
    try:
        _, cwd, umask, git_pid, ignored, soft, affinity = fields
        try:
            _take_limits(soft, affinity)
        except (OSError, ValueError):
            conn.sendall(DECLINED)  # it filters by itself, as it would without us
            os._exit(0)
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
        git_parent.git_pid = int(git_pid)
        proc.spawner = _Caller(conn).start
        # Fresh streams on the new descriptors, buffered as a filter's own would be.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")  # noqa: SIM115
        if os.environ.get("GIT_THETA_SERVER_TRACE") == "1":
            sys.stderr.write(f"git-theta: served by filter server {os.getppid()}\n")
        from git_theta.commands.cli import filter_process_command

        code = filter_process_command(for_one_command=True)
    except BaseException:  # a copy must never return into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        try:
            conn.sendall(EXIT + code.to_bytes(4, "little", signed=True))
        finally:
            os._exit(code)


class Running(NamedTuple):
    """A running server of this user's: its pid, socket and start (seconds since the epoch)."""

    pid: int
    socket: str
    started: float


def _started(pid: int) -> float:
    """When process ``pid`` started, in seconds since the epoch (0.0 when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            ticks = int(fh.read().rpartition(b")")[2].split()[19])
        with open("/proc/stat", "rb") as fh:
            boot = next(int(ln.split()[1]) for ln in fh if ln.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _server_socket(argv: list[bytes]) -> bytes | None:
    """The socket of a server's command line (an older git-theta's too), else None."""
    ours = [a.encode() for a in (*PYTHON_FLAGS, *SERVER_COMMAND)]
    if len(argv) >= len(ours) + 2 and argv[1:-1] == ours:
        return argv[-1]
    if len(argv) >= 4 and argv[-3:-1] == [b"-m", b"git_theta.forkserver"]:  # before 0.2
        return argv[-1]
    return None


def find_servers(directories: list[str]) -> list[Running]:
    """The servers of this user whose sockets are in one of ``directories`` (Linux)."""
    where = {os.fsencode(os.path.abspath(d)) for d in directories}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")[:-1]
        except OSError:
            continue
        sock = _server_socket(argv)
        if sock is not None and os.path.dirname(sock) in where:
            pid = int(entry.name)
            found.append(Running(pid, os.fsdecode(sock), _started(pid)))
    return sorted(found)


def running_servers(directory: str) -> list[int]:
    """The pids of the servers whose sockets are in ``directory`` (Linux)."""
    return [server.pid for server in find_servers([directory])]


def served(path: str, timeout: float = 1.0) -> int | None:
    """How many commands the server on socket ``path`` has served, or None if it does
    not answer within ``timeout`` seconds."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(len(STATUS).to_bytes(4, "little") + STATUS)
            return int(sock.recv(256).split()[1])
    except (OSError, ValueError, IndexError):
        return None


def stop_servers(directory: str) -> int:
    """Terminate the servers whose sockets are in ``directory``; return how many."""
    return len(stop(find_servers([directory])))


def stop(servers: list[Running], timeout: float = 5.0) -> list[Running]:
    """Terminate ``servers`` and wait up to ``timeout`` seconds for each to exit (killing
    one that does not); return those that were running."""
    stopped = []
    for server in servers:
        try:
            handle = os.pidfd_open(server.pid)
        except OSError:
            continue  # gone already
        try:
            if _started(server.pid) != server.started:
                continue  # another process has its pid by now
            signal.pidfd_send_signal(handle, signal.SIGTERM)  # this process, whatever its pid
            stopped.append(server)
            if not select.select([handle], [], [], timeout)[0]:
                signal.pidfd_send_signal(handle, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(handle)
    return stopped


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(0)  # serve() removes the socket on its way out


def main(argv: list[str]) -> int:
    """Run a server on socket ``argv[0]`` until it is idle or stopped; return 0, or 1
    when it could not start."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m git_theta filter-server SOCKET\n")
        return 2
    # Nothing git left open (a git-lfs filter's pipes: git would wait for their end).
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir("/")  # hold no repository's directory
    _name(SERVER_NAME)
    signal.signal(signal.SIGTERM, _terminated)
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
    # Listening: whoever started us with a pipe as stdout may wait for its end.
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
    server.serve()
    return 0
