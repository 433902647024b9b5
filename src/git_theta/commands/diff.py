"""``git theta diff`` and git's external diff driver: tensor-level reports, text or JSON."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from git_theta import git
from git_theta.diffing import (
    FileDiff,
    TensorDiff,
    TensorSide,
    compare,
    from_file,
    from_manifest,
    manifest_objects,
)
from git_theta.display import escape
from git_theta.errors import LocalSetupError, ObjectCorruptError, ObjectMissingError, UsageError
from git_theta.files import open_regular
from git_theta.history import manifests_at, manifests_in_index
from git_theta.manifest import PREFIX, Manifest, is_manifest, parse
from git_theta.proc import run
from git_theta.repo import Repo
from git_theta.revisions import bad_revision, has_commits, resolves
from git_theta.store import ObjectRef, ObjectStore

NULL_HEX = {"", ".", "0" * 40, "0" * 64}
_COLOURS = {"added": "\033[32m", "removed": "\033[31m", "modified": "\033[33m"}
_MARK = {"added": "A", "removed": "D", "modified": "M"}


def _use_colour() -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    return sys.stdout.isatty() or os.environ.get("GIT_PAGER_IN_USE") == "true"


def _shape(side: TensorSide | None) -> str:
    return "-" if side is None else f"{side.dtype} [{', '.join(map(str, side.shape))}]"


def _tensor_line(t: TensorDiff) -> str:
    parts = [f"{_MARK[t.status]} {t.name}"]
    if t.status == "modified":
        assert t.old is not None and t.new is not None
        if (t.old.dtype, t.old.shape) != (t.new.dtype, t.new.shape):
            parts.append(f"{_shape(t.old)} -> {_shape(t.new)}")
        else:
            parts.append(_shape(t.new))
        parts.append(t.new.update)
        if t.blocks is not None:  # quantized: what changed is whole blocks
            changed, total = t.blocks
            kind = t.new.dtype.removeprefix("GGML_")
            parts.append(
                f"{t.changed:,}/{t.numel:,} in changed blocks ({changed:,}/{total:,} "
                f"{kind} blocks, {_pct(changed, total)})"
            )
        elif t.changed is not None:
            parts.append(f"{t.changed:,}/{t.numel:,} changed ({_pct(t.changed, t.numel)})")
        if t.l2 is not None:
            rel = f"{t.rel:.4g}" if t.rel is not None else "n/a"  # the note says why
            parts.append(f"L2 {t.l2:.4g}  max {t.max_abs:.4g}  rel {rel}")
        if t.update_summary:
            parts.append(t.update_summary)
        if t.new.merge:  # how a merge made the new value
            parts.append(f"merged: {t.new.merge}")
        if t.note:
            parts.append(t.note)
    else:
        side = t.new or t.old
        assert side is not None
        parts.append(_shape(side))
        parts.append(side.update)
    return "  ".join(parts)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0.00%"


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _header(report: FileDiff) -> str:
    total = len(report.tensors) + report.unchanged
    # git's diff driver sees one file, not the version: objects that other files of the
    # old version hold are counted, so it says what it counts.
    stored = "stored for the change" if report.stored_scope == "version" else "new to this file"
    return (
        f"{len(report.tensors)} of {total} tensors changed: {report.params_changed:,} of "
        f"{report.params_total:,} parameters ({_pct(report.params_changed, report.params_total)}),"
        f" {_bytes(report.bytes_stored)} {stored}"
    )


_SEPARATOR = re.compile(r"([./])")  # safetensors and torch names use '.', Flax, HDF5, npz '/'


def _group(name: str, depth: int = 1) -> str:
    """The prefix a tensor is grouped under: up to its first numeric component (a layer)
    other than its last, else its first ``depth`` components (at '.' or '/')."""
    parts = _SEPARATOR.split(name)  # components at even places, separators between
    for i in range(2, len(parts) - 1, 2):
        if parts[i].isdigit():
            return "".join(parts[: i + 1])
    return "".join(parts[: 2 * depth - 1])


def _group_rel(items: list[TensorDiff]) -> str:
    """The group's relative change, ||new - old|| / ||old|| over its measured tensors
    ("" when none was measured; "was all zeros" when their old values were)."""
    measured = [t for t in items if t.l2 is not None and t.old_norm is not None]
    if not measured:
        return ""
    change = math.hypot(*(t.l2 or 0.0 for t in measured))  # hypot: squares never overflow
    norm = math.hypot(*(t.old_norm or 0.0 for t in measured))
    if norm > 0:
        rel = change / norm
        return f", rel {rel:.4g}" if math.isfinite(rel) else ""
    return ", rel 0" if change == 0 else ", was all zeros"


def _group_depth(names: list[str]) -> int:
    """2 when every name starts with the same component and goes deeper (Flax's
    ``params/``, Keras's ``layers/``): grouping by it alone would make one group."""
    firsts = {_SEPARATOR.split(n, maxsplit=1)[0] for n in names}
    deep = any(len(_SEPARATOR.split(n)) > 3 for n in names)
    return 2 if len(names) > 1 and len(firsts) == 1 and deep else 1


def render_text(report: FileDiff, stat: bool, colour: bool) -> str:
    """The report as lines for a terminal. Names, paths and dtypes come from the
    repository: each line is escaped (display.escape) before our colours are added."""
    path = escape(report.path)
    lines = [f"diff --theta a/{path} b/{path}", _header(report)]
    if stat:
        groups: dict[str, list[TensorDiff]] = {}
        depth = _group_depth([t.name for t in report.tensors])
        for t in report.tensors:
            groups.setdefault(_group(t.name, depth), []).append(t)
        for prefix, items in groups.items():
            params = sum(t.changed if t.changed is not None else t.numel for t in items)
            kinds = ", ".join(
                f"{n} {k}" for k in ("modified", "added", "removed")
                if (n := sum(t.status == k for t in items))
            )  # fmt: skip
            lines.append(escape(f" {prefix}  {kinds}, {params:,} parameters{_group_rel(items)}"))
    else:
        for t in report.tensors:
            line = escape(_tensor_line(t))
            lines.append(f"{_COLOURS[t.status]}{line}\033[0m" if colour else line)
    if report.unchanged:
        plural = "s" if report.unchanged != 1 else ""
        lines.append(f"{report.unchanged} unchanged tensor{plural}")
    return "\n".join(lines) + "\n"


def _side_json(side: TensorSide | None) -> dict[str, Any] | None:
    if side is None:
        return None
    return {
        "dtype": side.dtype,
        "shape": list(side.shape),
        "hash": side.hash,
        "update": side.update,
        "merged": side.merge or None,
    }


def _finite(x: float | None) -> float | None:
    """``x``, or None past float64: JSON has no Infinity (json.dumps would write one)."""
    return x if x is None or math.isfinite(x) else None


def render_json(reports: list[FileDiff]) -> str:
    files = []
    for r in reports:
        files.append({
            "path": r.path,
            "tensors_changed": len(r.tensors),
            "tensors_unchanged": r.unchanged,
            "parameters_changed": r.params_changed,
            "parameters_total": r.params_total,
            "bytes_stored": r.bytes_stored,
            "bytes_stored_scope": r.stored_scope,
            "tensors": [
                {
                    "name": t.name, "status": t.status, "old": _side_json(t.old),
                    "new": _side_json(t.new), "numel": t.numel, "changed": t.changed,
                    "l2": _finite(t.l2), "max_abs": _finite(t.max_abs), "rel": t.rel,
                    "old_norm": _finite(t.old_norm),
                    "blocks_changed": t.blocks[0] if t.blocks else None,
                    "blocks": t.blocks[1] if t.blocks else None,
                    "note": t.note or None, "update_summary": t.update_summary or None,
                }
                for t in r.tensors
            ],
        })  # fmt: skip
    return json.dumps({"files": files}, indent=1) + "\n"


def file_side(path: str, store: ObjectStore) -> dict[str, TensorSide]:
    """Describe a work-tree file: a checkpoint, or a manifest left by a skipped smudge."""
    with open_regular(path) as fh:  # a work-tree path: never a FIFO, never via a symlink
        head = fh.read(64)
    if is_manifest(head):
        with open_regular(path) as fh:
            return from_manifest(parse(fh.read()), store)
    return from_file(path)


def lfs_side(spec: str, repo: Repo) -> dict[str, TensorSide] | None:
    """Describe ``spec`` (``REV:PATH``, or ``:PATH`` for the index) when its blob is a Git
    LFS pointer (a version from before git-theta tracked the path) as the checkpoint its
    object holds, downloading the object when it is missing; None when it is not one."""
    from git_theta import lfs_pointer

    size = run("git", *git.NO_FILTER, "cat-file", "-s", spec, check=False, cwd=repo.cwd)
    if size.returncode != 0 or int(size.stdout or b"0") > lfs_pointer.MAX_POINTER:
        return None
    ref = lfs_pointer.parse(git.git("cat-file", "blob", spec, cwd=repo.cwd))
    if ref is None:
        return None
    if repo.store.open_plain_path(ref) is None:
        repo.downloader.fetch([ref])
    where = repo.store.open_plain_path(ref)
    if where is None:
        raise ObjectMissingError(
            f"{spec}: Git LFS object {ref.oid} is not local and could not be downloaded"
        )
    _verify_plain(ref, repo, spec)
    return from_file(where)


def _verify_plain(ref: ObjectRef, repo: Repo, spec: str) -> None:
    """Raise ObjectCorruptError unless the local copy of ``ref`` hashes to it: diffs
    describe its tensors, and a checkout would refuse it (lfs_pointer's one check)."""
    from git_theta import lfs_pointer

    try:
        lfs_pointer.write_object(ref, repo.store, lambda _chunk: None, None)
    except ObjectCorruptError as exc:
        exc.args = (f"{spec}: {exc}",)
        raise


def _under(path: str, spec: str) -> bool:
    """True when ``path`` is ``spec`` or inside the directory ``spec`` ('.' is the root)."""
    return spec == "." or path == spec or path.startswith(spec.rstrip("/") + "/")


def split_revs(args: list[str]) -> tuple[list[str], list[str]]:
    """Split positional arguments into revisions and paths, the way git does: a leading
    run of arguments that name commits are revisions, the rest are paths."""
    revs: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return revs, args[i + 1 :]
        if not resolves(arg):
            # As git: without "--", what is not a revision must be a path that exists.
            if "--" in args[i:]:
                raise bad_revision(arg)
            for path in args[i:]:
                if not os.path.lexists(path):
                    raise bad_revision(path)
            return revs, args[i:]
        revs.append(arg)
    return revs, []


def diff(
    revs: list[str],
    paths: list[str],
    cached: bool,
    as_json: bool,
    stat: bool,
    pattern: str | None,
) -> int:
    """Report tensor-level changes like ``git diff [--cached] [A [B]] -- PATHS``."""
    top = str(git.toplevel())
    repo = Repo(top)
    store = repo.store

    def at(rev: str | None) -> dict[str, Manifest]:
        if rev == "HEAD" and cached and not revs and not has_commits(top):
            return {}  # before the first commit, --cached compares with nothing, as git
        found = manifests_in_index(top) if rev is None else manifests_at(rev, top)
        return dict(found)

    if len(revs) > 2:
        raise UsageError("give at most two revisions")
    old_m = at(revs[0] if revs else ("HEAD" if cached else None))
    new_m: dict[str, Manifest] | None = None
    if len(revs) == 2:
        new_m = at(revs[1])
    elif cached:
        new_m = at(None)
    prefix = git.show_prefix(top)
    wanted = {os.path.normpath(prefix + p) for p in paths}
    names = sorted(set(old_m) | set(new_m if new_m is not None else old_m))
    names = [n for n in names if not wanted or any(_under(n, w) for w in wanted)]
    name_filter: Callable[[str], bool] | None = (
        (lambda n: fnmatch.fnmatchcase(n, pattern)) if pattern else None
    )
    reports = []
    old_rev = revs[0] if revs else ("HEAD" if cached else "")
    new_rev = revs[1] if len(revs) == 2 else ""

    def side(found: dict[str, Manifest], rev: str, path: str) -> dict[str, TensorSide]:
        if path in found:
            return from_manifest(_with_glue(found[path], path, repo), store)
        return lfs_side(f"{rev}:{path}", repo) or {}  # an LFS version of a tracked path

    # "Stored for the change": objects no file of the old version references (a tensor
    # that moved to another shard costs nothing), each counted in the first file using it.
    counted = set().union(*(manifest_objects(m) for m in old_m.values()))
    from git_theta.progress import Progress

    progress = Progress("comparing", 0, len(names), unit="files")  # decoding takes a while
    for path in names:
        progress.advance(0)
        old = side(old_m, old_rev, path)
        new_objects: set[tuple[str, int]] | None = None
        if new_m is not None:
            new = side(new_m, new_rev, path)
            if path in new_m:
                new_objects = manifest_objects(new_m[path])
        else:
            full = os.path.join(top, path)
            new = file_side(full, store) if os.path.exists(full) else {}
        report = compare(path, old, new, name_filter, counted, new_objects)
        counted = counted | (new_objects or set())
        if report.tensors or as_json:
            reports.append(report)
    progress.close()
    if as_json:
        sys.stdout.write(render_json(reports))
    else:
        colour = _use_colour()
        sys.stdout.write("".join(render_text(r, stat, colour) for r in reports))
    return 0


def _with_glue(manifest: Manifest, path: str, repo: Repo) -> Manifest:
    """Return ``manifest``, its glue downloaded when it is an npz's and missing: the glue
    holds its compressed arrays, which would otherwise show as added or removed. Raises
    ObjectMissingError when the glue cannot be had."""
    if manifest.format == "npz" and not repo.store.has(manifest.glue.ref):
        repo.downloader.fetch([manifest.glue.ref])  # what the remote lacks stays missing
        if not repo.store.has(manifest.glue.ref):
            raise ObjectMissingError(
                f"{path}: object {manifest.glue.ref.oid} (the file's header, which holds "
                "its compressed arrays) is not local and could not be downloaded: run "
                "`git theta fetch` with a Git LFS remote that has it"
            )
    return manifest


def _driver_side(
    path: str, file: str, hexid: str, repo: Repo
) -> tuple[dict[str, TensorSide], set[tuple[str, int]]]:
    """The version git gives the driver, and the objects it references (its glue too)."""
    store = repo.store
    if file == "/dev/null":
        return {}, set()
    if hexid not in NULL_HEX:
        blob = git.blobs_starting_with([hexid], PREFIX).get(hexid)
        if blob is not None:
            manifest = _with_glue(parse(blob), path, repo)
            return from_manifest(manifest, store), manifest_objects(manifest)
    sides = file_side(file, store)
    return sides, {o for side in sides.values() for o in side.objects}


def diff_driver(args: list[str]) -> int:
    """git's ``diff.theta.command``: PATH OLD-FILE OLD-HEX OLD-MODE NEW-FILE NEW-HEX NEW-MODE.

    Both versions are described from their manifests (by blob id) when git has them, so
    only the tensors that changed are decoded.
    """
    if len(args) < 7:
        sys.stdout.write(f"* Unmerged path {escape(args[0]) if args else ''}\n")
        return 0
    path, old_file, old_hex, _, new_file, new_hex, _ = args[:7]
    repo = Repo()
    try:
        old, old_objects = _driver_side(path, old_file, old_hex, repo)
        new, new_objects = _driver_side(path, new_file, new_hex, repo)
        report = compare(path, old, new, None, old_objects, new_objects)
        report.stored_scope = "file"  # it sees one file, not the version: it says so
    except LocalSetupError as exc:  # h5py missing: git diff still shows everything else
        for line in (f"diff --theta a/{path} b/{path}", f"{path}: not shown: {exc}"):
            sys.stdout.write(escape(line) + "\n")
        return 0
    sys.stdout.write(render_text(report, stat=False, colour=_use_colour()))
    sys.stdout.flush()
    return 0
