"""Tensor identity across the files of a checkpoint set.

A checkpoint set is more than one file: ``save_pretrained`` shards (and re-shards from one
save to the next), a model saved as ``.bin`` beside ``.safetensors``, shards renamed. When
clean meets a tensor that its own path's staged manifest does not explain, it asks here:

- ``same_content``: an entry of any known manifest with these exact bytes (hash and
  dtype), so the tensor costs a hash, not an encode, wherever it moved;
- ``previous``: the value this tensor name had elsewhere (same dtype and shape), so a
  tensor that moved and changed is stored as a change against it.

Known manifests, in order of preference: those this process wrote (one ``git add`` of
several files), then the index's, then HEAD's; within each, the cleaned file's own
directory first (two models in two directories may both have ``lm_head.weight``). A
previous value from an unrelated model only costs size: the update is encoded against
bytes rebuilt and verified by hash, and applies exactly. An entry whose content is
reused is rebuilt and checked against its hash once per process, unless this process
wrote it or this machine's record (verified.py, through clean's ``verify``) says it
rebuilds: a committed manifest may lie about what its objects hold.

Loading happens at most once per process and only when needed (``Known`` is lazy); its
inputs are capped (``history.identity_blobs``), and a manifest that does not parse is
ignored. Parsing every manifest of a repository of many checkpoints costs far more than
reading them (0.6 s for 200 manifests of 200 tensors), so blobs read unparsed go through
a prefilter first (``_Unparsed``): their raw text is searched for the hash or name looked
up, and only a blob that contains it is parsed, checked and indexed like any other. The
prefilter can only miss (a name or hash written in a JSON spelling other than the one
``Manifest.to_bytes`` writes: costs storage, never correctness); what it finds is used
only once parsed.
"""

from __future__ import annotations

import json
import posixpath
import re
import threading
from collections.abc import Callable, Iterable

from git_theta.manifest import Link, Manifest, TensorEntry, tensor_nbytes
from git_theta.records import NamedTuple

# Sources, in order of preference (lower first).
WRITTEN, INDEX, HEAD = 0, 1, 2
# Candidates ``same_content`` returns unless told otherwise (clean tries as many).
SAME_CONTENT_MAX = 4


class Candidate(NamedTuple):
    """A known tensor entry and where it came from."""

    rank: tuple[int, int, str]  # (other directory?, source, path): lower is preferred
    path: str
    name: str
    entry: TensorEntry
    trusted: bool  # written by this process: its chain needs no check


def _rank(path: str, source: int, near: str) -> tuple[int, int, str]:
    return (0 if posixpath.dirname(path) == near else 1, source, path)


class Blob(NamedTuple):
    """A manifest blob as read from git, not yet parsed."""

    source: int
    path: str
    oid: str
    data: bytes


# What ``Manifest.to_bytes`` writes: ``"hash": "<hex>"`` in every entry (and the glue's),
# and each tensor on its own line, its JSON name first. The name pattern takes only names
# without escapes (others are searched for in the text) and requires the entry's hash, so
# a hostile blob cannot make the index hold more than one key per ~100 bytes of it.
# Compiled on first use (re's cache), ~0.1 ms each: most cleans find every tensor under
# its name in the staged manifest and never scan.
_HASH_TEXT = rb'"hash": "([0-9a-f]{64})"'
_NAME_TEXT = (
    rb'\n  "([^"\\\n]*)": \{"dtype": "[^"\n]*", "shape": \[[0-9, ]*\], "hash": "[0-9a-f]{64}"'
)
# Any name, escapes (non-ASCII, quotes) included: three times slower to match, so used
# only once a clean has looked up several escaped names (a model named in another
# script); before that, each is searched for in the text.
_ANY_NAME_TEXT = (
    rb'\n  "((?:[^"\\\n]|\\[^\n])*)": \{"dtype": "[^"\n]*", "shape": \[[0-9, ]*\], '
    rb'"hash": "[0-9a-f]{64}"'
)
_SEARCHES_BEFORE_INDEX = 16


