"""The tensors of a checkpoint file a user names (update data, factors): read the way a
checkpoint is (format detection, the same parsers, every span checked), so a ``.pt`` is
read through the pickle reader that runs nothing. Callers put their option's name on the
errors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from git_theta.records import NamedTuple

if TYPE_CHECKING:
    from git_theta.formats.base import TensorSpan


class FileTensor(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    data: bytes


class FileTensors(NamedTuple):
    format: str  # the format's key ("safetensors", "npz", ...)
    total: int  # tensors in the file, wanted or not
    tensors: dict[str, FileTensor]  # the wanted ones


def read_tensors(path: str, wanted: Callable[[str], bool] = lambda _name: True) -> FileTensors:
    """Return the tensors of the file ``path`` whose names are ``wanted``; only those are
    copied out (a whole model given by mistake costs its header, not its size).

    ``path`` is what the user typed, so a link of theirs is followed (a Hugging Face
    cache's snapshot files are links); what it leads to must be a regular file (a FIFO or
    device is refused without blocking). Raises CheckpointError when it is not a file
    git-theta reads, or is corrupt or truncated; OSError (UnsafeFileError) when it cannot
    be opened or is not a regular file.
    """
    from git_theta.files import open_regular

    with open_regular(os.path.realpath(path)) as fh:
        key, spans = tensor_spans(fh, path)
        out = {}
        for span in spans:
            if wanted(span.name):
                fh.seek(span.start)
                out[span.name] = FileTensor(span.dtype, span.shape, fh.read(span.end - span.start))
        return FileTensors(key, len(spans), out)


def tensor_spans(fh: BinaryIO, path: str) -> tuple[str, list[TensorSpan]]:
    """Return the format key and the tensor spans of the checkpoint open as ``fh`` (named
    ``path`` in messages). Raises CheckpointError when it is not a file git-theta reads, or
    is corrupt or truncated."""
    from git_theta.errors import CheckpointError
    from git_theta.formats import detect, file_spans, header_spans
    from git_theta.formats.base import SNIFF_MAX

    size = os.fstat(fh.fileno()).st_size
    fh.seek(0)
    fmt = detect(fh.read(SNIFF_MAX), path)
    fh.seek(0)
    if fmt.needs_seek:
        return fmt.key, file_spans(fmt, fh, size)

    def read(n: int) -> bytes:
        data = fh.read(n)
        if len(data) < n:
            raise CheckpointError(f"file is truncated at byte {fh.tell()}")
        return data

    return fmt.key, header_spans(fmt, read)
