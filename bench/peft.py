"""Merged PEFT LoRA fine-tunes: what git-theta stores against plain Git LFS and the factors.

For BERT (``nn.Linear`` layers) and GPT-2 (``Conv1D``, ``fan_in_fan_out``), built from
configs (nothing downloaded): v0 is the base model's ``save_pretrained``; then a LoRA is
trained for a few AdamW steps on random tokens (CPU), saved (``adapter_model.safetensors``
+ ``adapter_config.json``), merged with ``merge_and_unload`` and the merged model saved
over v0. git-theta adds it with ``git theta add --update-type low-rank --update-path
ADAPTER_DIR``; Git LFS with ``git add``. Cases: plain LoRA (r 8, alpha 16), with an
``alpha_pattern``, with ``rank_pattern``, and rsLoRA; one adapter saved as ``.bin`` (torch
zip). The table gives the bytes each version adds to the object stores, the factors file
and the ratio git-theta / factors (target 1.2x), and the median add time of the merge.

Usage: HF_HUB_OFFLINE=1 python bench/peft.py [--runs N] [--steps N] [--out FILE] [--keep]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

# This file is named like the library it measures: take its directory off sys.path so
# `import peft` finds the library, and load bench/run.py (the shared helpers) by path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
_SPEC = importlib.util.spec_from_file_location("run", _HERE / "run.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
sys.modules["run"] = bench
_SPEC.loader.exec_module(bench)

FILE = "model.safetensors"
# (label, family, LoraConfig keyword arguments, adapter saved as safetensors)
CASES: list[tuple[str, str, dict[str, Any], bool]] = [
    ("BERT LoRA r8", "bert", {}, True),
    ("BERT alpha_pattern", "bert", {"alpha_pattern": {"value": 64}}, True),
    ("BERT rank_pattern", "bert", {"rank_pattern": {"query": 4}}, True),
    ("BERT rsLoRA", "bert", {"use_rslora": True}, True),
    ("GPT-2 LoRA r8 (Conv1D)", "gpt2", {}, True),
    ("GPT-2 alpha_pattern", "gpt2", {"alpha_pattern": {r"h\.1\.attn\.c_attn": 64}}, True),
    ("GPT-2 rsLoRA", "gpt2", {"use_rslora": True}, True),
    ("GPT-2 LoRA, .bin adapter", "gpt2", {}, False),
]


def build(family: str) -> Any:
    """A randomly initialised model of ``family`` (seeded), about 10 MB of FP32."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if family == "bert":
        config = tf.BertConfig(
            vocab_size=2000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, max_position_embeddings=128,
        )  # fmt: skip
        return tf.BertForMaskedLM(config), ["query", "value"]
    config = tf.GPT2Config(vocab_size=2000, n_embd=256, n_layer=4, n_head=4, n_positions=128)
    return tf.GPT2LMHeadModel(config), ["c_attn", "c_proj"]


