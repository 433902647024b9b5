"""Benchmark the identity read: adding a new file to a repository of many large manifests.

Identity (identity.py) looks up a tensor the path's own manifest does not explain in the
other manifests of the index and HEAD, by content hash and by name. This commits
--manifests synthetic manifests (--tensors entries each, random hashes and objects, so
nothing matches), then times `git add` of a new 20-tensor file against the same add in a
repository without them, and the same add with plain Git LFS.

Medians of --runs runs. Usage: python bench/identity.py [--runs N] [--manifests N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from api import new_repo
from run import hermetic_env, log, remove_workdir
from run import run as run_cmd

from git_theta.manifest import Glue, Link, Manifest, TensorEntry
from git_theta.store import ObjectRef


def synthetic_manifest(rng: np.random.Generator, index: int, tensors: int) -> bytes:
    """A valid manifest of ``tensors`` FP32 entries whose hashes and objects are random."""

    def hex64() -> str:
        return rng.bytes(32).hex()

    entries = {}
    for j in range(tensors):
        chain = (Link("dense", "zstd", ObjectRef(hex64(), 4000)),)
        entries[f"model.layers.{j // 8}.block{index}.w{j % 8}.weight"] = TensorEntry(
            "F32", (1024, 1024), hex64(), chain
        )
    size = 4 * 1024 * 1024 * tensors + 8
    manifest = Manifest(
        format="safetensors",
        size=size,
        glue=Glue(hex64(), ObjectRef(hex64(), 8)),
        layout=(8, *sorted(entries)),
        tensors=entries,
    )
    return manifest.to_bytes()


def stage_manifests(repo: Path, env: dict[str, str], count: int, tensors: int) -> int:
    """Commit ``count`` synthetic manifests under shards/; return their total bytes."""
    rng = np.random.default_rng(3)
    blobs = [synthetic_manifest(rng, i, tensors) for i in range(count)]
    oids = subprocess.run(
        ["git", "hash-object", "-w", "--stdin-paths"],
        cwd=repo, env=env, check=True, capture_output=True,
        input="".join(f"{_write(repo, i, b)}\n" for i, b in enumerate(blobs)).encode(),
    ).stdout.decode().split()  # fmt: skip
    info = "".join(f"100644 {oid}\tshards/m{i:03d}.safetensors\n" for i, oid in enumerate(oids))
    subprocess.run(["git", "update-index", "--index-info"], cwd=repo, env=env, check=True,
                   input=info.encode())  # fmt: skip
    run_cmd(["git", "commit", "-q", "-m", "manifests"], repo, env)
    return sum(map(len, blobs))


def _write(repo: Path, i: int, data: bytes) -> str:
    path = repo / ".git" / f"m{i}.tmp"
    path.write_bytes(data)
    return str(path)


def new_file() -> bytes:
    from safetensors.numpy import save

    rng = np.random.default_rng(5)
    arrays = {
        f"new.{i}.weight": rng.standard_normal((256, 256), dtype=np.float32) for i in range(20)
    }
    return save(arrays)


def time_add(repo: Path, env: dict[str, str], data: bytes) -> float:
    (repo / "new.safetensors").write_bytes(data)
    start = time.perf_counter()
    run_cmd(["git", "add", "new.safetensors"], repo, env)
    took = time.perf_counter() - start
    run_cmd(["git", "rm", "-q", "--cached", "new.safetensors"], repo, env)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--manifests", type=int, default=200)
    ap.add_argument("--tensors", type=int, default=200, help="entries per manifest")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="theta-identity-"))
    try:
        env = hermetic_env(work)
        many = new_repo(work, "many", env, lfs=False)
        total = stage_manifests(many, env, args.manifests, args.tensors)
        none = new_repo(work, "none", env, lfs=False)
        lfs = new_repo(work, "lfs", env, lfs=True)
        data = new_file()
        times: dict[str, list[float]] = {"many": [], "none": [], "lfs": []}
        for _ in range(args.runs):  # interleaved: the load's drift hits every case alike
            for name, repo in (("many", many), ("none", none), ("lfs", lfs)):
                times[name].append(time_add(repo, env, data))
        log(f"{args.manifests} manifests of {args.tensors} tensors, {total / 1e6:.1f} MB in all; "
            f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        for name, xs in times.items():
            log(f"git add, {name}: {statistics.median(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f})")
        extra = statistics.median(times["many"]) - statistics.median(times["none"])
        log(f"identity read (many - none): {extra:.3f} s")
    finally:
        remove_workdir(work, args.keep)


if __name__ == "__main__":
    main()
