"""Merge strategies: the element-wise three-way step, each strategy against a reference
written from its paper's definition and against mergekit's own implementation."""

from __future__ import annotations

import hashlib
import tomllib
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from git_theta.errors import ThetaError, UsageError
from git_theta.merges import MERGES, _floats
from git_theta.merges._threeway import tensor_seed
from git_theta.merges.base import (
    MergeBaseMissingError,
    MergeShapeError,
    MergeStrategy,
    MergeTypeError,
    TensorMerge,
    combinable,
    merge_tensor,
    parse_params,
)
from git_theta.merges.ties import keep_masks

KEYS = ["ours", "theirs", "base", "average", "task-arithmetic", "ties", "dare", "slerp"]
COMPUTING = ["average", "task-arithmetic", "ties", "dare", "slerp"]
EPS32 = float(np.finfo(np.float32).eps)
ROOT = Path(__file__).resolve().parents[1]


def run(
    key: str,
    base: np.ndarray | None,
    ours: np.ndarray,
    theirs: np.ndarray,
    dtype: str = "F32",
    **raw: str,
) -> TensorMerge:
    strategy = MERGES.get(key)
    return merge_tensor(
        strategy, parse_params(strategy, raw), base, ours, theirs, dtype, tensor="w"
    )


def three(seed: int, n: int = 6144, step: float = 0.05) -> tuple[np.ndarray, ...]:
    """A base and two fine-tunes of it, every element changed differently on both."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n).astype(np.float32)
    ours = base + (step * rng.standard_normal(n)).astype(np.float32)
    theirs = base + (step * rng.standard_normal(n)).astype(np.float32)
    return base.reshape(96, -1), ours.reshape(96, -1), theirs.reshape(96, -1)


def assert_f32_close(got: np.ndarray, want: np.ndarray, *scale: np.ndarray) -> None:
    """Equal up to a few float32 roundings of terms of magnitude ``sum(|scale|)``."""
    bound = 8 * EPS32 * sum(np.abs(s.astype(np.float64)) for s in scale)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.all(err <= bound), float(np.max(err / bound))


# --- references from the papers' definitions (float64, written for clarity) ---------


def ref_task_arithmetic(
    b: np.ndarray, o: np.ndarray, t: np.ndarray, a: float, c: float, normalize: bool = False
) -> np.ndarray:
    """Ilharco et al. 2023: theta = theta_0 + sum_i lambda_i tau_i, tau_i = theta_i - theta_0."""
    b, o, t = (x.astype(np.float64) for x in (b, o, t))
    mixed = a * (o - b) + c * (t - b)
    return b + (mixed / (a + c) if normalize else mixed)


def ref_top_k(tau: np.ndarray, density: float) -> np.ndarray:
    """TIES step 1 (trim): keep the top-k% entries of tau by magnitude, zero the rest."""
    flat = tau.reshape(-1)
    k = max(1, int(density * flat.size))
    keep = np.zeros(flat.size, dtype=bool)
    keep[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
    return np.where(keep, flat, 0.0).reshape(tau.shape)


def ref_ties(
    b: np.ndarray,
    o: np.ndarray,
    t: np.ndarray,
    density: float,
    weights: tuple[float, float] = (1.0, 1.0),
    normalize: bool = True,
) -> np.ndarray:
    """Yadav et al. 2023: trim, elect sign gamma = sgn(sum tau_hat), disjoint mean over
    the tasks whose sign agrees with gamma (weighted as mergekit weights them)."""
    b64 = b.astype(np.float64)
    taus = [
        w * ref_top_k(x.astype(np.float64) - b64, density)
        for x, w in zip((o, t), weights, strict=True)
    ]
    gamma = np.where(taus[0] + taus[1] >= 0, 1.0, -1.0)
    agree = [np.sign(tau) == gamma for tau in taus]
    total = sum(np.where(m, tau, 0.0) for m, tau in zip(agree, taus, strict=True))
    count = sum(np.where(m, w, 0.0) for m, w in zip(agree, weights, strict=True))
    return b64 + (total / np.where(count == 0, 1.0, count) if normalize else total)


def ref_dare_linear(
    b: np.ndarray, o: np.ndarray, t: np.ndarray, masks: tuple[np.ndarray, np.ndarray], p: float
) -> np.ndarray:
    """Yu et al. 2023: tau_hat = (m * tau) / (1 - p), m ~ Bernoulli(1 - p); then task
    arithmetic. Here density = 1 - p."""
    b64 = b.astype(np.float64)
    taus = [m * (x.astype(np.float64) - b64) / p for x, m in zip((o, t), masks, strict=True)]
    return b64 + taus[0] + taus[1]


def ref_slerp(v0: np.ndarray, v1: np.ndarray, t: float, threshold: float = 0.9995) -> np.ndarray:
    """Shoemake 1985: sin((1-t) W)/sin W v0 + sin(t W)/sin W v1, cos W = v0.v1/|v0||v1|."""
    a, b = v0.astype(np.float64), v1.astype(np.float64)
    cos = float(np.sum(a * b) / np.linalg.norm(a) / np.linalg.norm(b))
    if abs(cos) > threshold:
        return (1 - t) * a + t * b
    w = np.arccos(cos)
    return np.sin((1 - t) * w) / np.sin(w) * a + np.sin(t * w) / np.sin(w) * b


# --- the registry ------------------------------------------------------------------


def test_all_eight_strategies_are_registered_under_their_keys() -> None:
    plugins = MERGES.all()
    assert sorted(plugins) == sorted(KEYS)
    for key, plugin in plugins.items():
        assert isinstance(plugin, MergeStrategy)
        assert plugin.name == key
        assert plugin.description and "\n" not in plugin.description
    assert [k for k in KEYS if MERGES.get(k).picks_side] == ["ours", "theirs", "base"]
    assert [k for k in KEYS if MERGES.get(k).needs_base] == [
        "base",
        "task-arithmetic",
        "ties",
        "dare",
    ]
    assert [k for k in KEYS if MERGES.get(k).uses_seed] == ["dare"]


def test_entry_point_table_names_the_built_in_classes() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
        "git_theta.plugins.merges"
    ]
    assert sorted(table) == sorted(KEYS)
    for key, where in table.items():
        module, _, name = where.partition(":")
        assert type(MERGES.get(key)).__module__ == module
        assert type(MERGES.get(key)).__name__ == name
    # Once the package is (re)installed the entry points are these too.
    from importlib.metadata import entry_points

    installed = {ep.name: ep.value for ep in entry_points(group="git_theta.plugins.merges")}
    assert installed in ({}, table)


# --- parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "raw", "message"),
    [
        ("average", {"wieght": "0.3"}, "average has no param 'wieght' (params: weight)"),
        ("average", {"weight": "1.5"}, "average: weight='1.5' is not allowed "
         "(weight takes a number in [0, 1])"),
        ("average", {"weight": "nan"}, "average: weight='nan' is not allowed "
         "(weight takes a number in [0, 1])"),
        ("ties", {"density": "0"}, "ties: density='0' is not allowed "
         "(density takes a number in (0, 1])"),
        ("ties", {"normalize": "maybe"}, "ties: normalize='maybe' is not allowed "
         "(normalize takes true or false)"),
        ("dare", {"combine": "sum"}, "dare: combine='sum' is not allowed "
         "(combine takes linear or ties)"),
        ("dare", {"seed": "1.5"}, "dare: seed='1.5' is not allowed "
         "(seed takes an integer in [0, 9.22337e+18])"),
        ("task-arithmetic", {"ours_weight": "x"}, "task-arithmetic: ours_weight='x' is not "
         "allowed (ours_weight takes a number)"),
        ("ours", {"t": "1"}, "ours has no param 't' (params: none)"),
    ],
)  # fmt: skip
def test_bad_params_are_one_line_naming_the_param_and_what_is_allowed(
    key: str, raw: dict[str, str], message: str
) -> None:
    with pytest.raises(UsageError) as caught:
        parse_params(MERGES.get(key), raw)
    assert str(caught.value) == f"merge strategy {message}"
    assert caught.value.exit_code == 2


def test_params_are_converted_and_defaults_filled() -> None:
    ties = parse_params(MERGES.get("ties"), {"density": "0.2", "normalize": "False"})
    assert ties == {
        "density": 0.2,
        "ours_weight": 1.0,
        "theirs_weight": 1.0,
        "normalize": False,
        "lambda": 1.0,
    }
    dare = parse_params(MERGES.get("dare"), {"seed": "7"})
    assert dare["seed"] == 7 and isinstance(dare["seed"], int)
    assert "seed" not in parse_params(MERGES.get("dare"), {})  # drawn by merge_tensor
    assert parse_params(MERGES.get("slerp"), {}) == {"t": 0.5, "dot_threshold": 0.9995}


# --- the element-wise three-way step ---------------------------------------------------


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def disjoint(dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Base, two sparse fine-tunes touching disjoint elements (with -0.0 and a NaN
    payload among the changes), and the expected merge."""
    rng = np.random.default_rng(3)
    n = 4096
    if dtype == "I32":
        base = rng.integers(-1000, 1000, n).astype("<i4")
        ours, theirs = base.copy(), base.copy()
        ours[:100] += 1
        theirs[2000:2100] -= 1
    else:
        view = {"F32": "<f4", "F16": "<f2"}.get(dtype, "<u2")
        base = rng.standard_normal(n).astype(np.float32)
        base[7] = 0.0
        ours, theirs = base.copy(), base.copy()
        ours[:100] += 0.5
        ours[7] = -0.0
        theirs[2000:2100] *= 3.0
        theirs_bits = theirs.view(np.uint32)
        theirs_bits[2050] = 0x7FC01234  # a NaN with a payload
        base, ours, theirs = (_floats.narrow(x, dtype).view(view) for x in (base, ours, theirs))
        if dtype == "F16":  # float16 keeps its own NaN: set one with a payload directly
            theirs.view("<u2")[2050] = 0x7E12
    expected = base.copy()
    expected[:100] = ours[:100]
    expected[7] = ours[7]
    expected[2000:2100] = theirs[2000:2100]
    return base, ours, theirs, expected


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16", "I32"])
@pytest.mark.parametrize("key", KEYS)
def test_disjoint_sparse_fine_tunes_merge_bit_exactly_under_every_strategy(
    key: str, dtype: str
) -> None:
    base, ours, theirs, expected = disjoint(dtype)
    merged = run(key, base, ours, theirs, dtype, **({"seed": "1"} if key == "dare" else {}))
    assert bits(merged.data) == bits(expected)
    assert merged.data.dtype == ours.dtype and merged.data.shape == ours.shape
    assert (merged.unchanged, merged.from_ours, merged.from_theirs, merged.same, merged.merged) == (
        4096 - 200,
        100,
        100,
        0,
        0,
    )


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16", "F8_E4M3", "F8_E5M2FNUZ", "F64"])
@pytest.mark.parametrize("key", COMPUTING)
def test_only_elements_changed_differently_on_both_sides_get_the_strategy(
    key: str, dtype: str
) -> None:
    assert combinable(dtype)
    rng = np.random.default_rng(11)
    n = 3000
    wide = rng.standard_normal((3, n)).astype(np.float32)
    base, ours, theirs = (_floats.narrow(x, dtype) for x in wide)
    only_ours, only_theirs, same = slice(0, 500), slice(500, 1000), slice(1000, 1200)
    # the rest, from 1200 on, changed differently on both sides
    ours[only_theirs] = base[only_theirs]
    ours[same] = theirs[same]
    theirs[only_ours] = base[only_ours]
    ours[7] = base[7] = theirs[7]  # unchanged
    conflict = (ours != base) & (theirs != base) & (ours != theirs)
    extra = {"seed": "5", "density": "0.5"} if key == "dare" else {}
    merged = run(key, base, ours, theirs, dtype, **extra)
    assert bits(merged.data[only_ours]) == bits(ours[only_ours])
    assert bits(merged.data[only_theirs]) == bits(theirs[only_theirs])
    assert bits(merged.data[same]) == bits(theirs[same])
    assert merged.merged == int(np.count_nonzero(conflict))
    assert (
        merged.unchanged + merged.from_ours + merged.from_theirs + merged.same + merged.merged == n
    )
    # The conflicting elements are the strategy's values on the whole tensors, rounded once.
    whole = whole_tensor_values(MERGES.get(key), base, ours, theirs, dtype, merged.params)
    assert bits(merged.data[conflict]) == bits(whole[conflict])


