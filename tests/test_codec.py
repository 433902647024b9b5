"""The codec must give back every bit, for every dtype and every odd value."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from git_theta import _planes, codec, kernels
from git_theta.dtypes import DTYPES
from git_theta.errors import ObjectCorruptError
from git_theta.updates.layout import layout_for


def encode(data: bytes, layout: codec.Layout | None = None) -> bytes:
    return b"".join(codec.encode(data, layout or codec.Layout()))


WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def round_trip(data: bytes, dtype: str) -> None:
    obj = encode(data, layout_for(dtype))
    assert bytes(codec.decode(obj)) == data
    assert encode(data, layout_for(dtype)) == obj  # deterministic


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), data=st.data())
def test_random_bytes_round_trip_for_every_dtype(dtype: str, data: st.DataObject) -> None:
    item = max(1, DTYPES[dtype].bits // 8)
    n = data.draw(st.integers(0, 300))
    raw = data.draw(st.binary(min_size=n * item, max_size=n * item))
    round_trip(raw, dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_large_multi_chunk_round_trip(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "CHUNK_WORDS", 1000)  # many chunks, and a ragged last one
    rng = np.random.default_rng(7)
    normal = (rng.standard_normal(12_345) * 0.02).astype(np.float32).tobytes()
    width = DTYPES[dtype].bits * 12_345 // 8
    round_trip((normal * 8)[:width], dtype)


@pytest.mark.parametrize(
    ("dtype", "np_type"), [("F16", np.float16), ("F32", np.float32), ("F64", np.float64)]
)
def test_special_float_values_survive(dtype: str, np_type: type[np.floating]) -> None:
    info = np.finfo(np_type)
    values = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            info.tiny,
            info.tiny / 4,
            -info.tiny / 8,
            info.max,
            1e-30,
        ],
        dtype=np_type,
    )
    words = values.view(WORDS[values.itemsize]).copy()
    words[4] |= 0x1  # NaN with a payload
    signalling = words.copy()
    signalling[0] = words[4] ^ (1 << (values.itemsize * 8 - 1))  # negative NaN payload
    raw = np.concatenate([words, signalling] * 50).tobytes()
    round_trip(raw, dtype)


def test_bfloat16_and_float8_with_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    x = rng.standard_normal(50_000).astype(np.float32) * 0.05
    x[:4] = [-0.0, np.inf, np.nan, 1e-40]
    round_trip(x.astype(ml_dtypes.bfloat16).tobytes(), "BF16")
    round_trip(x.astype(ml_dtypes.float8_e4m3fn).tobytes(), "F8_E4M3")
    round_trip(x.astype(ml_dtypes.float8_e5m2).tobytes(), "F8_E5M2")


def test_compresses_float_weights() -> None:
    rng = np.random.default_rng(0)
    raw = (rng.standard_normal(1 << 20) * 0.02).astype(np.float32).tobytes()
    assert len(encode(raw, layout_for("F32"))) < 0.86 * len(raw)


def test_incompressible_data_costs_only_headers() -> None:
    raw = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    assert len(encode(raw, layout_for("F32"))) <= len(raw) + 64


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b[:10], "truncated"),
        (lambda b: b"XXXX" + b[4:], "not a git-theta content object"),
        (lambda b: b[:4] + b"\x09" + b[5:], "written by a newer git-theta: upgrade"),
        (lambda b: b + b"\0", "trailing bytes"),
        (lambda b: b[:-5], "truncated"),
        # A length that is not whole words (4-byte floats here) would misalign the planes.
        (lambda b: b[:8] + (19_999).to_bytes(8, "little") + b[16:], "header is corrupt"),
    ],
)
def test_malformed_objects_are_refused(mangle: object, message: str) -> None:
    raw = (np.arange(5000, dtype=np.float32) / 7).tobytes()
    obj = encode(raw, layout_for("F32"))
    with pytest.raises(ObjectCorruptError, match=message):
        codec.decode(mangle(obj))  # type: ignore[operator]


def test_the_c_kernel_was_built() -> None:
    # The NumPy fallback is correct but several times slower; the project's own install
    # (make setup, CI) must have built the kernel, or the benchmarks measure the wrong code.
    # With GIT_THETA_KERNELS=numpy (CI's second run) the switch must pick the twins.
    wanted = os.environ.get(kernels.ENV, "native")
    assert kernels.native is (None if wanted == "numpy" else _planes)


@settings(max_examples=80, deadline=None)
@given(word=st.sampled_from([2, 4, 8]), rotate=st.booleans(), data=st.data())
def test_c_kernel_and_numpy_give_the_same_planes(
    word: int, rotate: bool, data: st.DataObject
) -> None:
    n = data.draw(st.integers(0, 200))
    raw = data.draw(st.binary(min_size=n * word, max_size=n * word))
    layout = codec.Layout(word, rotate)
    planes = _planes.split(raw, word, rotate)
    assert planes == codec._split_numpy(memoryview(raw), layout)
    joined, joined_np = bytearray(len(raw)), bytearray(len(raw))
    _planes.join(joined, planes, word, rotate)
    codec._join_numpy(memoryview(joined_np), planes, layout)
    assert joined == joined_np == raw
    step = data.draw(st.integers(1, 7))
    expected = np.bincount(np.frombuffer(raw, np.uint8)[::step], minlength=256).tolist()
    assert _planes.histogram(raw, step) == expected


def test_objects_are_the_same_with_and_without_the_c_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(7)
    values = {
        "F32": (rng.standard_normal(300_000) * 0.02).astype(np.float32).tobytes(),
        "F64": rng.standard_normal(70_000).tobytes(),
        "F16": rng.standard_normal(90_000).astype(np.float16).tobytes(),
        "I64": rng.integers(-5, 5, 40_000).tobytes(),
    }
    monkeypatch.setattr(codec, "CHUNK_WORDS", 50_000)
    native = {dtype: encode(raw, layout_for(dtype)) for dtype, raw in values.items()}
    monkeypatch.setattr(kernels, "native", None)
    for dtype, raw in values.items():
        assert encode(raw, layout_for(dtype)) == native[dtype]
        assert bytes(codec.decode(native[dtype])) == raw


def test_c_kernel_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="word must be 2, 4 or 8, not 3"):
        _planes.split(b"abcdef", 3, False)
    with pytest.raises(ValueError, match="not a multiple of the word"):
        _planes.split(b"abc", 2, False)
    with pytest.raises(ValueError, match="plane length does not match"):
        _planes.join(bytearray(4), [b"a", b"bc"], 2, False)
    with pytest.raises(ValueError, match="one plane per byte"):
        _planes.join(bytearray(4), [b"ab"], 2, False)


@settings(max_examples=80, deadline=None)
@given(word=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_c_kernel_and_numpy_agree_on_the_delta_zigzag(word: int, data: st.DataObject) -> None:
    from git_theta.updates.delta import _unzigzag, _zigzag

    n = data.draw(st.integers(0, 200))
    old = data.draw(st.binary(min_size=n * word, max_size=n * word))
    new = data.draw(st.binary(min_size=n * word, max_size=n * word))
    z = _planes.zigzag(new, old, word)
    assert z == _zigzag(new, old, word).tobytes()
    value = bytearray(old)
    _planes.unzigzag_add(value, z, word)
    assert value == new == _unzigzag(np.frombuffer(z, dtype=f"<u{word}"), old, word)
    with pytest.raises(ValueError, match="differ in length"):
        _planes.unzigzag_add(bytearray(word), b"", word)


@settings(max_examples=60, deadline=None)
@given(size=st.sampled_from([1, 2, 3, 4, 8]), data=st.data())
def test_c_kernel_sparse_scatter_matches_numpy(size: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 300))
    value = bytearray(data.draw(st.binary(min_size=n * size, max_size=n * size)))
    where = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    gaps = np.diff(np.array(where, dtype=np.uint64), prepend=np.uint64(0)).astype("<u8")
    values = data.draw(st.binary(min_size=len(where) * size, max_size=len(where) * size))
    expected = np.frombuffer(bytes(value), dtype=np.uint8).reshape(n, size).copy()
    if where:
        expected[where] = np.frombuffer(values, dtype=np.uint8).reshape(-1, size)
    _planes.scatter(value, gaps.tobytes(), values, size)
    assert bytes(value) == expected.tobytes()
    with pytest.raises(IndexError, match="past the tensor's end"):
        _planes.scatter(value, np.array([n], "<u8").tobytes(), bytes(size), size)
    with pytest.raises(IndexError, match="past the tensor's end"):  # a huge gap wraps around
        big = np.array([0, 2**64 - 1], "<u8").tobytes()
        _planes.scatter(value, big, bytes(2 * size), size)


@settings(max_examples=80, deadline=None)
@given(size=st.sampled_from([1, 2, 3, 4, 8, 16]), data=st.data())
def test_c_kernel_finds_the_same_changed_elements_as_numpy(size: int, data: st.DataObject) -> None:
    """auto counts changed elements and sparse stores them without NumPy at add time, a
    range at a time (the ranges' gaps and values join to the whole tensor's; the NumPy
    twin gives the same bytes)."""
    from git_theta.updates.sparse import _diff_numpy, _elements

    n = data.draw(st.integers(0, 300))
    old = data.draw(st.binary(min_size=n * size, max_size=n * size))
    flips = data.draw(st.sets(st.integers(0, max(0, n * size - 1)), max_size=n * size))
    new = bytearray(old)
    for i in flips:
        if i < len(new):
            new[i] ^= 1 + (i % 255)
    a, b = _elements(old, size), _elements(bytes(new), size)
    where = np.flatnonzero(a != b).astype(np.uint64)
    assert _planes.count_changed(old, new, size) == len(where)
    cuts = sorted(data.draw(st.sets(st.integers(0, n), max_size=4)) | {0, n})
    parts, last, twin_last = [], 0, 0
    for start, stop in itertools.pairwise(cuts):
        got = _planes.sparse_diff(old, new, size, start, stop, last)
        twin = _diff_numpy(old, bytes(new), size, start, stop, twin_last)
        assert got == twin
        parts.append(got)
        last = twin_last = got[2]
    gaps = b"".join(p[0] for p in parts)
    values = b"".join(p[1] for p in parts)
    assert gaps == np.diff(where, prepend=np.uint64(0)).astype("<u8").tobytes()
    assert values == b[where.astype(np.intp)].tobytes()
    restored = bytearray(old)
    _planes.scatter(restored, gaps, values, size)
    assert restored == new
    with pytest.raises(ValueError, match="not whole elements"):
        _planes.count_changed(b"abc", b"abd", 2)


def _huffman_only(raw: bytes, strategy: int) -> bytes:
    from zlib_ng import zlib_ng

    comp = zlib_ng.compressobj(1, zlib_ng.DEFLATED, -15, 9, strategy)
    return bytes(comp.compress(raw) + comp.flush())


@settings(max_examples=150, deadline=None)
@given(
    skew=st.floats(0.05, 1.0),
    n=st.integers(0, 200_000),
    matches=st.booleans(),
    flip=st.integers(0, 10**9),
    seed=st.integers(0, 2**32 - 1),
)
def test_c_huffman_inflate_gives_zlibs_bytes_or_defers_to_it(
    skew: float, n: int, matches: bool, flip: int, seed: int
) -> None:
    """The table-driven inflate takes literal-only streams (what Z_HUFFMAN_ONLY writes);
    whatever else it meets, including damage, it returns None and zlib decides."""
    from zlib_ng import zlib_ng

    rng = np.random.default_rng(seed)
    raw = np.minimum(rng.geometric(skew, n), 255).astype(np.uint8).tobytes()
    strategy = zlib_ng.Z_DEFAULT_STRATEGY if matches else zlib_ng.Z_HUFFMAN_ONLY
    payload = _huffman_only(raw, strategy)
    got = _planes.inflate_literals(payload, n)
    if not matches:
        assert got == raw  # what the codec writes is always taken
    else:
        assert got in (None, raw)
    assert _planes.inflate_literals(payload, n + 1) is None
    if payload:
        damaged = bytearray(payload)
        damaged[flip % len(damaged)] ^= 1 << (flip % 8)
        got = _planes.inflate_literals(bytes(damaged), n)
        if got is not None:  # then zlib must agree to the byte
            assert got == zlib_ng.decompressobj(-15).decompress(bytes(damaged), n)


def test_c_huffman_inflate_defers_stored_blocks_and_garbage() -> None:
    raw = bytes(range(256)) * 64  # incompressible: zlib stores it
    assert _planes.inflate_literals(_huffman_only(raw, 2), len(raw)) is None
    assert _planes.inflate_literals(b"\xff" * 64, 100) is None
    assert _planes.inflate_literals(b"", 0) is None
    weights = np.random.default_rng(0).standard_normal(300_000).astype("<f4").tobytes()
    obj = b"".join(codec.encode(weights, codec.Layout(4, True)))
    assert obj[codec._HEAD.size] == codec.HUFFMAN  # the exponent plane, decoded in C
    assert codec.decode(obj) == weights


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(["F32", "F64", "F16", "BF16"]), data=st.data())
def test_c_diff_stats_match_the_numpy_summary(dtype: str, data: st.DataObject) -> None:
    import math

    from git_theta.diffing import _WIDEN, TensorDiff, _numpy_stats

    size = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2}[dtype]
    n = data.draw(st.integers(0, 64))
    old = data.draw(st.binary(min_size=n * size, max_size=n * size))  # NaNs, infs, subnormals
    new = data.draw(st.binary(min_size=n * size, max_size=n * size))
    ref = TensorDiff("t", "modified", None, None, n)
    norm = _numpy_stats(ref, old, new, dtype)
    changed, d2, max_abs, x2 = _planes.diff_stats(old, new, _WIDEN[dtype])
    assert changed == ref.changed
    assert norm is not None and ref.l2 is not None and ref.max_abs is not None
    assert max_abs == pytest.approx(ref.max_abs, rel=1e-9) or (
        math.isinf(max_abs) and math.isinf(ref.max_abs)
    )
    for c_value, numpy_value in ((math.sqrt(d2), ref.l2), (math.sqrt(x2), norm)):
        # A sum of squares past float64 (F64 near 1e300) is inf in C; diffing then takes
        # NumPy's pass, which scales, so its norm stays finite.
        assert (
            c_value == pytest.approx(numpy_value, rel=1e-9)
            or (math.isinf(c_value) and math.isinf(numpy_value))
            or (dtype == "F64" and math.isinf(c_value))
        )


def test_recycled_buffers_are_reused_by_size_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_spare", {})
    monkeypatch.setattr(codec, "_spare_bytes", 0)
    monkeypatch.setattr(codec, "SPARE_MAX", 1000)
    a = codec.new_buffer(600)
    codec.recycle(a)
    assert codec.new_buffer(600) is a  # same size: the same memory again
    assert codec.new_buffer(600) is not a  # handed out once only
    codec.recycle(a)
    codec.recycle(codec.new_buffer(600))  # over SPARE_MAX: dropped, not kept
    codec.recycle(b"x" * 600)  # immutable: never written into
    codec.recycle(memoryview(bytearray(600)))
    assert codec._spare_bytes == 600
    assert codec.new_buffer(599) is not a


# --- grouped planes: a delta's planes ordered by its previous value's exponent ---------


def fine_tune(n: int, word: int = 4, seed: int = 5) -> tuple[bytes, bytes]:
    """(old, new) bit patterns of ``n`` weights after a few AdamW-like steps: every weight
    moves by about the same amount (~6e-5), so the change in bit-pattern units follows
    each old value's exponent."""
    rng = np.random.default_rng(seed)
    np_type = {2: np.float16, 4: np.float32, 8: np.float64}[word]
    old = (rng.standard_normal(n) * 0.02).astype(np_type)
    old[: n // 8] = 1.0 + old[: n // 8]  # layer-norm weights: another exponent
    step = 6e-5 * rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)
    new = (old + step).astype(np_type)
    return old.tobytes(), new.tobytes()


