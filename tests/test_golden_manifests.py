"""A manifest of every format, written once (tests/golden/manifests/), with the objects it
needs (an LFS store under lfs/): each must check out to the recorded checkpoint, byte for
byte, forever. Clean is then checked to still write the same manifest from that checkpoint.

The checkout tests are never updated to follow the code (see tests/golden/README.md).
"""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path
from typing import Any

import pytest
from golden_fixtures import CODEC_MAGIC, MANIFESTS, PINS, fixtures, kernels

from git_theta.chains import last_step, plugin_for, rebuild
from git_theta.clean import clean
from git_theta.content import content_hash
from git_theta.errors import ManifestError
from git_theta.manifest import Link, Manifest, parse
from git_theta.smudge import needed_objects, smudge
from git_theta.store import ObjectStore
from git_theta.updates import UPDATES

LFS = MANIFESTS / "lfs"
CHECKPOINTS = {n: m for n, m in fixtures(MANIFESTS).items() if m.get("kind") != "future"}
FUTURE = fixtures(MANIFESTS, "future")
FORMATS = {"safetensors", "npy", "npz", "torch", "gguf", "flax", "hdf5"}


def manifest_bytes(name: str) -> bytes:
    return (MANIFESTS / f"{name}.manifest").read_bytes()


def manifest(name: str) -> Manifest:
    return parse(manifest_bytes(name))


def golden_store(tmp_path: Path) -> ObjectStore:
    """A copy of the fixtures' store, so nothing a test does can touch the fixtures."""
    shutil.copytree(LFS, tmp_path / "lfs")
    return ObjectStore(tmp_path / "lfs")


def check_out(name: str, store: ObjectStore) -> bytes:
    out = io.BytesIO()
    smudge(io.BytesIO(manifest_bytes(name)), out, CHECKPOINTS[name]["path"], store, False)
    return out.getvalue()


