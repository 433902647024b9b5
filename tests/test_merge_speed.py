"""What keeps a merge fast without changing its result: ours read from the work-tree file
(never trusted: hash-checked), the largest tensor in a lane of its own, values checked
before the merge left for the checkout, and the prompt's result accepted by `git theta
merge`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import git
from st_files import st_from_arrays

from git_theta.errors import ThetaError
from git_theta.manifest import Manifest, parse
from git_theta.merging import Choice, Values, merge3
from git_theta.repo import Repo

M = "m.safetensors"


def commit(repo: Path, values: dict[str, np.ndarray], message: str) -> None:
    (repo / M).write_bytes(st_from_arrays(values))
    git(repo, "add", M)
    git(repo, "commit", "-q", "-m", message)


def at(repo: Path, rev: str) -> Manifest:
    return parse(git(repo, "cat-file", "blob", f"{rev}:{M}").stdout)


@pytest.fixture
def fine_tunes(repo: Path) -> dict[str, np.ndarray]:
    """base, then ``left`` (theirs) and main (ours, checked out) changing every element of
    c and d; a and b unchanged. Returns base."""
    rng = np.random.default_rng(5)
    base = {n: (rng.standard_normal((32, 32)) * 0.02).astype(np.float32) for n in "abcd"}
    noise = {n: rng.standard_normal((32, 32)).astype(np.float32) * 1e-3 for n in "cd"}
    commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    commit(repo, {**base, **{n: base[n] - noise[n] for n in "cd"}}, "theirs")
    git(repo, "checkout", "-q", "main")
    commit(repo, {**base, **{n: base[n] + noise[n] for n in "cd"}}, "ours")
    return base


def average(name: str) -> Choice:
    return Choice("average")


def test_ours_is_read_from_the_work_tree_file_only_where_its_bytes_hash_right(
    repo: Path, fine_tunes: dict[str, np.ndarray]
) -> None:
    base, ours, theirs = at(repo, "main~1"), at(repo, "main"), at(repo, "left")
    store = Repo(str(repo)).store
    want = merge3(base, ours, theirs, Values(store), average).manifest
    # Ours' own objects (its updates on the base's chain) gone: only the file holds ours.
    for name in "cd":
        for link in ours.tensors[name].chain[len(base.tensors[name].chain) :]:
            os.unlink(store.path(link.ref.oid))
    got = merge3(base, ours, theirs, Values(store, ours_file=str(repo / M)), average)
    assert got.manifest == want
    # A file of the right size holding other bytes is not taken for ours.
    (repo / M).write_bytes(st_from_arrays({**fine_tunes}))
    with pytest.raises(ThetaError, match="tensor 'c'"):
        merge3(base, ours, theirs, Values(store, ours_file=str(repo / M)), average)
    # Nor a file that is not there, or not a regular file.
    for path in (repo / "missing", repo):
        with pytest.raises(ThetaError, match="tensor 'c'"):
            merge3(base, ours, theirs, Values(store, ours_file=str(path)), average)


def test_the_largest_tensor_runs_beside_the_others_and_results_stay_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from git_theta import merging, parallel

    monkeypatch.setattr(parallel, "BUDGET", 100)
    sizes = {"a": 10, "big": 1000, "c": 10, "d": 10}
    big_started = threading.Event()
    others_ran_during_big: list[str] = []

    def fn(name: str) -> str:
        if name == "big":
            big_started.set()
            # Waits for the others: they run beside it, not after it.
            for _ in range(200):
                if len(others_ran_during_big) == 3:
                    break
                threading.Event().wait(0.01)
        else:
            assert big_started.wait(5)
            others_ran_during_big.append(name)
        return name.upper()

    out = merging._run_first_passes(fn, sorted(sizes), sizes.__getitem__)
    assert out == {n: n.upper() for n in sizes}
    assert sorted(others_ran_during_big) == ["a", "c", "d"]
    # Two past the budget: never both at once (ordered_map's bound).
    sizes["big2"] = 1000
    running: list[str] = []
    peak = [0]

    def fn2(name: str) -> str:
        running.append(name)
        peak[0] = max(peak[0], sum(sizes[n] for n in running))
        threading.Event().wait(0.01)
        running.remove(name)
        return name

    assert merging._run_first_passes(fn2, sorted(sizes), sizes.__getitem__) == {n: n for n in sizes}
    assert peak[0] < 2000


def test_a_tensor_taken_from_theirs_is_decoded_once_for_the_check_and_the_checkout(
    repo: Path,
) -> None:
    # Not on this machine's verified record (a collaborator's branch), their tensors are
    # rebuilt before the driver writes its result; the checkout git runs next takes those
    # values instead of decoding them again: their objects, made unreadable right after
    # the driver, are never read.
    rng = np.random.default_rng(8)
    base = {
        "a": (rng.standard_normal((64, 64)) * 0.02).astype(np.float32),
        "b": (rng.standard_normal((64, 64)) * 0.02).astype(np.float32),
        "big": rng.standard_normal((2048, 1024)).astype(np.float32),  # streamed: 8 MiB
    }
    theirs = {
        **base,
        "a": base["a"] + np.float32(1e-3),
        "big": rng.standard_normal((2048, 1024)).astype(np.float32),
    }
    commit(repo, base, "base")
    git(repo, "checkout", "-q", "-b", "left")
    commit(repo, theirs, "theirs")
    git(repo, "checkout", "-q", "main")
    commit(repo, {**base, "b": base["b"] * np.float32(2)}, "ours")
    store = Repo(str(repo)).store
    mine, their_side = at(repo, "main~1"), at(repo, "left")
    assert [link.update for link in their_side.tensors["big"].chain] == ["dense"]
    own = {link.ref.oid for e in mine.tensors.values() for link in e.chain}
    hide = [
        store.path(link.ref.oid)
        for name in ("a", "big")
        for link in their_side.tensors[name].chain
        if link.ref.oid not in own
    ]
    assert len(hide) == 2
    os.unlink(os.path.join(store.own, "verified"))
    driver = git(repo, "config", "merge.theta.driver").stdout.decode().strip()
    wrapper = repo.parent / "driver.sh"
    wrapper.write_text(
        "#!/bin/sh\nset -e\n"
        + driver.replace("%O", '"$1"').replace("%A", '"$2"').replace("%B", '"$3"')
        .replace("%P", '"$4"').replace("exec ", "")
        + "".join(f'\nchmod u+w {p}; head -c $(stat -c %s {p}) /dev/zero > {p}' for p in hide)
        + "\n"
    )  # fmt: skip
    wrapper.chmod(0o755)
    git(repo, "-c", f"merge.theta.driver={wrapper} %O %A %B %P", "merge", "-q", "--no-edit", "left")
    from safetensors.numpy import load_file

    got = load_file(str(repo / M))
    for name, value in {**theirs, "b": base["b"] * np.float32(2)}.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not list((Path(store.own) / "merged").iterdir())


def test_a_streamed_value_is_left_only_when_every_piece_passed(repo: Path) -> None:
    from git_theta import merged_values

    store = Repo(str(repo)).store
    merged_values.sweep(store)
    kept = Path(store.own) / "merged"

    def pieces(fail: bool):  # type: ignore[no-untyped-def]
        yield b"ab"
        yield b"cd"
        if fail:
            raise ThetaError("rebuilt bytes do not match")

    with pytest.raises(ThetaError, match="do not match"):
        for _ in merged_values.keep_pieces(store, "f" * 64, 4, pieces(True)):
            pass
    early = merged_values.keep_pieces(store, "e" * 64, 4, pieces(False))
    assert next(early) == b"ab"
    early.close()  # the consumer stopped: nothing is left
    assert sorted(kept.iterdir()) == []
    assert list(merged_values.keep_pieces(store, "d" * 64, 4, pieces(False))) == [b"ab", b"cd"]
    assert [p.name for p in kept.iterdir()] == ["d" * 64]
    assert (kept / ("d" * 64)).read_bytes() == b"abcd"


def test_a_side_one_delta_past_the_base_is_added_out_of_place_with_the_chains_bits(
    repo: Path, fine_tunes: dict[str, np.ndarray]
) -> None:
    from git_theta import chains, kernels, merging
    from git_theta.errors import ObjectCorruptError

    if kernels.merge is None:
        pytest.skip("the C merge kernel is not built")
    base, theirs = at(repo, "main~1"), at(repo, "left")
    store = Repo(str(repo)).store
    for name in "cd":
        b, t = base.tensors[name], theirs.tensors[name]
        assert t.chain[:-1] == b.chain and t.chain[-1].update == "delta"  # else moot
        base_value = chains.rebuild(name, b, store)
        kept = bytes(base_value)
        got = merging._delta_on(t.chain[len(b.chain) :], t.dtype, base_value, store)
        assert got == chains.rebuild(name, t, store)
        assert base_value == kept  # the base stays for the other side and the merge
        assert merging._on_base(t, b, base_value, store, name) == got
        # A delta for another size is refused, and the caller takes the long way.
        with pytest.raises(ObjectCorruptError):
            merging._delta_on(t.chain[len(b.chain) :], t.dtype, base_value[:-4], store)


def test_a_damaged_object_of_theirs_is_named_and_set_aside(
    repo: Path, fine_tunes: dict[str, np.ndarray]
) -> None:
    """A flipped byte in theirs' delta (read on the fast path past the base) fails the
    merge naming the tensor and the object, which is moved aside for a fetch to
    replace, as a checkout does."""
    base, ours, theirs = at(repo, "main~1"), at(repo, "main"), at(repo, "left")
    store = Repo(str(repo)).store
    ref = theirs.tensors["c"].chain[-1].ref
    path = store.path(ref.oid)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x10
    os.chmod(path, 0o644)
    Path(path).write_bytes(bytes(data))
    with pytest.raises(ThetaError, match=f"tensor 'c'.*{ref.oid}.*moved aside"):
        merge3(base, ours, theirs, Values(store), average)
    assert not os.path.exists(path)


def test_every_merged_tensor_may_be_written_over_theirs(
    repo: Path, fine_tunes: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's merges let the step write over theirs' value (a fourth tensor-sized
    buffer otherwise: 154 MB of fresh pages for GPT-2's embeddings), and the result is
    the same as into a buffer of its own."""
    from git_theta.merges import base as merges_base

    real = merges_base.merge_tensor
    allowed: list[bool] = []

    def spy(*args: object, **kwargs: object) -> object:
        allowed.append(bool(kwargs.get("overwrite_theirs")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    base, ours, theirs = at(repo, "main~1"), at(repo, "main"), at(repo, "left")
    store = Repo(str(repo)).store
    monkeypatch.setattr(merges_base, "merge_tensor", spy)
    got = merge3(base, ours, theirs, Values(store), average).manifest
    assert allowed == [True, True]  # c and d

    def fresh(*args: object, **kwargs: object) -> object:
        return real(*args, **{**kwargs, "overwrite_theirs": False})  # type: ignore[arg-type]

    monkeypatch.setattr(merges_base, "merge_tensor", fresh)
    assert merge3(base, ours, theirs, Values(store), average).manifest == got
