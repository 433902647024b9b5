"""The machinery of the fault-injection suite: a hermetic git set-up, commands started in
a session of their own and killed with SIGKILL, mounts that fill or freeze a directory,
and the checks that must hold after every fault.

Only real tools are involved: git, git-lfs, git-theta's filter (direct or served by the
warm server) and giftless. Checks read what git and git-lfs wrote with code of their own
(JSON manifests, sha256 of files) rather than git-theta's, so a bug there cannot hide.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

BIN = str(Path(sys.executable).parent)
MODEL = "model.safetensors"
HEX = set("0123456789abcdef")
STALE_AGE = 7200  # seconds temporaries are aged by before `git theta prune` judges them


class Hung(Exception):
    """A process outlived its command by far: the fault left something running."""


# ------------------------------------------------------------------ environment


def hermetic_env(root: Path) -> dict[str, str]:
    """Environment for every command: its own HOME, git config and filter-server
    directory under ``root``; git-theta installed in that global config."""
    home = root / "home"
    home.mkdir(parents=True)
    servers = root / "servers"
    servers.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.pop("PYTHONUNBUFFERED", None)  # users do not run git with unbuffered Python
    env.update(
        HOME=str(home),
        GIT_CONFIG_GLOBAL=str(home / ".gitconfig"),
        GIT_CONFIG_NOSYSTEM="1",
        PATH=BIN + os.pathsep + os.environ["PATH"],
        GIT_THETA_QUIET="1",
        GIT_THETA_SERVER_DIR=str(servers),
        GIT_THETA_SERVER_IDLE="600",
    )
    for who in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{who}_NAME"] = "Theta Faults"
        env[f"GIT_{who}_EMAIL"] = "faults@example.com"
    common = (
        "[init]\n\tdefaultBranch = main\n"
        # A killed server must fail a push quickly, not after minutes of retries.
        "[lfs]\n\tdialtimeout = 5\n\tactivitytimeout = 10\n"
        '[lfs "transfer"]\n\tmaxretries = 1\n\tmaxretrydelay = 1\n'
    )
    # Two global configs: the direct filter, and the warm server's client (an opt-in).
    served = home / ".gitconfig-server"
    for config, flags in ((home / ".gitconfig", []), (served, ["--server"])):
        config.write_text(common)
        install_env = {**env, "GIT_CONFIG_GLOBAL": str(config)}
        run(["git-theta", "install", *flags], root, install_env, check=True)
    env["GIT_THETA_SERVED_CONFIG"] = str(served)  # ours, for with_filter below
    return env


def with_filter(env: dict[str, str], mode: str) -> dict[str, str]:
    """``env`` with the filter run directly or through the warm server."""
    if mode == "direct":
        return {**env, "GIT_THETA_SERVER": "0"}
    return {**env, "GIT_CONFIG_GLOBAL": env["GIT_THETA_SERVED_CONFIG"], "GIT_THETA_SERVER": "1"}


def server_dir(env: dict[str, str]) -> str:
    return env["GIT_THETA_SERVER_DIR"]


# ------------------------------------------------------------------ processes


@dataclass
class Done:
    """How a command ended: exit code (negative: killed by that signal), its stderr,
    what the fault killed (None: it finished before the fault) and how long it ran."""

    argv: list[str]
    rc: int
    stderr: str
    killed: str | None
    seconds: float
    stdout: str = ""

    def ok(self) -> bool:
        return self.rc == 0

    def describe(self) -> str:
        last = self.stderr.strip().splitlines()[-3:]
        return f"`{' '.join(self.argv)}` exit {self.rc}: {' | '.join(last) or 'no output'}"


def run(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    check: bool = False,
    timeout: float = 300,
) -> Done:
    """Run a command to its end (no fault); with ``check``, raise unless it succeeds."""
    start = time.monotonic()
    proc = subprocess.run(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout
    )
    stderr = proc.stderr.decode(errors="replace")
    done = Done(argv, proc.returncode, stderr, None, time.monotonic() - start, proc.stdout.decode())
    if check and not done.ok():
        raise AssertionError(done.describe())
    return done


def _procs() -> Iterator[tuple[int, int, int, bytes]]:
    """(pid, parent pid, session id, command line) of every process."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] == b"Z":
            continue  # a zombie holds nothing
        yield int(entry.name), int(fields[1]), int(fields[3]), cmdline


