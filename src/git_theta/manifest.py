"""The manifest: the small text file git stores in place of a checkpoint.

It names, for every tensor, its dtype, shape, content hash and the chain of content objects
that rebuild it (a base value, then updates, never a commit hash), plus the non-tensor bytes
of the file ("glue") and the order in which glue and tensors make up the file.

Serialization is deterministic (fixed key order, one tensor per line) so equal content
gives equal bytes in any process, and diffs show one changed line per changed tensor.

A manifest comes from a repository, which may be a stranger's: ``parse`` checks every
field before anything is read, fetched or written on its behalf (oids are 64 lowercase hex,
so they are file names and never paths; sizes and shapes agree with the dtypes and the
layout; names are printable; counts are capped), so code below may trust a ``Manifest``.
``to_bytes`` runs the same checks, so whatever git-theta writes it also reads back.
"""

from __future__ import annotations

import gc
import json
import math
import re
from typing import Any

from git_theta.display import quote
from git_theta.dtypes import BLOCKS, DTYPES, expected_nbytes
from git_theta.errors import ManifestError
from git_theta.records import NamedTuple
from git_theta.store import ObjectRef

# 3: chains may hold operand links (update type OPERAND_UPDATE, a factor an update
# after it consumes), which a reader of version 1 would misread. A manifest without them
# is still written as version 1, byte for byte as before. 2 is never written: the golden
# fixtures (append-only) pin a version-2 manifest as one from a newer git-theta.
VERSION = 3
_NEVER_WRITTEN = 2
OPERAND_UPDATE = "factor"
PREFIX = b'{\n "git-theta": '

# Caps on what a manifest may hold. A manifest of 100,000 tensors with one link each is
# 37 MB and parses in 1 s to 220 MB; 64 MB leaves headroom and bounds a hostile one.
MAX_BYTES = 64 << 20
MAX_TENSORS = 1 << 18
MAX_NAME = 4096  # characters of a tensor name
MAX_DIMS = 64  # NumPy's limit
MAX_LINKS = 16  # chains.MAX_CHAIN (8) steps; with factor links a chain may fill all 16
MAX_TENSOR_BYTES = 1 << 40
MAX_FILE_BYTES = 1 << 42
MAX_OBJECT_BYTES = 1 << 44  # a sparse update of a byte tensor can outgrow the tensor

_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")  # format and update type keys
_CODEC = re.compile(r"[A-Za-z0-9._+-]{0,64}")
# dtypes the formats record for element types outside dtypes.DTYPES: kept as plain bytes,
# their size known only from the object (np:<numpy name>, NPY<descr>, torch.<name>).
# Compiled on first use (re's cache, ~0.1 ms): a manifest of usual dtypes never needs it.
_OPAQUE_DTYPE = r"(?:np:|NPY|torch\.)[!-~]{1,64}"
_VERSION_AFTER_PREFIX = re.compile(rb"\s*(-?\d{1,20})\s*[,}]")


class Link(NamedTuple):
    """One step of a tensor's chain: an object and the update type that applies it."""

    update: str
    codec: str
    ref: ObjectRef


class MergeRecord(NamedTuple):
    """How a merge made this tensor's value: the strategy and its parameters (a drawn
    seed among them), as text; kept while the value stays the same."""

    strategy: str
    params: tuple[tuple[str, str], ...] = ()


MAX_MERGE_PARAMS = 16
MAX_MERGE_VALUE = 128  # characters of one recorded parameter value


class TensorEntry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    hash: str  # blake3 of the tensor's exact bytes
    chain: tuple[Link, ...]
    merge: MergeRecord | None = None  # optional: only a merged value has it


class Glue(NamedTuple):
    """The file's non-tensor bytes (headers, metadata, padding), stored as one object."""

    hash: str
    ref: ObjectRef


