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

``--history``: the adapter directory and the merged model committed together, two LoRA
versions (the second trained on from the first), added as ``git add .`` orders them (the
adapter file first, then the model with ``--update-type low-rank --update-path adapter/``);
and an adapter-only history (three versions, the adapter directory alone). Bytes each
commit adds, for git-theta, Git LFS and, with ``--previous SRC`` (the ``src`` directory of
an older git-theta, e.g. ``git archive REV src | tar -x -C DIR``), that git-theta.

Usage: HF_HUB_OFFLINE=1 python bench/peft.py [--runs N] [--steps N] [--out FILE] [--keep]
       HF_HUB_OFFLINE=1 python bench/peft.py --history [--previous DIR/src] [--steps N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
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
ADAPTER = "adapter_model.safetensors"
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


def lora_versions(work: Path, steps: int, count: int) -> list[Path]:
    """Base model (``work/v0``), then ``count`` versions of one BERT LoRA, each trained on
    from the last: ``work/vN`` holds ``adapter/`` and the merged ``model.safetensors``."""
    import copy

    import peft

    model, targets = build("bert")
    model.save_pretrained(work / "v0")
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    )
    out = []
    for n in range(1, count + 1):
        train(wrapped, steps)  # a new generator each time: the same batches, new factors
        wrapped.save_pretrained(work / f"v{n}" / "adapter")
        copy.deepcopy(wrapped).merge_and_unload().save_pretrained(work / f"v{n}" / "merged")
        os.replace(work / f"v{n}" / "merged" / FILE, work / f"v{n}" / FILE)
        out.append(work / f"v{n}")
    return out


def previous_env(work: Path, env: bench.Env, src: Path) -> bench.Env:
    """``env`` running the git-theta whose sources are ``src`` (the command and the filter)."""
    import shlex

    old = work / "previous-src"
    shutil.copytree(src, old)
    for built in (Path(__file__).resolve().parents[1] / "src" / "git_theta").glob("_planes*.so"):
        shutil.copy(built, old / "git_theta")  # the C kernel, if this checkout built one
    shim = work / "previous-bin"
    shim.mkdir()
    code = (
        f"import sys, runpy; sys.path.insert(0, {str(old)!r}); "
        "runpy.run_module('git_theta', run_name='__main__', alter_sys=True)"
    )
    script = shim / "git-theta"
    script.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -E -P -c {shlex.quote(code)} "$@"\n'
    )
    script.chmod(0o755)
    home = work / "previous-home"
    home.mkdir()
    # This git-theta's install (it refuses to set up another's), the filter pointed at it.
    shutil.copy(env["GIT_CONFIG_GLOBAL"], home / ".gitconfig")
    out = dict(env)
    out.update(
        HOME=str(home),
        GIT_CONFIG_GLOBAL=str(home / ".gitconfig"),
        PATH=os.pathsep.join([str(shim), env["PATH"]]),
    )
    for key, args in (("process", "filter-process"), ("clean", "clean -- %f"),
                      ("smudge", "smudge -- %f")):  # fmt: skip
        bench.run(
            ["git", "config", "--global", f"filter.theta.{key}", f"{script} {args}"], work, out
        )
    return out


def history(work: Path, envs: dict[str, bench.Env], versions: list[Path]) -> list[list[str]]:
    """Rows: bytes each commit adds, per tool, for the adapter + merged model history and
    the adapter-only one; every version checked out again bit for bit at the end."""
    rows = []
    for kind in ("adapter + merged model", "adapter only"):
        sizes: dict[str, list[int]] = {}
        for tool, env in envs.items():
            repo = work / f"{'model' if kind != 'adapter only' else 'adapter'}-{tool}"
            repo.mkdir()
            bench.run(["git", "init", "-q"], repo, env)
            if tool == "lfs":
                bench.run(["git", "lfs", "install", "--local"], repo, env)
                bench.run(["git", "lfs", "track", "*.safetensors"], repo, env)
            else:
                bench.run(["git", "theta", "track", "*.safetensors"], repo, env)
            sizes[tool] = []
            # Two versions with the merged model; three of the adapter alone.
            commits = [versions[0].parent / "v0", *versions[:2]]
            if kind == "adapter only":
                commits = versions
            shas = []
            for version in commits:
                before = bench.stored_bytes(repo)
                if (version / "adapter").exists():
                    shutil.copytree(version / "adapter", repo / "adapter", dirs_exist_ok=True)
                if kind != "adapter only":
                    (repo / FILE).write_bytes((version / FILE).read_bytes())
                if tool != "lfs" and kind != "adapter only" and (repo / "adapter").exists():
                    bench.run(["git", "add", "adapter"], repo, env)  # as `git add .` orders it
                    bench.run(["git", "theta", "add", "--update-type", "low-rank",
                               "--update-path", "adapter/", FILE], repo, env)  # fmt: skip
                bench.run(["git", "add", "-A"], repo, env)
                bench.run(["git", "commit", "-q", "-m", version.name], repo, env)
                sizes[tool].append(bench.stored_bytes(repo) - before)
                files = [p for p in (repo / FILE, repo / "adapter" / ADAPTER) if p.exists()]
                shas.append({p: bench.sha256(p) for p in files})
            for back, wanted in enumerate(reversed(shas)):
                bench.run(["git", "checkout", "-q", f"HEAD~{back}"], repo, env)
                for path, sha in wanted.items():
                    if bench.sha256(path) != sha:
                        raise bench.BenchError(f"{tool}: {path} at HEAD~{back} differs")
                bench.run(["git", "checkout", "-q", "main"], repo, env)
        for n in range(len(next(iter(sizes.values())))):
            label = ("v0 (base)" if n == 0 else f"v{n}") if kind != "adapter only" else f"v{n + 1}"
            rows.append([kind, label, *(f"{sizes[t][n]:,} B" for t in envs)])
        rows.append([kind, "**total**", *(f"**{sum(sizes[t]):,} B**" for t in envs)])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed adds of each merge")
    parser.add_argument("--steps", type=int, default=5, help="training steps per LoRA")
    parser.add_argument("--only", help="run the cases whose label contains this")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--history", action="store_true", help="adapter + merge histories")
    parser.add_argument("--previous", type=Path, help="with --history: an older git-theta's src")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    work = Path(tempfile.mkdtemp(prefix="theta-peft-"))
    env = bench.hermetic_env(work)
    rows = []
    if args.history:
        try:
            envs = {"theta": env}
            if args.previous is not None:
                envs["previous"] = previous_env(work, env, args.previous.resolve())
            envs["lfs"] = env
            loras = lora_versions(work / "lora", args.steps, 3)
            rows = history(work, envs, loras)
        finally:
            bench.remove_workdir(work, args.keep)
        names = {"theta": "git-theta", "previous": "git-theta (previous)", "lfs": "Git LFS"}
        head = " | ".join(["history", "commit", *(names[t] for t in envs)])
        text = "\n".join(bench.table(head, rows)) + "\n"
        print(text)
        if args.out is not None:
            args.out.write_text(text)
        return 0
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
