"""Review (session 3) of the codec's grouped plane method for deltas: each test asserts
the right behaviour and fails on the code as reviewed (a885cca..0da17bc)."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from git_theta import _planes, codec

ROOT = Path(__file__).resolve().parent.parent
BEFORE_GROUPING = "a885cca^"  # main just before the GROUPED method


def _adam_pair(n: int) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(5)
    old = (rng.standard_normal(n) * 0.02).astype(np.float32)
    new = (old + 6e-5 * rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    return old.tobytes(), new.tobytes()


def test_an_older_git_theta_says_a_grouped_delta_needs_a_newer_one(tmp_path: Path) -> None:
    """A checkpoint committed by this version (a delta with a plane grouped by the old
    exponent) checked out by the git-theta just before it must fail saying it was written
    by a newer git-theta (as a newer object version does), not that the object is
    corrupt: codec VERSION stayed 1, so the old reader says "unknown plane method 129"."""
    from safetensors.numpy import save

    from git_theta.clean import clean
    from git_theta.manifest import parse
    from git_theta.store import ObjectStore

    old, new = _adam_pair(300_000)
    store_dir = tmp_path / "store"
    store = ObjectStore(store_dir)
    previous = None
    manifests = []
    for raw in (old, new):
        data = save({"w": np.frombuffer(raw, np.float32)})
        out = io.BytesIO()
        clean(io.BytesIO(data), out, "model.safetensors", store, previous, False)
        previous = parse(out.getvalue())
        manifests.append(out.getvalue())
    (tmp_path / "v1.json").write_bytes(manifests[1])
    grouped = [p for p in store_dir.rglob("*") if p.is_file() and p.read_bytes()[:4] == codec.MAGIC]
    assert any(m & codec.GROUPED for p in grouped for m in _methods(p.read_bytes())), (
        "this version did not write a grouped delta: the test needs one"
    )

    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE_GROUPING, "src"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path / "old", filter="data")
    script = (
        "import io, sys\n"
        "from pathlib import Path\n"
        "from git_theta.smudge import smudge\n"
        "from git_theta.store import ObjectStore\n"
        "try:\n"
        f"    smudge(io.BytesIO(Path({str(tmp_path / 'v1.json')!r}).read_bytes()), io.BytesIO(),"
        f" 'model.safetensors', ObjectStore(Path({str(store_dir)!r})), False)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "    sys.exit(1)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path / "old" / "src"), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert run.returncode != 0, "the older git-theta checked the grouped delta out"
    assert "newer git-theta" in run.stdout, run.stdout + run.stderr


def _methods(obj: bytes) -> list[int]:
    view = memoryview(obj)
    layout, length, chunk_words = codec._parse_head(view, None)
    out = []
    for pos in codec._chunk_starts(view, layout, length, chunk_words):
        for _ in range(layout.word):
            method, n = codec._PLANE.unpack_from(view, pos)
            out.append(method)
            pos += codec._PLANE.size + n
    return out


def test_a_context_never_makes_a_plane_larger_than_without_it() -> None:
    """cb0919f encodes a plane the sample is "sure" about (>= 15% less entropy, >= 256 KiB)
    grouped only, without the natural-order encode to compare. Grouping destroys the
    repetition zstd finds in natural order: here the object with a context is ~128x the
    one without (4,399 B -> 561,398 B). The smaller of the two must be kept
    (test_grouping_is_kept_only_where_it_is_smaller never reaches 256 KiB planes)."""
    rng = np.random.default_rng(0)
    n = 1 << 20
    table = rng.integers(0, 200, 4096, dtype=np.uint8)
    top = np.tile(table, n // 4096)  # periodic: zstd codes it in a few KB
    key = ((top >> 4).astype(np.uint16) << 1 | rng.integers(0, 2, n)).astype(np.uint8)
    context = np.zeros((n, 4), np.uint8)
    context[:, 3], context[:, 2] = key >> 1, (key & 1) << 7  # F32 words with that key
    z = np.zeros((n, 4), np.uint8)
    z[:, 3] = top
    plain = b"".join(codec.encode(z.tobytes(), codec.Layout(4)))
    grouped = b"".join(codec.encode(z.tobytes(), codec.Layout(4), context=context.tobytes()))
    assert len(grouped) <= len(plain)


def test_c_group_gain_refuses_or_matches_its_twin_for_a_huge_step() -> None:
    """group_gain computes (len + step - 1) / step in Py_ssize_t: a step near
    PY_SSIZE_T_MAX overflows (UBSan: "signed integer overflow" at _planes.c group_gain)
    and returns NaN, where the NumPy twin returns a number."""
    plane, context = b"ab", bytes(8)
    twin = codec._group_gain_numpy(plane, context, 4, sys.maxsize)
    try:
        gain = _planes.group_gain(plane, context, 4, sys.maxsize)
    except (ValueError, OverflowError):
        return  # refusing it is right too
    assert gain == twin, f"C {gain!r}, NumPy {twin!r}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