class Manifest(NamedTuple):
    format: str
    size: int
    glue: Glue
    # The file is the concatenation of these: an int takes the next N bytes of glue,
    # a string is the named tensor's bytes.
    layout: tuple[int | str, ...]
    tensors: dict[str, TensorEntry]

    def to_bytes(self) -> bytes:
        """Return the canonical serialization.

        Raises ManifestError when the manifest breaks a rule ``parse`` checks (a name
        with a control character, sizes that do not add up): it would not read back.
        """
        try:
            _check(self)
        except _Invalid as exc:
            raise ManifestError(f"cannot write a valid manifest: {exc}") from None
        d = json.dumps
        lines = [
            "{",
            f' "git-theta": {_version_of(self)},',
            f' "format": {d(self.format)},',
            f' "size": {self.size},',
            f' "glue": {d(_glue_dict(self.glue))},',
            ' "layout": [',
        ]
        items = [f"  {d(item)}" for item in self.layout]
        lines.append(",\n".join(items))
        lines.append(" ],")
        lines.append(' "tensors": {')
        entries = [
            f"  {d(name)}: {d(_entry_dict(self.tensors[name]))}" for name in sorted(self.tensors)
        ]
        lines.append(",\n".join(entries))
        lines.append(" }")
        lines.append("}")
        data = ("\n".join(line for line in lines if line) + "\n").encode()
        if len(data) > MAX_BYTES:
            raise ManifestError(
                f"cannot write a valid manifest: it would be {len(data):,} bytes, more than "
                f"the {MAX_BYTES:,} git-theta reads ({len(self.tensors):,} tensors)"
            )
        return data


def _version_of(m: Manifest) -> int:
    """The oldest manifest version that can hold ``m``."""
    linked = any(ln.update == OPERAND_UPDATE for e in m.tensors.values() for ln in e.chain)
    return VERSION if linked else 1


def is_manifest(data: bytes) -> bool:
    """Return True when ``data`` looks like a git-theta manifest (not a checkpoint)."""
    return data.startswith(PREFIX)


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Return the byte size of a (checked) tensor entry's value, or None for an opaque
    dtype (``np:``, ``NPY``, ``torch.``), whose size only its object knows."""
    nbytes = expected_nbytes(dtype, shape)
    return None if nbytes is None or nbytes < 0 else nbytes


def glue_size(manifest: Manifest) -> int:
    """Return how many bytes of glue the layout takes: the glue object's exact length."""
    return sum(item for item in manifest.layout if isinstance(item, int))


def _glue_dict(glue: Glue) -> dict[str, Any]:
    return {"hash": glue.hash, "oid": glue.ref.oid, "size": glue.ref.size}


def _entry_dict(entry: TensorEntry) -> dict[str, Any]:
    out: dict[str, Any] = {
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "hash": entry.hash,
        "chain": [
            {"update": ln.update, "codec": ln.codec, "oid": ln.ref.oid, "size": ln.ref.size}
            for ln in entry.chain
        ],
    }
    if entry.merge is not None:  # absent otherwise: older manifests stay byte-identical
        out["merge"] = {"strategy": entry.merge.strategy, "params": dict(entry.merge.params)}
    return out


class _Invalid(Exception):
    """A rule of the manifest is broken (the message says which); never leaves here."""


def parse(data: bytes) -> Manifest:
    """Parse and check a manifest; the result is safe to act on.

    Raises ManifestError, one line, when it is too large, malformed, breaks a rule (see
    the module docstring) or was written by a newer git-theta.
    """
    _refuse_newer(data)
    if len(data) > MAX_BYTES:
        raise ManifestError(
            f"invalid manifest: {len(data):,} bytes, more than git-theta reads ({MAX_BYTES:,})"
        )
    # The collector would walk the growing heap again and again while a large manifest's
    # objects are made (a third of the time of 100,000 tensors); none of them form cycles.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _parse(data)
    finally:
        if collecting:
            gc.enable()


