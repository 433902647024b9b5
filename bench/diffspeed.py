"""Diff speed: `git theta diff` between two versions of a GPT-2-small-sized checkpoint that
differ in one layer, against decoding that layer's tensors alone (both as fresh processes,
so both pay the same start-up). The diff issue asks for under 2x.

Usage: python bench/diffspeed.py [--runs N] [--keep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import run as bench  # bench/run.py: the shared helpers

LAYER = "h.5."
DECODE = """
import sys, json
from git_theta.chains import rebuild
from git_theta.manifest import parse
from git_theta.repo import Repo
m = parse(sys.stdin.buffer.read())
store = Repo().store
for name, entry in m.tensors.items():
    if name.startswith(sys.argv[1]):
        rebuild(name, entry, store)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the repository (printed)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="theta-diffspeed-"))
    try:
        env = bench.hermetic_env(work)
        rng = np.random.default_rng(bench.SEED)
        tensors = bench.gpt2_small(rng)
        repo = work / "repo"
        repo.mkdir()
        bench.run(["git", "init", "-q"], repo, env)
        bench.run(["git", "theta", "track", "*.safetensors"], repo, env)
        for message in ("v1", "v2: layer 5 changed"):
            bench.write_safetensors(repo / bench.FILE, tensors)
            bench.run(["git", "add", "-A"], repo, env)
            bench.run(["git", "commit", "-q", "-m", message], repo, env)
            for name, value in tensors.items():
                if name.startswith(LAYER):
                    value += np.float32(1e-3) * rng.standard_normal(value.shape, np.float32)
        manifest = bench.run(["git", "show", f"HEAD:{bench.FILE}"], repo, env).stdout
        layer_bytes = sum(v.nbytes for k, v in tensors.items() if k.startswith(LAYER))
        diff_t, decode_t = [], []
        for _ in range(args.runs):
            diff_t.append(bench.run(["git", "theta", "diff", "HEAD~1", "HEAD"], repo, env).seconds)
            decode = [sys.executable, "-c", DECODE, LAYER]
            decode_t.append(_timed_stdin(decode, repo, env, manifest.encode()))
        d, c = statistics.median(diff_t), statistics.median(decode_t)
        print(f"layer {LAYER}* ({layer_bytes / bench.MB:.1f} MB of 497.8 MB): "
              f"git theta diff {d:.2f}s, decoding the layer alone {c:.2f}s: {d / c:.2f}x "
              f"(median of {args.runs})")  # fmt: skip
    finally:
        bench.remove_workdir(work, args.keep)
    return 0


def _timed_stdin(argv: list[str], cwd: Path, env: bench.Env, data: bytes) -> float:
    import subprocess
    import time

    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=dict(env), input=data, check=True, capture_output=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
