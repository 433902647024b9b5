"""The record of verified chains (verified.py): a clone's committed manifests may lie about
what their chains rebuild to, and clean must not copy a lying chain into the user's commit;
an honest clone's chains are reused without a rebuild. Real git."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256
from faults.harness import can_mount, read_only
from st_files import st_from_arrays

from git_theta import verified
from git_theta.manifest import Manifest

MODEL = "model.safetensors"
MOUNTABLE = can_mount()


def _model(seed: int = 0, change: float = 0.0) -> bytes:
    """A small checkpoint: a zero bias, a same-sized random vector, a weight (its first
    ``change`` fraction of rows shifted, for a second version stored as a delta)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    w[: int(64 * change)] += 1.0
    return st_from_arrays(
        {
            "bias": np.zeros(64, np.float32),
            "other": rng.standard_normal(64).astype(np.float32),
            "w": w,
        }
    )


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, cwd=cwd, capture_output=True)


def _record(repo: Path) -> Path:
    return repo / ".git" / "lfs" / "theta" / verified.FILE


def _clean_in_process(repo: Path, path: str = MODEL) -> tuple[Manifest, Manifest | None, int]:
    """Clean ``path`` as `git add` would, in this process with a fresh store (so the
    record is read from disk); return (manifest, staged manifest, chains rebuilt)."""
    from git_theta.clean import clean
    from git_theta.repo import Repo

    where = Repo(str(repo))
    staged = where.staged_manifest(path)
    before = verified.rebuilds
    with open(repo / path, "rb") as fh:
        got = clean(fh, io.BytesIO(), path, where.store, staged, show_progress=False,
                    known=where.known)  # fmt: skip
    assert got is not None
    return got, staged, verified.rebuilds - before


def test_a_hostile_chain_for_a_zero_bias_is_not_copied_into_the_users_commit(
    repo: Path, tmp_path: Path
) -> None:
    """The reviewer's attack: the committed manifest gives the zero bias's true hash and
    shape, but its chain points at another real object of the same size. Checkout fails;
    the user gets the real file elsewhere and adds it: the commit must check out."""
    honest = _model()
    (repo / MODEL).write_bytes(honest)
    git(repo, "add", MODEL)
    manifest = json.loads(git(repo, "show", f":{MODEL}").stdout)
    tensors = manifest["tensors"]
    assert tensors["bias"]["shape"] == tensors["other"]["shape"]
    tensors["bias"]["chain"] = tensors["other"]["chain"]  # a real object, 256 bytes too
    data = json.dumps(manifest, indent=1).encode() + b"\n"
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--cacheinfo", f"100644,{oid},{MODEL}")
    git(repo, "commit", "-q", "-m", "hostile")
    (repo / MODEL).unlink()

    victim = tmp_path / "victim"
    done = _run(tmp_path, "git", "clone", "-q", str(repo), str(victim))
    assert "rebuilt bytes do not match" in done.stderr.decode()
    assert not (victim / MODEL).exists() or (victim / MODEL).read_bytes() != honest
    # The user's real file, from elsewhere: same bias, same values.
    (victim / MODEL).write_bytes(honest)
    # A failed clone leaves the index empty; `git reset` (as the status suggests the
    # files were deleted) fills it with the committed manifests, work tree untouched.
    git(victim, "reset", "-q")
    assert git(victim, "ls-files", MODEL).stdout == f"{MODEL}\n".encode()
    added = git(victim, "add", MODEL)
    git(victim, "commit", "-q", "-m", "mine")
    fresh = tmp_path / "fresh"
    done = _run(tmp_path, "git", "clone", "-q", str(victim), str(fresh))
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(fresh / MODEL) == sha256(victim / MODEL)
    assert (fresh / MODEL).read_bytes() == honest
    # Said once, naming the tensor.
    lines = [ln for ln in added.stderr.decode().splitlines() if ln.startswith("git-theta:")]
    assert lines == [
        f"git-theta: warning: {MODEL}: tensor 'bias''s staged version does not rebuild to its "
        "hash; stored it afresh"
    ]


