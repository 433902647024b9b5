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


# What identity reads (identity.py): enough for a checkpoint set of many shards, bounded
# so a repository of many checkpoints (or a hostile one) costs little time and memory.
IDENTITY_MAX_MANIFESTS = 256
IDENTITY_MAX_BYTES = 16 << 20  # in all: 16 MB of manifests parse to ~90 MB


def identity_blobs(near: str, cwd: str | None = None) -> list[tuple[int, str, str, bytes]]:
    """Return (source, path, blob id, content) of the manifests in the index (source 1)
    and in HEAD's tree (source 2), unparsed: those in directory ``near`` first, then the
    rest by path, up to IDENTITY_MAX_MANIFESTS blobs and IDENTITY_MAX_BYTES in all. A
    repository without commits has only the index; git failing gives what was read."""
    import posixpath

    from git_theta.errors import ThetaError

    listed: list[tuple[int, str, str]] = []
    try:
        listed += [(1, path, oid) for oid, path in git.index_blobs(cwd)]
        listed += [(2, path, oid) for oid, path in git.tree_blobs("HEAD", cwd)]
    except ThetaError:
        pass  # no HEAD yet (a first commit), or no index
    listed.sort(key=lambda item: (posixpath.dirname(item[1]) != near, item[0], item[1]))
    try:
        sizes = git.blob_sizes(sorted({oid for _, _, oid in listed}), cwd)
        order = [oid for _, _, oid in listed if len(PREFIX) <= sizes.get(oid, 0) <= MAX_MANIFEST]
        contents = _read_manifests(list(dict.fromkeys(order)), sizes, cwd)
    except ThetaError:
        return []
    return [
        (source, path, oid, data)
        for source, path, oid in listed
        if (data := contents.get(oid)) is not None
    ]


def _read_manifests(oids: list[str], sizes: dict[str, int], cwd: str | None) -> dict[str, bytes]:
    """The blobs of ``oids`` (in order) that are manifests, through one ``git cat-file
    --batch``, until IDENTITY_MAX_MANIFESTS or IDENTITY_MAX_BYTES is reached; other blobs
    are streamed past, never held. Raises CommandError when git fails."""
    from git_theta.errors import CommandError
    from git_theta.proc import start

    budget = IDENTITY_MAX_BYTES
    wanted: list[str] = []
    for oid in oids:  # a blob larger than what is left is not asked for at all
        if len(wanted) < 4 * IDENTITY_MAX_MANIFESTS and sizes[oid] <= budget:
            wanted.append(oid)
    if not wanted:
        return {}
    proc = start("git", "cat-file", "--batch", cwd=cwd)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("".join(f"{o}\n" for o in wanted).encode())
    proc.stdin.close()
    out = proc.stdout
    found: dict[str, bytes] = {}
    for _ in wanted:
        header = out.readline().split()
        if len(header) != 3:
            continue  # "<oid> missing"
        size = int(header[2])
        head = out.read(min(size, len(PREFIX)))
        keep = head == PREFIX and size <= budget and len(found) < IDENTITY_MAX_MANIFESTS
        if keep:
            data = head + out.read(size - len(head))
            if is_manifest(data):
                found[header[0].decode()] = data
                budget -= size
        else:
            left = size - len(head)
            while left > 0:
                left -= len(out.read(min(left, 1 << 20))) or left
        out.read(1)  # the newline after the content
    code = proc.wait()
    if code != 0:
        raise CommandError(("git", "cat-file", "--batch"), code, b"", b"")
    return found
