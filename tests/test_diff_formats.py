"""Diffs exact in every format: quantized blocks, compressed npz members, all-zero tensors,
grouping at '/' and the bytes a change really stored."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import git, track
from st_files import st_bytes
from test_diff import theta

from git_theta.commands.cli import main
from git_theta.formats import numpy_npz


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def write_q8(path: Path, blocks: np.ndarray) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("ffn.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_quantized_tensor_counts_blocks_and_their_elements(repo: Path) -> None:
    track(repo, "*.gguf")
    rng = np.random.default_rng(5)
    # 64 rows of 128 Q8_0 blocks (34 bytes for 32 elements): 262,144 elements.
    blocks = rng.integers(0, 256, (64, 128 * 34), dtype=np.uint8)
    write_q8(repo / "m.gguf", blocks)
    commit(repo, "v1")
    changed = blocks.copy()
    changed[:4] = rng.integers(0, 256, (4, 128 * 34), dtype=np.uint8)  # 512 whole blocks
    assert np.count_nonzero(changed != blocks) < 512 * 34  # some bytes happen to be equal
    write_q8(repo / "m.gguf", changed)
    commit(repo, "v2")
    out = theta(repo, "diff", "HEAD~1", "HEAD").stdout
    assert (
        "M ffn.weight  GGML_Q8_0 [64, 4096]  dense+delta  16,384/262,144 in changed blocks " in out
    )
    assert "(512/8,192 Q8_0 blocks, 6.25%)" in out
    assert ": 16,384 of 262,144 parameters (6.25%)" in out
    (entry,) = json.loads(theta(repo, "diff", "--json", "HEAD~1", "HEAD").stdout)["files"][0][
        "tensors"
    ]
    assert (entry["changed"], entry["blocks_changed"], entry["blocks"]) == (16384, 512, 8192)


def test_compressed_npz_member_is_diffed_by_its_values(repo: Path) -> None:
    track(repo, "*.npz")
    w = np.arange(600, dtype=np.float32).reshape(20, 30) / 3
    b = np.ones(7, dtype=np.float16)
    np.savez_compressed(repo / "a.npz", w=w, b=b)
    commit(repo, "v1")
    w2 = w.copy()
    w2[0, :5] += np.float32(1.0)
    np.savez_compressed(repo / "a.npz", w=w2, b=b)
    delta = (w2.astype(np.float64) - w).ravel()
    l2 = float(np.sqrt(delta @ delta))
    rel = l2 / float(np.sqrt(w.astype(np.float64).ravel() @ w.astype(np.float64).ravel()))
    line = f"M w  F32 [20, 30]  deflated  5/600 changed (0.83%)  L2 {l2:.4g}  max 1  rel {rel:.4g}"
    header = "1 of 2 tensors changed: 5 of 607 parameters (0.82%)"
    # Work tree against HEAD (the file is read), through git's diff driver, then committed.
    worktree = theta(repo, "diff").stdout
    assert header in worktree and line in worktree
    assert line in git(repo, "diff").stdout.decode()
    commit(repo, "v2")
    out = theta(repo, "diff", "HEAD~1", "HEAD").stdout
    assert out.splitlines()[1].startswith(header + ", ")
    assert line in out and "1 unchanged tensor" in out
    manifest = json.loads(git(repo, "show", "HEAD:a.npz").stdout)
    (file,) = json.loads(theta(repo, "diff", "--json", "HEAD~1", "HEAD").stdout)["files"]
    assert file["bytes_stored"] == manifest["glue"]["size"]  # the member is in the glue
    (entry,) = file["tensors"]
    assert entry["l2"] == pytest.approx(l2, 1e-12) and entry["changed"] == 5


def test_compressed_member_past_the_inflate_cap_is_named_not_inflated(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    track(repo, "*.npz")
    np.savez_compressed(repo / "z.npz", z=np.zeros(4000, np.float32))
    commit(repo, "v1")
    np.savez_compressed(repo / "z.npz", z=np.ones(4000, np.float32))
    commit(repo, "v2")
    monkeypatch.setattr(numpy_npz, "INFLATE_FLOOR", 1000)
    monkeypatch.setenv("NO_COLOR", "1")
    capsys.readouterr()
    assert main(["diff", "HEAD~1", "HEAD"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("M z")]
    assert line.startswith("M z  F32 [4000]  deflated  not compared: it inflates to 16,128 ")
    assert line.endswith(" bytes from 112, more than git-theta inflates")


def test_a_tensor_that_was_all_zeros_has_no_infinite_relative_change(repo: Path) -> None:
    zeros, new = np.zeros(4, np.float32), np.array([3, 0, 4, 0], np.float32)
    for value in (zeros, new):
        (repo / "m.safetensors").write_bytes(st_bytes({"z": ("F32", (4,), value.tobytes())}))
        commit(repo, "v")
    out = theta(repo, "diff", "HEAD~1", "HEAD").stdout
    assert "M z  F32 [4]  dense  2/4 changed (50.00%)  L2 5  max 4  rel n/a  was all zeros" in out
    assert "inf" not in out
    (entry,) = json.loads(theta(repo, "diff", "--json", "HEAD~1", "HEAD").stdout)["files"][0][
        "tensors"
    ]
    assert (entry["rel"], entry["old_norm"], entry["l2"]) == (None, 0.0, 5.0)
    assert entry["note"] == "was all zeros"
    stat = theta(repo, "diff", "--stat", "HEAD~1", "HEAD").stdout
    assert " z  1 modified, 2 parameters, was all zeros\n" in stat and "inf" not in stat


def _stat_lines(repo: Path) -> list[str]:
    return theta(repo, "diff", "--stat", "HEAD~1", "HEAD").stdout.splitlines()[2:]


def _layers(scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {
        name: (rng.standard_normal(6) * scale).astype(np.float32)
        for name in ("layer/0/w", "layer/0/b", "layer/1/w", "head/w")
    }


def test_stat_groups_npz_names_at_slashes(repo: Path) -> None:
    track(repo, "*.npz")
    for scale in (1.0, 2.0):
        np.savez(repo / "m.npz", **_layers(scale))
        commit(repo, "v")
    assert _stat_lines(repo) == [
        " head  1 modified, 6 parameters, rel 1",
        " layer/0  2 modified, 12 parameters, rel 1",
        " layer/1  1 modified, 6 parameters, rel 1",
    ]


def test_stat_groups_flax_names_below_their_common_root(repo: Path) -> None:
    serialization = pytest.importorskip("flax.serialization")
    track(repo, "*.msgpack")
    for scale in (1.0, 2.0):
        tensors = _layers(scale)
        state = {
            "params": {
                "layer": {str(i): {"w": tensors[f"layer/{i}/w"]} for i in (0, 1)},
                "head": {"w": tensors["head/w"], "b": tensors["layer/0/b"]},
            }
        }
        (repo / "m.msgpack").write_bytes(serialization.to_bytes(state))
        commit(repo, "v")
    assert _stat_lines(repo) == [
        " params/head  2 modified, 12 parameters, rel 1",
        " params/layer/0  1 modified, 6 parameters, rel 1",
        " params/layer/1  1 modified, 6 parameters, rel 1",
    ]


def test_stat_groups_hdf5_names_at_slashes(repo: Path) -> None:
    h5py = pytest.importorskip("h5py")
    track(repo, "*.h5")
    for scale in (1.0, 2.0):
        with h5py.File(repo / "m.h5", "w") as f:
            for name, value in _layers(scale).items():
                f[name] = value
        commit(repo, "v")
    assert _stat_lines(repo) == [
        " head  1 modified, 6 parameters, rel 1",
        " layer/0  2 modified, 12 parameters, rel 1",
        " layer/1  1 modified, 6 parameters, rel 1",
    ]


def _objects(manifest: dict[str, object]) -> set[tuple[str, int]]:
    glue = manifest["glue"]
    assert isinstance(glue, dict)
    out = {(glue["oid"], glue["size"])}
    tensors = manifest["tensors"]
    assert isinstance(tensors, dict)
    for entry in tensors.values():
        out.update((link["oid"], link["size"]) for link in entry["chain"])
    return out


def test_a_tensor_that_moved_between_shards_is_not_stored_for_the_change(repo: Path) -> None:
    rng = np.random.default_rng(8)
    a, b, c = (rng.standard_normal(4096).astype(np.float32).tobytes() for _ in range(3))
    shards = {"s1": {"a": a, "b": b}, "s2": {"c": c}}
    for layout in (shards, {"s1": {"a": a}, "s2": {"b": b, "c": c}}):  # b moves to s2
        for shard, tensors in layout.items():
            body = {name: ("F32", (4096,), data) for name, data in tensors.items()}
            (repo / f"{shard}.safetensors").write_bytes(st_bytes(body))
        commit(repo, "v")
    old, new = (
        set().union(*(
            _objects(json.loads(git(repo, "show", f"{rev}:{s}.safetensors").stdout))
            for s in ("s1", "s2")
        ))
        for rev in ("HEAD~1", "HEAD")
    )  # fmt: skip
    expected = sum(size for _, size in new - old)
    assert expected < 4096  # headers only (b's value is 16 KB)
    report = json.loads(theta(repo, "diff", "--json", "HEAD~1", "HEAD").stdout)
    assert sum(f["bytes_stored"] for f in report["files"]) == expected
    moved = theta(repo, "diff", "HEAD~1", "HEAD", "--", "s2.safetensors").stdout
    assert f", {expected - report['files'][0]['bytes_stored']} B stored for the change" in moved
    # git's driver sees only the file: it counts b's object and says what it counted.
    driver = git(repo, "diff", "HEAD~1", "HEAD", "--", "s2.safetensors").stdout.decode()
    assert " kB new to this file\n" in driver


def test_git_show_measures_a_compressed_npz_member(repo: Path) -> None:
    track(repo, "*.npz")
    np.savez_compressed(repo / "a.npz", w=np.full(4, 2.0, np.float32))
    commit(repo, "v1")
    np.savez_compressed(repo / "a.npz", w=np.full(4, 3.0, np.float32))
    commit(repo, "v2")
    shown = git(repo, "show", "HEAD", "--", "a.npz").stdout.decode()
    assert "-w  F32 [4]  L2 4  " in shown and "+w  F32 [4]  L2 6  " in shown


def test_a_corrupt_compressed_member_is_named_and_the_rest_still_diffed(repo: Path) -> None:
    track(repo, "*.npz")
    w = np.random.default_rng(3).standard_normal(100_000).astype(np.float32)
    np.savez_compressed(repo / "a.npz", w=w, b=np.ones(3))
    commit(repo, "v1")
    np.savez_compressed(repo / "a.npz", w=w * 2, b=np.zeros(3))
    data = bytearray((repo / "a.npz").read_bytes())
    start = data.index(b"w.npy") + 300_000  # past the .npy header, inside w's stream
    data[start : start + 64] = b"\xff" * 64
    (repo / "a.npz").write_bytes(bytes(data))
    out = theta(repo, "diff").stdout
    assert "M b  F64 [3]  deflated  3/3 changed (100.00%)" in out
    (line,) = [x for x in out.splitlines() if x.startswith("M w")]
    assert line.startswith("M w  F32 [100000]  deflated  not compared: npz member 'w' is corrupt")


def test_glue_view_refuses_a_read_larger_than_the_glue() -> None:
    from git_theta.diffing import _GlueView
    from git_theta.errors import CheckpointError

    view = _GlueView(bytearray(b"PK" * 8), [(0, 0, 16)], 1 << 40)  # a 1 TB file, 16 B glue
    assert view.read(16) == b"PK" * 8
    view.seek(0)
    with pytest.raises(CheckpointError, match="outside the file's non-tensor bytes"):
        view.read(1 << 39)


# Hostile npz files (review): a member is inflated only within a budget, and once.
_PEAK = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024}\\n")
sys.stdout.write(f"{done.returncode}\\n{done.stderr}")
"""


