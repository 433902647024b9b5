"""git theta prune deletes only unreferenced git-theta objects; git lfs fsck stays happy."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from conftest import git, lfs_objects, sha256
from st_files import f32, st_from_arrays

SHAPES = {"a": (64, 16), "b": (16,)}


def test_prune_keeps_referenced_and_foreign_objects(repo: Path) -> None:
    (repo / "m.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    v1_sha = sha256(repo / "m.safetensors")
    kept = lfs_objects(repo)

    (repo / "m.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 2)))
    git(repo, "add", "m.safetensors")  # stores v2's objects...
    git(repo, "reset", "-q", "--hard")  # ...which nothing references any more
    orphans = lfs_objects(repo) - kept
    assert orphans

    # A plain Git LFS object a committed pointer names is never ours to delete; one that
    # no pointer anywhere names (what a migration leaves behind) is garbage.
    foreign = b"a plain Git LFS object, not ours\n"
    oid = hashlib.sha256(foreign).hexdigest()
    path = repo / ".git/lfs/objects" / oid[:2] / oid[2:4] / oid
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(foreign)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(foreign)}\n"
    (repo / "data.bin").write_text(pointer)
    git(repo, "add", "data.bin")
    git(repo, "commit", "-q", "-m", "a plain LFS file")
    litter = b"an LFS object no pointer names\n"
    litter_oid = hashlib.sha256(litter).hexdigest()
    litter_path = repo / ".git/lfs/objects" / litter_oid[:2] / litter_oid[2:4] / litter_oid
    litter_path.parent.mkdir(parents=True, exist_ok=True)
    litter_path.write_bytes(litter)
    for p in (repo / ".git/lfs").rglob("*"):
        if p.is_file():
            os.utime(p, (1, 1))  # older than prune's grace period

    dry = subprocess.run(["git", "theta", "prune", "--dry-run"], cwd=repo, capture_output=True)
    assert dry.returncode == 0
    assert f"would delete {len(orphans)} unreferenced objects" in dry.stderr.decode()
    assert "would delete 1 Git LFS objects no LFS pointer names any more" in dry.stderr.decode()
    assert lfs_objects(repo) == kept | orphans
    assert path.read_bytes() == foreign
    assert litter_path.read_bytes() == litter

    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert lfs_objects(repo) == kept
    assert path.read_bytes() == foreign
    assert not litter_path.exists()
    (repo / "m.safetensors").unlink()
    git(repo, "checkout", "--", "m.safetensors")
    assert sha256(repo / "m.safetensors") == v1_sha
    assert git(repo, "lfs", "fsck").returncode == 0


def test_prune_keeps_objects_staged_in_another_worktree(repo: Path, tmp_path: Path) -> None:
    (repo / "m.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    other = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", str(other))
    before = lfs_objects(repo)
    (other / "m.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 2)))
    git(other, "add", "m.safetensors", stdin=None)
    staged = lfs_objects(repo) - before
    assert staged
    for p in (repo / ".git/lfs").rglob("*"):
        if p.is_file():
            os.utime(p, (1, 1))
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert staged <= lfs_objects(repo)


def test_prune_deletes_unreferenced_sparse_objects(repo: Path) -> None:
    values = f32(SHAPES, 1)
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    kept = lfs_objects(repo)
    values["a"][0, :3] += 1
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    env = {**os.environ, "GIT_THETA_UPDATE_TYPE": "sparse"}
    subprocess.run(["git", "add", "m.safetensors"], cwd=repo, env=env, check=True)
    git(repo, "reset", "-q", "--hard")
    (orphan,) = lfs_objects(repo) - kept
    path = next((repo / ".git/lfs/theta/objects").rglob(orphan))
    assert path.read_bytes()[:4] == b"GTSP"
    os.utime(path, (1, 1))
    subprocess.run(["git", "theta", "prune"], cwd=repo, check=True, capture_output=True)
    assert lfs_objects(repo) == kept


def plain_object(repo: Path, data: bytes, lfs: str = ".git/lfs") -> Path:
    """A plain Git LFS object of ``data`` in git-lfs's directory, older than the grace."""
    oid = hashlib.sha256(data).hexdigest()
    path = repo / lfs / "objects" / oid[:2] / oid[2:4] / oid
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (1, 1))
    return path


def commit_blob(repo: Path, name: str, blob: bytes) -> None:
    """Commit ``blob`` as it is at ``name`` (no filter: a pointer as another tool wrote it)."""
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=blob).stdout.decode().strip()
    git(repo, "update-index", "--add", "--cacheinfo", f"100644,{oid},{name}")
    git(repo, "commit", "-q", "-m", name)


POINTER_FORMS = {
    "no final newline": "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}",
    "crlf": "version https://git-lfs.github.com/spec/v1\r\noid sha256:{oid}\r\nsize {size}\r\n",
    "hawser": "version https://hawser.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n",
    "extension": "version https://git-lfs.github.com/spec/v1\next-0-foo sha256:{ext}\n"
    "oid sha256:{oid}\nsize {size}\n",
}


