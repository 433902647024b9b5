"""The Python API (git_theta.save / open / history, save_to_git / load_from_git) against
real git: what it stages is what `git add` of the same file stages, checkouts are byte
exact, `open` reads only the tensor asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import git, lfs_objects, sha256, track

import git_theta
from git_theta.commands.cli import main
from git_theta.errors import ManifestError, UsageError
from git_theta.setup_check import NotSetUpError

torch = pytest.importorskip("torch")


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "norm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
        "head.f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "head.f8e5": torch.randn(16, generator=g).to(torch.float8_e5m2),
        "steps": np.arange(5, dtype=np.int64),
        "half": np.linspace(0, 1, 12, dtype=np.float16).reshape(3, 4),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def test_import_git_theta_stays_light() -> None:
    code = "import sys, git_theta; print(sorted(m for m in sys.modules if 'git_theta' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    assert out.stdout.decode().strip() == "['git_theta']"
    assert callable(git_theta.save) and "save" in dir(git_theta)


def test_save_stages_what_git_add_of_the_same_file_stages(repo: Path) -> None:
    """The stream save builds is the file safetensors' own writer makes: adding that file
    afterwards changes nothing, and the commit checks out to it byte for byte."""
    from safetensors.torch import save_file

    saved = git_theta.save(state(0), "model.safetensors", message="v0")
    assert saved.commit == git(repo, "rev-parse", "HEAD").stdout.decode().strip()
    assert not (repo / "model.safetensors").exists()  # nothing written to the work tree
    tensors = {k: torch.as_tensor(v) for k, v in state(0).items()}
    save_file(tensors, str(repo / "model.safetensors"))
    reference = sha256(repo / "model.safetensors")
    git(repo, "add", "model.safetensors")
    assert git(repo, "status", "--porcelain").stdout == b""  # git add staged nothing new
    (repo / "model.safetensors").unlink()
    git(repo, "checkout", "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == reference


def test_write_file_writes_what_checkout_gives_and_status_is_clean(repo: Path) -> None:
    git_theta.save(state(1), "model.safetensors", write_file=True, message="v1")
    written = sha256(repo / "model.safetensors")
    git(repo, "diff-index", "--quiet", "HEAD", "--")  # the index knows the file's stat data
    assert git(repo, "status", "--porcelain").stdout == b""
    (repo / "model.safetensors").unlink()
    git(repo, "checkout", "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == written


def test_second_save_stores_only_changed_tensors_with_the_update_type(repo: Path) -> None:
    first = state(2)
    git_theta.save(first, "model.safetensors", message="v1")
    before = lfs_objects(repo)
    second = dict(first)
    w = first["embed.weight"].clone()  # type: ignore[attr-defined]
    w[0, :3] += 1
    second["embed.weight"] = w
    git_theta.save(second, "model.safetensors", message="v2", update_type="sparse")
    manifest = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)
    chain = manifest["tensors"]["embed.weight"]["chain"]
    assert [link["update"] for link in chain] == ["dense", "sparse"]
    assert len(lfs_objects(repo) - before) == 1  # the sparse update (the header is the same)
    with git_theta.open("HEAD", "model.safetensors") as ckpt:
        assert torch.equal(ckpt.torch("embed.weight"), w)


def test_pytorch_and_numpy_formats_round_trip(repo: Path) -> None:
    track(repo, "*.pt", "*.npz")
    nested = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7}
    git_theta.save(nested, "ckpt.pt", message="pt", write_file=True)
    assert git(repo, "status", "--porcelain").stdout == b""
    loaded = torch.load(repo / "ckpt.pt", weights_only=True)
    assert torch.equal(loaded["model"]["w"], nested["model"]["w"]) and loaded["step"] == 7
    arrays = {"a": np.arange(4, dtype=np.float32), "b": np.eye(3)}
    git_theta.save(arrays, "arrays.npz", message="npz")
    with git_theta.open("HEAD", "arrays.npz") as ckpt:
        assert ckpt.format == "npz"
        assert ckpt.names == ["a", "b"]
        assert np.array_equal(ckpt["b"], np.eye(3))


def test_jax_arrays_save(repo: Path) -> None:
    jnp = pytest.importorskip("jax.numpy")
    params = {"w": jnp.ones((3, 2), dtype=jnp.bfloat16), "b": jnp.arange(3.0)}
    git_theta.save(params, "jax.safetensors", message="jax")
    with git_theta.open("HEAD", "jax.safetensors") as ckpt:
        assert ckpt.dtypes == {"b": "F32", "w": "BF16"}
        assert np.array_equal(np.asarray(ckpt.get("w", "jax")), np.asarray(params["w"]))


def test_every_save_with_a_message_commits_even_unchanged_weights(repo: Path) -> None:
    first = git_theta.save(state(0), "model.safetensors", message="a")
    second = git_theta.save(state(0), "model.safetensors", message="b", tag="b")
    assert first.commit != second.commit and first.blob == second.blob
    assert git(repo, "rev-parse", "b").stdout.decode().strip() == second.commit
    with pytest.raises(UsageError, match="tag 'b' already exists"):
        git_theta.save(state(1), "model.safetensors", message="c", tag="b")
    assert git(repo, "log", "-1", "--format=%s").stdout == b"b\n"  # nothing committed
    assert git(repo, "status", "--porcelain").stdout == b" D model.safetensors\n"  # nor staged


def test_save_refuses_untracked_paths_and_missing_set_up(repo: Path) -> None:
    with pytest.raises(UsageError) as exc:
        git_theta.save(state(0), "model.npz")
    assert str(exc.value) == (
        "model.npz is not tracked by git-theta: run `git theta track model.npz` first"
    )
    assert git(repo, "ls-files", "model.npz").stdout == b""
    assert main(["uninstall"]) == 0
    with pytest.raises(NotSetUpError, match="git theta install"):
        git_theta.save(state(0), "model.safetensors")
    assert git(repo, "ls-files", "model.safetensors").stdout == b""


def test_save_refuses_what_the_format_cannot_hold(repo: Path) -> None:
    with pytest.raises(UsageError, match="'x' is a nested dict"):
        git_theta.save({"x": {"y": torch.ones(1)}}, "model.safetensors")
    with pytest.raises(UsageError, match="'n' is a int, not a tensor"):
        git_theta.save({"n": 3}, "model.safetensors")
    with pytest.raises(UsageError, match="tag= needs message="):
        git_theta.save(state(0), "model.safetensors", tag="v1")
    assert git(repo, "ls-files", "model.safetensors").stdout == b""


def test_open_gives_metadata_and_one_tensor_from_its_objects_only(
    repo: Path, tmp_path: Path
) -> None:
    """A clone that skipped smudge has no objects: names, dtypes and shapes need none,
    and reading one tensor downloads only that tensor's objects."""
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    git_theta.save(state(3), "model.safetensors", message="v3", tag="v3")
    git(repo, "push", "-q", "origin", "main", "v3")
    manifest = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)
    wanted = {link["oid"] for link in manifest["tensors"]["norm.weight"]["chain"]}

    copy = tmp_path / "copy"
    env = {**os.environ, "GIT_THETA_SKIP_SMUDGE": "1"}
    subprocess.run(["git", "clone", "-q", f"file://{remote}", str(copy)], env=env, check=True)
    assert lfs_objects(copy) == set()
    with git_theta.open("v3", "model.safetensors", repo=copy) as ckpt:
        assert ckpt.names == sorted(ckpt.names, key=ckpt.names.index)
        assert ckpt.shapes["embed.weight"] == (64, 32)
        assert ckpt.dtypes["head.f8"] == "F8_E4M3"
        assert lfs_objects(copy) == set()  # metadata alone
        value = ckpt.torch("norm.weight")
        assert lfs_objects(copy) == wanted
    assert torch.equal(value, state(3)["norm.weight"])  # type: ignore[arg-type]
    with git_theta.open("v3", "model.safetensors", repo=copy) as ckpt, pytest.raises(KeyError):
        ckpt["nope"]