def _peak(repo: Path, *argv: str) -> tuple[int, int, str]:
    """Run ``argv`` in ``repo``: (peak RSS in MB of it and its children, exit code, stderr)."""
    import subprocess
    import sys

    env = {**os.environ, "NO_COLOR": "1", "GIT_THETA_SERVER": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, *argv], cwd=repo, capture_output=True, text=True, env=env
    ).stdout
    peak, code, err = out.split("\n", 2)
    return int(peak), int(code), err


def _alias(npz: bytes, name: bytes, alias: bytes) -> bytes:
    """``npz`` with a second central directory entry, ``alias``, for member ``name``'s
    bytes: one deflate stream under two names (``alias`` as long as ``name``)."""
    import struct

    end = npz.rindex(b"PK\x05\x06")
    count, cd_size, cd_offset = struct.unpack_from("<HII", npz, end + 10)
    at = cd_offset
    while npz[at + 46 : at + 46 + len(name)] != name:
        at = npz.index(b"PK\x01\x02", at + 4)
    n_name, n_extra, n_comment = struct.unpack_from("<HHH", npz, at + 28)
    record = npz[at : at + 46 + n_name + n_extra + n_comment].replace(name, alias, 1)
    tail = bytearray(npz[end:])
    struct.pack_into("<HHI", tail, 8, count + 1, count + 1, cd_size + len(record))
    return npz[:end] + record + bytes(tail)