def _honest_clone(repo: Path, tmp_path: Path) -> Path:
    """Two commits (the second a delta for w), cloned: the checkout verified every chain."""
    (repo / MODEL).write_bytes(_model())
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "one")
    (repo / MODEL).write_bytes(_model(change=0.05))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "two")
    dest = tmp_path / "clone"
    done = _run(tmp_path, "git", "clone", "-q", str(repo), str(dest))
    assert done.returncode == 0, done.stderr.decode()
    assert (dest / MODEL).read_bytes() == (repo / MODEL).read_bytes()
    return dest


def test_an_honest_clone_reuses_every_chain_without_a_rebuild(repo: Path, tmp_path: Path) -> None:
    """The clone's checkout (git's filter process) recorded what it verified: the first
    add after it, in another process, rebuilds nothing and stages the same manifest."""
    clone = _honest_clone(repo, tmp_path)
    assert _record(clone).is_file()
    got, staged, rebuilt = _clean_in_process(clone)
    assert rebuilt == 0
    assert staged is not None and got.tensors == staged.tensors
    assert len(got.tensors["w"].chain) == 2  # the delta chain itself, reused
    # Without the record every reused chain is rebuilt, once per process.
    _record(clone).unlink()
    got, _, rebuilt = _clean_in_process(clone)
    assert rebuilt == 3 and got.tensors == staged.tensors
    _, _, rebuilt = _clean_in_process(clone)  # and recorded by that rebuild
    assert rebuilt == 0


def test_the_record_of_an_add_survives_into_later_processes(repo: Path) -> None:
    """Chains `git add` wrote (git's filter process) are reused by a later process
    without a rebuild; and git status/add of the unchanged file keep working."""
    (repo / MODEL).write_bytes(_model(seed=4))
    git(repo, "add", MODEL)
    _, _, rebuilt = _clean_in_process(repo)
    assert rebuilt == 0
    os.utime(repo / MODEL)
    git(repo, "add", MODEL)
    assert git(repo, "status", "--porcelain").stdout == b"A  model.safetensors\n"


def test_a_corrupt_record_file_is_ignored(repo: Path, tmp_path: Path) -> None:
    """Garbage, a truncated key, a key of nothing: each only costs a rebuild, and the
    rebuilds are recorded after it."""
    clone = _honest_clone(repo, tmp_path)
    good = _record(clone).read_bytes()
    _record(clone).write_bytes(
        os.urandom(300) + b"\n" + b"f" * 64 + b"\n" + good[:40] + b"\x00" * 7
    )
    got, staged, rebuilt = _clean_in_process(clone)
    assert rebuilt == 3 and staged is not None and got.tensors == staged.tensors
    _, _, rebuilt = _clean_in_process(clone)
    assert rebuilt == 0


def test_a_record_in_a_directory_or_over_the_cap_is_ignored(repo: Path, tmp_path: Path) -> None:
    clone = _honest_clone(repo, tmp_path)
    record = _record(clone)
    keys = record.read_bytes()
    record.write_bytes(keys + b"0" * verified.CAP)  # over the cap: not read
    _, _, rebuilt = _clean_in_process(clone)
    assert rebuilt == 3
    assert record.stat().st_size < verified.CAP  # the appends started it afresh
    _, _, rebuilt = _clean_in_process(clone)
    assert rebuilt == 0
    record.unlink()
    record.mkdir()  # not a regular file: neither read nor written, the add works
    _, _, rebuilt = _clean_in_process(clone)
    assert rebuilt == 3 and record.is_dir()


def test_appends_of_two_writers_keep_every_key(tmp_path: Path) -> None:
    """Two records of one store, as two processes hold them, both appending."""
    from git_theta.manifest import Link, TensorEntry
    from git_theta.store import ObjectRef

    def entry(i: int) -> TensorEntry:
        return TensorEntry(
            "F32", (i,), f"{i:064x}", (Link("dense", "gtho1", ObjectRef("a" * 64, i)),)
        )

    one, two = verified.Verified(str(tmp_path)), verified.Verified(str(tmp_path))
    for i in range(50):
        (one if i % 2 else two).add([entry(i)])
        (one if i % 2 else two).flush()
    fresh = verified.Verified(str(tmp_path))
    assert all(fresh.has(entry(i)) for i in range(50))
    assert not fresh.has(entry(50))
    # The key covers the chain: the same hash with another object is not on the record.
    other = entry(3)._replace(chain=(Link("dense", "gtho1", ObjectRef("b" * 64, 3)),))
    assert not fresh.has(other)


