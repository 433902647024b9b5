"""Review R2 (session 5) of the lead's last commits: f28f744 (kept merged values mapped),
74464c6 (NumPy imported on a thread by the merge driver), d44bc0c (the push sha256-checks
what it would send), c23ece7 (a manifest lying about an intact object's size).
Each test asserts the right behaviour, so it fails now."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from conftest import git
from st_files import f32, st_from_arrays

MODEL = "model.safetensors"
SHAPES = {"emb": (64, 16), "bias": (16,)}


def commit(repo: Path, values: dict[str, np.ndarray], message: str) -> None:
    (repo / MODEL).write_bytes(st_from_arrays(values))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", message)


def manifest_at(repo: Path, rev: str) -> dict[str, object]:
    data: dict[str, object] = json.loads(git(repo, "show", f"{rev}:{MODEL}").stdout)
    return data


def first_oid(repo: Path, rev: str, name: str) -> tuple[str, int]:
    link = manifest_at(repo, rev)["tensors"][name]["chain"][0]  # type: ignore[index]
    return link["oid"], link["size"]


def test_a_kept_value_with_a_second_name_is_not_mapped(tmp_path: Path) -> None:
    """f28f744: take() maps the kept file (MAP_SHARED) after its hash check and removes
    its name, trusting that no one else can reach the inode. A second hard link (planted,
    or any other name for it) still can: truncating it after the check kills the
    checkout with SIGBUS when the mapping is written to git (no message, the filter just
    dies), and rewriting it changes bytes already checked. The copy take() made before
    was immune. Right: a file with st_nlink != 1 is not used (or is copied)."""
    script = textwrap.dedent(
        f"""
        import os, types
        from pathlib import Path
        from git_theta import merged_values
        from git_theta.content import content_hash
        from git_theta.store import ObjectStore
        root = Path({str(tmp_path)!r})
        store = ObjectStore(root)
        raw = bytes(range(256)) * 4096
        entry = types.SimpleNamespace(hash=content_hash(raw))
        folder = Path(merged_values._dir(store))
        folder.mkdir(parents=True)
        (folder / entry.hash).write_bytes(raw)
        os.link(folder / entry.hash, root / "other-name")
        value = merged_values.take(store, entry, len(raw))
        os.truncate(root / "other-name", 0)
        assert value is None or bytes(value) == raw, "the checked value changed"
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert done.returncode == 0, f"exit {done.returncode} (-7 is SIGBUS): {done.stderr.decode()}"


def test_a_broken_numpy_leaves_the_merge_driver_one_line(repo: Path, tmp_path: Path) -> None:
    """74464c6: the driver's NumPy thread suppresses only ImportError. A NumPy that fails
    otherwise (RuntimeError 'numpy.core.multiarray failed to import', an OSError from a
    missing BLAS) prints 'Exception in thread theta-numpy:' and a traceback on git's
    stderr, beside whatever the merge then says (the import is run again by the step).
    Right: the thread is silent; only the merge's own one line (if any) is printed."""
    commit(repo, f32(SHAPES, 1), "v1")
    for side in ("base", "ours", "theirs"):
        (tmp_path / side).write_bytes(git(repo, "show", f"HEAD:{MODEL}").stdout)
    fake = tmp_path / "fake" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("numpy.core.multiarray failed")\n')
    argv = ["merge-driver", "--", *(str(tmp_path / s) for s in ("base", "ours", "theirs")), MODEL]
    script = (
        f"import sys; sys.path.insert(0, {str(fake.parent)!r})\n"
        "from git_theta.commands.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, capture_output=True, stdin=subprocess.DEVNULL
    )
    err = done.stderr.decode()
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_a_push_does_not_recheck_objects_the_remote_already_has(repo: Path, tmp_path: Path) -> None:
    """d44bc0c: upload() sha256-checks every local object the new manifests name, not only
    those it may send: objects the remote is known to have (known_remote) are read and
    hashed again on every push, so a one-tensor change to a 10 GB model re-hashes all
    10 GB (~8 s at 1.3 GB/s) and a damaged local copy of an object the remote already
    holds (git-lfs would not send it) refuses the push. Right: check only what is not
    known to be on the remote; this push then succeeds."""
    values = f32(SHAPES, 1)
    commit(repo, values, "v1")
    remote = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", f"file://{remote}")
    git(repo, "push", "-q", "origin", "main")
    oid, _ = first_oid(repo, "HEAD", "bias")  # unchanged by v2, on the remote already
    path = repo / ".git/lfs/theta/objects" / oid[:2] / oid[2:4] / oid
    data = bytearray(path.read_bytes())
    data[7] ^= 0x01  # a copy of its own, never the remote's hard-linked bytes
    path.unlink()
    path.write_bytes(bytes(data))
    values["emb"][0, :4] += 1.0
    commit(repo, values, "v2")
    pushed = git(repo, "push", "-q", "origin", "main", check=False)
    assert pushed.returncode == 0, pushed.stderr.decode()


def test_a_checkout_says_the_manifest_lies_about_an_intact_objects_size(repo: Path) -> None:
    """c23ece7 says 'object X has N bytes; the manifest says M' from store.get, but every
    command checks store.has (size only) first: the checkout says the object 'is not in
    the local Git LFS store and could not be downloaded', fsck 'missing locally', the
    push 'is not in the local store ... run git theta fetch --all', though the object is
    there and intact and no fetch can help. The new message is reached only by the unit
    test calling chains.rebuild directly. Right: the checkout names the size lie."""
    commit(repo, f32(SHAPES, 1), "v1")
    oid, size = first_oid(repo, "HEAD", "emb")
    text = git(repo, "show", f"HEAD:{MODEL}").stdout.decode()
    lying = text.replace(f'"oid": "{oid}", "size": {size}', f'"oid": "{oid}", "size": {size + 1}')
    assert lying != text
    blob = git(repo, "hash-object", "-w", "--no-filters", "--stdin", stdin=lying.encode())
    git(repo, "update-index", "--cacheinfo", f"100644,{blob.stdout.decode().strip()},{MODEL}")
    git(repo, "commit", "-q", "-m", "lying size")
    (repo / MODEL).unlink()
    done = git(repo, "checkout", "--", MODEL, check=False)
    assert done.returncode != 0
    err = done.stderr.decode()
    assert f"has {size:,} bytes; the manifest says {size + 1:,}" in err, err
