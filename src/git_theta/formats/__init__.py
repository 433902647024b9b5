"""Checkpoint formats: each one tells where a file's tensors lie; the rest is generic."""

from __future__ import annotations

from git_theta.errors import CheckpointError
from git_theta.formats.base import CheckpointFormat
from git_theta.registry import Registry

FORMATS: Registry[CheckpointFormat] = Registry("git_theta.plugins.checkpoints", "checkpoint format")
# Built-ins in sniffing order: formats with a signature by key, structural sniffing last.
# They load one at a time as detect() reaches them (no entry-point scan either): a
# safetensors add never imports the pickle reader (12 ms with dataclasses) or msgpack's.
_BUILT_IN = (
    ("gguf", "gguf:GgufFormat"),
    ("hdf5", "hdf5:Hdf5Format"),
    ("npy", "numpy_npy:NpyFormat"),
    ("npz", "numpy_npz:NpzFormat"),
    ("safetensors", "safetensors:SafetensorsFormat"),
    ("torch", "torch_zip:TorchZipFormat"),
    ("flax", "flax_msgpack:FlaxMsgpackFormat"),
)
for _key, _where in _BUILT_IN:
    FORMATS.register_lazy(_key, f"git_theta.formats.{_where}")


def detect(head: bytes, path: str) -> CheckpointFormat:
    """Return the format whose signature matches ``head`` (the file's first bytes).

    Raises CheckpointError naming the formats tried when none matches.
    """
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
