"""Benchmark `git merge` of two fine-tunes of the synthetic GPT-2-small model.

Every tensor is changed on both sides (two full fine-tunes of one base). Measured, medians
of ``--runs`` runs, each from the same state (merge undone, its objects deleted):
- `git merge` with GIT_THETA_MERGE_STRATEGY=average and =ties (density 0.5), wall time,
  CPU time (user + system of every process it ran: steadier than wall time on a shared
  machine) and the largest single process's peak RSS;
- `git checkout` of one version (the file deleted first), the yardstick;
- mergekit (`mergekit-yaml`, linear and ties, same weights) on the same three versions as
  model directories, wall time, CPU time and peak RSS;
- a merge of two disjoint sparse fine-tunes (each changes 1% of the elements of its own
  six tensors and of one shared tensor, disjoint within it): no strategy set, and how many
  tensors the merge decoded (the merged manifest's records).

Usage: python bench/merge.py [--runs 3] [--no-mergekit] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import (
    FILE,
    Array,
    Ran,
    gpt2_small,
    hermetic_env,
    log,
    remove_workdir,
    run,
    write_safetensors,
)

SEED = 4321
MB = 1_000_000


def fine_tune(base: dict[str, Array], rng: np.random.Generator, scale: float) -> dict[str, Array]:
    """Every element of every tensor moved a little, as a full fine-tune does."""
    return {
        k: v + (rng.standard_normal(v.shape, dtype=np.float32) * scale) for k, v in base.items()
    }


def sparse_tune(
    base: dict[str, Array], rng: np.random.Generator, names: list[str], half: int
) -> dict[str, Array]:
    """1% of the elements of ``names`` changed; in the shared tensor ``wpe.weight`` only
    the first (half=0) or second (half=1) half of its rows."""
    out = dict(base)
    for name in [*names, "wpe.weight"]:
        v = base[name].copy()
        flat = v.reshape(-1)
        lo, hi = (
            (0, flat.size)
            if name != "wpe.weight"
            else (half * flat.size // 2, (half + 1) * flat.size // 2)
        )
        idx = rng.choice(np.arange(lo, hi), size=max(1, (hi - lo) // 100), replace=False)
        flat[idx] += np.float32(0.01)
        out[name] = v
    return out


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[Ran, float]:
    """Run ``argv`` (watched for peak RSS); return it and the CPU seconds (user + system)
    of the processes it ran: on a shared machine wall time says as much about the other
    processes as about us."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    ran = run(argv, cwd, env, watch=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ran, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def peak(ran_peaks: dict[str, float]) -> float:
    return max(ran_peaks.values(), default=0.0)


def objects(repo: Path) -> set[Path]:
    root = repo / ".git" / "lfs"
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def setup_repo(
    work: Path, env: dict[str, str], name: str, versions: list[dict[str, Array]]
) -> Path:
    """base on main~, theirs on branch left, ours on main."""
    repo = work / name
    repo.mkdir()
    run(["git", "init", "-q"], repo, env)
    run(["git", "theta", "track", "*.safetensors"], repo, env)
    run(["git", "add", ".gitattributes"], repo, env)
    base, ours, theirs = versions
    write_safetensors(repo / FILE, base)
    run(["git", "add", FILE], repo, env)
    run(["git", "commit", "-q", "-m", "base"], repo, env)
    run(["git", "checkout", "-q", "-b", "left"], repo, env)
    write_safetensors(repo / FILE, theirs)
    run(["git", "commit", "-q", "-am", "theirs"], repo, env)
    run(["git", "checkout", "-q", "main"], repo, env)
    write_safetensors(repo / FILE, ours)
    run(["git", "commit", "-q", "-am", "ours"], repo, env)
    return repo


def time_merge(
    repo: Path, env: dict[str, str], runs: int, extra: dict[str, str]
) -> tuple[list[float], list[float], dict[str, object], list[float]]:
    head = run(["git", "rev-parse", "HEAD"], repo, env).stdout.strip()
    before = objects(repo)
    times, peaks, cpus = [], [], []
    manifest: dict[str, object] = {}
    for _ in range(runs):
        settle(repo, env)
        ran, cpu = timed(["git", "merge", "-q", "--no-edit", "left"], repo, {**env, **extra})
        times.append(ran.seconds)
        peaks.append(peak(ran.peaks))
        cpus.append(cpu)
        manifest = json.loads(run(["git", "cat-file", "blob", f"HEAD:{FILE}"], repo, env).stdout)
        run(["git", "reset", "-q", "--hard", head], repo, env)
        for path in objects(repo) - before:
            path.unlink()
    return times, peaks, manifest, cpus


def settle(repo: Path, env: dict[str, str]) -> None:
    """Make the index's entry for the checkpoint not racily clean, as a work tree's is
    when a user merges. The file was just written (the setup's commit, the last run's
    reset): git cannot trust its stat data in the second it was written, so the timed
    merge began by running the clean filter over the whole file (0.6-1 s, seen in
    GIT_TRACE as a gap before the driver). Its mtime set into the past, one refresh here
    re-cleans it untimed and records stat data git trusts."""
    past = time.time() - 10
    os.utime(repo / FILE, (past, past))
    run(["git", "update-index", "-q", "--refresh"], repo, env)


def time_checkout(
    repo: Path, env: dict[str, str], runs: int
) -> tuple[list[float], list[float], list[float]]:
    times, peaks, cpus = [], [], []
    for _ in range(runs):
        (repo / FILE).unlink()
        ran, cpu = timed(["git", "checkout", "--", FILE], repo, env)
        times.append(ran.seconds)
        peaks.append(peak(ran.peaks))
        cpus.append(cpu)
    return times, peaks, cpus


