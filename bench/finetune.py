"""Storage of real fine-tuning runs (transformers, torch CPU): git-theta against Git LFS.

A GPT-2 built from a config (random init, no download) is trained with AdamW on random
tokens; after every few steps it is saved, and each save committed to a git-theta and a
plain Git LFS repository. The same trajectory is saved several ways:

- one file (``save_pretrained``, one ``model.safetensors``);
- sharded (``max_shard_size`` fixed: tensors can still move between shards);
- re-sharded (another ``max_shard_size`` at every save: most tensors move);
- renamed shards (sharded, the files renamed at every save);
- ``.bin`` then ``.safetensors`` (``torch.save`` of the state dict for the first saves,
  then ``save_pretrained``: the same tensors in another format and file);
- one layer fine-tuned with the rest frozen (one file).

For each version: bytes each tool added to ``.git/lfs``, and for the fine-tunes an
estimate of the information in the change: the order-0 empirical entropy of each byte
plane of XOR(new, old) bit patterns, summed over tensors (what a coder that sees each
changed bit pattern independently would need). A last table shows where a full
fine-tune's bytes go: per byte plane of the delta against the first save, its coded
size (with and without grouping by the old exponent), its order-0 entropy and its
entropy given the old value's exponent or the plane above.

Usage: HF_HUB_OFFLINE=1 python bench/finetune.py [--out FILE] [--steps 3] [--saves 4]
       [--layers 6] [--width 384] [--keep]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import run as bench  # bench/run.py: the shared helpers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
State = dict[str, Any]  # name -> torch tensor (CPU, detached copies)


def train(args: argparse.Namespace, frozen: bool) -> list[State]:
    """Return the state dicts of ``args.saves`` saves: the initial model, then one after
    every ``args.steps`` AdamW steps (lr 2e-5) on random tokens."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(bench.SEED)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                        vocab_size=args.vocab, n_positions=256)  # fmt: skip
    model = GPT2LMHeadModel(config)
    params = list(model.parameters())
    if frozen:  # only the last block trains
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith(f"transformer.h.{args.layers - 1}.")
        params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-5)
    gen = torch.Generator().manual_seed(bench.SEED)
    states = [snapshot(model)]
    for _ in range(args.saves - 1):
        for _ in range(args.steps):
            tokens = torch.randint(0, args.vocab, (4, 64), generator=gen)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        states.append(snapshot(model))
    return states


def snapshot(model: Any) -> State:
    """Copies of the model's tensors; tied ones (lm_head is wte) stay one tensor."""
    copies: dict[int, Any] = {}
    out = {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in copies:
            copies[v.data_ptr()] = v.detach().clone()
        out[k] = copies[v.data_ptr()]
    return out


def model_for(state: State, args: argparse.Namespace) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                        vocab_size=args.vocab, n_positions=256)  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.load_state_dict(state)
    return model


def clear(directory: Path) -> None:
    for p in directory.iterdir():
        if p.name != ".git" and p.name != ".gitattributes":
            p.unlink()


Saver = Callable[[Path, State, int], None]


