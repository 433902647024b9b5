"""A pickle reader that runs no code: it understands the opcodes ``torch.save`` emits and
builds plain values, with only an allow-list of constructors, each interpreted here.

Anything else (``os.system``, ``builtins.eval``, an unknown class) is refused with a
CheckpointError before anything from the file could run.

The reader is bounded as well as safe: the pickle's size, the opcodes run and an
estimate of the memory its values take are capped, and a dict key may only be a scalar
or a flat tuple of them (hashing a deeply nested tuple crashes CPython). Values may share
sub-objects (the memo) or nest; whoever walks them must visit each container once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from git_theta.errors import CheckpointError
from git_theta.formats.base import MAX_RANK, MAX_TENSORS, LimitExceeded, shown


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
# A state dict's pickle takes ~125 bytes, 32 opcodes and 1.2 KB of values per tensor
# (estimated below at 2.1 KB: the estimate errs high). A hostile pickle's values are
# priced near their real cost, so with the pickle's own bytes and the interpreter it
# stays under 300 MB.
MAX_BYTES = 32 << 20  # data.pkl: 4x MAX_TENSORS tensors' worth
MAX_OPS = 64 * MAX_TENSORS  # 4M opcodes, ~4 s; MAX_TENSORS need 2.1M
MAX_MEMORY = 160 << 20  # estimated bytes of values built; MAX_TENSORS need 140 MB
_SCALAR_KEYS = (str, int, float, bool, bytes, type(None), Global)


def _key(key: Any) -> Any:
    """Return ``key`` if it is safe to hash: a scalar or a flat tuple of scalars."""
    if isinstance(key, _SCALAR_KEYS) or (
        type(key) is tuple and all(isinstance(k, _SCALAR_KEYS) for k in key)
    ):
        return key
    raise CheckpointError("pickle has a dict key that is not a plain value")


def _dict(items: list[Any]) -> dict[Any, Any]:
    if len(items) % 2:
        raise CheckpointError("pickle has a dict with a key but no value")
    return {_key(k): v for k, v in zip(items[::2], items[1::2], strict=True)}


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if (
        type(value) is not tuple
        or len(value) > MAX_RANK
        or not all(type(d) is int and d >= 0 for d in value)
    ):
        raise CheckpointError(f"pickle rebuilds a tensor whose {what} is not non-negative ints")
    return value


def _reduce(func: Any, args: Any) -> Any:
    if not isinstance(func, Global):
        raise CheckpointError("pickle calls something that is not a known constructor")
    if type(args) is not tuple:
        raise CheckpointError("pickle calls a constructor without an argument tuple")
    name = (func.module, func.name)
    if name in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")):
        if len(args) < 4:
            raise CheckpointError("pickle rebuilds a tensor with too few arguments")
        storage, offset, shape, stride = args[:4]
        if not isinstance(storage, StorageRef):
            raise CheckpointError("pickle rebuilds a tensor without a storage")
        if type(offset) is not int or offset < 0:
            raise CheckpointError("pickle rebuilds a tensor at a bad storage offset")
        dtype = ""
        if func.name == "_rebuild_tensor_v3":
            if len(args) < 7 or not isinstance(args[6], Global):
                raise CheckpointError("pickle rebuilds a tensor without a dtype")
            dtype = args[6].name
        return TensorRef(storage, offset, _ints(shape, "shape"), _ints(stride, "stride"), dtype)
    if name == ("torch._utils", "_rebuild_parameter"):
        return args[0]
    if name == ("collections", "OrderedDict"):
        if not args:
            return {}
        if type(args[0]) is not list or not all(type(p) is tuple and len(p) == 2 for p in args[0]):
            raise CheckpointError("pickle builds an OrderedDict from something else than pairs")
        return {_key(k): v for k, v in args[0]}
    if name == ("torch", "Size"):
        return tuple(args[0]) if args and type(args[0]) in (tuple, list) else ()
    if name in (("builtins", "set"), ("builtins", "frozenset")):
        return list(args[0]) if args and type(args[0]) in (tuple, list) else []
    if name == ("torch", "device"):
        return f"device({', '.join(str(a)[:20] for a in args[:2])})"
    raise CheckpointError(f"pickle calls {_dotted(func.module, func.name)}, which is not allowed")


_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_F64 = struct.Struct(">d")


def load(data: bytes) -> Any:
    """Interpret a torch pickle without executing it; return plain values and refs.

    Raises CheckpointError for any opcode or constructor outside the allow-list, for a
    malformed pickle, and (LimitExceeded) past MAX_BYTES, MAX_OPS or MAX_MEMORY.
    """
    if len(data) > MAX_BYTES:
        raise LimitExceeded("torch pickle", len(data), MAX_BYTES, "bytes")
    try:
        return _run(data)
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, struct.error) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            "the pickle inside is malformed: check the file (save or download it again)"
        ) from None


def _run(data: bytes) -> Any:
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    end = len(data)
    pos = 0
    ops = 0
    memory = 0  # estimated bytes of what was built: 8 a slot, plus each new object

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > end:
            raise CheckpointError("pickle is truncated")
        pos += n
        return data[pos - n : pos]

    def pop_mark() -> list[Any]:
        if not marks:
            raise CheckpointError("pickle is malformed (no mark)")
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    if data[:1] == b"\x80":  # PROTO, only as the first opcode
        pos = 2
    while True:
        if pos >= end:
            raise CheckpointError("pickle is truncated")
        op = data[pos]
        pos += 1
        ops += 1
        memory += 8
        if not ops & 255:  # now and then: 256 opcodes add at most a few kB (or a string)
            if ops > MAX_OPS:
                raise LimitExceeded("torch pickle's opcode count", None, MAX_OPS)
            if memory > MAX_MEMORY:
                raise LimitExceeded("torch pickle's values", None, MAX_MEMORY, "bytes (estimated)")
        # Most frequent first (LONG_BINPUT, BININT1, BINGET, BINUNICODE, REDUCE, MARK...).
        if op == 0x72:  # r LONG_BINPUT
            memo[_U32.unpack(take(4))[0]] = stack[-1]
            memory += 100  # a dict entry, its int key, resizes
        elif op == 0x4B:  # K BININT1
            stack.append(take(1)[0])
        elif op == 0x68:  # h BINGET
            stack.append(memo[take(1)[0]])
        elif op == 0x6A:  # j LONG_BINGET
            stack.append(memo[_U32.unpack(take(4))[0]])
        elif op == 0x58:  # X BINUNICODE
            text = take(_U32.unpack(take(4))[0])
            stack.append(text.decode("utf-8", "surrogatepass"))
            memory += 50 + 4 * len(text)
        elif op == 0x52 or op == 0x81:  # R REDUCE, NEWOBJ
            args = stack.pop()
            stack.append(_reduce(stack.pop(), args))
            memory += 128
        elif op == 0x28:  # ( MARK
            marks.append(len(stack))
            memory += 40
        elif op == 0x74:  # t TUPLE
            items = pop_mark()
            stack.append(tuple(items))
            memory += 40 + 8 * len(items)
        elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
            n = op - 0x84
            if len(stack) < n:
                raise CheckpointError("pickle is malformed (stack underflow)")
            items = stack[-n:]
            del stack[-n:]
            stack.append(tuple(items))
            memory += 40 + 8 * n
        elif op == 0x29:  # ) EMPTY_TUPLE
            stack.append(())
        elif op == 0x51:  # Q BINPERSID
            stack.append(_storage(stack.pop()))
            memory += 128
        elif op == 0x89:  # NEWFALSE
            stack.append(False)
        elif op == 0x88:  # NEWTRUE
            stack.append(True)
        elif op == 0x4E:  # N NONE
            stack.append(None)
        elif op == 0x71:  # q BINPUT
            memo[take(1)[0]] = stack[-1]
            memory += 100  # a dict entry, its int key, resizes
        elif op == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1]
            memory += 100  # a dict entry, its int key, resizes
        elif op == 0x7D:  # } EMPTY_DICT
            stack.append({})
            memory += 80
        elif op == 0x5D or op == 0x8F:  # ] EMPTY_LIST, EMPTY_SET (read as a list)
            stack.append([])
            memory += 72
        elif op == 0x75:  # u SETITEMS
            items = pop_mark()
            target = stack[-1]
            if type(target) is not dict:
                raise CheckpointError("pickle sets items on something that is not a dict")
            target.update(_dict(items))
            memory += 32 * len(items)
        elif op == 0x73:  # s SETITEM
            value, key = stack.pop(), stack.pop()
            if type(stack[-1]) is not dict:
                raise CheckpointError("pickle sets an item on something that is not a dict")
            stack[-1][_key(key)] = value
            memory += 64
        elif op == 0x65 or op == 0x90:  # e APPENDS, ADDITEMS
            items = pop_mark()
            if type(stack[-1]) is not list:
                raise CheckpointError("pickle appends to something that is not a list")
            stack[-1].extend(items)
            memory += 8 * len(items)
        elif op == 0x61:  # a APPEND
            value = stack.pop()
            if type(stack[-1]) is not list:
                raise CheckpointError("pickle appends to something that is not a list")
            stack[-1].append(value)
        elif op == 0x6C:  # l LIST
            items = pop_mark()
            stack.append(items)
            memory += 56 + 8 * len(items)
        elif op == 0x64:  # d DICT
            items = pop_mark()
            stack.append(_dict(items))
            memory += 64 + 32 * len(items)
        elif op == 0x8C:  # SHORT_BINUNICODE
            text = take(take(1)[0])
            stack.append(text.decode("utf-8", "surrogatepass"))
            memory += 50 + 4 * len(text)
        elif op == 0x43 or op == 0x42:  # C SHORT_BINBYTES, B BINBYTES
            n = take(1)[0] if op == 0x43 else _U32.unpack(take(4))[0]
            stack.append(take(n))
            memory += 40 + n
        elif op == 0x55:  # U SHORT_BINSTRING
            stack.append(take(take(1)[0]).decode("latin1"))
            memory += 300
        elif op == 0x4D:  # M BININT2
            stack.append(_U16.unpack(take(2))[0])
            memory += 32
        elif op == 0x4A:  # J BININT
            stack.append(_I32.unpack(take(4))[0])
            memory += 32
        elif op == 0x8A:  # LONG1
            n = take(1)[0]
            stack.append(int.from_bytes(take(n), "little", signed=True))
            memory += 32 + n
        elif op == 0x47:  # G BINFLOAT
            stack.append(_F64.unpack(take(8))[0])
            memory += 24
        elif op == 0x63:  # c GLOBAL "module\nname\n"
            module = take(_line_length(data, pos)).decode("ascii", "replace")
            pos += 1
            name = take(_line_length(data, pos)).decode("ascii", "replace")
            pos += 1
            stack.append(_global(module, name))
            memory += 64
        elif op == 0x93:  # STACK_GLOBAL
            name, module = stack.pop(), stack.pop()
            if type(name) is not str or type(module) is not str:
                raise CheckpointError("pickle names a global with something else than text")
            stack.append(_global(module, name))
            memory += 64
        elif op == 0x62:  # b BUILD: state on a known object (ignored: no code runs)
            stack.pop()
        elif op == 0x95:  # FRAME
            take(8)
        elif op == 0x2E:  # . STOP
            if not stack:
                raise CheckpointError("pickle is empty")
            return stack.pop()
        else:
            raise CheckpointError(f"pickle opcode {bytes([op])!r} is not allowed")


def _storage(pid: Any) -> StorageRef:
    """The persistent id ``('storage', type, key, location, numel)`` as a StorageRef."""
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
        raise CheckpointError("pickle has a persistent id that is not a storage")
    kind, key, numel = pid[1], pid[2], pid[4]
    if not isinstance(kind, Global) or kind.name not in _STORAGES | {"UntypedStorage"}:
        raise CheckpointError("pickle names an unknown storage type")
    if type(key) is not str or len(key) > 256 or type(numel) is not int or numel < 0:
        raise CheckpointError("pickle has a storage with a bad key or size")
    return StorageRef(kind.name, key, numel)


def _line_length(data: bytes, pos: int) -> int:
    """The length of the GLOBAL name at ``pos``, up to its newline (at most 256)."""
    end = data.find(b"\n", pos, pos + 257)
    if end < 0:
        raise CheckpointError("pickle GLOBAL name is too long or unterminated")
    return end - pos


def _dotted(module: str, name: str) -> str:
    """``module.name`` for a message: as it is when printable and short, else quoted."""
    dotted = f"{module}.{name}"
    return dotted if dotted.isprintable() and len(dotted) <= 120 else shown(dotted)


def _global(module: str, name: str) -> Global:
    if (module, name) not in _ALLOWED:
        raise CheckpointError(
            f"pickle refers to {_dotted(module, name)}, which is not on git-theta's "
            "allow-list (only tensors, storages and plain containers are read; no code runs)"
        )
    return Global(module, name)
