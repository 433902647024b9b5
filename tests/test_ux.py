"""What a newcomer touches: help and the manual, quiet and counts, bad revisions, errors
outside a repository, a closed output pipe, prune's grace period, a per-user install."""

from __future__ import annotations

import ast
import copy
import os
import pickle
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import git
from st_files import f32, st_from_arrays

from git_theta.commands.cli import _parser, main
from git_theta.commands.help_text import ABOUT
from git_theta.errors import CommandError, command_error

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "git_theta"
SHAPES = {"layer.weight": (8, 8), "layer.bias": (8,)}


def _subcommands() -> dict[str, object]:
    import argparse

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_says_what_it_does_with_an_example() -> None:
    commands = _subcommands()
    assert set(commands) <= set(ABOUT), f"add {set(commands) - set(ABOUT)} to help_text.ABOUT"
    for name, parser in commands.items():
        text = parser.format_help()  # type: ignore[attr-defined]
        assert ABOUT[name][0].split()[0] in text, name
        assert f"example:\n  {ABOUT[name][1]}" in text, name
    top = _parser().format_help()
    assert "examples:" in top and "git help theta" in top


def test_the_committed_man_page_is_what_the_parser_gives() -> None:
    from git_theta.manpage import render

    page = (ROOT / "docs/man/git-theta.1").read_text()
    assert page == render(), "run: python -m git_theta.manpage > docs/man/git-theta.1"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["data-files"]
    assert data["share/man/man1"] == ["docs/man/git-theta.1"]


def test_git_help_theta_and_git_theta_help_open_the_installed_page(tmp_path: Path) -> None:
    """Laid out as pip installs it: <prefix>/bin/git-theta and
    <prefix>/share/man/man1/git-theta.1; git runs `man git-theta` for both."""
    if shutil.which("man") is None:
        pytest.skip("no man(1) on this machine")
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "share/man/man1").mkdir(parents=True)
    os.symlink(shutil.which("git-theta") or "", prefix / "bin/git-theta")
    shutil.copy(ROOT / "docs/man/git-theta.1", prefix / "share/man/man1/git-theta.1")
    env = {**os.environ, "PATH": f"{prefix / 'bin'}:{os.environ['PATH']}", "MANPAGER": "cat"}
    env.pop("MANPATH", None)
    for argv in (["git", "help", "theta"], ["git", "theta", "--help"]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "GIT-THETA(1)" in done.stdout
        assert "git theta fetch" in done.stdout


def test_git_quiet_is_seen_through_the_shell_git_starts_filters_with(tmp_path: Path) -> None:
    """git runs a filter command through ``sh -c``: the filter's parent is the shell, and
    git's -q must still be seen (a Python that records what progress decides)."""
    work = tmp_path / "probe"
    work.mkdir()
    git(work, "init", "-q")
    out = tmp_path / "quiet.txt"
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from git_theta import progress\n"
        f"open({str(out)!r}, 'a').write(str(progress._git_is_quiet()) + '\\n')\n"
    )
    (work / ".gitattributes").write_text("*.bin filter=probe\n")
    (work / "a.bin").write_bytes(b"a")
    git(work, "add", "a.bin", ".gitattributes")
    git(work, "commit", "-q", "-m", "a")
    # Two commands: sh cannot exec the first, so it stays the Python's parent.
    git(work, "config", "filter.probe.smudge", f"{sys.executable} {probe}; cat")
    for quiet in (["-q"], []):
        (work / "a.bin").unlink()
        git(work, "checkout", *quiet, "--", "a.bin")
    assert out.read_text().split() == ["True", "False"]


