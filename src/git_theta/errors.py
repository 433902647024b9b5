"""The exceptions git-theta raises on purpose.

Every expected failure is a ThetaError: the CLI prints its message as one line on stderr
and exits with its ``exit_code``. Subclasses also inherit the matching built-in so callers
using the library API can catch them the usual way.
"""

from __future__ import annotations


def _rebuilt(cls: type[ThetaError], args: tuple[object, ...], state: dict[str, object]) -> object:
    """Return a ``cls`` with ``args`` and attributes ``state``, its __init__ not called."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ThetaError(Exception):
    """A failure we expected and can explain in one line."""

    exit_code = 1

    def __reduce__(self) -> tuple[object, ...]:
        # copy and pickle (an error crossing from a worker) rebuild an exception by calling
        # its class with its args: a subclass whose __init__ takes other arguments (the
        # command, its exit code...) would turn into a TypeError. Rebuilt as it is instead.
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


class UsageError(ThetaError, ValueError):
    """The command line or a setting is wrong."""

    exit_code = 2


class CheckpointError(ThetaError, ValueError):
    """A checkpoint file is truncated, corrupt or not in a format we read."""


class ManifestError(ThetaError, ValueError):
    """A manifest in git cannot be parsed or is of a newer version."""


class LocalSetupError(ThetaError):
    """git-theta's own settings (.theta-updates) or this machine's set-up (a missing
    optional dependency) keep it from storing a file as asked. Commands that only look
    (git status, git diff) degrade to a lossless choice and warn; storing ones fail."""


class ObjectMissingError(ThetaError, FileNotFoundError):
    """A content object a manifest needs is not in the local store."""


class ObjectCorruptError(ThetaError, ValueError):
    """A content object's bytes do not match its oid or its recorded content hash."""


class TransferError(ThetaError, OSError):
    """Objects could not be moved to or from the Git LFS remote."""


class UnknownPluginError(ThetaError, LookupError):
    """No plugin is registered under the requested key."""


def _program(argv: tuple[str, ...]) -> str:
    """Return the program and its subcommand ("git ls-tree"), skipping ``-c KEY=VALUE``
    and other leading options: the whole command line is internal (it goes to the log)."""
    words = [argv[0]] if argv else ["a command"]
    rest = list(argv[1:])
    while rest:
        word = rest.pop(0)
        if word == "-c":
            if rest:
                rest.pop(0)
        elif not word.startswith("-"):
            words.append(word)
            if words[0] != "git" or word != "lfs":
                break
    return " ".join(words)


def _reason(stderr: bytes, returncode: int) -> str:
    """The line of a failed command's stderr that says why: git's first ``fatal:`` or
    ``error:`` line (its advice follows it, and a last line such as "remove the file
    manually to continue" would mislead), else the last line."""
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return f"exit code {returncode}"
    said = next((ln for ln in lines if ln.startswith(("fatal: ", "error: "))), lines[-1])
    said = said.removeprefix("fatal: ").removeprefix("error: ")
    if "index.lock" in said and "File exists" in said:
        said += (
            " (another git command is running in this repository: let it finish, then try again)"
        )
    return said


class CommandError(ThetaError, RuntimeError):
    """An external command (git, git-lfs) failed."""

    def __init__(self, argv: tuple[str, ...], returncode: int, stdout: bytes, stderr: bytes):
        self.argv = argv
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"{_program(argv)} failed: {_reason(stderr, returncode)}")


NOT_A_REPOSITORY = (
    "not a git repository (or any parent directory): run this inside a repository "
    "(cd into one, or `git init`)"
)


class NotARepositoryError(CommandError):
    """git was asked about a repository, and there is none here."""

    exit_code = 128  # as git's own

    def __init__(self, argv: tuple[str, ...], returncode: int, stdout: bytes, stderr: bytes):
        super().__init__(argv, returncode, stdout, stderr)
        self.args = (NOT_A_REPOSITORY,)


def command_error(
    argv: tuple[str, ...], returncode: int, stdout: bytes, stderr: bytes
) -> CommandError:
    """Return the CommandError for a failed command: NotARepositoryError when git said
    there is no repository here."""
    if argv[:1] == ("git",) and b"fatal: not a git repository" in stderr:
        return NotARepositoryError(argv, returncode, stdout, stderr)
    return CommandError(argv, returncode, stdout, stderr)
