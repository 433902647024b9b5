"""Before the merge driver writes its result: can git check it out?

A tensor changed on one side only is taken whole from that side's manifest, never
decoded. A branch's manifest may name an object nobody pushed, or lie about its hash;
the driver then wrote a clean merge, git's checkout of it failed, and the work tree
showed the checkpoint deleted. So every entry the merge takes from a side other than
ours (and the header, when it is that side's) is checked here: its objects fetched in
one batch, its chain rebuilt to its hash on the worker pool, unless this machine's record
(verified.py) says it already did. Entries the merge computed were built from values it
decoded and verified, and ours' is the checkout the user has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from git_theta.manifest import Manifest, TensorEntry
    from git_theta.store import ObjectRef, ObjectStore


def _key(entry: TensorEntry | None) -> object:
    return None if entry is None else (entry.dtype, entry.shape, entry.hash, entry.chain)


def taken(
    merged: Manifest, ours: Manifest, others: Iterable[Manifest | None]
) -> dict[str, TensorEntry]:
    """The entries of ``merged`` that are another side's (``others``: base, theirs) as
    they are, not ours'."""
    sides = [m for m in others if m is not None]
    out = {}
    for name, entry in merged.tensors.items():
        key = _key(entry)
        if key == _key(ours.tensors.get(name)):
            continue
        if any(key == _key(m.tensors.get(name)) for m in sides):
            out[name] = entry
    return out


def check_taken(
    merged: Manifest,
    ours: Manifest,
    others: Iterable[Manifest | None],
    store: ObjectStore,
    fetch: Callable[[Iterable[ObjectRef]], None] | None,
    keep: bool = False,
) -> None:
    """Make sure every entry (and the header) ``merged`` takes whole from a side other
    than ours is local and rebuilds to its hash within its size; with ``keep``, leave
    each value rebuilt for the checkout that follows (merged_values), which would
    otherwise decode it a second time. Raises ThetaError (ObjectMissingError,
    ObjectCorruptError...) naming the tensor and object."""
    from git_theta import chains, codec
    from git_theta.display import quote
    from git_theta.errors import ObjectCorruptError
    from git_theta.manifest import tensor_nbytes
    from git_theta.parallel import ordered_map
    from git_theta.smudge import read_glue

    sides = [m for m in others if m is not None]
    entries = {n: e for n, e in taken(merged, ours, sides).items() if not store.verified.has(e)}
    glue_taken = merged.glue != ours.glue and any(merged.glue == m.glue for m in sides)
    needed = {link.ref for e in entries.values() for link in e.chain}
    if glue_taken:
        needed.add(merged.glue.ref)
    missing = [ref for ref in needed if not store.has(ref)]
    if missing and fetch is not None:
        fetch(missing)
    if glue_taken:
        read_glue(merged, store)  # raises unless it decodes to its hash and length

    from git_theta import merged_values

    def rebuilds(name: str, entry: TensorEntry) -> bool:
        size = tensor_nbytes(entry.dtype, entry.shape)
        if chains.streamable(entry):
            pieces: Iterable[bytes | bytearray | memoryview]
            pieces = chains.stream(name, entry, store, merged.size)
            if keep and size:
                pieces = merged_values.keep_pieces(store, entry.hash, size, pieces)
            for piece in pieces:
                codec.recycle(piece)  # hashed as it passes; raises at the end if wrong
        else:
            value = chains.rebuild(name, entry, store, limit=merged.size)
            if keep and size == len(value):
                merged_values.keep(store, entry.hash, memoryview(value))
        return True

    def check(name: str) -> None:
        entry = entries[name]
        if not store.verified.check(entry, lambda: rebuilds(name, entry)):
            raise ObjectCorruptError(f"tensor {quote(name)}: rebuilt bytes do not match its hash")

    def weight(name: str) -> int:
        entry = entries[name]
        return tensor_nbytes(entry.dtype, entry.shape) or merged.size

    try:
        for _ in ordered_map(check, sorted(entries), weight):
            pass
    finally:
        store.verified.flush()
