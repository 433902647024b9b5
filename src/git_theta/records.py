"""``typing.NamedTuple``'s class syntax for the filter's start-up path, at a tenth of its cost.

Under ``from __future__ import annotations`` a field's annotation is a string, and
typing.NamedTuple compiles each into a ForwardRef: the process's first ``compile()``
builds the AST types (~1.5 ms) and the ~60 fields one ``git add`` defines cost ~1 ms
more, before git's first file. This makes the same class (a collections.namedtuple
with the body's defaults, docstring and methods) and keeps the annotations as written.
mypy sees typing's, and checks every use against it.
"""

from __future__ import annotations

from collections import namedtuple
from typing import TYPE_CHECKING, Any

_NOT_COPIED = frozenset({"__module__", "__annotations__"})


class _Meta(type):
    def __new__(mcs, name: str, bases: tuple[type, ...], body: dict[str, Any]) -> Any:
        fields: dict[str, str] = body.get("__annotations__", {})
        defaults = [body[field] for field in fields if field in body]
        if defaults and any(field not in body for field in list(fields)[-len(defaults) :]):
            raise TypeError(f"{name}: a field without a default follows one with a default")
        record = namedtuple(name, fields, defaults=defaults, module=body["__module__"])  # type: ignore[misc]
        record.__annotations__ = dict(fields)
        for key, value in body.items():
            if key not in _NOT_COPIED and key not in fields:
                setattr(record, key, value)
        return record


if TYPE_CHECKING:
    from typing import NamedTuple as NamedTuple
else:  # the base a record class names; its own creation bypasses _Meta.__new__
    NamedTuple = type.__new__(_Meta, "NamedTuple", (), {})