def _parse(data: bytes) -> Manifest:
    try:
        raw = json.loads(data.decode(), object_pairs_hook=_object, parse_constant=_constant)
    except RecursionError:
        raise ManifestError("invalid manifest: JSON nested too deeply") from None
    except _Invalid as exc:
        raise ManifestError(f"invalid manifest: {exc}") from None
    except ValueError as exc:  # UnicodeDecodeError and json's errors among them
        raise ManifestError(f"invalid manifest: not valid UTF-8 JSON ({exc})") from None
    if not isinstance(raw, dict) or "git-theta" not in raw:
        raise ManifestError("not a git-theta manifest")
    version = raw["git-theta"]
    if type(version) is not int or version < 1:
        raise ManifestError(f"invalid manifest: version {_show(version)} is not a version")
    if _unknown(version):
        raise _newer(version)
    try:
        manifest = _build(raw)
        _check(manifest)
    except _Invalid as exc:
        raise ManifestError(f"invalid manifest: {exc}") from None
    if version < _version_of(manifest):  # it would not be written back the same
        raise ManifestError(
            f"invalid manifest: version {version} cannot hold {OPERAND_UPDATE} links"
        )
    return manifest


def _unknown(version: int) -> bool:
    """Whether manifest ``version`` (1 or more) is one a newer git-theta writes."""
    return version > VERSION or version == _NEVER_WRITTEN


def _newer(version: int) -> ManifestError:
    return ManifestError(
        f"written by a newer git-theta (manifest version {version}): upgrade git-theta"
    )


def _refuse_newer(data: bytes) -> None:
    """A newer writer's manifest says so, whatever else it holds (it may be larger, or
    hold fields this version does not know)."""
    if data.startswith(PREFIX):
        found = _VERSION_AFTER_PREFIX.match(data, len(PREFIX))
        if found is not None and _unknown(int(found.group(1))):
            raise _newer(int(found.group(1)))


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # json would keep the last of equal keys silently
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Invalid(f"{quote(key)} appears twice in one object")
            seen.add(key)
    return out


def _constant(name: str) -> Any:
    raise _Invalid(f"{name} is not a number a manifest holds")


def _show(value: Any) -> str:
    """A short, printable rendering of an unexpected JSON value for a message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(value: Any, keys: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(f"{what} is not a JSON object")
    if value.keys() != keys:
        missing, extra = sorted(keys - value.keys()), sorted(value.keys() - keys)
        detail = f"lacks {quote(missing[0])}" if missing else f"has unknown field {quote(extra[0])}"
        raise _Invalid(f"{what} {detail}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Invalid(f"{what} is not a JSON list")
    return value


_TOP = frozenset({"git-theta", "format", "size", "glue", "layout", "tensors"})
_GLUE = frozenset({"hash", "oid", "size"})
_ENTRY = frozenset({"dtype", "shape", "hash", "chain"})
_MERGED_ENTRY = _ENTRY | {"merge"}
_MERGE = frozenset({"strategy", "params"})
_LINK = frozenset({"update", "codec", "oid", "size"})


def _build(raw: dict[str, Any]) -> Manifest:
    """The JSON's structure as a Manifest; the values are checked by ``_check``."""
    _fields(raw, _TOP, "the manifest")
    glue = _fields(raw["glue"], _GLUE, "the header entry (glue)")
    tensors_raw = raw["tensors"]
    if not isinstance(tensors_raw, dict):
        raise _Invalid("tensors is not a JSON object")
    if len(tensors_raw) > MAX_TENSORS:
        raise _Invalid(f"{len(tensors_raw):,} tensors, more than git-theta reads ({MAX_TENSORS:,})")
    tensors = {}
    # The fast path checks only types; messages are built when something is wrong.
    for name, e in tensors_raw.items():
        if type(e) is not dict or e.keys() != _ENTRY:
            if type(e) is dict and "merge" in e:
                _fields(e, _MERGED_ENTRY, f"tensor {quote(name)}")
            else:
                _fields(e, _ENTRY, f"tensor {quote(name)}")
        chain_raw, shape_raw = e["chain"], e["shape"]
        if type(chain_raw) is not list or type(shape_raw) is not list:
            _list(chain_raw, f"tensor {quote(name)}: the chain")
            _list(shape_raw, f"tensor {quote(name)}: the shape")
        chain = []
        for ln in chain_raw[: MAX_LINKS + 1]:  # one more, for the check to refuse
            if type(ln) is not dict or ln.keys() != _LINK:
                _fields(ln, _LINK, f"tensor {quote(name)}: a link")
            chain.append(Link(ln["update"], ln["codec"], ObjectRef(ln["oid"], ln["size"])))
        tensors[name] = TensorEntry(
            e["dtype"],
            tuple(shape_raw[: MAX_DIMS + 1]),
            e["hash"],
            tuple(chain),
            _merge_record(e["merge"], name) if "merge" in e else None,
        )
    layout = tuple(_list(raw["layout"], "the layout")[: 2 * MAX_TENSORS + 2])
    glue_ref = Glue(glue["hash"], ObjectRef(glue["oid"], glue["size"]))
    return Manifest(raw["format"], raw["size"], glue_ref, layout, tensors)


