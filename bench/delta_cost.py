"""CPU cost of adding and checking out a full fine-tune's versions, in process.

Trains the GPT-2 of bench/finetune.py (4 saves, AdamW lr 2e-5), then for each save runs
git-theta's clean (the add: a delta on the previous version, or on the base) and smudge
(the checkout, checked byte for byte) on one object store, timing the process's CPU
(all threads) so a shared machine's load moves the figures less than wall time does.
``--src`` runs another tree's git_theta (e.g. ``git archive OLD src | tar -x -C DIR``,
with the C kernel copied in) to compare two versions of the code on the same saves.

Usage: HF_HUB_OFFLINE=1 python bench/delta_cost.py [--src DIR] [--runs 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--src", type=Path, help="a tree whose src/ holds the git_theta to time")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    if args.src:
        sys.path.insert(0, str(args.src / "src"))
    sys.path.insert(0, str(Path(__file__).parent))
    import finetune
    from safetensors.torch import save

    from git_theta.clean import clean
    from git_theta.manifest import parse
    from git_theta.smudge import smudge
    from git_theta.store import ObjectStore

    shape = argparse.Namespace(steps=3, saves=4, layers=6, width=384, vocab=8192, shard_mb=12)
    states = finetune.train(shape, frozen=False)
    files = [save({k: v.contiguous() for k, v in _untied(s).items()}) for s in states]
    with tempfile.TemporaryDirectory(prefix="theta-delta-cost-") as tmp:
        store = ObjectStore(Path(tmp))
        previous, manifests, adds = None, [], []
        for data in files:
            out = io.BytesIO()
            start = time.process_time()
            clean(io.BytesIO(data), out, "model.safetensors", store, previous, False)
            adds.append(time.process_time() - start)
            previous = parse(out.getvalue())
            manifests.append(out.getvalue())
        stored = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        print(f"stored {stored / 1e6:.2f} MB; add CPU " + ", ".join(f"v{i} {s:.2f} s"
              for i, s in enumerate(adds)))  # fmt: skip
        for i, (manifest, data) in enumerate(zip(manifests, files, strict=True)):
            times = []
            for _ in range(args.runs):
                sink = io.BytesIO()
                start = time.process_time()
                smudge(io.BytesIO(manifest), sink, "model.safetensors", store, False)
                times.append(time.process_time() - start)
                if sink.getvalue() != data:
                    raise SystemExit(f"v{i} checked out with other bytes")
            print(f"checkout CPU v{i}: {statistics.median(times) * 1e3:.0f} ms (median of "
                  f"{args.runs})")  # fmt: skip
    return 0


def _untied(state: dict[str, object]) -> dict[str, object]:
    """The state without the second name of a tied tensor (lm_head is wte)."""
    seen: set[int] = set()
    out = {}
    for name, value in state.items():
        ptr = value.data_ptr()  # type: ignore[attr-defined]
        if ptr not in seen:
            seen.add(ptr)
            out[name] = value
    return out


if __name__ == "__main__":
    sys.exit(main())
