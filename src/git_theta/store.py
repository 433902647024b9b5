"""Content objects: Git LFS objects that git-theta keeps out of git-lfs's reach.

An object is named by the sha256 of its bytes (a Git LFS oid), so any LFS remote carries
it. It lives in ``LFS_DIR/theta/objects/aa/bb/OID``, beside git-lfs's own
``LFS_DIR/objects``: ``git lfs prune`` (and ``git lfs fetch --prune``) delete every object
there that no LFS pointer names, which is every one of ours. For a push our objects are
hard-linked into git-lfs's directory and the links removed after it; objects git-lfs
downloads land in its directory and are linked into ours when first looked for, as are
objects an older git-theta kept there. A link costs no space, and git-lfs deleting it
costs us nothing.

Writes go to a temporary file (``theta-PID-RANDOM``, made by ``files.TempFile``) in the
LFS tmp directory and are renamed into place; reads verify the oid. Temporaries a killed
process left are removed by the first write of a later process and by ``git theta prune``.
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
OWN_DIR = "theta"  # under the LFS directory: ours, never scanned by git-lfs
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
    """git-theta's object directory of one repository, beside git-lfs's (``lfs_dir``)."""

    # Paths are strings, not pathlib: every filter process builds a store, and pathlib's
    # import (4 ms, with urllib) was a tenth of a small file's add.
    def __init__(self, lfs_dir: str | os.PathLike[str]):
        self.root = os.path.join(lfs_dir, OWN_DIR, "objects")
        self.lfs_root = os.path.join(lfs_dir, "objects")
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

    def lfs_path(self, oid: str) -> str:
        """Return where git-lfs keeps (or would keep) the object ``oid``."""
        return os.path.join(self.lfs_root, oid[0:2], oid[2:4], oid)

    def _adopt(self, oid: str) -> bool:
        """Link git-lfs's copy of ``oid`` (a download, or an older git-theta's object) into
        our directory; return whether it is now there."""
        final = self.path(oid)
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.link(self.lfs_path(oid), final, follow_symlinks=False)
        except FileExistsError:
            return True
        except OSError:  # absent there, or links unsupported: copy it, hash-checked
            return False
        return True

    def _locate(self, ref: ObjectRef) -> str | None:
        """Where to read ``ref`` from: our directory, else git-lfs's (after taking its copy
        into ours, so that git-lfs deleting it loses nothing; a copy that cannot be taken
        in is still read where it is). None when neither has it at the right size."""
        for path in (self.path(ref.oid), self.lfs_path(ref.oid)):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != ref.size:
                return None
            if path != self.path(ref.oid) and (self._adopt(ref.oid) or self.copy_in(path, ref)):
                return self.path(ref.oid)
            return path
        return None

    def has(self, ref: ObjectRef) -> bool:
        """Return True when the object is present with the expected size."""
        return self._locate(ref) is not None

    def expose(self, refs: Iterable[ObjectRef]) -> list[str]:
        """Hard-link our objects into git-lfs's directory so that git-lfs can upload them;
        return the links made (for ``unexpose``). Where links are unsupported a copy is
        made, and kept: git-lfs may delete it, never ours."""
        made = []
        for ref in refs:
            dest = self.lfs_path(ref.oid)
            if os.path.lexists(dest):
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                os.link(self.path(ref.oid), dest, follow_symlinks=False)
            except FileExistsError:
                continue
            except OSError:
                with self._temp_file() as tmp, self.open(ref) as src:
                    while chunk := src.read(_COPY_CHUNK):
                        tmp.file.write(chunk)
                    tmp.commit(dest)
                continue
            made.append(dest)
        return made

    @staticmethod
    def unexpose(links: Iterable[str]) -> None:
        """Remove the links ``expose`` made."""
        for link in links:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)

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
            return open(self._locate(ref) or self.path(ref.oid), "rb")
        except FileNotFoundError:
            raise ObjectMissingError(f"object {ref.oid} is not in the local store") from None

    def open_plain_path(self, ref: ObjectRef) -> str | None:
        """Where a plain Git LFS object is (see ``open_plain``), or None."""
        for path in (self.lfs_path(ref.oid), self.path(ref.oid)):
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    return path
        return None

    def open_plain(self, ref: ObjectRef) -> BinaryIO | None:
        """Open a plain Git LFS object (a file's bytes, not a git-theta object) for reading,
        unverified: from git-lfs's directory, else ours (where a ``file://`` download
        copies); never taken into ours, so ``git lfs prune`` still frees it. None when
        absent."""
        for path in (self.lfs_path(ref.oid), self.path(ref.oid)):
            try:
                return open_regular(path)
            except (FileNotFoundError, UnsafeFileError):
                continue
        return None

    def read(self, ref: ObjectRef) -> ObjectBytes:
        """Return the object's bytes, unverified (pair with ``verify``): the file mapped
        read-only, not copied. A checkout reads every object of a version once, and a copy
        is as much fresh memory again (a page fault per 4 KiB); mapped, the bytes are the
        page cache's. Objects are never changed in place (a new one is renamed in), so
        the mapping stays valid while it is used.

        Raises ObjectMissingError when it is absent.
        """
        try:
            with open(self._locate(ref) or self.path(ref.oid), "rb") as fh:
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
