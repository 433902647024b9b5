"""History rewrites between Git LFS and git-theta (``git theta migrate import|export``).

Import: in every commit of the chosen refs, the root .gitattributes is rewritten first
(matching patterns get ``filter=theta``), then every file git would run our filter on is
made a manifest: an LFS pointer's object, or a raw blob, is cleaned with that path's
manifest in the rewritten first parent as ``previous``, so each version is stored as a
change on the one before. Export is the way back: each manifest is rebuilt into a Git
LFS object and replaced by the pointer git-lfs itself writes; the attribute lines go
back to ``filter=lfs``, so exporting an imported LFS history gives its commits back.

Which paths a commit converts is asked of git (``git check-attr`` on the rewritten
.gitattributes), so it is exactly what git filters when that commit is checked out.
Commits keep their raw headers and messages; only tree and parent lines change, and a
signature is dropped (it no longer matches). A commit whose tree and parents come out the
same keeps its id. Nothing a user sees changes before every object is written: refs then
move in one ``git update-ref --stdin`` transaction (their reflogs keep the old tips), and
the checked-out branch's index is refreshed in place of rewriting its files.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shlex
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO, NamedTuple

from git_theta import git, git_objects, lfs_pointer
from git_theta.clean import clean
from git_theta.commands.track import OURS, update_attributes
from git_theta.display import quote
from git_theta.errors import CheckpointError, ObjectCorruptError, ThetaError
from git_theta.files import TempFile
from git_theta.git_objects import REGULAR, TREE, Entry
from git_theta.history import MAX_MANIFEST
from git_theta.manifest import Manifest, is_manifest, parse
from git_theta.proc import run
from git_theta.protocol.filter_process import Sink
from git_theta.repo import Repo
from git_theta.smudge import needed_objects, write_checkpoint
from git_theta.store import TMP_PREFIX, ObjectRef
from git_theta.transfer import POINTER

# File names whose Git LFS lines an import takes over when no --include is given.
CHECKPOINT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".npy", ".gguf", ".msgpack", ".h5",
)  # fmt: skip
LFS_ATTRS = ("filter=lfs", "diff=lfs", "merge=lfs", "-text")
ATTRIBUTES_CAP = 16 << 20  # a larger .gitattributes is refused (nobody writes 16 MB by hand)
MESSAGE = "git theta migrate {mode}"

_READERS_OPEN = 8  # `git check-attr` processes kept running (one per .gitattributes text)


class MigrateError(ThetaError):
    """A history cannot be rewritten as asked; nothing was changed."""


class Result(NamedTuple):
    """What a migration did: commits rewritten, distinct checkpoint versions converted,
    their bytes before and after (objects each needs, counted once), refs moved (name,
    old, new), and the refs left alone because every commit of theirs is on a remote."""

    commits: int
    versions: int
    before: int
    after: int
    refs: list[tuple[str, str, str]]
    on_remote: list[str]


class _Side(NamedTuple):
    """A parent commit's view of one directory: its tree there before and after the
    rewrite, and the key of the rules it was rewritten with (None: left as it was)."""

    orig: str | None
    new: str | None
    key: str | None


class _AtParent(NamedTuple):
    """A path's entry in one parent, before and after that parent's rewrite."""

    old: Entry | None
    new: Entry | None
    rewritten: bool  # False: a parent outside the rewrite (on a remote), left as it was


class _Rules(NamedTuple):
    """One commit's rules: its root .gitattributes blob before and after the rewrite."""

    key: str
    old: str | None
    new: str | None

    @property
    def attributes(self) -> str | None:
        """The blob to put at the root, None: leave the entry as it is."""
        return self.new if self.new != self.old else None