def session(sid: int) -> list[int]:
    return [pid for pid, _, s, _ in _procs() if s == sid]


def server_workers(directory: str) -> list[int]:
    """Workers the warm servers in ``directory`` forked (each serves one git command)."""
    from git_theta.forkserver import running_servers

    servers = set(running_servers(directory))
    return [pid for pid, ppid, _, _ in _procs() if ppid in servers]


def _theta_in(sid: int) -> list[int]:
    marks = (b"git_theta", b"git-theta")
    return [pid for pid, _, s, cmd in _procs() if s == sid and any(m in cmd for m in marks)]


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_gone(sid: int, directory: str, timeout: float = 60) -> None:
    """Wait until nothing of the session, and no filter-server worker, still runs."""
    deadline = time.monotonic() + timeout
    while session(sid) or server_workers(directory):
        if time.monotonic() > deadline:
            left = session(sid) + server_workers(directory)
            kill(left)
            raise Hung(f"processes {left} still ran {timeout:.0f} s after the fault")
        time.sleep(0.02)


TARGETS = ("session", "git", "theta")  # what a kill hits: all, the top process, ours


def run_and_kill(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    delay: float,
    target: str,
    action: Callable[[], None] | None = None,
) -> Done:
    """Start ``argv`` in a session of its own; after ``delay`` seconds SIGKILL ``target``:
    the whole session (as when a terminal dies), only the top process, or only
    git-theta's processes (the filter, the pre-push command, the server's worker); or
    run ``action`` instead (another fault, such as stopping a server).
    Returns after every process the command started has exited."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=err, start_new_session=True,
        )  # fmt: skip
        killed: str | None = None
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            if action is not None:
                action()
                victims = [0]
            elif target == "session":
                victims = session(proc.pid)
            elif target == "git":
                victims = [proc.pid]
            else:
                victims = _theta_in(proc.pid) + server_workers(server_dir(env))
            if action is None:
                kill(victims)
            killed = target if victims else None  # none: it was past git-theta's part
        rc = proc.wait()
        wait_gone(proc.pid, server_dir(env))
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return Done(argv, rc, stderr, killed, time.monotonic() - start)


def remove_stale_lock(repo: Path) -> bool:
    """Remove an index.lock a killed git left (git refuses to run while it exists, and
    tells the user to remove it once no git process runs: what a user does next)."""
    git_dir = repo / ".git"
    if git_dir.is_file():  # a linked worktree: .git names its directory
        git_dir = Path(git_dir.read_text().split(":", 1)[1].strip())
    found = False
    for lock in (git_dir / "index.lock", git_dir / "HEAD.lock"):
        if lock.exists():
            lock.unlink()
            found = True
    return found


def unclear_lines(stderr: str) -> list[str]:
    """Lines that are not the one clear line a user should get: tracebacks, internal
    errors, Python exception names."""
    bad = ("Traceback", "internal error", "Error:", "Exception")
    return [
        line.strip()
        for line in stderr.splitlines()
        if any(b in line for b in bad) and "git-theta: error:" not in line
    ]


# ------------------------------------------------------------------ mounts


def can_mount() -> bool:
    """True when this process may mount file systems (root with CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return False
    probe = Path(tempfile.mkdtemp(prefix="theta-mount-probe-"))
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True
        )
        if done.returncode:
            return False
        subprocess.run(["umount", str(probe)], check=True)
        return True
    finally:
        probe.rmdir()


