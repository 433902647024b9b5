"""merge3 on real manifests, in process: which tensors merge, which stay conflicts and why,
for dtypes a strategy cannot compute with and dtype changes on one side; and the rules
file read as hostile input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import git
from st_files import st_from_arrays

from git_theta.errors import ThetaError
from git_theta.manifest import Manifest, parse
from git_theta.merge_rules import load_rule, parse_rules
from git_theta.merging import Choice, Values, merge3
from git_theta.repo import Repo

M = "m.safetensors"


def manifest_at(repo: Path, rev: str) -> Manifest:
    return parse(git(repo, "cat-file", "blob", f"{rev}:{M}").stdout)


@pytest.fixture
def versions(repo: Path) -> tuple[Manifest, Manifest, Manifest, Repo]:
    rng = np.random.default_rng(11)
    a = (rng.standard_normal((16, 16)) * 0.02).astype(np.float32)
    b = (rng.standard_normal((16, 16)) * 0.02).astype(np.float32)
    n = np.arange(64, dtype=np.int64)
    sides = {
        "base": {"a": a, "b": b, "n": n},
        "ours": {"a": a + np.float32(1), "b": b.astype(np.float16), "n": n + 1},
        "theirs": {"a": a + np.float32(3), "b": b * np.float32(2), "n": n + 2},
    }
    for rev, values in sides.items():
        (repo / M).write_bytes(st_from_arrays(values))
        git(repo, "add", M)
        git(repo, "commit", "-q", "-m", rev)
        git(repo, "tag", rev)
    base, ours, theirs = (manifest_at(repo, rev) for rev in sides)
    return base, ours, theirs, Repo(str(repo))


def rule_of(table: dict[str, Choice]):  # type: ignore[no-untyped-def]
    return lambda name: table.get(name)


def test_what_no_strategy_resolves_is_named(versions: tuple[Manifest, ...]) -> None:
    base, ours, theirs, repo = versions  # type: ignore[misc]
    result = merge3(base, ours, theirs, Values(repo.store), rule_of({
        "a": Choice("average"), "b": Choice("average"), "n": Choice("average"),
    }))  # fmt: skip
    assert result.conflicted == ["b", "n"]
    assert result.conflicts[0] == (
        "'b' (dtype or shape changed; average cannot resolve that: only ours, theirs or base can)"
    )
    assert result.conflicts[1].startswith("'n' (")
    assert "I64" in result.conflicts[1]
    assert result.records["a"].strategy == "average"
    assert result.manifest.tensors["b"] == ours.tensors["b"]  # conflicts keep ours


def test_side_strategies_resolve_dtype_changes_and_integers(versions: tuple[Manifest, ...]) -> None:
    base, ours, theirs, repo = versions  # type: ignore[misc]
    result = merge3(base, ours, theirs, Values(repo.store), rule_of({
        "a": Choice("ties", (("density", "0.5"),)), "b": Choice("ours"), "n": Choice("theirs"),
    }))  # fmt: skip
    assert result.conflicts == []
    assert result.manifest.tensors["b"] == ours.tensors["b"]._replace(merge=result.records["b"])
    assert result.manifest.tensors["n"].hash == theirs.tensors["n"].hash  # every element
    assert result.records["a"].params[0] == ("density", "0.5")
    result.manifest.to_bytes()  # a valid manifest

    # theirs' b (F32) does not fit the header ours changed (F16): still a conflict.
    result = merge3(base, ours, theirs, Values(repo.store), rule_of({
        "a": Choice("ours"), "b": Choice("theirs"), "n": Choice("ours"),
    }))  # fmt: skip
    assert result.conflicted == ["b"]
    assert result.manifest.tensors["b"] == ours.tensors["b"]


def test_without_values_both_sided_changes_are_conflicts(versions: tuple[Manifest, ...]) -> None:
    base, ours, theirs, _ = versions  # type: ignore[misc]
    assert merge3(base, ours, theirs).conflicted == ["a", "b", "n"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("* averge\n", ".theta-merges:1: unknown merge strategy 'averge'"),
        (
            "# ok\n*\n",
            ".theta-merges:2: expected 'TENSOR_GLOB STRATEGY [PARAM=VALUE ...]', got '*'",
        ),
        ("* ties density\n", ".theta-merges:1: expected PARAM=VALUE, got 'density'"),
        ("* ties density=2\n", ".theta-merges:1: merge strategy ties: density='2' is not allowed"),
        ("* ties densty=0.5\n", ".theta-merges:1: merge strategy ties has no param 'densty'"),
        ("* average\x1b[2J\n", ".theta-merges:1: holds a control character"),
    ],
)
def test_bad_rules_are_one_line_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(ThetaError) as info:
        parse_rules(text, ".theta-merges")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_rules_file_as_hostile_input(tmp_path: Path) -> None:
    (tmp_path / ".theta-merges").write_bytes(b"* average\n" + b"# pad\n" * 200_000)
    with pytest.raises(ThetaError, match=r"1,048,576|more than"):
        load_rule(str(tmp_path))
    (tmp_path / ".theta-merges").write_bytes(b"* average \xff\n")
    with pytest.raises(ThetaError, match=r"^\.theta-merges: not UTF-8 text \(byte 10\)"):
        load_rule(str(tmp_path))
    (tmp_path / ".theta-merges").unlink()
    (tmp_path / ".theta-merges").symlink_to("/dev/zero")
    with pytest.raises(ThetaError):
        load_rule(str(tmp_path))


def test_precedence_env_over_rules_over_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "theta.mergeStrategy", "ours")
    git(tmp_path, "config", "theta.mergeParams", "")
    (tmp_path / ".theta-merges").write_text("*.bias theirs\n")
    rule, whole = load_rule(str(tmp_path))
    assert (rule("x.bias").strategy, rule("x.weight").strategy) == ("theirs", "ours")  # type: ignore[union-attr]
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    monkeypatch.setenv("GIT_THETA_MERGE_PARAMS", "weight=0.3")
    rule, whole = load_rule(str(tmp_path))
    assert rule("x.bias") == Choice("average", (("weight", "0.3"),), "GIT_THETA_MERGE_STRATEGY")
    assert whole == rule("x.bias")
    monkeypatch.delenv("GIT_THETA_MERGE_STRATEGY")
    with pytest.raises(ThetaError, match="GIT_THETA_MERGE_PARAMS needs GIT_THETA_MERGE_STRATEGY"):
        load_rule(str(tmp_path))
