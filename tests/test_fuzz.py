"""Corrupted, truncated and hostile files of every format, and hostile manifests: a clear
one-line ThetaError or an exact round trip, never a crash, a hang, unbounded memory, or
code from the file running.

``make fuzz`` runs >= 10,000 such cases (tests/hostile/runner.py); CI runs a fixed few
hundred of them here, each in a worker process whose peak memory and CPU time are
measured, and a hypothesis search in process.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from hostile.cases import FORMATS, plan
from hostile.runner import run, summary
from hostile.samples import make_samples

from git_theta.clean import clean
from git_theta.errors import ThetaError
from git_theta.smudge import smudge
from git_theta.store import ObjectStore

SAMPLES = make_samples()
CI_CASES = 320  # ~40 s on 2 busy cores; `make fuzz` runs 10,500


def test_fixed_hostile_cases_end_in_one_line_within_time_and_memory() -> None:
    specs = plan(CI_CASES, seed=0)
    results = run(specs, SAMPLES, jobs=2)
    assert sorted(r.id for r in results) == sorted(s.id for s in specs)
    assert not [r for r in results if r.outcome == "violation"], summary(results, 0)
    assert {r.fmt for r in results} == {*FORMATS, "manifest"} & {*SAMPLES, "manifest"}
    assert {r.outcome for r in results} == {"ok", "refused"}


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
    data = bytearray(SAMPLES[kind][0])
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(Path(tmp))
        manifest = io.BytesIO()
        try:
            clean(io.BytesIO(bytes(data)), manifest, f"m.{kind}", store, None, False)
        except ThetaError as exc:
            assert str(exc).isprintable() and str(exc).strip()  # one line
            return
        out = io.BytesIO()
        smudge(io.BytesIO(manifest.getvalue()), out, f"m.{kind}", store, False)
        assert out.getvalue() == bytes(data)
