"""Regenerate the golden fixtures. Run only for a deliberate manifest-format change; old
fixtures must keep checking out, so add new files rather than overwriting old ones."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from st_files import st_bytes  # noqa: E402

from git_theta.clean import clean  # noqa: E402
from git_theta.store import ObjectStore  # noqa: E402


def small_checkpoint() -> bytes:
    rng = np.random.default_rng(2026)
    w = (rng.standard_normal((4, 8)) * 0.02).astype(np.float32)
    b = np.linspace(-1, 1, 8, dtype=np.float32)
    emb = rng.integers(0, 1 << 16, 64, dtype=np.uint16)  # raw BF16 bits
    return st_bytes(
        {
            "a.weight": ("F32", (4, 8), w.tobytes()),
            "a.bias": ("F32", (8,), b.tobytes()),
            "b.emb": ("BF16", (16, 4), emb.tobytes()),
            "c.count": ("I64", (), np.int64(-7).tobytes()),
            "d.empty": ("F16", (0, 3), b""),
            "e.flags": ("BOOL", (5,), bytes([1, 0, 1, 1, 0])),
        },
        metadata={"format": "pt", "z": "1", "a": "2"},
    )


class _Src(io.BytesIO):
    pass


if __name__ == "__main__":
    data = small_checkpoint()
    (HERE / "v1.safetensors").write_bytes(data)
    lfs = HERE / "v1-lfs"
    shutil.rmtree(lfs, ignore_errors=True)
    out = io.BytesIO()
    clean(_Src(data), out, "v1.safetensors", ObjectStore(lfs), None, show_progress=False)
    (HERE / "v1.manifest").write_bytes(out.getvalue())
    shutil.rmtree(lfs / "tmp", ignore_errors=True)