class OneBlock:
    """base.Blocks serving the whole tensors as a single block."""

    def __init__(self, *arrays: np.ndarray) -> None:
        self.arrays = arrays

    @property
    def size(self) -> int:
        return self.arrays[1].size

    @property
    def has_base(self) -> bool:
        return True

    def __call__(self) -> Iterator[tuple[int, np.ndarray | None, np.ndarray, np.ndarray]]:
        yield (0, *(a.copy() for a in self.arrays))


def whole_tensor_values(
    strategy: MergeStrategy,
    base: np.ndarray,
    ours: np.ndarray,
    theirs: np.ndarray,
    dtype: str,
    params: dict[str, Any],
) -> np.ndarray:
    """The strategy run on the whole tensors at once (no blocks), rounded to ``dtype``;
    a seed is the tensor's own stream, as merge_tensor derives it (run names it "w")."""
    if "seed" in params:
        params = {**params, "seed": tensor_seed(params["seed"], "w")}
    wide = [_floats.widen(x, dtype) for x in (base, ours, theirs)]
    state = strategy.prepare(OneBlock(*wide), params) if strategy.blockwise else None
    return _floats.narrow(strategy.combine(*wide, params, state, 0), dtype)


def test_tensors_added_on_both_sides_merge_where_they_differ() -> None:
    _, ours, theirs = (x.reshape(-1) for x in three(2))
    theirs[:10] = ours[:10]
    merged = run("average", None, ours, theirs, weight="0.25")
    assert bits(merged.data[:10]) == bits(ours[:10])
    assert_f32_close(merged.data, 0.75 * ours.astype(np.float64) + 0.25 * theirs, ours, theirs)
    assert (merged.same, merged.merged) == (10, ours.size - 10)
    assert bits(run("theirs", None, ours, theirs).data) == bits(theirs)
    for key in ("base", "ties", "task-arithmetic", "dare"):
        with pytest.raises(MergeBaseMissingError) as caught:
            run(key, None, ours, theirs)
        assert str(caught.value) == (
            f"tensor w: {key} needs the common ancestor's tensor and it has none (added on "
            "both sides); use ours, theirs, average or slerp"
        )


