"""Content hashes of exact tensor bytes (blake3: fast, and releases the GIL)."""

from __future__ import annotations

import blake3


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """Return the hex blake3 digest of ``data``."""
    return str(blake3.blake3(data).hexdigest())
