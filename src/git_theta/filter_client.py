"""What git runs as ``filter.theta.process``: hand git's pipes to a warm server, or filter here.

Every git command that touches a checkpoint starts the filter, and a Python process that
has imported the filter costs ~50 ms before it reads a byte (interpreter start and
imports, on a 2-core VM). This script runs as ``python -I -S filter_client.py`` and
imports only modules built into the interpreter (~10 ms). It passes its stdin, stdout and
stderr, working directory and environment over a Unix socket to ``git_theta.forkserver``,
a process that has imported the filter already and forks a copy of itself to serve this
git command, and exits with that copy's exit code.

With no server to take the request (none running, another version's, a socket directory
that is not private, no fork on this platform, ``GIT_THETA_SERVER=0``), it starts one for
the next command and becomes the filter itself: ``python -m git_theta filter-process``.

Nothing from git_theta is imported here: ``-S`` leaves site-packages off the path. The
server imports this module for the socket's location, so both sides agree on it.
"""

from __future__ import annotations

import _socket
import os
import sys

ACCEPTED, REFUSED = b"+", b"-"  # the server's first reply: it serves, or it is stale
FDS = (0, 1, 2)
_LEN = 4  # bytes of the request's length prefix and of the exit code (little-endian)


def _key() -> str:
    """Which server this is: one per interpreter and installed copy of git-theta."""
    import _blake2  # in the interpreter itself; hashlib would load OpenSSL

    where = f"{sys.executable}\0{os.path.dirname(os.path.abspath(__file__))}"
    return _blake2.blake2b(where.encode(errors="surrogateescape"), digest_size=8).hexdigest()


def server_dir() -> str | None:
    """The private directory the sockets live in, or None when it is not private.

    ``GIT_THETA_SERVER_DIR``, else ``$XDG_RUNTIME_DIR/git-theta``, else
    ``/tmp/git-theta-UID``. Another user's directory, or one others can enter, is not
    used: whoever owns the socket runs every filter that connects to it.
    """
    base = os.environ.get("GIT_THETA_SERVER_DIR")
    if not base:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(runtime, "git-theta") if runtime else f"/tmp/git-theta-{os.getuid()}"
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


def _request() -> bytes:
    """Working directory, then the environment, NUL-separated, behind a length prefix."""
    parts = [os.getcwdb(), *(k + b"=" + v for k, v in os.environb.items())]
    body = b"\0".join(parts)
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
    import _signal  # type: ignore[import-not-found]  # built in; signal would import enum

    def forward(signum: int, frame: object) -> None:
        try:  # noqa: SIM105 - contextlib would cost this script 3 ms of imports
            os.kill(pid, signum)
        except OSError:
            pass  # it has finished already

    for signum in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT):
        _signal.signal(signum, forward)


def start_server(path: str) -> None:
    """Start a server for ``path`` in the background (its own session, no terminal)."""
    argv = [sys.executable, "-m", "git_theta.forkserver", path]
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:  # noqa: SIM105 - contextlib would cost this script 3 ms of imports
        os.posix_spawn(sys.executable, argv, os.environ, file_actions=actions, setsid=True)
    except OSError:
        pass  # no server, then: every command runs the filter itself, as before


def run_here() -> None:
    """Become the filter: nothing has read git's pipes yet."""
    os.execv(sys.executable, [sys.executable, "-m", "git_theta", "filter-process"])


def main() -> None:
    # Off as settings.env_flag reads it; any other value leaves the server on.
    off = os.environ.get("GIT_THETA_SERVER", "1").strip().lower() in {"", "0", "false", "no", "off"}
    if off or not hasattr(os, "fork"):
        run_here()
        return
    directory = server_dir()
    if directory is None:
        run_here()
        return
    path = socket_path(directory)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # none running, or it died: start one for the next command
        sock.close()
        start_server(path)
        run_here()
        return
    fds = b"".join(fd.to_bytes(4, sys.byteorder) for fd in FDS)
    try:
        request = _request()
        sent = sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        if sent < len(request):
            sock.sendall(request[sent:])
        answer = sock.recv(1)
    except OSError:
        answer = b""
    if answer != ACCEPTED:
        sock.close()
        if answer == REFUSED:  # another version of git-theta: replace it for next time
            start_server(path)
        run_here()
        return
    # The server's copy holds git's pipes now; ours must not keep them open.
    os.close(0)
    os.close(1)
    worker = int.from_bytes(_recv_exact(sock, _LEN) or b"\0", "little")
    if worker > 0:
        _forward_signals(worker)
    code = _recv_exact(sock, _LEN)
    if len(code) != _LEN:
        os.write(2, b"git-theta: the filter server's worker ended without an exit status\n")
        os._exit(1)
    os._exit(int.from_bytes(code, "little", signed=True))


if __name__ == "__main__":
    main()