class _Unparsed:
    """Manifest blobs read but not parsed, and where their hashes and names occur."""

    def __init__(self, blobs: Iterable[Blob]):
        self.listed: dict[str, list[tuple[int, str]]] = {}  # oid -> (source, path)
        self.data: dict[str, bytes] = {}
        for blob in blobs:
            self.listed.setdefault(blob.oid, []).append((blob.source, blob.path))
            self.data.setdefault(blob.oid, blob.data)
        self._hashes: dict[bytes, list[str]] | None = None
        self._names: dict[bytes, list[str]] | None = None
        self._escaped: dict[bytes, list[str]] | None = None
        self._searches = 0

    @staticmethod
    def _scan(data: dict[str, bytes], pattern: bytes) -> dict[bytes, list[str]]:
        found: dict[bytes, list[str]] = {}
        compiled = re.compile(pattern)
        for oid, text in data.items():
            for key in compiled.findall(text):
                oids = found.setdefault(key, [])
                if not oids or oids[-1] != oid:  # once per blob, however often it says it
                    oids.append(oid)
        return found

    def with_hash(self, digest: str) -> list[str]:
        """Return the unparsed blobs whose text holds ``"hash": "<digest>"``."""
        if self._hashes is None:  # one pass over all the text, on the first look-up
            self._hashes = self._scan(self.data, _HASH_TEXT)
        return self._alive(self._hashes.get(digest.encode(), ()))

    def with_name(self, name: str) -> list[str]:
        """Return the unparsed blobs with a tensor line for ``name``, as to_bytes writes it."""
        spelled = json.dumps(name)
        key = spelled[1:-1].encode()
        if "\\" in spelled:  # escaped: searched for in the text, indexed once common
            if self._escaped is None and self._searches < _SEARCHES_BEFORE_INDEX:
                self._searches += 1
                line = b"\n  " + spelled.encode() + b": {"
                return [oid for oid, text in self.data.items() if line in text]
            if self._escaped is None:
                self._escaped = self._scan(self.data, _ANY_NAME_TEXT)
            return self._alive(self._escaped.get(key, ()))
        if self._names is None:
            self._names = self._scan(self.data, _NAME_TEXT)
        return self._alive(self._names.get(key, ()))

    def _alive(self, oids: Iterable[str]) -> list[str]:
        return [oid for oid in dict.fromkeys(oids) if oid in self.data]

    def take(self, oid: str) -> tuple[bytes, list[tuple[int, str]]]:
        """Remove blob ``oid``: its text and where it is listed (it is parsed now)."""
        return self.data.pop(oid), self.listed.pop(oid)


