"""Unsafe set-ups are refused in one line before git can store a checkpoint's raw bytes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import git
from st_files import f32, st_from_arrays

from git_theta.commands.cli import main

NOT_SET_UP = (
    "git-theta: error: git-theta's filter is not configured for this repository: run "
    "`git theta install` (or `git theta install --local` for this repository only) first\n"
)


@pytest.fixture
def bare_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "r"
    path.mkdir()
    git(path, "init", "-q")
    monkeypatch.chdir(path)
    return path


def test_track_before_install_is_refused_and_writes_nothing(
    bare_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["track", "*.safetensors"]) == 1
    assert capsys.readouterr().err == NOT_SET_UP
    assert not (bare_repo / ".gitattributes").exists()
    assert not (bare_repo / ".git/hooks/pre-push").exists()


def test_theta_add_before_install_stages_nothing(
    bare_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (bare_repo / ".gitattributes").write_text("*.safetensors filter=theta diff=theta -text\n")
    (bare_repo / "m.safetensors").write_bytes(st_from_arrays(f32({"w": (64, 64)}, 1)))
    assert main(["add", "m.safetensors"]) == 1
    assert capsys.readouterr().err == NOT_SET_UP
    assert git(bare_repo, "ls-files").stdout == b""


def test_a_deleted_interpreter_says_to_install_again(
    bare_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["install", "--local"]) == 0
    gone = tmp_path / "old-venv/bin/python"
    git(bare_repo, "config", "filter.theta.process", f"{gone} -m git_theta filter-process")
    capsys.readouterr()
    assert main(["track", "*.pt"]) == 1
    assert capsys.readouterr().err == (
        f"git-theta: error: filter.theta.process runs {gone}, which no longer exists (a "
        "moved or deleted virtualenv?): run `git theta install` again\n"
    )
    assert not (bare_repo / ".gitattributes").exists()


def test_theta_checkout_without_the_filter_never_stages_weights(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (repo / "m.safetensors").write_bytes(st_from_arrays(f32({"w": (64, 64)}, 1)))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "m")
    staged = git(repo, "ls-files", "-s").stdout
    for key in ("process", "clean", "smudge"):
        git(repo, "config", "--global", "--unset", f"filter.theta.{key}")
    (repo / "m.safetensors").write_bytes(git(repo, "show", "HEAD:m.safetensors").stdout)
    capsys.readouterr()
    assert main(["checkout", "m.safetensors"]) == 1
    assert capsys.readouterr().err == NOT_SET_UP
    assert git(repo, "ls-files", "-s").stdout == staged
    done = subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=repo)
    assert done.returncode == 0


def test_a_gone_interpreter_in_git_s_own_commands_says_what_to_do(
    repo: Path, tmp_path: Path
) -> None:
    """git runs the configured commands itself: with their Python gone (a deleted
    virtualenv), git add prints our line first instead of only the shell's 'not found'."""
    from git_theta.commands import install

    gone = str(tmp_path / "deleted-venv/bin/python")
    real = install.python_argv()[0]
    for key, value in install.settings():
        if value.startswith("[ -x "):
            git(repo, "config", key, value.replace(real, gone))
    (repo / "m.safetensors").write_bytes(st_from_arrays(f32({"w": (8, 8)}, 1)))
    done = git(repo, "add", "m.safetensors", check=False)
    assert done.returncode != 0
    assert done.stderr.decode().splitlines()[0] == (
        f"git-theta: error: {gone}, the Python git-theta was installed with, is gone (a "
        "moved or deleted virtualenv?): reinstall git-theta and run `git theta install` again"
    )
    assert git(repo, "ls-files", "m.safetensors").stdout == b""
