"""Update types: how a changed tensor is stored. One registry, entry point group
``git_theta.plugins.updates``; the key is what the manifest records."""

from __future__ import annotations

from git_theta.registry import Registry
from git_theta.updates.auto import Auto
from git_theta.updates.base import UpdateType
from git_theta.updates.delta import Delta
from git_theta.updates.dense import Dense
from git_theta.updates.factored import IA3, LowRank
from git_theta.updates.sparse import Sparse

UPDATES: Registry[UpdateType] = Registry("git_theta.plugins.updates", "update type")
for _plugin in (Dense(), Sparse(), Delta(), Auto(), LowRank(), IA3()):
    UPDATES.register(_plugin.key, _plugin)
