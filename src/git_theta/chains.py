"""A tensor's chain: a dense base value and the updates on top, by object, never by commit.

Storing picks the update type (or auto's choice) and keeps chains short: past
``max_chain`` links, or when the updates on the base would add up to more bytes than a
fresh dense value, a dense value is stored and the chain starts again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import blake3

from git_theta.content import content_hash
from git_theta.display import quote
from git_theta.errors import ObjectCorruptError, ThetaError
from git_theta.manifest import (
    MAX_LINKS,
    MAX_TENSOR_BYTES,
    OPERAND_UPDATE,
    Link,
    TensorEntry,
    tensor_nbytes,
)
from git_theta.parallel import chunk_pool
from git_theta.store import ObjectRef, ObjectStore

if TYPE_CHECKING:
    from git_theta.store import ObjectBytes
    from git_theta.updates.base import Buffer, Picked, UpdateType

MAX_CHAIN = 8
MAX_OPERANDS = 2  # a low-rank update's two factors; ia3 takes one


def steps(chain: tuple[Link, ...]) -> int:
    """The updates of ``chain`` (its base among them), operand links not counted: a
    low-rank step is one step however many factor objects it takes."""
    return sum(1 for link in chain if link.update != OPERAND_UPDATE)


def last_step(chain: tuple[Link, ...]) -> int:
    """Where ``chain``'s last step starts: its last link and the operand links before it."""
    start = len(chain) - 1
    while start > 0 and chain[start - 1].update == OPERAND_UPDATE:
        start -= 1
    return start


def _links(picked: Picked, store: ObjectStore) -> tuple[Link, ...]:
    """Store ``picked``'s operands and payload; return their links, in chain order."""
    from git_theta.updates import UPDATES
    from git_theta.updates.operand import FactorOperand

    assert picked.parts is not None
    links = [Link(FactorOperand.key, FactorOperand.codec, store.put(p)) for p in picked.operands]
    links.append(Link(picked.key, UPDATES.get(picked.key).codec, store.put(picked.parts)))
    return tuple(links)


def store_value(
    new: bytes | bytearray | memoryview,
    dtype: str,
    store: ObjectStore,
    update: str | UpdateType = "dense",
    previous: TensorEntry | None = None,
    load_previous: Callable[[], Buffer | None] | None = None,
    max_chain: int = MAX_CHAIN,
    name: str = "",
    shape: tuple[int, ...] = (),
) -> tuple[Link, ...]:
    """Store ``new`` and return its chain: an update on ``previous`` or a fresh dense value.

    ``update`` is a registered key or a configured plugin (e.g. low-rank with its factors).
    """
    from git_theta.updates import UPDATES
    from git_theta.updates.base import CLEAR_WIN
    from git_theta.updates.dense import Dense

    plugin = UPDATES.get(update) if isinstance(update, str) else update
    dense = UPDATES.get("dense")
    assert isinstance(dense, Dense)
    memo: list[list[bytes]] = []

    def dense_parts() -> list[bytes]:
        if not memo:
            parts = dense.encode(new, None, dtype)
            assert parts is not None
            memo.append(parts)
        return memo[0]

    known: list[bool] = []

    def present() -> bool:
        """Whether the dense object, when it was encoded anyway, is in the store already
        (a committed adapter's factor, another file's tensor): then it costs nothing and
        is the link to take, whatever an update would cost."""
        if memo and not known:
            known.append(_stored(memo[0], store))
        return bool(known) and known[0]

    can_chain = (
        previous is not None
        and previous.dtype == dtype
        and load_previous is not None
        and plugin.needs_previous
        and steps(previous.chain) < max_chain
    )
    grown: tuple[int, Picked] | None = None  # a longer chain, if nothing better is found
    if can_chain:
        assert previous is not None and load_previous is not None
        prev = load_previous()
        if prev is not None:
            base = previous.chain[0]
            estimate = base.ref.size if base.update == "dense" else None
            picked = plugin.pick_linked(new, prev, dtype, dense_parts, estimate, name, shape)
            fits = len(previous.chain) + 1 + len(picked.operands) <= MAX_LINKS
            if picked.parts is not None and picked.key != "dense" and fits:
                # The base is stored already; the updates on top are what a fresh value
                # would replace (and what every checkout has to apply). Far below the last
                # dense value's size, the new dense value need not be computed to know.
                updates = sum(link.ref.size for link in previous.chain[1:]) + picked.size()
                clear = estimate is not None and updates < CLEAR_WIN * estimate
                if (clear or updates < sum(map(len, dense_parts()))) and not present():
                    if clear or not plugin.takes_operands:
                        return (*previous.chain, *_links(picked, store))
                    # An adapter's factors describe the change from the base model: a
                    # second version's, applied to the first's merge, leave a correction
                    # of most of the tensor (182 KB of 218 KB on BERT), on the base none.
                    grown = (updates, picked)
            del prev, picked  # before the base is rebuilt: memory holds one old value
    if not present():
        rebased = _on_base(new, dtype, store, plugin, previous, dense_parts, name, shape)
        if grown is not None and not present():
            assert previous is not None
            if rebased is None or rebased[1].size() >= grown[0]:
                return (*previous.chain, *_links(grown[1], store))
        if rebased is not None and not present():
            return (rebased[0], *_links(rebased[1], store))
    if previous is not None and plugin.key not in ("auto", "dense") and not present():
        fell_back.append((name, plugin.key))  # asked for, not used: the filter says so
    # A fresh value: stream it to the store unless it was encoded for a comparison.
    parts_in = memo[0] if memo else dense.stream(new, dtype)
    return (Link("dense", dense.codec, store.put(parts_in)),)


