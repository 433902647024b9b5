"""Review of tensor identity (identity.py, clean.py) against hostile manifests, and of the
chain bound (chains.py) over many save sequences: real git, seeded randomness."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from conftest import git, sha256
from st_files import st_from_arrays

from git_theta.content import content_hash

BOMB_BYTES = 512 << 20  # what the hostile entry declares (and its object decodes to)


def _bomb_object(length: int) -> list[bytes]:
    """A valid plain content object of ``length`` zero bytes, a few kB on disk."""
    import zstandard

    from git_theta import codec

    chunk = codec.CHUNK_WORDS  # plain objects: one byte per word
    payload = zstandard.ZstdCompressor(level=3).compress(bytes(chunk))
    head = struct.pack("<4sBBBBQI", codec.MAGIC, codec.VERSION, 1, 0, 0, length, chunk)
    plane = struct.pack("<BI", codec.ZSTD, len(payload)) + payload
    assert length % chunk == 0
    return [head, plane * (length // chunk)]


def _peak_rss_mb(repo: Path, *args: str) -> float:
    """Run git ``args`` in a fresh process; return the peak RSS (MB) of its processes."""
    script = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], check=True, capture_output=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, "git", *args], cwd=repo,
                          capture_output=True, check=True)  # fmt: skip
    return int(done.stdout) / 1024


def test_a_hostile_entry_claiming_a_common_hash_with_a_huge_shape_costs_nothing(
    repo: Path,
) -> None:
    """A committed manifest may claim the hash of a value every model has (a zero bias)
    with a huge shape and a tiny object that inflates to it. Identity must not rebuild it
    for a small tensor of those bytes: equal bytes have equal sizes."""
    from git_theta.repo import Repo

    zeros = np.zeros(64, np.float32)
    (repo / "other.safetensors").write_bytes(st_from_arrays({"z": zeros}))
    git(repo, "add", "other.safetensors")
    honest = json.loads(git(repo, "show", ":other.safetensors").stdout)
    ref = Repo(str(repo)).store.put(_bomb_object(BOMB_BYTES))
    entry = honest["tensors"]["z"]
    assert entry["hash"] == content_hash(zeros.tobytes())
    entry["shape"] = [BOMB_BYTES // 4]
    entry["chain"] = [{"update": "dense", "codec": "gtho1", "oid": ref.oid, "size": ref.size}]
    honest["size"] += BOMB_BYTES - zeros.nbytes
    # Many entries (and files) claiming it: each must not cost a rebuild per tensor either.
    for i in range(20):
        honest["tensors"][f"z{i}"] = entry
        honest["layout"].append(f"z{i}")
        honest["size"] += BOMB_BYTES
    data = json.dumps(honest, indent=1).encode() + b"\n"
    from git_theta.manifest import parse

    parse(data)  # valid: identity would read it
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--cacheinfo", f"100644,{oid},other.safetensors")
    git(repo, "commit", "-q", "-m", "hostile")
    # The user's new file: a few zero biases beside a weight.
    rng = np.random.default_rng(1)
    mine = {f"b{i}": np.zeros(64, np.float32) for i in range(4)}
    mine["w"] = rng.standard_normal((64, 64)).astype(np.float32)
    (repo / "mine.safetensors").write_bytes(st_from_arrays(mine))
    sha = sha256(repo / "mine.safetensors")
    start = time.perf_counter()
    peak = _peak_rss_mb(repo, "add", "mine.safetensors")
    took = time.perf_counter() - start
    assert peak < 200, f"an add of a 17 kB file peaked at {peak:.0f} MB"
    assert took < 5, f"an add of a 17 kB file took {took:.1f} s"
    git(repo, "commit", "-q", "-m", "mine")
    (repo / "mine.safetensors").unlink()
    git(repo, "checkout", "--", "mine.safetensors")
    assert sha256(repo / "mine.safetensors") == sha


def test_a_hostile_staged_manifest_of_the_same_path_costs_nothing_and_loses_nothing(
    repo: Path,
) -> None:
    """A clone's index holds the committed manifest of the path the user then overwrites
    and adds. An entry whose shape disagrees with the user's tensor is neither reused for
    equal bytes (its chain cannot give them: the user's commit would not check out) nor
    rebuilt as a previous value (it would inflate to what the shape says)."""
    from git_theta.repo import Repo

    rng = np.random.default_rng(2)
    theirs = {"z": np.zeros(64, np.float32), "w": rng.standard_normal((64, 64)).astype(np.float32)}
    (repo / "mine.safetensors").write_bytes(st_from_arrays(theirs))
    git(repo, "add", "mine.safetensors")
    hostile = json.loads(git(repo, "show", ":mine.safetensors").stdout)
    ref = Repo(str(repo)).store.put(_bomb_object(BOMB_BYTES))
    bomb = [{"update": "dense", "codec": "gtho1", "oid": ref.oid, "size": ref.size}]
    for name, value in theirs.items():
        entry = hostile["tensors"][name]
        entry["shape"] = [BOMB_BYTES // 4]
        entry["chain"] = bomb
        hostile["size"] += BOMB_BYTES - value.nbytes
    data = json.dumps(hostile, indent=1).encode() + b"\n"
    from git_theta.manifest import parse

    parse(data)
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--cacheinfo", f"100644,{oid},mine.safetensors")
    git(repo, "commit", "-q", "-m", "hostile")
    # The user's own file at that path: the same zero bias, another weight.
    mine = {"z": np.zeros(64, np.float32), "w": rng.standard_normal((64, 64)).astype(np.float32)}
    (repo / "mine.safetensors").write_bytes(st_from_arrays(mine))
    sha = sha256(repo / "mine.safetensors")
    peak = _peak_rss_mb(repo, "add", "mine.safetensors")
    assert peak < 200, f"an add of a 17 kB file peaked at {peak:.0f} MB"
    git(repo, "commit", "-q", "-m", "mine")
    (repo / "mine.safetensors").unlink()
    git(repo, "checkout", "--", "mine.safetensors")
    assert sha256(repo / "mine.safetensors") == sha


# -- chains over many save sequences ----------------------------------------------------

DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}


def _random_value(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> bytes:
    count = int(np.prod(shape)) * DTYPES[dtype]
    if dtype in ("F32", "BF16"):  # float-like words: small weights, some exact zeros
        words = (rng.standard_normal(count // DTYPES[dtype]) * 0.02).astype(np.float32)
        words[rng.random(words.size) < 0.05] = 0.0
        raw = words.tobytes()
        if dtype == "BF16":  # the top half of each float32
            raw = np.frombuffer(raw, np.uint16)[1::2].tobytes()
        return raw
    return rng.integers(0, 256, count, dtype=np.uint8).tobytes()


def _mutate(rng: np.random.Generator, raw: bytes, dtype: str, fraction: float) -> bytes:
    """Change about ``fraction`` of the elements: a low bit flipped, or a new value."""
    word = DTYPES[dtype]
    out = np.frombuffer(raw, np.uint8).copy().reshape(-1, word)
    picked = rng.random(out.shape[0]) < fraction
    if not picked.any():
        picked[rng.integers(out.shape[0])] = True
    out[picked, 0] ^= rng.integers(1, 256, int(picked.sum()), dtype=np.uint8)
    if rng.random() < 0.3:  # a sign flip of one element (e.g. +0.0 -> -0.0)
        out[rng.integers(out.shape[0]), word - 1] ^= 0x80
    return out.tobytes()


Model = dict[str, dict[str, tuple[str, tuple[int, ...], bytes]]]  # file -> name -> value


def _step(rng: np.random.Generator, model: Model) -> None:
    """One save's worth of random edits, across both files; tensor w1 (wherever it is)
    changes a little at almost every save, so its chain reaches the bound."""
    files = list(model)
    for tensors in model.values():
        if "w1" in tensors and rng.random() < 0.9:
            dtype, shape, raw = tensors["w1"]
            tensors["w1"] = (
                dtype,
                shape,
                _mutate(rng, raw, dtype, float(rng.choice([0.001, 0.3]))),
            )
    for _ in range(int(rng.integers(1, 4))):
        f = files[int(rng.integers(len(files)))]
        if not model[f]:
            continue
        names = sorted(model[f])
        name = names[int(rng.integers(len(names)))]
        dtype, shape, raw = model[f][name]
        op = rng.choice(["small", "small", "sparse", "full", "shape", "dtype", "move", "new"])
        if op == "small":
            model[f][name] = (dtype, shape, _mutate(rng, raw, dtype, 0.001))
        elif op == "sparse":
            model[f][name] = (dtype, shape, _mutate(rng, raw, dtype, 0.05))
        elif op == "full":
            model[f][name] = (dtype, shape, _mutate(rng, raw, dtype, 1.0))
        elif op == "shape":
            new_shape = (int(rng.integers(1, 40)), int(rng.integers(1, 40)))
            model[f][name] = (dtype, new_shape, _random_value(rng, dtype, new_shape))
        elif op == "dtype":
            new = str(rng.choice([d for d in DTYPES if d != dtype]))
            model[f][name] = (new, shape, _random_value(rng, new, shape))
        elif op == "move":  # to the other file, maybe changed on the way
            other = files[1 - files.index(f)]
            value = model[f].pop(name)
            if rng.random() < 0.5:
                value = (value[0], value[1], _mutate(rng, value[2], value[0], 0.01))
            model[other][name] = value
        else:
            fresh = f"t{int(rng.integers(1000))}"
            new_shape = (int(rng.integers(1, 30)), 24)
            model[f][fresh] = ("F32", new_shape, _random_value(rng, "F32", new_shape))


def _initial(rng: np.random.Generator) -> Model:
    model: Model = {"a.safetensors": {}, "b.safetensors": {}}
    for i in range(6):
        dtype = str(rng.choice(list(DTYPES)))
        shape = (int(rng.integers(8, 48)), 32)
        model[["a.safetensors", "b.safetensors"][i % 2]][f"w{i}"] = (
            dtype,
            shape,
            _random_value(rng, dtype, shape),
        )
    model["a.safetensors"]["zero"] = ("F32", (64,), bytes(256))
    return model


def _file(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> bytes:
    from st_files import st_bytes

    return st_bytes(dict(sorted(tensors.items())))


def _check_chains(manifest: object) -> None:
    from git_theta.chains import MAX_CHAIN
    from git_theta.manifest import Manifest, tensor_nbytes

    assert isinstance(manifest, Manifest)
    for name, entry in manifest.tensors.items():
        assert len(entry.chain) <= MAX_CHAIN, name
        nbytes = tensor_nbytes(entry.dtype, entry.shape)
        assert nbytes is not None
        stored = sum(link.ref.size for link in entry.chain)
        # A base and updates that together stay near the size of a fresh value.
        assert stored <= 2 * nbytes + 200 * len(entry.chain), (name, stored, nbytes)


def test_every_version_of_many_random_save_sequences_rebuilds_exactly(tmp_path: Path) -> None:
    """In process (many sequences): clean both files per save with one identity view, as
    one `git add` does; every version of every file smudges back to its exact bytes."""
    import io

    from git_theta.clean import clean
    from git_theta.identity import INDEX, Known
    from git_theta.manifest import Manifest
    from git_theta.smudge import smudge
    from git_theta.store import ObjectStore

    for seed in range(12):
        rng = np.random.default_rng(seed)
        store = ObjectStore(tmp_path / f"s{seed}")
        model = _initial(rng)
        staged: dict[str, Manifest] = {}
        versions: list[tuple[str, bytes, bytes]] = []  # path, file, manifest bytes
        for _ in range(20):
            _step(rng, model)
            snapshot = dict(staged)

            def load(
                near: str, s: dict[str, Manifest] = snapshot
            ) -> list[tuple[int, str, Manifest]]:
                return [(INDEX, p, m) for p, m in s.items()]

            known = Known(load)
            for path in sorted(model):
                data = _file(model[path])
                sink = io.BytesIO()
                got = clean(io.BytesIO(data), sink, path, store, staged.get(path),
                            show_progress=False, known=known)  # fmt: skip
                assert got is not None
                _check_chains(got)
                staged[path] = got
                versions.append((path, data, sink.getvalue()))
        for path, data, manifest_bytes in versions:
            out = io.BytesIO()
            smudge(io.BytesIO(manifest_bytes), out, path, store, show_progress=False)
            assert out.getvalue() == data, (seed, path)


def test_every_commit_of_a_random_save_sequence_checks_out_exactly(repo: Path) -> None:
    """Real git: each save commits both files; every commit checks out to their sha256."""
    import hashlib

    rng = np.random.default_rng(100)
    model = _initial(rng)
    expected: dict[str, dict[str, str]] = {}
    for i in range(8):
        _step(rng, model)
        for path, tensors in model.items():
            (repo / path).write_bytes(_file(tensors))
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"save {i}")
        rev = git(repo, "rev-parse", "HEAD").stdout.decode().strip()
        expected[rev] = {p: hashlib.sha256(_file(t)).hexdigest() for p, t in model.items()}
    from git_theta.manifest import parse

    for rev, files in expected.items():
        git(repo, "checkout", "-q", rev)
        for path, digest in files.items():
            assert sha256(repo / path) == digest, (rev, path)
            _check_chains(parse(git(repo, "show", f"{rev}:{path}").stdout))


def test_a_verified_but_overlong_chain_of_another_file_is_not_reused(repo: Path) -> None:
    """A committed manifest's chain may rebuild to the right bytes through many full
    values (each dense link replaces the last): reusing it would make every checkout of
    the user's commit decode them all. Only chains within the bounds clean keeps are."""
    from git_theta.chains import MAX_CHAIN, store_value
    from git_theta.repo import Repo

    rng = np.random.default_rng(3)
    mine = rng.standard_normal((64, 64)).astype(np.float32)
    (repo / "other.safetensors").write_bytes(st_from_arrays({"w": mine}))
    git(repo, "add", "other.safetensors")
    hostile = json.loads(git(repo, "show", ":other.safetensors").stdout)
    store = Repo(str(repo)).store
    links = []
    for i in range(2 * MAX_CHAIN):
        value = mine if i == 2 * MAX_CHAIN - 1 else rng.standard_normal((64, 64)).astype(np.float32)
        (link,) = store_value(value.tobytes(), "F32", store)
        links.append(
            {"update": "dense", "codec": link.codec, "oid": link.ref.oid, "size": link.ref.size}
        )
    hostile["tensors"]["w"]["chain"] = links
    data = json.dumps(hostile, indent=1).encode() + b"\n"
    oid = git(repo, "hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
    git(repo, "update-index", "--cacheinfo", f"100644,{oid},other.safetensors")
    git(repo, "commit", "-q", "-m", "hostile")
    (repo / "mine.safetensors").write_bytes(st_from_arrays({"w": mine}))
    git(repo, "add", "mine.safetensors")
    chain = json.loads(git(repo, "show", ":mine.safetensors").stdout)["tensors"]["w"]["chain"]
    assert len(chain) <= MAX_CHAIN
    assert sum(link["size"] for link in chain) <= 2 * mine.nbytes + 4096
