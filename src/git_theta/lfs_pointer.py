"""Git LFS pointer files met where git-theta now tracks the path.

A path that Git LFS tracked before ``git theta track`` took it over still has LFS pointers
in its older commits. Our filter is what git runs for every version of the path, so a
pointer is checked out as the file it points to (its object fetched when missing), never
as the pointer's text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from git_theta.errors import ObjectCorruptError, ObjectMissingError
from git_theta.store import ObjectRef, ObjectStore

VERSION_LINE = b"version https://git-lfs.github.com/spec/v1\n"
MAX_POINTER = 1024  # git-lfs itself never reads a larger blob as a pointer
_CHUNK = 8 << 20

Fetch = Callable[[Iterable[ObjectRef]], None]


def parse(data: bytes) -> ObjectRef | None:
    """Return the object a Git LFS pointer names, or None when ``data`` is not one.

    Only the plain form git-lfs writes is accepted (version, oid sha256, size; extension
    lines are not: their objects are not the file's bytes).
    """
    if len(data) > MAX_POINTER or not data.startswith(VERSION_LINE):
        return None
    lines = data[len(VERSION_LINE) :].split(b"\n")
    if len(lines) != 3 or lines[2] != b"":
        return None
    oid_line, size_line = lines[0], lines[1]
    if not (oid_line.startswith(b"oid sha256:") and size_line.startswith(b"size ")):
        return None
    oid, size = oid_line[11:], size_line[5:]
    if len(oid) != 64 or oid.strip(b"0123456789abcdef") or not size.isdigit() or len(size) > 19:
        return None
    return ObjectRef(oid.decode(), int(size))


def write_object(
    ref: ObjectRef, store: ObjectStore, write: Callable[[bytes], object], fetch: Fetch | None
) -> None:
    """Write the bytes of the LFS object ``ref`` with ``write``, fetching it first when it
    is not local (a download lands in git-lfs's directory, where ``git lfs prune`` frees
    it). The sha256 is checked as the bytes pass and raises ObjectCorruptError at the end
    (git discards a smudge that ends in error).

    Raises ObjectMissingError when the object is neither local nor downloadable.
    """
    fh = store.open_plain(ref)
    if fh is None and fetch is not None:
        fetch([ref])
        fh = store.open_plain(ref)
    if fh is None:
        raise ObjectMissingError(
            f"Git LFS object {ref.oid} (a version of this file from before git-theta "
            "tracked it) is not local and could not be downloaded"
        ) from None
    import hashlib  # here, not at start-up: OpenSSL's set-up is ~3 ms

    digest = hashlib.sha256()
    size = 0
    with fh:
        while size <= ref.size and (chunk := fh.read(_CHUNK)):
            digest.update(chunk)
            size += len(chunk)
            if size > ref.size:
                break  # longer than its pointer says: corrupt, and never read to its end
            write(chunk)
    if size != ref.size or digest.hexdigest() != ref.oid:
        raise ObjectCorruptError(f"Git LFS object {ref.oid} is corrupt (its sha256 does not match)")
