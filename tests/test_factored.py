"""low-rank and ia3: factors from --update-path, stored with an exact correction."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256
from st_files import st_bytes, st_from_arrays

from git_theta.updates import UPDATES
from git_theta.updates.factored import Factor, Inputs, LowRank

RNG = np.random.default_rng(21)
W = {
    "attn.q.weight": (RNG.standard_normal((96, 64)) * 0.02).astype(np.float32),
    "attn.v.weight": (RNG.standard_normal((96, 64)) * 0.02).astype(np.float32),
    "norm.weight": np.ones(64, dtype=np.float32),
}
R = (RNG.standard_normal((96, 8)) * 0.01).astype(np.float32)
C = (RNG.standard_normal((8, 64)) * 0.01).astype(np.float32)


def factor(a: np.ndarray) -> Factor:
    return Factor("F32", a.shape, a.tobytes())


def test_low_rank_payload_is_exact_and_small() -> None:
    prev = W["attn.q.weight"]
    new = prev + R @ C  # a float32 matmul, as a user's tool would do it
    plugin = LowRank({"attn.q.weight": Inputs("low-rank", (factor(R), factor(C)))})
    key, parts = plugin.pick(
        new.tobytes(), prev.tobytes(), "F32", lambda: [], None, "attn.q.weight", prev.shape
    )
    assert key == "low-rank" and parts is not None
    payload = b"".join(parts)
    out = UPDATES.get("low-rank").apply(bytearray(prev.tobytes()), payload, "F32")
    assert bytes(out) == new.tobytes()
    assert len(payload) < 1.2 * (R.nbytes + C.nbytes)


def run_add(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "theta", "add", *args, "m.safetensors"], cwd=repo, capture_output=True, text=True
    )


def chain_of(repo: Path, name: str) -> list[str]:
    manifest = json.loads(git(repo, "show", "HEAD:m.safetensors").stdout)
    return [link["update"] for link in manifest["tensors"][name]["chain"]]


def test_low_rank_and_ia3_through_git(repo: Path, tmp_path: Path) -> None:
    (repo / "m.safetensors").write_bytes(st_from_arrays(W))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "base")

    merged = dict(W)
    merged["attn.q.weight"] = W["attn.q.weight"] + R @ C
    (repo / "m.safetensors").write_bytes(st_from_arrays(merged))
    factors = tmp_path / "lora.safetensors"
    factors.write_bytes(st_from_arrays({"attn.q.weight/R": R, "attn.q.weight/C": C}))
    done = run_add(repo, "--update-type", "low-rank", "--update-path", str(factors))
    assert done.returncode == 0, done.stderr
    assert "git-theta: attn.q.weight: low-rank factors reproduce the file within" in done.stderr
    git(repo, "commit", "-q", "-m", "lora")
    assert chain_of(repo, "attn.q.weight") == ["dense", "low-rank"]
    report = subprocess.run(
        ["git", "theta", "diff", "HEAD~1", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout
    norm_r, norm_c = np.linalg.norm(R.astype(np.float64)), np.linalg.norm(C.astype(np.float64))
    assert f"low-rank update: rank 8, scale 1, |R| {norm_r:.4g}, |C| {norm_c:.4g}" in report, report
    assert git(repo, "status", "--porcelain").stdout == b""
    v2 = sha256(repo / "m.safetensors")

    scales = (1 + 0.1 * RNG.standard_normal(96)).astype(np.float32)
    scaled = dict(merged)
    scaled["attn.v.weight"] = W["attn.v.weight"] * scales[:, None]
    (repo / "m.safetensors").write_bytes(st_from_arrays(scaled))
    vectors = tmp_path / "ia3.safetensors"
    vectors.write_bytes(st_from_arrays({"attn.v.weight/ia3": scales}))
    done = run_add(repo, "--update-type", "ia3", "--update-path", str(vectors))
    assert done.returncode == 0, done.stderr
    git(repo, "commit", "-q", "-m", "ia3")
    assert chain_of(repo, "attn.v.weight") == ["dense", "ia3"]
    v3 = sha256(repo / "m.safetensors")

    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(repo), str(fresh))
    assert sha256(fresh / "m.safetensors") == v3
    git(fresh, "checkout", "-q", "HEAD~1")
    assert sha256(fresh / "m.safetensors") == v2


def test_peft_adapter_is_scaled_by_alpha_over_r(repo: Path, tmp_path: Path) -> None:
    (repo / "m.safetensors").write_bytes(st_from_arrays(W))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "base")
    a, b = C, R  # PEFT: lora_A is (r, in), lora_B is (out, r)
    adapter = tmp_path / "adapter_model.safetensors"
    prefix = "base_model.model.attn.v"
    adapter.write_bytes(
        st_bytes(
            {
                f"{prefix}.lora_A.weight": ("F32", a.shape, a.tobytes()),
                f"{prefix}.lora_B.weight": ("F32", b.shape, b.tobytes()),
            }
        )
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    merged = dict(W)
    merged["attn.v.weight"] = W["attn.v.weight"] + 2.0 * (b @ a)
    (repo / "m.safetensors").write_bytes(st_from_arrays(merged))
    done = run_add(repo, "--update-type", "low-rank", "--update-path", str(adapter))
    assert done.returncode == 0, done.stderr
    git(repo, "commit", "-q", "-m", "peft")
    assert chain_of(repo, "attn.v.weight") == ["dense", "low-rank"]
    manifest = json.loads(git(repo, "show", "HEAD:m.safetensors").stdout)
    size = manifest["tensors"]["attn.v.weight"]["chain"][1]["size"]
    assert size < 1.2 * (a.nbytes + b.nbytes)


def test_update_path_errors(repo: Path, tmp_path: Path) -> None:
    (repo / "m.safetensors").write_bytes(st_from_arrays(W))
    done = run_add(repo, "--update-type", "sparse", "--update-path", "x.safetensors")
    assert (done.returncode, done.stderr) == (
        2,
        "git-theta: error: --update-path needs --update-type low-rank or ia3\n",
    )
    done = run_add(repo, "--update-type", "low-rank", "--update-path", "missing.safetensors")
    assert done.stderr == "git-theta: error: --update-path missing.safetensors: no such file\n"


def test_filter_repo_rewrite_of_sparse_low_rank_and_dense_history(
    repo: Path, tmp_path: Path
) -> None:
    if shutil.which("git-filter-repo") is None:
        pytest.skip("git-filter-repo is not installed")
    values = dict(W)
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    (repo / "secret.txt").write_text("to be removed from history\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    shas = [sha256(repo / "m.safetensors")]

    values["attn.q.weight"] = W["attn.q.weight"] + R @ C  # low-rank, from its factors
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    factors = tmp_path / "lora.safetensors"
    factors.write_bytes(st_from_arrays({"attn.q.weight/R": R, "attn.q.weight/C": C}))
    assert run_add(repo, "--update-type", "low-rank", "--update-path", str(factors)).returncode == 0
    git(repo, "commit", "-q", "-m", "lora")
    shas.append(sha256(repo / "m.safetensors"))

    values["attn.v.weight"] = W["attn.v.weight"].copy()
    values["attn.v.weight"][::17, 2] = -0.0  # a few entries: auto stores it sparse
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "sparse")
    assert chain_of(repo, "attn.v.weight") == ["dense", "sparse"]
    shas.append(sha256(repo / "m.safetensors"))

    values["attn.q.weight"] = (values["attn.q.weight"] * np.float32(3)).astype(np.float32)
    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    assert run_add(repo, "--update-type", "dense").returncode == 0
    git(repo, "commit", "-q", "-m", "dense")
    assert chain_of(repo, "attn.q.weight") == ["dense"]
    shas.append(sha256(repo / "m.safetensors"))

    done = subprocess.run(
        ["git", "filter-repo", "--force", "--invert-paths", "--path", "secret.txt",
         "--path-rename", "m.safetensors:models/m.safetensors"],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert git(repo, "log", "--all", "--format=%H", "--", "secret.txt").stdout == b""
    # Every rewritten commit keeps `*.safetensors filter=theta`, which matches the new path.
    for back, sha in enumerate(reversed(shas)):
        git(repo, "checkout", "-q", f"main~{back}")
        (repo / "models" / "m.safetensors").unlink()
        git(repo, "checkout", "--", "models/m.safetensors")
        assert sha256(repo / "models" / "m.safetensors") == sha, back
        assert git(repo, "status", "--porcelain").stdout == b""
