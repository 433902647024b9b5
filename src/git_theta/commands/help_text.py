"""What each ``git theta`` subcommand does, and one example: shown by ``-h`` and the man page.

Kept apart from the parser so that the table is one place to read and to check
(tests/test_ux.py requires an entry, with an example, for every subcommand).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

# name -> (what it does, in a sentence or two; an example command line)
ABOUT: dict[str, tuple[str, str]] = {
    "install": (
        "Register git-theta's filter, diff and merge drivers in git's config (your global "
        "config unless --local or --system). Run it once per user; in a repository, "
        "`git theta install --local` also installs the pre-push hook that uploads tensors.",
        "git theta install",
    ),
    "server": (
        "Show the warm filter servers (`git theta install --server`) that are running, "
        "or stop them all.",
        "git theta server status",
    ),
    "uninstall": (
        "Remove the git config keys and hooks that install wrote, putting back hooks it "
        "chained with; keys you set yourself stay.",
        "git theta uninstall --local",
    ),
    "doctor": (
        "Print versions, settings, hooks, git-lfs and the object store, with one "
        "`problem:` line for each fault and the way to fix it (exit 1 if any).",
        "git theta doctor",
    ),
    "track": (
        "Add `PATTERN filter=theta diff=theta merge=theta -text` to .gitattributes, so "
        "git stores matching checkpoints through git-theta.",
        "git theta track '*.safetensors'",
    ),
    "migrate": (
        "Rewrite history: checkpoints stored by Git LFS become git-theta manifests "
        "(import), or the other way round (export). Refuses to rewrite a branch another "
        "worktree has checked out.",
        "git theta migrate import --include '*.safetensors' main",
    ),
    "add": (
        "Run `git add` on checkpoints, storing their changed tensors as TYPE (overriding "
        ".theta-updates). A file git already staged unchanged is staged again, so the "
        "update type really applies.",
        "git theta add model.safetensors --update-type sparse",
    ),
    "fetch": (
        "Download the tensor objects that revisions need (default HEAD) so that they "
        "can be checked out offline; says how many were downloaded and how many were "
        "already present.",
        "git theta fetch origin/main",
    ),
    "checkout": (
        "Write checkpoints that were left as manifests (GIT_THETA_SKIP_SMUDGE=1) to disk, "
        "downloading missing objects; --force also overwrites files that hold weights.",
        "git theta checkout model.safetensors",
    ),
    "diff": (
        "Show which tensors changed between two revisions, the index or the work tree: "
        "dtype and shape, elements changed, size of the change, bytes stored.",
        "git theta diff HEAD~1 HEAD -- model.safetensors",
    ),
    "merge": (
        "Resolve checkpoints a merge left conflicted, tensor by tensor: with a strategy "
        "(ours, theirs, base, average, ties, ...) for the tensors both sides changed, or "
        "--manual to write PATH.theta-{base,ours,theirs} and merge them by hand.",
        "git theta merge --strategy average model.safetensors",
    ),
    "diff-driver": (
        "git's external diff driver for tracked checkpoints (git runs it; not for direct use).",
        "git show --ext-diff HEAD",
    ),
    "textconv": (
        "Print one line per tensor of a manifest, for `git show` and `git log -p` (git "
        "runs it; not for direct use).",
        "git log -p -- model.safetensors",
    ),
    "merge-driver": (
        "git's merge driver: merges two branches of a checkpoint tensor by tensor (git "
        "runs it; not for direct use).",
        "git merge feature",
    ),
    "ls-files": (
        "List the checkpoints git-theta tracks in the work tree's index, or in REV.",
        "git theta ls-files HEAD~1",
    ),
    "show": (
        "List the tensors of one version of a checkpoint, with dtype, shape and how "
        "each is stored.",
        "git theta show HEAD~1:model.safetensors",
    ),
    "fsck": (
        "Check that every version can be checked out: manifests valid, objects present "
        "and intact, every tensor rebuilding to its hash; --remote also lists what that "
        "remote lacks. One line per problem, exit 1 if any.",
        "git theta fsck --remote origin",
    ),
    "prune": (
        "Delete local tensor objects that no commit, index entry or reflog entry needs. "
        "Objects younger than the grace period (--grace SECONDS, default 3600) are kept, "
        "as a git command may be writing the manifest that needs them.",
        "git theta prune --dry-run",
    ),
    "pre-push": (
        "Upload the tensor objects of the commits being pushed (the pre-push hook runs "
        "it; not for direct use).",
        "git push origin main",
    ),
    "upload": (
        "Upload the tensor objects that revisions need (default: the remote's refs) to "
        "the remote's Git LFS server.",
        "git theta upload origin main",
    ),
    "after-push": (
        "Repair a pre-push hook that another tool replaced (a hook runs it; not for direct use).",
        "git push origin main",
    ),
    "filter-process": (
        "git's long-running clean/smudge filter (git runs it; not for direct use).",
        "git add model.safetensors",
    ),
    "clean": (
        "One-shot clean filter: checkpoint on stdin, manifest on stdout (git runs it; "
        "not for direct use).",
        "git theta clean model.safetensors < model.safetensors",
    ),
    "smudge": (
        "One-shot smudge filter: manifest on stdin, checkpoint on stdout (git runs it; "
        "not for direct use).",
        "git cat-file blob HEAD:model.safetensors | git theta smudge model.safetensors",
    ),
}

EXAMPLES = """\
examples:
  git theta install                        # once per user
  git theta track '*.safetensors'          # then git add / commit as usual
  git theta add model.safetensors --update-type sparse
  git theta diff HEAD~1 HEAD               # which tensors changed, and how much

Run `git theta COMMAND -h` for a command's options; `git help theta` for the manual.
"""


def describe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Give every subcommand in ``sub`` its description and example from ABOUT."""
    import argparse
    import contextlib
    import textwrap

    for name, parser in sub.choices.items():
        about = ABOUT.get(name)
        if about is None:  # tests/test_ux.py fails on this: add the command to ABOUT
            continue
        what, example = about
        parser.description = textwrap.fill(what, 79)
        parser.epilog = f"example:\n  {example}"
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        # `git theta fetch -q` as well as `git theta -q fetch`; SUPPRESS keeps the
        # subcommand's default from undoing the top-level flag.
        with contextlib.suppress(argparse.ArgumentError):  # the command has its own -q
            parser.add_argument(
                "-q",
                "--quiet",
                action="store_true",
                default=argparse.SUPPRESS,
                help="no progress or summary lines (as GIT_THETA_QUIET=1)",
            )
