"""A real Git LFS server (giftless, local storage) on 127.0.0.1 for remote tests."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

CONFIG = """AUTH_PROVIDERS:
  - giftless.auth.allow_anon:read_write
TRANSFER_ADAPTERS:
  basic:
    factory: giftless.transfer.basic_streaming:factory
    options:
      storage_class: giftless.storage.local_storage:LocalStorage
      storage_options:
        path: {storage}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LfsServer:
    """Starts giftless under flask; ``stop`` and ``start`` keep the same storage and port."""

    def __init__(self, root: Path):
        self.root = root
        self.storage = root / "storage"
        self.port = free_port()
        self.config = root / "giftless.yaml"
        self.config.write_text(CONFIG.format(storage=self.storage))
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, repo: str) -> str:
        return f"http://127.0.0.1:{self.port}/theta/{repo}.git/info/lfs"

    def start(self) -> None:
        env = {**os.environ, "GIFTLESS_CONFIG_FILE": str(self.config)}
        flask = [sys.executable, "-m", "flask", "--app", "giftless.app:init_app", "run"]
        self.proc = subprocess.Popen(
            [*flask, "--host", "127.0.0.1", "--port", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "server.log", "ab"),  # noqa: SIM115 - lives with the server
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=1)
            except urllib.error.HTTPError:
                return  # the server answered (404 for /): it is up
            except OSError:
                time.sleep(0.1)
            else:
                return
        raise RuntimeError(f"giftless did not start: {(self.root / 'server.log').read_text()}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def objects(self) -> set[str]:
        return {p.name for p in self.storage.rglob("*") if p.is_file()}


class CuttingProxy:
    """A TCP proxy in front of the LFS server that goes down after forwarding ``cut_after``
    bytes from clients: every open connection is reset and new ones are refused, as when
    the server dies in the middle of an upload. ``start`` again to serve normally."""

    def __init__(self, target_port: int, cut_after: int | None = None):
        self.target_port = target_port
        self.cut_after = cut_after
        self.port = free_port()
        self.sent = 0  # bytes forwarded from clients to the server
        self.cut = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None

    def url(self, repo: str) -> str:
        return f"http://127.0.0.1:{self.port}/theta/{repo}.git/info/lfs"

    def start(self, cut_after: int | None = None) -> None:
        self.cut_after, self.sent = cut_after, 0
        self.cut.clear()
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    # SO_LINGER 0: close with a reset, like a process that was killed.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upload: bool) -> None:
        try:
            while data := src.recv(65536):
                if upload:
                    with self._lock:
                        self.sent += len(data)
                        over = self.cut_after is not None and self.sent > self.cut_after
                    if over:
                        self.cut.set()
                        self.stop()
                        return
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