GPT2_CONFIG = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_embd": 768,
    "n_head": 12, "vocab_size": 50257, "n_positions": 1024, "torch_dtype": "float32",
}  # fmt: skip


def mergekit(
    work: Path, env: dict[str, str], versions: list[dict[str, Array]], runs: int
) -> dict[str, tuple[list[float], list[float], list[float]]]:
    dirs = []
    for label, values in zip(("base", "ours", "theirs"), versions, strict=True):
        d = work / "mk" / label
        d.mkdir(parents=True)
        write_safetensors(d / FILE, values)
        (d / "config.json").write_text(json.dumps(GPT2_CONFIG))
        dirs.append(d)
    configs = {
        "average": {
            "merge_method": "linear",
            "models": [{"model": str(dirs[1]), "parameters": {"weight": 0.5}},
                       {"model": str(dirs[2]), "parameters": {"weight": 0.5}}],
            "dtype": "float32",
        },
        "ties": {
            "merge_method": "ties", "base_model": str(dirs[0]),
            "models": [{"model": str(dirs[1]), "parameters": {"weight": 1.0, "density": 0.5}},
                       {"model": str(dirs[2]), "parameters": {"weight": 1.0, "density": 0.5}}],
            "parameters": {"normalize": True}, "dtype": "float32",
        },
    }  # fmt: skip
    out = {}
    for name, config in configs.items():
        path = work / "mk" / f"{name}.yml"
        path.write_text(json.dumps(config))  # YAML is a superset of JSON
        times, peaks, cpus = [], [], []
        for i in range(runs):
            dest = work / "mk" / f"out-{name}-{i}"
            ran, cpu = timed(
                ["mergekit-yaml", str(path), str(dest), "--no-lazy-unpickle"],
                work,
                {**env, "HF_HUB_OFFLINE": "1"},
            )
            times.append(ran.seconds)
            peaks.append(peak(ran.peaks))
            cpus.append(cpu)
        out[name] = (times, peaks, cpus)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-mergekit", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="theta-merge-bench-"))
    try:
        env = hermetic_env(work)
        rng = np.random.default_rng(SEED)
        base = gpt2_small(rng)
        largest = max(v.nbytes for v in base.values())
        versions = [base, fine_tune(base, rng, 2e-4), fine_tune(base, rng, 2e-4)]
        log("full fine-tunes: setting up")
        repo = setup_repo(work, env, "full", versions)
        rows = []
        checkout, checkout_peaks, checkout_cpu = time_checkout(repo, env, args.runs)
        rows.append(
            (
                "`git checkout` of one version",
                med(checkout),
                max(checkout_peaks),
                med(checkout_cpu),
                "",
            )
        )
        results: dict[str, float] = {}
        for strategy, params in (("average", ""), ("ties", "density=0.5")):
            log(f"git merge, {strategy}")
            extra = {"GIT_THETA_MERGE_STRATEGY": strategy, "GIT_THETA_MERGE_PARAMS": params}
            times, peaks, manifest, cpus = time_merge(repo, env, args.runs, extra)
            tensors = manifest["tensors"]
            assert isinstance(tensors, dict)
            merged = sum(1 for e in tensors.values() if "merge" in e)
            results[strategy] = med(times)
            rows.append(
                (
                    f"`git merge`, {strategy}",
                    med(times),
                    max(peaks),
                    med(cpus),
                    f"{merged}/{len(tensors)} tensors merged",
                )
            )
        mk = {} if args.no_mergekit else mergekit(work, env, versions, args.runs)
        for name, (times, peaks, cpus) in mk.items():
            rows.append(
                (
                    f"mergekit-yaml, {'linear' if name == 'average' else 'ties'}",
                    med(times),
                    max(peaks),
                    med(cpus),
                    "",
                )
            )
        del versions
        log("disjoint sparse fine-tunes")
        names = sorted(base)
        left, right = names[:6], names[-6:]
        sparse = [base, sparse_tune(base, rng, right, 1), sparse_tune(base, rng, left, 0)]
        srepo = setup_repo(work, env, "sparse", sparse)
        times, peaks, manifest, cpus = time_merge(srepo, env, args.runs, {})
        tensors = manifest["tensors"]
        assert isinstance(tensors, dict)
        decoded = [n for n, e in tensors.items() if "merge" in e]
        rows.append(
            (
                "`git merge`, disjoint sparse, no strategy",
                med(times),
                max(peaks),
                med(cpus),
                f"decoded {len(decoded)} of {len(tensors)} tensors ({', '.join(decoded)})",
            )
        )
        total = sum(v.nbytes for v in base.values()) / MB
        sys.stdout.write(
            f"GPT-2-small FP32 (124M parameters, {total:.0f} MB; largest tensor "
            f"{largest / MB:.0f} MB), medians of {args.runs} runs\n\n"
            "| operation | time (s) | x checkout | CPU (s) | CPU x checkout | peak RSS (MB) "
            "| note |\n|---|---|---|---|---|---|---|\n"
        )
        for label, seconds, rss, cpu, note in rows:
            ratio = seconds / med(checkout)
            cpu_ratio = cpu / med(checkout_cpu)
            rss_s = f"{rss:.0f}" if rss is not None else ""
            sys.stdout.write(
                f"| {label} | {seconds:.2f} | {ratio:.2f}x | {cpu:.2f} | {cpu_ratio:.2f}x "
                f"| {rss_s} | {note} |\n"
            )
        sys.stdout.write(
            f"\nmemory target: 300 MB + 4 x {largest / MB:.0f} MB = "
            f"{300 + 4 * largest / MB:.0f} MB\n"
        )
    finally:
        remove_workdir(work, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