def test_quiet_flag_and_summary_lines(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`git push -q` prints no count; without it the count says what happened; `git theta
    fetch` says how many it downloaded and how many were already there."""
    monkeypatch.delenv("GIT_THETA_QUIET")
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    quiet = git(repo, "push", "-q", "origin", "main")
    assert b"git-theta" not in quiet.stderr
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 2)))
    git(repo, "commit", "-qam", "v2")
    loud = git(repo, "push", "origin", "main")
    assert re.search(rb"^git-theta: \d+ tensor objects uploaded to origin or already there$",
                     loud.stderr, re.M)  # fmt: skip

    lazy = tmp_path / "lazy"
    done = subprocess.run(
        ["git", "clone", "-q", f"file://{remote}", str(lazy)],
        capture_output=True,
        env={**os.environ, "GIT_THETA_SKIP_SMUDGE": "1"},
    )
    assert done.returncode == 0, done.stderr
    first = subprocess.run(["git", "theta", "fetch"], cwd=lazy, capture_output=True, text=True)
    assert first.stderr == "git-theta: downloaded 3 tensor objects, 0 already present\n"
    again = subprocess.run(["git", "theta", "fetch"], cwd=lazy, capture_output=True, text=True)
    assert again.stderr == "git-theta: downloaded 0 tensor objects, 3 already present\n"
    silent = subprocess.run(
        ["git", "theta", "fetch", "-q"], cwd=lazy, capture_output=True, text=True
    )
    assert (silent.returncode, silent.stderr) == (0, "")


UNKNOWN = "no branch, tag or commit has that name; see `git branch -a` and `git log --oneline`"
SHORT = (
    "HEAD exists, but its history is shorter than that or it has no such parent; see "
    "`git log --oneline HEAD`"
)


@pytest.mark.parametrize(
    ("argv", "rev", "why"),
    [
        (["diff", "mian", "HEAD"], "mian", UNKNOWN),
        (["diff", "HEAD~10"], "HEAD~10", SHORT),
        (["diff", "mian", "--", "model.safetensors"], "mian", UNKNOWN),
        (["show", "HEAD~10:model.safetensors"], "HEAD~10", SHORT),
        (["ls-files", "mian"], "mian", UNKNOWN),
        (["fetch", "mian"], "mian", UNKNOWN),
        (["fsck", "mian"], "mian", UNKNOWN),
        (["upload", "origin", "mian"], "mian", UNKNOWN),
        (["migrate", "import", "mian"], "mian", UNKNOWN),
    ],
)
def test_a_bad_revision_exits_128_naming_it(
    repo: Path, capsys: pytest.CaptureFixture[str], argv: list[str], rev: str, why: str
) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    git(repo, "remote", "add", "origin", str(repo))
    capsys.readouterr()
    assert main(argv) == 128
    captured = capsys.readouterr()
    assert captured.err == f"git-theta: error: unknown revision {rev!r}: {why}\n"
    assert captured.out == ""


@pytest.mark.parametrize("argv", [["diff"], ["ls-files"], ["fetch"], ["prune"], ["show", "m"]])
def test_outside_a_repository_says_so_in_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert main(argv) == 128
    assert capsys.readouterr().err == (
        "git-theta: error: not a git repository (or any parent directory): run this inside "
        "a repository (cd into one, or `git init`)\n"
    )


def test_diff_cached_before_the_first_commit_compares_with_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "fresh"
    work.mkdir()
    git(work, "init", "-q")
    assert main(["install"]) == 0
    monkeypatch.chdir(work)
    assert main(["track", "*.safetensors"]) == 0
    (work / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(work, "add", "model.safetensors")
    capsys.readouterr()
    assert main(["diff", "--cached"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "A layer.weight" in captured.out


def _many_tensors(repo: Path) -> None:
    shapes = {f"t{i}": (2,) for i in range(3000)}  # more lines than a pipe holds
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(shapes, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(shapes, 2)))
    git(repo, "commit", "-qam", "v2")


PIPED = [
    "git theta show model.safetensors | head -1",
    "git theta diff HEAD~1 HEAD | head -1",
    "git show --ext-diff HEAD | head -1",
    "git log -p | head -1",
]


def test_closing_the_output_early_is_silent(repo: Path) -> None:
    _many_tensors(repo)
    for command in PIPED:
        done = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {command}"],
            cwd=repo, capture_output=True, text=True,
        )  # fmt: skip
        assert done.stderr == "", command
        assert len(done.stdout.splitlines()) == 1, command
        # git itself dies of SIGPIPE (141) once its reader is gone; git-theta exits 0.
        allowed = (0,) if command.startswith("git theta") else (0, 141)
        assert done.returncode in allowed, command


def test_a_git_failure_survives_copy_and_pickle() -> None:
    """A worker's error crossing to its parent (or copied by a library) must stay the
    same error, not become a TypeError from the constructor's four arguments."""
    exc = command_error(("git", "-c", "a=b", "ls-tree", "x"), 128, b"", b"fatal: bad tree")
    exc.args = ("tensor 'w': " + str(exc),)
    for again in (copy.copy(exc), pickle.loads(pickle.dumps(exc))):
        assert type(again) is CommandError
        assert (again.argv, again.returncode, str(again)) == (exc.argv, 128, str(exc))
    assert str(exc) == "tensor 'w': git ls-tree failed: bad tree"


def test_every_theta_error_survives_copy_and_pickle() -> None:
    """Whatever its __init__ takes, each ThetaError subclass (imported from every module
    of the package) comes back from copy and pickle as itself, message and fields kept."""
    import importlib
    import pkgutil

    import git_theta
    from git_theta.errors import ThetaError

    for info in pkgutil.walk_packages(git_theta.__path__, "git_theta."):
        # (integrations import the ML libraries they serve; they define no errors)
        if not info.name.endswith(("__main__", "hdf5_layout")) and ".integrations" not in info.name:
            importlib.import_module(info.name)
    seen: list[type[ThetaError]] = [ThetaError]
    for cls in seen:
        seen.extend(c for c in cls.__subclasses__() if c not in seen)
    assert len(seen) > 25
    for cls in seen:
        exc = cls.__new__(cls)
        exc.args = (f"{cls.__name__}: one line",)
        exc.detail = 7  # type: ignore[attr-defined]
        for again in (copy.copy(exc), pickle.loads(pickle.dumps(exc))):
            assert type(again) is cls
            assert (str(again), again.detail) == (str(exc), 7)  # type: ignore[attr-defined]


def test_no_exception_is_rebuilt_from_its_type() -> None:
    """`raise type(exc)(message)` turns a CommandError into a TypeError: add a note or
    set exc.args instead (a scan, so no future path can bring it back)."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                continue
            func = node.exc.func
            rebuilt = (
                isinstance(func, ast.Call)
                and isinstance(func.func, ast.Name)
                and func.func.id == "type"
            ) or (isinstance(func, ast.Attribute) and func.attr == "__class__")
            if rebuilt:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_prune_dry_run_names_the_grace_period_and_how_to_override_it(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "rm", "-q", "--cached", "model.safetensors")  # its objects: needed by nothing
    capsys.readouterr()
    assert main(["prune", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "would delete 0 unreferenced objects" in err
    assert (
        "git-theta: kept 3 unreferenced objects younger than the grace period (1 hour: a git "
        "command may be writing the manifest that needs them); `git theta prune --grace 0` "
        "deletes them too\n"
    ) in err
    assert main(["prune", "--dry-run", "--grace", "0"]) == 0
    err = capsys.readouterr().err
    assert "would delete 3 unreferenced objects" in err and "younger" not in err


def test_a_per_user_install_leaves_the_current_repository_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "w"
    work.mkdir()
    git(work, "init", "-q")
    hooks = sorted(p.name for p in (work / ".git/hooks").iterdir())
    monkeypatch.chdir(work)
    assert main(["install"]) == 0
    assert sorted(p.name for p in (work / ".git/hooks").iterdir()) == hooks
    assert git(work, "config", "--local", "--get-regexp", "theta", check=False).stdout == b""
    assert "`git theta track PATTERN` installs the pre-push hook" in capsys.readouterr().err
    assert main(["track", "*.safetensors"]) == 0
    assert (work / ".git/hooks/pre-push").exists()


def _broken_h5py_filter(repo: Path, tmp_path: Path) -> str:
    """A filter command whose Python has no working h5py (see test_flax_hdf5.py)."""
    import shlex

    venv = tmp_path / "no-h5py"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "h5py.py").write_text("raise ImportError('no h5py here')\n")
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "project.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return shlex.join([str(venv / "bin" / "python"), "-E", "-P", "-m", "git_theta"])


def test_status_and_diff_degrade_without_h5py_and_add_refuses(repo: Path, tmp_path: Path) -> None:
    import h5py
    import numpy as np

    assert main(["track", "*.h5"]) == 0
    for name, value in (("a.h5", 1.0), ("b.h5", 2.0)):
        with h5py.File(repo / name, "w") as f:
            f["w"] = np.full(100, value, dtype=np.float32)
    git(repo, "add", ".gitattributes", "a.h5", "b.h5")
    git(repo, "commit", "-q", "-m", "h5")
    broken = _broken_h5py_filter(repo, tmp_path)
    git(repo, "config", "--local", "filter.theta.process", f"{broken} filter-process")
    for name in ("a.h5", "b.h5"):
        with h5py.File(repo / name, "r+") as f:
            f["w"][0] = 9.0
    warning = (
        "git-theta: warning: reading an HDF5 file needs h5py, which is not installed: pip "
        "install h5py; HDF5 files may show as modified until then\n"
    )
    status = git(repo, "status", "--porcelain", check=False)
    assert (status.returncode, status.stdout) == (0, b" M a.h5\n M b.h5\n")
    assert status.stderr.decode() == warning  # once for both files
    diff = git(repo, "diff", "--stat", check=False)
    assert diff.returncode == 0 and b"a.h5" in diff.stdout
    git(repo, "config", "--local", "diff.theta.command", f"{broken} diff-driver")
    diff = git(repo, "diff", check=False)  # the diff driver reads the work-tree file
    assert diff.returncode == 0, diff.stderr
    assert (
        b"a.h5: not shown: reading an HDF5 file needs h5py, which is not installed: pip "
        b"install h5py (checking out does not need it)\n"
    ) in diff.stdout
    add = git(repo, "add", "a.h5", check=False)
    assert add.returncode != 0
    assert add.stderr.decode().splitlines()[0] == (
        "git-theta: error: a.h5: reading an HDF5 file needs h5py, which is not installed: "
        "pip install h5py (checking out does not need it)"
    )
    assert git(repo, "diff", "--cached", "--name-only").stdout == b""


def test_a_malformed_rules_file_degrades_status_and_fails_add(repo: Path) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    (repo / ".theta-updates").write_text("layer.* sparse extra\n")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 2)))
    status = git(repo, "status", "--porcelain", check=False)
    assert status.returncode == 0
    assert b" M model.safetensors\n" in status.stdout
    assert status.stderr.decode() == (
        "git-theta: warning: .theta-updates:1: expected 'TENSOR_GLOB UPDATE_TYPE', got "
        "'layer.* sparse extra': fix that line; using auto until it is fixed (git add "
        "refuses it)\n"
    )
    assert git(repo, "diff", check=False).returncode == 0
    add = git(repo, "add", "model.safetensors", check=False)
    assert add.returncode != 0
    assert add.stderr.decode().splitlines()[0] == (
        "git-theta: error: model.safetensors: .theta-updates:1: expected 'TENSOR_GLOB "
        "UPDATE_TYPE', got 'layer.* sparse extra': fix that line"
    )


def test_forcing_an_update_type_restages_and_says_when_it_stored_dense(repo: Path) -> None:
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    weight = rng.standard_normal(4096).astype(np.float32)
    (repo / "model.safetensors").write_bytes(st_from_arrays({"w": weight}))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")

    def staged_chain() -> list[str]:
        manifest = json.loads(git(repo, "show", ":model.safetensors").stdout)
        return [link["update"] for link in manifest["tensors"]["w"]["chain"]]

    weight[7] += 1
    (repo / "model.safetensors").write_bytes(st_from_arrays({"w": weight}))
    git(repo, "add", "model.safetensors")  # auto: a sparse change
    assert staged_chain() == ["dense", "sparse"]
    done = subprocess.run(
        ["git", "theta", "add", "model.safetensors", "--update-type", "dense"],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")
    assert staged_chain() == ["dense"]  # really stored again, as asked

    every = rng.standard_normal(4096).astype(np.float32)
    (repo / "model.safetensors").write_bytes(st_from_arrays({"w": every}))
    done = subprocess.run(
        ["git", "theta", "add", "model.safetensors", "--update-type", "sparse"],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0
    assert done.stderr == (
        "git-theta: model.safetensors: stored 1 changed tensor(s) dense (e.g. 'w'), not "
        "sparse: a dense value was smaller (most elements changed) or the type cannot "
        "describe the change\n"
    )
    assert staged_chain() == ["dense"]


def test_an_update_type_for_a_path_git_theta_does_not_track_is_refused(
    repo: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (repo / "notes.txt").write_text("hello\n")
    capsys.readouterr()
    assert main(["add", "notes.txt", "--update-type", "sparse"]) == 2
    assert capsys.readouterr().err == (
        "git-theta: error: notes.txt is not tracked by git-theta (no filter=theta "
        "attribute), so --update-type sparse does not apply to it; run `git theta track "
        "notes.txt` first, or stage it with `git add notes.txt`\n"
    )
    assert git(repo, "diff", "--cached", "--name-only").stdout == b""


def test_a_missing_object_is_one_line_naming_the_file_without_git_lfs_noise(
    repo: Path,
) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    shutil.rmtree(repo / ".git/lfs/theta/objects")
    (repo / "model.safetensors").unlink()
    why = (
        "could not be downloaded from the Git LFS remote: this repository has no Git LFS "
        "remote (no git remote, no lfs.url); add one with `git remote add origin URL` and "
        "retry"
    )
    done = git(repo, "checkout", "--", "model.safetensors", check=False)
    lines = done.stderr.decode().splitlines()
    assert lines[0].startswith("git-theta: error: model.safetensors: object ")
    assert lines[0].endswith(why)
    assert lines[1:] == ["fatal: model.safetensors: smudge filter theta failed"]

    env = {**os.environ, "GIT_THETA_SKIP_SMUDGE": "1"}
    subprocess.run(["git", "checkout", "--", "model.safetensors"], cwd=repo, env=env, check=True)
    done = subprocess.run(["git", "theta", "checkout"], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.startswith("git-theta: error: model.safetensors: object ")
    assert done.stderr.endswith(why + "\n") and done.stderr.count("\n") == 1


def _on_a_terminal(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``argv`` on a pseudo-terminal (stdout, stderr); return its exit code and what the
    terminal showed."""
    import pty

    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=secondary, stderr=secondary)
        os.close(secondary)
        shown = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        return proc.wait(), shown.decode(errors="replace")
    finally:
        os.close(primary)


