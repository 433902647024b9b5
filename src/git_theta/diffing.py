"""What changed between two versions of a checkpoint, tensor by tensor.

Only tensors whose content hash differs are decoded; unchanged tensors cost nothing.
A version is a mapping of tensor name to ``TensorSide``: from a manifest (values come from
objects) or from a checkpoint file in the work tree (values come from the file). An npz
member saved compressed is kept as glue by clean, yet it is an array: it is a side too,
read by inflating its bytes (from the file, or from the manifest's glue object).
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, cast

from git_theta import chains, kernels
from git_theta.content import content_hash
from git_theta.dtypes import BLOCKS, FLOAT_KINDS, lookup
from git_theta.errors import CheckpointError, ThetaError
from git_theta.files import open_regular
from git_theta.formats import detect, file_spans, header_spans
from git_theta.formats.base import SNIFF_MAX
from git_theta.manifest import (
    MAX_TENSOR_BYTES,
    OPERAND_UPDATE,
    Link,
    Manifest,
    TensorEntry,
    tensor_nbytes,
)
from git_theta.parallel import ordered_map
from git_theta.store import ObjectStore

if TYPE_CHECKING:  # NumPy is imported where values are compared, not at start-up
    import numpy as np

    from git_theta.smudge import Expansion


@dataclass(frozen=True)
class TensorSide:
    dtype: str
    shape: tuple[int, ...]
    hash: str
    update: str  # how it is stored ("dense", ...; "file" for a work-tree file)
    objects: frozenset[tuple[str, int]]  # (oid, size) of its chain
    load: Callable[[], bytes | bytearray] | None  # None: values not available locally
    links: tuple[Link, ...] = ()  # its chain, when it comes from a manifest
    store: ObjectStore | None = None
    limit: int | None = None  # the most bytes its value may have (from its manifest)
    unreadable: str = ""  # why its values cannot be compared (a member over the inflate cap)
    merge: str = ""  # how a merge made this value ("ties density=0.5 ..."), from its manifest


# How a compressed npz member is stored: in the file's glue, as its deflated zip member.
DEFLATED = "deflated"


@dataclass
class TensorDiff:
    name: str
    status: str  # added, removed, modified
    old: TensorSide | None
    new: TensorSide | None
    numel: int = 0
    changed: int | None = None  # elements whose bits differ
    l2: float | None = None  # ||new - old||_2
    max_abs: float | None = None
    rel: float | None = None  # ||new - old|| / ||old||; None when ||old|| is 0 (see note)
    old_norm: float | None = None  # ||old||_2 (its finite values)
    blocks: tuple[int, int] | None = None  # block-quantized: (blocks changed, blocks)
    note: str = ""
    update_summary: str = ""  # from the stored update (sparse count, low-rank rank...)


@dataclass
class FileDiff:
    path: str
    tensors: list[TensorDiff] = field(default_factory=list)
    unchanged: int = 0
    params_changed: int = 0
    params_total: int = 0
    bytes_stored: int = 0  # bytes of objects new here that the old version never references
    stored_scope: str = "version"  # "file": only the old file's objects were known


def _limit(manifest: Manifest, entry: TensorEntry) -> int:
    """The most bytes ``entry``'s value may have: shape x dtype, else the file's size."""
    nbytes = tensor_nbytes(entry.dtype, entry.shape)
    return manifest.size if nbytes is None else nbytes


def manifest_objects(manifest: Manifest) -> set[tuple[str, int]]:
    """Return (oid, size) of every object ``manifest`` references: its glue and chains."""
    out = {(manifest.glue.ref.oid, manifest.glue.ref.size)}
    for entry in manifest.tensors.values():
        out.update((link.ref.oid, link.ref.size) for link in entry.chain)
    return out


_ZIP_TAIL = 65536 + 22  # what zip_entries reads to find the directory


class _GlueView:
    """The file a manifest describes, as a read-only file of its glue: the bytes of its
    tensors are not in hand and read as zeros (only glue is read through it)."""

    def __init__(self, glue: bytearray, pieces: list[tuple[int, int, int]], size: int):
        self._glue = memoryview(glue)
        self._pieces = pieces  # (offset in the file, offset in the glue, length)
        self._starts = [p[0] for p in pieces]
        self._size = size
        self._pos = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, pos + (0, self._pos, self._size)[whence])
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Return the next ``n`` bytes. Raises CheckpointError for more than the glue and
        a zip tail could need: a crafted directory must not make us allocate its claims."""
        start = self._pos
        end = self._size if n < 0 else min(self._size, start + n)
        if end - start > len(self._glue) + _ZIP_TAIL:
            raise CheckpointError("an npz member lies outside the file's non-tensor bytes")
        out = bytearray(max(0, end - start))
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._pieces) and self._pieces[i][0] < end:
            at, glue_at, length = self._pieces[i]
            lo, hi = max(at, start), min(at + length, end)
            if lo < hi:
                out[lo - start : hi - start] = self._glue[glue_at + lo - at : glue_at + hi - at]
            i += 1
        self._pos = max(start, end)
        return bytes(out)