class _Verified:
    """A Git LFS object read as a stream, its sha256 and size checked at the end."""

    def __init__(self, fh: io.BufferedReader, ref: ObjectRef):
        self._fh = fh
        self._ref = ref
        self._digest = hashlib.sha256()
        self._size = 0

    def read(self, n: int = -1, /) -> bytes:
        data = self._fh.read(n)
        self._digest.update(data)
        self._size += len(data)
        return data

    def readinto(self, out: memoryview, /) -> int:
        got = self._fh.readinto(out)
        self._digest.update(out[:got])
        self._size += got
        return got

    def check(self) -> None:
        """Raise ObjectCorruptError unless the whole object had the bytes its oid names."""
        while self.read(1 << 20):
            pass
        if self._size != self._ref.size or self._digest.hexdigest() != self._ref.oid:
            raise ObjectCorruptError(
                f"Git LFS object {self._ref.oid} is corrupt (its sha256 does not match)"
            )


class _Collect:
    """A sink keeping what is written (a manifest: small)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        self.data += data
        return len(data)


class _HashingSink:
    """Writes to a file, hashing as it goes (a Git LFS object being made)."""

    def __init__(self, fh: IO[bytes]):
        self._fh = fh
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview, /) -> int:
        self.digest.update(data)
        self._fh.write(data)
        self.size += len(data)
        return len(data)


# ---------------------------------------------------------------------------------------
# .gitattributes


def _lines(text: str) -> list[str]:
    """Split as git does, on LF only, each line keeping its ending."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    return [*lines, parts[-1]] if parts[-1] else lines


def _fields(line: str) -> list[str]:
    return line.rstrip("\n").rstrip("\r").split()


def _checkpoint_lfs_patterns(text: str) -> list[str]:
    """The patterns Git LFS tracks in ``text`` that name checkpoint files."""
    found = []
    for line in _lines(text):
        fields = _fields(line)
        if len(fields) > 1 and "filter=lfs" in fields[1:]:
            name = fields[0].rsplit("/", 1)[-1]
            if name.endswith(CHECKPOINT_SUFFIXES) and fields[0] not in found:
                found.append(fields[0])
    return found


def _theta_patterns(text: str) -> list[str]:
    found = []
    for line in _lines(text):
        fields = _fields(line)
        if len(fields) > 1 and "filter=theta" in fields[1:] and fields[0] not in found:
            found.append(fields[0])
    return found


def _to_theta(body: str, pattern: str) -> str:
    return update_attributes(body, pattern).rstrip("\n")


def _to_lfs(body: str, pattern: str) -> str:
    # The exact inverse of _to_theta on the line `git lfs track` writes.
    theta = _to_theta(body, pattern)
    return theta.removesuffix(" ".join(OURS)) + " ".join(LFS_ATTRS)


def rewrite_attributes(text: str | None, patterns: list[str], to: str) -> str | None:
    """Return .gitattributes ``text`` (None: no file) with each of ``patterns`` routed
    ``to`` 'theta' or 'lfs'; with no patterns, every Git LFS checkpoint line (to theta)
    or every git-theta line (to lfs). Lines are rewritten in place, their endings and
    every other line kept; a given pattern with no line of its own gets one at the end.
    """
    explicit = bool(patterns)
    if not explicit:
        if text is None:
            return None
        patterns = _checkpoint_lfs_patterns(text) if to == "theta" else _theta_patterns(text)
    lines = _lines(text or "")
    for pattern in patterns:
        found = False
        for i, line in enumerate(lines):
            fields = _fields(line)
            if not fields or fields[0] != pattern:
                continue
            found = True
            body = line.rstrip("\n").rstrip("\r")
            routed = "filter=theta" in fields[1:]
            if to == "theta" and not routed:
                lines[i] = _to_theta(body, pattern) + line[len(body) :]
            elif to == "lfs" and routed:
                lines[i] = _to_lfs(body, pattern) + line[len(body) :]
        if explicit and not found:
            if lines and not lines[-1].endswith("\n"):
                lines[-1] += "\n"
            attrs = OURS if to == "theta" else LFS_ATTRS
            lines.append(" ".join([pattern, *attrs]) + "\n")
    new = "".join(lines)
    return None if text is None and not new else new


# ---------------------------------------------------------------------------------------
# the rewrite


