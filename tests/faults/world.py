"""A repository the faults happen to: a main work tree and a linked worktree of one
repository, a file:// remote and a remote whose LFS objects live on a giftless server,
and the ledger of what every commit must check out to."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from st_files import st_bytes

from faults.harness import (
    MODEL,
    Done,
    Ledger,
    corrupt_objects,
    lfs_objects,
    rmtree,
    run,
    sha256_file,
)

# ~20 MB: big enough that an add or a checkout spends a few tenths of a second writing
# objects or the file (room for a kill to land inside), small enough for hundreds.
SHAPES = {"w0": (768, 768), "w1": (1536, 2048), "w2": (512, 768)}
EMB = (1024, 512)


def model_bytes(seed: int, branch: str, version: int, shrink: int = 1) -> bytes:
    """Version ``version`` of the checkpoint on ``branch``: each version changes one
    tensor sparsely (sparse update), nudges another (delta) and now and then replaces
    one (dense), so every kind of object is written. ``shrink`` divides every dimension."""
    shapes = {n: (r // shrink, c // shrink) for n, (r, c) in SHAPES.items()}
    emb_shape = (EMB[0] // shrink, EMB[1] // shrink)
    base = np.random.default_rng(seed)
    w = {n: (base.standard_normal(s) * 0.02).astype(np.float32) for n, s in shapes.items()}
    emb = base.integers(0, 1 << 16, emb_shape, dtype=np.uint16)
    salt = int.from_bytes(hashlib.sha256(f"{seed}/{branch}/{version}".encode()).digest()[:8])
    rng = np.random.default_rng(salt)
    flat = w["w0"].reshape(-1)
    flat[rng.integers(0, flat.size, 500)] = rng.standard_normal(500).astype(np.float32)
    w["w1"] *= (1 + rng.standard_normal(shapes["w1"]) * 1e-3).astype(np.float32)
    if version % 3 == 0:
        w["w2"] = (rng.standard_normal(shapes["w2"]) * 0.02).astype(np.float32)
    if version % 4 == 0:
        emb = rng.integers(0, 1 << 16, emb_shape, dtype=np.uint16)
    tensors = {n: ("F32", a.shape, a.tobytes()) for n, a in w.items()}
    tensors["emb"] = ("BF16", emb_shape, emb.tobytes())
    return st_bytes(tensors, metadata={"branch": branch, "version": str(version)})


# Seconds each command usually takes without a fault (where kills should land), kept
# across repositories: measured when a repository is set up, refined by every retry.
TYPICAL: dict[str, float] = {}


class World:
    """One repository and its remotes under ``root``; ``number`` seeds its checkpoints."""

    def __init__(self, root: Path, env: dict[str, str], number: int, lfs_url: str | None):
        self.root = root
        self.env = env
        self.number = number
        self.repo = root / "repo"
        self.side = root / "side"  # a linked worktree of repo, on branch side
        self.remotes = {"file": root / "file.git", "http": root / "http.git"}
        self.lfs_url = lfs_url
        self.ledger = Ledger()
        self.branch_of: dict[str, str] = {}
        self.versions = {"main": 0, "side": 0}
        self.typical = TYPICAL
        self.faults = 0

    # -------------------------------------------------------------- set-up and steps

    def git(self, *args: str, cwd: Path | None = None, check: bool = True) -> Done:
        done = run(["git", *args], cwd or self.repo, self.env, check=check)
        return done

    def setup(self, worktree: bool = True) -> World:
        self.root.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", str(self.repo), cwd=self.root)
        run(["git-theta", "track", "*.safetensors"], self.repo, self.env, check=True)
        self.git("add", ".gitattributes")
        self.git("commit", "-q", "-m", "track")
        self.write(self.repo, "main")
        self.git("add", MODEL)
        self.commit(self.repo, "main")
        if worktree:
            self.git("worktree", "add", "-q", "-b", "side", str(self.side))
        for name, path in self.remotes.items():
            if name == "http" and self.lfs_url is None:
                continue
            self.git("init", "-q", "--bare", str(path), cwd=self.root)
            self.git("remote", "add", name, f"file://{path}")
        if self.lfs_url:
            self.git("config", "remote.http.lfsurl", self.lfs_url)
        self.calibrate()
        return self

    def calibrate(self) -> None:
        """Time each command once, as a fault-free run (the first ones of a run)."""
        first = self.head()
        self.add_and_commit()
        self.note("checkout", self.git("checkout", "-q", "--detach", first))
        self.note("checkout", self.git("checkout", "-q", "main"))
        for name, path in self.remotes.items():
            if not path.exists():
                continue
            self.note(f"push {name}", self.git("push", "-q", name, "main"))
            argv = ["clone", "-q"]
            if name == "http":
                argv += ["-c", f"remote.origin.lfsurl={self.lfs_url}"]
            dest = self.root / "calibrate"
            self.note(f"clone {name}", self.git(*argv, f"file://{path}", str(dest)))
            rmtree(dest)
        self.add_and_commit()  # main is ahead of the remotes: pushes have work to do

    def tree(self, branch: str) -> Path:
        return self.repo if branch == "main" else self.side

    def write(self, where: Path, branch: str) -> None:
        """Write the next version of the checkpoint on ``branch`` into ``where``."""
        self.versions[branch] += 1
        data = model_bytes(self.number, branch, self.versions[branch])
        (where / MODEL).write_bytes(data)

    def commit(self, where: Path, branch: str) -> str:
        """Commit what is staged; record what the commit must check out to."""
        sha, size = sha256_file(where / MODEL), (where / MODEL).stat().st_size
        self.git("commit", "-q", "-m", f"{branch} v{self.versions[branch]}", cwd=where)
        commit = self.head(where)
        self.ledger.record(commit, MODEL, sha, size)
        self.branch_of[commit] = branch
        return commit

    def add_and_commit(self, branch: str = "main") -> str:
        where = self.tree(branch)
        self.write(where, branch)
        done = self.git("add", MODEL, cwd=where)
        self.note("add", done)
        return self.commit(where, branch)

    def head(self, where: Path | None = None) -> str:
        return self.git("rev-parse", "HEAD", cwd=where).stdout.strip()

    def commits(self, branch: str) -> list[str]:
        return [c for c, b in self.branch_of.items() if b == branch]

    def note(self, what: str, done: Done) -> None:
        """Keep a running figure of how long ``what`` takes (where kills should land)."""
        old = self.typical.get(what)
        self.typical[what] = done.seconds if old is None else 0.7 * old + 0.3 * done.seconds

    # -------------------------------------------------------------- checks

    def lfs_dir(self, where: Path | None = None) -> Path:
        return (where or self.repo) / ".git" / "lfs"

    def corrupt(self) -> list[str]:
        return corrupt_objects(self.lfs_dir())

    def lost_locally(self) -> tuple[int, list[str]]:
        """Bytes of committed files that can no longer be rebuilt here (an object a
        commit needs is missing), and which commits."""
        present = set(lfs_objects(self.lfs_dir()))
        lost, which = 0, []
        for commit in self.ledger.files:
            if self.ledger.oids(self.repo, self.env, commit) - present:
                lost += self.ledger.size(commit)
                which.append(commit[:10])
        return lost, which

    def checks_out(self, where: Path, commit: str) -> str | None:
        """Check ``commit`` out in ``where`` (forced, detached) and compare every file
        with the ledger; return what differs, or None."""
        done = self.git("checkout", "-q", "-f", "--detach", commit, cwd=where, check=False)
        if not done.ok():
            return f"checkout of {commit[:10]} failed: {done.describe()}"
        return self.matches(where, commit)

    def matches(self, where: Path, commit: str) -> str | None:
        for path, (sha, _) in self.ledger.files[commit].items():
            if not (where / path).is_file() or sha256_file(where / path) != sha:
                return f"{path} at {commit[:10]} is not the committed file"
        status = self.git("status", "--porcelain", "--untracked-files=no", cwd=where)
        if status.stdout.strip():
            return f"git status is not clean at {commit[:10]}: {status.stdout.strip()}"
        return None

    def back_to_branches(self) -> None:
        """Leave both work trees on their branch tips, clean."""
        for branch in ("main", "side"):
            where = self.tree(branch)
            if where.exists():
                self.git("checkout", "-q", "-f", branch, cwd=where)

    def remote_tip(self, remote: str) -> str | None:
        bare = self.remotes[remote]
        done = self.git("rev-parse", "-q", "--verify", "refs/heads/main", cwd=bare, check=False)
        return done.stdout.strip() or None

    def reachable(self, tip: str) -> list[str]:
        out = self.git("rev-list", tip).stdout
        return [c for c in out.split() if c in self.ledger.files]

    def close(self) -> None:
        rmtree(self.root)
