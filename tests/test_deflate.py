"""The Huffman plane coder (git_theta/deflate.py and _planes.deflate_literals): valid
deflate streams that zlib and the fast inflater read back exactly, the same bytes from
the C kernel and its NumPy definition, and codes no worse than zlib-ng's."""

from __future__ import annotations

import heapq
import os
import zlib

import numpy as np
import pytest
from zlib_ng import zlib_ng

from git_theta import deflate, kernels

native = kernels.native
needs_c = pytest.mark.skipif(native is None, reason="the C kernel is not built")
rng = np.random.default_rng(20261201)


def _fibonacci_bytes() -> bytes:
    """Symbol frequencies 1, 1, 2, 3, 5, ...: Huffman's code for them is ~25 bits deep,
    past deflate's 15, so the length limit has to cut it."""
    a, b, out = 1, 1, []
    for sym in range(26):
        out.append(bytes([sym]) * a)
        a, b = b, a + b
    return b"".join(out)


def _tied_counts() -> bytes:
    """200 symbols whose counts are a few values (1, 2, 300 and 9000), shuffled: the
    leaves' sort must break every tie by symbol, across all bytes of the count."""
    counts = np.random.default_rng(7).choice([1, 2, 300, 9000], 200)
    data = np.repeat(np.arange(200, dtype=np.uint8), counts)
    return np.random.default_rng(8).permutation(data).tobytes()


CASES = {
    "empty": b"",
    "one byte": b"a",
    "two symbols": b"ab" * 40,
    "one symbol": bytes(5000),
    "every byte": bytes(range(256)) * 300,
    "random": os.urandom(20000),
    "geometric": rng.geometric(0.3, 300_000).clip(0, 255).astype(np.uint8).tobytes(),
    "fibonacci": _fibonacci_bytes(),
    "three symbols": rng.integers(0, 3, 70_000).astype(np.uint8).tobytes(),
    # Every code at most 9 bits (the encoder's six-codes-a-flush loop), a length that is
    # no multiple of six, over several 16 KiB pieces.
    "short codes": rng.integers(0, 200, 100_001).astype(np.uint8).tobytes(),
    "tied counts": _tied_counts(),
}
# Each needs more bits than it has: a stream of them is longer than the bytes (None).
INCOMPRESSIBLE = {"empty", "one byte", "every byte", "random"}


def _case(name: str, block: int) -> bytes:
    """The case, cut short for tiny blocks (a block header per few bytes)."""
    data = CASES[name]
    return data[:3000] if block < 100 else data


@pytest.mark.parametrize("block", [1, 7, 1000, deflate.BLOCK])
@pytest.mark.parametrize("name", sorted(CASES))
def test_streams_read_back_exactly_by_zlib_and_the_fast_inflater(name: str, block: int) -> None:
    data = _case(name, block)
    out = deflate.literals_numpy(data, block)
    if out is None:  # coding does not pay: ~8 bits a byte, or a header every few bytes
        assert name in INCOMPRESSIBLE or block < 100
        return
    assert len(out) <= len(data)
    assert zlib.decompressobj(-15).decompress(out) == data
    if native is not None and data:
        # The fast path takes every stream the coder writes (None would mean zlib's).
        assert native.inflate_literals(out, len(data)) == data


@needs_c
@pytest.mark.parametrize("block", [1, 7, 1000, deflate.BLOCK])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_c_kernel_writes_the_numpy_definitions_bytes(name: str, block: int) -> None:
    assert native is not None
    data = _case(name, block)
    assert native.deflate_literals(data, block) == deflate.literals_numpy(data, block)


def test_none_exactly_when_the_stream_would_be_longer() -> None:
    noise = os.urandom(100_000)
    assert deflate.literals(noise) is None
    assert deflate.literals_numpy(noise, deflate.BLOCK) is None
    skewed = CASES["geometric"]
    coded = deflate.literals(skewed)
    assert coded is not None and len(coded) < len(skewed) / 2


def _huffman_cost(freq: list[int]) -> int:
    """Bits of an unrestricted Huffman code for ``freq`` (textbook heap merge)."""
    heap = [f for f in freq if f]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


@pytest.mark.parametrize("seed", range(40))
def test_code_lengths_are_complete_limited_and_optimal_within_the_limit(seed: int) -> None:
    gen = np.random.default_rng(seed)
    n = int(gen.integers(2, 258))
    # The literal code (257 symbols, 15 bits) and the code-length code (19, 7 bits).
    limit, n = (15, n) if seed % 2 else (7, min(n, 19))
    kind = seed // 2 % 4
    if kind == 0:
        freq = gen.integers(0, 1000, n).tolist()
    elif kind == 1:
        freq = (2.0 ** gen.uniform(0, 30, n)).astype(np.int64).tolist()  # very skewed
    elif kind == 2:
        freq = [0] * n
        freq[int(gen.integers(0, n))] = 5  # a lone symbol
    else:
        freq = gen.geometric(0.05, n).tolist()
    lens = deflate.code_lengths(freq, limit)
    used = [x for x in lens if x]
    assert max(used) <= limit
    assert sum(2.0**-x for x in used) == 1.0  # complete: inflaters require it
    assert all(x for f, x in zip(freq, lens, strict=True) if f)  # every symbol coded
    cost = sum(f * x for f, x in zip(freq, lens, strict=True))
    if max(used) < limit:  # the limit did not bind: Huffman's own cost
        assert cost == _huffman_cost(freq) or sum(1 for f in freq if f) < 2


def test_no_larger_than_zlib_ng_on_exponent_planes() -> None:
    """What it replaced: zlib-ng's Z_HUFFMAN_ONLY on the exponent plane of float32
    weights (the codec's commonest Huffman plane)."""
    from git_theta import codec
    from git_theta.updates.layout import layout_for

    weights = (rng.standard_normal(1 << 20) * 0.05).astype(np.float32)
    plane = codec._split(memoryview(weights.tobytes()), layout_for("F32"))[0]
    comp = zlib_ng.compressobj(1, zlib_ng.DEFLATED, -15, 9, zlib_ng.Z_HUFFMAN_ONLY)
    theirs = comp.compress(plane) + comp.flush()
    ours = deflate.literals(plane)
    assert ours is not None
    assert len(ours) <= len(theirs) * 1.001
    assert zlib.decompressobj(-15).decompress(ours) == plane


# What the coder writes for a seeded 300 kB skewed input (ten blocks): like the golden
# encoder pins, updated only when the coder changes on purpose (their fixtures are
# small: no other pin covers a stream of several blocks of the default size).
MULTIBLOCK_SHA256 = "c5c6854f299ec4745fe64aeb7087aac5bf51aa64a510969e7c535e017ffc787b"


def test_a_multi_block_stream_is_pinned() -> None:
    import hashlib

    data = np.random.default_rng(20261201).geometric(0.2, 300_000).clip(0, 255)
    raw = data.astype(np.uint8).tobytes()
    assert len(raw) > 8 * deflate.BLOCK
    out = deflate.literals(raw)
    assert out is not None and zlib.decompressobj(-15).decompress(out) == raw
    assert hashlib.sha256(out).hexdigest() == MULTIBLOCK_SHA256
    assert deflate.literals_numpy(raw, deflate.BLOCK) == out
