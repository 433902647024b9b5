"""Hostile manifests committed to a repository, driven through real git: clone, checkout,
diff (the driver), show and log -p (textconv), and git theta's show, diff, ls-files and
fsck each end in one clear line and a non-zero exit, within bounded memory and time, with
nothing written outside the repository.

The manifests are written as blobs directly (``git hash-object -w`` and ``update-index
--cacheinfo``), so no filter cleans them on the way in, as an attacker's would not be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import git
from st_files import f32, st_from_arrays

from git_theta.commands.cli import main
from git_theta.store import ObjectStore

SHAPES = {"emb": (64, 16), "layer.weight": (16, 16), "layer.bias": (16,)}
TIME_LIMIT = 30.0  # seconds per command: each takes well under one when nothing is wrong
MEMORY_LIMIT = 300  # MB of peak RSS for any process (the tensors here are kilobytes)

# Runs ``argv`` and reports the peak RSS of it and everything it waited for (git waits for
# the filter), with a file size limit so that a regression cannot fill the disk.
MEASURE = """
import json, resource, subprocess, sys, time
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))
start = time.monotonic()
try:
    done = subprocess.run(sys.argv[2:], capture_output=True, timeout=float(sys.argv[1]))
    code, out, err = done.returncode, done.stdout, done.stderr
except subprocess.TimeoutExpired as exc:
    code, out, err = "timeout", exc.stdout or b"", exc.stderr or b""
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
sys.stdout.write(json.dumps({"code": code, "seconds": time.monotonic() - start, "peak": peak,
                             "out": out.decode("latin1"), "err": err.decode("latin1")}))
"""


def measured(cwd: Path, *argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(TIME_LIMIT), *argv],
        cwd=cwd,
        capture_output=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def snapshot(*roots: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int, int]]:
    """(size, mtime, mode) of every file and directory under ``roots``, ``skip`` aside."""
    found = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in skip]
            for name in dirnames + filenames:
                st = os.lstat(os.path.join(dirpath, name))
                found[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return found


def theta_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("git-theta")]


class World:
    """A repository with a good version committed and pushed to a ``file://`` origin."""

    def __init__(self, repo: Path, tmp_path: Path, outside: Path):
        self.repo, self.tmp = repo, tmp_path
        self.origin = tmp_path / "origin.git"
        git(tmp_path, "init", "-q", "--bare", str(self.origin))
        git(repo, "remote", "add", "origin", f"file://{self.origin}")
        (repo / "model.safetensors").write_bytes(st_from_arrays(f32(SHAPES, 1)))
        git(repo, "add", "model.safetensors")
        git(repo, "commit", "-q", "-m", "v1")
        git(repo, "push", "-q", "origin", "main")
        self.good: dict[str, Any] = json.loads(git(repo, "show", "HEAD:model.safetensors").stdout)
        self.outside = outside  # where a hostile path would aim (a short path)
        outside.mkdir(exist_ok=True)
        (self.outside / "victim").write_bytes(b"precious\n")

    def commit(self, manifest: bytes) -> None:
        """Commit ``manifest`` as the checkpoint's new version, as an attacker would, and
        push it (without the hook, which would refuse it) for clones."""
        blob = git(self.repo, "hash-object", "-w", "--no-filters", "--stdin", stdin=manifest)
        entry = f"100644,{blob.stdout.decode().strip()},model.safetensors"
        git(self.repo, "update-index", "--cacheinfo", entry)
        git(self.repo, "commit", "-q", "-m", "hostile")
        git(self.repo, "push", "-q", "--no-verify", "origin", "main")

    def store_object(self, data: bytes) -> str:
        """Put ``data`` in the local store and where a push puts it at the origin (git-lfs's
        own layout there); return its oid."""
        oid = ObjectStore(self.repo / ".git" / "lfs").put([data]).oid
        at_origin = self.origin / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
        at_origin.parent.mkdir(parents=True, exist_ok=True)
        at_origin.write_bytes(data)
        return oid


def dump(raw: dict[str, Any]) -> bytes:
    """Serialize like the writer's opening, so is_manifest sees a manifest."""
    rest = json.dumps({k: v for k, v in raw.items() if k != "git-theta"})
    return f'{{\n "git-theta": {json.dumps(raw["git-theta"])}, {rest[1:]}'.encode()


def edit(world: World, change: Callable[[dict[str, Any]], object]) -> bytes:
    raw = json.loads(json.dumps(world.good))
    change(raw)
    return dump(raw)


def first_link(raw: dict[str, Any], name: str = "emb") -> dict[str, Any]:
    link: dict[str, Any] = raw["tensors"][name]["chain"][0]
    return link


