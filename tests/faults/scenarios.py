"""The faults: each function injects one into a World, retries what was interrupted,
and records what held. Every fault is followed by the same checks (``settle``):
no corrupt object, nothing committed lost, the retry succeeded, and no temporary left
once `git theta prune` has run."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lfs_server import LfsServer

from faults.harness import (
    MODEL,
    TARGETS,
    Done,
    corrupt_objects,
    fill,
    left_after_prune,
    lfs_objects,
    read_only,
    remove_stale_lock,
    rmtree,
    run,
    run_and_kill,
    sha256_file,
    temporaries,
    unclear_lines,
    with_filter,
)
from faults.world import World


@dataclass
class Fault:
    """One injected fault and what was seen after it."""

    kind: str
    detail: str = ""  # enough to reproduce: the variant, target, delay, filter mode
    outcome: str = ""  # killed / finished first / failed cleanly / succeeded / ...
    corrupt: list[str] = field(default_factory=list)  # objects not matching their oid
    retry: str = "ok"  # or why the retry failed
    stale_after_retry: list[str] = field(default_factory=list)
    stale_after_prune: list[str] = field(default_factory=list)
    lost: int = 0  # bytes of committed files no longer recoverable (locally or remotely)
    unclear: list[str] = field(default_factory=list)  # error output that is not one line
    problems: list[str] = field(default_factory=list)  # any other invariant broken
    notes: list[str] = field(default_factory=list)  # what git or giftless did, not ours

    def failed(self) -> bool:
        return bool(
            self.corrupt or self.retry != "ok" or self.stale_after_prune or self.lost
            or self.unclear or self.problems
        )  # fmt: skip


class Context:
    """What the scenarios share: the seeded random source and the LFS server."""

    def __init__(self, rng: random.Random, server: LfsServer | None):
        self.rng = rng
        self.server = server

    def filter_env(self, world: World, fault: Fault) -> dict[str, str]:
        """The world's environment with the filter either direct or served warm."""
        mode = self.rng.choice(["direct", "server"])
        fault.detail += f" filter={mode}"
        return with_filter(world.env, mode)

    def delay(self, world: World, what: str, default: float = 0.5) -> float:
        """A random point in the command's usual run (a little past it, sometimes)."""
        return self.rng.uniform(0.0, 1.15 * world.typical.get(what, default))

    def target(self, fault: Fault, choices: tuple[str, ...] = TARGETS) -> str:
        target = self.rng.choice(choices)
        fault.detail += f" kill={target}"
        return target


def outcome_of(done: Done) -> str:
    if done.killed is not None:
        return "killed"
    return "finished first" if done.ok() else f"failed (exit {done.rc})"


def judge_error(fault: Fault, done: Done) -> None:
    """A failed command must say what is wrong in one git-theta line, no traceback."""
    fault.unclear += unclear_lines(done.stderr)
    ours = done.argv[0] == "git-theta" or "filter 'theta' failed" in done.stderr
    if not done.ok() and done.killed is None and ours and "git-theta: error:" not in done.stderr:
        fault.unclear.append(f"no git-theta error line: {done.describe()}")


def settle(world: World, fault: Fault, where: list[Path] | None = None) -> None:
    """The checks after every fault (after its retry)."""
    fault.corrupt += world.corrupt()
    lost, which = world.lost_locally()
    if lost:
        fault.lost += lost
        fault.problems.append(f"objects of commits {', '.join(which)} are gone")
    for tree in where or [world.repo]:
        fault.stale_after_retry += temporaries(tree)
        left, done = left_after_prune(tree, world.env)
        if not done.ok():
            fault.problems.append(f"prune failed: {done.describe()}")
        fault.stale_after_prune += left
    world.back_to_branches()


def retry(fault: Fault, done: Done, what: str) -> bool:
    if done.ok():
        return True
    fault.retry = f"{what}: {done.describe()}"
    return False


def file_state(path: Path, *known: tuple[str, str]) -> str:
    """Which known version ``path`` holds: a name from ``known`` (name, sha256), absent,
    or partial (anything else: a file that is not any committed version)."""
    if not path.exists():
        return "absent"
    sha = sha256_file(path)
    for name, expected in known:
        if sha == expected:
            return name
    return f"partial ({path.stat().st_size} bytes)"


