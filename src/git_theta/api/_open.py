"""A committed (or staged) version of a checkpoint, read lazily, tensor by tensor."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Literal

from git_theta import git, proc
from git_theta.errors import ManifestError, UsageError

Framework = Literal["numpy", "torch", "jax"]


def read_manifest_blob(top: str, rev: str | None, path: str) -> bytes:
    """The blob of ``path`` at ``rev`` (None: the staged version), capped at a manifest's
    largest size; raises UsageError when there is none, ManifestError when it is not a
    git-theta manifest."""
    from git_theta.manifest import MAX_BYTES, is_manifest

    spec = f":{path}" if rev is None else f"{rev}:{path}"
    done = proc.run("git", *git.NO_FILTER, "cat-file", "-s", spec, check=False, cwd=top)
    if done.returncode != 0:
        if rev is not None:
            require_revision(top, rev)
        where = "the index" if rev is None else f"revision {rev!r}"
        raise UsageError(f"{path} is not in {where}")
    if int(done.stdout) > MAX_BYTES:
        raise ManifestError(f"{spec}: {int(done.stdout):,} bytes, larger than any manifest")
    blob = git.git("cat-file", "blob", spec, cwd=top)
    if not is_manifest(blob):
        raise ManifestError(
            f"{spec} is not a git-theta manifest (a plain file, or a Git LFS pointer of a "
            "version stored before git-theta tracked the path)"
        )
    return blob


def _is_revision(top: str, rev: str) -> bool:
    done = proc.run("git", "rev-parse", "-q", "--verify", "--end-of-options", f"{rev}^{{tree}}",
                    check=False, cwd=top)  # fmt: skip
    return done.returncode == 0


def require_revision(top: str, rev: str) -> None:
    """Raise UsageError unless ``rev`` names a commit or tree. A name git would take for
    an option (``--output=FILE``) never reaches a git command line as one."""
    if rev.startswith("-") or not _is_revision(top, rev):
        raise UsageError(f"revision {rev!r} does not exist (a commit, branch or tag name)")


class Checkpoint:
    """One version of a checkpoint. Names, dtypes and shapes come from its manifest alone;
    ``ckpt[name]`` (NumPy), ``ckpt.torch(name)`` or ``ckpt.get(name, framework)`` decode,
    downloading when missing, only that tensor's objects."""

    def __init__(self, top: str, rev: str | None, path: str):
        from git_theta import smudge
        from git_theta.manifest import parse
        from git_theta.repo import Repo

        self.path = path
        self.rev = rev
        self.manifest = parse(read_manifest_blob(top, rev, path))
        self._repo = Repo(top)
        # smudge's bomb accounting for what this version rebuilt, tensor by tensor: a loop
        # over ``ckpt[name]`` meets the cap ``to_dict`` meets (a name counts once).
        self._counted: set[str] = set()
        self._rebuilt = smudge.Expansion()  # this version's own bomb accounting

    @property
    def format(self) -> str:
        """The checkpoint format's key (``safetensors``, ``pytorch``, ...)."""
        return self.manifest.format

    @property
    def names(self) -> list[str]:
        """Tensor names in file order."""
        return [item for item in self.manifest.layout if isinstance(item, str)]

    @property
    def dtypes(self) -> dict[str, str]:
        """Tensor name -> git-theta dtype name (``F32``, ``BF16``, ``F8_E4M3``...)."""
        return {n: e.dtype for n, e in self.manifest.tensors.items()}

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: e.shape for n, e in self.manifest.tensors.items()}

    def keys(self) -> list[str]:
        return self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.manifest.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.tensors

    def raw(self, name: str) -> bytearray:
        """The exact bytes of tensor ``name``, verified; raises KeyError for an unknown
        name, ObjectMissingError when its objects are neither local nor on the remote."""
        from git_theta import chains

        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise KeyError(name)
        store = self._repo.store
        if name not in self._counted:  # a tiny object claiming a huge shape is refused
            self._count(self.manifest._replace(tensors={name: entry}, size=_nbytes(entry)))
        missing = [link.ref for link in entry.chain if not store.has(link.ref)]
        if missing:
            self._repo.downloader.fetch(missing)
        return chains.rebuild(name, entry, store, limit=self.manifest.size)

    def get(self, name: str, framework: Framework = "numpy") -> Any:
        """Tensor ``name`` as a NumPy array, torch tensor or JAX array."""
        from git_theta.api import _arrays

        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise KeyError(name)
        data = self.raw(name)
        if framework == "numpy":
            return _arrays.to_numpy(data, entry.dtype, entry.shape)
        if framework == "torch":
            return _arrays.to_torch(data, entry.dtype, entry.shape)
        if framework == "jax":
            return _arrays.to_jax(data, entry.dtype, entry.shape)
        raise UsageError(f"framework {framework!r}: use 'numpy', 'torch' or 'jax'")

    def __getitem__(self, name: str) -> Any:
        return self.get(name, "numpy")

    def torch(self, name: str) -> Any:
        return self.get(name, "torch")

    def to_dict(self, framework: Framework = "numpy") -> dict[str, Any]:
        """Every tensor, decoded (fetching whatever is missing in one batch first)."""
        from git_theta import smudge

        rest = {n: e for n, e in self.manifest.tensors.items() if n not in self._counted}
        self._count(self.manifest._replace(tensors=rest, size=sum(map(_nbytes, rest.values()))))
        smudge.ensure_objects(self.manifest, self._repo.store, self._repo.downloader.fetch)
        return {name: self.get(name, framework) for name in self.names}

    def _count(self, part: Any) -> None:
        """Count the tensors of ``part`` (a manifest) as rebuilt by this version; raises
        ExpansionError, counting nothing, when they would pass smudge's cap."""
        from git_theta import smudge

        smudge.check_expansion(part, self._rebuilt)
        self._counted.update(part.tensors)

    def file_bytes_to(self, out: Any) -> None:
        """Write the whole checkpoint file, byte for byte as a checkout gives it, to ``out``
        (anything with ``write``)."""
        from git_theta import smudge

        smudge.write_checkpoint(self.manifest, out, self.path, self._repo.store, False,
                                self._repo.downloader.fetch, smudge.Expansion())  # fmt: skip

    def close(self) -> None:
        """Stop the downloader, if one was started."""
        self._repo.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _nbytes(entry: Any) -> int:
    from git_theta.manifest import tensor_nbytes

    n = tensor_nbytes(entry.dtype, entry.shape)
    return n if n is not None else sum(link.ref.size for link in entry.chain)


def open_checkpoint(rev: str | None, path: str | os.PathLike[str], repo: str = ".") -> Checkpoint:
    from git_theta.api._stage import Where

    where = Where(repo, path)
    return Checkpoint(where.top, rev, where.path)
