"""dense: the whole value, compressed; it starts a chain and needs nothing before it."""

from __future__ import annotations

from collections.abc import Iterator

from git_theta import codec
from git_theta.parallel import chunk_pool
from git_theta.updates.base import Buffer, Payload, UpdateType
from git_theta.updates.layout import layout_for


class Dense(UpdateType):
    key = "dense"
    codec = "gtho1"
    needs_previous = False

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes]:
        return codec.encode(new, layout_for(dtype), pool=chunk_pool())

    def stream(self, new: Buffer, dtype: str) -> Iterator[bytes]:
        """The dense object part by part, never all in memory (for fresh values)."""
        return codec.encode_stream(new, layout_for(dtype), pool=chunk_pool())

    def apply(
        self, prev: bytearray | None, payload: Payload, dtype: str, limit: int | None = None
    ) -> bytearray:
        return codec.decode(payload, pool=chunk_pool(), limit=limit)