def test_a_push_on_a_terminal_shows_upload_progress_and_q_silences_it(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GIT_THETA_QUIET")
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    code, shown = _on_a_terminal(["git", "push", "-q", "origin", "main"], repo)
    assert (code, shown) == (0, "")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 2)))
    git(repo, "commit", "-qam", "v2")
    code, shown = _on_a_terminal(["git", "push", "origin", "main"], repo)
    assert code == 0
    assert "Uploading LFS objects: 100% (3/3)" in shown  # git-lfs's own meter
    assert "tensor objects uploaded to origin or already there" in shown


def test_progress_lines_for_known_and_unknown_totals(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from git_theta import progress

    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    known = progress.Progress("downloading", 2_000_000, 2, show=True, unit="objects")
    known.advance(1_000_000)
    known.close()
    walk = progress.Progress("looking at objects", 0, 0, show=True, unit="objects")
    walk.advance(0)
    walk.close()
    err = capsys.readouterr().err
    assert "\rgit-theta: downloading: 1/2 objects, 1.0/2.0 MB, " in err
    assert "\rgit-theta: looking at objects: 1 objects, 0.0 MB, " in err
    assert err.endswith(" MB/s\n")
    monkeypatch.setenv("GIT_THETA_QUIET", "1")
    assert not progress.enabled() and progress.quiet()


def test_a_local_install_outside_a_repository_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert main(["install", "--local"]) == 2
    assert capsys.readouterr().err == (
        "git-theta: error: --local: not a git repository (or any parent directory): run this "
        "inside a repository (cd into one, or `git init`); or install for your user without it\n"
    )


@pytest.mark.parametrize(("name", "value"), [("GIT_THETA_UPDATE_TYPE", "bogus")])
def test_a_bad_setting_in_the_environment_never_breaks_git_status(
    repo: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 2)))
    monkeypatch.setenv(name, value)
    status = git(repo, "status", "--porcelain", check=False)
    assert (status.returncode, status.stdout) == (0, b" M model.safetensors\n")
    add = git(repo, "add", "model.safetensors", check=False)
    assert add.returncode != 0 and value in add.stderr.decode().splitlines()[0]


