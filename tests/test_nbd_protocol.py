"""The sans-IO protocol core on its own: bytes in, events and bytes out."""

from __future__ import annotations

import struct

import pytest

from thinblock.frontends.nbd import constants as c
from thinblock.frontends.nbd.protocol import (
    NEED_DATA,
    Closed,
    ExportInfo,
    ExportRouted,
    PayloadPending,
    RemoteProtocolError,
    Request,
    Route,
    ServerConnection,
    Transmission,
)


class Catalog:
    def __init__(self) -> None:
        self.exports = {"a": ExportInfo("a", 1 << 20, False), "ro": ExportInfo("ro", 4096, True)}

    def list_names(self) -> list[tuple[str, str]]:
        return [(e.name, e.description) for e in self.exports.values()]

    def lookup(self, name: str) -> ExportInfo | None:
        return self.exports.get(name)


def opt(option: int, data: bytes = b"") -> bytes:
    return struct.pack(">QII", c.IHAVEOPT, option, len(data)) + data


def replies(data: bytes) -> list[tuple[int, int, bytes]]:
    out = []
    while data:
        magic, option, reply, length = struct.unpack_from(">QIII", data)
        assert magic == c.OPTION_REPLY_MAGIC
        out.append((option, reply, data[20 : 20 + length]))
        data = data[20 + length :]
    return out


def started(flags: int = c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES) -> ServerConnection:
    conn = ServerConnection(Catalog())
    greeting = conn.data_to_send()
    assert greeting == struct.pack(">QQH", c.NBDMAGIC, c.IHAVEOPT, c.FLAG_FIXED_NEWSTYLE | c.FLAG_NO_ZEROES)
    conn.receive_data(struct.pack(">I", flags))
    assert conn.next_event() is NEED_DATA
    return conn


def test_bytes_arrive_in_any_split() -> None:
    conn = started()
    data = opt(c.OPT_LIST)
    for i in range(len(data)):
        conn.receive_data(data[i : i + 1])
        assert conn.next_event() is NEED_DATA
    got = replies(conn.data_to_send())
    assert [r[1] for r in got] == [c.REP_SERVER, c.REP_SERVER, c.REP_ACK]
    assert got[0][2][4:5] == b"a"


def test_go_info_and_unknown_export() -> None:
    conn = started()
    name = b"nope"
    conn.receive_data(opt(c.OPT_INFO, struct.pack(">I", 4) + name + struct.pack(">H", 0)))
    assert conn.next_event() is NEED_DATA
    assert replies(conn.data_to_send())[-1][1] == c.REP_ERR_UNKNOWN
    conn.receive_data(opt(c.OPT_GO, struct.pack(">I", 1) + b"a" + struct.pack(">HH", 1, c.INFO_NAME)))
    event = conn.next_event()
    assert isinstance(event, Transmission) and event.export.name == "a" and not event.structured
    kinds = [(r[1], struct.unpack_from(">H", r[2])[0] if r[2] else None) for r in replies(conn.data_to_send())]
    assert (c.REP_INFO, c.INFO_EXPORT) in kinds and (c.REP_INFO, c.INFO_NAME) in kinds and kinds[-1][0] == c.REP_ACK


def test_meta_context_needs_structured_replies() -> None:
    conn = started()
    query = struct.pack(">I", 1) + b"a" + struct.pack(">I", 1) + struct.pack(">I", 15) + b"base:allocation"
    conn.receive_data(opt(c.OPT_SET_META_CONTEXT, query))
    conn.next_event()
    assert replies(conn.data_to_send())[-1][1] == c.REP_ERR_INVALID
    conn.receive_data(opt(c.OPT_STRUCTURED_REPLY) + opt(c.OPT_SET_META_CONTEXT, query))
    conn.next_event()
    got = replies(conn.data_to_send())
    assert got[-2][1] == c.REP_META_CONTEXT and got[-2][2][4:] == b"base:allocation"
    conn.receive_data(opt(c.OPT_GO, struct.pack(">I", 1) + b"a" + struct.pack(">H", 0)))
    event = conn.next_event()
    assert isinstance(event, Transmission) and list(event.contexts.values()) == ["base:allocation"]


