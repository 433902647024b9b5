"""Zip-based checkpoints (``.npz``, PyTorch ``.bin``/``.pt``): the CRC-32 fields of their
members, found and recomputed after tensor bytes change.

A zip records each member's CRC-32 in its local header, in the central directory and,
for writers that stream (PyTorch), in a data descriptor after the data. All three lie in
the file's non-tensor bytes (a manifest's glue), so replacing a tensor's bytes means
patching them there: side-loaded updates do it on a file (``crc_fields``), a merge on a
manifest's glue (``ZipGlue``), without the file.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO

from git_theta.errors import CheckpointError
from git_theta.formats.zip_index import zip_data_start, zip_directory
from git_theta.records import NamedTuple

ZIP_FORMATS = frozenset({"npz", "torch"})
# A member whose bytes differ at every save: PyTorch's per-save random identifier. A
# merge takes the chosen side's, as it takes that side's header.
VOLATILE_SUFFIXES = ("/.data/serialization_id", ".data/serialization_id")


class ZipCrc(NamedTuple):
    """A member: where its CRC-32 is recorded, and its stored data ``[start, end)``."""

    crc_at: tuple[int, ...]
    start: int
    end: int
    name: str


def crc_fields(fh: BinaryIO, size: int) -> list[ZipCrc]:
    """Every member of the zip ``fh`` (``size`` bytes): its data range and the offsets of
    its CRC-32 fields (local header, central directory, data descriptor). Raises
    CheckpointError when the directory is corrupt or points outside the file (the
    directory is read by zip_index, with its caps)."""
    out = []
    for name, member in zip_directory(fh, size):
        start = zip_data_start(fh, member.offset, size)
        end = start + member.size
        if end > size:
            raise CheckpointError("zip member lies outside the file")
        crc_at = [member.offset + 14, member.entry_at + 16]
        if member.flags & 8:  # a data descriptor after the data, with or without its signature
            fh.seek(end)
            crc_at.append(end + (4 if fh.read(4) == b"PK\x07\x08" else 0))
        out.append(ZipCrc(tuple(crc_at), start, end, name))
    return out


# --- CRC-32 of a concatenation, from the CRCs of its parts (as zlib's crc32_combine) ----

_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected: bit 31 is x^0


def _mul(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both reflected."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """Return the CRC-32 of A + B given ``crc1`` = crc32(A), ``crc2`` = crc32(B) and
    ``len2`` = len(B): crc1 times x^(8 len2), plus crc2."""
    power, square, n = 1 << 31, 1 << 30, 8 * len2  # x^0; x^1
    while n:
        if n & 1:
            power = _mul(power, square)
        square = _mul(square, square)
        n >>= 1
    return _mul(power, crc1) ^ crc2


# --- a manifest's glue ---------------------------------------------------------------

Piece = tuple[str, str] | bytes  # a tensor (name, content hash) or glue bytes


class _Region(NamedTuple):
    start: int  # in the file
    end: int
    glue_at: int  # where it starts in the glue, or -1 for a tensor
    name: str


class _GlueFile:
    """The file a manifest describes, its tensors' bytes read as zeros."""

    def __init__(self, glue: bytes, regions: Sequence[_Region]):
        self.glue = glue
        self.regions = regions
        self.pos = 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        out = bytearray()
        for r in self.regions:
            lo, hi = max(self.pos, r.start), min(self.pos + n, r.end)
            if lo >= hi:
                continue
            if r.glue_at < 0:  # read as zeros: the end record's search reads over them;
                out += bytes(hi - lo)  # a CRC field found there is refused (_in_glue)
            else:
                out += self.glue[r.glue_at + lo - r.start : r.glue_at + hi - r.start]
        self.pos += len(out)
        return bytes(out)


