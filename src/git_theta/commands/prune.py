"""``git theta prune``: delete local objects that no manifest in the repository needs.

``git lfs prune`` cannot see our objects (they are named by manifests, not by LFS pointer
files), which is why they live in a directory of their own (see store.py); this is the
prune for them. It deletes git-theta objects (in our directory, and links or an older
git-theta's copies in git-lfs's), and plain Git LFS objects only when no LFS pointer
anywhere in the repository (refs, reflogs, every worktree's index) names them, as after
``git theta migrate import``.

What it deletes it first moves out of sight (``ObjectStore.hold``), then looks at the
indexes again: a ``git add`` that found an old object present and reused it (git-lfs does
not touch it, so its age says nothing) holds the index lock until it has written the
pointer, so it is either still running (everything goes back) or its pointer is in the
index (that object goes back). One that starts later finds the object gone and writes
it anew.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time

from git_theta import git
from git_theta.commands.remote import needed_by
from git_theta.errors import ThetaError
from git_theta.files import UnsafeFileError, open_dir, open_regular, remove_stale
from git_theta.history import manifests_between, manifests_in_index
from git_theta.repo import Repo
from git_theta.store import ObjectStore, is_theta_object, remove_stale_temporaries, stored_files

GRACE = 3600  # seconds: never delete objects this new (an add may be writing its manifest)
# What may name a Git LFS object in a pointer blob. Looser than lfs_pointer.parse on
# purpose: git-lfs also reads pointers without a final newline, with CRLF, with the old
# hawser version line or ext- lines, and keeping too much costs only space.
_NAMED = re.compile(rb"sha256:([0-9a-fA-F]{64})")
_BATCH = 10_000  # blobs per `git cat-file --batch`: at most 10 MB of pointers held


class PruneRefusedError(ThetaError):
    """Pruning now could delete an object something still needs."""


def _written_beside(name: str) -> bool:
    """Whether ``name`` may be an AtomicWriter's temporary (``.NAME.theta-PID-RANDOM``)."""
    return name.startswith(".") and ".theta-" in name


def lfs_pointed_at(everything: list[str], top: str) -> set[str]:
    """The oids any blob reachable from ``everything`` (or staged here) small enough to be
    a Git LFS pointer (git-lfs reads no larger one) may name: every 64 hex digits after
    ``sha256:`` in it, whatever else it holds."""
    from git_theta import lfs_pointer

    blobs = {oid for oid, _ in git.new_blobs(everything, [], top)}
    blobs |= {oid for oid, _ in git.index_blobs(top)}
    sizes = git.blob_sizes(sorted(blobs), top)
    small = [oid for oid, size in sizes.items() if size <= lfs_pointer.MAX_POINTER]
    named: set[str] = set()
    for start in range(0, len(small), _BATCH):
        for data in git.blobs_starting_with(small[start : start + _BATCH], b"", top).values():
            named.update(m.group(1).decode().lower() for m in _NAMED.finditer(data))
    return named


def _needed(everything: list[str], top: str) -> set[str]:
    """Every oid a manifest or (as far as git-lfs may read it) an LFS pointer in
    ``everything`` names."""
    needed = {ref.oid for ref in needed_by(manifests_between(everything, [], top))}
    return needed | lfs_pointed_at(everything, top)


def _index_being_written(common: str) -> str | None:
    """A lock file git holds while it writes an index of this repository (any worktree's,
    or a temporary index such as a stash's), or None."""
    directories = [common]
    try:
        with os.scandir(os.path.join(common, "worktrees")) as entries:
            directories += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        pass
    for directory in directories:
        try:
            with os.scandir(directory) as entries:
                for e in entries:
                    if "index" in e.name and e.name.endswith(".lock"):
                        return e.path
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


def _refuse_while_indexing(lock: str) -> PruneRefusedError:
    return PruneRefusedError(
        f"a git command is writing an index of this repository ({lock} exists), and prune "
        "must see what it stages: nothing was deleted; run `git theta prune` again when it "
        "is done (or delete that file if no git command is running)"
    )


def _candidates(
    store: ObjectStore, keep: set[str], grace: float
) -> tuple[list[tuple[str, bool, int]], int]:
    """Return (path, a git-theta object?, size) of each object file not in ``keep`` and
    older than ``grace`` seconds, in either directory, and how many were younger."""
    from git_theta.progress import Progress

    now = time.time()
    found = []
    young = 0
    progress = Progress("looking at objects", 0, 0, unit="objects")
    for root in (store.root, store.lfs_root):
        for oid, path in stored_files(root):
            progress.advance(0)
            if oid in keep:
                continue
            try:
                with open_regular(path) as fh:  # nothing but regular files is ours
                    st = os.fstat(fh.fileno())
                    if now - st.st_mtime < grace:
                        young += 1  # new: an add may be writing its manifest
                        continue
                    found.append((path, is_theta_object(fh.read(4)), st.st_size))
            except (UnsafeFileError, FileNotFoundError):
                continue
    progress.close()
    return found, young