class _Rewriter:
    """Rewrites commits in topological order; subclasses say which files and how."""

    to = ""

    def __init__(self, patterns: list[str], scratch: str):
        self.patterns = patterns
        self.scratch = scratch
        self.objects = git_objects.Objects(scratch)
        self.repo = Repo()
        self.store = self.repo.store  # git-theta's objects; lfs_path(): git-lfs's
        self.commit_map: dict[str, str] = {}
        self.current = ""  # the commit being rewritten, for messages
        self._done: dict[str, tuple[str, str, str]] = {}  # commit -> orig, new tree, key
        self._trees: dict[str, list[Entry]] = {}
        self._tree_memo: dict[tuple[object, ...], str] = {}
        self._rules: dict[str | None, _Rules] = {}  # by the original .gitattributes blob
        self._readers: dict[str, git_objects.AttributeReader] = {}
        self._open: list[git_objects.AttributeReader] = []

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self.objects.close()
        self.repo.close()

    # -- to be provided: which paths, and how each blob changes

    def selected(self, rules: _Rules, path: bytes) -> bool:
        raise NotImplementedError

    def convert(self, oid: str, path: bytes, parents: list[_AtParent]) -> str:
        raise NotImplementedError

    def stats(self) -> tuple[int, int, int]:
        """(versions, bytes before, bytes after)."""
        raise NotImplementedError

    # -- shared

    def fail(self, path: bytes, exc: BaseException) -> MigrateError:
        where = f"{os.fsdecode(path)} in commit {self.current[:12]}"
        hint = "nothing was changed"
        if isinstance(exc, CheckpointError) and not self.patterns:
            hint += " (to keep such files in Git LFS, name the checkpoints with --include)"
        return MigrateError(f"{where}: {exc}; {hint}")

    def entries(self, tree: str) -> list[Entry]:
        if tree not in self._trees:
            if len(self._trees) > 50_000:
                self._trees.clear()
            self._trees[tree] = git_objects.parse_tree(
                self.objects.read(tree)[1], self.objects.oid_bytes
            )
        return self._trees[tree]

    def entry_map(self, tree: str | None) -> dict[bytes, Entry]:
        return {} if tree is None else {e.name: e for e in self.entries(tree)}

    def filter_of(self, blob: str | None, path: bytes) -> str:
        """The filter git gives ``path`` under the root .gitattributes ``blob``."""
        if blob is None:
            return "unspecified"
        reader = self._readers.get(blob)
        if reader is None:
            index = os.path.join(self.scratch, f"attributes-{len(self._readers)}.index")
            reader = self._readers[blob] = git_objects.AttributeReader(blob, index)
        if reader in self._open:
            self._open.remove(reader)
        self._open.append(reader)
        while len(self._open) > _READERS_OPEN:  # answers stay memoised; a process restarts
            self._open.pop(0).close()
        return reader.filter_of(path)

    def rules(self, tree: str) -> _Rules:
        """The rules of a commit whose root tree is ``tree`` (one per .gitattributes)."""
        found = [e for e in self.entries(tree) if e.name == b".gitattributes"]
        if found and found[0].mode not in REGULAR:  # a symlink or directory: git ignores it
            return _Rules("none", None, None)
        oid = found[0].oid if found else None
        if oid not in self._rules:
            text = None
            if oid is not None:
                _, size = self.objects.info(oid)
                if size > ATTRIBUTES_CAP:
                    raise MigrateError(
                        f".gitattributes in commit {self.current[:12]} is over "
                        f"{ATTRIBUTES_CAP:,} bytes; refused"
                    )
                text = self.objects.read(oid)[1].decode(errors="surrogateescape")
            new_text = rewrite_attributes(text, self.patterns, self.to)
            new = oid
            if new_text != text:
                assert new_text is not None
                new = self.objects.write("blob", new_text.encode(errors="surrogateescape"))
            self._rules[oid] = _Rules(f"{oid}>{new}", oid, new)
        return self._rules[oid]

    def lfs_copy(self, ref: ObjectRef) -> str | None:
        """Where a Git LFS object is, at its size: git-lfs's directory, else ours (where a
        download from a ``file://`` remote is copied); None when neither has it."""
        for path in (self.store.lfs_path(ref.oid), self.store.path(ref.oid)):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size == ref.size:
                return path
        return None

    def new_tip(self, oid: str, kind: str) -> str:
        """What a ref holding ``oid`` (a commit, or an annotated tag) moves to."""
        if kind == "commit":
            return self.commit_map.get(oid, oid)
        if kind != "tag":
            return oid  # a tag of a tree or blob: nothing of ours in it
        _, raw = self.objects.read(oid)
        lines = git_objects.split_header(raw)[0]
        target, target_kind = (
            git_objects.header(lines, b"object")[0],
            git_objects.header(lines, b"type")[0],
        )
        new = self.new_tip(target, target_kind)
        return oid if new == target else self.objects.write("tag", git_objects.new_tag(raw, new))

    def side(self, parent: str) -> _Side:
        if parent in self._done:
            orig, new, key = self._done[parent]
            return _Side(orig, new, key)
        _, raw = self.objects.read(parent)
        tree = git_objects.header(git_objects.split_header(raw)[0], b"tree")[0]
        return _Side(tree, tree, None)  # outside the rewrite (on a remote): left as it is

    def rewrite_commit(self, oid: str, parents: list[str]) -> str:
        """Rewrite one commit (its parents done already); return its new id."""
        self.current = oid
        _, raw = self.objects.read(oid)
        tree = git_objects.header(git_objects.split_header(raw)[0], b"tree")[0]
        rules = self.rules(tree)
        new_tree = self.tree(tree, b"", rules, [self.side(p) for p in parents])
        new_parents = [self.commit_map.get(p, p) for p in parents]
        self._done[oid] = (tree, new_tree, rules.key)
        if new_tree == tree and new_parents == parents:
            new = oid  # nothing to change: the same commit, signature and all
        else:
            new = self.objects.write("commit", git_objects.new_commit(raw, new_tree, new_parents))
        self.commit_map[oid] = new
        return new

    def tree(self, tree: str, prefix: bytes, rules: _Rules, sides: list[_Side]) -> str:
        """Return the rewritten ``tree`` (at ``prefix``): a parent's result when it had
        this very tree under the same rules, else entry by entry."""
        for side in sides:
            if side.key == rules.key and side.orig == tree and side.new is not None:
                return side.new
        memo = (tree, prefix, rules.key, tuple(sides))
        if memo in self._tree_memo:
            return self._tree_memo[memo]
        maps = [(self.entry_map(s.orig), self.entry_map(s.new), s.key) for s in sides]
        out: list[Entry] = []
        has_attributes = False
        for entry in self.entries(tree):
            path = prefix + entry.name
            new = entry.oid
            if entry.mode == TREE:
                below = [
                    _Side(_subtree(old.get(entry.name)), _subtree(now.get(entry.name)), key)
                    for old, now, key in maps
                ]
                new = self.tree(entry.oid, path + b"/", rules, below)
            elif not prefix and entry.name == b".gitattributes":
                has_attributes = True
                if rules.attributes is not None:
                    new = rules.attributes
            elif entry.mode in REGULAR and self.selected(rules, path):
                at_parents = [
                    _AtParent(old.get(entry.name), now.get(entry.name), key is not None)
                    for old, now, key in maps
                ]
                new = self.convert(entry.oid, path, at_parents)
            out.append(entry._replace(oid=new))
        if not prefix and not has_attributes and rules.attributes is not None:
            out = git_objects.insert_sorted(
                out, Entry(b"100644", b".gitattributes", rules.attributes)
            )
        changed = len(out) != len(self.entries(tree)) or any(
            a.oid != b.oid for a, b in zip(out, self.entries(tree), strict=True)
        )
        result = self.objects.write("tree", git_objects.tree_bytes(out)) if changed else tree
        if len(self._tree_memo) > 200_000:
            self._tree_memo.clear()
        self._tree_memo[memo] = result
        return result


