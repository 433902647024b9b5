"""Content objects kept where git-lfs keeps its objects, so any LFS remote can carry them.

An object is named by the sha256 of its bytes (a Git LFS oid). Writes go to a temporary
file (``theta-PID-RANDOM``, made by ``files.TempFile``) in the LFS tmp directory and are
renamed into place; reads verify the oid. Temporaries a killed process left are removed
by the first write of a later process and by ``git theta prune``.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import stat
from collections.abc import Iterable
from typing import BinaryIO, NamedTuple

from git_theta.errors import ObjectCorruptError, ObjectMissingError
from git_theta.files import TempFile, UnsafeFileError, open_regular, remove_stale

# What ``read``/``get`` return: bytes, or a read-only mapping of the object's file. Both
# slice to bytes and give memoryviews.
ObjectBytes = bytes | mmap.mmap

_COPY_CHUNK = 8 << 20
TMP_PREFIX = "theta-"
_swept: set[str] = set()  # tmp directories this process has swept


def remove_stale_temporaries(directory: str, dry_run: bool = False) -> tuple[int, int]:
    """Remove the stale ``theta-PID-...`` temporaries (files.remove_stale) in the store's
    tmp ``directory``; return how many and their bytes. git-lfs's own are not touched."""
    try:
        return remove_stale(directory, lambda name: name.startswith(TMP_PREFIX), dry_run)
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0


class ObjectRef(NamedTuple):
    """A stored object: its oid (sha256 hex) and byte size."""

    oid: str
    size: int


class ObjectStore:
    """The git-lfs object directory of one repository."""

    # Paths are strings, not pathlib: every filter process builds a store, and pathlib's
    # import (4 ms, with urllib) was a tenth of a small file's add.
    def __init__(self, lfs_dir: str | os.PathLike[str]):
        self.root = os.path.join(lfs_dir, "objects")
        self.tmp = os.path.join(lfs_dir, "tmp")

    def tmp_dir(self) -> str:
        """The directory for temporary files. The first call in a process creates it,
        checks it and removes stale temporaries. Raises UnsafeFileError when it is a
        symlink or not a directory: git-theta never makes it one, so someone else did."""
        if self.tmp not in _swept:
            os.makedirs(self.tmp, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(self.tmp).st_mode):
                raise UnsafeFileError(
                    f"{self.tmp} is not a directory (a symbolic link?); git-theta keeps its "
                    "temporary files only in a real directory: remove it and retry"
                )
            _swept.add(self.tmp)
            with contextlib.suppress(OSError):  # a sweep that fails must not fail a write
                remove_stale_temporaries(self.tmp)
        return self.tmp

    def _temp_file(self) -> TempFile:
        """A new temporary in tmp_dir(), named with our pid so a sweep can tell it is ours
        (TempFile opens the directory without following a symlink, on every call)."""
        try:
            return TempFile(self.tmp_dir(), TMP_PREFIX)
        except FileNotFoundError:  # removed while we ran (a prune of git-lfs's?): again
            _swept.discard(self.tmp)
            return TempFile(self.tmp_dir(), TMP_PREFIX)

    def path(self, oid: str) -> str:
        """Return where the object ``oid`` lives (git-lfs's ``aa/bb/oid`` layout)."""
        return os.path.join(self.root, oid[0:2], oid[2:4], oid)

    def has(self, ref: ObjectRef) -> bool:
        """Return True when the object is present with the expected size."""
        try:
            return os.stat(self.path(ref.oid)).st_size == ref.size
        except FileNotFoundError:
            return False

    def _is_stored(self, final: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(final).st_mode)
        except FileNotFoundError:
            return False

    def put(self, parts: Iterable[bytes]) -> ObjectRef:
        """Store the concatenation of ``parts`` (unless present) and return its reference.

        Parts are written as they come, so the object is never joined in memory.
        """
        digest = hashlib.sha256()
        size = 0
        with self._temp_file() as tmp:
            for part in parts:
                digest.update(part)
                tmp.file.write(part)
                size += len(part)
            ref = ObjectRef(digest.hexdigest(), size)
            final = self.path(ref.oid)
            if self._is_stored(final):  # the temporary is removed on leaving the block
                with contextlib.suppress(OSError):  # in use again: out of prune's grace window
                    os.utime(final)
            else:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                tmp.commit(final)
        return ref

    def copy_in(self, source: str | os.PathLike[str], ref: ObjectRef) -> bool:
        """Copy the object ``ref`` from ``source`` (another repository's store) if its bytes
        hash to ``ref``; return whether it is now here. A corrupt or absent source, or one
        that is not a regular file, copies nothing."""
        digest = hashlib.sha256()
        size = 0
        try:
            with open_regular(source) as src, self._temp_file() as tmp:
                # Never more than one byte past the size: a longer file is wrong already.
                while size <= ref.size and (chunk := src.read(_COPY_CHUNK)):
                    digest.update(chunk)
                    tmp.file.write(chunk)
                    size += len(chunk)
                if size != ref.size or digest.hexdigest() != ref.oid:
                    return False
                final = self.path(ref.oid)
                os.makedirs(os.path.dirname(final), exist_ok=True)
                tmp.commit(final)
        except OSError:
            return False
        return True

    def open(self, ref: ObjectRef) -> BinaryIO:
        """Open the object for reading (unverified). Raises ObjectMissingError."""
        try:
            return open(self.path(ref.oid), "rb")
        except FileNotFoundError:
            raise ObjectMissingError(f"object {ref.oid} is not in the local store") from None

    def read(self, ref: ObjectRef) -> ObjectBytes:
        """Return the object's bytes, unverified (pair with ``verify``): the file mapped
        read-only, not copied. A checkout reads every object of a version once, and a copy
        is as much fresh memory again (a page fault per 4 KiB); mapped, the bytes are the
        page cache's. Objects are never changed in place (a new one is renamed in), so
        the mapping stays valid while it is used.

        Raises ObjectMissingError when it is absent.
        """
        try:
            with open(self.path(ref.oid), "rb") as fh:
                if os.fstat(fh.fileno()).st_size == 0:
                    return b""  # an empty file cannot be mapped
                try:
                    return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except OSError:  # a file system that cannot map files: read it
                    return fh.read()
        except FileNotFoundError:
            raise ObjectMissingError(f"object {ref.oid} is not in the local store") from None

    @staticmethod
    def verify(ref: ObjectRef, data: ObjectBytes) -> None:
        """Raise ObjectCorruptError unless ``data`` has the oid and size of ``ref``."""
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.oid:
            raise ObjectCorruptError(f"object {ref.oid} is corrupt (its sha256 does not match)")

    def get(self, ref: ObjectRef) -> ObjectBytes:
        """Return the object's bytes after checking them against its oid."""
        data = self.read(ref)
        self.verify(ref, data)
        return data
