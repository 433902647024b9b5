"""Side-loaded updates: ``git theta add PATH --update-type sparse|low-rank|ia3
--update-data FILE`` (or ``GIT_THETA_UPDATE_DATA_PATH=FILE``), as the predecessor had them.

FILE says what to add to the staged version of PATH: the committed value of each tensor
it names is the staged value plus the update (sparse: the predecessor's ``T/data``,
``T/indices``, ``T/indptr``, ``T/shape``, a 1 x N CSR matrix; low-rank: ``T/R``, ``T/C``;
ia3: ``T/ia3``; any format git-theta reads), and PATH is rewritten to exactly that, so
``git status`` is clean. This holds per tensor, as the predecessor had it: a named tensor
that PATH changed since it was staged keeps PATH's value (for low-rank and ia3 the factors
are then how it is stored, as with ``--update-path``), and so does every tensor FILE does
not name. The new version is staged first (cleaned in this process, the manifest put in
the index), then PATH is replaced in one rename: a failure before that changes nothing.
Errors name the file that is wrong: FILE, or PATH.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from git_theta.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from git_theta.api._stage import Where
    from git_theta.formats.base import TensorSpan
    from git_theta.manifest import Manifest
    from git_theta.repo import Repo
    from git_theta.tensor_files import FileTensor as Stored
    from git_theta.updates.base import UpdateType

DATA_ENV = "GIT_THETA_UPDATE_DATA_PATH"
TYPES = ("sparse", "low-rank", "ia3")
_SPARSE_KEYS = ("data", "indices", "indptr", "shape")
_CHUNK = 4 << 20


class UpdateDataError(UsageError):
    """The update file is unreadable, or does not fit the checkpoint it is applied to."""


def read_tensors(path: str) -> dict[str, Stored]:
    """Every tensor of the checkpoint file ``path``, in any format git-theta reads (no
    pickle code runs); raises UpdateDataError naming ``path`` when it cannot be read."""
    from git_theta.tensor_files import read_tensors as read_file

    try:
        return read_file(path).tensors
    except FileNotFoundError:
        raise UpdateDataError(f"--update-data {path}: no such file") from None
    except (CheckpointError, OSError) as exc:
        raise UpdateDataError(f"{path}: {exc}") from None


# --- what the update file says, per tensor -------------------------------------------

Apply = Callable[[bytes | bytearray, str, tuple[int, ...]], bytes]


def _numpy(stored: Stored, what: str) -> Any:
    from git_theta.api._arrays import numpy_dtype

    dtype = numpy_dtype(stored.dtype)
    if dtype is None:
        raise ValueError(f"{what} has dtype {stored.dtype}, which is not a number type")
    import numpy as np

    return np.frombuffer(stored.data, dtype=dtype).reshape(stored.shape)


def sparse_updates(data_path: str) -> dict[str, Apply]:
    """Tensor name -> function adding that tensor's sparse update to its value. The file
    holds the predecessor's layout: ``T/data``, ``T/indices``, ``T/indptr`` and
    ``T/shape``, the update as a 1 x N CSR matrix over the flattened tensor."""
    tensors = read_tensors(data_path)
    groups: dict[str, dict[str, Stored]] = {}
    for key, stored in tensors.items():
        name, _, part = key.rpartition("/")
        if name and part in _SPARSE_KEYS:
            groups.setdefault(name, {})[part] = stored
    if not groups:
        raise UpdateDataError(
            f"{data_path}: no sparse updates found (expected T/data, T/indices, T/indptr and "
            "T/shape for each tensor T)"
        )
    out = {}
    for name, parts in groups.items():
        missing = [k for k in ("data", "indices") if k not in parts]
        if missing:
            raise UpdateDataError(
                f"{data_path}: sparse update of {name!r} lacks {name}/{missing[0]}"
            )
        out[name] = _sparse_apply(data_path, name, parts)
    return out


def _sparse_apply(data_path: str, name: str, parts: dict[str, Stored]) -> Apply:
    import numpy as np

    try:
        values = _numpy(parts["data"], f"{name}/data").reshape(-1)
        indices = _numpy(parts["indices"], f"{name}/indices").reshape(-1)
        shape = (
            tuple(int(d) for d in _numpy(parts["shape"], "shape").reshape(-1))
            if ("shape" in parts)
            else None
        )
        indptr = _numpy(parts["indptr"], "indptr").reshape(-1) if "indptr" in parts else None
    except ValueError as exc:
        raise UpdateDataError(f"{data_path}: {exc}") from None
    if indices.dtype.kind not in "iu" or len(indices) != len(values):
        raise UpdateDataError(
            f"{data_path}: {name}/indices must be integers, one per value of {name}/data"
        )
    if indptr is not None and (len(indptr) != 2 or indptr[0] != 0 or indptr[1] != len(values)):
        raise UpdateDataError(
            f"{data_path}: {name}/indptr must be [0, {len(values)}] (one row: the flattened tensor)"
        )

    def apply(prev: bytes | bytearray, dtype: str, tensor_shape: tuple[int, ...]) -> bytes:
        from git_theta.api._arrays import numpy_dtype

        np_dtype = numpy_dtype(dtype)
        if np_dtype is None:
            raise UpdateDataError(f"{data_path}: {name!r} has dtype {dtype}: no sparse update")
        if shape is not None and shape != tensor_shape:
            raise UpdateDataError(
                f"{data_path}: {name}/shape is {list(shape)}, the tensor's {list(tensor_shape)}"
            )
        new = np.frombuffer(prev, dtype=np_dtype).copy()
        if len(indices) and (indices.min() < 0 or indices.max() >= new.size):
            raise UpdateDataError(
                f"{data_path}: {name}/indices go past the tensor's {new.size} elements"
            )
        added = values.astype(np_dtype)
        if np_dtype.kind in "biu" and not np.array_equal(added.astype(values.dtype), values):
            raise UpdateDataError(  # 1.5 or 300 into int8 would be cut or wrapped silently
                f"{data_path}: {name}/data holds values {dtype} cannot hold (the tensor's dtype)"
            )
        # Only the listed elements change: an unlisted -0.0 stays -0.0.
        np.add.at(new, indices.astype(np.int64), added)
        return new.tobytes()

    return apply


def factored_updates(data_path: str, update_type: str) -> tuple[UpdateType, Callable[[str], Any]]:
    """(the plugin configured with the file's factors, name -> (key, that tensor's
    candidate factors)), through the same reader and matching ``--update-path`` uses."""
    from git_theta.updates import UPDATES

    try:
        plugin = UPDATES.get(update_type).with_inputs(data_path)
    except CheckpointError as exc:
        raise UpdateDataError(f"{data_path}: {exc}") from None
    from git_theta.updates.factored import Factored, candidates_for

    assert isinstance(plugin, Factored)
    inputs = plugin.inputs  # the one matching of names, shared with --update-path
    return plugin, lambda name: candidates_for(inputs, name)


# --- the rewritten file --------------------------------------------------------------


_Bytes = bytes | Callable[[], bytes]  # given, or made when the stream reaches them


class Rewrite:
    """The checkpoint at ``path`` with some tensors' bytes replaced (same dtype and shape,
    so the same layout), produced as a stream as often as needed; zip CRCs follow."""

    def __init__(self, path: str, spans: list[TensorSpan], new: dict[str, Callable[[], bytes]]):
        self.path = path
        self.size = os.path.getsize(path)
        self._replace = sorted(
            ((s.start, s.end, new[s.name]) for s in spans if s.name in new), key=lambda r: r[0]
        )
        self._patches: list[tuple[int, int, bytes]] = []
        self.zip = False

    def fix_zip_crcs(self) -> None:
        """Record the new CRC-32 of every zip member holding a replaced tensor."""
        from git_theta.files import open_regular
        from git_theta.formats.zip_glue import crc_fields

        with open_regular(self.path) as fh:
            members = crc_fields(fh, self.size)
        for member in members:
            inside = [r for r in self._replace if member.start <= r[0] and r[1] <= member.end]
            if not inside:
                continue
            crc = 0
            for piece in self._pieces(member.start, member.end, inside):
                crc = zlib.crc32(piece, crc)
            value = struct.pack("<I", crc)
            for at in member.crc_at:
                self._patches.append((at, at + 4, value))

    def _pieces(
        self, start: int, end: int, replace: Sequence[tuple[int, int, _Bytes]]
    ) -> Iterator[bytes]:
        from git_theta.files import open_regular

        with open_regular(self.path) as fh:
            pos = start
            for r_start, r_end, make in sorted(replace, key=lambda r: r[0]):
                yield from _copy_range(fh, pos, r_start)
                data = make if isinstance(make, bytes) else make()
                assert len(data) == r_end - r_start
                yield data
                pos = r_end
            yield from _copy_range(fh, pos, end)

    def pieces(self) -> Iterator[bytes]:
        """The new file's bytes, front to back."""
        every: list[tuple[int, int, _Bytes]] = [*self._replace, *self._patches]
        return self._pieces(0, self.size, every)


