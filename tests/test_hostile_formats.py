"""One test per parser defect reproduced against git-theta (issue 13), each on the file
that showed it: the answer is one exact line (or, for a valid file, an exact round
trip), within a bounded time (CPU seconds) and peak resident memory of the process
running clean, measured in a worker process by the fuzzer's runner."""

from __future__ import annotations

import io
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hostile.cases import defect
from hostile.files import DEFECTS
from hostile.runner import Result, run

from git_theta.errors import CheckpointError, ThetaError

LIMIT = "over git-theta's limit of"
CRAFTED = "the file is corrupt or crafted"
EXPECTED = {
    # .npy headers went whole to literal_eval: 2 MB cost 950 MB, 50 MB 17.8 GB.
    "npy_header_2mb": f".npy header is 2097145 bytes, {LIMIT} 10000 bytes: {CRAFTED}",
    "npy_header_50mb": f".npy header is 52428793 bytes, {LIMIT} 10000 bytes: {CRAFTED}",
    # A negative shape was an internal error; a float one was accepted (as 2).
    "npy_negative_shape": ".npy shape (-4,) is not a tuple of non-negative integers",
    "npy_float_shape": ".npy shape (2.5,) is not a tuple of non-negative integers",
    # 2^40 paths through a shared memo: the add never ended. It is a valid file.
    "torch_shared_memo": None,
    # RecursionError from the walk, and a segfault hashing a deep tuple used as a key.
    "torch_deep_nesting": f"torch pickle nesting is 101 levels, {LIMIT} 100 levels: {CRAFTED}",
    "torch_deep_tuple_key": "pickle has a dict key that is not a plain value",
    # Shapes that lie went into manifests: a string, 10^12 elements, negative dims.
    "torch_string_shape": "pickle rebuilds a tensor whose shape is not non-negative ints",
    "torch_10e12_elements": "torch storage '0' has the wrong size",
    "torch_negative_shape": "pickle rebuilds a tensor whose shape is not non-negative ints",
    # A zip64 locator pointing at 2^63 was an internal error (OverflowError).
    "zip64_offset": "zip64 end of central directory lies outside the file",
    # 87 MB of header, 1.5M entries: past 60 s. Under the byte cap: the value count.
    "safetensors_1_5m_entries": (
        f"safetensors header is 98659307 bytes, {LIMIT} 16777216 bytes: {CRAFTED}"
    ),
    "safetensors_200k_entries": (
        f"safetensors header's JSON value count is 2200000, {LIMIT} 1048576: {CRAFTED}"
    ),
    "safetensors_deep_json": "safetensors header nests too deeply to be a header",
    # 200M u8 of GGUF metadata, each built as an int: past 60 s; nesting: RecursionError.
    "gguf_200m_array": (
        f"GGUF metadata array (200000000 elements) is 200000000 bytes, {LIMIT} 67108864 "
        f"bytes: {CRAFTED}"
    ),
    "gguf_deep_arrays": f"GGUF metadata array nesting is 101 levels, {LIMIT} 100 levels: {CRAFTED}",
    "flax_deep_nesting": f"Flax msgpack nesting is 101 levels, {LIMIT} 100 levels: {CRAFTED}",
    # 10^12 elements of an unknown type in 0 bytes went into the manifest.
    "flax_lying_shape": (
        "header lies about tensor 'p/k': 0 bytes cannot hold 1000000000000 elements of 'np:bfloat8'"
    ),
}
CPU_CAP = 2.0  # seconds
RSS_CAP = 150 << 20  # bytes: these files hold no tensor worth keeping


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Result]]:
    specs = [defect(name) for name in EXPECTED]
    yield {r.id.split("/", 1)[1]: r for r in run(specs, {}, jobs=2, hard_timeout=30)}


