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