def _subtree(entry: Entry | None) -> str | None:
    return entry.oid if entry is not None and entry.mode == TREE else None


class _Importer(_Rewriter):
    """LFS pointers and raw checkpoint blobs -> manifests."""

    to = "theta"

    def __init__(self, patterns: list[str], scratch: str):
        super().__init__(patterns, scratch)
        self._converted: dict[tuple[str, bytes, str | None], str] = {}
        self._manifests: set[str] = set()  # blobs known to be manifests (our results)
        self._parsed: dict[str, Manifest] = {}
        self._sources: dict[str, int] = {}  # converted blob -> bytes it stood for

    def selected(self, rules: _Rules, path: bytes) -> bool:
        return self.filter_of(rules.new, path) == "theta"

    def convert(self, oid: str, path: bytes, parents: list[_AtParent]) -> str:
        # The previous version: from a parent that had this very blob first (its result
        # is then reused as is), else from the first parent that has the path.
        ordered = sorted(parents, key=lambda p: not (p.old is not None and p.old.oid == oid))
        previous = None
        for old, new, rewritten in ordered:
            if not rewritten:  # a parent left as it was: its version, converted
                if old is not None and old.mode in REGULAR:
                    with contextlib.suppress(ThetaError):
                        previous = self.blob(old.oid, path, None)
            elif new is not None and new.oid in self._manifests:
                previous = new.oid
            if previous is not None:
                break
        return self.blob(oid, path, previous)

    def manifest(self, oid: str) -> Manifest:
        if oid not in self._parsed:
            if len(self._parsed) > 256:
                self._parsed.clear()
            self._parsed[oid] = parse(self.objects.read(oid)[1])
        return self._parsed[oid]

    def blob(self, oid: str, path: bytes, previous: str | None) -> str:
        """Return the manifest blob for blob ``oid`` at ``path``, stored as a change on
        the manifest blob ``previous``."""
        key = (oid, path, previous)
        if key in self._converted:
            return self._converted[key]
        _, size = self.objects.info(oid)
        pointer = None
        if size <= lfs_pointer.MAX_POINTER:
            data = self.objects.read(oid)[1]
            if is_manifest(data):
                self._manifests.add(oid)
                return oid
            pointer = lfs_pointer.parse(data)
        sink = _Collect()
        name = os.fsdecode(path)
        try:
            prev = self.manifest(previous) if previous is not None else None
            if pointer is not None:
                with self.lfs_object(pointer) as source:
                    clean(source, sink, name, self.repo.store, prev, show_progress=False)
                    source.check()
            else:
                with self.objects.stream(oid) as stream:
                    clean(stream, sink, name, self.repo.store, prev, show_progress=False)
        except ThetaError as exc:
            raise self.fail(path, exc) from None
        new = self.objects.write("blob", bytes(sink.data))
        self._manifests.add(new)
        if new != oid:
            self._sources[oid] = pointer.size if pointer is not None else size
        self._converted[key] = new
        self._converted[(oid, path, new)] = new  # cleaned again on top of itself: the same
        return new

    @contextlib.contextmanager
    def lfs_object(self, ref: ObjectRef) -> Iterator[_Verified]:
        """Yield the Git LFS object ``ref`` as a checked stream, downloaded if need be."""
        path = self.lfs_copy(ref)
        if path is None:
            self.repo.downloader.fetch([ref])
            path = self.lfs_copy(ref)
        try:
            if path is None:
                raise FileNotFoundError
            fh = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise MigrateError(
                f"Git LFS object {ref.oid} is not local and could not be downloaded: "
                "fetch it (`git lfs fetch --all`) and migrate again"
            ) from None
        with fh:
            yield _Verified(fh, ref)

    def stats(self) -> tuple[int, int, int]:
        refs: dict[str, int] = {}
        for oid in {v for k, v in self._converted.items() if k[0] != v}:
            for _, ref in needed_objects(self.manifest(oid)):
                refs[ref.oid] = ref.size
        return len(self._sources), sum(self._sources.values()), sum(refs.values())


