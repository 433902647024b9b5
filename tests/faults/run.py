"""Inject faults into real git-theta repositories and check that nothing is lost.

    make faults                       # FAULTS=200 SEED=1 by default
    .venv/bin/python tests/faults/run.py --faults 50 --seed 7 --kinds kill-add,disk-full

Each fault is one of: kill -9 at a random point of `git add`, `git checkout` (or `git
theta checkout`), `git push` (file:// remote or a giftless LFS server) and `git clone`;
the disk full during an add or a checkout; the LFS store read-only; the LFS server
killed mid-push; concurrent adds in two worktrees. After each: no corrupt object, every
commit still has its objects, the interrupted command succeeds when run again, and no
temporary is left once `git theta prune` has run. Every few faults the repository's
whole history is checked out, and cloned from each remote and checked out there.
Prints a table per kind of fault and every defect seen; exits 1 if there was any.

Kill points are seeded delays into each command's usual duration, so a seed gives the
same sequence of faults, though not always the same instant in the process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: st_files, lfs_server

from lfs_server import LfsServer

from faults.harness import Hung, can_mount, hermetic_env, rmtree, run, server_dir, tmpfs
from faults.scenarios import (
    NEEDS_MOUNT,
    SCENARIOS,
    Context,
    Fault,
    check_remote,
)
from faults.world import TYPICAL, World

DISK_MB = 256  # the small file system of the disk-full faults


def final_check(world: World, ctx: Context) -> Fault:
    """Every commit checks out byte for byte here, and from a fresh clone of each remote."""
    fault = Fault("history check", detail=f"world {world.number}")
    fault.corrupt += world.corrupt()
    for commit in world.ledger.files:
        mismatch = world.checks_out(world.repo, commit)
        if mismatch:
            fault.problems.append(mismatch)
            fault.lost += world.ledger.size(commit)
    for remote, bare in world.remotes.items():
        if not bare.exists() or world.remote_tip(remote) is None:
            continue
        check_remote(world, fault, remote, ctx.server)
        dest = world.root / f"final-{remote}"
        argv = ["git", "clone", "-q"]
        if remote == "http":
            argv += ["-c", f"remote.origin.lfsurl={world.lfs_url}"]
        done = run([*argv, f"file://{bare}", str(dest)], world.root, world.env)
        if not done.ok():
            fault.problems.append(f"clone from {remote} failed: {done.describe()}")
            continue
        tip = world.remote_tip(remote)
        assert tip is not None
        for commit in world.reachable(tip):
            mismatch = world.checks_out(dest, commit)
            if mismatch:
                fault.problems.append(f"clone of {remote}: {mismatch}")
                fault.lost += world.ledger.size(commit)
        rmtree(dest)
    world.back_to_branches()
    return fault


def summary(faults: list[Fault], checks: list[Fault], seconds: float) -> str:
    head = (
        "kind", "faults", "killed", "done first", "failed", "corrupt", "retry failed",
        "tmp left", "tmp after prune", "bytes lost", "unclear msg", "other",
    )  # fmt: skip
    rows: dict[str, list[int]] = {}
    for f in faults:
        row = rows.setdefault(f.kind, [0] * (len(head) - 1))
        cells = [
            1,
            "killed" in f.outcome or "server killed" in f.outcome,
            "finished first" in f.outcome or f.outcome == "succeeded",
            "failed" in f.outcome,
            len(f.corrupt),
            f.retry != "ok",
            bool(f.stale_after_retry),
            bool(f.stale_after_prune),
            f.lost,
            bool(f.unclear),
            bool(f.problems),
        ]
        for i, value in enumerate(cells):
            row[i] += int(value)
    total = [sum(col) for col in zip(*rows.values(), strict=True)] if rows else []
    widths = [max(len(head[0]), *(len(k) for k in rows), 5)] + [max(len(h), 6) for h in head[1:]]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        padded = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in pairs]
        return "| " + " | ".join(padded) + " |"

    out = [line(list(head)), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for kind in sorted(rows):
        out.append(line([kind, *map(str, rows[kind])]))
    if total:
        out.append(line(["**total**", *map(str, total)]))
    lost = sum(f.lost for f in faults + checks)
    out.append("")
    out.append(
        f"{len(faults)} faults in {seconds:.0f} s; history checks: {len(checks)}, "
        f"{sum(bool(c.problems or c.corrupt) for c in checks)} with problems; "
        f"bytes lost: {lost}"
    )
    return "\n".join(out)


def defects(faults: list[Fault], seed: int) -> str:
    """Every distinct problem once, with the first fault that showed it."""
    seen: dict[str, list[int]] = {}  # problem -> [first fault's number, how many]
    for number, f in enumerate(faults, 1):
        found = (
            [f"corrupt object {c}" for c in f.corrupt[:1]]
            + ([f"retry failed: {f.retry}"] if f.retry != "ok" else [])
            + [f"left after prune: {t}" for t in f.stale_after_prune[:1]]
            + [f"unclear error: {u}" for u in f.unclear[:1]]
            + f.problems[:2]
        )
        for text in found:
            key = f"{f.kind}: {_shape(text)}"
            if key in seen:
                seen[key][1] += 1
            else:
                seen[key] = [number, 1]
    lines = []
    for key, (number, count) in seen.items():
        f = faults[number - 1]
        lines.append(f"- {key}  (x{count}; first: fault {number}, seed {seed},{f.detail})")
        lines.append(f"  e.g. {_first_problem(f)}")
    return "\n".join(lines) or "none"


def observations(faults: list[Fault]) -> str:
    """What git, git-lfs and giftless did (not git-theta's invariants), counted by kind."""
    counts: dict[str, int] = {}
    for f in faults:
        for note in f.notes:
            if "Traceback" in note:
                continue
            key = f"{f.kind}: {_shape(note)}"
            counts[key] = counts.get(key, 0) + 1
    return "\n".join(f"- {k}: {n}" for k, n in sorted(counts.items())) or "none"


def _first_problem(f: Fault) -> str:
    for text in [*f.corrupt, *([f.retry] if f.retry != "ok" else []), *f.stale_after_prune,
                 *f.unclear, *f.problems]:  # fmt: skip
        return text[:300]
    return ""


def _shape(text: str) -> str:
    """A problem without its variable parts (pids, oids, sizes), to count alike ones."""
    import re

    text = re.sub(r"[0-9a-f]{10,64}", "<id>", text)
    text = re.sub(r"\d+", "N", text)
    return text[:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--per-world", type=int, default=20, help="faults per repository")
    parser.add_argument("--json", type=Path, help="write every fault's record here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="theta-faults-"))
    env = hermetic_env(root)
    mountable = can_mount()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = set(kinds) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    skipped = [k for k in kinds if k in NEEDS_MOUNT and not mountable]
    kinds = [k for k in kinds if k not in skipped]
    if skipped:
        print(f"skipped (need root to mount): {', '.join(skipped)}", file=sys.stderr)
    rng = random.Random(args.seed)
    schedule = [kinds[i % len(kinds)] for i in range(args.faults)]
    rng.shuffle(schedule)

    (root / "lfs-server").mkdir()
    server = LfsServer(root / "lfs-server")
    server.start()
    ctx = Context(rng, server)
    faults: list[Fault] = []
    checks: list[Fault] = []
    numbers = iter(range(1, 1 << 30))
    start = time.monotonic()
    try:
        with tmpfs(root / "disk", DISK_MB) if mountable else contextlib.nullcontext() as disk:

            def new_world(on_disk: bool) -> World:
                n = next(numbers)
                base = disk if on_disk and disk is not None else root
                url = None if on_disk else server.url(f"world{n}")
                return World(base / f"world{n}", env, n, url).setup(worktree=not on_disk)

            worlds: dict[bool, World | None] = {False: None, True: None}
            for number, kind in enumerate(schedule, 1):
                on_disk = kind == "disk-full"
                world = worlds[on_disk]
                if world is not None and _full(world, on_disk, args.per_world):
                    checks.append(final_check(world, ctx))
                    world.close()
                    world = None
                if world is None:
                    world = worlds[on_disk] = new_world(on_disk)
                try:
                    fault = SCENARIOS[kind](world, ctx)
                except (Hung, AssertionError, OSError) as exc:
                    fault = Fault(kind, problems=[f"the scenario broke: {exc!r}"])
                    fault.notes.append(traceback.format_exc(limit=4))
                    checks.append(final_check(world, ctx))
                    world.close()
                    worlds[on_disk] = None
                world.faults += 1
                faults.append(fault)
                flag = "FAIL" if fault.failed() else "ok"
                print(
                    f"[{number:4}/{len(schedule)}] {flag:4} {fault.kind}:{fault.detail} -> "
                    f"{fault.outcome}", file=sys.stderr, flush=True,
                )  # fmt: skip
            for world in worlds.values():
                if world is not None:
                    checks.append(final_check(world, ctx))
                    world.close()
    finally:
        server.stop()
        from git_theta.forkserver import stop_servers

        stop_servers(server_dir(env))
    seconds = time.monotonic() - start
    print(summary(faults, checks, seconds))
    print("\nDefects:\n" + defects(faults + checks, args.seed))
    print("\nObservations (not git-theta's to hold):\n" + observations(faults))
    typical = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(TYPICAL.items()))
    print(f"\nUsual durations (kill points are drawn from 0 to 1.15x these): {typical}")
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in faults + checks], indent=1))
    if not args.keep:
        rmtree(root)
    else:
        print(f"kept {root}", file=sys.stderr)
    return 1 if any(f.failed() for f in faults + checks) else 0


def _full(world: World, on_disk: bool, per_world: int) -> bool:
    """Time for a fresh repository: enough faults in this one, or its disk half full."""
    if world.faults >= per_world:
        return True
    stat = os.statvfs(world.root)
    return on_disk and stat.f_bavail < 0.5 * stat.f_blocks


if __name__ == "__main__":
    sys.exit(main())