def zigzag(old: bytes, new: bytes, word: int) -> bytes:
    from git_theta.updates.delta import _zigzag

    return _zigzag(new, old, word).tobytes()


def planes_of(obj: bytes) -> list[tuple[int, int]]:
    """(method, payload length) of every plane, chunk by chunk."""
    found, pos = [], codec._HEAD.size
    while pos < len(obj):
        method, n = codec._PLANE.unpack_from(obj, pos)
        found.append((method, n))
        pos += codec._PLANE.size + n
    return found


def methods(obj: bytes) -> list[int]:
    return [method for method, _ in planes_of(obj)]


@settings(max_examples=80, deadline=None)
@given(word=st.sampled_from([2, 4, 8]), count=st.integers(0, 8), data=st.data())
def test_c_kernel_and_numpy_group_planes_alike(word: int, count: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 300))
    context = data.draw(st.binary(min_size=n * word, max_size=n * word))
    planes = [data.draw(st.binary(min_size=n, max_size=n)) for _ in range(count)]
    grouped = _planes.group(planes, context, word, True)
    assert grouped == codec._group_numpy(planes, context, word, True)
    assert _planes.group(grouped, context, word, False) == planes
    assert codec._group_numpy(grouped, context, word, False) == planes


@pytest.mark.parametrize("n", [3, 4, 10_003, 65_536])
def test_c_grouping_keeps_the_stable_order_where_keys_repeat(n: int) -> None:
    """A weight tensor's keys are a few exponents, repeated in runs and across the whole
    chunk (which the C kernel walks in parts): the order is still the stable sort's."""
    rng = np.random.default_rng(n)
    values = (rng.standard_normal(n) * 0.02).astype("<f4")
    values[: n // 3] = 0.5  # a long run of one key
    context = values.tobytes()
    planes = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for _ in range(4)]
    for count in (1, 2, 3, 4):
        grouped = _planes.group(planes[:count], context, 4, True)
        assert grouped == codec._group_numpy(planes[:count], context, 4, True)
        assert _planes.group(grouped, context, 4, False) == planes[:count]


