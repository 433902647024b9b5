"""Corrupted and truncated files of every format: a clear ThetaError or an exact round trip,
never a crash, a hang, or code from the file running."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from st_files import f32, st_from_arrays

from git_theta.clean import clean
from git_theta.errors import ThetaError
from git_theta.smudge import smudge
from git_theta.store import ObjectStore


def samples() -> dict[str, bytes]:
    out = {"safetensors": st_from_arrays(f32({"a": (8, 4), "b": (3,)}, 1), {"k": "v"})}
    buf = io.BytesIO()
    np.save(buf, np.arange(20, dtype=np.float32))
    out["npy"] = buf.getvalue()
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(10, dtype=np.float32), b=np.ones(3, dtype=np.int64))
    out["npz"] = buf.getvalue()
    gguf = pytest.importorskip("gguf")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_string("general.name", "fuzz")
        writer.add_tensor("t", np.arange(32, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        out["gguf"] = path.read_bytes()
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    w = torch.arange(12, dtype=torch.float32)
    torch.save({"w": w, "tied": w, "h": torch.ones(3, dtype=torch.float16), "n": 1}, buf)
    out["pt"] = buf.getvalue()
    # Optional libraries add their formats; without them the others are still fuzzed
    # (an importorskip here would skip the whole module).
    try:
        from flax import serialization as flax_serialization
    except ImportError:
        pass
    else:
        state = {"p": {"k": np.arange(12, dtype=np.float32), "b": np.ones(2, np.float16)}}
        out["msgpack"] = flax_serialization.to_bytes({**state, "n": 3})
    try:
        import h5py
    except ImportError:
        pass
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "m.h5"
            with h5py.File(path, "w") as f:
                f["g/w"] = np.arange(16, dtype=np.float32)
                f["s"] = "text"
            out["h5"] = path.read_bytes()
    return out


SAMPLES = samples()


@settings(
    max_examples=int(os.environ.get("THETA_FUZZ_EXAMPLES", "150")),
    deadline=None,
    derandomize=not os.environ.get("THETA_FUZZ_EXAMPLES"),  # CI: the same cases every run
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(sorted(SAMPLES)),
    cut=st.one_of(st.none(), st.integers(0, 2000)),
    flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=6),
)
def test_mutated_files_error_cleanly_or_round_trip(
    kind: str, cut: int | None, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(SAMPLES[kind])
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(Path(tmp))
        manifest = io.BytesIO()
        try:
            clean(io.BytesIO(bytes(data)), manifest, f"m.{kind}", store, None, False)
        except ThetaError:
            return
        out = io.BytesIO()
        smudge(io.BytesIO(manifest.getvalue()), out, f"m.{kind}", store, False)
        assert out.getvalue() == bytes(data)
