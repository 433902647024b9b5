"""Merging checkpoints in git's other ways of combining work: rebase, cherry-pick, stash
pop, pull, octopus; and in a format other than safetensors (npy)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256, track
from st_files import st_from_arrays

M = "m.safetensors"


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {n: (rng.standard_normal((16, 16)) * 0.02).astype(np.float32) for n in "abc"}


def write(repo: Path, values: dict[str, np.ndarray], name: str = M) -> None:
    if name.endswith(".npy"):  # one tensor: "a"
        buf = io.BytesIO()
        np.save(buf, values["a"])
        (repo / name).write_bytes(buf.getvalue())
    elif name.endswith(".npz"):  # stored members, as np.savez writes them
        np.savez(repo / name, **values)
    elif name.endswith(".bin"):
        import torch

        torch.save({k: torch.from_numpy(v.copy()) for k, v in values.items()}, repo / name)
    else:
        (repo / name).write_bytes(st_from_arrays(values))


def commit(repo: Path, values: dict[str, np.ndarray], message: str, name: str = M) -> None:
    write(repo, values, name)
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", message)


def two_sides(repo: Path, name: str = M) -> tuple[dict[str, np.ndarray], ...]:
    base = arrays()
    left = {**base, "a": base["a"] + np.float32(1), "b": base["b"] + np.float32(1)}
    right = {**base, "a": base["a"] + np.float32(3), "c": base["c"] * np.float32(2)}
    commit(repo, base, "base", name)
    git(repo, "checkout", "-q", "-b", "left")
    commit(repo, left, "left", name)
    git(repo, "checkout", "-q", "main")
    commit(repo, right, "right", name)
    return base, left, right


def expected(base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "a": base["a"] + np.float32(2),
        "b": base["b"] + np.float32(1),
        "c": base["c"] * np.float32(2),
    }


def check(values: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, value in want.items():
        np.testing.assert_allclose(values[name], value, atol=1e-6, err_msg=name)


def load(path: Path) -> dict[str, np.ndarray]:
    if path.name.endswith(".npy"):
        return {"a": np.load(path)}
    if path.name.endswith(".npz"):
        with np.load(path) as got:  # reading a member checks its CRC-32
            return {k: got[k] for k in got.files}
    if path.name.endswith(".bin"):
        import torch

        return {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()}
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.mark.slow  # ~3 s each on 2 cores: past the default run's budget
@pytest.mark.parametrize("how", ["rebase", "cherry-pick", "pull"])
def test_rebase_cherry_pick_and_pull_merge_with_the_configured_strategy(
    repo: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    base, _, _ = two_sides(repo)
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    if how == "rebase":
        git(repo, "rebase", "-q", "left")
    elif how == "cherry-pick":
        git(repo, "cherry-pick", "left")
    else:
        git(repo, "pull", "-q", "--no-rebase", "--no-edit", ".", "left")
    check(load(repo / M), expected(base))
    assert git(repo, "status", "--porcelain").stdout == b""


@pytest.mark.slow
def test_stash_pop_merges_a_stashed_checkpoint(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = arrays()
    commit(repo, base, "base")
    write(repo, {**base, "a": base["a"] + np.float32(1), "b": base["b"] + np.float32(1)})
    git(repo, "stash", "-q")
    commit(repo, {**base, "a": base["a"] + np.float32(3), "c": base["c"] * np.float32(2)}, "r")
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    git(repo, "stash", "pop", "-q")
    check(load(repo / M), expected(base))


def test_a_conflicting_rebase_leaves_a_whole_checkpoint_and_aborts_cleanly(repo: Path) -> None:
    _, _, right = two_sides(repo)
    before = sha256(repo / M)
    done = git(repo, "rebase", "left", check=False)
    assert done.returncode != 0
    assert b"git theta merge --strategy STRATEGY m.safetensors" in done.stderr
    assert load(repo / M).keys() == right.keys()  # a readable model, never markers
    git(repo, "rebase", "--abort")
    assert sha256(repo / M) == before
    assert git(repo, "status", "--porcelain").stdout == b""


@pytest.mark.slow
def test_octopus_merge_of_conflicting_checkpoints_keeps_the_model(repo: Path) -> None:
    base, _, _ = two_sides(repo)
    git(repo, "checkout", "-q", "-b", "third", "main~1")
    commit(repo, {**base, "a": base["a"] - np.float32(5)}, "third")
    git(repo, "checkout", "-q", "main")
    before = sha256(repo / M)
    done = git(repo, "merge", "--no-edit", "left", "third", check=False)
    assert done.returncode != 0
    git(repo, "merge", "--abort", check=False)
    git(repo, "reset", "-q", "--merge")
    assert sha256(repo / M) == before


def test_npy_checkpoints_merge_too(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    track(repo, "*.npy")
    base, _, _ = two_sides(repo, "m.npy")
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    git(repo, "merge", "-q", "--no-edit", "left")
    check(load(repo / "m.npy"), {"a": expected(base)["a"]})
    assert git(repo, "status", "--porcelain").stdout == b""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["rebase", "cherry-pick"])
def test_a_stopped_rebase_or_cherry_pick_is_resolved_with_git_theta_merge(
    repo: Path, how: str
) -> None:
    from git_theta.commands.cli import main

    base, _, _ = two_sides(repo)
    args = ["rebase", "left"] if how == "rebase" else ["cherry-pick", "left"]
    assert git(repo, *args, check=False).returncode != 0
    assert main(["merge", "--strategy", "average", M]) == 0
    git(repo, "-c", "core.editor=true", how, "--continue")
    check(load(repo / M), expected(base))
    assert git(repo, "status", "--porcelain").stdout == b""


def zip_members_read_whole(path: Path) -> None:
    """Every member's CRC-32 matches its bytes (zipfile checks it on a full read)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None