def expected_pick(
    dtype: str, base: np.ndarray, ours: np.ndarray, theirs: np.ndarray, side: np.ndarray
) -> bytes:
    """The three-way rule unit by unit, with ``side`` where both changed differently."""
    size = _floats.unit_bytes(dtype, ours.nbytes)
    b, o, t, s = (
        np.ascontiguousarray(x).reshape(-1).view(np.uint8).reshape(-1, size)
        for x in (base, ours, theirs, side)
    )
    out = []
    for bu, ou, tu, su in zip(b, o, t, s, strict=True):
        oc, tc = bytes(ou) != bytes(bu), bytes(tu) != bytes(bu)
        out.append(su if oc and tc and bytes(ou) != bytes(tu) else (tu if tc else ou))
    return b"".join(bytes(u) for u in out)


@pytest.mark.parametrize(
    ("dtype", "make"),
    [
        ("I64", lambda r: r.integers(-9, 9, 64).astype("<i8")),
        ("U8", lambda r: r.integers(0, 255, 64).astype("u1")),
        ("GGML_Q4_0", lambda r: r.integers(0, 255, (4, 18)).astype("u1")),  # 4 blocks
        ("F8_E8M0", lambda r: r.integers(0, 254, 64).astype("u1")),
        ("C64", lambda r: r.standard_normal(64).astype(np.complex64)),
        ("np:object_thing", lambda r: r.integers(0, 255, 40).astype("u1")),
    ],
)
def test_dtypes_that_cannot_be_combined_are_left_to_ours_theirs_or_base(
    dtype: str, make: Callable[[np.random.Generator], np.ndarray]
) -> None:
    rng = np.random.default_rng(4)
    base = make(rng)
    ours, theirs = make(rng), make(rng)
    assert not combinable(dtype)
    for key in COMPUTING:
        with pytest.raises(MergeTypeError) as caught:
            run(key, base, ours, theirs, dtype, **({"seed": "1"} if key == "dare" else {}))
        assert str(caught.value) == (
            f"tensor w: {key} cannot combine {dtype} tensors; use ours, theirs or base"
        )
        assert isinstance(caught.value, ThetaError)
    for key, side in (("ours", ours), ("theirs", theirs), ("base", base)):
        merged = run(key, base, ours, theirs, dtype)
        assert merged.data.dtype == ours.dtype and merged.data.shape == ours.shape
        assert bits(merged.data) == expected_pick(dtype, base, ours, theirs, side)
        assert merged.merged > 0


