"""Review (s3) of the operand links change: factor links, manifest version 3.

Each test asserts the right behaviour and fails on the reviewed code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import git
from st_files import st_from_arrays
from test_factor_links import add_low_rank

from git_theta import chains, diffing
from git_theta.content import content_hash
from git_theta.manifest import MAX_LINKS, Glue, Manifest, TensorEntry, parse
from git_theta.store import ObjectRef, ObjectStore
from git_theta.updates.factored import Factor, Inputs, LowRank, reproduce

SHAPE = (256, 256)


def _lora(seed: int) -> Inputs:
    r = np.random.default_rng(seed)
    b = (r.standard_normal((256, 4)) * 0.01).astype("<f4").tobytes()
    a = (r.standard_normal((4, 256)) * 0.1).astype("<f4").tobytes()
    return Inputs("low-rank", (Factor("F32", (256, 4), b), Factor("F32", (4, 256), a)), 2.0)


def _full_linked_chain(store: ObjectStore) -> tuple[TensorEntry, bytes]:
    """What clean writes for five low-rank versions merged one on the other: a dense base
    and five (factor, factor, low-rank) steps, 16 links (MAX_LINKS), 6 steps."""
    value = (np.random.default_rng(3).standard_normal(SHAPE) * 0.02).astype("<f4").tobytes()
    entry = TensorEntry("F32", SHAPE, content_hash(value), chains.store_value(value, "F32", store))
    for seed in range(1, 6):
        new = reproduce(value, "F32", SHAPE, _lora(seed))
        assert new is not None
        chain = chains.store_value(
            new, "F32", store, LowRank({"w": _lora(seed)}), entry,
            lambda v=value: bytearray(v), name="w", shape=SHAPE,
        )  # fmt: skip
        entry, value = TensorEntry("F32", SHAPE, content_hash(new), chain), new
    assert len(entry.chain) == MAX_LINKS and chains.steps(entry.chain) == 6
    return entry, value


def test_a_merge_on_a_full_linked_base_chain_stays_within_max_links(tmp_path: Path) -> None:
    """merging._on_base_chain bounds the base's chain by steps (< MAX_CHAIN) only, not by
    links: on a 16-link chain of 6 steps (as clean writes it) an averaged merge gets 17
    links, and the merged manifest cannot be written ("cannot write a valid manifest:
    tensor 'w': the chain must have 1 to 16 links"), so the merge fails. The merged value
    must be stored within MAX_LINKS (ours' chain or a fresh value)."""
    from git_theta.merging import Choice, Values, merge3

    store = ObjectStore(tmp_path / "lfs")
    base, value = _full_linked_chain(store)
    glue = Glue("0" * 64, ObjectRef("1" * 64, 0))

    def side(i: int) -> Manifest:
        a = np.frombuffer(value, "<f4").copy()
        a[i] += 0.5
        new = a.tobytes()
        chain = chains.store_value(
            new, "F32", store, "auto", base, lambda: bytearray(value), name="w", shape=SHAPE
        )
        entry = TensorEntry("F32", SHAPE, content_hash(new), chain)
        return Manifest("safetensors", len(new), glue, ("w",), {"w": entry})

    b = Manifest("safetensors", len(value), glue, ("w",), {"w": base})
    result = merge3(b, side(5), side(9), Values(store), lambda name: Choice("average"))
    chain = result.manifest.tensors["w"].chain
    assert len(chain) <= MAX_LINKS, f"{len(chain)} links"
    parse(result.manifest.to_bytes())


def test_the_update_summary_reads_no_more_factor_objects_than_an_update_takes(
    tmp_path: Path,
) -> None:
    """diffing._update_summary collects a step's operands itself (not chains.apply_links,
    and test_every_chain_is_folded_by_chains_apply_links does not see ``summary_with(``):
    a hostile chain of many factor links before the last update has every one of them
    read and sha256-hashed before the count is refused. The fold stops after two."""
    store = ObjectStore(tmp_path / "lfs")
    base, _ = _full_linked_chain(store)
    first = base.chain[:4]  # dense, factor, factor, low-rank
    factor = base.chain[1]
    hostile = (base.chain[0], *([factor] * 12), first[3])  # 14 links, valid manifest size
    old = diffing.TensorSide("F32", SHAPE, "", "dense", frozenset(), None, (base.chain[0],), store)
    new = diffing.TensorSide("F32", SHAPE, "", "x", frozenset(), None, hostile, store)
    reads: list[str] = []
    real_get = store.get

    def counting_get(ref: ObjectRef) -> object:
        if ref == factor.ref:
            reads.append(ref.oid)
        return real_get(ref)

    store.get = counting_get  # type: ignore[method-assign]
    assert diffing._update_summary(old, new) == ""
    assert len(reads) <= chains.MAX_OPERANDS, f"{len(reads)} factor objects read"


def test_history_names_an_unchanged_linked_tensor_as_diff_does(repo: Path, tmp_path: Path) -> None:
    """api.history reports how each tensor is stored. A changed tensor's label comes
    from diffing ("dense+low-rank", factor links left out); an unchanged one's is built in
    api/_history.py from every link ("dense+factor+factor+low-rank"): the same chain
    shown two ways in consecutive revisions."""

    from git_theta import api

    rng = np.random.default_rng(4)
    w = (rng.standard_normal((64, 48)) * 0.02).astype("<f4")
    v = rng.standard_normal(32).astype("<f4")
    r = (rng.standard_normal((64, 2)) * 0.1).astype("<f4")
    c = (rng.standard_normal((2, 48)) * 0.1).astype("<f4")
    model = repo / "m.safetensors"
    model.write_bytes(st_from_arrays({"w": w, "v": v}))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "base")
    lora = Inputs(
        "low-rank", (Factor("F32", r.shape, r.tobytes()), Factor("F32", c.shape, c.tobytes()))
    )
    new = reproduce(w.tobytes(), "F32", w.shape, lora)
    assert new is not None
    w2 = np.frombuffer(new, "<f4").reshape(w.shape)
    add_low_rank(repo, tmp_path, {"w": w2, "v": v}, r, c)
    model.write_bytes(st_from_arrays({"w": w2, "v": v + 1}))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "v only")
    revs = api.history("m.safetensors", repo=repo)
    assert len(revs) == 3
    changed, unchanged = revs[1].tensors["w"], revs[0].tensors["w"]
    assert changed.status != "unchanged" and unchanged.status == "unchanged"
    assert unchanged.update == changed.update, (unchanged.update, changed.update)


