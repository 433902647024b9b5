"""A real Git LFS server (giftless, local storage) on 127.0.0.1 for remote tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
