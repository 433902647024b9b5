"""Three-way merge of manifests, tensor by tensor and, inside a tensor, element by element.

A tensor changed on one side only takes that side's entry (nothing is decoded or stored);
changed the same way on both, either. Changed differently on both, its three versions are
decoded and merged element-wise (``merges.merge_tensor``): an element changed on one side
only comes from that side, bit-exact, so two disjoint sparse fine-tunes merge exactly
with no strategy; only elements changed differently on both get the chosen strategy's
value. The result is stored as an update on ours' chain (its smallest form).

Removed on one side and changed on the other, or a dtype or shape change, cannot be
combined: a conflict unless the chosen strategy picks a side (ours, theirs, base). The
file's non-tensor bytes (the header, which names every tensor's dtype and shape) follow
the one-side rule as a whole; when both sides changed them only a file-wide side choice
resolves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from git_theta.display import quote
from git_theta.manifest import Link, Manifest, MergeRecord, TensorEntry, tensor_nbytes

if TYPE_CHECKING:
    import numpy as np

    from git_theta.formats.zip_glue import Piece, ZipGlue
    from git_theta.merges.base import MergeStrategy, TensorMerge
    from git_theta.store import ObjectRef, ObjectStore

T = TypeVar("T")
ELEMENTWISE = "elementwise"  # the record of a tensor no element of which both sides changed


@dataclass(frozen=True)
class Choice:
    """A strategy for a tensor, with its parameters as text, and where it was chosen
    (for messages: ``.theta-merges:3``, ``GIT_THETA_MERGE_STRATEGY``...)."""

    strategy: str
    params: tuple[tuple[str, str], ...] = ()
    source: str = ""


@dataclass
class Question:
    """What the prompt is asked about one conflicting tensor."""

    name: str
    reason: str
    computable: bool  # False: only a strategy that picks a side resolves it
    entries: tuple[TensorEntry | None, TensorEntry | None, TensorEntry | None]  # b, o, t
    values: tuple[bytearray | None, ...] = ()  # decoded b, o, t (computable only)
    both: int = 0  # elements both sides changed differently


Rule = Callable[[str], Choice | None]  # tensor name -> the configured choice, no stats
Ask = Callable[[Question], Choice | None]  # the interactive prompt


@dataclass
class Values:
    """Where tensor values come from: the object store, and a download for what is
    missing (None: only local objects)."""

    store: ObjectStore
    fetch: Callable[[Iterable[ObjectRef]], None] | None = None
    keep: bool = False  # leave merged values for the checkout that follows (merged_values)
    # A file that may hold ours' checkpoint (the work-tree file, which a merge starts from):
    # ours' tensors are read from it when their bytes have ours' hashes, not decoded.
    ours_file: str | None = None


@dataclass
class MergeResult:
    manifest: Manifest
    conflicts: list[str] = field(default_factory=list)  # one item per tensor (or header)
    records: dict[str, MergeRecord] = field(default_factory=dict)  # tensors combined
    conflicted: list[str] = field(default_factory=list)  # the tensor names among conflicts


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


def _fits(a: TensorEntry | None, b: TensorEntry | None) -> bool:
    return a is not None and b is not None and (a.dtype, a.shape) == (b.dtype, b.shape)


def side_of(strategy: MergeStrategy) -> int | None:
    """Which input (0 base, 1 ours, 2 theirs) a side-picking strategy returns; None for
    one that computes. Asked of the strategy itself, so a plugin's works too."""
    if not strategy.picks_side:
        return None
    import numpy as np

    marks = [np.array([float(i)], dtype=np.float32) for i in range(3)]
    try:
        got = strategy.combine(marks[0], marks[1], marks[2], {})
    except Exception:
        return None
    for i, mark in enumerate(marks):
        if got is mark or (got.shape == (1,) and float(got[0]) == float(i)):
            return i
    return None


