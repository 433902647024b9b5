"""Reading a zip archive's layout (not its contents): where each member's bytes lie.

Shared by the zip-based formats (PyTorch, .npz). Members are located through the central
directory at the end (zip64 included), since local headers may not carry sizes. Every
offset and size read is checked against the file before it is used, and the member
count and directory size are capped before the directory is read.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

from git_theta.errors import CheckpointError
from git_theta.formats.base import MAX_TENSORS, LimitExceeded, shown
from git_theta.records import NamedTuple

MAX_ENTRIES = MAX_TENSORS + 1024  # members: one per storage, and a few records
# Bytes of central directory: 46 bytes and a name per member (~110 for torch's).
MAX_DIRECTORY = 64 << 20
_EOCD = b"PK\x05\x06"
_ENTRY = struct.Struct("<4s4xHH4xIIIHHH8xI")  # sig, flags, method, crc32, csize, usize,
# n_name, n_extra, n_comment, local header offset: one central directory record, without
# its name


class ZipMember(NamedTuple):
    offset: int  # of its local header
    size: int  # stored (compressed) bytes
    method: int
    crc: int  # CRC-32 of its uncompressed bytes
    usize: int  # uncompressed bytes (as the directory claims)
    flags: int  # general purpose bits (8: a data descriptor follows the data)
    entry_at: int  # where its central directory record starts in the file


def zip_entries(fh: BinaryIO, size: int) -> dict[str, tuple[int, int, int]]:
    """Return the central directory: name -> (local header offset, stored size, method).

    Raises CheckpointError when the directory is missing, corrupt, points outside the
    file, or claims more than MAX_ENTRIES members or MAX_DIRECTORY bytes.
    """
    return {name: m[:3] for name, m in zip_members(fh, size).items()}


def zip_members(fh: BinaryIO, size: int) -> dict[str, ZipMember]:
    """Return the central directory, name -> ZipMember (raises as ``zip_entries``)."""
    return dict(zip_directory(fh, size))


def zip_directory(fh: BinaryIO, size: int) -> list[tuple[str, ZipMember]]:
    """Return every central directory record in order, a repeated name included (raises
    as ``zip_entries``)."""
    tail_len = min(size, 65536 + 22)
    fh.seek(size - tail_len)
    tail = fh.read(tail_len)
    at = tail.rfind(_EOCD)
    if at < 0 or at + 22 > len(tail):
        raise CheckpointError("zip end of central directory not found (truncated file?)")
    count, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    if (count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF) and (
        at >= 20 and tail[at - 20 : at - 16] == b"PK\x06\x07"
    ):  # zip64: the locator right before the end record points at the zip64 end record
        (eocd64,) = struct.unpack_from("<Q", tail, at - 20 + 8)
        if eocd64 + 56 > size:
            raise CheckpointError("zip64 end of central directory lies outside the file")
        fh.seek(eocd64)
        record = fh.read(56)
        if record[:4] != b"PK\x06\x06":
            raise CheckpointError("zip64 end of central directory is corrupt")
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", record, 32)
    if count > MAX_ENTRIES:
        raise LimitExceeded("zip member count", count, MAX_ENTRIES)
    if cd_size > MAX_DIRECTORY:
        raise LimitExceeded("zip central directory", cd_size, MAX_DIRECTORY, "bytes")
    if cd_offset + cd_size > size:
        raise CheckpointError("zip central directory lies outside the file")
    if count * _ENTRY.size > cd_size:
        raise CheckpointError(f"zip central directory is too short for {count} members")
    fh.seek(cd_offset)
    directory = fh.read(cd_size)
    out: list[tuple[str, ZipMember]] = []
    pos = 0
    for _ in range(count):
        if pos + _ENTRY.size > len(directory):
            raise CheckpointError("zip central directory is corrupt")
        fields = _ENTRY.unpack_from(directory, pos)
        sig, flags, method, crc, csize, usize, n_name, n_extra, n_comment, offset = fields
        end = pos + _ENTRY.size + n_name + n_extra + n_comment
        if sig != b"PK\x01\x02" or end > len(directory):
            raise CheckpointError("zip central directory is corrupt")
        name_at = pos + _ENTRY.size
        name = directory[name_at : name_at + n_name].decode("utf-8", "replace")
        extra = directory[name_at + n_name : name_at + n_name + n_extra]
        csize, usize, offset = _zip64_sizes(extra, csize, usize, offset)
        if offset + 30 > size or csize > size:
            raise CheckpointError(f"zip member {shown(name)} lies outside the file")
        out.append((name, ZipMember(offset, csize, method, crc, usize, flags, cd_offset + pos)))
        pos = end
    return out


def _zip64_sizes(extra: bytes, csize: int, usize: int, offset: int) -> tuple[int, int, int]:
    """Return (stored size, size, offset), taken from the zip64 extra field where the
    record says so (a field of all ones). Raises CheckpointError when the field lacks
    them."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + length > len(extra):
            raise CheckpointError("zip extra field runs past its record")
        if tag == 1:
            fields = list(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            wanted = [usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, offset == 0xFFFFFFFF]
            if sum(wanted) > len(fields):
                raise CheckpointError("zip64 extra field is missing a size or an offset")
            if wanted[0]:
                usize = fields.pop(0)
            if wanted[1]:
                csize = fields.pop(0)
            if wanted[2]:
                offset = fields.pop(0)
        pos += 4 + length
    return csize, usize, offset


def zip_data_start(fh: BinaryIO, offset: int, size: int) -> int:
    """Return where the data of the member whose local header is at ``offset`` starts.
    Raises CheckpointError when the header is corrupt or lies outside the file."""
    if offset + 30 > size:
        raise CheckpointError("zip local header lies outside the file")
    fh.seek(offset)
    head = fh.read(30)
    if head[:4] != b"PK\x03\x04":
        raise CheckpointError("zip local header is corrupt")
    n_name, n_extra = struct.unpack_from("<HH", head, 26)
    return int(offset + 30 + n_name + n_extra)
