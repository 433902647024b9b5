"""``git theta fsck [REV...] [--remote NAME]``: can every version still be checked out?

Every manifest reachable from the revisions (default: every ref, and the index) is parsed
and checked; every object it needs must be in the local store with its sha256; every
tensor is rebuilt, one at a time, and its hash compared; with ``--remote``, the remote is
asked which of those objects it lacks (without downloading them). Each object and each
tensor is checked once however many versions share it. One line per problem, then a
summary; exit 1 when there was any problem.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from git_theta import chains, git
from git_theta.display import escape, quote
from git_theta.errors import ManifestError, ThetaError
from git_theta.history import manifest_blobs
from git_theta.manifest import Manifest, TensorEntry, parse
from git_theta.repo import Repo
from git_theta.smudge import read_glue
from git_theta.store import ObjectRef, ObjectStore


@dataclass
class _Report:
    problems: int = 0
    manifests: int = 0
    tensors: int = 0
    objects: dict[str, str | None] = field(default_factory=dict)  # oid -> its problem
    needs: dict[str, tuple[str, ObjectRef]] = field(default_factory=dict)  # oid -> user, ref

    def say(self, line: str) -> None:
        self.problems += 1
        sys.stdout.write(escape(line) + "\n")


def _labelled_blobs(revs: list[str], cwd: str) -> list[tuple[str, str, bytes]]:
    """(label, blob id, content) of every manifest to check, each blob once: those in a
    revision's tree as ``REV:PATH``, the index's as ``:PATH``, older ones by path and id."""
    tips = revs or ["HEAD", *git.git("for-each-ref", "--format=%(refname:short)", cwd=cwd)
                    .decode().split()]  # fmt: skip
    labelled: list[tuple[str, str]] = []  # (blob id, label)
    for rev in tips:
        if rev == "HEAD" and not revs and not git.object_exists("HEAD", cwd):
            continue  # a repository without commits yet
        labelled += [(oid, f"{rev}:{path}") for oid, path in git.tree_blobs(rev, cwd)]
    if not revs:
        labelled += [(oid, f":{path}") for oid, path in git.index_blobs(cwd)]
    history = git.new_blobs(revs or ["--all"], [], cwd)
    labelled += [(oid, f"{path} (blob {oid[:12]})") for oid, path in history]
    first: dict[str, str] = {}
    for oid, label in labelled:
        first.setdefault(oid, label)
    found = manifest_blobs([(oid, label) for oid, label in first.items()], cwd)
    return [(label, oid, data) for oid, label, data in found]


def _check_object(
    report: _Report, store: ObjectStore, label: str, what: str, ref: ObjectRef
) -> bool:
    """Check one object (once); say what is wrong with it; return whether it is usable."""
    if ref.oid not in report.objects:
        problem = None
        if not store.has(ref):
            problem = f"object {ref.oid} missing locally"
        else:
            try:
                store.get(ref)
            except ThetaError as exc:
                problem = str(exc)
        report.objects[ref.oid] = problem
        report.needs[ref.oid] = (f"{label}: {what}", ref)
        if problem is not None:
            report.say(f"{label}: {what}: {problem}")
    return report.objects[ref.oid] is None


def _check_glue(report: _Report, store: ObjectStore, label: str, m: Manifest) -> None:
    if _check_object(report, store, label, "the file's header", m.glue.ref):
        try:
            read_glue(m, store)
        except ThetaError as exc:
            report.say(f"{label}: {exc}")


def _check_tensor(
    report: _Report, store: ObjectStore, label: str, m: Manifest, name: str, entry: TensorEntry
) -> None:
    what = f"tensor {quote(name)}"
    usable = [_check_object(report, store, label, what, link.ref) for link in entry.chain]
    if not all(usable):
        return
    report.tensors += 1
    try:
        if chains.streamable(entry):
            for piece in chains.stream(name, entry, store, m.size):
                del piece  # checked as it passes; a few chunks in memory at a time
        else:
            chains.rebuild(name, entry, store, limit=m.size)
    except ThetaError as exc:
        report.say(f"{label}: {exc}")


def _check_remote(report: _Report, remote: str, cwd: str) -> None:
    from git_theta.remote_objects import missing_at_remote

    refs = [ref for _, ref in report.needs.values()]
    for ref in missing_at_remote(remote, refs, cwd):
        user, _ = report.needs[ref.oid]
        report.say(f"{user}: object {ref.oid} is not on remote {quote(remote)}")


def fsck(revs: list[str], remote: str | None) -> int:
    """Check every manifest reachable from ``revs``; return 0 when all is well, else 1."""
    if not git.inside_work_tree():
        raise ThetaError("not inside a git work tree: run git theta fsck in a repository")
    top = str(git.toplevel())
    store = Repo(top).store
    report = _Report()
    seen: set[tuple[str, tuple[int, ...], str, tuple[object, ...]]] = set()
    for label, _, data in _labelled_blobs(revs, top):
        report.manifests += 1
        try:
            m = parse(data)
        except ManifestError as exc:
            report.say(f"{label}: {exc}")
            continue
        _check_glue(report, store, label, m)
        for name in sorted(m.tensors):
            entry = m.tensors[name]
            key = (entry.dtype, entry.shape, entry.hash, entry.chain)
            if key not in seen:
                seen.add(key)
                _check_tensor(report, store, label, m, name, entry)
    if remote is not None:
        _check_remote(report, remote, top)
    where = f" and remote {quote(remote)}" if remote is not None else ""
    outcome = f"{report.problems} problem{'s' if report.problems != 1 else ''}"
    sys.stdout.write(
        f"git theta fsck: {report.manifests} manifests, {report.tensors} tensors, "
        f"{len(report.objects)} objects checked{where}: "
        f"{outcome if report.problems else 'no problems'}\n"
    )
    return 1 if report.problems else 0
