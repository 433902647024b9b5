"""docs/messages.md is every message git-theta can print, read from the source: an error
raised as a ThetaError (or a subclass), a warning or summary line written to stderr. The
page is checked against the source on every run, so a new message cannot go undocumented
and a removed one cannot linger; and each message is checked for what users must never
see (an internal command line, an exception's name, a traceback).

Regenerate the page with: ``python tests/test_messages.py > docs/messages.md``
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "git_theta"
PAGE = ROOT / "docs" / "messages.md"

# What each kind of error means and what to do about it in general (each message says
# its own next step too). A new ThetaError subclass needs a line here.
KINDS: dict[str, tuple[str, str]] = {
    "ThetaError": ("a failure git-theta expected: the line says what and why", "follow the line"),
    "UsageError": (
        "the command line or a setting is wrong (exit 2)",
        "fix the option or setting named",
    ),
    "CheckpointError": (
        "a checkpoint file is truncated, corrupt or not a format git-theta reads",
        "check the file: save or download it again",
    ),
    "LimitExceeded": (
        "a file claims more than git-theta's parsing caps allow (corrupt or crafted)",
        "check where the file came from",
    ),
    "LengthError": (
        "an object declares more bytes than its reader expects",
        "`git theta fsck`, then fetch the object again",
    ),
    "_Truncated": ("a Flax msgpack file ends early", "save the file again"),
    "ManifestError": (
        "a manifest in git cannot be parsed, or is of a newer git-theta",
        "upgrade git-theta, or check the commit",
    ),
    "ObjectMissingError": (
        "a tensor object is not local and could not be downloaded",
        "`git theta fetch`, check the remote and lfs.url",
    ),
    "ObjectCorruptError": (
        "an object's bytes do not match its hash",
        "`git theta fsck`; a fetch replaces the copy moved aside",
    ),
    "ExpansionError": (
        "manifests rebuild far more bytes than their objects hold (a decompression bomb)",
        "do not check out that commit; report where it came from",
    ),
    "TransferError": (
        "objects could not be moved to or from the Git LFS remote; no ref was pushed",
        "push again once the server is reachable",
    ),
    "LfsUnavailableError": (
        "git-lfs is missing or did not start",
        "install git-lfs (apt-get install git-lfs)",
    ),
    "UnknownPluginError": (
        "no format, update type or merge strategy has that name",
        "use one of those the line lists",
    ),
    "CommandError": ("git or git-lfs failed; its own last line is quoted", "follow git's words"),
    "NotARepositoryError": (
        "the command needs a repository and there is none here (exit 128)",
        "cd into a repository or `git init`",
    ),
    "BadRevisionError": (
        "a revision names no branch, tag or commit (exit 128, as git)",
        "check the name: `git branch -a`, `git log --oneline`",
    ),
    "GitObjectError": ("git could not read or write an object", "follow git's words; `git fsck`"),
    "NotSetUpError": (
        "git-theta's filter is not configured, or its program is gone",
        "`git theta install`",
    ),
    "NotImportableError": (
        "the commands install would write could not import this git-theta",
        "install git-theta with pip, then `git theta install`",
    ),
    "HooksElsewhereError": (
        "core.hooksPath points outside the repository",
        "chain git-theta's hook there yourself, as the line says",
    ),
    "IndexBusyError": (
        "another git command holds the index lock (`git theta add --update-type`)",
        "let it finish, then run the command again; remove the lock only if none runs",
    ),
    "UnsafeFileError": (
        "a path is a symlink, FIFO or device, or leaves the repository",
        "replace it with a regular file",
    ),
    "MigrateError": (
        "a history cannot be rewritten as asked; nothing was changed",
        "follow the line (branch names, --include)",
    ),
    "PruneRefusedError": (
        "pruning now could delete an object something needs; nothing was deleted",
        "retry when the other command is done, or as the line says",
    ),
    "MergeError": ("two versions of a tensor cannot be merged as asked", "choose another strategy"),
    "MergeTypeError": (
        "the strategy cannot compute with the tensor's dtype",
        "use ours, theirs or base for it",
    ),
    "MergeBaseMissingError": (
        "the strategy needs the common ancestor's tensor and there is none",
        "use a strategy without a base",
    ),
    "MergeShapeError": (
        "the versions differ in size, so no element-wise merge exists",
        "use ours or theirs for it",
    ),
    "MergeConflictError": (
        "tensors stay in conflict after `git theta merge`",
        "resolve the named tensors",
    ),
    "NotTrackedError": ("the path is not tracked by git-theta", "`git theta track PATH`"),
    "LocalSetupError": (
        "git-theta's settings or a missing optional dependency stop a store; status and "
        "diff degrade and warn",
        "fix the file or install what the line names",
    ),
    "UpdateDataError": (
        "an --update-data file is unreadable or does not fit the checkpoint",
        "check the file against the tensors named",
    ),
    "GitGoneError": (
        "git closed the filter's pipes mid-protocol (killed or exited)",
        "rerun the git command",
    ),
}

# Never in a message a user reads (an internal command line, an exception's name).
FORBIDDEN = re.compile(
    r"filter\.theta\.process=|`git -c |Traceback|__name__|\bfailed with exit code\b"
)


def _theta_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """Names of ThetaError and every class deriving from it, across src/."""
    names = {"ThetaError"}
    grew = True
    while grew:
        grew = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names:
                    bases = {
                        b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                        for b in node.bases
                    }
                    if bases & names:
                        names.add(node.name)
                        grew = True
    return names


def _template(node: ast.expr) -> str | None:
    """A message's text with ``{}`` for what is filled in at run time; None when the
    whole message is computed elsewhere."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        return None if not text.strip("{}: ") else text
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        return (left or "{}") + (right or "{}") if left or right else None
    return None


