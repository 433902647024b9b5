"""``git theta fsck [REV...] [--remote NAME]``: can every version still be checked out?

Every manifest reachable from the revisions (default: every ref, and the index) is parsed
and checked; every object it needs must be in the local store with its sha256; every
tensor is rebuilt, one at a time, and its hash compared; with ``--remote``, the remote is
asked which of those objects it lacks (without downloading them). A Git LFS pointer at a
git-theta path (a version from before git-theta took the path over, which checks out
through our filter) needs its Git LFS object, locally with its size and sha256 (streamed)
and on the remote alike. Each object and each tensor is checked once however many
versions share it. One line per problem, then a summary; exit 1 when there was any
problem.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from git_theta import chains, git, lfs_pointer
from git_theta.display import escape, quote
from git_theta.errors import ManifestError, ObjectCorruptError, ObjectMissingError, ThetaError
from git_theta.history import manifest_blobs
from git_theta.manifest import Manifest, TensorEntry, parse
from git_theta.repo import Repo
from git_theta.smudge import read_glue
from git_theta.store import ObjectRef, ObjectStore, size_lie


@dataclass
class _Report:
    problems: int = 0
    manifests: int = 0
    tensors: int = 0
    objects: dict[str, str | None] = field(default_factory=dict)  # oid -> its problem
    lfs_objects: dict[str, str | None] = field(default_factory=dict)  # of LFS pointers
    needs: dict[str, tuple[str, ObjectRef]] = field(default_factory=dict)  # oid -> user, ref

    def say(self, line: str) -> None:
        self.problems += 1
        sys.stdout.write(escape(line) + "\n")


def _visited(revs: list[str], cwd: str) -> list[tuple[str, str, str]]:
    """(blob id, path, label) of every blob to look at: those in a revision's tree
    labelled ``REV:PATH``, the index's ``:PATH``, older ones by path and id (a blob is
    listed wherever it is; the first label is the one problems are told under)."""
    tips = revs or ["HEAD", *git.git("for-each-ref", "--format=%(refname:short)", cwd=cwd)
                    .decode().split()]  # fmt: skip
    visited: list[tuple[str, str, str]] = []
    for rev in tips:
        if rev == "HEAD" and not revs and not git.object_exists("HEAD", cwd):
            continue  # a repository without commits yet
        visited += [(oid, path, f"{rev}:{path}") for oid, path in git.tree_blobs(rev, cwd)]
    if not revs:
        visited += [(oid, path, f":{path}") for oid, path in git.index_blobs(cwd)]
    history = git.new_blobs(revs or ["--all"], [], cwd)
    visited += [(oid, path, f"{path} (blob {oid[:12]})") for oid, path in history]
    return visited


def _first_labels(visited: list[tuple[str, str, str]]) -> dict[str, str]:
    first: dict[str, str] = {}
    for oid, _, label in visited:
        first.setdefault(oid, label)
    return first


def _manifests(visited: list[tuple[str, str, str]], cwd: str) -> list[tuple[str, str, bytes]]:
    """(label, blob id, content) of every manifest among ``visited``, each blob once."""
    found = manifest_blobs(list(_first_labels(visited).items()), cwd)
    return [(label, oid, data) for oid, label, data in found]


def _theta_attributed(paths: set[str], cwd: str) -> set[str]:
    """Those of ``paths`` that git gives our filter under the current attributes."""
    if not paths:
        return set()
    feed = b"".join(os.fsencode(path) + b"\0" for path in sorted(paths))
    out = git.git("check-attr", "-z", "--stdin", "filter", cwd=cwd, stdin=feed).split(b"\0")
    return {os.fsdecode(out[i]) for i in range(0, len(out) - 2, 3) if out[i + 2] == b"theta"}


def _lfs_pointers(
    visited: list[tuple[str, str, str]], manifests: set[str], cwd: str
) -> list[tuple[str, ObjectRef]]:
    """(label, object) of every Git LFS pointer among ``visited`` at a git-theta path: one
    where a manifest was found, or that the current attributes give our filter. Such a
    pointer (a version from before git-theta took the path over) checks out through our
    filter, which then needs its object. Each pointer blob is listed once."""
    theta_paths = {path for oid, path, _ in visited if oid in manifests}
    theta_paths |= _theta_attributed({path for _, path, _ in visited} - theta_paths, cwd)
    first = _first_labels([v for v in visited if v[1] in theta_paths and v[0] not in manifests])
    sizes = git.blob_sizes(sorted(first), cwd)
    small = [oid for oid, size in sizes.items() if size <= lfs_pointer.MAX_POINTER]
    contents = git.blobs_starting_with(small, lfs_pointer.VERSION_LINE, cwd)
    out = []
    for oid, label in first.items():
        ref = lfs_pointer.parse(contents[oid]) if oid in contents else None
        if ref is not None:
            out.append((label, ref))
    return out


def _check_lfs_object(report: _Report, store: ObjectStore, label: str, ref: ObjectRef) -> None:
    """Check one Git LFS object (once) as checkout reads it: from git-lfs's directory,
    else ours, its size and sha256 checked as it streams past."""
    what = "Git LFS pointer"
    if ref.oid not in report.lfs_objects:
        problem = None
        if store.open_plain_path(ref) is None:
            problem = f"object {ref.oid} missing locally"
        else:
            try:
                lfs_pointer.write_object(ref, store, lambda chunk: None, None)
            except ObjectMissingError:  # removed meanwhile
                problem = f"object {ref.oid} missing locally"
            except ObjectCorruptError:
                problem = f"object {ref.oid} is corrupt (its sha256 does not match)"
        report.lfs_objects[ref.oid] = problem
        report.needs.setdefault(ref.oid, (f"{label}: {what}", ref))
        if problem is not None:
            report.say(f"{label}: {what}: {problem}")


def _check_object(
    report: _Report, store: ObjectStore, label: str, what: str, ref: ObjectRef
) -> bool:
    """Check one object (once); say what is wrong with it; return whether it is usable."""
    if ref.oid not in report.objects:
        problem = None
        if not store.has(ref):
            found = store.other_size(ref)
            problem = (
                f"object {ref.oid} missing locally" if found is None else str(size_lie(ref, found))
            )
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
        return
    store.verified.add([entry])  # rebuilt to its hash: an add may reuse it (verified.py)


def _check_remote(report: _Report, remote: str, cwd: str) -> None:
    from git_theta.remote_objects import missing_at_remote

    refs = [ref for _, ref in report.needs.values()]
    for ref in missing_at_remote(remote, refs, cwd):
        user, _ = report.needs[ref.oid]
        report.say(f"{user}: object {ref.oid} is not on remote {quote(remote)}")


def fsck(revs: list[str], remote: str | None) -> int:
    """Check every manifest, and every Git LFS pointer at a git-theta path, reachable from
    ``revs``; return 0 when all is well, else 1."""
    if not git.inside_work_tree():
        raise ThetaError("not inside a git work tree: run git theta fsck in a repository")
    top = str(git.toplevel())
    store = Repo(top).store
    report = _Report()
    seen: set[tuple[str, tuple[int, ...], str, tuple[object, ...]]] = set()
    visited = _visited(revs, top)
    manifests = _manifests(visited, top)
    for label, _, data in manifests:
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
    store.verified.flush()
    for label, ref in _lfs_pointers(visited, {oid for _, oid, _ in manifests}, top):
        _check_lfs_object(report, store, label, ref)
    if remote is not None:
        _check_remote(report, remote, top)
    where = f" and remote {quote(remote)}" if remote is not None else ""
    outcome = f"{report.problems} problem{'s' if report.problems != 1 else ''}"
    sys.stdout.write(
        f"git theta fsck: {report.manifests} manifests, {report.tensors} tensors, "
        f"{len(report.objects) + len(report.lfs_objects)} objects checked{where}: "
        f"{outcome if report.problems else 'no problems'}\n"
    )
    return 1 if report.problems else 0