@pytest.mark.parametrize("kernel", ["native", "numpy"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_golden_manifest_checks_out_to_the_recorded_checkpoint(
    name: str, kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = CHECKPOINTS[name]
    with kernels(kernel, monkeypatch):
        data = check_out(name, golden_store(tmp_path))
    assert len(data) == meta["checkpoint_size"]
    assert hashlib.sha256(data).hexdigest() == meta["checkpoint_sha256"]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_golden_manifest_serialization_round_trips(name: str) -> None:
    assert manifest(name).to_bytes() == manifest_bytes(name)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_every_link_codec_names_its_update_types_codec_and_object(
    name: str, tmp_path: Path
) -> None:
    """The per-link "codec" is written for every link; what it says must be true."""
    store = golden_store(tmp_path)
    for entry in manifest(name).tensors.values():
        for link in entry.chain:
            assert link.codec == plugin_for(link).codec
            magic = CODEC_MAGIC[link.codec]
            with store.open(link.ref) as fh:
                assert fh.read(len(magic)) == magic


@pytest.mark.parametrize("name", sorted(FUTURE))
def test_a_manifest_from_a_newer_git_theta_says_so(name: str, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=f"{FUTURE[name]['error']}.*upgrade"):
        smudge(io.BytesIO(manifest_bytes(name)), io.BytesIO(), "m", golden_store(tmp_path), False)


def test_fixture_store_holds_exactly_the_objects_the_manifests_need() -> None:
    needed = {ref.oid for n in CHECKPOINTS for _, ref in needed_objects(manifest(n))}
    present = {p.name for p in (LFS / "objects").rglob("*") if p.is_file()}
    assert present == needed
    for path in (LFS / "objects").rglob("*"):
        if path.is_file():  # an object renamed or rewritten by hand
            assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name


def test_fixtures_cover_every_format_and_update_type() -> None:
    formats = {manifest(n).format for n in CHECKPOINTS}
    assert formats == FORMATS
    updates = {
        link.update
        for n in CHECKPOINTS
        for entry in manifest(n).tensors.values()
        for link in entry.chain
    }
    assert updates == {"dense", "sparse", "delta", "low-rank", "ia3", "factor"}
    assert max(len(e.chain) for n in CHECKPOINTS for e in manifest(n).tensors.values()) >= 3
    assert FUTURE
    total = sum(p.stat().st_size for p in MANIFESTS.rglob("*") if p.is_file())
    assert total < 512 << 10  # fixtures stay small


# ------------------------------------------------------------------------------------------
# Clean: from the checked-out checkpoint (and the previous version's manifest, for chains)
# it still writes the same manifest and the same objects. Updated when clean changes on
# purpose; the checkout tests above never are.


def _update_for(meta: dict[str, Any]) -> Any:
    wanted: dict[str, str] = meta["updates"]
    factors = str(MANIFESTS / meta["factors"]) if meta["factors"] else ""

    def pick(tensor: str) -> Any:
        key = wanted.get(tensor, "auto")
        if key in ("low-rank", "ia3"):
            return UPDATES.get(key).with_inputs(factors)
        return key

    return pick


# Written while low-rank and ia3 payloads held their factors: clean now stores each factor
# as an operand object of its own, right before the update (chains.py); nothing else of
# these manifests may change.
FACTORS_INLINE = {"chains-v2"}
# Content objects may come out this much larger than the fixtures' (an encoder change
# such as the Huffman coder of 2026-12 changes their bytes, never what they hold).
SLACK = 1.002


def _same_links(new: tuple[Link, ...], old: tuple[Link, ...]) -> None:
    """The same steps (update type and codec) on objects no larger than ``old``'s (within
    SLACK): what the chain holds, whatever bytes the encoder gives its objects."""
    assert [(ln.update, ln.codec) for ln in new] == [(ln.update, ln.codec) for ln in old]
    for n, o in zip(new, old, strict=True):
        assert n.ref.size <= o.ref.size * SLACK + 64, (n, o)


def _same_but_objects(written: Manifest, golden: Manifest, store: ObjectStore) -> None:
    """``written`` is ``golden`` but for its objects' bytes (``_same_links``). For a
    fixture from before factor links, a tensor whose factors ``written`` links where
    ``golden`` holds them inline has golden's chain with the last update relinked, and
    rebuilds to the same hash."""
    assert (written.format, written.size, written.layout) == (
        golden.format,
        golden.size,
        golden.layout,
    )
    assert written.glue.hash == golden.glue.hash
    assert written.glue.ref.size <= golden.glue.ref.size * SLACK + 64
    assert list(written.tensors) == list(golden.tensors)
    for tensor, entry in written.tensors.items():
        old = golden.tensors[tensor]
        assert (entry.dtype, entry.shape, entry.hash, entry.merge) == (
            old.dtype,
            old.shape,
            old.hash,
            old.merge,
        )
        if [ln.update for ln in entry.chain] == [ln.update for ln in old.chain]:
            _same_links(entry.chain, old.chain)
            continue
        cut = last_step(entry.chain)
        _same_links(entry.chain[:cut], old.chain[:-1])
        assert [ln.update for ln in entry.chain[cut:-1]] == ["factor"] * (
            len(entry.chain) - cut - 1
        )
        assert entry.chain[-1].update == old.chain[-1].update in ("low-rank", "ia3")
        assert content_hash(rebuild(tensor, entry, store)) == old.hash


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_clean_still_writes_the_golden_manifest(name: str, tmp_path: Path) -> None:
    meta = CHECKPOINTS[name]
    if manifest(name).format == "hdf5":
        pytest.importorskip("h5py")  # reading an HDF5 layout needs it; checking out does not
    data = check_out(name, golden_store(tmp_path / "golden"))
    store = ObjectStore(tmp_path / "fresh")
    previous = manifest(meta["previous"]) if meta["previous"] else None
    for _, ref in needed_objects(previous) if previous else []:
        store.copy_in(ObjectStore(LFS).lfs_path(ref.oid), ref)  # what the earlier add stored
    out = io.BytesIO()
    clean(io.BytesIO(data), out, meta["path"], store, previous, False, _update_for(meta))
    written = parse(out.getvalue())
    if name in FACTORS_INLINE:
        assert any(ln.update == "factor" for e in written.tensors.values() for ln in e.chain)
    _same_but_objects(written, manifest(name), store)
    # Deterministic, and unchanged since the encoder was last changed on purpose.
    assert hashlib.sha256(out.getvalue()).hexdigest() == PINS["manifests"][name], name
    stored = {p.name for p in (tmp_path / "fresh" / "theta" / "objects").rglob("*") if p.is_file()}
    assert stored == {ref.oid for _, ref in needed_objects(written)} | (
        {ref.oid for _, ref in needed_objects(previous)} if previous else set()
    )
    # Each requested update type is what the chain's newest link records.
    for tensor, key in meta["updates"].items():
        assert manifest(name).tensors[tensor].chain[-1].update == key
