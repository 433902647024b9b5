"""What every git command that touches a checkpoint pays before the filter's first file:
the modules the real filter process imports, the source text it compiles and the
processes it starts, for an add (new, changed, unchanged file) and a checkout."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import git
from st_files import f32, st_from_arrays

from git_theta.records import NamedTuple as Record

SHAPES = {"embed": (64, 32), "layer.weight": (32, 32), "layer.bias": (32,), "head": (32, 4)}

# Run as the filter with -E -P, as `git theta install` sets it up: records, at exit, every
# module imported, every source text compiled, every process started and the imports and
# starts in the order they happened (the audit hook sees the helper thread's too).
RECORDER = """
import json, os, sys, runpy
seen, compiled, started, order = set(sys.modules), [], [], []
def hook(event, args):
    if event == "import" and args[0] not in seen:
        seen.add(args[0])
        order.append("import " + args[0])
    elif event == "compile":
        text = args[0] if isinstance(args[0], str) else bytes(args[0]).decode()
        frame = sys._getframe(1)
        while frame is not None and "git_theta" not in frame.f_code.co_filename:
            frame = frame.f_back
        compiled.append((text, os.path.basename(frame.f_code.co_filename) if frame else ""))
    elif event in ("os.posix_spawn", "subprocess.Popen", "os.fork", "os.exec"):
        argv = [str(a) for a in args[1]] if event != "os.fork" else ["fork"]
        started.append(argv)
        order.append("start " + " ".join(argv))
sys.addaudithook(hook)
real_exit = os._exit
def record_and_exit(code):
    with open(os.environ["THETA_STARTUP_RECORD"], "a") as out:
        out.write(json.dumps({"modules": sorted(sys.modules), "compiled": compiled,
                              "started": started, "order": order}) + "\\n")
    real_exit(code)
os._exit = record_and_exit
sys.argv[0] = "git_theta"
runpy.run_module("git_theta", run_name="__main__", alter_sys=True)
"""

# Modules the filter does without (docs/architecture.md, "Start-up"): NumPy (0.12 s);
# dataclasses and inspect (~20 ms); importlib.metadata (the entry-point scan);
# subprocess, pathlib, concurrent.futures, tempfile, logging (4-7 ms each); urllib and
# ipaddress (pathlib's, or transfer.py's, which only a download needs); argparse (15 ms).
HEAVY = (
    "numpy", "dataclasses", "inspect", "importlib.metadata", "subprocess", "pathlib",
    "concurrent.futures", "tempfile", "logging", "urllib.parse", "ipaddress", "argparse",
    "git_theta.transfer",
)  # fmt: skip
# What sniffing a safetensors file against the formats before it used to import (~1.5 ms).
SNIFFED_BEFORE = (
    "git_theta.formats.gguf", "git_theta.formats.hdf5", "git_theta.formats.numpy_npy",
    "git_theta.formats.zip_index",
)  # fmt: skip


Run = dict[str, Any]  # one filter process's record: modules, compiled, started, order


def _records(path: Path) -> list[Run]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines]


@pytest.fixture
def recorded(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``repo`` with its filter run under RECORDER; returns the file it appends to."""
    import compileall

    import git_theta

    # Bytecode as an install writes it: a module compiled from source (a fresh clone,
    # PYTHONDONTWRITEBYTECODE, a file just edited) would be counted as a compile.
    compileall.compile_dir(os.path.dirname(git_theta.__file__), quiet=1)
    script = tmp_path / "record_filter.py"
    script.write_text(RECORDER)
    out = tmp_path / "startup.jsonl"
    monkeypatch.setenv("THETA_STARTUP_RECORD", str(out))
    command = " ".join([sys.executable, "-E", "-P", str(script), "filter-process"])
    git(repo, "config", "filter.theta.process", command)
    return out


def _run(repo: Path, out: Path, *args: str) -> Run:
    """Run ``git ARGS`` in ``repo`` and return what its one filter process recorded."""
    before = len(_records(out))
    git(repo, *args)
    runs = _records(out)[before:]
    assert len(runs) == 1, f"git {' '.join(args)} ran {len(runs)} filter processes"
    return runs[0]


def _git_calls(run: Run) -> list[str]:
    """The git subcommands the filter ran (options such as NO_FILTER's -c left out)."""
    calls = []
    for argv in run["started"]:
        assert os.path.basename(argv[0]) == "git", f"the filter started {argv}"
        words = iter(argv[1:])
        for word in words:
            if word in ("-c", "-C"):
                next(words)
            elif not word.startswith("-"):
                calls.append(word)
                break
    return sorted(calls)


def _compiled(run: Run) -> list[list[str]]:
    """(text, module) of what the filter compiled, collections.namedtuple's own eval of
    its __new__ (cheap) left out: any compile() (typing's ForwardRef of a NamedTuple
    field) builds the AST types first, 1.5 ms."""
    return [[text, where] for text, where in run["compiled"] if not text.startswith("lambda _cls")]


