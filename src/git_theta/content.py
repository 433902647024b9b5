"""Content hashes of exact tensor bytes (blake3: fast, and releases the GIL)."""

from __future__ import annotations

from collections.abc import Callable

import blake3


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """Return the hex blake3 digest of ``data``."""
    return str(blake3.blake3(data).hexdigest())


def content_hash_of(read: Callable[[int], bytes], n: int) -> str:
    """Return the hex blake3 digest of the next ``n`` bytes ``read`` gives (fewer where it
    ends), read in 8 MiB pieces so a large tensor is never held whole."""
    digest = blake3.blake3()
    while n > 0:
        piece = read(min(n, 8 << 20))
        if not piece:
            break
        digest.update(piece)
        n -= len(piece)
    return str(digest.hexdigest())