def test_bool_tensors_never_need_a_strategy() -> None:
    # With two values, an element both sides changed was changed the same way.
    rng = np.random.default_rng(8)
    base, ours, theirs = (rng.integers(0, 2, 256).astype(bool) for _ in range(3))
    for key in KEYS:
        merged = run(key, base, ours, theirs, "BOOL", **({"seed": "1"} if key == "dare" else {}))
        assert merged.merged == 0
        assert bits(merged.data) == expected_pick("BOOL", base, ours, theirs, ours)


def test_versions_of_different_sizes_are_refused() -> None:
    base, ours, theirs = three(1)
    with pytest.raises(MergeShapeError, match=r"^tensor w: its versions differ in size"):
        run("average", base, ours, theirs[:10])


def test_ml_dtypes_arrays_come_back_in_their_own_dtype() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    base, ours, theirs = (x.astype(ml_dtypes.bfloat16) for x in three(5))
    merged = run("average", base, ours, theirs, "BF16")
    assert merged.data.dtype == ml_dtypes.bfloat16
    raw = run("average", *(x.view("<u2") for x in (base, ours, theirs)), "BF16")
    assert bits(merged.data) == bits(raw.data)
    both = (ours != base) & (theirs != base) & (ours != theirs)
    want = ((ours.astype(np.float32) + theirs.astype(np.float32)) * np.float32(0.5)).astype(
        ml_dtypes.bfloat16
    )
    assert bits(merged.data[both]) == bits(want[both])


