"""``git theta prune``: delete local objects that no manifest in the repository needs.

``git lfs prune`` cannot see our objects (they are named by manifests, not by LFS pointer
files), which is why they live in a directory of their own (see store.py); this is the
prune for them. It deletes git-theta objects (in our directory, and links or an older
git-theta's copies in git-lfs's), and plain Git LFS objects only when no LFS pointer
anywhere in the repository (refs, reflogs, every worktree's index) names them, as after
``git theta migrate import``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from git_theta import git
from git_theta.codec import MAGIC as DENSE
from git_theta.commands.remote import needed_by
from git_theta.files import UnsafeFileError, open_dir, open_regular, remove_stale
from git_theta.history import manifests_between, manifests_in_index
from git_theta.repo import Repo
from git_theta.store import remove_stale_temporaries
from git_theta.updates.factored import MAGIC as FACTORED
from git_theta.updates.sparse import MAGIC as SPARSE

GRACE = 3600  # seconds: never delete objects this new (an add may be writing its manifest)


def _written_beside(name: str) -> bool:
    """Whether ``name`` may be an AtomicWriter's temporary (``.NAME.theta-PID-RANDOM``)."""
    return name.startswith(".") and ".theta-" in name


def lfs_pointed_at(everything: list[str], top: str) -> set[str]:
    """The oids every Git LFS pointer reachable from ``everything`` (or staged) names."""
    from git_theta import lfs_pointer

    blobs = {oid for oid, _ in git.new_blobs(everything, [], top)}
    blobs |= {oid for oid, _ in git.index_blobs(top)}
    sizes = git.blob_sizes(sorted(blobs), top)
    small = [oid for oid, size in sizes.items() if size <= lfs_pointer.MAX_POINTER]
    found = git.blobs_starting_with(small, lfs_pointer.VERSION_LINE, top)
    refs = (lfs_pointer.parse(data) for data in found.values())
    return {ref.oid for ref in refs if ref is not None}


def prune(dry_run: bool) -> int:
    """Delete unreferenced git-theta objects, and plain Git LFS objects no LFS pointer in
    any ref, reflog entry or index names (what ``git theta migrate import`` leaves behind);
    return 0. Prints what it did."""
    repo = Repo()
    # --indexed-objects covers the index of every worktree, not just this one.
    everything = ["--all", "--reflog", "--indexed-objects"]
    keep = {ref.oid for ref in needed_by(manifests_between(everything, []))}
    top = str(git.toplevel())
    staged = manifests_in_index(top)
    keep |= {ref.oid for ref in needed_by(staged)}
    pointed = lfs_pointed_at(everything, top)
    now = time.time()
    count = size = plain = plain_size = 0
    roots = [Path(repo.store.root), Path(repo.store.lfs_root)]
    gone: set[str] = set()
    for path in (p for root in roots if root.exists() for p in root.glob("??/??/*")):
        if path.name in keep or path.name in pointed or len(path.name) != 64:
            continue
        try:
            with open_regular(path) as fh:  # nothing but regular files is ours
                stat = os.fstat(fh.fileno())
                if now - stat.st_mtime < GRACE:
                    continue  # new: an add may be writing its manifest
                ours = fh.read(4) in (DENSE, SPARSE, FACTORED)
        except (UnsafeFileError, FileNotFoundError):
            continue
        if path.name not in gone:  # a link in git-lfs's directory is the same object
            gone.add(path.name)
            if ours:
                count += 1
                size += stat.st_size
            else:
                plain += 1
                plain_size += stat.st_size
        if not dry_run:
            path.unlink()
    verb = "would delete" if dry_run else "deleted"
    sys.stderr.write(
        f"git-theta: {verb} {count} unreferenced objects ({size / 1e6:.1f} MB), "
        f"kept {len(keep)} referenced\n"
    )
    if plain:
        sys.stderr.write(
            f"git-theta: {verb} {plain} Git LFS objects no LFS pointer names any more "
            f"({plain_size / 1e6:.1f} MB)\n"
        )
    stale, stale_size = remove_stale_temporaries(repo.store.tmp, dry_run)
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
    return 0