def _stored(parts: list[bytes], store: ObjectStore) -> bool:
    """Whether the object of ``parts`` is in ``store``."""
    import hashlib  # here, not at start-up: OpenSSL's set-up is ~3 ms

    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return store.has(ObjectRef(digest.hexdigest(), sum(map(len, parts))))


REBASE_MAX = 64 << 20  # larger tensors are not tried against their base (memory)


def _on_base(
    new: bytes | bytearray | memoryview,
    dtype: str,
    store: ObjectStore,
    plugin: UpdateType,
    previous: TensorEntry | None,
    dense_parts: Callable[[], list[bytes]],
    name: str,
    shape: tuple[int, ...],
) -> tuple[Link, Picked] | None:
    """The chain's dense base and one update against its value (to store) when such an
    update is smaller than a fresh dense value; None otherwise. Tried when the chain cannot grow:
    a full fine-tune's updates add up past a fresh value after two saves, and a fresh
    value every other save cost 0.83x of raw where a change against the base costs ~0.6x.
    The base decodes to exact bytes (its object is sha256-checked), so the update applies
    exactly at checkout; the final hash is checked there as always."""
    if (
        previous is None
        or previous.dtype != dtype
        or len(previous.chain) < 2
        or previous.chain[0].update != "dense"
        or not plugin.needs_previous
        or len(new) > REBASE_MAX
    ):
        return None
    from git_theta.updates import UPDATES

    base = previous.chain[0]
    try:
        value = UPDATES.get("dense").apply(None, store.get(base.ref), dtype, limit=len(new))
    except ThetaError:
        return None  # not local, or damaged: a fresh value
    if len(value) != len(new):
        return None
    picked = plugin.pick_linked(new, value, dtype, dense_parts, base.ref.size, name, shape)
    del value
    if (
        picked.parts is None
        or picked.key == "dense"
        or picked.size() >= sum(map(len, dense_parts()))
    ):
        return None
    return base, picked


# (tensor, update type) of each changed tensor whose explicitly asked-for update type
# (--update-type, .theta-updates) was not used: every element changed, so a dense value
# was smaller, or the type cannot describe the change. The filter reports them per file.
fell_back: list[tuple[str, str]] = []


def plugin_for(link: Link) -> UpdateType:
    """The update type that reads ``link`` (operand links too, whose type is no choice a
    user has, so not among UPDATES); raises when it is unknown or the link records
    another codec than the one that type writes."""
    from git_theta.updates import UPDATES

    if link.update == OPERAND_UPDATE:
        from git_theta.updates.operand import FactorOperand

        plugin: UpdateType = FactorOperand()
    else:
        plugin = UPDATES.get(link.update)
    if link.codec != plugin.codec:
        raise ObjectCorruptError(
            f"object {link.ref.oid} is recorded with codec {quote(link.codec)}, but "
            f"{link.update} objects use {quote(plugin.codec)}"
        )
    return plugin


def _cap(entry: TensorEntry, limit: int | None) -> tuple[int, bool]:
    """Return (the most bytes the value may have, whether it is exactly that): its shape
    x dtype, or for an opaque dtype ``limit`` (the file's size)."""
    exact = tensor_nbytes(entry.dtype, entry.shape)
    if exact is not None:
        return exact, True
    return (limit if limit is not None else MAX_TENSOR_BYTES), False


def _in_tensor(exc: ThetaError, name: str, link: Link | None = None) -> None:
    """Prefix ``exc``'s message with the tensor (and the object ``link`` names, unless the
    message does) it is about, keeping its type."""
    message = str(exc)
    if link is not None and link.ref.oid not in message:
        message = f"object {link.ref.oid}: {message}"
    exc.args = (f"tensor {quote(name)}: {message}",)


def rebuild(
    name: str, entry: TensorEntry, store: ObjectStore, limit: int | None = None
) -> bytearray:
    """Return the exact bytes of tensor ``name``, verified against its content hash.

    Nothing is allocated beyond the value's size (shape x dtype; ``limit`` for a dtype
    that does not say, normally the file's size). Raises a ThetaError naming the tensor
    and the object when anything is missing or wrong.
    """
    cap, exact = _cap(entry, limit)
    value = apply_links(None, entry.chain, entry.dtype, store, cap, exact, name)
    if content_hash(value) != entry.hash:
        raise ObjectCorruptError(
            f"tensor {quote(name)}: rebuilt bytes do not match the recorded hash "
            f"(object {entry.chain[-1].ref.oid})"
        )
    return value


