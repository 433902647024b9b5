"""Our pre-push hook, chained with whatever hook was there before (Git LFS's, a user's).

A hook that is not ours is kept as ``pre-push.theta-chained`` and run after ours with the
same arguments and input; we never delete or overwrite another tool's hook.

Our hook also does Git LFS's work (``git lfs pre-push``), then runs the chained hook unless
it is Git LFS's own (which would do that work twice): once our hook
is in place ``git lfs install`` refuses to add its own ("Hook already exists"), and a
repository whose plain LFS files never reach the remote is broken for everyone who
clones it. ``git lfs install --force`` replaces our hook with Git LFS's; the
next git-theta command or filter run puts ours back in front of it.
"""

from __future__ import annotations

import contextlib
import os

from git_theta import git
from git_theta.errors import ThetaError
from git_theta.files import atomic_write
from git_theta.interpreter import python_argv

MARKER = "# git-theta pre-push hook"
CHAINED = "pre-push.theta-chained"
LFS_CALL = "git lfs pre-push"
WATCH_MARKER = "# git-theta reference-transaction hook"


def _sh_quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"  # shlex.join's rule, without its import


# The hooks run git-theta with the interpreter that wrote them, isolated (interpreter.py:
# git runs hooks in the work tree); a moved or deleted virtualenv says what to do.
PYTHON = python_argv()[0]
THETA = " ".join(_sh_quote(arg) for arg in python_argv("-m", "git_theta"))
GONE = (
    f"git-theta: error: {PYTHON} (the Python git-theta's hooks run) is gone: run "
    "`git theta install` again"
)

# Git's input to a hook is a few lines (one per ref): held in a variable, not a temporary
# file, so an unusable TMPDIR cannot refuse a push or abort a ref update.
_FEED = 'feed() { if [ -n "$input" ]; then printf \'%s\\n\' "$input"; fi; }'

SCRIPT = f"""#!/bin/sh
{MARKER}: uploads tensor objects, then Git LFS objects, before git updates the
# remote's refs. A hook that was here before is kept as {CHAINED} and runs
# after them (not when it is Git LFS's own: this hook did its work).
[ -x {_sh_quote(PYTHON)} ] || {{
  echo {_sh_quote(GONE + "; push refused")} >&2
  exit 1
}}
input=$(cat)
{_FEED}
feed | {THETA} pre-push "$@" || exit $?
if command -v git-lfs >/dev/null 2>&1; then
  feed | {LFS_CALL} "$@" || exit $?
fi
chained="$(dirname "$0")/{CHAINED}"
if [ -x "$chained" ]; then
  # Git LFS's own hook (nothing but `{LFS_CALL}`) did its work above already; any other
  # runs as it would alone (its own pushes must upload Git LFS objects too).
  body=$(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' -e '^command -v git-lfs' "$chained")
  if [ "$body" != '{LFS_CALL} "$@"' ]; then
    feed | "$chained" "$@" || exit $?
  fi
fi
exit 0
"""

# Runs on every ref update, so it costs a shell and a grep unless our pre-push hook is
# gone (`git lfs install --force` replaces it): then it puts it back and, when the update
# is a push's remote-tracking refs, uploads what that push sent without its objects. When
# the hook cannot be put back (another tool's hook and a different chained one), that is
# said once and remembered in CONFLICT, so later commits do not start Python again.
WATCH_CHAINED = "reference-transaction.theta-chained"
CONFLICT = "pre-push.theta-conflict"
WATCH_SCRIPT = f"""#!/bin/sh
{WATCH_MARKER}: puts the pre-push hook back when another tool
# replaced it, and uploads the tensor objects of a push made without it.
# A hook that was here before is kept as {WATCH_CHAINED} and runs first.
hooks=$(dirname "$0")
chained="$hooks/{WATCH_CHAINED}"
if [ "$1" != committed ]; then
  if [ -x "$chained" ]; then exec "$chained" "$@"; fi
  exit 0
fi
input=$(cat)
{_FEED}
if [ -x "$chained" ]; then feed | "$chained" "$@"; fi
grep -qF "{MARKER}" "$hooks/pre-push" 2>/dev/null && exit 0
case $input in
  *" refs/remotes/"*) ;;
  *) [ -e "$hooks/{CONFLICT}" ] && exit 0 ;;
esac
[ -x {_sh_quote(PYTHON)} ] || {{ echo {_sh_quote(GONE)} >&2; exit 0; }}
feed | {THETA} after-push || true
exit 0
"""