_STORAGE = {
    "BOOL": "u1", "U8": "u1", "I8": "i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
    "BF16": "<u2", "I32": "<i4", "U32": "<u4", "F32": "<f4", "I64": "<i8", "U64": "<u8",
    "F64": "<f8", "C64": "<c8", "C128": "<c16",
}  # fmt: skip


def _view(data: bytes | bytearray | memoryview, dtype: str) -> np.ndarray:
    """The tensor's bytes as a flat NumPy view of its storage type (merges' contract)."""
    import numpy as np

    return np.frombuffer(data, dtype=_STORAGE.get(dtype, "u1"))


def _strategy(key: str) -> MergeStrategy:
    from git_theta.merges import MERGES

    return MERGES.get(key)


def _record(choice: Choice | None, merged: TensorMerge) -> MergeRecord:
    if merged.merged == 0 or choice is None:
        return MergeRecord(ELEMENTWISE)
    used = tuple((k, v if isinstance(v, str) else repr(v)) for k, v in merged.params.items())
    return MergeRecord(choice.strategy, tuple(sorted(used)))


class _Tensors:
    """Merges the tensors both sides changed, given where values come from."""

    def __init__(self, values: Values, rule: Rule | None, ask: Ask | None):
        self.values = values
        self.rule = rule
        self.ask = ask
        self.crcs: dict[str, int] | None = None  # merged tensors' CRC-32 (zip formats)
        self.ours_file: _FileValues | None = None

    def fetch(self, entries: Iterable[TensorEntry | None]) -> None:
        """Download, in one batch, every object of ``entries`` that is not local."""
        store = self.values.store
        missing = {
            link.ref
            for e in entries
            if e is not None
            for link in e.chain
            if not store.has(link.ref)
        }
        if missing and self.values.fetch is not None:
            self.values.fetch(missing)

    def decode(
        self, name: str, entries: tuple[TensorEntry | None, ...], size: int
    ) -> list[bytearray | None]:
        """The values of (base, ours, theirs), each verified against its hash. Two
        fine-tunes of one base usually store their values as updates on the base's
        chain: the base is then decoded once and only their own updates applied."""
        from git_theta import chains

        store = self.values.store
        b = entries[0]
        base = None if b is None else chains.rebuild(name, b, store, limit=size)
        out: list[bytearray | None] = [base]
        for i, e in enumerate(entries[1:], 1):
            value = None
            if i == 1 and e is not None and self.ours_file is not None:
                value = self.ours_file.read(name, e)
            if value is None and e is not None and b is not None and base is not None:
                value = _on_base(e, b, base, self.values.store, name)
            if value is None and e is not None:
                value = chains.rebuild(name, e, store, limit=size)
            out.append(value)
        return out

    def combine(
        self,
        name: str,
        choice: Choice,
        entries: tuple[TensorEntry | None, TensorEntry, TensorEntry],
        values: list[bytearray | None],
    ) -> TensorMerge:
        """Run the element-wise step with ``choice``'s strategy; raises MergeError (or
        UsageError for bad params) naming the tensor. The result may be written over
        theirs' value (``values[2]``, which no caller reads again): no fourth
        tensor-sized buffer of fresh pages for the largest tensor."""
        from git_theta.merges.base import merge_tensor, parse_params

        strategy = _strategy(choice.strategy)
        params = parse_params(strategy, dict(choice.params))
        b, o, t = values
        assert o is not None and t is not None
        dtype = entries[1].dtype
        return merge_tensor(
            strategy,
            params,
            None if b is None else _view(b, dtype),
            _view(o, dtype),
            _view(t, dtype),
            dtype,
            tensor=name,
            overwrite_theirs=True,
        )

    def store(
        self,
        name: str,
        ours: TensorEntry,
        values: list[bytearray | None],
        merged: TensorMerge,
        base: TensorEntry | None,
    ) -> TensorEntry:
        """Store the merged value: as one update on the base's chain when that is clearly
        smaller than a fresh value (``_on_base_chain``), else as its smallest update on
        ours' chain. ``values`` are the decoded (base, ours, theirs); it is emptied."""
        import numpy as np

        from git_theta import chains
        from git_theta.content import content_hash

        data = np.ascontiguousarray(merged.data).reshape(-1).view(np.uint8).data
        if self.crcs is not None:
            import zlib

            self.crcs[name] = zlib.crc32(data)
        base_value, ours_value = values[0], values[1]
        values.clear()
        chain = None
        if base is not None and base_value is not None and base.dtype == ours.dtype:
            # Ours is needed only if the base's chain is no clear win: freed now, the
            # encode's buffers take its place (the largest tensor sets the peak).
            give_back(ours_value, base_value)
            ours_value = None
            chain = _on_base_chain(data, base, base_value, self.values.store, name, ours.shape)
        give_back(base_value, ours_value)
        del base_value

        def ours_again() -> bytearray | None:
            if ours_value is not None:
                return ours_value
            return chains.rebuild(name, ours, self.values.store, limit=len(data))

        if chain is None:
            chain = chains.store_value(
                data,
                ours.dtype,
                self.values.store,
                "auto",
                ours,
                ours_again,
                name=name,
                shape=ours.shape,
            )
        hash_ = content_hash(data)
        if self.values.keep:
            from git_theta import merged_values

            merged_values.keep(self.values.store, hash_, data)
        give_back(ours_value)
        give_back(_owner(merged.data))
        return TensorEntry(ours.dtype, ours.shape, hash_, chain)