def _glue_pieces(manifest: Manifest) -> list[tuple[int, int, int]] | None:
    """Where the glue lies in the file, or None when a tensor's size is not known from the
    manifest (an opaque dtype): then the offsets after it are not known either."""
    pieces, at, glue_at = [], 0, 0
    for item in manifest.layout:
        if isinstance(item, int):
            pieces.append((at, glue_at, item))
            at, glue_at = at + item, glue_at + item
            continue
        entry = manifest.tensors[item]
        nbytes = tensor_nbytes(entry.dtype, entry.shape)
        if nbytes is None:
            return None
        at += nbytes
    return pieces


def _member_side(
    name: str, data: bytes, reread: Callable[[], bytes], crc: int, room: int
) -> tuple[TensorSide, int]:
    """A deflated npz member as a side, and the bytes comparing it inflates (0 when it
    will not be): its hash is its compressed bytes' (equal bytes, equal array), its values
    are inflated when compared (``reread`` gives the bytes), unless its array is past
    ``inflate_cap`` or ``room`` (what is left of its file's budget)."""
    from git_theta.formats.numpy_npz import inflate_cap, member_array

    digest = content_hash(data)
    try:
        inner, _ = member_array(data, name, header_only=True)
    except CheckpointError as exc:
        side = TensorSide("?", (), digest, DEFLATED, frozenset(), None, unreadable=str(exc))
        return side, 0
    unreadable = ""
    if inner.end > inflate_cap(len(data)):
        unreadable = (
            f"not compared: it inflates to {inner.end:,} bytes from {len(data):,}, more "
            "than git-theta inflates"
        )
    elif inner.end > room:
        unreadable = (
            f"not compared: it inflates to {inner.end:,} bytes, past what git-theta "
            "inflates for one file"
        )

    def load() -> bytes | bytearray:
        return member_array(reread(), name, crc=crc)[1]

    side = TensorSide(
        inner.dtype, inner.shape, digest, DEFLATED, frozenset(), load, unreadable=unreadable
    )
    return side, 0 if unreadable else inner.end


def _deflated_sides(
    fh: BinaryIO, size: int, taken: Set[str], reread: Callable[[int, int], bytes], real: int
) -> dict[str, TensorSide]:
    """Sides for the deflated members of the npz ``fh`` (those not named in ``taken``:
    a name given twice is a crafted file, and the stored tensor wins). All of them
    inflate to at most ``inflate_cap(real)`` (``real``: the bytes the file really has),
    as smudge bounds a file's output, so many small bombs cost no more than one."""
    from git_theta.formats.numpy_npz import compressed_members, inflate_cap

    out = {}
    room = inflate_cap(real)
    for member in compressed_members(fh, size):
        if member.name in taken or member.name in out:
            continue
        fh.seek(member.start)
        data = fh.read(member.size)

        def again(start: int = member.start, n: int = member.size) -> bytes:
            return reread(start, n)

        out[member.name], inflated = _member_side(member.name, data, again, member.crc, room)
        room -= inflated
    return out


