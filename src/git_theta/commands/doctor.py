"""``git theta doctor``: what git-theta finds set up here, and what is wrong with it.

Like ``git lfs env``: versions, every git-theta setting and whether the program it runs
exists, the hooks and their chain, git-lfs, the object store and the warm server. Each
problem is one line starting with ``problem:`` that says what to run; the exit code is 1
when there is any.
"""

from __future__ import annotations

import os
import sys

from git_theta import __version__, git
from git_theta.hooks import (
    CHAINED,
    MARKER,
    WATCH_CHAINED,
    WATCH_MARKER,
    HooksElsewhereError,
    install_hooks,
    is_lfs_hook,
    runs_theta,
)
from git_theta.proc import run
from git_theta.setup_check import FILTER_KEYS, INSTALL, program_problem, theta_config

COMMAND_KEYS = (
    *FILTER_KEYS,
    "diff.theta.command",
    "diff.theta.textconv",
    "merge.theta.driver",
)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 16)
    except OSError:
        return None


def _hook_lines(hooks: str) -> tuple[list[str], list[str]]:
    """Report lines and problems for our two hooks and what they chain to."""
    lines: list[str] = []
    problems: list[str] = []
    for name, marker, chained in (
        ("pre-push", MARKER, CHAINED),
        ("reference-transaction", WATCH_MARKER, WATCH_CHAINED),
    ):
        text = _read(os.path.join(hooks, name))
        if text is None:
            state = "absent"
            problems.append(
                f"no {name} hook: pushes will not upload tensor objects; run "
                "`git theta install --local`"
            )
        elif marker in text:
            state = "git-theta's"
        elif name == "pre-push" and is_lfs_hook(text):
            state = "Git LFS's, not git-theta's"
            problems.append(
                "the pre-push hook is Git LFS's alone (git lfs install --force?): the next "
                "git-theta command puts git-theta's back; or run `git theta install --local`"
            )
        else:
            state = "another tool's"
            problems.append(
                f"the {name} hook is not git-theta's: run `git theta install --local` to "
                "chain it behind git-theta's"
            )
        after = _read(os.path.join(hooks, chained))
        if after is not None:
            who = "Git LFS's" if is_lfs_hook(after) else "another hook"
            state += f", then {chained} ({who})"
        lines.append(f"hook {name}: {state}")
    return lines, problems


def _store_lines(lfs_dir: str) -> list[str]:
    from git_theta.store import ObjectStore

    store = ObjectStore(lfs_dir)
    out = []
    for what, root in (("git-theta objects", store.root), ("Git LFS objects", store.lfs_root)):
        count = size = 0
        for base, _dirs, files in os.walk(root):
            for name in files:
                try:
                    size += os.lstat(os.path.join(base, name)).st_size
                except OSError:
                    continue
                count += 1
        out.append(f"{what}: {root} ({count} objects, {size / 1e6:.1f} MB)")
    return out


def doctor() -> int:
    """Print the report; return 1 when it found a problem, else 0."""
    out: list[str] = [
        f"git-theta {__version__} ({sys.executable})",
        run("git", "--version", check=False).stdout.decode().strip() or "git: not found",
    ]
    problems: list[str] = []
    lfs = git.lfs_version()
    out.append(lfs or "git-lfs: not installed")
    if lfs is None:
        problems.append("git-lfs is not installed: apt-get install git-lfs (or brew), then retry")
    config = theta_config()
    if not any(config.get(k) for k in FILTER_KEYS):
        problems.append(f"git-theta's filter is not configured: {INSTALL}")
    for key in COMMAND_KEYS:
        value = config.get(key)
        if value is None:
            continue
        problem = program_problem(value)
        out.append(f"{key} = {value}" + (f"  [{problem}]" if problem else ""))
        if problem:
            problems.append(f"{key} {problem}: run `git theta install` again")
    for key, value in sorted(config.items()):
        if key not in COMMAND_KEYS:
            out.append(f"{key} = {value}")
    from git_theta import filter_client, forkserver

    mode = "warm server" if "filter_client" in config.get("filter.theta.process", "") else "direct"
    running = forkserver.find_servers(filter_client.server_dirs())
    pids = ", ".join(str(server.pid) for server in running) or "none"
    out.append(f"filter process: {mode}; warm servers running: {pids}")
    if git.inside_work_tree():
        hooks = git.hooks_dir()
        out.append(f"hooks directory: {hooks}")
        common = os.path.realpath(git.common_dir())
        if os.path.commonpath([os.path.realpath(hooks), common]) != common:
            # core.hooksPath elsewhere (shared, husky...): git-theta does not write there.
            ok = runs_theta(os.path.join(hooks, "pre-push"))
            out.append(f"hook pre-push: {'runs' if ok else 'does not run'} git-theta's upload")
            if not ok:
                try:
                    install_hooks()
                except HooksElsewhereError as exc:
                    problems.append(str(exc))
        else:
            lines, found = _hook_lines(hooks)
            out += lines
            problems += found
        out += _store_lines(git.lfs_storage_dir())
    else:
        out.append("not inside a git work tree: repository checks skipped")
    for line in out:
        sys.stdout.write(line + "\n")
    for problem in problems:
        sys.stdout.write(f"problem: {problem}\n")
    sys.stdout.flush()
    return 1 if problems else 0
