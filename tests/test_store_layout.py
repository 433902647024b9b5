"""Where objects live, against real git and git-lfs: git-theta's in LFS_DIR/theta/objects
(out of `git lfs prune`'s reach, those an older git-theta left in git-lfs's directory
included), plain Git LFS objects in git-lfs's LFS_DIR/objects (where it frees them); and
a damaged copy is moved aside so that the next fetch or checkout downloads it again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import git, lfs_objects, sha256
from faults.harness import can_mount, read_only
from lfs_server import LfsServer
from st_files import f32, st_from_arrays

from git_theta import codec
from git_theta.commands.cli import main
from git_theta.store import LAYOUT, THETA_MAGICS
from git_theta.updates import factored, sparse

MODEL = "model.safetensors"
SHAPES = {"emb": (64, 16), "bias": (16,)}
BIG = {"big": (2048, 1024), "bias": (16,)}  # 8 MiB: checked out as a stream
MOVED_ASIDE = "; moved aside: run `git theta fetch` or check out again"
GOLDEN_OBJECTS = Path(__file__).parent / "golden" / "objects"


def names(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def ours(repo: Path) -> Path:
    return repo / ".git/lfs/theta/objects"


def theirs(repo: Path) -> Path:
    return repo / ".git/lfs/objects"


def where(root: Path, oid: str) -> Path:
    return root / oid[:2] / oid[2:4] / oid


def commit_model(repo: Path, seed: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> str:
    """Commit a model of ``seed``; return its sha256."""
    (repo / MODEL).write_bytes(st_from_arrays(f32(shapes, seed)))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", f"v{seed}")
    return sha256(repo / MODEL)


def older_layout(repo: Path) -> None:
    """What yesterday's git-theta left: every object in git-lfs's directory, no stamp."""
    for path in list(ours(repo).rglob("*")):
        if path.is_file():
            dest = theirs(repo) / path.relative_to(ours(repo))
            dest.parent.mkdir(parents=True, exist_ok=True)
            path.rename(dest)
    (repo / ".git/lfs/theta" / LAYOUT).unlink(missing_ok=True)


def check_out(repo: Path) -> subprocess.CompletedProcess[bytes]:
    (repo / MODEL).unlink(missing_ok=True)
    return git(repo, "checkout", "--", MODEL, check=False)


def test_every_kind_of_object_starts_with_a_magic_the_store_knows() -> None:
    """The store tells git-theta's objects from plain ones by these bytes: a new kind of
    object must be added to THETA_MAGICS (or `git lfs prune` may delete it)."""
    assert {codec.MAGIC, sparse.MAGIC, factored.MAGIC} == THETA_MAGICS
    fixtures = sorted(GOLDEN_OBJECTS.glob("*.gtho"))
    assert len(fixtures) > 30  # every plane method, sparse, delta, low-rank, ia3, glue
    for path in fixtures:
        assert path.read_bytes()[:4] in THETA_MAGICS, path.name


def test_an_older_repository_loses_nothing_to_git_lfs_prune(repo: Path) -> None:
    """Objects an older git-theta kept in git-lfs's directory are all taken into ours by
    the first git-theta command, not only those it looks up: unpushed history survives
    a `git lfs prune`."""
    shas = {}
    for seed in (1, 2):
        sha = commit_model(repo, seed)
        shas[git(repo, "rev-parse", "HEAD").stdout.decode().strip()] = sha
    stored = lfs_objects(repo)
    older_layout(repo)
    assert check_out(repo).returncode == 0  # looks up HEAD's objects only
    assert (repo / ".git/lfs/theta" / LAYOUT).is_file()
    assert names(ours(repo)) == stored
    assert git(repo, "lfs", "prune").returncode == 0
    for commit, sha in shas.items():
        git(repo, "checkout", "-q", commit)
        assert sha256(repo / MODEL) == sha


def test_processes_taking_in_an_older_store_at_once_all_finish(repo: Path) -> None:
    for seed in (1, 2, 3):
        commit_model(repo, seed)
    stored = lfs_objects(repo)
    older_layout(repo)
    code = "from git_theta.repo import Repo; Repo().store.settle()"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=repo, stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    for proc in procs:
        _, err = proc.communicate()
        assert proc.returncode == 0, err.decode()
    assert names(ours(repo)) == stored
    leftovers = [p.name for p in (repo / ".git/lfs").rglob("*") if ".theta-" in p.name]
    assert leftovers == []
    assert (repo / ".git/lfs/theta" / LAYOUT).is_file()


@pytest.mark.skipif(not can_mount(), reason="needs a read-only bind mount (root)")
def test_a_read_only_older_store_is_read_in_place_and_taken_in_later(repo: Path) -> None:
    sha = commit_model(repo, 1)
    stored = lfs_objects(repo)
    older_layout(repo)
    (repo / ".git/lfs/tmp").mkdir(exist_ok=True)
    with read_only(repo / ".git/lfs"):
        done = check_out(repo)
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(repo / MODEL) == sha
    assert not (repo / ".git/lfs/theta" / LAYOUT).exists()
    assert check_out(repo).returncode == 0  # writable again: sorted now
    assert names(ours(repo)) == stored
    assert (repo / ".git/lfs/theta" / LAYOUT).is_file()


def mixed_history_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A clone (file://) of a repository whose model was a Git LFS file, then git-theta's;
    return it and the oid of the LFS version's object."""
    git(tmp_path, "lfs", "install", "--skip-repo")
    assert main(["install"]) == 0
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    monkeypatch.chdir(work)
    git(work, "lfs", "track", MODEL)
    (work / MODEL).write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(work, "add", ".gitattributes", MODEL)
    git(work, "commit", "-q", "-m", "an LFS file")
    assert main(["track", MODEL]) == 0
    (work / MODEL).write_bytes(st_from_arrays(f32(SHAPES, 2)))
    git(work, "add", ".gitattributes", MODEL)
    git(work, "commit", "-q", "-m", "git-theta's")
    remote = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(work, "remote", "add", "origin", f"file://{remote}")
    git(work, "push", "-q", "origin", "main")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", f"file://{remote}", str(clone))
    pointer = git(clone, "cat-file", "-p", f"HEAD~1:{MODEL}").stdout.decode()
    oid = pointer.split("oid sha256:")[1][:64]
    monkeypatch.chdir(clone)
    return clone, oid


