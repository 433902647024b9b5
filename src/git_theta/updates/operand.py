"""factor: an operand link, one factor tensor an update right after it consumes.

A low-rank or ia3 update stores its factors as links of their own, each the dense
object of that factor's bytes (``Dense.encode``), so the adapter file they come from,
committed too, stores the very same objects. The link holds no value: the chain fold
(``chains.apply_links``) passes its object to the next link's ``apply_with``.
"""

from __future__ import annotations

from git_theta.errors import ObjectCorruptError
from git_theta.manifest import OPERAND_UPDATE
from git_theta.updates.base import Buffer, Payload, UpdateType


class FactorOperand(UpdateType):
    key = OPERAND_UPDATE
    codec = "gtho1"  # a dense object, byte for byte
    needs_previous = False
    is_operand = True

    def encode(self, new: Buffer, prev: Buffer | None, dtype: str) -> list[bytes] | None:
        return None  # written by the update that consumes it, never chosen for a value

    def apply(
        self, prev: bytearray | None, payload: Payload, dtype: str, limit: int | None = None
    ) -> bytearray:
        raise ObjectCorruptError("a factor object is an input of the update after it")
