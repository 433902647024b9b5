"""Tensor-level diffs: exact text (golden), JSON numbers equal to NumPy's, git integration."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import git
from st_files import st_bytes

GOLDEN = Path(__file__).parent / "golden"
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def versions() -> tuple[bytes, bytes, dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    a1 = (rng.standard_normal((4, 8)) * 0.02).astype(np.float32)
    a2 = a1.copy()
    a2[1, :3] += np.float32(0.5)
    a2[3, 7] = -0.0 if a1[3, 7] == 0 else -a1[3, 7]
    b = np.arange(8, dtype=np.float32)
    c1 = rng.integers(0, 1 << 16, 6, dtype=np.uint16)
    d = np.ones(3, dtype=np.float64)
    v1 = st_bytes(
        {"a": ("F32", (4, 8), a1.tobytes()), "b": ("F32", (8,), b.tobytes()),
         "c": ("BF16", (6,), c1.tobytes()), "same": ("I64", (2,), np.int64([5, 6]).tobytes())}
    )  # fmt: skip
    v2 = st_bytes(
        {"a": ("F32", (4, 8), a2.tobytes()), "c": ("BF16", (2, 3), c1.tobytes()),
         "d": ("F64", (3,), d.tobytes()), "same": ("I64", (2,), np.int64([5, 6]).tobytes())}
    )  # fmt: skip
    return v1, v2, {"a": a1}, {"a": a2}


def theta(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    done = subprocess.run(
        ["git", "theta", *args], cwd=repo, capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    return done


def two_commits(repo: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    v1, v2, old, new = versions()
    (repo / "m.safetensors").write_bytes(v1)
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    (repo / "m.safetensors").write_bytes(v2)
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v2")
    return old, new


def test_text_report_matches_golden(repo: Path) -> None:
    two_commits(repo)
    out = theta(repo, "diff", "HEAD~1", "HEAD").stdout
    assert out == (GOLDEN / "diff_v1_v2.txt").read_text()
    assert theta(repo, "diff", "HEAD~1", "HEAD", ".").stdout == out  # a directory pathspec
    stat = theta(repo, "diff", "--stat", "HEAD~1", "HEAD").stdout
    assert stat.splitlines()[2:] == [
        " a  1 modified, 4 parameters, rel 8.57",
        " b  1 removed, 8 parameters",
        " c  1 modified, 6 parameters",
        " d  1 added, 3 parameters",
        "1 unchanged tensor",
    ]


def test_json_numbers_match_numpy(repo: Path) -> None:
    old, new = two_commits(repo)
    report = json.loads(theta(repo, "diff", "--json", "HEAD~1", "HEAD").stdout)
    (file,) = report["files"]
    assert file["path"] == "m.safetensors"
    assert (file["tensors_changed"], file["tensors_unchanged"]) == (4, 1)
    by_name = {t["name"]: t for t in file["tensors"]}
    assert {n: t["status"] for n, t in by_name.items()} == {
        "a": "modified", "b": "removed", "c": "modified", "d": "added"
    }  # fmt: skip
    a = by_name["a"]
    delta = new["a"].astype(np.float64) - old["a"].astype(np.float64)
    assert a["changed"] == int(
        np.count_nonzero(new["a"].view(np.uint32) != old["a"].view(np.uint32))
    )
    # Sums in float64, in whatever order: equal to NumPy's to the last few ulps.
    assert a["l2"] == pytest.approx(float(np.sqrt(np.dot(delta.ravel(), delta.ravel()))), 1e-12)
    assert a["max_abs"] == float(np.abs(delta).max())
    ref = old["a"].astype(np.float64).ravel()
    assert a["rel"] == pytest.approx(a["l2"] / float(np.sqrt(np.dot(ref, ref))), 1e-12)
    assert by_name["c"]["note"] == "dtype or shape changed"
    assert by_name["c"]["old"]["shape"] == [6] and by_name["c"]["new"]["shape"] == [2, 3]
    filtered = json.loads(
        theta(repo, "diff", "--json", "--filter", "[ab]", "HEAD~1", "HEAD").stdout
    )
    assert [t["name"] for t in filtered["files"][0]["tensors"]] == ["a", "b"]


def test_git_diff_show_and_log_use_the_drivers(repo: Path) -> None:
    two_commits(repo)
    v1, _, _, _ = versions()
    (repo / "m.safetensors").write_bytes(v1)
    worktree = git(repo, "diff").stdout.decode()
    assert worktree.startswith(
        "diff --theta a/m.safetensors b/m.safetensors\n4 of 5 tensors changed"
    )
    shown = git(repo, "show", "HEAD").stdout.decode()
    assert "-b  F32 [8]  L2 11.8322  " in shown
    assert "+d  F64 [3]  L2 1.73205  " in shown
    logged = git(repo, "log", "-p", "-1").stdout.decode()
    assert "+d  F64 [3]  L2 1.73205  " in logged
    ext = git(repo, "show", "--ext-diff", "HEAD").stdout.decode()
    assert "M a  F32 [4, 8]  dense  4/32 changed (12.50%)" in ext


def test_missing_objects_and_empty_tree(repo: Path) -> None:
    two_commits(repo)
    first = theta(repo, "diff", EMPTY_TREE, "HEAD~1").stdout
    assert first.splitlines()[1].startswith("4 of 4 tensors changed: 48 of 48 parameters (100.00%)")
    manifest = json.loads(git(repo, "show", "HEAD~1:m.safetensors").stdout)
    oid = manifest["tensors"]["a"]["chain"][0]["oid"]
    (repo / ".git/lfs/theta/objects" / oid[:2] / oid[2:4] / oid).unlink()
    out = theta(repo, "diff", "HEAD~1", "HEAD").stdout
    assert "M a  F32 [4, 8]  dense  values not local: run `git theta fetch`" in out


def test_ls_files_and_show(repo: Path) -> None:
    two_commits(repo)
    listed = theta(repo, "ls-files").stdout
    assert listed == "m.safetensors\tsafetensors\t4 tensors\t43 parameters\t" + (
        f"{(repo / 'm.safetensors').stat().st_size:,} bytes\n"
    )
    shown = theta(repo, "show", "HEAD~1:m.safetensors").stdout.splitlines()
    assert shown[0].startswith("m.safetensors at HEAD~1: safetensors, ")
    assert shown[1].startswith("a\tF32\t[4, 8]\tdense ")
