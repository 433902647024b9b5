"""Tensor values a merge just computed, kept for the checkout that follows it.

git stores the merge driver's manifest and then checks it out through the smudge filter,
which would decode every merged tensor again (the base, then the update the merge just
encoded). The driver leaves each merged value's bytes in ``LFS_DIR/theta/merged/HASH``;
the smudge takes it from there instead: the file is read, removed, and used only when its
bytes have the entry's content hash (anything else is decoded as always, so a stale,
partial or planted file never reaches the work tree). Files a checkout never took (a
merge without a work tree, ``git merge-tree``) are removed by the next merge after
STALE seconds, and at most MAX_KEPT bytes are left at once. Every failure here is
silent: the values are a shortcut, never needed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from git_theta.manifest import TensorEntry
    from git_theta.store import ObjectStore
    from git_theta.updates.base import Buffer

DIR = "merged"
STALE = 600  # seconds
# Bytes left at once: a merge of a sharded model runs every file's driver before git
# checks any out, and the disk should not have to hold a second copy of a large model.
MAX_KEPT = 4 << 30
_room = [0]  # bytes this process may still leave (set by ``sweep``)
_lock = threading.Lock()


def _dir(store: ObjectStore) -> str:
    return os.path.join(store.own, DIR)


def keep(store: ObjectStore, hash_: str, data: memoryview) -> None:
    """Leave ``data`` (a merged value whose content hash is ``hash_``) for the checkout."""
    with _lock:
        if len(data) > _room[0]:
            return
        _room[0] -= len(data)
    from git_theta.errors import ThetaError
    from git_theta.files import AtomicWriter

    folder = _dir(store)
    # Through files.py: a planted symlink or directory at the name is refused, never
    # written through, and a failed write leaves no temporary behind.
    with contextlib.suppress(OSError, ThetaError):
        os.makedirs(folder, exist_ok=True)
        with AtomicWriter(os.path.join(folder, hash_)) as fh:
            fh.write(data)


def keep_pieces(
    store: ObjectStore, hash_: str, size: int, pieces: Iterable[Buffer]
) -> Iterator[Buffer]:
    """Yield ``pieces`` as they pass, writing each to the value left for ``hash_`` (a
    value of ``size`` bytes): it is left only when every piece passed (the caller's
    iterator checks the hash, raising at its end when wrong); otherwise nothing is."""
    with _lock:
        room = size <= _room[0]
        if room:
            _room[0] -= size
    from git_theta.errors import ThetaError

    writer = None
    if room:
        from git_theta.files import AtomicWriter

        with contextlib.suppress(OSError, ThetaError):
            os.makedirs(_dir(store), exist_ok=True)
            opening = AtomicWriter(os.path.join(_dir(store), hash_))
            fh = opening.__enter__()
            writer = opening  # only once it is open
    done = False
    try:
        for piece in pieces:
            if writer is not None:
                try:
                    fh.write(piece)
                except OSError:
                    with contextlib.suppress(OSError, ThetaError):
                        writer.__exit__(_Abandoned, _Abandoned(), None)
                    writer = None
            yield piece
        done = True
    finally:
        if writer is not None:
            with contextlib.suppress(OSError, ThetaError):
                if done:
                    writer.__exit__(None, None, None)
                else:
                    writer.__exit__(_Abandoned, _Abandoned(), None)


class _Abandoned(Exception):
    """Given to the writer of a value that is not to be left: it removes its temporary."""


def any_left(store: ObjectStore) -> bool:
    """Whether any value is left (a checkout with none looks no further)."""
    try:
        with os.scandir(_dir(store)) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def take(store: ObjectStore, entry: TensorEntry, size: int) -> memoryview | None:
    """The value left for ``entry`` (``size`` bytes), removed from the directory; None
    when there is none or its bytes do not have the entry's hash. It is the file mapped
    read-only, not copied: a copy was as much fresh memory again (a page fault and
    zeroing per page: for GPT-2-small, 500 MB in the checkout that follows a merge),
    and the mapping stays valid after the name is removed."""
    from git_theta.mapped import map_checked

    path = os.path.join(_dir(store), entry.hash)
    try:  # not through a planted link, and a FIFO there must not block the checkout
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return map_checked(fd, size, entry.hash)  # (an empty value is rebuilt: no cost)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def sweep(store: ObjectStore) -> None:
    """Remove values older than STALE seconds (left by a merge no checkout followed), and
    allow this process to leave what keeps the directory within MAX_KEPT bytes."""
    import time

    folder = _dir(store)
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    cutoff = time.time() - STALE
    held = 0
    for name in names:
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if info.st_mtime < cutoff:
                os.unlink(path)
            else:
                held += info.st_size
    with _lock:
        _room[0] = max(0, MAX_KEPT - held)