class _Exporter(_Rewriter):
    """Manifests (and raw blobs at git-theta paths) -> Git LFS pointers."""

    to = "lfs"

    def __init__(self, patterns: list[str], scratch: str):
        super().__init__(patterns, scratch)
        self._converted: dict[str, str] = {}
        self._before: dict[str, int] = {}  # content objects the exported manifests need
        self._after: dict[str, int] = {}  # the Git LFS objects made
        self._versions = 0

    def selected(self, rules: _Rules, path: bytes) -> bool:
        return (
            self.filter_of(rules.new, path) == "lfs" and self.filter_of(rules.old, path) == "theta"
        )

    def convert(self, oid: str, path: bytes, parents: list[_AtParent]) -> str:
        if oid not in self._converted:
            try:
                self._converted[oid] = self.blob(oid, path)
            except ThetaError as exc:
                raise self.fail(path, exc) from None
        return self._converted[oid]

    def blob(self, oid: str, path: bytes) -> str:
        with self.objects.stream(oid) as stream:
            head = stream.read(lfs_pointer.MAX_POINTER + 1)
            if lfs_pointer.parse(head) is not None:
                return oid  # an older LFS version: stays as it is
            if is_manifest(head):
                manifest = parse(head + stream.read(MAX_MANIFEST))
                for _, ref in needed_objects(manifest):
                    self._before[ref.oid] = ref.size
                self._versions += 1
                ref = self.put_lfs(
                    lambda sink: write_checkpoint(
                        manifest, sink, os.fsdecode(path), self.repo.store, False,
                        self.repo.downloader.fetch,
                    )
                )  # fmt: skip
            else:  # committed raw where git-theta was to clean it: stored as it is

                def copy(sink: Sink) -> None:
                    sink.write(head)
                    while chunk := stream.read(1 << 20):
                        sink.write(chunk)

                ref = self.put_lfs(copy)
                self._versions += 1
        self._after[ref.oid] = ref.size
        return self.objects.write("blob", POINTER.format(oid=ref.oid, size=ref.size).encode())

    def put_lfs(self, fill: Callable[[Sink], None]) -> ObjectRef:
        """Store what ``fill`` writes as a Git LFS object in git-lfs's own directory
        (a temporary, renamed once complete); return its reference."""
        with TempFile(self.store.tmp_dir(), TMP_PREFIX) as tmp:
            sink = _HashingSink(tmp.file)
            fill(sink)
            ref = ObjectRef(sink.digest.hexdigest(), sink.size)
            final = self.store.lfs_path(ref.oid)
            if self.lfs_copy(ref) != final:  # else the temporary is removed on leaving
                os.makedirs(os.path.dirname(final), exist_ok=True)
                tmp.commit(final)
        return ref

    def stats(self) -> tuple[int, int, int]:
        return self._versions, sum(self._before.values()), sum(self._after.values())


