"""low-rank and ia3: factors from --update-path, stored with an exact correction."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256
from hypothesis import given, settings
from hypothesis import strategies as st
from st_files import st_bytes, st_from_arrays

from git_theta import _planes
from git_theta.updates import UPDATES
from git_theta.updates.factored import (
    _CODES,
    Factor,
    Inputs,
    LowRank,
    reproduce,
    reproduce_numpy,
)

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
    assert chain_of(repo, "attn.q.weight") == ["dense", "factor", "factor", "low-rank"]
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
    assert chain_of(repo, "attn.v.weight") == ["dense", "factor", "ia3"]
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
    assert chain_of(repo, "attn.v.weight") == ["dense", "factor", "factor", "low-rank"]
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


_NP = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}
_SPECIAL = [np.inf, -np.inf, 0.0, -0.0, 5e-324, 1e-310, 6.1e-5, 65504.0, 70000.0, 3.4e38, 1e300]


def _floats(data: st.DataObject, n: int, dtype: str) -> bytes:
    values = np.array(
        data.draw(
            st.lists(
                st.one_of(st.floats(-1e6, 1e6, width=64), st.sampled_from(_SPECIAL)),
                min_size=n,
                max_size=n,
            )
        )
    )
    with np.errstate(over="ignore"):
        if dtype == "BF16":  # truncate a float32 to its top half
            return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        return values.astype(_NP[dtype]).tobytes()


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(["F64", "F32", "BF16"]),
    fdtypes=st.tuples(*[st.sampled_from(["F64", "F32", "F16", "BF16"])] * 2),
    shape=st.tuples(st.integers(1, 7), st.integers(1, 7), st.integers(1, 4)),
    scale=st.sampled_from([1.0, 0.5, -3.7, 1e-3, 2.0**-20]),
    ia3=st.booleans(),
    data=st.data(),
)
def test_c_reproduction_is_bit_identical_to_the_numpy_definition(
    dtype: str,
    fdtypes: tuple[str, str],
    shape: tuple[int, int, int],
    scale: float,
    ia3: bool,
    data: st.DataObject,
) -> None:
    """The C kernel rebuilds low-rank and ia3 values without NumPy; a single differing
    bit would make every checkout of such a commit fail its hash check."""
    rows, cols, rank = shape
    prev = _floats(data, rows * cols, dtype)
    if ia3:
        n = data.draw(st.sampled_from([rows, cols]))
        inputs = Inputs("ia3", (Factor(fdtypes[0], (n,), _floats(data, n, fdtypes[0])),))
    else:
        r = Factor(fdtypes[0], (rows, rank), _floats(data, rows * rank, fdtypes[0]))
        c = Factor(fdtypes[1], (rank, cols), _floats(data, rank * cols, fdtypes[1]))
        inputs = Inputs("low-rank", (r, c), scale)
    with np.errstate(all="ignore"):
        want = reproduce_numpy(prev, dtype, (rows, cols), inputs)
    if ia3:
        got = _planes.factored(
            prev, _CODES[dtype], rows, cols, inputs.factors[0].raw, _CODES[fdtypes[0]], b"", 0,
            0, 1.0,
        )  # fmt: skip
    else:
        got = _planes.factored(
            prev, _CODES[dtype], rows, cols, r.raw, _CODES[fdtypes[0]], c.raw,
            _CODES[fdtypes[1]], rank, scale,
        )  # fmt: skip
    assert got is not None  # no NaN was drawn: the kernel must not fall back
    assert got == want
    assert reproduce(prev, dtype, (rows, cols), inputs) == want


def test_c_reproduction_leaves_nan_and_f16_to_numpy() -> None:
    one = np.ones(4, "<f4").tobytes()
    f32, f16 = _CODES["F32"], _CODES["F16"]
    nan = np.array([1.0, np.nan, 1.0, 1.0], "<f4").tobytes()
    vec = np.ones(2, "<f4").tobytes()
    assert _planes.factored(nan, f32, 2, 2, vec, f32, b"", 0, 0, 1.0) is None
    assert _planes.factored(one, f32, 2, 2, nan[:8], f32, b"", 0, 0, 1.0) is None
    half = np.ones(4, "<f2").tobytes()
    assert _planes.factored(half, f16, 2, 2, vec, f32, b"", 0, 0, 1.0) is None
    inputs = Inputs("ia3", (Factor("F32", (2,), nan[4:12]),))
    assert reproduce(one, "F32", (2, 2), inputs) == reproduce_numpy(one, "F32", (2, 2), inputs)
    with pytest.raises(ValueError, match="do not fit"):
        _planes.factored(one, f32, 2, 2, np.ones(3, "<f4").tobytes(), f32, b"", 0, 0, 1.0)


def test_c_reproduction_refuses_damaged_sizes_and_declared_shapes() -> None:
    """Sizes come from an update object's header: a damaged one must fail fast, and a
    factor whose declared shape disagrees with its bytes is the definition's to judge."""
    with pytest.raises(ValueError, match="bad dtype code or sizes"):
        _planes.factored(b"", _CODES["F32"], 2**62, 0, b"", _CODES["F32"], b"", 0, 0, 1.0)
    prev = np.arange(6, dtype="<f4").tobytes()
    wrong = Inputs("ia3", (Factor("F32", (5,), np.ones(2, "<f4").tobytes()),))
    with pytest.raises(ValueError, match="reshape"):
        reproduce_numpy(prev, "F32", (2, 3), wrong)
    with pytest.raises(ValueError, match="reshape"):
        reproduce(prev, "F32", (2, 3), wrong)


def test_rank_is_capped_so_a_checkout_does_bounded_work_per_element() -> None:
    # A rebuild costs rank multiply-adds per element; a stranger's 4096 x 4096 object at
    # rank 4096 made a checkout take minutes. Past 1024 the factors do not fit (a clean
    # stores such a tensor as auto would; a decode calls the object corrupt).
    from git_theta.updates.factored import matrix_shape

    square = (4096, 4096)
    assert matrix_shape("low-rank", [(4096, 1024), (1024, 4096)], square, False, False) == (
        1, 4096, 4096,
    )  # fmt: skip
    assert matrix_shape("low-rank", [(4096, 1025), (1025, 4096)], square, False, False) is None
    # small heads keep their slack: 2 x 768 at rank 8
    assert matrix_shape("low-rank", [(2, 8), (8, 768)], (2, 768), False, False) == (1, 2, 768)
