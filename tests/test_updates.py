"""Update types: a conformance kit for lossless types, auto's choices, and git end to end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256
from hypothesis import given, settings
from hypothesis import strategies as st
from st_files import st_from_arrays

from git_theta.chains import rebuild, store_value
from git_theta.content import content_hash
from git_theta.dtypes import DTYPES
from git_theta.manifest import TensorEntry
from git_theta.store import ObjectStore
from git_theta.updates import UPDATES

LOSSLESS = ["dense", "sparse", "delta", "auto"]


def payload(key: str, new: bytes, prev: bytes, dtype: str) -> bytes:
    parts = UPDATES.get(key).encode(new, prev, dtype)
    assert parts is not None
    return b"".join(parts)


@settings(max_examples=80, deadline=None)
@given(
    key=st.sampled_from(["dense", "sparse", "delta"]),
    dtype=st.sampled_from(sorted(DTYPES)),
    data=st.data(),
)
def test_apply_encode_is_bit_exact(key: str, dtype: str, data: st.DataObject) -> None:
    size = max(1, DTYPES[dtype].bits // 8)
    n = data.draw(st.integers(0, 200))
    prev = data.draw(st.binary(min_size=n * size, max_size=n * size))
    flips = data.draw(st.lists(st.integers(0, max(0, n * size - 1)), max_size=20))
    new = bytearray(prev)
    for i in flips:
        if new:
            new[i] ^= 1 << (i % 8)  # includes sign flips (-0.0) and lowest-bit changes
    out = UPDATES.get(key).apply(bytearray(prev), payload(key, bytes(new), prev, dtype), dtype)
    assert bytes(out) == bytes(new)


def test_sparse_keeps_negative_zero_nan_payloads_and_tiny_changes() -> None:
    prev = np.zeros(1000, dtype=np.float32)
    new = prev.copy()
    new[3] = -0.0
    words = new.view(np.uint32)
    words[10] = 0x7FC0DEAD  # NaN with a payload
    new[500] = np.float32(1e-40)  # subnormal
    new[999] = np.nextafter(np.float32(0), np.float32(1))  # smallest change there is
    out = UPDATES.get("sparse").apply(
        bytearray(prev.tobytes()), payload("sparse", new.tobytes(), prev.tobytes(), "F32"), "F32"
    )
    assert bytes(out) == new.tobytes()


def test_auto_picks_the_compact_form() -> None:
    rng = np.random.default_rng(0)
    prev = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    sparse = prev.copy()
    idx = rng.choice(prev.size, prev.size // 200, replace=False)
    sparse[idx] += np.float32(1e-3)
    nudged = prev * (1 + 1e-3 * rng.standard_normal(prev.size)).astype(np.float32)
    fresh = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    auto = UPDATES.get("auto")
    dense_size = len(payload("dense", fresh.tobytes(), prev.tobytes(), "F32"))
    dense = UPDATES.get("dense")
    for new, expected in ((sparse, "sparse"), (nudged, "delta"), (fresh, "dense")):
        key, parts = auto.pick(
            new.tobytes(),
            prev.tobytes(),
            "F32",
            lambda n=new: dense.encode(n.tobytes(), None, "F32"),  # type: ignore[misc]
        )
        assert key == expected
        assert parts is not None
        assert sum(map(len, parts)) <= dense_size + 64
    sparse_size = len(payload("sparse", sparse.tobytes(), prev.tobytes(), "F32"))
    assert sparse_size < 0.006 * prev.nbytes
    assert len(payload("delta", nudged.tobytes(), prev.tobytes(), "F32")) < 0.5 * prev.nbytes


def test_chains_are_bounded(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path)
    value = np.random.default_rng(4).standard_normal(100_000).astype(np.float32)
    entry: TensorEntry | None = None
    lengths = []
    for step in range(6):
        value = value.copy()
        value[step] += 1
        data = value.tobytes()
        prev = entry

        def load(prev: TensorEntry | None = prev) -> bytearray | None:
            return rebuild("t", prev, store) if prev is not None else None

        chain = store_value(data, "F32", store, "sparse", prev, load, max_chain=3)
        entry = TensorEntry("F32", value.shape, content_hash(data), chain)
        assert bytes(rebuild("t", entry, store)) == data
        lengths.append(len(chain))
    # Past the bound the new value is stored as one update on the dense base (smaller
    # than a fresh value here), so the chain restarts at two links, never past three.
    assert lengths == [1, 2, 3, 2, 3, 2]


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "emb": (rng.standard_normal((256, 64)) * 0.02).astype(np.float32),
        "attn": (rng.standard_normal((64, 64)) * 0.02).astype(np.float32),
        "mlp": (rng.standard_normal((64, 128)) * 0.02).astype(np.float32),
    }


def save(repo: Path, values: dict[str, np.ndarray]) -> str:
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    return sha256(repo / "m.safetensors")


def commit(repo: Path, message: str, **env: str) -> str:
    done = subprocess.run(
        ["git", "add", "m.safetensors"], cwd=repo, capture_output=True, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr.decode()
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.decode().strip()


def updates_of(repo: Path, rev: str = "HEAD") -> dict[str, list[str]]:
    manifest = json.loads(git(repo, "show", f"{rev}:m.safetensors").stdout)
    return {n: [link["update"] for link in e["chain"]] for n, e in manifest["tensors"].items()}


def test_auto_env_and_rules_choose_per_tensor(repo: Path) -> None:
    values = arrays(1)
    save(repo, values)
    commit(repo, "v1")
    flat = values["emb"].reshape(-1)
    flat[np.random.default_rng(2).choice(flat.size, 82, replace=False)] += np.float32(1e-3)
    values["attn"] *= np.float32(1.001)  # every element nudged
    save(repo, values)
    commit(repo, "auto")
    assert updates_of(repo) == {
        "emb": ["dense", "sparse"], "attn": ["dense", "delta"], "mlp": ["dense"]
    }  # fmt: skip
    report = subprocess.run(
        ["git", "theta", "diff", "HEAD~1", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout
    assert "M emb  F32 [256, 64]  dense+sparse  82/16,384 changed (0.50%)" in report
    assert "sparse update of 82 elements" in report

    values["mlp"][0, 0] = np.float32(7)
    values["emb"][1, 1] = np.float32(3)
    save(repo, values)
    (repo / ".theta-updates").write_text("# per-tensor rules\nemb  dense\n*  sparse\n")
    commit(repo, "rules")
    assert updates_of(repo) == {
        "emb": ["dense"], "attn": ["dense", "delta"], "mlp": ["dense", "sparse"]
    }  # fmt: skip

    values["attn"][0, 0] = np.float32(1)
    save(repo, values)
    commit(repo, "env wins over rules", GIT_THETA_UPDATE_TYPE="dense")
    assert updates_of(repo)["attn"] == ["dense"]

    values["emb"][2, 2] = np.float32(2)
    save(repo, values)
    done = subprocess.run(
        ["git", "theta", "add", "--update-type", "sparse", "m.safetensors"],
        cwd=repo, capture_output=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    git(repo, "commit", "-q", "-m", "flag")
    assert updates_of(repo)["emb"] == ["dense", "sparse"]


def test_unknown_types_and_bad_rules_are_clear_errors(repo: Path) -> None:
    save(repo, arrays(1))
    done = subprocess.run(
        ["git", "theta", "add", "--update-type", "lowrank", "m.safetensors"],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        "git-theta: error: --update-type: unknown update type 'lowrank' "
        "(available: auto, delta, dense, ia3, low-rank, sparse)\n"
    )
    (repo / ".theta-updates").write_text("emb sparse\nattn\n")
    done = subprocess.run(["git", "add", "m.safetensors"], cwd=repo, capture_output=True, text=True)
    assert done.returncode != 0
    assert ".theta-updates:2: expected 'TENSOR_GLOB UPDATE_TYPE', got 'attn'" in done.stderr
    assert git(repo, "diff", "--cached", "--quiet", check=False).returncode == 0


def test_history_rewrites_keep_every_commit_exact(repo: Path) -> None:
    base = arrays(1)
    save(repo, base)
    commit(repo, "v1")
    git(repo, "checkout", "-q", "-b", "tune")
    tune = {k: v.copy() for k, v in base.items()}
    tune["emb"][::40, 3] += np.float32(1e-3)
    save(repo, tune)
    commit(repo, "sparse", GIT_THETA_UPDATE_TYPE="sparse")
    tune["attn"] *= np.float32(1.0005)
    save(repo, tune)
    commit(repo, "delta", GIT_THETA_UPDATE_TYPE="delta")
    assert updates_of(repo) == {
        "emb": ["dense", "sparse"], "attn": ["dense", "delta"], "mlp": ["dense"]
    }  # fmt: skip

    git(repo, "checkout", "-q", "main")
    main = {k: v.copy() for k, v in base.items()}
    main["mlp"] += np.float32(0.5)
    save(repo, main)
    commit(repo, "main moves", GIT_THETA_UPDATE_TYPE="dense")

    git(repo, "checkout", "-q", "tune")
    git(repo, "rebase", "-q", "main")
    expected = {**main, "emb": tune["emb"], "attn": tune["attn"]}
    expected_sha = sha256_of(expected)
    assert sha256(repo / "m.safetensors") == expected_sha
    git(repo, "checkout", "-q", "HEAD~1")
    assert sha256(repo / "m.safetensors") == sha256_of({**main, "emb": tune["emb"]})

    git(repo, "checkout", "-q", "tune")
    git(repo, "reset", "-q", "--soft", "HEAD~2")  # squash the two tuned commits
    git(repo, "commit", "-q", "-m", "squashed")
    git(repo, "commit", "-q", "--amend", "-m", "squashed and amended")
    git(repo, "checkout", "-q", "main")
    git(repo, "cherry-pick", "tune")
    assert sha256(repo / "m.safetensors") == expected_sha
    git(repo, "rm", "-q", "--cached", "m.safetensors")
    (repo / "m.safetensors").unlink()
    git(repo, "checkout", "-q", "HEAD", "--", "m.safetensors")
    assert sha256(repo / "m.safetensors") == expected_sha


def sha256_of(values: dict[str, np.ndarray]) -> str:
    import hashlib

    return hashlib.sha256(st_from_arrays(values)).hexdigest()


@pytest.mark.parametrize("key", LOSSLESS)
def test_every_update_type_is_registered(key: str) -> None:
    assert UPDATES.get(key).key == key


def test_filter_branch_rewrite_keeps_every_commit_exact(repo: Path) -> None:
    values = arrays(5)
    shas = []
    (repo / "notes.txt").write_text("scratch\n")
    for step, update in enumerate(("dense", "sparse", "delta", "auto")):
        values["emb"][step, :4] += np.float32(0.01)
        values["attn"] *= np.float32(1.0002)
        shas.append(save(repo, values))
        git(repo, "add", "notes.txt")
        commit(repo, f"step {step}", GIT_THETA_UPDATE_TYPE=update)
    assert updates_of(repo)["emb"][0] == "dense"
    env_rewrite = {**os.environ, "FILTER_BRANCH_SQUELCH_WARNING": "1"}
    done = subprocess.run(
        ["git", "filter-branch", "-f", "--index-filter",
         "git rm -q --cached --ignore-unmatch notes.txt", "--", "--all"],
        cwd=repo, capture_output=True, env=env_rewrite,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert b"notes.txt" not in git(repo, "ls-files").stdout
    for back, sha in enumerate(reversed(shas)):
        git(repo, "checkout", "-q", f"main~{back}")
        assert sha256(repo / "m.safetensors") == sha


def test_unknown_update_type_in_a_manifest_names_the_tensor_at_checkout(repo: Path) -> None:
    save(repo, arrays(3))
    commit(repo, "v1")
    lines = git(repo, "show", "HEAD:m.safetensors").stdout.decode().splitlines(keepends=True)
    # One line per tensor: give attn's chain an update type nobody registered.
    changed = "".join(
        line.replace('"update": "dense"', '"update": "magic"') if '"attn"' in line else line
        for line in lines
    )
    blob = subprocess.run(
        ["git", "hash-object", "-w", "--no-filters", "--stdin"],
        cwd=repo, input=changed.encode(), capture_output=True, check=True,
    ).stdout.decode().strip()  # fmt: skip
    git(repo, "update-index", "--cacheinfo", f"100644,{blob},m.safetensors")
    (repo / "m.safetensors").unlink()
    done = git(repo, "checkout", "--", "m.safetensors", check=False)
    assert done.returncode != 0
    assert done.stderr.decode().splitlines()[0] == (
        "git-theta: error: m.safetensors: tensor 'attn': unknown update type 'magic' "
        "(available: auto, delta, dense, ia3, low-rank, sparse)"
    )
    assert not (repo / "m.safetensors").exists()


def test_same_shape_tensors_changed_in_different_ways_stay_exact(repo: Path) -> None:
    """Tensor buffers are reused for the next tensor of the same size once hashed and
    stored: a buffer reused while an encode still read it would corrupt some commit."""
    rng = np.random.default_rng(7)
    values = {f"layer.{i}": (rng.standard_normal((96, 96)) * 0.02).astype(np.float32)
              for i in range(12)}  # fmt: skip
    shas, revs = [save(repo, values)], [commit(repo, "v1")]
    for step in range(3):
        for i, name in enumerate(values):
            flat = values[name].reshape(-1).copy()
            if (i + step) % 3 == 0:  # sparse: a few entries
                flat[rng.integers(0, flat.size, 20)] += np.float32(1e-3)
            elif (i + step) % 3 == 1:  # delta: every entry nudged
                flat *= np.float32(1) + np.float32(1e-3) * rng.standard_normal(flat.size).astype(
                    np.float32
                )
            else:  # dense: a new value
                flat = (rng.standard_normal(flat.size) * 0.02).astype(np.float32)
            values[name] = flat.reshape(96, 96)
        shas.append(save(repo, values))
        revs.append(commit(repo, f"v{step + 2}"))
    kinds = {k for chain in updates_of(repo).values() for k in chain}
    assert {"sparse", "delta", "dense"} <= kinds
    for rev, sha in zip(revs, shas, strict=True):
        git(repo, "checkout", "-q", rev, "--", "m.safetensors")
        assert sha256(repo / "m.safetensors") == sha
