"""Content objects kept where git-lfs keeps its objects, so any LFS remote can carry them.

An object is named by the sha256 of its bytes (a Git LFS oid). Writes go to a unique
temporary file in the LFS tmp directory and are renamed into place; reads verify the oid.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import os
import threading
from collections.abc import Iterable
from typing import BinaryIO, NamedTuple

from git_theta.errors import ObjectCorruptError, ObjectMissingError

# What ``read``/``get`` return: bytes, or a read-only mapping of the object's file. Both
# slice to bytes and give memoryviews.
ObjectBytes = bytes | mmap.mmap

_counter = itertools.count()
_COPY_CHUNK = 8 << 20


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


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
        """The directory for temporary files (created on demand)."""
        os.makedirs(self.tmp, exist_ok=True)
        return self.tmp

    def _tmp_name(self) -> str:
        """A temporary file name no other process or thread of ours uses."""
        name = f"theta-{os.getpid()}-{threading.get_ident()}-{next(_counter)}"
        return os.path.join(self.tmp_dir(), name)

    def path(self, oid: str) -> str:
        """Return where the object ``oid`` lives (git-lfs's ``aa/bb/oid`` layout)."""
        return os.path.join(self.root, oid[0:2], oid[2:4], oid)

    def has(self, ref: ObjectRef) -> bool:
        """Return True when the object is present with the expected size."""
        try:
            return os.stat(self.path(ref.oid)).st_size == ref.size
        except FileNotFoundError:
            return False

    def put(self, parts: Iterable[bytes]) -> ObjectRef:
        """Store the concatenation of ``parts`` (unless present) and return its reference.

        Parts are written as they come, so the object is never joined in memory.
        """
        tmp = self._tmp_name()
        digest = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "xb") as fh:
                for part in parts:
                    digest.update(part)
                    fh.write(part)
                    size += len(part)
            ref = ObjectRef(digest.hexdigest(), size)
            final = self.path(ref.oid)
            if os.path.exists(final):
                os.unlink(tmp)
                with contextlib.suppress(OSError):  # in use again: out of prune's grace window
                    os.utime(final)
            else:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                os.replace(tmp, final)
        except BaseException:
            _remove(tmp)
            raise
        return ref

    def copy_in(self, source: str | os.PathLike[str], ref: ObjectRef) -> bool:
        """Copy the object ``ref`` from ``source`` (another repository's store) if its bytes
        hash to ``ref``; return whether it is now here. A corrupt or absent source copies
        nothing."""
        tmp = self._tmp_name()
        digest = hashlib.sha256()
        size = 0
        try:
            with open(source, "rb") as src, open(tmp, "xb") as dst:
                while chunk := src.read(_COPY_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
            if size != ref.size or digest.hexdigest() != ref.oid:
                os.unlink(tmp)
                return False
            final = self.path(ref.oid)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(tmp, final)
        except OSError:
            _remove(tmp)
            return False
        except BaseException:
            _remove(tmp)
            raise
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