def _manifest_members(
    manifest: Manifest, store: ObjectStore, account: Expansion | None
) -> dict[str, TensorSide]:
    """The deflated members of an npz manifest, read from its glue object (none when that
    object is not local or the glue's place in the file is not known)."""
    if manifest.format != "npz" or not store.has(manifest.glue.ref):
        return {}
    pieces = _glue_pieces(manifest)
    if pieces is None:
        return {}
    from git_theta.smudge import check_expansion, read_glue

    # A small glue object claiming a huge glue: a bomb, as in smudge.
    check_expansion(manifest, account)
    glue = read_glue(manifest, store)
    view = _GlueView(glue, pieces, manifest.size)

    def reread(start: int, n: int) -> bytes:
        view.seek(start)
        return view.read(n)

    taken = manifest.tensors.keys()
    return _deflated_sides(cast(BinaryIO, view), manifest.size, taken, reread, len(glue))


def merge_text(entry: TensorEntry) -> str:
    """How a merge made ``entry``'s value, as "STRATEGY k=v ...", or ""."""
    if entry.merge is None:
        return ""
    return " ".join([entry.merge.strategy, *(f"{k}={v}" for k, v in entry.merge.params)])


def from_manifest(
    manifest: Manifest | None, store: ObjectStore, account: Expansion | None = None
) -> dict[str, TensorSide]:
    """Describe every tensor of ``manifest`` (empty for None), deflated npz members too
    (their glue counted against the expansion cap in ``account``: the process's, unless
    given; an API call, serving one request of a long-lived process, gives its own)."""
    if manifest is None:
        return {}
    out = _manifest_members(manifest, store, account)
    for name, entry in manifest.tensors.items():
        present = all(store.has(link.ref) for link in entry.chain)

        def load(name: str = name, entry: TensorEntry = entry) -> bytearray:
            return chains.rebuild(name, entry, store, limit=manifest.size)

        out[name] = TensorSide(
            entry.dtype,
            entry.shape,
            entry.hash,
            chain_label(entry.chain),
            frozenset((link.ref.oid, link.ref.size) for link in entry.chain),
            load if present else None,
            entry.chain,
            store,
            _limit(manifest, entry),
            merge=merge_text(entry),
        )
    return out


def from_file(
    path: str, visit: Callable[[str, str, bytes], None] | None = None
) -> dict[str, TensorSide]:
    """Describe every tensor of a checkpoint file on disk (hashing, not storing).

    Each tensor is read once; ``visit(name, dtype, data)`` sees its bytes while they are
    in hand (textconv computes norms there instead of reading the file again).
    """
    with open_regular(path) as fh:  # a work-tree file: never a FIFO, never via a symlink
        size = os.fstat(fh.fileno()).st_size
        fmt = detect(fh.read(SNIFF_MAX), path)
        fh.seek(0)

        def read(n: int) -> bytes:
            data = fh.read(n)
            if len(data) != n:
                raise CheckpointError("file is truncated")
            return data

        spans = file_spans(fmt, fh, size) if fmt.needs_seek else header_spans(fmt, read)
    out = {}
    for span in spans:

        def load(start: int = span.start, end: int = span.end) -> bytes:
            with open_regular(path) as fh:
                fh.seek(start)
                return fh.read(end - start)

        data = load()
        if visit is not None:
            visit(span.name, span.dtype, data)
        out[span.name] = TensorSide(
            span.dtype, span.shape, content_hash(data), "file", frozenset(), load
        )
    if fmt.key == "npz":

        def reread(start: int, n: int) -> bytes:
            with open_regular(path) as fh:
                fh.seek(start)
                return fh.read(n)

        with open_regular(path) as fh:
            out.update(_deflated_sides(fh, size, set(out), reread, size))
    return out


