"""Bad input gets one clear message and stores nothing that a manifest would point to."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
from st_files import st_bytes

from git_theta import kernels
from git_theta.clean import clean
from git_theta.errors import CheckpointError, ManifestError
from git_theta.formats import FORMATS
from git_theta.manifest import parse
from git_theta.store import ObjectStore

KNOWN = ", ".join(sorted(FORMATS.all()))  # built-ins and any installed plugin
GOOD = st_bytes({"w": ("F32", (4,), b"\0" * 16), "b": ("F32", (2,), b"\1" * 8)})


def run_clean(data: bytes, tmp_path: Path) -> bytes:
    out = io.BytesIO()
    clean(io.BytesIO(data), out, "m.safetensors", ObjectStore(tmp_path), None, False)
    return out.getvalue()


def header(entries: dict[str, object]) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", f"not a checkpoint in a known format (known: {KNOWN})"),
        (b"hello world, this is text", "not a checkpoint in a known format"),
        (GOOD[:-3], "file is truncated at byte"),
        (GOOD[:20], "file is truncated at byte 20"),
        (struct.pack("<Q", 20) + b"{not json at all!!!}", "safetensors header is not valid JSON"),
        (
            header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}) + b"\0" * 8,
            "safetensors header lies about tensor 'w': F32 [4] needs 16 bytes but "
            "data_offsets span 8",
        ),
        (
            header(
                {
                    "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                }
            )
            + b"\0" * 12,
            "header lies about offsets: tensor 'v' overlaps the header or another tensor",
        ),
        (
            header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}) + b"\0" * 8,
            "safetensors header entry 'w' is malformed",
        ),
        (
            header({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}) + b"\0" * 8,
            "safetensors header entry 'w' is malformed",
        ),
    ],
)
def test_bad_checkpoints_are_refused(data: bytes, message: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        run_clean(data, tmp_path)
    assert message in str(info.value)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("claim", [1 << 34, 1 << 40])  # more elements: test_hostile_formats
def test_a_huge_claimed_tensor_fails_as_truncated_without_using_memory(
    claim: int, native: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffer for a tensor is reserved, not touched, until its bytes arrive: a header
    claiming 16 GiB or 1 TiB (too much to reserve) costs nothing, with the C kernel or
    without it."""
    import resource

    if not native:
        monkeypatch.setattr(kernels, "native", None)
    data = header({"w": {"dtype": "U8", "shape": [claim], "data_offsets": [0, claim]}})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError) as info:
        run_clean(data + b"x" * 1000, tmp_path)
    assert str(info.value) == (
        f"file is truncated at byte {len(data) + 1000} (expected at least {len(data) + claim} "
        "bytes)"
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


@pytest.mark.skipif(kernels.native is None, reason="faulting ahead needs the C kernel")
def test_a_large_tensor_is_faulted_in_only_a_little_ahead_of_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large tensor's buffer is faulted in by a helper thread ahead of the reader
    (clean._Prefault), never more than two pieces past the bytes that have arrived: a
    header claiming 1 GiB and followed by little costs little. The source hands out one
    piece at a time, each only once the helper has faulted in all it may so far."""
    import threading

    from git_theta.clean import _PIECE, _Reader

    native = kernels.native
    calls: list[tuple[int, int]] = []  # (piece faulted, pieces received then)
    received = [0]
    faulted = threading.Condition()

    class Native:
        def __getattr__(self, name: str) -> object:
            return getattr(native, name)

        def prefault(self, out: bytearray, start: int, end: int) -> bool:
            with faulted:
                calls.append((start // _PIECE, received[0]))
                faulted.notify_all()
            return True  # nothing touched: the claim stays a reservation

    class Source:
        def readinto(self, view: memoryview) -> int:
            if received[0] == 6:
                return 0  # the file ends: truncated
            with faulted:  # the helper's allowed pieces are done before the next arrives
                assert faulted.wait_for(lambda: len(calls) >= received[0] + 2, timeout=30)
            view[:] = b"x" * len(view)
            received[0] += 1
            return len(view)

    monkeypatch.setattr(kernels, "native", Native())
    with pytest.raises(CheckpointError, match="file is truncated at byte"):
        _Reader(b"", Source()).read(1 << 30)  # type: ignore[arg-type]
    assert calls, "nothing was faulted ahead"
    assert [piece for piece, _ in calls] == list(range(1, len(calls) + 1))
    assert max(piece - got for piece, got in calls) <= 2, calls


def test_trailing_bytes_and_gaps_are_kept(tmp_path: Path) -> None:
    data = header({"w": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}}) + b"gapWWtail"
    manifest = parse(run_clean(data, tmp_path))
    assert manifest.size == len(data)
    assert manifest.layout == (len(data) - 9 + 3, "w", 4)


def test_manifest_input_passes_through(tmp_path: Path) -> None:
    manifest = run_clean(GOOD, tmp_path)
    assert run_clean(manifest, tmp_path) == manifest


def test_newer_manifest_version_is_refused() -> None:
    with pytest.raises(
        ManifestError,
        match=r"^written by a newer git-theta \(manifest version 99\): upgrade git-theta$",
    ):
        parse(b'{\n "git-theta": 99}')
