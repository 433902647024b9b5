"""``git theta server status|stop``: the warm filter servers of this user.

The server is off unless ``git theta install --server`` made its client git's filter.
Both subcommands look at the servers whose sockets are in the directories clients use
(``GIT_THETA_SERVER_DIR``, else ``$XDG_RUNTIME_DIR/git-theta`` and
``/tmp/git-theta-UID``), older git-theta's servers included.
"""

from __future__ import annotations

import sys
import time

from git_theta import filter_client, forkserver
from git_theta.proc import run


def _uptime(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h " if hours else "") + f"{rest // 60}m {rest % 60}s"


def _configured() -> str:
    done = run("git", "config", "--get", "filter.theta.process", check=False)
    value = done.stdout.decode(errors="replace").strip()
    if not value:
        return "git-theta's filter is not configured here (`git theta install`)"
    if filter_client.__file__ in value or "filter_client" in value:
        return "on here: git's filter hands its work to a server (`git theta install` turns it off)"
    return "off here: git runs the filter itself (`git theta install --server` turns it on)"


def status() -> int:
    """Print whether git's filter here uses the server and every running server (pid,
    socket, start, uptime, commands served); return 0."""
    out = [f"filter server: {_configured()}"]
    servers = forkserver.find_servers(filter_client.server_dirs())
    now = time.time()
    for server in servers:
        count = forkserver.served(server.socket)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(server.started))
        out.append(
            f"pid {server.pid}  socket {server.socket}  started {started}  "
            f"up {_uptime(now - server.started)}  served " + ("?" if count is None else str(count))
        )
    if not servers:
        out.append("no filter server is running")
    sys.stdout.write("".join(line + "\n" for line in out))
    return 0


def stop() -> int:
    """Stop every running server (each exits, removing its socket); return 0."""
    stopped = forkserver.stop(forkserver.find_servers(filter_client.server_dirs()))
    for server in stopped:
        sys.stderr.write(f"git-theta: stopped filter server {server.pid} ({server.socket})\n")
    if not stopped:
        sys.stderr.write("git-theta: no filter server is running\n")
    return 0
