"""NumPy ``.npz``: a zip of ``.npy`` members. Each stored (uncompressed) member's array is
a tensor span; compressed members (``savez_compressed``), zip headers and the directory
are glue, kept verbatim, so every ``.npz`` checks out byte for byte."""

from __future__ import annotations

import io
import struct
from typing import BinaryIO

from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat, ReadExact, TensorSpan, shown
from git_theta.formats.numpy_npy import MAGIC, NpyFormat
from git_theta.formats.zip_index import zip_data_start, zip_entries


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
