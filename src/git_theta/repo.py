"""The repository a command works in, with what it needs looked up once."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

from git_theta import git
from git_theta.store import ObjectStore

if TYPE_CHECKING:  # imported where used: the filter answers git's handshake first
    from collections.abc import Callable, Iterable

    from git_theta.identity import Known
    from git_theta.manifest import Manifest
    from git_theta.store import ObjectRef
    from git_theta.transfer import Downloader


class Repo:
    """Lazily resolves the object store; one instance serves a whole filter process."""

    def __init__(self, cwd: str | None = None):
        self.cwd = cwd
        self._parsed: dict[str, Manifest | None] = {}  # blob id -> manifest (None: invalid)

    @cached_property
    def store(self) -> ObjectStore:
        return ObjectStore(git.lfs_storage_dir(self.cwd))

    @cached_property
    def downloader(self) -> Downloader:
        from git_theta.transfer import Downloader

        return Downloader(self.store, self.cwd)

    def fetch(self, refs: Iterable[ObjectRef]) -> None:
        """Download whichever of ``refs`` are missing (``Downloader.fetch``). The
        downloader, and transfer.py's imports (pathlib, urllib: ~4 ms), are only made
        once something is missing: a checkout whose objects are local never needs them."""
        self.downloader.fetch(refs)

    def failure(self) -> str:
        """Why git-lfs could not download something ("" when nothing was fetched); what
        smudge's error names, as for a Downloader's own ``fetch``."""
        return self.downloader.failure() if "downloader" in self.__dict__ else ""

    def close(self) -> None:
        """Stop helper processes (git-lfs) this repository started."""
        if "downloader" in self.__dict__:
            self.downloader.close()

    def staged_manifest(self, path: str) -> Manifest | None:
        """Return the manifest staged for ``path``, or None when there is none to reuse."""
        return self.staged_manifest_soon(path)()

    def staged_manifest_soon(self, path: str) -> Callable[[], Manifest | None]:
        """Start reading the manifest staged for ``path`` and return the function that
        returns it as ``staged_manifest`` does: git reads it while the caller imports
        what it needs (the first file of a filter process)."""
        blob_of = git.index_blob_soon(path, self.cwd)

        def staged() -> Manifest | None:
            from git_theta.errors import ManifestError
            from git_theta.manifest import MAX_BYTES, is_manifest, parse

            blob = blob_of(MAX_BYTES)  # a larger one is no manifest
            if blob is None or not is_manifest(blob):
                return None
            try:
                return parse(blob)
            except ManifestError:
                return None

        return staged

    def _parse_blob(self, oid: str, data: bytes) -> Manifest | None:
        """The manifest in blob ``oid``, parsed once per process; None when it is invalid
        (a hostile or newer one: identity ignores it)."""
        from git_theta.errors import ManifestError
        from git_theta.manifest import parse

        if oid not in self._parsed:
            try:
                self._parsed[oid] = parse(data)
            except ManifestError:
                self._parsed[oid] = None
        return self._parsed[oid]

    @cached_property
    def known(self) -> Known:
        """The tensors of the other manifests of this repository (the index's, HEAD's,
        and those this process writes), read when a clean first needs them."""
        from git_theta.history import identity_blobs
        from git_theta.identity import Blob, Known

        def blobs(near: str) -> list[Blob]:
            return [Blob(*found) for found in identity_blobs(near, self.cwd)]

        # Parsed only when the prefilter finds a looked-up hash or name in its text.
        return Known(blobs=blobs, parse=self._parse_blob)