def test_open_staged_version_and_errors(repo: Path) -> None:
    git_theta.save(state(4), "model.safetensors")
    with git_theta.open(None, "model.safetensors") as ckpt:
        assert len(ckpt) == 8 and "mask" in ckpt
        assert ckpt["mask"].tolist() == [True, False, True]
    with pytest.raises(UsageError, match=r"^model\.safetensors is not in revision 'HEAD'$"):
        git_theta.open("HEAD", "model.safetensors")


def test_open_refuses_a_hostile_manifest_in_one_line(repo: Path) -> None:
    """What is committed is untrusted: open parses it as smudge does (manifest.parse)."""
    git_theta.save(state(0), "model.safetensors")
    good = git(repo, "show", ":model.safetensors").stdout
    blob = good.replace(b'"shape": [64, 32]', b'"shape": [1048576, 1048576]')  # 4 TB claimed
    assert blob != good
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=blob).stdout.decode().strip()
    git(repo, "update-index", "--add", "--cacheinfo", f"100644,{oid},model.safetensors")
    with pytest.raises(ManifestError) as exc:
        git_theta.open(None, "model.safetensors")
    assert "\n" not in str(exc.value) and "embed.weight" in str(exc.value)


def test_history_says_which_tensors_changed_and_how_much(repo: Path) -> None:
    base = state(5)
    git_theta.save(base, "model.safetensors", message="v1")
    changed = dict(base)
    w = base["embed.weight"].clone()  # type: ignore[attr-defined]
    w[1, 2] += 3.0
    changed["embed.weight"] = w
    git_theta.save(changed, "model.safetensors", message="v2")
    git(repo, "commit", "-q", "--allow-empty", "-m", "unrelated")
    revs = git_theta.history("model.safetensors")
    assert [r.subject for r in revs] == ["v2", "v1"]
    assert revs[0].changed == ["embed.weight"]
    change = revs[0].tensors["embed.weight"]
    assert change.status == "modified" and change.changed == 1
    assert change.max_abs == pytest.approx(3.0, rel=1e-6)
    assert revs[0].tensors["mask"].status == "unchanged"
    assert all(c.status == "added" for c in revs[1].tensors.values())
    only = git_theta.history("model.safetensors", "embed.weight", max_count=1)
    assert [r.subject for r in only] == ["v2"] and list(only[0].tensors) == ["embed.weight"]
    assert [r.subject for r in git_theta.history("model.safetensors", "mask")] == ["v1"]


