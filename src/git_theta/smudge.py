"""Smudge: a manifest -> the checkpoint's exact bytes, rebuilt tensor by tensor.

Every object is checked for presence before the first byte is written, so a missing
object fails the checkout without a partial file; each object's oid and each tensor's
content hash are verified as it is read.
"""

from __future__ import annotations

from git_theta import chains
from git_theta.content import content_hash
from git_theta.errors import ObjectCorruptError, ObjectMissingError
from git_theta.manifest import Manifest, is_manifest, parse
from git_theta.parallel import ordered_map
from git_theta.progress import Progress
from git_theta.protocol.filter_process import Sink, Source
from git_theta.store import ObjectStore


def missing_objects(manifest: Manifest, store: ObjectStore) -> list[tuple[str, str]]:
    """Return (what, oid) for every object the manifest needs that the store lacks."""
    out = []
    if not store.has(manifest.glue.ref):
        out.append(("the file's header", manifest.glue.ref.oid))
    for name in sorted(manifest.tensors):
        for link in manifest.tensors[name].chain:
            if not store.has(link.ref):
                out.append((f"tensor {name!r}", link.ref.oid))
    return out


def smudge(
    source: Source, sink: Sink, path: str, store: ObjectStore, show_progress: bool | None = None
) -> None:
    """Read a manifest from ``source`` and write the checkpoint it describes to ``sink``.

    Content that is not a manifest is passed through. Raises ObjectMissingError or
    ObjectCorruptError (naming the tensor and the object) before or while writing.
    """
    data = source.read()
    if not is_manifest(data):
        sink.write(data)
        return
    manifest = parse(data)
    missing = missing_objects(manifest, store)
    if missing:
        what, oid = missing[0]
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ObjectMissingError(f"object {oid} for {what}{more} is not in the local Git LFS store")
    from git_theta import codec

    glue = codec.decode(store.get(manifest.glue.ref))
    if content_hash(glue) != manifest.glue.hash:
        raise ObjectCorruptError(f"header object {manifest.glue.ref.oid} is corrupt")
    names = [item for item in manifest.layout if isinstance(item, str)]
    progress = Progress(f"checking out {path}", manifest.size, len(names), show_progress)

    def rebuild(name: str) -> bytearray:
        return chains.rebuild(name, manifest.tensors[name], store)

    def weight(name: str) -> int:
        entry = manifest.tensors[name]
        return sum(link.ref.size for link in entry.chain)

    values = ordered_map(rebuild, names, weight)
    glue_pos = 0
    for item in manifest.layout:
        if isinstance(item, int):
            sink.write(memoryview(glue)[glue_pos : glue_pos + item])
            glue_pos += item
        else:
            value = next(values)
            sink.write(value)
            progress.advance(len(value))
    progress.close()