class _FileValues:
    """Ours' tensor values read from a file that may hold ours' checkpoint: the work-tree
    file a merge starts from (git merges into a clean work tree). Reading and hashing a
    value costs a fraction of decoding its chain. Each value is used only when its bytes
    have the entry's hash, so a file that changed, or holds something else, only costs
    the read: the caller decodes the chain then."""

    def __init__(self, path: str, manifest: Manifest):
        import os

        from git_theta.errors import ThetaError
        from git_theta.files import open_regular

        self.spans: dict[str, tuple[int, int]] = {}
        self.fd = -1
        try:
            with open_regular(path) as fh:
                if os.fstat(fh.fileno()).st_size != manifest.size:
                    return
                self.fd = os.dup(fh.fileno())
        except (OSError, ThetaError):
            return
        pos = 0
        for item in manifest.layout:
            if isinstance(item, int):
                pos += item
                continue
            n = tensor_nbytes(manifest.tensors[item].dtype, manifest.tensors[item].shape)
            if n is None:  # an opaque size: the offsets after it are unknown
                break
            self.spans[item] = (pos, n)
            pos += n

    def read(self, name: str, entry: TensorEntry) -> bytearray | None:
        """``entry``'s value from the file, or None when the file does not hold it."""
        import os

        from git_theta import codec
        from git_theta.content import content_hash

        span = self.spans.get(name)
        if span is None or self.fd < 0 or span[1] != tensor_nbytes(entry.dtype, entry.shape):
            return None
        offset, n = span
        value = codec.new_buffer(n)
        view, got = memoryview(value), 0
        try:
            while got < n:
                k = os.preadv(self.fd, [view[got:]], offset + got)
                if k <= 0:
                    return None
                got += k
        except OSError:
            return None
        finally:
            view.release()
        return value if content_hash(value) == entry.hash else None

    def close(self) -> None:
        import os

        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _NotClear(Exception):
    """The update needs a dense encode to compare with: it is no clear win."""


