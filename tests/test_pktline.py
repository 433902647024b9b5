from __future__ import annotations

import io

import pytest

from git_theta.protocol.pktline import (
    MAX_PAYLOAD,
    PacketReader,
    PacketWriter,
    ProtocolError,
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