def train(model: Any, steps: int) -> None:
    """A few real AdamW steps on random tokens (the LoRA factors move off their init)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, 2000, (4, 32), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()


def versions(work: Path, family: str, extra: dict[str, Any], safe: bool, steps: int) -> Path:
    """Write v0 (base) and v1 (merged) models and the adapter under ``work``."""
    import peft

    model, targets = build(family)
    model.save_pretrained(work / "v0")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, **extra)
    wrapped = peft.get_peft_model(model, config)
    train(wrapped, steps)
    wrapped.save_pretrained(work / "adapter", safe_serialization=safe)
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(work / "v1")
    return work / "adapter"


def stored_case(work: Path, env: bench.Env, label: str, adapter: Path, runs: int) -> list[str]:
    """Commit v0 then v1 in a git-theta and a Git LFS repository; return a table row."""
    added: dict[str, list[int]] = {}
    seconds: list[float] = []
    checkout: dict[str, float] = {}
    for tool in ("theta", "lfs"):
        repo = work / tool
        repo.mkdir()
        bench.run(["git", "init", "-q"], repo, env)
        if tool == "lfs":
            bench.run(["git", "lfs", "install", "--local"], repo, env)
            bench.run(["git", "lfs", "track", "*.safetensors"], repo, env)
        else:
            bench.run(["git", "theta", "track", "*.safetensors"], repo, env)
        added[tool] = []
        for version in ("v0", "v1"):
            (repo / FILE).write_bytes((work / version / FILE).read_bytes())
            before = bench.stored_bytes(repo)
            add = ["git", "theta", "add", "--update-type", "low-rank", "--update-path"]
            if tool == "theta" and version == "v1":
                seconds.append(bench.run([*add, str(adapter), FILE], repo, env).seconds)
            bench.run(["git", "add", "-A"], repo, env)
            bench.run(["git", "commit", "-q", "-m", version], repo, env)
            added[tool].append(bench.stored_bytes(repo) - before)
        if tool == "theta":
            for _ in range(runs - 1):  # the same add again, from v0 in the index
                bench.run(["git", "read-tree", "HEAD~1"], repo, env)  # work tree untouched
                seconds.append(bench.run([*add, str(adapter), FILE], repo, env).seconds)
            bench.run(["git", "read-tree", "HEAD"], repo, env)
        times = []
        for _ in range(runs):  # the merged version checks out bit for bit
            (repo / FILE).unlink()
            times.append(bench.run(["git", "checkout", "--", FILE], repo, env).seconds)
            if bench.sha256(repo / FILE) != bench.sha256(work / "v1" / FILE):
                raise bench.BenchError(f"{label}: the checkout differs from the merged file")
        checkout[tool] = statistics.median(times)
        factors = next(adapter.glob("adapter_model.*"))
        if factors.suffix == ".safetensors":  # the adapter committed beside the merge
            before = bench.stored_bytes(repo)
            (repo / factors.name).write_bytes(factors.read_bytes())
            bench.run(["git", "add", "-A"], repo, env)
            bench.run(["git", "commit", "-q", "-m", "adapter"], repo, env)
            added[tool].append(bench.stored_bytes(repo) - before)
    factors = next(adapter.glob("adapter_model.*"))
    size = factors.stat().st_size
    raw = (work / "v1" / FILE).stat().st_size
    theta, lfs = added["theta"], added["lfs"]
    also = f"{theta[2]:,} B / {lfs[2]:,} B" if len(theta) > 2 else "-"
    mb = bench.MB
    return [
        label, f"{raw / mb:.2f} MB", f"{theta[0] / mb:.2f} / {lfs[0] / mb:.2f} MB",
        f"{theta[1]:,} B", f"{lfs[1]:,} B", f"{size:,} B ({factors.suffix})",
        f"**{theta[1] / size:.2f}x**", also, f"{statistics.median(seconds):.2f} s",
        f"{checkout['theta']:.2f} / {checkout['lfs']:.2f} s",
    ]  # fmt: skip


HEAD = [
    "case", "model", "v0 theta / LFS", "v1 (merged) theta", "v1 LFS", "factors file",
    "v1 theta / factors", "adapter committed too: theta / LFS", "add v1 (median)",
    "checkout v1 theta / LFS (median)",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed adds of each merge")
    parser.add_argument("--steps", type=int, default=5, help="training steps per LoRA")
    parser.add_argument("--only", help="run the cases whose label contains this")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    work = Path(tempfile.mkdtemp(prefix="theta-peft-"))
    env = bench.hermetic_env(work)
    rows = []
    try:
        for number, (label, family, extra, safe) in enumerate(CASES):
            if args.only and args.only not in label:
                continue
            case = work / f"case{number}"
            case.mkdir()
            bench.log(f"{label}: training and merging")
            adapter = versions(case, family, extra, safe, args.steps)
            rows.append(stored_case(case, env, label, adapter, args.runs))
            bench.log(" | ".join(rows[-1]))
    finally:
        bench.remove_workdir(work, args.keep)
    text = "\n".join(bench.table(" | ".join(HEAD), rows)) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
