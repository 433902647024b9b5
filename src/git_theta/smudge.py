"""Smudge: a manifest -> the checkpoint's exact bytes, rebuilt tensor by tensor.

Every object is checked for presence before the first byte is written, so a missing
object fails the checkout without a partial file; each object's oid and each tensor's
content hash are verified as it is read.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable

from git_theta import chains, lfs_pointer
from git_theta.content import content_hash, content_hash_of
from git_theta.display import quote
from git_theta.errors import ObjectCorruptError, ObjectMissingError, ThetaError, UsageError
from git_theta.manifest import (
    MAX_BYTES,
    PREFIX,
    Manifest,
    glue_size,
    is_manifest,
    parse,
    tensor_nbytes,
)
from git_theta.parallel import ordered_map
from git_theta.progress import Progress
from git_theta.protocol.filter_process import Sink, Source
from git_theta.settings import env_int
from git_theta.store import ObjectRef, ObjectStore, size_lie

Fetch = Callable[[Iterable[ObjectRef]], None]
AHEAD = 32 << 20  # bytes of objects decoded ahead of what git has taken


def needed_objects(manifest: Manifest) -> list[tuple[str, ObjectRef]]:
    """Return (what, object) for every object the manifest needs to be rebuilt."""
    out = [("the file's header", manifest.glue.ref)]
    for name in sorted(manifest.tensors):
        out.extend((f"tensor {quote(name)}", link.ref) for link in manifest.tensors[name].chain)
    return out


def _named(exc: ObjectCorruptError, what: str) -> ObjectCorruptError:
    exc.args = (f"{what}: {exc}",)
    return exc


def ensure_objects(manifest: Manifest, store: ObjectStore, fetch: Fetch | None) -> None:
    """Make sure every object the manifest needs is local, downloading what is missing.

    Raises ObjectMissingError naming the first missing object and what it is for.
    """
    needed = needed_objects(manifest)
    missing = [(what, ref) for what, ref in needed if not store.has(ref)]
    if missing and fetch is not None:
        fetch(ref for _, ref in missing)
        missing = [(what, ref) for what, ref in missing if not store.has(ref)]
    if missing:
        what, ref = missing[0]
        for lied_what, lied in missing:  # present and intact, under another size
            if (found := store.other_size(lied)) is not None:
                raise _named(size_lie(lied, found), lied_what)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = "could not be downloaded from the Git LFS remote" if fetch else "is not local"
        why = _download_failure(fetch)
        raise ObjectMissingError(
            f"object {ref.oid} for {what}{more} is not in the local Git LFS store and {where}"
            + (f": {why}" if why else "")
        )


def _download_failure(fetch: Fetch | None) -> str:
    """Why the download failed, when ``fetch`` is a Downloader's (transfer.py) or a
    Repo's and git-lfs said; "" otherwise."""
    failure = getattr(getattr(fetch, "__self__", None), "failure", None)
    return str(failure()) if callable(failure) else ""


def smudge(
    source: Source,
    sink: Sink,
    path: str,
    store: ObjectStore,
    show_progress: bool | None = None,
    fetch: Fetch | None = None,
) -> None:
    """Read a manifest from ``source`` and write the checkpoint it describes to ``sink``.

    Content that is not a manifest is passed through. Missing objects are downloaded with
    ``fetch`` first. Raises ObjectMissingError or ObjectCorruptError (naming the tensor and
    the object) before or while writing.
    """
    head = _read_up_to(source, len(PREFIX))
    if lfs_pointer.VERSION_LINE.startswith(head):
        # A Git LFS pointer: a version from before git-theta tracked the path. The file it
        # names is what this version holds, not the pointer's text.
        head += _read_up_to(source, lfs_pointer.MAX_POINTER + 1 - len(head))
        ref = lfs_pointer.parse(head)
        if ref is not None:
            lfs_pointer.write_object(ref, store, sink.write, fetch)
            return
    if not is_manifest(head):  # not ours: passed through as it comes, never held whole
        sink.write(head)
        while piece := source.read(_PASS_CHUNK):
            sink.write(piece)
        return
    # One byte more than a manifest may have is enough to know it is too large.
    data = head + _read_up_to(source, MAX_BYTES + 1 - len(head))
    write_checkpoint(parse(data), sink, path, store, show_progress, fetch)


_PASS_CHUNK = 1 << 20
_PIECE = 64 << 10  # a read reserves what it asks for: a manifest is mostly a few kB


