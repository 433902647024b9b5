"""Which content objects a Git LFS remote lacks, found without downloading any.

git-lfs 3.3 has no command that asks: ``git lfs push --dry-run`` lists what it would
push without asking the server, ``git lfs fetch --dry-run`` only knows the pointer files
in git's trees, and its downloader (``filter-process``) downloads. So a ``file://``
remote's store is looked at directly (sizes only), and an HTTP(S) remote is asked through
the batch API's download operation, which answers per object with actions or an error
(404: the server does not have it; a 404 for the whole request, as git-lfs reads it, is
"repository or object not found": none of them), 100 objects per request; git's
credential helpers answer when the server asks for authentication. An ``ssh://``
endpoint needs git-lfs's own ``git-lfs-authenticate`` handshake and is not asked.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from git_theta import git
from git_theta.display import quote
from git_theta.errors import CommandError, ThetaError, TransferError
from git_theta.proc import run
from git_theta.store import ObjectRef

BATCH = 100  # objects per batch request (git-lfs's own default)
_MEDIA = "application/vnd.git-lfs+json"
_TIMEOUT = 60


def endpoint(remote: str, cwd: str | None = None) -> str:
    """The Git LFS endpoint URL of ``remote`` as git-lfs resolves it (``git lfs env``).

    Raises ThetaError when git-lfs names none for it.
    """
    try:
        env = run("git", *git.NO_FILTER, "lfs", "env", cwd=cwd).stdout.decode(errors="replace")
    except CommandError as exc:
        raise ThetaError(f"cannot ask git-lfs for the endpoint of {quote(remote)}: {exc}") from None
    default = git.config_get("remote.lfsdefault", cwd) or "origin"
    keys = [f"Endpoint ({remote})="] + (["Endpoint="] if remote == default else [])
    for key in keys:
        for line in env.splitlines():
            if line.startswith(key):
                return line[len(key) :].rsplit(" (auth=", 1)[0]
    raise ThetaError(f"{quote(remote)} is not a remote with a Git LFS endpoint (`git remote -v`)")


def missing_at_remote(
    remote: str, refs: list[ObjectRef], cwd: str | None = None
) -> list[ObjectRef]:
    """Return those of ``refs`` the remote does not have (sorted by oid).

    Raises TransferError when the remote cannot be asked.
    """
    url = endpoint(remote, cwd)
    unique = sorted({ref.oid: ref for ref in refs}.values())
    if url.startswith("file://"):
        from git_theta.transfer import file_store

        store = file_store(url)
        if store is None:
            raise TransferError(f"remote {quote(remote)}: no repository at {url}")
        return [
            ref
            for ref in unique
            if not _has_file(store / ref.oid[:2] / ref.oid[2:4] / ref.oid, ref)
        ]
    if not url.startswith(("http://", "https://")):
        raise TransferError(
            f"remote {quote(remote)}: only file:// and http(s) Git LFS endpoints can be asked "
            f"without downloading ({url.split(':', 1)[0]} is not)"
        )
    missing: list[ObjectRef] = []
    auth: list[str] = []  # filled once the server asks for credentials
    for batch in _batches(unique):
        missing += _ask(url, batch, auth, cwd)
    return missing


def _has_file(path: os.PathLike[str], ref: ObjectRef) -> bool:
    try:
        return os.stat(path).st_size == ref.size
    except OSError:
        return False


def _batches(refs: list[ObjectRef]) -> Iterator[list[ObjectRef]]:
    for i in range(0, len(refs), BATCH):
        yield refs[i : i + BATCH]


def _ask(url: str, refs: list[ObjectRef], auth: list[str], cwd: str | None) -> list[ObjectRef]:
    """One batch request; return the refs the server says it does not have."""
    body = json.dumps({
        "operation": "download",
        "transfers": ["basic"],
        "objects": [{"oid": ref.oid, "size": ref.size} for ref in refs],
    }).encode()  # fmt: skip
    for attempt in range(2):
        headers = {"Accept": _MEDIA, "Content-Type": _MEDIA, **_auth_header(auth)}
        request = urllib.request.Request(f"{url}/objects/batch", body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT) as response:
                answer = json.loads(response.read(64 << 20))
            break
        except urllib.error.HTTPError as exc:
            if exc.code == 401 and attempt == 0 and not auth:
                auth.append(_credentials(url, cwd))
                continue
            if exc.code == 404:  # "repository or object not found": it has none of them
                return refs
            raise TransferError(
                f"{url}: the Git LFS server answered {exc.code} {exc.reason}"
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise TransferError(f"{url}: cannot ask the Git LFS server: {exc}") from None
    else:  # pragma: no cover - the loop breaks or raises
        raise AssertionError
    have = set()
    for obj in answer.get("objects", []) if isinstance(answer, dict) else []:
        if isinstance(obj, dict) and "error" not in obj and "download" in obj.get("actions", {}):
            have.add(obj.get("oid"))
    return [ref for ref in refs if ref.oid not in have]


def _auth_header(auth: list[str]) -> dict[str, str]:
    return {"Authorization": auth[0]} if auth else {}


def _credentials(url: str, cwd: str | None) -> str:
    """A Basic authorization from ``git credential fill`` for ``url`` (it may prompt)."""
    parts = urllib.parse.urlsplit(url)
    query = f"protocol={parts.scheme}\nhost={parts.netloc}\npath={parts.path.lstrip('/')}\n\n"
    try:
        out = run("git", "credential", "fill", stdin=query.encode(), cwd=cwd).stdout.decode()
    except CommandError:
        raise TransferError(
            f"{url}: the Git LFS server wants credentials, and git has none"
        ) from None
    fields = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    token = f"{fields.get('username', '')}:{fields.get('password', '')}".encode()
    return "Basic " + base64.b64encode(token).decode()