def saver(kind: str, args: argparse.Namespace) -> Saver:
    """How version ``i`` of the model is written into the work tree for ``kind``."""
    import torch

    shard = f"{args.shard_mb}MB"

    def save(repo: Path, state: State, i: int) -> None:
        clear(repo)
        model = model_for(state, args)
        if kind in ("one file", "one layer"):
            model.save_pretrained(repo, max_shard_size="50GB")
        elif kind == "sharded":
            model.save_pretrained(repo, max_shard_size=shard)
        elif kind == "re-sharded":
            sizes = [args.shard_mb, args.shard_mb * 2 // 3, args.shard_mb * 3 // 2]
            model.save_pretrained(repo, max_shard_size=f"{sizes[i % len(sizes)]}MB")
        elif kind == "renamed shards":
            model.save_pretrained(repo, max_shard_size=shard)
            for p in sorted(repo.glob("model-*.safetensors")):
                p.rename(repo / f"step{i}-{p.name}")
        elif kind == ".bin then .safetensors":
            if i < args.saves // 2:
                # As transformers 4 wrote pytorch_model.bin: tied copies left out.
                sd = {k: v.contiguous() for k, v in model.state_dict().items()}
                for key in getattr(model, "_tied_weights_keys", None) or ["lm_head.weight"]:
                    sd.pop(key, None)
                torch.save(sd, repo / "pytorch_model.bin")
                model.config.save_pretrained(repo)
            else:
                model.save_pretrained(repo, max_shard_size="50GB")
        else:
            raise ValueError(kind)

    return save


def xor_entropy_bytes(old: State, new: State) -> float:
    """Bytes an order-0 coder per byte plane would need for XOR(new, old) of each tensor
    (new tensors count whole, at 8 bits per byte)."""
    total = 0.0
    seen: set[int] = set()
    for name, value in new.items():
        if value.data_ptr() in seen:  # a tied weight (lm_head is wte): saved once
            continue
        seen.add(value.data_ptr())
        a = value.contiguous().view(-1).numpy()
        prev = old.get(name)
        if prev is None or prev.shape != value.shape or prev.dtype != value.dtype:
            total += a.nbytes
            continue
        word = a.dtype.itemsize
        x = (a.view(f"<u{word}") ^ prev.contiguous().view(-1).numpy().view(f"<u{word}")).view(
            np.uint8
        )
        planes = x.reshape(-1, word)
        for k in range(word):
            counts = np.bincount(planes[:, k], minlength=256)
            n = counts.sum()
            p = counts[counts > 0] / n
            total += float(-(p * np.log2(p)).sum()) * n / 8
    return total


def _entropy(plane: np.ndarray, context: np.ndarray | None = None) -> float:
    """Bytes an order-0 coder needs for ``plane`` (uint8), or, given ``context`` (ints
    >= 0, one per byte), for each group of equal context on its own: the empirical
    conditional entropy."""
    key = plane.astype(np.int64) if context is None else context * 256 + plane
    counts = np.bincount(key)
    counts = np.pad(counts, (0, -len(counts) % 256)).reshape(-1, 256)
    n = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(counts > 0, counts / np.maximum(n, 1), 1.0)
    return float(-(counts * np.log2(p)).sum()) / 8


def plane_report(states: list[State]) -> list[str]:
    """Per byte plane of the zigzag delta of every fine-tuned save against the first
    save (what the chains store for a full fine-tune): its raw size, coded size now and
    with grouping off, order-0 entropy, entropy given the old value's exponent (what
    grouping exploits) and given the plane above; summed over tensors, in MB."""
    from git_theta import codec

    mb = bench.MB
    rows = []
    for i, state in enumerate(states[1:], 1):
        sums = np.zeros((4, 6))
        seen: set[int] = set()
        for name, value in state.items():
            if value.data_ptr() in seen:  # a tied weight (lm_head is wte): saved once
                continue
            seen.add(value.data_ptr())
            old = states[0][name].contiguous().view(-1).numpy()
            new = value.contiguous().view(-1).numpy()
            if old.dtype != np.float32 or old.shape != new.shape:
                continue
            a, b = old.view("<u4"), new.view("<u4")
            d = (b - a).view("<i4")
            z = ((d << 1) ^ (d >> 31)).view("<u4")
            planes = z.view(np.uint8).reshape(-1, 4)
            exponent = ((a >> 23) & 0xFF).astype(np.int64)
            coded = [_plane_sizes(codec.encode(z.tobytes(), codec.Layout(4), context=ctx))
                     for ctx in (a.tobytes(), None)]  # fmt: skip
            for k in range(4):  # k = 0: the most significant byte
                plane = planes[:, 3 - k]
                h0 = _entropy(plane)
                above = _entropy(plane, planes[:, 4 - k].astype(np.int64)) if k else h0
                sums[k] += [len(plane), coded[0][k], coded[1][k], h0,
                            _entropy(plane, exponent), above]  # fmt: skip
        for k in range(4):
            r = sums[k]
            rows.append([f"v{i}", f"byte {3 - k}", *(f"{x / mb:.2f}" for x in r)])
    head = ("version|plane (3 = top)|raw MB|coded MB|coded, not grouped|order-0 entropy|"
            "given old exponent|given plane above")  # fmt: skip
    return ["Where a full fine-tune's bytes go (delta against the first save, per plane):", "",
            *bench.table(head, rows)]  # fmt: skip


def _plane_sizes(parts: list[bytes]) -> list[int]:
    """Payload bytes of each plane (most significant first), summed over chunks."""
    from git_theta import codec

    obj = b"".join(parts)
    sizes, pos, k = [0, 0, 0, 0], codec._HEAD.size, 0
    while pos < len(obj):
        _, n = codec._PLANE.unpack_from(obj, pos)
        sizes[k % 4] += n
        pos += codec._PLANE.size + n
        k += 1
    return sizes


def run_kind(
    kind: str, states: list[State], work: Path, env: bench.Env, args: argparse.Namespace
) -> list[dict[str, float]]:
    """Commit every version with both tools; return per version: raw, theta and LFS bytes
    added, the XOR-entropy estimate, and each tool's add time."""
    repos = {}
    for tool in ("theta", "lfs"):
        repo = work / f"{kind}-{tool}".replace(" ", "_").replace(".", "")
        repo.mkdir(parents=True)
        bench.run(["git", "init", "-q"], repo, env)
        if tool == "lfs":
            bench.run(["git", "lfs", "install", "--local"], repo, env)
        bench.run(["git", tool, "track", "*.safetensors", "*.bin"], repo, env)
        bench.run(["git", "add", ".gitattributes"], repo, env)
        bench.run(["git", "commit", "-q", "-m", "track"], repo, env)
        repos[tool] = repo
    save = saver(kind, args)
    rows = []
    for i, state in enumerate(states):
        row: dict[str, float] = {}
        row["entropy"] = xor_entropy_bytes(states[i - 1], state) if i else float("nan")
        for tool, repo in repos.items():
            save(repo, state, i)
            row["raw"] = sum(p.stat().st_size for p in repo.iterdir()
                             if p.suffix in (".safetensors", ".bin"))  # fmt: skip
            before = bench.stored_bytes(repo)
            ran = bench.run(["git", "add", "-A"], repo, env)
            bench.run(["git", "commit", "-q", "-m", f"v{i}"], repo, env)
            row[tool] = bench.stored_bytes(repo) - before
            row[f"{tool} s"] = ran.seconds
        check_out(repos["theta"], env)
        rows.append(row)
        bench.log(f"{kind} v{i}: theta {row['theta'] / bench.MB:.2f} MB, "
                  f"LFS {row['lfs'] / bench.MB:.2f} MB")  # fmt: skip
    return rows


def check_out(repo: Path, env: bench.Env) -> None:
    """Delete the work tree's checkpoints, check them out, compare sha256 with before."""
    files = [p for p in repo.iterdir() if p.suffix in (".safetensors", ".bin")]
    sums = {p: bench.sha256(p) for p in files}
    for p in files:
        p.unlink()
    bench.run(["git", "checkout", "--", "."], repo, env)
    for p, s in sums.items():
        if bench.sha256(p) != s:
            raise bench.BenchError(f"{p.name} checked out with other bytes")


KINDS = ["one file", "sharded", "re-sharded", "renamed shards", ".bin then .safetensors"]


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    mb = bench.MB
    lines = [f"GPT-2 from a config ({args.layers} layers, width {args.width}, vocab "
             f"{args.vocab}, FP32), AdamW lr 2e-5, {args.steps} steps of 4x64 random tokens "
             f"between saves, {args.saves} saves; shards of {args.shard_mb} MB.", ""]  # fmt: skip
    rows = []
    for kind, per in results.items():
        for i, r in enumerate(per):
            ent = "" if math.isnan(r["entropy"]) else f"{r['entropy'] / mb:.2f} MB"
            gap = "" if math.isnan(r["entropy"]) else f"{r['theta'] / r['entropy']:.2f}x"
            theta = f"{r['theta'] / mb:.2f} MB ({r['theta'] / r['raw']:.3f})"
            lfs = f"{r['lfs'] / mb:.2f} MB ({r['lfs'] / r['raw']:.3f})"
            rows.append([kind, f"v{i}", f"{r['raw'] / mb:.1f} MB", theta, lfs, ent, gap])
    lines += bench.table("save|version|raw|git-theta adds (of raw)|Git LFS adds (of raw)|"
                         "XOR entropy|theta / entropy", rows)  # fmt: skip
    rows = []
    base = results.get("one file")
    for kind, per in results.items():
        tuned = per[1:]
        theta = sum(r["theta"] for r in tuned)
        raw = sum(r["raw"] for r in tuned)
        lfs = sum(r["lfs"] for r in tuned)
        ent = sum(r["entropy"] for r in tuned)
        vs = ""
        if base is not None and kind != "one layer":
            one = sum(r["theta"] for r in base[1:])
            vs = f"{theta / one - 1:+.1%}"
        rows.append([kind, f"{theta / mb:.2f} MB", f"{theta / raw:.3f}x",
                     f"{lfs / raw:.3f}x", f"{theta / ent:.2f}x", vs])  # fmt: skip
    lines += ["Fine-tuned versions (all but the first save) together:", ""]
    lines += bench.table("save|git-theta adds|of raw|Git LFS of raw|theta / XOR entropy|"
                         "vs one file", rows)  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--shard-mb", type=int, default=12)
    ap.add_argument("--only", action="append", help="run only this save kind (repeatable)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-planes", dest="planes", action="store_false",
                    help="leave out the per-plane table of a full fine-tune's bytes")  # fmt: skip
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="theta-finetune-"))
    try:
        env = bench.hermetic_env(work)
        bench.log("training (all layers)")
        full = train(args, frozen=False)
        results: dict[str, list[dict[str, float]]] = {}
        for kind in KINDS:
            if not args.only or kind in args.only:
                results[kind] = run_kind(kind, full, work / "repos", env, args)
        if not args.only or "one layer" in args.only:
            bench.log("training (last layer only)")
            results["one layer"] = run_kind("one layer", train(args, frozen=True),
                                            work / "repos", env, args)  # fmt: skip
        text = report(results, args)
        if args.planes:
            text += "\n" + "\n".join(plane_report(full))
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
    finally:
        bench.remove_workdir(work, args.keep)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