def chain_label(chain: tuple[Link, ...]) -> str:
    """How a tensor is stored, for reports: its update types in order ("dense+sparse"),
    operand links left out (a low-rank step is one step)."""
    return "+".join(ln.update for ln in chain if ln.update != OPERAND_UPDATE)


def _update_summary(old: TensorSide, new: TensorSide) -> str:
    """What the stored update itself says, when ``new`` is ``old`` plus one update."""
    cut = chains.last_step(new.links) if new.links else 0
    if new.store is None or not old.links or new.links[:cut] != old.links:
        return ""
    store = new.store
    if not all(store.has(ln.ref) for ln in new.links[cut:]):
        return ""
    try:
        return chains.summarize_step(new.links[cut:], store, new.limit)
    except ThetaError:
        return ""


def _apply_last(old: TensorSide, new: TensorSide, a: bytes | bytearray) -> bytearray | None:
    """``new`` when it is ``old`` plus one stored update: that update applied to ``a``
    (old's bytes, in hand), rather than rebuilding new's whole chain again. None when
    ``new`` is not stored that way."""
    cut = chains.last_step(new.links) if new.links else 0
    if new.store is None or not old.links or new.links[:cut] != old.links:
        return None
    cap = new.limit if new.limit is not None else MAX_TENSOR_BYTES
    try:
        value = chains.apply_links(bytearray(a), new.links[cut:], new.dtype, new.store, cap)
    except ThetaError:
        return None  # rebuild it the long way, which names what is wrong
    return value if content_hash(value) == new.hash else None


_WIDEN = FLOAT_KINDS  # dtypes _planes.diff_stats widens


