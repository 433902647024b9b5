"""The merge step's C kernel (_merge.c) gives the bits of its NumPy definition: every
float dtype, every element pattern (unchanged, one side only, the same change on both,
different changes), NaN payloads, inf, -0.0 and denormals, for every strategy it runs;
and the same counts, params and errors."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from git_theta import kernels
from git_theta.merges import MERGES, _floats, _native
from git_theta.merges._threeway import _Widened
from git_theta.merges.base import MergeError, TensorMerge, merge_tensor, parse_params
from git_theta.merges.ties import Cut, find_cut

try:
    from git_theta import _merge as merge_kernel
except ImportError:  # pragma: no cover - depends on the install
    pytest.skip("the C merge kernel is not built", allow_module_level=True)

N = 70_001  # three blocks of the three-way step and a ragged end
STORAGE = {"F32": "<u4", "F16": "<u2", "BF16": "<u2", "F64": "<u8"}
FLOATS = {"F32": np.float32, "F64": np.float64}


def specials(dtype: str) -> np.ndarray:
    """Bit patterns of NaNs (quiet, signalling, negative, payloads), infinities, zeros,
    the smallest and largest denormals and normals, as the storage type."""
    if dtype == "F64":
        bits = [0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000001, 0x7FF0000000000000,
                0xFFF0000000000000, 0x8000000000000000, 0, 1, 0x800FFFFFFFFFFFFF,
                0x0010000000000000, 0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF]  # fmt: skip
    elif dtype == "F32":
        bits = [0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FA00000, 0x7F800000, 0xFF800000,
                0x80000000, 0, 1, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF]  # fmt: skip
    elif dtype == "F16":
        bits = [0x7E00, 0xFE01, 0x7C01, 0x7D00, 0x7C00, 0xFC00, 0x8000, 0, 1, 0x83FF,
                0x0400, 0x7BFF, 0xFBFF]  # fmt: skip
    else:
        bits = [0x7FC0, 0xFFC1, 0x7F81, 0x7FA0, 0x7F80, 0xFF80, 0x8000, 0, 1, 0x807F,
                0x0080, 0x7F7F, 0xFF7F]  # fmt: skip
    return np.array(bits, dtype=np.uint64).astype(STORAGE[dtype])


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 ``values`` as the dtype's bits (rounded by the NumPy definition)."""
    wide = values.astype(np.float64 if dtype == "F64" else np.float32)
    return _floats.narrow(wide, dtype).view(STORAGE[dtype])


