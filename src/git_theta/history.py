"""Finding the manifests stored in git: in a revision's tree, or in commits being pushed."""

from __future__ import annotations

from git_theta import git
from git_theta.errors import ManifestError
from git_theta.manifest import MAX_BYTES, PREFIX, Manifest, is_manifest, parse

MAX_MANIFEST = MAX_BYTES  # larger blobs are not candidate manifests (parse refuses them)


def manifest_blobs(
    blobs: list[tuple[str, str]], cwd: str | None = None
) -> list[tuple[str, str, bytes]]:
    """Return (blob id, path, content) for those of ``blobs`` that are manifests, unparsed."""
    sizes = git.blob_sizes(sorted({oid for oid, _ in blobs}), cwd)
    wanted = [oid for oid, size in sizes.items() if size <= MAX_MANIFEST]
    contents = git.blobs_starting_with(wanted, PREFIX, cwd)
    return [
        (oid, path, data)
        for oid, path in blobs
        if (data := contents.get(oid)) is not None and is_manifest(data)
    ]


def _parse_all(blobs: list[tuple[str, str]], cwd: str | None) -> list[tuple[str, Manifest]]:
    found: list[tuple[str, Manifest]] = []
    for oid, path, data in manifest_blobs(blobs, cwd):
        try:
            found.append((path, parse(data)))
        except ManifestError as exc:
            raise ManifestError(f"{path} (blob {oid}): {exc}") from None
    return found


def manifests_at(rev: str, cwd: str | None = None) -> list[tuple[str, Manifest]]:
    """Return (path, manifest) for every checkpoint in ``rev``'s tree."""
    return _parse_all(git.tree_blobs(rev, cwd), cwd)


def manifests_between(
    include: list[str], exclude: list[str], cwd: str | None = None
) -> list[tuple[str, Manifest]]:
    """Return (path, manifest) for every manifest blob in ``include`` not in ``exclude``."""
    return _parse_all(git.new_blobs(include, exclude, cwd), cwd)


def manifests_in_index(cwd: str | None = None) -> list[tuple[str, Manifest]]:
    """Return (path, manifest) for every manifest staged in the index."""
    return _parse_all(git.index_blobs(cwd), cwd)
