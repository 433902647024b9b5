"""Decompression bombs: a few KB of objects that rebuild files of gigabytes. git holds a
smudge's whole output in memory, so a clone of such a repository must refuse it, whether
the bytes come as one file or as many files that each look harmless."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

from conftest import git

N = 40 << 20  # elements per tensor: two F32 tensors of zeros, 320 MiB of file
HINT = (
    "bytes of objects, more than 100x: a hostile repository can fill memory and disk this "
    "way; if you trust it, run `git config theta.maxExpansion 0` (or set "
    "GIT_THETA_MAX_EXPANSION=0) and check out again"
)


def zeros(path: Path, tensors: int, elements: int) -> None:
    """A safetensors file of F32 zeros, written without writing the zeros."""
    header = json.dumps(
        {
            f"w{i}": {
                "dtype": "F32",
                "shape": [elements],
                "data_offsets": [4 * elements * i, 4 * elements * (i + 1)],
            }
            for i in range(tensors)
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + 4 * elements * tensors)


def clone(repo: Path, dest: Path, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["git", "clone", "-q", str(repo), str(dest)],
        capture_output=True,
        env={**os.environ, **env},
    )


def test_a_file_far_larger_than_its_objects_is_refused_unless_trusted(
    repo: Path, tmp_path: Path
) -> None:
    zeros(repo / "model.safetensors", 2, N)
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "zeros")
    objects = sum(p.stat().st_size for p in (repo / ".git/lfs").rglob("*") if p.is_file())
    assert objects < 1 << 20  # ~the same chunk of zeros, compressed, once per tensor

    done = clone(repo, tmp_path / "copy")
    lines = done.stderr.decode().splitlines()
    assert lines[0].startswith("git-theta: error: model.safetensors: 335,544,"), lines
    assert lines[0].endswith(HINT)
    copy = tmp_path / "copy"
    assert not (copy / "model.safetensors").exists() or (
        (copy / "model.safetensors").stat().st_size < 1 << 20
    )
    # The user's own git config (never a committed file) trusts this repository.
    git(copy, "config", "theta.maxExpansion", "0")
    git(copy, "checkout", "-f", "HEAD", "--", "model.safetensors")
    assert (copy / "model.safetensors").stat().st_size == (
        (repo / "model.safetensors").stat().st_size
    )


def test_many_small_files_of_zeros_are_counted_together(repo: Path, tmp_path: Path) -> None:
    """Each file is under the 256 MiB floor; their sum is not."""
    for i in range(6):
        zeros(repo / f"part{i}.safetensors", 1, 15 << 20)  # 60 MiB each, 360 MiB in all
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "parts")
    done = clone(repo, tmp_path / "copy")
    assert done.returncode != 0
    errors = [ln for ln in done.stderr.decode().splitlines() if ln.startswith("git-theta:")]
    assert errors and errors[0].endswith(HINT), errors
    written = sum(
        p.stat().st_size for p in (tmp_path / "copy").glob("part*.safetensors") if p.is_file()
    )
    assert written <= 300 << 20
    trusted = clone(repo, tmp_path / "trusted", GIT_THETA_MAX_EXPANSION="0")
    assert trusted.returncode == 0, trusted.stderr.decode()
