"""Review sweep of the day's new paths that plain git commands run in a stranger's repository
(git status, git diff...): what each must hold whatever the repository or environment holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import git
from st_files import f32, st_from_arrays
from test_ux import SHAPES, _broken_h5py_filter

from git_theta.commands.cli import main

_PEAK_OF_CHILDREN = (
    "import resource, subprocess, sys; "
    "done = subprocess.run(sys.argv[1:], capture_output=True); "
    "sys.stderr.buffer.write(done.stderr); "
    "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _peak_kib(repo: Path, *argv: str) -> tuple[int, int, str]:
    """Run ``argv`` in ``repo`` from a fresh Python; return (exit code, peak RSS in KiB of
    its largest descendant, stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_CHILDREN, *argv], cwd=repo, capture_output=True
    )
    code, peak = done.stdout.split()
    return int(code), int(peak), done.stderr.decode()


def test_status_without_h5py_keeps_memory_bounded_on_a_large_hdf5_file(
    repo: Path, tmp_path: Path
) -> None:
    """Without h5py git status stores an HDF5 file as one opaque piece: it must still be
    read and encoded piece by piece, not held whole (a 5 GB file took 10 GB)."""
    import h5py
    import numpy as np

    assert main(["track", "*.h5"]) == 0
    # 256 MiB in 32 datasets of 8 MiB: the largest tensor is 8 MiB.
    rng = np.random.default_rng(0)
    block = rng.integers(0, 1 << 16, size=2 << 20, dtype=np.uint32).view(np.float32)
    with h5py.File(repo / "m.h5", "w") as f:
        for i in range(32):
            f[f"w{i}"] = block
    git(repo, "add", ".gitattributes", "m.h5")
    git(repo, "commit", "-q", "-m", "v1")
    with h5py.File(repo / "m.h5", "r+") as f:  # same size: git status must clean it
        f["w0"][0] = 9.0
    broken = _broken_h5py_filter(repo, tmp_path)
    git(repo, "config", "--local", "filter.theta.process", f"{broken} filter-process")
    code, peak, err = _peak_kib(repo, "git", "status", "--porcelain")
    assert code == 0, err
    assert "needs h5py" in err
    assert peak < 200 * 1024, f"git status peaked at {peak // 1024} MiB for a 256 MiB file"


def test_a_revision_that_looks_like_an_option_is_refused_and_writes_nothing(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """upload/fetch/fsck/ls-files pass revisions to rev-list and ls-tree: one starting
    with '-' (``--output=FILE`` made rev-list write FILE) is refused in one line, exit 128."""
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    remote = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", str(remote))
    target = tmp_path / "written"
    rev = f"--output={target}"
    for argv in (["upload", "origin", "--", rev], ["fetch", "--", rev], ["fsck", "--", rev],
                 ["ls-files", "--", rev]):  # fmt: skip
        assert main(argv) == 128, argv
        err = capsys.readouterr().err
        assert err == (
            f"git-theta: error: {rev!r} is not a revision: give options before revisions\n"
        ), argv
        assert not target.exists(), argv
    assert main(["upload", "origin", "--", "--all"]) == 0  # rev-list's sets still work


def test_show_names_a_revision_that_looks_like_an_option(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    assert main(["show", "--", "--all:model.safetensors"]) == 128
    assert capsys.readouterr().err == (
        "git-theta: error: '--all' is not a revision: give options before revisions\n"
    )


def test_the_api_history_survives_an_import_of_the_history_module() -> None:
    """Every command imports the ``git_theta.history`` module; in a training process that
    also runs one (git theta ls-files through main, a test run), ``git_theta.history(...)``
    was a TypeError: the import put the module in the function's place."""
    code = (
        "import git_theta, git_theta.history\n"
        "from git_theta.history import manifests_at\n"
        "from git_theta.api import history\n"
        "assert git_theta.history is history, git_theta.history\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_huge_staged_blob_is_not_read_to_find_it_is_no_manifest(repo: Path) -> None:
    """The clean reads the path's staged blob to reuse its chains: a committed plain blob
    of 256 MiB (a zip bomb in the pack: it compresses to kB) was read whole, although no
    manifest is larger than manifest.MAX_BYTES."""
    (repo / "model.safetensors").write_bytes(bytes(256 << 20))
    off = ["-c", "filter.theta.process=", "-c", "filter.theta.clean=",
           "-c", "filter.theta.required=false"]  # fmt: skip
    git(repo, *off, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "a plain blob where a checkpoint is tracked")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    code, peak, err = _peak_kib(repo, "git", "add", "model.safetensors")
    assert code == 0, err
    assert peak < 150 * 1024, f"git add peaked at {peak // 1024} MiB"


def test_progress_and_summary_lines_escape_repository_paths(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cloned repository's path with terminal escapes reached the terminal raw through
    the checkout's progress line ("checking out PATH") and `checked out PATH`."""
    from git_theta import progress

    monkeypatch.delenv("GIT_THETA_QUIET")
    path = "\x1b]0;owned\x07m.safetensors"
    bar = progress.Progress(f"checking out {path}", 10, 1, show=True)
    bar.advance(10)
    bar._print(1.0)
    bar.close()
    progress.summary(f"checked out {path}")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "git-theta: checked out \\x1b]0;owned\\x07m.safetensors\n" in err