class HooksElsewhereError(ThetaError):
    """core.hooksPath points outside the repository: hooks there are not ours to change."""


def runs_theta(hook: str) -> bool:
    """Whether the pre-push hook at ``hook`` runs git-theta's upload (ours, or a line a
    user added to a shared hook)."""
    text = _read(hook) or ""
    return MARKER in text or "git_theta pre-push" in text or "git-theta pre-push" in text


def is_lfs_hook(text: str) -> bool:
    """True when ``text`` is a hook Git LFS wrote: it does nothing but ``git lfs pre-push``
    (any of its versions), so our hook can stand in for it."""
    body = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return (
        bool(body)
        and body[-1] == f'{LFS_CALL} "$@"'
        and all(line.startswith("command -v git-lfs") for line in body[:-1])
    )


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def install_hooks(cwd: str | None = None) -> str:
    """Install (or refresh) our pre-push and reference-transaction hooks; return the
    pre-push hook's path.

    A hook Git LFS put over ours (``git lfs install --force``) is replaced again when a
    chained hook already exists: ours does Git LFS's work. Raises HooksElsewhereError when
    core.hooksPath points outside the git directory (a shared or tracked hooks directory),
    and ThetaError when a foreign hook is present and a different chained one already
    exists, rather than lose either.
    """
    hooks = git.hooks_dir(cwd)
    common = os.path.realpath(git.common_dir(cwd))
    if os.path.commonpath([os.path.realpath(hooks), common]) != common:
        raise HooksElsewhereError(
            f"core.hooksPath is {hooks}, outside this repository; git-theta does not write "
            f'there: add `{THETA} pre-push "$@"` and `{LFS_CALL} "$@"` to that pre-push '
            "hook, or pushes will not upload tensor objects"
        )
    hook = _install(hooks, "pre-push", SCRIPT, MARKER, CHAINED)
    _install(hooks, "reference-transaction", WATCH_SCRIPT, WATCH_MARKER, WATCH_CHAINED)
    with contextlib.suppress(FileNotFoundError):  # in place: nothing to remember any more
        os.unlink(os.path.join(hooks, CONFLICT))
    return hook


def _install(hooks: str, name: str, script: str, marker: str, chained_name: str) -> str:
    hook = os.path.join(hooks, name)
    current = _read(hook)
    if current == script:
        return hook
    os.makedirs(hooks, exist_ok=True)
    if current is not None and marker not in current:
        chained = os.path.join(hooks, chained_name)
        before = _read(chained)
        if before is None:
            os.replace(hook, chained)
        elif before != current and not is_lfs_hook(current):
            raise ThetaError(
                f"{hook} is not git-theta's and {chained} exists too; merge them by hand, "
                "then run `git theta install --local`"
            )
        # else: the chained hook holds it already, or it is Git LFS's (ours does its work)
    # A temporary of its own per writer: two filters (two git commands) may refresh it at once.
    atomic_write(hook, script.encode(), mode=0o755)
    return hook


def remove_hooks(cwd: str | None = None) -> list[str]:
    """Remove our hooks, putting back the hooks they chained to; return what changed.

    A hook that is not ours is left alone.
    """
    hooks = git.hooks_dir(cwd)
    changed = []
    for name, marker, chained_name in (
        ("pre-push", MARKER, CHAINED),
        ("reference-transaction", WATCH_MARKER, WATCH_CHAINED),
    ):
        hook = os.path.join(hooks, name)
        current = _read(hook)
        if current is None or marker not in current:
            continue
        chained = os.path.join(hooks, chained_name)
        if os.path.lexists(chained):
            os.replace(chained, hook)
            changed.append(f"restored {hook} (the hook git-theta had chained)")
        else:
            os.unlink(hook)
            changed.append(f"removed {hook}")
    return changed
