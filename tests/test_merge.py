"""git merge combines two branches of a model tensor by tensor."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from conftest import git, sha256
from st_files import st_from_arrays


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {n: (rng.standard_normal((32, 32)) * 0.02).astype(np.float32) for n in "abcd"}


def save_commit(repo: Path, values: dict[str, np.ndarray], message: str) -> None:
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", message)


def test_changes_to_different_tensors_merge_cleanly(repo: Path) -> None:
    base = arrays()
    save_commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    left = {**base, "a": base["a"] + np.float32(1), "b": base["b"] * np.float32(2)}
    save_commit(repo, left, "left")
    git(repo, "checkout", "-q", "main")
    right = {**base, "c": base["c"] - np.float32(1)}
    save_commit(repo, right, "right")
    git(repo, "merge", "-q", "--no-edit", "left")
    expected = st_from_arrays({**base, "a": left["a"], "b": left["b"], "c": right["c"]})
    assert sha256(repo / "m.safetensors") == hashlib.sha256(expected).hexdigest()
    assert git(repo, "status", "--porcelain").stdout == b""


def test_both_sides_changing_a_tensor_is_a_named_conflict(repo: Path) -> None:
    base = arrays()
    save_commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    save_commit(repo, {**base, "d": base["d"] + np.float32(1)}, "left")
    git(repo, "checkout", "-q", "main")
    ours = {**base, "d": base["d"] + np.float32(2), "a": base["a"] * np.float32(3)}
    save_commit(repo, ours, "right")
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode != 0
    err = done.stderr.decode() + done.stdout.decode()
    assert "git-theta: m.safetensors: tensors changed on both sides: d; the merge keeps ours" in err
    assert sha256(repo / "m.safetensors") == hashlib.sha256(st_from_arrays(ours)).hexdigest()
