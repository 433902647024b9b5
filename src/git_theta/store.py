"""Content objects: Git LFS objects that git-theta keeps out of git-lfs's reach.

An object is named by the sha256 of its bytes (a Git LFS oid), so any LFS remote carries
it. It lives in ``LFS_DIR/theta/objects/aa/bb/OID``, beside git-lfs's own
``LFS_DIR/objects``: ``git lfs prune`` (and ``git lfs fetch --prune``) delete every object
there that no LFS pointer names, which is every one of ours. For a push our objects are
hard-linked into git-lfs's directory and the links removed after it; objects git-lfs
downloads land in its directory and are linked into ours when first looked for. A link
costs no space, and git-lfs deleting it costs us nothing.

A copy from a ``file://`` remote goes where its first four bytes (``THETA_MAGICS``) say
it belongs: git-theta's objects to ours, plain Git LFS objects (the files of versions
git-lfs tracked) to git-lfs's, where its prune frees them. Repositories of an older
git-theta kept ours in git-lfs's directory: the first process to use a store without the
stamp ``LFS_DIR/theta/layout`` links every git-theta object there into ours, once
(``settle``), and writes the stamp; after that a process pays one lstat.

Writes go to a temporary file (``theta-PID-RANDOM``, made by ``files.TempFile``) in the
LFS tmp directory and are renamed into place; reads verify the oid. A stored copy found
corrupt is moved aside to ``LFS_DIR/theta/corrupt/`` (``corrupt``), so that the next fetch
downloads it again. Temporaries a killed process left are removed by the first write of a
later process and by ``git theta prune``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, BinaryIO

from git_theta.errors import ObjectCorruptError, ObjectMissingError
from git_theta.files import TempFile, UnsafeFileError, atomic_write, open_regular, remove_stale
from git_theta.records import NamedTuple

if TYPE_CHECKING:
    from git_theta.verified import Verified

# What ``read``/``get`` return: bytes, or a read-only mapping of the object's file. Both
# slice to bytes and give memoryviews.
ObjectBytes = bytes | mmap.mmap

_COPY_CHUNK = 8 << 20
_PRECHECK = 1 << 20  # parts up to this size are hashed before any temporary is made
TMP_PREFIX = "theta-"
OWN_DIR = "theta"  # under the LFS directory: ours, never scanned by git-lfs
# The first bytes of every object git-theta writes: codec objects (dense values, deltas,
# the glue), sparse and factored (low-rank, ia3) payloads. A file in either directory
# that starts otherwise is a plain Git LFS object (tests/test_store_layout.py checks
# every kind of object against this).
THETA_MAGICS = frozenset({b"GTHO", b"GTSP", b"GTFX"})
MAGIC_SIZE = 4
LAYOUT = "layout"  # the stamp: both directories were sorted once (see settle)
_LAYOUT_TEXT = b"2 git-theta objects in theta/objects, plain Git LFS objects in objects\n"
CORRUPT_DIR = "corrupt"
HOLD_DIR = "pruning"  # where git theta prune keeps what it means to delete (see hold)
# A hard link that fails with one of these is made a copy instead; anything else (a
# read-only or full store) is an error of the store itself.
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP})
_HEX = frozenset("0123456789abcdef")
_swept: set[str] = set()  # tmp directories this process has swept
_settled: set[str] = set()  # stores this process has checked the stamp of
_hashed_good: set[tuple[str, str]] = set()  # (oid, path) whose bytes hashed to their oid


def remove_stale_temporaries(directory: str, dry_run: bool = False) -> tuple[int, int]:
    """Remove the stale ``theta-PID-...`` temporaries (files.remove_stale) in the store's
    tmp ``directory``; return how many and their bytes. git-lfs's own are not touched."""
    try:
        return remove_stale(directory, lambda name: name.startswith(TMP_PREFIX), dry_run)
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0


def is_theta_object(head: bytes) -> bool:
    """Whether bytes starting with ``head`` are a git-theta object (else a plain one)."""
    return head[:MAGIC_SIZE] in THETA_MAGICS