def _on_base_chain(
    data: memoryview,
    base: TensorEntry,
    base_value: bytearray,
    store: ObjectStore,
    name: str,
    shape: tuple[int, ...],
) -> tuple[Link, ...] | None:
    """The base's chain plus one update to ``data`` (auto's pick against the base value
    already decoded), when the chain's updates are clearly smaller than the base's dense
    object (updates.base.CLEAR_WIN): no dense value is encoded to compare with, nothing
    is decoded again, and a checkout applies one update. None otherwise. Two fine-tunes
    of one base that both changed every element store ~0.8x each: on ours' chain the
    merged value would need two such updates, past a fresh value."""
    from git_theta.chains import MAX_CHAIN, steps
    from git_theta.manifest import MAX_LINKS
    from git_theta.updates import UPDATES
    from git_theta.updates.base import CLEAR_WIN

    first = base.chain[0]
    if (
        first.update != "dense"
        or steps(base.chain) >= MAX_CHAIN
        or len(base.chain) + 1 > MAX_LINKS  # factor links count as links: a manifest's cap
        or len(base_value) != len(data)
    ):
        return None
    estimate = first.ref.size

    def no_dense() -> list[bytes]:
        raise _NotClear

    try:
        key, parts = UPDATES.get("auto").pick(
            data, base_value, base.dtype, no_dense, estimate, name, shape
        )
    except _NotClear:
        return None
    if parts is None or key == "dense":
        return None
    size = sum(link.ref.size for link in base.chain[1:]) + sum(map(len, parts))
    if size >= CLEAR_WIN * estimate:
        return None
    return (*base.chain, Link(key, UPDATES.get(key).codec, store.put(parts)))


def give_back(value: object, *live: object) -> None:
    """Recycle ``value`` (a decoded or merged tensor's buffer nothing else will read)
    for the next tensor of its size, unless it is one of the ``live`` buffers: a merge
    of a model's repeated layers then reuses memory instead of faulting in fresh pages."""
    from git_theta import codec

    if isinstance(value, bytearray) and all(value is not other for other in live):
        codec.recycle(value)


def _theirs_done(values: list[bytearray | None], merged: TensorMerge) -> None:
    """Drop theirs' value from the decoded (base, ours, theirs) once merged, recycling
    its buffer unless the merge wrote its result there (or it is another side's)."""
    give_back(values[2], values[0], values[1], _owner(merged.data))
    values[2] = None


def _owner(array: object) -> object:
    """The object whose memory NumPy ``array`` views (a bytearray for a merge result)."""
    import numpy as np

    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array.obj if isinstance(array, memoryview) else array


def _on_base(
    entry: TensorEntry, base: TensorEntry, value: bytearray, store: ObjectStore, name: str
) -> bytearray | None:
    """``entry``'s value from its base's decoded ``value`` plus the links it adds, when
    its chain extends the base's and the result has its hash; else None (the caller
    rebuilds it the long way, which names whatever is wrong). A damaged object is named
    here, for tensor ``name``: its read moved it aside, so the long way would only find
    it missing."""
    from git_theta import chains
    from git_theta.content import content_hash
    from git_theta.errors import ObjectCorruptError, ThetaError

    n = len(base.chain)
    if entry.dtype != base.dtype or entry.chain[:n] != base.chain:
        return None
    from git_theta import codec

    try:
        out = _delta_on(entry.chain[n:], entry.dtype, value, store)
        if out is None:
            out = codec.new_buffer(len(value))  # updates apply in place; the base is kept
            out[:] = value
            out = chains.apply_links(
                out, entry.chain[n:], entry.dtype, store, len(value), name=name
            )
    except ObjectCorruptError as exc:
        if not str(exc).startswith("tensor "):  # apply_links names it; _delta_on does not
            chains._in_tensor(exc, name)
        raise
    except ThetaError:
        return None
    return out if content_hash(out) == entry.hash else None


