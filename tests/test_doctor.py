"""``git theta doctor`` reports the set-up and its problems; ``uninstall`` undoes install."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import git

from git_theta.commands.cli import main


def test_doctor_on_a_good_repository_exits_0(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("git-theta ")
    assert "hook pre-push: git-theta's" in out
    assert "hook reference-transaction: git-theta's" in out
    assert any(line.startswith("git-theta objects: ") for line in out)
    assert not [line for line in out if line.startswith("problem:")]


def test_doctor_names_each_problem_with_what_to_run(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    git(repo, "lfs", "install", "--force")
    gone = tmp_path / "gone/bin/python"
    git(repo, "config", "filter.theta.process", f"{gone} -m git_theta filter-process")
    assert main(["doctor"]) == 1
    problems = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")
    ]
    assert problems == [
        f"problem: filter.theta.process runs {gone}, which no longer exists (a moved or "
        "deleted virtualenv?): run `git theta install` again",
        "problem: the pre-push hook is Git LFS's alone (git lfs install --force?): the next "
        "git-theta command puts git-theta's back; or run `git theta install --local`",
    ]


def test_uninstall_removes_exactly_what_install_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hermetic_git: Path
) -> None:
    work = tmp_path / "w"
    work.mkdir()
    git(work, "init", "-q")
    git(work, "lfs", "install")  # Git LFS's hooks first: ours chain them
    hooks = work / ".git/hooks"
    lfs_hook = (hooks / "pre-push").read_bytes()
    config_before = (hermetic_git / ".gitconfig").read_bytes()
    monkeypatch.chdir(work)
    assert main(["install"]) == 0
    assert (hooks / "pre-push").read_bytes() == lfs_hook  # a global install leaves it
    assert main(["track", "*.safetensors"]) == 0  # the repository's first set-up: hooks
    assert (hooks / "pre-push").read_bytes() != lfs_hook
    assert main(["uninstall"]) == 0
    assert (hooks / "pre-push").read_bytes() == lfs_hook
    assert not (hooks / "pre-push.theta-chained").exists()
    assert not (hooks / "reference-transaction").exists()
    assert (hermetic_git / ".gitconfig").read_bytes() == config_before
    assert git(work, "config", "--get-regexp", "theta", check=False).stdout == b""


def test_uninstall_keeps_keys_install_did_not_write(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = repo / ".git/config"
    git(repo, "config", "diff.theta.xfuncname", "^tensor")  # the user's own, beside ours
    git(repo, "config", "theta.note", "mine")
    before = config.read_bytes()
    assert main(["install", "--local"]) == 0
    capsys.readouterr()
    assert main(["uninstall", "--local"]) == 0
    assert config.read_bytes() == before
    assert capsys.readouterr().err.splitlines()[0] == (
        "git-theta: removed the 9 keys git-theta install writes from the local git config "
        "(kept diff.theta.xfuncname, which it does not write)"
    )
