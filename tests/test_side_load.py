"""Side-loaded updates (`git theta add PATH --update-type T --update-data FILE`): the
committed value is the staged value plus FILE's update, the work-tree file is rewritten
to exactly that (status clean), older commits check out unchanged; errors name FILE."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256, track
from safetensors.numpy import load_file, save_file

from git_theta.commands.cli import main

torch = pytest.importorskip("torch")


def sparse_update(values: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The predecessor's sparse layout: a 1 x N CSR matrix per tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in values.items():
        idx = torch.tensor(sorted({0, value.numel() - 1}), dtype=torch.int32)
        out[f"{name}/data"] = torch.randn(len(idx), generator=g)
        out[f"{name}/indices"] = idx
        out[f"{name}/indptr"] = torch.tensor([0, len(idx)], dtype=torch.int32)
        out[f"{name}/shape"] = torch.tensor(list(value.shape))
    return out


def plus(values: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> dict[str, object]:
    out = {}
    for name, value in values.items():
        flat = value.reshape(-1).clone()
        flat[update[f"{name}/indices"].long()] += update[f"{name}/data"]
        out[name] = flat.reshape(value.shape)
    return out


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(8, 6, generator=g),
        "fc.bias": torch.randn(6, generator=g),
        "signs": torch.tensor([-0.0, 1.0, -0.0, 2.0]),
    }


def status_clean(repo: Path) -> None:
    assert git(repo, "status", "--porcelain", "--untracked-files=no").stdout == b""
    git(repo, "diff-index", "--quiet", "HEAD", "--")  # the predecessor's own check


def test_predecessor_sparse_end_to_end_with_pt_files(repo: Path) -> None:
    """tests/end2end/sparse of the predecessor, through today's CLI."""
    track(repo, "*.pt")
    torch.save(model(0), repo / "model.pt")
    first = sha256(repo / "model.pt")
    git(repo, "add", "model.pt")
    git(repo, "commit", "-q", "-m", "first")
    update = sparse_update(model(0), 42)
    torch.save(update, repo / "sparse-data.pt")
    code = main(["add", "model.pt", "--update-type", "sparse", "--update-data", "sparse-data.pt"])
    assert code == 0
    git(repo, "commit", "-q", "-m", "sparse")
    status_clean(repo)
    zipfile.ZipFile(repo / "model.pt").testzip()  # CRCs follow the new bytes
    loaded = torch.load(repo / "model.pt", weights_only=True)
    expected = plus(model(0), update)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert str(loaded["signs"][2].item()) == "-0.0"  # untouched elements keep their bits
    chain = json.loads(git(repo, "show", "HEAD:model.pt").stdout)["tensors"]["fc.weight"]["chain"]
    assert [link["update"] for link in chain] == ["dense", "sparse"]
    after = sha256(repo / "model.pt")
    git(repo, "checkout", "-q", "HEAD~1")
    assert sha256(repo / "model.pt") == first
    git(repo, "checkout", "-q", "main")
    assert sha256(repo / "model.pt") == after