def three(dtype: str, seed: int, with_specials: bool = True) -> tuple[np.ndarray, ...]:
    """base, ours, theirs of N elements, each element in one of the five patterns; a
    share of the values are specials and a share are coarse (equal magnitudes at TIES's
    cut, exact ties when rounding)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(N)
    coarse = rng.random(N) < 0.2
    base[coarse] = np.round(base[coarse] * 4) / 4
    step = rng.standard_normal((2, N)) * 0.05
    step[:, coarse[:N]] = np.round(step[:, coarse] * 16) / 16
    b = to_storage(base, dtype)
    o = to_storage(base + step[0], dtype)
    t = to_storage(base + step[1], dtype)
    pattern = rng.integers(0, 5, N)  # unchanged, ours only, theirs only, same, both
    o = np.where(pattern == 2, b, o)
    o = np.where(pattern == 0, b, o)
    t = np.where((pattern == 1) | (pattern == 0), b, t)
    t = np.where(pattern == 3, o, t)
    if with_specials:
        pool = specials(dtype)
        for side in (b, o, t):
            hit = rng.random(N) < 0.02
            side[hit] = rng.choice(pool, int(hit.sum()))
    return b, o, t


def both_kernels(
    key: str, b: np.ndarray | None, o: np.ndarray, t: np.ndarray, dtype: str, /, **raw: str
) -> Iterator[TensorMerge | str]:
    """The merge (or its error's message) under the NumPy definition, then the C kernel,
    then the C kernel writing its result over (a copy of) theirs."""
    strategy = MERGES.get(key)
    params = parse_params(strategy, raw)
    for kernel, in_theirs in ((None, False), (merge_kernel, False), (merge_kernel, True)):
        saved = kernels.merge
        kernels.merge = kernel
        try:
            side = t.copy() if in_theirs else t
            yield merge_tensor(
                strategy, params, b, o, side, dtype, tensor="h.0.w", overwrite_theirs=in_theirs
            )
        except MergeError as exc:
            yield str(exc)
        finally:
            kernels.merge = saved


def assert_same(key: str, b: np.ndarray | None, o: np.ndarray, t: np.ndarray, dtype: str,
                /, **raw: str) -> None:  # fmt: skip
    want, *gots = both_kernels(key, b, o, t, dtype, **raw)
    for got in gots:
        if isinstance(want, str) or isinstance(got, str):
            assert got == want
            continue
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert got.data.tobytes() == want.data.tobytes()
        counts = ("unchanged", "from_ours", "from_theirs", "same", "merged")
        assert [getattr(got, c) for c in counts] == [getattr(want, c) for c in counts]
        assert got.params == want.params


CASES = [
    ("average", {}),
    ("average", {"weight": "0.3"}),
    ("average", {"weight": "0"}),
    ("task-arithmetic", {}),
    (
        "task-arithmetic",
        {"ours_weight": ".7", "theirs_weight": "-.2", "lambda": "1.3", "normalize": "1"},
    ),
    ("task-arithmetic", {"ours_weight": "1", "theirs_weight": "-1", "normalize": "true"}),
    ("ties", {}),
    ("ties", {"density": "0.5"}),
    ("ties", {"density": "0.2", "ours_weight": "0.3", "theirs_weight": "1.5", "lambda": ".8"}),
    ("ties", {"density": "0.7", "ours_weight": "-0.5", "normalize": "false"}),
    ("ours", {}),
    ("theirs", {}),
    ("base", {}),
]


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "F64"])
@pytest.mark.parametrize(("key", "raw"), CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_the_kernel_gives_the_numpy_definitions_bits(
    dtype: str, key: str, raw: dict[str, str]
) -> None:
    b, o, t = three(dtype, seed=len(key) + len(raw))
    assert_same(key, b, o, t, dtype, **raw)
    # Specials only where TIES's cut is (NaN magnitudes, infinite task vectors) too.
    b, o, t = three(dtype, seed=7, with_specials=False)
    assert_same(key, b, o, t, dtype, **raw)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "F64"])
@pytest.mark.parametrize("key", ["average", "ours", "theirs"])
def test_without_a_base_too(dtype: str, key: str) -> None:
    _, o, t = three(dtype, seed=3)
    assert_same(key, None, o, t, dtype)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_the_cut_of_a_task_vector_full_of_nan_keeps_what_the_definition_keeps(dtype: str) -> None:
    b, o, t = three(dtype, seed=11, with_specials=False)
    o[: N // 2] = specials(dtype)[0]  # half of ours NaN: the cut at 0.8 is NaN
    assert_same("ties", b, o, t, dtype, density="0.8")


@pytest.mark.parametrize(("dtype", "raw"), [
    ("F16", {"lambda": "1e6"}), ("BF16", {"lambda": "1e38"}), ("F32", {"lambda": "1e38"}),
    ("F64", {"lambda": "1e300"}),
])  # fmt: skip
def test_inf_from_finite_versions_is_the_same_error(dtype: str, raw: dict[str, str]) -> None:
    b, o, t = three(dtype, seed=5)
    want, got, in_theirs = both_kernels("task-arithmetic", b, o, t, dtype, **raw)
    assert isinstance(want, str) and "gives values that are not finite for" in want
    assert got == want and in_theirs == want


@pytest.mark.parametrize(("dtype", "storage"), [("I8", "i1"), ("I16", "<i2"), ("I32", "<i4"),
                                                ("U64", "<u8"), ("BOOL", "u1")])  # fmt: skip
@pytest.mark.parametrize("key", ["ours", "theirs", "base"])
def test_side_picks_on_any_dtype(dtype: str, storage: str, key: str) -> None:
    rng = np.random.default_rng(2)
    b = rng.integers(0, 3, N).astype(storage)
    o = np.where(rng.random(N) < 0.5, b, rng.integers(0, 3, N).astype(storage))
    t = np.where(rng.random(N) < 0.5, b, rng.integers(0, 3, N).astype(storage))
    assert_same(key, b, o, t, dtype)
    assert_same("average", b, o, t, dtype)  # a clear error under both when it conflicts


def test_strategies_the_kernel_does_not_run_still_merge() -> None:
    b, o, t = three("F32", seed=9)
    for key, raw in (("dare", {"density": "0.5", "seed": "1"}), ("slerp", {"t": "0.4"})):
        assert_same(key, b, o, t, "F32", **raw)
    b8 = np.arange(N, dtype=np.uint8)  # an FP8 dtype runs the NumPy definition
    assert_same("average", b8, b8 ^ 1, b8 ^ 2, "F8_E4M3")


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "F64"])
@pytest.mark.parametrize("key", ["average", "task-arithmetic", "ties", "ours", "theirs", "base"])
def test_the_kernel_runs_every_merge_it_covers(dtype: str, key: str) -> None:
    """None would mean the NumPy definition ran: correct, and silently slow."""
    b, o, t = three(dtype, seed=4, with_specials=False)
    strategy = MERGES.get(key)
    params = parse_params(strategy, {"density": "0.5"} if key == "ties" else {})
    widened = _Widened(b, o, t, dtype)
    assert _native.run(merge_kernel, strategy, params, widened, o.copy(), "w") is not None


def test_a_subclass_of_a_built_in_is_not_taken_for_it() -> None:
    from git_theta.merges.linear import Average

    class Louder(Average):
        pass

    b, o, t = three("F32", seed=1)
    widened = _Widened(b, o, t, "F32")
    assert _native.run(merge_kernel, Louder(), {"weight": 0.5}, widened, o.copy(), "w") is None


def rounding_probe() -> np.ndarray:
    """float32 bit patterns: random ones, and every exponent with the dropped bits of an
    F16 and a BF16 rounding at and around the tie."""
    rng = np.random.default_rng(0)
    sample = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    exps = np.arange(512, dtype=np.uint32) << np.uint32(23)  # both signs
    tops = rng.integers(0, 1 << 23, 512, dtype=np.uint64).astype(np.uint32)
    lows = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x7FFF, 0x8000, 0x8001, 0xFFFF],
                    dtype=np.uint32)  # fmt: skip
    f16 = (exps[:, None, None] | ((tops[None, :, None] >> 13) << 13)) | lows[None, None, :5]
    bf16 = (exps[:, None, None] | ((tops[None, :, None] >> 16) << 16)) | lows[None, None, 4:]
    return np.concatenate([sample, f16.ravel(), bf16.ravel()])


@pytest.mark.parametrize(("dtype", "kind"), [("F16", 2), ("BF16", 3)])
def test_rounding_to_16_bits_is_numpys(dtype: str, kind: int) -> None:
    probe = rounding_probe()
    with np.errstate(over="ignore"):
        want = _floats.narrow(probe.view(np.float32), dtype).tobytes()
    assert merge_kernel.narrow(probe.data, kind) == want


def same_cut(a: Cut | None, b: Cut | None) -> bool:
    if a is None or b is None:
        return a is b
    nan = math.isnan(a.magnitude) and math.isnan(b.magnitude)
    return a.last == b.last and (nan or a.magnitude == b.magnitude)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("infinite", [0, 1, 10, 30_000])
def test_the_cut_found_without_a_copy_is_the_partitions(dtype: str, infinite: int) -> None:
    """Many equal magnitudes (the lowest indices win), and inf and NaN task vectors in
    numbers that put the cut among them."""
    rng = np.random.default_rng(infinite)
    base = to_storage(rng.integers(-4, 4, N) / 4, dtype)
    ours = to_storage(rng.integers(-8, 8, N) / 8, dtype)
    pool = specials(dtype)
    hit = rng.choice(N, infinite, replace=False)
    ours[hit] = rng.choice(pool[:6], infinite)  # NaNs and infinities
    widened = _Widened(base, ours, ours, dtype)
    for density in (1e-4, 0.01, 0.3, 0.5, 0.77, 0.999):
        k = max(1, int(density * N))
        saved = kernels.merge
        try:
            kernels.merge = merge_kernel
            fast = widened.task_cut(1, k)
            kernels.merge = None
            with np.errstate(invalid="ignore"):
                want = find_cut(widened, 1, density, [])
        finally:
            kernels.merge = saved
        assert isinstance(fast, Cut) and same_cut(fast, want), (density, fast, want)


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_ties_with_nothing_changed_differently_on_both_sides(dtype: str) -> None:
    b, o, t = three(dtype, seed=13)
    t = np.where(o != b, b, t)  # theirs changes only what ours left
    assert_same("ties", b, o, t, dtype, density="0.5")


@pytest.mark.parametrize("n", [0, 1, 5])
@pytest.mark.parametrize("key", ["average", "ties", "ours"])
def test_empty_and_tiny_tensors(n: int, key: str) -> None:
    b, o, t = (side[:n] for side in three("F32", seed=6))
    assert_same(key, b, o, t, "F32", **({"density": "0.5"} if key == "ties" else {}))


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F64", "I16"])
@pytest.mark.parametrize("key", ["average", "ties", "theirs"])
def test_the_kernel_merges_over_theirs_when_allowed_and_never_otherwise(
    dtype: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written over theirs, the largest tensor's merge holds three tensor-sized buffers
    instead of four; unless allowed to, the merge never touches theirs."""
    monkeypatch.setattr(kernels, "merge", merge_kernel)  # under GIT_THETA_KERNELS=numpy too
    if dtype == "I16":
        rng = np.random.default_rng(6)
        b = rng.integers(0, 3, N).astype("<i2")
        o, t = b ^ rng.integers(0, 2, N).astype("<i2"), b ^ rng.integers(0, 2, N).astype("<i2")
    else:
        b, o, t = three(dtype, seed=8, with_specials=False)
    strategy = MERGES.get(key)
    params = parse_params(strategy, {"density": "0.5"} if key == "ties" else {})
    if dtype == "I16" and key != "theirs":
        return  # only a side pick merges integers
    kept = t.copy()
    fresh = merge_tensor(strategy, params, b, o, t, dtype)
    assert t.tobytes() == kept.tobytes() and not np.shares_memory(fresh.data, t)
    over = merge_tensor(strategy, params, b, o, t, dtype, overwrite_theirs=True)
    assert np.shares_memory(over.data, t)
    assert over.data.tobytes() == fresh.data.tobytes()


def test_a_strategy_the_kernel_does_not_run_leaves_theirs_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "merge", merge_kernel)
    b, o, t = three("F32", seed=12)
    kept = t.copy()
    slerp = MERGES.get("slerp")
    params = parse_params(slerp, {"t": "0.4"})
    got = merge_tensor(slerp, params, b, o, t, "F32", overwrite_theirs=True)
    assert t.tobytes() == kept.tobytes() and not np.shares_memory(got.data, t)


