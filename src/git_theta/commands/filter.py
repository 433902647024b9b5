"""git's filter entry points: the long-running process and one-shot clean/smudge."""

from __future__ import annotations

import importlib
import sys
import threading
from typing import cast

from git_theta.clean import clean
from git_theta.commands.errors import report
from git_theta.protocol.filter_process import Handler, Sink, Source, serve
from git_theta.repo import Repo
from git_theta.smudge import smudge


def _handlers(repo: Repo) -> dict[str, Handler]:
    def do_clean(source: Source, sink: Sink, path: str) -> None:
        clean(source, sink, path, repo.store, repo.staged_manifest(path))

    def do_smudge(source: Source, sink: Sink, path: str) -> None:
        smudge(source, sink, path, repo.store)

    return {"clean": do_clean, "smudge": do_smudge}


def filter_process() -> int:
    """Serve ``filter.theta.process`` for one git command."""

    def on_error(exc: BaseException, path: str) -> None:
        report(exc, path)

    # Import the codec (numpy & co, ~0.15 s) while git starts streaming the first file.
    threading.Thread(target=importlib.import_module, args=("git_theta.codec",), daemon=True).start()
    return serve(_handlers(Repo()), on_error)


def one_shot(command: str, path: str) -> int:
    """Run one clean or smudge with the file on stdin and the result on stdout."""
    handler = _handlers(Repo())[command]
    try:
        handler(cast(Source, sys.stdin.buffer), sys.stdout.buffer, path)
    except Exception as exc:
        return report(exc, path)
    sys.stdout.buffer.flush()
    return 0