@settings(max_examples=80, deadline=None)
@given(
    word=st.sampled_from([2, 4, 8]),
    n=st.integers(0, 5000),
    # A step past the plane (up to one that overflowed the C count) samples byte 0 only.
    step=st.one_of(st.integers(1, 7), st.integers(5000, 2**63 - 1)),
    related=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_c_kernel_and_numpy_estimate_the_same_grouping_gain(
    word: int, n: int, step: int, related: bool, seed: int
) -> None:
    """The estimate decides whether a plane is tried grouped: both kernels must get the
    same double, or the same input would give other objects without the C kernel."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 256, n * word, dtype=np.uint8)
    plane = rng.integers(0, 256, n, dtype=np.uint8)
    if related:
        plane = (plane % (1 + context[word - 1 :: word].astype(np.uint16))).astype(np.uint8)
    gain = _planes.group_gain(plane.tobytes(), context.tobytes(), word, step)
    assert gain == codec._group_gain_numpy(plane.tobytes(), context.tobytes(), word, step)
    if related and n >= 2000 and step == 1:
        assert gain > 0.3  # bytes bounded by their key: much less entropy per group


def test_c_kernel_group_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="plane length does not match the context"):
        _planes.group([b"ab", b"abc"], bytes(8), 4, True)
    with pytest.raises(ValueError, match="word must be 2, 4 or 8, not 3"):
        _planes.group([b"a"], bytes(3), 3, True)
    with pytest.raises(ValueError, match="context is not whole words"):
        _planes.group([b"a"], bytes(5), 4, False)
    with pytest.raises(ValueError, match="at most 8 planes"):
        _planes.group([b""] * 9, b"", 4, True)
    with pytest.raises(ValueError, match="one word per plane byte, or step < 1"):
        _planes.group_gain(b"ab", bytes(4), 4, 1)
    with pytest.raises(ValueError, match="one word per plane byte, or step < 1"):
        _planes.group_gain(b"a", bytes(4), 4, 0)


@pytest.mark.parametrize("word", [2, 4, 8])
def test_a_fine_tune_delta_grouped_by_its_previous_value_is_smaller(
    word: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(codec, "CHUNK_WORDS", 40_000)  # several chunks, a ragged last one
    old, new = fine_tune(100_000, word)
    z = zigzag(old, new, word)
    plain = encode(z, codec.Layout(word))
    grouped = b"".join(codec.encode(z, codec.Layout(word), context=old))
    assert len(grouped) < len(plain)
    pairs = [(g, p) for g, p in zip(planes_of(grouped), planes_of(plain), strict=True)]
    kept = [(g[1], p[1]) for g, p in pairs if g[0] & codec.GROUPED]
    assert kept, "no plane was stored grouped"
    assert sum(g for g, _ in kept) < 0.97 * sum(p for _, p in kept)
    assert all(g[1] == p[1] for g, p in pairs if not g[0] & codec.GROUPED)
    assert bytes(codec.decode(grouped, context=old)) == z
    monkeypatch.setattr(kernels, "native", None)  # the NumPy twins: the same bytes
    assert b"".join(codec.encode(z, codec.Layout(word), context=old)) == grouped
    assert bytes(codec.decode(grouped, context=bytearray(old))) == z


def test_a_change_proportional_to_the_weight_is_not_even_tried_grouped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Multiplicative noise moves every bit pattern by about the same amount whatever the
    exponent: trying its planes grouped would cost a second encode for nothing."""
    tried: list[int] = []
    group = codec._group

    def counted(*args: Any) -> list[bytes]:
        tried.append(1)
        return group(*args)

    monkeypatch.setattr(codec, "_group", counted)
    rng = np.random.default_rng(9)
    old = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    new = (old * (1 + 1e-3 * rng.standard_normal(old.size))).astype(np.float32)
    z = zigzag(old.tobytes(), new.tobytes(), 4)
    obj = b"".join(codec.encode(z, codec.Layout(4), context=old.tobytes()))
    assert obj == encode(z, codec.Layout(4))
    assert not tried
    old_, new_ = fine_tune(200_000)  # an Adam step is tried, and kept
    codec.encode(zigzag(old_, new_, 4), codec.Layout(4), context=old_)
    assert tried


@settings(max_examples=40, deadline=None)
@given(
    word=st.sampled_from([2, 4, 8]),
    n=st.integers(0, 12_000),
    low=st.integers(1, 255),
    related=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_grouping_is_kept_only_where_it_is_smaller(
    word: int, n: int, low: int, related: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 256, n * word, dtype=np.uint8)
    z = rng.integers(0, low + 1, n * word, dtype=np.uint8)
    if related:  # each plane's bytes bounded by the context's top byte: grouping helps
        z = (z % (1 + np.repeat(context[word - 1 :: word].astype(np.uint16), word))).astype(
            np.uint8
        )
    with_context = b"".join(
        codec.encode(z.tobytes(), codec.Layout(word), context=context.tobytes())
    )
    assert len(with_context) <= len(encode(z.tobytes(), codec.Layout(word)))
    assert bytes(codec.decode(with_context, context=context.tobytes())) == z.tobytes()


def test_an_object_is_version_3_exactly_when_a_plane_is_grouped() -> None:
    """A reader from before grouped planes refuses version 3 as written by a newer
    git-theta; every object without one stays version 1, byte for byte as before."""
    old, new = fine_tune(200_000)
    z = zigzag(old, new, 4)
    obj = b"".join(codec.encode(z, codec.Layout(4), context=old))
    assert any(m & codec.GROUPED for m in methods(obj))
    assert obj[4] == 3
    assert b"".join(codec.encode_stream(z, codec.Layout(4), context=old)) == obj
    assert bytes(codec.decode(obj, context=old)) == z
    assert bytes(codec.decode(obj[:4] + b"\x01" + obj[5:], context=old)) == z  # as first written
    with pytest.raises(ObjectCorruptError, match="version 2 was written by a newer git-theta"):
        codec.decode(obj[:4] + b"\x02" + obj[5:], context=old)
    assert encode(z, codec.Layout(4))[4] == 1
    rng = np.random.default_rng(9)  # with a context but nothing grouped: version 1
    prev = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    noisy = (prev * (1 + 1e-3 * rng.standard_normal(prev.size))).astype(np.float32)
    z = zigzag(prev.tobytes(), noisy.tobytes(), 4)
    ungrouped = b"".join(codec.encode(z, codec.Layout(4), context=prev.tobytes()))
    assert ungrouped == encode(z, codec.Layout(4))


def test_a_periodic_plane_is_kept_in_natural_order_when_that_is_smaller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plane the sample is sure about (grouped only, no natural-order encode) whose
    natural order repeats: grouping breaks the repeats zstd finds, the probe sees them."""
    rng = np.random.default_rng(3)
    n = 1 << 18  # a plane of GROUP_SURE_MIN bytes, one chunk
    top = np.tile(rng.integers(0, 200, 2048, dtype=np.uint8), n // 2048)
    context = np.zeros((n, 4), np.uint8)
    context[:, 3], context[:, 2] = top >> 5, rng.integers(0, 2, n, dtype=np.uint8) << 7
    z = np.zeros((n, 4), np.uint8)
    z[:, 3] = top
    bits = codec._entropy_bits(top.tobytes())
    assert codec._grouping_odds(top.tobytes(), context.tobytes(), 4, bits) >= codec.GROUP_SURE_SHARE
    plain = encode(z.tobytes(), codec.Layout(4))
    for native in (True, False):
        if not native:
            monkeypatch.setattr(kernels, "native", None)
        obj = b"".join(codec.encode(z.tobytes(), codec.Layout(4), context=context.tobytes()))
        assert obj == plain  # nothing grouped: version 1, the same bytes
        assert len(obj) < 20_000


def test_a_grouped_object_decodes_only_with_a_context_of_its_size() -> None:
    import io

    old, new = fine_tune(20_000)
    z = zigzag(old, new, 4)
    obj = b"".join(codec.encode(z, codec.Layout(4), context=old))
    missing = "content object is grouped by a previous value, and it was read without one"
    with pytest.raises(ObjectCorruptError, match=missing):
        codec.decode(obj)
    with pytest.raises(ObjectCorruptError, match=missing):
        codec.decode_each(obj, lambda at, chunk: None)
    with pytest.raises(ObjectCorruptError, match=missing):
        list(codec.decode_stream(io.BytesIO(obj).read))
    other = "content object holds 80,000 bytes, its previous value 79,996: they must be the same"
    with pytest.raises(ObjectCorruptError, match=other):
        codec.decode(obj, context=old[:-4])
    with pytest.raises(ObjectCorruptError, match=other):
        codec.decode_each(obj, lambda at, chunk: None, context=old[:-4])
    # A plain object (no planes) never has a grouped plane: the flag there is corrupt.
    head = codec._HEAD.pack(b"GTHO", 1, 1, 0, 0, 4, 1 << 20)
    plain = head + codec._PLANE.pack(codec.GROUPED | codec.RAW, 4) + b"abcd"
    with pytest.raises(ObjectCorruptError, match="grouped by a previous value"):
        codec.decode(plain, context=b"wxyz")


def test_a_grouped_plane_larger_than_a_chunk_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reordering holds a plane twice: a hostile object's one giant chunk must not."""
    monkeypatch.setattr(codec, "CHUNK_WORDS", 300_000)  # one chunk, as a writer never makes
    old, new = fine_tune(300_000)
    obj = b"".join(codec.encode(zigzag(old, new, 4), codec.Layout(4), context=old))
    assert any(m & codec.GROUPED for m in methods(obj))
    monkeypatch.setattr(codec, "GROUP_MAX_WORDS", 299_999)
    with pytest.raises(ObjectCorruptError) as info:
        codec.decode(obj, context=old)
    assert str(info.value) == (
        "content object has a grouped plane of 300,000 words, more than the 299,999 of a chunk"
    )


GROUPED_SAMPLE = fine_tune(6000)
GROUPED_SAMPLE_OBJECT = b"".join(
    codec.encode(zigzag(*GROUPED_SAMPLE, 4), codec.Layout(4), context=GROUPED_SAMPLE[0])
)


@settings(max_examples=150, deadline=None)
@given(
    cut=st.one_of(st.none(), st.integers(0, 20_000)),
    flips=st.lists(st.tuples(st.integers(0, 20_000), st.integers(1, 255)), max_size=6),
    native=st.booleans(),
)
def test_a_mutated_grouped_object_is_refused_or_decodes_to_its_size(
    cut: int | None, flips: list[tuple[int, int]], native: bool
) -> None:
    assert any(m & codec.GROUPED for m in methods(GROUPED_SAMPLE_OBJECT))
    old = GROUPED_SAMPLE[0]
    obj = bytearray(GROUPED_SAMPLE_OBJECT)
    for pos, mask in flips:
        obj[pos % len(obj)] ^= mask
    if cut is not None:
        del obj[cut % (len(obj) + 1) :]
    saved = kernels.native
    kernels.native = kernels.native if native else None
    try:
        out = codec.decode(bytes(obj), limit=len(old), context=old)
    except ObjectCorruptError as exc:
        assert str(exc).isprintable() and str(exc).strip()
    else:
        assert len(out) == len(old)
    finally:
        kernels.native = saved


@pytest.mark.parametrize(("dtype", "word"), [("F16", 2), ("F32", 4), ("F64", 8)])
@pytest.mark.parametrize("kernel", ["native", "numpy"])
def test_a_delta_applies_exactly_with_grouped_planes(
    dtype: str, word: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from git_theta.updates.delta import Delta

    monkeypatch.setattr(codec, "CHUNK_WORDS", 30_000)
    if kernel == "numpy":
        monkeypatch.setattr(kernels, "native", None)
    old, new = fine_tune(70_000, word)
    parts = Delta().encode(new, old, dtype)
    assert parts is not None
    obj = b"".join(parts)
    assert any(m & codec.GROUPED for m in methods(obj))
    assert Delta().apply(bytearray(old), obj, dtype) == new


@pytest.mark.parametrize("kernel", ["native", "numpy"])
def test_a_delta_is_encoded_without_holding_the_whole_difference(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zigzag difference is made chunk by chunk on the encoding workers: an add of a
    changed 154 MB embedding held it whole beside the new and old values (a tensor's
    size past the 300 MB + 2x bound). Here 64 MB of F32: what the encode holds beside
    its output stays below the tensor's size (the chunks in flight, ~4 per core)."""
    import tracemalloc

    from git_theta import kernels
    from git_theta.updates.delta import Delta

    if kernel == "numpy":
        monkeypatch.setattr(kernels, "native", None)
    elif kernels.native is None:
        pytest.skip("no C kernel")
    rng = np.random.default_rng(11)
    old = (rng.standard_normal(16 << 20, dtype=np.float32) * 0.02).tobytes()
    new = (np.frombuffer(old, np.float32) + np.float32(2e-4)).tobytes()
    whole = Delta().encode(new, old, "F32")  # warm: pools and imports
    assert whole is not None
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        parts = Delta().encode(new, old, "F32")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert parts == whole  # the same object, chunk-made or not
    stored = sum(map(len, parts))
    assert peak - stored < len(new), (peak, stored)  # the difference is never whole
    assert Delta().apply(bytearray(old), b"".join(parts), "F32") == bytearray(new)


@pytest.mark.parametrize("claim", [1 << 29, 1 << 40])
def test_a_zstd_plane_claiming_more_than_its_size_is_refused_before_allocating(
    claim: int,
) -> None:
    """python-zstandard allocates a frame header's content size whatever max_output_size
    says: any object's plane (a tensor's as much as a glue's) is checked first."""
    import tracemalloc

    from test_review_s4_merge import _zstd_bomb

    tracemalloc.start()
    try:
        with pytest.raises(ObjectCorruptError, match="a zstd plane claims"):
            codec.decode(_zstd_bomb(300, claim))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=3000), step=st.integers(1, 9), skew=st.integers(1, 256))
def test_c_kernel_entropy_is_the_python_formulas_double(data: bytes, step: int, skew: int) -> None:
    """The plane method follows this number: the C kernel's and the formula's must be
    the same double, or the kernels would write other objects."""
    raw = bytes(b % skew for b in data)
    counts = _planes.histogram(raw, step)
    total = sum(counts)
    expected = -math.fsum(c / total * math.log2(c / total) for c in counts if c)
    got = _planes.entropy_bits(raw, step)
    assert got is not None and got.hex() == expected.hex()