def _delta_on(
    links: tuple[Link, ...], dtype: str, base: bytearray, store: ObjectStore
) -> bytearray | None:
    """``base`` plus the one delta update ``links`` holds, written to a new buffer in one
    pass (the merge kernel's add_delta) instead of a copy of the base that the delta is
    then added to; None when ``links`` are anything else or there is no C kernel (the
    caller applies them as a chain). Raises ObjectCorruptError for a malformed delta."""
    from git_theta import codec, kernels
    from git_theta.errors import ObjectCorruptError
    from git_theta.parallel import chunk_pool
    from git_theta.updates import UPDATES
    from git_theta.updates.delta import Delta
    from git_theta.updates.delta import _size as word_size  # the delta's word for dtype

    kernel = kernels.merge
    if kernel is None or len(links) != 1 or links[0].update != Delta.key:
        return None
    if links[0].codec != Delta.codec or type(UPDATES.get(Delta.key)) is not Delta:
        return None  # a plugin registered under the key: its own apply
    size = word_size(dtype)
    payload = store.get(links[0].ref)
    out = codec.new_buffer(len(base))
    out_view, base_view = memoryview(out), memoryview(base)

    def add(start: int, z: memoryview) -> None:
        end = start + len(z)
        if end > len(out):
            raise ObjectCorruptError("delta is longer than the previous value")
        try:
            kernel.add_delta(out_view[start:end], base_view[start:end], z, size)
        except ValueError as exc:  # not whole words
            raise ObjectCorruptError(f"delta is malformed: {exc}") from None

    # Not recycled when this raises: a chunk still being added may write to it.
    got = codec.decode_each(payload, add, pool=chunk_pool(), limit=len(base), context=base)
    out_view.release()
    if got != len(base):
        raise ObjectCorruptError("delta does not match the size of the previous value")
    return out


def merge3(
    base: Manifest | None,
    ours: Manifest,
    theirs: Manifest,
    values: Values | None = None,
    rule: Rule | None = None,
    ask: Ask | None = None,
    whole_file: Choice | None = None,
) -> MergeResult:
    """Merge ``theirs`` into ``ours`` relative to ``base``; list what stays in conflict.

    ``values`` (the object store) lets tensors changed on both sides be merged; without
    it they are conflicts. ``rule`` names the configured strategy of a tensor, ``ask`` is
    the prompt for one left without; ``whole_file`` (a side-picking strategy given for
    the whole file) also resolves a header both sides changed. A conflicting tensor keeps
    ours' entry. Raises a ThetaError when values cannot be read or a strategy or its
    params are unknown.
    """
    if values is not None:
        _check_expansion(base, ours, theirs)
    b_tensors = base.tensors if base else {}
    result = MergeResult(ours)
    tensors: dict[str, TensorEntry] = {}
    both: list[str] = []
    for name in sorted(set(b_tensors) | set(ours.tensors) | set(theirs.tensors)):
        b, o, t = b_tensors.get(name), ours.tensors.get(name), theirs.tensors.get(name)
        # Equal content counts as unchanged even when stored through different chains.
        if _same(o, t) or _same(t, b):
            chosen = o
        elif _same(o, b):
            chosen = t  # only theirs changed it
        else:
            both.append(name)
            chosen = o
        if chosen is not None:
            tensors[name] = chosen

    b_frame = (base.format, base.size, base.glue, base.layout) if base else None
    o_frame = (ours.format, ours.size, ours.glue, ours.layout)
    t_frame = (theirs.format, theirs.size, theirs.glue, theirs.layout)
    frame, clean = _pick(b_frame, o_frame, t_frame)
    frame_side = theirs if frame == t_frame and frame != o_frame else ours
    zip_crcs: _ZipFix | None = None
    if not clean and values is not None and ours.format in _zip_formats():
        zip_crcs = _ZipFix.pick(base, ours, theirs, values)
        if zip_crcs is not None:
            frame_side, clean = zip_crcs.side, True
            frame = (frame_side.format, frame_side.size, frame_side.glue, frame_side.layout)
    if not clean:
        side = side_of(_strategy(whole_file.strategy)) if whole_file is not None else None
        if side is not None and (side != 0 or base is not None):
            frame_side = (base, ours, theirs)[side] or ours
            frame = (frame_side.format, frame_side.size, frame_side.glue, frame_side.layout)
            clean = True
        else:
            result.conflicts.append(
                "(file header: both sides changed dtypes, shapes, tensor names or metadata)"
            )
    assert frame is not None
    fmt, size, glue, layout = frame
    names = [item for item in layout if isinstance(item, str)]
    name_set = set(names)

    merger = _Tensors(values, rule, ask) if values is not None else None
    if merger is not None and zip_crcs is not None:
        merger.crcs = {}
    if merger is not None and values is not None and values.ours_file is not None and both:
        merger.ours_file = _FileValues(values.ours_file, ours)
    try:
        _merge_both(merger, both, b_tensors, ours, theirs, tensors, result, size)
    finally:
        if merger is not None and merger.ours_file is not None:
            merger.ours_file.close()

    # Every tensor the chosen header names must be there, with the dtype and shape it says.
    for name in names:
        want = frame_side.tensors.get(name)
        have = tensors.get(name)
        if have is None or (want is not None and not _fits(have, want)):
            if name not in result.conflicted and clean:
                result.conflicts.append(
                    f"{quote(name)} (the header names it with another dtype or shape, or "
                    "a side removed it)"
                )
                result.conflicted.append(name)
            fallback = want or ours.tensors.get(name) or theirs.tensors.get(name)
            if fallback is not None:
                tensors[name] = fallback
    merged = Manifest(fmt, size, glue, layout, {n: e for n, e in tensors.items() if n in name_set})
    if zip_crcs is not None and merger is not None:
        merged = zip_crcs.fixed(merged, merger)
    result.manifest = merged
    result.records = {n: r for n, r in result.records.items() if n in merged.tensors}
    return result


