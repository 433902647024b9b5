"""The C kernel's "steps" low-rank reproduction (torch's rounding of a LoRA merge):
bit-identical to the NumPy definition, and NumPy never imported for it."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from git_theta import _planes
from git_theta.updates.factored import _CODES, Factor, Inputs, reproduce, reproduce_numpy

# Few-bit values make exact products and float32 ties common; tiny ones reach float32's
# subnormal range, where NumPy's definition settles double rounding by hand.
_VALUES = st.one_of(
    st.floats(-4.0, 4.0, width=32),
    st.builds(lambda m, e: m * 2.0**e, st.integers(-16, 16), st.integers(-8, 8)),
    st.builds(lambda m, e: m * 2.0**e, st.integers(-(2**20), 2**20), st.integers(-150, -120)),
    st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 65504.0]),
)


def _raw(data: st.DataObject, n: int, dtype: str) -> bytes:
    values = np.array(data.draw(st.lists(_VALUES, min_size=n, max_size=n)), np.float64)
    with np.errstate(over="ignore"):
        if dtype == "BF16":  # truncate a float32 to its top half
            return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        return values.astype({"F32": "<f4", "F16": "<f2"}[dtype]).tobytes()


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(["F32", "BF16"]),
    fdtypes=st.tuples(*[st.sampled_from(["F32", "F16", "BF16"])] * 2),
    shape=st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 9)),
    scale=st.sampled_from([1.0, 2.0, 0.5, 1 / 3, 16.0, 2.0**-60, -3.7]),
    data=st.data(),
)
def test_steps_kernel_is_bit_identical_to_the_numpy_definition(
    dtype: str, fdtypes: tuple[str, str], shape: tuple[int, int, int], scale: float,
    data: st.DataObject,
) -> None:  # fmt: skip
    """A single differing bit would make a checkout without the kernel (or with it)
    fail the hash check of every tensor stored through such a link."""
    rows, cols, rank = shape
    prev = _raw(data, rows * cols, dtype)
    r = Factor(fdtypes[0], (rows, rank), _raw(data, rows * rank, fdtypes[0]))
    c = Factor(fdtypes[1], (rank, cols), _raw(data, rank * cols, fdtypes[1]))
    inputs = Inputs("low-rank", (r, c), scale, rounding="steps")
    with np.errstate(all="ignore"):
        want = reproduce_numpy(prev, dtype, (rows, cols), inputs)
    got = _planes.factored_steps(
        prev, _CODES[dtype], rows, cols, r.raw, _CODES[fdtypes[0]], c.raw, _CODES[fdtypes[1]],
        rank, scale,
    )  # fmt: skip
    assert got is not None  # finite inputs and steps: the kernel must not fall back
    assert got == want
    assert reproduce(prev, dtype, (rows, cols), inputs) == want


@pytest.mark.parametrize(
    ("prev", "r", "c", "scale"),
    [
        ([1.0, np.inf, 1.0, 1.0], [1.0, 1.0], [1.0, 1.0], 1.0),  # a non-finite value
        ([1.0, 1.0, 1.0, 1.0], [np.nan, 1.0], [1.0, 1.0], 1.0),  # a non-finite factor
        ([1.0, 1.0, 1.0, 1.0], [3e38, 1.0], [3e38, 1.0], 1.0),  # a step overflows
        ([3e38, 1.0, 1.0, 1.0], [1e38, 1.0], [1.0, 1.0], 16.0),  # the result overflows
    ],
)
def test_steps_kernel_leaves_what_is_not_finite_to_numpy(
    prev: list[float], r: list[float], c: list[float], scale: float
) -> None:
    f32 = _CODES["F32"]
    raw = [np.array(v, "<f4").tobytes() for v in (prev, r, c)]
    assert _planes.factored_steps(raw[0], f32, 2, 2, raw[1], f32, raw[2], f32, 1, scale) is None
    factors = (Factor("F32", (2, 1), raw[1]), Factor("F32", (1, 2), raw[2]))
    inputs = Inputs("low-rank", factors, scale, rounding="steps")
    with np.errstate(all="ignore"):
        want = reproduce_numpy(raw[0], "F32", (2, 2), inputs)
        assert reproduce(raw[0], "F32", (2, 2), inputs) == want


def test_steps_reproduction_of_an_f32_tensor_does_not_import_numpy() -> None:
    """Rebuilding a value stored through a torch-rounded LoRA link (the previous value of
    a changed tensor, on every `git add` after such a version) costs no NumPy import:
    ~100 ms of the filter's start on a 2-core machine."""
    script = """
import struct, sys
from git_theta.updates.factored import Factor, Inputs, reproduce
rows, cols, rank = 64, 48, 8
f32 = lambda n, k: struct.pack(f"<{n}f", *[((i * k) % 17 - 8) / 64 for i in range(n)])
r = Factor("F32", (rows, rank), f32(rows * rank, 3))
c = Factor("F32", (rank, cols), f32(rank * cols, 5))
inputs = Inputs("low-rank", (r, c), 2.0, rounding="steps")
out = reproduce(f32(rows * cols, 7), "F32", (rows, cols), inputs)
assert out is not None and len(out) == rows * cols * 4
print("numpy" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


def _f32(values: list[float]) -> bytes:
    return np.array(values, "<f4").tobytes()


def _bf16(values: list[float]) -> bytes:
    return (np.array(values, "<f4").view("<u4") >> 16).astype("<u2").tobytes()


@pytest.mark.parametrize(
    ("dtype", "prev", "r", "c", "scale"),
    [
        ("F32", _f32([1.0]), _f32([2.0]), _f32([3.0]), 1.0),  # 1 x 1, rank 1
        ("F32", _f32([-0.0]), _f32([-0.0]), _f32([1.0]), 1.0),  # -0 + (+0 + -0)
        ("F32", _f32([-0.0]), _f32([0.0]), _f32([1.0]), -1.0),  # -0 + (+0 * -1)
        ("BF16", _bf16([-0.0]), _bf16([-0.0]), _bf16([0.0]), 3.0),
        ("F32", _f32([1e-45]), _f32([1e-45]), _f32([0.5]), 1.0),  # subnormal ties
        ("F32", _f32([-1e-45]), _f32([3e-45]), _f32([0.5]), 1.0),
        ("F32", _f32([1.5e-45]), _f32([1e-45]), _f32([1e-45]), 2.0**100),
        ("F32", _f32([1.0]), _f32([2.0**-100]), _f32([2.0**-20]), 3.0e38),  # huge scale
        ("F32", _f32([1.0]), _f32([1.0]), _f32([1.0]), 3.4028235e38),
        ("F32", _f32([1.0]), _f32([1.0]), _f32([1.0]), 1 + 2.0**-24),  # scale's float32 tie
        ("F32", _f32([0.0]), _f32([1.0]), _f32([1.0]), 1e-46),  # scale rounds to +0
        ("BF16", _bf16([3.38e38]), _bf16([1.0]), _bf16([1.0]), 1e36),  # BF16 rounds to inf
    ],
)
def test_steps_kernel_edge_values_are_numpys(
    dtype: str, prev: bytes, r: bytes, c: bytes, scale: float
) -> None:
    fdtype = dtype
    inputs = Inputs(
        "low-rank", (Factor(fdtype, (1, 1), r), Factor(fdtype, (1, 1), c)), scale, rounding="steps"
    )
    with np.errstate(all="ignore"):
        want = reproduce_numpy(prev, dtype, (1, 1), inputs)
        code = _CODES[dtype]
        got = _planes.factored_steps(prev, code, 1, 1, r, code, c, code, 1, scale)
        assert reproduce(prev, dtype, (1, 1), inputs) == want
    assert got is None or got == want


_F32, _BF16 = _CODES["F32"], _CODES["BF16"]
_ONE, _FOUR = _f32([1.0]), _f32([1.0] * 4)


@pytest.mark.parametrize(
    "args",
    [
        (b"", _F32, 0, 0, b"", _F32, b"", _F32, 1, 1.0),  # a zero-size tensor
        (_ONE, _F32, 1, 1, b"", _F32, b"", _F32, 0, 1.0),  # rank 0
        (_ONE, _F32, 1, 1, _ONE, _F32, _ONE, _F32, -1, 1.0),
        (_ONE, _F32, -1, -1, _ONE, _F32, _ONE, _F32, 1, 1.0),
        (_ONE, _F32, 1, 1, _ONE[:3], _F32, _ONE, _F32, 1, 1.0),  # short factors
        (_ONE, _F32, 1, 1, _ONE, _F32, _ONE[:2], _F32, 1, 1.0),
        (_ONE, _F32, 1, 1, _ONE, _F32, _ONE[:2], _BF16, 2, 1.0),
        (_ONE + b"\0", _F32, 1, 1, _ONE, _F32, _ONE, _F32, 1, 1.0),  # long value
        (_FOUR, _F32, 2**62, 2**62, _ONE, _F32, _ONE, _F32, 1, 1.0),  # rows * cols wraps
        (_FOUR, _F32, 2, 2, _f32([1.0] * 2), _F32, _f32([1.0] * 2), _F32, 2**62, 1.0),
        (_FOUR, _F32, 2**31 + 2, 2, _f32([1.0] * 2), _F32, _f32([1.0] * 2), _F32, 1, 1.0),
        (_FOUR, 1, 2, 2, _f32([1.0] * 2), _F32, _f32([1.0] * 2), _F32, 1, 1.0),  # F64
        (_FOUR, _F32, 2, 2, _f32([1.0] * 2), 7, _f32([1.0] * 2), -1, 1, 1.0),
        (_FOUR, _F32, 2, 2, _FOUR, _F32, _f32([1.0] * 2), _F32, 2, 1.0),  # rank mismatch
    ],
)
def test_steps_kernel_checks_every_length_itself(args: tuple[object, ...]) -> None:
    """Shapes come from a stranger's object header: the kernel trusts none of them."""
    with pytest.raises((ValueError, OverflowError)):
        _planes.factored_steps(*args)  # type: ignore[arg-type]