def test_a_git_failure_names_its_reason_not_its_advice(repo: Path) -> None:
    # git ends a held index.lock's message with "remove the file manually to continue":
    # the last line alone dropped which file and invited deleting a live lock.
    from git_theta import git as gitcalls

    (repo / "a.txt").write_text("a")
    (repo / ".git" / "index.lock").write_text("")
    with pytest.raises(CommandError) as caught:
        gitcalls.git("add", "a.txt", cwd=str(repo))
    message = str(caught.value)
    assert message.startswith("git add failed: Unable to create '"), message
    assert (
        "index.lock': File exists. (another git command is running in this repository: " in message
    )
    assert "remove the file manually" not in message and "\n" not in message


def test_a_bad_quiet_value_is_one_warning_on_a_terminal_and_breaks_nothing(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIT_THETA_QUIET only changes what is printed: a checkout on a terminal failed every
    # file on it (exit 128), while off a terminal it was ignored.
    import hashlib

    (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    want = hashlib.sha256((repo / "model.safetensors").read_bytes()).hexdigest()
    (repo / "model.safetensors").unlink()
    monkeypatch.setenv("GIT_THETA_QUIET", "maybe")
    code, shown = _on_a_terminal(["git", "checkout", "--", "model.safetensors"], repo)
    assert code == 0, shown
    assert shown.count("GIT_THETA_QUIET='maybe' is not a boolean") == 1, shown
    assert hashlib.sha256((repo / "model.safetensors").read_bytes()).hexdigest() == want


def test_an_interrupted_forced_add_leaves_the_index_as_it_was(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`git theta add --update-type` re-stages in a private copy of the index: Ctrl-C at
    the worst moment (entries put back to HEAD's, the add not yet run) changes nothing,
    and a held index lock is refused before anything happens."""
    import json

    import numpy as np

    from git_theta.commands import add as add_command

    rng = np.random.default_rng(1)
    weight = rng.standard_normal(4096).astype(np.float32)
    (repo / "model.safetensors").write_bytes(st_from_arrays({"w": weight}))
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    weight[7] += 1
    (repo / "model.safetensors").write_bytes(st_from_arrays({"w": weight}))
    git(repo, "add", "model.safetensors")
    index = repo / ".git" / "index"
    before = index.read_bytes()
    head = git(repo, "ls-tree", "HEAD", "--format=%(objectmode) %(objectname) 0\t%(path)").stdout
    assert git(repo, "ls-files", "-s").stdout != head

    def interrupted(*argv: str, env: dict[str, str] | None = None) -> int:
        # the private index was put back to HEAD's version of the file, the real one not
        assert env is not None
        assert os.path.basename(env["GIT_INDEX_FILE"]).startswith("index.theta-")
        assert git(repo, "ls-files", "-s").stdout == head  # our git calls: the copy
        assert index.read_bytes() == before
        with open(env["GIT_INDEX_FILE"] + ".lock", "x"):  # as a git add killed mid-way
            pass
        raise KeyboardInterrupt

    original = add_command.run_attached
    monkeypatch.setattr(add_command, "run_attached", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["add", "model.safetensors", "--update-type", "dense"])
    assert index.read_bytes() == before
    assert sorted(p.name for p in (repo / ".git").glob("index*")) == ["index"]
    assert "GIT_INDEX_FILE" not in os.environ
    monkeypatch.setattr(add_command, "run_attached", original)

    (repo / ".git" / "index.lock").write_bytes(b"")
    capsys.readouterr()
    assert main(["add", "model.safetensors", "--update-type", "dense"]) == 1
    lock = repo / ".git" / "index.lock"
    assert capsys.readouterr().err == (
        f"git-theta: error: {lock} exists: another git command is running in this "
        "repository; let it finish, then try again (if none is, remove that file)\n"
    )
    lock.unlink()
    assert index.read_bytes() == before
    assert main(["add", "model.safetensors", "--update-type", "dense"]) == 0
    manifest = json.loads(git(repo, "show", ":model.safetensors").stdout)
    assert [link["update"] for link in manifest["tensors"]["w"]["chain"]] == ["dense"]
