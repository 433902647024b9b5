"""Run hostile cases in worker processes and judge each one.

Each case runs clean (and, when clean succeeds, smudge of its manifest: the checkout must
be byte-exact), in a worker whose HOME, TMPDIR and working directory are empty
directories of a sandbox, on a file of its own directory. A case must end in success or
a ThetaError of one printable line, within ``time_cap`` seconds and 300 MB + 2x its
largest legitimate tensor of resident memory (the worker's peak RSS, reset before each
case through /proc/self/clear_refs), writing nothing outside its directory. A worker
that crashes, hangs (``hard_timeout``) or runs away with memory is killed and the case
is a violation; the next worker picks up the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from hostile.cases import Built, Spec, build, mutate_manifest

TESTS = str(Path(__file__).resolve().parents[1])
MEMORY_BASE = 300 << 20  # bytes any input may cost (docs/reliability.md)
RUNAWAY = 3 << 30  # resident bytes at which the parent kills a worker outright
RESTART_EVERY = 400  # cases per worker before a fresh one (freed memory is not given back)


@dataclass
class Result:
    id: str
    fmt: str
    kind: str
    outcome: str  # "ok", "refused" (a ThetaError) or "violation"
    message: str
    seconds: float  # wall time
    cpu: float  # CPU seconds, all threads: what the time cap applies to (the machine is shared)
    peak_rss: int  # bytes
    cap_rss: int  # bytes allowed: MEMORY_BASE + 2x the largest legitimate tensor
    violation: str = ""


# --- the worker ------------------------------------------------------------------------


def _peak_reset() -> None:
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: freed memory stays, as it may
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM, the peak resident set size


def _peak() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu() -> float:
    """CPU seconds of this process's threads and its waited-for children (h5py's reader)."""
    children = os.times()  # in clock ticks (10 ms): fine for h5py's ~0.3 s
    return time.process_time() + children.children_user + children.children_system


def _one_line(message: str) -> str:
    """Why ``message`` is not one clear line, or ""."""
    if not message.strip():
        return "empty message"
    if not message.isprintable():
        return f"message is not one printable line: {message[:200]!r}"
    if len(message) > 2000:
        return f"message is {len(message)} characters long"
    return ""


def _run_case(spec: Spec, built: Built, case_dir: Path, time_cap: float) -> Result:
    from git_theta.clean import clean
    from git_theta.errors import ThetaError
    from git_theta.smudge import smudge
    from git_theta.store import ObjectStore

    store = ObjectStore(case_dir / "lfs")
    legit = 0
    smudge_only = built.prepare is not None
    if smudge_only:  # a manifest case: the sample's objects go into the store first
        assert built.prepare is not None
        good = case_dir / "good"
        good.write_bytes(built.prepare)
        manifest = case_dir / "good.manifest"
        with open(good, "rb") as src, open(manifest, "wb") as dst:
            clean(src, dst, built.name, store, None, False)
        legit = _tensor_bytes(manifest.read_bytes())
        data = mutate_manifest(manifest.read_bytes(), spec)
    else:
        data = built.data
    source = case_dir / "input"
    source.write_bytes(data)
    digest = hashlib.sha256(data).digest()
    size, path = len(data), built.name
    del data, built
    outcome, message, violation = "ok", "", ""
    _peak_reset()
    start, start_cpu = time.perf_counter(), _cpu()
    try:
        out = case_dir / "output"
        if smudge_only:
            with open(source, "rb") as src, open(out, "wb") as dst:
                smudge(src, dst, path, store, False)
        else:
            manifest = case_dir / "manifest"
            with open(source, "rb") as src, open(manifest, "wb") as dst:
                clean(src, dst, path, store, None, False)
            try:
                legit = _tensor_bytes(manifest.read_bytes())
                with open(manifest, "rb") as src, open(out, "wb") as dst:
                    smudge(src, dst, path, store, False)
            except ThetaError as exc:
                violation = f"clean accepted it, checkout refused: {exc}"
            else:
                with open(out, "rb") as fh:
                    if hashlib.sha256(fh.read()).digest() != digest:
                        violation = "checkout is not byte-exact"
    except ThetaError as exc:
        outcome, message = "refused", str(exc)
        violation = _one_line(message)
    except BaseException as exc:  # anything else reached the user as "internal error"
        if isinstance(exc, KeyboardInterrupt):
            raise
        outcome, message = "violation", f"{type(exc).__name__}: {exc}"[:300]
        violation = f"internal error: {message}"
    seconds, cpu = time.perf_counter() - start, _cpu() - start_cpu
    peak = _peak()
    if not smudge_only and outcome != "ok":
        legit = size  # nothing was accepted: no tensor can be larger than the file
    cap = MEMORY_BASE + 2 * legit
    if not violation and cpu > time_cap:
        violation = f"took {cpu:.1f} s of CPU (cap {time_cap} s)"
    if not violation and peak > cap:
        violation = f"peak RSS {peak >> 20} MB over the cap of {cap >> 20} MB"
    if violation:
        outcome = "violation"
    return Result(spec.id, spec.fmt, spec.kind, outcome, message[:300], seconds, cpu, peak,
                  cap, violation)  # fmt: skip


def _tensor_bytes(manifest: bytes) -> int:
    """The bytes of all the tensors a manifest describes: a bound on the largest."""
    from git_theta.manifest import parse

    parsed = parse(manifest)
    return parsed.size - sum(n for n in parsed.layout if isinstance(n, int))


def _stray(sandbox: Path, case_dir: Path) -> str:
    """What the case wrote outside its own directory, or ""."""
    found = []
    for name in ("home", "tmp", "cwd"):
        found += [str(p) for p in (sandbox / name).iterdir()]
    extra = {p.name for p in case_dir.iterdir()} - {
        "lfs", "input", "output", "manifest", "good", "good.manifest",
    }  # fmt: skip
    found += [str(case_dir / n) for n in sorted(extra)]
    legacy_log = Path(f"/tmp/git-theta-{os.getuid()}.log")
    if legacy_log.exists() and legacy_log.stat().st_mtime > _STARTED:
        found.append(str(legacy_log))
    return ", ".join(found[:5])


_STARTED = time.time()


def worker(sandbox: str, samples_dir: str, time_cap: float, results_fd: int) -> None:
    """Read specs (JSON lines) on stdin, write a start line and a Result line for each
    to ``results_fd``."""
    root = Path(sandbox)
    samples: dict[str, list[bytes]] = {}
    for path in sorted(Path(samples_dir).iterdir()):
        samples.setdefault(path.name.split("-")[0], []).append(path.read_bytes())
    out = os.fdopen(results_fd, "w", buffering=1)
    for line in sys.stdin:
        spec = Spec(**json.loads(line))
        out.write(json.dumps({"start": spec.id}) + "\n")
        case_dir = root / "cases" / spec.id.replace("/", "_")
        case_dir.mkdir(parents=True)
        try:
            result = _run_case(spec, build(spec, samples), case_dir, time_cap)
        except Exception as exc:  # the generator itself failed: say so, it is a bug here
            result = Result(spec.id, spec.fmt, spec.kind, "violation", "", 0.0, 0.0, 0, 0,
                            f"case generator failed: {type(exc).__name__}: {exc}")  # fmt: skip
        stray = _stray(root, case_dir)
        if stray:
            result.outcome, result.violation = "violation", f"wrote outside its directory: {stray}"
        shutil.rmtree(case_dir, ignore_errors=True)
        for name in ("home", "tmp", "cwd"):  # so one stray file is reported once
            for path in (root / name).iterdir():
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
        out.write(json.dumps(asdict(result)) + "\n")


# --- the parent ------------------------------------------------------------------------


class _Worker:
    def __init__(self, sandbox: Path, time_cap: float):
        read_end, write_end = os.pipe()
        env = dict(os.environ)
        env.update(
            HOME=str(sandbox / "home"), TMPDIR=str(sandbox / "tmp"), GIT_THETA_QUIET="1",
            GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=str(sandbox / "home" / ".gitconfig"),
        )  # fmt: skip
        code = (
            f"import sys; sys.path.insert(0, {TESTS!r}); from hostile.runner import worker; "
            f"worker({str(sandbox)!r}, {str(sandbox / 'samples')!r}, {time_cap!r}, {write_end})"
        )
        self.log = open(sandbox / "worker.log", "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=self.log,
            stderr=self.log, cwd=sandbox / "cwd", env=env, pass_fds=(write_end,),
            start_new_session=True,
        )  # fmt: skip
        os.close(write_end)
        self.results = read_end
        self.pending = b""  # bytes read after the last whole line
        self.spec: Spec | None = None
        self.started = 0.0
        self.done = 0

    def send(self, spec: Spec) -> None:
        assert self.proc.stdin is not None
        self.spec, self.started = spec, time.monotonic()
        self.proc.stdin.write((json.dumps(asdict(spec)) + "\n").encode())
        self.proc.stdin.flush()

    def rss(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        self.proc.wait()
        os.close(self.results)
        self.log.close()


def run(
    specs: Iterable[Spec],
    samples: dict[str, list[bytes]],
    jobs: int = 2,
    time_cap: float = 5.0,
    hard_timeout: float = 60.0,
    sandbox: Path | None = None,
    progress: bool = False,
) -> list[Result]:
    """Run every spec; return their Results in the order they finished."""
    made = sandbox is None
    root = Path(tempfile.mkdtemp(prefix="theta-fuzz-")) if sandbox is None else sandbox
    try:
        for name in ("home", "tmp", "cwd", "samples", "cases"):
            (root / name).mkdir(parents=True, exist_ok=True)
        for fmt, files in samples.items():
            for i, data in enumerate(files):
                (root / "samples" / f"{fmt}-{i}").write_bytes(data)
        results = []
        for result in _schedule(list(specs), root, jobs, time_cap, hard_timeout):
            results.append(result)
            if progress and len(results) % 1000 == 0:
                bad = sum(r.outcome == "violation" for r in results)
                print(f"{len(results)} done, {bad} violations", file=sys.stderr, flush=True)
        return results
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)


def _schedule(
    specs: list[Spec], root: Path, jobs: int, time_cap: float, hard_timeout: float
) -> Iterator[Result]:
    todo = list(reversed(specs))
    workers: list[_Worker] = []

    def lost(w: _Worker, why: str) -> Result:
        spec = w.spec
        assert spec is not None
        w.kill()
        workers.remove(w)
        wall = time.monotonic() - w.started
        return Result(spec.id, spec.fmt, spec.kind, "violation", "", wall, wall, 0, 0, why)

    try:
        while todo or any(w.spec for w in workers):
            while len(workers) < jobs and todo:
                workers.append(_Worker(root, time_cap))
            for w in workers:
                if w.spec is None and todo:
                    w.send(todo.pop())
            busy = {w.results: w for w in workers if w.spec is not None}
            ready, _, _ = select.select(list(busy), [], [], 0.1)
            for fd in ready:
                w = busy[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # died mid-case: a segfault, an abort, the kernel's OOM killer
                    code = w.proc.wait()
                    yield lost(w, f"worker died (exit {code}) during the case")
                    continue
                *lines, w.pending = (w.pending + chunk).split(b"\n")
                for line in lines:
                    record = json.loads(line)
                    if "start" not in record:
                        w.spec = None
                        w.done += 1
                        yield Result(**record)
                if w.spec is None and w.done >= RESTART_EVERY:
                    w.close()
                    workers.remove(w)
            for w in list(workers):
                if w.spec is None:
                    continue
                if time.monotonic() - w.started > hard_timeout:
                    yield lost(w, f"hung: killed after {hard_timeout:.0f} s")
                elif w.rss() > RUNAWAY:
                    yield lost(w, f"memory ran away: killed at {w.rss() >> 20} MB")
    finally:
        for w in workers:
            w.kill()


def summary(results: list[Result], seconds: float) -> str:
    """A human report: cases per format and kind, outcomes, slowest, peak RSS, violations."""
    lines = [f"{len(results)} cases in {seconds:.0f} s"]
    by_format: dict[str, Counter[str]] = {}
    for r in results:
        by_format.setdefault(r.fmt, Counter())[r.outcome] += 1
    lines.append(f"{'format':<12} {'cases':>6} {'ok':>6} {'refused':>8} {'violation':>10}")
    for fmt in sorted(by_format):
        c = by_format[fmt]
        lines.append(
            f"{fmt:<12} {sum(c.values()):>6} {c['ok']:>6} {c['refused']:>8} {c['violation']:>10}"
        )
    kinds = Counter(r.kind for r in results)
    lines.append("kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    if results:
        slow = max(results, key=lambda r: r.cpu)
        big = max(results, key=lambda r: r.peak_rss)
        lines.append(
            f"slowest: {slow.id} {slow.cpu:.2f} s CPU, {slow.seconds:.2f} s wall "
            f"({slow.outcome}: {slow.message[:80]})"
        )
        lines.append(f"peak RSS: {big.id} {big.peak_rss >> 20} MB (cap {big.cap_rss >> 20} MB)")
    bad = [r for r in results if r.outcome == "violation"]
    lines.append(f"violations: {len(bad)}")
    lines += [f"  {r.id}: {r.violation}" for r in bad[:50]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="git-theta's hostile-input fuzzer")
    parser.add_argument("--cases", type=int, default=10_500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--time-cap", type=float, default=5.0)
    parser.add_argument("--hard-timeout", type=float, default=60.0)
    parser.add_argument("--json", help="write every result to this file")
    args = parser.parse_args(argv)
    from hostile.cases import plan
    from hostile.samples import make_samples

    start = time.monotonic()
    specs = plan(args.cases, args.seed)
    print(f"{len(specs)} cases, seed {args.seed}, {args.jobs} workers", file=sys.stderr)
    results = run(specs, make_samples(), args.jobs, args.time_cap, args.hard_timeout, progress=True)
    print(summary(results, time.monotonic() - start))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=0))
    return 1 if any(r.outcome == "violation" for r in results) else 0


if __name__ == "__main__":  # cd tests && python -m hostile.runner
    sys.exit(main())