def _read_up_to(source: Source, n: int) -> bytes:
    """Return the next ``n`` bytes of ``source``, fewer only where it ends."""
    parts = []
    while n > 0 and (piece := source.read(min(n, _PIECE))):
        parts.append(piece)
        n -= len(piece)
    return b"".join(parts)


def read_glue(manifest: Manifest, store: ObjectStore) -> bytearray:
    """Return the file's glue bytes, decoded and verified.

    The layout's glue lengths say exactly how long the glue is: an object that decodes to
    more fails before it is allocated, one that decodes to less before anything is
    written. Raises ObjectCorruptError (or ObjectMissingError) naming the object.
    """
    from git_theta import codec

    glue_bytes = glue_size(manifest)
    oid = manifest.glue.ref.oid
    try:
        glue = codec.decode(store.get(manifest.glue.ref), limit=glue_bytes)
    except ThetaError as exc:
        message = str(exc) if oid in str(exc) else f"object {oid}: {exc}"
        exc.args = (f"the file's header: {message}",)
        raise
    if len(glue) != glue_bytes:
        raise ObjectCorruptError(
            f"the file's header: object {oid} gives {len(glue):,} bytes; the manifest's "
            f"layout expects {glue_bytes:,}"
        )
    if content_hash(glue) != manifest.glue.hash:
        raise ObjectCorruptError(f"the file's header: object {oid} is corrupt")
    return glue


EXPANSION_ENV = "GIT_THETA_MAX_EXPANSION"
EXPANSION_CONFIG = "theta.maxExpansion"  # the user's git config (never a committed file)
MAX_EXPANSION = 100  # real checkpoints rebuild from 0.3x-1x of their size in objects
EXPANSION_FLOOR = 256 << 20  # this much output per process is never refused


class ExpansionError(ThetaError):
    """Manifests rebuild files out of all proportion to their objects."""


class Expansion:
    """What one reader has rebuilt so far: bytes written, and the distinct objects they
    came from. A filter serves every file of one git command, so the process shares one
    (``PROCESS``); an API checkpoint (a training loop reads many) keeps its own. The lock
    makes a check and its count one step for threads reading at once."""

    def __init__(self) -> None:
        self.written = 0
        self.objects: dict[str, int] = {}
        self.lock = threading.Lock()


PROCESS = Expansion()


def _configured_limit() -> int:
    """``git config theta.maxExpansion``, else 100 (asked only when that would refuse)."""
    from git_theta import git

    raw = (git.config_get(EXPANSION_CONFIG) or "").strip()
    if not raw:
        return MAX_EXPANSION
    if not raw.isdigit() or len(raw) > 18:
        raise UsageError(f"git config {EXPANSION_CONFIG}={raw!r} is not a non-negative integer")
    return int(raw)


def check_expansion(manifest: Manifest, account: Expansion | None = None) -> None:
    """Refuse a manifest when the files this process rebuilt, with this one, would be more
    than 100 times (``GIT_THETA_MAX_EXPANSION`` or ``theta.maxExpansion``; 0: no limit) the
    bytes of the distinct objects they need, past 256 MiB in all.

    git holds a smudge's whole output in memory, so a few KB of objects that decompress
    to zeros, shared by many tensors or many files, made a clone take gigabytes of memory
    and disk: a hostile repository's bomb. Raises ExpansionError, else counts the file
    in ``account`` (the process's, unless given).
    """
    account = PROCESS if account is None else account
    with account.lock:
        _check_expansion(manifest, account)


def _check_expansion(manifest: Manifest, account: Expansion) -> None:
    objects = {**account.objects, **{ref.oid: ref.size for _, ref in needed_objects(manifest)}}
    written = account.written + manifest.size
    stored = max(sum(objects.values()), 1)
    from_env = bool(os.environ.get(EXPANSION_ENV, "").strip())
    limit = env_int(EXPANSION_ENV, MAX_EXPANSION)
    if limit and written > EXPANSION_FLOOR and written > limit * stored:
        if not from_env:
            limit = _configured_limit()  # a git call: only where the default would refuse
        if limit and written > limit * stored:
            raise ExpansionError(
                f"{written:,} bytes would be rebuilt from {stored:,} bytes of objects, more "
                f"than {limit}x: a hostile repository can fill memory and disk this way; if "
                f"you trust it, run `git config {EXPANSION_CONFIG} 0` (or set "
                f"{EXPANSION_ENV}=0) and check out again"
            )
    account.written, account.objects = written, objects


