"""The API's save copies each tensor into clean's own (recycled) buffers, so that what is
hashed is what is encoded however the caller's memory changes meanwhile, under every update
type, leaves the caller's tensors as they were, and checks out byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256

import git_theta
from git_theta import clean as clean_module
from git_theta.content import content_hash


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a.weight": (rng.standard_normal((256, 128)) * 0.02).astype(np.float32),
        "b.weight": (rng.standard_normal((128, 128)) * 0.02).astype(np.float32),
        "c.bias": (rng.standard_normal(1024) * 0.02).astype(np.float32),
    }


@pytest.mark.parametrize("update_type", ["auto", "dense", "sparse", "ia3"])
def test_save_hashes_and_encodes_a_private_copy_of_each_tensor(
    repo: Path, monkeypatch: pytest.MonkeyPatch, update_type: str
) -> None:
    """Every tensor is read into a buffer of clean's own (f0dc65f lent it the caller's
    memory instead, which another thread may change between the hash and the encode);
    the caller's arrays are left untouched and the version checks out byte for byte."""
    hashed: list[object] = []

    def recording(data: object) -> str:
        hashed.append(data)
        return content_hash(data)  # type: ignore[arg-type]

    monkeypatch.setattr(clean_module, "content_hash", recording)
    first = _state(0)
    git_theta.save(first, "model.safetensors", message="v0")
    second = {k: v.copy() for k, v in first.items()}
    second["a.weight"].reshape(-1)[::53] += np.float32(1e-3)
    second["b.weight"] *= np.float32(1.001)
    kept = {k: v.copy() for k, v in second.items()}
    hashed.clear()
    git_theta.save(second, "model.safetensors", message="v1", update_type=update_type)
    assert all(np.array_equal(second[k], kept[k]) for k in kept)  # the caller's, untouched
    tensors = [d for d in hashed if len(d) >= 4096]  # type: ignore[arg-type]
    assert len(tensors) == len(second)
    assert all(isinstance(d, bytearray) for d in tensors)  # clean's own, not a view
    # ... and what was staged checks out to what safetensors' own writer makes.
    from safetensors.numpy import save_file

    save_file(second, str(repo / "ref.safetensors"))
    (repo / "model.safetensors").unlink(missing_ok=True)
    git(repo, "checkout", "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == sha256(repo / "ref.safetensors")


@pytest.mark.parametrize("name", ["model.pt", "weights.npz"])
def test_a_zip_format_save_spools_its_bytes_once(
    repo: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """torch.save and numpy.savez write a zip (its index at the end), serialised into one
    temporary file; clean used to copy all of it into a second one to seek in."""
    import tempfile

    from git_theta.commands.cli import main

    assert main(["track", "*.pt", "*.npz"]) == 0
    made: list[object] = []
    temporary_file = tempfile.TemporaryFile

    def counting(*args: object, **kwargs: object) -> object:
        made.append(args)
        return temporary_file(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(tempfile, "TemporaryFile", counting)
    state = _state(1)
    if name.endswith(".pt"):
        import torch

        git_theta.save({k: torch.from_numpy(v) for k, v in state.items()}, name, message="v")
    else:
        git_theta.save(state, name, message="v")
    assert len(made) == 1
    with git_theta.open("HEAD", name) as ckpt:
        assert all(np.array_equal(np.asarray(ckpt[k]), v) for k, v in state.items())
