"""Checkpoint formats: each one tells where a file's tensors lie; the rest is generic.

Every caller goes through ``header_spans`` / ``file_spans`` (never a format's
``read_header`` / ``read_spans`` directly): they are the boundary where whatever a
parser raised on a hostile file becomes one CheckpointError, and where every span a
format returns is checked (``check_spans``), so no format has to be trusted with shapes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from git_theta.dtypes import expected_nbytes
from git_theta.errors import CheckpointError, ThetaError
from git_theta.formats.base import (
    MAX_ELEMENTS,
    MAX_HEADER_BYTES,
    MAX_RANK,
    MAX_TENSORS,
    CheckpointFormat,
    LimitExceeded,
    ReadExact,
    TensorSpan,
    shown,
)
from git_theta.registry import Registry

FORMATS: Registry[CheckpointFormat] = Registry("git_theta.plugins.checkpoints", "checkpoint format")
# Built-ins in sniffing order: a signature format before any structural sniff that could
# also accept its heads, flax's weak sniff last. They load one at a time as detect()
# reaches them (no entry-point scan either): a safetensors add never imports the pickle
# reader (12 ms with dataclasses) or msgpack's, nor gguf's, hdf5's or npy's (~1 ms): no
# head of theirs passes safetensors' sniff (read as its length field, each signature is
# over 100 MB; tests/test_startup.py checks), while a crafted zip's can.
_BUILT_IN = (
    ("npz", "numpy_npz:NpzFormat"),
    ("safetensors", "safetensors:SafetensorsFormat"),
    ("gguf", "gguf:GgufFormat"),
    ("hdf5", "hdf5:Hdf5Format"),
    ("npy", "numpy_npy:NpyFormat"),
    ("torch", "torch_zip:TorchZipFormat"),
    ("flax", "flax_msgpack:FlaxMsgpackFormat"),
)
for _key, _where in _BUILT_IN:
    FORMATS.register_lazy(_key, f"git_theta.formats.{_where}")

# What a parser may raise on a hostile file when it did not foresee a case: nesting
# beyond the interpreter's recursion limit, sizes beyond a C long, a struct read past
# the end, bytes that are not text, a missing key or item.
_PARSER_ERRORS = (
    RecursionError, OverflowError, MemoryError, struct.error, UnicodeError, KeyError,
    IndexError, ValueError, TypeError, AttributeError, StopIteration, ZeroDivisionError,
)  # fmt: skip


@contextmanager
def _parsing(what: str) -> Iterator[None]:
    """Turn any of ``_PARSER_ERRORS`` raised inside into one CheckpointError line."""
    try:
        yield
    except ThetaError:
        raise
    except RecursionError:
        raise CheckpointError(
            f"{what} nests too deeply to parse: the file is corrupt or crafted"
        ) from None
    except MemoryError:
        raise CheckpointError(
            f"{what} claims more memory than there is: the file is corrupt or crafted"
        ) from None
    except _PARSER_ERRORS as exc:
        # The parser's own words, never its exception's name (users read this line).
        detail = str(exc).splitlines()[0][:200] if str(exc) else "it ends or breaks early"
        raise CheckpointError(
            f"{what} is corrupt ({detail}): check the file (save or download it again)"
        ) from None


def detect(head: bytes, path: str) -> CheckpointFormat:
    """Return the format whose signature matches ``head`` (the file's first bytes).

    Raises CheckpointError naming the formats tried when none matches.
    """
    with _parsing("checkpoint"):
        for key, _ in _BUILT_IN:
            built_in = FORMATS.get(key)
            if built_in.sniff(head, path):
                return built_in
        formats = FORMATS.all(scan=True)  # then plugins, also signatures before structure
        for key in sorted(formats, key=lambda k: (formats[k].weak_sniff, k)):
            if formats[key].sniff(head, path):
                return formats[key]
    known = ", ".join(sorted(formats))
    raise CheckpointError(f"not a checkpoint in a known format (known: {known})")


def header_spans(fmt: CheckpointFormat, read: ReadExact) -> list[TensorSpan]:
    """Run ``fmt.read_header`` on a stream (``read`` gives its bytes from the start);
    return the checked spans in file order.

    Raises CheckpointError (one line) for anything wrong with the file, including a
    header over MAX_HEADER_BYTES, which is refused before those bytes are read.
    """
    taken = 0

    def bounded(n: int) -> bytes:
        nonlocal taken
        if n < 0:
            raise CheckpointError(f"{fmt.key} header asks for a negative length")
        if taken + n > MAX_HEADER_BYTES:
            raise LimitExceeded(f"{fmt.key} header", taken + n, MAX_HEADER_BYTES, "bytes")
        data = read(n)
        taken += n
        return data

    with _parsing(f"{fmt.key} checkpoint"):
        spans = fmt.read_header(bounded)
    return check_spans(spans, taken)


def file_spans(fmt: CheckpointFormat, fh: BinaryIO, size: int) -> list[TensorSpan]:
    """Run ``fmt.read_spans`` on the seekable file ``fh`` of ``size`` bytes; return the
    checked spans in file order. Raises CheckpointError (one line)."""
    with _parsing(f"{fmt.key} checkpoint"):
        spans = fmt.read_spans(fh, size)
    return check_spans(spans, 0, size)


def check_spans(
    spans: list[TensorSpan], header_end: int, size: int | None = None
) -> list[TensorSpan]:
    """Return ``spans`` in file order once every claim in them holds: at most MAX_TENSORS;
    names and types are text; shapes are at most MAX_RANK non-negative ints of at most
    MAX_ELEMENTS elements; each span's length is what its shape and type need; spans lie
    after ``header_end``, inside ``size`` bytes when given, and do not overlap.

    Raises CheckpointError naming the first tensor that breaks one.
    """
    if len(spans) > MAX_TENSORS:
        raise LimitExceeded("tensor count", len(spans), MAX_TENSORS)
    for span in spans:
        _check_span(span, size)
    ordered = sorted(spans, key=lambda s: (s.start, s.end))
    pos = header_end
    seen: set[str] = set()
    for span in ordered:
        if span.name in seen:
            raise CheckpointError(f"tensor {shown(span.name)} appears twice")
        seen.add(span.name)
        if span.start < pos:
            raise CheckpointError(
                f"header lies about offsets: tensor {shown(span.name)} overlaps "
                "the header or another tensor"
            )
        pos = span.end
    return ordered


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_span(span: TensorSpan, size: int | None) -> None:
    name, dtype, shape, start, end = span
    if not isinstance(name, str) or not isinstance(dtype, str):
        raise CheckpointError(f"a tensor's name or type is not text ({_brief(name)})")
    if not (
        isinstance(shape, tuple)
        and len(shape) <= MAX_RANK
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise CheckpointError(
            f"tensor {shown(name)} has the shape {_brief(shape)}: a shape is at most {MAX_RANK} "
            "non-negative integers"
        )
    count = 1
    for d in shape:
        count *= d
    if count > MAX_ELEMENTS or max(shape, default=0) > MAX_ELEMENTS:
        raise LimitExceeded(f"tensor {shown(name)}'s element count", count, MAX_ELEMENTS)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)) or not (
        0 <= start <= end
    ):
        raise CheckpointError(f"tensor {shown(name)} has a bad byte range {_brief((start, end))}")
    if size is not None and end > size:
        raise CheckpointError(
            f"tensor {shown(name)} ends at byte {end}, past the end of the file ({size} bytes)"
        )
    length = end - start
    expected = expected_nbytes(dtype, shape)
    if expected == -1:
        raise CheckpointError(
            f"tensor {shown(name)} of {dtype} {list(shape)} is not a whole number of blocks"
        )
    if expected is not None and expected != length:
        raise CheckpointError(
            f"header lies about tensor {shown(name)}: {dtype} {list(shape)} needs "
            f"{expected} bytes but its data spans {length}"
        )
    # A type we do not know still has a whole, non-zero number of bytes per element.
    if expected is None and ((count == 0) != (length == 0) or (count and length % count)):
        raise CheckpointError(
            f"header lies about tensor {shown(name)}: {length} bytes cannot hold {count} "
            f"elements of {shown(dtype)}"
        )
