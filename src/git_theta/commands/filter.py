"""git's filter entry points: the long-running process and one-shot clean/smudge."""

from __future__ import annotations

import sys

from git_theta.clean import clean
from git_theta.commands.errors import report
from git_theta.protocol.filter_process import Sink, Source, serve
from git_theta.repo import Repo
from git_theta.smudge import smudge


def _handlers(repo: Repo) -> dict[str, object]:
    def do_clean(source: Source, sink: Sink, path: str) -> None:
        clean(source, sink, path, repo.store, repo.staged_manifest(path))

    def do_smudge(source: Source, sink: Sink, path: str) -> None:
        smudge(source, sink, path, repo.store)

    return {"clean": do_clean, "smudge": do_smudge}


def filter_process() -> int:
    """Serve ``filter.theta.process`` for one git command."""
    repo = Repo()
    handlers = _handlers(repo)

    def on_error(exc: BaseException, path: str) -> None:
        report(exc, path)

    return serve(handlers, on_error)  # type: ignore[arg-type]


class _StdinSource:
    def __init__(self) -> None:
        self._raw = sys.stdin.buffer

    def read(self, n: int = -1, /) -> bytes:
        return self._raw.read(n)

    def readinto(self, out: memoryview, /) -> int:
        return self._raw.readinto(out)


def one_shot(command: str, path: str) -> int:
    """Run one clean or smudge with the file on stdin and the result on stdout."""
    repo = Repo()
    handler = _handlers(repo)[command]
    out = sys.stdout.buffer
    handler(_StdinSource(), out, path)  # type: ignore[operator]
    out.flush()
    return 0
