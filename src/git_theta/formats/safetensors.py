"""safetensors: an 8-byte little-endian header length, a JSON header, then the data.

The header is parsed in one pass of the C JSON decoder: each tensor's entry becomes a
span as soon as it closes (no dict per entry), the count is capped while parsing, and
the header size is capped before it is read.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from git_theta.dtypes import lookup
from git_theta.errors import CheckpointError
from git_theta.formats.base import (
    MAX_RANK,
    MAX_TENSORS,
    CheckpointFormat,
    LimitExceeded,
    ReadExact,
    TensorSpan,
    shown,
)

SNIFF_HEADER = 100_000_000  # the safetensors library's own limit: larger is not safetensors
# Bytes of JSON header we parse: 256 bytes for each of MAX_TENSORS (real entries take
# ~150). While it is parsed the header is held three times (kept as glue, read, decoded
# to text of up to 4 bytes a character), which this keeps to ~100 MB.
MAX_HEADER = 16 << 20
# JSON values the parser may build (each costs ~60 bytes), bounded before parsing by
# counting the bytes that can start one (, : [ {): a real entry has about 12.
MAX_VALUES = 16 * MAX_TENSORS
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


class _Entry(tuple[str, tuple[int, ...], int, int]):
    """A tensor's header entry, checked: (dtype, shape, start, end) relative to the data."""


class _Malformed:
    """An entry that looked like a tensor's but did not hold; named when it is met."""


_MALFORMED = _Malformed()


def _entry(pairs: list[tuple[str, Any]]) -> Any:
    """object_pairs_hook: a tensor entry becomes an _Entry; other objects stay dicts."""
    if len(pairs) < 3 or not {k for k, _ in pairs} >= _ENTRY_KEYS:
        return dict(pairs)  # __metadata__, the header itself
    info = dict(pairs)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and len(shape) <= MAX_RANK
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(x) is int and x >= 0 for x in [*shape, *offsets])
        and offsets[0] <= offsets[1]
    ):
        return _MALFORMED
    return _Entry((dtype, tuple(shape), offsets[0], offsets[1]))


class SafetensorsFormat(CheckpointFormat):
    key = "safetensors"
    head_size = 9

    def sniff(self, head: bytes, path: str) -> bool:
        if len(head) < 9:
            return False
        (size,) = struct.unpack_from("<Q", head)
        return 2 <= size <= SNIFF_HEADER and head[8:9] == b"{"

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        (size,) = struct.unpack("<Q", read(8))
        if size > MAX_HEADER:
            raise LimitExceeded("safetensors header", size, MAX_HEADER, "bytes")
        raw = read(size)
        values = sum(raw.count(c) for c in (b",", b":", b"[", b"{"))
        if values > MAX_VALUES:
            raise LimitExceeded("safetensors header's JSON value count", values, MAX_VALUES)
        objects = 0

        def hook(pairs: list[tuple[str, Any]]) -> Any:
            nonlocal objects
            objects += 1  # every JSON object: a tensor's entry, __metadata__, the header
            if objects > MAX_TENSORS + 2:
                raise LimitExceeded("safetensors header's entry count", None, MAX_TENSORS)
            return _entry(pairs)

        try:
            text = raw.decode("utf-8")
            del raw  # the text is all that is needed now (and up to 4x its size)
            header = json.loads(text, object_pairs_hook=hook)
        except RecursionError:
            raise CheckpointError("safetensors header nests too deeply to be a header") from None
        except (ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"safetensors header is not valid JSON: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointError("safetensors header is not a JSON object")
        base = 8 + size
        spans = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, _Entry):
                raise CheckpointError(f"safetensors header entry {shown(name)} is malformed")
            dtype, shape, start, end = info
            known = lookup(dtype)
            if known is not None and known.nbytes(shape) != end - start:
                raise CheckpointError(
                    f"safetensors header lies about tensor {shown(name)}: {dtype} {list(shape)} "
                    f"needs {known.nbytes(shape)} bytes but data_offsets span {end - start}"
                )
            spans.append(TensorSpan(name, dtype, shape, base + start, base + end))
        return spans
