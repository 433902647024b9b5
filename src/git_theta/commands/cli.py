"""``git theta ...``: parse the command line and dispatch; one error handler for all."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

from git_theta import __version__
from git_theta.commands.errors import report

if TYPE_CHECKING:
    import argparse


def _scope_options(p: argparse.ArgumentParser) -> None:
    """--global (the default), --local or --system: which git config a command writes."""
    scope = p.add_mutually_exclusive_group()
    for name in ("global", "local", "system"):
        scope.add_argument(
            f"--{name}", dest="scope", action="store_const", const=name, help=f"{name} config"
        )
    p.set_defaults(scope="global")


def _parser() -> argparse.ArgumentParser:
    import argparse  # not for filter-process (see main)

    from git_theta.commands.help_text import EXAMPLES, describe

    parser = argparse.ArgumentParser(
        prog="git theta",
        description="Version ML model checkpoints in git, tensor by tensor.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"git-theta {__version__}")
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress or summary lines (as GIT_THETA_QUIET=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("install", help="configure git to use git-theta")
    _scope_options(p)
    p.add_argument(
        "--server",
        action="store_true",
        help="hand git's filter work to a warm filter server (off by default; see README)",
    )

    p = sub.add_parser("server", help="the warm filter server: status, or stop them all")
    p.add_argument("action", choices=("status", "stop"))

    p = sub.add_parser("uninstall", help="remove git-theta's git config and hooks")
    _scope_options(p)

    sub.add_parser("doctor", help="show git-theta's set-up here and what is wrong with it")

    p = sub.add_parser("track", help="track checkpoint paths or globs with git-theta")
    p.add_argument("patterns", nargs="+", metavar="PATH_OR_GLOB")

    p = sub.add_parser("migrate", help="rewrite history: Git LFS checkpoints to git-theta and back")
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode, what in (("import", "Git LFS to git-theta"), ("export", "git-theta to Git LFS")):
        m = modes.add_parser(mode, help=f"rewrite checkpoints from {what}")
        m.add_argument(
            "--include",
            action="append",
            default=[],
            metavar="PATTERN",
            help="gitattributes pattern(s) to convert (default: see README, Migrating)",
        )
        m.add_argument("--everything", action="store_true", help="all local branches and tags")
        m.add_argument("refs", nargs="*", metavar="REF", help="branches or tags (default: HEAD's)")

    p = sub.add_parser("add", help="stage checkpoints, choosing how changed tensors are stored")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument(
        "--update-type",
        metavar="TYPE",
        help="auto (default), dense, sparse, delta, low-rank or ia3; overrides .theta-updates",
    )
    p.add_argument(
        "--update-path",
        metavar="FILE",
        help="factors for low-rank (T/R, T/C or a PEFT LoRA adapter) or ia3 (T/ia3)",
    )
    p.add_argument(
        "--update-data",
        metavar="FILE",
        help="an update to add to the staged version: sparse (T/data, T/indices, T/indptr, "
        "T/shape), low-rank (T/R, T/C) or ia3 (T/ia3); the file is rewritten to the result",
    )

    p = sub.add_parser("fetch", help="download the tensor objects of revisions (default HEAD)")
    p.add_argument("revs", nargs="*", metavar="REV")
    p.add_argument("--all", action="store_true", help="every revision in the repository")

    p = sub.add_parser(
        "checkout", help="write checkpoints left as manifests (GIT_THETA_SKIP_SMUDGE) in place"
    )
    p.add_argument("paths", nargs="*", metavar="PATH")
    p.add_argument("--force", action="store_true", help="also overwrite files holding weights")

    p = sub.add_parser("diff", help="tensor-level diff: [REV_A [REV_B]] [PATH...]")
    p.add_argument("args", nargs="*", metavar="REV_OR_PATH")
    p.add_argument("--cached", "--staged", action="store_true", help="index against HEAD")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--stat", action="store_true", help="one line per layer (name prefix)")
    p.add_argument("--filter", metavar="GLOB", help="only tensors whose name matches")

    p = sub.add_parser("diff-driver", help="git's external diff driver (used by git)")
    p.add_argument("args", nargs="*")

    p = sub.add_parser("textconv", help="one line per tensor for git show/log -p (used by git)")
    p.add_argument("file")

    p = sub.add_parser("merge", help="resolve conflicted checkpoints: --strategy S, or --manual")
    p.add_argument("paths", nargs="*", metavar="PATH", help="default: every conflicted path")
    p.add_argument("--strategy", metavar="S", help="ours, theirs, base, average, ties, ...")
    p.add_argument(
        "--param", action="append", default=[], metavar="K=V", help="a strategy parameter"
    )
    p.add_argument(
        "--manual", action="store_true", help="write PATH.theta-{base,ours,theirs} to merge by hand"
    )

    p = sub.add_parser("merge-driver", help="git's merge driver (used by git)")
    p.add_argument("base")
    p.add_argument("ours")
    p.add_argument("theirs")
    p.add_argument("path")

    p = sub.add_parser("ls-files", help="list tracked checkpoints")
    p.add_argument("rev", nargs="?", metavar="REV")

    p = sub.add_parser("show", help="list a version's tensors: [REV:]PATH")
    p.add_argument("spec", metavar="[REV:]PATH")

    p = sub.add_parser(
        "fsck", help="check that every version can be checked out: manifests, objects, hashes"
    )
    p.add_argument("revs", nargs="*", metavar="REV", help="default: every ref and the index")
    p.add_argument("--remote", metavar="NAME", help="also list the objects this remote lacks")

    p = sub.add_parser("prune", help="delete local tensor objects no commit, index or reflog needs")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    p.add_argument("--force", action="store_true", help="prune even a shared lfs.storage")
    p.add_argument(
        "--grace",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="keep unreferenced objects younger than this (default 3600: an add may be "
        "writing the manifest that needs them)",
    )

    p = sub.add_parser("pre-push", help="upload tensor objects (run by the pre-push hook)")
    p.add_argument("remote")
    p.add_argument("url", nargs="?")

    p = sub.add_parser(
        "upload", help="upload the tensor objects of revisions (default: the remote's refs)"
    )
    p.add_argument("remote")
    p.add_argument("revs", nargs="*", metavar="REV")

    sub.add_parser("after-push", help="repair a replaced pre-push hook (run by a hook)")

    sub.add_parser("filter-process", help="git's long-running filter (used by git)")
    for name in ("clean", "smudge"):
        p = sub.add_parser(name, help=f"one-shot {name} filter (used by git)")
        p.add_argument("path", metavar="PATH")
    describe(sub)
    return parser


def _seconds(text: str) -> float:
    """argparse type: a non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def filter_process_command(for_one_command: bool = False) -> int:
    """Serve git's filter requests on stdin/stdout; return the exit code, output flushed.
    ``for_one_command``: set the process up to serve one git command (filter.py)."""
    try:
        # Inside the error handling: importing the filter reads GIT_THETA_KERNELS
        # (kernels.py), whose bad value is one line, not a traceback git shows.
        from git_theta.commands.filter import filter_process

        if for_one_command:
            from git_theta.commands.filter import for_one_command as set_up

            set_up()
        code = filter_process()
    except Exception as exc:
        code = report(exc)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # git closed it already
            stream.flush()
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit code."""
    if (sys.argv[1:] if argv is None else argv) == ["filter-process"]:
        # git starts this for every command that touches a checkpoint; argparse alone
        # costs 15 ms of that start-up.
        # argv None: the real process, not a test calling main()
        code = filter_process_command(for_one_command=argv is None)
        if argv is None:
            # Interpreter teardown (module finalisation, the helper thread) added 20-40 ms
            # to every git command; every file has been answered and closed by now.
            os._exit(code)
        return code
    args = _parser().parse_args(argv)
    if args.quiet:
        os.environ["GIT_THETA_QUIET"] = "1"  # read by progress, here and in git's filters
    try:
        if args.command == "install":
            from git_theta.commands.install import install

            return install(args.scope, args.server)
        if args.command == "server":
            from git_theta.commands import server

            return server.status() if args.action == "status" else server.stop()
        if args.command == "uninstall":
            from git_theta.commands.uninstall import uninstall

            return uninstall(args.scope)
        if args.command == "doctor":
            from git_theta.commands.doctor import doctor

            return doctor()
        if args.command == "track":
            from git_theta.commands.track import track

            return track(args.patterns)
        if args.command == "migrate":
            from git_theta.commands.migrate import migrate_command

            return migrate_command(args.mode, args.include, args.refs, args.everything)
        if args.command == "add":
            from git_theta.commands.add import add

            return add(args.paths, args.update_type, args.update_path, args.update_data)
        if args.command == "fetch":
            from git_theta.commands.remote import fetch

            return fetch(args.revs, args.all)
        if args.command == "checkout":
            from git_theta.commands.remote import checkout

            return checkout(args.paths, args.force)
        if args.command == "diff":
            from git_theta.commands.diff import diff, split_revs

            revs, paths = split_revs(args.args)
            return diff(revs, paths, args.cached, args.json, args.stat, args.filter)
        if args.command == "diff-driver":
            from git_theta.commands.diff import diff_driver

            return diff_driver(args.args)
        if args.command == "textconv":
            from git_theta.commands.textconv import textconv

            return textconv(args.file)
        if args.command == "merge":
            from git_theta.commands.merge import merge_command

            return merge_command(args.paths, args.strategy, args.param, args.manual)
        if args.command == "merge-driver":
            from git_theta.commands.merge import merge_driver

            if argv is None:  # git's merge driver: a process per conflicted file
                from git_theta.commands.filter import for_one_command

                for_one_command()
            return merge_driver(args.base, args.ours, args.theirs, args.path)
        if args.command == "ls-files":
            from git_theta.commands.inspect import ls_files

            return ls_files(args.rev)
        if args.command == "show":
            from git_theta.commands.inspect import show

            return show(args.spec)
        if args.command == "fsck":
            from git_theta.commands.fsck import fsck

            return fsck(args.revs, args.remote)
        if args.command == "prune":
            from git_theta.commands.prune import prune

            return prune(args.dry_run, args.force, args.grace)
        if args.command == "pre-push":
            from git_theta.commands.remote import pre_push

            return pre_push(args.remote, sys.stdin.read().splitlines())
        if args.command == "upload":
            from git_theta.commands.remote import upload_command

            return upload_command(args.remote, args.revs)
        if args.command == "after-push":
            from git_theta.commands.remote import after_push

            return after_push(sys.stdin.read().splitlines())
        if args.command == "filter-process":
            from git_theta.commands.filter import filter_process

            return filter_process()
        if args.command in ("clean", "smudge"):
            from git_theta.commands.filter import one_shot

            return one_shot(args.command, args.path)
    except Exception as exc:
        return report(exc)
    raise AssertionError(f"unhandled command {args.command}")


def entry() -> None:
    sys.exit(main())