@pytest.mark.parametrize("how", ["diff", "checkout"])
def test_plain_lfs_objects_from_a_file_remote_land_where_git_lfs_prune_frees_them(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clone, oid = mixed_history_clone(tmp_path, monkeypatch)
    if how == "diff":
        done = subprocess.run(["git", "theta", "diff", "HEAD~1", "HEAD"], cwd=clone,
                              capture_output=True)  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()
    else:  # the LFS version under today's attributes: our filter smudges its pointer
        git(clone, "checkout", "HEAD~1", "--", MODEL)
        assert sha256(clone / MODEL) == sha256_of(st_from_arrays(f32(SHAPES, 1)))
    assert where(theirs(clone), oid).is_file()
    assert not where(ours(clone), oid).exists()


def sha256_of(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def manifest_oids(repo: Path) -> dict[str, str]:
    """The glue's and each tensor's (last) object oid in HEAD's manifest."""
    manifest = json.loads(git(repo, "show", f"HEAD:{MODEL}").stdout)
    out = {"glue": manifest["glue"]["oid"]}
    for name, entry in manifest["tensors"].items():
        out[name] = entry["chain"][-1]["oid"]
    return out


def damage(path: Path, how: str) -> None:
    """Damage ``path`` in a copy of its own (never the remote's hard-linked bytes)."""
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 1
    else:
        del data[-1:]
    path.unlink()
    path.write_bytes(bytes(data))


def pushed_to_file_remote(repo: Path, tmp_path: Path, shapes: dict[str, tuple[int, ...]]) -> str:
    remote = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    sha = commit_model(repo, 1, shapes)
    git(repo, "push", "-q", "origin", "main")
    return sha


@pytest.mark.parametrize(
    ("which", "shapes"),
    [("glue", SHAPES), ("emb", SHAPES), ("big", BIG)],
    ids=["header object", "tensor object", "streamed tensor object"],
)
def test_a_corrupt_object_of_the_right_size_is_moved_aside_and_downloaded_again(
    which: str, shapes: dict[str, tuple[int, ...]], repo: Path, tmp_path: Path
) -> None:
    sha = pushed_to_file_remote(repo, tmp_path, shapes)
    oid = manifest_oids(repo)[which]
    where(theirs(repo), oid).unlink(missing_ok=True)
    damage(where(ours(repo), oid), "flip")
    done = check_out(repo)
    assert done.returncode == 128
    (line,) = [ln for ln in done.stderr.decode().splitlines() if ln.startswith("git-theta:")]
    assert oid in line and line.endswith(MOVED_ASIDE), line
    assert (repo / ".git/lfs/theta/corrupt" / oid).is_file()
    fetch = subprocess.run(["git", "theta", "fetch"], cwd=repo, capture_output=True)
    assert fetch.returncode == 0, fetch.stderr.decode()
    assert sha256(where(ours(repo), oid)) == oid  # downloaded again
    assert check_out(repo).returncode == 0
    assert sha256(repo / MODEL) == sha


def test_a_damaged_base_under_an_intact_update_is_named_and_moved_aside(repo: Path) -> None:
    """A chain's objects are verified by the tensor's content hash, their sha256 only
    when that fails: a damaged base under an intact update must still be the object
    named and moved aside, not the update, and the add of a next version must not build
    on it (its previous value fails the same check, so it is stored afresh)."""
    values = f32(SHAPES, 1)
    (repo / MODEL).write_bytes(st_from_arrays(values))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "v1")
    values["emb"][0, :4] += 1.0  # a sparse update on the dense base
    (repo / MODEL).write_bytes(st_from_arrays(values))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "v2")
    chain = json.loads(git(repo, "show", f"HEAD:{MODEL}").stdout)["tensors"]["emb"]["chain"]
    assert [link["update"] for link in chain] == ["dense", "sparse"]
    base, update = chain[0]["oid"], chain[1]["oid"]
    damage(where(ours(repo), base), "flip")
    done = check_out(repo)
    assert done.returncode == 128
    (line,) = [ln for ln in done.stderr.decode().splitlines() if ln.startswith("git-theta:")]
    assert line == (
        f"git-theta: error: {MODEL}: tensor 'emb': object {base} is corrupt (its sha256 does "
        f"not match){MOVED_ASIDE}"
    ), line
    assert (repo / ".git/lfs/theta/corrupt" / base).is_file()
    assert where(ours(repo), update).is_file()  # the intact update stays
    values["emb"][1, :4] += 1.0
    (repo / MODEL).write_bytes(st_from_arrays(values))
    git(repo, "add", MODEL)
    staged = json.loads(git(repo, "show", f":{MODEL}").stdout)["tensors"]["emb"]["chain"]
    assert base not in {link["oid"] for link in staged}


