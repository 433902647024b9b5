"""The codec's Huffman planes: raw deflate streams (RFC 1951) of literals only.

Each block of BLOCK input bytes is one dynamic-Huffman block coded with its own
histogram's code (lengths at most 15 bits), ending in its end-of-block symbol, with two
one-bit distance codes that are never used (inflaters want a complete code). zlib and
``_planes.inflate_literals`` read these streams. The C kernel (``_planes.deflate_literals``)
writes them ~2.1x as fast as zlib-ng's Z_HUFFMAN_ONLY (bench/deflate.py); the NumPy code
below is its definition for builds without a compiler, and writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from git_theta import kernels

if TYPE_CHECKING:
    import numpy as np

# Input bytes per block (bench/deflate.py): at 32 KiB the streams are zlib-ng's size on
# both kinds of Huffman plane (MiniLM's exponent planes 1.0000x, an Adam-like delta's
# 0.9999x); 64 KiB was 0.06% smaller on exponents but 2.4% larger on grouped delta
# planes (sorted by the old exponent, their histogram drifts along the plane), 16 KiB
# the reverse (+0.14%, -1.6%).
BLOCK = 1 << 15
MAX_BITS = 15  # deflate's longest literal code
CL_MAX_BITS = 7  # and code-length code
CL_ORDER = (16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15)
CL_EXTRA = (0,) * 16 + (2, 3, 7)


def literals(raw: bytes | bytearray | memoryview) -> bytes | None:
    """The stream for ``raw``, or None when it is longer than ``raw`` (keep it raw)."""
    native = kernels.native
    if native is not None:
        out: bytes | None = native.deflate_literals(raw, BLOCK)
        return out
    return literals_numpy(raw, BLOCK)


def code_lengths(freq: Sequence[int], limit: int) -> list[int]:
    """Code lengths of at most ``limit`` bits for symbols of frequencies ``freq`` (0: no
    code), as ``_planes.code_lengths`` makes them: Huffman's, the codes past the limit
    cut to it and the Kraft sum restored one unit at a time; a lone symbol gets a partner
    so the code is complete."""
    lens = [0] * len(freq)
    leaves = sorted((f, s) for s, f in enumerate(freq) if f)
    m = len(leaves)
    if m < 2:
        only = leaves[0][1] if m else 0
        lens[only] = 1
        lens[1 if only == 0 else 0] = 1
        return lens
    weight = [f for f, _ in leaves] + [0] * (m - 1)
    parent = [0] * (2 * m - 1)
    leaf, node = 0, m
    for made in range(m, 2 * m - 1):  # two ascending queues: leaves, and nodes as made
        for k in range(2):
            if leaf < m and (node >= made or weight[leaf] <= weight[node]):
                pick, leaf = leaf, leaf + 1
            else:
                pick, node = node, node + 1
            parent[pick] = made
            weight[made] = weight[made] + weight[pick] if k else weight[pick]
    depth = [0] * (2 * m - 1)
    for k in range(2 * m - 3, -1, -1):
        depth[k] = depth[parent[k]] + 1
    count = [0] * (2 * m)
    for d in depth[:m]:
        count[d] += 1
    longest = max(depth[:m])
    if longest > limit:
        for d in range(limit + 1, longest + 1):
            count[limit] += count[d]
            count[d] = 0
        kraft = sum(count[d] << (limit - d) for d in range(1, limit + 1))
        while kraft > 1 << limit:
            # One code at the limit goes, a shorter one splits in two: one unit less.
            count[limit] -= 1
            for d in range(limit - 1, 0, -1):
                if count[d]:
                    count[d] -= 1
                    count[d + 1] += 2
                    break
            kraft -= 1
        longest = limit
    i = 0
    for d in range(longest, 0, -1):  # the longest codes to the rarest symbols
        for _ in range(count[d]):
            lens[leaves[i][1]] = d
            i += 1
    return lens


def canonical_codes(lens: Sequence[int]) -> list[int]:
    """The canonical code of each symbol, bit-reversed (deflate sends the top bit first)."""
    count = [0] * (MAX_BITS + 1)
    for n in lens:
        count[n] += 1
    count[0] = 0
    nxt = [0] * (MAX_BITS + 2)
    code = 0
    for n in range(1, MAX_BITS + 1):
        code = (code + count[n - 1]) << 1
        nxt[n] = code
    out = []
    for n in lens:
        if not n:
            out.append(0)
            continue
        c = nxt[n]
        nxt[n] += 1
        out.append(int(format(c, f"0{n}b")[::-1], 2))
    return out


def _rle(lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """Run-length coded code lengths: (symbols 0-18, their extra bits' values)."""
    syms: list[int] = []
    extra: list[int] = []
    i, n = 0, len(lens)
    while i < n:
        run = 1
        while i + run < n and lens[i + run] == lens[i]:
            run += 1
        if lens[i] == 0 and run >= 3:
            take = min(run, 138)
            syms.append(18 if take >= 11 else 17)
            extra.append(take - 11 if take >= 11 else take - 3)
            i += take
        elif lens[i] and run >= 4:
            syms.append(lens[i])
            extra.append(0)
            rest = run - 1
            while rest >= 3:
                take = min(rest, 6)
                syms.append(16)
                extra.append(take - 3)
                rest -= take
            i += run - rest
        else:
            syms.append(lens[i])
            extra.append(0)
            i += 1
    return syms, extra


def _block_head(lens: Sequence[int], last: bool) -> tuple[list[int], list[int]]:
    """A dynamic block's header for literal code ``lens`` (257): (values, bit counts)."""
    values: list[int] = []
    bits: list[int] = []

    def put(value: int, k: int) -> None:
        values.append(value)
        bits.append(k)

    syms, extra = _rle(lens)
    more = _rle([1, 1])  # the two distance codes, coded on their own as zlib does
    syms, extra = syms + more[0], extra + more[1]
    freq = [0] * len(CL_ORDER)
    for s in syms:
        freq[s] += 1
    cl_lens = code_lengths(freq, CL_MAX_BITS)
    cl_codes = canonical_codes(cl_lens)
    hclen = len(CL_ORDER)
    while hclen > 4 and cl_lens[CL_ORDER[hclen - 1]] == 0:
        hclen -= 1
    put(int(last) | 2 << 1, 3)  # BFINAL, BTYPE = dynamic
    put(0, 5)  # HLIT: 257 codes
    put(1, 5)  # HDIST: 2 codes
    put(hclen - 4, 4)
    for k in range(hclen):
        put(cl_lens[CL_ORDER[k]], 3)
    for s, e in zip(syms, extra, strict=True):
        put(cl_codes[s], cl_lens[s])
        put(e, CL_EXTRA[s])
    return values, bits


def literals_numpy(raw: bytes | bytearray | memoryview, block: int) -> bytes | None:
    """NumPy version of ``_planes.deflate_literals`` (the same bytes)."""
    import numpy as np

    data = np.frombuffer(raw, dtype=np.uint8)
    n = len(data)
    values: list[np.ndarray] = []
    bits: list[np.ndarray] = []
    at = 0
    while True:
        piece = data[at : at + block]
        lens = code_lengths([*np.bincount(piece, minlength=256).tolist(), 1], MAX_BITS)
        codes = canonical_codes(lens)
        head = _block_head(lens, at + len(piece) >= n)
        values += [np.array(head[0], np.uint32), np.array(codes[:256], np.uint32)[piece]]
        bits += [np.array(head[1], np.uint8), np.array(lens[:256], np.uint8)[piece]]
        values.append(np.array([codes[256]], np.uint32))
        bits.append(np.array([lens[256]], np.uint8))
        at += len(piece)
        if at >= n:
            break
    return _pack(np.concatenate(values), np.concatenate(bits), n)


def _pack(values: np.ndarray, bits: np.ndarray, limit: int) -> bytes | None:
    """The codes ``values`` of ``bits`` (<= 15) bits each, first code in the lowest bits, as
    bytes; None when that is more than ``limit`` bytes."""
    import numpy as np

    # Neighbours joined first, twice (codes of <= 15 bits: two fit in 32, four in 64): a
    # quarter of the elements for the passes below, which cost most of this function.
    for wide in (np.uint32, np.uint64):
        if len(values) % 2:
            values = np.append(values, values.dtype.type(0))
            bits = np.append(bits, bits.dtype.type(0))
        values = values.astype(wide, copy=False)
        values = values[0::2] | values[1::2] << bits[0::2].astype(wide)
        bits = bits[0::2] + bits[1::2]
    ends = np.cumsum(bits, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    nbytes = (total + 7) // 8
    if nbytes > limit:
        return None
    starts = ends - bits
    word = starts >> 6
    offset = (starts & 63).astype(np.uint64)
    words = np.zeros(nbytes // 8 + 2, dtype=np.uint64)
    # Codes never share bits, so OR-ing the codes that start in one word is their sum;
    # the words are in order, so each run of one word reduces in one step.
    first = np.flatnonzero(np.r_[True, word[1:] != word[:-1]])
    words[word[first]] |= np.bitwise_or.reduceat(values << offset, first)
    spill = (starts & 63) + bits > 64  # a code that crosses into the next word
    # Its high bits, shifted in two steps: a shift by 64 is not defined.
    high = (values[spill] >> np.uint64(1)) >> (np.uint64(63) - offset[spill])
    words[word[spill] + 1] |= high  # at most one code crosses each boundary
    return words.astype("<u8").tobytes()[:nbytes]