def _subdirs(path: str, width: int) -> list[os.DirEntry[str]]:
    """The directories named with ``width`` hex digits in ``path`` (no symlinks)."""
    try:
        with os.scandir(path) as entries:
            return [
                e
                for e in entries
                if len(e.name) == width
                and _HEX.issuperset(e.name)
                and e.is_dir(follow_symlinks=False)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []


def stored_files(root: str) -> Iterator[tuple[str, str]]:
    """Yield (oid, path) of each object file under ``root`` (``aa/bb/OID``, a regular
    file where git-lfs would look for it; symlinks are never followed)."""
    for first in _subdirs(root, 2):
        for second in _subdirs(first.path, 2):
            prefix = first.name + second.name
            try:
                with os.scandir(second.path) as entries:
                    found = [
                        (e.name, e.path)
                        for e in entries
                        if len(e.name) == 64
                        and e.name.startswith(prefix)
                        and _HEX.issuperset(e.name)
                        and e.is_file(follow_symlinks=False)
                    ]
            except (FileNotFoundError, NotADirectoryError):
                continue
            yield from found


def _head(path: str) -> bytes | None:
    """The first bytes of the regular file ``path``; None when it cannot be read."""
    try:
        with open_regular(path) as fh:
            return fh.read(MAGIC_SIZE)
    except OSError:
        return None


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _link(source: str, dest: str) -> bool:
    """Hard-link the object file ``source`` (never followed as a symlink) to ``dest``,
    creating its directory; return False when ``dest`` exists already. Raises OSError
    (FileNotFoundError when ``source`` is gone)."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        os.link(source, dest, follow_symlinks=False)
    except FileExistsError:
        return False
    return True


def _move(source: str, dest: str) -> None:
    """Rename the object file ``source`` to ``dest`` (same file system: the LFS
    directory), creating its directory. Raises OSError."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.replace(source, dest)


class ObjectRef(NamedTuple):
    """A stored object: its oid (sha256 hex) and byte size."""

    oid: str
    size: int


def size_lie(ref: ObjectRef, found: int) -> ObjectCorruptError:
    """The error for a manifest naming intact object ``ref`` under another size."""
    return ObjectCorruptError(
        f"object {ref.oid} has {found:,} bytes; the manifest says {ref.size:,}: this "
        "version's manifest is wrong (check out another commit, or add the file again)"
    )


class ObjectStore:
    """git-theta's object directory of one repository, beside git-lfs's (``lfs_dir``)."""

    # Paths are strings, not pathlib: every filter process builds a store, and pathlib's
    # import (4 ms, with urllib) was a tenth of a small file's add.
    def __init__(self, lfs_dir: str | os.PathLike[str]):
        self.own = os.path.join(lfs_dir, OWN_DIR)
        self.root = os.path.join(self.own, "objects")
        self.lfs_root = os.path.join(lfs_dir, "objects")
        self.tmp = os.path.join(lfs_dir, "tmp")
        self._verified: Verified | None = None

    @property
    def verified(self) -> Verified:
        """The record of chains this machine saw rebuild to their hash (verified.py),
        ``LFS_DIR/theta/verified``: local state, read on first use."""
        if self._verified is None:
            from git_theta.verified import Verified

            self._verified = Verified(self.own)
        return self._verified

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

    # -- the one-time sorting of an older repository's objects ---------------------------

    def settle(self) -> None:
        """Take in an older git-theta's objects (``_take_in_older``) unless the stamp says
        that was done, then write the stamp; once per process and store, one lstat when
        it was done. Two processes may do it at once (links only ever add a name). Where
        the store cannot be written (read-only) it is used as it is, and a later process
        takes them in."""
        if self.own in _settled:
            return
        _settled.add(self.own)
        stamp = os.path.join(self.own, LAYOUT)
        if _lstat(stamp) is not None:
            return
        with contextlib.suppress(OSError):
            self._take_in_older()
            os.makedirs(self.own, exist_ok=True)
            atomic_write(stamp, _LAYOUT_TEXT)

    def _take_in_older(self) -> None:
        """Link every git-theta object in git-lfs's directory (an older git-theta kept them
        there, where ``git lfs prune`` deletes every one) into ours; plain Git LFS objects
        stay. Raises OSError when a link or copy fails for a reason other than links being
        unsupported (a read-only or full store)."""
        for oid, path in stored_files(self.lfs_root):
            if _lstat(self.path(oid)) is None and is_theta_object(_head(path) or b""):
                self._link_or_copy(oid, path, self.path(oid))

    def _link_or_copy(self, oid: str, source: str, dest: str) -> None:
        """Link ``source`` to ``dest``, else copy it there when its bytes hash to ``oid``
        (a corrupt copy is left where it is, for reads to find and set aside). Raises
        OSError when the store cannot be written."""
        try:
            _link(source, dest)
        except FileNotFoundError:
            return  # deleted meanwhile (a prune): nothing to keep
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
            with contextlib.suppress(FileNotFoundError):
                self._copy_checked(source, ObjectRef(oid, os.lstat(source).st_size), dest)

    # -- finding objects ---------------------------------------------------------------

    def _adopt(self, ref: ObjectRef) -> bool:
        """Take git-lfs's copy of the git-theta object ``ref`` (a download) into our
        directory; return whether ours has it now. Whatever its first bytes: an update
        plugin's object need not start with one of ours. Unverified: every read verifies,
        and ``corrupt`` clears both copies."""
        source = self.lfs_path(ref.oid)
        try:
            _link(source, self.path(ref.oid))
        except OSError:  # gone, links unsupported, a read-only store: copy, hash-checked
            return self.copy_in(source, ref)
        return True

    def _locate(self, ref: ObjectRef) -> str | None:
        """Where to read ``ref`` from: our directory, else git-lfs's (after taking a
        git-theta object into ours, so that git-lfs deleting it loses nothing; a copy that
        cannot be taken in is still read where it is). None when neither has it at the
        right size."""
        self.settle()
        ours = self.path(ref.oid)
        st = _lstat(ours)
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                return None
            if st.st_size == ref.size:
                return ours
            # Damaged (set aside, so that a download can take its place), or the reader
            # is wrong about the size (left alone: the bytes hash to their name).
            if not self._set_aside_if_corrupt(ref.oid, ours):
                return None
        st = _lstat(self.lfs_path(ref.oid))
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != ref.size:
            return None
        return ours if self._adopt(ref) else self.lfs_path(ref.oid)

    def has(self, ref: ObjectRef) -> bool:
        """Return True when the git-theta object is present with the expected size (taken
        into our directory if git-lfs's has it)."""
        return self._locate(ref) is not None

    def present(self, ref: ObjectRef) -> bool:
        """Return True when either directory has ``ref`` (of either kind) at its size;
        nothing is taken in, so a plain object stays where ``git lfs prune`` frees it."""
        for path in (self.path(ref.oid), self.lfs_path(ref.oid)):
            st = _lstat(path)
            if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == ref.size:
                return True
        return False

    def expose(self, refs: Iterable[ObjectRef]) -> list[str]:
        """Hard-link our objects into git-lfs's directory so that git-lfs can upload them;
        return the links made (for ``unexpose``). Where links are unsupported a copy is
        made, hash-checked, and kept: git-lfs may delete it, never ours. Raises
        ObjectCorruptError when such a copy finds the object corrupt."""
        self.settle()
        made = []
        for ref in refs:
            dest = self.lfs_path(ref.oid)
            if os.path.lexists(dest):
                continue
            source = self._locate(ref) or self.path(ref.oid)
            try:
                if _link(source, dest):
                    made.append(dest)
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
                if not self._copy_checked(source, ref, dest):
                    raise self.corrupt(ref) from None
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

    # -- writing -------------------------------------------------------------------------

    def put(self, parts: Iterable[bytes]) -> ObjectRef:
        """Store the concatenation of ``parts`` (unless present) and return its reference.

        Parts are written as they come, so the object is never joined in memory. Small
        parts already in memory (a file's glue, which every clean stores) are hashed
        first and not written when the object is here: re-cleaning an unchanged file, as
        `git status` does, must work on a read-only store.
        """
        self.settle()
        if isinstance(parts, list | tuple) and sum(map(len, parts)) <= _PRECHECK:
            import hashlib  # here, not at start-up: OpenSSL's set-up is ~3 ms

            digest = hashlib.sha256()
            for part in parts:
                digest.update(part)
            ref = ObjectRef(digest.hexdigest(), sum(map(len, parts)))
            if self._locate(ref) is not None:
                with contextlib.suppress(OSError):  # in use again: out of prune's grace window
                    os.utime(self.path(ref.oid))
                return ref
        import hashlib

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

    def _copy_checked(self, source: str, ref: ObjectRef, dest: str | None = None) -> bool:
        """Copy ``source`` to ``dest`` if its bytes hash to ``ref``; return whether they
        did. ``dest`` None: where the bytes belong, ours for a git-theta object and
        git-lfs's for a plain one. Raises OSError (UnsafeFileError for a source that is
        not a regular file)."""
        import hashlib

        digest = hashlib.sha256()
        size = 0
        head = b""
        with open_regular(source) as src, self._temp_file() as tmp:
            # Never more than one byte past the size: a longer file is wrong already.
            while size <= ref.size and (chunk := src.read(_COPY_CHUNK)):
                if len(head) < MAGIC_SIZE:
                    head += chunk[: MAGIC_SIZE - len(head)]
                digest.update(chunk)
                tmp.file.write(chunk)
                size += len(chunk)
            if size != ref.size or digest.hexdigest() != ref.oid:
                return False
            if dest is None:
                dest = self.path(ref.oid) if is_theta_object(head) else self.lfs_path(ref.oid)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp.commit(dest)
        return True

    def copy_in(self, source: str | os.PathLike[str], ref: ObjectRef) -> bool:
        """Copy the object ``ref`` from ``source`` (another repository's store) if its bytes
        hash to ``ref``: a git-theta object into our directory, a plain Git LFS object into
        git-lfs's (where ``git lfs prune`` frees it). Return whether it is now in the
        store. A corrupt or absent source, or one that is not a regular file, copies
        nothing."""
        self.settle()
        try:
            return self._copy_checked(os.fspath(source), ref)
        except OSError:
            return False

    # -- reading -------------------------------------------------------------------------

    def open(self, ref: ObjectRef) -> BinaryIO:
        """Open the object for reading (unverified: on a mismatch, raise ``corrupt``).
        Raises ObjectMissingError."""
        try:
            return open(self._locate(ref) or self.path(ref.oid), "rb")
        except FileNotFoundError:
            raise ObjectMissingError(f"object {ref.oid} is not in the local store") from None

    def open_plain_path(self, ref: ObjectRef) -> str | None:
        """Where a plain Git LFS object is (see ``open_plain``), or None."""
        self.settle()
        for path in (self.lfs_path(ref.oid), self.path(ref.oid)):
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    return path
        return None

    def open_plain(self, ref: ObjectRef) -> BinaryIO | None:
        """Open a plain Git LFS object (a file's bytes, not a git-theta object) for reading,
        unverified: from git-lfs's directory (where downloads put it), else ours (where
        an older git-theta's did); never taken into ours, so ``git lfs prune`` still frees
        it. None when absent."""
        self.settle()
        for path in (self.lfs_path(ref.oid), self.path(ref.oid)):
            try:
                return open_regular(path)
            except (FileNotFoundError, UnsafeFileError):
                continue
        return None

    def read(self, ref: ObjectRef) -> ObjectBytes:
        """Return the object's bytes, unverified (``get`` verifies): the file mapped
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

    def get(self, ref: ObjectRef) -> ObjectBytes:
        """Return the object's bytes after checking them against its oid. Raises
        ObjectMissingError, or ObjectCorruptError (from ``corrupt``)."""
        data = self.read(ref)
        import hashlib

        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.oid:
            if len(data) != ref.size and (found := self.other_size(ref)) is not None:
                raise size_lie(ref, found)  # an intact copy: nothing is set aside
            raise self.corrupt(ref)
        return data

    def other_size(self, ref: ObjectRef) -> int | None:
        """The size of a stored copy of ``ref`` that hashes to its oid although it is not
        ``ref.size`` bytes (the manifest lies about the size: no fetch can help), else
        None. A copy that does not hash right is moved aside, as ``corrupt`` does; one
        found good is not hashed again in this process."""
        for path in (self.path(ref.oid), self.lfs_path(ref.oid)):
            st = _lstat(path)
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size == ref.size:
                continue
            if not self._set_aside_if_corrupt(ref.oid, path) and (ref.oid, path) in _hashed_good:
                return st.st_size
        return None

    # -- damaged copies --------------------------------------------------------------------

    def corrupt(
        self, ref: ObjectRef, error: ObjectCorruptError | None = None
    ) -> ObjectCorruptError:
        """Return the error to raise for ``ref`` read back wrong (``error``, else the
        usual one), after moving aside to ``LFS_DIR/theta/corrupt/`` each stored copy
        (ours, git-lfs's) whose bytes do not hash to its oid, and saying so: the next
        fetch or checkout then downloads it again, where a size check alone would find it
        present forever. A copy that hashes right is left alone (the reader was wrong, or
        another process replaced it meanwhile)."""
        exc = error or ObjectCorruptError(
            f"object {ref.oid} is corrupt (its sha256 does not match)"
        )
        copies = (self.path(ref.oid), self.lfs_path(ref.oid))
        if [path for path in copies if self._set_aside_if_corrupt(ref.oid, path)]:
            exc.args = (f"{exc}; moved aside: run `git theta fetch` or check out again",)
        return exc

    def _set_aside_if_corrupt(self, oid: str, path: str) -> bool:
        """Move the file ``path`` aside when its bytes do not hash to ``oid``; return
        whether it did (False too when it is absent or cannot be moved). A file found good
        is not hashed again in this process (a manifest may name a large object it has
        under a wrong size, as many times as it likes)."""
        if (oid, path) in _hashed_good:
            return False
        try:
            import hashlib

            digest = hashlib.sha256()
            with open_regular(path) as fh:
                while chunk := fh.read(_COPY_CHUNK):
                    digest.update(chunk)
            if digest.hexdigest() == oid:
                _hashed_good.add((oid, path))
                return False
            name = oid if path == self.path(oid) else f"{oid}.lfs"
            _move(path, os.path.join(self.own, CORRUPT_DIR, name))
        except OSError:
            return False
        return True

    # -- what git theta prune means to delete ----------------------------------------------

    def hold(self, path: str) -> str:
        """Move the object file ``path`` (in either directory) to the holding directory
        ``LFS_DIR/theta/pruning/``; return where it went. Out of sight there, a writer
        that needs it again writes it anew. Raises OSError."""
        oid = os.path.basename(path)
        side = "theta" if path.startswith(self.root + os.sep) else "lfs"
        held = os.path.join(self.own, HOLD_DIR, side, oid)
        _move(path, held)
        return held

    def release(self, held: str) -> None:
        """Move a file ``hold`` took back where it was. Raises OSError."""
        oid = os.path.basename(held)
        side = os.path.basename(os.path.dirname(held))
        _move(held, self.path(oid) if side == "theta" else self.lfs_path(oid))

    def held(self) -> list[str]:
        """The files in the holding directory (a prune that was killed left them)."""
        found = []
        for side in ("theta", "lfs"):
            directory = os.path.join(self.own, HOLD_DIR, side)
            try:
                with os.scandir(directory) as entries:
                    found += [
                        e.path
                        for e in entries
                        if len(e.name) == 64
                        and _HEX.issuperset(e.name)
                        and e.is_file(follow_symlinks=False)
                    ]
            except (FileNotFoundError, NotADirectoryError):
                continue
        return found
