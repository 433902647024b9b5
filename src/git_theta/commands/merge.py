"""Merging checkpoints: git's merge driver (``merge.theta.driver``) and ``git theta merge``.

The driver gets the three versions' manifests from git (%O %A %B) and writes the merge
into %A; git stores it and checks it out through our filter. On a conflict it keeps
ours for the conflicting tensors (so the work tree holds a whole, valid checkpoint),
exits 1 and says how to resolve: ``git theta merge --strategy S PATH`` (which merges the
index's conflict stages again, writes the file and stages it) or ``--manual`` (the three
versions written beside the file, for any tool to merge).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, cast

from git_theta.display import escape
from git_theta.errors import ManifestError, ThetaError, UsageError
from git_theta.manifest import Manifest, is_manifest, parse
from git_theta.merging import Choice, MergeResult, Values, merge3

if TYPE_CHECKING:
    from git_theta.merging import Ask, Rule
    from git_theta.protocol.filter_process import Source
    from git_theta.repo import Repo
    from git_theta.store import ObjectRef

# Manual mode's files: PATH.theta-base etc. Their names match no `*.ext` track pattern,
# and install puts them in .git/info/exclude, so `git add .` does not sweep them in.
SIDES = ("base", "ours", "theirs")
MANUAL_SUFFIX = ".theta-"
EXCLUDE_LINES = ("# git-theta: the versions `git theta merge --manual` writes", "*.theta-base",
                 "*.theta-ours", "*.theta-theirs")  # fmt: skip


class MergeConflictError(ThetaError):
    """Tensors stay in conflict after a ``git theta merge``."""


def _read(
    path: str, repo: Repo | None = None, shown: str = "", side: str = "one version"
) -> Manifest | None:
    """The manifest in ``path`` (None for an empty file: that side has no version); with
    ``repo``, a Git LFS pointer (a version from before git-theta tracked the path) is
    read as the manifest of the checkpoint it names (``lfs_manifest``). Raises
    ManifestError naming ``shown`` (the user's path, not git's temporary file) and
    ``side`` when the file is neither."""
    from git_theta.files import open_regular

    with open_regular(path) as fh:
        data = fh.read()
    if not data:
        return None  # the file did not exist on that side
    if not is_manifest(data):
        if repo is not None:
            from git_theta import lfs_pointer

            ref = lfs_pointer.parse(data)
            if ref is not None:
                return lfs_manifest(ref, repo, shown or path)
        shown = shown or path
        raise ManifestError(
            f"{shown}: {side} is not a git-theta checkpoint; keep one side with "
            f"`git checkout --ours {shown}` or `git checkout --theirs {shown}`, then "
            f"`git add {shown}`"
        )
    try:
        return parse(data)
    except ManifestError as exc:
        exc.args = (f"{shown or path} ({side}): {exc}",)
        raise


def lfs_manifest(ref: ObjectRef, repo: Repo, shown: str) -> Manifest:
    """The manifest of the checkpoint in the Git LFS object ``ref``: the object (local,
    or downloaded as a checkout would) is verified, then cleaned as ``git add`` would
    (its tensors stored as objects, nothing else written). Raises ThetaError naming
    ``shown`` when the object is unavailable or corrupt, or not a checkpoint."""
    import io

    from git_theta import lfs_pointer
    from git_theta.clean import clean
    from git_theta.files import open_regular

    try:
        lfs_pointer.write_object(ref, repo.store, lambda _chunk: None, repo.downloader.fetch)
    except ThetaError as exc:
        exc.args = (
            f"{shown}: the merge base is a Git LFS version ({exc}); fetch it "
            "(`git lfs fetch --all`) and merge again",
        )
        raise
    where = repo.store.open_plain_path(ref)
    assert where is not None  # write_object found it
    sink = io.BytesIO()
    with open_regular(where) as fh:
        try:
            source = cast("Source", fh)  # a file object: it has readinto
            manifest = clean(source, sink, shown, repo.store, None, show_progress=False)
        except ThetaError as exc:
            exc.args = (f"{shown}: the merge base (a Git LFS version): {exc}",)
            raise
    if manifest is None:
        raise ManifestError(f"{shown}: the merge base's Git LFS object is not a checkpoint")
    return manifest


def _strategies() -> list[str]:
    from git_theta.merges import MERGES

    return sorted(MERGES.all())


def _prompt(path: str) -> Ask | None:
    from git_theta.merge_prompt import Prompt, open_terminal

    terminal = open_terminal()
    return None if terminal is None else Prompt(terminal, path, _strategies(), sys.stderr)


def _summary(path: str, result: MergeResult) -> str:
    """'merged N tensors both sides changed (average: 3, elementwise: 1)', or ''."""
    if not result.records:
        return ""
    counts: dict[str, int] = {}
    for record in result.records.values():
        counts[record.strategy] = counts.get(record.strategy, 0) + 1
    how = ", ".join(f"{key}: {n}" for key, n in sorted(counts.items()))
    count = len(result.records)
    return f"git-theta: {escape(path)}: merged {count} tensors both sides changed ({how})\n"


def _conflict_message(path: str, result: MergeResult) -> str:
    shown = ", ".join(escape(c) for c in result.conflicts[:10])
    more = f" and {len(result.conflicts) - 10} more" if len(result.conflicts) > 10 else ""
    return (
        f"git-theta: {escape(path)}: tensors changed on both sides: {shown}{more}; the merge "
        f"keeps ours for them. Resolve with `git theta merge --strategy STRATEGY "
        f"{escape(path)}` (strategies: {', '.join(_strategies())}), or `git theta merge "
        f"--manual {escape(path)}` to merge the versions with another tool, then `git add` it."
    )


def _merge(
    path: str,
    base: Manifest | None,
    ours: Manifest,
    theirs: Manifest,
    repo: Repo,
    forced: Choice | None,
    interactive: bool,
    ours_file: str | None = None,
) -> MergeResult:
    """Merge the three versions of ``path`` with the settings (``forced`` first) and,
    when ``interactive``, the prompt. ``ours_file`` is the work-tree file, which may
    hold ours' bytes (read instead of decoded where they hash right)."""
    from git_theta.merge_rules import load_rule

    rule: Rule
    rule, whole = load_rule(str(repo.cwd or "."), forced)
    ask = _prompt(path) if interactive else None
    from git_theta import merged_values

    merged_values.sweep(repo.store)
    values = Values(repo.store, repo.downloader.fetch, keep=True, ours_file=ours_file)
    return merge3(base, ours, theirs, values, rule, ask, whole)


