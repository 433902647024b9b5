"""``git-theta textconv``: show a manifest as one readable line per tensor for git diff."""

from __future__ import annotations

import sys
from pathlib import Path

from git_theta.manifest import is_manifest, parse


def render(data: bytes) -> str:
    """Return the text git diff compares for a manifest (or the raw text otherwise)."""
    if not is_manifest(data):
        return data.decode(errors="replace")
    manifest = parse(data)
    lines = [f"{manifest.format} checkpoint, {manifest.size} bytes, {len(manifest.tensors)} tensors"]
    for name in sorted(manifest.tensors):
        e = manifest.tensors[name]
        shape = "x".join(map(str, e.shape)) or "scalar"
        updates = "+".join(link.update for link in e.chain)
        lines.append(f"{name}\t{e.dtype}\t[{shape}]\t{updates}\t{e.hash[:16]}")
    return "\n".join(lines) + "\n"


def textconv(file: str) -> int:
    sys.stdout.write(render(Path(file).read_bytes()))
    return 0
