"""install, track and settings, called in process through main()."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DIRECT, git

from git_theta import progress
from git_theta.commands.cli import main
from git_theta.commands.track import update_attributes
from git_theta.errors import UsageError
from git_theta.settings import env_flag


def config(key: str, *scope: str) -> str:
    return subprocess.run(
        ["git", "config", *scope, "--get", key], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_install_writes_global_config() -> None:
    assert main(["install"]) == 0
    # The filter itself (the warm server is opt-in), isolated from PYTHONPATH and the cwd.
    expected = DIRECT
    assert config("filter.theta.process", "--global") == expected
    assert config("filter.theta.required", "--global") == "true"


def test_install_local_only_touches_the_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git(tmp_path, "init", "-q")
    monkeypatch.chdir(tmp_path)
    assert main(["install", "--local"]) == 0
    expected = DIRECT
    assert config("filter.theta.process", "--local") == expected
    global_config = Path(os.environ["GIT_CONFIG_GLOBAL"]).read_text()
    assert "theta" not in global_config


def test_install_without_git_lfs_says_how_to_get_it(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").symlink_to(subprocess.check_output(["which", "git"], text=True).strip())
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}"}
    done = subprocess.run(
        [sys.executable, "-m", "git_theta", "install"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.startswith("git-theta: error: git-lfs is not installed;")
    assert "apt-get install git-lfs" in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_update_attributes_is_idempotent_and_keeps_other_attributes() -> None:
    text = "*.bin filter=lfs diff=lfs merge=lfs -text\n*.txt eol=lf\n"
    once = update_attributes(text, "*.bin")
    assert once == "*.bin filter=theta diff=theta merge=theta -text\n*.txt eol=lf\n"
    assert update_attributes(once, "*.bin") == once
    assert (
        update_attributes("", "model.safetensors")
        == "model.safetensors filter=theta diff=theta merge=theta -text\n"
    )


def test_track_from_a_subdirectory_anchors_the_pattern(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    git(tmp_path, "init", "-q")
    assert main(["install"]) == 0
    (tmp_path / "models" / "v1").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "models")
    assert main(["track", "v1/my model.safetensors", "*.pt"]) == 0
    assert main(["track", "*.pt"]) == 0
    assert (tmp_path / ".gitattributes").read_text() == (
        "models/v1/my[[:space:]]model.safetensors filter=theta diff=theta merge=theta -text\n"
        "models/*.pt filter=theta diff=theta merge=theta -text\n"
    )
    attr = git(tmp_path, "check-attr", "filter", "--", "models/v1/my model.safetensors")
    assert attr.stdout.decode().strip().endswith("filter: theta")


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("True", True),
        ("yes", True),
        ("False", False),
        ("0", False),
        ("", False),
        ("off", False),
    ],
)
def test_env_flag_parses_false_as_false(
    raw: str, value: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_THETA_X", raw)
    assert env_flag("GIT_THETA_X") is value


def test_env_flag_refuses_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_THETA_X", "maybe")
    with pytest.raises(UsageError, match="GIT_THETA_X='maybe' is not a boolean"):
        env_flag("GIT_THETA_X")


def test_progress_reports_tensors_bytes_and_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    bar = progress.Progress("adding m.safetensors", 2_000_000, 2, show=True)
    bar.advance(1_000_000)
    bar.advance(1_000_000)
    bar.close()
    last = err.getvalue().split("\r")[-1]
    assert last.startswith("git-theta: adding m.safetensors: 2/2 tensors, 2.0/2.0 MB, ")
    assert last.endswith(" MB/s\n")


def test_progress_is_silent_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "DELAY", 0.0)
    bar = progress.Progress("adding", 10, 1)
    bar.advance(10)
    bar.close()
    assert err.getvalue() == ""
