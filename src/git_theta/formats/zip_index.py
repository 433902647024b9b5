"""Reading a zip archive's layout (not its contents): where each member's bytes lie.

Shared by the zip-based formats (PyTorch, .npz). Members are located through the central
directory at the end (zip64 included), since local headers may not carry sizes.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

from git_theta.errors import CheckpointError


def zip_entries(fh: BinaryIO, size: int) -> dict[str, tuple[int, int, int]]:
    """Central directory: name -> (local header offset, stored size, method)."""
    tail_len = min(size, 65536 + 22)
    fh.seek(size - tail_len)
    tail = fh.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0:
        raise CheckpointError("zip end of central directory not found (truncated file?)")
    count, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    loc = tail.rfind(b"PK\x06\x07", 0, at)
    if loc >= 0 and (count == 0xFFFF or cd_offset == 0xFFFFFFFF):  # zip64
        (eocd64,) = struct.unpack_from("<Q", tail, loc + 8)
        fh.seek(eocd64)
        record = fh.read(56)
        if record[:4] != b"PK\x06\x06":
            raise CheckpointError("zip64 end of central directory is corrupt")
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", record, 32)
    if cd_offset + cd_size > size:
        raise CheckpointError("zip central directory lies outside the file")
    fh.seek(cd_offset)
    directory = fh.read(cd_size)
    out: dict[str, tuple[int, int, int]] = {}
    pos = 0
    for _ in range(count):
        if directory[pos : pos + 4] != b"PK\x01\x02":
            raise CheckpointError("zip central directory is corrupt")
        (method,) = struct.unpack_from("<H", directory, pos + 10)
        csize, _usize, n_name, n_extra, n_comment = struct.unpack_from(
            "<IIHHH", directory, pos + 20
        )
        (offset,) = struct.unpack_from("<I", directory, pos + 42)
        name = directory[pos + 46 : pos + 46 + n_name].decode("utf-8", "replace")
        extra = directory[pos + 46 + n_name : pos + 46 + n_name + n_extra]
        csize, offset = _zip64_fields(extra, csize, _usize, offset)
        out[name] = (offset, csize, method)
        pos += 46 + n_name + n_extra + n_comment
    return out


def _zip64_fields(extra: bytes, csize: int, usize: int, offset: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            fields = iter(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF:
                usize = next(fields)
            if csize == 0xFFFFFFFF:
                csize = next(fields)
            if offset == 0xFFFFFFFF:
                offset = next(fields)
        pos += 4 + length
    return csize, offset


def zip_data_start(fh: BinaryIO, offset: int) -> int:
    fh.seek(offset)
    head = fh.read(30)
    if head[:4] != b"PK\x03\x04":
        raise CheckpointError("zip local header is corrupt")
    n_name, n_extra = struct.unpack_from("<HH", head, 26)
    return int(offset + 30 + n_name + n_extra)
