"""The optional per-tensor merge record: written only when present, checked on parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from git_theta.errors import ManifestError
from git_theta.manifest import MergeRecord, parse

GOLDEN = Path(__file__).parent / "golden" / "manifests"


def a_manifest() -> bytes:
    return (GOLDEN / "safetensors.manifest").read_bytes()


def test_record_round_trips_and_older_manifests_are_unchanged() -> None:
    old = parse(a_manifest())
    assert old.to_bytes() == a_manifest()  # no record: byte-identical
    name = sorted(old.tensors)[0]
    record = MergeRecord("ties", (("density", "0.5"), ("seed", "7")))
    merged = old._replace(tensors={**old.tensors, name: old.tensors[name]._replace(merge=record)})
    data = merged.to_bytes()
    assert b'"merge": {"strategy": "ties", "params": {"density": "0.5", "seed": "7"}}' in data
    assert parse(data).tensors[name].merge == record


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"strategy": "../x", "params": {}}, 'strategy "../x" is not a key'),
        ({"strategy": "ties", "params": {"k": "\x1b[2J"}}, "k is not printable text"),
        ({"strategy": "ties", "params": {"k": 1}}, "k is not printable text"),
        ({"strategy": "ties", "params": {"k": "v" * 200}}, "k is not printable text"),
        ({"strategy": "ties", "params": {str(i): "v" for i in range(40)}}, "more than 16"),
        ({"strategy": "ties"}, "lacks 'params'"),
        ({"strategy": "ties", "params": [], "x": 1}, "has unknown field 'x'"),
        ("ties", "is not a JSON object"),
    ],
)
def test_hostile_record_is_one_line(record: object, message: str) -> None:
    old = parse(a_manifest())
    name = sorted(old.tensors)[0]
    raw = json.loads(a_manifest())
    raw["tensors"][name]["merge"] = record
    data = b'{\n "git-theta": ' + json.dumps(raw)[len('{"git-theta": ') :].encode()
    with pytest.raises(ManifestError) as info:
        parse(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