# ---------------------------------------------------------------------------------------
# refs, the work tree, and the whole


def _refs(names: list[str], everything: bool) -> list[tuple[str, str, str]]:
    """Return (refname, object id, object type) of each ref to migrate: the current
    branch, the named branches and tags, or every local branch and tag.

    Raises MigrateError for a name that is no local branch or tag, a detached HEAD, or a
    branch without commits.
    """
    out = git.git("for-each-ref", "--format=%(objectname) %(objecttype) %(refname)",
              "refs/heads/", "refs/tags/")  # fmt: skip
    local: dict[str, tuple[str, str]] = {}
    for line in os.fsdecode(out).splitlines():
        oid, kind, name = line.split(" ", 2)
        local[name] = (oid, kind)
    if everything:
        wanted = list(local)
    elif names:
        wanted = []
        for name in names:
            full = name if name in local else ""
            if not full:
                done = run("git", "rev-parse", "--symbolic-full-name", name, check=False)
                full = os.fsdecode(done.stdout).strip()
            if full not in local:
                from git_theta.revisions import require

                require([name])  # names nothing at all: the same error as every command
                raise MigrateError(
                    f"{name} is not a local branch or tag: migrate rewrites branches and "
                    "tags; give one (`git branch`, `git tag`) or --everything"
                )
            wanted.append(full)
    else:
        done = run("git", "symbolic-ref", "-q", "HEAD", check=False)
        head = os.fsdecode(done.stdout).strip()
        if not head:
            raise MigrateError(
                "HEAD is detached: name the branches or tags to migrate, or use --everything"
            )
        if head not in local:
            raise MigrateError(f"{head} has no commits yet: nothing to migrate")
        wanted = [head]
    return [(name, *local[name]) for name in dict.fromkeys(wanted)]