def test_sparse_from_the_environment_on_safetensors(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {k: v.numpy() for k, v in model(1).items()}
    save_file(values, str(repo / "model.safetensors"))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    update = {k: v.numpy() for k, v in sparse_update(model(1), 7).items()}
    save_file(update, str(repo / "blob"))
    # The user's own link (a Hugging Face cache's snapshot files are links) is followed.
    (repo / "update.safetensors").symlink_to("blob")
    monkeypatch.setenv("GIT_THETA_UPDATE_DATA_PATH", "update.safetensors")
    assert main(["add", "model.safetensors", "--update-type", "sparse"]) == 0
    git(repo, "commit", "-q", "-m", "v2")
    status_clean(repo)
    got = load_file(str(repo / "model.safetensors"))
    expected = plus(model(1), {k: torch.from_numpy(v) for k, v in update.items()})
    for name, value in expected.items():
        assert np.array_equal(got[name], value.numpy())  # type: ignore[attr-defined]


def test_plain_git_add_refuses_the_data_variable(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_file({"w": np.ones(3, np.float32)}, str(repo / "model.safetensors"))
    monkeypatch.setenv("GIT_THETA_UPDATE_DATA_PATH", "update.safetensors")
    done = git(repo, "add", "model.safetensors", check=False)
    assert done.returncode != 0
    assert "GIT_THETA_UPDATE_DATA_PATH is applied by `git theta add PATH" in done.stderr.decode()


def test_low_rank_and_ia3_factors_are_applied_and_stored_as_factors(repo: Path) -> None:
    from git_theta.updates.factored import Factor, Inputs, apply_update

    g = np.random.default_rng(3)
    w = g.standard_normal((64, 48)).astype(np.float32)  # large enough for factors to pay
    v = g.standard_normal((48, 32)).astype(np.float32)
    save_file({"w": w, "v": v}, str(repo / "model.safetensors"))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    r = g.standard_normal((64, 2)).astype(np.float32)
    c = g.standard_normal((2, 48)).astype(np.float32)
    save_file({"w/R": r, "w/C": c}, str(repo / "lora.safetensors"))
    args = ["add", "model.safetensors", "--update-type", "low-rank", "--update-data"]
    assert main([*args, "lora.safetensors"]) == 0
    git(repo, "commit", "-q", "-m", "lora")
    status_clean(repo)
    factors = (Factor("F32", r.shape, r.tobytes()), Factor("F32", c.shape, c.tobytes()))
    want = apply_update(w.tobytes(), "F32", w.shape, Inputs("low-rank", factors))
    got = load_file(str(repo / "model.safetensors"))
    assert got["w"].tobytes() == want and np.array_equal(got["v"], v)
    assert np.allclose(got["w"], w + r @ c, atol=1e-5)
    chain = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)["tensors"]["w"]["chain"]
    assert chain[-1]["update"] == "low-rank"

    scale = g.standard_normal(32).astype(np.float32)
    save_file({"v/ia3": scale}, str(repo / "ia3.safetensors"))
    args = ["add", "model.safetensors", "--update-type", "ia3", "--update-data"]
    assert main([*args, "ia3.safetensors"]) == 0
    git(repo, "commit", "-q", "-m", "ia3")
    status_clean(repo)
    assert np.array_equal(load_file(str(repo / "model.safetensors"))["v"], v * scale[None, :])


def test_errors_name_the_update_file(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"w": np.ones((2, 3), np.float32)}, str(repo / "model.safetensors"))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    before = sha256(repo / "model.safetensors")
    (repo / "broken.pt").write_bytes(b"PK\x03\x04 not a zip at all")
    save_file({"x/data": np.ones(1, np.float32), "x/indices": np.zeros(1, np.int32)},
              str(repo / "other.safetensors"))  # fmt: skip
    bad_shape = {"w/data": np.ones(1, np.float32), "w/indices": np.zeros(1, np.int32),
                 "w/shape": np.array([3, 2])}  # fmt: skip
    save_file(bad_shape, str(repo / "shape.safetensors"))
    cases = {
        "broken.pt": "git-theta: error: broken.pt: ",
        "other.safetensors": "git-theta: error: other.safetensors: model.safetensors has no "
        "tensor 'x'",
        "shape.safetensors": "git-theta: error: shape.safetensors: w/shape is [3, 2], the "
        "tensor's [2, 3]",
        "missing.pt": "git-theta: error: --update-data missing.pt: no such file",
        "adapter": "git-theta: error: --update-data adapter: not a regular file",
    }
    (repo / "adapter").mkdir()
    for name, message in cases.items():
        args = ["add", "model.safetensors", "--update-type", "sparse", "--update-data", name]
        assert main(args) != 0
        err = capsys.readouterr().err
        assert err.startswith(message), err
        assert len(err.strip().splitlines()) <= 2, err
        assert sha256(repo / "model.safetensors") == before
        status_clean(repo)
    args = ["add", "model.safetensors", "--update-type", "delta", "--update-data", "x.pt"]
    assert main(args) != 0
    assert "--update-data needs --update-type sparse, low-rank or ia3" in capsys.readouterr().err


