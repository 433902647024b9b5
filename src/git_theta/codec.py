"""A tensor's bytes <-> a compact, self-describing content object (format versions 1, 3).

Floats are stored as byte planes: each word is rotated left by one bit so the exponent
fills the top byte and the sign joins the low mantissa byte; then byte k of every word is
grouped into plane k. The exponent plane has ~2.7 bits of entropy per byte and compresses
to about a third with a Huffman coder; the mantissa planes are nearly random and are kept
raw or zstd'd. This measured 0.819x on MiniLM FP32 and 0.665x on BF16 (docs/benchmarks.md).

Object layout (little-endian)::

    b"GTHO" | version u8 (1, or 3 with a grouped plane) | word u8 | flags u8 (bit0 =
    rotated) | reserved u8
    raw length u64 | words per chunk u32
    per chunk, per plane: method u8 | payload length u32 | payload

``word`` = 1 means no planes (plain bytes). Chunks bound memory and keep entropy tables
local; each plane of each chunk picks its own method, so odd data cannot blow up.

Method bit 7 (GROUPED) says the plane's bytes are stored in *grouped order*: sorted,
stably, by the top byte of the rotated word of a context the reader already has (a
delta's previous value: the byte is its exponent). A bit-pattern change's size follows
the old value's exponent, so grouped high planes are far more skewed and compress ~30%
better (a full fine-tune at lr 2e-5 stored 4.5% less). Such an object decodes only with
its context. An object holding a grouped plane is written as version 3, so a reader from
before the method says it needs a newer git-theta instead of calling it corrupt (version
2 is what the golden fixtures use for "newer", as for manifests); this reader also takes
version-1 objects with grouped planes, as the first writer of the method stored them.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from git_theta import deflate, kernels
from git_theta.errors import ObjectCorruptError
from git_theta.parallel import Pool, pipelined
from git_theta.records import NamedTuple

if TYPE_CHECKING:
    import mmap

    import zstandard


MAGIC = b"GTHO"
VERSION = 1  # an object without grouped planes: byte for byte what every reader takes
VERSION_GROUPED = 3  # an object with one: readers from before GROUPED refuse it as newer
VERSIONS = frozenset({VERSION, VERSION_GROUPED})
_HEAD = struct.Struct("<4sBBBBQI")
_PLANE = struct.Struct("<BI")
CHUNK_WORDS = 1 << 20

RAW, ZSTD, HUFFMAN = 0, 1, 2
GROUPED = 0x80  # method flag: the plane is in its context's key order
GROUP_MIN = 4096  # bytes: a smaller plane would save tens of bytes for a second encode
# Words a grouped plane may hold: what a writer makes (one chunk). Reordering keeps a
# plane and its reordered copy, so a hostile object's single giant chunk is refused.
GROUP_MAX_WORDS = CHUNK_WORDS
# Grouping is tried (a second encode of the plane, and a reorder at every decode) only
# where a sample says it saves this share of the plane's entropy (plus a floor): a change
# proportional to the weight (multiplicative noise) does not depend on the exponent and
# gains ~0.2%, an Adam step does (the top planes' entropy drops by 20-50%).
GROUP_MIN_SHARE, GROUP_MIN_GAIN = 0.01, 0.002
# Above this share, in a plane of several entropy-coder blocks (one block codes the same
# histogram in any order), the plane is encoded grouped only, not also in natural order
# to compare: on the fine-tune of docs/benchmarks.md every such plane came out 2-78%
# smaller, and the second Huffman encode doubled a delta's encode time.
GROUP_SURE_SHARE, GROUP_SURE_MIN = 0.15, 1 << 18
# ... unless a probe of the natural order (a few contiguous spans, coded) says it may come
# out within this factor of the grouped result: the sample's histograms do not see what
# a coder finds in the natural order beyond them (repeats zstd matches, runs), which
# grouping breaks up (a periodic plane: 4 KB in natural order, 560 KB grouped).
GROUP_PROBE_SPANS, GROUP_PROBE_MARGIN = 4, 1.05
_SAMPLE = 1 << 16  # bytes sampled to pick a plane's method
_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}

_local = threading.local()


def _zstd_c(level: int) -> zstandard.ZstdCompressor:
    key = f"c{level}"
    comp = getattr(_local, key, None)
    if comp is None:
        import zstandard

        comp = zstandard.ZstdCompressor(level=level)
        setattr(_local, key, comp)
    return comp


def _zstd_d() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "d", None)
    if dec is None:
        import zstandard

        dec = _local.d = zstandard.ZstdDecompressor()
    return dec


SPARE_MAX = 64 << 20  # bytes of recycled buffers kept for reuse, process-wide
_spare: dict[int, list[bytearray]] = {}
_spare_bytes = 0
_spare_lock = threading.Lock()  # buffers are taken and given back on worker threads


def new_buffer(n: int) -> bytearray:
    """A bytearray of ``n`` bytes for the caller to overwrite completely (not zeroed when
    the C kernel is built: zeroing is a whole extra pass over every decoded tensor).

    A recycled buffer of that size is handed out first: fresh memory costs a page fault
    per 4 KiB (or zeroing per 2 MiB) on first touch, and on a 2-core VM that was the
    largest single cost of adding or checking out a 250 MB file (50,000 faults, ~0.2 s
    of system time). A model repeats its layers' shapes, so most sizes come back.
    """
    global _spare_bytes
    with _spare_lock:
        spare = _spare.get(n)
        if spare:
            _spare_bytes -= n
            return spare.pop()
    return kernels.native.empty(n) if kernels.native is not None else bytearray(n)


def recycle(buf: bytes | bytearray | memoryview) -> None:
    """Give back a buffer from ``new_buffer`` that nothing refers to any more; the next
    ``new_buffer`` of its size reuses it. Anything but a bytearray is ignored, and
    nothing is kept where malloc reuses freed memory itself (kernels.malloc_keeps_freed)."""
    global _spare_bytes
    if type(buf) is not bytearray or kernels.malloc_keeps_freed:
        return
    n = len(buf)
    with _spare_lock:
        if _spare_bytes + n <= SPARE_MAX:
            _spare.setdefault(n, []).append(buf)
            _spare_bytes += n


def _entropy_bits(plane: bytes | memoryview) -> float:
    """Order-0 entropy (bits per byte) of an evenly spaced sample of ``plane``."""
    step = max(1, len(plane) // _SAMPLE)
    native = kernels.native
    if native is not None:
        bits: float | None = native.entropy_bits(plane, step)  # the same double as below
        if bits is not None:
            return bits
        counts: list[int] = native.histogram(plane, step)
    else:
        import numpy as np

        counts = np.bincount(np.frombuffer(plane, np.uint8)[::step], minlength=256).tolist()
    total = sum(counts)
    return -math.fsum(c / total * math.log2(c / total) for c in counts if c)


def _pack_plane(
    raw: bytes | memoryview, level: int, bits: float | None = None
) -> tuple[int, bytes | memoryview]:
    """Return (method, payload) for one plane: the compact choice, never larger than raw.
    ``bits``: ``_entropy_bits(raw)`` when the caller has it already."""
    if len(raw) < 64:
        return RAW, raw
    if bits is None:
        bits = _entropy_bits(raw)
    if 1.0 <= bits < 6.0:
        # Skewed but not repetitive (exponents): entropy coding without LZ matching wins.
        coded = deflate.literals(raw)
        if coded is None:
            return RAW, raw
        method, payload = HUFFMAN, coded
    else:
        method, payload = ZSTD, _zstd_c(level).compress(raw)
    if len(payload) >= len(raw):
        return RAW, raw
    return method, payload


def _group_numpy(
    planes: Sequence[bytes | memoryview], context: bytes | memoryview, word: int, forward: bool
) -> list[bytes]:
    """NumPy version of ``_planes.group``: each plane in (or back from) grouped order."""
    import numpy as np

    grid = np.frombuffer(context, dtype=np.uint8).reshape(-1, word)
    key = ((grid[:, word - 1].astype(np.uint16) << 1) | (grid[:, word - 2] >> 7)).astype(np.uint8)
    order = np.argsort(key, kind="stable")  # a counting sort's order
    out = []
    for plane in planes:
        data = np.frombuffer(plane, dtype=np.uint8)
        if len(data) != len(key):
            raise ValueError("plane length does not match the context")
        if forward:
            out.append(data[order].tobytes())
        else:
            back = np.empty_like(data)
            back[order] = data
            out.append(back.tobytes())
    return out


def _c_log_c(counts: Sequence[int]) -> tuple[float, int]:
    """(sum of c*log2(c), nonzero count) summed in order, as the C kernel sums."""
    total, nonzero = 0.0, 0
    for c in counts:
        if c:
            total += c * math.log2(c)
            nonzero += 1
    return total, nonzero


def _group_gain_numpy(
    plane: bytes | memoryview, context: bytes | memoryview, word: int, step: int
) -> float:
    """NumPy version of ``_planes.group_gain`` (the same double: the same sums in order)."""
    import numpy as np

    step = min(step, max(len(plane), 1))  # as the C kernel clamps it (the same sample)
    grid = np.frombuffer(context, dtype=np.uint8).reshape(-1, word)[::step]
    key = ((grid[:, word - 1].astype(np.int64) << 1) | (grid[:, word - 2] >> 7)) & 0xFF
    data = np.frombuffer(plane, dtype=np.uint8)[::step]
    counts = np.bincount(key * 256 + data, minlength=65536).reshape(256, 256)
    n = int(counts.sum())
    if not n:
        return 0.0
    within, mk = 0.0, 0
    for row in counts.tolist():
        part, nonzero = _c_log_c(row)
        within += part
        mk += nonzero
    across, groups = _c_log_c(counts.sum(axis=1).tolist())
    whole, m0 = _c_log_c(counts.sum(axis=0).tolist())
    total = float(n)
    drop = (total * math.log2(total) - whole - (across - within)) / total
    return drop + ((m0 - 1) - (mk - groups)) / (2.0 * total * math.log(2.0))


def _group_gain(plane: bytes | memoryview, context: bytes | memoryview, word: int) -> float:
    """Bits per byte an evenly spaced sample of ``plane`` says grouping by ``context``
    saves (Miller-Madow corrected entropies: small groups are not counted as a gain)."""
    step = max(1, len(plane) // _SAMPLE)
    if kernels.native is not None:
        gain: float = kernels.native.group_gain(plane, context, word, step)
        return gain
    return _group_gain_numpy(plane, context, word, step)


def _grouping_odds(
    plane: bytes | memoryview, context: bytes | memoryview, word: int, bits: float
) -> float:
    """The share of the plane's sample entropy (``bits``, its ``_entropy_bits``) grouping
    saves, less a floor (0 for a plane too small to try)."""
    if not GROUP_MIN <= len(plane) <= GROUP_MAX_WORDS:
        return 0.0
    if bits > 7.995:  # random (a mantissa's low byte): nothing to gain, skip the estimate
        return 0.0
    return (_group_gain(plane, context, word) - GROUP_MIN_GAIN) / max(bits, 1e-9)


def _group(
    planes: Sequence[bytes | memoryview], context: bytes | memoryview, word: int, forward: bool
) -> list[bytes]:
    """Return each plane in grouped order (``forward``) or back in natural order."""
    if kernels.native is not None:
        grouped: list[bytes] = kernels.native.group(planes, context, word, forward)
        return grouped
    return _group_numpy(planes, context, word, forward)


def _inflate(payload: bytes | memoryview, size: int) -> bytes:
    """At most ``size`` bytes of the raw deflate stream ``payload``, inflated by zlib-ng
    (imported here: 4 ms of start-up, with its gzip, that the C decoder rarely needs)."""
    from zlib_ng import zlib_ng

    error: type[Exception] = zlib_ng.error  # type: ignore[assignment]  # typed an instance
    try:
        out: bytes = zlib_ng.decompressobj(-15).decompress(payload, size)
    except error as exc:
        raise ObjectCorruptError(f"content object is corrupt: {exc}") from exc
    return out


def _unpack_plane(method: int, payload: bytes | memoryview, size: int) -> bytes | memoryview:
    if method == RAW:
        out = payload
    elif method == ZSTD:
        import zstandard  # on first use: 5 ms with its `platform`; BF16 planes never need it

        try:
            # python-zstandard allocates what a frame header says its content is and
            # ignores max_output_size then: a hostile object's 300 bytes could claim a
            # terabyte. A claim past the plane's size is refused before anything is
            # allocated; an unknown one (-1) is bounded by max_output_size.
            claimed = zstandard.frame_content_size(payload)
            if claimed > size:
                raise ObjectCorruptError(
                    f"content object is corrupt: a zstd plane claims {claimed} bytes, "
                    f"expected {size}"
                )
            out = _zstd_d().decompress(payload, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ObjectCorruptError(f"content object is corrupt: {exc}") from exc
    elif method == HUFFMAN:
        # The C decoder takes what deflate.literals (and Z_HUFFMAN_ONLY, which wrote the
        # planes before it) writes, ~1.7x faster than zlib-ng; anything else (None) is
        # zlib's to decode or reject.
        native = kernels.native
        fast = native.inflate_literals(payload, size) if native is not None else None
        out = fast if fast is not None else _inflate(payload, size)
    else:
        raise ObjectCorruptError(f"unknown plane method {method}")
    if len(out) != size:
        raise ObjectCorruptError(f"plane decoded to {len(out)} bytes, expected {size}")
    return out


class Layout(NamedTuple):
    """How to split a buffer into planes: word size in bytes and whether to rotate."""

    word: int = 1
    rotate: bool = False


PLAIN = Layout()  # bytes as they are: no planes


def _split_numpy(chunk: memoryview, layout: Layout) -> list[bytes]:
    """NumPy version of ``_planes.split`` (same bytes, several passes)."""
    import numpy as np

    words = np.frombuffer(chunk, dtype=_UINT[layout.word])
    if layout.rotate:
        rotated: np.ndarray = words << np.array(1, dtype=words.dtype)
        rotated |= words >> np.array(layout.word * 8 - 1, dtype=words.dtype)
        # Shifts give native byte order; the planes are defined on little-endian words.
        words = rotated.astype(_UINT[layout.word], copy=False)
    grid = words.view(np.uint8).reshape(-1, layout.word)
    # Column copies are several times faster than a full transpose in numpy.
    return [grid[:, k].tobytes() for k in range(layout.word - 1, -1, -1)]


def _join_numpy(out: memoryview, planes: Sequence[bytes | memoryview], layout: Layout) -> None:
    """NumPy version of ``_planes.join``: interleave ``planes`` into ``out``."""
    import numpy as np

    flat = np.frombuffer(out, dtype=np.uint8)
    grid = flat.reshape(-1, layout.word)
    for k, plane in zip(range(layout.word - 1, -1, -1), planes, strict=True):
        grid[:, k] = np.frombuffer(plane, dtype=np.uint8)
    if layout.rotate:
        words = flat.view(_UINT[layout.word])
        low = words << np.array(layout.word * 8 - 1, dtype=words.dtype)
        words >>= np.array(1, dtype=words.dtype)
        words |= low


def _split(chunk: memoryview, layout: Layout) -> list[bytes]:
    """Return byte k of every word as plane k, most significant byte first."""
    if kernels.native is not None:
        planes: list[bytes] = kernels.native.split(chunk, layout.word, layout.rotate)
        return planes
    return _split_numpy(chunk, layout)


def _join_into(out: memoryview, planes: Sequence[bytes | memoryview], layout: Layout) -> None:
    """Inverse of ``_split``: interleave ``planes`` into ``out``."""
    if kernels.native is not None:
        kernels.native.join(out, planes, layout.word, layout.rotate)
    else:
        _join_numpy(out, planes, layout)


def _natural_estimate(row: bytes | memoryview, level: int) -> int:
    """Bytes ``row`` in natural order may code to: GROUP_PROBE_SPANS evenly spaced
    contiguous spans of it (_SAMPLE bytes in all) coded as a plane, scaled to its length."""
    span = _SAMPLE // GROUP_PROBE_SPANS
    gap = len(row) // GROUP_PROBE_SPANS
    probe = b"".join(row[k * gap : k * gap + span] for k in range(GROUP_PROBE_SPANS))
    _, payload = _pack_plane(probe, level)
    return len(payload) * len(row) // max(len(probe), 1)


def _encode_chunk(
    chunk: memoryview, layout: Layout, level: int, context: memoryview | None = None
) -> tuple[bytes, bool]:
    """Return the chunk's planes (headers and payloads) and whether any is grouped."""
    rows: list[bytes | memoryview] = [chunk] if layout.word == 1 else [*_split(chunk, layout)]
    odds = [0.0] * len(rows)
    # Each row's sampled entropy once: the grouping odds and its method both use it.
    bits = [_entropy_bits(row) if len(row) >= 64 else 0.0 for row in rows]
    if context is not None and layout.word > 1:
        odds = [_grouping_odds(r, context, layout.word, b) for r, b in zip(rows, bits, strict=True)]
    tried = [k for k, share in enumerate(odds) if share >= GROUP_MIN_SHARE]
    grouped: dict[int, bytes] = {}
    if tried:
        assert context is not None
        rows_grouped = _group([rows[k] for k in tried], context, layout.word, True)
        grouped = dict(zip(tried, rows_grouped, strict=True))
    packed = []
    for k, row in enumerate(rows):
        if k not in grouped:
            packed.append(_pack_plane(row, level, bits[k]))
            continue
        # A plane the sample says grouping helps is encoded grouped, and unless the
        # sample is sure and a probe of the natural order agrees, in natural order too:
        # the smaller is kept.
        method, payload = _pack_plane(grouped[k], level)
        choice = (RAW, row) if method == RAW else (method | GROUPED, payload)
        sure = odds[k] >= GROUP_SURE_SHARE and len(row) >= GROUP_SURE_MIN
        if sure and _natural_estimate(row, level) < len(choice[1]) * GROUP_PROBE_MARGIN:
            sure = False  # the natural order may code as small: encode it to compare
        if not sure:
            natural = _pack_plane(row, level, bits[k])
            choice = natural if len(natural[1]) <= len(choice[1]) else choice
        packed.append(choice)
    parts: list[bytes | memoryview] = []
    for method, payload in packed:
        parts.append(_PLANE.pack(method, len(payload)))
        parts.append(payload)
    return b"".join(parts), any(method & GROUPED for method, _ in packed)