# --- rounding to the narrow float types, without ml_dtypes ----------------------------


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        ("BF16", "bfloat16"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ],
)
def test_rounding_matches_ml_dtypes(dtype: str, name: str) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kind = getattr(ml_dtypes, name)
    codes = np.arange(2 ** (8 * np.dtype(kind).itemsize), dtype=f"<u{np.dtype(kind).itemsize}")
    decoded = codes.view(kind).astype(np.float32)
    assert bits(_floats.widen(codes, dtype)) == bits(decoded) or np.array_equal(
        _floats.widen(codes, dtype), decoded, equal_nan=True
    )
    rng = np.random.default_rng(9)
    finite = decoded[np.isfinite(decoded)]
    # Every value, every midpoint between neighbours (ties), and random values at all scales.
    grid = np.unique(finite.astype(np.float64))
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    samples = np.concatenate(
        [
            finite,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(-np.inf)),
            (rng.standard_normal(50000) * 10.0 ** rng.integers(-8, 6, 50000)).astype(np.float32),
            np.array([np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30], np.float32),
        ]
    )
    assert bits(_floats.narrow(samples, dtype)) == bits(samples.astype(kind))


# --- each strategy against its paper and against mergekit --------------------------------


@pytest.fixture(scope="module")
def mergekit() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # never download
        yield pytest.importorskip("mergekit.merge_methods")


def torch_of(*arrays: np.ndarray) -> list[Any]:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in arrays]


def mk_average(mk: Any, b: np.ndarray, o: np.ndarray, t: np.ndarray, w: float) -> np.ndarray:
    params = {"weight": [1 - w, w], "normalize": False}
    return mk.merge_tensors(torch_of(o, t), "linear", parameters=params).numpy()


def mk_task_arithmetic(
    mk: Any,
    b: np.ndarray,
    o: np.ndarray,
    t: np.ndarray,
    a: float,
    c: float,
    normalize: bool = False,
) -> np.ndarray:
    params = {"weight": [a, c], "normalize": normalize}
    return mk.merge_tensors(
        torch_of(b, o, t), "task_arithmetic", parameters=params, base_index=0
    ).numpy()


def mk_ties(
    mk: Any,
    b: np.ndarray,
    o: np.ndarray,
    t: np.ndarray,
    density: float,
    a: float = 1.0,
    c: float = 1.0,
    normalize: bool = True,
) -> np.ndarray:
    params = {"weight": [a, c], "density": density, "normalize": normalize}
    return mk.merge_tensors(torch_of(b, o, t), "ties", parameters=params, base_index=0).numpy()


def mk_slerp(mk: Any, b: np.ndarray, o: np.ndarray, t: np.ndarray, at: float) -> np.ndarray:
    return mk.merge_tensors(torch_of(o, t), "slerp", parameters={"t": at}, base_index=0).numpy()


def test_average_equals_its_definition_and_mergekit_linear(mergekit: Any) -> None:
    base, ours, theirs = three(21)
    for w in (0.5, 0.3, 0.0, 1.0):
        got = run("average", base, ours, theirs, weight=str(w)).data
        assert_f32_close(got, (1 - w) * ours.astype(np.float64) + w * theirs, ours, theirs)
        assert_f32_close(got, mk_average(mergekit, base, ours, theirs, w), ours, theirs)


