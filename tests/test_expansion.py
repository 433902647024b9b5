"""A decompression bomb: a few KB of objects that rebuild a file of gigabytes. git holds a
smudge's whole output in memory, so a clone of such a repository must refuse it."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

from conftest import git

N = 40 << 20  # elements per tensor: two F32 tensors of zeros, 320 MiB of file


def test_a_file_far_larger_than_its_objects_is_refused_unless_trusted(
    repo: Path, tmp_path: Path
) -> None:
    header = json.dumps(
        {
            f"w{i}": {"dtype": "F32", "shape": [N], "data_offsets": [4 * N * i, 4 * N * (i + 1)]}
            for i in range(2)
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    with open(repo / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + 8 * N)  # zeros, without writing them
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "zeros")
    objects = sum(p.stat().st_size for p in (repo / ".git/lfs").rglob("*") if p.is_file())
    assert objects < 1 << 20  # ~the same chunk of zeros, compressed, once per tensor

    done = subprocess.run(
        ["git", "clone", "-q", str(repo), str(tmp_path / "copy")], capture_output=True
    )
    lines = done.stderr.decode().splitlines()
    assert lines[0].startswith("git-theta: error: model.safetensors: 335,544,")
    assert lines[0].endswith(
        "bytes of objects, more than 1000x: a hostile repository can fill memory and disk "
        "this way; if you trust it, check out again with GIT_THETA_MAX_EXPANSION=0"
    )
    assert not (tmp_path / "copy" / "model.safetensors").exists() or (
        (tmp_path / "copy" / "model.safetensors").stat().st_size < 1 << 20
    )
    trusted = {**os.environ, "GIT_THETA_MAX_EXPANSION": "0"}
    copy = tmp_path / "copy"
    done = subprocess.run(
        ["git", "checkout", "-f", "HEAD", "--", "model.safetensors"],
        cwd=copy,
        env=trusted,
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert (copy / "model.safetensors").stat().st_size == (
        repo / "model.safetensors"
    ).stat().st_size
