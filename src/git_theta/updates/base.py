"""The contract of an update type: how a change to one tensor is stored and applied."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from git_theta.errors import UsageError
from git_theta.store import ObjectBytes

Buffer = bytes | bytearray | memoryview
Payload = ObjectBytes  # a stored update: bytes, or a read-only mapping of its object file
# An update smaller than this fraction of the previous dense value cannot lose to a new
# dense value worth computing: auto and the chain bound skip that encode. A tensor's
# dense size moves little between versions (fine-tuning noise keeps its entropy), so a
# full-tensor delta at 0.80-0.84 of it (MiniLM's last layer after 1e-3 noise) need not
# be compared: that dense encode was a fifth of such an add's CPU.
CLEAR_WIN = 0.85


class UpdateType(ABC):
    """Stores a tensor's new value as a payload relative to its previous value.

    ``apply(prev, encode(new, prev)) == new`` bit for bit for every lossless type.
    """

    key: ClassVar[str]
    codec: ClassVar[str]  # recorded in the manifest next to the object
    needs_previous: ClassVar[bool] = True

    @abstractmethod
    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        """Return the payload (parts to concatenate), or None when this type cannot store
        the change (the caller then stores a dense value)."""

    def pick(
        self,
        new: Buffer,
        prev: Buffer | None,
        dtype: str,
        dense: Callable[[], list[bytes]],
        dense_estimate: int | None = None,
        name: str = "",
        shape: tuple[int, ...] = (),
    ) -> tuple[str, list[bytes] | None]:
        """Return (key recorded in the manifest, payload); ``auto`` picks among types.

        ``dense()`` returns the (cached) dense encoding of ``new`` for comparisons;
        ``dense_estimate`` (the previous dense value's size) lets a clear win skip it;
        ``name`` and ``shape`` identify the tensor for types that take per-tensor inputs.
        """
        return self.key, self.encode(new, prev, dtype)

    def with_inputs(self, path: str) -> UpdateType:
        """Return this type reading its per-tensor inputs (factors, scales) from ``path``.

        Raises UsageError for types that take none.
        """
        raise UsageError(f"update type {self.key!r} takes no --update-path")

    def summary(self, payload: Payload, limit: int | None = None) -> str:
        """One line on what a stored update says about the change (for diffs), if any
        (nothing for a payload it cannot read; ``limit`` as for ``apply``)."""
        return ""

    @abstractmethod
    def apply(
        self, prev: bytearray | None, payload: Payload, dtype: str, limit: int | None = None
    ) -> bytearray:
        """Return the new value from the previous value and the payload. ``prev`` belongs
        to the caller's chain and is not used again: an update may change it in place.
        ``payload`` is bytes or a read-only mmap of the object: slicing either gives
        bytes, and ``memoryview(payload)`` reads it without a copy.

        Payloads come from repositories that may be hostile: ``limit`` is the most bytes
        the value may have (the manifest's shape x dtype), and nothing the payload
        declares may make this allocate more than it or than the payload's own size
        accounts for. Raises ObjectCorruptError (before allocating) when it would."""