def test_task_arithmetic_equals_its_definition_and_mergekit(mergekit: Any) -> None:
    base, ours, theirs = three(22)
    for a, c, normalize in ((1.0, 1.0, False), (0.6, 0.8, False), (0.7, 0.5, True)):
        got = run(
            "task-arithmetic",
            base,
            ours,
            theirs,
            ours_weight=str(a),
            theirs_weight=str(c),
            normalize=str(normalize),
        ).data
        assert_f32_close(
            got, ref_task_arithmetic(base, ours, theirs, a, c, normalize), base, ours, theirs
        )
        want = mk_task_arithmetic(mergekit, base, ours, theirs, a, c, normalize)
        assert_f32_close(got, want, base, ours, theirs)


@pytest.mark.parametrize(
    ("density", "weights", "normalize"),
    [
        (1.0, (1.0, 1.0), True),
        (0.2, (1.0, 1.0), True),
        (0.5, (0.7, 1.3), True),
        (0.3, (1.0, 1.0), False),
    ],
)
def test_ties_equals_the_paper_and_mergekit(
    mergekit: Any, density: float, weights: tuple[float, float], normalize: bool
) -> None:
    base, ours, theirs = three(23)
    got = run(
        "ties",
        base,
        ours,
        theirs,
        density=str(density),
        ours_weight=str(weights[0]),
        theirs_weight=str(weights[1]),
        normalize=str(normalize),
    ).data
    assert_f32_close(
        got, ref_ties(base, ours, theirs, density, weights, normalize), base, ours, theirs
    )
    want = mk_ties(mergekit, base, ours, theirs, density, *weights, normalize=normalize)
    assert_f32_close(got, want, base, ours, theirs)


def test_slerp_equals_its_definition_and_mergekit_with_the_colinear_fallback(
    mergekit: Any,
) -> None:
    base, ours, theirs = three(24, step=1.0)
    for at in (0.5, 0.2, 0.9):
        got = run("slerp", base, ours, theirs, t=str(at)).data
        assert_f32_close(got, ref_slerp(ours, theirs, at), ours, theirs)
        assert_f32_close(got, mk_slerp(mergekit, base, ours, theirs, at), ours, theirs)
    # Nearly colinear (cosine above 0.9995): plain interpolation, as mergekit.
    near = (ours * np.float32(2.0) + np.float32(1e-3) * theirs).astype(np.float32)
    got = run("slerp", base, ours, near, t="0.3").data
    assert_f32_close(got, 0.7 * ours.astype(np.float64) + 0.3 * near, ours, near)
    assert_f32_close(got, mk_slerp(mergekit, base, ours, near, 0.3), ours, near)


@pytest.fixture
def fed_masks(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[np.ndarray]], None]:
    """Make mergekit's DARE draw our masks: torch.bernoulli returns them in turn."""
    import torch

    def feed(masks: list[np.ndarray]) -> None:
        queue = list(masks)

        def bernoulli(probs: Any, *args: Any, **kwargs: Any) -> Any:
            mask = queue.pop(0).reshape(tuple(probs.shape))
            return torch.from_numpy(mask.astype(np.float32)).to(probs.dtype)

        monkeypatch.setattr(torch, "bernoulli", bernoulli)

    return feed


@pytest.mark.parametrize("combine", ["linear", "ties"])
def test_dare_equals_the_paper_and_mergekit_given_the_same_masks(
    mergekit: Any, fed_masks: Callable[[list[np.ndarray]], None], combine: str
) -> None:
    base, ours, theirs = three(25)
    density, seed = 0.3, 1234
    masks = keep_masks(ours.size, density, tensor_seed(seed, "w"))
    paper = run("dare", base, ours, theirs, density=str(density), seed=str(seed)).data
    if combine == "linear":
        want = ref_dare_linear(
            base,
            ours,
            theirs,
            (masks[0].reshape(ours.shape), masks[1].reshape(ours.shape)),
            density,
        )
        assert_f32_close(paper, want, base, ours / density, theirs / density)
    got = run(
        "dare",
        base,
        ours,
        theirs,
        density=str(density),
        seed=str(seed),
        combine=combine,
        rescale="l1",
        ours_weight="0.9",
        theirs_weight="0.6",
    ).data
    fed_masks(list(masks))
    params = {"weight": [0.9, 0.6], "density": density}
    want = mergekit.merge_tensors(
        torch_of(base, ours, theirs), f"dare_{combine}", parameters=params, base_index=0
    ).numpy()
    assert_f32_close(got, want, base, ours / density, theirs / density)


