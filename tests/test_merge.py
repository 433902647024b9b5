"""git merge combines two branches of a model tensor by tensor, and element by element
inside a tensor both changed; strategies come from env, rules, config or the command."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import git, lfs_objects, sha256
from st_files import st_from_arrays

from git_theta.commands.cli import main

M = "m.safetensors"


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {n: (rng.standard_normal((32, 32)) * 0.02).astype(np.float32) for n in "abcd"}


def save_commit(repo: Path, values: dict[str, np.ndarray], message: str, path: str = M) -> None:
    (repo / path).write_bytes(st_from_arrays(values))
    git(repo, "add", path)
    git(repo, "commit", "-q", "-m", message)


def branches(
    repo: Path, left: dict[str, np.ndarray], right: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Commit base, ``left`` on branch left, ``right`` on main (checked out); return base."""
    base = arrays()
    save_commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    save_commit(repo, {**base, **left}, "left")
    git(repo, "checkout", "-q", "main")
    save_commit(repo, {**base, **right}, "right")
    return base


def digest(values: dict[str, np.ndarray]) -> str:
    return hashlib.sha256(st_from_arrays(values)).hexdigest()


def read_st(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def staged_manifest(repo: Path) -> dict[str, object]:
    return json.loads(git(repo, "cat-file", "blob", f":{M}").stdout)


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
    assert sha256(repo / M) == hashlib.sha256(expected).hexdigest()
    assert git(repo, "status", "--porcelain").stdout == b""


def test_both_sides_changing_elements_is_a_named_conflict_then_resolved(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = arrays()
    base = branches(repo, {"d": base["d"] + np.float32(1)}, {"d": base["d"] + np.float32(2)})
    ours = {**base, "d": base["d"] + np.float32(2)}
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode == 1
    err = done.stderr.decode()
    assert (
        "git-theta: m.safetensors: tensors changed on both sides: 'd' (1,024 elements changed "
        "differently on both sides); the merge keeps ours for them. Resolve with `git theta "
        "merge --strategy STRATEGY m.safetensors`" in err
    )
    assert sha256(repo / M) == digest(ours)  # a whole checkpoint, never a broken one

    assert main(["merge", "--strategy", "average", M]) == 0
    got = read_st(repo / M)
    np.testing.assert_allclose(got["d"], base["d"] + np.float32(1.5), rtol=0, atol=1e-6)
    assert git(repo, "status", "--porcelain").stdout == b"M  m.safetensors\n"
    git(repo, "commit", "-q", "--no-edit")
    assert git(repo, "status", "--porcelain").stdout == b""
    record = staged_manifest(repo)["tensors"]["d"]["merge"]  # type: ignore[index]
    assert record == {"strategy": "average", "params": {"weight": "0.5"}}
    capsys.readouterr()
    assert main(["show", M]) == 0
    assert "\tmerged: average weight=0.5\n" in capsys.readouterr().out
    assert main(["diff", "HEAD^", "HEAD"]) == 0
    assert "merged: average weight=0.5" in capsys.readouterr().out
    # Re-adding the same bytes keeps the record: nothing shows as modified.
    (repo / M).write_bytes((repo / M).read_bytes())
    git(repo, "add", M)
    assert git(repo, "status", "--porcelain").stdout == b""


def test_disjoint_sparse_changes_inside_a_tensor_merge_exactly_without_a_strategy(
    repo: Path,
) -> None:
    base = arrays()
    left_d, right_d = base["d"].copy(), base["d"].copy()
    left_d[:4] += np.float32(0.5)  # rows 0-3 on one side
    right_d[-4:] -= np.float32(0.25)  # rows 28-31 on the other
    right_d[10, 10] = -0.0 if base["d"][10, 10] == 0 else np.float32(-0.0)
    branches(repo, {"d": left_d, "a": base["a"] * 2}, {"d": right_d})
    before = lfs_objects(repo)
    git(repo, "merge", "-q", "--no-edit", "left")
    # At most d's merged value (here its sparse update on ours equals theirs' own update,
    # object for object); "a" is theirs' entry.
    assert len(lfs_objects(repo) - before) <= 1
    expected_d = right_d.copy()
    expected_d[:4] = left_d[:4]
    assert sha256(repo / M) == digest({**base, "a": base["a"] * 2, "d": expected_d})
    assert git(repo, "status", "--porcelain").stdout == b""
    tensors = json.loads(git(repo, "cat-file", "blob", f"HEAD:{M}").stdout)["tensors"]
    assert tensors["d"]["merge"] == {"strategy": "elementwise", "params": {}}
    assert "merge" not in tensors["a"]  # taken from one side: nothing recorded, nothing new


def test_environment_strategy_merges_inside_git_merge(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = arrays()
    left = {"d": base["d"] + np.float32(1), "c": base["c"] + np.float32(1)}
    branches(repo, left, {"d": base["d"] - np.float32(1), "c": base["c"] + np.float32(3)})
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    monkeypatch.setenv("GIT_THETA_MERGE_PARAMS", "weight=0.25")
    git(repo, "merge", "-q", "--no-edit", "left")
    got = read_st(repo / M)
    np.testing.assert_allclose(got["d"], base["d"] - np.float32(0.5), atol=1e-6)
    np.testing.assert_allclose(got["c"], base["c"] + np.float32(2.5), atol=1e-6)
    assert git(repo, "status", "--porcelain").stdout == b""
    assert main(["show", M]) == 0


def test_rules_file_picks_per_tensor_and_a_bad_line_is_one_error(repo: Path) -> None:
    base = arrays()
    left = {n: base[n] + np.float32(1) for n in "cd"}
    branches(repo, left, {n: base[n] + np.float32(3) for n in "cd"})
    (repo / ".theta-merges").write_text("# per tensor\nc theirs\n* average weight=0.5\n")
    git(repo, "merge", "-q", "--no-edit", "left")
    got = read_st(repo / M)
    assert got["c"].tobytes() == (base["c"] + np.float32(1)).tobytes()  # theirs, bit-exact
    np.testing.assert_allclose(got["d"], base["d"] + np.float32(2), atol=1e-6)

    git(repo, "reset", "-q", "--hard", "HEAD~1")
    (repo / ".theta-merges").write_text("c theirs\nd averge\n")
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode != 0
    assert (
        "git-theta: error: .theta-merges:2: unknown merge strategy 'averge' (available: average,"
        in done.stderr.decode()
    )
    assert sha256(repo / M) == digest({**base, **{n: base[n] + np.float32(3) for n in "cd"}})


@pytest.mark.slow  # test_merge_cases checks the precedence in process
def test_git_config_strategy_and_precedence(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = arrays()
    branches(repo, {"d": base["d"] + np.float32(1)}, {"d": base["d"] + np.float32(3)})
    git(repo, "config", "theta.mergeStrategy", "ours")
    (repo / ".theta-merges").write_text("d theirs\n")
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "base")  # env > rules > config
    git(repo, "merge", "-q", "--no-edit", "left")
    assert read_st(repo / M)["d"].tobytes() == base["d"].tobytes()


def test_aborted_merge_leaves_ours_whole(repo: Path) -> None:
    base = arrays()
    branches(repo, {"d": base["d"] + np.float32(1)}, {"d": base["d"] + np.float32(2)})
    before = sha256(repo / M)
    head = git(repo, "rev-parse", "HEAD").stdout
    assert git(repo, "merge", "--no-edit", "left", check=False).returncode == 1
    assert b"UU m.safetensors" in git(repo, "status", "--porcelain").stdout
    git(repo, "merge", "--abort")
    assert sha256(repo / M) == before
    assert git(repo, "status", "--porcelain").stdout == b""
    assert git(repo, "rev-parse", "HEAD").stdout == head


def test_manual_mode_writes_the_three_versions_outside_git_add(repo: Path) -> None:
    base = arrays()
    left = {"d": base["d"] + np.float32(1)}
    right = {"d": base["d"] + np.float32(2)}
    branches(repo, left, right)
    assert git(repo, "merge", "--no-edit", "left", check=False).returncode == 1
    assert main(["merge", "--manual", M]) == 0
    assert sha256(repo / f"{M}.theta-base") == digest(base)
    assert sha256(repo / f"{M}.theta-ours") == digest({**base, **right})
    assert sha256(repo / f"{M}.theta-theirs") == digest({**base, **left})
    git(repo, "add", ".")  # the versions are not swept in
    listed = git(repo, "status", "--porcelain").stdout.decode()
    assert "theta-" not in listed
    merged = {**base, "d": base["d"] + np.float32(1.25)}
    (repo / M).write_bytes(st_from_arrays(merged))
    before = lfs_objects(repo)
    git(repo, "add", M)
    assert len(lfs_objects(repo) - before) == 1  # only d's change: the rest is ours'
    git(repo, "commit", "-q", "--no-edit")
    assert git(repo, "status", "--porcelain").stdout == b""
    assert sha256(repo / M) == digest(merged)


def test_merge_command_outside_a_conflict_is_one_line(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_commit(repo, arrays(), "base")
    assert main(["merge", "--strategy", "average"]) == 2
    assert capsys.readouterr().err == (
        "git-theta: error: no conflicted paths: `git theta merge` resolves a merge's conflicts\n"
    )
    assert main(["merge", "--strategy", "ties", "--param", "densty=0.5", M]) == 2
    assert "merge strategy ties has no param 'densty'" in capsys.readouterr().err


def lfs_then_theta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, right: str = "c"
) -> tuple[Path, dict]:
    """A model committed with plain Git LFS, then tracked by git-theta; branch left
    changes 'b', main changes ``right``: the merge base is a Git LFS pointer."""
    repo = tmp_path / "mixed"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "lfs", "install", "--local")
    git(repo, "lfs", "track", "*.safetensors")
    base = arrays()
    (repo / M).write_bytes(st_from_arrays(base))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "lfs")
    monkeypatch.chdir(repo)
    assert main(["install", "--local"]) == 0
    assert main(["track", "*.safetensors"]) == 0
    git(repo, "add", ".gitattributes")
    git(repo, "commit", "-q", "-m", "track")
    git(repo, "checkout", "-q", "-b", "left")
    save_commit(repo, {**base, "b": base["b"] + np.float32(1)}, "left")
    git(repo, "checkout", "-q", "main")
    save_commit(repo, {**base, right: base[right] * np.float32(2)}, "right")
    assert git(repo, "show", "HEAD~2:" + M).stdout.startswith(b"version https://git-lfs")
    return repo, base


def test_a_merge_whose_base_is_a_git_lfs_version_merges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import load_file

    repo, base = lfs_then_theta(tmp_path, monkeypatch)
    git(repo, "merge", "-q", "--no-edit", "left")
    got = load_file(str(repo / M))
    want = {**base, "b": base["b"] + np.float32(1), "c": base["c"] * np.float32(2)}
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert git(repo, "status", "--porcelain").stdout == b""


def test_a_git_lfs_merge_base_that_is_not_local_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    repo, _ = lfs_then_theta(tmp_path, monkeypatch)
    shutil.rmtree(repo / ".git" / "lfs" / "objects")  # no remote to download it from
    before = sha256(repo / M)
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode != 0
    said = [line for line in done.stderr.decode().splitlines() if "git-theta" in line]
    assert len(said) == 1 and "the merge base is a Git LFS version" in said[0], said
    assert "Traceback" not in done.stderr.decode()
    assert "git lfs fetch" in said[0]
    git(repo, "merge", "--abort")
    assert sha256(repo / M) == before


def test_a_merged_tensor_is_one_update_on_the_base_when_that_is_clearly_smaller(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two full fine-tunes: on ours' chain the merged value would take two updates.
    base = arrays()
    rng = np.random.default_rng(11)
    noise = {n: rng.standard_normal((32, 32)).astype(np.float32) * 1e-4 for n in "cd"}
    branches(
        repo,
        {n: base[n] + noise[n] for n in "cd"},
        {n: base[n] - noise[n] * np.float32(0.5) for n in "cd"},
    )
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    before = lfs_objects(repo)
    git(repo, "merge", "-q", "--no-edit", "left")
    old = json.loads(git(repo, "cat-file", "blob", f"HEAD~2:{M}").stdout)["tensors"]
    new = json.loads(git(repo, "cat-file", "blob", f"HEAD:{M}").stdout)["tensors"]
    for name in "cd":
        assert new[name]["chain"][:-1] == old[name]["chain"], name
        assert new[name]["chain"][-1]["update"] == "delta", name
    assert len(lfs_objects(repo) - before) == 2  # one update per merged tensor
    want = {**base, **{n: base[n] + noise[n] * np.float32(0.25) for n in "cd"}}
    got = read_st(repo / M)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-7, err_msg=name)
    assert git(repo, "status", "--porcelain").stdout == b""


def full_merge(repo: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, np.ndarray]:
    """Both sides change every element of c and d; merged with average; returns base."""
    base = arrays()
    rng = np.random.default_rng(12)
    noise = {n: rng.standard_normal((32, 32)).astype(np.float32) * 1e-3 for n in "cd"}
    branches(repo, {n: base[n] + noise[n] for n in "cd"}, {n: base[n] - noise[n] for n in "cd"})
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    return base


def test_the_checkout_after_a_merge_takes_the_values_it_computed(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The merged values are left for git's checkout of the result, which takes them
    # (the objects just stored are not read: deleting them does not matter) and removes
    # them; a later checkout decodes as always.
    full_merge(repo, monkeypatch)
    kept = repo / ".git" / "lfs" / "theta" / "merged"
    before = lfs_objects(repo)
    objects = repo / ".git" / "lfs" / "theta" / "objects"
    hidden = repo.parent / "hidden"
    hidden.mkdir()
    listed = repo.parent / "before.txt"
    listed.write_text("".join(f"{p}\n" for p in sorted(map(str, objects.rglob("*")))))
    # Run the driver, then hide what it stored before git's checkout reads anything.
    driver = git(repo, "config", "merge.theta.driver").stdout.decode().strip()
    wrapper = repo.parent / "driver.sh"
    wrapper.write_text(
        "#!/bin/sh\nset -e\n"
        + driver.replace("%O", '"$1"').replace("%A", '"$2"').replace("%B", '"$3"')
        .replace("%P", '"$4"').replace("exec ", "")
        + f"\nfor f in $(find {objects} -type f | sort | comm -13 {listed} -); do\n"
        f"  cp -p $f {hidden}/; chmod u+w $f; head -c $(stat -c %s $f) /dev/zero > $f.z\n"
        "  mv $f.z $f\ndone\n"
    )  # fmt: skip
    wrapper.chmod(0o755)
    git(repo, "-c", f"merge.theta.driver={wrapper} %O %A %B %P", "merge", "-q", "--no-edit", "left")
    assert len(list(hidden.iterdir())) == 2  # the updates of c and d, made unreadable
    assert not kept.exists() or not list(kept.iterdir())
    merged = read_st(repo / M)
    for path in hidden.iterdir():  # put them back: a fresh checkout decodes them
        dest = objects / path.name[:2] / path.name[2:4] / path.name
        dest.chmod(0o644)
        path.replace(dest)
    assert lfs_objects(repo) - before == {p.name for p in hidden.iterdir()} | {
        p.name for p in (objects).rglob("*") if p.is_file() and p.name not in before
    }
    (repo / M).unlink()
    git(repo, "checkout", "--", M)
    for name, value in read_st(repo / M).items():
        np.testing.assert_array_equal(value, merged[name], err_msg=name)
    assert git(repo, "status", "--porcelain").stdout == b""


def merged_then_left_value(repo: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """Merge, then return the merged file's sha256 and where the value of its tensor 'c'
    would be left for a checkout (nothing is there: the merge's checkout took it)."""
    full_merge(repo, monkeypatch)
    git(repo, "merge", "-q", "--no-edit", "left")
    entry = json.loads(git(repo, "cat-file", "blob", f"HEAD:{M}").stdout)["tensors"]["c"]
    kept = repo / ".git" / "lfs" / "theta" / "merged"
    kept.mkdir(parents=True, exist_ok=True)
    return sha256(repo / M), kept / entry["hash"]


def test_a_left_value_whose_bytes_do_not_match_is_never_checked_out(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want, left = merged_then_left_value(repo, monkeypatch)
    left.write_bytes(bytes(32 * 32 * 4))  # the right size, wrong bytes
    (repo / M).unlink()
    git(repo, "checkout", "--", M)
    assert sha256(repo / M) == want
    assert not left.exists()


def test_a_fifo_planted_as_a_left_value_neither_blocks_nor_is_checked_out(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Opening a FIFO to read waits for a writer: the checkout would hang on it for good.
    want, left = merged_then_left_value(repo, monkeypatch)
    os.mkfifo(left)
    (repo / M).unlink()
    done = subprocess.run(["git", "checkout", "--", M], cwd=repo, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(repo / M) == want


def test_a_merge_leaves_no_more_than_the_cap_of_values(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sharded model's drivers all run before git checks any file out: the values left
    # at once are capped, and what is not left is decoded as always.
    from git_theta import merged_values
    from git_theta.repo import Repo

    monkeypatch.setattr(merged_values, "MAX_KEPT", 32 * 32 * 4)  # one of the two tensors
    base = full_merge(repo, monkeypatch)
    merged_values.sweep(Repo(str(repo)).store)
    kept = repo / ".git" / "lfs" / "theta" / "merged"
    store = Repo(str(repo)).store
    merged_values.keep(store, "a" * 64, memoryview(bytes(32 * 32 * 4)))
    merged_values.keep(store, "b" * 64, memoryview(bytes(32 * 32 * 4)))
    assert sorted(p.name for p in kept.iterdir()) == ["a" * 64]
    git(repo, "merge", "-q", "--no-edit", "left")
    assert read_st(repo / M).keys() == base.keys()


def test_git_theta_merge_resolves_a_conflict_whose_base_is_a_git_lfs_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import load_file

    repo, base = lfs_then_theta(tmp_path, monkeypatch, right="b")
    assert git(repo, "merge", "--no-edit", "left", check=False).returncode == 1
    assert main(["merge", "--strategy", "average", M]) == 0
    got = load_file(str(repo / M))
    want = (base["b"] + np.float32(1) + base["b"] * np.float32(2)) / np.float32(2)
    np.testing.assert_allclose(got["b"], want, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(got["c"], base["c"])
    git(repo, "commit", "-q", "--no-edit")
    assert git(repo, "status", "--porcelain").stdout == b""
