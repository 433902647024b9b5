"""Review (session 3, late): restage's signal handling, chunked zigzag, registry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def test_a_second_signal_during_the_forced_adds_cleanup_leaves_no_index_lock(
    repo: Path,
) -> None:
    """05f6ba1 makes SIGTERM/SIGHUP raise SystemExit so the finally blocks remove
    ``index.lock``; but the handler stays installed while those blocks run, so a second
    signal (the terminal closed after ``timeout`` fired, Ctrl-C pressed again, a CI
    runner signalling again) raises SystemExit inside the cleanup itself and skips the
    ``os.unlink(lock)``: ``.git/index.lock`` stays and every later git command fails.
    The cleanup should run with the signals blocked (or the handler turned off after the
    first), delivering a pending one once the lock is gone. The second signal is sent
    deterministically, by the process itself, just before the lock is removed."""
    import signal
    import subprocess
    import sys

    from st_files import st_from_arrays
    from test_merge import save_commit

    w = np.arange(64, dtype=np.float32)
    save_commit(repo, {"w": w}, "v1", "model.safetensors")
    w[3] += 1
    (repo / "model.safetensors").write_bytes(st_from_arrays({"w": w}))
    script = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "from git_theta.commands import add\n"
        "real_unlink = os.unlink\n"
        "def unlink(path, *a, **k):\n"
        "    if os.path.basename(os.fsdecode(path)) == 'index.lock':\n"
        "        os.kill(os.getpid(), signal.SIGHUP)  # the second signal, mid-cleanup\n"
        "    return real_unlink(path, *a, **k)\n"
        "os.unlink = unlink\n"
        "def terminated(*argv, env=None):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "add.run_attached = terminated\n"
        "from git_theta.commands.cli import main\n"
        "sys.exit(main(['add', 'model.safetensors', '--update-type', 'dense']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True)
    assert done.returncode in (128 + signal.SIGTERM, 128 + signal.SIGHUP), done.stderr
    assert sorted(p.name for p in (repo / ".git").glob("index*")) == ["index"]


def test_a_plugin_that_exits_on_import_is_left_out_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """9a349e5 leaves out a plugin that does not load, with one warning, catching
    ``Exception``; a third-party module that refuses to import with ``sys.exit(...)``
    (``raise SystemExit("needs torch>=3")``, common in scripts turned packages) raises
    SystemExit, which is no Exception: it escapes the scan and ends git-theta (a smudge,
    a diff) with that package's message and code, the very failure the fix is for. A
    SystemExit from ``ep.load()`` should be treated as a load failure (KeyboardInterrupt
    still propagating)."""
    import sys

    from git_theta.errors import UnknownPluginError
    from git_theta.registry import Registry

    info = tmp_path / "exiting_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: exiting-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[git_theta.plugins.test_exiting]\nexiting = exiting_plugin_xyz:Plugin\n"
    )
    (tmp_path / "exiting_plugin_xyz.py").write_text('raise SystemExit("needs torch>=3")\n')
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    registry: Registry[object] = Registry("git_theta.plugins.test_exiting", "update type")
    registry.register("fine", object())
    with pytest.raises(UnknownPluginError, match=r"available: fine"):
        registry.get("other")
    assert "plugin 'exiting'" in capsys.readouterr().err
