"""pkt-line framing (gitprotocol-common(5)): a 4-hex-digit length, then the payload."""

from __future__ import annotations

import io
import os
from typing import IO

from git_theta import kernels

MAX_PAYLOAD = 65516
FLUSH = b"0000"
_FULL_HEADER = b"%04x" % (MAX_PAYLOAD + 4)
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_IOV_BATCH = 32  # buffers per writev: 16 packets, ~1 MiB, the width of our pipes


def _writev_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    """``os.writev`` until every byte of ``buffers`` is written (writes may be partial)."""
    while buffers:
        done = os.writev(fd, buffers)
        while buffers and done >= len(buffers[0]):
            done -= len(buffers[0])
            buffers = buffers[1:]
        if done:
            buffers[0] = memoryview(buffers[0])[done:]


class ProtocolError(Exception):
    """The peer sent something that is not valid pkt-line data."""


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if data is not None and len(data) == n:
        return data
    # An unbuffered stream (the filter's stdin) may return part of a packet that git
    # wrote in two pieces: only an empty read is the end.
    parts = [data or b""]
    have = len(parts[0])
    while have < n:
        more = stream.read(n - have)
        if not more:
            raise EOFError("pkt-line stream ended early")
        parts.append(more)
        have += len(more)
    return b"".join(parts)


def read_packet(stream: IO[bytes]) -> bytes | None:
    """Return one packet's payload, or None for a flush packet.

    Raises EOFError when the stream ends at a packet boundary or inside a packet.
    """
    size = read_length(stream)
    return None if size is None else _read_exact(stream, size)


def read_length(stream: IO[bytes]) -> int | None:
    """Read a packet's 4-hex-digit length; return its payload size, or None for a flush.

    Raises EOFError when the stream ends there, ProtocolError for a bad length.
    """
    head = stream.read(4)
    if not head:
        raise EOFError("pkt-line stream closed")
    if len(head) != 4:
        try:
            head += _read_exact(stream, 4 - len(head))
        except EOFError:
            raise EOFError("pkt-line stream ended inside a length") from None
    # Exactly four hex digits, as the C reader takes (int() also takes '0x', '+', '_' and
    # spaces: the same stream would be content on one path and an error on the other).
    if head.translate(None, _HEX_DIGITS):
        raise ProtocolError(f"bad pkt-line length {head!r}")
    size = int(head, 16)
    if size == 0:
        return None
    if size < 4 or size - 4 > MAX_PAYLOAD:
        raise ProtocolError(f"bad pkt-line length {size}")
    return size - 4


def read_text_list(stream: IO[bytes]) -> list[str]:
    """Read text packets up to the next flush and return them without trailing newlines."""
    out: list[str] = []
    while (packet := read_packet(stream)) is not None:
        # Paths need not be UTF-8: keep their bytes (as subprocess will pass them back).
        out.append(packet.decode(errors="surrogateescape").rstrip("\n"))
    return out


def write_text(stream: IO[bytes], *lines: str) -> None:
    """Write each line as one text packet, then a flush packet."""
    for line in lines:
        data = (line + "\n").encode()
        stream.write(b"%04x" % (len(data) + 4) + data)
    stream.write(FLUSH)


def write_flush(stream: IO[bytes]) -> None:
    """Write a flush packet."""
    stream.write(FLUSH)


