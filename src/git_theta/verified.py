"""The chains this machine has seen rebuild to their tensor's hash.

A manifest entry claims that its chain (a list of objects and update types) rebuilds to
bytes of a given hash. A committed manifest may lie: a clone's index holds the committed
manifests, and clean would reuse a lying chain for the user's own equal bytes, making the
user's commit impossible to check out. Rebuilding every reused chain on every add costs
a full decode per add, so clean asks here first.

A record is one key per line, ``LFS_DIR/theta/verified``: hex of a blake2b (32 bytes)
over everything a rebuild depends on (the tensor's hash, dtype, shape, and each link's
update type, codec, object oid and size). It is local state, never committed, and holds
no data: a key is only ever added by this machine after the chain's bytes were seen to
hash right (clean storing a value it holds, clean rebuilding a chain, a checkout, fsck).
Appends are single ``O_APPEND`` writes, so git processes of two worktrees may append at
once. The file is read once per process; a file grown past ``CAP`` is started afresh,
and a corrupt, truncated, foreign or unreadable one only costs re-verification. Where it
cannot be written (a read-only store) the keys last for the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from git_theta.manifest import TensorEntry

FILE = "verified"
CAP = 2 << 20  # 32,000 keys of 65 bytes: many versions of the largest checkpoints
# Chains rebuilt by ``check`` in this process: tests count them (no timing).
rebuilds = 0


def key(entry: TensorEntry) -> bytes:
    """Return the record key (64 hex digits, as bytes) of ``entry``'s hash and chain."""
    import hashlib  # here, not at start-up: OpenSSL's set-up is ~3 ms

    h = hashlib.blake2b(digest_size=32, person=b"theta-verified1")
    shape = ",".join(map(str, entry.shape))
    h.update(f"{entry.hash}\0{entry.dtype}\0{shape}\0".encode())
    for link in entry.chain:
        h.update(f"{link.update}\0{link.codec}\0{link.ref.oid}\0{link.ref.size}\0".encode())
    return h.hexdigest().encode()


class Verified:
    """The record of one store (``own``: its ``LFS_DIR/theta`` directory)."""

    def __init__(self, own: str):
        self.path = os.path.join(own, FILE)
        self._own = own
        self._lock = threading.Lock()
        self._keys: set[bytes] | None = None
        self._refused: set[bytes] = set()  # rebuilt wrong in this process: never kept
        self._pending: list[bytes] = []

    def _loaded(self) -> set[bytes]:
        # Called with the lock held.
        if self._keys is None:
            self._keys = _read(self.path)
        return self._keys

    def has(self, entry: TensorEntry) -> bool:
        """Whether ``entry``'s chain is on the record (seen to rebuild to its hash)."""
        k = key(entry)
        with self._lock:
            return k in self._loaded()

    def add(self, entries: Iterable[TensorEntry]) -> None:
        """Put these entries, whose chains were seen to rebuild to their hashes, on the
        record (written by ``flush``)."""
        keys = [key(e) for e in entries]
        with self._lock:
            known = self._loaded()
            for k in keys:
                if k not in known:
                    known.add(k)
                    self._pending.append(k)

    def check(self, entry: TensorEntry, verify: Callable[[], bool]) -> bool:
        """Whether ``entry``'s chain rebuilds to its hash: on the record, else ``verify()``
        (a rebuild) says so now; a yes is recorded, a no remembered for the process."""
        global rebuilds
        k = key(entry)
        with self._lock:
            if k in self._loaded():
                return True
            if k in self._refused:
                return False
            rebuilds += 1
        ok = verify()
        if ok:
            self.add([entry])
        else:
            with self._lock:
                self._refused.add(k)
        return ok

    def flush(self) -> None:
        """Append the keys added since the last flush; where the store cannot be written,
        they are kept for this process only (never an error: the record only saves work)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        from git_theta.errors import ThetaError
        from git_theta.files import append_record

        with contextlib.suppress(OSError, ThetaError):
            os.makedirs(self._own, exist_ok=True)
            # A line of its own even after a torn last record (a killed writer's).
            append_record(self.path, b"\n" + b"\n".join(pending) + b"\n", CAP)


def _read(path: str) -> set[bytes]:
    """The keys in the record at ``path``; an empty set when it is absent, unreadable,
    not a regular file of ours, or over the cap. A damaged line matches no key."""
    from git_theta.errors import ThetaError
    from git_theta.files import open_regular

    try:
        with open_regular(path) as fh:
            if os.fstat(fh.fileno()).st_uid != os.getuid():
                return set()
            data = fh.read(CAP + 1)
    except (OSError, ThetaError):
        return set()
    if len(data) > CAP:
        return set()
    return set(data.split(b"\n"))
