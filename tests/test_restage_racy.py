"""`git theta add --update-type` cleans a file rewritten in the second of the last commit.

Git trusts an index entry's stat data only when the file changed after the index was
written (racy git). The re-stage works in a copy of the index: with a fresh mtime on the
copy, a checkpoint rewritten at the same size in the same second looked unchanged, and
the add staged nothing (seen as intermittent "nothing to commit" in tests and benches).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
from conftest import git
from st_files import st_from_arrays


def test_an_add_right_after_a_commit_cleans_the_rewritten_file(repo: Path) -> None:
    git(repo, "config", "core.trustctime", "false")  # the rewrite's ctime is not the test
    w = np.zeros((16, 16), np.float32)
    path = repo / "m.safetensors"
    path.write_bytes(st_from_arrays({"w": w}))
    past = os.stat(path).st_mtime_ns - 100 * 10**9
    os.utime(path, ns=(past, past))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "base")
    w[3, 4] = 1.0  # the same size, rewritten in place (the same inode) ...
    with open(path, "r+b") as fh:
        fh.write(st_from_arrays({"w": w}))
    # ... in the second the index was written: git must compare the contents.
    os.utime(path, ns=(past, past))
    os.utime(repo / ".git" / "index", ns=(past, past))
    done = subprocess.run(
        ["git", "theta", "add", "--update-type", "sparse", "m.safetensors"],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert git(repo, "diff", "--cached", "--name-only").stdout == b"m.safetensors\n"


def test_a_forced_add_stores_only_what_its_manifest_refers_to(repo: Path) -> None:
    """Putting the staged entry back to HEAD's runs no clean of its own (git reset's
    refresh did: a second encode of the file, objects nothing refers to)."""
    import json

    from conftest import lfs_objects

    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    path = repo / "m.safetensors"
    path.write_bytes(st_from_arrays({"w": w, "v": w[:8].copy()}))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "base")
    w[:, :3] += 1.0
    path.write_bytes(st_from_arrays({"w": w, "v": w[:8].copy()}))
    git(repo, "add", "m.safetensors")  # auto's choice staged
    w[:, 5:9] -= 1.0  # and changed again since
    path.write_bytes(st_from_arrays({"w": w, "v": w[:8].copy()}))
    before = lfs_objects(repo)
    done = subprocess.run(
        ["git", "theta", "add", "--update-type", "dense", "m.safetensors"],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = json.loads(git(repo, "show", ":m.safetensors").stdout)
    referenced = {manifest["glue"]["oid"]} | {
        link["oid"] for entry in manifest["tensors"].values() for link in entry["chain"]
    }
    new = lfs_objects(repo) - before
    assert new and new <= referenced