def _import_numpy() -> None:
    import contextlib

    # Silent whatever goes wrong (a missing or broken NumPy): the merge's own import then
    # fails where its error is reported, in one line.
    with contextlib.suppress(Exception):
        import numpy  # noqa: F401


def merge_driver(base: str, ours: str, theirs: str, path: str) -> int:
    """Write the merge into ``ours``; exit 0 when clean, 1 with the conflicts listed."""
    import threading

    # The merge step needs NumPy (0.09 s to import, one core): imported beside the git
    # calls and manifest reads before it, which wait on git. An import in progress makes
    # a second one wait for it, never run twice.
    numpy_import = threading.Thread(target=_import_numpy, name="theta-numpy", daemon=True)
    numpy_import.start()
    try:
        return _merge_driver(base, ours, theirs, path)
    finally:
        numpy_import.join()  # never exit mid-import


def _merge_driver(base: str, ours: str, theirs: str, path: str) -> int:
    from git_theta import git
    from git_theta.repo import Repo

    top = str(git.toplevel())
    repo = Repo(top)
    try:
        shown = escape(path)
        o, t = _read(ours, repo, shown, "our version"), _read(theirs, repo, shown, "their version")
        if o is None or t is None:
            sys.stderr.write(
                f"git-theta: {escape(path)}: deleted on one side and changed on the other; "
                f"`git rm {escape(path)}` or `git add {escape(path)}` to resolve\n"
            )
            return 1
        b = _read(base, repo, shown, "the merge base's version")
        # git merges into a work tree whose file is ours (a rebase's, a stash pop's too).
        full = os.path.join(top, path)
        result = _merge(path, b, o, t, repo, None, interactive=True, ours_file=full)
        from git_theta.merge_check import check_taken

        try:
            check_taken(result.manifest, o, (b, t), repo.store, repo.downloader.fetch, keep=True)
        except ThetaError as exc:
            # %A keeps ours: git checks that out, and no merge commit holds what cannot be.
            sys.stderr.write(
                f"git-theta: {shown}: their version cannot be checked out ({escape(str(exc))});"
                " the merge keeps ours; run `git lfs fetch --all` (or ask for the objects to "
                "be pushed) and merge again\n"
            )
            return 1
        from git_theta import driver_results
        from git_theta.files import atomic_write

        data = result.manifest.to_bytes()
        atomic_write(ours, data)
        # `git theta merge` then knows the conflicted file as this result (the prompt's
        # answers included), not as the user's own work.
        if result.conflicts:
            driver_results.save(repo.store, top, path, data)
        else:
            driver_results.drop(repo.store, top, path)
    finally:
        repo.close()
    sys.stderr.write(_summary(path, result))
    if result.conflicts:
        sys.stderr.write(_conflict_message(path, result) + "\n")
        return 1
    return 0


