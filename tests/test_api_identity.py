"""The API's save finds tensors in the repository's other files as `git add` does
(identity.py): what it stages is what `git add` of the same file would stage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from conftest import git

import git_theta


def _chains(repo: Path, path: str) -> dict[str, list[object]]:
    tensors = json.loads(git(repo, "show", f"HEAD:{path}").stdout)["tensors"]
    return {name: entry["chain"] for name, entry in tensors.items()}


def test_a_tensor_moved_to_another_file_keeps_its_chain(repo: Path) -> None:
    rng = np.random.default_rng(31)
    first = {f"w{i}": (rng.standard_normal((64, 48)) * 0.02).astype(np.float32) for i in range(3)}
    git_theta.save(first, "a.safetensors", message="v0")
    for value in first.values():  # a base and a sparse update: a fresh value would be one link
        value.reshape(-1)[::101] += np.float32(1e-3)
    git_theta.save(first, "a.safetensors", message="v1")
    before = _chains(repo, "a.safetensors")
    assert all(len(chain) == 2 for chain in before.values())
    moved = {"w0": first["w0"], "w1": first["w1"].copy()}
    moved["w1"].reshape(-1)[::97] += np.float32(1e-3)  # moved and changed: a change on it
    git_theta.save(moved, "b.safetensors", message="moved")
    after = _chains(repo, "b.safetensors")
    assert after["w0"] == before["w0"]
    assert after["w1"][:2] == before["w1"] and len(after["w1"]) == 3
    (repo / "b.safetensors").unlink(missing_ok=True)
    git(repo, "checkout", "--", "b.safetensors")
    from safetensors.numpy import load_file

    got = load_file(str(repo / "b.safetensors"))
    assert all(np.array_equal(got[k], v) for k, v in moved.items())