def test_one_compressed_stream_under_many_names_is_refused(repo: Path) -> None:
    track(repo, "*.npz")
    np.savez_compressed(repo / "a.npz", w=np.zeros(1000, np.float32))
    commit(repo, "v1")
    data = (repo / "a.npz").read_bytes()
    for i in range(3):  # each name would inflate the same stream again: a bomb per name
        data = _alias(data, b"w.npy", f"{i}.npy".encode())
    (repo / "a.npz").write_bytes(data)
    expected = "git-theta: error: npz member '0' overlaps 'w': a crafted file\n"
    for argv in (["git", "theta", "diff"], ["git-theta", "textconv", "a.npz"]):
        _, code, err = _peak(repo, *argv)
        assert (code, err) == (1, expected), argv


def test_compressed_members_share_one_inflate_budget_per_file(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    track(repo, "*.npz")
    for fill in (0.0, 1.0):  # four 1 MiB members of ~1 kB each: within 3 MiB, two fit
        np.savez_compressed(
            repo / "z.npz", **{f"m{i}": np.full(1 << 18, fill, np.float32) for i in range(4)}
        )
        commit(repo, "v")
    monkeypatch.setattr(numpy_npz, "INFLATE_FLOOR", 3 << 20)
    monkeypatch.setenv("NO_COLOR", "1")
    capsys.readouterr()
    assert main(["diff", "HEAD~1", "HEAD"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("M m")]
    assert [line.split("  ")[3].startswith("262,144/262,144 changed") for line in lines] == [
        True, True, False, False,
    ]  # fmt: skip
    past = "not compared: it inflates to 1,048,704 bytes, past what git-theta inflates for one"
    assert lines[2].endswith(past + " file") and lines[3].endswith(past + " file")


def test_git_show_of_a_compressed_member_costs_its_bytes_not_copies(repo: Path) -> None:
    track(repo, "*.npz")
    np.savez_compressed(repo / "z.npz", z=np.zeros(24 << 20, np.float32))  # 96 MiB in 94 kB
    peak, code, err = _peak(repo, "git-theta", "textconv", "z.npz")
    assert (code, err) == (0, "")
    assert peak < 96 + 120, f"peak RSS {peak} MB"  # the array once, and the interpreter's


def test_a_glue_object_that_inflates_past_its_bound_is_refused_before_diffing(
    repo: Path,
) -> None:
    from test_hostile_objects import bomb

    from git_theta.content import content_hash_of
    from git_theta.store import ObjectStore

    track(repo, "*.npz")
    np.savez_compressed(repo / "a.npz", w=np.ones(4, np.float32))
    commit(repo, "v1")
    size = 512 << 20  # a 512 MiB glue of zeros in ~25 kB: a diff must not allocate it
    glue = bomb(size)
    oid = ObjectStore(repo / ".git" / "lfs").put([glue]).oid
    manifest = json.loads(git(repo, "show", "HEAD:a.npz").stdout)
    assert manifest["tensors"] == {}  # all its members are compressed: all glue
    manifest.update(size=size, layout=[size])
    manifest["glue"] = {"hash": content_hash_of(bytes, size), "oid": oid, "size": len(glue)}
    text = json.dumps(manifest, indent=1).encode()
    blob = git(repo, "hash-object", "-w", "--no-filters", "--stdin", stdin=text)
    git(repo, "update-index", "--cacheinfo", f"100644,{blob.stdout.decode().strip()},a.npz")
    git(repo, "commit", "-q", "-m", "hostile")
    peak, code, err = _peak(repo, "git", "theta", "diff", "HEAD~1", "HEAD")
    assert peak < 300, f"peak RSS {peak} MB"
    assert code == 1 and err.count("\n") == 1 and "would be rebuilt from" in err, err


def test_float64_values_whose_squares_overflow_have_finite_norms(repo: Path) -> None:
    track(repo, "*.npz")
    np.savez(repo / "m.npz", w=np.array([1e300, 1.0]))
    commit(repo, "v1")
    np.savez(repo / "m.npz", w=np.array([-1e300, 1.0]))
    commit(repo, "v2")
    out = theta(repo, "diff", "HEAD~1", "HEAD").stdout
    assert "M w  F64 [2]  dense  1/2 changed (50.00%)  L2 2e+300  max 2e+300  rel 2\n" in out
    assert (
        " w  1 modified, 1 parameters, rel 2\n"
        in theta(repo, "diff", "--stat", "HEAD~1", "HEAD").stdout
    )
    report = theta(repo, "diff", "--json", "HEAD~1", "HEAD").stdout
    assert "Infinity" not in report and "NaN" not in report
    (entry,) = json.loads(report)["files"][0]["tensors"]
    assert (entry["l2"], entry["old_norm"], entry["rel"]) == (2e300, 1e300, 2.0)
    # git show / git log -p (textconv) print each version's norm: finite too
    shown = git(repo, "show", "HEAD").stdout.decode()
    assert "+w  F64 [2]  L2 1e+300  " in shown and "inf" not in shown


def test_git_diff_counts_a_changed_glue_as_stored(repo: Path) -> None:
    track(repo, "*.npz")
    for value in (2.0, 3.0):  # savez_compressed: every member is glue
        np.savez_compressed(repo / "a.npz", w=np.full(4, value, np.float32))
        commit(repo, "v")
    glue = json.loads(git(repo, "show", "HEAD:a.npz").stdout)["glue"]["size"]
    driver = git(repo, "diff", "HEAD~1", "HEAD").stdout.decode()
    assert f"(100.00%), {glue} B new to this file\n" in driver
    stored = theta(repo, "diff", "HEAD~1", "HEAD").stdout
    assert f"(100.00%), {glue} B stored for the change\n" in stored


def test_an_npz_whose_glue_cannot_be_had_is_not_shown_as_removed_members(repo: Path) -> None:
    import subprocess

    from git_theta.store import ObjectStore

    track(repo, "*.npz")
    for value in (2.0, 3.0):
        np.savez_compressed(repo / "a.npz", w=np.full(4, value, np.float32))
        commit(repo, "v")
    oid = json.loads(git(repo, "show", "HEAD:a.npz").stdout)["glue"]["oid"]
    Path(ObjectStore(repo / ".git" / "lfs").path(oid)).unlink()  # and there is no remote
    done = subprocess.run(
        ["git", "theta", "diff", "HEAD~1", "HEAD"], cwd=repo, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (1, "")
    expected = (
        f"git-theta: error: a.npz: object {oid} (the file's header, which holds its "
        "compressed arrays) is not local and could not be downloaded: run `git theta "
        "fetch` with a Git LFS remote that has it\n"
    )
    assert done.stderr == expected
    # git smudges both versions for its driver first: that names the object too.
    driver = subprocess.run(
        ["git", "diff", "HEAD~1", "HEAD"], cwd=repo, capture_output=True, text=True
    )
    assert driver.returncode != 0 and f"object {oid} for the file's header" in driver.stderr