def test_a_changed_file_is_added_as_it_is(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"w": np.ones((2, 3), np.float32)}, str(repo / "model.safetensors"))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    save_file({"w": np.full((2, 3), 2.0, np.float32)}, str(repo / "model.safetensors"))
    changed = sha256(repo / "model.safetensors")
    save_file({"w/data": np.ones(1, np.float32), "w/indices": np.zeros(1, np.int32)},
              str(repo / "u.safetensors"))  # fmt: skip
    args = ["add", "model.safetensors", "--update-type", "sparse", "--update-data"]
    assert main([*args, "u.safetensors"]) == 0
    err = capsys.readouterr().err
    assert "to 0 tensors; 1 it names changed in the file since it was staged" in err
    assert sha256(repo / "model.safetensors") == changed
    git(repo, "commit", "-q", "-m", "v2")
    status_clean(repo)


def test_predecessor_low_rank_end_to_end(repo: Path) -> None:
    """tests/end2end/low-rank of the predecessor: the 1-D tensors change in the file, the
    2-D ones get their factors from FILE; each tensor ends as the predecessor defined."""
    from git_theta.updates.factored import Factor, Inputs, apply_update

    track(repo, "*.pt")
    g = torch.Generator().manual_seed(0)
    first = {"fc.weight": torch.randn(64, 48, generator=g), "fc.bias": torch.randn(48, generator=g)}
    torch.save(first, repo / "model.pt")
    git(repo, "add", "model.pt")
    git(repo, "commit", "-q", "-m", "first")
    bias = first["fc.bias"] + 1
    torch.save({"fc.weight": first["fc.weight"], "fc.bias": bias}, repo / "model.pt")
    r, c = torch.randn(64, 2, generator=g), torch.randn(2, 48, generator=g)
    torch.save({"fc.weight/R": r, "fc.weight/C": c}, repo / "low-rank-data.pt")
    args = ["add", "model.pt", "--update-type", "low-rank", "--update-data", "low-rank-data.pt"]
    assert main(args) == 0
    git(repo, "commit", "-q", "-m", "low-rank")
    status_clean(repo)
    loaded = torch.load(repo / "model.pt", weights_only=True)
    assert torch.equal(loaded["fc.bias"], bias)
    factors = tuple(Factor("F32", tuple(t.shape), t.numpy().tobytes()) for t in (r, c))
    w = first["fc.weight"].numpy()
    want = apply_update(w.tobytes(), "F32", w.shape, Inputs("low-rank", factors))
    assert loaded["fc.weight"].numpy().tobytes() == want
    assert torch.allclose(loaded["fc.weight"], first["fc.weight"] + r @ c, atol=1e-5)
    git(repo, "checkout", "-q", "HEAD~1")
    assert torch.equal(
        torch.load(repo / "model.pt", weights_only=True)["fc.bias"], first["fc.bias"]
    )


def test_predecessor_ia3_end_to_end_broadcasts_like_numpy(repo: Path) -> None:
    """tests/end2end/ia3 of the predecessor: each tensor is multiplied by its ia3 vector
    with NumPy's broadcasting, a (1,) scale on an (8,) bias included."""
    track(repo, "*.pt")
    g = torch.Generator().manual_seed(1)
    first = {"fc.weight": torch.randn(8, 6, generator=g), "fc.bias": torch.randn(8, generator=g)}
    torch.save(first, repo / "model.pt")
    git(repo, "add", "model.pt")
    git(repo, "commit", "-q", "-m", "first")
    scales = {
        "fc.weight/ia3": torch.randn(1, 6, generator=g),
        "fc.bias/ia3": torch.randn(1, generator=g),
    }
    torch.save(scales, repo / "ia3-data.pt")
    args = ["add", "model.pt", "--update-type", "ia3", "--update-data", "ia3-data.pt"]
    assert main(args) == 0
    git(repo, "commit", "-q", "-m", "ia3")
    status_clean(repo)
    loaded = torch.load(repo / "model.pt", weights_only=True)
    for name in ("fc.weight", "fc.bias"):
        want = first[name].numpy() * scales[f"{name}/ia3"].numpy()
        assert loaded[name].numpy().tobytes() == want.astype(np.float32).tobytes(), name
    git(repo, "checkout", "-q", "HEAD~1")
    assert torch.equal(
        torch.load(repo / "model.pt", weights_only=True)["fc.bias"], first["fc.bias"]
    )


