"""The plugin registry, under the threads that rebuild tensors in parallel."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from git_theta.errors import UnknownPluginError
from git_theta.registry import Registry


def test_lazy_plugin_loads_once_for_many_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plugin module whose import takes a while, like the NumPy-backed update types.
    (tmp_path / "slow_plugin.py").write_text(
        "import time\ntime.sleep(0.3)\nclass Slow:\n    made = 0\n"
        "    def __init__(self):\n        Slow.made += 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry: Registry[object] = Registry("git_theta.plugins.none", "thing")
    registry.register_lazy("slow", "slow_plugin:Slow")
    barrier = threading.Barrier(8)
    results: list[object] = []
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            results.append(registry.get("slow"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert sys.modules["slow_plugin"].Slow.made == 1
    with pytest.raises(UnknownPluginError, match=r"unknown thing 'nope' \(available: slow\)"):
        registry.get("nope")


def test_a_plugin_that_does_not_load_is_left_out_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken third-party package (its module gone) must not make every scan, and so
    every checkout naming an unknown type, fail with a traceback."""
    info = tmp_path / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[git_theta.plugins.test_broken]\nbroken = no_such_module_xyz:Plugin\n"
    )
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    registry: Registry[object] = Registry("git_theta.plugins.test_broken", "update type")
    registry.register("fine", object())
    unknown = r"^unknown update type 'other' \(available: fine\)$"
    with pytest.raises(UnknownPluginError, match=unknown):
        registry.get("other")
    assert capsys.readouterr().err == (
        "git-theta: warning: update type plugin 'broken' (no_such_module_xyz:Plugin) does "
        "not load (No module named 'no_such_module_xyz'): ignored; reinstall or uninstall "
        "the package that provides it\n"
    )
