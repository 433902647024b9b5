"""``git theta migrate import|export``: rewrite history from Git LFS to git-theta and back."""

from __future__ import annotations

import sys

from git_theta.errors import UsageError


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def patterns(includes: list[str]) -> list[str]:
    """The gitattributes patterns of ``--include`` values (comma-separated lists allowed,
    as `git lfs migrate` takes them; relative to the repository's root)."""
    out = []
    for value in includes:
        for raw in value.split(","):
            pattern = raw.strip().removeprefix("./").replace(" ", "[[:space:]]")
            if pattern and pattern not in out:
                out.append(pattern)
    return out


def migrate_command(mode: str, includes: list[str], refs: list[str], everything: bool) -> int:
    """Run the migration and report it on stderr; return 0.

    Raises UsageError for REF... given with --everything, and what ``migrate.migrate``
    raises (nothing is changed then).
    """
    from git_theta.migrate import migrate

    if everything and refs:
        raise UsageError("name the refs to migrate or give --everything, not both")
    if mode not in ("import", "export"):
        raise UsageError(f"unknown migrate mode {mode!r}: use import or export")
    result = migrate(mode, patterns(includes), refs, everything)
    say = sys.stderr.write
    for name, old, new in result.refs:
        say(f"git-theta: {name}: {old[:12]} -> {new[:12]}\n")
    if result.on_remote:
        say(
            f"git-theta: every commit of {', '.join(result.on_remote)} is on a remote already: "
            "to rewrite published history, run again with --everything (then push --force)\n"
        )
        return 0
    lfs, theta = _mb(result.before), _mb(result.after)
    sizes = (
        f"{lfs} as Git LFS objects -> {theta} as git-theta objects"
        if mode == "import"
        else f"{lfs} as git-theta objects -> {theta} as Git LFS objects"
    )
    say(
        f"git-theta: {_plural(result.commits, 'commit')} rewritten, "
        f"{_plural(result.versions, 'checkpoint version')}: {sizes}\n"
    )
    if result.refs:
        say(
            "git-theta: the old objects stay until no ref or reflog needs them "
            "(`git theta prune`); push rewritten branches with --force\n"
        )
    return 0
