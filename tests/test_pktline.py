from __future__ import annotations

import io
import os
import random
import tempfile
from pathlib import Path

import pytest

from git_theta import kernels
from git_theta.protocol.pktline import (
    MAX_PAYLOAD,
    PacketReader,
    PacketWriter,
    ProtocolError,
    _writev_all,
    read_packet,
    read_text_list,
    write_text,
)


def test_text_list_round_trip() -> None:
    buf = io.BytesIO()
    write_text(buf, "git-filter-server", "version=2")
    assert buf.getvalue() == b"0016git-filter-server\n000eversion=2\n0000"
    buf.seek(0)
    assert read_text_list(buf) == ["git-filter-server", "version=2"]


@pytest.mark.parametrize("size", [0, 1, MAX_PAYLOAD - 1, MAX_PAYLOAD, MAX_PAYLOAD + 1, 300_001])
def test_content_round_trip_splits_packets(size: int) -> None:
    data = bytes(i % 251 for i in range(size))
    buf = io.BytesIO()
    writer = PacketWriter(buf)
    for i in range(0, size, 7000):  # odd write sizes straddle packet borders
        writer.write(data[i : i + 7000])
    writer.close()
    buf.seek(0)
    reader = PacketReader(buf)
    assert reader.read(10) + reader.read() == data
    assert buf.read() == b""


def test_bad_length_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="bad pkt-line length"):
        read_packet(io.BytesIO(b"zzzz"))
    with pytest.raises(EOFError):
        read_packet(io.BytesIO(b"0010abc"))


def _write_through_file(chunks: list[bytes]) -> bytes:
    """Write ``chunks`` with a PacketWriter on a real file descriptor (the writev path)."""
    with tempfile.TemporaryFile() as fh:
        stream = os.fdopen(os.dup(fh.fileno()), "wb")
        stream.write(b"0012status=success\n")  # buffered bytes must go out first
        writer = PacketWriter(stream)
        for chunk in chunks:
            writer.write(chunk)
        writer.close()
        stream.close()
        fh.seek(0)
        return fh.read()


def test_writev_path_gives_the_same_packets_as_buffered_writes() -> None:
    rng = random.Random(3)
    data = rng.randbytes(3 * 1024 * 1024 + 12345)
    sizes = [0, 1, MAX_PAYLOAD, 5 * MAX_PAYLOAD + 3, 2 * 1024 * 1024, 17, 400_000]
    chunks, pos = [], 0
    for size in sizes:
        chunks.append(data[pos : pos + size])
        pos += size
    chunks.append(data[pos:])
    through_fd = _write_through_file(chunks)
    buf = io.BytesIO()
    buf.write(b"0012status=success\n")
    writer = PacketWriter(buf)
    for chunk in chunks:
        writer.write(chunk)
    writer.close()
    assert through_fd == buf.getvalue()
    reader = PacketReader(io.BytesIO(through_fd[len(b"0012status=success\n") :]))
    assert reader.read() == data


def test_writev_all_resumes_after_partial_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev
    calls = []

    def short_writev(fd: int, buffers: list[bytes | memoryview]) -> int:
        # A pipe may accept part of a write (a signal, a full pipe): take 1000 bytes at most.
        joined = b"".join(bytes(b) for b in buffers)[:1000]
        calls.append(len(joined))
        return real(fd, [joined])

    monkeypatch.setattr(os, "writev", short_writev)
    parts: list[bytes | memoryview] = [b"a" * 700, memoryview(b"b" * 2500), b"", b"c" * 10]
    with tempfile.TemporaryFile() as fh:
        _writev_all(fh.fileno(), list(parts))
        fh.seek(0)
        assert fh.read() == b"a" * 700 + b"b" * 2500 + b"c" * 10
    assert calls == [1000, 1000, 1000, 210]