def test_a_symlinked_directory_is_refused_before_anything_is_staged(
    repo: Path, tmp_path: Path
) -> None:
    """A directory of the work tree replaced by a link to elsewhere: the file behind it is
    neither read into the index nor rewritten; the index stays as it was."""
    import shutil

    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"w": np.arange(6, dtype=np.float32)}, str(outside / "m.safetensors"))
    before = sha256(outside / "m.safetensors")
    (repo / "d").mkdir()
    save_file({"w": np.arange(6, dtype=np.float32)}, str(repo / "d" / "m.safetensors"))
    git(repo, "add", "d/m.safetensors")
    git(repo, "commit", "-q", "-m", "v0")
    index = (repo / ".git" / "index").read_bytes()
    shutil.rmtree(repo / "d")
    (repo / "d").symlink_to(outside)
    data = tmp_path / "u.safetensors"
    save_file({"w/data": np.ones(1, np.float32), "w/indices": np.array([1])}, str(data))
    args = ["add", "d/m.safetensors", "--update-type", "sparse", "--update-data", str(data)]
    assert main(args) == 1
    assert git(repo, "diff", "--cached", "--name-only").stdout == b""
    assert (repo / ".git" / "index").read_bytes() == index
    assert sha256(outside / "m.safetensors") == before
    assert sorted(p.name for p in outside.iterdir()) == ["m.safetensors"]


@pytest.mark.parametrize("values", [[1.5], [300.0], [-1.0]])
def test_a_sparse_value_an_integer_tensor_cannot_hold_is_refused(
    repo: Path, tmp_path: Path, values: list[float]
) -> None:
    save_file({"w": np.arange(6, dtype=np.uint8)}, str(repo / "m.safetensors"))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v0")
    before = sha256(repo / "m.safetensors")
    data = tmp_path / "u.safetensors"
    save_file({"w/data": np.array(values, np.float32), "w/indices": np.array([1])}, str(data))
    args = ["add", "m.safetensors", "--update-type", "sparse", "--update-data", str(data)]
    assert main(args) == 2
    assert sha256(repo / "m.safetensors") == before
    status_clean(repo)


def test_an_in_process_add_leaves_the_callers_environment_as_it_was(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`main(["add", ...])` from Python (a notebook, the API's users) hands its settings
    to git's filter without leaving them in the caller's environment."""
    import os

    for name in ("GIT_THETA_UPDATE_TYPE", "GIT_THETA_UPDATE_PATH"):
        monkeypatch.delenv(name, raising=False)
    values = {k: v.numpy() for k, v in model(1).items()}
    save_file(values, str(repo / "model.safetensors"))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    before = dict(os.environ)
    values["fc.bias"][0] += 1
    save_file(values, str(repo / "model.safetensors"))
    assert main(["add", "model.safetensors", "--update-type", "sparse"]) == 0
    assert dict(os.environ) == before
    update = {k: v.numpy() for k, v in sparse_update(model(1), 7).items()}
    save_file(update, str(repo / "update.safetensors"))
    git(repo, "commit", "-q", "-m", "v2")
    monkeypatch.setenv("GIT_THETA_UPDATE_DATA_PATH", "update.safetensors")
    before = dict(os.environ)
    assert main(["add", "model.safetensors", "--update-type", "sparse"]) == 0
    assert dict(os.environ) == before
    # and with the variable set, the commit after it (git cleans the file again when its
    # timestamp is racy) is not refused: nothing changed, nothing is stored
    git(repo, "commit", "-q", "-m", "v3")
    assert git(repo, "status", "--porcelain").stdout == b"?? update.safetensors\n"
