"""The manifest: the small text file git stores in place of a checkpoint.

It names, for every tensor, its dtype, shape, content hash and the chain of content objects
that rebuild it (a base value, then updates, never a commit hash), plus the non-tensor bytes
of the file ("glue") and the order in which glue and tensors make up the file.

Serialization is deterministic (fixed key order, one tensor per line) so equal content
gives equal bytes in any process, and diffs show one changed line per changed tensor.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from git_theta.errors import ManifestError
from git_theta.store import ObjectRef

VERSION = 1
PREFIX = b'{\n "git-theta": '


class Link(NamedTuple):
    """One step of a tensor's chain: an object and the update type that applies it."""

    update: str
    codec: str
    ref: ObjectRef


class TensorEntry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    hash: str  # blake3 of the tensor's exact bytes
    chain: tuple[Link, ...]


class Glue(NamedTuple):
    """The file's non-tensor bytes (headers, metadata, padding), stored as one object."""

    hash: str
    ref: ObjectRef


class Manifest(NamedTuple):
    format: str
    size: int
    glue: Glue
    # The file is the concatenation of these: an int takes the next N bytes of glue,
    # a string is the named tensor's bytes.
    layout: tuple[int | str, ...]
    tensors: dict[str, TensorEntry]

    def to_bytes(self) -> bytes:
        """Return the canonical serialization."""
        d = json.dumps
        lines = [
            "{",
            f' "git-theta": {VERSION},',
            f' "format": {d(self.format)},',
            f' "size": {self.size},',
            f' "glue": {d(_glue_dict(self.glue))},',
            ' "layout": [',
        ]
        items = [f"  {d(item)}" for item in self.layout]
        lines.append(",\n".join(items))
        lines.append(" ],")
        lines.append(' "tensors": {')
        entries = [
            f"  {d(name)}: {d(_entry_dict(self.tensors[name]))}" for name in sorted(self.tensors)
        ]
        lines.append(",\n".join(entries))
        lines.append(" }")
        lines.append("}")
        return ("\n".join(line for line in lines if line) + "\n").encode()


def is_manifest(data: bytes) -> bool:
    """Return True when ``data`` looks like a git-theta manifest (not a checkpoint)."""
    return data.startswith(PREFIX)


def _glue_dict(glue: Glue) -> dict[str, Any]:
    return {"hash": glue.hash, "oid": glue.ref.oid, "size": glue.ref.size}


def _entry_dict(entry: TensorEntry) -> dict[str, Any]:
    return {
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "hash": entry.hash,
        "chain": [
            {"update": ln.update, "codec": ln.codec, "oid": ln.ref.oid, "size": ln.ref.size}
            for ln in entry.chain
        ],
    }


def _ref(d: Any) -> ObjectRef:
    oid, size = d["oid"], d["size"]
    if not (isinstance(oid, str) and len(oid) == 64 and isinstance(size, int)):
        raise ValueError("bad object reference")
    return ObjectRef(oid, size)


def parse(data: bytes) -> Manifest:
    """Parse a manifest. Raises ManifestError when it is malformed or too new."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or "git-theta" not in raw:
        raise ManifestError("not a git-theta manifest")
    version = raw["git-theta"]
    if not isinstance(version, int) or version > VERSION:
        raise ManifestError(
            f"manifest version {version} is newer than this git-theta supports ({VERSION}); "
            "upgrade git-theta"
        )
    try:
        glue = Glue(raw["glue"]["hash"], _ref(raw["glue"]))
        layout = tuple(raw["layout"])
        tensors = {
            name: TensorEntry(
                dtype=e["dtype"],
                shape=tuple(int(x) for x in e["shape"]),
                hash=e["hash"],
                chain=tuple(Link(ln["update"], ln["codec"], _ref(ln)) for ln in e["chain"]),
            )
            for name, e in raw["tensors"].items()
        }
        manifest = Manifest(str(raw["format"]), int(raw["size"]), glue, layout, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"manifest is malformed: {exc!r}") from None
    for item in layout:
        if isinstance(item, str) and item not in tensors:
            raise ManifestError(f"manifest layout names unknown tensor {item!r}")
        if not isinstance(item, int | str) or isinstance(item, bool):
            raise ManifestError("manifest layout holds a bad item")
    return manifest