def summarize_step(links: tuple[Link, ...], store: ObjectStore, limit: int | None) -> str:
    """What the update of ``links`` (one step: its operand links, then the update) says
    about the change (``UpdateType.summary_with``); "" when it says nothing. Operands are
    read as ``apply_links`` reads them: no more than an update can take.

    Raises a ThetaError when a link cannot be read."""
    *operand_links, link = links
    if len(operand_links) > MAX_OPERANDS or any(
        ln.update != OPERAND_UPDATE for ln in operand_links
    ):
        raise ObjectCorruptError(
            f"more than {MAX_OPERANDS} factor objects in a row; no update takes that many"
        )
    plugin = plugin_for(link)
    operands = [store.get(ln.ref) for ln in operand_links]
    return plugin.summary_with(store.get(link.ref), operands, limit)


def apply_links(
    value: bytearray | None,
    links: tuple[Link, ...],
    dtype: str,
    store: ObjectStore,
    cap: int,
    exact: bool = False,
    name: str = "",
) -> bytearray:
    """Return ``value`` (None before a chain's base) with ``links`` applied in order: the
    one fold of a chain (rebuild, diffs, merges). Operand links are collected and given
    to the link after them. Each value is at most ``cap`` bytes (exactly, when
    ``exact``). Raises a ThetaError naming tensor ``name`` and the object: for a link
    that cannot apply, or operand links no update takes (before one taking none, or at
    the end; a chain is written that way only by hand).
    """
    operands: list[ObjectBytes] = []
    for link in links:
        try:
            plugin = plugin_for(link)
        except ThetaError as exc:
            _in_tensor(exc, name)
            raise
        try:
            if plugin.is_operand:
                if len(operands) == MAX_OPERANDS:  # read no more than an update can take
                    raise ObjectCorruptError(
                        f"more than {MAX_OPERANDS} factor objects in a row; no update takes "
                        "that many"
                    )
                operands.append(store.get(link.ref))
                continue
            value = plugin.apply_with(value, store.get(link.ref), operands, dtype, limit=cap)
            operands = []
            if len(value) > cap or (exact and len(value) != cap):
                raise ObjectCorruptError(
                    f"object {link.ref.oid} gives {len(value):,} bytes; the manifest expects "
                    f"{cap:,}"
                )
        except ThetaError as exc:
            _in_tensor(exc, name, link)
            raise
    if operands or value is None:
        from git_theta.updates.base import factor_objects

        left = ObjectCorruptError(
            f"the chain ends with {factor_objects(len(operands))} no update takes"
        )
        _in_tensor(left, name, links[-1] if links else None)
        raise left
    return value


STREAM_MIN = 8 << 20  # tensors at least this large are written out chunk by chunk


def streamable(entry: TensorEntry) -> bool:
    """True when the tensor is one large dense value, decoded best as a stream (large
    as stored, or as the manifest says: a small object may declare a large value, and
    streamed it never needs more than a few chunks of memory)."""
    if len(entry.chain) != 1 or entry.chain[0].update != "dense":
        return False
    nbytes = tensor_nbytes(entry.dtype, entry.shape)
    return entry.chain[0].ref.size >= STREAM_MIN or (nbytes or 0) >= STREAM_MIN


def stream(
    name: str, entry: TensorEntry, store: ObjectStore, limit: int | None = None
) -> Iterator[bytearray]:
    """Yield the exact bytes of a ``streamable`` tensor chunk by chunk.

    The object's sha256 and the tensor's hash are checked as the bytes pass; a mismatch
    raises at the end, after the bytes were yielded, so callers must not commit their
    output before the iterator is exhausted (git discards a smudge that ends in error).
    An object declaring more bytes than the manifest expects fails before its first
    chunk is decoded (``limit`` as for ``rebuild``).
    """
    from git_theta import codec

    link = entry.chain[0]
    ref = link.ref
    cap, exact = _cap(entry, limit)
    import hashlib

    oid_hash = hashlib.sha256()
    content = blake3.blake3()
    total = 0
    try:
        plugin_for(link)
    except ThetaError as exc:
        _in_tensor(exc, name)
        raise
    try:
        with store.open(ref) as fh:

            def read(n: int) -> bytes:
                data = fh.read(n)
                oid_hash.update(data)
                return data

            for piece in codec.decode_stream(read, chunk_pool(), limit=cap):
                total += len(piece)
                content.update(piece)  # before the yield: the consumer recycles the piece
                yield piece
    except ThetaError as exc:
        if isinstance(exc, ObjectCorruptError):  # a damaged copy is moved aside
            store.corrupt(ref, exc)
        _in_tensor(exc, name, link)
        raise
    if oid_hash.hexdigest() != ref.oid:
        raise store.corrupt(
            ref, ObjectCorruptError(f"tensor {quote(name)}: object {ref.oid} is corrupt")
        )
    if exact and total != cap:
        raise ObjectCorruptError(
            f"tensor {quote(name)}: object {ref.oid} gives {total:,} bytes; the manifest "
            f"expects {cap:,}"
        )
    if content.hexdigest() != entry.hash:
        raise ObjectCorruptError(
            f"tensor {quote(name)}: rebuilt bytes do not match the recorded hash (object {ref.oid})"
        )
