"""git-theta inside repositories that also use Git LFS for plain files (every Hugging Face
repository): whatever order the two tools set up their hooks in, a push sends both kinds of
objects and a fresh clone gets every file back exactly."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import git, lfs_objects, sha256
from lfs_server import LfsServer
from st_files import f32, st_from_arrays

from git_theta.commands.cli import main
from git_theta.hooks import MARKER
from git_theta.interpreter import python_argv

SHAPES = {"emb": (64, 16), "layer.weight": (16, 16), "layer.bias": (16,)}
TOKENIZER = b'{"vocab": {"a": 0, "b": 1}, "merges": []}\n' * 50


def lfs(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run git-lfs as a user would, letting it refuse (it exits 2 for a foreign hook)."""
    return git(repo, "lfs", *args, check=False)


def theta_setup(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["install"]) == 0
    monkeypatch.chdir(repo)
    assert main(["track", "*.safetensors"]) == 0


def lfs_setup(repo: Path) -> None:
    lfs(repo, "install")
    assert lfs(repo, "track", "*.json").returncode == 0


def theta_first(repo: Path, mp: pytest.MonkeyPatch) -> None:
    theta_setup(repo, mp)
    lfs_setup(repo)  # git lfs install refuses: "Hook already exists: pre-push"


def lfs_first(repo: Path, mp: pytest.MonkeyPatch) -> None:
    lfs_setup(repo)
    theta_setup(repo, mp)


def then_lfs_update(repo: Path, mp: pytest.MonkeyPatch) -> None:
    theta_first(repo, mp)
    lfs(repo, "update")


def then_lfs_install_force(repo: Path, mp: pytest.MonkeyPatch) -> None:
    """Git LFS overwrites our hook with its own; nothing of git-theta runs before the push."""
    lfs_first(repo, mp)
    assert lfs(repo, "install", "--force").returncode == 0
    assert MARKER not in (repo / ".git/hooks/pre-push").read_text()


def theta_first_then_lfs_force(repo: Path, mp: pytest.MonkeyPatch) -> None:
    theta_setup(repo, mp)
    assert lfs(repo, "install", "--force").returncode == 0
    assert lfs(repo, "track", "*.json").returncode == 0


def later_lfs_track(repo: Path, mp: pytest.MonkeyPatch) -> None:
    """Git LFS set up once for the user (filters only, as `git lfs install` run outside
    any repository leaves it): no Git LFS hook in this repository, ever."""
    assert lfs(repo, "install", "--skip-repo").returncode == 0
    theta_setup(repo, mp)
    assert lfs(repo, "track", "*.json").returncode == 0