def test_predecessor_save_to_git_and_load_from_git(repo: Path) -> None:
    """The predecessor's tests/end2end/inprocess, in today's repository."""
    track(repo, "*.pt")
    model = {k: torch.as_tensor(v).clone() for k, v in state(6).items() if k != "mask"}
    updated = dict(model)
    updated["embed.weight"] = torch.rand(64, 32)
    sha_1 = git_theta.save_to_git(model, "model_1.pt", "commit first model")
    sha_2 = git_theta.save_to_git(model, "model_2.pt", "commit second model")
    git_theta.save_to_git(updated, "model_1.pt", "changed model, same path", tag="updated-model")
    assert not (repo / "model_1.pt").exists() and not (repo / "model_2.pt").exists()
    m1 = git_theta.load_from_git(sha_1, "model_1.pt")
    m2 = git_theta.load_from_git(sha_2, "model_2.pt")
    m11 = git_theta.load_from_git("updated-model", "model_1.pt")
    for name, value in model.items():
        assert torch.equal(m1[name], value) and torch.equal(m2[name], value)
    assert not torch.equal(m11["embed.weight"], m1["embed.weight"])
    assert torch.equal(m11["embed.weight"], updated["embed.weight"])


def test_save_through_a_symlinked_directory_stages_nothing(repo: Path, tmp_path: Path) -> None:
    """git refuses a path beyond a symlink; so does save, written or not."""
    from git_theta.files import UnsafeFileError

    outside = tmp_path / "outside"
    outside.mkdir()
    (repo / "linkdir").symlink_to(outside)
    for write_file in (True, False):
        with pytest.raises(UnsafeFileError, match=r"^linkdir is a symbolic link; git-theta"):
            git_theta.save(state(0), "linkdir/m.safetensors", write_file=write_file)
        assert git(repo, "ls-files").stdout == b".gitattributes\n"
    assert list(outside.iterdir()) == []


