"""A Hugging Face ``transformers`` TrainerCallback that commits every checkpoint save.

    from git_theta.integrations.transformers import GitThetaCallback
    trainer = Trainer(..., callbacks=[GitThetaCallback()])

On each save the checkpoint directory (``checkpoint-STEP/``: ``model.safetensors`` or the
sharded ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``, and
the JSON files beside them) is staged and committed with the step and the latest metrics
in the message. The weights are cleaned in this process against the previous checkpoint's
tensors, wherever they were (each save is a new directory, and save_pretrained moves
tensors between shards), so a changed tensor is stored as an update on its previous value
and an unchanged one costs nothing. ``*.safetensors`` is tracked with git-theta first if
it is not. The commit is of the index, as ``git commit`` makes it.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from git_theta.manifest import Manifest

_SKIP_METRICS = frozenset({"step", "epoch", "total_flos"})


class GitThetaCallback(TrainerCallback):
    """Commit each checkpoint the Trainer saves.

    ``repo``: the repository (default: the one holding ``args.output_dir``). ``include``:
    globs of the checkpoint's other files to commit (plain git; default the JSON files;
    add ``"*.pt"`` for the optimizer state, tracked by git-theta if ``track`` matches it).
    ``message``: a template with ``{step}``, ``{epoch}`` and ``{metrics}``. ``tag``: a
    template for a tag per save (``"step-{step}"``), none by default. ``update_type``:
    how changed tensors are stored (default: what ``git add`` would use).
    """

    def __init__(
        self,
        repo: str | os.PathLike[str] | None = None,
        *,
        include: Sequence[str] = ("*.json",),
        track: Sequence[str] = ("*.safetensors",),
        message: str = "checkpoint step {step}: {metrics}",
        tag: str | None = None,
        update_type: str | None = None,
    ) -> None:
        self.repo = None if repo is None else os.fspath(repo)
        self.include = tuple(include)
        self.track = tuple(track)
        self.message = message
        self.tag = tag
        self.update_type = update_type
        self.commits: list[str] = []  # every commit made, oldest first
        self._previous: Manifest | None = None

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        directory = os.path.join(args.output_dir or ".", f"checkpoint-{state.global_step}")
        if os.path.isdir(directory):
            self.commit_checkpoint(directory, state.global_step, state.epoch, state.log_history)

    def commit_checkpoint(
        self,
        directory: str | os.PathLike[str],
        step: int,
        epoch: float | None = None,
        log_history: Sequence[dict[str, Any]] = (),
    ) -> str:
        """Stage and commit the checkpoint in ``directory``; return the commit id."""
        from git_theta.api import _stage

        directory = os.path.abspath(os.fspath(directory))
        names = sorted(os.listdir(directory))
        weights = [n for n in names if any(fnmatch.fnmatch(n, p) for p in self.track)]
        others = [n for n in names if n not in weights and self._included(n)]
        if not weights:
            from git_theta.errors import UsageError

            raise UsageError(f"{directory}: no weights ({', '.join(self.track)}) to commit")
        first = _stage.Where(self.repo or directory, os.path.join(directory, weights[0]))
        self._ensure_tracked(first)
        tag = None if self.tag is None else self.tag.format(step=step, epoch=epoch)
        if tag is not None:
            _stage.check_tag(first.top, tag)  # before anything is staged
        staged: list[Manifest] = []
        for name in weights:
            where = _stage.Where(first.top, os.path.join(directory, name))
            staged.append(self._stage_weights(where))
        if staged:
            self._previous = _merged(staged)
        from git_theta.proc import run

        if others:
            rel = [os.path.relpath(os.path.join(directory, n), first.top) for n in others]
            run("git", "add", "--", *rel, cwd=first.top)
        # Checkpoints the Trainer rotated away (save_total_limit) leave the tip's tree; the
        # commits that saved them keep them.
        gone = _removed(first.top, os.path.relpath(os.path.dirname(directory), first.top))
        if gone:
            run("git", "rm", "-q", "--cached", "--", *gone, cwd=first.top)
        metrics = _metrics(log_history, step)
        text = self.message.format(step=step, epoch=epoch, metrics=metrics or "no metrics yet")
        commit = _stage.commit(first.top, text)
        if tag is not None:
            _stage.tag(first.top, tag, commit)
        self.commits.append(commit)
        return commit

    def _included(self, name: str) -> bool:
        return any(fnmatch.fnmatch(name, pattern) for pattern in self.include)

    def _ensure_tracked(self, where: Any) -> None:
        """Track the weight patterns at the repository's top, as ``git theta track``."""
        from git_theta.api import _stage

        if _stage.is_tracked(where):
            _stage.require_tracked(where)
            return
        from git_theta.commands.track import ATTRIBUTES_CAP, update_attributes
        from git_theta.files import atomic_write, read_capped
        from git_theta.proc import run
        from git_theta.setup_check import require_filter

        require_filter(where.top)
        path = os.path.join(where.top, ".gitattributes")
        try:
            text = read_capped(path, ATTRIBUTES_CAP).decode()
        except FileNotFoundError:
            text = ""
        for pattern in self.track:
            text = update_attributes(text, pattern)
        atomic_write(path, text.encode(), within=where.top)
        run("git", "add", "--", ".gitattributes", cwd=where.top)
        _stage.require_tracked(where)

    def _stage_weights(self, where: Any) -> Manifest:
        """Clean one weights file against the previous checkpoint's tensors and stage it."""
        from git_theta.api import _stage, _writers
        from git_theta.files import open_regular
        from git_theta.manifest import parse
        from git_theta.repo import Repo

        theta = Repo(where.top)
        try:
            update_for = _stage.policy(where.top, self.update_type)
            with open_regular(where.full) as fh:
                source = _writers.FileSource(fh)
                data = _stage.clean_to_manifest(theta, where, source, update_for, self._previous)
            _stage.stage_manifest(where, data)
        finally:
            theta.close()
        _stage.refresh(where)
        return parse(data)


def _removed(top: str, parent: str) -> list[str]:
    """Staged paths in ``parent``'s ``checkpoint-*`` directories whose files are gone from
    the work tree (not the user's other deleted files: ``parent`` may be the top)."""
    from git_theta import git

    literal = "".join(f"[{c}]" if c in "*?[" else c for c in parent)  # the dir, not a glob
    rotated = "checkpoint-*" if parent == os.curdir else f"{literal}/checkpoint-*"
    out = git.git("ls-files", "-z", "--deleted", "--", f":(glob){rotated}/**", cwd=top)
    return [os.fsdecode(p) for p in out.split(b"\0") if p]


def _merged(manifests: list[Manifest]) -> Manifest:
    """One manifest whose tensors are every shard's: what the next save is cleaned
    against (only its tensors are read)."""
    tensors = {}
    for manifest in manifests:
        tensors.update(manifest.tensors)
    return manifests[0]._replace(tensors=tensors)


def _metrics(log_history: Sequence[dict[str, Any]], step: int) -> str:
    """``name=value`` for the latest value of every metric logged up to ``step``."""
    latest: dict[str, Any] = {}
    for entry in log_history:
        if entry.get("step", 0) <= step:
            latest.update({k: v for k, v in entry.items() if k not in _SKIP_METRICS})
    return ", ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(latest.items())
    )