def _check_expansion(*sides: Manifest | None) -> None:
    """Refuse, as a checkout does (smudge.check_expansion: same rule, message and
    setting), a side whose values would be far larger than its objects: a few MB that
    decode to zeros declaring 64 GiB must not be allocated by the merge. Raises
    ExpansionError."""
    from git_theta.smudge import check_expansion

    for side in sides:
        if side is not None:
            check_expansion(side)


def _zip_formats() -> frozenset[str]:
    from git_theta.formats.zip_glue import ZIP_FORMATS

    return ZIP_FORMATS


class _ZipFix:
    """A zip-based file whose sides' headers differ only in members' CRC-32 fields (and
    per-save identifiers): the header of the side the one-side rule picks once those are
    set aside, with every CRC-32 set for the merged tensors."""

    def __init__(self, side: Manifest, glue: ZipGlue, known: list[dict[tuple[Piece, ...], int]]):
        self.side = side
        self.glue = glue
        self.known = known

    @classmethod
    def pick(
        cls, base: Manifest | None, ours: Manifest, theirs: Manifest, values: Values
    ) -> _ZipFix | None:
        """The fix, or None when the headers differ otherwise on both sides (or cannot
        be read as zip records from the glue alone)."""
        from git_theta.errors import CheckpointError
        from git_theta.formats.zip_glue import ZipGlue
        from git_theta.smudge import read_glue

        sides = [m for m in (base, ours, theirs) if m is not None]
        if any(m.format != ours.format for m in sides):
            return None
        missing = [m.glue.ref for m in sides if not values.store.has(m.glue.ref)]
        if missing and values.fetch is not None:
            values.fetch(missing)
        try:
            zips = [
                ZipGlue(
                    bytes(read_glue(m, values.store)),
                    m.layout,
                    {n: tensor_nbytes(e.dtype, e.shape) for n, e in m.tensors.items()},
                )
                for m in sides
            ]
        except CheckpointError:
            return None
        frames = [(m.size, z.normalized(), m.layout) for m, z in zip(sides, zips, strict=True)]
        b_frame, o_frame, t_frame = [None, *frames] if base is None else frames
        frame, clean = _pick(b_frame, o_frame, t_frame)
        if not clean:
            return None
        at = 1 if frame == o_frame else 2
        at -= base is None
        known = []
        for m, z in zip(sides, zips, strict=True):
            known.append(z.crcs({n: e.hash for n, e in m.tensors.items()}))
        return cls(sides[at], zips[at], known)

    def fixed(self, merged: Manifest, merger: _Tensors) -> Manifest:
        """``merged`` with its glue's CRC-32 fields set for its tensors (a tensor neither
        side's header covers is decoded once for its CRC, unless the merge computed it)."""
        import zlib

        from git_theta import chains, codec
        from git_theta.content import content_hash
        from git_theta.manifest import Glue

        store = merger.values.store

        def tensor_crc(name: str) -> int:
            if merger.crcs is not None and name in merger.crcs:
                return merger.crcs[name]
            return zlib.crc32(chains.rebuild(name, merged.tensors[name], store))

        hashes = {n: e.hash for n, e in merged.tensors.items()}
        if any(isinstance(i, str) and i not in hashes for i in merged.layout):
            return merged  # a conflict (the header names a tensor the merge lacks)
        glue = self.glue.with_crcs(hashes, self.known, tensor_crc)
        if glue == self.glue.glue:
            return merged
        ref = store.put(codec.encode(glue, level=9))
        return merged._replace(glue=Glue(content_hash(glue), ref))


