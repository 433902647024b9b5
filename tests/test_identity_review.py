"""Review of tensor identity (identity.py, clean.py) against hostile manifests, and of the
chain bound (chains.py) over many save sequences: real git, seeded randomness."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from conftest import git, sha256
from st_files import st_from_arrays

from git_theta.content import content_hash

BOMB_BYTES = 512 << 20  # what the hostile entry declares (and its object decodes to)


def _bomb_object(length: int) -> list[bytes]:
    """A valid plain content object of ``length`` zero bytes, a few kB on disk."""
    import zstandard

    from git_theta import codec

    chunk = codec.CHUNK_WORDS  # plain objects: one byte per word
    payload = zstandard.ZstdCompressor(level=3).compress(bytes(chunk))
    head = struct.pack("<4sBBBBQI", codec.MAGIC, codec.VERSION, 1, 0, 0, length, chunk)
    plane = struct.pack("<BI", codec.ZSTD, len(payload)) + payload
    assert length % chunk == 0
    return [head, plane * (length // chunk)]


def _peak_rss_mb(repo: Path, *args: str) -> float:
    """Run git ``args`` in a fresh process; return the peak RSS (MB) of its processes."""
    script = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], check=True, capture_output=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, "git", *args], cwd=repo,
                          capture_output=True, check=True)  # fmt: skip
    return int(done.stdout) / 1024


def test_a_hostile_entry_claiming_a_common_hash_with_a_huge_shape_costs_nothing(
    repo: Path,
) -> None:
    """A committed manifest may claim the hash of a value every model has (a zero bias)
    with a huge shape and a tiny object that inflates to it. Identity must not rebuild it
    for a small tensor of those bytes: equal bytes have equal sizes."""
    from git_theta.repo import Repo

    zeros = np.zeros(64, np.float32)
    (repo / "other.safetensors").write_bytes(st_from_arrays({"z": zeros}))
    git(repo, "add", "other.safetensors")
    honest = json.loads(git(repo, "show", ":other.safetensors").stdout)
    ref = Repo(str(repo)).store.put(_bomb_object(BOMB_BYTES))
    entry = honest["tensors"]["z"]
    assert entry["hash"] == content_hash(zeros.tobytes())
    entry["shape"] = [BOMB_BYTES // 4]
    entry["chain"] = [{"update": "dense", "codec": "gtho1", "oid": ref.oid, "size": ref.size}]
    honest["size"] += BOMB_BYTES - zeros.nbytes
    # Many entries (and files) claiming it: each must not cost a rebuild per tensor either.
    for i in range(20):
        honest["tensors"][f"z{i}"] = entry
        honest["layout"].append(f"z{i}")
        honest["size"] += BOMB_BYTES
    data = json.dumps(honest, indent=1).encode() + b"\n"
    from git_theta.manifest import parse

    parse(data)  # valid: identity would read it
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--cacheinfo", f"100644,{oid},other.safetensors")
    git(repo, "commit", "-q", "-m", "hostile")
    # The user's new file: a few zero biases beside a weight.
    rng = np.random.default_rng(1)
    mine = {f"b{i}": np.zeros(64, np.float32) for i in range(4)}
    mine["w"] = rng.standard_normal((64, 64)).astype(np.float32)
    (repo / "mine.safetensors").write_bytes(st_from_arrays(mine))
    sha = sha256(repo / "mine.safetensors")
    start = time.perf_counter()
    peak = _peak_rss_mb(repo, "add", "mine.safetensors")
    took = time.perf_counter() - start
    assert peak < 200, f"an add of a 17 kB file peaked at {peak:.0f} MB"
    assert took < 5, f"an add of a 17 kB file took {took:.1f} s"
    git(repo, "commit", "-q", "-m", "mine")
    (repo / "mine.safetensors").unlink()
    git(repo, "checkout", "--", "mine.safetensors")
    assert sha256(repo / "mine.safetensors") == sha


def test_a_hostile_staged_manifest_of_the_same_path_costs_nothing_and_loses_nothing(
    repo: Path,
) -> None:
    """A clone's index holds the committed manifest of the path the user then overwrites
    and adds. An entry whose shape disagrees with the user's tensor is neither reused for
    equal bytes (its chain cannot give them: the user's commit would not check out) nor
    rebuilt as a previous value (it would inflate to what the shape says)."""
    from git_theta.repo import Repo

    rng = np.random.default_rng(2)
    theirs = {"z": np.zeros(64, np.float32), "w": rng.standard_normal((64, 64)).astype(np.float32)}
    (repo / "mine.safetensors").write_bytes(st_from_arrays(theirs))
    git(repo, "add", "mine.safetensors")
    hostile = json.loads(git(repo, "show", ":mine.safetensors").stdout)
    ref = Repo(str(repo)).store.put(_bomb_object(BOMB_BYTES))
    bomb = [{"update": "dense", "codec": "gtho1", "oid": ref.oid, "size": ref.size}]
    for name, value in theirs.items():
        entry = hostile["tensors"][name]
        entry["shape"] = [BOMB_BYTES // 4]
        entry["chain"] = bomb
        hostile["size"] += BOMB_BYTES - value.nbytes
    data = json.dumps(hostile, indent=1).encode() + b"\n"
    from git_theta.manifest import parse

    parse(data)
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--cacheinfo", f"100644,{oid},mine.safetensors")
    git(repo, "commit", "-q", "-m", "hostile")
    # The user's own file at that path: the same zero bias, another weight.
    mine = {"z": np.zeros(64, np.float32), "w": rng.standard_normal((64, 64)).astype(np.float32)}
    (repo / "mine.safetensors").write_bytes(st_from_arrays(mine))
    sha = sha256(repo / "mine.safetensors")
    peak = _peak_rss_mb(repo, "add", "mine.safetensors")
    assert peak < 200, f"an add of a 17 kB file peaked at {peak:.0f} MB"
    git(repo, "commit", "-q", "-m", "mine")
    (repo / "mine.safetensors").unlink()
    git(repo, "checkout", "--", "mine.safetensors")
    assert sha256(repo / "mine.safetensors") == sha
