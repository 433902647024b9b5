from __future__ import annotations

import struct

import numpy as np
from git_theta_rawf32 import MAGIC, RawF32Format

from git_theta.formats import FORMATS
from git_theta.testing import check_format


def sample(n: int) -> bytes:
    values = np.random.default_rng(n).standard_normal(n).astype("<f4")
    return MAGIC + struct.pack("<Q", n) + values.tobytes()


def test_conformance() -> None:
    good = [sample(0), sample(5), sample(100_000)]
    bad = [MAGIC + struct.pack("<Q", 10) + b"\0" * 8, MAGIC[:5]]
    check_format(RawF32Format(), good, bad)


def test_registered_through_its_entry_point() -> None:
    assert isinstance(FORMATS.get("rawf32"), RawF32Format)