def test_the_kernel_refuses_an_output_overlapping_another_input() -> None:
    b, o, t = three("F32", seed=13, with_specials=False)
    raw = bytearray(o.tobytes() + t.tobytes())
    both = np.frombuffer(raw, dtype="<u4")
    mine, theirs = both[:N], both[N:]
    args = (1, 4, 3, (0.5, 0.5, 1.0, 1.0, False, False, False, 0.0, -1, False, 0.0, -1))
    for out in (mine, both[1 : N + 1], both[N - 1 : 2 * N - 1]):
        with pytest.raises(ValueError, match="overlaps an input other than theirs"):
            merge_kernel.threeway(out, b, mine, theirs, *args)
    merge_kernel.threeway(theirs, b, mine, theirs, *args)  # exactly theirs: allowed


@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_a_delta_added_out_of_place_has_the_in_place_bits(word: int) -> None:
    from git_theta import _planes

    rng = np.random.default_rng(word)
    base = rng.integers(0, 256, 8 * 9_999, dtype=np.uint8).tobytes()
    z = rng.integers(0, 256, len(base), dtype=np.uint8)
    z[::7] = 0xFF  # the largest folded values: wrapping both ways
    want = bytearray(base)
    _planes.unzigzag_add(want, z.tobytes(), word)
    out = bytearray(len(base))
    merge_kernel.add_delta(out, base, z.tobytes(), word)
    assert out == want


def test_a_delta_added_out_of_place_refuses_bad_arguments() -> None:
    base, z = bytes(64), bytes(64)
    with pytest.raises(ValueError, match="word must be 1, 2, 4 or 8, not 3"):
        merge_kernel.add_delta(bytearray(64), base, z, 3)
    with pytest.raises(ValueError, match="differ in length or are not whole words"):
        merge_kernel.add_delta(bytearray(60), base, z, 4)
    with pytest.raises(ValueError, match="differ in length or are not whole words"):
        merge_kernel.add_delta(bytearray(62), base[:62], z[:62], 4)
    shared = bytearray(128)
    with pytest.raises(ValueError, match="out overlaps an input"):
        merge_kernel.add_delta(memoryview(shared)[:64], memoryview(shared)[32:96], z, 4)
