"""The contract a checkpoint format plugin fulfils."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import BinaryIO, ClassVar

from git_theta.errors import CheckpointError
from git_theta.records import NamedTuple

SNIFF_MAX = 4096  # the most bytes ``sniff`` is ever given (``head_size`` must not exceed it)

# Caps on what a file may claim, shared by every parser. A checkpoint is untrusted input
# (a cloned repository runs the filter on checkout): each cap sits far above what real
# models need and far below what would exhaust memory or time. docs/reliability.md says
# where each value comes from.
MAX_TENSORS = 1 << 16  # tensors in one file: 65,536, several times the most real files hold
MAX_ELEMENTS = 1 << 40  # elements in one tensor (4 TB of F32)
MAX_RANK = 64  # dimensions of one tensor (NumPy's own limit)
MAX_DEPTH = 100  # nesting of any structure a parser walks (state dicts nest a handful)
MAX_HEADER_BYTES = 64 << 20  # bytes a streaming header may take (all of it is kept as glue)

# read(n) returns exactly n bytes of the file or raises CheckpointError (truncated).
ReadExact = Callable[[int], bytes]


def shown(text: str) -> str:
    """``text`` (a name or type from the file) quoted for a one-line message: escaped
    like repr and cut to 80 characters."""
    quoted = repr(text)
    return quoted if len(quoted) <= 80 else quoted[:76] + "...'"


class LimitExceeded(CheckpointError):
    """A file claims more than one of the parsing caps above allows.

    ``claim`` is what the file claims (None when parsing stopped at the limit, before the
    whole claim was seen); the message names both and says the file is not trusted.
    """

    def __init__(self, what: str, claim: int | None, limit: int, unit: str = "") -> None:
        self.what = what
        self.claim = claim
        self.limit = limit
        unit = f" {unit}" if unit else ""
        said = f"is {claim}{unit}, over" if claim is not None else "is over"
        super().__init__(
            f"{what} {said} git-theta's limit of {limit}{unit}: the file is corrupt or crafted"
        )


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
