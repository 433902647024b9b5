"""transformers' Trainer with GitThetaCallback: a real run (GPT-2 from a config, CPU, a
few steps, nothing downloaded) commits every save with its step and metrics, and every
file checks out byte for byte as the Trainer wrote it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import git, sha256

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def tiny_gpt2() -> object:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) * (i + 1)) % 128
        return {"input_ids": ids, "labels": ids}


NOT_COMMITTED = "training_args.bin"  # a pickle: not in the callback's include= by default


def files_of(directory: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in sorted(directory.iterdir()) if p.name != NOT_COMMITTED}


def test_trainer_commits_each_save(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import Trainer, TrainingArguments

    from git_theta.integrations.transformers import GitThetaCallback

    out = repo / "out"
    args = TrainingArguments(
        output_dir=str(out), max_steps=4, save_steps=2, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, report_to=[], use_cpu=True,
        save_only_model=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    callback = GitThetaCallback()
    Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[callback]).train()

    assert len(callback.commits) == 2
    subjects = git(repo, "log", "--format=%s", "-2").stdout.decode().splitlines()
    assert subjects[0].startswith("checkpoint step 4: ") and "loss=" in subjects[0]
    assert subjects[1].startswith("checkpoint step 2: ") and "loss=" in subjects[1]
    untracked = git(repo, "status", "--porcelain").stdout.decode().splitlines()
    # Only the Trainer's pickled arguments are left out (include= names what to commit).
    assert {line.rsplit("/", 1)[-1] for line in untracked} == {NOT_COMMITTED}
    git(repo, "diff-index", "--quiet", "HEAD", "--")

    written = {step: files_of(out / f"checkpoint-{step}") for step in (2, 4)}
    assert "model.safetensors" in written[4] and "config.json" in written[4]
    # The second save is stored against the first: changed tensors as updates.
    manifest = json.loads(git(repo, "show", "HEAD:out/checkpoint-4/model.safetensors").stdout)
    chains = [t["chain"] for t in manifest["tensors"].values()]
    assert any(len(chain) > 1 for chain in chains)

    for step, commit in zip((2, 4), callback.commits, strict=True):
        for directory in out.iterdir():
            for f in directory.iterdir():
                if f.name != NOT_COMMITTED:
                    f.unlink()
        git(repo, "checkout", "-q", commit, "--", ".")
        assert files_of(out / f"checkpoint-{step}") == written[step]


def test_a_sharded_save_pretrained_layout(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_pretrained's shards and index, committed twice: tensors that moved between
    shards are still stored against their previous values."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from git_theta.integrations.transformers import GitThetaCallback

    model = tiny_gpt2()
    callback = GitThetaCallback(tag="step-{step}")
    for step in (1, 2):
        directory = repo / "run" / f"checkpoint-{step}"
        model.save_pretrained(directory, max_shard_size="100KB")  # type: ignore[attr-defined]
        if step == 2:  # rotated away, as save_total_limit=1 does
            for f in (repo / "run" / "checkpoint-1").iterdir():
                f.unlink()
            (repo / "run" / "checkpoint-1").rmdir()
        callback.commit_checkpoint(directory, step, log_history=[{"loss": 1.5, "step": step}])
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, :4] += 1  # type: ignore[attr-defined]
    shards = sorted(p.name for p in (repo / "run" / "checkpoint-2").glob("*.safetensors"))
    assert len(shards) > 1 and (repo / "run/checkpoint-2/model.safetensors.index.json").exists()
    assert git(repo, "tag").stdout.decode().split() == ["step-1", "step-2"]
    assert "loss=1.5" in git(repo, "log", "-1", "--format=%s").stdout.decode()
    assert git(repo, "status", "--porcelain").stdout == b""
    tip = git(repo, "ls-tree", "--name-only", "HEAD", "run/").stdout.decode().split()
    assert tip == ["run/checkpoint-2"]
    assert git(repo, "ls-tree", "step-1", "run/checkpoint-1/config.json").stdout
    changed = "transformer.h.0.mlp.c_fc.weight"
    updates = []
    for shard in shards:
        blob = git(repo, "show", f"step-2:run/checkpoint-2/{shard}").stdout
        entry = json.loads(blob)["tensors"].get(changed)
        if entry is not None:
            updates = [link["update"] for link in entry["chain"]]
    assert len(updates) == 2 and updates[0] == "dense"


def test_rotation_removes_only_checkpoints(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints in the repository's top: a file of the user's that is deleted but not
    staged is not committed as removed along with a rotated checkpoint."""
    import numpy as np
    from safetensors.numpy import save_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from git_theta.integrations.transformers import GitThetaCallback

    (repo / "notes.txt").write_text("mine\n")
    git(repo, "add", "notes.txt")
    git(repo, "commit", "-q", "-m", "notes")
    (repo / "notes.txt").unlink()
    callback = GitThetaCallback()
    for step in (1, 2):
        directory = repo / f"checkpoint-{step}"
        directory.mkdir()
        save_file({"w": np.full(4, step, np.float32)}, str(directory / "model.safetensors"))
        if step == 2:
            (repo / "checkpoint-1" / "model.safetensors").unlink()
            (repo / "checkpoint-1").rmdir()
        callback.commit_checkpoint(directory, step)
    tip = git(repo, "ls-tree", "--name-only", "HEAD").stdout.decode().split()
    assert tip == [".gitattributes", "checkpoint-2", "notes.txt"]
