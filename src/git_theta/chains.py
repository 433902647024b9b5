"""A tensor's chain: a dense base value and the updates on top, by object, never by commit.

Storing picks the update type (or auto's choice) and keeps chains short: past
``max_chain`` links, or when the updates on the base would add up to more bytes than a
fresh dense value, a dense value is stored and the chain starts again.
"""

from __future__ import annotations

from collections.abc import Callable

from git_theta.content import content_hash
from git_theta.errors import ObjectCorruptError, ThetaError
from git_theta.manifest import Link, TensorEntry
from git_theta.store import ObjectStore

MAX_CHAIN = 8
CLEAR_WIN = 0.25


def store_value(
    new: bytes | bytearray | memoryview,
    dtype: str,
    store: ObjectStore,
    update: str = "dense",
    previous: TensorEntry | None = None,
    load_previous: Callable[[], bytearray | None] | None = None,
    max_chain: int = MAX_CHAIN,
) -> tuple[Link, ...]:
    """Store ``new`` and return its chain: an update on ``previous`` or a fresh dense value."""
    from git_theta.updates import UPDATES

    plugin = UPDATES.get(update)
    dense = UPDATES.get("dense")
    memo: list[list[bytes]] = []

    def dense_parts() -> list[bytes]:
        if not memo:
            parts = dense.encode(new, None, dtype)
            assert parts is not None
            memo.append(parts)
        return memo[0]

    can_chain = (
        previous is not None
        and previous.dtype == dtype
        and load_previous is not None
        and plugin.needs_previous
        and len(previous.chain) < max_chain
    )
    if can_chain:
        assert previous is not None and load_previous is not None
        prev = load_previous()
        if prev is not None:
            base = previous.chain[0]
            estimate = base.ref.size if base.update == "dense" else None
            key, parts = plugin.pick(new, prev, dtype, dense_parts, estimate)
            if parts is not None and key != "dense":
                # The base is stored already; the updates on top are what a fresh value
                # would replace (and what every checkout has to apply). Far below the last
                # dense value's size, the new dense value need not be computed to know.
                updates = sum(link.ref.size for link in previous.chain[1:])
                updates += sum(map(len, parts))
                clear = estimate is not None and updates < CLEAR_WIN * estimate
                if clear or updates < sum(map(len, dense_parts())):
                    link = Link(key, UPDATES.get(key).codec, store.put(parts))
                    return (*previous.chain, link)
    return (Link("dense", dense.codec, store.put(dense_parts())),)


def rebuild(name: str, entry: TensorEntry, store: ObjectStore) -> bytearray:
    """Return the exact bytes of tensor ``name``, verified against its content hash.

    Raises a ThetaError naming the tensor and the object when anything is missing or wrong.
    """
    from git_theta.updates import UPDATES

    if not entry.chain:
        raise ObjectCorruptError(f"tensor {name!r} has an empty chain")
    value: bytearray | None = None
    for link in entry.chain:
        try:
            value = UPDATES.get(link.update).apply(value, store.get(link.ref), entry.dtype)
        except ThetaError as exc:
            raise type(exc)(f"tensor {name!r}: {exc}") from None
    assert value is not None
    if content_hash(value) != entry.hash:
        raise ObjectCorruptError(
            f"tensor {name!r}: rebuilt bytes do not match the recorded hash "
            f"(object {entry.chain[-1].ref.oid})"
        )
    return value
