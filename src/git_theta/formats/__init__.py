"""Checkpoint formats: each one tells where a file's tensors lie; the rest is generic."""

from __future__ import annotations

from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat
from git_theta.formats.flax_msgpack import FlaxMsgpackFormat
from git_theta.formats.gguf import GgufFormat
from git_theta.formats.hdf5 import Hdf5Format
from git_theta.formats.numpy_npy import NpyFormat
from git_theta.formats.numpy_npz import NpzFormat
from git_theta.formats.safetensors import SafetensorsFormat
from git_theta.formats.torch_zip import TorchZipFormat
from git_theta.registry import Registry

FORMATS: Registry[CheckpointFormat] = Registry("git_theta.plugins.checkpoints", "checkpoint format")
# Built-ins are registered directly so the filter does not pay for an entry-point scan.
for _format in (
    SafetensorsFormat(), NpyFormat(), NpzFormat(), GgufFormat(), TorchZipFormat(),
    FlaxMsgpackFormat(), Hdf5Format(),
):  # fmt: skip
    FORMATS.register(_format.key, _format)


def detect(head: bytes, path: str) -> CheckpointFormat:
    """Return the format whose signature matches ``head`` (the file's first bytes).

    Raises CheckpointError naming the formats tried when none matches.
    """
    for scan in (False, True):
        formats = FORMATS.all(scan)
        for key in sorted(formats, key=lambda k: (formats[k].weak_sniff, k)):
            if formats[key].sniff(head, path):
                return formats[key]
    known = ", ".join(sorted(formats))
    raise CheckpointError(f"not a checkpoint in a known format (known: {known})")