class Known:
    """The tensors of the manifests a clean may reuse, loaded on first use."""

    def __init__(
        self,
        load: Callable[[str], Iterable[tuple[int, str, Manifest]]] | None = None,
        *,
        blobs: Callable[[str], Iterable[Blob]] | None = None,
        parse: Callable[[str, bytes], Manifest | None] | None = None,
    ):
        """``load(directory)``: (source, path, manifest) of the index and HEAD, those in
        ``directory`` (of the first path that needs them) first when they are capped; or
        ``blobs(directory)``, the same unparsed, with ``parse(oid, data)`` (None: invalid),
        called only for a blob that holds a hash or name looked up."""
        self._load = load
        self._blobs = blobs
        self._parse = parse
        self._unparsed: _Unparsed | None = None
        self._lock = threading.Lock()
        self._loaded = False
        # (path, source) -> manifest; this process's writes replace the index's view.
        self._manifests: dict[tuple[str, int], Manifest] = {}
        # (hash, dtype, byte size or None) -> (source, path) -> its names, sorted: a
        # look-up takes the few it needs from each file, in order, whatever a manifest
        # claims (60,000 entries of one common hash cost their indexing once, not each
        # look-up of that hash). Files are bounded by identity's caps; names are not.
        self._by_hash: dict[tuple[str, str, int | None], dict[tuple[int, str], list[str]]] = {}
        self._by_name: dict[str, list[tuple[int, str]]] = {}
        self._verified: set[tuple[str, tuple[Link, ...]]] = set()
        self._refused: set[tuple[str, tuple[Link, ...]]] = set()  # checked and wrong

    def _ensure(self, path: str) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            near = posixpath.dirname(path)
            if self._load is not None:
                for source, other, manifest in self._load(near):
                    self._index(source, other, manifest)
            if self._blobs is not None:
                self._unparsed = _Unparsed(self._blobs(near))

    def _admit(self, oids: list[str]) -> None:
        """Parse the unparsed blobs ``oids`` (a prefilter hit) and index the valid ones
        under every path they are listed at. Called with the lock held."""
        assert self._unparsed is not None and self._parse is not None
        for oid in oids:
            data, listed = self._unparsed.take(oid)
            manifest = self._parse(oid, data)
            if manifest is not None:
                for source, path in listed:
                    self._index(source, path, manifest)

    def _index(self, source: int, path: str, manifest: Manifest) -> None:
        key = (path, source)
        if key in self._manifests:
            return
        self._manifests[key] = manifest
        names: dict[tuple[str, str, int | None], list[str]] = {}
        for name, entry in manifest.tensors.items():
            content = (entry.hash, entry.dtype, tensor_nbytes(entry.dtype, entry.shape))
            names.setdefault(content, []).append(name)
            self._by_name.setdefault(name, []).append((source, path))
        for content, listed in names.items():
            listed.sort()
            self._by_hash.setdefault(content, {})[(source, path)] = listed

    def _unindex(self, source: int, path: str) -> None:
        """Forget the manifest of ``path`` from ``source`` (rewritten by this process)."""
        manifest = self._manifests.pop((path, source), None)
        if manifest is None:
            return
        for entry in manifest.tensors.values():
            content = (entry.hash, entry.dtype, tensor_nbytes(entry.dtype, entry.shape))
            files = self._by_hash.get(content)
            if files is not None:
                files.pop((source, path), None)

    def written(self, path: str, manifest: Manifest) -> None:
        """Record a manifest this process wrote for ``path`` (its chains are trusted)."""
        with self._lock:
            self._unindex(WRITTEN, path)
            self._index(WRITTEN, path, manifest)

    @property
    def loaded(self) -> bool:
        """Whether the index and HEAD have been read (else only this process's writes)."""
        return self._loaded

    def _candidates(
        self, found: Iterable[tuple[int, str, str]], near: str, skip: str
    ) -> list[Candidate]:
        out = []
        for source, path, name in found:
            if path == skip and source != WRITTEN:
                continue  # the path's own staged manifest: the caller looked there first
            manifest = self._manifests.get((path, source))
            entry = manifest.tensors.get(name) if manifest is not None else None
            if entry is not None:
                out.append(Candidate(_rank(path, source, near), path, name, entry,
                                     source == WRITTEN))  # fmt: skip
        out.sort(key=lambda c: (c.rank, c.name))
        return out

    def same_content(
        self,
        digest: str,
        dtype: str,
        nbytes: int,
        path: str,
        load: bool = True,
        limit: int = SAME_CONTENT_MAX,
    ) -> list[Candidate]:
        """Return the (at most ``limit``) known entries holding exactly these ``nbytes``
        bytes (blake3 ``digest``, ``dtype``), preferred first; the index and HEAD are read
        first if ``load``. An entry whose shape says another size cannot hold them: a
        committed manifest may claim a common hash (a zero bias) with a huge shape, and
        rebuilding that to check it would cost what the shape says. The work is bounded
        by ``limit`` per file holding the hash, not by how many entries claim it."""
        if load:
            self._ensure(path)
        near = posixpath.dirname(path)
        with self._lock:
            if self._unparsed is not None:  # read by an earlier look-up even if not now
                self._admit(self._unparsed.with_hash(digest))
            files: dict[tuple[int, str], list[list[str]]] = {}
            for size in (nbytes, None):  # an opaque dtype's size only its object knows
                for where, names in self._by_hash.get((digest, dtype, size), {}).items():
                    files.setdefault(where, []).append(names)
            out: list[Candidate] = []
            for (source, other), lists in sorted(
                files.items(), key=lambda item: _rank(item[0][1], item[0][0], near)
            ):
                if len(out) >= limit:
                    break
                if other == path and source != WRITTEN:
                    continue  # the path's own staged manifest: the caller looked there first
                manifest = self._manifests.get((other, source))
                if manifest is None:
                    continue
                picked: list[Candidate] = []
                for names in lists:
                    for name in names[:limit]:
                        entry = manifest.tensors.get(name)
                        if entry is not None and (entry.hash, entry.dtype) == (digest, dtype):
                            picked.append(Candidate(_rank(other, source, near), other, name,
                                                    entry, source == WRITTEN))  # fmt: skip
                picked.sort(key=lambda c: c.name)
                out.extend(picked)
        return out[:limit]

    def previous(
        self, name: str, dtype: str, shape: tuple[int, ...], path: str
    ) -> TensorEntry | None:
        """Return the entry tensor ``name`` had in another known file (same dtype and
        byte size: a format may record a flat storage where another has the shape), the
        preferred one; None when no file has it."""
        nbytes = tensor_nbytes(dtype, shape)
        self._ensure(path)
        with self._lock:
            if self._unparsed is not None:
                self._admit(self._unparsed.with_name(name))
            found = [(source, p, name) for source, p in dict.fromkeys(self._by_name.get(name, ()))]
            for cand in self._candidates(found, posixpath.dirname(path), path):
                if cand.entry.dtype == dtype and (
                    cand.entry.shape == shape
                    or (nbytes is not None and tensor_nbytes(dtype, cand.entry.shape) == nbytes)
                ):
                    return cand.entry
        return None

    def checked(self, cand: Candidate, verify: Callable[[Candidate], bool]) -> bool:
        """Whether ``cand``'s chain may be reused: trusted, checked before in this
        process, or ``verify()`` (rebuilds it and compares its hash) says so now; an
        answer is remembered for the process either way."""
        if cand.trusted:
            return True
        key = (cand.entry.hash, cand.entry.chain)
        with self._lock:
            if key in self._verified or key in self._refused:
                return key in self._verified
        ok = verify(cand)
        with self._lock:
            # A lying entry is rebuilt once per process, not once per tensor it matches.
            (self._verified if ok else self._refused).add(key)
        return ok