ORDERS: dict[str, Callable[[Path, pytest.MonkeyPatch], None]] = {
    "theta-first": theta_first,
    "lfs-first": lfs_first,
    "lfs-update": then_lfs_update,
    "lfs-install-force": then_lfs_install_force,
    "theta-first-lfs-force": theta_first_then_lfs_force,
    "later-lfs-track": later_lfs_track,
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_both_kinds_of_objects_reach_the_server_in_any_hook_order(
    order: str, tmp_path: Path, server: LfsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    ORDERS[order](work, monkeypatch)
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(work, "remote", "add", "origin", f"file://{remote}")
    git(work, "config", "lfs.transfer.maxretries", "1")
    (work / ".lfsconfig").write_text(f'[lfs]\n\turl = "{server.url("hf")}"\n')
    (work / "tokenizer.json").write_bytes(TOKENIZER)
    (work / "README.md").write_text("# a model\n")
    (work / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    want = {name: sha256(work / name) for name in ("tokenizer.json", "README.md")}
    want["model.safetensors"] = sha256(work / "model.safetensors")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "model, tokenizer, readme")
    assert git(work, "lfs", "ls-files", "-n").stdout.decode().split() == ["tokenizer.json"]
    git(work, "push", "-q", "origin", "main")

    # The plain LFS file's object and every tensor object are on the server.
    tokenizer_oid = git(work, "lfs", "ls-files", "-l").stdout.decode().split()[0]
    assert tokenizer_oid in server.objects()
    local = {p.name for p in (work / ".git/lfs/theta/objects").rglob("*") if p.is_file()}
    assert local <= server.objects()
    # Our hook is in front again, whatever git-lfs did to it.
    assert MARKER in (work / ".git/hooks/pre-push").read_text()

    copy = tmp_path / "copy"
    done = subprocess.run(
        ["git", "clone", "-q", f"file://{remote}", str(copy)], capture_output=True, env=os.environ
    )
    assert done.returncode == 0, done.stderr.decode()
    assert {name: sha256(copy / name) for name in want} == want
    assert git(copy, "status", "--porcelain").stdout == b""


def test_force_replaced_hook_is_restored_by_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    theta_setup(work, monkeypatch)
    lfs(work, "install", "--force")
    hook = work / ".git/hooks/pre-push"
    lfs_hook = hook.read_text()
    assert MARKER not in lfs_hook
    git(work, "add", ".gitattributes")
    git(work, "commit", "-q", "-m", "attributes")
    assert MARKER in hook.read_text()
    assert (work / ".git/hooks/pre-push.theta-chained").read_text() == lfs_hook
    # Replaced again (the chained copy exists now): still restored, nothing lost.
    lfs(work, "install", "--force")
    git(work, "commit", "-q", "--allow-empty", "-m", "again")
    assert MARKER in hook.read_text()
    assert (work / ".git/hooks/pre-push.theta-chained").read_text() == lfs_hook


def test_git_lfs_prune_cannot_lose_tensor_objects(
    repo: Path, tmp_path: Path, server: LfsServer
) -> None:
    """`git lfs prune` deletes every object no LFS pointer names, which is every tensor
    object; ours live where it does not look, so every commit still checks out."""
    git(repo, "lfs", "install", "--skip-repo")
    assert lfs(repo, "track", "*.json").returncode == 0
    git(repo, "remote", "add", "origin", f"file://{tmp_path / 'origin.git'}")
    git(tmp_path, "init", "-q", "--bare", str(tmp_path / "origin.git"))
    (repo / ".lfsconfig").write_text(f'[lfs]\n\turl = "{server.url("prune")}"\n')
    shas = {}
    for seed in (1, 2):
        (repo / "tokenizer.json").write_bytes(TOKENIZER + bytes([seed]))
        (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed)))
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"v{seed}")
        shas[git(repo, "rev-parse", "HEAD").stdout.decode().strip()] = sha256(
            repo / "model.safetensors"
        )
    git(repo, "push", "-q", "origin", "main")  # pushed: git lfs prune may delete anything
    for p in (repo / ".git/lfs").rglob("*"):
        if p.is_file():
            os.utime(p, (1, 1))
    ours = lfs_objects(repo)
    for args in (("prune", "--force"), ("fetch", "--prune")):
        done = lfs(repo, *args)
        assert done.returncode == 0, done.stderr.decode()
    assert lfs_objects(repo) == ours  # not one tensor object lost (or to download again)
    plain = {p.name for p in (repo / ".git/lfs/objects").rglob("*") if p.is_file()}
    assert hashlib.sha256(TOKENIZER + b"\x01").hexdigest() not in plain  # it did prune
    for commit, sha in shas.items():
        git(repo, "checkout", "-q", commit)
        assert sha256(repo / "model.safetensors") == sha