@contextlib.contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    """A small file system at ``path``: writes past ``size_mb`` fail with ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only for everyone, root included (a read-only bind mount over it)."""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(directory: Path, leave: int) -> Path:
    """Take all but ``leave`` bytes of the free space of ``directory``'s file system."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    filler = directory / "filler"
    with open(filler, "wb") as fh:
        size = max(0, free - leave)
        while size > 0:
            try:
                os.posix_fallocate(fh.fileno(), 0, size)
                break
            except OSError:
                size -= 1 << 20
    return filler


# ------------------------------------------------------------------ checks


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def lfs_objects(lfs: Path) -> dict[str, Path]:
    """oid -> file of every object under an LFS directory (``.git/lfs``, or a bare
    remote's ``lfs``), wherever below it the object directories are (git-lfs's
    ``objects/``, or a store of git-theta's own beside it): files at ``objects/aa/bb/NAME``."""
    found = {}
    for path in lfs.rglob("*") if lfs.exists() else []:
        if path.parent.parent.parent.name == "objects" and path.is_file():
            found[path.name] = path
    return found


def corrupt_objects(lfs: Path) -> list[str]:
    """Objects under an LFS directory whose bytes do not hash to their name (or whose
    name is not an oid): what no fault may leave behind."""
    bad = []
    for name, path in lfs_objects(lfs).items():
        if len(name) != 64 or not set(name) <= HEX or sha256_file(path) != name:
            bad.append(str(path.relative_to(lfs)))
    return sorted(bad)


def manifest_oids(manifest: bytes) -> set[str]:
    """Every object a manifest needs (read as JSON, not by git-theta's parser)."""
    data = json.loads(manifest)
    oids = {data["glue"]["oid"]}
    for entry in data["tensors"].values():
        oids.update(link["oid"] for link in entry["chain"])
    return oids


def temporaries(repo: Path) -> list[str]:
    """Files a command leaves only when it did not finish: anything in a tmp directory
    under .git/lfs (git-lfs's, or a store of git-theta's own beside it),
    and git-theta's temporaries beside the files it replaces (work-tree checkpoints,
    hooks, attributes: `.NAME.theta-*`, `NAME.theta-tmp*`)."""
    git_dir = repo / ".git"
    found = []
    lfs = git_dir / "lfs"
    for path in lfs.rglob("*") if lfs.exists() else []:
        if "tmp" in path.relative_to(lfs).parts[:-1] and path.is_file():
            found.append(str(path.relative_to(repo)))
    for base in (repo, git_dir / "hooks"):
        for path in base.iterdir() if base.is_dir() else []:
            if ".theta-" in path.name:
                found.append(str(path.relative_to(repo)))
    return sorted(set(found))


def age(paths: list[Path], seconds: float) -> None:
    """Set the files' times ``seconds`` back, as if that long had passed since."""
    then = time.time() - seconds
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.utime(path, (then, then), follow_symlinks=False)


def left_after_prune(repo: Path, env: dict[str, str]) -> tuple[list[str], Done]:
    """Temporaries still there after `git theta prune`, once they are old enough that no
    running command can own them. They are then removed, so that the next fault's
    record shows only what it left itself."""
    age([repo / p for p in temporaries(repo)], STALE_AGE)
    done = run(["git-theta", "prune"], repo, env)
    left = temporaries(repo)
    for path in left:
        (repo / path).unlink(missing_ok=True)
    return [f"{path}{_writer_state(path)}" for path in left], done


def _writer_state(name: str) -> str:
    """What became of the process named in a temporary's name (``theta-PID-...``): a
    zombie still answers kill(pid, 0) until its parent, or init, reaps it."""
    _, sep, tail = name.rpartition("theta-")
    pid = tail.partition("-")[0]
    if not sep or not pid.isdigit():
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return f" (its writer, pid {pid}, is gone)"
    state = stat[stat.rindex(b")") + 2 :].split()[0].decode()
    return f" (its writer, pid {pid}, is {'a zombie' if state == 'Z' else 'running'})"


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Ledger:
    """What each commit must check out to: commit -> {path: (sha256, size)}; manifests
    are read from git once (commits do not change)."""

    files: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)
    _oids: dict[str, set[str]] = field(default_factory=dict)

    def record(self, commit: str, path: str, sha: str, size: int) -> None:
        self.files.setdefault(commit, {})[path] = (sha, size)

    def oids(self, repo: Path, env: dict[str, str], commit: str) -> set[str]:
        if commit not in self._oids:
            out: set[str] = set()
            for path in self.files[commit]:
                show = subprocess.run(
                    ["git", "show", f"{commit}:{path}"], cwd=repo, env=env, capture_output=True,
                    check=True,
                )  # fmt: skip
                out |= manifest_oids(show.stdout)
            self._oids[commit] = out
        return self._oids[commit]

    def size(self, commit: str) -> int:
        return sum(size for _, size in self.files[commit].values())
