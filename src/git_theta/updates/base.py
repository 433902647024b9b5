"""The contract of an update type: how a change to one tensor is stored and applied."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from git_theta.errors import ObjectCorruptError, UsageError
from git_theta.records import NamedTuple
from git_theta.store import ObjectBytes

Buffer = bytes | bytearray | memoryview
Payload = ObjectBytes  # a stored update: bytes, or a read-only mapping of its object file
# An update smaller than this fraction of the previous dense value cannot lose to a new
# dense value worth computing: auto and the chain bound skip that encode. A tensor's
# dense size moves little between versions (fine-tuning noise keeps its entropy), so a
# full-tensor delta at 0.80-0.84 of it (MiniLM's last layer after 1e-3 noise) need not
# be compared: that dense encode was a fifth of such an add's CPU.
CLEAR_WIN = 0.85


def factor_objects(count: int) -> str:
    """``count`` factor objects, in words ("1 factor object", "2 factor objects")."""
    return f"{count} factor object{'' if count == 1 else 's'}"


class Picked(NamedTuple):
    """What an update type chose to store for one tensor (see ``pick_linked``).

    ``operands``: objects stored as links of their own right before the update's link
    (update type ``factor``): each the dense object of one factor tensor, so a file
    holding the same tensor (a committed adapter) stores the same object. They are
    returned, not kept on the plugin: values are encoded in parallel threads.
    """

    key: str
    parts: list[bytes] | None
    operands: tuple[list[bytes], ...] = ()

    def size(self) -> int:
        """The bytes this adds to the store at most: the payload and its operands."""
        own = sum(map(len, self.parts)) if self.parts is not None else 0
        return own + sum(len(p) for parts in self.operands for p in parts)


class UpdateType(ABC):
    """Stores a tensor's new value as a payload relative to its previous value.

    ``apply(prev, encode(new, prev)) == new`` bit for bit for every lossless type.
    """

    key: ClassVar[str]
    codec: ClassVar[str]  # recorded in the manifest next to the object
    needs_previous: ClassVar[bool] = True
    # An operand link holds an input of the next link (``apply_with``), not a value.
    is_operand: ClassVar[bool] = False
    takes_operands: ClassVar[bool] = False

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

    def pick_linked(
        self,
        new: Buffer,
        prev: Buffer | None,
        dtype: str,
        dense: Callable[[], list[bytes]],
        dense_estimate: int | None = None,
        name: str = "",
        shape: tuple[int, ...] = (),
    ) -> Picked:
        """As ``pick``, for storing: the payload may leave inputs to operand objects
        (``Picked.operands``), which ``apply_with`` then receives. ``pick`` returns a
        payload holding everything (what ``apply`` reads); a type with no operands needs
        only that."""
        key, parts = self.pick(new, prev, dtype, dense, dense_estimate, name, shape)
        return Picked(key, parts)

    def with_inputs(self, path: str) -> UpdateType:
        """Return this type reading its per-tensor inputs (factors, scales) from ``path``.

        Raises UsageError for types that take none.
        """
        raise UsageError(f"update type {self.key!r} takes no --update-path")

    def summary(self, payload: Payload, limit: int | None = None) -> str:
        """One line on what a stored update says about the change (for diffs), if any
        (nothing for a payload it cannot read; ``limit`` as for ``apply``)."""
        return ""

    def summary_with(
        self, payload: Payload, operands: Sequence[Payload], limit: int | None = None
    ) -> str:
        """``summary`` of a payload stored after operand links (their objects, in order)."""
        return self.summary(payload, limit) if not operands else ""

    def apply_with(
        self,
        prev: bytearray | None,
        payload: Payload,
        operands: Sequence[Payload],
        dtype: str,
        limit: int | None = None,
    ) -> bytearray:
        """``apply``, given the objects of the operand links stored right before this
        link, in order (empty for a payload without). Raises ObjectCorruptError when
        they are not what the payload declares (a type taking none refuses any)."""
        if operands:
            raise ObjectCorruptError(
                f"{factor_objects(len(operands))} {'precede' if len(operands) > 1 else 'precedes'}"
                f" a {self.key} update, which takes none"
            )
        return self.apply(prev, payload, dtype, limit)

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
