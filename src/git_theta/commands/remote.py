"""``git theta pre-push`` (run by the hook), ``git theta fetch``, ``git theta checkout``."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from git_theta import git, transfer
from git_theta.errors import ObjectCorruptError, ObjectMissingError, ThetaError
from git_theta.files import AtomicWriter, UnsafeFileError, open_regular
from git_theta.history import manifests_at, manifests_between
from git_theta.manifest import Manifest, is_manifest
from git_theta.proc import run
from git_theta.progress import summary
from git_theta.repo import Repo
from git_theta.smudge import needed_objects, write_checkpoint
from git_theta.store import ObjectRef, size_lie

ZERO = "0" * 40


def needed_by(manifests: list[tuple[str, Manifest]]) -> dict[ObjectRef, str]:
    """Map every object the manifests need to a description of what it is for."""
    out: dict[ObjectRef, str] = {}
    for path, manifest in manifests:
        for what, ref in needed_objects(manifest):
            out.setdefault(ref, f"{what} of {path}")
    return out


def pre_push(remote: str, lines: list[str]) -> int:
    """Upload every object the pushed commits' manifests need, before git updates refs.

    Raises ObjectMissingError when an object is neither local nor known to be on the
    remote, so the push stops instead of leaving a broken repository behind.
    """
    include: list[str] = []
    exclude = git.remote_tracking_refs(remote)
    for line in lines:
        fields = line.split()
        if len(fields) != 4 or fields[1] == ZERO:
            continue  # a deleted ref sends nothing
        include.append(fields[1])
        if fields[3] != ZERO and git.object_exists(fields[3]):
            exclude.append(fields[3])
    count = upload(remote, include, exclude)
    if count:
        # git-lfs asks the server first and sends only what it lacks, without saying which.
        summary(f"{count} tensor objects uploaded to {remote} or already there")
    return 0


def upload(remote: str, include: list[str], exclude: list[str], local_only: bool = False) -> int:
    """Upload every object the manifests in ``include`` but not ``exclude`` need (what
    the remote is known to have); return how many were checked or uploaded.

    Raises ObjectMissingError when an object is neither local nor known to be on the
    remote, unless ``local_only`` (only what is here is sent, and nothing is said of the
    rest: after a fetch, commits are the remote's own).
    """
    if not include:
        return 0
    repo = Repo()
    wanted = needed_by(manifests_between(include, exclude))
    known_remote = set(needed_by([m for rev in exclude for m in manifests_at(rev)]))
    local = [ref for ref in wanted if repo.store.has(ref)]
    lost = [ref for ref in wanted if ref not in known_remote and not repo.store.has(ref)]
    for ref in lost:
        if (found := repo.store.other_size(ref)) is not None:
            raise ObjectCorruptError(f"push refused: {wanted[ref]}: {size_lie(ref, found)}")
    if lost and not local_only:
        raise ObjectMissingError(
            f"push refused: object {lost[0].oid} for {wanted[lost[0]]} is not in the local "
            f"store ({len(lost)} missing); run `git theta fetch --all` and push again"
        )
    for ref in local:
        if ref in known_remote:
            continue  # git-lfs does not send what the remote has (and it is not re-read)
        # git-lfs uploads a file as it finds it: a damaged copy would reach the remote
        # under its oid, and every clone would then fail on it. Checked here, it is moved
        # aside (get) and the push stops before anything is sent.
        try:
            repo.store.get(ref)
        except ObjectCorruptError as exc:
            raise ObjectCorruptError(
                f"push refused: {wanted[ref]}: {exc}, then push again"
            ) from None
    links = repo.store.expose(local)  # git-lfs uploads from its own directory
    try:
        return transfer.push(remote, local)
    finally:
        repo.store.unexpose(links)


def after_push(lines: list[str]) -> int:
    """The reference-transaction hook's half (state ``committed``), run only when our
    pre-push hook had been replaced (``git lfs install --force``): upload the objects of
    what was just pushed, as the remote-tracking refs moved, and put our hook back.

    ``lines`` are git's ``OLD NEW REFNAME``. Returns 0; a failed upload says how to retry.
    """
    from git_theta.files import atomic_write
    from git_theta.hooks import CONFLICT, install_hooks

    conflict = os.path.join(git.hooks_dir(), CONFLICT)
    try:
        install_hooks()
    except ThetaError as exc:
        if not os.path.lexists(conflict):  # said once; the hook skips Python from now on
            sys.stderr.write(f"git-theta: error: {exc}\n")
            atomic_write(conflict, f"{exc}\n".encode())
        return 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(conflict)
    remotes = sorted(git.git("remote").decode().split(), key=len, reverse=True)
    pushed: dict[str, tuple[list[str], list[str]]] = {}
    for line in lines:
        fields = line.split()
        if len(fields) != 3 or fields[1] == ZERO or not fields[2].startswith("refs/remotes/"):
            continue
        name = fields[2].removeprefix("refs/remotes/")
        remote = next((r for r in remotes if name.startswith(r + "/")), None)
        if remote is None:
            continue
        include, exclude = pushed.setdefault(remote, ([], []))
        include.append(fields[1])
        if fields[0] != ZERO and git.object_exists(fields[0]):
            exclude.append(fields[0])
    for remote, (include, exclude) in pushed.items():
        try:
            count = upload(remote, include, exclude, local_only=True)
        except ThetaError as exc:
            sys.stderr.write(
                f"git-theta: error: the pre-push hook had been replaced, so this push sent "
                f"no tensor objects, and uploading them now failed: {exc}; run "
                f"`git theta upload {remote}` to retry\n"
            )
            continue
        if count:
            sys.stderr.write(
                f"git-theta: the pre-push hook had been replaced (git lfs install --force?); "
                f"it is back, and {count} tensor objects of these commits were uploaded to "
                f"{remote}\n"
            )
    return 0


def upload_command(remote: str, revs: list[str]) -> int:
    """``git theta upload REMOTE [REV...]``: upload every object the checkpoints in
    ``revs`` (default: the remote's tracking refs) need, whatever the remote has."""
    include = revs or git.remote_tracking_refs(remote)
    if not include:
        raise ThetaError(
            f"no revision given and no refs of remote {remote!r} are known: name the "
            f"revisions, or run `git fetch {remote}` first"
        )
    count = upload(remote, include, [])
    summary(f"{count} tensor objects uploaded to {remote} or already there")
    return 0


def fetch(revs: list[str], everything: bool) -> int:
    """Download the objects of the checkpoints in ``revs`` (or in all history)."""
    repo = Repo()
    if everything:
        manifests = manifests_between(["--all"], [])
    else:
        manifests = [m for rev in revs or ["HEAD"] for m in manifests_at(rev)]
    wanted = needed_by(manifests)
    already = sum(1 for ref in wanted if repo.store.has(ref))
    try:
        repo.downloader.fetch(wanted)
    finally:
        repo.close()
    missing = [ref for ref in wanted if not repo.store.has(ref)]
    if missing:
        raise ObjectMissingError(
            f"object {missing[0].oid} for {wanted[missing[0]]} could not be downloaded from "
            f"the Git LFS remote ({len(missing)} missing): "
            + (repo.downloader.failure() or "was it pushed? `git theta fsck --remote NAME` says")
        )
    summary(f"downloaded {len(wanted) - already} tensor objects, {already} already present")
    return 0


def _placeholders(top: Path) -> list[str]:
    """Tracked files whose work-tree content is still a manifest (skipped smudge)."""
    out = git.git("ls-files", "-z", cwd=str(top)).split(b"\0")
    paths = [os.fsdecode(raw) for raw in out if raw]
    found = []
    for path in paths:
        try:  # a symlink, FIFO or directory is no placeholder of ours: never opened
            if (top / path).exists() and _is_placeholder(top / path):
                found.append(path)
        except UnsafeFileError:
            continue
    return found


def _is_placeholder(path: Path) -> bool:
    """True when ``path`` holds a manifest or is absent. Raises UnsafeFileError when it is
    not a regular file."""
    try:
        with open_regular(path) as fh:
            return is_manifest(fh.read(64))
    except FileNotFoundError:
        return True


def _finish_interrupted(top: Path, repo: Repo, skip: list[str]) -> list[str]:
    """Update the index entries of tracked checkpoints whose bytes are exactly what is
    staged but whose stat data is stale (what a checkout killed between its rename and
    its index update leaves: git takes a changed size for changed content without looking,
    so `git status` would show them modified for good); return their paths.

    Each file is compared with its staged manifest (read once, hashed, stored nowhere) and
    updated right after, only if its stat data did not change meanwhile; should the entry
    then differ from what was staged (the user wrote the file at that very moment), the
    old entry is put back. A file the user changed is never staged."""
    from git_theta.smudge import file_matches

    out = git.git("diff-files", "--name-only", "-z", cwd=str(top)).split(b"\0")
    done = []
    for path in (os.fsdecode(raw) for raw in out if raw):
        manifest = repo.staged_manifest(path)
        if path in skip or manifest is None:
            continue
        entry = git.git("ls-files", "-s", "-z", "--", path, cwd=str(top)).split(b"\0")[0]
        mode, blob = entry.split(b" ")[:2] if entry else (b"", b"")
        full = top / path
        try:
            before = os.lstat(full)
            if not file_matches(str(full), manifest, repo.store):
                continue
            after = os.lstat(full)
        except OSError:
            continue  # gone, or not a regular file: not ours to touch
        if (before.st_mtime_ns, before.st_size, before.st_ino) != (
            after.st_mtime_ns,
            after.st_size,
            after.st_ino,
        ):
            continue  # written while we read it: the user's
        run("git", "update-index", "-q", "--refresh", "--", path, cwd=str(top), check=False)
        now = git.git("ls-files", "-s", "-z", "--", path, cwd=str(top)).split(b"\0")[0]
        if now.split(b" ")[:2] != [mode, blob]:
            cacheinfo = f"{mode.decode()},{blob.decode()},{path}"
            run("git", "update-index", "--cacheinfo", cacheinfo, cwd=str(top), check=False)
            continue
        done.append(path)
    return done


def checkout(paths: list[str], force: bool = False) -> int:
    """Write checkpoints into the work tree directly (not through git's filter pipe, so
    memory does not grow with the file), downloading objects as needed."""
    from git_theta.setup_check import require_filter

    require_filter()  # the index refresh below would hash the weights as a plain blob
    top = git.toplevel()
    prefix = git.show_prefix()
    repo = Repo(str(top))
    targets = [os.path.normpath(prefix + p) for p in paths] if paths else _placeholders(top)
    try:
        for path in targets:
            manifest = repo.staged_manifest(path)
            if manifest is None:
                raise ThetaError(
                    f"{path}: not a git-theta checkpoint in the index (`git theta ls-files` "
                    "lists them)"
                )
            dest = top / path
            if not force and not _is_placeholder(dest):
                raise ThetaError(
                    f"{path}: the file holds weights, not a manifest; refusing to overwrite "
                    "it (use --force, or `git checkout -- PATH` to discard changes)"
                )
            # A temporary of an unguessable name beside it, in a directory reached
            # without following symlinks, renamed over it only if it is a regular file.
            try:
                with AtomicWriter(dest, within=str(top)) as fh:
                    write_checkpoint(manifest, fh, path, repo.store, fetch=repo.downloader.fetch)
            except ThetaError as exc:
                exc.args = (f"{path}: {exc}",)  # which file, as git's own checkout says
                raise
            summary(f"checked out {path}")
    finally:
        repo.close()
    if not paths:
        _finish_interrupted(top, repo, targets)
    if targets:
        # With our filter on: git re-cleans (hashes) the files and records their stat
        # data (naming them updates their entries), so `git status` stays clean.
        run("git", "update-index", "-q", "--refresh", "--", *targets, cwd=str(top), check=False)
    return 0