def test_every_defect_has_a_test() -> None:
    assert set(EXPECTED) == set(DEFECTS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reproduced_defect_is_one_line_fast_and_small(
    name: str, results: dict[str, Result]
) -> None:
    result = results[name]
    expected = EXPECTED[name]
    if expected is None:
        assert (result.outcome, result.violation) == ("ok", "")  # round trip byte-exact
    else:
        assert (result.outcome, result.message) == ("refused", expected), result.violation
    assert result.cpu < CPU_CAP, f"{result.cpu:.2f} s"
    assert result.peak_rss < RSS_CAP, f"{result.peak_rss >> 20} MB"


class _Raises:
    """A format plugin whose parser fails in a way it did not foresee."""

    key = "raises"
    needs_seek = False

    def __init__(self, exc: BaseException):
        self.exc = exc

    def read_header(self, read: object) -> list[object]:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (RecursionError("maximum recursion depth exceeded"),
         "raises checkpoint nests too deeply to parse: the file is corrupt or crafted"),
        (MemoryError(), "raises checkpoint claims more memory than there is: the file is "
                        "corrupt or crafted"),
        (struct.error("unpack requires a buffer of 8 bytes"),
         "raises checkpoint is corrupt (unpack requires a buffer of 8 bytes): check the "
         "file (save or download it again)"),
        (OverflowError("Python int too large\nto convert"),
         "raises checkpoint is corrupt (Python int too large): check the file (save or "
         "download it again)"),
        (KeyError("dtype"), "raises checkpoint is corrupt ('dtype'): check the file (save "
                            "or download it again)"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
         "raises checkpoint is corrupt ('utf-8' codec can't decode byte 0xff in position 0: "
         "invalid start byte): check the file (save or download it again)"),
    ],
)  # fmt: skip
def test_a_parser_failure_it_did_not_foresee_is_one_checkpoint_error(
    exc: BaseException, message: str
) -> None:
    from git_theta.formats import header_spans

    with pytest.raises(CheckpointError) as info:
        header_spans(_Raises(exc), io.BytesIO().read)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("shape", "dtype", "length", "message"),
    [
        ((-1, 2), "F32", 8, "tensor 'w' has the shape (-1, 2): a shape is at most 64 "
                            "non-negative integers"),
        ((2.0,), "F32", 8, "tensor 'w' has the shape (2.0,): a shape is at most 64 "
                           "non-negative integers"),
        ((True,), "U8", 1, "tensor 'w' has the shape (True,): a shape is at most 64 "
                           "non-negative integers"),
        ((1,) * 65, "U8", 1, "tensor 'w' has the shape (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
                             "1, 1, 1, 1, 1, 1, 1,...: a shape is at most 64 non-negative "
                             "integers"),
        ((2**41,), "U8", 0, "tensor 'w''s element count is 2199023255552, over git-theta's "
                            "limit of 1099511627776: the file is corrupt or crafted"),
        ((2, 2), "F32", 8, "header lies about tensor 'w': F32 [2, 2] needs 16 bytes but its "
                           "data spans 8"),
        ((33,), "GGML_Q8_0", 34, "tensor 'w' of GGML_Q8_0 [33] is not a whole number of "
                                 "blocks"),
        ((64,), "GGML_Q8_0", 34, "header lies about tensor 'w': GGML_Q8_0 [64] needs 68 "
                                 "bytes but its data spans 34"),
        ((3,), "np:x", 4, "header lies about tensor 'w': 4 bytes cannot hold 3 elements of "
                          "'np:x'"),
        ((0,), "np:x", 4, "header lies about tensor 'w': 4 bytes cannot hold 0 elements of "
                          "'np:x'"),
    ],
)  # fmt: skip
def test_every_span_is_checked_against_its_shape_and_type(
    shape: tuple[object, ...], dtype: str, length: int, message: str
) -> None:
    from git_theta.formats import check_spans
    from git_theta.formats.base import TensorSpan

    span = TensorSpan("w", dtype, shape, 0, length)  # type: ignore[arg-type]
    with pytest.raises(ThetaError) as info:
        check_spans([span], 0)
    assert str(info.value) == message


def test_spans_past_the_file_and_too_many_are_refused() -> None:
    from git_theta.formats import check_spans
    from git_theta.formats.base import MAX_TENSORS, TensorSpan

    with pytest.raises(CheckpointError, match=r"^tensor 'w' ends at byte 16, past the end of"):
        check_spans([TensorSpan("w", "F32", (4,), 0, 16)], 0, size=12)
    many = [TensorSpan(f"t{i}", "U8", (1,), i, i + 1) for i in range(MAX_TENSORS + 1)]
    with pytest.raises(CheckpointError, match=r"^tensor count is 65537, over git-theta.s limit"):
        check_spans(many, 0)


def test_no_module_reads_a_header_around_the_checked_boundary() -> None:
    """Every path from a file to spans goes through formats.header_spans/file_spans, so
    none skips the caps on stray errors and the span checks."""
    import ast

    import git_theta

    root = Path(git_theta.__file__).parent
    bypass = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "formats":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("read_header", "read_spans"):
                bypass.append(f"{path.relative_to(root)}:{node.lineno}")
    assert bypass == []
