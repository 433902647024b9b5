"""One plugin registry class, used for checkpoint formats (and later update types, merges).

Plugins are found through entry points, loaded lazily by key; the key a plugin is
registered under is the key the manifest records.
"""

from __future__ import annotations

import importlib
import threading
from typing import Generic, TypeVar

from git_theta.errors import ThetaError, UnknownPluginError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps keys to plugin instances of one kind."""

    def __init__(self, group: str, kind: str):
        self.group = group
        self.kind = kind
        self._plugins: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._scanned = False
        self._lock = threading.RLock()

    def register(self, key: str, plugin: T) -> None:
        """Add ``plugin`` under ``key``. Raises ThetaError if the key is taken."""
        with self._lock:
            if key in self._plugins or key in self._lazy:
                raise ThetaError(f"{self.kind} {key!r} is already registered")
            self._plugins[key] = plugin

    def register_lazy(self, key: str, where: str) -> None:
        """Add the plugin class at ``where`` ("module:Class"), imported on first use."""
        with self._lock:
            if key in self._plugins or key in self._lazy:
                raise ThetaError(f"{self.kind} {key!r} is already registered")
            self._lazy[key] = where

    def _load(self, key: str) -> None:
        # Called with the lock held. The plugin is in _plugins before it leaves _lazy, so
        # no thread ever sees the key in neither (tensors are rebuilt on several threads).
        module, _, name = self._lazy[key].partition(":")
        self._plugins[key] = getattr(importlib.import_module(module), name)()
        del self._lazy[key]

    def _scan(self) -> None:
        # Called with the lock held; marked done only once every entry point is loaded.
        if self._scanned:
            return
        from importlib.metadata import entry_points  # slow import: only when needed

        for ep in entry_points(group=self.group):
            if ep.name not in self._plugins and ep.name not in self._lazy:
                try:
                    self._plugins[ep.name] = ep.load()()
                except (Exception, SystemExit) as exc:  # a third party's: any fault
                    # One broken package must not stop every checkout: it is left out,
                    # and a request for its key says what exists.
                    import sys

                    sys.stderr.write(
                        f"git-theta: warning: {self.kind} plugin {ep.name!r} ({ep.value}) "
                        f"does not load ({exc}): ignored; reinstall or uninstall the "
                        "package that provides it\n"
                    )
        self._scanned = True

    def get(self, key: str) -> T:
        """Return the plugin for ``key``. Raises UnknownPluginError listing what exists."""
        plugin = self._plugins.get(key)
        if plugin is not None:
            return plugin
        with self._lock:
            if key in self._lazy:
                self._load(key)
            if key not in self._plugins:
                self._scan()
            try:
                return self._plugins[key]
            except KeyError:
                known = ", ".join(sorted({*self._plugins, *self._lazy})) or "none"
                raise UnknownPluginError(
                    f"unknown {self.kind} {key!r} (available: {known})"
                ) from None

    def all(self, scan: bool = True) -> dict[str, T]:
        """Return every registered plugin by key (built-ins only when ``scan`` is false)."""
        with self._lock:
            for key in list(self._lazy):
                self._load(key)
            if scan:
                self._scan()
            return dict(self._plugins)