_SCAN_PROBE = """
import io, shutil, sys
from pathlib import Path
from git_theta.smudge import smudge
from git_theta.store import ObjectStore
from git_theta.updates import UPDATES
golden = Path(sys.argv[1]) / "manifests"
shutil.copytree(golden / "lfs", Path(sys.argv[2]) / "lfs")
store = ObjectStore(Path(sys.argv[2]) / "lfs")
data = (golden / (sys.argv[3] + ".manifest")).read_bytes()
smudge(io.BytesIO(data), io.BytesIO(), "chains.safetensors", store, False)
print(UPDATES._scanned)
"""


def test_a_checkout_of_factor_links_does_not_scan_for_plugins(tmp_path: Path) -> None:
    """smudge loads each link's update type before its workers start
    (``UPDATES.get(key)`` for every key in the chains, smudge.py:243). ``factor`` is no
    registered update type, so every checkout of a version-3 manifest scans the entry
    points (importlib.metadata, ~36 ms here) and imports and instantiates every
    installed third-party update plugin, though none is used (a broken one's ImportError
    is not a ThetaError and escapes the ``suppress``). A version-2-era manifest's
    checkout (chains-v2: the same tensors, factors inline) scans nothing."""
    import subprocess
    import sys

    from golden_fixtures import GOLDEN

    def scanned(name: str) -> str:
        out = tmp_path / name
        done = subprocess.run(
            [sys.executable, "-c", _SCAN_PROBE, str(GOLDEN), str(out), name],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert scanned("chains-v2") == "False"  # factors inline: built-in types only
    assert scanned("linked-v2") == "False"
