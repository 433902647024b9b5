"""Push, clone, fetch and pull through real remotes: file:// and a giftless LFS server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import git, lfs_objects, sha256
from lfs_server import CuttingProxy, LfsServer
from st_files import f32, st_from_arrays

SHAPES = {"emb": (128, 32), "layer.weight": (32, 32), "layer.bias": (32,), "head": (32, 8)}


def write(repo: Path, seed: int, name: str = "model.safetensors") -> str:
    (repo / name).write_bytes(st_from_arrays(f32(SHAPES, seed)))
    return sha256(repo / name)


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.decode().strip()


def make_origin(tmp_path: Path, repo: Path, lfs_url: str | None = None) -> str:
    """A bare remote for ``repo``; with ``lfs_url`` the LFS objects go to that server."""
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    if lfs_url:
        (repo / ".lfsconfig").write_text(f'[lfs]\n\turl = "{lfs_url}"\n')
    return f"file://{remote}"


def history(repo: Path) -> dict[str, str]:
    """Three commits on main and one on a branch: commit -> sha256 of the checkpoint."""
    shas = {}
    for seed in (1, 2, 3):
        sha = write(repo, seed)
        shas[commit(repo, f"v{seed}")] = sha
    git(repo, "checkout", "-q", "-b", "feature", "HEAD~1")
    sha = write(repo, 9)
    shas[commit(repo, "feature")] = sha
    git(repo, "checkout", "-q", "main")
    return shas


def clone(url: str, dest: Path, **env: str) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(
        ["git", "clone", "-q", url, str(dest)], capture_output=True, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr.decode()
    git(dest, "config", "lfs.transfer.maxretries", "1")
    return done


def check_every_commit(repo: Path, shas: dict[str, str]) -> None:
    for commit_id, sha in shas.items():
        git(repo, "checkout", "-q", commit_id)
        assert sha256(repo / "model.safetensors") == sha, commit_id
        assert git(repo, "status", "--porcelain").stdout == b""


def test_file_remote_push_clone_every_commit(repo: Path, tmp_path: Path) -> None:
    url = make_origin(tmp_path, repo)
    shas = history(repo)
    git(repo, "push", "-q", "origin", "main", "feature")
    stored = {
        p.name for p in (tmp_path / "origin.git" / "lfs" / "objects").rglob("*") if p.is_file()
    }
    assert stored == lfs_objects(repo)

    for name in ("second", "third"):
        other = tmp_path / name
        clone(url, other)
        git(other, "fetch", "-q", "origin", "feature:feature")
        check_every_commit(other, shas)


def test_file_remote_objects_are_copied_without_git_lfs_transfers(
    repo: Path, tmp_path: Path
) -> None:
    """A file:// remote's objects are copied straight from its LFS store (git-lfs's own
    adapter moves them one at a time); a corrupt copy there is never taken."""
    url = make_origin(tmp_path, repo)
    shas = history(repo)
    git(repo, "push", "-q", "origin", "main", "feature")
    trace = tmp_path / "trace"
    clone(url, tmp_path / "copy", GIT_TRACE=str(trace))
    assert "lfs filter-process" not in trace.read_text()  # no git-lfs transfer was started
    git(tmp_path / "copy", "fetch", "-q", "origin", "feature:feature")
    check_every_commit(tmp_path / "copy", shas)

    # Flip one byte of one object on the remote: the shortcut refuses it, git-lfs then
    # gets its turn, and the checkout fails naming the tensor with no partial file.
    manifest = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)
    oid = manifest["tensors"]["emb"]["chain"][0]["oid"]
    (stored,) = (tmp_path / "origin.git" / "lfs" / "objects").rglob(oid)
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 1
    stored.chmod(0o644)
    stored.write_bytes(bytes(data))
    dest = tmp_path / "broken"
    done = subprocess.run(["git", "clone", "-q", url, str(dest)], capture_output=True)
    assert done.returncode != 0
    assert f"object {oid} for tensor 'emb'" in done.stderr.decode()
    assert not (dest / "model.safetensors").exists()
    assert not list((dest / ".git" / "lfs" / "objects").rglob(oid))


def test_file_remote_with_its_own_lfs_storage_clones(repo: Path, tmp_path: Path) -> None:
    """Pushes put objects under the remote's lfs.storage; downloads look there too (plain
    git-lfs 3.3 looks in the default place and fails to clone)."""
    url = make_origin(tmp_path, repo)
    git(tmp_path / "origin.git", "config", "lfs.storage", str(tmp_path / "elsewhere"))
    shas = history(repo)
    git(repo, "push", "-q", "origin", "main", "feature")
    assert not (tmp_path / "origin.git" / "lfs").exists()
    clone(url, tmp_path / "copy")
    git(tmp_path / "copy", "fetch", "-q", "origin", "feature:feature")
    check_every_commit(tmp_path / "copy", shas)


def test_lfs_server_round_trip_push_from_clone_and_pull(
    repo: Path, tmp_path: Path, server: LfsServer
) -> None:
    url = make_origin(tmp_path, repo, server.url("model"))
    shas = history(repo)
    git(repo, "push", "-q", "origin", "main", "feature")
    assert server.objects() == lfs_objects(repo)

    second = tmp_path / "second"
    clone(url, second)
    git(second, "fetch", "-q", "origin", "feature:feature")
    check_every_commit(second, shas)

    # The second clone pushes a new version (a new branch first, then main); the first pulls.
    git(second, "checkout", "-q", "main")
    v4 = write(second, 4)
    commit(second, "v4 from the second clone")
    git(second, "push", "-q", "origin", "main:from-second", "main")
    git(repo, "pull", "-q", "--no-rebase", "origin", "main")
    assert sha256(repo / "model.safetensors") == v4

    third = tmp_path / "third"
    clone(url, third)
    assert sha256(third / "model.safetensors") == v4


def test_stopped_server_fails_push_cleanly_and_retry_succeeds(
    repo: Path, tmp_path: Path, server: LfsServer
) -> None:
    url = make_origin(tmp_path, repo, server.url("model"))
    write(repo, 1)
    first = commit(repo, "v1")
    git(repo, "push", "-q", "origin", "main")
    v2 = write(repo, 2)
    commit(repo, "v2")

    server.stop()
    done = git(repo, "push", "origin", "main", check=False)
    assert done.returncode != 0
    assert "git-theta: error:" in done.stderr.decode()
    remote_main = git(repo, "ls-remote", url, "refs/heads/main").stdout.decode().split()[0]
    assert remote_main == first  # refs were not updated

    server.start()
    git(repo, "push", "-q", "origin", "main")
    fresh = tmp_path / "fresh"
    clone(url, fresh)
    assert sha256(fresh / "model.safetensors") == v2


def test_server_dying_mid_upload_fails_push_and_retry_loses_nothing(
    repo: Path, tmp_path: Path, server: LfsServer
) -> None:
    import hashlib

    import numpy as np

    proxy = CuttingProxy(server.port)
    url = make_origin(tmp_path, repo, proxy.url("model"))
    rng = np.random.default_rng(5)
    shas = {}
    for version in range(2):  # ~10 MB objects, so the cut lands inside an upload
        big = rng.standard_normal((1024, 3072)).astype(np.float32)
        (repo / "model.safetensors").write_bytes(st_from_arrays({"big": big}))
        shas[commit(repo, f"v{version}")] = sha256(repo / "model.safetensors")

    proxy.start(cut_after=3 << 20)
    done = git(repo, "push", "origin", "main", check=False)
    assert proxy.cut.is_set()  # the connection really was cut mid-transfer
    assert done.returncode != 0
    first = done.stderr.decode().splitlines()[0]
    assert first.startswith(
        "git-theta: error: uploading 3 content object(s) to 'origin' failed, so no ref was "
        "pushed; push again once the server is reachable (git-lfs: "
    )
    assert git(repo, "ls-remote", url).stdout == b""  # no ref reached the remote
    server.stop()  # the server process dies too; the retry meets a restarted one

    server.start()
    proxy.start()
    git(repo, "push", "-q", "origin", "main")
    for oid in server.objects():  # nothing half-written kept under an object's name
        stored = next(server.storage.rglob(oid)).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == oid
    fresh = tmp_path / "fresh"
    clone(url, fresh)
    check_every_commit(fresh, shas)
    proxy.stop()


def test_object_missing_on_remote_fails_checkout_naming_it(
    repo: Path, tmp_path: Path, server: LfsServer
) -> None:
    url = make_origin(tmp_path, repo, server.url("model"))
    write(repo, 1)
    commit(repo, "v1")
    git(repo, "push", "-q", "origin", "main")
    manifest = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)
    oid = manifest["tensors"]["head"]["chain"][0]["oid"]
    for path in server.storage.rglob(oid):
        path.unlink()

    dest = tmp_path / "broken"
    done = subprocess.run(["git", "clone", "-q", url, str(dest)], capture_output=True)
    assert done.returncode != 0
    assert (
        f"git-theta: error: model.safetensors: object {oid} for tensor 'head' is not in the "
        "local Git LFS store and could not be downloaded from the Git LFS remote"
    ) in done.stderr.decode()
    assert not (dest / "model.safetensors").exists()


def test_skip_smudge_then_checkout_in_place(repo: Path, tmp_path: Path) -> None:
    url = make_origin(tmp_path, repo)
    sha = write(repo, 1)
    commit(repo, "v1")
    git(repo, "push", "-q", "origin", "main")

    lazy = tmp_path / "lazy"
    clone(url, lazy, GIT_THETA_SKIP_SMUDGE="1")
    assert (lazy / "model.safetensors").read_bytes().startswith(b'{\n "git-theta": 1')
    assert lfs_objects(lazy) == set()
    assert git(lazy, "status", "--porcelain").stdout == b""

    done = subprocess.run(["git", "theta", "checkout"], cwd=lazy, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(lazy / "model.safetensors") == sha
    assert git(lazy, "status", "--porcelain").stdout == b""


def test_push_to_new_remote_needs_all_objects_then_fetch_all_fixes_it(
    repo: Path, tmp_path: Path
) -> None:
    url = make_origin(tmp_path, repo)
    write(repo, 1)
    old = commit(repo, "v1")
    sha2 = write(repo, 2)
    commit(repo, "v2")
    git(repo, "push", "-q", "origin", "main")

    lazy = tmp_path / "lazy"
    clone(url, lazy, GIT_THETA_SKIP_SMUDGE="1")
    mirror = tmp_path / "mirror.git"
    git(tmp_path, "init", "-q", "--bare", str(mirror))
    git(lazy, "remote", "add", "mirror", f"file://{mirror}")
    done = git(lazy, "push", "mirror", "main", check=False)
    assert done.returncode != 0
    assert "push refused: object" in done.stderr.decode()
    assert "run `git theta fetch --all` and push again" in done.stderr.decode()

    fetched = subprocess.run(["git", "theta", "fetch", "--all"], cwd=lazy, capture_output=True)
    assert fetched.returncode == 0, fetched.stderr.decode()
    git(lazy, "push", "-q", "mirror", "main")
    copy = tmp_path / "copy"
    clone(f"file://{mirror}", copy)
    assert sha256(copy / "model.safetensors") == sha2
    git(copy, "checkout", "-q", old)


def test_hooks_chain_with_git_lfs_and_plain_lfs_files_still_travel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from git_theta.commands.cli import main

    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    git(work, "lfs", "install")  # global filter config, and hooks in this repository
    lfs_hook = (work / ".git/hooks/pre-push").read_text()
    assert "git lfs pre-push" in lfs_hook
    git(work, "lfs", "track", "*.json")
    assert main(["install"]) == 0
    monkeypatch.chdir(work)
    assert main(["track", "*.safetensors"]) == 0
    assert (work / ".git/hooks/pre-push.theta-chained").read_text() == lfs_hook

    url = make_origin(tmp_path, work)
    (work / "tokenizer.json").write_text('{"vocab": [1, 2, 3]}\n')
    sha = write(work, 1)
    commit(work, "model and tokenizer")
    git(work, "push", "-q", "origin", "main")

    other = tmp_path / "other"
    clone(url, other)
    assert sha256(other / "model.safetensors") == sha
    assert (other / "tokenizer.json").read_text() == '{"vocab": [1, 2, 3]}\n'
    assert git(other, "lfs", "ls-files", "-n").stdout.decode().split() == ["tokenizer.json"]
    shutil.rmtree(other)


def test_lfs_skip_smudge_for_plain_lfs_does_not_stop_tensor_downloads(
    repo: Path, tmp_path: Path
) -> None:
    url = make_origin(tmp_path, repo)
    sha = write(repo, 1)
    commit(repo, "v1")
    git(repo, "push", "-q", "origin", "main")
    other = tmp_path / "other"
    clone(url, other, GIT_LFS_SKIP_SMUDGE="1")
    assert sha256(other / "model.safetensors") == sha


def test_theta_checkout_refuses_to_overwrite_weights(repo: Path, tmp_path: Path) -> None:
    write(repo, 1)
    commit(repo, "v1")
    work = write(repo, 2)  # uncommitted weights in the work tree
    done = subprocess.run(
        ["git", "theta", "checkout", "model.safetensors"], cwd=repo, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "model.safetensors: the file holds weights, not a manifest" in done.stderr
    assert sha256(repo / "model.safetensors") == work


def test_tags_force_pushes_several_remotes_and_rejections(repo: Path, tmp_path: Path) -> None:
    url = make_origin(tmp_path, repo)
    backup = tmp_path / "backup.git"
    git(tmp_path, "init", "-q", "--bare", str(backup))
    git(repo, "remote", "add", "backup", f"file://{backup}")
    write(repo, 1)
    commit(repo, "v1")
    git(repo, "tag", "-a", "v1", "-m", "release 1")
    git(repo, "push", "-q", "origin", "main", "v1")
    git(repo, "push", "-q", "backup", "main", "--tags")

    # A rewritten history goes up with --force, objects and all.
    v2 = write(repo, 2)
    git(repo, "commit", "-q", "--amend", "-a", "-m", "v1, redone")
    git(repo, "push", "-q", "--force", "origin", "main")
    for remote in (url, f"file://{backup}"):
        dest = tmp_path / f"clone-{len(list(tmp_path.iterdir()))}"
        clone(remote, dest)
        git(dest, "checkout", "-q", "v1")
        assert sha256(dest / "model.safetensors") != v2
    fresh = tmp_path / "fresh"
    clone(url, fresh)
    assert sha256(fresh / "model.safetensors") == v2

    # A diverged remote: the push is rejected the normal git way, refs untouched.
    write(fresh, 3)
    commit(fresh, "from fresh")
    git(fresh, "push", "-q", "origin", "main")
    write(repo, 4)
    commit(repo, "diverged")
    done = git(repo, "push", "origin", "main", check=False)
    assert done.returncode != 0
    assert "[rejected]" in done.stderr.decode()
    remote_main = git(repo, "ls-remote", url, "refs/heads/main").stdout.decode().split()[0]
    assert remote_main == git(fresh, "rev-parse", "HEAD").stdout.decode().strip()


def test_merge_commits_push_from_a_fresh_clone(repo: Path, tmp_path: Path) -> None:
    url = make_origin(tmp_path, repo)
    write(repo, 1)
    commit(repo, "v1")
    git(repo, "push", "-q", "origin", "main")
    second = tmp_path / "second"
    clone(url, second)
    git(second, "checkout", "-q", "-b", "side")
    values = f32(SHAPES, 1)
    values["head"] += 1
    (second / "model.safetensors").write_bytes(st_from_arrays(values))
    commit(second, "side changes head")
    git(second, "checkout", "-q", "main")
    values = f32(SHAPES, 1)
    values["emb"] += 1
    (second / "model.safetensors").write_bytes(st_from_arrays(values))
    commit(second, "main changes emb")
    git(second, "merge", "-q", "--no-edit", "side")
    merged = sha256(second / "model.safetensors")
    git(second, "push", "-q", "origin", "main", "side")
    third = tmp_path / "third"
    clone(url, third)
    assert sha256(third / "model.safetensors") == merged


def test_unwritable_hooks_dir_is_one_line_and_checkout_still_works(repo: Path) -> None:
    sha = write(repo, 1)
    commit(repo, "v1")
    hooks = repo / ".git" / "hooks"
    shutil.rmtree(hooks)
    hooks.write_text("not a directory\n")  # the filter cannot install its pre-push hook
    (repo / "model.safetensors").unlink()
    done = git(repo, "checkout", "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == sha
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr.decode()
    assert lines[0] == (
        f"git-theta: error: a component of {hooks}/pre-push is not a directory: "
        "move that file aside"
    )


def test_push_without_git_lfs_is_refused_in_one_line(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = make_origin(tmp_path, repo)
    write(repo, 1)
    commit(repo, "v1")
    # A PATH with git, the venv and the hook's shell tools, but no git-lfs.
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("git", "sh", "mktemp", "cat", "dirname", "rm"):
        found = shutil.which(tool)
        assert found is not None
        (bare / tool).symlink_to(found)
    venv_bin = Path(shutil.which("git-theta") or "").parent
    monkeypatch.setenv("PATH", f"{bare}:{venv_bin}")
    done = subprocess.run(["git", "push", "origin", "main"], cwd=repo, capture_output=True)
    assert done.returncode != 0
    assert done.stderr.decode().splitlines()[0] == (
        "git-theta: error: git-lfs is not installed, so tensor objects cannot be uploaded "
        "and no ref was pushed (apt-get install git-lfs, or see https://git-lfs.com)"
    )
    assert git(repo, "ls-remote", url).stdout == b""
