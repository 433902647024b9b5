"""``git theta fsck``: a good repository is clean; each kind of damage is one line, exit 1."""

from __future__ import annotations

import hashlib
import json
import shutil
import tracemalloc
from pathlib import Path

import pytest
from conftest import git
from lfs_server import LfsServer
from st_files import f32, st_from_arrays

from git_theta.commands.cli import main
from git_theta.store import ObjectStore

SHAPES = {"emb": (64, 16), "layer.weight": (16, 16), "layer.bias": (16,)}


def write(repo: Path, seed: int) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed)))


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


@pytest.fixture
def two_versions(repo: Path) -> Path:
    write(repo, 1)
    commit(repo, "v1")
    arrays = f32(SHAPES, 1)
    arrays["layer.bias"][3] += 1  # a sparse update on top of v1
    (repo / "model.safetensors").write_bytes(st_from_arrays(arrays))
    commit(repo, "v2")
    return repo


def fsck(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = main(["fsck", *args])
    out, err = capsys.readouterr()
    assert err == ""
    return code, out.splitlines()


def manifest(repo: Path, rev: str = "HEAD") -> dict[str, object]:
    data: dict[str, object] = json.loads(git(repo, "show", f"{rev}:model.safetensors").stdout)
    return data


def object_of(repo: Path, rev: str, name: str, link: int = -1) -> Path:
    tensors = manifest(repo, rev)["tensors"]
    assert isinstance(tensors, dict)
    return Path(ObjectStore(repo / ".git" / "lfs").path(tensors[name]["chain"][link]["oid"]))


def objects_needed(repo: Path, *revs: str) -> set[str]:
    oids = set()
    for rev in revs:
        m = manifest(repo, rev)
        assert isinstance(m["glue"], dict) and isinstance(m["tensors"], dict)
        oids.add(m["glue"]["oid"])
        oids |= {link["oid"] for e in m["tensors"].values() for link in e["chain"]}
    return oids


def test_a_good_repository_is_clean(two_versions: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = fsck(capsys)
    objects = len(objects_needed(two_versions, "HEAD", "HEAD~1"))
    assert code == 0
    assert lines == [
        f"git theta fsck: 2 manifests, 4 tensors, {objects} objects checked: no problems"
    ]
    assert fsck(capsys, "HEAD~1")[0] == 0


def test_a_deleted_object_is_one_line(
    two_versions: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = object_of(two_versions, "HEAD", "layer.bias")  # the sparse update
    path.unlink()
    code, lines = fsck(capsys)
    assert code == 1
    assert lines[:-1] == [
        f"HEAD:model.safetensors: tensor 'layer.bias': object {path.name} missing locally"
    ]
    assert lines[-1].endswith(": 1 problem")
    assert fsck(capsys, "HEAD~1")[0] == 0  # v1 does not need it


def test_a_corrupted_object_is_one_line(
    two_versions: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = object_of(two_versions, "HEAD~1", "emb")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    code, lines = fsck(capsys)
    assert code == 1
    # v1's emb is v2's too: one object, one line, under the first version naming it;
    # moved aside (as `git lfs fsck` does), so that a fetch downloads it again.
    assert lines[:-1] == [
        f"HEAD:model.safetensors: tensor 'emb': object {path.name} is corrupt "
        "(its sha256 does not match); moved aside: run `git theta fetch` or check out again"
    ]


def test_an_object_that_does_not_decode_to_the_tensor_is_one_line(
    two_versions: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Swap two objects of the same size class: each is intact, neither is its tensor.
    a = object_of(two_versions, "HEAD~1", "layer.weight")
    b = object_of(two_versions, "HEAD~1", "emb")
    data = b.read_bytes()
    bad = manifest(two_versions, "HEAD~1")
    tensors = bad["tensors"]
    assert isinstance(tensors, dict)
    tensors["layer.weight"]["chain"][0].update(oid=b.name, size=len(data))
    hostile = ('{\n "git-theta": 1, ' + json.dumps(bad)[len('{"git-theta": 1, ') :]).encode()
    blob = git(two_versions, "hash-object", "-w", "--stdin", stdin=hostile).stdout.decode().strip()
    git(two_versions, "update-index", "--cacheinfo", f"100644,{blob},model.safetensors")
    code, lines = fsck(capsys)
    assert code == 1
    assert lines[:-1] == [
        f":model.safetensors: tensor 'layer.weight': object {b.name}: content object declares "
        "4,096 bytes, more than the 1,024 expected"
    ]
    assert a.exists()


def test_a_bad_manifest_is_one_line(two_versions: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = manifest(two_versions)
    bad["layout"] = [-5, *bad["layout"]]  # type: ignore[misc]
    hostile = ('{\n "git-theta": 1, ' + json.dumps(bad)[len('{"git-theta": 1, ') :]).encode()
    blob = git(two_versions, "hash-object", "-w", "--stdin", stdin=hostile).stdout.decode().strip()
    git(two_versions, "update-index", "--cacheinfo", f"100644,{blob},model.safetensors")
    git(two_versions, "commit", "-q", "-m", "hostile")
    code, lines = fsck(capsys)
    assert code == 1
    assert lines[:-1] == [
        "HEAD:model.safetensors: invalid manifest: the layout holds a glue length of -5"
    ]
    assert fsck(capsys, "HEAD~1")[0] == 0


def test_remote_lacking_objects_is_named_without_downloading(
    two_versions: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(two_versions, "remote", "add", "origin", f"file://{remote}")
    git(two_versions, "push", "-q", "origin", "main")
    assert fsck(capsys, "--remote", "origin")[0] == 0
    gone = object_of(two_versions, "HEAD", "layer.bias")
    (remote / "lfs" / "objects" / gone.name[:2] / gone.name[2:4] / gone.name).unlink()
    code, lines = fsck(capsys, "--remote", "origin")
    assert code == 1
    assert lines[:-1] == [
        f"HEAD:model.safetensors: tensor 'layer.bias': object {gone.name} is not on remote 'origin'"
    ]
    assert lines[-1].endswith("checked and remote 'origin': 1 problem")


def test_an_http_remote_is_asked_through_the_batch_api(
    two_versions: Path, tmp_path: Path, server: LfsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(two_versions, "remote", "add", "origin", f"file://{remote}")
    git(two_versions, "config", "lfs.url", server.url("model"))
    code, lines = fsck(capsys, "--remote", "origin")  # nothing pushed yet
    assert code == 1
    assert len(lines) - 1 == len(objects_needed(two_versions, "HEAD", "HEAD~1"))
    assert all(" is not on remote 'origin'" in line for line in lines[:-1])
    git(two_versions, "push", "-q", "origin", "main")
    downloaded_before = sorted(p.name for p in (two_versions / ".git" / "lfs").rglob("*"))
    assert fsck(capsys, "--remote", "origin")[0] == 0
    assert sorted(p.name for p in (two_versions / ".git" / "lfs").rglob("*")) == downloaded_before
    assert len(server.objects()) == len(objects_needed(two_versions, "HEAD", "HEAD~1"))


def test_an_unknown_remote_is_one_error_line(
    two_versions: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fsck", "--remote", "nowhere"]) == 1
    _, err = capsys.readouterr()
    assert (
        err
        == "git-theta: error: 'nowhere' is not a remote with a Git LFS endpoint (`git remote -v`)\n"
    )


def test_outside_a_repository_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["fsck"]) == 1
    _, err = capsys.readouterr()
    assert (
        err == "git-theta: error: not inside a git work tree: run git theta fsck in a repository\n"
    )


# A path Git LFS tracked before git-theta took it over: its older commits hold Git LFS
# pointers, which check out through git-theta's filter and need their objects too.


@pytest.fixture
def lfs_then_theta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A Git LFS version of model.safetensors, then a git-theta one; returns the
    repository and the pointer's blob id."""
    repo = tmp_path / "hf"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "lfs", "install")
    git(repo, "lfs", "track", "model.safetensors")
    write(repo, 1)
    commit(repo, "lfs")
    assert main(["install"]) == 0
    monkeypatch.chdir(repo)
    assert main(["track", "model.safetensors"]) == 0
    write(repo, 2)
    commit(repo, "theta")
    pointer = git(repo, "rev-parse", "HEAD~1:model.safetensors").stdout.decode().strip()
    return repo, pointer


def lfs_oid(repo: Path, blob: str) -> str:
    return git(repo, "cat-file", "blob", blob).stdout.split(b"oid sha256:")[1][:64].decode()


def test_a_git_lfs_version_whose_object_is_gone_is_one_line(
    lfs_then_theta: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, pointer = lfs_then_theta
    oid = lfs_oid(repo, pointer)
    assert fsck(capsys)[0] == 0
    shutil.rmtree(repo / ".git/lfs/objects")  # git-theta's own objects are elsewhere
    code, lines = fsck(capsys)
    assert code == 1
    assert lines[:-1] == [
        f"model.safetensors (blob {pointer[:12]}): Git LFS pointer: object {oid} missing locally"
    ]
    assert lines[-1].endswith(": 1 problem")
    assert fsck(capsys, "HEAD~1")[1][:-1] == [
        f"HEAD~1:model.safetensors: Git LFS pointer: object {oid} missing locally"
    ]


def test_a_corrupt_or_short_git_lfs_object_is_one_line(
    lfs_then_theta: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, pointer = lfs_then_theta
    oid = lfs_oid(repo, pointer)
    path = Path(ObjectStore(repo / ".git/lfs").lfs_path(oid))
    good = path.read_bytes()
    path.chmod(0o644)
    for bad in (good[:-1] + bytes([good[-1] ^ 1]), good[:-1], good + b"\0"):
        path.write_bytes(bad)
        code, lines = fsck(capsys)
        assert code == 1
        assert lines[:-1] == [
            f"model.safetensors (blob {pointer[:12]}): Git LFS pointer: object {oid} is "
            "corrupt (its sha256 does not match)"
        ]
    # Where a download from a file:// remote is copied, git-theta's directory, is a
    # copy checkout reads too.
    path.unlink()
    ours = Path(ObjectStore(repo / ".git/lfs").path(oid))
    ours.parent.mkdir(parents=True, exist_ok=True)
    ours.write_bytes(good)
    assert fsck(capsys)[0] == 0


def test_a_pointer_at_a_path_git_theta_tracks_now_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "hf"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "lfs", "install")
    git(repo, "lfs", "track", "*.safetensors", "*.bin")
    write(repo, 1)
    (repo / "data.bin").write_bytes(b"Git LFS's alone\n")
    commit(repo, "lfs")
    assert main(["install"]) == 0
    monkeypatch.chdir(repo)
    assert main(["track", "*.safetensors"]) == 0  # no git-theta version committed yet
    git(repo, "commit", "-q", "-m", "track", "--", ".gitattributes")
    oid = lfs_oid(repo, "HEAD:model.safetensors")
    shutil.rmtree(repo / ".git/lfs/objects")
    capsys.readouterr()
    code, lines = fsck(capsys)
    assert code == 1  # data.bin is not git-theta's: `git lfs fsck` is for that
    assert lines == [
        f"HEAD:model.safetensors: Git LFS pointer: object {oid} missing locally",
        "git theta fsck: 0 manifests, 0 tensors, 1 objects checked: 1 problem",
    ]


def test_a_remote_lacking_a_git_lfs_version_is_named(
    lfs_then_theta: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, pointer = lfs_then_theta
    oid = lfs_oid(repo, pointer)
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    git(repo, "push", "-q", "origin", "main")
    assert fsck(capsys, "--remote", "origin")[0] == 0
    (remote / "lfs" / "objects" / oid[:2] / oid[2:4] / oid).unlink()
    code, lines = fsck(capsys, "--remote", "origin")
    assert code == 1
    assert lines[:-1] == [
        f"model.safetensors (blob {pointer[:12]}): Git LFS pointer: object {oid} is not on "
        "remote 'origin'"
    ]


def test_a_git_lfs_object_is_hashed_in_bounded_memory(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size, chunk = 96 << 20, bytes(range(256)) * 4096  # 1 MiB pieces, never the whole
    digest = hashlib.sha256()
    for _ in range(size // len(chunk)):
        digest.update(chunk)
    oid = digest.hexdigest()
    path = Path(ObjectStore(repo / ".git/lfs").lfs_path(oid))
    path.parent.mkdir(parents=True)
    with path.open("wb") as fh:
        for _ in range(size // len(chunk)):
            fh.write(chunk)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
    blob = git(repo, "hash-object", "-w", "--stdin", stdin=pointer.encode()).stdout.decode()
    git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob.strip()},big.safetensors")
    tracemalloc.start()
    try:
        code, lines = fsck(capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (code, lines) == (
        0,
        ["git theta fsck: 0 manifests, 0 tensors, 1 objects checked: no problems"],
    )
    assert peak < 32 << 20, peak
