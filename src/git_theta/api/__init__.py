"""git-theta from Python: save a state dict into a repository, open a version lazily,
read a checkpoint's history; and the predecessor's ``save_to_git``/``load_from_git``.

``import git_theta`` stays light: ``git_theta.save`` and the others load this package on
first use (see the package's ``__getattr__``). docs/api.md has examples.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from git_theta.api._history import Revision, TensorChange
from git_theta.api._open import Checkpoint, Framework

__all__ = [
    "Checkpoint",
    "Framework",
    "Revision",
    "Saved",
    "TensorChange",
    "history",
    "load_from_git",
    "open",
    "save",
    "save_to_git",
]

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class Saved:
    """What ``save`` did: the path (relative to the work tree's top), the staged manifest's
    blob id, and the commit made (None without ``message``)."""

    path: str
    blob: str
    commit: str | None


def save(
    state_dict: Mapping[str, Any],
    path: PathLike,
    *,
    repo: PathLike = ".",
    format: str | None = None,
    message: str | None = None,
    tag: str | None = None,
    update_type: str | None = None,
    write_file: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> Saved:
    """Store ``state_dict`` (torch tensors, NumPy or JAX arrays) as the checkpoint at
    ``path`` and stage it, as ``git add`` of that file would, without writing the file.

    ``format``: "safetensors", "pytorch", "numpy" (npz) or "flax" (msgpack); by default
    from the suffix. safetensors and npz hold flat dicts; torch and flax nest.
    ``message`` commits the index (everything staged, like ``git commit``); ``tag`` then
    tags that commit (it needs ``message``). ``update_type`` stores every changed tensor
    so (default: GIT_THETA_UPDATE_TYPE, .theta-updates, auto). ``write_file`` also writes
    the work-tree file, byte for byte what a checkout gives. ``metadata``: safetensors'
    ``__metadata__``.

    Raises NotSetUpError when git-theta's filter is not configured, NotTrackedError when
    ``path`` is not tracked (``git theta track``), UsageError for values or names the
    format cannot hold; nothing is staged then.
    """
    from git_theta.api import _stage, _writers
    from git_theta.errors import UsageError
    from git_theta.repo import Repo

    if tag is not None and message is None:
        raise UsageError("tag= needs message=: a tag names a commit")
    where = _stage.Where(repo, path)
    fmt = _writers.format_for(where.path, format)
    if metadata is not None and fmt != "safetensors":
        raise UsageError("metadata= is safetensors' __metadata__; other formats have none")
    _stage.require_tracked(where)
    if write_file:
        _stage.require_replaceable(where)
    if tag is not None:
        _stage.check_tag(where.top, tag)
    update_for = _stage.policy(where.top, update_type)
    theta = Repo(where.top)
    try:
        blob = _save_stream(theta, where, state_dict, fmt, update_for, write_file, metadata)
    finally:
        theta.close()
    if write_file:
        _stage.refresh(where)
    _stage.install_hooks_quietly(where.top)
    commit = None
    if message is not None:
        commit = _stage.commit(where.top, message)
        if tag is not None:
            _stage.tag(where.top, tag, commit)
    return Saved(where.path, blob, commit)


def _save_stream(
    theta: Any,
    where: Any,
    state_dict: Mapping[str, Any],
    fmt: str,
    update_for: Any,
    write_file: bool,
    metadata: Mapping[str, str] | None,
) -> str:
    """Clean the checkpoint's bytes as they are produced (teed into the work-tree file
    when asked, which is renamed in only once the manifest is staged)."""
    import contextlib

    from git_theta.api import _stage, _writers
    from git_theta.files import AtomicWriter

    with contextlib.ExitStack() as stack:
        out = None
        if write_file:
            out = stack.enter_context(AtomicWriter(where.full, within=where.top))
        if fmt == "safetensors":
            parts, _size = _writers.safetensors_parts(state_dict, metadata)
            source: Any = _writers.PartsSource(parts, out)
        else:
            import tempfile

            spool = stack.enter_context(tempfile.TemporaryFile(dir=theta.store.tmp_dir()))
            _writers.serialise(state_dict, fmt, spool)
            spool.seek(0)
            source = _writers.FileSource(spool, out, private=True)
        manifest = _stage.clean_to_manifest(theta, where, source, update_for)
        return _stage.stage_manifest(where, manifest)


def open(rev: str | None, path: PathLike, *, repo: PathLike = ".") -> Checkpoint:
    """Open the version of the checkpoint at ``path`` in revision ``rev`` (None: the
    staged version). Use as a context manager. Names, dtypes and shapes are read from the
    manifest; tensors are decoded (and downloaded, when missing) one at a time on access.

    Raises UsageError when ``path`` is not in ``rev``, ManifestError when what is there is
    not a valid git-theta manifest.
    """
    from git_theta.api._open import open_checkpoint

    return open_checkpoint(rev, path, os.fspath(repo))


def history(
    path: PathLike,
    tensor: str | None = None,
    *,
    repo: PathLike = ".",
    rev: str = "HEAD",
    max_count: int | None = None,
) -> list[Revision]:
    """The commits reachable from ``rev`` that changed ``path``, newest first, each with
    every tensor's change (status, elements changed, L2 and max-abs difference, relative
    change, how it is stored). With ``tensor``, only commits that changed that tensor.
    Values whose objects are not local are not measured (``note`` says so)."""
    from git_theta.api._history import revisions
    from git_theta.api._stage import Where

    where = Where(repo, path)
    return revisions(where.top, where.path, tensor, rev, max_count)


# The predecessor's API (r-three/git-theta): same names, arguments and behaviour, in the
# current directory's repository.


def save_to_git(
    state_dict: Mapping[str, Any],
    path: str,
    commit_msg: str,
    tag: str | None = None,
    checkpoint_type: str = "pytorch",
    checkout: bool = False,
) -> str:
    """Save ``state_dict`` at ``path`` without writing it to the work tree, commit it
    with ``commit_msg`` (and tag it); return the commit id. ``checkpoint_type`` as the
    predecessor named formats ("pytorch", "safetensors", "flax", ...); ``checkout`` also
    writes the work-tree file."""
    fmt = _predecessor_format(checkpoint_type)
    saved = save(state_dict, path, format=fmt, message=commit_msg, tag=tag, write_file=checkout)
    assert saved.commit is not None
    return saved.commit


def load_from_git(
    sha_or_tag: str, path: str, checkpoint_type: str = "pytorch", checkout: bool = False
) -> Any:
    """Load the checkpoint at ``path`` as of ``sha_or_tag`` without checking it out: a
    torch state dict for "pytorch" (nesting and non-tensor values kept, read with
    ``torch.load(weights_only=True)``), torch tensors for "safetensors", NumPy arrays
    otherwise. ``checkout`` also runs ``git checkout sha_or_tag``."""
    from git_theta.api._open import require_revision
    from git_theta.api._stage import Where

    where = Where(".", path)
    require_revision(where.top, sha_or_tag)  # `git checkout` below must not see an option
    with Checkpoint(where.top, sha_or_tag, where.path) as ckpt:
        if ckpt.format == "torch":
            value = _torch_load(ckpt)
        else:
            framework: Framework = "torch" if checkpoint_type == "safetensors" else "numpy"
            value = ckpt.to_dict(framework)
    if checkout:
        from git_theta.proc import run_attached

        run_attached("git", "checkout", sha_or_tag)
    return value


def _torch_load(ckpt: Checkpoint) -> Any:
    import tempfile

    import torch

    with tempfile.TemporaryFile(dir=ckpt._repo.store.tmp_dir()) as spool:
        ckpt.file_bytes_to(spool)
        spool.seek(0)
        return torch.load(spool, weights_only=True)


_PREDECESSOR_FORMATS = {
    "pytorch": "pytorch", "pt": "pytorch", "safetensors": "safetensors",
    "flax": "flax", "msgpack": "flax", "numpy": "numpy", "npz": "numpy",
}  # fmt: skip


def _predecessor_format(name: str) -> str:
    from git_theta.errors import UsageError

    fmt = _PREDECESSOR_FORMATS.get(name)
    if fmt is None:
        raise UsageError(
            f"checkpoint_type {name!r}: git-theta writes {', '.join(sorted(_PREDECESSOR_FORMATS))}"
        )
    return fmt
