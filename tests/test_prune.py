"""git theta prune deletes only unreferenced git-theta objects; git lfs fsck stays happy."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

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