def _structural_reason(b: TensorEntry | None, o: TensorEntry | None, t: TensorEntry | None) -> str:
    if o is None or t is None:
        return "removed on one side and changed on the other"
    if b is None:
        return "added on both sides with different dtypes or shapes"
    return "dtype or shape changed"


def _merge_both(
    merger: _Tensors | None,
    both: list[str],
    b_tensors: dict[str, TensorEntry],
    ours: Manifest,
    theirs: Manifest,
    tensors: dict[str, TensorEntry],
    result: MergeResult,
    size: int,
) -> None:
    """Resolve the tensors both sides changed, in ``tensors``; the rest are conflicts."""
    from git_theta.merges.base import MergeError

    def conflict(name: str, reason: str) -> None:
        result.conflicts.append(f"{quote(name)} ({reason})")
        result.conflicted.append(name)

    if merger is None:
        for name in both:
            conflict(name, "changed on both sides")
        return

    def choose(name: str) -> Choice | None:
        return merger.rule(name) if merger.rule is not None else None

    def take_side(name: str, choice: Choice, entries: tuple[TensorEntry | None, ...]) -> bool:
        side = side_of(_strategy(choice.strategy))
        if side is None:
            return False
        entry = entries[side]
        record = MergeRecord(choice.strategy)
        if entry is None:
            tensors.pop(name, None)
        else:
            tensors[name] = entry._replace(merge=record)
        result.records[name] = record
        return True

    computable = []
    for name in both:
        entries = (b_tensors.get(name), ours.tensors.get(name), theirs.tensors.get(name))
        b, o, t = entries
        if _fits(o, t) and (b is None or _fits(b, o)):
            computable.append(name)
            continue
        reason = _structural_reason(b, o, t)
        choice = choose(name)
        if choice is None and merger.ask is not None:
            choice = merger.ask(Question(name, reason, False, entries))
        if choice is None or not take_side(name, choice, entries):
            how = "" if choice is None else f"; {choice.strategy} cannot resolve that"
            conflict(name, reason + how + ": only ours, theirs or base can")

    merger.fetch(
        e
        for name in computable
        for e in (b_tensors.get(name), ours.tensors.get(name), theirs.tensors.get(name))
    )

    def first_pass(name: str) -> tuple[str, TensorEntry | MergeError | Question, Choice | None]:
        """Merge one tensor with its configured strategy (or none: exact when no element
        changed differently on both); runs on worker threads. Returns what happened:
        ("done", entry), ("conflict", error) or ("ask", question for the prompt)."""
        b, o, t = b_tensors.get(name), ours.tensors[name], theirs.tensors[name]
        entries3 = (b, o, t)
        # Element-wise even for a side-picking strategy: it picks only where both sides
        # changed an element differently, as git's -X ours/theirs keeps the other's hunks.
        choice = choose(name)
        values = merger.decode(name, entries3, size)
        try:
            done = merger.combine(name, choice or Choice("ours"), entries3, values)
        except MergeError as exc:
            return "conflict", exc, choice
        if done.merged and choice is None:
            # Only the count is kept: three values of every conflicted tensor held until
            # the end were 3x the model in memory. The prompt decodes them again.
            question = Question(name, "changed on both sides", True, entries3)
            question.both = done.merged
            return "ask", question, None
        _theirs_done(values, done)  # not needed to store it
        return (
            "done",
            merger.store(name, o, values, done, b)._replace(merge=_record(choice, done)),
            choice,
        )

    def weight(name: str) -> int:
        return 6 * nbytes(ours.tensors[name])  # three values, working copies, the result

    done_by_name = _run_first_passes(first_pass, computable, weight)
    asked: list[Question] = []
    for name in computable:  # results, conflicts and questions in name order
        what, got, _choice = done_by_name.pop(name)
        if what == "done":
            assert isinstance(got, TensorEntry) and got.merge is not None
            tensors[name] = got
            result.records[name] = got.merge
        elif what == "conflict":
            conflict(name, str(got))
        else:
            assert isinstance(got, Question)
            asked.append(got)
    # The prompt, one tensor at a time, after the merges that needed none.
    for question in asked:
        name = question.name
        entries3 = (b_tensors.get(name), ours.tensors[name], theirs.tensors[name])
        choice = None
        if merger.ask is not None:
            values = merger.decode(name, entries3, size)
            question.values = tuple(values)  # for the prompt's statistics
            choice = merger.ask(question)
            question.values = ()
        if choice is None:
            conflict(name, f"{question.both:,} elements changed differently on both sides")
            continue
        try:
            done = merger.combine(name, choice, entries3, values)
        except MergeError as exc:
            conflict(name, str(exc))
            continue
        _theirs_done(values, done)
        record = _record(choice, done)
        stored = merger.store(name, ours.tensors[name], values, done, entries3[0])
        tensors[name] = stored._replace(merge=record)
        result.records[name] = record


