"""Benchmark the merge strategies tensor by tensor: git-theta's against mergekit's.

Two GPT-2-small-sized tensors (768x3072, an MLP weight, and 50257x768, the embedding), in
FP32 and BF16; a base and two fine-tunes of it in which every element changed on both
sides, differently (so git-theta's element-wise step hands every element to the
strategy: its worst case). For each strategy (average, ties, dare, slerp) and tool, the
median wall time of ``--runs`` runs and the peak memory above the inputs (max RSS after
the first run, result included, minus RSS before it, by /proc/self/clear_refs), each tool
in its own fresh process (glibc's free memory handed back with malloc_trim before each
run, so a merge's memory is counted even where it reuses freed heap).

- git-theta: ``merges.merge_tensor`` on the tensors' raw bytes (BF16 as uint16), which
  includes the three-way step and the single rounding to the dtype;
- mergekit 0.1.5: ``mergekit.merge_methods.merge_tensors`` on torch tensors of the same
  values in their own dtype (linear with weights 0.5/0.5, ties, dare_linear, slerp).

Parameters: average weight 0.5; ties density 0.2; dare density 0.1 (drop rate 0.9, the
paper's; git-theta rescales by 1/density, mergekit to the L1 norm, equal cost); slerp
t 0.5. Both run on one thread (torch.set_num_threads(1); NumPy does not thread here).

Usage: python bench/merge_strategies.py [--runs 5] [--quick] [--no-mergekit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"768x3072": (768, 3072), "50257x768": (50257, 768)}
STRATEGIES = ["average", "ties", "dare", "slerp"]
OURS_PARAMS = {
    "average": {"weight": "0.5"},
    "ties": {"density": "0.2"},
    "dare": {"density": "0.1", "seed": "7"},
    "slerp": {"t": "0.5"},
}
MERGEKIT = {
    "average": ("linear", {"weight": [0.5, 0.5], "normalize": False}, False),
    "ties": ("ties", {"weight": [1.0, 1.0], "density": 0.2}, True),
    "dare": ("dare_linear", {"weight": [1.0, 1.0], "density": 0.1}, True),
    "slerp": ("slerp", {"t": 0.5}, False),
}


def tensors(shape: tuple[int, int], dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return base, ours, theirs as float32 values (rounded to BF16 when asked), every
    element changed on both sides and differently."""
    rng = np.random.default_rng(20261201)
    base = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    ours = base + (0.002 * rng.standard_normal(shape)).astype(np.float32)
    theirs = base + (0.002 * rng.standard_normal(shape)).astype(np.float32)
    if dtype == "BF16":
        sys.path.insert(0, str(ROOT / "src"))
        from git_theta.merges import _floats

        rounded = [_floats.widen(_floats.narrow(x, "BF16"), "BF16") for x in (base, ours, theirs)]
        base, ours, theirs = (x.reshape(shape) for x in rounded)
    return base, ours, theirs


def _status(field: str) -> int:
    """Return a /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Give freed heap back to the OS, reset the peak RSS to the current RSS (Linux
    clear_refs 5); return the RSS."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def measure(tool: str, strategy: str, shape_name: str, dtype: str, runs: int) -> dict[str, float]:
    """Run in a child process: time ``runs`` merges, peak RSS of the first."""
    base, ours, theirs = tensors(SHAPES[shape_name], dtype)
    if tool == "git-theta":
        sys.path.insert(0, str(ROOT / "src"))
        from git_theta.merges import MERGES, _floats
        from git_theta.merges.base import merge_tensor, parse_params

        plugin = MERGES.get(strategy)
        params = parse_params(plugin, OURS_PARAMS[strategy])
        raw = [_floats.narrow(x, dtype).reshape(x.shape) for x in (base, ours, theirs)]

        def once() -> object:
            return merge_tensor(plugin, params, raw[0], raw[1], raw[2], dtype)
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from mergekit.merge_methods import merge_tensors

        torch.set_num_threads(1)
        kind = torch.bfloat16 if dtype == "BF16" else torch.float32
        inputs = [torch.from_numpy(x).to(kind) for x in (base, ours, theirs)]
        method, params, with_base = MERGEKIT[strategy]
        args = inputs if with_base else inputs[1:]

        base_index = 0 if with_base or method == "slerp" else None  # slerp: ours is t=0

        def once() -> object:
            return merge_tensors(args, method, parameters=params, base_index=base_index)

    # The inputs stay alive, so a merge's memory is new pages, not reused freed ones.
    times = []
    for run in range(runs):
        before = reset_peak()
        start = time.perf_counter()
        result = once()
        times.append(time.perf_counter() - start)
        if run == 0:
            peak = _status("VmHWM") - before  # the result included
        del result
    return {"time": statistics.median(times), "peak": peak}


def child(tool: str, strategy: str, shape_name: str, dtype: str, runs: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", tool, strategy, shape_name, dtype, str(runs)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="768x3072 FP32 only")
    parser.add_argument("--no-mergekit", action="store_true")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tool, strategy, shape_name, dtype, runs = args.child
        print(json.dumps(measure(tool, strategy, shape_name, dtype, int(runs))))
        return
    shapes = ["768x3072"] if args.quick else list(SHAPES)
    dtypes = ["F32"] if args.quick else ["F32", "BF16"]
    tools = ["git-theta"] + ([] if args.no_mergekit else ["mergekit"])
    print(
        "| tensor | dtype | strategy | git-theta (s) | mergekit (s) | ratio | "
        "git-theta peak (MB) | mergekit peak (MB) | tensor (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape_name in shapes:
        for dtype in dtypes:
            size = np.prod(SHAPES[shape_name]) * (4 if dtype == "F32" else 2) / 1e6
            for strategy in STRATEGIES:
                got = {t: child(t, strategy, shape_name, dtype, args.runs) for t in tools}
                print(f"  {shape_name} {dtype} {strategy}: {got}", file=sys.stderr)
                ours, theirs = got["git-theta"], got.get("mergekit")
                mk_time = f"{theirs['time']:.3f}" if theirs else "n/a"
                ratio = f"{ours['time'] / theirs['time']:.2f}x" if theirs else "n/a"
                mk_peak = f"{theirs['peak'] / 1e6:.0f}" if theirs else "n/a"
                print(
                    f"| {shape_name} | {dtype} | {strategy} | {ours['time']:.3f} | {mk_time} | "
                    f"{ratio} | {ours['peak'] / 1e6:.0f} | {mk_peak} | {size:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
