"""The history of a checkpoint, tensor by tensor: what each commit changed, and how much
(the statistics ``git theta diff`` shows, from diffing.compare)."""

from __future__ import annotations

from dataclasses import dataclass, field

from git_theta import git


@dataclass(frozen=True)
class TensorChange:
    """How one commit changed one tensor."""

    name: str
    status: str  # "added", "removed", "modified" or "unchanged"
    numel: int
    changed: int | None = None  # elements whose bits differ (None: not measured)
    l2: float | None = None  # ||new - old||_2
    max_abs: float | None = None
    rel: float | None = None  # ||new - old|| / ||old||
    update: str = ""  # how the new value is stored ("dense", "dense+sparse", ...)
    note: str = ""  # why something is not measured ("values not local: ...")


@dataclass(frozen=True)
class Revision:
    """One commit that touched the checkpoint."""

    commit: str
    subject: str
    date: str  # ISO 8601, the committer's
    tensors: dict[str, TensorChange] = field(default_factory=dict)

    @property
    def changed(self) -> list[str]:
        """Names of the tensors this commit added, removed or modified."""
        return [n for n, c in self.tensors.items() if c.status != "unchanged"]


def _manifest_at(top: str, rev: str, path: str):  # type: ignore[no-untyped-def]
    from git_theta.api._open import read_manifest_blob
    from git_theta.errors import ManifestError, UsageError
    from git_theta.manifest import parse

    try:
        return parse(read_manifest_blob(top, rev, path))
    except UsageError:
        return None  # the path is not in that revision (added or removed here)
    except ManifestError:
        return None  # not a git-theta version (plain Git LFS before tracking)


def revisions(
    top: str, path: str, tensor: str | None, rev: str, max_count: int | None
) -> list[Revision]:
    """Newest first: every commit reachable from ``rev`` that changed ``path`` (and, with
    ``tensor``, changed that tensor)."""
    from git_theta import diffing
    from git_theta.api._open import require_revision
    from git_theta.repo import Repo

    require_revision(top, rev)
    args = ["log", "--format=%H%x00%cI%x00%s", "--no-renames", "--end-of-options", rev]
    log = git.git(*args, "--", path, cwd=top).decode(errors="replace")
    store = Repo(top).store
    from git_theta.smudge import Expansion

    account = Expansion()  # this call's, as one git command's: not the process's
    out: list[Revision] = []
    for line in log.splitlines():
        commit, date, subject = line.split("\0", 2)
        new = _manifest_at(top, commit, path)
        parents = git.git("rev-list", "--parents", "-n", "1", commit, cwd=top).split()
        old = _manifest_at(top, parents[1].decode(), path) if len(parents) > 1 else None
        only = None if tensor is None else (lambda n: n == tensor)
        report = diffing.compare(
            path,
            diffing.from_manifest(old, store, account),
            diffing.from_manifest(new, store, account),
            only,
        )
        changes = {
            d.name: TensorChange(
                d.name,
                d.status,
                d.numel,
                d.changed,
                d.l2,
                d.max_abs,
                d.rel,
                (d.new.update if d.new is not None else ""),
                d.note,
            )
            for d in report.tensors
        }
        if new is not None:
            for name, entry in new.tensors.items():
                if name not in changes and (tensor is None or name == tensor):
                    import math

                    update = diffing.chain_label(entry.chain)
                    changes[name] = TensorChange(
                        name, "unchanged", math.prod(entry.shape), 0, update=update
                    )
        if tensor is not None and not any(c.status != "unchanged" for c in changes.values()):
            continue
        out.append(Revision(commit, subject, date, changes))
        if max_count is not None and len(out) >= max_count:
            break
    return out