def abs_oid(world: World) -> bytes:
    # 64 characters, not hex: os.path.join(root, oid[:2], oid[2:4], oid) is /dev/zero.
    return edit(world, lambda r: first_link(r).update(oid="/dev/" + "/" * 55 + "zero"))


def dots_oid(world: World) -> bytes:
    objects = os.path.dirname(ObjectStore(world.repo / ".git" / "lfs").path("0" * 64))
    target = os.path.relpath(world.outside / "victim", os.path.dirname(os.path.dirname(objects)))
    oid = ("./" * 32 + target)[-64:] if len(target) <= 62 else "../" * 21 + "x"
    return edit(world, lambda r: first_link(r).update(oid=oid))


def fifo_oid(world: World) -> bytes:
    fifo = world.outside / "fifo"
    os.mkfifo(fifo)
    path = str(fifo)
    if len(path) > 63:
        pytest.skip("the temporary directory's path is too long for a 64-character oid")
    oid = "/" * (64 - len(path)) + path  # a FIFO: reading it waits for a writer forever
    return edit(world, lambda r: first_link(r).update(oid=oid))


def negative_glue(world: World) -> bytes:
    def change(raw: dict[str, Any]) -> None:
        raw["layout"][0] = -raw["layout"][0]

    return edit(world, change)


def glue_sum(world: World) -> bytes:
    def change(raw: dict[str, Any]) -> None:
        raw["layout"][0] += 1000
        raw["size"] += 1000  # consistent size, glue object 1000 bytes short

    return edit(world, change)


def glue_sum_and_size(world: World) -> bytes:
    return edit(world, lambda r: r["layout"].__setitem__(0, r["layout"][0] + 1000))


def empty_tensors(world: World) -> bytes:
    return edit(world, lambda r: r.update(tensors=[]))


def bomb(world: World) -> bytes:
    """A real object whose header declares 2 GiB of zeros (in ~110 kB) for a 4 kB tensor."""
    from test_hostile_objects import bomb as make_bomb

    data = make_bomb(2 << 30)
    oid, size = world.store_object(data), len(data)

    def change(raw: dict[str, Any]) -> None:
        first_link(raw).update(oid=oid, size=size)
        raw["tensors"]["emb"]["hash"] = "0" * 64  # changed, so diffs decode it

    return edit(world, change)


def escape_name(world: World) -> bytes:
    def change(raw: dict[str, Any]) -> None:
        name = "\x1b[2J\x1b[31memb\u202e"
        raw["tensors"][name] = raw["tensors"].pop("emb")
        raw["layout"][raw["layout"].index("emb")] = name

    return edit(world, change)


def negative_shape(world: World) -> bytes:
    return edit(world, lambda r: r["tensors"]["emb"].update(shape=[-64, -16]))


def float_shape(world: World) -> bytes:
    return edit(world, lambda r: r["tensors"]["emb"].update(shape=[64.0, 16]))


def huge_shape(world: World) -> bytes:
    return edit(world, lambda r: r["tensors"]["emb"].update(shape=[10**6, 10**6]))


def newer(world: World) -> bytes:
    return edit(world, lambda r: r.update({"git-theta": 2, "chunks": [[1, 2]]}))


def deep(world: World) -> bytes:
    return b'{\n "git-theta": 1, "format": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"


# (make it, the line git-theta says). Most are refused as manifests, before anything is
# read, fetched or written; DECODED ones are valid manifests whose objects lie.
CASES: list[tuple[Callable[[World], bytes], str]] = [
    (abs_oid, "invalid manifest: tensor 'emb': an object's oid is \"/dev//"),
    (dots_oid, "invalid manifest: tensor 'emb': an object's oid is \""),
    (fifo_oid, "invalid manifest: tensor 'emb': an object's oid is \"//"),
    (negative_glue, "invalid manifest: the layout holds a glue length of -"),
    (glue_sum, "bytes; the manifest's layout expects "),
    (glue_sum_and_size, "invalid manifest: the layout's glue"),
    (empty_tensors, "invalid manifest: tensors is not a JSON object"),
    (bomb, "content object declares 2,147,483,648 bytes, more than the 4,096 expected"),
    (escape_name, "invalid manifest: tensor name '\\x1b[2J\\x1b[31memb\\u202e' holds a control"),
    (negative_shape, "invalid manifest: tensor 'emb': the shape has a dimension that is -64"),
    (float_shape, "invalid manifest: tensor 'emb': the shape has a dimension that is 64.0"),
    (huge_shape, "invalid manifest: tensor 'emb': 4,000,000,000,000 bytes, more than git-theta"),
    (newer, "written by a newer git-theta (manifest version 2): upgrade git-theta"),
    (deep, "invalid manifest: JSON nested too deeply"),
]
DECODED = (glue_sum, bomb)


