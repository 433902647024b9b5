"""Review (s3) of the identity prefilter, the API's save in place and its accounting, and
the private index of ``git theta add --update-type``: each test asserts the right
behaviour and fails now."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import track

import git_theta
from git_theta import clean as clean_module
from git_theta import smudge


def test_a_tensor_changed_by_the_caller_during_a_save_never_commits_a_broken_version(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save lends clean the caller's memory (f0dc65f): the hash is taken there, then the
    encode reads the same memory again later (another thread, a GIL-free kernel). A
    training thread stepping the weights meanwhile (an asynchronous checkpoint of
    ``model.state_dict()``, whose tensors are the parameters) makes the manifest record
    the hash of one value and an object holding another: that commit never checks out,
    and verified.py records the chain as rebuilding to that hash. Before, clean hashed and
    encoded its own copy: a torn snapshot at worst, but one that checks out. Here the
    other thread's step lands, deterministically, just after the hash."""
    rng = np.random.default_rng(5)
    weights = {"w": rng.standard_normal((256, 256)).astype(np.float32)}
    original = weights["w"].copy()
    real_hash = clean_module.content_hash

    def hash_then_step(data: object) -> str:
        digest = real_hash(data)
        weights["w"] *= np.float32(1.5)  # the optimiser's step, in another thread
        return digest

    monkeypatch.setattr(clean_module, "content_hash", hash_then_step)
    git_theta.save(weights, "m.safetensors", message="v0")
    monkeypatch.setattr(clean_module, "content_hash", real_hash)
    with git_theta.open("HEAD", "m.safetensors") as ckpt:
        got = ckpt["w"]  # now: "rebuilt bytes do not match the recorded hash"
    # What was hashed is what was stored: the value as the save read it.
    assert np.array_equal(got, original)


def test_api_history_in_a_long_lived_process_is_not_counted_as_a_bomb(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """609169c gave each opened API version its own expansion account and left the
    process's (``smudge.PROCESS``, meant for a filter serving one git command) for the
    rest; but ``git_theta.history`` of an .npz counts every revision's manifest there
    (diffing._manifest_members), and nothing resets it in an API process (a notebook, a
    training loop calling history after each save). The same revisions read again are
    counted again while their objects count once, so after enough calls a legitimate
    history is refused as a bomb. The 256 MiB floor is lowered here so that a few dozen
    calls on a small file show what a few hundred on a real one do."""
    monkeypatch.setattr(smudge, "EXPANSION_FLOOR", 0)
    track(repo, "*.npz")
    rng = np.random.default_rng(6)
    state = {"w": rng.standard_normal((64, 64)).astype(np.float32)}
    git_theta.save(state, "m.npz", message="v0")
    state["w"][0] += 1
    git_theta.save(state, "m.npz", message="v1")
    for _ in range(60):
        assert len(git_theta.history("m.npz")) == 2  # now: ExpansionError on ~the 30th


def test_a_hostile_manifest_of_one_common_hash_does_not_cost_every_look_up_of_it() -> None:
    """A clone's manifest (within identity's 16 MB) may list 60,000 tensors all claiming
    the hash of a 768-float vector of ones (a fresh LayerNorm weight; zero biases work
    alike). The prefilter admits it on the first look-up of that hash, as it should, but
    then every later ``same_content`` of the same bytes builds and sorts a candidate for
    each of the 60,000 entries (~0.2 s each here) before clean looks at IDENTITY_TRIES of
    them: a fresh model's 100 LayerNorms cost ~20 s of ``git add`` or ``save``. Work
    per look-up should be bounded (the size filter and the cut to a few candidates
    applied before building all of them), not proportional to what a stranger wrote."""
    import time

    import blake3

    from git_theta.identity import INDEX, Blob, Known
    from git_theta.manifest import Glue, Link, Manifest, TensorEntry, parse
    from git_theta.store import ObjectRef

    digest = blake3.blake3(np.ones(768, np.float32).tobytes()).hexdigest()
    link = (Link("dense", "zstd", ObjectRef("0" * 64, 9)),)
    n = 60_000
    tensors = {f"t{i}": TensorEntry("F32", (768,), digest, link) for i in range(n)}
    hostile = Manifest("safetensors", 8 + 3072 * n, Glue("1" * 64, ObjectRef("2" * 64, 8)),
                       (8, *sorted(tensors)), tensors).to_bytes()  # fmt: skip
    assert len(hostile) < 16 << 20  # within history.IDENTITY_MAX_BYTES
    known = Known(blobs=lambda near: [Blob(INDEX, "h.safetensors", "h" * 40, hostile)],
                  parse=lambda oid, data: parse(data))  # fmt: skip
    known.same_content(digest, "F32", 3072, "x.safetensors")  # admits and parses it once
    start = time.perf_counter()
    for _ in range(20):  # 20 tensors of the user's model hold these bytes
        known.same_content(digest, "F32", 3072, "x.safetensors")
    assert time.perf_counter() - start < 1.0  # now ~5-7 s


def test_a_terminated_forced_add_leaves_no_index_lock(repo: Path) -> None:
    """ce15bbc locks the index (``index.lock``) for the whole of `git theta add
    --update-type`, and removes the lock in a ``finally``: SIGTERM (``timeout``, a CI
    job cancelled) or SIGHUP (the terminal closed) ended Python without running it, so
    ``.git/index.lock`` stayed and every later git command failed until the user deleted
    it. The signal is sent at the worst moment, deterministically: by the process itself,
    while the lock is held and `git add` is about to run."""
    import signal
    import subprocess
    import sys

    from conftest import git
    from st_files import st_from_arrays
    from test_merge import save_commit

    w = np.arange(64, dtype=np.float32)
    save_commit(repo, {"w": w}, "v1", "model.safetensors")
    w[3] += 1
    (repo / "model.safetensors").write_bytes(st_from_arrays({"w": w}))
    script = (
        "import os, signal, sys\n"
        # as in a terminal: a test run under nohup would otherwise ignore SIGHUP
        "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "from git_theta.commands import add\n"
        "def terminated(*argv, env=None):\n"
        "    assert os.path.exists(os.path.join('.git', 'index.lock'))\n"
        "    os.kill(os.getpid(), getattr(signal, sys.argv[1]))\n"
        "add.run_attached = terminated\n"
        "from git_theta.commands.cli import main\n"
        "sys.exit(main(['add', 'model.safetensors', '--update-type', 'dense']))\n"
    )
    for name in ("SIGTERM", "SIGHUP"):
        done = subprocess.run(
            [sys.executable, "-c", script, name], cwd=repo, capture_output=True, text=True
        )
        assert done.returncode == 128 + getattr(signal, name), done.stderr
        assert sorted(p.name for p in (repo / ".git").glob("index*")) == ["index"]
    git(repo, "add", "model.safetensors")  # git works again