def _verify_commit(world: World, fault: Fault, where: Path, commit: str) -> None:
    """The new commit checks out (a real git checkout of the file) byte for byte."""
    (where / MODEL).unlink()
    done = world.git("checkout", "--", MODEL, cwd=where, check=False)
    mismatch = world.matches(where, commit) if done.ok() else done.describe()
    if mismatch:
        fault.problems.append(f"the new commit does not check out: {mismatch}")
        fault.lost += world.ledger.size(commit)


# ------------------------------------------------------------------ kill -9


def kill_add(world: World, ctx: Context) -> Fault:
    """kill -9 during `git add` of a new version; the add is run again and committed."""
    fault = Fault("kill -9 during add")
    env = ctx.filter_env(world, fault)
    world.write(world.repo, "main")
    delay = ctx.delay(world, "add")
    fault.detail += f" delay={delay:.3f}s"
    done = run_and_kill(["git", "add", MODEL], world.repo, env, delay, ctx.target(fault))
    fault.outcome = outcome_of(done)
    fault.unclear += unclear_lines(done.stderr)
    if remove_stale_lock(world.repo):
        fault.notes.append("git left index.lock")
    again = run(["git", "add", MODEL], world.repo, env)
    world.note("add", again)
    if retry(fault, again, "add"):
        commit = world.commit(world.repo, "main")
        _verify_commit(world, fault, world.repo, commit)
    settle(world, fault)
    return fault


def kill_checkout(world: World, ctx: Context) -> Fault:
    """kill -9 during `git checkout` of another commit (or `git theta checkout` of a
    file left as a manifest); the checkout is run again."""
    fault = Fault("kill -9 during checkout")
    env = ctx.filter_env(world, fault)
    head = world.head()
    choices = [c for c in world.commits("main") if c != head]
    if not choices:
        world.add_and_commit()
        return kill_checkout(world, ctx)
    commit = ctx.rng.choice(choices)
    old = world.ledger.files[head][MODEL][0]
    new = world.ledger.files[commit][MODEL][0]
    direct = ctx.rng.random() < 0.3
    delay = ctx.delay(world, "theta checkout" if direct else "checkout")
    fault.detail += f" {'git theta checkout' if direct else 'git checkout'} delay={delay:.3f}s"
    target = ctx.target(fault)
    if direct:
        _placeholder(world, env, commit)
        argv = ["git-theta", "checkout"]
        done = run_and_kill(argv, world.repo, env, delay, target)
        state = file_state(world.repo / MODEL, ("new", new))
        if state.startswith("partial") and _is_manifest(world.repo / MODEL):
            state = "manifest"
    else:
        argv = ["git", "checkout", "-q", "--detach", commit]
        done = run_and_kill(argv, world.repo, env, delay, target)
        state = file_state(world.repo / MODEL, ("old", old), ("new", new))
    fault.outcome = outcome_of(done)
    fault.unclear += unclear_lines(done.stderr)
    fault.notes.append(f"work-tree file after the fault: {state}")
    if remove_stale_lock(world.repo):
        fault.notes.append("git left index.lock")
    again = run(argv if direct else ["git", "checkout", "-q", "-f", "--detach", commit],
                world.repo, env)  # fmt: skip
    world.note("theta checkout" if direct else "checkout", again)
    if retry(fault, again, "checkout"):
        mismatch = world.matches(world.repo, commit)
        if mismatch:
            fault.problems.append(mismatch)
    settle(world, fault)
    return fault


