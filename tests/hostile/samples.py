"""Good files of every format, written by the libraries users have (numpy, safetensors,
torch, gguf, flax, h5py): what the mutations start from. A format whose library is
missing gets only the hand-written samples of ``files``."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np

from hostile import files as F


def make_samples() -> dict[str, list[bytes]]:
    """Return format -> sample files (deterministic bytes)."""
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((8, 4)).astype(np.float32)
    out: dict[str, list[bytes]] = {}
    out["safetensors"] = _safetensors(f32)
    out["npy"] = [_npy(a) for a in (
        np.arange(20, dtype=np.float32), np.asfortranarray(f32.astype(np.float64)),
        np.array([True, False]), np.zeros((), dtype=np.int16),
        np.zeros(3, dtype=[("a", "<f4"), ("b", "<i8")]),
    )]  # fmt: skip
    out["npz"] = []
    for save in (np.savez, np.savez_compressed):
        buf = io.BytesIO()
        save(buf, a=np.arange(10, dtype=np.float32), b=np.ones(3, dtype=np.int64))
        out["npz"].append(buf.getvalue())
    out["torch"] = _torch(f32)
    out["gguf"] = _gguf(f32)
    out["flax"] = _flax(f32)
    out["hdf5"] = _hdf5(f32)
    return {k: v for k, v in out.items() if v}


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _safetensors(f32: np.ndarray) -> list[bytes]:
    raw = f32.tobytes()
    written = [
        F.safetensors(
            {"__metadata__": {"format": "pt"},
             "a": {"dtype": "F32", "shape": [8, 4], "data_offsets": [0, len(raw)]},
             "b": {"dtype": "F16", "shape": [3], "data_offsets": [len(raw), len(raw) + 6]}},
            raw + bytes(6),
        )
    ]  # fmt: skip
    try:
        from safetensors.numpy import save
    except ImportError:
        return written
    written.append(save({"w": f32, "i": np.arange(5, dtype=np.int64)}, {"k": "v", "x": "y"}))
    return written


def _torch(f32: np.ndarray) -> list[bytes]:
    try:
        import torch
    except ImportError:
        return [F.torch_file(F._state_pickle({"w": ("0", "FloatStorage", (2,))}), {"0": bytes(8)})]
    w = torch.from_numpy(f32.copy())
    state = {"w": w, "tied": w, "h": torch.ones(3, dtype=torch.float16), "view": w[2:4], "n": 1}
    nested = {"model": {"layer.0.weight": w}, "optim": {"state": {0: {"step": 3}}, "lr": [1e-3]}}
    out = []
    for obj, protocol in ((state, 2), (nested, 2), (state, 4)):
        buf = io.BytesIO()
        torch.save(obj, buf, pickle_protocol=protocol)
        out.append(buf.getvalue())
    return out


def _gguf(f32: np.ndarray) -> list[bytes]:
    try:
        import gguf
    except ImportError:
        return [F.gguf([F.gguf_kv("n", 4, b"\1\0\0\0")], [("t", [8], 0, 0)], bytes(32))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_string("general.name", "fuzz")
        writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello"])
        writer.add_array("tokenizer.ggml.scores", [0.0, 1.0, 2.0])
        writer.add_tensor("t", f32)
        blocks = np.random.default_rng(1).integers(0, 256, (2, 34), dtype=np.uint8)
        writer.add_tensor("q", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return [path.read_bytes()]


def _flax(f32: np.ndarray) -> list[bytes]:
    try:
        from flax import serialization
    except ImportError:
        return [F.mp({"p": {"k": F.flax_array([2], "float32", bytes(8))}})]
    state = {"params": {"Dense_0": {"kernel": f32, "bias": np.ones(4, np.float16)}}, "step": 3}
    return [serialization.to_bytes(state)]


def _hdf5(f32: np.ndarray) -> list[bytes]:
    try:
        import h5py
    except ImportError:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.h5"
        with h5py.File(path, "w") as f:
            f["g/w"] = f32
            f["g/b"] = np.arange(4, dtype=np.int32)
            f.create_dataset("c", data=np.arange(64, dtype=np.float32), chunks=(16,))
            f["s"] = "text"
            f["g"].attrs["note"] = "attr"
        return [path.read_bytes()]