def encode_stream(
    data: bytes | bytearray | memoryview | int,
    layout: Layout = PLAIN,
    level: int = 1,
    pool: Pool | None = None,
    context: bytes | bytearray | memoryview | None = None,
    chunk_of: Callable[[int, int], bytes | bytearray | memoryview] | None = None,
) -> Iterator[bytes]:
    """Yield the content object for ``data`` part by part (deterministic for equal input).

    With ``pool``, chunks are encoded in parallel; only a few are held at a time. With
    ``context`` (as long as ``data``: a delta's previous value), planes may be stored
    grouped by it; the object then decodes only with the same context, and its header
    (whose version says whether a plane is grouped) comes after every chunk is encoded,
    so the whole object is held before the first part is yielded. With ``chunk_of``,
    the bytes encoded are not ``data``'s but ``chunk_of(start, end)`` for each chunk's
    span of it, made on demand by the worker (a delta's zigzag difference: never whole
    in memory, a tensor's size less at the peak of an add). ``data`` may then be just
    the length of those bytes (a sparse update's positions: no buffer of them exists).
    """
    if isinstance(data, int):
        if chunk_of is None:
            raise ValueError("a length alone needs chunk_of")
        view, total = None, data
    else:
        view = memoryview(data).cast("B")
        total = len(view)
    if layout.word > 1 and total % layout.word:
        layout = Layout()
    ctx = None if context is None else memoryview(context).cast("B")
    if ctx is not None and len(ctx) != total:
        raise ValueError("the context is not as long as the data")
    chunk_bytes = CHUNK_WORDS * layout.word
    starts = range(0, total, chunk_bytes)
    use = pool if total > chunk_bytes else None

    def head(version: int) -> bytes:
        return _HEAD.pack(MAGIC, version, layout.word, int(layout.rotate), 0, total, CHUNK_WORDS)

    def one(start: int) -> tuple[bytes, bool]:
        part = None if ctx is None else ctx[start : start + chunk_bytes]
        end = min(start + chunk_bytes, total)
        if chunk_of is not None:
            raw = chunk_of(start, end)
        else:
            assert view is not None
            raw = view[start:end]
        if len(raw) != end - start:
            raise ValueError("chunk_of gave a chunk of the wrong length")
        return _encode_chunk(memoryview(raw).cast("B"), layout, level, part)

    coded = pipelined(one, iter(starts), use)
    if ctx is None:  # nothing can be grouped: stream it
        yield head(VERSION)
        for body, _ in coded:
            yield body
        return
    bodies = list(coded)
    yield head(VERSION_GROUPED if any(grouped for _, grouped in bodies) else VERSION)
    for body, _ in bodies:
        yield body