# -- git theta merge: resolving a conflicted path ------------------------------------


def _stages(top: str) -> dict[str, dict[int, tuple[str, str]]]:
    """Conflicted paths -> {stage: (mode, blob)} from the index."""
    from git_theta import git

    out: dict[str, dict[int, tuple[str, str]]] = {}
    for raw in git.git("ls-files", "-u", "-z", cwd=top).split(b"\0"):
        if not raw:
            continue
        info, _, name = raw.decode("utf-8", "surrogateescape").partition("\t")
        mode, blob, stage = info.split()
        out.setdefault(name, {})[int(stage)] = (mode, blob)
    return out


def _blob_manifest(blob: str, top: str, what: str, repo: Repo) -> Manifest:
    from git_theta import git, lfs_pointer
    from git_theta.manifest import PREFIX

    data = git.blobs_starting_with([blob], PREFIX, cwd=top).get(blob)
    if data is None:
        pointer = git.blobs_starting_with([blob], lfs_pointer.VERSION_LINE, cwd=top).get(blob)
        ref = None if pointer is None else lfs_pointer.parse(pointer)
        if ref is not None:
            return lfs_manifest(ref, repo, what)
        raise ThetaError(f"{what} is not a git-theta checkpoint; resolve it with git")
    try:
        return parse(data)
    except ManifestError as exc:
        exc.args = (f"{what}: {exc}",)
        raise


def _write_checkpoint(dest: str, manifest: Manifest, path: str, repo: Repo, top: str) -> None:
    from git_theta.files import AtomicWriter
    from git_theta.smudge import write_checkpoint

    with AtomicWriter(dest, within=top) as fh:
        write_checkpoint(manifest, fh, path, repo.store, fetch=repo.downloader.fetch)


def ensure_excluded(top: str) -> None:
    """Add manual mode's names to ``.git/info/exclude`` once (they are never staged by
    `git add .`)."""
    from git_theta import git
    from git_theta.files import atomic_write, read_capped

    info = os.path.join(git.git("rev-parse", "--git-common-dir", cwd=top).decode().strip())
    if not os.path.isabs(info):
        info = os.path.join(top, info)
    exclude = os.path.join(info, "info", "exclude")
    try:
        old = read_capped(exclude, 1 << 20)
    except FileNotFoundError:
        old = b""
    have = set(old.decode("utf-8", "replace").splitlines())
    missing = [line for line in EXCLUDE_LINES if line not in have]
    if not missing:
        return
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    sep = b"" if not old or old.endswith(b"\n") else b"\n"
    atomic_write(exclude, old + sep + ("\n".join(missing) + "\n").encode())


def manual_paths(path: str) -> list[str]:
    """The files manual mode writes for ``path``: base, ours, theirs."""
    return [f"{path}{MANUAL_SUFFIX}{side}" for side in SIDES]


def merge_command(paths: list[str], strategy: str | None, params: list[str], manual: bool) -> int:
    """Resolve conflicted checkpoints: merge the index's stages again with ``strategy``
    (or the configured rules, or the prompt), write the file and stage it; or with
    ``manual`` write the three versions beside it. Returns 0; raises ThetaError."""
    from git_theta import git
    from git_theta.merge_rules import check_choice
    from git_theta.repo import Repo
    from git_theta.setup_check import require_filter

    if manual and strategy:
        raise UsageError("--manual writes the versions for another tool; it takes no --strategy")
    if params and not strategy:
        raise UsageError("--param needs --strategy")
    require_filter()
    top = str(git.toplevel())
    prefix = git.show_prefix()
    forced = check_choice(strategy, params, "--strategy") if strategy else None
    conflicted = _stages(top)
    targets = [os.path.normpath(prefix + p) for p in paths] if paths else sorted(conflicted)
    if not targets:
        raise UsageError("no conflicted paths: `git theta merge` resolves a merge's conflicts")
    for path in targets:
        if path not in conflicted:
            raise UsageError(f"{escape(path)}: not in conflict (no merge stages in the index)")
    repo = Repo(top)
    try:
        for path in targets:
            _resolve(path, conflicted[path], repo, top, forced, manual)
    finally:
        repo.close()
    return 0