def _copy_range(fh: BinaryIO, start: int, end: int) -> Iterator[bytes]:
    fh.seek(start)
    left = end - start
    while left > 0:
        piece = fh.read(min(left, _CHUNK))
        if not piece:
            raise CheckpointError("file changed while it was read")
        left -= len(piece)
        yield piece


class _IterSource:
    """clean's ``Source`` over an iterator of pieces."""

    def __init__(self, pieces: Iterator[bytes], tee: BinaryIO | None = None):
        self._pieces = pieces
        self._left = memoryview(b"")
        self._tee = tee  # receives every piece as it is taken

    def readinto(self, out: memoryview) -> int:
        done = 0
        while done < len(out):
            if not self._left:
                piece = next(self._pieces, None)
                if piece is None:
                    break
                if self._tee is not None:
                    self._tee.write(piece)
                self._left = memoryview(piece)
            n = min(len(self._left), len(out) - done)
            out[done : done + n] = self._left[:n]
            self._left = self._left[n:]
            done += n
        return done

    def read(self, n: int = -1) -> bytes:
        parts = []
        want = n if n >= 0 else 1 << 62
        while want > 0:
            buf = bytearray(min(want, _CHUNK))
            got = self.readinto(memoryview(buf))
            if not got:
                break
            parts.append(bytes(buf[:got]))
            want -= got
        return b"".join(parts)


