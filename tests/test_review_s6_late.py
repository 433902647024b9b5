"""Review R4 (session 6) of the lead's later commits: 99f1fcb (+ f41f4a3) the values an
add stores as changes kept in LFS_DIR/theta/values for the next add, 562d11f sparse's
windowed encode, c17bbdd review R3's fixes. Each test asserts the right behaviour, so it
fails now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import _kill_servers, git
from st_files import st_from_arrays
from test_previous_values import _version

from git_theta import kernels, previous_values
from git_theta.commands.cli import main
from git_theta.manifest import parse
from git_theta.store import ObjectStore

MODEL = "model.safetensors"


def _kept(repo: Path) -> dict[str, tuple[int, int]]:
    """Every kept value of the repository's store: its path below values/ -> (inode,
    mtime): a file written again has another."""
    root = Path(previous_values.root(ObjectStore(repo / ".git" / "lfs")))
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def test_git_status_of_a_modified_checkpoint_does_not_rewrite_its_kept_values(
    repo: Path,
) -> None:
    """99f1fcb: keep() writes each value it is given (a temporary, renamed over the
    file), even when the file with that content hash is already there. A modified
    checkpoint of the same size as its staged version (every training step's) is
    re-cleaned by every `git status` (git cannot tell it from its stat data; it never
    refreshes the index for a modified file), so each status, and every IDE's status
    poll, rewrites up to 256 MiB per file of the values it kept last time: bytes written
    for nothing, on each status. Right: a value whose file is already there (same name:
    its content hash) is not written again."""
    for step in range(2):
        (repo / MODEL).write_bytes(st_from_arrays(_version(step)))
        git(repo, "add", MODEL)
        git(repo, "commit", "-q", "-m", f"v{step}")
    (repo / MODEL).write_bytes(st_from_arrays(_version(2)))  # modified, not added
    git(repo, "status", "--porcelain")
    first = _kept(repo)
    staged = parse(git(repo, "show", f":{MODEL}").stdout)
    assert len(first) >= 2, first  # v2's changed tensors, kept by the first status
    git(repo, "status", "--porcelain")
    assert _kept(repo) == first  # the same files: nothing rewritten
    assert staged == parse(git(repo, "show", f":{MODEL}").stdout)


def test_a_renamed_checkpoint_leaves_no_third_version_of_its_tensors_kept(repo: Path) -> None:
    """99f1fcb says "at most two versions of a tensor are kept": each add of a path
    removes that path's values that neither its staged nor its new manifest holds. The
    values are filed by path (values/KEY, KEY a hash of the path), and nothing ever
    tidies the folder of a path that is renamed or removed (`git mv`, a re-shard, a
    `git rm`): its last versions stay until `git theta prune`, up to 2 x 256 MiB per file
    ever renamed. Here model.safetensors is renamed after two versions and two more are
    added under its new name: w's value of version 1 is kept beside versions 2 and 3.
    Right: an add does not leave values of a path git no longer has (or the bound is
    store-wide), so at most two versions of w are kept."""
    old, new = "old.safetensors", MODEL
    for step in range(2):
        (repo / old).write_bytes(st_from_arrays(_version(step)))
        git(repo, "add", old)
        git(repo, "commit", "-q", "-m", f"v{step}")
    git(repo, "mv", old, new)
    git(repo, "commit", "-q", "-m", "rename")
    hashes = set()
    # The fix bounds it store-wide instead: the folder of a file no add touched for
    # previous_values.STALE seconds is removed by the next add that keeps a value (and all
    # the values of a store stay within STORE_MAX). Here the old name's folder is made
    # that old before the last add.
    import os

    from git_theta import previous_values

    for step in range(2, 4):
        if step == 3:  # the old name's folder: none of its values is staged now
            staged = {e.hash for e in parse(git(repo, "show", f":{new}").stdout).tensors.values()}
            root = repo / ".git" / "lfs" / "theta" / previous_values.DIR
            for folder in root.iterdir():
                if not {p.name for p in folder.iterdir()} & staged:
                    past = folder.stat().st_mtime - previous_values.STALE - 60
                    os.utime(folder, (past, past))
        (repo / new).write_bytes(st_from_arrays(_version(step)))
        git(repo, "add", new)
        git(repo, "commit", "-q", "-m", f"v{step}")
    for rev in range(4):
        path = new if rev >= 2 else old
        text = git(repo, "show", f"HEAD~{(3 - rev) + (1 if rev < 2 else 0)}:{path}").stdout
        hashes.add((rev, parse(text).tensors["w"].hash))
    kept_names = {Path(name).name for name in _kept(repo)}
    kept_w = sorted(rev for rev, digest in hashes if digest in kept_names)
    assert kept_w in ([3], [2, 3]), f"versions of w kept: {kept_w}"


@pytest.mark.xdist_group("filter-server")
def test_a_served_add_reads_the_callers_git_theta_kernels(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """c17bbdd moved the import that reads GIT_THETA_KERNELS inside the filter's error
    handling, "the forkserver worker too". But a server's worker never reads it: the
    server imported the filter (kernels.py chose its kernel) at its own start, with the
    environment of whichever command started it, and GIT_THETA_KERNELS is not among the
    start-up variables a caller must share with its server. So through a warm server a
    bad value is silently ignored (the add succeeds), and GIT_THETA_KERNELS=numpy (CI's
    way to test the NumPy twins) runs the C kernel, or the reverse: every later command
    runs the kernel of the command that started the server. Right: the worker takes the
    caller's choice (or the variable is a start-up one), so the served add answers as the
    direct one: exit 1 and the one line."""
    from test_forkserver import SERVED, add, start_server

    servers = tmp_path / "servers"
    servers.mkdir(mode=0o700)
    monkeypatch.setenv("GIT_THETA_SERVER_DIR", str(servers))
    monkeypatch.setenv("GIT_THETA_SERVER_TRACE", "1")
    assert main(["install", "--server"]) == 0
    server = start_server(servers)
    try:
        (repo / MODEL).write_bytes(st_from_arrays(_version(0)))
        direct = add(repo, MODEL, GIT_THETA_KERNELS="bogus", GIT_THETA_SERVER="0")
        assert direct.returncode != 0
        assert "GIT_THETA_KERNELS='bogus': use native or numpy" in direct.stderr
        served = add(repo, MODEL, GIT_THETA_KERNELS="bogus")
        assert (served.returncode, served.stderr.count("GIT_THETA_KERNELS='bogus'")) == (
            direct.returncode,
            1,
        ), served.stderr
        # The fix takes the other way: GIT_THETA_KERNELS is a start-up variable, so a
        # caller whose value differs is never served by this server (it meets its own).
        numpy = add(repo, MODEL, GIT_THETA_KERNELS="numpy")
        assert numpy.returncode == 0, numpy.stderr
        assert SERVED not in numpy.stderr
    finally:
        server.terminate()
        server.wait()
        _kill_servers(servers)  # any other this test's commands started


@pytest.mark.skipif(kernels.native is None, reason="counts the C kernel's scans")
def test_a_sparse_encode_scans_each_window_of_the_tensor_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """562d11f: Sparse.encode runs the windowed diff twice over the whole tensor, once
    for the positions (keeping the gaps, dropping the values) and once for the values
    (keeping the values, dropping the gaps), and each _planes.sparse_diff call counts the
    window's changes before collecting them: with the first count_changed, five passes
    over both tensors where the encode before made two. Measured on 64M BF16 elements
    with 10% changed (load ~3.8, best of 3): 1.10-1.16 s against 0.55-0.65 s for one
    full-range sparse_diff and the same two codec encodes, and auto now runs it for every
    changed tensor with at most half its elements changed, at any size. Right: one scan
    per window gives both the gaps and the values (e.g. the values' chunks fed from what
    the positions' pass produced, or both objects encoded from one pass)."""
    from git_theta.updates import sparse

    native = kernels.native
    calls: list[int] = []

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(native, name)

        def sparse_diff(self, *args: Any) -> tuple[bytes, bytes, int]:
            calls.append(args[3])
            return native.sparse_diff(*args)  # type: ignore[union-attr, no-any-return]

    monkeypatch.setattr(kernels, "native", Counting())
    rng = np.random.default_rng(0)
    n = 3 * sparse.WINDOW
    prev = rng.standard_normal(n, dtype=np.float32)
    new = prev.copy()
    new[::7] += np.float32(1)
    assert sparse.Sparse().encode(new.tobytes(), prev.tobytes(), "F32") is not None
    assert sorted(calls) == [0, sparse.WINDOW, 2 * sparse.WINDOW], calls


@pytest.mark.parametrize("kernel", ["native", "numpy"])
def test_sparse_encodes_a_buffer_of_floats_whole(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """562d11f: Sparse.encode now takes the element count as len(new) // itemsize, which
    is the count only for a buffer of bytes (Buffer is bytes | bytearray | memoryview, and
    a memoryview of a float32 array has len = its elements). Before, the scan ran over the
    buffer's bytes (C: a.len; NumPy: frombuffer) and such a buffer encoded right, as delta
    still does. Now the C path raises ValueError ("the changed elements ended early":
    the count is of all the bytes), and the NumPy path, when the quarter of the elements
    it scans is a whole number of windows, returns an update of the first quarter's
    changes only: apply() gives other bytes than ``new``, silently (nothing at the add
    rebuilds a chain it stores). Every caller today passes a byte view, so this is
    latent; right: the counts come from the buffer's bytes (memoryview(...).nbytes, or a
    cast to "B" at the top), as every other update type does."""
    from git_theta.updates.sparse import WINDOW, Sparse

    if kernel == "numpy":
        monkeypatch.setattr(kernels, "native", None)
    elif kernels.native is None:
        pytest.skip("no C kernel")
    rng = np.random.default_rng(0)
    prev = rng.standard_normal(4 * WINDOW, dtype=np.float32)
    new = prev.copy()
    new[::5] += np.float32(1)
    parts = Sparse().encode(new.data, prev.data, "F32")  # memoryviews of format "f"
    assert parts is not None
    got = Sparse().apply(bytearray(prev.tobytes()), b"".join(parts), "F32")
    assert bytes(got) == new.tobytes()
