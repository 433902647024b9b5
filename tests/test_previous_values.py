"""Values an add stored as changes, kept for the next add of the file
(previous_values.py): the next add builds on them instead of rebuilding the chain, with
the same manifest; a planted, stale or unverified value is never built on; nothing is
written through a planted link; at most the staged and the new version are kept."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from st_files import st_from_arrays

from git_theta import chains, previous_values
from git_theta.clean import clean
from git_theta.manifest import Manifest, parse
from git_theta.store import ObjectStore

PATH = "model.safetensors"


def _version(step: int) -> dict[str, np.ndarray]:
    """Version ``step`` of a small model: ``w`` and ``b`` change every version (a little),
    ``frozen`` never does."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 128)).astype(np.float32)  # 128 KiB each: over VALUE_MIN
    b = rng.standard_normal(32768).astype(np.float32)
    for k in range(step):
        noise = np.random.default_rng(k + 1)
        w = w + np.float32(1e-3) * noise.standard_normal(w.shape).astype(np.float32)
        b = b + np.float32(1e-3) * noise.standard_normal(b.shape).astype(np.float32)
    frozen = np.arange(32768, dtype=np.float32)
    return {"b": b, "frozen": frozen, "w": w}


def _add(store: ObjectStore, step: int, previous: Manifest | None) -> tuple[Manifest, bytes]:
    out = io.BytesIO()
    data = st_from_arrays(_version(step))
    got = clean(io.BytesIO(data), out, PATH, store, previous, show_progress=False)
    assert got is not None
    return got, out.getvalue()


def _count_rebuilds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = chains.rebuild

    def counting(name: str, *args: object, **kwargs: object) -> bytearray:
        seen.append(name)
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(chains, "rebuild", counting)
    return seen


def _history(tmp_path: Path) -> tuple[ObjectStore, Manifest]:
    """A store after two adds (versions 0 and 1); return it and the second manifest."""
    store = ObjectStore(tmp_path / "lfs")
    first, _ = _add(store, 0, None)
    second, _ = _add(store, 1, first)
    return store, second


def _folder(store: ObjectStore) -> Path:
    found = list(Path(previous_values.root(store)).iterdir())
    assert len(found) == 1, found
    return found[0]


def test_the_next_add_builds_on_the_kept_values_and_writes_the_same_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, second = _history(tmp_path)
    held = {p.name for p in _folder(store).iterdir()}
    assert held == {second.tensors["w"].hash, second.tensors["b"].hash}  # changed ones only
    # The same add on a copy of the store without the kept values: the rebuild path.
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "lfs", bare)
    shutil.rmtree(previous_values.root(ObjectStore(bare)))
    rebuilt = _count_rebuilds(monkeypatch)
    third, manifest = _add(store, 2, second)
    assert rebuilt == []  # both changed tensors built on their kept values
    _, manifest_bare = _add(ObjectStore(bare), 2, second)
    assert sorted(rebuilt) == ["b", "w"]
    assert manifest == manifest_bare  # byte for byte: clean output is deterministic
    assert len(third.tensors["w"].chain) > 1  # stored as a change, not whole
    for name, value in _version(2).items():
        got = chains.rebuild(name, parse(manifest).tensors[name], store)
        assert bytes(got) == value.tobytes(), name
    # Kept: the staged (second) and the new (third) versions of the changed tensors.
    held = {p.name for p in _folder(store).iterdir()}
    wanted = {m.tensors[n].hash for m in (second, third) for n in ("w", "b")}
    assert held == wanted


def test_a_planted_or_stale_value_is_not_built_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, second = _history(tmp_path)
    folder = _folder(store)
    w = folder / second.tensors["w"].hash
    w.write_bytes(bytes(w.stat().st_size))  # the right size, other bytes
    b = folder / second.tensors["b"].hash
    b.unlink()
    os.mkfifo(b)  # a FIFO must not block the add
    rebuilt = _count_rebuilds(monkeypatch)
    _, manifest = _add(store, 2, second)
    assert sorted(rebuilt) == ["b", "w"]
    for name, value in _version(2).items():
        assert bytes(chains.rebuild(name, parse(manifest).tensors[name], store)) == value.tobytes()


def test_a_value_whose_chain_is_not_known_to_rebuild_to_it_is_not_built_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update is stored on top of the staged chain, so the chain must be known here to
    rebuild to the kept bytes (a clone's staged manifest may claim any hash)."""
    store, second = _history(tmp_path)
    os.unlink(store.verified.path)  # a fresh record: nothing seen to rebuild
    fresh = ObjectStore(tmp_path / "lfs")
    rebuilt = _count_rebuilds(monkeypatch)
    _add(fresh, 2, second)
    assert {"b", "w"} <= set(rebuilt)  # (and frozen, to reuse its chain: test_verified)


def test_no_value_is_written_through_a_planted_link(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "lfs")
    first, _ = _add(store, 0, None)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, previous_values.root(store))
    second, _ = _add(store, 1, first)
    _add(store, 2, second)
    assert list(outside.iterdir()) == []


def test_nothing_is_kept_when_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(previous_values.ENV, "0")
    store, _ = _history(tmp_path)
    assert not os.path.exists(previous_values.root(store))


def test_real_adds_keep_values_and_every_version_checks_out_exactly(repo: Path) -> None:
    """Through git: each add builds on what the last one kept; every commit checks out
    byte for byte; `git theta prune` removes the kept values (the next add rebuilds)."""
    import subprocess

    from conftest import git, sha256

    digests = []
    for step in range(4):
        (repo / PATH).write_bytes(st_from_arrays(_version(step)))
        digests.append(sha256(repo / PATH))
        git(repo, "add", PATH)
        git(repo, "commit", "-q", "-m", f"v{step}")
    root = Path(previous_values.root(ObjectStore(repo / ".git" / "lfs")))
    held = {p.name for folder in root.iterdir() for p in folder.iterdir()}
    last, before = (parse(git(repo, "show", f"{rev}:{PATH}").stdout) for rev in ("HEAD", "HEAD~"))
    # What the next add builds on; at most the version before too (a re-clean of the same
    # content, as git does for a file as new as its index, keeps the current one only).
    assert {last.tensors[n].hash for n in ("w", "b")} <= held
    assert held <= {m.tensors[n].hash for m in (last, before) for n in ("w", "b")}
    for step in range(4):
        (repo / PATH).unlink()
        git(repo, "checkout", "-q", f"HEAD~{3 - step}", "--", PATH)
        assert sha256(repo / PATH) == digests[step]
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert f"removed {len(held)} tensor values kept for the next add" in done.stderr.decode()
    assert [p for folder in root.iterdir() for p in folder.iterdir()] == []