def test_a_corrupt_copy_in_git_lfs_dir_is_not_taken_in_for_good(repo: Path, tmp_path: Path) -> None:
    """A damaged download (or an older git-theta's damaged object) in git-lfs's directory:
    the checkout that finds it moves it aside (both names of it), the next one downloads."""
    sha = pushed_to_file_remote(repo, tmp_path, SHAPES)
    oid = manifest_oids(repo)["emb"]
    where(theirs(repo), oid).parent.mkdir(parents=True, exist_ok=True)
    where(ours(repo), oid).rename(where(theirs(repo), oid))
    damage(where(theirs(repo), oid), "flip")
    done = check_out(repo)
    assert done.returncode == 128
    assert MOVED_ASIDE in done.stderr.decode()
    assert not where(ours(repo), oid).exists() and not where(theirs(repo), oid).exists()
    assert check_out(repo).returncode == 0
    assert sha256(repo / MODEL) == sha


def test_a_truncated_object_is_downloaded_again_from_an_lfs_server(
    repo: Path, server: LfsServer
) -> None:
    """A size check finds it missing, but a download (into git-lfs's directory) must then
    replace it, not be shadowed by it forever."""
    (repo / ".lfsconfig").write_text(f'[lfs]\n\turl = "{server.url("trunc")}"\n')
    git(repo, "add", ".lfsconfig")
    sha = commit_model(repo, 1)
    git(repo, "remote", "add", "origin", str(repo.parent / "unused.git"))
    git(repo.parent, "init", "-q", "--bare", "unused.git")
    git(repo, "push", "-q", "origin", "main")
    oid = manifest_oids(repo)["emb"]
    assert oid in server.objects()
    where(theirs(repo), oid).unlink(missing_ok=True)
    damage(where(ours(repo), oid), "truncate")
    done = check_out(repo)
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(repo / MODEL) == sha
    assert (repo / ".git/lfs/theta/corrupt" / oid).is_file()


def test_the_stamp_costs_one_lstat_once_written(repo: Path, tmp_path: Path) -> None:
    """A settled store is never walked again: a tiny add reads no object directory."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    commit_model(repo, 1)
    (repo / MODEL).write_bytes(st_from_arrays(f32(SHAPES, 2)))
    trace = tmp_path / "trace"
    subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=openat,lstat,newfstatat,statx",
         "-o", str(trace), "git", "add", MODEL],
        cwd=repo, check=True,
    )  # fmt: skip
    calls = trace.read_text().splitlines()
    stamp = [ln for ln in calls if f"theta/{LAYOUT}" in ln]
    assert len(stamp) == 1, stamp
    assert not [ln for ln in calls if "O_DIRECTORY" in ln and "lfs/objects" in ln]