def test_objects_an_older_git_theta_kept_in_git_lfs_dir_are_taken_in(repo: Path) -> None:
    """Repositories made before the store moved: objects in git-lfs's directory still check
    out, and are linked into ours so a later `git lfs prune` loses nothing."""
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 3)))
    sha = sha256(repo / "model.safetensors")
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v3")
    ours, theirs = repo / ".git/lfs/theta/objects", repo / ".git/lfs/objects"
    theirs.mkdir(parents=True, exist_ok=True)
    for p in list(ours.rglob("*")):
        if p.is_file():
            dest = theirs / p.relative_to(ours)
            dest.parent.mkdir(parents=True, exist_ok=True)
            p.rename(dest)
    (repo / "model.safetensors").unlink()
    git(repo, "checkout", "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == sha
    assert {p.name for p in ours.rglob("*") if p.is_file()} == {
        p.name for p in theirs.rglob("*") if p.is_file()
    }
    assert git(repo, "lfs", "prune", "--force", check=False).returncode == 0
    (repo / "model.safetensors").unlink()
    git(repo, "checkout", "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == sha


def test_a_chained_hook_that_only_mentions_git_lfs_does_not_stop_its_upload(
    tmp_path: Path, server: LfsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    hook = work / ".git/hooks/pre-push"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text("#!/bin/sh\n# we used to call git lfs pre-push here\nexit 0\n")
    hook.chmod(0o755)
    assert lfs(work, "install", "--skip-repo").returncode == 0
    later_lfs_track(work, monkeypatch)  # git-theta chains the user's hook
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(work, "remote", "add", "origin", f"file://{remote}")
    (work / ".lfsconfig").write_text(f'[lfs]\n\turl = "{server.url("mention")}"\n')
    (work / "tokenizer.json").write_bytes(TOKENIZER)
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "tokenizer")
    git(work, "push", "-q", "origin", "main")
    assert hashlib.sha256(TOKENIZER).hexdigest() in server.objects()


def test_ref_updates_never_need_a_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unusable TMPDIR must not abort `git commit` (a chained reference-transaction
    hook, which gets git's input through ours) nor refuse a push."""
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    theirs = work / ".git/hooks/reference-transaction"
    theirs.parent.mkdir(parents=True, exist_ok=True)
    theirs.write_text("#!/bin/sh\ncat >/dev/null\nexit 0\n")
    theirs.chmod(0o755)
    theta_setup(work, monkeypatch)
    assert (work / ".git/hooks/reference-transaction.theta-chained").exists()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "no-such-dir"))
    git(work, "add", ".gitattributes")
    git(work, "commit", "-q", "-m", "attributes")
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(work, "push", "-q", f"file://{remote}", "main")
    assert git(remote, "rev-parse", "main").stdout == git(work, "rev-parse", "main").stdout


def test_a_shared_hooks_path_without_our_upload_is_said_on_every_command(repo: Path) -> None:
    """core.hooksPath set after set-up (husky...): git-theta does not write there, and a
    push would leave a repository nobody can clone, so every command says so."""
    shared = repo / ".husky"
    shared.mkdir()
    git(repo, "config", "core.hooksPath", ".husky")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 4)))
    done = git(repo, "add", "model.safetensors")
    warning = done.stderr.decode().splitlines()
    assert len(warning) == 1 and warning[0].startswith(
        f"git-theta: warning: core.hooksPath is {shared}, outside this repository"
    ), warning
    assert warning[0].endswith("or pushes will not upload tensor objects")
    doctor = git(repo, "theta", "doctor", check=False)
    assert doctor.returncode == 1
    assert b"hook pre-push: does not run git-theta's upload\n" in doctor.stdout
    assert b"\nproblem: core.hooksPath is " in doctor.stdout
    # With the lines added by hand, nothing more is said.
    theta = " ".join(shlex.quote(a) for a in python_argv("-m", "git_theta"))
    (shared / "pre-push").write_text(f'#!/bin/sh\n{theta} pre-push "$@" || exit $?\n')
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 5)))
    assert git(repo, "add", "model.safetensors").stderr == b""


def test_a_chained_hook_that_pushes_elsewhere_sends_git_lfs_objects_there_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    backup = tmp_path / "backup.git"
    git(tmp_path, "init", "-q", "--bare", str(backup))
    hook = work / ".git/hooks/pre-push"
    hook.parent.mkdir(parents=True, exist_ok=True)
    # A user's hook that mirrors every push to a backup (file:// remotes need no server).
    hook.write_text(
        f'#!/bin/sh\ncase "$1" in *backup*) exit 0 ;; esac\ngit push -q file://{backup} HEAD:main\n'
    )
    hook.chmod(0o755)
    later_lfs_track(work, monkeypatch)
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(origin))
    git(work, "remote", "add", "origin", f"file://{origin}")
    (work / "tokenizer.json").write_bytes(TOKENIZER)
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "tokenizer")
    git(work, "push", "-q", "origin", "main")
    oid = hashlib.sha256(TOKENIZER).hexdigest()
    for remote in (origin, backup):
        assert (remote / "lfs/objects" / oid[:2] / oid[2:4] / oid).is_file(), remote
