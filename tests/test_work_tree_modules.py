"""No module is ever imported from a work tree, whatever PYTHONPATH holds.

git runs every command git-theta configures (filters, drivers, the pre-push hook) in the
work tree of a repository that anyone may have written, and ``git theta ...`` typed there
runs in it too. An empty entry of PYTHONPATH (``PYTHONPATH=/opt/lib:``) is the working
directory, which ``python -P`` does not drop; only ``-E`` does (git_theta/interpreter.py).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import git, sha256
from hostile_modules import PYTHONPATHS, markers_left, plant
from st_files import f32, st_from_arrays

from git_theta.commands.cli import main
from git_theta.interpreter import FLAGS

SHAPES = {"a.weight": (64, 32), "b.weight": (32, 16), "c.bias": (16,)}
SRC = Path(__file__).parents[1] / "src" / "git_theta"


def run(where: Path, *argv: str, pythonpath: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in ``where`` with PYTHONPATH set; fail the test if it fails."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    return done


def save(path: Path, arrays: dict[str, np.ndarray]) -> str:
    path.write_bytes(st_from_arrays(arrays))
    return sha256(path)


@pytest.mark.parametrize("pythonpath", PYTHONPATHS)
def test_no_git_or_git_theta_command_imports_from_the_work_tree(
    repo: Path, tmp_path: Path, pythonpath: str
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    for where in (repo, repo / "sub"):
        plant(where, markers, f"{where.name}")
    git(repo, "add", "-A")  # the hostile files are committed: every clone has them
    git(repo, "commit", "-q", "-m", "modules")
    arrays = f32(SHAPES, seed=1)
    v1 = save(repo / "model.safetensors", arrays)

    def cmd(where: Path, *argv: str) -> subprocess.CompletedProcess[str]:
        return run(where, *argv, pythonpath=pythonpath)

    cmd(repo, "git", "add", "model.safetensors")
    cmd(repo, "git", "commit", "-q", "-m", "v1")
    cmd(repo, "git", "push", "-q", "origin", "main")
    clone = tmp_path / "clone"
    cmd(tmp_path, "git", "clone", "-q", f"file://{remote}", str(clone))
    assert sha256(clone / "model.safetensors") == v1

    # Two branches changing different tensors: the merge driver runs.
    cmd(clone, "git", "checkout", "-q", "-b", "left")
    left = {**arrays, "a.weight": arrays["a.weight"] + np.float32(1)}
    save(clone / "model.safetensors", left)
    cmd(clone, "git", "commit", "-q", "-am", "left")
    cmd(clone, "git", "checkout", "-q", "main")
    right = {**arrays, "b.weight": arrays["b.weight"] * np.float32(2)}
    save(clone / "model.safetensors", right)
    cmd(clone, "git", "add", "model.safetensors")
    assert "b.weight" in cmd(clone, "git", "diff", "--cached").stdout  # the diff driver
    cmd(clone, "git", "commit", "-q", "-m", "right")
    cmd(clone, "git", "merge", "-q", "--no-edit", "left")
    merged = {**arrays, "a.weight": left["a.weight"], "b.weight": right["b.weight"]}
    assert (clone / "model.safetensors").read_bytes() == st_from_arrays(merged)
    cmd(clone, "git", "show", "HEAD~1")  # textconv
    cmd(clone, "git", "log", "-p", "-3")
    cmd(clone, "git", "checkout", "-q", "HEAD~2", "--", "model.safetensors")  # smudge
    assert sha256(clone / "model.safetensors") == v1
    cmd(clone, "git", "checkout", "-q", "HEAD", "--", "model.safetensors")
    cmd(clone, "git", "push", "-q", "origin", "main")  # the pre-push hook
    for where in (clone, clone / "sub"):  # what users type, from the root and a subdirectory
        cmd(where, "git", "theta", "--version")
        cmd(where, "git", "theta", "ls-files")
        assert "a.weight" in cmd(where, "git", "theta", "show", "HEAD:model.safetensors").stdout
        cmd(where, "git", "theta", "diff", "HEAD~2", "HEAD")
    assert markers_left(markers) == []


@pytest.mark.parametrize("pythonpath", PYTHONPATHS)
def test_git_theta_typed_in_a_cloned_repository_imports_nothing_from_it(
    tmp_path: Path, pythonpath: str
) -> None:
    # The git-theta command itself (not pip's wrapper of an entry point, whose Python
    # starts without -E and imports sitecustomize, re... from here).
    markers = tmp_path / "markers"
    markers.mkdir()
    work = tmp_path / "work"
    git(tmp_path, "init", "-q", str(work))
    plant(work, markers, "work")
    assert run(work, "git", "theta", "--version", pythonpath=pythonpath).stdout.startswith(
        "git-theta "
    )
    assert run(work, "git-theta", "ls-files", pythonpath=pythonpath).stdout == ""
    assert markers_left(markers) == []


def test_every_command_install_writes_runs_python_isolated() -> None:
    assert main(["install"]) == 0
    done = git(Path.cwd(), "config", "--global", "--get-regexp", "theta")
    written = dict(line.split(" ", 1) for line in done.stdout.decode().splitlines())
    commands = {k: v for k, v in written.items() if k not in ("merge.theta.name",)}
    commands = {k: v for k, v in commands.items() if v != "true"}
    assert len(commands) == 6, written  # process, clean, smudge, diff, textconv, merge
    for key, value in commands.items():
        guard, _, runs = value.partition("; exec ")
        assert guard.startswith(f"[ -x {shlex.quote(sys.executable)} ] || "), key
        assert shlex.split(runs)[:5] == [sys.executable, *FLAGS, "-m", "git_theta"], key
    assert written["filter.theta.process"].endswith(" filter-process")


def test_no_code_of_ours_starts_python_another_way() -> None:
    # Every Python git-theta starts goes through interpreter.python_argv (the filter
    # client, which cannot import it, through its copy of the flags).
    from git_theta import filter_client

    assert filter_client.PYTHON_FLAGS == FLAGS
    as_argv = re.compile(r"[\[(,]\s*sys\.executable\b")  # an argv's first item
    starts = []
    for path in SRC.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if as_argv.search(line):
                starts.append(f"{path.relative_to(SRC)}:{number}")
    allowed = {"interpreter.py", "filter_client.py", "commands/install.py"}
    assert [s for s in starts if s.split(":")[0] not in allowed] == []


def test_a_python_started_without_the_flags_drops_the_work_tree_from_sys_path(
    tmp_path: Path,
) -> None:
    # Defence in depth: `python -m git_theta` typed by hand, or an older config, without
    # -E: the entry point removes the working directory before importing the rest.
    markers = tmp_path / "markers"
    markers.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "argparse.py").write_text(  # imported by the CLI, after the entry's guard
        f"open({str(markers / 'argparse')!r}, 'w')\n"
    )
    env = {**os.environ, "PYTHONPATH": ":"}
    done = subprocess.run(
        [sys.executable, "-m", "git_theta", "--version"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert markers_left(markers) == []


def test_a_module_the_interpreter_took_from_the_work_tree_stops_the_command(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "sitecustomize.py").write_text("")  # imported while Python starts, before us
    env = {**os.environ, "PYTHONPATH": "/nonexistent:"}
    done = subprocess.run(
        [sys.executable, "-m", "git_theta", "--version"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "git-theta: error: Python imported sitecustomize from the working directory "
        "(PYTHONPATH has an empty or relative entry): fix PYTHONPATH, then run "
        "`git theta install` again\n"
    )


def test_install_refuses_when_the_configured_commands_would_not_find_git_theta(
    tmp_path: Path,
) -> None:
    # git-theta found only through PYTHONPATH: the filters, which ignore it, would fail.
    base = Path(sys.base_prefix) / "bin" / "python3"
    src = str(SRC.parent)
    env = {**os.environ, "PYTHONPATH": src, "PATH": os.environ["PATH"]}
    done = subprocess.run(
        [str(base), "-m", "git_theta", "install"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"git-theta: error: {base}, started as git will start it (-E: ignoring PYTHONPATH "
        "and every PYTHON* variable, so that a cloned repository cannot supply modules) "
        "does not find git-theta: install git-theta with pip (in a virtualenv, or --user), "
        "then run `git theta install`\n"
    )
    assert not Path(os.environ["GIT_CONFIG_GLOBAL"]).read_text().count("theta")


def test_install_accepts_this_interpreter() -> None:
    assert main(["install"]) == 0