def _is_manifest(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(16).startswith(b'{\n "git-theta"')


def _ahead(world: World, remote: str) -> None:
    """Make sure main has a commit ``remote`` lacks, so a push has objects to send."""
    if world.remote_tip(remote) == world.head():
        world.add_and_commit()


def remote_objects(world: World, remote: str, server: LfsServer | None) -> dict[str, Path]:
    """oid -> file of every object the remote's LFS store holds for this world."""
    if remote == "file":
        return lfs_objects(world.remotes["file"] / "lfs")
    assert server is not None  # giftless keeps STORAGE/ORG/REPO/OID; the repo is the world
    ours = {f"world{world.number}", f"world{world.number}.git"}
    found = server.storage.rglob("*") if server.storage.exists() else []
    return {p.name: p for p in found if p.is_file() and p.parent.name in ours}


def check_remote(world: World, fault: Fault, remote: str, server: LfsServer | None) -> None:
    """If the remote's branch names a commit, every object it needs is complete there
    (else everyone who clones it loses that commit)."""
    tip = world.remote_tip(remote)
    if tip is None:
        return
    have = remote_objects(world, remote, server)
    verified: set[str] = set()
    for commit in world.reachable(tip):
        for oid in sorted(world.ledger.oids(world.repo, world.env, commit)):
            if oid in verified:
                continue
            if oid not in have or sha256_file(have[oid]) != oid:
                state = "missing" if oid not in have else "incomplete"
                fault.problems.append(
                    f"{remote} remote has {commit[:10]} but object {oid} is {state}"
                )
                fault.lost += world.ledger.size(commit)
                break
            verified.add(oid)
    partial = [o for o, p in have.items() if o not in verified and sha256_file(p) != o]
    if partial:
        fault.notes.append(f"{len(partial)} partial object(s) on the {remote} remote, unreferenced")


def kill_push(world: World, ctx: Context) -> Fault:
    """kill -9 during `git push` to a file:// remote or through giftless; pushed again."""
    remote = ctx.rng.choice(["file", "http"] if ctx.server else ["file"])
    fault = Fault(f"kill -9 during push ({remote})")
    _ahead(world, remote)
    delay = ctx.delay(world, f"push {remote}", 1.0)
    fault.detail += f" delay={delay:.3f}s"
    argv = ["git", "push", "-q", remote, "main"]
    done = run_and_kill(argv, world.repo, world.env, delay, ctx.target(fault))
    fault.outcome = outcome_of(done)
    fault.unclear += unclear_lines(done.stderr)
    check_remote(world, fault, remote, ctx.server)
    again = run(argv, world.repo, world.env)
    world.note(f"push {remote}", again)
    if retry(fault, again, "push") and world.remote_tip(remote) != world.head():
        fault.retry = "push succeeded but the remote branch did not move"
    check_remote(world, fault, remote, ctx.server)
    settle(world, fault)
    return fault


def server_killed_mid_push(world: World, ctx: Context) -> Fault:
    """The giftless server is killed while a push uploads; restarted, the push again."""
    assert ctx.server is not None
    server = ctx.server
    fault = Fault("LFS server killed mid-push")
    _ahead(world, "http")
    delay = ctx.delay(world, "push http", 1.0)
    fault.detail += f" delay={delay:.3f}s"
    argv = ["git", "push", "-q", "http", "main"]
    done = run_and_kill(argv, world.repo, world.env, delay, "server", action=server.stop)
    fault.outcome = "server killed" if done.killed else outcome_of(done)
    if done.killed:
        judge_error(fault, done)
    server.stop()
    check_remote(world, fault, "http", server)
    server.start()
    again = run(argv, world.repo, world.env)
    if retry(fault, again, "push") and world.remote_tip("http") != world.head():
        fault.retry = "push succeeded but the remote branch did not move"
    check_remote(world, fault, "http", server)
    settle(world, fault)
    return fault


def kill_clone(world: World, ctx: Context) -> Fault:
    """kill -9 during `git clone`; the clone is finished in place when git got as far as
    a HEAD (`git reset --hard`), else cloned again."""
    remote = ctx.rng.choice(["file", "http"] if ctx.server else ["file"])
    fault = Fault(f"kill -9 during clone ({remote})")
    if world.remote_tip(remote) != world.head():
        world.git("push", "-q", remote, "main")
    tip = world.head()
    env = ctx.filter_env(world, fault)
    dest = world.root / f"clone-{world.faults}"
    argv = ["git", "clone", "-q"]
    if remote == "http":
        assert world.lfs_url is not None
        argv += ["-c", f"remote.origin.lfsurl={world.lfs_url}"]
    argv += [f"file://{world.remotes[remote]}", str(dest)]
    delay = ctx.delay(world, f"clone {remote}", 1.0)
    fault.detail += f" delay={delay:.3f}s"
    done = run_and_kill(argv, world.root, env, delay, ctx.target(fault))
    fault.outcome = outcome_of(done)
    fault.unclear += unclear_lines(done.stderr)
    if dest.exists():
        fault.corrupt += corrupt_objects(world.lfs_dir(dest))
    resumable = (
        dest.exists() and run(["git", "rev-parse", "-q", "--verify", "HEAD"], dest, env).ok()
    )
    if done.killed is None and done.ok():
        again = done
    elif resumable:
        fault.notes.append("finished in place")
        remove_stale_lock(dest)
        again = run(["git", "reset", "-q", "--hard", "HEAD"], dest, env)
    else:
        fault.notes.append("cloned again")
        rmtree(dest)
        again = run(argv, world.root, env)
        world.note(f"clone {remote}", again)
    if retry(fault, again, "clone"):
        mismatch = world.matches(dest, tip)
        if mismatch:
            fault.problems.append(mismatch)
        fault.corrupt += corrupt_objects(world.lfs_dir(dest))
    fault.stale_after_retry += temporaries(dest)
    if dest.exists():
        fault.stale_after_prune += left_after_prune(dest, env)[0]
    rmtree(dest)
    settle(world, fault)
    return fault


# ------------------------------------------------------------------ disk full, read-only


def disk_full(world: World, ctx: Context) -> Fault:
    """The file system is full (all but a random few MB taken) during an add, a git
    checkout or a `git theta checkout`; space is freed and the command run again. The
    checked-out file is also held by another link (as by a process that has it open),
    so replacing it frees no space."""
    variant = ctx.rng.choice(["add", "checkout", "theta checkout"])
    fault = Fault(f"disk full during {variant}")
    env = ctx.filter_env(world, fault)
    head = world.head()
    size = world.ledger.size(head)
    leave = ctx.rng.randint(0, int(size * 1.3))
    fault.detail += f" free={leave / 1e6:.2f}MB"
    before = world.git("diff", "--cached", "--name-only").stdout
    commit = ctx.rng.choice([c for c in world.commits("main") if c != head] or [head])
    if variant == "add":
        world.write(world.repo, "main")
        argv = ["git", "add", MODEL]
    elif variant == "checkout":
        argv = ["git", "checkout", "-q", "--detach", commit]
    else:
        _placeholder(world, env, commit)
        argv = ["git-theta", "checkout"]
    pin = world.root / "pinned"
    os.link(world.repo / MODEL, pin)
    filler = fill(world.root, leave)
    try:
        done = run(argv, world.repo, env)
    finally:
        filler.unlink()
        pin.unlink()
    fault.outcome = "succeeded" if done.ok() else "failed"
    judge_error(fault, done)
    if variant == "add":
        if not done.ok() and world.git("diff", "--cached", "--name-only").stdout != before:
            fault.problems.append("a failed add staged something")
        again = run(argv, world.repo, env)
        if retry(fault, again, "add"):
            _verify_commit(world, fault, world.repo, world.commit(world.repo, "main"))
    else:
        old = world.ledger.files[head][MODEL][0]
        state = file_state(world.repo / MODEL, ("old", old), ("new", _sha(world, commit)))
        if variant == "theta checkout":
            if _is_manifest(world.repo / MODEL):
                state = "manifest"
            elif state != "new":  # our own write: all or nothing
                fault.problems.append(f"git theta checkout left a {state} file")
        fault.notes.append(f"work-tree file after the fault: {state}")
        remove_stale_lock(world.repo)
        if variant == "checkout":
            argv = ["git", "checkout", "-q", "-f", "--detach", commit]
        again = run(argv, world.repo, env)
        if retry(fault, again, variant) and (mismatch := world.matches(world.repo, commit)):
            fault.problems.append(mismatch)
    settle(world, fault)
    return fault


def _sha(world: World, commit: str) -> str:
    return world.ledger.files[commit][MODEL][0]


def _placeholder(world: World, env: dict[str, str], commit: str) -> None:
    """Check ``commit`` out with its checkpoint left as a manifest (skipped smudge)."""
    skip = {**env, "GIT_THETA_SKIP_SMUDGE": "1"}
    run(["git", "checkout", "-q", "-f", "--detach", commit], world.repo, skip, check=True)
    (world.repo / MODEL).unlink()
    run(["git", "checkout", "--", MODEL], world.repo, skip, check=True)


def read_only_store(world: World, ctx: Context) -> Fault:
    """The LFS store is read-only (a read-only mount: root too): an add must fail with one
    line and stage nothing; a checkout of objects already there must work."""
    variant = ctx.rng.choice(["add", "checkout"])
    fault = Fault(f"read-only store during {variant}")
    env = ctx.filter_env(world, fault)
    head = world.head()
    store = world.repo / ".git" / "lfs"
    before = world.git("diff", "--cached", "--name-only").stdout
    if variant == "add":
        world.write(world.repo, "main")
        with read_only(store):
            done = run(["git", "add", MODEL], world.repo, env)
        fault.outcome = "succeeded" if done.ok() else "failed"
        judge_error(fault, done)
        if done.ok():
            fault.problems.append("an add into a read-only store succeeded")
        elif world.git("diff", "--cached", "--name-only").stdout != before:
            fault.problems.append("a failed add staged something")
        again = run(["git", "add", MODEL], world.repo, env)
        if retry(fault, again, "add"):
            _verify_commit(world, fault, world.repo, world.commit(world.repo, "main"))
    else:
        commit = ctx.rng.choice([c for c in world.commits("main") if c != head] or [head])
        with read_only(store):
            done = run(["git", "checkout", "-q", "--detach", commit], world.repo, env)
        fault.outcome = "succeeded" if done.ok() else "failed"
        judge_error(fault, done)
        if not done.ok():
            fault.problems.append(f"checkout from a read-only store failed: {done.describe()}")
        elif mismatch := world.matches(world.repo, commit):
            fault.problems.append(mismatch)
    settle(world, fault)
    return fault


# ------------------------------------------------------------------ concurrency


def concurrent_adds(world: World, ctx: Context) -> Fault:
    """Two worktrees of one repository add new versions at the same moment (one of the
    two sometimes killed); both are committed and check out."""
    fault = Fault("concurrent adds in two worktrees")
    env = ctx.filter_env(world, fault)
    world.write(world.repo, "main")
    world.write(world.side, "side")
    victim = ctx.rng.choice(["none", "main", "side"])
    delay = ctx.delay(world, "add")
    target = "none"
    if victim != "none":
        target = ctx.rng.choice(["session", "git"])  # never the other add's worker
    fault.detail += f" kill={victim}:{target} delay={delay:.3f}s"
    results: dict[str, Done] = {}

    def one(branch: str) -> None:
        wait = delay if branch == victim else 1e9
        tree = world.tree(branch)
        results[branch] = run_and_kill(["git", "add", MODEL], tree, env, wait, target)

    threads = [threading.Thread(target=one, args=(b,)) for b in ("main", "side")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fault.outcome = ", ".join(f"{b} {outcome_of(d)}" for b, d in sorted(results.items()))
    for branch, done in results.items():
        fault.unclear += unclear_lines(done.stderr)
        if branch != victim and not done.ok():
            fault.problems.append(f"the {branch} add failed beside another: {done.describe()}")
        tree = world.tree(branch)
        remove_stale_lock(tree)
        again = run(["git", "add", MODEL], tree, env)
        if retry(fault, again, f"add in {branch}"):
            _verify_commit(world, fault, tree, world.commit(tree, branch))
    settle(world, fault, [world.repo, world.side])
    return fault


Scenario = Callable[[World, Context], Fault]
SCENARIOS: dict[str, Scenario] = {
    "kill-add": kill_add,
    "kill-checkout": kill_checkout,
    "kill-push": kill_push,
    "kill-clone": kill_clone,
    "server-kill": server_killed_mid_push,
    "disk-full": disk_full,
    "read-only": read_only_store,
    "concurrent": concurrent_adds,
}
NEEDS_MOUNT = {"disk-full", "read-only"}
NEEDS_SERVER = {"server-kill"}
