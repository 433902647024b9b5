"""Benchmark the Python API on a 500 MB synthetic model (48 FP32 tensors of 10.24 MB).

- save: `git_theta.save(state_dict, path)` against writing the same file
  (safetensors.numpy.save_file) and `git add`-ing it, with git-theta and with plain Git LFS;
  the store is emptied before every run, so each stores everything;
- open one tensor: `with git_theta.open("HEAD", path) as c: c[name]` against a full
  `git checkout` of the file (and Git LFS's), counting which objects the open read;
- peak memory of a save, in a child process: the rise of its peak RSS over the RSS with
  the state dict already in memory, against the bound of an add (300 MB + 2x the largest
  tensor).

Medians of --runs runs (default 5). Usage: python bench/api.py [--runs N] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import hermetic_env, log, remove_workdir
from run import run as run_cmd

MB = 1_000_000
TENSORS = 48
SHAPE = (1600, 1600)  # 10.24 MB of FP32 each
FILE = "model.safetensors"


def state_dict(seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"layers.{i}.weight": (rng.standard_normal(SHAPE, dtype=np.float32) * 0.02)
        for i in range(TENSORS)
    }


def empty_store(repo: Path) -> None:
    for sub in ("lfs/objects", "lfs/theta/objects"):
        shutil.rmtree(repo / ".git" / sub, ignore_errors=True)


def unstage(repo: Path, env: dict[str, str]) -> None:
    subprocess.run(["git", "rm", "-q", "--cached", "--ignore-unmatch", FILE], cwd=repo,
                   env=env, check=True, capture_output=True)  # fmt: skip


def new_repo(work: Path, name: str, env: dict[str, str], lfs: bool) -> Path:
    repo = work / name
    repo.mkdir()
    run_cmd(["git", "init", "-q"], repo, env)
    if lfs:
        run_cmd(["git", "lfs", "install", "--local"], repo, env)
        run_cmd(["git", "lfs", "track", "*.safetensors"], repo, env)
    else:
        run_cmd(["git", "theta", "track", "*.safetensors"], repo, env)
    run_cmd(["git", "add", ".gitattributes"], repo, env)
    run_cmd(["git", "commit", "-q", "-m", "track"], repo, env)
    return repo


def timed(fn: Callable[[], Any], runs: int, before: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(runs):
        before()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def bench_save(work: Path, env: dict[str, str], sd: dict[str, np.ndarray], runs: int) -> list[str]:
    from safetensors.numpy import save_file

    import git_theta

    theta = new_repo(work, "theta", env, lfs=False)
    lfs = new_repo(work, "lfs", env, lfs=True)

    def reset(repo: Path) -> Callable[[], None]:
        def go() -> None:
            unstage(repo, env)
            (repo / FILE).unlink(missing_ok=True)
            empty_store(repo)

        return go

    def write_and_add(repo: Path) -> Callable[[], None]:
        def go() -> None:
            save_file(sd, str(repo / FILE))
            run_cmd(["git", "add", FILE], repo, env)

        return go

    os.chdir(theta)
    cases = {
        "api": (lambda: git_theta.save(sd, FILE), reset(theta)),
        "api_file": (lambda: git_theta.save(sd, FILE, write_file=True), reset(theta)),
        "add": (write_and_add(theta), reset(theta)),
        "lfs_add": (write_and_add(lfs), reset(lfs)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpus: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):  # interleaved: a loaded machine's drift hits every case alike
        for name, (fn, before) in cases.items():
            before()
            start, cpu = time.perf_counter(), cpu_seconds()
            fn()
            times[name].append(time.perf_counter() - start)
            cpus[name].append(cpu_seconds() - cpu)

    def ratio(case: str, of: dict[str, list[float]]) -> str:
        """The median over rounds of case / write + add in the same round."""
        rounds = [a / b for a, b in zip(of[case], of["add"], strict=True)]
        return f"{statistics.median(rounds):.2f}x"

    def cpu(case: str) -> str:
        return f"{statistics.median(cpus[case]):.2f} s"

    return [
        "| operation | wall (median, min-max) | vs write + `git add` | CPU (median) | CPU vs |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {med(times[case])} | {ratio(case, times)} | {cpu(case)} | "
            f"{ratio(case, cpus)} |"
            for case, label in (
                ("api", "`git_theta.save(sd, path)`"),
                ("api_file", "`git_theta.save(sd, path, write_file=True)`"),
                ("add", "`save_file` + `git add` (git-theta)"),
                ("lfs_add", "`save_file` + `git add` (plain Git LFS)"),
            )
        ),
        "",
        "Ratios: the median over rounds of each case against write + `git add` in the same",
        "round. CPU: user + system of this process and of the commands it ran.",
    ]


def cpu_seconds() -> float:
    """User + system CPU of this process (all threads) and of its waited-for children."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_open(work: Path, env: dict[str, str], sd: dict[str, np.ndarray], runs: int) -> list[str]:
    import git_theta
    from git_theta.store import ObjectStore

    theta, lfs = work / "theta", work / "lfs"
    for repo in (theta, lfs):
        (repo / FILE).unlink(missing_ok=True)
        unstage(repo, env)
    os.chdir(theta)
    git_theta.save(sd, FILE, message="v1", write_file=True)
    from safetensors.numpy import save_file

    save_file(sd, str(lfs / FILE))
    run_cmd(["git", "add", FILE], lfs, env)
    run_cmd(["git", "commit", "-q", "-m", "v1"], lfs, env)
    name = "layers.17.weight"

    read: list[str] = []
    original = ObjectStore.get

    def counting(self: ObjectStore, ref: Any) -> Any:
        read.append(ref.oid)
        return original(self, ref)

    ObjectStore.get = counting  # type: ignore[method-assign]
    try:

        def open_one() -> None:
            with git_theta.open("HEAD", FILE) as ckpt:
                value = ckpt[name]
            assert np.array_equal(value, sd[name])

        cold_start = time.perf_counter()
        open_one()  # the first open imports the API's modules
        cold = time.perf_counter() - cold_start
        first_reads = list(read)
        warm = timed(open_one, runs, lambda: None)
    finally:
        ObjectStore.get = original  # type: ignore[method-assign]
    with git_theta.open("HEAD", FILE) as ckpt:
        chain = {link.ref.oid for link in ckpt.manifest.tensors[name].chain}
        total = len({link.ref.oid for e in ckpt.manifest.tensors.values() for link in e.chain})

    def remove(repo: Path) -> Callable[[], None]:
        return lambda: (repo / FILE).unlink()

    checkout = timed(lambda: run_cmd(["git", "checkout", "--", FILE], theta, env), runs,
                     remove(theta))  # fmt: skip
    lfs_checkout = timed(lambda: run_cmd(["git", "checkout", "--", FILE], lfs, env), runs,
                         remove(lfs))  # fmt: skip
    full = statistics.median(checkout)
    only = "yes" if set(first_reads) == chain else f"no: {sorted(set(first_reads))}"
    return [
        "| operation | time (median, min-max) | vs full checkout |",
        "|---|---|---|",
        f"| `git_theta.open(...)[name]`, warm | {med(warm)} | "
        f"{100 * statistics.median(warm) / full:.1f}% |",
        f"| the same, first call in the process (imports) | {cold:.2f} s | "
        f"{100 * cold / full:.1f}% |",
        f"| `git checkout` of the file (git-theta) | {med(checkout)} | 100% |",
        f"| `git checkout` of the file (plain Git LFS) | {med(lfs_checkout)} | "
        f"{100 * statistics.median(lfs_checkout) / full:.0f}% |",
        "",
        f"Objects the open read: {len(set(first_reads))} of the manifest's {total} "
        f"(only that tensor's: {only}).",
    ]


