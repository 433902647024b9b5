"""Write git-theta(1) from the command-line parser, so the manual cannot drift from ``-h``.

``git theta --help`` and ``git help theta`` run ``man git-theta``. pip installs the page as
``<prefix>/share/man/man1/git-theta.1`` (pyproject's data-files); man finds it because
``<prefix>/bin``, which holds ``git-theta``, is on PATH (man-db derives its search path
from PATH). Regenerate with ``python -m git_theta.manpage > docs/man/git-theta.1``;
tests/test_ux.py checks that the committed page is what this writes.
"""

from __future__ import annotations

import sys


def _roff(text: str) -> str:
    """Escape ``text`` for roff: backslashes, and a leading dot or quote."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(
        "\\&" + line if line.startswith((".", "'")) else line for line in text.splitlines()
    )


def render() -> str:
    """Return the whole man page, in roff."""
    import argparse

    from git_theta import __version__
    from git_theta.commands.cli import _parser
    from git_theta.commands.help_text import ABOUT

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = [
        f'.TH GIT\\-THETA 1 "" "git-theta {__version__}" "Git Manual"',
        ".SH NAME",
        "git\\-theta \\- version ML model checkpoints in git, tensor by tensor",
        ".SH SYNOPSIS",
        ".B git theta",
        "[\\-q] COMMAND [ARGS]",
        ".SH DESCRIPTION",
        _roff(
            "git-theta stores each checkpoint as a small manifest in git and each tensor's "
            "content as a Git LFS object; only the tensors that changed are stored again, "
            "and a checkout gives back the exact file. Plain git commands (add, commit, "
            "diff, checkout, merge, push, clone) work on tracked files; the commands below "
            "add what git alone cannot do."
        ),
        ".SH COMMANDS",
    ]
    for name, command in sub.choices.items():
        what, example = ABOUT.get(name, ("", ""))
        usage = " ".join(command.format_usage().removeprefix("usage: ").split())
        out += [".TP", f".B {_roff(usage)}", _roff(what)]
        if example:
            out += [".RS", ".PP", "Example:", ".B " + _roff(example), ".RE"]
    out += [
        ".SH OPTIONS",
        ".TP",
        ".B \\-q, \\-\\-quiet",
        _roff(
            "No progress or summary lines, as GIT_THETA_QUIET=1 or git's own -q (progress is "
            "also off when stderr is not a terminal)."
        ),
        ".SH ENVIRONMENT",
        ".TP",
        ".B GIT_THETA_UPDATE_TYPE",
        _roff("The update type for a plain git add (as git theta add --update-type)."),
        ".TP",
        ".B GIT_THETA_SKIP_SMUDGE",
        _roff("Clone and check out without downloading weights; see git theta checkout."),
        ".TP",
        ".B GIT_THETA_QUIET",
        _roff("No progress or summary lines (see -q)."),
        ".SH FILES",
        ".TP",
        ".B .theta\\-updates",
        _roff("TENSOR_GLOB UPDATE_TYPE rules, first match wins, at the top of the work tree."),
        ".SH SEE ALSO",
        _roff("git(1), git-lfs(1); docs/messages.md lists every message and what to do."),
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
