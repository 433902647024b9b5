"""Review R3 (session 6) of the lead's last commits: 1c53334 (content packets read in C
without the GIL, large buffers faulted in ahead), be55db7 (zstandard and the update types
imported on a helper thread), 51adb8f (auto tries no sparse candidate over 128 MiB).
Each test asserts the right behaviour, so it fails now."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import git, measure_filter_peaks, peak_mib
from st_files import st_from_arrays

from git_theta import kernels
from git_theta.protocol.pktline import PacketReader, ProtocolError

MODEL = "model.safetensors"
MIB = 1 << 20


def test_auto_stores_a_half_pruned_matrix_as_sparse_not_a_6x_larger_delta() -> None:
    """51adb8f: auto no longer tries sparse when the changed elements' positions and
    values would hold over 128 MiB, so every large tensor with many changed elements is
    stored as a delta (or dense) however much smaller sparse would be. The commit says
    "delta's zeros for the unchanged ones code to almost nothing", but what a delta costs
    is the changed elements' differences: for values set to zero (unstructured pruning,
    e.g. Wanda/SparseGPT at 45-50%) sparse stores positions and all-zero values. Here, a
    4096 x 8192 BF16 matrix (one MLP projection of a 7B model has 45M elements) with 45%
    of its elements pruned: sparse 6.3% of the raw bytes, the delta auto now stores 35.6%,
    5.7x larger, in every later version's history. F32: 13-15x, F64: 25-30x (sizes from
    Sparse/Delta.encode on 4M elements). Right: sparse is still a candidate (with an
    encode whose memory is bounded, as delta's chunked one is), and auto keeps the
    smallest form."""
    import ml_dtypes

    from git_theta.updates.auto import Auto
    from git_theta.updates.dense import Dense
    from git_theta.updates.sparse import Sparse

    rng = np.random.default_rng(0)
    prev = (rng.standard_normal((4096, 8192), dtype=np.float32) * np.float32(0.02)).astype(
        ml_dtypes.bfloat16
    )
    new = prev.copy()
    new[np.abs(prev.astype(np.float32)) < np.float32(0.6 * 0.02)] = 0  # ~45% pruned
    new_bytes, prev_bytes = new.tobytes(), prev.tobytes()
    del new, prev
    key, parts = Auto().pick(
        new_bytes,
        prev_bytes,
        "BF16",
        lambda: Dense().encode(new_bytes, None, "BF16"),
        name="model.layers.0.mlp.up_proj.weight",
        shape=(4096, 8192),
    )
    assert parts is not None
    stored = sum(map(len, parts))
    sparse = sum(map(len, Sparse().encode(new_bytes, prev_bytes, "BF16") or []))
    assert stored <= 1.25 * sparse, (
        f"auto stored {key}: {stored / len(new_bytes):.1%} of the raw bytes, "
        f"sparse would be {sparse / len(new_bytes):.1%}"
    )


def test_with_numpy_kernels_a_sparse_candidate_stays_within_the_memory_bound(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """51adb8f sizes the sparse candidate as 8 bytes of position and the value of each
    changed element (what _planes.sparse_diff returns). With GIT_THETA_KERNELS=numpy (the
    path of an install without a compiler, which CI keeps tested) Sparse.encode holds
    far more: a bool mask, flatnonzero's uint64 positions, the diff, its astype copy and
    bytes, an intp copy, the gathered values and their bytes, ~3x the C kernel's. A
    file of 128 + 4 + 16 MiB float32 tensors where every third element of each changed
    (the largest just under the 128 MiB cap) peaks at 597 MiB in the filter, against
    300 MB + 2 x 128 MiB = 542 MiB (the C kernel: 443 MiB; the same file with every
    second element changed, delta only: 405 MiB). Right: the cap counts what the
    running kernel holds (or the NumPy encode holds no more than the C one)."""
    monkeypatch.setenv("GIT_THETA_KERNELS", "numpy")
    peaks = tmp_path / "peaks.txt"
    measure_filter_peaks(repo, peaks)
    rng = np.random.default_rng(0)
    sizes_mib = [128, 4, 16]
    values = {
        f"t{i}": rng.standard_normal(mib * MIB // 4, dtype=np.float32) * np.float32(0.02)
        for i, mib in enumerate(sizes_mib)
    }
    (repo / MODEL).write_bytes(st_from_arrays(values))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "v1")
    for value in values.values():
        value[::3][:-1000] *= np.float32(1.0001)  # t0: 11.18M changed, 128 MiB - 12 KB
    peaks.unlink()
    (repo / MODEL).write_bytes(st_from_arrays(values))
    git(repo, "add", MODEL)
    peak = peak_mib(peaks)
    bound_mib = (300e6 + 2 * max(sizes_mib) * MIB) / MIB
    assert peak <= bound_mib, f"peak {peak:.0f} MiB, bound {bound_mib:.0f} MiB"


@pytest.mark.skipif(kernels.native is None, reason="the C path is the one under test")
def test_a_signal_handler_runs_while_the_filter_waits_for_content(tmp_path: Path) -> None:
    """1c53334: _planes.read_packets retries EINTR inside its GIL-free loop, so a Python
    signal handler never runs while it waits for git: SIGINT's KeyboardInterrupt (or any
    handler that raises) is held until git writes more or closes the pipe. FileIO's read
    (the NumPy-kernel path, and this path before) runs the handlers on EINTR (PEP 475)
    and raises. Here git has sent half a packet and an interval timer's handler raises:
    with GIT_THETA_KERNELS=numpy it stops the read at once, with the C kernel it never
    does. Right: on EINTR, take the GIL, PyErr_CheckSignals, return its error."""
    script = textwrap.dedent(
        """
        import io, os, signal, sys
        from git_theta.protocol.pktline import PacketReader
        r, w = os.pipe()
        os.write(w, b"0008ab")  # half a packet; the writer stays, silent
        armed = False
        class Stop(Exception):
            pass
        def on_alarm(signum, frame):
            if armed:
                raise Stop()
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        reader = PacketReader(io.FileIO(r, "rb"))
        assert reader._fd is not None
        armed = True
        try:
            reader.readinto(memoryview(bytearray(100)))
        except Stop:
            sys.exit(0)
        sys.exit(3)
        """
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=3)
    except subprocess.TimeoutExpired:
        pytest.fail("the handler's exception never stopped the read (3 s)")
    assert done.returncode == 0, done.stderr.decode()


@pytest.mark.parametrize("head", [b"0x10", b" 010", b"+010", b"0_10", b"010 "])
def test_both_paths_refuse_a_length_that_is_not_four_hex_digits(
    head: bytes, tmp_path: Path
) -> None:
    """1c53334's C parser takes exactly four hex digits; the Python one (read_length, used
    for the handshake, every request's header, and all content without the C kernel or on
    a buffered stream) is int(head, 16), which also takes '0x', '+', '_' and spaces: the
    same stream is content on one path and a ProtocolError on the other (the commit's
    test says each refuses what the other refuses). Right: both refuse."""
    wire = head + b"x" * 12 + b"0000"
    with pytest.raises(ProtocolError):
        PacketReader(io.BytesIO(wire)).read()
    if kernels.native is not None:
        path = tmp_path / "wire"
        path.write_bytes(wire)
        with pytest.raises(ProtocolError):
            PacketReader(io.FileIO(path, "rb")).read(100)


def test_an_unchanged_file_imports_nothing_to_store_a_change(tmp_path: Path) -> None:
    """be55db7 says clean imports zstandard and the update types "once the staged
    manifest says a tensor may change"; it does so for every file that has a staged
    manifest, before any tensor is hashed: the re-clean of an unchanged file (git status
    or git add after a touch, the most common clean) imports zstandard, platform and
    updates.auto/delta/sparse for nothing: 4.1 ms of CPU, 4.8 ms of wall time, median
    of 60 interleaved re-adds of a 20-tensor file (82.5 vs 78.4 ms CPU). Right: the
    helper starts once a tensor's hash misses (or the trade is measured and documented)."""
    from st_files import f32

    from git_theta.clean import clean
    from git_theta.store import ObjectStore

    data = tmp_path / MODEL
    data.write_bytes(st_from_arrays(f32({"a": (64, 64), "b": (64,)}, 1)))
    manifest = tmp_path / "manifest"
    with manifest.open("wb") as out:
        clean(io.BytesIO(data.read_bytes()), out, MODEL, ObjectStore(tmp_path), None, False)
    script = textwrap.dedent(
        f"""
        import io, sys, threading
        from git_theta.clean import clean
        from git_theta.manifest import parse
        from git_theta.store import ObjectStore
        previous = parse(open({str(manifest)!r}, "rb").read())
        source = io.BytesIO(open({str(data)!r}, "rb").read())
        clean(source, io.BytesIO(), {MODEL!r}, ObjectStore({str(tmp_path)!r}), previous, False)
        for thread in threading.enumerate():
            if thread.name == "theta-import":
                thread.join()
        wanted = ("zstandard", "git_theta.updates.")
        print(sorted(m for m in sys.modules if m.startswith(wanted)))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    imported = done.stdout.decode().strip()
    assert "zstandard" not in imported and "sparse" not in imported, imported


def test_a_bad_kernels_variable_fails_an_add_in_one_line(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Older than these commits (for_one_command imported kernels outside the filter's
    error handling), and 1c53334 now imports kernels with pktline, before anything can
    catch it: GIT_THETA_KERNELS=nmpy (a typo) makes every filter start print a 15-line
    traceback ending in UsageError, then git's 'fatal: the remote end hung up
    unexpectedly'. Right: the UsageError's one line (it says what to use), non-zero."""
    (repo / MODEL).write_bytes(st_from_arrays({"w": np.zeros(4, dtype=np.float32)}))
    monkeypatch.setenv("GIT_THETA_KERNELS", "nmpy")
    done = git(repo, "add", MODEL, check=False)
    err = done.stderr.decode()
    assert done.returncode != 0
    assert "Traceback" not in err, err
    assert "GIT_THETA_KERNELS='nmpy': use native or numpy" in err, err
