"""Merge strategies: how a tensor changed differently on both sides is combined. One
registry, entry point group ``git_theta.plugins.merges``; the key is what a merge
records. The contract (MergeStrategy, parse_params, merge_tensor) is in base.py."""

from __future__ import annotations

from git_theta.merges.base import MergeStrategy
from git_theta.registry import Registry

MERGES: Registry[MergeStrategy] = Registry("git_theta.plugins.merges", "merge strategy")
# Built-ins are registered here as well as by entry point, so they are found before the
# package's entry points are installed; loaded on first use.
for _key, _where in {
    "ours": "sides:Ours",
    "theirs": "sides:Theirs",
    "base": "sides:Base",
    "average": "linear:Average",
    "task-arithmetic": "linear:TaskArithmetic",
    "ties": "ties:Ties",
    "dare": "ties:Dare",
    "slerp": "slerp:Slerp",
}.items():
    MERGES.register_lazy(_key, f"git_theta.merges.{_where}")
