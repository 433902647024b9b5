"""Conformance checks a plugin's own tests can call (git-theta's tests use them too).

    from git_theta.testing import check_format, check_update_type

Each raises AssertionError with what went wrong.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Iterable
from pathlib import Path

from git_theta.clean import clean
from git_theta.errors import ThetaError
from git_theta.formats.base import CheckpointFormat
from git_theta.manifest import parse
from git_theta.smudge import smudge
from git_theta.store import ObjectStore
from git_theta.updates.base import UpdateType


def check_format(fmt: CheckpointFormat, samples: Iterable[bytes], bad: Iterable[bytes]) -> None:
    """Every sample is detected as ``fmt``, cleans to a manifest of that format and checks
    out byte for byte; every bad input fails with a ThetaError (one clear message)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(Path(tmp))
        for data in samples:
            assert fmt.sniff(data[: fmt.head_size], "sample"), "sniff does not recognise a sample"
            manifest = io.BytesIO()
            clean(io.BytesIO(data), manifest, "sample", store, None, False)
            assert parse(manifest.getvalue()).format == fmt.key, "manifest names another format"
            out = io.BytesIO()
            smudge(io.BytesIO(manifest.getvalue()), out, "sample", store, False)
            assert out.getvalue() == data, "checkout is not byte-exact"
        for data in bad:
            try:
                clean(io.BytesIO(data), io.BytesIO(), "bad", store, None, False)
            except ThetaError:
                continue
            raise AssertionError("a bad input was accepted")


def check_update_type(plugin: UpdateType, pairs: Iterable[tuple[bytes, bytes]], dtype: str) -> None:
    """``apply(prev, encode(new, prev)) == new`` bit for bit for each (prev, new) pair
    (through ``pick``, so a type that chooses another, like ``auto``, is checked too)."""
    from git_theta.updates import UPDATES

    dense = UPDATES.get("dense")
    for prev, new in pairs:

        def dense_parts(new: bytes = new) -> list[bytes]:
            return dense.encode(new, None, dtype) or []

        key, parts = plugin.pick(new, prev, dtype, dense_parts)
        if parts is None:
            continue  # the type declined: the caller stores a dense value
        applier = plugin if key == plugin.key else UPDATES.get(key)
        out = applier.apply(bytearray(prev), b"".join(parts), dtype)
        assert bytes(out) == new, f"{plugin.key} ({key}): apply(encode(new, prev)) != new"
