"""Review s4 (R2): the C merge step and the staged-glue reuse in clean. Each test asserts
the right behaviour and fails now."""

from __future__ import annotations

import io
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import test_golden_manifests as golden

from git_theta import codec, kernels
from git_theta.clean import clean
from git_theta.manifest import Glue, parse
from git_theta.merges import MERGES
from git_theta.merges.base import merge_tensor, parse_params
from git_theta.store import ObjectStore

try:
    from git_theta import _merge as merge_kernel
except ImportError:  # pragma: no cover - depends on the install
    merge_kernel = None


@pytest.mark.skipif(merge_kernel is None, reason="the C merge kernel is not built")
@pytest.mark.parametrize("key", ["average", "task-arithmetic", "ties"])
def test_two_different_nans_in_a_tensors_tail_merge_to_the_same_bits_under_both_kernels(
    key: str,
) -> None:
    """Both sides changed the last element of a 17-element F32 tensor to different NaNs
    (a signalling and a quiet one). NumPy's scalar tail loop returns the second operand's
    NaN for `ours += theirs` (0x7fc00000) where its SIMD body and the C kernel return
    the first's (0x7fe00000): the merged bytes depend on GIT_THETA_KERNELS and on the
    element's position, against the kernel's bit-identity claim (same for F16, BF16,
    F64, and for a one-element tensor)."""
    base = np.full(17, 0x3F800000, dtype="<u4")
    ours, theirs = base.copy(), base.copy()
    ours[-1], theirs[-1] = 0x7FA00000, 0x7FC00000
    strategy = MERGES.get(key)
    params = parse_params(strategy, {})
    got = []
    for kernel in (None, merge_kernel):
        saved = kernels.merge
        kernels.merge = kernel
        try:
            done = merge_tensor(strategy, params, base, ours, theirs, "F32", tensor="w")
        finally:
            kernels.merge = saved
        got.append(hex(int(done.data.view("<u4")[-1])))
    assert got[0] == got[1]


def _zstd_bomb(length: int, claim: int) -> bytes:
    """A plain codec object of ``length`` bytes whose one zstd plane's frame header claims
    ``claim`` bytes of content (a few hundred bytes in all; it hashes right, as anything
    a clone brings does)."""
    import zstandard

    good = zstandard.ZstdCompressor(level=3).compress(b"a" * length)
    fhd = good[4]
    single = (fhd >> 5) & 1
    fcs = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    body = good[5 + (0 if single else 1) + fcs :]
    frame = good[:4] + bytes([0b11000000, 0x50]) + struct.pack("<Q", claim) + body
    head = struct.pack("<4sBBBBQI", b"GTHO", 1, 1, 0, 0, length, 1 << 20)
    return head + struct.pack("<BI", 1, len(frame)) + frame


def test_a_staged_glue_object_whose_zstd_frame_claims_gigabytes_is_not_allocated(
    tmp_path: Path,
) -> None:
    """A clone's staged manifest names, as its glue, a 300-byte object with a zstd plane
    whose frame header claims 512 MiB (or 1 TiB). _staged_glue decodes it with
    limit=len(glue), but python-zstandard allocates the frame's declared content size
    whatever max_output_size says: re-cleaning the unchanged file (git status, git add)
    allocates 512 MiB, and with 1 TiB crashes with a bare MemoryError. The cap must be
    checked before allocating (frame_content_size against the plane's size), and such
    an object is simply not reused."""
    data = golden.check_out("safetensors", golden.golden_store(tmp_path / "golden"))
    store = ObjectStore(tmp_path / "store")
    staged = golden.manifest("safetensors")
    for _, ref in golden.needed_objects(staged):
        store.copy_in(ObjectStore(golden.LFS).lfs_path(ref.oid), ref)
    length = len(codec.decode(store.get(staged.glue.ref)))
    for claim in (512 << 20, 1 << 40):
        bomb = store.put([_zstd_bomb(length, claim)])
        lying = staged._replace(glue=Glue(staged.glue.hash, bomb))
        out = io.BytesIO()
        tracemalloc.start()
        try:
            clean(io.BytesIO(data), out, "model.safetensors", store, lying, False)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        written = parse(out.getvalue())
        assert written.glue.ref != bomb and written.glue.hash == staged.glue.hash
        assert peak < 64 << 20, f"{peak >> 20} MiB allocated for a {length}-byte glue"
