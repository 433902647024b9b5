"""PyTorch ``torch.save`` files (the zip format, torch >= 1.6), read without unpickling.

The archive's central directory gives each record's place; ``data.pkl`` is interpreted by
``safe_pickle`` (an allow-list, no code runs) to learn each storage's dtype and the names
of the tensors that use it. Each storage record is one tensor span (tied weights and views
share a storage, so they are stored once); everything else — the pickle, zip headers,
alignment padding, the central directory — is kept verbatim, so checkout is byte-exact.
"""

from __future__ import annotations

import math
import struct
from typing import Any, BinaryIO

from git_theta.dtypes import lookup
from git_theta.errors import CheckpointError
from git_theta.formats.base import (
    MAX_DEPTH,
    CheckpointFormat,
    LimitExceeded,
    ReadExact,
    TensorSpan,
    shown,
)
from git_theta.formats.safe_pickle import MAX_BYTES, StorageRef, TensorRef, load
from git_theta.formats.zip_index import zip_data_start, zip_entries

_DTYPES = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16",
    "BFloat16Storage": "BF16", "LongStorage": "I64", "IntStorage": "I32",
    "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8", "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64", "ComplexDoubleStorage": "C128",
    "Float8_e4m3fnStorage": "F8_E4M3", "Float8_e5m2Storage": "F8_E5M2",
    "UInt16Storage": "U16", "UInt32Storage": "U32", "UInt64Storage": "U64",
}  # fmt: skip
_FROM_TORCH = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64", "complex128": "C128", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "uint16": "U16", "uint32": "U32", "uint64": "U64",
}  # fmt: skip
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # pickled magic number


def _tensors(root: Any) -> dict[str, TensorRef]:
    """Name every tensor in the unpickled ``root`` by its key path ("model.layer.0").

    The pickle's memo lets containers be shared (a 1.3 KB pickle can nest a list in
    itself 40 times over: 2^40 paths) or even contain themselves, so each container is
    walked once, under the first path that reaches it; a tensor reached by several
    entries (tied weights) gets each name; of two tensors whose paths read the same, the
    later is named with a "#N" suffix. Raises LimitExceeded past MAX_DEPTH levels.
    """
    out: dict[str, TensorRef] = {}
    seen: set[int] = set()
    suffixes: dict[str, int] = {}  # the next "#N" of a name two paths flatten to
    todo: list[tuple[Any, str, int]] = [(root, "", 0)]
    while todo:
        value, prefix, depth = todo.pop()
        if isinstance(value, TensorRef):
            name = prefix or "tensor"
            if out.get(name, value) is not value:
                # {"a.b": x, "a": {"b": y}}: both paths read "a.b"; the second tensor
                # is "a.b#2", so it is listed and stored as a tensor, not as glue.
                n = suffixes.get(name, 2)
                while f"{name}#{n}" in out:
                    n += 1
                suffixes[name] = n + 1
                name = f"{name}#{n}"
            out.setdefault(name, value)
            continue
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list | tuple):
            items = enumerate(value)
        else:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))  # ``root`` keeps every container alive: ids stay unique
        if depth >= MAX_DEPTH:
            raise LimitExceeded("torch pickle nesting", depth + 1, MAX_DEPTH, "levels")
        children = [(v, f"{prefix}.{k}" if prefix else str(k), depth + 1) for k, v in items]
        todo.extend(reversed(children))  # depth first, in order: the first path wins
    return out


class TorchZipFormat(CheckpointFormat):
    key = "torch"
    head_size = 64
    needs_seek = True

    def sniff(self, head: bytes, path: str) -> bool:
        if head.startswith(LEGACY_MAGIC):
            return True  # to say how to convert it
        if not head.startswith(b"PK\x03\x04") or len(head) < 30:
            return False
        n_name = struct.unpack_from("<H", head, 26)[0]
        return head[30 : 30 + n_name].endswith(b"data.pkl")

    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        raise CheckpointError("torch files are read from a seekable copy")

    def read_spans(self, fh: BinaryIO, size: int) -> list[TensorSpan]:
        fh.seek(0)
        if fh.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC:
            raise CheckpointError(
                "legacy (pre-1.6, non-zip) torch.save file: load it with torch and save it "
                "again with torch.save(obj, path) to track it"
            )
        entries = zip_entries(fh, size)
        pickles = [n for n in entries if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise CheckpointError("torch archive has no data.pkl")
        prefix = pickles[0][: -len("data.pkl")]
        offset, length, method = entries[pickles[0]]
        if method != 0:
            raise CheckpointError("torch archive's data.pkl is compressed")
        if length > MAX_BYTES:  # before reading it
            raise LimitExceeded("torch pickle", length, MAX_BYTES, "bytes")
        fh.seek(zip_data_start(fh, offset, size))
        pickle = fh.read(length)
        if len(pickle) != length:
            raise CheckpointError("torch archive's data.pkl is truncated")
        tensors = _tensors(load(pickle))
        users: dict[str, list[tuple[str, TensorRef]]] = {}
        storages: dict[str, StorageRef] = {}
        for name in sorted(tensors):
            ref = tensors[name]
            storages[ref.storage.key] = ref.storage
            users.setdefault(ref.storage.key, []).append((name, ref))
        spans = []
        for key, storage in storages.items():
            record = f"{prefix}data/{key}"
            if record not in entries:
                raise CheckpointError(f"torch archive lacks the record for storage {shown(key)}")
            offset, length, method = entries[record]
            if method != 0:
                raise CheckpointError(f"torch archive record {shown(record)} is compressed")
            name, ref = users[key][0]
            if storage.kind == "UntypedStorage":  # numel counts bytes; the tensor has the dtype
                if not ref.dtype:
                    raise CheckpointError(
                        f"torch storage {shown(key)} is untyped, as is its tensor"
                    )
                dtype = _FROM_TORCH.get(ref.dtype, f"torch.{ref.dtype}")
                known = lookup(dtype)
                itemsize = known.bits // 8 if known is not None and known.bits >= 8 else 1
                if storage.numel != length:
                    raise CheckpointError(f"torch storage {shown(key)} has the wrong size")
                if length % itemsize:  # not whole elements of the first user's type
                    dtype, itemsize = "U8", 1
                numel = length // itemsize
            else:
                dtype, numel = _DTYPES[storage.kind], storage.numel
                known = lookup(dtype)
                if known is not None and known.nbytes((numel,)) != length:
                    raise CheckpointError(f"torch storage {shown(key)} has the wrong size")
            whole = len(users[key]) == 1 and ref.offset == 0 and math.prod(ref.shape) == numel
            shape = ref.shape if whole else (numel,)
            if not whole:
                name = f"{name} (storage {key})"
            start = zip_data_start(fh, offset, size)
            spans.append(TensorSpan(name, dtype, shape, start, start + length))
        return spans