def _merge_record(raw: Any, name: str) -> MergeRecord:
    """The structure of a tensor's merge record; its values are checked by ``_check``."""
    what = f"tensor {quote(name)}: the merge record"
    _fields(raw, _MERGE, what)
    params = raw["params"]
    if not isinstance(params, dict):
        raise _Invalid(f"{what}'s params is not a JSON object")
    items = list(params.items())[: MAX_MERGE_PARAMS + 1]
    return MergeRecord(raw["strategy"], tuple(items))


def _merge_problem(record: MergeRecord) -> str | None:
    """What is wrong with a merge record (keys, at most 16 short printable values)."""
    if type(record.strategy) is not str or not _KEY.fullmatch(record.strategy):
        return f"the merge record's strategy {_show(record.strategy)} is not a key"
    if type(record.params) is not tuple or len(record.params) > MAX_MERGE_PARAMS:
        return f"the merge record holds more than {MAX_MERGE_PARAMS} parameters"
    for key, value in record.params:
        if type(key) is not str or not _KEY.fullmatch(key):
            return f"the merge record's parameter {_show(key)} is not a key"
        if type(value) is not str or len(value) > MAX_MERGE_VALUE or not value.isprintable():
            return (
                f"the merge record's {key} is not printable text of at most "
                f"{MAX_MERGE_VALUE} characters"
            )
    return None


def _int_problem(value: Any, top: int) -> str | None:
    """What is wrong with ``value`` as a count or size up to ``top``, or None."""
    if type(value) is not int:  # bool is an int subclass: true is not a size
        return f"is {_show(value)}, not an integer"
    if not 0 <= value <= top:
        return f"is {value}, outside 0..{top:,}"
    return None


def _hex_problem(value: Any) -> str | None:
    if type(value) is str and _HEX64.fullmatch(value):
        return None
    return f"is {_show(value)}, not 64 lowercase hex digits"


def _ref_problem(ref: ObjectRef) -> str | None:
    problem = _hex_problem(ref.oid)
    if problem is not None:
        return f"oid {problem}"
    problem = _int_problem(ref.size, MAX_OBJECT_BYTES)
    return None if problem is None else f"size {problem}"


def _name_problem(name: Any) -> str | None:
    if type(name) is not str:
        return f"a tensor name is {_show(name)}, not a string"
    if len(name) > MAX_NAME:
        return f"a tensor name is {len(name):,} characters (at most {MAX_NAME:,})"
    if not name.isprintable():
        return f"tensor name {quote(name)} holds a control or formatting character"
    return None


def _check(m: Manifest) -> None:
    """Raise _Invalid naming the first broken rule of ``m``."""
    if not (type(m.format) is str and _KEY.fullmatch(m.format)):
        raise _Invalid(f"format {_show(m.format)} is not a format key")
    for what, problem in (
        ("the file's size", _int_problem(m.size, MAX_FILE_BYTES)),
        ("the header's hash", _hex_problem(m.glue.hash)),
        ("the header object's", _ref_problem(m.glue.ref)),
    ):
        if problem is not None:
            raise _Invalid(f"{what} {problem}")
    if type(m.tensors) is not dict or len(m.tensors) > MAX_TENSORS:
        raise _Invalid(f"tensors must be an object of at most {MAX_TENSORS:,} entries")
    sized, opaque = 0, False
    for name, entry in m.tensors.items():
        problem = _name_problem(name)
        if problem is not None:
            raise _Invalid(problem)
        try:
            nbytes = _entry_nbytes(entry)
        except _Invalid as exc:
            raise _Invalid(f"tensor {quote(name)}: {exc}") from None
        if nbytes is None:
            opaque = True
        else:
            sized += nbytes
    _check_layout(m, sized, opaque)


