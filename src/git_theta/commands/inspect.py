"""``git theta ls-files`` and ``git theta show``: what is tracked, and what a version holds."""

from __future__ import annotations

import math
import sys

from git_theta import git
from git_theta.display import escape
from git_theta.errors import ManifestError, ThetaError
from git_theta.history import manifests_at, manifests_in_index
from git_theta.manifest import PREFIX, parse
from git_theta.revisions import require


def ls_files(rev: str | None) -> int:
    """List tracked checkpoints (in the index, or in ``rev``) with format and size."""
    found = manifests_in_index() if rev is None else manifests_at(rev)
    for path, m in sorted(found):
        params = sum(math.prod(e.shape) for e in m.tensors.values())
        sys.stdout.write(
            f"{escape(path)}\t{m.format}\t{len(m.tensors)} tensors\t{params:,} parameters\t"
            f"{m.size:,} bytes\n"
        )
    return 0


def show(spec: str) -> int:
    """List the tensors of ``REV:PATH`` (or ``:PATH`` for the index) with their chains."""
    if ":" not in spec:
        spec = f"HEAD:{spec}"
    rev, _, path = spec.partition(":")
    oid = git.git("rev-parse", "--verify", "-q", f"{rev}:{path}", check=False).decode().strip()
    if not oid:
        if rev:
            require([rev])  # a bad revision is that, not a missing file
        where = f"in {rev}" if rev else "in the index"
        raise ThetaError(
            f"{spec}: no such file {where}; see `git theta ls-files{' ' + rev if rev else ''}`"
        )
    blob = git.blobs_starting_with([oid], PREFIX).get(oid)
    if blob is None:
        raise ThetaError(
            f"{spec}: not a git-theta checkpoint (`git theta ls-files` lists them; "
            f"`git show {spec}` shows this file)"
        )
    try:
        m = parse(blob)
    except ManifestError as exc:
        exc.args = (f"{spec}: {exc}",)
        raise
    where = escape(rev) or "the index"
    sys.stdout.write(f"{escape(path)} at {where}: {m.format}, {m.size:,} bytes\n")
    for name in sorted(m.tensors):
        e = m.tensors[name]
        chain = " + ".join(f"{link.update} {link.ref.size:,} B" for link in e.chain)
        shape = ", ".join(map(str, e.shape))
        merged = ""
        if e.merge is not None:  # how a merge made this value (strategy, params, seed)
            params = " ".join(f"{k}={v}" for k, v in e.merge.params)
            merged = "\tmerged: " + escape(f"{e.merge.strategy} {params}".rstrip())
        sys.stdout.write(f"{escape(name)}\t{e.dtype}\t[{shape}]\t{chain}\t{e.hash[:12]}{merged}\n")
    return 0
