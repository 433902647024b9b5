"""``filter.theta.process`` with the warm server on: hand git's pipes to a server, or filter here.

Off by default; ``git theta install --server`` writes this script as the filter. Every git
command that touches a checkpoint starts the filter, and a Python process that has
imported the filter costs ~50 ms before it reads a byte (interpreter start and imports,
on a 2-core VM). This script runs as ``python -I -S filter_client.py`` and imports only
modules that need no site-packages (~10 ms). It passes its stdin, stdout and stderr,
working directory, umask, soft resource limits, CPU affinity and environment over a Unix
socket to ``git_theta.forkserver``, a process that has imported the filter already and
forks a worker to serve this git command, and exits with the worker's exit code.

What a worker cannot take over from its caller (groups, hard limits, nice value, cgroup,
namespaces, privileges, the loader's and the locale's variables: ``attributes()``) it
must share with its server: they are part of the socket's name, so callers that differ
meet different servers, and the server checks them again.

When no server takes the request it becomes the filter itself
(``python -E -P -m git_theta filter-process``), and when none is running, or a stale one
refused, it first starts one for the next command. No server is used off Linux, with
``GIT_THETA_SERVER=0``, or when the socket's directory is not private.

The server gets the socket's path on its command line and imports this module for the
exchange's constants. Exchange, on one connection: the request (length-prefixed, with
the three descriptors); the server answers REFUSED (stale: it exits), DECLINED (it
cannot serve this caller) or, from the forked worker, ACCEPTED and the worker's pid, or
DECLINED when it could not take the caller's limits; the client sends GO, and only then
does the worker touch the descriptors, so a client that gave up waiting and filters by
itself never shares git's pipes with a worker; the worker may then ask the client to
start helpers that may prompt (SPAWN: the client has the terminal), and last sends its
exit code (EXIT). A request of just STATUS gets the server's pid, start time and count
of commands served (``git theta server status``).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal would import enum
import _socket
import os
import resource
import sys
import time

PROTOCOL = b"2"
STATUS = b"status"  # a request of just this: the server answers with its state
ACCEPTED, REFUSED, DECLINED, GO = b"+", b"-", b"=", b"!"
EXIT, SPAWN = b"x", b"s"  # from the worker: its exit code; start a helper here
FDS = (0, 1, 2)
FORWARDED = (2, 1, 3, 15)  # SIGINT, SIGHUP, SIGQUIT, SIGTERM (the same on Linux)
WAIT = 10.0  # seconds a client waits for the server's answer before filtering itself
# interpreter.FLAGS (this script imports nothing of git-theta's): no PYTHON* variable, no
# working directory on sys.path.
PYTHON_FLAGS = ("-E", "-P")
SERVER_COMMAND = ("-m", "git_theta", "filter-server")  # then the socket's path
LIMITS = tuple(sorted({getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")}))
# Variables that act when a program starts (the dynamic loader, malloc, the C library,
# Python's locale; GIT_THETA_KERNELS, read when the server imports the filter), which a
# worker forked from its server cannot take from its caller.
_STARTUP_VARIABLES = (
    b"LD_", b"MALLOC_", b"GLIBC_TUNABLES", b"LANG", b"LC_ALL", b"LC_CTYPE", b"GIT_THETA_KERNELS",
)  # fmt: skip
_STATUS_LINES = (b"Cap", b"NoNewPrivs:", b"Seccomp:")  # privileges and confinement
_LEN = 4  # bytes of the request's length prefix, the pid and the exit code
STARTING = ".starting"  # beside the socket while a server starts (see _may_start)
START_BACKOFF = 10.0
_MAX_PATH = 107  # bytes of a Unix socket's path, without the final NUL


def groups() -> bytes:
    """This process's group and supplementary groups (a worker's are its server's)."""
    return b",".join(b"%d" % g for g in (os.getgid(), *sorted(os.getgroups())))


def _proc_self(name: str) -> bytes:
    try:
        with open("/proc/self/" + name, "rb") as fh:
            return fh.read(1 << 16)
    except OSError:
        return b""


def attributes() -> list[bytes]:
    """What a worker inherits from its server and cannot change to its caller's: groups,
    hard resource limits, nice value, OOM score, cgroups, namespaces, privileges and
    confinement (capabilities, no_new_privs, seccomp, the security label) and the
    start-up variables. Each item free of NUL bytes."""
    status = _proc_self("status").splitlines()
    try:
        spaces = sorted(os.listdir("/proc/self/ns"))
        namespaces = [os.fsencode(os.readlink("/proc/self/ns/" + n)) for n in spaces]
    except OSError:
        namespaces = []
    return [
        groups(),
        b",".join(b"%d" % resource.getrlimit(r)[1] for r in LIMITS),
        b"%d" % os.getpriority(os.PRIO_PROCESS, 0),
        _proc_self("oom_score_adj").strip(),
        _proc_self("cgroup").replace(b"\0", b""),
        _proc_self("attr/current").replace(b"\0", b""),
        b",".join(namespaces),
        b"\n".join(ln for ln in status if ln.startswith(_STATUS_LINES)),
        *sorted(k + b"=" + v for k, v in os.environb.items() if k.startswith(_STARTUP_VARIABLES)),
    ]