def _entry_nbytes(entry: TensorEntry) -> int | None:
    """Check one tensor's entry; return its byte size (None for an opaque dtype).

    Raises _Invalid with a message to follow "tensor NAME: ".
    """
    dtype, shape = entry.dtype, entry.shape
    if type(dtype) is not str or not (
        dtype in DTYPES or dtype in BLOCKS or re.fullmatch(_OPAQUE_DTYPE, dtype)
    ):
        raise _Invalid(f"unknown dtype {_show(dtype)}")
    if type(shape) is not tuple or len(shape) > MAX_DIMS:
        raise _Invalid(f"the shape is not a list of at most {MAX_DIMS} dimensions")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= MAX_TENSOR_BYTES:
            raise _Invalid(f"the shape has a dimension that {_int_problem(dim, MAX_TENSOR_BYTES)}")
    count = math.prod(shape)
    if count > MAX_TENSOR_BYTES:
        raise _Invalid(f"{count:,} elements, more than git-theta reads")
    nbytes = expected_nbytes(dtype, shape)
    if nbytes is not None and nbytes < 0:
        raise _Invalid(f"shape {list(shape)} is not whole {dtype} blocks")
    if nbytes is not None and nbytes > MAX_TENSOR_BYTES:
        raise _Invalid(f"{nbytes:,} bytes, more than git-theta reads")
    problem = _hex_problem(entry.hash)
    if problem is not None:
        raise _Invalid(f"the hash {problem}")
    if entry.merge is not None:
        problem = _merge_problem(entry.merge)
        if problem is not None:
            raise _Invalid(problem)
    chain = entry.chain
    if type(chain) is not tuple or not 1 <= len(chain) <= MAX_LINKS:
        raise _Invalid(f"the chain must have 1 to {MAX_LINKS} links")
    for link in chain:
        if not (type(link.update) is str and _KEY.fullmatch(link.update)):
            raise _Invalid(f"update type {_show(link.update)} is not a key")
        if not (type(link.codec) is str and _CODEC.fullmatch(link.codec)):
            raise _Invalid(f"codec {_show(link.codec)} is not a key")
        problem = _ref_problem(link.ref)
        if problem is not None:
            raise _Invalid(f"an object's {problem}")
    return nbytes


def _check_layout(m: Manifest, sized: int, opaque: bool) -> None:
    """Every tensor exactly once, glue lengths positive, and the bytes add up to the size."""
    if type(m.layout) is not tuple or len(m.layout) > 2 * len(m.tensors) + 1:
        raise _Invalid(f"the layout holds more items than {len(m.tensors):,} tensors need")
    seen: set[str] = set()
    glue = 0
    for item in m.layout:
        if type(item) is int:
            if not 0 < item <= MAX_FILE_BYTES:
                raise _Invalid(f"the layout holds a glue length of {item}")
            glue += item
        elif type(item) is str:
            if item not in m.tensors:
                raise _Invalid(f"the layout names unknown tensor {quote(item)}")
            if item in seen:
                raise _Invalid(f"the layout names tensor {quote(item)} twice")
            seen.add(item)
        else:
            raise _Invalid(f"the layout holds {_show(item)}, neither a length nor a name")
    if len(seen) != len(m.tensors):
        missing = min(set(m.tensors) - seen)
        raise _Invalid(f"tensor {quote(missing)} is not in the layout")
    total = glue + sized
    if total != m.size and not (opaque and total < m.size):
        raise _Invalid(
            f"the layout's glue ({glue:,} bytes) and tensors ({sized:,} bytes) add up to "
            f"{total:,} bytes, but the file's size is {m.size:,}"
        )