def test_an_add_and_a_checkout_start_light(repo: Path, recorded: Path) -> None:
    """New file, changed file, unchanged file (re-cleaned, as `git status` does after a
    touch), checkout: none imports a heavy module or compiles source text, an add runs
    three git commands (repository, lfs.storage, the staged manifest) and a checkout two,
    and the staged manifest's is started before the clean's imports (read after them)."""
    model = repo / "model.safetensors"
    arrays = f32(SHAPES, seed=3)
    model.write_bytes(st_from_arrays(arrays))
    runs = {"new": _run(repo, recorded, "add", "model.safetensors")}
    git(repo, "commit", "-q", "-m", "v1")
    arrays["head"] = arrays["head"] + np.float32(1e-3)
    model.write_bytes(st_from_arrays(arrays))
    runs["changed"] = _run(repo, recorded, "add", "model.safetensors")
    git(repo, "commit", "-q", "-m", "v2")
    os.utime(model, (5, 5))
    runs["unchanged"] = _run(repo, recorded, "add", "model.safetensors")
    model.unlink()
    runs["checkout"] = _run(repo, recorded, "checkout", "--", "model.safetensors")
    assert model.read_bytes() == st_from_arrays(arrays)

    # Every add: the repository's directories, lfs.storage, the staged manifest. A new
    # file's tensors are looked for in the other manifests too (identity.py): the
    # index's and HEAD's blobs, their sizes, then their contents.
    start_up = ["config", "rev-parse"]
    calls = {
        "new": [*start_up, "cat-file", "ls-files", "ls-tree", "cat-file", "cat-file"],
        "changed": [*start_up, "cat-file"],
        "unchanged": [*start_up, "cat-file"],
        "checkout": start_up,
    }
    for what, run in runs.items():
        assert sorted(set(HEAVY) & set(run["modules"])) == [], what
        assert _compiled(run) == [], what
        assert _git_calls(run) == sorted(calls[what]), what
    for what in ("new", "changed", "unchanged"):
        assert sorted(set(SNIFFED_BEFORE) & set(runs[what]["modules"])) == [], what
        order = runs[what]["order"]
        cat_file = next(i for i, e in enumerate(order) if e.startswith("start") and "cat-file" in e)
        assert cat_file < order.index("import git_theta.clean"), what
    # The changed file's clean encoded a tensor; the checkout decoded them.
    assert "zstandard" in runs["changed"]["modules"]
    assert "git_theta.smudge" in runs["checkout"]["modules"]


class _Pair(Record):
    """Two values."""

    left: str
    right: tuple[int, ...] | None = None

    def both(self) -> str:
        return f"{self.left}{self.right}"


def test_a_record_is_typing_namedtuple_without_its_compiles() -> None:
    pair = _Pair("a", (1, 2))
    assert tuple(pair) == ("a", (1, 2)) and isinstance(pair, tuple)
    assert tuple(_Pair("b")) == ("b", None) and _Pair._field_defaults == {"right": None}
    assert repr(pair) == "_Pair(left='a', right=(1, 2))"
    assert pair._replace(right=None).both() == "aNone"
    assert pair._asdict() == {"left": "a", "right": (1, 2)}
    assert _Pair._fields == ("left", "right") and _Pair.__doc__ == "Two values."
    assert _Pair.__module__ == __name__ and _Pair.__qualname__ == "_Pair"
    assert _Pair.__annotations__ == {"left": "str", "right": "tuple[int, ...] | None"}
    assert pickle.loads(pickle.dumps(pair)) == pair
    with pytest.raises(TypeError, match="without a default follows one with a default"):

        class _Bad(Record):  # as typing's, and mypy's error
            first: int = 0
            second: int  # type: ignore[misc]


@pytest.mark.parametrize("key", ["gguf", "hdf5", "npy"])
def test_no_signature_sniffed_after_safetensors_passes_its_sniff(key: str) -> None:
    """safetensors is sniffed before gguf, hdf5 and npy (formats._BUILT_IN), so that a
    safetensors add never imports them: no file of theirs may pass its sniff, whatever
    follows the signature (its length field reads each signature as over 100 MB)."""
    from git_theta.formats import _BUILT_IN, FORMATS

    keys = [k for k, _ in _BUILT_IN]
    assert keys.index("safetensors") < keys.index(key)
    signature = {"gguf": b"GGUF", "hdf5": b"\x89HDF\r\n\x1a\n", "npy": b"\x93NUMPY"}[key]
    rng = np.random.default_rng(7)
    for i in range(2000):
        head = bytearray(signature + rng.bytes(64))
        if i % 2:  # the smallest length field the signature allows
            head[len(signature) : 8] = bytes(8 - len(signature))
        head[8:9] = b"{"
        assert FORMATS.get(key).sniff(bytes(head), "x"), key
        assert not FORMATS.get("safetensors").sniff(bytes(head), "x.safetensors"), head[:9]