def test_a_scale_too_large_for_a_float_is_corrupt_not_a_crash() -> None:
    """A JSON integer has no bound; one of 400 digits made float() raise OverflowError."""
    from git_theta.errors import ObjectCorruptError
    from git_theta.updates import UPDATES

    text = json.dumps(
        {
            "kind": "low-rank", "scale": 1, "shape": [2, 2], "rounding": "steps",
            "factors": [
                {"dtype": "F32", "shape": [2, 1], "size": 0},
                {"dtype": "F32", "shape": [1, 2], "size": 0},
            ],
        }
    ).replace('"scale": 1', '"scale": 1' + "0" * 400)  # fmt: skip
    payload = b"GTFX" + struct.pack("<I", len(text)) + text.encode()
    with pytest.raises(ObjectCorruptError, match="its scale is out of range"):
        UPDATES.get("low-rank").apply(bytearray(16), payload, "F32")


@pytest.mark.parametrize(
    ("r", "c", "scale"),
    [
        ([np.inf, 1.0], [0.0, 1.0], 1.0),
        ([3e38, 1.0], [3e38, 1.0], 1.0),
        ([1.0] * 2, [1.0] * 2, 1e39),
    ],
)
def test_non_finite_inputs_print_no_numpy_warnings(
    r: list[float], c: list[float], scale: float
) -> None:
    """The kernel leaves NaN and overflow to NumPy; a stranger's object with them must
    still fail with one line, not NumPy's RuntimeWarnings on stderr."""
    import warnings

    factors = (Factor("F32", (2, 1), _f32(r)), Factor("F32", (1, 2), _f32(c)))
    inputs = Inputs("low-rank", factors, scale, rounding="steps")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reproduce(_f32([1.0] * 4), "F32", (2, 2), inputs) is not None
