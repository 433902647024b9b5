"""The API's save does not copy the caller's tensors: clean hashes and encodes them where
they are (read-only views), under every update type, and leaves them as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256

import git_theta
from git_theta import clean as clean_module
from git_theta import codec


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a.weight": (rng.standard_normal((256, 128)) * 0.02).astype(np.float32),
        "b.weight": (rng.standard_normal((128, 128)) * 0.02).astype(np.float32),
        "c.bias": (rng.standard_normal(1024) * 0.02).astype(np.float32),
    }


@pytest.mark.parametrize("update_type", ["auto", "dense", "sparse", "ia3"])
def test_save_reads_no_tensor_into_a_buffer_of_its_own(
    repo: Path, monkeypatch: pytest.MonkeyPatch, update_type: str
) -> None:
    """Every tensor byte used to be copied into a fresh buffer (new pages, a memcpy of
    the whole model); what clean reads for the tensors now is the caller's memory."""
    asked: list[int] = []

    class Counting:  # clean's view of the codec: counts the buffers its reader asks for
        def __getattr__(self, name: str) -> object:
            return getattr(codec, name)

        def new_buffer(self, n: int) -> bytearray:
            asked.append(n)
            return codec.new_buffer(n)

    monkeypatch.setattr(clean_module, "codec", Counting())
    first = _state(0)
    git_theta.save(first, "model.safetensors", message="v0")
    second = {k: v.copy() for k, v in first.items()}
    second["a.weight"].reshape(-1)[::53] += np.float32(1e-3)
    second["b.weight"] *= np.float32(1.001)
    kept = {k: v.copy() for k, v in second.items()}
    asked.clear()
    git_theta.save(second, "model.safetensors", message="v1", update_type=update_type)
    assert all(np.array_equal(second[k], kept[k]) for k in kept)  # the caller's, untouched
    assert [n for n in asked if n >= 4096] == []  # the header's reads only
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