@pytest.mark.parametrize("name", ["m.npz", "m.bin"])
def test_zip_checkpoints_merge_a_tensor_both_sides_changed(
    repo: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Each member's CRC-32 lies in the header: both sides' headers differ, in it only.
    track(repo, "*" + name[1:])
    base, _, _ = two_sides(repo, name)
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    git(repo, "merge", "-q", "--no-edit", "left")
    zip_members_read_whole(repo / name)
    check(load(repo / name), expected(base))
    assert git(repo, "status", "--porcelain").stdout == b""


@pytest.mark.parametrize("name", ["m.npz", "m.bin"])
def test_zip_checkpoints_merge_disjoint_changes_with_no_strategy(repo: Path, name: str) -> None:
    track(repo, "*" + name[1:])
    base = arrays()
    commit(repo, base, "base", name)
    git(repo, "checkout", "-q", "-b", "left")
    commit(repo, {**base, "b": base["b"] + np.float32(1)}, "left", name)
    git(repo, "checkout", "-q", "main")
    commit(repo, {**base, "c": base["c"] * np.float32(2)}, "right", name)
    git(repo, "merge", "-q", "--no-edit", "left")
    zip_members_read_whole(repo / name)
    want = {**base, "b": base["b"] + np.float32(1), "c": base["c"] * np.float32(2)}
    got = load(repo / name)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert git(repo, "status", "--porcelain").stdout == b""


def test_zip_headers_changed_otherwise_on_both_sides_still_conflict(repo: Path) -> None:
    # Each side adds its own member: more than CRC-32 fields differ, so only a file-wide
    # side choice resolves it, and the work tree keeps ours whole.
    track(repo, "*.npz")
    base = arrays()
    commit(repo, base, "base", "m.npz")
    git(repo, "checkout", "-q", "-b", "left")
    commit(repo, {**base, "d": base["a"] + np.float32(1)}, "left", "m.npz")
    git(repo, "checkout", "-q", "main")
    commit(repo, {**base, "e": base["b"] * np.float32(2)}, "right", "m.npz")
    before = sha256(repo / "m.npz")
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode == 1
    assert b"(file header: both sides changed" in done.stderr
    assert sha256(repo / "m.npz") == before
    zip_members_read_whole(repo / "m.npz")


def test_crc32_of_a_concatenation_from_its_parts() -> None:
    import zlib

    from git_theta.formats.zip_glue import crc32_combine

    rng = np.random.default_rng(9)
    for n1, n2 in [(0, 0), (0, 7), (5, 0), (1000, 1), (3, 1 << 20)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)