# --- the command ---------------------------------------------------------------------


def add_with_update_data(paths: list[str], update_type: str | None, data_path: str) -> int:
    """``git theta add PATHS --update-type TYPE --update-data FILE``; returns 0. Raises
    UsageError (naming FILE or the checkpoint) when they do not fit."""
    if update_type not in TYPES:
        raise UsageError("--update-data needs --update-type sparse, low-rank or ia3")
    if not os.path.lexists(data_path):
        raise UsageError(f"--update-data {data_path}: no such file")
    if not os.path.isfile(data_path):
        raise UsageError(f"--update-data {data_path}: not a regular file")
    # Messages name the file as the user gave it; it is read from where it is now.
    # git's filter, run for the refresh, refuses the variable: it is unset meanwhile and
    # put back after, so an in-process caller's environment ends as it began.
    given = os.environ.pop(DATA_ENV, None)
    from git_theta.api._stage import Where, require_tracked
    from git_theta.repo import Repo

    try:
        for path in paths:
            where = Where(".", path)
            require_tracked(where)
            repo = Repo(where.top)
            try:
                _add_one(repo, where, path, update_type, data_path)
            finally:
                repo.close()
    finally:
        if given is not None:
            os.environ[DATA_ENV] = given
    return 0


def _add_one(repo: Repo, where: Where, shown: str, update_type: str, data_path: str) -> None:
    """Apply the update to each tensor it names that is unchanged since it was staged;
    a named tensor the file changed keeps the file's value (stored as ``--update-path``
    stores it for low-rank and ia3, as a sparse change for sparse). Stage, then rewrite
    the file when anything was applied."""
    previous = repo.staged_manifest(where.path)
    if previous is None:
        raise UsageError(
            f"{shown} has no staged git-theta version to apply {data_path} to: "
            f"`git add {shown}` (and commit) it first"
        )
    if not os.path.isfile(where.full):
        raise UsageError(f"{shown}: no such file in the work tree (`git checkout -- {shown}`)")
    spans = _file_spans(where.full)
    named = _named_updates(where.full, shown, spans, update_type, data_path)
    plugin, applies = named
    new = {
        span.name: _lazy(where.full, span, applies[span.name])
        for span in spans
        if span.name in applies and _as_staged(where.full, span, previous)
    }
    kept = len(applies) - len(new)
    rewrite = Rewrite(where.full, spans, new)
    if new and _is_zip(where.full):
        rewrite.fix_zip_crcs()
    import contextlib

    from git_theta.api._stage import (
        clean_to_manifest,
        install_hooks_quietly,
        refresh,
        stage_manifest,
    )
    from git_theta.files import AtomicWriter

    # The new file is written (to a temporary beside PATH) from the very stream cleaned,
    # and renamed in only once the manifest is staged: a failure before changes nothing.
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(AtomicWriter(where.full, within=where.top)) if new else None
        source = _IterSource(rewrite.pieces(), out)
        manifest = clean_to_manifest(repo, where, source, lambda _: plugin)
        while source.read(_CHUNK):  # the whole file reaches the temporary, whatever clean read
            pass
        stage_manifest(where, manifest)
    refresh(where)
    install_hooks_quietly(where.top)
    said = f"git-theta: {shown}: applied the {update_type} update from {data_path} to "
    said += f"{len(new)} tensor{'s' * (len(new) != 1)}"
    if kept:
        said += (
            f"; {kept} it names changed in the file since it was staged and are added as "
            f"they are in it (to apply it to them, `git checkout -- {shown}` first)"
        )
    sys.stderr.write(said + "\n")


