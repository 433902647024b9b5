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

    foreign = b"a plain Git LFS object, not ours\n"
    oid = hashlib.sha256(foreign).hexdigest()
    path = repo / ".git/lfs/objects" / oid[:2] / oid[2:4] / oid
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(foreign)
    for p in (repo / ".git/lfs/objects").rglob("*"):
        if p.is_file():
            os.utime(p, (1, 1))  # older than prune's grace period

    dry = subprocess.run(["git", "theta", "prune", "--dry-run"], cwd=repo, capture_output=True)
    assert dry.returncode == 0
    assert f"would delete {len(orphans)} unreferenced objects" in dry.stderr.decode()
    assert lfs_objects(repo) == kept | orphans | {oid}

    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert lfs_objects(repo) == kept | {oid}
    (repo / "m.safetensors").unlink()
    git(repo, "checkout", "--", "m.safetensors")
    assert sha256(repo / "m.safetensors") == v1_sha
    assert git(repo, "lfs", "fsck").returncode == 0
