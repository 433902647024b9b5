"""Three-way merge of manifests, tensor by tensor.

A tensor changed on one side only takes that side's entry; changed the same way on both,
either; changed differently on both, it is a conflict. The file's non-tensor bytes (the
header, which names every tensor's dtype and shape) follow the same rule as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from git_theta.manifest import Manifest, TensorEntry

T = TypeVar("T")


@dataclass
class MergeResult:
    manifest: Manifest
    conflicts: list[str] = field(default_factory=list)


def _pick(base: T | None, ours: T | None, theirs: T | None) -> tuple[T | None, bool]:
    """Return (merged value, clean?) for one item."""
    if ours == theirs:
        return ours, True
    if ours == base:
        return theirs, True
    if theirs == base:
        return ours, True
    return ours, False


def _same(a: TensorEntry | None, b: TensorEntry | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.dtype, a.shape, a.hash) == (b.dtype, b.shape, b.hash)


def merge3(base: Manifest | None, ours: Manifest, theirs: Manifest) -> MergeResult:
    """Merge ``theirs`` into ``ours`` relative to ``base``; list conflicting tensors."""
    b_tensors = base.tensors if base else {}
    conflicts: list[str] = []
    tensors: dict[str, TensorEntry] = {}
    for name in sorted(set(b_tensors) | set(ours.tensors) | set(theirs.tensors)):
        b, o, t = b_tensors.get(name), ours.tensors.get(name), theirs.tensors.get(name)
        # Equal content counts as unchanged even when stored through different chains.
        if _same(o, t) or _same(t, b):
            chosen = o
        elif _same(o, b):
            chosen = t  # only theirs changed it
        else:
            chosen = o
            conflicts.append(name)
        if chosen is not None:
            tensors[name] = chosen
    b_frame = (base.format, base.size, base.glue, base.layout) if base else None
    frame, clean = _pick(
        b_frame,
        (ours.format, ours.size, ours.glue, ours.layout),
        (theirs.format, theirs.size, theirs.glue, theirs.layout),
    )
    assert frame is not None
    if not clean:
        conflicts.insert(0, "(file header: both sides changed dtypes, shapes or tensor names)")
    fmt, size, glue, layout = frame
    names = {item for item in layout if isinstance(item, str)}
    missing = sorted(names - set(tensors))
    if missing and clean:
        conflicts.append(f"(header names tensors one side removed: {', '.join(missing)})")
    for name in missing:
        entry = ours.tensors.get(name) or theirs.tensors.get(name)
        if entry is not None:
            tensors[name] = entry
    merged = Manifest(fmt, size, glue, layout, {n: e for n, e in tensors.items() if n in names})
    return MergeResult(merged, conflicts)
