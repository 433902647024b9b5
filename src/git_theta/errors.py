"""The exceptions git-theta raises on purpose.

Every expected failure is a ThetaError: the CLI prints its message as one line on stderr
and exits with its ``exit_code``. Subclasses also inherit the matching built-in so callers
using the library API can catch them the usual way.
"""

from __future__ import annotations


class ThetaError(Exception):
    """A failure we expected and can explain in one line."""

    exit_code = 1


class UsageError(ThetaError, ValueError):
    """The command line or a setting is wrong."""

    exit_code = 2


class CheckpointError(ThetaError, ValueError):
    """A checkpoint file is truncated, corrupt or not in a format we read."""


class ManifestError(ThetaError, ValueError):
    """A manifest in git cannot be parsed or is of a newer version."""


class ObjectMissingError(ThetaError, FileNotFoundError):
    """A content object a manifest needs is not in the local store."""


class ObjectCorruptError(ThetaError, ValueError):
    """A content object's bytes do not match its oid or its recorded content hash."""


class TransferError(ThetaError, OSError):
    """Objects could not be moved to or from the Git LFS remote."""


class UnknownPluginError(ThetaError, LookupError):
    """No plugin is registered under the requested key."""


class CommandError(ThetaError, RuntimeError):
    """An external command (git, git-lfs) failed."""

    def __init__(self, argv: tuple[str, ...], returncode: int, stdout: bytes, stderr: bytes):
        self.argv = argv
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        detail = stderr.decode(errors="replace").strip().splitlines()
        last = detail[-1] if detail else "no output"
        super().__init__(f"`{' '.join(argv)}` failed with exit code {returncode}: {last}")