@pytest.mark.skipif(not MOUNTABLE and os.geteuid() == 0, reason="root cannot freeze a directory")
def test_a_read_only_store_works_and_verifies_once_per_process(repo: Path, tmp_path: Path) -> None:
    clone = _honest_clone(repo, tmp_path)
    _record(clone).unlink()
    lfs = clone / ".git" / "lfs"
    (lfs / "tmp").mkdir(exist_ok=True)
    from git_theta.clean import clean
    from git_theta.repo import Repo

    mount = read_only(lfs) if MOUNTABLE else None
    if mount is not None:
        mount.__enter__()
    else:
        for d in [lfs, *(p for p in lfs.rglob("*") if p.is_dir())]:
            d.chmod(0o555)
    try:
        os.utime(clone / MODEL)
        status = git(clone, "status", "--porcelain")
        assert status.stdout == b""
        where = Repo(str(clone))
        staged = where.staged_manifest(MODEL)
        counts = []
        for _ in range(2):  # one store: its record lasts for the process
            before = verified.rebuilds
            with open(clone / MODEL, "rb") as fh:
                got = clean(fh, io.BytesIO(), MODEL, where.store, staged, show_progress=False)
            counts.append(verified.rebuilds - before)
            assert got is not None and staged is not None and got.tensors == staged.tensors
        assert counts == [3, 0]
        assert not _record(clone).exists()
    finally:
        if mount is not None:
            mount.__exit__(None, None, None)
        else:
            for d in [lfs, *(p for p in lfs.rglob("*") if p.is_dir())]:
                d.chmod(0o755)


@pytest.mark.parametrize("where", ["its own staged entry", "another staged name", "another file"])
def test_no_reuse_path_takes_a_chain_off_the_record_without_a_rebuild(
    tmp_path: Path, where: str
) -> None:
    """Every way clean reuses a chain it did not write (the path's staged entry of the
    tensor, a staged entry of another name, another file's through identity.py) checks
    it: a lying one is stored afresh and the manifest rebuilds to the user's bytes."""
    from git_theta.clean import clean
    from git_theta.identity import INDEX, Known
    from git_theta.smudge import smudge
    from git_theta.store import ObjectStore

    honest = _model()
    first = clean(io.BytesIO(honest), io.BytesIO(), MODEL, ObjectStore(tmp_path), None,
                  show_progress=False)  # fmt: skip
    assert first is not None
    lying = first.tensors["bias"]._replace(chain=first.tensors["other"].chain)
    tensors = dict(first.tensors)
    previous: Manifest | None = None
    others: list[tuple[int, str, Manifest]] = []
    if where == "its own staged entry":
        previous = first._replace(tensors={**tensors, "bias": lying})
    elif where == "another staged name":
        del tensors["bias"]
        previous = first._replace(tensors={**tensors, "zero": lying})
    else:
        others = [(INDEX, "other.safetensors", first._replace(tensors={"bias": lying}))]
    store = ObjectStore(tmp_path)  # another process: the record read from disk
    out = io.BytesIO()
    got = clean(io.BytesIO(honest), out, MODEL, store, previous, show_progress=False,
                known=Known(lambda near: others))  # fmt: skip
    assert got is not None and got.tensors["bias"].chain != lying.chain
    rebuilt = io.BytesIO()
    smudge(io.BytesIO(out.getvalue()), rebuilt, MODEL, ObjectStore(tmp_path), False)
    assert rebuilt.getvalue() == honest


def test_fsck_records_what_it_rebuilt(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from git_theta.commands.cli import main

    clone = _honest_clone(repo, tmp_path)
    _record(clone).unlink()
    monkeypatch.chdir(clone)
    assert main(["fsck"]) == 0
    _, _, rebuilt = _clean_in_process(clone)
    assert rebuilt == 0
