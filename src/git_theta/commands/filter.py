"""git's filter entry points: the long-running process and one-shot clean/smudge."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from git_theta import git
from git_theta.commands.errors import report
from git_theta.hooks import HooksElsewhereError, install_hooks, runs_theta
from git_theta.protocol.filter_process import Handler, Sink, Source, serve
from git_theta.repo import Repo
from git_theta.settings import env_flag

if TYPE_CHECKING:
    from git_theta.updates.base import UpdateType


def _handlers(repo: Repo) -> dict[str, Handler]:
    policies: list[Callable[[str], UpdateType]] = []

    def do_clean(source: Source, sink: Sink, path: str) -> None:
        # git reads the staged manifest (~5 ms) on the other core while the first file's
        # clean imports its modules (~20 ms) here.
        staged = repo.staged_manifest_soon(path)
        try:
            from git_theta import git_parent
            from git_theta.clean import clean
            from git_theta.update_rules import load_policy

            git_parent.in_clean_filter = True  # see git_parent.git_only_looks
            if not policies:  # read once per process, and only when something is added
                policies.append(load_policy(os.getcwd()))
        finally:
            previous = staged()  # waited for even on failure: no zombie git, no open pipe
        clean(source, sink, path, repo.store, previous, update_for=policies[0], known=repo.known)
        _say_fell_back(path)

    skip = env_flag("GIT_THETA_SKIP_SMUDGE")

    def do_smudge(source: Source, sink: Sink, path: str) -> None:
        if skip:  # leave the manifest in the work tree; `git theta checkout` fills it later
            sink.write(source.read())
        else:
            from git_theta.smudge import smudge

            smudge(source, sink, path, repo.store, fetch=repo.fetch)

    return {"clean": do_clean, "smudge": do_smudge}


def _say_fell_back(path: str) -> None:
    """One line for the tensors of ``path`` stored dense although another update type was
    asked for (chains.fell_back), so that forcing a type never silently does less."""
    from git_theta.chains import fell_back
    from git_theta.display import escape

    if not fell_back:
        return
    names = sorted(fell_back)
    fell_back.clear()
    kinds = ", ".join(sorted({key for _, key in names}))
    sys.stderr.write(
        escape(
            f"git-theta: {path}: stored {len(names)} changed tensor(s) dense (e.g. "
            f"{names[0][0]!r}), not {kinds}: a dense value was smaller (most elements "
            "changed) or the type cannot describe the change"
        )
        + "\n"
    )


def for_one_command() -> None:
    """Set this process up to serve one git command and exit (the filter git starts, a
    warm server's worker, git's merge driver; never a process that imports git_theta as
    a library): malloc keeps and reuses what is freed, blocks up to 32 MiB at any size
    (``_planes.keep_freed_memory``; larger ones are mapped and returned on their own), so
    the buffers of tensors found unchanged, or already encoded, are what the next ones are
    read and decoded into. Fresh pages cost a fault and zeroing each. codec's spare
    buffers, which keep a freed buffer for the next of the same size only, would then hold
    memory malloc could hand out at other sizes: they are turned off (codec itself is
    imported later, when the first file arrives)."""
    from git_theta import kernels

    # A kernel built before keep_freed_memory (an editable install not rebuilt) lacks it.
    keep = getattr(kernels.native, "keep_freed_memory", None)
    kernels.malloc_keeps_freed = keep is not None and bool(keep())


def filter_process() -> int:
    """Serve ``filter.theta.process`` for one git command."""

    def on_error(exc: BaseException, path: str) -> None:
        report(exc, path)

    repo = Repo()
    hooks_done = threading.Event()

    def prepare() -> None:
        try:
            install_hooks()  # a fresh clone gets its pre-push hook on its first checkout
        except HooksElsewhereError as exc:
            # Not ours to write (a shared or tracked hooks directory, husky...): said on
            # every command while its pre-push hook does not upload tensor objects, since
            # then every push leaves a repository that cannot be cloned.
            if not runs_theta(os.path.join(git.hooks_dir(), "pre-push")):
                sys.stderr.write(f"git-theta: warning: {exc}\n")
        except Exception as exc:  # a read-only hooks dir must not stop a checkout
            report(exc)
        finally:
            hooks_done.set()
        # Resolving the store early is only a head start: on failure the handler meets
        # the same error and reports it once.
        with contextlib.suppress(Exception):
            repo.store  # noqa: B018 - resolves the store's directory (git calls) early

    # Only work that waits on git (its calls release the GIL) runs here. Importing the
    # codec or clean here as well made a tiny checkout slower (154 -> 128 ms without):
    # git sends the first file right after the handshake, so imports only competed for
    # the GIL with the handler's own. A daemon, so that exiting never waits on it.
    helper = threading.Thread(target=prepare, name="theta-prepare", daemon=True)
    helper.start()
    try:
        return serve(_handlers(repo), on_error)
    finally:
        hooks_done.wait()
        repo.close()


def one_shot(command: str, path: str) -> int:
    """Run one clean or smudge with the file on stdin and the result on stdout."""
    repo = Repo()
    handler = _handlers(repo)[command]
    try:
        handler(cast(Source, sys.stdin.buffer), sys.stdout.buffer, path)
    except Exception as exc:
        return report(exc, path)
    finally:
        repo.close()
    sys.stdout.buffer.flush()
    return 0