def _delete(
    store: ObjectStore,
    candidates: list[tuple[str, bool, int]],
    common: str,
    top: str,
    grace: float,
) -> list[tuple[str, bool, int]]:
    """Delete ``candidates`` unless something took them up meanwhile (see the module's
    docstring); return those deleted. Raises PruneRefusedError, having put every one
    back, when an index is being written."""
    held = []
    for path, ours, size in candidates:
        try:
            held.append((store.hold(path), ours, size))
        except OSError:
            continue  # it stays: never deleted in sight of a writer
    lock = _index_being_written(common)
    if lock is not None:
        for where, _, _ in held:
            _release(store, where)
        raise _refuse_while_indexing(lock)
    again = _needed(["--indexed-objects"], top)
    now = time.time()
    deleted = []
    for where, ours, size in held:
        try:
            if os.path.basename(where) in again or now - os.lstat(where).st_mtime < grace:
                store.release(where)  # staged meanwhile, or written again (put touches it)
            else:
                os.unlink(where)
                deleted.append((where, ours, size))
        except FileNotFoundError:
            continue  # a prune starting meanwhile put it back: kept
    return deleted


def _duration(seconds: float) -> str:
    """Return ``seconds`` as words: "1 hour", "10 minutes", "30 seconds"."""
    for unit, size in (("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:g} seconds"


def _release(store: ObjectStore, held: str) -> None:
    """Put a held file back (one another prune put back already is fine)."""
    with contextlib.suppress(FileNotFoundError):
        store.release(held)


def prune(dry_run: bool, force: bool = False, grace: float | None = None) -> int:
    """Delete unreferenced git-theta objects, and plain Git LFS objects no LFS pointer in
    any ref, reflog entry or index names (what ``git theta migrate import`` leaves behind);
    return 0. Prints what it did. Raises PruneRefusedError when ``lfs.storage`` is set
    (other repositories may share it) unless ``force``, and while an index is written.
    Objects younger than ``grace`` seconds (default GRACE) are kept, and said so."""
    grace = GRACE if grace is None else grace
    repo = Repo()
    top = str(git.toplevel())
    storage = git.config_get("lfs.storage", top)
    if storage and not force:
        raise PruneRefusedError(
            f"lfs.storage is set ({storage}): other repositories may keep their objects "
            "there, and prune sees only this one's, so it would delete theirs; run `git "
            "theta prune --force` if no other repository uses it"
        )
    lfs_dir = os.path.realpath(repo.store.lfs_root)
    own = os.path.realpath(git.common_dir(top))
    if os.path.commonpath([lfs_dir, own]) != own and not force:
        raise PruneRefusedError(
            f"the Git LFS directory is {os.path.dirname(lfs_dir)}, outside this repository "
            "(a symbolic link?): other repositories may keep their objects there, and "
            "prune sees only this one's; run `git theta prune --force` if none does"
        )
    store = repo.store
    common = git.common_dir(top)
    if not dry_run:
        if (lock := _index_being_written(common)) is not None:
            raise _refuse_while_indexing(lock)
        for held in store.held():  # a killed prune's: looked at again below
            _release(store, held)
    store.settle()
    # --indexed-objects covers the index of every worktree, not just this one.
    everything = ["--all", "--reflog", "--indexed-objects"]
    staged = manifests_in_index(top)
    referenced = {ref.oid for ref in needed_by(manifests_between(everything, [], top))}
    referenced |= {ref.oid for ref in needed_by(staged)}
    keep = referenced | lfs_pointed_at(everything, top)
    candidates, young = _candidates(store, keep, grace)
    if not dry_run:
        candidates = _delete(store, candidates, common, top, grace)
    # A link in git-lfs's directory is the same object: count each oid once.
    counted = {os.path.basename(path): (ours, size) for path, ours, size in candidates}
    count = sum(1 for ours, _ in counted.values() if ours)
    size = sum(size for ours, size in counted.values() if ours)
    plain = len(counted) - count
    plain_size = sum(size for ours, size in counted.values() if not ours)
    verb = "would delete" if dry_run else "deleted"
    sys.stderr.write(
        f"git-theta: {verb} {count} unreferenced objects ({size / 1e6:.1f} MB), "
        f"kept {len(referenced)} referenced\n"
    )
    if young:
        sys.stderr.write(
            f"git-theta: kept {young} unreferenced objects younger than the grace period "
            f"({_duration(grace)}: a git command may be writing the manifest that needs "
            "them); `git theta prune --grace 0` deletes them too\n"
        )
    if plain:
        sys.stderr.write(
            f"git-theta: {verb} {plain} Git LFS objects no LFS pointer names any more "
            f"({plain_size / 1e6:.1f} MB)\n"
        )
    stale, stale_size = remove_stale_temporaries(store.tmp, dry_run)
    # Beside the files checkout, track and the merge driver replace: the top, and every
    # directory with a staged checkpoint.
    for directory in {top} | {os.path.join(top, os.path.dirname(p)) for p, _ in staged}:
        try:
            fd = open_dir(directory, within=top)
        except OSError:
            continue  # gone, or reached through a symlink: nothing of ours is there
        try:
            count_here, size_here = remove_stale(fd, _written_beside, dry_run)
        finally:
            os.close(fd)
        stale += count_here
        stale_size += size_here
    if stale:
        verb = "would remove" if dry_run else "removed"
        sys.stderr.write(
            f"git-theta: {verb} {stale} temporary files of killed git-theta processes "
            f"({stale_size / 1e6:.1f} MB)\n"
        )
    from git_theta import previous_values

    kept, kept_size = previous_values.clear(store, dry_run)
    if kept:
        verb = "would remove" if dry_run else "removed"
        sys.stderr.write(
            f"git-theta: {verb} {kept} tensor values kept for the next add "
            f"({kept_size / 1e6:.1f} MB; the next add rebuilds them)\n"
        )
    return 0