def soft_limits() -> bytes:
    """This process's soft resource limits, which a worker takes (-1: unlimited)."""
    return b",".join(b"%d=%d" % (r, resource.getrlimit(r)[0]) for r in LIMITS)


def _key() -> str:
    """Which server this is: one per interpreter, installed copy of git-theta and set of
    ``attributes()``, so that a server can act for every caller it meets."""
    import _blake2  # no OpenSSL, unlike hashlib

    where = [os.fsencode(sys.executable), os.fsencode(os.path.dirname(os.path.abspath(__file__)))]
    return _blake2.blake2b(b"\0".join(where + attributes()), digest_size=8).hexdigest()


def server_dirs() -> list[str]:
    """Where sockets may be, without creating anything: ``GIT_THETA_SERVER_DIR``, else
    both defaults (``$XDG_RUNTIME_DIR`` is not set in every session)."""
    chosen = os.environ.get("GIT_THETA_SERVER_DIR")
    if chosen:
        return [os.path.abspath(chosen)]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    found = [os.path.join(runtime, "git-theta")] if runtime else []
    return [*found, f"/tmp/git-theta-{os.getuid()}"]


def server_dir() -> str | None:
    """The private directory the sockets live in, or None when it is not private.

    ``GIT_THETA_SERVER_DIR``, else ``$XDG_RUNTIME_DIR/git-theta``, else
    ``/tmp/git-theta-UID``. Another user's directory, or one others can enter, is not
    used: whoever owns the socket runs every filter that connects to it.
    """
    base = server_dirs()[0]  # absolute: the server runs in /
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(base)
    except OSError:
        return None
    private = st.st_uid == os.getuid() and st.st_mode & 0o077 == 0
    return base if private and (st.st_mode & 0o170000) == 0o040000 else None


def socket_path(directory: str) -> str:
    return os.path.join(directory, _key() + ".sock")


def ignored_signals() -> list[int]:
    """The forwarded signals this process ignores (nohup, a background job)."""
    return [s for s in FORWARDED if _signal.getsignal(s) == _signal.SIG_IGN]


def _request() -> bytes:
    """What the worker must be like the filter in: NUL-separated fields, length-prefixed."""
    mask = os.umask(0)
    os.umask(mask)
    shared = attributes()
    fields = [
        PROTOCOL,
        os.getcwdb(),
        b"%d" % mask,
        b"%d" % os.getppid(),  # git, whose -q keeps progress quiet
        b",".join(b"%d" % s for s in ignored_signals()),
        soft_limits(),
        b",".join(b"%d" % cpu for cpu in sorted(os.sched_getaffinity(0))),
        b"%d" % len(shared),
        *shared,
        *(k + b"=" + v for k, v in os.environb.items()),
    ]
    body = b"\0".join(fields)
    return len(body).to_bytes(_LEN, "little") + body


def _recv_exact(sock: _socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            break
        data += more
    return data


def _forward_signals(pid: int) -> None:
    """Pass a Ctrl-C (or a kill of this process) on to the worker doing the filtering: it
    runs in the server's session, out of reach of the terminal's signals to git."""

    def forward(signum: int, frame: object) -> None:
        try:  # noqa: SIM105 - contextlib would cost this script 3 ms of imports
            os.kill(pid, signum)
        except OSError:
            pass  # it has finished already

    ignored = ignored_signals()
    for signum in FORWARDED:
        if signum not in ignored:  # ignored ones stay ignored, as the worker has them
            _signal.signal(signum, forward)


def _spawn(sock: _socket.socket, request: bytes) -> None:
    """Start a helper for the worker, here in git's session where the terminal is (git-lfs
    may prompt for credentials), and send the worker its pid and its stdin and stdout.

    Like ``subprocess.Popen``: none of our other descriptors (git's pipes to other filters
    among them), SIGPIPE and SIGXFSZ back to their defaults. ``argv[0]`` is looked up on
    this process's PATH, which is the worker's: it came from here.
    """
    pid, ends, theirs = -1, [], []
    here = os.getcwd()
    try:
        fields = request.split(b"\0")
        cwd, argc = fields[0], int(fields[1])
        argv, rest = fields[2 : 2 + argc], fields[2 + argc :]
        env = dict(e.partition(b"=")[::2] for e in rest[1:]) if rest[0] == b"1" else os.environb
        if cwd:
            os.chdir(cwd)
        stdin_r, stdin_w = os.pipe()  # close-on-exec, but for what is duplicated onto 0, 1
        stdout_r, stdout_w = os.pipe()
        ends, theirs = [stdin_w, stdout_r], [stdin_r, stdout_w]
        actions: list[tuple[int, ...]] = [
            (os.POSIX_SPAWN_DUP2, stdin_r, 0),
            (os.POSIX_SPAWN_DUP2, stdout_w, 1),
        ]
        actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _open_fds() if fd > 2]
        pid = os.posix_spawnp(
            argv[0], argv, env, file_actions=actions, setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ)
        )
    except Exception:  # anything: the worker hears "could not start it"
        pid = -1
    finally:
        os.chdir(here)
    rights = b"".join(fd.to_bytes(4, sys.byteorder) for fd in ends) if pid > 0 else b""
    ancillary = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)] if rights else []
    try:
        sock.sendmsg([SPAWN + pid.to_bytes(_LEN, "little", signed=True)], ancillary)
    finally:
        for fd in ends + theirs:
            os.close(fd)


