"""A committed PEFT adapter file and the low-rank links made from it share their factors.

What users care about: committing ``adapter/adapter_model.safetensors`` next to the merged
model (added with ``--update-type low-rank --update-path adapter/``) stores no factor
tensor twice, in either order and for every version; every file checks out bit for bit
from a fresh clone; prune keeps the shared objects and fsck names a missing one; old
objects (factors inside the payload) still read; a hand-made chain that misplaces factor
objects is one clear line.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import git, lfs_objects, sha256
from golden_fixtures import OBJECTS

from git_theta import chains, codec
from git_theta.errors import ObjectCorruptError
from git_theta.manifest import Link, TensorEntry, parse
from git_theta.store import ObjectStore
from git_theta.updates import UPDATES
from git_theta.updates.dense import Dense
from git_theta.updates.factored import Factor, Inputs, LowRank, reproduce
from git_theta.updates.layout import layout_for

MODEL = "model.safetensors"
ADAPTER = "adapter/adapter_model.safetensors"
LORA = (".lora_A.", ".lora_B.")

Version = tuple[bytes, bytes, bytes]  # merged model, adapter file, adapter_config.json


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[bytes, list[Version]]]:
    """A tiny BERT (from a config), and two LoRA versions: (adapter, its merge) each."""
    monkey = pytest.MonkeyPatch()
    monkey.setenv("HF_HUB_OFFLINE", "1")
    import peft
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("lora")
    model = tf.BertForMaskedLM(config)
    model.save_pretrained(out / "base")
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"])
    )
    optim = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    made = []
    for v in (1, 2):
        for _ in range(2):
            ids = torch.randint(0, 100, (2, 16), generator=gen)
            wrapped(input_ids=ids, labels=ids).loss.backward()
            optim.step()
            optim.zero_grad()
        wrapped.save_pretrained(out / f"adapter{v}")
        copy.deepcopy(wrapped).merge_and_unload().save_pretrained(out / f"merged{v}")
        adapter = out / f"adapter{v}"
        made.append(
            (
                (out / f"merged{v}" / MODEL).read_bytes(),
                (adapter / "adapter_model.safetensors").read_bytes(),
                (adapter / "adapter_config.json").read_bytes(),
            )
        )
    yield (out / "base" / MODEL).read_bytes(), made
    monkey.undo()


def manifest_of(repo: Path, path: str, rev: str = "HEAD") -> Any:
    return json.loads(git(repo, "show", f"{rev}:{path}").stdout)


def factor_oids(repo: Path, rev: str = "HEAD") -> set[str]:
    """The operand objects of the model's chains at ``rev``."""
    tensors = manifest_of(repo, MODEL, rev)["tensors"]
    return {ln["oid"] for e in tensors.values() for ln in e["chain"] if ln["update"] == "factor"}


def adapter_oids(repo: Path, rev: str = "HEAD") -> set[str]:
    """The objects of the adapter file's LoRA tensors at ``rev``."""
    tensors = manifest_of(repo, ADAPTER, rev)["tensors"]
    return {ln["oid"] for n, e in tensors.items() if any(p in n for p in LORA) for ln in e["chain"]}


def put(repo: Path, version: Version) -> None:
    merged, adapter, config = version
    (repo / "adapter").mkdir(exist_ok=True)
    (repo / ADAPTER).write_bytes(adapter)
    (repo / "adapter" / "adapter_config.json").write_bytes(config)
    (repo / MODEL).write_bytes(merged)


