"""``git theta track``: route paths through the theta filter in .gitattributes."""

from __future__ import annotations

import sys

from git_theta import git
from git_theta.files import atomic_write, read_capped
from git_theta.hooks import HooksElsewhereError, install_hooks

OURS = ("filter=theta", "diff=theta", "merge=theta", "-text")
_PREFIXES = ("filter=", "diff=", "merge=")
ATTRIBUTES_CAP = 16 << 20  # bytes (git ignores attribute files over 100 MB)
_REPLACED = ("text", "-text", "!text", "filter", "-filter", "diff", "-diff", "merge", "-merge")


def _escape(pattern: str) -> str:
    return pattern.replace(" ", "[[:space:]]")


def _merge_attrs(attrs: list[str]) -> list[str]:
    """Keep the other attributes on the line; replace any filter/diff/text setting."""
    kept = [a for a in attrs if not (a in _REPLACED or a.startswith(_PREFIXES))]
    return kept + list(OURS)


def update_attributes(text: str, pattern: str) -> str:
    """Return .gitattributes ``text`` with ``pattern`` tracked (unchanged if it already is)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if fields and fields[0] == pattern:
            lines[i] = " ".join([pattern, *_merge_attrs(fields[1:])])
            break
    else:
        lines.append(" ".join([pattern, *OURS]))
    return "\n".join(lines) + "\n"


def _lfs_tracked(text: str, pattern: str) -> bool:
    """Whether ``pattern``'s own line in .gitattributes ``text`` gives it Git LFS's filter."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == pattern:
            return "filter=lfs" in fields[1:]
    return False


def track(patterns: list[str]) -> int:
    """Add each pattern (relative to the current directory) to the root .gitattributes.

    Raises NotSetUpError when git-theta's filter is not configured: git would then commit
    the checkpoints' raw bytes.
    """
    from git_theta.setup_check import require_filter

    require_filter()
    top = git.toplevel()
    prefix = git.show_prefix()
    attributes = top / ".gitattributes"
    try:  # committed, so untrusted: a regular file only, of a sane size
        data = read_capped(attributes, ATTRIBUTES_CAP)
    except FileNotFoundError:
        data = b""
    text = data.decode(errors="surrogateescape")  # other lines' bytes go back unchanged
    new = text
    for raw in patterns:
        pattern = _escape(prefix + raw.removeprefix("./"))
        was_lfs = _lfs_tracked(new, pattern)
        new = update_attributes(new, pattern)
        sys.stderr.write(f"git-theta: tracking {pattern}\n")
        if was_lfs:
            sys.stderr.write(
                f"git-theta: {pattern} was tracked by Git LFS (filter=lfs): git-theta "
                "tracks it now. Earlier commits keep their Git LFS versions, which still "
                "check out; to rewrite them as git-theta versions run `git theta migrate "
                f"import --include '{pattern}' --everything`\n"
            )
    if new != text:
        atomic_write(attributes, new.encode(errors="surrogateescape"), within=str(top))
    try:
        install_hooks()
    except HooksElsewhereError as exc:
        sys.stderr.write(f"git-theta: warning: {exc}\n")
    return 0