def test_prune_keeps_the_object_of_every_pointer_git_lfs_reads(repo: Path) -> None:
    git(repo, "lfs", "install", "--skip-repo")
    kept = {}
    for i, (form, text) in enumerate(sorted(POINTER_FORMS.items())):
        data = f"the bytes of a file git-lfs tracks, {form}\n".encode()
        path = plain_object(repo, data)
        ext = hashlib.sha256(b"before the extension ran %d" % i).hexdigest()
        pointer = text.format(oid=path.name, size=len(data), ext=ext).encode()
        commit_blob(repo, f"file{i}.bin", pointer)
        kept[form] = (path, data, pointer)
    litter = plain_object(repo, b"an LFS object no pointer names\n")
    for form, (_, data, pointer) in kept.items():
        if form != "extension":  # git-lfs reads each as a pointer, not as a file's text
            assert git(repo, "lfs", "smudge", stdin=pointer).stdout == data, form
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert {form: path.read_bytes() for form, (path, _, _) in kept.items()} == {
        form: data for form, (_, data, _) in kept.items()
    }
    assert not litter.exists()


def theta_objects(lfs: Path) -> set[str]:
    return {p.name for p in (lfs / "theta/objects").rglob("*") if p.is_file()}


def orphans(repo: Path, lfs: str = ".git/lfs") -> tuple[set[str], Path]:
    """Commit v1, stage then drop v2 (its objects unreferenced), leave an unnamed plain
    object; age everything. Return v2's objects and the plain object."""
    (repo / "m.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    kept = theta_objects(repo / lfs)
    (repo / "m.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 2)))
    git(repo, "add", "m.safetensors")
    git(repo, "reset", "-q", "--hard")
    litter = plain_object(repo, b"an LFS object no pointer names\n", lfs)
    for p in (repo / lfs).rglob("*"):
        if p.is_file():
            os.utime(p, (1, 1))
    return theta_objects(repo / lfs) - kept, litter


def test_prune_refuses_a_shared_lfs_storage_unless_forced(repo: Path, tmp_path: Path) -> None:
    """Repositories sharing lfs.storage each see only their own references: a prune in
    one would delete the others' objects."""
    shared = tmp_path / "shared-lfs"
    git(repo, "config", "lfs.storage", str(shared))
    dropped, litter = orphans(repo, str(shared))
    assert dropped
    stored = {p for p in shared.rglob("*") if p.is_file()}
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 1
    assert done.stderr.decode() == (
        f"git-theta: error: lfs.storage is set ({shared}): other repositories may keep "
        "their objects there, and prune sees only this one's, so it would delete theirs; "
        "run `git theta prune --force` if no other repository uses it\n"
    )
    assert {p for p in shared.rglob("*") if p.is_file()} == stored
    forced = subprocess.run(["git", "theta", "prune", "--force"], cwd=repo, capture_output=True)
    assert forced.returncode == 0, forced.stderr.decode()
    assert not litter.exists()
    assert not theta_objects(shared) & dropped


@pytest.mark.parametrize("where", ["index.lock", "worktrees/wt/index.lock"])
def test_prune_deletes_nothing_while_an_index_is_being_written(
    where: str, repo: Path, tmp_path: Path
) -> None:
    """A `git add` reusing an old unreferenced object (git-lfs leaves its age alone) holds
    the index lock until its pointer is staged: prune must not delete it meanwhile."""
    git(repo, "worktree", "add", "-q", str(tmp_path / "wt"))
    dropped, litter = orphans(repo)
    stored = {p for p in (repo / ".git/lfs").rglob("*") if p.is_file()}
    lock = repo / ".git" / where
    lock.write_bytes(b"")
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 1
    assert done.stderr.decode() == (
        f"git-theta: error: a git command is writing an index of this repository ({lock} "
        "exists), and prune must see what it stages: nothing was deleted; run `git theta "
        "prune` again when it is done (or delete that file if no git command is running)\n"
    )
    assert {p for p in (repo / ".git/lfs").rglob("*") if p.is_file()} == stored
    # The add finishes: its pointer to the old object is staged, the lock gone.
    pointer = (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{litter.name}\n"
        f"size {litter.stat().st_size}\n"
    ).encode()
    lock.unlink()
    blob = git(repo, "hash-object", "-w", "--stdin", stdin=pointer).stdout.decode().strip()
    git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},data.bin")
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert litter.exists()
    assert not lfs_objects(repo) & dropped


def test_objects_a_killed_prune_held_go_back(repo: Path) -> None:
    dropped, litter = orphans(repo)
    named = plain_object(repo, b"a file git-lfs tracks\n")
    pointer = (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{named.name}\n"
        f"size {named.stat().st_size}\n"
    ).encode()
    commit_blob(repo, "data.bin", pointer)
    held = repo / ".git/lfs/theta/pruning/lfs" / named.name
    held.parent.mkdir(parents=True)
    named.rename(held)  # where a prune killed between its two looks left it
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert named.read_bytes() == b"a file git-lfs tracks\n"
    assert not held.exists() and not litter.exists()
    assert not lfs_objects(repo) & dropped


def test_prune_refuses_a_git_lfs_directory_outside_the_repository(
    repo: Path, tmp_path: Path
) -> None:
    """A symlinked .git/lfs may be shared by other repositories, whose objects prune
    cannot see."""
    shared = tmp_path / "shared-lfs"
    (repo / ".git/lfs").rename(shared) if (repo / ".git/lfs").exists() else shared.mkdir()
    (repo / ".git/lfs").symlink_to(shared)
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 1
    assert done.stderr.decode() == (
        f"git-theta: error: the Git LFS directory is {shared}, outside this repository (a "
        "symbolic link?): other repositories may keep their objects there, and prune sees "
        "only this one's; run `git theta prune --force` if none does\n"
    )