@functools.cache
def collect() -> tuple[list[tuple[str, str, str]], set[str]]:
    """Return (file, kind, template) of every message in src/, sorted, and the kinds."""
    trees = {p: ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}
    kinds = _theta_classes(trees)
    found: set[tuple[str, str, str]] = set()
    for path, tree in trees.items():
        where = str(path.relative_to(SRC))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name in kinds and node.exc.args:
                    text = _template(node.exc.args[0])
                    found.add((where, name, text if text is not None else "(computed)"))
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                text = _template(node.args[0])
                if text is None:
                    continue
                if name == "write" and text.startswith("git-theta: "):
                    kind = (
                        "error line"
                        if "error:" in text[:30]
                        else "warning"
                        if "warning:" in text[:30]
                        else "summary"
                    )
                    found.add((where, kind, text.rstrip("\n")))
                elif name == "summary":
                    found.add((where, "summary", "git-theta: " + text))
    return sorted(found), kinds


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'").replace("\n", " ") + "`"


def render() -> str:
    """Return docs/messages.md as it must be."""
    messages, kinds = collect()
    out = [
        "# Messages",
        "",
        "Every line git-theta can print, read from the source by `tests/test_messages.py`",
        "(which fails when this page and the source disagree; regenerate it with",
        "`python tests/test_messages.py > docs/messages.md`). An error is one line on",
        "stderr, `git-theta: error: [PATH: ]MESSAGE`, saying what is wrong and what to do",
        "next, with a non-zero exit (1 unless the kind says otherwise); `{}` below stands for",
        "a file, tensor, revision, number or git's own words, filled in at run time.",
        "",
        "Outside the table: a closed output pipe (`| head`, a pager quit) is silent, exit 0;",
        "an unexpected failure is `git-theta: internal error: ...` with the traceback in the",
        "log it names (exit 70): please report it. git's -q, `git theta -q`, `GIT_THETA_QUIET=1`",
        "or a pipe silence progress lines; -q and `GIT_THETA_QUIET` also silence summaries.",
        "",
        "## Kinds of error",
        "",
        "| kind | what it means | what to do |",
        "|---|---|---|",
    ]
    for kind in sorted(kinds):
        meaning, todo = KINDS.get(kind, ("(undocumented)", "(undocumented)"))
        out.append(f"| {kind} | {meaning} | {todo} |")
    out += ["", "## Every message", "", "| message | kind | where |", "|---|---|---|"]
    for where, kind, text in messages:
        out.append(f"| {_cell(text)} | {kind} | {where} |")
    return "\n".join(out) + "\n"


def test_the_page_lists_every_message_in_the_source() -> None:
    assert PAGE.read_text() == render(), "run: python tests/test_messages.py > docs/messages.md"


def test_every_kind_of_error_says_what_it_means_and_what_to_do() -> None:
    _, kinds = collect()
    assert sorted(kinds - set(KINDS)) == [], "add a line to KINDS in tests/test_messages.py"


def test_no_message_shows_an_internal_command_line_or_an_exception_name() -> None:
    messages, _ = collect()
    bad = [(where, text) for where, _, text in messages if FORBIDDEN.search(text)]
    assert bad == []
    several = [(where, text) for where, _, text in messages if "\n" in text.rstrip("\n")]
    assert several == [], "a message is one line"


if __name__ == "__main__":
    sys.stdout.write(render())
