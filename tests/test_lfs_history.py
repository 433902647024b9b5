"""A path Git LFS tracked before git-theta took it over: its older commits hold LFS pointers,
and every git command on them still gives the checkpoint, never the pointer's text."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import git, sha256
from st_files import f32, st_from_arrays

from git_theta.commands.cli import main

SHAPES = {"emb": (64, 16), "layer.weight": (16, 16), "layer.bias": (16,)}


def write(repo: Path, seed: int) -> str:
    values = f32(SHAPES, 1)
    values["layer.bias"] += seed  # one tensor changes from version to version
    (repo / "model.safetensors").write_bytes(st_from_arrays(values))
    return sha256(repo / "model.safetensors")


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.decode().strip()


@pytest.fixture
def mixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, str]]:
    """Two Git LFS versions, then git-theta takes the path over and commits a third."""
    repo = tmp_path / "hf"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "lfs", "install")
    git(repo, "lfs", "track", "*.safetensors")
    shas = {}
    for seed in (1, 2):
        sha = write(repo, seed)
        shas[commit(repo, f"lfs v{seed}")] = sha
    assert git(repo, "lfs", "ls-files", "-n").stdout.decode().split() == ["model.safetensors"]
    assert main(["install"]) == 0
    monkeypatch.chdir(repo)
    assert main(["track", "*.safetensors"]) == 0
    git(repo, "add", ".gitattributes")
    sha = write(repo, 3)
    shas[commit(repo, "git-theta v3")] = sha
    assert git(repo, "show", "HEAD:model.safetensors").stdout.startswith(b'{\n "git-theta"')
    return repo, shas


def test_track_says_what_it_took_from_git_lfs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "lfs", "track", "*.safetensors")
    assert main(["install"]) == 0
    monkeypatch.chdir(repo)
    capsys.readouterr()
    assert main(["track", "*.safetensors"]) == 0
    assert capsys.readouterr().err.splitlines()[1] == (
        "git-theta: *.safetensors was tracked by Git LFS (filter=lfs): git-theta tracks it "
        "now. Earlier commits keep their Git LFS versions, which still check out; to rewrite "
        "them as git-theta versions run `git theta migrate import --include '*.safetensors' "
        "--everything`"
    )
    assert (repo / ".gitattributes").read_text() == (
        "*.safetensors filter=theta diff=theta merge=theta -text\n"
    )


def test_lfs_versions_check_out_by_commit_and_by_path(mixed: tuple[Path, dict[str, str]]) -> None:
    repo, shas = mixed
    first, _second, third = shas
    git(repo, "checkout", "-q", first, "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == shas[first]
    assert subprocess.run(["git", "status", "--porcelain"], cwd=repo).returncode == 0
    git(repo, "checkout", "-q", third, "--", "model.safetensors")
    for commit_id, sha in shas.items():
        git(repo, "checkout", "-q", commit_id)
        assert sha256(repo / "model.safetensors") == sha, commit_id
        status = git(repo, "status", "--porcelain").stdout.decode()
        assert status == "", (commit_id, status)


def test_lfs_versions_check_out_in_a_fresh_clone(
    mixed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    repo, shas = mixed
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    git(repo, "push", "-q", "origin", "main")
    copy = tmp_path / "copy"
    git(tmp_path, "clone", "-q", f"file://{remote}", str(copy))
    for commit_id, sha in shas.items():
        git(copy, "checkout", "-q", commit_id)
        assert sha256(copy / "model.safetensors") == sha, commit_id


def test_lfs_versions_diff_as_checkpoints(mixed: tuple[Path, dict[str, str]]) -> None:
    repo, shas = mixed
    first, second, third = shas
    for args in (
        ("diff", first, third, "--", "model.safetensors"),
        ("diff", second, third),
        ("log", "-p"),
        ("show", second),
        ("show", third),
    ):
        done = git(repo, *args, check=False)
        assert done.returncode == 0, (args, done.stderr.decode())
        assert b"version https://git-lfs" not in done.stdout, args
    out = git(repo, "theta", "diff", second, third).stdout.decode()
    assert "layer.bias" in out and "emb" not in out, out


def test_a_corrupt_lfs_version_is_refused_by_theta_diff_too(
    mixed: tuple[Path, dict[str, str]],
) -> None:
    repo, shas = mixed
    first, _second, third = shas
    pointer = git(repo, "cat-file", "blob", f"{first}:model.safetensors").stdout.decode()
    oid = pointer.split("oid sha256:")[1].split()[0]
    obj = repo / ".git/lfs/objects" / oid[:2] / oid[2:4] / oid
    data = bytearray(obj.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    obj.chmod(0o644)
    obj.write_bytes(bytes(data))
    done = git(repo, "theta", "diff", first, third, check=False)
    assert done.returncode == 1
    assert done.stderr.decode() == (
        f"git-theta: error: {first}:model.safetensors: Git LFS object {oid} is corrupt "
        "(its sha256 does not match)\n"
    )