def test_export_name_then_requests_and_validation() -> None:
    conn = started(c.FLAG_C_FIXED_NEWSTYLE)  # zeroes not suppressed
    conn.receive_data(opt(c.OPT_EXPORT_NAME, b"ro"))
    assert isinstance(conn.next_event(), Transmission)
    out = conn.data_to_send()
    assert len(out) == 8 + 2 + 124
    size, flags = struct.unpack_from(">QH", out)
    assert size == 4096 and flags & c.FLAG_READ_ONLY and not flags & c.FLAG_SEND_TRIM
    assert not flags & c.FLAG_SEND_DF  # the spec: only where structured replies were negotiated
    conn.receive_data(struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_WRITE, 7, 0, 3) + b"abc")
    req = conn.next_event()
    assert isinstance(req, Request) and req.payload == b"abc" and req.cookie == 7
    assert conn.check_request(req) == (c.EPERM, "export is read-only")
    assert conn.check_request(Request(1, c.CMD_READ, 0, 4000, 200))[0] == c.EINVAL  # type: ignore[index]
    assert conn.check_request(Request(1, c.CMD_READ, c.CMD_FLAG_DF, 0, 1))[0] == c.EINVAL  # type: ignore[index]
    assert conn.check_request(Request(1, 42, 0, 0, 0))[0] == c.EINVAL  # type: ignore[index]
    assert conn.check_request(Request(1, c.CMD_READ, 0, 0, 4096)) is None
    assert conn.simple_reply(7, c.EPERM) == struct.pack(">IIQ", c.SIMPLE_REPLY_MAGIC, c.EPERM, 7)
    conn.receive_data(struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_DISC, 8, 0, 0))
    assert isinstance(conn.next_event(), Closed)


def test_write_payload_is_announced_then_handed_over_whole() -> None:
    """A write's header alone gives PayloadPending once (the shell reserves memory
    before reading on), wanted() counts the missing bytes, and the payload that
    ends the buffer is handed over without a copy; 64 MiB is accepted, more is not."""
    conn = started(c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES)
    conn.receive_data(opt(c.OPT_EXPORT_NAME, b"a"))
    assert isinstance(conn.next_event(), Transmission)
    conn.data_to_send()
    header = struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_WRITE, 9, 0, 10)
    conn.receive_data(header + b"abcd")
    assert conn.next_event() == PayloadPending(10)
    assert conn.wanted() == 6
    assert conn.next_event() is NEED_DATA  # announced once only
    conn.receive_data(b"efghij")
    assert conn.wanted() == 0
    req = conn.next_event()
    assert isinstance(req, Request) and req.payload == b"abcdefghij" and isinstance(req.payload, bytearray)
    conn.receive_data(struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_WRITE, 10, 0, c.MAX_PAYLOAD_BYTES))
    assert conn.next_event() == PayloadPending(64 << 20)
    assert conn.wanted() == 64 << 20
    big = ServerConnection(Catalog())
    big.receive_data(struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE) + opt(c.OPT_EXPORT_NAME, b"a"))
    assert isinstance(big.next_event(), Transmission)
    big.receive_data(struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_WRITE, 11, 0, c.MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(RemoteProtocolError):
        big.next_event()


def test_large_payload_is_read_into_its_own_buffer() -> None:
    """receive_buffer: a large payload's missing bytes go straight into one buffer
    (no copy through the input), in any split, and bytes after it are kept."""
    conn = started(c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES)
    conn.receive_data(opt(c.OPT_EXPORT_NAME, b"a"))
    assert isinstance(conn.next_event(), Transmission)
    conn.data_to_send()
    payload = bytes(range(256)) * 1024  # 256 KiB
    assert conn.receive_buffer() is None  # nothing pending yet
    conn.receive_data(struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_WRITE, 5, 0, len(payload)) + payload[:100])
    assert conn.next_event() == PayloadPending(len(payload))
    pos = 100
    for step in (1000, 70000, len(payload)):
        target = conn.receive_buffer()
        assert target is not None and len(target) == len(payload) - pos
        n = min(step, len(target))
        target[:n] = payload[pos : pos + n]
        target.release()
        conn.received_into(n)
        pos += n
        if pos < len(payload):
            assert conn.next_event() is NEED_DATA and conn.wanted() == len(payload) - pos
    trailer = struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_FLUSH, 6, 0, 0)
    conn.receive_data(trailer)  # after the payload, through the ordinary path
    req = conn.next_event()
    assert isinstance(req, Request) and req.cookie == 5 and req.payload == payload
    flush = conn.next_event()
    assert isinstance(flush, Request) and flush.command == c.CMD_FLUSH and flush.cookie == 6


def test_structured_read_reply_sends_holes_not_zeros() -> None:
    conn = started()
    conn.receive_data(opt(c.OPT_STRUCTURED_REPLY) + opt(c.OPT_GO, struct.pack(">I", 1) + b"a" + struct.pack(">H", 0)))
    assert isinstance(conn.next_event(), Transmission)
    wire = b"".join(conn.read_reply(5, [(0, 1 << 20, None), (1 << 20, 3, b"xyz")]))
    assert len(wire) == (20 + 12) + (20 + 8 + 3)
    magic, flags, kind, cookie, length = struct.unpack_from(">IHHQI", wire)
    assert (magic, flags, kind, cookie, length) == (c.STRUCTURED_REPLY_MAGIC, 0, c.REPLY_TYPE_OFFSET_HOLE, 5, 12)
    assert struct.unpack_from(">HH", wire, 32 + 4) == (c.REPLY_FLAG_DONE, c.REPLY_TYPE_OFFSET_DATA)