def test_readinto_large_buffers_reads_payloads_in_place() -> None:
    data = random.Random(5).randbytes(5 * MAX_PAYLOAD + 777)
    buf = io.BytesIO()
    writer = PacketWriter(buf)
    writer.write(data)
    writer.close()
    stream = io.BytesIO(buf.getvalue())
    reader = PacketReader(stream)
    got = bytearray(reader.read(10))  # leaves part of a packet buffered
    out = bytearray(2 * MAX_PAYLOAD + 5)  # room for whole packets: the in-place path
    while n := reader.readinto(memoryview(out)):
        got += out[:n]
    assert got == data
    assert stream.read() == b""  # the flush was consumed, nothing more

    cut = io.BytesIO(buf.getvalue()[: 4 + MAX_PAYLOAD // 2])  # ends inside a payload
    with pytest.raises(EOFError, match="ended early"):
        PacketReader(cut).readinto(memoryview(bytearray(MAX_PAYLOAD)))


def test_an_empty_data_packet_is_not_the_end_of_the_content() -> None:
    # gitprotocol-common: "0004" is an empty packet, distinct from the flush "0000".
    stream = io.BytesIO(b"0008abcd" + b"0004" + b"0008efgh" + b"0000" + b"0009next\n")
    reader = PacketReader(stream)
    out = bytearray(3 * MAX_PAYLOAD)
    got = bytearray()
    while n := reader.readinto(memoryview(out)):
        got += out[:n]
    assert got == b"abcdefgh"
    assert stream.read() == b"0009next\n"
    assert PacketReader(io.BytesIO(b"0004" + b"0006xy" + b"0000")).read() == b"xy"


def _packets(sizes: list[int], rng: random.Random) -> tuple[bytes, bytes]:
    """(content, its packets up to a flush) for data packets of ``sizes``."""
    parts = [rng.randbytes(size) for size in sizes]
    wire = b"".join(b"%04x" % (len(p) + 4) + p for p in parts) + b"0000"
    return b"".join(parts), wire


def _fd_reader(wire: bytes, tmp_path: Path) -> tuple[PacketReader, io.FileIO]:
    """A PacketReader on an unbuffered file holding ``wire`` (the filter's stdin kind)."""
    path = tmp_path / "wire"
    path.write_bytes(wire + b"0009next\n")
    raw = io.FileIO(path, "rb")
    return PacketReader(raw), raw


@pytest.mark.skipif(kernels.native is None, reason="needs the C kernel")
@pytest.mark.parametrize("seed", range(6))
def test_the_unbuffered_path_reads_what_the_buffered_one_does(seed: int, tmp_path: Path) -> None:
    """On the filter's unbuffered stdin, content is read by _planes.read_packets without
    the GIL; reads of any size, stopping inside packets and resuming (the rest read at
    once, as clean reads a file's tail), give the bytes the Python path gives, and leave
    the stream just past the flush."""
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 3, MAX_PAYLOAD, MAX_PAYLOAD - 1, rng.randrange(1, MAX_PAYLOAD)])
             for _ in range(40)]  # fmt: skip
    data, wire = _packets(sizes, rng)
    reader, raw = _fd_reader(wire, tmp_path)
    assert reader._fd is not None  # the C path is the one under test
    got = bytearray()
    stop = rng.randrange(len(data) // 2, len(data))  # then the rest at once (read_rest)
    while len(got) < stop:
        if rng.random() < 0.3:
            piece = reader.read(rng.randrange(1, 5000))  # small reads finish a packet first
            got += piece
            if not piece:
                break
        else:
            out = bytearray(rng.randrange(1, 3 * MAX_PAYLOAD))
            n = reader.readinto(memoryview(out))
            got += out[:n]
            if n < len(out):
                break
    got += reader.read()
    assert got == data
    assert reader.read() == b""
    assert raw.read() == b"0009next\n"


@pytest.mark.skipif(kernels.native is None, reason="needs the C kernel")
def test_the_unbuffered_path_refuses_what_the_buffered_one_refuses(tmp_path: Path) -> None:
    data, wire = _packets([MAX_PAYLOAD, 100], random.Random(1))
    bad = wire[: 4 + MAX_PAYLOAD] + b"zz10" + wire[4 + MAX_PAYLOAD + 4 :]
    for stream in (_fd_reader(bad, tmp_path)[0], PacketReader(io.BytesIO(bad))):
        with pytest.raises(ProtocolError, match=r"^bad pkt-line length b'zz10'$"):
            stream.readinto(memoryview(bytearray(len(data))))
    too_long = b"fff5" + bytes(MAX_PAYLOAD + 1)
    for stream in (_fd_reader(too_long, tmp_path)[0], PacketReader(io.BytesIO(too_long))):
        with pytest.raises(ProtocolError, match=r"^bad pkt-line length 65525$"):
            stream.readinto(memoryview(bytearray(2 * MAX_PAYLOAD)))
    path = tmp_path / "cut"
    path.write_bytes(wire[: 4 + MAX_PAYLOAD // 2])  # git went away inside a payload
    with pytest.raises(EOFError, match="ended early"):
        PacketReader(io.FileIO(path, "rb")).readinto(memoryview(bytearray(len(data))))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_short_reads_from_a_pipe_give_the_same_bytes(
    native: bool, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """git's writes reach a pipe in pieces: a read returns part of a length or of a payload.
    Over a real pipe written a few bytes at a time, both paths (the C reader, and the
    Python one on the unbuffered stdin) give the content exactly and stop at its flush."""
    import threading

    if native and kernels.native is None:
        pytest.skip("needs the C kernel")
    if not native:
        monkeypatch.setattr(kernels, "native", None)
    rng = random.Random(seed)
    data, wire = _packets([rng.choice([0, 1, 7, 4096, MAX_PAYLOAD]) for _ in range(24)], rng)
    wire += b"0009next\n"
    r, w = os.pipe()

    def feed() -> None:
        at = 0
        while at < len(wire):
            step = rng.randrange(1, 300)
            os.write(w, wire[at : at + step])
            at += step
        os.close(w)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        with io.FileIO(r, "rb") as raw:
            reader = PacketReader(raw)
            assert (reader._fd is not None) == native
            got = bytearray(reader.read(5))
            out = bytearray(3 * MAX_PAYLOAD + 11)
            while n := reader.readinto(memoryview(out)):
                got += out[:n]
            assert got == data
            rest = b""
            while more := raw.read(100):
                rest += more
            assert rest == b"0009next\n"
    finally:
        writer.join()