def check_one_clear_line(result: dict[str, Any], expected: str, what: str) -> None:
    assert result["code"] not in (0, "timeout"), f"{what}: {result}"
    assert result["seconds"] < TIME_LIMIT, what
    assert result["peak"] < MEMORY_LIMIT, f"{what}: peak RSS {result['peak']} MB"
    lines = theta_lines(result["err"])
    assert len(lines) == 1 and expected in lines[0], f"{what}: {result['err']}"
    assert "\x1b" not in result["out"] + result["err"], what


@pytest.mark.parametrize(("make", "expected"), CASES, ids=[c[0].__name__ for c in CASES])
def test_hostile_manifest_ends_in_one_clear_line(
    repo: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[World], bytes],
    expected: str,
) -> None:
    monkeypatch.setenv("GIT_THETA_SERVER", "0")  # the filter is git's child: measured too
    world = World(repo, tmp_path, tmp_path_factory.mktemp("o"))
    world.commit(make(world))
    home = Path(os.environ["HOME"])
    clone_dir = tmp_path / "clone"
    before = snapshot(tmp_path, home, world.outside, skip=(repo, clone_dir, world.origin))

    result = measured(tmp_path, "git", "clone", "-q", f"file://{world.origin}", str(clone_dir))
    check_one_clear_line(result, expected, "clone")

    (repo / "model.safetensors").unlink()
    result = measured(repo, "git", "checkout", "--", "model.safetensors")
    check_one_clear_line(result, expected, "checkout")
    assert not (repo / "model.safetensors").exists()

    if make is not glue_sum:  # diffs compare tensors, not the glue
        result = measured(repo, "git", "diff", "HEAD~1", "HEAD")
        check_one_clear_line(result, expected, "diff (driver)")
        result = measured(repo, "git", "log", "-p", "--no-ext-diff", "-1")
        check_one_clear_line(result, expected, "log -p (textconv)")
        commands = [["diff", "HEAD~1", "HEAD"]]
        if make not in DECODED:  # these read manifests, not objects
            commands += [["show", "HEAD:model.safetensors"], ["ls-files", "HEAD"]]
        for argv in commands:
            assert main(argv) != 0, argv
            out, err = capsys.readouterr()
            lines = theta_lines(err)
            assert len(lines) == 1 and expected in lines[0], (argv, err)
            assert "\x1b" not in out + err
    assert main(["fsck"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("HEAD:model.safetensors: ") and expected in out, out
    assert "\x1b" not in out + err and err == ""

    assert snapshot(tmp_path, home, world.outside, skip=(repo, clone_dir, world.origin)) == before
    assert (world.outside / "victim").read_bytes() == b"precious\n"


def test_an_invalid_staged_manifest_does_not_block_adding_a_good_file(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = World(repo, tmp_path, tmp_path / "outside")
    world.commit(empty_tensors(world))
    data = st_from_arrays(f32(SHAPES, 2))
    (repo / "model.safetensors").write_bytes(data)
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "good again")
    (repo / "model.safetensors").unlink()
    git(repo, "checkout", "--", "model.safetensors")
    assert (repo / "model.safetensors").read_bytes() == data
    assert main(["fsck", "HEAD"]) == 1  # the hostile version is still in HEAD's history
    out, _ = capsys.readouterr()
    assert "tensors is not a JSON object" in out


def test_escape_sequences_in_a_work_tree_checkpoint_are_shown_not_run(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from st_files import st_bytes

    evil = "\x1b[2J\x1b]0;pwned\x07layer\u202e.weight"
    shown = "\\x1b[2J\\x1b]0;pwned\\x07layer\\u202e.weight"
    good = st_from_arrays(f32(SHAPES, 1))
    (repo / "model.safetensors").write_bytes(good)
    git(repo, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v1")
    hostile = st_bytes({evil: ("F32", (2,), bytes(8))})
    (repo / "model.safetensors").write_bytes(hostile)

    assert main(["diff"]) == 0
    out, _ = capsys.readouterr()
    assert f"A {shown}  F32 [2]" in out and "\x1b" not in out
    assert main(["textconv", str(repo / "model.safetensors")]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith(f"1 tensors\n{shown}  F32 [2]") and "\x1b" not in out

    done = git(repo, "add", "model.safetensors", check=False)
    assert done.returncode != 0
    err = done.stderr.decode()
    assert theta_lines(err) == [
        f"git-theta: error: model.safetensors: cannot write a valid manifest: tensor name "
        f"'{shown}' holds a control or formatting character"
    ]
    assert "\x1b" not in err