def _stage(cacheinfo: str, path: str, top: str) -> None:
    """Put the merge in the index (one stage-0 entry); raises ThetaError when git cannot
    (another git command holds the index)."""
    from git_theta.proc import run

    done = run("git", "update-index", "--cacheinfo", cacheinfo, cwd=top, check=False)
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        why = lines[0].removeprefix("fatal: ").rstrip(".") if lines else "it failed"
        raise ThetaError(
            f"{escape(path)}: git cannot stage the merge ({escape(why)}); nothing was "
            "written: run this again once no other git command is running"
        )


def _refuse_changed(full: str, path: str, versions: dict[int, Manifest], repo: Repo) -> None:
    """Raise ThetaError unless the work-tree file is what the merge left there: ours
    (stage 2) or the driver's result (the one-side rule; else the configured rules with
    no prompt). Anything else is the user's own work: a checkpoint merged by hand after
    --manual, or uncommitted changes git kept under the conflict. The file is compared
    with each (smudge.file_matches: hashed as read, stored nowhere)."""
    from git_theta.smudge import file_matches

    if not os.path.lexists(full):
        return  # nothing there to lose
    from git_theta import driver_results

    base, ours, theirs = versions.get(1), versions[2], versions[3]
    left = driver_results.load(repo.store, repo.cwd or ".", path)
    for candidate in (ours, merge3(base, ours, theirs).manifest, left):
        if candidate is not None and file_matches(full, candidate, repo.store):
            return
    from git_theta.merge_rules import load_rule

    rule, whole = load_rule(str(repo.cwd or "."), None)
    values = Values(repo.store, repo.downloader.fetch)
    driver = merge3(base, ours, theirs, values, rule, None, whole).manifest
    if not file_matches(full, driver, repo.store):
        shown = escape(path)
        raise ThetaError(
            f"{shown} changed since the merge stopped; `git add {shown}` to keep it, or "
            f"`git checkout --merge -- {shown}` and run this again"
        )


def _resolve(
    path: str,
    stages: dict[int, tuple[str, str]],
    repo: Repo,
    top: str,
    forced: Choice | None,
    manual: bool,
) -> None:
    from git_theta import git
    from git_theta.proc import run

    if 2 not in stages or 3 not in stages:
        raise ThetaError(
            f"{escape(path)}: deleted on one side and changed on the other; `git rm` or "
            "`git add` it to resolve"
        )
    versions: dict[int, Manifest] = {
        s: _blob_manifest(stages[s][1], top, f"{escape(path)} (stage {s})", repo)
        for s in (1, 2, 3)
        if s in stages
    }
    full = os.path.join(top, path)
    if manual:
        from git_theta.files import check_replaceable

        for dest in manual_paths(path):  # all first: a refusal leaves no half-done set
            check_replaceable(os.path.join(top, dest), shown=escape(dest))
        ensure_excluded(top)
        for side, dest in zip(SIDES, manual_paths(path), strict=True):
            manifest = versions.get(SIDES.index(side) + 1)
            if manifest is not None:
                _write_checkpoint(os.path.join(top, dest), manifest, dest, repo, top)
                sys.stderr.write(f"git-theta: wrote {escape(dest)} ({side})\n")
        sys.stderr.write(
            f"git-theta: write the merged checkpoint to {escape(path)}, `git add {escape(path)}`"
            f" and delete the {MANUAL_SUFFIX}* files\n"
        )
        return
    _refuse_changed(full, path, versions, repo)
    result = _merge(path, versions.get(1), versions[2], versions[3], repo, forced, True, full)
    if result.conflicts:
        raise MergeConflictError(_conflict_message(path, result).removeprefix("git-theta: "))
    data = result.manifest.to_bytes()
    blob = git.git("hash-object", "-w", "--stdin", cwd=top, stdin=data).decode().strip()
    from git_theta.files import AtomicWriter
    from git_theta.smudge import write_checkpoint

    with AtomicWriter(full, within=top) as fh:
        write_checkpoint(result.manifest, fh, path, repo.store, fetch=repo.downloader.fetch)
        # Staged before the file is renamed into place: a failure (a locked index)
        # leaves the work tree as it was.
        _stage(f"{stages[2][0]},{blob},{path}", path, top)
    # With our filter on, git hashes the file once and records its stat data, so
    # `git status` shows it staged, not modified.
    run("git", "update-index", "-q", "--refresh", "--", path, cwd=top, check=False)
    for stale in manual_paths(path):
        if os.path.isfile(os.path.join(top, stale)):
            os.unlink(os.path.join(top, stale))
    from git_theta import driver_results

    driver_results.drop(repo.store, top, path)
    sys.stderr.write(_summary(path, result))
    sys.stderr.write(f"git-theta: {escape(path)}: merged and staged\n")
