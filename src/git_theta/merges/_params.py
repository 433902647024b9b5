"""Checking ``--param k=v`` text against a strategy's declared params."""

from __future__ import annotations

import math
from collections.abc import Mapping

from git_theta.errors import UsageError
from git_theta.merges.base import MergeStrategy, Param, ParamValue

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _allowed(param: Param) -> str:
    """Return what ``param`` accepts, for messages: "a number in (0, 1]", "linear or ties"."""
    if param.kind is bool:
        return "true or false"
    if param.choices:
        return " or ".join(param.choices)
    what = {float: "a number", int: "an integer", str: "text"}[param.kind]
    if param.low is None and param.high is None:
        return what
    left = "(" if param.low_open else "["
    low = "-inf" if param.low is None else f"{param.low:g}"
    high = "inf" if param.high is None else f"{param.high:g}"
    return f"{what} in {left}{low}, {high}{']' if param.high is not None else ')'}"


def shown(text: str) -> str:
    """``text`` for a message, cut to 60 characters (a committed rules file's line may be
    1 MiB, all of it echoed to the terminal)."""
    return text if len(text) <= 60 else text[:57] + "..."


def _convert(strategy: MergeStrategy, param: Param, text: str) -> ParamValue:
    bad = UsageError(
        f"merge strategy {strategy.name}: {param.name}={shown(text)!r} is not allowed "
        f"({param.name} takes {_allowed(param)})"
    )
    value: ParamValue
    if param.kind is bool:
        lowered = text.strip().lower()
        if lowered not in _TRUE + _FALSE:
            raise bad
        return lowered in _TRUE
    if param.kind is str:
        if param.choices and text not in param.choices:
            raise bad
        return text
    try:
        value = int(text, 10) if param.kind is int else float(text)
    except ValueError:
        raise bad from None
    if not math.isfinite(value):
        raise bad
    if param.low is not None and (value < param.low or (param.low_open and value == param.low)):
        raise bad
    if param.high is not None and value > param.high:
        raise bad
    return value


def parse(strategy: MergeStrategy, raw: Mapping[str, str]) -> dict[str, ParamValue]:
    """See base.parse_params."""
    declared = {p.name: p for p in strategy.params}
    for name in raw:
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise UsageError(
                f"merge strategy {strategy.name} has no param {shown(name)!r} (params: {known})"
            )
    out: dict[str, ParamValue] = {}
    for name, param in declared.items():
        if name in raw:
            out[name] = _convert(strategy, param, raw[name])
        elif param.default is not None:
            out[name] = param.default
        elif not (strategy.uses_seed and name == "seed"):  # a missing seed is drawn later
            raise UsageError(
                f"merge strategy {strategy.name} needs --param {name}=VALUE "
                f"({name} takes {_allowed(param)})"
            )
    return out
