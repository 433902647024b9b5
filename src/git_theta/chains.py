"""A tensor's chain of objects: store a value, rebuild the exact bytes from a chain."""

from __future__ import annotations

from typing import TYPE_CHECKING

from git_theta.content import content_hash
from git_theta.dtypes import lookup
from git_theta.errors import ObjectCorruptError, ThetaError, UnknownPluginError
from git_theta.manifest import Link, TensorEntry
from git_theta.parallel import chunk_pool
from git_theta.store import ObjectStore

if TYPE_CHECKING:
    from git_theta.codec import Layout

CODEC = "gtho1"
# codec (numpy, zstd, zlib-ng) is imported on first use: a re-add of a file whose tensors
# did not change only hashes, and the filter process warms the import in the background.


def layout_for(dtype: str) -> Layout:
    """Return how to split a tensor of ``dtype`` into byte planes."""
    from git_theta import codec

    known = lookup(dtype)
    if known is None or known.bits % 8 or known.word == 1:
        return codec.Layout()
    return codec.Layout(known.word, known.is_float)


def store_dense(data: bytes | bytearray | memoryview, dtype: str, store: ObjectStore) -> Link:
    """Encode ``data`` as a fresh dense value, store it and return its chain link."""
    from git_theta import codec

    return Link("dense", CODEC, store.put(codec.encode(data, layout_for(dtype), pool=chunk_pool())))


def rebuild(name: str, entry: TensorEntry, store: ObjectStore) -> bytearray:
    """Return the exact bytes of tensor ``name``, verified against its content hash.

    Raises a ThetaError naming the tensor and the object when anything is missing or wrong.
    """
    from git_theta import codec

    if not entry.chain:
        raise ObjectCorruptError(f"tensor {name!r} has an empty chain")
    value: bytearray | None = None
    for link in entry.chain:
        try:
            if link.update != "dense":
                raise UnknownPluginError(f"unknown update type {link.update!r}")
            value = codec.decode(store.get(link.ref), pool=chunk_pool())
        except ThetaError as exc:
            raise type(exc)(f"tensor {name!r}: {exc}") from None
    assert value is not None
    if content_hash(value) != entry.hash:
        raise ObjectCorruptError(
            f"tensor {name!r}: rebuilt bytes do not match the recorded hash "
            f"(object {entry.chain[-1].ref.oid})"
        )
    return value