def test_dare_seed_reproduces_bit_exactly_and_is_recorded_when_drawn() -> None:
    base, ours, theirs = three(26)
    first = run("dare", base, ours, theirs, density="0.4")
    seed = first.params["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**63
    again = run("dare", base, ours, theirs, density="0.4", seed=str(seed))
    assert bits(again.data) == bits(first.data)
    assert again.params == first.params
    other = run("dare", base, ours, theirs, density="0.4", seed=str(seed ^ 1))
    assert bits(other.data) != bits(first.data)
    # The masks are a fixed function of the seed (PCG64's 64-bit outputs): pinned.
    keep = keep_masks(1000, 0.3, 42)
    digest = hashlib.sha256(np.packbits(keep[0]).tobytes() + np.packbits(keep[1]).tobytes())
    assert digest.hexdigest() == "9fdfff877138b6f09f340eb1197b7d28909755e75f446c8e1d0262a095284edb"
    raw = np.random.PCG64(42).random_raw(2000) >> np.uint64(11)
    assert np.array_equal(np.concatenate(keep), raw * 2.0**-53 < 0.3)


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Return the largest distance in units in the last place between two arrays of
    16-bit float bit patterns (sign-magnitude mapped to a monotonic integer)."""

    def order(x: np.ndarray) -> np.ndarray:
        v = x.view("<u2").astype(np.int64)
        return np.where(v & 0x8000, -(v & 0x7FFF), v)

    return int(np.max(np.abs(order(a) - order(b))))


def round_torch(values: np.ndarray, dtype: str) -> np.ndarray:
    import torch

    kind = torch.bfloat16 if dtype == "BF16" else torch.float16
    return torch.from_numpy(values).to(kind).view(torch.int16).numpy().view("<u2")


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_half_precision_results_are_mergekits_float32_rounded_once_within_one_ulp(
    mergekit: Any, fed_masks: Callable[[list[np.ndarray]], None], dtype: str
) -> None:
    rng = np.random.default_rng(27)
    n = 6144
    wide = rng.standard_normal(n).astype(np.float32)
    base = _floats.narrow(wide, dtype).view("<u2")
    # Every element changed on both sides, differently: steps of 1 to 20 units.
    step_o = rng.integers(1, 21, n) * rng.choice([-1, 1], n)
    step_t = rng.integers(1, 21, n) * rng.choice([-1, 1], n)
    step_t[step_t == step_o] += 21
    ours = (base.astype(np.int64) + step_o).astype("<u2")
    theirs = (base.astype(np.int64) + step_t).astype("<u2")
    b, o, t = (_floats.widen(x, dtype) for x in (base, ours, theirs))
    masks = keep_masks(n, 0.5, tensor_seed(3, "w"))
    cases: list[tuple[str, dict[str, str], Callable[[], np.ndarray]]] = [
        ("average", {"weight": "0.3"}, lambda: mk_average(mergekit, b, o, t, 0.3)),
        (
            "task-arithmetic",
            {"ours_weight": "0.6", "theirs_weight": "0.8"},
            lambda: mk_task_arithmetic(mergekit, b, o, t, 0.6, 0.8),
        ),
        ("ties", {}, lambda: mk_ties(mergekit, b, o, t, 1.0)),
        ("slerp", {"t": "0.4"}, lambda: mk_slerp(mergekit, b, o, t, 0.4)),
    ]
    for key, raw, reference in cases:
        got = run(key, base, ours, theirs, dtype, **raw)
        assert got.merged == n
        assert ulps(got.data, round_torch(reference(), dtype)) <= 1, key
    got = run("dare", base, ours, theirs, dtype, density="0.5", seed="3", rescale="l1")
    fed_masks(list(masks))
    want = mergekit.merge_tensors(
        torch_of(b, o, t),
        "dare_linear",
        parameters={"weight": [1.0, 1.0], "density": 0.5},
        base_index=0,
    ).numpy()
    assert ulps(got.data, round_torch(want, dtype)) <= 1


# --- memory ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = 16 * 1024 * 1024  # 64 MB of float32
    rng = np.random.default_rng(6)
    base = rng.standard_normal(n, dtype=np.float32)
    ours = base + np.float32(0.01) * rng.standard_normal(n, dtype=np.float32)
    theirs = base + np.float32(0.01) * rng.standard_normal(n, dtype=np.float32)
    return base, ours, theirs


@pytest.mark.parametrize("key", COMPUTING)
def test_peak_memory_is_bounded_on_a_64_mb_tensor(
    big: tuple[np.ndarray, np.ndarray, np.ndarray], key: str
) -> None:
    base, ours, theirs = big
    strategy = MERGES.get(key)
    raw = {"ties": {"density": "0.2"}, "dare": {"density": "0.2", "seed": "1"}}.get(key, {})
    params = parse_params(strategy, raw)
    tracemalloc.start()
    try:
        merged = merge_tensor(strategy, params, base, ours, theirs, "F32")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert merged.merged > 0.99 * ours.size
    # The brief's bound is 4x the tensor plus the float32 working copies; blocks keep it
    # to the result (1x) plus a few MB, and TIES's one magnitude buffer (1x).
    scratch = 1 if key == "ties" else 0
    assert peak <= (1 + scratch) * ours.nbytes + 16 * 2**20, peak / ours.nbytes


@pytest.mark.parametrize("key", COMPUTING)
def test_results_do_not_depend_on_the_block_size(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    from git_theta.merges import _threeway

    # BF16 deltas repeat magnitudes, so TIES's cut falls among equal values, and whole
    # blocks without a conflict are skipped (DARE's draws must still line up).
    rng = np.random.default_rng(31)
    n = 20000
    base = _floats.narrow(rng.standard_normal(n).astype(np.float32), "BF16")
    ours, theirs = base.copy(), base.copy()
    ours[::3] += rng.integers(1, 4, ours[::3].size).astype("<u2")
    theirs[::2] += rng.integers(1, 4, theirs[::2].size).astype("<u2")
    theirs[5000:9000] = base[5000:9000]  # blocks with nothing to combine
    raw = {"ties": {"density": "0.3"}, "dare": {"density": "0.4", "seed": "9"}}.get(key, {})
    whole = run(key, base, ours, theirs, "BF16", **raw)
    assert 0 < whole.merged < n
    monkeypatch.setattr(_threeway, "BLOCK", 1000)
    blocked = run(key, base, ours, theirs, "BF16", **raw)
    assert bits(blocked.data) == bits(whole.data)
    if key == "dare":
        for extra in ({"rescale": "l1"}, {"combine": "ties"}):
            monkeypatch.setattr(_threeway, "BLOCK", 1 << 17)
            whole = run(key, base, ours, theirs, "BF16", **raw, **extra)
            monkeypatch.setattr(_threeway, "BLOCK", 999)
            assert bits(run(key, base, ours, theirs, "BF16", **raw, **extra).data) == bits(
                whole.data
            )


@pytest.mark.parametrize("key", COMPUTING)
def test_nan_and_inf_values_do_not_break_a_strategy(key: str) -> None:
    # A diverged fine-tune: most of ours is NaN, some of theirs is inf.
    base, ours, theirs = (x.reshape(-1) for x in three(41))
    ours[: ours.size * 9 // 10] = np.nan
    theirs[::7] = np.inf
    raw = {"ties": {"density": "0.05"}, "dare": {"density": "0.5", "seed": "2"}}.get(key, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing printed on the merge's stderr
        merged = run(key, base, ours, theirs, **raw)
    assert merged.merged == ours.size
    assert merged.data.shape == ours.shape


def test_one_seed_gives_each_tensor_its_own_drop_masks() -> None:
    # A rules file's `dare seed=7` covers every tensor; equal-sized tensors (a model's
    # q, k and v) must not all drop the same positions, yet the merge stays reproducible.
    rng = np.random.default_rng(3)
    base = rng.standard_normal(4096).astype(np.float32)
    ours, theirs = base + 1.0, base - 0.5
    dare = MERGES.get("dare")
    params = parse_params(dare, {"density": "0.5", "seed": "7"})

    def dropped(name: str) -> bytes:
        merged = merge_tensor(dare, params, base, ours, theirs, "F32", tensor=name)
        assert merged.params["seed"] == 7  # the record keeps the seed given
        return bits(merged.data)

    assert dropped("q.weight") == dropped("q.weight")
    assert dropped("q.weight") != dropped("k.weight")
