"""Update types: how a changed tensor is stored. One registry, entry point group
``git_theta.plugins.updates``; the key is what the manifest records."""

from __future__ import annotations

from git_theta.registry import Registry
from git_theta.updates.base import UpdateType
from git_theta.updates.dense import Dense

UPDATES: Registry[UpdateType] = Registry("git_theta.plugins.updates", "update type")
UPDATES.register("dense", Dense())
# The others need NumPy, whose import costs ~0.12 s of every filter start-up; a checkout
# of dense values or an add of a new file never loads them.
for _key, _where in {
    "sparse": "sparse:Sparse",
    "delta": "delta:Delta",
    "auto": "auto:Auto",
    "low-rank": "factored:LowRank",
    "ia3": "factored:IA3",
}.items():
    UPDATES.register_lazy(_key, f"git_theta.updates.{_where}")