def _named_updates(
    path: str, shown: str, spans: list[TensorSpan], update_type: str, data_path: str
) -> tuple[UpdateType, dict[str, Apply]]:
    """(the update type to store with, tensor name -> its update) for every tensor of the
    file the update names; raises UpdateDataError naming ``data_path`` when it names a
    tensor the file lacks, or none of them."""
    from git_theta.updates import UPDATES

    by_name = {s.name: s for s in spans}
    if update_type == "sparse":
        applies = sparse_updates(data_path)
        for name in applies:
            if name not in by_name:
                raise UpdateDataError(f"{data_path}: {shown} has no tensor {name!r}")
        return UPDATES.get("sparse"), applies
    from git_theta.updates.factored import apply_update

    plugin, find = factored_updates(data_path, update_type)
    out: dict[str, Apply] = {}
    for span in spans:
        _key, candidates = find(span.name)
        if not candidates:
            continue

        def apply(prev: bytes | bytearray, dtype: str, shape: tuple[int, ...],
                  candidates: Any = candidates, name: str = span.name) -> bytes:  # fmt: skip
            try:  # H3's definition: previous + update, as torch merges it
                return apply_update(prev, dtype, shape, candidates)
            except UsageError as exc:
                raise UpdateDataError(f"{data_path}: {name!r}: {exc}") from None

        out[span.name] = apply
    if not out:
        raise UpdateDataError(f"{data_path}: none of its factors name a tensor of {shown}")
    return plugin, out


def _as_staged(path: str, span: TensorSpan, previous: Manifest) -> bool:
    """Whether the file holds the staged value of ``span``'s tensor (same dtype, shape
    and content hash)."""
    from git_theta.content import content_hash_of
    from git_theta.files import open_regular

    entry = previous.tensors.get(span.name)
    if entry is None or (entry.dtype, entry.shape) != (span.dtype, span.shape):
        return False
    with open_regular(path) as fh:
        fh.seek(span.start)
        return content_hash_of(fh.read, span.end - span.start) == entry.hash


def _lazy(path: str, span: TensorSpan, apply: Apply) -> Callable[[], bytes]:
    """The new value of ``span``'s tensor, computed from the file each time it is asked
    for (the rewrite streams the file more than once; values are not all held)."""

    def make() -> bytes:
        from git_theta.files import open_regular

        with open_regular(path) as fh:
            fh.seek(span.start)
            prev = fh.read(span.end - span.start)
        out = apply(prev, span.dtype, span.shape)
        if len(out) != len(prev):
            raise UpdateDataError(f"the update of {span.name!r} changes its size")
        return out

    return make


def _file_spans(path: str) -> list[TensorSpan]:
    from git_theta.files import open_regular
    from git_theta.tensor_files import tensor_spans

    with open_regular(path) as fh:  # the work tree's file: no link followed
        return tensor_spans(fh, path)[1]


def _is_zip(path: str) -> bool:
    from git_theta.files import open_regular

    with open_regular(path) as fh:
        return fh.read(4) == b"PK\x03\x04"
