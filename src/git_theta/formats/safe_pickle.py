"""A pickle reader that runs no code: it understands the opcodes ``torch.save`` emits and
builds plain values, with only an allow-list of constructors, each interpreted here.

Anything else (``os.system``, ``builtins.eval``, an unknown class) is refused with a
CheckpointError before anything from the file could run.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from git_theta.errors import CheckpointError


@dataclass(frozen=True)
class StorageRef:
    """A persistent id ``('storage', <type>, key, location, numel)``."""

    kind: str  # e.g. "FloatStorage"
    key: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str = ""  # torch dtype name, given by _rebuild_tensor_v3 (untyped storages)


@dataclass(frozen=True)
class Global:
    module: str
    name: str


_STORAGES = {
    "FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage", "LongStorage",
    "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage",
    "ComplexFloatStorage", "ComplexDoubleStorage", "Float8_e4m3fnStorage",
    "Float8_e5m2Storage", "UInt16Storage", "UInt32Storage", "UInt64Storage",
}  # fmt: skip
TORCH_DTYPES = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu", "uint16", "uint32", "uint64",
}  # fmt: skip
_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch.storage", "UntypedStorage"),
    ("torch._utils", "_rebuild_parameter"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch", "device"),
} | {("torch", s) for s in _STORAGES | TORCH_DTYPES}
_MARK = object()


def _reduce(func: Any, args: Any) -> Any:
    if not isinstance(func, Global):
        raise CheckpointError("pickle calls something that is not a known constructor")
    name = (func.module, func.name)
    if name in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")):
        storage, offset, shape, stride = args[:4]
        if not isinstance(storage, StorageRef):
            raise CheckpointError("pickle rebuilds a tensor without a storage")
        dtype = ""
        if func.name == "_rebuild_tensor_v3":
            if len(args) < 7 or not isinstance(args[6], Global):
                raise CheckpointError("pickle rebuilds a tensor without a dtype")
            dtype = args[6].name
        return TensorRef(storage, int(offset), tuple(shape), tuple(stride), dtype)
    if name == ("torch._utils", "_rebuild_parameter"):
        return args[0]
    if name == ("collections", "OrderedDict"):
        return dict(args[0]) if args else {}
    if name == ("torch", "Size"):
        return tuple(args[0]) if args else ()
    if name in (("builtins", "set"), ("builtins", "frozenset")):
        return list(args[0]) if args else []
    if name == ("torch", "device"):
        return f"device({', '.join(map(str, args))})"
    raise CheckpointError(f"pickle calls {func.module}.{func.name}, which is not allowed")


def load(data: bytes) -> Any:
    """Interpret a torch pickle without executing it; return plain values and refs.

    Raises CheckpointError for any opcode or constructor outside the allow-list.
    """
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise CheckpointError("pickle is truncated")
        pos += n
        return data[pos - n : pos]

    def unpack(fmt: str) -> Any:
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def pop_mark() -> list[Any]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1 :]
                del stack[i:]
                return items
        raise CheckpointError("pickle is malformed (no mark)")

    while True:
        op = take(1)
        try:
            if op == b"\x80":  # PROTO
                take(1)
            elif op == b"\x95":  # FRAME
                take(8)
            elif op == b".":  # STOP
                if not stack:
                    raise CheckpointError("pickle is empty")
                return stack.pop()
            elif op == b"}":
                stack.append({})
            elif op == b"]":
                stack.append([])
            elif op == b")":
                stack.append(())
            elif op == b"(":
                stack.append(_MARK)
            elif op == b"X":  # BINUNICODE
                stack.append(take(unpack("<I")).decode("utf-8", "surrogatepass"))
            elif op == b"\x8c":  # SHORT_BINUNICODE
                stack.append(take(unpack("<B")).decode("utf-8", "surrogatepass"))
            elif op in (b"C", b"B"):  # SHORT_BINBYTES, BINBYTES
                stack.append(take(unpack("<B") if op == b"C" else unpack("<I")))
            elif op == b"U":  # SHORT_BINSTRING
                stack.append(take(unpack("<B")).decode("latin1"))
            elif op == b"K":
                stack.append(unpack("<B"))
            elif op == b"M":
                stack.append(unpack("<H"))
            elif op == b"J":
                stack.append(unpack("<i"))
            elif op == b"\x8a":  # LONG1
                stack.append(int.from_bytes(take(unpack("<B")), "little", signed=True))
            elif op == b"G":
                stack.append(unpack(">d"))
            elif op == b"N":
                stack.append(None)
            elif op == b"\x88":
                stack.append(True)
            elif op == b"\x89":
                stack.append(False)
            elif op == b"t":
                stack.append(tuple(pop_mark()))
            elif op in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
                n = {b"\x85": 1, b"\x86": 2, b"\x87": 3}[op]
                items = stack[-n:]
                del stack[-n:]
                stack.append(tuple(items))
            elif op == b"l":  # LIST
                stack.append(pop_mark())
            elif op == b"d":  # DICT
                items = pop_mark()
                stack.append(dict(zip(items[::2], items[1::2], strict=True)))
            elif op == b"q":
                memo[unpack("<B")] = stack[-1]
            elif op == b"r":
                memo[unpack("<I")] = stack[-1]
            elif op == b"\x94":  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == b"h":
                stack.append(memo[unpack("<B")])
            elif op == b"j":
                stack.append(memo[unpack("<I")])
            elif op == b"c":  # GLOBAL "module\nname\n"
                module = _line(take, "GLOBAL")
                name = _line(take, "GLOBAL")
                stack.append(_global(module, name))
            elif op == b"\x93":  # STACK_GLOBAL
                name, module = stack.pop(), stack.pop()
                stack.append(_global(str(module), str(name)))
            elif op == b"Q":  # BINPERSID
                pid = stack.pop()
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                    raise CheckpointError("pickle has a persistent id that is not a storage")
                kind = pid[1]
                if not isinstance(kind, Global) or kind.name not in _STORAGES | {"UntypedStorage"}:
                    raise CheckpointError("pickle names an unknown storage type")
                stack.append(StorageRef(kind.name, str(pid[2]), int(pid[4])))
            elif op == b"R":  # REDUCE
                args = stack.pop()
                func = stack.pop()
                stack.append(_reduce(func, args))
            elif op == b"\x81":  # NEWOBJ
                args = stack.pop()
                cls = stack.pop()
                stack.append(_reduce(cls, args))
            elif op == b"b":  # BUILD: state on a known object (ignored: no code runs)
                stack.pop()
            elif op == b"s":
                value, key = stack.pop(), stack.pop()
                stack[-1][key] = value
            elif op == b"u":
                items = pop_mark()
                target = stack[-1]
                for k, v in zip(items[::2], items[1::2], strict=True):
                    target[k] = v
            elif op == b"a":
                value = stack.pop()
                stack[-1].append(value)
            elif op == b"e":
                items = pop_mark()
                stack[-1].extend(items)
            elif op == b"\x8f":  # EMPTY_SET
                stack.append([])
            elif op == b"\x90":  # ADDITEMS
                items = pop_mark()
                stack[-1].extend(items)
            else:
                raise CheckpointError(f"pickle opcode {op!r} is not allowed")
        except (IndexError, KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"pickle is malformed: {exc!r}") from None


def _line(take: Any, what: str) -> str:
    out = b""
    while (ch := take(1)) != b"\n":
        out += ch
        if len(out) > 256:
            raise CheckpointError(f"pickle {what} name is too long")
    return out.decode("ascii", "replace")


def _global(module: str, name: str) -> Global:
    if (module, name) not in _ALLOWED:
        raise CheckpointError(
            f"pickle refers to {module}.{name}, which is not on git-theta's allow-list "
            "(only tensors, storages and plain containers are read; no code runs)"
        )
    return Global(module, name)
