"""NumPy ``.npz``: a zip of ``.npy`` members. Each stored (uncompressed) member's array is
a tensor span; compressed members (``savez_compressed``), zip headers and the directory
are glue, kept verbatim, so every ``.npz`` checks out byte for byte. Diffs read a
compressed member's array through ``compressed_members`` and ``member_array``."""

from __future__ import annotations

import io
import struct
import zlib
from typing import BinaryIO

from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat, LimitExceeded, ReadExact, TensorSpan, shown
from git_theta.records import NamedTuple

# The zip index and the .npy reader are imported where an npz is read: every added file is
# sniffed against this module first, and a safetensors add needs neither (~0.7 ms).


class NpzFormat(CheckpointFormat):
    key = "npz"
    head_size = 64
    needs_seek = True

    def sniff(self, head: bytes, path: str) -> bool:
        if not head.startswith(b"PK\x03\x04") or len(head) < 30:
            return False
        n_name = struct.unpack_from("<H", head, 26)[0]
        return head[30 : 30 + n_name].endswith(b".npy")

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        raise CheckpointError("npz files are read from a seekable copy")

    def read_spans(self, fh: BinaryIO, size: int) -> list[TensorSpan]:
        from git_theta.formats.numpy_npy import MAGIC, NpyFormat
        from git_theta.formats.zip_index import zip_data_start, zip_entries

        entries = zip_entries(fh, size)
        spans = []
        for name, (offset, length, method) in sorted(entries.items(), key=lambda e: e[1][0]):
            if method != 0 or not name.endswith(".npy"):
                continue  # compressed members stay glue: exact, just not per tensor
            start = zip_data_start(fh, offset, size)
            fh.seek(start)
            member = fh.read(min(length, 64 << 10))  # .npy headers are at most ~40 KB
            if not member.startswith(MAGIC):
                raise CheckpointError(f"npz member {shown(name)} is not an .npy array")
            buffer = io.BytesIO(member)

            def read(n: int, buffer: io.BytesIO = buffer) -> bytes:
                data = buffer.read(n)
                if len(data) != n:
                    raise CheckpointError("npz member header is truncated")
                return data

            (inner,) = NpyFormat().read_header(read)
            if inner.end > length:
                raise CheckpointError(f"npz member {shown(name)} is shorter than its header says")
            spans.append(
                TensorSpan(
                    name[: -len(".npy")], inner.dtype, inner.shape,
                    start + inner.start, start + inner.end,
                )
            )  # fmt: skip
        return spans


# Reading a compressed member's array, for diffs (clean keeps the member as glue). A
# member is untrusted: it inflates to at most 100x its compressed size, past 256 MiB
# (what smudge allows a whole file), and to exactly the size its .npy header declares.
INFLATE_FLOOR = 256 << 20
INFLATE_RATIO = 100
_DEFLATED = 8  # zip's method number for deflate: what np.savez_compressed writes


def inflate_cap(compressed: int) -> int:
    """Return the most bytes a member of ``compressed`` bytes may inflate to."""
    return max(INFLATE_FLOOR, INFLATE_RATIO * compressed)


class CompressedMember(NamedTuple):
    """A deflated ``.npy`` member: its array name, where its compressed bytes lie, and
    the CRC-32 and size the zip directory gives its uncompressed bytes."""

    name: str
    start: int
    size: int
    crc: int
    usize: int


def compressed_members(fh: BinaryIO, size: int) -> list[CompressedMember]:
    """Return the deflated ``.npy`` members of the npz ``fh``, in file order. Raises
    CheckpointError when the zip directory or a member lies outside the file."""
    from git_theta.formats.zip_index import zip_data_start, zip_members

    out: list[CompressedMember] = []
    end = 0  # where the previous member's bytes end
    for name, m in sorted(zip_members(fh, size).items(), key=lambda e: e[1].offset):
        if m.method != _DEFLATED or not name.endswith(".npy"):
            continue
        if m.offset < end:  # one stream under many names would inflate once per name
            raise CheckpointError(
                f"npz member {shown(name[:-4])} overlaps {shown(out[-1].name)}: a crafted file"
            )
        start = zip_data_start(fh, m.offset, size)
        if start + m.size > size:
            raise CheckpointError(f"npz member {shown(name)} lies outside the file")
        out.append(CompressedMember(name[: -len(".npy")], start, m.size, m.crc, m.usize))
        end = start + m.size
    return out


def _npy_header(member: bytes, name: str) -> TensorSpan:
    from git_theta.formats.numpy_npy import MAGIC, NpyFormat

    if not member.startswith(MAGIC):
        raise CheckpointError(f"npz member {shown(name)} is not an .npy array")
    buffer = io.BytesIO(member)

    def read(n: int) -> bytes:
        data = buffer.read(n)
        if len(data) != n:
            raise CheckpointError(f"npz member {shown(name)} has a truncated .npy header")
        return data

    (inner,) = NpyFormat().read_header(read)
    return inner


_CHUNK = 16 << 20  # inflated at a time, so a member costs its array and no copy of it


def member_array(
    compressed: bytes, name: str, header_only: bool = False, crc: int | None = None
) -> tuple[TensorSpan, bytes | bytearray]:
    """Inflate a deflated member: return its array's span (offsets into the member) and
    its array's bytes (the member's first bytes, its header among them, with
    ``header_only``).

    Raises CheckpointError when it is not an .npy array, is truncated, or is corrupt (a
    raw deflate stream has no checksum: ``crc``, the zip directory's CRC-32 of the whole
    member, is checked when given), and LimitExceeded when its array would inflate past
    ``inflate_cap`` (not checked for ``header_only``: the header is at most 64 KiB).
    """
    inflate = zlib.decompressobj(-15)  # zip members are raw deflate streams
    try:
        head = inflate.decompress(compressed, 64 << 10)  # .npy headers are at most ~40 KB
        inner = _npy_header(head, name)
        if header_only:
            return inner, head
        cap = inflate_cap(len(compressed))
        if inner.end > cap:
            raise LimitExceeded(f"npz member {shown(name)} inflated", inner.end, cap, "bytes")
        # Inflated in chunks into the array's own buffer: never the array twice in memory.
        values = bytearray(inner.end - inner.start)
        got = head[inner.start : inner.end]
        values[: len(got)] = got
        pos, check = len(got), zlib.crc32(head[: inner.end])
        while pos < len(values):  # max_length 0 would mean no limit: only ask for more
            chunk = inflate.decompress(inflate.unconsumed_tail, min(_CHUNK, len(values) - pos))
            if not chunk:
                break
            values[pos : pos + len(chunk)] = chunk
            pos, check = pos + len(chunk), zlib.crc32(chunk, check)
        # Past the array: nothing more, then the stream's end (else it was cut short).
        more = len(head) > inner.end or bool(inflate.decompress(inflate.unconsumed_tail, 1))
    except zlib.error as exc:
        raise CheckpointError(f"npz member {shown(name)} is corrupt ({exc})") from None
    if pos < len(values) or (crc is not None and not inflate.eof):
        raise CheckpointError(f"npz member {shown(name)} is shorter than its header says")
    if crc is not None and (more or check != crc):
        raise CheckpointError(f"npz member {shown(name)} is corrupt (its CRC-32 differs)")
    return inner, values
