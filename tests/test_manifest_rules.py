"""Every rule ``manifest.parse`` checks, one hostile manifest each: a ManifestError of one
line, never another exception; and what git-theta writes always reads back."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from git_theta import chains, manifest
from git_theta.errors import ManifestError
from git_theta.manifest import parse

GOLDEN = Path(__file__).parent / "golden" / "v1.manifest"
GOOD = json.loads(GOLDEN.read_bytes())


def dump(raw: dict[str, Any]) -> bytes:
    """JSON opening as the writer's does, so is_manifest and the version peek see it."""
    rest = json.dumps({k: v for k, v in raw.items() if k != "git-theta"})
    return f'{{\n "git-theta": {json.dumps(raw["git-theta"])}, {rest[1:]}'.encode()


def mutated(change: Callable[[dict[str, Any]], object]) -> bytes:
    raw = copy.deepcopy(GOOD)
    change(raw)
    return dump(raw)


def tensor(raw: dict[str, Any], name: str = "a.bias") -> dict[str, Any]:
    entry: dict[str, Any] = raw["tensors"][name]
    return entry


def set_in(path: tuple[Any, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        target: Any = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


ABS_OID = "/dev/" + "/" * 55 + "zero"
DOTS_OID = "../" * 21 + "x"
BIAS = ("tensors", "a.bias")
LINK = (*BIAS, "chain", 0)

CASES: list[tuple[str, Callable[[dict[str, Any]], object], str]] = [
    (
        "absolute-path oid",
        set_in((*LINK, "oid"), ABS_OID),
        "tensor 'a.bias': an object's oid is \"/dev/",
    ),
    ("../ oid", set_in((*LINK, "oid"), DOTS_OID), "not 64 lowercase hex"),
    ("upper-case oid", set_in((*LINK, "oid"), "A" * 64), "not 64 lowercase hex"),
    ("short glue oid", set_in(("glue", "oid"), "ab" * 31), "the header object's oid"),
    ("glue hash", set_in(("glue", "hash"), 7), "the header's hash is 7"),
    ("negative size", set_in(("size",), -1), "the file's size is -1, outside"),
    ("bool size", set_in(("size",), True), "the file's size is true, not an integer"),
    ("huge size", set_in(("size",), 1 << 60), "outside 0..4,398,046,511,104"),
    ("bool object size", set_in((*LINK, "size"), False), "size is false, not an integer"),
    ("float object size", set_in((*LINK, "size"), 72.0), "size is 72.0, not an integer"),
    ("unknown dtype", set_in((*BIAS, "dtype"), "F33"), 'unknown dtype "F33"'),
    ("dtype escape", set_in((*BIAS, "dtype"), "np:\x1b[2J"), "unknown dtype"),
    ("negative dim", set_in((*BIAS, "shape"), [-8]), "dimension that is -8"),
    ("float dim", set_in((*BIAS, "shape"), [8.0]), "dimension that is 8.0, not an integer"),
    ("bool dim", set_in((*BIAS, "shape"), [True]), "dimension that is true"),
    ("10^12 elements", set_in((*BIAS, "shape"), [10**6, 10**6, 10]), "elements, more than"),
    ("shape lies", set_in((*BIAS, "shape"), [9]), "add up to 745 bytes, but the file's"),
    ("too many dims", set_in((*BIAS, "shape"), [1] * 65), "at most 64 dimensions"),
    (
        "shape not a list",
        set_in((*BIAS, "shape"), "8"),
        "tensor 'a.bias': the shape is not a JSON list",
    ),
    ("hash", set_in((*BIAS, "hash"), "x"), "tensor 'a.bias': the hash is \"x\""),
    ("empty chain", set_in((*BIAS, "chain"), []), "the chain must have 1 to 16 links"),
    ("long chain", lambda r: tensor(r)["chain"].__imul__(17), "chain must have 1 to 16"),
    (
        "update key",
        set_in((*LINK, "update"), "de\x1bnse"),
        'update type "de\\u001bnse" is not a key',
    ),
    ("codec key", set_in((*LINK, "codec"), "x" * 65), "... is not a key"),
    ("link field", set_in((*LINK, "extra"), 1), "has unknown field 'extra'"),
    ("link lacks", lambda r: tensor(r)["chain"][0].pop("oid"), "lacks 'oid'"),
    ("entry lacks", lambda r: tensor(r).pop("hash"), "tensor 'a.bias' lacks 'hash'"),
    ("top field", set_in(("more",), 1), "the manifest has unknown field 'more'"),
    ("format", set_in(("format",), "safe tensors"), 'format "safe tensors" is not'),
    ("tensors list", set_in(("tensors",), []), "tensors is not a JSON object"),
    ("tensors null", set_in(("tensors",), None), "tensors is not a JSON object"),
    ("layout not list", set_in(("layout",), {}), "the layout is not a JSON list"),
    ("negative glue", lambda r: r["layout"].__setitem__(0, -440), "glue length of -440"),
    ("zero glue", lambda r: r["layout"].insert(1, 0), "glue length of 0"),
    ("bool in layout", lambda r: r["layout"].insert(1, True), "holds true, neither"),
    ("glue sum", lambda r: r["layout"].__setitem__(0, 400), "add up to 701 bytes"),
    ("overlap", lambda r: r["layout"].extend([-100, 100]), "glue length of -100"),
    ("unknown name", lambda r: r["layout"].append("zz"), "unknown tensor 'zz'"),
    ("name twice", lambda r: r["layout"].append("a.bias"), "names tensor 'a.bias' twice"),
    ("name missing", lambda r: r["layout"].remove("a.bias"), "'a.bias' is not in the layout"),
    ("version 0", set_in(("git-theta",), 0), "version 0 is not a version"),
    ("version bool", set_in(("git-theta",), True), "version true is not a version"),
    ("version float", set_in(("git-theta",), 1.5), "version 1.5 is not a version"),
]


def rename(raw: dict[str, Any], name: str) -> None:
    raw["tensors"][name] = raw["tensors"].pop("a.bias")
    raw["layout"][raw["layout"].index("a.bias")] = name


NAMES = [
    ("\x1b[31mred\x1b[0m", "'\\x1b[31mred\\x1b[0m' holds a control or formatting character"),
    ("a\u202eb", "'a\\u202eb' holds a control"),
    ("zero\u200bwidth", "'zero\\u200bwidth' holds"),
    ("tab\there", "'tab\\there' holds"),
    ("new\nline", "'new\\nline' holds"),
    ("c1\x9b", "'c1\\x9b' holds"),
    ("\ud800", "'\\ud800' holds"),
    ("x" * 5000, "a tensor name is 5,000 characters (at most 4,096)"),
]


def refused(data: bytes) -> str:
    with pytest.raises(ManifestError) as info:
        parse(data)
    message = str(info.value)
    assert "\n" not in message and message.isprintable()
    return message


@pytest.mark.parametrize(("case", "change", "expected"), CASES, ids=[c[0] for c in CASES])
def test_each_rule(case: str, change: Callable[[dict[str, Any]], object], expected: str) -> None:
    message = refused(mutated(change))
    assert message.startswith("invalid manifest: ")
    assert expected in message


@pytest.mark.parametrize(("name", "expected"), NAMES, ids=range(len(NAMES)))
def test_names_must_be_printable(name: str, expected: str) -> None:
    message = refused(mutated(lambda r: rename(r, name)))
    assert expected in message


def test_the_golden_manifest_and_printable_unicode_names_pass() -> None:
    assert parse(GOLDEN.read_bytes()).to_bytes() == GOLDEN.read_bytes()
    m = parse(mutated(lambda r: rename(r, "模型.层.0 — wéight ✓")))
    assert "模型.层.0 — wéight ✓" in m.tensors


def test_a_newer_manifest_says_upgrade_and_nothing_else() -> None:
    expected = "written by a newer git-theta (manifest version 2): upgrade git-theta"
    assert refused(mutated(set_in(("git-theta",), 2))) == expected
    # Whatever else it holds: fields this version does not know, or more bytes.
    newer = b'{\n "git-theta": 2, "chunks": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    assert refused(newer) == expected
    assert refused(b'{\n "git-theta": 7,' + b" " * (65 << 20) + b"}") == expected.replace("2", "7")


@pytest.mark.parametrize(
    "data",
    [
        b'{\n "git-theta": 1, "x": ' + b"[" * 100_000,
        b'{\n "git-theta": 1, "x": ' + b'{"a":' * 100_000,
        b'{\n "git-theta": 1, "size": 1' + b"0" * 5000 + b"}",
        b'{\n "git-theta": 1, "size": NaN}',
        b'{\n "git-theta": 1, "size": 1, "size": 2}',
        b'{\n "git-theta": 1, "format": "\xff"}',
        b'{\n "git-theta": 1, "format": "\xed\xa0\x80"}',
        b"[1, 2]",
        b'{\n "git-theta": 1',
    ],
    ids=["arrays", "objects", "digits", "nan", "duplicate", "utf8", "surrogate", "list", "cut"],
)
def test_malformed_json_is_one_manifest_error(data: bytes) -> None:
    refused(data)


def test_duplicate_tensor_names_are_refused() -> None:
    data = GOLDEN.read_bytes().replace(b'  "a.weight": {', b'  "a.bias": {', 1)
    assert "'a.bias' appears twice in one object" in refused(data)


def test_too_large_a_manifest_is_refused_before_parsing() -> None:
    data = GOLDEN.read_bytes()[:-3] + b" " * manifest.MAX_BYTES + b"}\n}\n"
    assert re.fullmatch(
        r"invalid manifest: [\d,]+ bytes, more than git-theta reads .*", refused(data)
    )


def test_the_writer_refuses_what_the_reader_would() -> None:
    good = parse(GOLDEN.read_bytes())
    entry = good.tensors["a.bias"]
    bad = good._replace(tensors={**good.tensors, "a.bias": entry._replace(shape=(9,))})
    with pytest.raises(ManifestError, match=r"cannot write a valid manifest: .*add up to"):
        bad.to_bytes()
    tensors = {("\x1b" if k == "a.bias" else k): v for k, v in good.tensors.items()}
    layout = tuple("\x1b" if x == "a.bias" else x for x in good.layout)
    with pytest.raises(ManifestError, match=r"tensor name '\\x1b' holds a control"):
        good._replace(tensors=tensors, layout=layout).to_bytes()


def test_opaque_dtypes_need_only_fit_in_the_file() -> None:
    def opaque(raw: dict[str, Any]) -> None:
        tensor(raw)["dtype"] = "np:str256"  # its 32 bytes are now of unknown size

    assert parse(mutated(opaque)).tensors["a.bias"].dtype == "np:str256"

    def too_large(raw: dict[str, Any]) -> None:
        opaque(raw)
        raw["size"] = 700  # less than the glue and the sized tensors

    assert "but the file's size is 700" in refused(mutated(too_large))


def test_quantized_gguf_dtypes_count_whole_blocks() -> None:
    def q4(shape: list[int]) -> Callable[[dict[str, Any]], None]:
        def change(raw: dict[str, Any]) -> None:
            tensor(raw)["dtype"], tensor(raw)["shape"] = "GGML_Q4_0", shape
            raw["size"] += 18 - 32  # one block of 32 elements is 18 bytes

        return change

    assert parse(mutated(q4([32]))).tensors["a.bias"].shape == (32,)
    assert "is not whole GGML_Q4_0 blocks" in refused(mutated(q4([31])))


def test_the_chain_cap_leaves_room_over_what_clean_writes() -> None:
    assert chains.MAX_CHAIN < manifest.MAX_LINKS