class PacketReader:
    """Reads the content of one request (packets up to a flush) as a byte stream.

    ``read(n)`` returns fewer than ``n`` bytes only at the end of the content. On an
    unbuffered file (the filter's stdin) with the C kernel, ``readinto`` reads packets
    straight into the caller's buffer without the GIL (``_planes.read_packets``).
    """

    def __init__(self, stream: IO[bytes]):
        self._stream = stream
        self._buf = memoryview(b"")
        self._done = False
        self._left = 0  # payload bytes of the packet in progress still on the stream
        native = kernels.native
        self._fd: int | None = None
        # (A kernel built before read_packets, an editable install not rebuilt, lacks it.)
        if type(stream) is io.FileIO and getattr(native, "read_packets", None) is not None:
            self._fd = stream.fileno()  # unbuffered: no bytes of ours sit in a buffer

    def _fill(self) -> bool:
        if self._done:
            return False
        if self._left:  # the rest of a packet read_packets stopped in
            packet: bytes | None = _read_exact(self._stream, self._left)
            self._left = 0
        else:
            packet = read_packet(self._stream)
        if packet is None:
            self._done = True
            return False
        self._buf = memoryview(packet)
        return True

    def readinto(self, out: memoryview) -> int:
        """Fill ``out`` as far as the content allows; return the number of bytes written.

        While ``out`` has room for a whole packet, payloads are read straight into it
        (no intermediate bytes object: this is every byte of every file git adds).
        """
        filled = 0
        if self._buf:
            take = min(len(self._buf), len(out))
            out[:take] = self._buf[:take]
            self._buf = self._buf[take:]
            filled = take
        if self._fd is not None and filled < len(out) and not self._done:
            assert kernels.native is not None
            try:
                read: tuple[int, int, bool] = kernels.native.read_packets(
                    self._fd, out[filled:], self._left
                )
            except ValueError as exc:  # a length that is not one
                raise ProtocolError(str(exc)) from None
            got, self._left, self._done = read
            return filled + got
        while filled < len(out):
            if not self._buf:
                if self._done:
                    break
                if len(out) - filled >= MAX_PAYLOAD and not self._left:
                    size = read_length(self._stream)
                    if size is None:
                        self._done = True
                        break
                    target = out[filled : filled + size]
                    got = 0
                    while got < size:
                        n = self._stream.readinto(target[got:])  # type: ignore[attr-defined]
                        if not n:
                            raise EOFError("pkt-line stream ended early")
                        got += n
                    filled += size
                    continue
                if not self._fill():
                    break
            take = min(len(self._buf), len(out) - filled)
            out[filled : filled + take] = self._buf[:take]
            self._buf = self._buf[take:]
            filled += take
        return filled

    def read(self, n: int = -1) -> bytes:
        """Return up to ``n`` bytes (all remaining when ``n`` < 0)."""
        if n < 0:
            parts = [bytes(self._buf)]
            self._buf = memoryview(b"")
            while self._fill():
                parts.append(bytes(self._buf))
                self._buf = memoryview(b"")
            return b"".join(parts)
        out = bytearray(n)
        got = self.readinto(memoryview(out))
        del out[got:]
        return bytes(out)

    def drain(self) -> None:
        """Discard the rest of the content, up to and including its flush."""
        self._buf = memoryview(b"")
        while self._fill():
            self._buf = memoryview(b"")


class PacketWriter:
    """Writes a byte stream as content packets; ``close`` ends it with a flush.

    On a real file descriptor, full packets go out with ``os.writev`` straight from the
    caller's buffer: one system call per ~1 MiB instead of two per 64 KiB packet.
    """

    def __init__(self, stream: IO[bytes]):
        self._stream = stream
        self._pending = bytearray()
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            self._fd = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        if self._pending:
            take = min(MAX_PAYLOAD - len(self._pending), len(view))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) == MAX_PAYLOAD:
                self._emit(self._pending)
                self._pending = bytearray()
        full = len(view) - len(view) % MAX_PAYLOAD
        if full:
            self._emit_full(view[:full])
            view = view[full:]
        if view:
            self._pending += view
        return total

    def _emit(self, payload: bytes | bytearray | memoryview) -> None:
        self._stream.write(b"%04x" % (len(payload) + 4))
        self._stream.write(payload)

    def _emit_full(self, view: memoryview) -> None:
        """Write ``view`` (a whole number of full packets)."""
        if self._fd is None:
            for pos in range(0, len(view), MAX_PAYLOAD):
                self._emit(view[pos : pos + MAX_PAYLOAD])
            return
        self._stream.flush()
        buffers: list[bytes | memoryview] = []
        for pos in range(0, len(view), MAX_PAYLOAD):
            buffers += [_FULL_HEADER, view[pos : pos + MAX_PAYLOAD]]
        for start in range(0, len(buffers), _IOV_BATCH):
            _writev_all(self._fd, buffers[start : start + _IOV_BATCH])

    def close(self) -> None:
        if self._pending:
            self._emit(self._pending)
            self._pending = bytearray()
        self._stream.write(FLUSH)