def _branches_in_other_worktrees() -> dict[str, tuple[str, bool]]:
    """Branch -> (path, whether its directory is gone) of every worktree but this one
    that has a branch checked out (``git worktree list``)."""
    done = run("git", "rev-parse", "--show-toplevel", check=False)
    here = os.path.realpath(os.fsdecode(done.stdout.strip())) if done.returncode == 0 else None
    out: dict[str, tuple[str, bool]] = {}
    listing = git.git("worktree", "list", "--porcelain", "-z")
    for record in listing.split(b"\0\0"):
        fields = [os.fsdecode(f) for f in record.split(b"\0") if f]
        path = next((f[9:] for f in fields if f.startswith("worktree ")), "")
        branch = next((f[7:] for f in fields if f.startswith("branch ")), "")
        if branch and path and os.path.realpath(path) != here:
            out[branch] = (path, any(f.split(" ", 1)[0] == "prunable" for f in fields))
    return out


def refuse_branches_checked_out_elsewhere(names: list[str]) -> None:
    """Raise MigrateError when one of the refs ``names`` is the branch of another
    worktree: moving it under that worktree would leave its index and files on the old
    commit, so its status shows the rewrite undone and its next commit makes it so (git
    itself refuses to move such a branch)."""
    elsewhere = _branches_in_other_worktrees()
    for name in names:
        if name not in elsewhere:
            continue
        path, gone = elsewhere[name]
        branch = quote(name.removeprefix("refs/heads/"))
        fix = (
            "its directory is gone: run `git worktree prune`"
            if gone
            else f"detach it there (`git -C {shlex.quote(path)} switch --detach`) or name "
            "the branches to migrate"
        )
        raise MigrateError(
            f"branch {branch} is checked out in the worktree {quote(path)}: {fix}, then "
            "run `git theta migrate` again"
        )


def _commits(tips: list[str], everything: bool) -> list[list[str]]:
    """Each commit to rewrite followed by its parents, parents before children. Unless
    ``everything``, commits a remote has are left out, as `git lfs migrate` does."""
    if not tips:
        return []
    exclude = [] if everything else ["--not", "--remotes"]
    out = git.git("rev-list", "--topo-order", "--reverse", "--parents", *tips, *exclude, "--")
    return [line.split() for line in out.decode().splitlines()]


def require_clean_work_tree() -> None:
    """Raise MigrateError when the work tree or index has changes (untracked files are
    fine: no rewritten commit changes them)."""
    # With our filters: a checkpoint whose file was only touched is not a change.
    done = run("git", "status", "--porcelain", "--untracked-files=no")
    if done.stdout.strip():
        raise MigrateError(
            "the work tree has uncommitted changes: commit or stash them, "
            "then run `git theta migrate` again"
        )


def _refresh_work_tree(top: str) -> None:
    """Point the index at the rewritten HEAD and make `git status` agree with the files
    as they are: their bytes are the same, only how git stores them changed. Files git
    still sees as different (a checkout that skipped smudging) are checked out.

    Raises MigrateError saying how to recover when git fails (the refs have moved).
    """
    from git_theta.errors import CommandError

    try:
        # -m keeps the stat data of unchanged entries, so only converted files are
        # cleaned again; it checks the others are up to date, through the filters the
        # old index was made with (the work tree's .gitattributes is still the old one).
        if run("git", "read-tree", "-m", "HEAD", check=False, cwd=top).returncode != 0:
            git.git("read-tree", "HEAD", cwd=top)
        if run("git", "cat-file", "-e", "HEAD:.gitattributes", check=False).returncode == 0:
            git.git("checkout-index", "-f", "--", ".gitattributes", cwd=top)
        # Our filter (or git-lfs's) cleans each file again; the result is the staged blob.
        run("git", "update-index", "-q", "--refresh", check=False, cwd=top)
        stale = run("git", "diff-files", "--name-only", "-z", cwd=top).stdout
        if stale.strip(b"\0"):
            run("git", "checkout-index", "-f", "-z", "--stdin", stdin=stale, cwd=top)
    except CommandError as exc:
        raise MigrateError(
            f"history was rewritten, but the work tree could not be brought up to date "
            f"({exc}): run `git reset --hard` to check out the rewritten HEAD"
        ) from None


