"""git theta migrate: a Hugging Face style Git LFS history to git-theta and back, checked
commit by commit against real git and git-lfs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import git
from st_files import f32, st_from_arrays

from git_theta.commands.cli import main

SHAPES = {"emb": (256, 128), "l0.w": (256, 256), "l0.b": (256,), "l1.w": (256, 256)}
POINTER_START = b"version https://git-lfs.github.com/spec/v1\n"
MANIFEST_START = b'{\n "git-theta": '
SUMMARY = re.compile(
    r"git-theta: (\d+) commits? rewritten, (\d+) checkpoint versions?: "
    r"([\d.]+) MB as (Git LFS|git-theta) objects -> ([\d.]+) MB as (git-theta|Git LFS) objects"
)
DIRTY = (
    "git-theta: error: the work tree has uncommitted changes: commit or stash them, "
    "then run `git theta migrate` again\n"
)


def tokenizer(version: int) -> bytes:
    vocab = {f"tok{i}": i for i in range(200 + version)}
    return json.dumps({"version": version, "vocab": vocab}).encode()


def nudge(arrays: dict[str, np.ndarray], name: str, rows: slice) -> dict[str, np.ndarray]:
    """A copy of ``arrays`` with a few rows of one tensor changed (a fine-tuning step)."""
    out = {k: v.copy() for k, v in arrays.items()}
    out[name][rows] += np.float32(0.001)
    return out


def commit(repo: Path, message: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (repo / name).write_bytes(data)
    git(repo, "add", *files)
    git(repo, "commit", "-q", "-m", message)


def lfs_repo(path: Path, monkeypatch: pytest.MonkeyPatch, *patterns: str) -> Path:
    """A repository set up as a Hugging Face clone is: Git LFS for ``patterns``, and
    git-theta installed (but tracking nothing yet)."""
    path.mkdir()
    git(path, "init", "-q")
    git(path, "lfs", "install")
    assert main(["install"]) == 0
    monkeypatch.chdir(path)
    # Written here as Hugging Face writes it: `git lfs track A B` orders its lines at random.
    lines = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in patterns)
    if lines:
        (path / ".gitattributes").write_text(lines)
    return path


@pytest.fixture
def hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """LFS-tracked safetensors over 7 versions on two branches with a merge, a
    lightweight and an annotated tag, an LFS tokenizer and a plain README."""
    repo = lfs_repo(tmp_path / "hf", monkeypatch, "*.safetensors", "tokenizer.json")
    w1 = f32(SHAPES, seed=1)
    commit(repo, "init", {
        ".gitattributes": (repo / ".gitattributes").read_bytes(),
        "README.md": b"# a model\n",
        "tokenizer.json": tokenizer(1),
        "model.safetensors": st_from_arrays(w1, {"format": "pt"}),
    })  # fmt: skip
    w2 = nudge(w1, "l0.w", slice(0, 4))
    commit(repo, "v2", {"model.safetensors": st_from_arrays(w2, {"format": "pt"})})
    git(repo, "tag", "v0.1")
    git(repo, "checkout", "-q", "-b", "finetune")
    f1 = nudge(w2, "l1.w", slice(10, 12))
    commit(repo, "ft1", {"model.safetensors": st_from_arrays(f1, {"format": "pt"})})
    f2 = nudge(f1, "emb", slice(0, 2))
    commit(repo, "ft2", {
        "model.safetensors": st_from_arrays(f2, {"format": "pt"}),
        "tokenizer.json": tokenizer(2),
    })  # fmt: skip
    git(repo, "checkout", "-q", "main")
    w3 = nudge(w2, "l0.b", slice(0, 8))
    commit(repo, "v3", {
        "model.safetensors": st_from_arrays(w3, {"format": "pt"}),
        "README.md": b"# a model\n\nversion 3\n",
    })  # fmt: skip
    git(repo, "tag", "-a", "v1.0", "-m", "release 1.0")
    git(repo, "merge", "-q", "--no-ff", "--no-commit", "-s", "ours", "finetune")
    merged = {**w3, "l1.w": f2["l1.w"], "emb": f2["emb"]}
    commit(repo, "merge finetune", {
        "model.safetensors": st_from_arrays(merged, {"format": "pt"}),
        "tokenizer.json": tokenizer(2),
    })  # fmt: skip
    w6 = nudge(merged, "l0.w", slice(100, 103))
    commit(repo, "v6", {"model.safetensors": st_from_arrays(w6, {"format": "pt"})})
    return repo


def refs(repo: Path) -> dict[str, str]:
    out = git(repo, "for-each-ref", "--format=%(objectname) %(refname)").stdout.decode()
    return {name: oid for oid, name in (line.split() for line in out.splitlines())}


def commits(repo: Path) -> dict[str, str]:
    """Subject -> commit, over every branch and tag (subjects are unique here)."""
    out = git(repo, "log", "--all", "--format=%H %s").stdout.decode()
    return {line.split(" ", 1)[1]: line.split(" ", 1)[0] for line in out.splitlines()}


def blob(repo: Path, spec: str) -> bytes:
    return git(repo, "cat-file", "blob", spec).stdout


def committed_files(repo: Path, rev: str) -> dict[str, str]:
    """Path -> sha256 of the file a checkout of ``rev`` writes, as git-lfs sees it (an LFS
    pointer's oid is the sha256 of its file)."""
    out = git(repo, "ls-tree", "-r", "--name-only", rev).stdout.decode().split()
    files = {}
    for path in out:
        data = blob(repo, f"{rev}:{path}")
        if data.startswith(POINTER_START):
            files[path] = data.split(b"oid sha256:")[1][:64].decode()
        else:
            files[path] = hashlib.sha256(data).hexdigest()
    return files


def checked_out_files(repo: Path, rev: str) -> dict[str, str]:
    """Path -> sha256 of each file after a real checkout of ``rev``."""
    git(repo, "checkout", "-q", "--detach", rev)
    paths = git(repo, "ls-files").stdout.decode().split()
    return {p: hashlib.sha256((repo / p).read_bytes()).hexdigest() for p in paths}


def but_attributes(files: dict[str, str]) -> dict[str, str]:
    """Every file but .gitattributes (which a migration rewrites, checked on its own)."""
    return {path: sha for path, sha in files.items() if path != ".gitattributes"}


def status(repo: Path) -> str:
    return git(repo, "status", "--porcelain").stdout.decode()


def summary(text: str) -> tuple[int, int, float, float]:
    found = SUMMARY.search(text)
    assert found, text
    return int(found[1]), int(found[2]), float(found[3]), float(found[5])


def manifest(repo: Path, spec: str) -> dict[str, dict[str, object]]:
    data = blob(repo, spec)
    assert data.startswith(MANIFEST_START), data[:80]
    tensors: dict[str, dict[str, object]] = json.loads(data)["tensors"]
    return tensors


def test_import_then_export_gives_back_the_lfs_history(
    hf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before_refs = refs(hf)
    before = commits(hf)
    expected = {subject: committed_files(hf, c) for subject, c in before.items()}
    tokenizers = {s: git(hf, "rev-parse", f"{c}:tokenizer.json").stdout for s, c in before.items()}
    capsys.readouterr()

    assert main(["migrate", "import", "--everything"]) == 0
    err = capsys.readouterr().err
    rewritten, versions, lfs_mb, theta_mb = summary(err)
    assert (rewritten, versions) == (7, 7)
    assert theta_mb < lfs_mb / 2, err
    assert status(hf) == ""
    after = commits(hf)
    assert set(after) == set(before)
    assert set(after.values()).isdisjoint(before.values())
    assert set(refs(hf)) == set(before_refs)
    assert git(hf, "symbolic-ref", "HEAD").stdout.strip() == b"refs/heads/main"
    # Tags moved as git lfs migrate moves them: lightweight stays lightweight, annotated
    # gets a new tag object with the same message.
    assert git(hf, "cat-file", "-t", "v0.1").stdout.strip() == b"commit"
    assert git(hf, "rev-parse", "v0.1").stdout.strip().decode() == after["v2"]
    assert git(hf, "cat-file", "-t", "v1.0").stdout.strip() == b"tag"
    assert git(hf, "rev-parse", "v1.0^{commit}").stdout.strip().decode() == after["v3"]
    assert b"release 1.0" in git(hf, "cat-file", "tag", "v1.0").stdout
    # The merge keeps both parents; authors, dates and messages are untouched.
    parents = git(hf, "rev-list", "--parents", "-n1", after["merge finetune"]).stdout.split()
    assert [p.decode() for p in parents[1:]] == [after["v3"], after["ft2"]]
    for subject, c in before.items():
        show = ["show", "-s", "--format=%an %ae %ad %cn %ce %cd %B"]
        assert git(hf, *show, c).stdout == git(hf, *show, after[subject]).stdout

    attributes = blob(hf, f"{after['v6']}:.gitattributes").decode()
    assert attributes == (
        "*.safetensors filter=theta diff=theta merge=theta -text\n"
        "tokenizer.json filter=lfs diff=lfs merge=lfs -text\n"
    )
    for subject, c in after.items():
        assert git(hf, "rev-parse", f"{c}:tokenizer.json").stdout == tokenizers[subject]
        assert blob(hf, f"{c}:README.md") == blob(hf, f"{before[subject]}:README.md")
    # Each version is a change on the one before: untouched tensors keep their objects,
    # a changed one is an update on its previous value.
    v2, ft1 = (
        manifest(hf, f"{after['v2']}:model.safetensors"),
        manifest(hf, f"{after['ft1']}:model.safetensors"),
    )
    assert v2["emb"]["chain"] == ft1["emb"]["chain"]
    assert v2["l0.w"]["chain"] == ft1["l0.w"]["chain"]
    assert len(ft1["l1.w"]["chain"]) == 2  # type: ignore[arg-type]
    for subject, c in after.items():
        assert but_attributes(checked_out_files(hf, c)) == but_attributes(expected[subject])
    git(hf, "checkout", "-q", "main")
    assert status(hf) == ""

    assert main(["migrate", "export", "--everything"]) == 0
    err = capsys.readouterr().err
    rewritten, versions, _, lfs_mb2 = summary(err)
    assert (rewritten, versions, lfs_mb2) == (7, 7, lfs_mb)
    # Identical pointers and attributes: the very commits, tags and branches we started with.
    assert refs(hf) == before_refs
    assert status(hf) == ""
    assert checked_out_files(hf, before["ft1"]) == expected["ft1"]
    git(hf, "checkout", "-q", "main")


def test_a_dirty_work_tree_is_refused(hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = refs(hf)
    (hf / "README.md").write_text("edited\n")
    capsys.readouterr()
    assert main(["migrate", "import"]) == 1
    assert capsys.readouterr().err == DIRTY
    assert refs(hf) == before
    git(hf, "add", "README.md")  # staged counts too
    assert main(["migrate", "import"]) == 1
    assert capsys.readouterr().err == DIRTY
    assert refs(hf) == before


def test_include_limits_what_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = lfs_repo(tmp_path / "r", monkeypatch, "*.safetensors", "*.npy")
    w1 = f32(SHAPES, seed=2)
    npy = b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (64,), }"
    npy = npy + b" " * (127 - len(npy)) + b"\n" + np.arange(64, dtype=np.float32).tobytes()
    commit(repo, "one", {
        ".gitattributes": (repo / ".gitattributes").read_bytes(),
        "model.safetensors": st_from_arrays(w1),
        "bias.npy": npy,
    })  # fmt: skip
    commit(repo, "two", {"model.safetensors": st_from_arrays(nudge(w1, "emb", slice(0, 1)))})
    before = commits(repo)
    expected = {s: committed_files(repo, c) for s, c in before.items()}
    capsys.readouterr()

    assert main(["migrate", "import", "--include", "*.safetensors"]) == 0
    assert summary(capsys.readouterr().err)[:2] == (2, 2)
    after = commits(repo)
    for subject, c in after.items():
        assert blob(repo, f"{c}:bias.npy") == blob(repo, f"{before[subject]}:bias.npy")
        assert blob(repo, f"{c}:bias.npy").startswith(POINTER_START)
        assert blob(repo, f"{c}:model.safetensors").startswith(MANIFEST_START)
        files = but_attributes(checked_out_files(repo, c))
        assert files == but_attributes(expected[subject])
    assert blob(repo, "main:.gitattributes") == (
        b"*.safetensors filter=theta diff=theta merge=theta -text\n"
        b"*.npy filter=lfs diff=lfs merge=lfs -text\n"
    )
    git(repo, "checkout", "-q", "main")
    assert status(repo) == ""
    # Run again: nothing left to do, nothing rewritten.
    before_refs = refs(repo)
    assert main(["migrate", "import", "--include", "*.safetensors"]) == 0
    assert summary(capsys.readouterr().err)[:2] == (0, 0)
    assert refs(repo) == before_refs


def test_a_raw_checkpoint_blob_in_history_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = lfs_repo(tmp_path / "raw", monkeypatch)
    w1 = f32(SHAPES, seed=3)
    commit(repo, "raw", {"model.safetensors": st_from_arrays(w1), "README.md": b"hi\n"})
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    w2 = nudge(w1, "l1.w", slice(0, 2))
    commit(repo, "lfs", {
        ".gitattributes": (repo / ".gitattributes").read_bytes(),
        "model.safetensors": st_from_arrays(w2),
    })  # fmt: skip
    before = commits(repo)
    assert not blob(repo, "HEAD~:model.safetensors").startswith(POINTER_START)
    expected = {s: committed_files(repo, c) for s, c in before.items()}
    capsys.readouterr()

    assert main(["migrate", "import", "--include", "*.safetensors", "main"]) == 0
    assert summary(capsys.readouterr().err)[:2] == (2, 2)
    after = commits(repo)
    # The commit from before any .gitattributes gets one, so its manifest checks out.
    assert blob(repo, f"{after['raw']}:.gitattributes") == (
        b"*.safetensors filter=theta diff=theta merge=theta -text\n"
    )
    raw, lfs = (manifest(repo, f"{after[s]}:model.safetensors") for s in ("raw", "lfs"))
    assert raw["emb"]["chain"] == lfs["emb"]["chain"]
    assert len(lfs["l1.w"]["chain"]) == 2  # type: ignore[arg-type]
    for subject, c in after.items():
        files = but_attributes(checked_out_files(repo, c))
        assert files == but_attributes(expected[subject])
    git(repo, "checkout", "-q", "main")
    assert status(repo) == ""

    # Exported, the raw version becomes a Git LFS object where git-lfs itself finds it.
    assert main(["migrate", "export"]) == 0
    exported = commits(repo)
    pointer = blob(repo, f"{exported['raw']}:model.safetensors")
    oid = pointer.split(b"oid sha256:")[1][:64].decode()
    assert pointer == (
        f"{POINTER_START.decode()}oid sha256:{oid}\nsize {len(st_from_arrays(w1))}\n".encode()
    )
    assert (repo / ".git/lfs/objects" / oid[:2] / oid[2:4] / oid).is_file()
    assert status(repo) == ""
    for subject, c in exported.items():
        files = but_attributes(checked_out_files(repo, c))
        assert files == but_attributes(expected[subject]), subject
    git(repo, "checkout", "-q", "main")


def test_a_clone_rewrites_published_history_only_when_asked(
    hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", f"file://{hf}", str(clone))
    monkeypatch.chdir(clone)
    before = refs(clone)
    expected = {s: committed_files(clone, c) for s, c in commits(clone).items()}
    capsys.readouterr()
    assert main(["migrate", "import"]) == 0
    assert capsys.readouterr().err == (
        "git-theta: every commit of refs/heads/main is on a remote already: to rewrite "
        "published history, run again with --everything (then push --force)\n"
    )
    assert refs(clone) == before

    # Old versions' LFS objects were never checked out here: they come from the remote,
    # and one the remote lost fails the whole migration, changing nothing.
    ft1 = blob(clone, "origin/finetune~:model.safetensors").split(b"sha256:")[1][:64].decode()
    assert not list((clone / ".git/lfs/objects").rglob(ft1))
    (hf / ".git/lfs").rename(hf / ".git/lfs-away")
    assert main(["migrate", "import", "--everything"]) == 1
    line = capsys.readouterr().err
    assert re.fullmatch(
        r"git-theta: error: model\.safetensors in commit [0-9a-f]{12}: Git LFS object [0-9a-f]{64} "
        r"is not local and could not be downloaded: fetch it \(`git lfs fetch --all`\) and "
        r"migrate again; nothing was changed\n",
        line,
    ), line
    assert refs(clone) == before
    shutil.rmtree(hf / ".git/lfs")  # git-lfs made its directory again meanwhile
    (hf / ".git/lfs-away").rename(hf / ".git/lfs")

    assert main(["migrate", "import", "--everything"]) == 0
    assert summary(capsys.readouterr().err)[:2] == (7, 7)
    assert refs(clone)["refs/remotes/origin/main"] == before["refs/remotes/origin/main"]
    assert refs(clone)["refs/heads/main"] != before["refs/heads/main"]
    for subject, c in commits(clone).items():
        if c not in before.values():  # the remote's refs still hold the old history
            files = but_attributes(checked_out_files(clone, c))
            assert files == but_attributes(expected[subject]), subject


def test_prune_after_import_frees_the_lfs_objects_no_pointer_names(
    hf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer_oids = set()
    for c in commits(hf).values():
        text = blob(hf, f"{c}:tokenizer.json").decode()
        tokenizer_oids.add(text.split("oid sha256:")[1].split()[0])
    assert main(["migrate", "import", "--everything"]) == 0
    lfs_dir = hf / ".git/lfs/objects"
    before = {p.name for p in lfs_dir.rglob("*") if p.is_file()}
    assert len(before) > len(tokenizer_oids)
    for p in (hf / ".git/lfs").rglob("*"):
        if p.is_file():
            os.utime(p, (1, 1))  # older than prune's grace period
    git(hf, "reflog", "expire", "--expire=now", "--all")  # the old history goes
    git(hf, "gc", "-q", "--prune=now")
    capsys.readouterr()
    assert main(["prune"]) == 0
    err = capsys.readouterr().err
    assert f"deleted {len(before) - len(tokenizer_oids)} Git LFS objects" in err, err
    assert {p.name for p in lfs_dir.rglob("*") if p.is_file()} == tokenizer_oids
    for subject, c in commits(hf).items():
        git(hf, "checkout", "-q", c)
        assert status(hf) == "", subject


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def test_a_branch_checked_out_in_another_worktree_is_refused(
    hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other worktree"
    git(hf, "worktree", "add", "-q", str(other), "finetune")
    before, stored = refs(hf), files_under(hf / ".git")
    capsys.readouterr()
    # Moving finetune would leave that worktree's index and files on the old commit: its
    # status would show the whole rewrite staged, and its next commit would undo it.
    assert main(["migrate", "import", "--everything"]) == 1
    assert capsys.readouterr().err == (
        f"git-theta: error: branch 'finetune' is checked out in the worktree '{other}': "
        f"detach it there (`git -C '{other}' switch --detach`) or name the branches to "
        "migrate, then run `git theta migrate` again\n"
    )
    assert refs(hf) == before
    assert files_under(hf / ".git") == stored  # no object written, no ref moved
    assert status(other) == ""

    monkeypatch.chdir(other)  # from there, the main worktree's branch is the other one
    assert main(["migrate", "import", "--everything"]) == 1
    assert "branch 'main' is checked out in the worktree" in capsys.readouterr().err
    assert main(["migrate", "import"]) == 0  # its own branch, refreshed in place
    assert status(other) == "" and status(hf) == ""
    assert refs(hf)["refs/heads/finetune"] != before["refs/heads/finetune"]
    assert refs(hf)["refs/heads/main"] == before["refs/heads/main"]

    git(other, "switch", "-q", "--detach")
    monkeypatch.chdir(hf)
    assert main(["migrate", "import", "main"]) == 0
    assert status(other) == "" and status(hf) == ""

    gone = tmp_path / "gone"
    git(hf, "worktree", "add", "-q", "-b", "gone", str(gone))
    shutil.rmtree(gone)  # still registered: git refuses to move its branch too
    capsys.readouterr()
    assert main(["migrate", "import", "--everything"]) == 1
    assert capsys.readouterr().err == (
        f"git-theta: error: branch 'gone' is checked out in the worktree '{gone}': its "
        "directory is gone: run `git worktree prune`, then run `git theta migrate` again\n"
    )
    git(hf, "worktree", "prune")
    assert main(["migrate", "import", "--everything"]) == 0