@pytest.mark.parametrize(
    "data",
    [
        struct.pack(">I", 0x80),  # unknown client flag
        struct.pack(">I", 1) + struct.pack(">QII", 1, 1, 0),  # bad option magic
        struct.pack(">I", 1) + struct.pack(">QII", c.IHAVEOPT, 3, 1 << 30),  # huge option
    ],
)
def test_remote_errors(data: bytes) -> None:
    conn = ServerConnection(Catalog())
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError):
        conn.next_event()
    assert isinstance(conn.next_event(), Closed)


def test_tls_required_refuses_plaintext_options() -> None:
    conn = ServerConnection(Catalog(), tls_required=True)
    conn.receive_data(struct.pack(">I", 1) + opt(c.OPT_LIST))
    assert conn.next_event() is NEED_DATA
    assert replies(conn.data_to_send()[18:])[-1][1] == c.REP_ERR_TLS_REQD
    conn.receive_data(opt(c.OPT_EXPORT_NAME, b"a"))
    event = conn.next_event()
    assert isinstance(event, Closed) and not event.clean


# ----- hand-over between worker processes (serve --workers) -----------------------


class Elsewhere(Catalog):
    """Export "b" is a sibling's: naming it routes the connection."""

    def lookup(self, name: str) -> ExportInfo | None:
        if name == "b":
            raise ExportRouted("4242", name)
        return super().lookup(name)


def _meta_context(name: str, *queries: str) -> bytes:
    data = struct.pack(">I", len(name)) + name.encode() + struct.pack(">I", len(queries))
    for q in queries:
        data += struct.pack(">I", len(q)) + q.encode()
    return opt(c.OPT_SET_META_CONTEXT, data)


def test_an_option_naming_a_siblings_export_is_left_for_it_and_answered_there() -> None:
    conn = ServerConnection(Elsewhere())
    conn.data_to_send()
    conn.receive_data(struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE))
    conn.receive_data(opt(c.OPT_STRUCTURED_REPLY))
    go = opt(c.OPT_GO, struct.pack(">I", 1) + b"b" + struct.pack(">H", 0))
    conn.receive_data(_meta_context("b", "base:allocation") + go)
    event = conn.next_event()
    assert event == Route("4242", "b")
    assert [r[1] for r in replies(conn.data_to_send())] == [c.REP_ACK]  # STRUCTURED_REPLY only
    state = conn.handoff_state()

    # The sibling knows b; it answers the meta context option and GO, as if it had
    # been there from the start: no greeting again, structured replies kept.
    sibling = Catalog()
    sibling.exports["b"] = ExportInfo("b", 8192, False)
    there = ServerConnection.resume(sibling, state, tls_required=False, tls_available=False)
    assert there.data_to_send() == b""
    event = there.next_event()
    assert isinstance(event, Transmission) and event.export.name == "b" and event.structured
    assert list(event.contexts.values()) == ["base:allocation"]
    kinds = [r[1] for r in replies(there.data_to_send())]
    assert kinds[:2] == [c.REP_META_CONTEXT, c.REP_ACK] and kinds[-1] == c.REP_ACK


def test_a_route_the_sibling_refused_is_answered_here() -> None:
    conn = started()
    conn.catalog = Elsewhere()
    conn.receive_data(opt(c.OPT_INFO, struct.pack(">I", 1) + b"b" + struct.pack(">H", 0)))
    assert isinstance(conn.next_event(), Route)
    assert conn.refuse_routed("its worker is restarting") is None
    (answer,) = replies(conn.data_to_send())
    assert answer[1] == c.REP_ERR_UNKNOWN and answer[2] == b"its worker is restarting"
    assert conn.next_event() is NEED_DATA  # the option is consumed; the client may go on
    conn.receive_data(opt(c.OPT_EXPORT_NAME, b"b"))
    assert isinstance(conn.next_event(), Route)
    closed = conn.refuse_routed("gone")
    assert isinstance(closed, Closed) and not closed.clean


@pytest.mark.parametrize(
    "broken",
    [{}, {"structured": True}, {"contexts": [], "structured": 1, "no_zeroes": 0, "contexts_export": None,
                                "fixed": 1, "next_context_id": 1, "tls_active": 0, "input": "zz"}],
)  # fmt: skip
def test_a_malformed_handoff_state_is_a_remote_error(broken: dict[str, object]) -> None:
    with pytest.raises(RemoteProtocolError):
        ServerConnection.resume(Catalog(), broken, tls_required=False, tls_available=False)