def _update_refs(updates: list[tuple[str, str, str]], mode: str) -> None:
    """Move every ref at once, each only if it still holds what we read."""
    commands = [b"start\0"]
    for name, old, new in updates:
        commands.append(f"update {name}\0{new}\0{old}\0".encode())
    commands.append(b"prepare\0commit\0")
    git.git("update-ref", "-m", MESSAGE.format(mode=mode), "--stdin", "-z",
        stdin=b"".join(commands))  # fmt: skip


class _Progress:
    """ "migrating: N/M commits" on a terminal, for histories that take a while."""

    def __init__(self, total: int):
        from git_theta.progress import enabled

        self.total = total
        self.show = enabled()
        self.start = self.last = time.monotonic()
        self.printed = False

    def step(self, done: int) -> None:
        now = time.monotonic()
        if self.show and now - self.start > 1.0 and now - self.last > 0.2:
            self.last = now
            self.printed = True
            sys.stderr.write(f"\rgit-theta: migrating: {done}/{self.total} commits")
            sys.stderr.flush()

    def close(self) -> None:
        if self.printed:
            sys.stderr.write(f"\rgit-theta: migrating: {self.total}/{self.total} commits\n")


def migrate(mode: str, patterns: list[str], names: list[str], everything: bool) -> Result:
    """Rewrite the history of the chosen refs, ``mode`` 'import' (Git LFS and raw blobs to
    git-theta) or 'export' (git-theta to Git LFS); return what was done.

    Raises MigrateError (nothing changed) for a dirty work tree, a ref that is not local,
    a branch to rewrite that another worktree has checked out, a file that cannot be
    converted or an object that cannot be found; NotSetUpError when
    the filter the result needs is not configured.
    """
    from git_theta.setup_check import require_filter

    if mode == "import":
        require_filter()
    elif not (git.config_get("filter.lfs.process") or git.config_get("filter.lfs.clean")):
        raise MigrateError(
            "git-lfs's filter is not configured, so the exported files would not check out: "
            "run `git lfs install` first"
        )
    bare = git.git("rev-parse", "--is-bare-repository").strip() == b"true"
    if not bare:
        require_clean_work_tree()
    refs = _refs(names, everything)
    commits = _commits(sorted({oid for _, oid, _ in refs}), everything)
    # Before anything is written, so a refusal leaves no trace: a branch whose tip is
    # among the commits to rewrite may move.
    to_rewrite = {oid for oid, *_ in commits}
    refuse_branches_checked_out_elsewhere([name for name, oid, _ in refs if oid in to_rewrite])
    with tempfile.TemporaryDirectory(prefix="theta-migrate-", dir=git.common_dir()) as scratch:
        rewriter = (_Importer if mode == "import" else _Exporter)(patterns, scratch)
        try:
            progress = _Progress(len(commits))
            for done, (oid, *parents) in enumerate(commits, 1):
                rewriter.rewrite_commit(oid, parents)
                progress.step(done)
            progress.close()
            updates = []
            for name, oid, kind in refs:
                new = rewriter.new_tip(oid, kind)
                if new != oid:
                    updates.append((name, oid, new))
            versions, before, after = rewriter.stats()
        finally:
            rewriter.close()
    on_remote = []
    if not everything and not commits and refs:
        on_remote = [name for name, _, _ in refs]
    if updates:
        _update_refs(updates, mode)
        head = os.fsdecode(run("git", "symbolic-ref", "-q", "HEAD", check=False).stdout).strip()
        if not bare and head in {name for name, _, _ in updates}:
            _refresh_work_tree(str(git.toplevel()))
    if mode == "import":  # so that a push sends the new objects
        from git_theta.hooks import install_hooks

        try:
            install_hooks()
        except ThetaError as exc:  # the history is rewritten by now: say it, do not fail
            from git_theta.display import escape

            sys.stderr.write(f"git-theta: warning: {escape(str(exc))}\n")
    rewritten = sum(1 for old, new in rewriter.commit_map.items() if old != new)
    return Result(rewritten, versions, before, after, updates, on_remote)