_CHILD = """
import os, sys, numpy as np
sys.path.insert(0, {bench!r})
from api import state_dict
import git_theta
def kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
sd = state_dict()
import git_theta.api, git_theta.clean, git_theta.chains, git_theta.codec
base = kb("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
git_theta.save(sd, {file!r})
print(base, kb("VmHWM:"))
"""


def bench_memory(work: Path, env: dict[str, str], runs: int) -> list[str]:
    theta = work / "theta"
    rises = []
    for _ in range(runs):
        unstage(theta, env)
        empty_store(theta)
        code = _CHILD.format(bench=str(Path(__file__).parent), file=FILE)
        done = subprocess.run([sys.executable, "-c", code], cwd=theta, env=env, check=True,
                              capture_output=True, text=True)  # fmt: skip
        base, peak = map(int, done.stdout.split())
        rises.append((peak - base) / 1000)
    largest = SHAPE[0] * SHAPE[1] * 4 / MB
    bound = 300 + 2 * largest
    return [
        "Peak RSS rise of a save over the process with its state dict in memory "
        f"(~{TENSORS * largest:.0f} MB): "
        f"median {statistics.median(rises):.0f} MB (min {min(rises):.0f}, max {max(rises):.0f}); "
        f"the bound of an add is 300 MB + 2 x {largest:.1f} MB = {bound:.0f} MB.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--only", choices=("save", "open", "memory"), help="one part only")
    args = parser.parse_args(argv)
    parts = {args.only} if args.only else {"save", "open", "memory"}
    work = Path(tempfile.mkdtemp(prefix="theta-bench-api-"))
    try:
        env = hermetic_env(work)
        os.environ.clear()
        os.environ.update(env)  # the API runs in this process, as users run it
        sd = state_dict()
        lines = [f"load average {os.getloadavg()[0]:.1f} at the start", ""]
        if parts & {"save", "open"}:  # open reads the repositories save makes
            log("save")
            lines += ["### Save from memory", "", *bench_save(work, env, sd, args.runs), ""]
        if "open" in parts:
            log("open")
            lines += ["### Open one tensor", "", *bench_open(work, env, sd, args.runs), ""]
        if "memory" in parts:
            log("memory")
            lines += ["### Memory of a save", "", *bench_memory(work, env, args.runs), ""]
        lines += [f"load average {os.getloadavg()[0]:.1f} at the end"]
        print("\n".join(lines))
    finally:
        os.chdir(str(Path.home()))
        remove_workdir(work, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
