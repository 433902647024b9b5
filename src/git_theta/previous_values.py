"""Tensor values an add stored as changes, kept for the next add of the same file.

A changed tensor is stored as an update on its previous value, which clean rebuilds
from that value's chain first: each object read and sha256-checked, the base decoded,
every update applied. In a training loop that adds a checkpoint every so often, the
previous value is what the last add of the file held in memory. So each add leaves the
values of the tensors it stored as changes in ``LFS_DIR/theta/values/KEY/HASH`` (KEY
names the file's path), and the next add maps that file instead of rebuilding, when:

- the bytes have the entry's content hash (a stale, partial or planted file is ignored);
- the entry's chain is on this machine's record of chains seen to rebuild to that hash
  (verified.py): the new update is stored on top of the chain, so a checkout applies it
  to what the chain rebuilds to, which must be these bytes (a clone's manifest may lie);
- the chain's objects are here (else the value is stored whole, as without this file).

Bounded: only values of VALUE_MIN to VALUE_MAX bytes, at most ADD_MAX bytes per add of a file,
and each add of a path removes its values that neither the staged manifest nor the new
one holds, so at most two versions of a tensor are kept. ``git theta prune`` removes
them all; ``GIT_THETA_KEEP_VALUES=0`` stops an add from leaving any. Every failure here
is silent: the values are a shortcut, never needed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from git_theta.manifest import TensorEntry
    from git_theta.store import ObjectStore
    from git_theta.updates.base import Buffer

DIR = "values"
ENV = "GIT_THETA_KEEP_VALUES"
VALUE_MAX = 64 << 20  # a larger tensor is rebuilt (and not written a second time)
VALUE_MIN = 64 << 10  # a smaller one rebuilds in less time than a file takes to write
ADD_MAX = 256 << 20  # bytes one add of a file may leave
_HEX = frozenset("0123456789abcdef")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def root(store: ObjectStore) -> str:
    return os.path.join(store.own, DIR)


def _path_key(path: str) -> str:
    import hashlib  # here, not at start-up: OpenSSL's set-up is ~3 ms

    return hashlib.blake2b(path.encode(errors="surrogateescape"), digest_size=16).hexdigest()


def _is_hash(name: str) -> bool:
    return len(name) == 64 and set(name) <= _HEX


class PreviousValues:
    """The values kept for one file of one store (``path``: as git names it)."""

    def __init__(self, store: ObjectStore, path: str, enabled: bool = True):
        self._key = _path_key(path)
        self.folder = os.path.join(root(store), self._key)
        self._store = store
        self._enabled = enabled
        self._room = ADD_MAX
        self._lock = threading.Lock()

    def _open(self, create: bool) -> int | None:
        """A descriptor of this file's folder (close it), made first when ``create``; None
        when it is absent or anything on the way is not a directory of ours (no link
        below the store's own directory is followed, nor made a way out of it)."""
        from git_theta.errors import ThetaError
        from git_theta.files import open_dir

        try:
            fd = open_dir(self._store.own)
        except (OSError, ThetaError):
            return None
        try:
            for name in (DIR, self._key):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o700, dir_fd=fd)
                step = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = step
        except OSError:
            os.close(fd)
            return None
        return fd

    def take(self, entry: TensorEntry, size: int) -> memoryview | None:
        """The previous value of ``entry`` (``size`` bytes), mapped read-only; None when
        there is none, its bytes do not have the entry's hash, or the entry's chain is not
        known here to rebuild to them, or its objects are not here."""
        if not VALUE_MIN <= size <= VALUE_MAX or not _is_hash(entry.hash):
            return None
        store = self._store
        if not store.verified.has(entry) or not all(store.has(ln.ref) for ln in entry.chain):
            return None
        from git_theta.mapped import map_checked

        folder = self._open(create=False)
        if folder is None:
            return None
        try:  # not through a planted link, and a FIFO there must not block the add
            fd = os.open(entry.hash, _READ_FLAGS, dir_fd=folder)
        except OSError:
            return None
        finally:
            os.close(folder)
        return map_checked(fd, size, entry.hash)

    def keep(self, digest: str, data: Buffer) -> None:
        """Leave ``data`` (a value just stored, whose content hash is ``digest``) for the
        next add, within this add's room."""
        size = len(memoryview(data))
        if not self._enabled or not VALUE_MIN <= size <= VALUE_MAX or not _is_hash(digest):
            return
        with self._lock:
            if size > self._room:
                return
            self._room -= size
        from git_theta.errors import ThetaError
        from git_theta.files import TempFile

        folder = self._open(create=True)
        if folder is None:
            return
        os.close(folder)
        # Through files.py: created exclusively in the folder reached without following
        # links, renamed over nothing but a regular file; a failed write leaves nothing.
        with (
            contextlib.suppress(OSError, ThetaError),
            TempFile(self.folder, "theta-", within=self._store.own) as tmp,
        ):
            tmp.file.write(data)
            tmp.commit(os.path.join(self.folder, digest), tmp.dir_fd, digest)

    def tidy(self, wanted: Iterable[str]) -> None:
        """Remove this file's values whose hashes are not ``wanted`` (the staged and the
        new manifest's), and temporaries no live writer holds."""
        from git_theta.files import remove_stale

        folder = self._open(create=False)
        if folder is None:
            return
        keep = set(wanted)
        try:
            with contextlib.suppress(OSError):
                remove_stale(folder, lambda name: name.startswith("theta-"))
            for name in os.listdir(folder):
                if _is_hash(name) and name not in keep:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=folder)
        except OSError:
            pass
        finally:
            os.close(folder)


def clear(store: ObjectStore, dry_run: bool = False) -> tuple[int, int]:
    """Remove every value kept in ``store`` (``git theta prune``); return how many and their
    bytes. Only regular files in the folders of ``root`` are removed, no link followed."""
    import stat

    from git_theta.errors import ThetaError
    from git_theta.files import open_dir

    count = size = 0
    try:
        top = open_dir(root(store), within=store.own)
    except (OSError, ThetaError):
        return 0, 0
    try:
        for key in os.listdir(top):
            try:
                folder = os.open(key, _DIR_FLAGS, dir_fd=top)
            except OSError:
                continue
            try:
                for name in os.listdir(folder):
                    with contextlib.suppress(OSError):
                        info = os.lstat(name, dir_fd=folder)
                        if not stat.S_ISREG(info.st_mode):
                            continue
                        if not dry_run:
                            os.unlink(name, dir_fd=folder)
                        count += 1
                        size += info.st_size
            finally:
                os.close(folder)
            if not dry_run:
                with contextlib.suppress(OSError):
                    os.rmdir(key, dir_fd=top)
    finally:
        os.close(top)
    return count, size
