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

Bounded: only values of VALUE_MIN to VALUE_MAX bytes, at most ADD_MAX bytes per add of a
file and STORE_MAX in the store; each add of a path removes its values that neither the
staged manifest nor the new one holds (at most two versions of a tensor per file), and
the folders of files no add touched for STALE seconds (renamed, removed) go when a value
is next kept. A value kept already is not written again (git status re-cleans a modified
file every time). ``git theta prune`` removes them all; ``GIT_THETA_KEEP_VALUES=0`` stops
an add from leaving any. Every failure here is silent: the values are a shortcut.
"""

from __future__ import annotations

import contextlib
import os
import stat
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
STORE_MAX = 2 << 30  # bytes kept in a store at once, for all its files
STALE = 7 * 86400  # seconds: the folder of a file no add touched since (renamed, removed)
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


def _store_room(store: ObjectStore, own_key: str) -> int:
    """Bytes the store's values may still grow by (STORE_MAX less what they hold), once
    the folders of files no add touched for STALE seconds are removed (a renamed or
    removed file's: its own adds tidy only its own folder)."""
    import time

    from git_theta.errors import ThetaError
    from git_theta.files import open_dir

    try:
        top = open_dir(root(store), within=store.own)
    except (OSError, ThetaError):
        return STORE_MAX
    held = 0
    cutoff = time.time() - STALE
    try:
        for key in os.listdir(top):
            with contextlib.suppress(OSError):
                info = os.stat(key, dir_fd=top, follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode):
                    continue
                stale = key != own_key and info.st_mtime < cutoff
                held += _empty_folder(top, key, remove=stale)[1]
    except OSError:
        pass
    finally:
        os.close(top)
    return max(0, STORE_MAX - held)


def _empty_folder(top: int, key: str, remove: bool, dry_run: bool = False) -> tuple[int, int]:
    """(Files, bytes) of the regular files in folder ``key`` of ``top``; with ``remove``,
    they and the folder are removed (not when ``dry_run``). No link is followed."""
    count = held = 0
    try:
        folder = os.open(key, _DIR_FLAGS, dir_fd=top)
    except OSError:
        return 0, 0
    try:
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):
                info = os.lstat(name, dir_fd=folder)
                if not stat.S_ISREG(info.st_mode):
                    continue
                if remove and not dry_run:
                    os.unlink(name, dir_fd=folder)
                count += 1
                held += info.st_size
    finally:
        os.close(folder)
    if remove and not dry_run:
        with contextlib.suppress(OSError):
            os.rmdir(key, dir_fd=top)
    return count, held


class PreviousValues:
    """The values kept for one file of one store (``path``: as git names it)."""

    def __init__(self, store: ObjectStore, path: str, enabled: bool = True):
        self._key = _path_key(path)
        self.folder = os.path.join(root(store), self._key)
        self._store = store
        self._enabled = enabled
        self._room: int | None = None  # what this add may still leave (on first keep)
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
        try:
            try:  # not through a planted link, and a FIFO there must not block the add
                fd = os.open(entry.hash, _READ_FLAGS, dir_fd=folder)
            except OSError:
                return None
            value = map_checked(fd, size, entry.hash)
            if value is None:  # stale or planted: removed, so that a keep writes it anew
                with contextlib.suppress(OSError):
                    os.unlink(entry.hash, dir_fd=folder)
            return value
        finally:
            os.close(folder)

    def keep(self, digest: str, data: Buffer) -> None:
        """Leave ``data`` (a value just stored, whose content hash is ``digest``) for the
        next add, within this add's room."""
        size = len(memoryview(data))
        if not self._enabled or not VALUE_MIN <= size <= VALUE_MAX or not _is_hash(digest):
            return
        with self._lock:
            if self._room is None:
                self._room = min(ADD_MAX, _store_room(self._store, self._key))
            if size > self._room:
                return
            self._room -= size
        from git_theta.errors import ThetaError
        from git_theta.files import TempFile

        folder = self._open(create=True)
        if folder is None:
            return
        try:
            # Kept already (git status re-cleans a modified file on every run): not
            # written again. A wrong one there is removed by take, which checks it.
            info = os.stat(digest, dir_fd=folder, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_size == size:
                return
        except OSError:
            pass
        finally:
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
    from git_theta.errors import ThetaError
    from git_theta.files import open_dir

    count = size = 0
    try:
        top = open_dir(root(store), within=store.own)
    except (OSError, ThetaError):
        return 0, 0
    try:
        for key in os.listdir(top):
            files, held = _empty_folder(top, key, remove=True, dry_run=dry_run)
            count += files
            size += held
    finally:
        os.close(top)
    return count, size