def encode(
    data: bytes | bytearray | memoryview | int,
    layout: Layout = PLAIN,
    level: int = 1,
    pool: Pool | None = None,
    context: bytes | bytearray | memoryview | None = None,
    chunk_of: Callable[[int, int], bytes | bytearray | memoryview] | None = None,
) -> list[bytes]:
    """Return the content object for ``data`` as a list of parts to concatenate (see
    ``encode_stream`` for ``context`` and ``chunk_of``)."""
    return list(encode_stream(data, layout, level, pool, context, chunk_of))


def _decode_chunk(
    view: memoryview, pos: int, out: memoryview, layout: Layout, context: memoryview | None
) -> None:
    """Decode the chunk whose planes start at ``view[pos]`` into ``out``; ``context`` is
    the same span of the object's context, or None when it has none."""
    word = layout.word
    rows: list[bytes | memoryview] = []
    grouped = []
    for k in range(word):
        method, n = _PLANE.unpack_from(view, pos)
        pos += _PLANE.size
        if pos + n > len(view):
            raise ObjectCorruptError("content object is truncated")
        if method & GROUPED:
            if word == 1 or context is None:
                raise ObjectCorruptError(
                    "content object is grouped by a previous value, and it was read without one"
                )
            if len(out) // word > GROUP_MAX_WORDS:
                raise ObjectCorruptError(
                    f"content object has a grouped plane of {len(out) // word:,} words, "
                    f"more than the {GROUP_MAX_WORDS:,} of a chunk"
                )
            grouped.append(k)
        rows.append(_unpack_plane(method & ~GROUPED, view[pos : pos + n], len(out) // word))
        pos += n
    if grouped:
        assert context is not None
        back = _group([rows[k] for k in grouped], context, word, False)
        for k, row in zip(grouped, back, strict=True):
            rows[k] = row
    if word == 1:
        out[:] = rows[0]
    else:
        _join_into(out, rows, layout)


class LengthError(ObjectCorruptError):
    """An object declares more bytes than its reader expects: found from the header, before
    anything is allocated (a hostile object of 33 KB can declare gigabytes of zeros)."""


def _parse_head(head: bytes | memoryview, limit: int | None) -> tuple[Layout, int, int]:
    """Return (layout, raw length, words per chunk) from an object's fixed header.

    Raises LengthError when the raw length is over ``limit``.
    """
    if len(head) < _HEAD.size:
        raise ObjectCorruptError("content object is truncated")
    magic, version, word, flags, _, length, chunk_words = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise ObjectCorruptError("not a git-theta content object")
    if version not in VERSIONS:
        raise ObjectCorruptError(
            f"content object version {version} was written by a newer git-theta: upgrade"
        )
    if word not in _UINT or chunk_words <= 0 or length % word:
        raise ObjectCorruptError("content object header is corrupt")
    if limit is not None and length > limit:
        raise LengthError(
            f"content object declares {length:,} bytes, more than the {limit:,} expected"
        )
    return Layout(word, bool(flags & 1)), length, chunk_words


def _plane_length(head: bytes | memoryview, pos: int, plane_size: int) -> int:
    """The payload length in a plane header; never more than the plane's raw size (the
    writer stores a plane raw whenever compressing does not make it smaller)."""
    _, n = _PLANE.unpack_from(head, pos)
    if n > plane_size:
        raise ObjectCorruptError("content object is corrupt: a plane is longer than its data")
    return int(n)


def decode_stream(
    read: Callable[[int], bytes], pool: Pool | None = None, limit: int | None = None
) -> Iterator[bytearray]:
    """Decode an object read sequentially through ``read(n)``; yield the bytes chunk by
    chunk, so memory stays bounded by a few chunks whatever the tensor's size.

    Raises ObjectCorruptError when the object is malformed or truncated, LengthError
    (before reading on) when it declares more than ``limit`` bytes.
    """
    layout, length, chunk_words = _parse_head(read(_HEAD.size), limit)
    chunk_bytes = chunk_words * layout.word

    def chunks() -> Iterator[tuple[bytes, int]]:
        for start in range(0, length, chunk_bytes):
            size = min(chunk_bytes, length - start)
            parts = []
            for _ in range(layout.word):
                head = read(_PLANE.size)
                if len(head) != _PLANE.size:
                    raise ObjectCorruptError("content object is truncated")
                n = _plane_length(head, 0, size // layout.word)
                body = read(n)
                if len(body) != n:
                    raise ObjectCorruptError("content object is truncated")
                parts += [head, body]
            yield b"".join(parts), size

    def one(job: tuple[bytes, int]) -> bytearray:
        blob, size = job
        out = new_buffer(size)
        try:
            _decode_chunk(memoryview(blob), 0, memoryview(out), layout, None)
        except struct.error as exc:
            raise ObjectCorruptError(f"content object is corrupt: {exc}") from exc
        return out

    yield from pipelined(one, chunks(), pool if length > chunk_bytes else None)
    if read(1):
        raise ObjectCorruptError("content object has trailing bytes")


def _chunk_starts(view: memoryview, layout: Layout, length: int, chunk_words: int) -> list[int]:
    """Where each chunk's planes start (lengths only); checks the object ends there.

    Every chunk takes at least a plane header per word, so a length the object's own
    size cannot hold fails here, before its chunks are counted out or decoded.
    """
    chunk_bytes = chunk_words * layout.word
    chunks = -(-length // chunk_bytes)
    if _HEAD.size + chunks * layout.word * _PLANE.size > len(view):
        raise ObjectCorruptError("content object is truncated")
    starts = []
    pos = _HEAD.size
    for start in range(0, length, chunk_bytes):
        starts.append(pos)
        plane_size = min(chunk_bytes, length - start) // layout.word
        for _ in range(layout.word):
            pos += _PLANE.size + _plane_length(view, pos, plane_size)
    if pos != len(view):
        raise ObjectCorruptError("content object is truncated or has trailing bytes")
    return starts


def decode(
    obj: bytes | memoryview | mmap.mmap,
    pool: Pool | None = None,
    limit: int | None = None,
    context: bytes | bytearray | memoryview | None = None,
) -> bytearray:
    """Return the bytes stored in content object ``obj`` (``context``: what it was encoded
    with, for grouped planes).

    Raises ObjectCorruptError when the object is malformed or of an unknown version, or
    its context is missing or of another length, and LengthError, before allocating,
    when it declares more than ``limit`` bytes.
    """
    view = memoryview(obj).cast("B")
    layout, length, chunk_words = _parse_head(view, limit)
    starts = _checked_starts(view, layout, length, chunk_words)
    ctx = _context_for(context, length)
    out = new_buffer(length)  # every chunk below is written in full, or decode raises
    _decode_chunks(view, layout, length, chunk_words, starts, memoryview(out), _ignore, pool, ctx)
    return out


def _context_for(context: bytes | bytearray | memoryview | None, length: int) -> memoryview | None:
    """``context`` as bytes; ObjectCorruptError when it is not the object's length."""
    if context is None:
        return None
    ctx = memoryview(context).cast("B")
    if len(ctx) != length:
        raise ObjectCorruptError(
            f"content object holds {length:,} bytes, its previous value {len(ctx):,}: "
            "they must be the same size"
        )
    return ctx


def _checked_starts(view: memoryview, layout: Layout, length: int, chunk_words: int) -> list[int]:
    try:
        return _chunk_starts(view, layout, length, chunk_words)
    except struct.error as exc:
        raise ObjectCorruptError(f"content object is corrupt: {exc}") from exc


def _ignore(start: int, chunk: memoryview) -> None:
    """``decode`` writes chunks in place: nothing more to do with each."""


def decode_each(
    obj: bytes | memoryview | mmap.mmap,
    each: Callable[[int, memoryview], None],
    pool: Pool | None = None,
    limit: int | None = None,
    context: bytes | bytearray | memoryview | None = None,
) -> int:
    """Decode ``obj`` chunk by chunk, calling ``each(offset, chunk)`` (from pool threads
    when ``pool`` is given) instead of assembling the whole value; return its length.
    ``each`` must not keep the chunk: its buffer is reused for the next one.
    Memory is a few chunks, whatever the size. Raises ObjectCorruptError (LengthError
    over ``limit``) like ``decode``. A chunk's span of ``context`` is read before
    ``each`` is called for that chunk, so ``each`` may overwrite that span.
    """
    view = memoryview(obj).cast("B")
    layout, length, chunk_words = _parse_head(view, limit)
    starts = _checked_starts(view, layout, length, chunk_words)
    ctx = _context_for(context, length)
    _decode_chunks(view, layout, length, chunk_words, starts, None, each, pool, ctx)
    return length


def _decode_chunks(
    view: memoryview,
    layout: Layout,
    length: int,
    chunk_words: int,
    starts: list[int],
    out: memoryview | None,
    each: Callable[[int, memoryview], None],
    pool: Pool | None,
    context: memoryview | None = None,
) -> None:
    """Decode every chunk into ``out`` (or a scratch buffer per chunk), then ``each``."""
    chunk_bytes = chunk_words * layout.word

    def one(job: tuple[int, int]) -> None:
        pos, start = job
        size = min(chunk_bytes, length - start)
        ctx = None if context is None else context[start : start + size]
        if out is not None:
            _decode_chunk(view, pos, out[start : start + size], layout, ctx)
            each(start, out[start : start + size])
            return
        scratch = new_buffer(size)
        with memoryview(scratch) as target:
            _decode_chunk(view, pos, target, layout, ctx)
            each(start, target)
        recycle(scratch)  # each() keeps nothing of the chunk

    try:
        jobs = list(zip(starts, range(0, length, chunk_bytes), strict=True))
        if pool is not None and len(jobs) > 1:
            for _ in pool.map(one, jobs):
                pass
        else:
            for job in jobs:
                one(job)
    except struct.error as exc:
        raise ObjectCorruptError(f"content object is corrupt: {exc}") from exc
