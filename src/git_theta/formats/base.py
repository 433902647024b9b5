"""The contract a checkpoint format plugin fulfils."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import BinaryIO, ClassVar, NamedTuple

SNIFF_MAX = 4096  # the most bytes ``sniff`` is ever given (``head_size`` must not exceed it)

# read(n) returns exactly n bytes of the file or raises CheckpointError (truncated).
ReadExact = Callable[[int], bytes]


class TensorSpan(NamedTuple):
    """Where one tensor's bytes lie in the file (absolute offsets, end exclusive)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class CheckpointFormat(ABC):
    """A format reads its own header; storing, hashing and rebuilding are generic.

    The file is treated as tensor byte spans plus everything else ("glue"), which is kept
    verbatim, so every format checks out byte for byte.
    """

    key: ClassVar[str]
    head_size: ClassVar[int] = 16  # bytes ``sniff`` needs
    needs_seek: ClassVar[bool] = False  # True: read_spans on a seekable copy instead
    # True when ``sniff`` recognises a structure rather than a magic number (msgpack):
    # such formats are tried after every format with a real signature.
    weak_sniff: ClassVar[bool] = False

    @abstractmethod
    def sniff(self, head: bytes, path: str) -> bool:
        """Return True when ``head`` (the first ``head_size`` bytes) is this format."""

    @abstractmethod
    def read_header(self, read: ReadExact) -> list[TensorSpan]:
        """Read the header from the start of the file; return every tensor's span.

        Raises CheckpointError when the header is malformed. Spans must lie after the
        bytes this method consumed and must not overlap.
        """

    def read_spans(self, fh: BinaryIO, size: int) -> list[TensorSpan]:
        """For ``needs_seek`` formats (an index at the end, like zip): return every
        tensor's span in the seekable file ``fh`` of ``size`` bytes."""
        raise NotImplementedError