def _numpy_stats(
    diff: TensorDiff, a: bytes | bytearray, b: bytes | bytearray, dtype: str
) -> float | None:
    """Fill ``diff``'s counts and norms with NumPy; return ||old||, or None (with a note)
    when the dtype has no numeric summary."""
    import numpy as np

    from git_theta.values import as_float64, elements_changed

    dt = lookup(dtype)
    bits = dt.bits if dt else 8
    if bits % 8 == 0:
        diff.changed = elements_changed(a, b, bits // 8)
    else:
        flips = np.unpackbits(np.frombuffer(a, np.uint8)) != np.unpackbits(
            np.frombuffer(b, np.uint8)
        )
        diff.changed = int(flips[: diff.numel * bits].reshape(-1, bits).any(axis=1).sum())
    with np.errstate(invalid="ignore", over="ignore"):  # NaN payloads widen quietly
        x, y = as_float64(a, dtype), as_float64(b, dtype)
        if x is None or y is None:
            diff.note = f"no numeric summary for {dtype}"
            return None
        delta = y - x
        finite = delta[np.isfinite(delta)]
        diff.l2 = _l2_norm(finite)
        diff.max_abs = float(np.abs(finite).max()) if finite.size else 0.0
        return _l2_norm(x[np.isfinite(x)])


def _l2_norm(finite: np.ndarray) -> float:
    """The L2 norm of finite values: scaled by their largest when their squares overflow
    (1e300 is a finite float64 whose square is not), so it is inf only past float64."""
    import numpy as np

    if not finite.size:
        return 0.0
    squares = float(np.dot(finite, finite))
    if math.isfinite(squares):
        return math.sqrt(squares)
    top = float(np.abs(finite).max())
    scaled = finite / top
    return top * math.sqrt(float(np.dot(scaled, scaled)))


def _measure(diff: TensorDiff) -> None:
    old, new = diff.old, diff.new
    assert old is not None and new is not None
    diff.update_summary = _update_summary(old, new)
    if old.unreadable or new.unreadable:
        diff.note = old.unreadable or new.unreadable
        return
    if old.dtype != new.dtype or old.shape != new.shape:
        diff.note = "dtype or shape changed"
        return
    if old.load is None or new.load is None:
        diff.note = "values not local: run `git theta fetch`"
        return
    try:
        a = old.load()
        b = _apply_last(old, new, a) or new.load()
    except CheckpointError as exc:
        if DEFLATED not in (old.update, new.update):
            raise
        diff.note = f"not compared: {exc}"  # a corrupt member: the rest of the diff stands
        return
    block = BLOCKS.get(new.dtype)
    if block is not None:  # quantized: its bytes are blocks of elements, not elements
        from git_theta.values import elements_changed

        elements, nbytes = block
        changed = elements_changed(a, b, nbytes)
        diff.blocks = (changed, len(b) // nbytes)
        diff.changed = changed * elements  # elements in the blocks that changed
        return

    kind = _WIDEN.get(new.dtype)
    squares = math.inf  # of the change and of old, from the C pass (inf: none was made)
    if kernels.native is not None and kind is not None:
        # One pass in C, and no NumPy import (0.12 s) for the usual float tensors.
        diff.changed, d2, max_abs, x2 = kernels.native.diff_stats(a, b, kind)
        diff.l2, diff.max_abs, norm = math.sqrt(d2), max_abs, math.sqrt(x2)
        squares = d2 + x2
    if math.isinf(squares):  # no C pass, or squares past float64 (F64 near 1e300):
        found = _numpy_stats(diff, a, b, new.dtype)  # NumPy's pass scales them
        if found is None:
            return
        norm = found
    l2 = diff.l2 or 0.0
    diff.old_norm = norm
    if norm > 0 and math.isfinite(l2 / norm):
        diff.rel = l2 / norm
    elif norm > 0:  # a norm or change past float64 (or a tiny old norm): no ratio to give
        diff.note = "relative change too large to show"
    elif l2 == 0:
        diff.rel = 0.0
    else:  # no relative size to give: the change is the new value, whose L2 is l2
        diff.note = "was all zeros"


def _weight(diff: TensorDiff) -> int:
    side = diff.new or diff.old
    known = lookup(side.dtype) if side is not None else None
    return 2 * diff.numel * (known.bits // 8 if known and known.bits >= 8 else 1)


def compare(
    path: str,
    old: dict[str, TensorSide],
    new: dict[str, TensorSide],
    name_filter: Callable[[str], bool] | None = None,
    old_objects: Set[tuple[str, int]] | None = None,
    new_objects: Set[tuple[str, int]] | None = None,
) -> FileDiff:
    """Return the tensor-level differences between ``old`` and ``new``.

    ``bytes_stored`` counts the objects of ``new_objects`` (by default the objects of
    ``new``'s chains) that ``old_objects`` lacks: give every object the old version
    references, in all its files, so that a tensor which only moved to another file is
    not counted (by default only ``old``'s own: ``stored_scope`` is then "file").
    """
    report = FileDiff(path)
    if old_objects is None:
        old_objects = {o for side in old.values() for o in side.objects}
        report.stored_scope = "file"
    if new_objects is None:
        new_objects = {o for side in new.values() for o in side.objects}
    report.bytes_stored = sum(size for _, size in set(new_objects) - set(old_objects))
    for name in sorted(set(old) | set(new)):
        if name_filter is not None and not name_filter(name):
            continue
        a, b = old.get(name), new.get(name)
        side = b or a
        assert side is not None
        numel = math.prod(side.shape)
        # Over both versions: a removed tensor's parameters count as changed, so they
        # count in the total too (else "9,000 of 6 parameters (150000.00%)").
        report.params_total += numel
        if a is not None and b is not None and a.hash == b.hash and a.shape == b.shape:
            report.unchanged += 1
            continue
        status = "added" if a is None else "removed" if b is None else "modified"
        report.tensors.append(TensorDiff(name, status, a, b, numel))
    modified = [d for d in report.tensors if d.status == "modified"]
    # Both sides of every changed tensor are decoded: do that on all cores (the codec
    # and NumPy's reductions release the GIL), bounded in bytes like a checkout.
    for _ in ordered_map(_measure, modified, _weight):
        pass
    for diff in report.tensors:
        if diff.status == "modified" and diff.changed is not None:
            report.params_changed += diff.changed
        else:
            report.params_changed += diff.numel
    return report
