"""Raw git objects for history rewrites: read and written through long-running git
processes, trees, commits and tags as their exact bytes, and git's own answer to which
filter a path gets.

A process per object would cost more than the rewrite of a whole commit, so objects are
read through one ``git cat-file --batch-command`` and written through one
``git hash-object --stdin-paths`` per type; large blobs stream from ``git cat-file blob``.
Trees are rewritten as their raw bytes with ids replaced, so an entry git wrote oddly
long ago comes out as it was; commits and tags keep every header but the ones replaced.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import IO, NamedTuple

from git_theta import git
from git_theta.errors import ThetaError
from git_theta.files import atomic_write
from git_theta.proc import Helper, run, start

TREE = b"40000"
REGULAR = (b"100644", b"100755", b"100664")  # 100664: written by very old gits
_SIGNATURE_HEADERS = (b"gpgsig", b"gpgsig-sha256")
_SIGNATURE_STARTS = (
    b"-----BEGIN PGP SIGNATURE-----",
    b"-----BEGIN PGP MESSAGE-----",
    b"-----BEGIN SSH SIGNATURE-----",
    b"-----BEGIN SIGNED MESSAGE-----",
)


class GitObjectError(ThetaError):
    """git could not read or write an object (its own message says more)."""


class Entry(NamedTuple):
    """One entry of a tree: mode and name as git stores them, the object's id."""

    mode: bytes
    name: bytes
    oid: str


def _pipes(proc: Helper) -> tuple[IO[bytes], IO[bytes]]:
    assert proc.stdin is not None and proc.stdout is not None
    return proc.stdin, proc.stdout