def test_a_repository_reached_through_a_link_of_the_users(repo: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(repo)
    saved = git_theta.save(state(0), "m.safetensors", repo=link)
    assert saved.path == "m.safetensors"
    assert git_theta.save(state(0), link / "n.safetensors").path == "n.safetensors"
    with git_theta.open(None, link / "m.safetensors") as ckpt:
        assert "embed.weight" in ckpt


def test_reading_tensor_by_tensor_counts_towards_one_expansion_cap(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version whose tensors are tiny objects that decompress to a lot (a hostile
    repository's bomb) is refused by ``ckpt[name]`` in a loop as by ``to_dict``: the cap
    counts what one opened version rebuilds, not each tensor afresh."""
    from git_theta import smudge

    zeros = {f"t{i}": np.zeros(1 << 18, np.float32) for i in range(4)}  # 1 MiB each
    git_theta.save(zeros, "m.safetensors", message="zeros")
    monkeypatch.setattr(smudge, "EXPANSION_FLOOR", 5 << 19)  # 2.5 MiB
    with git_theta.open("HEAD", "m.safetensors") as ckpt:
        with pytest.raises(smudge.ExpansionError):
            ckpt.to_dict()
        got = []
        with pytest.raises(smudge.ExpansionError, match=r"^3,145,728 bytes would be rebuilt"):
            for name in ckpt:
                got.append(name)
                assert not ckpt[name].any()
                assert not ckpt[name].any()  # the same tensor again is not counted twice
    assert got == ["t0", "t1", "t2"]


def test_one_line_errors_for_a_missing_revision_and_an_invalid_name(repo: Path) -> None:
    git_theta.save(state(0), "m.safetensors", message="v0")
    with pytest.raises(UsageError, match=r"^revision 'nope' does not exist \(a commit"):
        git_theta.open("nope", "m.safetensors")
    with pytest.raises(UsageError, match=r"^revision '--help' does not exist"):
        git_theta.open("--help", "m.safetensors")
    with pytest.raises(UsageError, match=r"^x.safetensors is not in revision 'HEAD'$"):
        git_theta.open("HEAD", "x.safetensors")
    with pytest.raises(UsageError, match=r"^safetensors names are UTF-8; .* is not valid Unicode"):
        git_theta.save({"a\ud800": np.ones(2, np.float32)}, "m.safetensors")


def test_conjugate_and_negative_views_are_stored_as_their_values(repo: Path) -> None:
    values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    saved = {"conj": values.conj(), "neg": values.conj().imag}
    git_theta.save(saved, "m.safetensors")
    with git_theta.open(None, "m.safetensors") as ckpt:
        assert torch.equal(ckpt.torch("conj"), values.conj().resolve_conj())
        assert torch.equal(ckpt.torch("neg"), torch.tensor([-2.0, 4.0]))


def test_zero_dimensional_arrays_keep_their_shape(repo: Path, tmp_path: Path) -> None:
    """A NumPy or JAX scalar (a step counter, a temperature) is a 0-d tensor, written as
    safetensors' own writer writes it: shape [], not [1]."""
    from safetensors.numpy import save_file

    jnp = pytest.importorskip("jax.numpy")
    scalars = {"n": np.float32(2.0), "a": np.array(7, dtype=np.int64), "j": jnp.float32(1.5)}
    git_theta.save(scalars, "m.safetensors", write_file=True)
    save_file({k: np.asarray(v) for k, v in scalars.items()}, str(tmp_path / "ref.safetensors"))
    assert sha256(repo / "m.safetensors") == sha256(tmp_path / "ref.safetensors")
    with git_theta.open(None, "m.safetensors") as ckpt:
        assert ckpt.shapes == {"a": (), "j": (), "n": ()}
        assert ckpt["j"].shape == () and float(ckpt["j"]) == 1.5


def test_a_revision_is_never_taken_for_an_option(repo: Path, tmp_path: Path) -> None:
    """``git log --output=FILE`` writes FILE: a rev of that shape is refused, as is one
    that does not exist, by history, open and load_from_git alike."""
    git_theta.save(state(0), "m.safetensors", message="v0")
    target = tmp_path / "written"
    for rev in (f"--output={target}", "nope"):
        message = f"^revision '{rev}' does not exist"
        with pytest.raises(UsageError, match=message):
            git_theta.history("m.safetensors", rev=rev)
        with pytest.raises(UsageError, match=message):
            git_theta.open(rev, "m.safetensors")
        with pytest.raises(UsageError, match=message):
            git_theta.load_from_git(rev, "m.safetensors", "safetensors", checkout=True)
    assert not target.exists()
    assert len(git_theta.history("m.safetensors")) == 1


@pytest.mark.parametrize("planted", ["symlink", "directory"])
def test_save_refuses_to_replace_what_is_not_a_file_before_staging(
    repo: Path, tmp_path: Path, planted: str
) -> None:
    """write_file=True over a symlink (to a file outside) or a directory: refused before
    the index changes; nothing behind the link is touched."""
    from git_theta.files import UnsafeFileError

    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"theirs")
    if planted == "symlink":
        (repo / "m.safetensors").symlink_to(outside)
    else:
        (repo / "m.safetensors").mkdir()
    index = (repo / ".git" / "index").read_bytes()
    with pytest.raises(UnsafeFileError, match=r"^m.safetensors is a (symbolic link|directory)"):
        git_theta.save(state(0), "m.safetensors", write_file=True)
    assert (repo / ".git" / "index").read_bytes() == index
    assert outside.read_bytes() == b"theirs"


def test_versions_read_in_parallel_threads_each_keep_their_own_expansion_count(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each opened version counts what it rebuilt, however many threads read others at
    the same time: every reader is refused at its own third tensor, never earlier or later."""
    import sys
    import threading

    from git_theta import smudge

    zeros = {f"t{i}": np.zeros(1 << 18, np.float32) for i in range(4)}  # 1 MiB each
    git_theta.save(zeros, "m.safetensors", message="zeros")
    monkeypatch.setattr(smudge, "EXPANSION_FLOOR", 5 << 19)  # 2.5 MiB
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave between any two bytecodes
    start = threading.Barrier(8)
    results: list[list[str]] = []

    def reader() -> None:
        got: list[str] = []
        with git_theta.open("HEAD", "m.safetensors") as ckpt:
            start.wait()
            for _ in range(20):
                for name in ckpt:
                    try:
                        ckpt[name]
                    except smudge.ExpansionError:
                        got.append(f"refused {name}")
                        break
                    got.append(name)
        results.append(got)

    try:
        threads = [threading.Thread(target=reader) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    refused = ["t0", "t1", "refused t2"] + ["t0", "t1", "refused t2"] * 19
    assert results == [refused] * 8