def add_model(repo: Path) -> None:
    done = subprocess.run(
        ["git", "theta", "add", "--update-type", "low-rank", "--update-path", "adapter/", MODEL],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_an_adapter_file_stores_its_factors_once(
    repo: Path, tmp_path: Path, versions: tuple[bytes, list[Version]]
) -> None:
    base, (v1, v2) = versions
    (repo / MODEL).write_bytes(base)
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "base")

    # Version 1: the model first (its low-rank links store the factors), then the adapter.
    put(repo, v1)
    add_model(repo)
    before = lfs_objects(repo)
    git(repo, "add", "adapter")
    git(repo, "commit", "-q", "-m", "lora v1")
    new = lfs_objects(repo) - before
    assert new == {manifest_of(repo, ADAPTER)["glue"]["oid"]}  # no factor stored again
    assert len(factor_oids(repo)) == 8  # A and B of query and value, in two layers
    assert adapter_oids(repo) == factor_oids(repo)

    # Version 2 as `git add .` does it: the adapter file first, then the model.
    put(repo, v2)
    git(repo, "add", "adapter")
    before = lfs_objects(repo)
    add_model(repo)
    git(repo, "commit", "-q", "-m", "lora v2")
    tensors = manifest_of(repo, MODEL)["tensors"]
    added = lfs_objects(repo) - before
    assert not added & factor_oids(repo)  # the adapter stored them already
    assert adapter_oids(repo) == factor_oids(repo)
    # Each version's factors describe the change from the base: on the base, not on v1.
    old = manifest_of(repo, MODEL, "HEAD~1")["tensors"]
    for n, e in tensors.items():
        if n.endswith(("query.weight", "value.weight")):
            assert [ln["update"] for ln in e["chain"]] == ["dense", "factor", "factor", "low-rank"]
            assert e["chain"][0] == old[n]["chain"][0]
    assert git(repo, "status", "--porcelain").stdout == b""
    shas = {rev: (sha256(repo / MODEL), sha256(repo / ADAPTER)) for rev in ("HEAD",)}
    git(repo, "checkout", "-q", "HEAD~1")
    shas["HEAD~1"] = (sha256(repo / MODEL), sha256(repo / ADAPTER))
    git(repo, "checkout", "-q", "-")
    assert shas["HEAD"] != shas["HEAD~1"]

    diff = subprocess.run(
        ["git", "theta", "diff", "HEAD~2", "HEAD~1", "--", MODEL],
        cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert "low-rank update: rank 8, scale 2" in diff.stdout, diff.stdout + diff.stderr

    # Pushed to a file:// remote and cloned: every object came along.
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    git(repo, "push", "-q", "origin", "HEAD:main")
    clone = tmp_path / "clone"
    done = subprocess.run(
        ["git", "clone", "-q", f"file://{remote}", str(clone)], capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    for rev, (model_sha, adapter_sha) in shas.items():
        git(clone, "checkout", "-q", rev)
        assert (sha256(clone / MODEL), sha256(clone / ADAPTER)) == (model_sha, adapter_sha), rev

    # Prune keeps the shared objects (both manifests name them); fsck names a lost one.
    done = subprocess.run(["git", "theta", "prune"], cwd=repo, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    assert factor_oids(repo) | factor_oids(repo, "HEAD~1") <= lfs_objects(repo)
    name, entry = next((n, e) for n, e in tensors.items() if n.endswith("query.weight"))
    lost = entry["chain"][-2]["oid"]
    Path(ObjectStore(repo / ".git" / "lfs").path(lost)).unlink()
    fsck = subprocess.run(
        ["git", "theta", "fsck", "HEAD"], cwd=repo, capture_output=True, text=True
    )
    assert fsck.returncode == 1
    # Said once, at the first tensor needing it (fsck names each object once).
    said = [line for line in fsck.stdout.splitlines() if lost in line]
    assert len(said) == 1 and said[0].endswith(f"{lost} missing locally"), fsck.stdout
    assert said[0].startswith((f"HEAD:{MODEL}: tensor {name!r}", f"HEAD:{ADAPTER}: tensor "))


def test_the_three_dense_encoders_write_the_same_object() -> None:
    """An operand is the adapter tensor's dense object only while every way of writing a
    dense object (for comparisons, streamed, a factor's) gives the same bytes."""
    rng = np.random.default_rng(5)
    dense = Dense()
    for dtype, values in (
        ("F32", rng.standard_normal(5 << 18).astype("<f4")),  # past one 1 Mi-word chunk
        ("F16", rng.standard_normal(999).astype("<f2")),
        ("BF16", rng.integers(0, 1 << 16, 4096).astype("<u2")),
        ("F64", rng.standard_normal(33)),
    ):
        raw = values.tobytes()
        encoded = b"".join(dense.encode(raw, None, dtype))
        assert b"".join(dense.stream(raw, dtype)) == encoded, dtype
        assert b"".join(codec.encode(raw, layout_for(dtype))) == encoded, dtype


# ------------------------------------------------------------------------------------------
# Chains, in process: the linked payload, the inline one, and hostile arrangements.

RNG = np.random.default_rng(11)
PREV = (RNG.standard_normal((64, 48)) * 0.02).astype("<f4")
R = Factor("F32", (64, 2), (RNG.standard_normal((64, 2)) * 0.1).astype("<f4").tobytes())
C = Factor("F32", (2, 48), (RNG.standard_normal((2, 48)) * 0.1).astype("<f4").tobytes())
INPUTS = Inputs("low-rank", (R, C), 2.0)


def linked_chain(store: ObjectStore) -> tuple[TensorEntry, bytes]:
    """A tensor stored as a dense base and a linked low-rank update; its new bytes."""
    from git_theta.content import content_hash

    new = reproduce(PREV.tobytes(), "F32", PREV.shape, INPUTS)
    assert new is not None
    chain = chains.store_value(PREV.tobytes(), "F32", store)
    entry = TensorEntry("F32", PREV.shape, "", chain)
    plugin = LowRank({"w": INPUTS})
    chain = chains.store_value(
        new, "F32", store, plugin, entry, lambda: bytearray(PREV.tobytes()), name="w",
        shape=PREV.shape,
    )  # fmt: skip
    return TensorEntry("F32", PREV.shape, content_hash(new), chain), new


def test_a_linked_chain_rebuilds_and_counts_as_one_step(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "lfs")
    entry, new = linked_chain(store)
    assert [ln.update for ln in entry.chain] == ["dense", "factor", "factor", "low-rank"]
    assert chains.steps(entry.chain) == 2 and chains.last_step(entry.chain) == 1
    assert bytes(chains.rebuild("w", entry, store)) == new
    # The operands are the dense objects of the factors' bytes.
    for link, factor in zip(entry.chain[1:3], (R, C), strict=True):
        assert link.ref == store.put(Dense().encode(factor.raw, None, factor.dtype))
    header = bytes(store.get(entry.chain[-1].ref))[8:300]
    assert b'"linked": true' in header and b'"size"' not in header


@pytest.mark.parametrize("name", ["low-rank-f32", "low-rank-bf16", "ia3-f32-cols"])
def test_old_objects_with_factors_inside_still_apply(name: str) -> None:
    """A golden update object (factors inside) applies without operands, and refuses
    operands given to it: they cannot be its own."""
    import hashlib

    meta = json.loads((OBJECTS / f"{name}.json").read_text())
    payload = (OBJECTS / f"{name}.gtho").read_bytes()
    base = codec.decode((OBJECTS / f"{meta['prev']}.gtho").read_bytes())
    plugin = UPDATES.get(meta["update"])
    out = plugin.apply_with(bytearray(base), payload, (), meta["dtype"])
    assert hashlib.sha256(out).hexdigest() == meta["new_sha256"]
    with pytest.raises(ObjectCorruptError, match="takes 0 factor objects, but 1 precedes it"):
        plugin.apply_with(bytearray(base), payload, (b"x",), meta["dtype"])


def _swap(entry: TensorEntry, chain: tuple[Link, ...]) -> TensorEntry:
    return entry._replace(chain=chain)


@pytest.mark.parametrize(
    ("arrange", "message"),
    [
        (lambda c: (c[1], c[0], c[2], c[3]), "1 factor object precedes a dense update, which"),
        (lambda c: (c[0], c[1], c[3]), "low-rank update object is corrupt: it takes 2 factor"),
        (lambda c: (*c, c[1]), "the chain ends with 1 factor object no update takes"),
        (lambda c: (c[0], c[1], c[1], c[3]), "declares 512 bytes, more than the 384 expected"),
        (lambda c: (c[1], c[2]), "the chain ends with 2 factor objects no update takes"),
        (lambda c: (c[0], c[1], c[2], c[1], c[3]), "more than 2 factor objects in a row"),
    ],
    ids=["before-dense", "one-missing", "trailing", "wrong-factor", "only-factors", "three"],
)
def test_misplaced_factor_objects_are_one_clear_error(
    tmp_path: Path, arrange: Any, message: str
) -> None:
    store = ObjectStore(tmp_path / "lfs")
    entry, _ = linked_chain(store)
    with pytest.raises(ObjectCorruptError) as info:
        chains.rebuild("w", _swap(entry, arrange(entry.chain)), store)
    text = str(info.value)
    assert text.startswith("tensor 'w': ") and message in text and "\n" not in text, text


def test_a_factor_before_an_update_taking_none_is_refused(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "lfs")
    entry, new = linked_chain(store)
    sparse = UPDATES.get("sparse")
    parts = sparse.encode(new, PREV.tobytes(), "F32")
    assert parts is not None
    link = Link("sparse", sparse.codec, store.put(parts))
    with pytest.raises(ObjectCorruptError, match="1 factor object precedes a sparse update"):
        chains.rebuild("w", _swap(entry, (entry.chain[0], entry.chain[1], link)), store)


def test_manifests_with_factor_links_need_the_new_version(tmp_path: Path) -> None:
    """Written as version 3 (a version-1 reader says "written by a newer git-theta");
    without factor links, as version 1, byte for byte as before."""
    from git_theta.errors import ManifestError
    from git_theta.manifest import Glue, Manifest
    from git_theta.store import ObjectRef

    store = ObjectStore(tmp_path / "lfs")
    entry, new = linked_chain(store)
    glue = Glue("0" * 64, ObjectRef("1" * 64, 0))
    m = Manifest("safetensors", len(new), glue, ("w",), {"w": entry})
    data = m.to_bytes()
    assert data.startswith(b'{\n "git-theta": 3,')
    assert parse(data).to_bytes() == data
    dense_only = m._replace(tensors={"w": entry._replace(chain=entry.chain[:1])})
    assert dense_only.to_bytes().startswith(b'{\n "git-theta": 1,')
    with pytest.raises(ManifestError, match="version 1 cannot hold factor links"):
        parse(data.replace(b'"git-theta": 3,', b'"git-theta": 1,', 1))


def test_auto_stores_peft_factor_tensors_whole() -> None:
    prev = RNG.standard_normal(512).astype("<f4")
    new = prev.copy()
    new[3] = 1.0  # one element changed: a sparse update anywhere else
    dense = Dense()

    def encode() -> list[bytes]:
        return dense.encode(new.tobytes(), None, "F32")

    auto = UPDATES.get("auto")
    for name, key in (
        ("base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight", "dense"),
        ("base_model.model.bert.embeddings.word_embeddings.lora_embedding_B", "dense"),
        ("base_model.model.bert.encoder.layer.0.attention.self.query.weight", "sparse"),
    ):
        got, _ = auto.pick(new.tobytes(), prev.tobytes(), "F32", encode, None, name, (512,))
        assert got == key, name


def test_a_second_adapter_version_is_stored_on_the_base(tmp_path: Path) -> None:
    """Each adapter version's factors describe the change from the base model: stored on
    the first version's merge they leave a correction of most of the tensor (still just
    under a fresh dense value), on the base almost nothing."""
    from git_theta.content import content_hash

    rng = np.random.default_rng(2)
    base = (rng.standard_normal((256, 256)) * 0.02).astype("<f4").tobytes()

    def lora(seed: int) -> Inputs:
        r = np.random.default_rng(seed)
        b = (r.standard_normal((256, 8)) * 0.001).astype("<f4").tobytes()
        a = (r.standard_normal((8, 256)) * 0.1).astype("<f4").tobytes()
        return Inputs("low-rank", (Factor("F32", (256, 8), b), Factor("F32", (8, 256), a)), 2.0)

    store = ObjectStore(tmp_path / "lfs")
    entry = TensorEntry(
        "F32", (256, 256), content_hash(base), chains.store_value(base, "F32", store)
    )
    value = base
    for seed in (1, 2):
        new = reproduce(base, "F32", (256, 256), lora(seed))
        assert new is not None
        chain = chains.store_value(
            new, "F32", store, LowRank({"w": lora(seed)}), entry,
            lambda v=value: bytearray(v), name="w", shape=(256, 256),
        )  # fmt: skip
        entry, value = TensorEntry("F32", (256, 256), content_hash(new), chain), new
        assert [ln.update for ln in chain] == ["dense", "factor", "factor", "low-rank"]
        assert chain[-1].ref.size < 1024  # no correction to speak of
        assert bytes(chains.rebuild("w", entry, store)) == new


def test_every_chain_is_folded_by_chains_apply_links() -> None:
    """A new place that applied links itself would misread operand links: outside the
    update types and the conformance kit, only chains.py applies an update."""
    import re

    import git_theta

    root = Path(git_theta.__file__).parent
    applying = re.compile(r"\.(apply|apply_with|summary|summary_with)\(")
    found = {
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if applying.search(p.read_text()) and not p.is_relative_to(root / "updates")
    }
    assert found <= {"chains.py", "testing.py"}, found


def add_low_rank(
    repo: Path, tmp_path: Path, values: dict[str, np.ndarray], r: np.ndarray, c: np.ndarray
) -> None:
    """Write ``values`` as m.safetensors, add it with ``--update-type low-rank`` and the
    factors ``r``, ``c`` of tensor w (a file beside the repository), and commit "lora"."""
    from st_files import st_from_arrays

    (repo / "m.safetensors").write_bytes(st_from_arrays(values))
    factors = tmp_path / "lora.safetensors"
    factors.write_bytes(st_from_arrays({"w/R": r, "w/C": c}))
    done = subprocess.run(
        ["git", "theta", "add", "--update-type", "low-rank", "--update-path", str(factors),
         "m.safetensors"], cwd=repo, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    git(repo, "commit", "-q", "-m", "lora")


def test_factor_objects_go_through_an_lfs_server(repo: Path, tmp_path: Path, server: Any) -> None:
    """Pushed to giftless (the batch API) and cloned: the factor objects are uploaded
    with the rest, and the low-rank version checks out bit for bit."""
    from st_files import st_from_arrays

    rng = np.random.default_rng(4)
    w = (rng.standard_normal((64, 48)) * 0.02).astype("<f4")
    r = (rng.standard_normal((64, 2)) * 0.1).astype("<f4")
    c = (rng.standard_normal((2, 48)) * 0.1).astype("<f4")
    model = repo / "m.safetensors"
    model.write_bytes(st_from_arrays({"w": w}))
    git(repo, "add", "m.safetensors")
    git(repo, "commit", "-q", "-m", "base")
    new = reproduce(w.tobytes(), "F32", w.shape, Inputs("low-rank", (factor_of(r), factor_of(c))))
    assert new is not None
    add_low_rank(repo, tmp_path, {"w": np.frombuffer(new, "<f4").reshape(w.shape)}, r, c)
    chain = manifest_of(repo, "m.safetensors")["tensors"]["w"]["chain"]
    assert [ln["update"] for ln in chain] == ["dense", "factor", "factor", "low-rank"]
    remote = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    (repo / ".lfsconfig").write_text(f'[lfs]\n\turl = "{server.url("model")}"\n')
    git(repo, "add", ".lfsconfig")
    git(repo, "commit", "-q", "-m", "the LFS server")  # what the clone reads
    git(repo, "push", "-q", "origin", "HEAD:main")
    assert {ln["oid"] for ln in chain} <= server.objects()
    clone = tmp_path / "clone"
    done = subprocess.run(
        ["git", "clone", "-q", f"file://{remote}", str(clone)], capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    assert sha256(clone / "m.safetensors") == sha256(model)


def factor_of(a: np.ndarray) -> Factor:
    return Factor("F32", a.shape, a.tobytes())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h["factors"][0].update(size=5), "a factor is malformed"),
        (lambda h: h.update(linked=1), "its header is malformed"),
        (lambda h: h["factors"][0].update(shape=[64, 3]), "its factors do not fit the tensor"),
    ],
    ids=["size-in-linked", "linked-not-bool", "factor-shape"],
)
def test_a_hostile_linked_header_is_one_clear_error(
    tmp_path: Path, edit: Any, message: str
) -> None:
    import struct

    store = ObjectStore(tmp_path / "lfs")
    entry, _ = linked_chain(store)
    payload = bytes(store.get(entry.chain[-1].ref))
    (length,) = struct.unpack_from("<I", payload, 4)
    header = json.loads(payload[8 : 8 + length])
    edit(header)
    text = json.dumps(header, sort_keys=True).encode()
    bad = payload[:4] + struct.pack("<I", len(text)) + text + payload[8 + length :]
    link = Link("low-rank", "gtfx1", store.put([bad]))
    with pytest.raises(ObjectCorruptError, match=message):
        chains.rebuild("w", _swap(entry, (*entry.chain[:-1], link)), store)