def _open_fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def _may_start(path: str) -> bool:
    """Claim the start of ``path``'s server: false while another start is under way, or
    failed less than START_BACKOFF seconds ago (its claim stays, so commands run at once,
    or a server that cannot start, do not each spawn one)."""
    claim = path + STARTING
    for _ in range(2):
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - os.stat(claim).st_mtime < START_BACKOFF:
                    return False
                os.unlink(claim)  # an old claim: its start failed; try again
            except OSError:
                return False
        except OSError:
            return False
    return False


def start_server(path: str) -> None:
    """Start a server for ``path`` in the background: its own session, no terminal, none
    of the descriptors git left open (a git-lfs filter's pipes among them)."""
    if not _may_start(path):
        return
    argv = [sys.executable, *PYTHON_FLAGS, *SERVER_COMMAND, path]
    actions: list[tuple[int, ...] | tuple[int, int, str, int, int]] = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _open_fds() if fd > 2]
    try:  # noqa: SIM105 - contextlib would cost this script 3 ms of imports
        os.posix_spawn(
            sys.executable, argv, os.environ, file_actions=actions, setsid=True,
            setsigdef=FORWARDED,
        )  # fmt: skip
    except (OSError, NotImplementedError):
        pass  # no server, then: every command runs the filter itself, as before


def run_here() -> None:
    """Become the filter: nothing has read git's pipes yet. With ``PYTHON_FLAGS``: git
    runs the filter in the work tree, and a cloned repository's json.py must not be
    imported, whatever PYTHONPATH holds."""
    argv = [sys.executable, *PYTHON_FLAGS, "-m", "git_theta", "filter-process"]
    os.execv(sys.executable, argv)


def _handed_over() -> int | None:
    """Hand this command to a server; return its exit code, or None to filter here."""
    if os.environ.get("GIT_THETA_SERVER", "1").strip().lower() in {"", "0", "false", "no", "off"}:
        return None  # off, read as settings.env_flag reads it
    directory = server_dir()
    if directory is None:
        return None
    path = socket_path(directory)
    if len(os.fsencode(path)) > _MAX_PATH:
        return None
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.settimeout(WAIT)
    try:
        sock.connect(path)
    except OSError:  # none running, or it died: start one for the next command
        sock.close()
        start_server(path)
        return None
    peer = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)  # pid, uid, gid
    if int.from_bytes(peer[4:8], sys.byteorder) != os.getuid():
        sock.close()
        return None
    fds = b"".join(fd.to_bytes(4, sys.byteorder) for fd in FDS)
    answer = b""
    try:
        request = _request()
        sent = sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        if sent < len(request):
            sock.sendall(request[sent:])
        answer = sock.recv(1)
        worker = int.from_bytes(_recv_exact(sock, _LEN), "little") if answer == ACCEPTED else 0
        if worker > 0:
            sock.sendall(GO)  # from here on the worker owns git's pipes
            _committed.append(True)
    except OSError:  # timed out, or the server went away: the worker never got GO
        worker = 0
    if worker <= 0:
        sock.close()
        if answer == REFUSED:  # another version of git-theta: replace it for next time
            start_server(path)
        return None
    try:  # the worker has git's pipes now: whatever happens, never filter here as well
        nul = os.open(os.devnull, os.O_RDWR)  # let go of git's pipes, keep 0 and 1 taken
        os.dup2(nul, 0)
        os.dup2(nul, 1)
        os.close(nul)
        _forward_signals(worker)
        sock.settimeout(None)
        code = b""
        while (kind := _recv_exact(sock, 1)) == SPAWN:
            _spawn(sock, _recv_exact(sock, int.from_bytes(_recv_exact(sock, _LEN), "little")))
        if kind == EXIT:
            code = _recv_exact(sock, _LEN)
    except Exception:
        code = b""
    if len(code) != _LEN:
        try:  # noqa: SIM105 - contextlib would cost this script 3 ms of imports
            os.write(2, b"git-theta: the filter server's worker ended without an exit status\n")
        except OSError:
            pass
        return 1
    return int.from_bytes(code, "little", signed=True)


_committed: list[bool] = []  # GO was sent: git's pipes are the worker's, never ours again


def main() -> None:
    if sys.platform != "linux" or not hasattr(os, "fork"):
        run_here()
    try:
        code = _handed_over()
    except Exception:  # anything unforeseen: before GO, git's pipes are still ours
        code = 1 if _committed else None
    if code is None:
        run_here()
    os._exit(code if code is not None else 1)


if __name__ == "__main__":
    main()
