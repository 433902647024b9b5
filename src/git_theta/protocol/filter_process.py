"""Git's long-running filter protocol (gitattributes(5), "Long Running Filter Process").

This module knows requests and statuses, not checkpoints: each request's content is handed
to a handler as a readable stream, and what the handler writes goes back to git.
"""

from __future__ import annotations

import contextlib
import fcntl
import sys
from collections.abc import Callable
from typing import IO, Protocol, cast

from git_theta.errors import ThetaError
from git_theta.protocol.pktline import (
    PacketReader,
    PacketWriter,
    ProtocolError,
    read_text_list,
    write_flush,
    write_text,
)


class Source(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...
    def readinto(self, out: memoryview, /) -> int: ...


class Sink(Protocol):
    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...


F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# How a pipe to a peer that went away shows itself: a short read, or a failed write.
_GONE = (EOFError, BrokenPipeError, ConnectionResetError)


class GitGoneError(ThetaError, EOFError):
    """git closed the filter's pipes in the middle of the protocol (killed, or exited)."""


def _gone(path: str) -> GitGoneError:
    during = f" while filtering {path}" if path else ""
    return GitGoneError(f"git closed the filter's pipes{during} (was it killed?); stopped")


# handler(source, sink, pathname); raises to report status=error for this path only.
Handler = Callable[[Source, Sink, str], None]
ErrorReporter = Callable[[BaseException, str], None]


class _Response:
    """Sends ``status=success`` only once the handler writes, so early errors stay clean."""

    def __init__(self, out: IO[bytes]):
        self._out = out
        self._content: PacketWriter | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._content is None:
            write_text(self._out, "status=success")
            self._content = PacketWriter(self._out)
        return self._content.write(data)

    def finish(self) -> None:
        if self._content is None:
            write_text(self._out, "status=success")
            self._content = PacketWriter(self._out)
        self._content.close()
        write_flush(self._out)  # empty list: keep status=success

    def fail(self) -> None:
        if self._content is not None:
            self._content.close()
        write_text(self._out, "status=error")


def _unbuffered(stream: IO[bytes]) -> IO[bytes]:
    """The raw file under ``stream`` (a BufferedReader that has read nothing yet)."""
    raw = getattr(stream, "raw", None)
    return cast(IO[bytes], raw) if raw is not None else stream


def _widen_pipes(*streams: IO[bytes]) -> None:
    """Ask for 1 MiB pipe buffers (Linux): 64 KiB ones make every packet a context switch."""
    for stream in streams:
        # Not a pipe, not Linux, or over the system's limit: keep the default.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fcntl.fcntl(stream.fileno(), F_SETPIPE_SZ, 1 << 20)


def serve(
    handlers: dict[str, Handler],
    on_error: ErrorReporter,
    stdin: IO[bytes] | None = None,
    stdout: IO[bytes] | None = None,
) -> int:
    """Serve git's filter requests until git closes the pipe; return an exit code."""
    # Unbuffered: content packets are then read straight into tensor buffers, without
    # the GIL (PacketReader); nothing has read stdin before, so no bytes are left behind.
    inp = stdin if stdin is not None else _unbuffered(sys.stdin.buffer)
    out = stdout if stdout is not None else sys.stdout.buffer
    _widen_pipes(inp, out)
    try:
        if read_text_list(inp) != ["git-filter-client", "version=2"]:
            raise ProtocolError("unexpected filter handshake from git")
        write_text(out, "git-filter-server", "version=2")
        out.flush()  # git waits for this before it sends its capabilities
        offered = {line.removeprefix("capability=") for line in read_text_list(inp)}
        write_text(out, *(f"capability={c}" for c in ("clean", "smudge") if c in offered))
        out.flush()
    except _GONE:
        raise _gone("") from None
    while True:
        try:
            header = read_text_list(inp)
        except EOFError:
            return 0
        fields = dict(line.split("=", 1) for line in header if "=" in line)
        command = fields.get("command", "")
        path = fields.get("pathname", "")
        source = PacketReader(inp)
        response = _Response(out)
        handler = handlers.get(command)
        try:
            try:
                if handler is None:
                    raise ProtocolError(f"unsupported filter command {command!r}")
                handler(source, response, path)
            except Exception as exc:  # one bad file must not stop the other files
                source.drain()  # EOFError here: git went away, not the file's fault
                if isinstance(exc, _GONE):  # maybe git's pipe, maybe a helper's: ask git
                    response.fail()
                    out.flush()
                    on_error(exc, path)
                    continue
                on_error(exc, path)
                response.fail()
            else:
                source.drain()
                response.finish()
            out.flush()
        except _GONE:  # nobody is left to answer: one line, not one per file
            raise _gone(path) from None
