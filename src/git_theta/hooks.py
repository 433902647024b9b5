"""Our pre-push hook, chained with whatever hook was there before (Git LFS's, a user's).

A hook that is not ours is kept as ``pre-push.theta-chained`` and run after ours with the
same arguments and input; we never delete or overwrite another tool's hook.
"""

from __future__ import annotations

import contextlib
import os

from git_theta import git
from git_theta.errors import ThetaError

MARKER = "# git-theta pre-push hook"
CHAINED = "pre-push.theta-chained"

SCRIPT = f"""#!/bin/sh
{MARKER}: uploads tensor objects before git updates the remote's refs.
# A hook that was here before is kept as {CHAINED} and runs after this one.
command -v git-theta >/dev/null 2>&1 || {{
  echo "git-theta is not on PATH: tensor objects cannot be uploaded, push refused" >&2
  exit 1
}}
input=$(mktemp) || exit 1
trap 'rm -f "$input"' EXIT
cat >"$input"
git-theta pre-push "$@" <"$input" || exit $?
chained="$(dirname "$0")/{CHAINED}"
if [ -x "$chained" ]; then
  "$chained" "$@" <"$input" || exit $?
fi
"""


class HooksElsewhereError(ThetaError):
    """core.hooksPath points outside the repository: hooks there are not ours to change."""


def install_hooks(cwd: str | None = None) -> str:
    """Install (or refresh) our pre-push hook in the repository; return its path.

    Raises HooksElsewhereError when core.hooksPath points outside the git directory (a
    shared or tracked hooks directory), and ThetaError when a foreign hook is present
    and a chained one already exists, rather than lose either.
    """
    hooks = git.hooks_dir(cwd)
    common = os.path.realpath(git.common_dir(cwd))
    if os.path.commonpath([os.path.realpath(hooks), common]) != common:
        raise HooksElsewhereError(
            f"core.hooksPath is {hooks}, outside this repository; git-theta does not write "
            'there: add `git-theta pre-push "$@"` to that pre-push hook, or pushes will not '
            "upload tensor objects"
        )
    hook = os.path.join(hooks, "pre-push")
    try:
        with open(hook, encoding="utf-8", errors="replace") as fh:
            current: str | None = fh.read()
    except FileNotFoundError:
        current = None
    if current == SCRIPT:
        return hook
    os.makedirs(hooks, exist_ok=True)
    if current is not None and MARKER not in current:
        chained = os.path.join(hooks, CHAINED)
        if os.path.exists(chained):
            raise ThetaError(
                f"{hook} is not git-theta's and {chained} exists too; merge them by hand, "
                "then run `git theta install --local`"
            )
        os.replace(hook, chained)
    # Unique per process: two filters (two git commands) may refresh the hook at once.
    tmp = os.path.join(hooks, f"pre-push.theta-tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(SCRIPT)
        os.chmod(tmp, 0o755)
        os.replace(tmp, hook)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return hook