def _stop(proc: Helper) -> None:
    """Close a helper's pipes and wait for it (it sees EOF, or EPIPE if mid-answer)."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    proc.wait()


class Objects:
    """The repository's objects, read and written through long-running git processes
    (see the module's docstring); ``scratch`` is a private directory for their files."""

    def __init__(self, scratch: str):
        self._scratch = os.path.join(scratch, "object")
        self._reader = start("git", *git.NO_FILTER, "cat-file", "--batch-command")
        self._writers: dict[str, Helper] = {}
        self.oid_bytes = (
            32 if git.git("rev-parse", "--show-object-format").strip() == b"sha256" else 20
        )

    def _ask(self, command: str, oid: str) -> list[bytes]:
        inp, out = _pipes(self._reader)
        inp.write(f"{command} {oid}\n".encode())
        inp.flush()
        header = out.readline().split()
        if len(header) != 3:
            raise GitObjectError(f"object {oid} is missing from the repository: run `git fsck`")
        return header

    def info(self, oid: str) -> tuple[str, int]:
        """Return the type and size of ``oid``."""
        header = self._ask("info", oid)
        return header[1].decode(), int(header[2])

    def read(self, oid: str) -> tuple[str, bytes]:
        """Return the type and content of ``oid`` (commits, trees, small blobs only)."""
        header = self._ask("contents", oid)
        _, out = _pipes(self._reader)
        data = out.read(int(header[2]))
        out.read(1)  # the newline after the content
        return header[1].decode(), data

    def write(self, kind: str, data: bytes) -> str:
        """Store ``data`` as an object of ``kind``; return its id."""
        if kind not in self._writers:
            literally = () if kind == "blob" else ("--literally",)  # keep odd old objects
            self._writers[kind] = start(
                "git", *git.NO_FILTER, "hash-object", "-w", "-t", kind, *literally,
                "--no-filters", "--stdin-paths",
            )  # fmt: skip
        atomic_write(self._scratch, data)  # in our private scratch directory, as every write
        inp, out = _pipes(self._writers[kind])
        inp.write(os.fsencode(self._scratch) + b"\n")
        inp.flush()
        oid = out.readline().strip().decode()
        if not oid:
            raise GitObjectError(f"git could not write a {kind} object: see its message above")
        return oid

    @contextlib.contextmanager
    def stream(self, oid: str) -> Iterator[io.BufferedReader]:
        """Yield the content of blob ``oid`` as a stream (checkpoints never sit in memory)."""
        proc = start("git", *git.NO_FILTER, "cat-file", "blob", oid)
        _, out = _pipes(proc)
        assert isinstance(out, io.BufferedReader)
        try:
            yield out
            while out.read(1 << 20):
                pass
        finally:
            _stop(proc)

    def close(self) -> None:
        for proc in [self._reader, *self._writers.values()]:
            _stop(proc)


class AttributeReader:
    """Which filter git gives each path under one root .gitattributes, from git itself:
    ``git check-attr --cached`` over a scratch index that holds only that file."""

    def __init__(self, blob: str, index: str):
        self._env = dict(os.environ, GIT_INDEX_FILE=index)
        run("git", *git.NO_FILTER, "update-index", "--index-info", env=self._env,
            stdin=f"100644 blob {blob}\t.gitattributes\n".encode())  # fmt: skip
        self._proc: Helper | None = None
        self._buffer = bytearray()
        self._memo: dict[bytes, str] = {}

    def filter_of(self, path: bytes) -> str:
        """Return the ``filter`` attribute of ``path`` ('unspecified' when none)."""
        if path not in self._memo:
            if self._proc is None:
                # The user's own attributes file is no part of history: left out.
                self._proc = start(
                    "git", "-c", "core.attributesFile=/dev/null", "check-attr", "--stdin",
                    "-z", "--cached", "filter", env=self._env,
                )  # fmt: skip
            inp, out = _pipes(self._proc)
            assert isinstance(out, io.BufferedReader)
            inp.write(path + b"\0")
            inp.flush()
            while self._buffer.count(b"\0") < 3:
                more = out.read1(1 << 16)
                if not more:
                    raise GitObjectError(
                        "`git check-attr` stopped answering: see its message above"
                    )
                self._buffer += more
            fields = bytes(self._buffer).split(b"\0", 3)
            self._buffer = bytearray(fields[3])
            self._memo[path] = fields[2].decode(errors="replace")
        return self._memo[path]

    def close(self) -> None:
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None


def parse_tree(raw: bytes, oid_bytes: int) -> list[Entry]:
    """Return the entries of a raw tree object, in its order (ids ``oid_bytes`` long)."""
    entries = []
    pos = 0
    while pos < len(raw):
        space = raw.index(b" ", pos)
        nul = raw.index(b"\0", space)
        end = nul + 1 + oid_bytes
        entries.append(Entry(raw[pos:space], raw[space + 1 : nul], raw[nul + 1 : end].hex()))
        pos = end
    return entries


def tree_bytes(entries: list[Entry]) -> bytes:
    """Return the raw tree object holding ``entries`` (in the order given)."""
    return b"".join(e.mode + b" " + e.name + b"\0" + bytes.fromhex(e.oid) for e in entries)


def insert_sorted(entries: list[Entry], entry: Entry) -> list[Entry]:
    """Insert a blob entry where git's tree order puts it (a tree sorts as NAME/)."""

    def key(e: Entry) -> bytes:
        return e.name + (b"/" if e.mode == TREE else b"")

    at = next((i for i, e in enumerate(entries) if key(e) > entry.name), len(entries))
    return [*entries[:at], entry, *entries[at:]]


def split_header(raw: bytes) -> tuple[list[bytes], bytes]:
    """Split a commit or tag into header lines (continuations joined to their header)
    and the rest (the blank line and message, exactly as they were)."""
    end = raw.find(b"\n\n")
    head, rest = (raw, b"") if end < 0 else (raw[:end], raw[end:])
    lines: list[bytes] = []
    for line in head.split(b"\n"):
        if line.startswith(b" ") and lines:
            lines[-1] += b"\n" + line
        else:
            lines.append(line)
    return lines, rest


def header(lines: list[bytes], name: bytes) -> list[str]:
    """Return the values of every ``name`` header among ``lines``."""
    return [ln[len(name) + 1 :].decode() for ln in lines if ln.startswith(name + b" ")]


def _unsigned(lines: list[bytes]) -> list[bytes]:
    return [ln for ln in lines if ln.split(b" ", 1)[0] not in _SIGNATURE_HEADERS]


def new_commit(raw: bytes, tree: str, parents: list[str]) -> bytes:
    """Return commit ``raw`` with its tree and parents replaced and its signature dropped;
    every other header, the encoding and the message exactly as they were."""
    lines, rest = split_header(raw)
    out: list[bytes] = []
    for line in _unsigned(lines):
        field = line.split(b" ", 1)[0]
        if field == b"tree":
            out.append(b"tree " + tree.encode())
        elif field == b"parent":
            if not any(ln.startswith(b"parent ") for ln in out):
                out.extend(b"parent " + p.encode() for p in parents)
        else:
            out.append(line)
    return b"\n".join(out) + rest


def new_tag(raw: bytes, target: str) -> bytes:
    """Return tag ``raw`` pointing at ``target``, its signature dropped."""
    lines, rest = split_header(raw)
    out = [b"object " + target.encode() if ln.startswith(b"object ") else ln for ln in lines]
    for start_line in _SIGNATURE_STARTS:  # a signature is the message's last lines
        at = rest.rfind(b"\n" + start_line)
        if at >= 0:
            rest = rest[: at + 1]
    return b"\n".join(_unsigned(out)) + rest