class ZipGlue:
    """A zip-based manifest's glue, its members and their CRC-32 fields.

    Built from the glue bytes, the layout and each tensor's byte size; raises
    CheckpointError when the zip records cannot be read from the glue alone.
    """

    def __init__(self, glue: bytes, layout: Sequence[int | str], sizes: Mapping[str, int | None]):
        regions, pos, glue_at = [], 0, 0
        for item in layout:
            if isinstance(item, int):
                regions.append(_Region(pos, pos + item, glue_at, ""))
                glue_at += item
                pos += item
            else:
                n = sizes.get(item)
                if n is None:
                    raise CheckpointError(f"tensor {item!r} has no known size")
                regions.append(_Region(pos, pos + n, -1, item))
                pos += n
        self.glue = glue
        self.regions = regions
        self.members = crc_fields(_GlueFile(glue, regions), pos)  # type: ignore[arg-type]
        self._glue_offsets = [[self._in_glue(at) for at in m.crc_at] for m in self.members]
        # A streaming writer (PyTorch's) leaves the local header's CRC-32 zero and gives
        # it after the data: such a zero stays, so unchanged members keep their bytes.
        self._write_at = [
            offsets[1:] if len(offsets) == 3 and glue[offsets[0] : offsets[0] + 4] == bytes(4)
            else offsets
            for offsets in self._glue_offsets
        ]  # fmt: skip

    def _in_glue(self, at: int) -> int:
        for r in self.regions:
            if r.start <= at and at + 4 <= r.end and r.glue_at >= 0:
                return r.glue_at + at - r.start
        raise CheckpointError("a zip CRC-32 field overlaps a tensor's bytes")

    def _volatile(self, member: ZipCrc) -> bool:
        return member.name.endswith(VOLATILE_SUFFIXES) and all(
            r.glue_at >= 0 for r in self.regions if r.start < member.end and member.start < r.end
        )

    def normalized(self) -> bytes:
        """The glue with every CRC-32 field zeroed, and the bytes of members that differ
        at every save (VOLATILE_SUFFIXES): equal for two files that differ only in tensor
        values and in those."""
        out = bytearray(self.glue)
        for member, offsets in zip(self.members, self._glue_offsets, strict=True):
            for at in offsets:
                out[at : at + 4] = bytes(4)
            if self._volatile(member):
                for r in self.regions:
                    lo, hi = max(member.start, r.start), min(member.end, r.end)
                    if lo < hi:
                        out[r.glue_at + lo - r.start : r.glue_at + hi - r.start] = bytes(hi - lo)
        return bytes(out)

    def pieces(self, member: ZipCrc, hashes: Mapping[str, str]) -> tuple[Piece, ...]:
        """What ``member``'s data consists of: glue bytes and whole tensors (name, hash).
        Raises CheckpointError for a tensor only partly inside it."""
        out: list[Piece] = []
        for r in self.regions:
            lo, hi = max(member.start, r.start), min(member.end, r.end)
            if lo >= hi:
                continue
            if r.glue_at >= 0:
                out.append(self.glue[r.glue_at + lo - r.start : r.glue_at + hi - r.start])
            elif (lo, hi) == (r.start, r.end):
                out.append((r.name, hashes[r.name]))
            else:
                raise CheckpointError(f"tensor {r.name!r} lies across zip members")
        return tuple(out)

    def crcs(self, hashes: Mapping[str, str]) -> dict[tuple[Piece, ...], int]:
        """Each member's content (``pieces``) -> its recorded CRC-32."""
        out = {}
        for member, offsets in zip(self.members, self._glue_offsets, strict=True):
            (crc,) = struct.unpack_from("<I", self.glue, offsets[1])  # the directory's
            out[self.pieces(member, hashes)] = crc
        return out

    def with_crcs(
        self,
        hashes: Mapping[str, str],
        known: Sequence[Mapping[tuple[Piece, ...], int]],
        tensor_crc: Callable[[str], int],
    ) -> bytes:
        """The glue with every member's CRC-32 set for the tensors ``hashes`` names: the
        CRC a version with the same member content recorded (``known``), else computed
        from the glue bytes and ``tensor_crc(name)``, the CRC-32 of a tensor's bytes."""
        out = bytearray(self.glue)
        sizes = {r.name: r.end - r.start for r in self.regions if r.glue_at < 0}
        for member, offsets in zip(self.members, self._write_at, strict=True):
            content = self.pieces(member, hashes)
            crc = next((k[content] for k in known if content in k), None)
            if crc is None:
                crc = 0
                for piece in content:
                    if isinstance(piece, bytes):
                        crc = zlib.crc32(piece, crc)
                    else:
                        crc = crc32_combine(crc, tensor_crc(piece[0]), sizes[piece[0]])
            for at in offsets:
                out[at : at + 4] = struct.pack("<I", crc)
        return bytes(out)