def _run_first_passes(
    fn: Callable[[str], T], names: list[str], weight: Callable[[str], int]
) -> dict[str, T]:
    """``fn(name)`` for every name, on the worker pool, memory-bounded by ``weight``.

    A model's largest tensor (GPT-2's embeddings: a third of its bytes) is often far past
    the pool's budget, so ordered_map runs it alone: merged last, it kept one core busy
    for a third of the merge while the other idled. When it is the only tensor past the
    budget it gets a lane of its own from the start, and the others share the machine
    with it through ordered_map (its budget still bounds them): memory is the largest
    tensor's working set plus the budget, as before, and both cores work throughout."""
    from git_theta.parallel import BUDGET, Pool, Task, ordered_map

    by_size = sorted(names, key=weight, reverse=True)
    lane = by_size[:1] if by_size and weight(by_size[0]) > BUDGET else []
    if len(by_size) > 1 and weight(by_size[1]) > BUDGET:
        lane = []  # two past the budget: one at a time, as ordered_map runs them
    rest = [n for n in names if n not in lane]
    pool = Pool(1, "theta-merge-large") if lane else None
    tasks: list[tuple[str, Task[T]]] = []
    try:
        if pool is not None:
            tasks = [(n, pool.submit(fn, n)) for n in lane]
        out = dict(zip(rest, ordered_map(fn, rest, weight, BUDGET), strict=True))
        for name, task in tasks:
            out[name] = task.result()
    finally:
        if pool is not None:
            for _, task in tasks:
                task.cancel()
            pool.shutdown()
    return out


def nbytes(entry: TensorEntry) -> int:
    """The byte size of an entry's value (0 for an opaque dtype)."""
    return tensor_nbytes(entry.dtype, entry.shape) or 0
