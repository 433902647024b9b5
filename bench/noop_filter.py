"""The floor of any git filter written in Python: a long-running filter process
(gitattributes(5)) that receives each file and answers with a few bytes.

bench/run.py --add-speed sets it as `filter.theta.process` of a repository of its own,
so `git add` of the same checkpoint costs what git, a Python start and the pipe cost and
nothing else: the content is read into one reused buffer (no fresh memory), nothing is
hashed, encoded or stored.

Usage (as git runs it): python -E -P bench/noop_filter.py
"""

from __future__ import annotations

import contextlib
import fcntl
import os

F_SETPIPE_SZ = 1031  # Linux; what git-theta's filter asks for too


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = os.read(fd, n - len(out))
        if not got:
            raise EOFError
        out += got
    return bytes(out)


def _packet(fd: int) -> bytes | None:
    """One packet's payload, or None for a flush."""
    size = int(_read_exact(fd, 4), 16)
    return None if size == 0 else _read_exact(fd, size - 4)


def _until_flush(fd: int) -> list[bytes]:
    out = []
    while (p := _packet(fd)) is not None:
        out.append(p)
    return out


def _send(fd: int, *lines: bytes) -> None:
    data = b"".join(b"%04x" % (len(line) + 4) + line for line in lines) + b"0000"
    while data:
        data = data[os.write(fd, data) :]


def _skip_content(fd: int, buf: memoryview) -> None:
    """Read one request's content packets into ``buf`` over and over, to the flush."""
    while True:
        size = int(_read_exact(fd, 4), 16)
        if size == 0:
            return
        left = size - 4
        while left:
            got = os.readv(fd, [buf[:left]])
            if not got:
                raise EOFError
            left -= got


def main() -> None:
    inp, out = 0, 1
    for fd in (inp, out):
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
    _until_flush(inp)  # git-filter-client, version=2
    _send(out, b"git-filter-server\n", b"version=2\n")
    _until_flush(inp)  # capabilities
    _send(out, b"capability=clean\n", b"capability=smudge\n")
    buf = memoryview(bytearray(1 << 16))
    while True:
        try:
            _until_flush(inp)  # command, pathname
        except EOFError:
            return
        _skip_content(inp, buf)
        _send(out, b"status=success\n")
        _send(out, b"no-op\n")
        _send(out)  # keep status=success


if __name__ == "__main__":
    main()
