"""A state dict -> the bytes of a checkpoint file, as a stream clean reads from.

safetensors is produced piece by piece straight from the tensors' memory (the header,
then each tensor's bytes): nothing is written or copied whole. Formats whose writer is
their library's (torch.save, numpy.savez, flax) are serialised once into an anonymous
temporary file in the store's temporary directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import IO, Any

from git_theta.api._arrays import RawTensor, is_array, is_torch, raw
from git_theta.errors import UsageError

SUFFIXES = {
    ".safetensors": "safetensors",
    ".pt": "pytorch", ".pth": "pytorch", ".bin": "pytorch", ".ckpt": "pytorch",
    ".npz": "numpy",
    ".msgpack": "flax",
}  # fmt: skip
FORMATS = ("safetensors", "pytorch", "numpy", "flax")

# The safetensors library writes tensors by dtype, in the reverse of this order, then by
# name; following it makes a saved file byte-identical to the library's (so `git add` of
# the library's file afterwards stages nothing new).
_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
    "F64", "I64", "U64", "C128",
)  # fmt: skip
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}


def format_for(path: str, fmt: str | None) -> str:
    """The format to write ``path`` in: ``fmt``, else the one its suffix names; raises
    UsageError when neither says."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UsageError(f"format {fmt!r} is not one git-theta writes: {', '.join(FORMATS)}")
        return fmt
    for suffix, name in SUFFIXES.items():
        if path.endswith(suffix):
            return name
    raise UsageError(
        f"{path}: cannot tell the format from its suffix; pass format= one of {', '.join(FORMATS)}"
    )


_BIG = 1 << 20


def _copy(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src``; a large copy through NumPy, which releases the GIL for it, so
    the clean's workers (hashing, encoding) go on meanwhile."""
    if len(src) >= _BIG:
        import numpy as np

        np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dest[:] = src


class PartsSource:
    """A read-only stream over byte pieces (clean's ``Source``), handed out without
    joining them; ``tee`` (when given) receives every byte read."""

    def __init__(self, parts: list[memoryview], tee: IO[bytes] | None = None):
        self._parts = parts
        self._index = 0
        self._pos = 0
        self._tee = tee

    def readinto(self, out: memoryview) -> int:
        done = 0
        while done < len(out) and self._index < len(self._parts):
            part = self._parts[self._index]
            n = min(len(part) - self._pos, len(out) - done)
            _copy(out[done : done + n], part[self._pos : self._pos + n])
            done += n
            self._pos += n
            if self._pos == len(part):
                self._parts[self._index] = memoryview(b"")  # let the tensor go
                self._index += 1
                self._pos = 0
        if self._tee is not None and done:
            self._tee.write(out[:done])
        return done

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = sum(len(p) for p in self._parts[self._index :]) - self._pos
        buf = bytearray(n)
        got = self.readinto(memoryview(buf))
        return bytes(buf[:got])


class FileSource:
    """clean's ``Source`` over an open file, optionally teed."""

    def __init__(self, fh: IO[bytes], tee: IO[bytes] | None = None, private: bool = False):
        """``private``: ``fh`` is our own temporary file, which nobody else can change."""
        self._fh = fh
        self._tee = tee
        self._private = private

    def spooled(self) -> IO[bytes] | None:
        """The open file itself, for a reader that must seek (a zip's index is at its
        end): when it is private and nothing is teed, its whole content, from byte 0, is
        this stream; else None (the reader spools what it reads)."""
        return self._fh if self._private and self._tee is None else None

    def readinto(self, out: memoryview) -> int:
        got = self._fh.readinto(out)  # type: ignore[attr-defined]
        if self._tee is not None and got:
            self._tee.write(out[:got])
        return int(got or 0)

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        if self._tee is not None and data:
            self._tee.write(data)
        return data


def flat_tensors(state_dict: Mapping[str, Any], fmt: str) -> dict[str, RawTensor]:
    """Every tensor of a flat ``state_dict``; raises UsageError for a nested dict or a
    value that is not a tensor (the format cannot hold it)."""
    out = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise UsageError(f"{fmt} names tensors by strings, not {type(name).__name__} {name!r}")
        if isinstance(value, Mapping):
            raise UsageError(
                f"{fmt} holds a flat dict of tensors; {name!r} is a nested dict: flatten it "
                "(e.g. join names with '.') or save as .pt or .msgpack"
            )
        out[name] = raw(value, name)
    return out


def safetensors_parts(
    state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None = None
) -> tuple[list[memoryview], int]:
    """The pieces of a safetensors file holding ``state_dict`` and its total size."""
    tensors = flat_tensors(state_dict, "safetensors")
    order = sorted(tensors, key=lambda n: (-_RANK.get(tensors[n].dtype, -1), n))
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise UsageError("safetensors metadata maps strings to strings")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + len(t.data)
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, end]}
        offset += len(t.data)
    try:
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:  # a lone surrogate: UTF-8 cannot hold it
        bad = exc.object[max(exc.start - 20, 0) : exc.end + 20]
        raise UsageError(f"safetensors names are UTF-8; {bad!r} is not valid Unicode") from None
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors writes it
    head = len(text).to_bytes(8, "little") + text
    parts = [memoryview(head)] + [tensors[n].data for n in order]
    return parts, len(head) + offset


def _torch_value(value: Any, name: str) -> Any:
    """``value`` as torch.save can store it: arrays as torch tensors, dicts walked."""
    if isinstance(value, Mapping):
        return {k: _torch_value(v, f"{name}.{k}" if name else str(k)) for k, v in value.items()}
    if is_torch(value) or not is_array(value):
        return value
    from git_theta.api._arrays import to_torch

    t = raw(value, name)
    return to_torch(bytearray(t.data), t.dtype, t.shape)


def serialise(state_dict: Mapping[str, Any], fmt: str, out: IO[bytes]) -> None:
    """Write ``state_dict`` into ``out`` in ``fmt`` (not safetensors) with its library."""
    if fmt == "pytorch":
        import torch

        torch.save(_torch_value(state_dict, ""), out)
    elif fmt == "numpy":
        import numpy as np

        tensors = flat_tensors(state_dict, "npz")
        from git_theta.api._arrays import to_numpy

        arrays = {n: to_numpy(bytes(t.data), t.dtype, t.shape) for n, t in tensors.items()}
        np.savez(out, **arrays)
    elif fmt == "flax":
        from flax import serialization

        out.write(serialization.msgpack_serialize(_numpy_tree(state_dict)))
    else:
        raise AssertionError(fmt)


def _numpy_tree(value: Any) -> Any:
    import numpy as np

    if isinstance(value, Mapping):
        return {k: _numpy_tree(v) for k, v in value.items()}
    return np.asarray(value) if is_array(value) and not is_torch(value) else value