def write_checkpoint(
    manifest: Manifest,
    sink: Sink,
    path: str,
    store: ObjectStore,
    show_progress: bool | None = None,
    fetch: Fetch | None = None,
    account: Expansion | None = None,
) -> None:
    """Write the checkpoint ``manifest`` describes to ``sink`` (see ``smudge``).

    Raises ExpansionError, before fetching or writing anything, when the file would be far
    larger than the objects it is rebuilt from (``check_expansion``, counted in
    ``account``)."""
    check_expansion(manifest, account)
    ensure_objects(manifest, store, fetch)
    from git_theta import codec

    glue = read_glue(manifest, store)
    names = [item for item in manifest.layout if isinstance(item, str)]
    progress = Progress(f"checking out {path}", manifest.size, len(names), show_progress)
    # Load the update types this file needs before the workers start: an import (NumPy's
    # takes 0.12 s) holds the GIL and would stall every worker mid-tensor. Through
    # chains.plugin_for, as the rebuild asks: operand links are no registered type, and
    # asking the registry for one would scan every installed plugin.
    kinds = {link.update: link for e in manifest.tensors.values() for link in e.chain}
    for key in sorted(kinds):
        with contextlib.suppress(ThetaError):  # unknown: the rebuild names the tensor
            chains.plugin_for(kinds[key])

    unrebuilt: set[str] = set()
    from git_theta import merged_values

    left = merged_values.any_left(store)  # by a merge: values it computed or checked

    def rebuild(name: str) -> bytearray | memoryview | None:
        entry = manifest.tensors[name]
        size = tensor_nbytes(entry.dtype, entry.shape) if left else None
        if size:  # hash-checked on use
            kept = merged_values.take(store, entry, size)
            if kept is not None:
                unrebuilt.add(name)  # its chain was not seen to rebuild it
                return kept
        if chains.streamable(entry):
            return None  # written chunk by chunk below, in order
        return chains.rebuild(name, entry, store, limit=manifest.size)

    def weight(name: str) -> int:
        entry = manifest.tensors[name]
        return 0 if chains.streamable(entry) else sum(link.ref.size for link in entry.chain)

    # git, taking the bytes, is the slow end: decoding further ahead only holds more fresh
    # memory (GPT-2 FP32: 128 MB ahead took 45,000 page faults and 261 MB; 32 MB ahead,
    # 32,000 and 138 MB, no slower).
    values = ordered_map(rebuild, names, weight, budget=AHEAD)
    glue_pos = 0
    for item in manifest.layout:
        if isinstance(item, int):
            sink.write(memoryview(glue)[glue_pos : glue_pos + item])
            glue_pos += item
        else:
            value = next(values)
            if value is None:
                for piece in chains.stream(item, manifest.tensors[item], store, manifest.size):
                    sink.write(piece)  # copied or written out: the sink keeps no reference
                    progress.advance(len(piece), 0)
                    codec.recycle(piece)
                progress.advance(0)
            else:
                sink.write(value)
                progress.advance(len(value))
                codec.recycle(value)
    progress.close()
    # Every tensor rebuilt to its hash (each raises otherwise): a later add of these
    # bytes reuses the chains without rebuilding them (verified.py).
    store.verified.add(e for n, e in manifest.tensors.items() if n not in unrebuilt)
    store.verified.flush()


def file_matches(path: str, manifest: Manifest, store: ObjectStore) -> bool:
    """Whether the file at ``path`` holds exactly the checkpoint ``manifest`` describes:
    its size, its glue bytes and each tensor's hash, read once and stored nowhere. False
    too when that cannot be told here (the glue object is not local, a tensor's size is
    only known to its objects)."""
    import os

    from git_theta.files import open_regular
    from git_theta.manifest import tensor_nbytes

    sizes = {n: tensor_nbytes(e.dtype, e.shape) for n, e in manifest.tensors.items()}
    if any(size is None for size in sizes.values()):
        return False
    try:
        glue = memoryview(read_glue(manifest, store))
    except ThetaError:
        return False
    with open_regular(path) as fh:
        if os.fstat(fh.fileno()).st_size != manifest.size:
            return False
        glue_pos = 0
        for item in manifest.layout:
            if isinstance(item, int):
                if fh.read(item) != glue[glue_pos : glue_pos + item]:
                    return False
                glue_pos += item
                continue
            digest = content_hash_of(fh.read, sizes[item] or 0)
            if digest != manifest.tensors[item].hash:
                return False
    return True
