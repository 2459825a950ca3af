"""The NBD server protocol with no I/O (in the style of h11 / h2).

Bytes from the client go in with `receive_data`; `next_event` turns them into
events; bytes for the client come out of `data_to_send` (handshake and option
replies, which the core answers itself from an `ExportCatalog`) and from the
`*_reply` methods (transmission replies, which the caller may send in any
order). Every state transition lives here; the socket code is a thin shell.

Two error kinds, as in h11: `RemoteProtocolError` (the client broke the
protocol: end that connection) and `LocalProtocolError` (we misused the core).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from thinblock.frontends.nbd import constants as c
from thinblock.logtext import shown

_OPTION_HEADER = struct.Struct(">QII")
_OPTION_REPLY = struct.Struct(">QIII")
DIRECT_PAYLOAD_BYTES = 64 << 10  # payloads at least this large are read into their own buffer
_REQUEST = struct.Struct(">IHHQQI")
_SIMPLE_REPLY = struct.Struct(">IIQ")
_CHUNK = struct.Struct(">IHHQI")
_DATA_CHUNK = struct.Struct(">IHHQIQ")  # a chunk's header and an OFFSET_DATA chunk's offset
_ALLOWED_FLAGS = {  # the flags each command may carry
    c.CMD_READ: c.CMD_FLAG_FUA | c.CMD_FLAG_DF,
    c.CMD_WRITE: c.CMD_FLAG_FUA,
    c.CMD_FLUSH: c.CMD_FLAG_FUA,
    c.CMD_TRIM: c.CMD_FLAG_FUA,
    c.CMD_CACHE: c.CMD_FLAG_FUA,
    c.CMD_WRITE_ZEROES: c.CMD_FLAG_FUA | c.CMD_FLAG_NO_HOLE | c.CMD_FLAG_FAST_ZERO,
    c.CMD_BLOCK_STATUS: c.CMD_FLAG_FUA | c.CMD_FLAG_REQ_ONE,
}

BASE_ALLOCATION = "base:allocation"


class RemoteProtocolError(Exception):
    """The client violated the protocol; the connection must end."""


class LocalProtocolError(Exception):
    """The caller used the core wrongly (a bug in thinblock, not the client)."""


def _base_only() -> tuple[str, ...]:
    return (BASE_ALLOCATION,)


@dataclass(frozen=True)
class ExportInfo:
    """What the core needs to know about one export (looked up for INFO, GO,
    EXPORT_NAME and the META_CONTEXT options; a listing needs only names)."""

    name: str
    size_bytes: int
    read_only: bool
    description: str = ""
    min_block: int = 1
    preferred_block: int = 4096
    max_payload: int = c.MAX_PAYLOAD_BYTES
    # The metadata contexts a LIST_META_CONTEXT enumerates, computed only when one asks
    # (INFO and GO never need them); `offers` says whether a context named exactly may
    # be selected, which may go beyond what is enumerated (the spec lets a server list
    # a namespace's contexts partly).
    contexts: Callable[[], tuple[str, ...]] = _base_only
    offers: Callable[[str], bool] | None = None  # None: exactly the enumerated ones

    @property
    def meta_contexts(self) -> tuple[str, ...]:
        return self.contexts()

    def offers_context(self, name: str) -> bool:
        return self.offers(name) if self.offers is not None else name in self.contexts()


# One NBD_REP_SERVER reply's header with the name length that starts its payload.
_LIST_REPLY = struct.Struct(">QIIII")


class ExportCatalog(Protocol):
    """The exports a client may see. lookup answers None both for a name that does not
    exist and for one the client may not see (authz.py), and raises ExportRefused
    when the client may use nothing at all (the server's authorisation). list_names
    gives (name, description) of each, in the order they are listed: all a listing
    sends, so it never builds a whole ExportInfo per export."""

    def list_names(self) -> list[tuple[str, str]]: ...

    def lookup(self, name: str) -> ExportInfo | None: ...


class ExportRefused(Exception):
    """This client may use no export: REP_ERR_POLICY with the message."""


class ExportElsewhere(Exception):
    """The export exists but another server serves it: REP_ERR_UNKNOWN (the spec's
    "not available") with the message, which names that server when it is known."""


class ExportRouted(Exception):
    """The export is served by a sibling process that can take this connection over
    (serve --workers): the option naming it is left unanswered and a Route event
    tells the shell where to hand the connection."""

    def __init__(self, target: str, name: str) -> None:
        super().__init__(f"export '{name}' is served by worker {target}")
        self.target = target
        self.name = name


class Phase(Enum):
    GREETING = "greeting"  # waiting for the client flags
    OPTIONS = "options"
    TRANSMISSION = "transmission"
    CLOSED = "closed"


# ----- events ----------------------------------------------------------------------------


class NeedData:
    """More bytes are needed before another event can be produced."""


NEED_DATA = NeedData()


@dataclass
class StartTLS:
    """STARTTLS was acknowledged: send data_to_send(), then wrap the socket in TLS."""


@dataclass
class Route:
    """The option at the head of the input names an export a sibling process serves:
    hand the connection (handoff_state() and the socket) to `target`, which answers
    that option itself. If it cannot, refuse_routed() answers it here."""

    target: str
    export_name: str


@dataclass
class Transmission:
    """Option haggling ended: requests follow for this export."""

    export: ExportInfo
    structured: bool
    contexts: dict[int, str]


@dataclass
class Request:
    cookie: int
    command: int
    flags: int
    offset: int
    length: int
    payload: bytes | bytearray | None = None


@dataclass
class PayloadPending:
    """A WRITE header arrived and its payload of `length` bytes is on its way (once per
    request, before its NeedData): the shell may reserve memory for it, or stop
    reading, before the bytes come in. `wanted()` says how many are still missing."""

    length: int


@dataclass
class Closed:
    """The session is over (client abort/disconnect, EOF, or a refused export)."""

    reason: str
    clean: bool = True


Event = NeedData | PayloadPending | StartTLS | Route | Transmission | Request | Closed


@dataclass
class _Negotiated:
    structured: bool = False
    no_zeroes: bool = False
    contexts: dict[int, str] = field(default_factory=dict)
    contexts_export: str | None = None


class ServerConnection:
    """One client connection's protocol state."""

    def __init__(self, catalog: ExportCatalog, *, tls_required: bool = False, tls_available: bool = False) -> None:
        self.catalog = catalog
        self.tls_required = tls_required
        self.tls_available = tls_available or tls_required
        self.tls_active = False
        self.phase = Phase.GREETING
        self.export: ExportInfo | None = None
        self.neg = _Negotiated()
        self._inbuf = bytearray()
        # A large write payload is read straight into its own buffer (receive_buffer):
        # the buffer, how much of it has arrived, and bytes that came after it.
        self._direct: bytearray | None = None
        self._direct_filled = 0
        self._spill = bytearray()
        self._outbuf = bytearray()
        self._eof = False
        self._fixed = False
        self._next_context_id = 1
        # Options this connection had answered, wherever it was (carried in a hand-over):
        # one routed again with this unchanged went unanswered in between.
        self.options_handled = 0
        self._payload_announced = False
        self._outbuf += struct.pack(">QQH", c.NBDMAGIC, c.IHAVEOPT, c.FLAG_FIXED_NEWSTYLE | c.FLAG_NO_ZEROES)

    # ----- I/O-free plumbing ------------------------------------------------------

    def receive_data(self, data: bytes | memoryview) -> None:
        """Feed bytes from the client; b"" means the client closed its side."""
        if not data:
            self._eof = True
        elif self._direct is not None:
            n = min(len(data), len(self._direct) - self._direct_filled)
            self._direct[self._direct_filled : self._direct_filled + n] = data[:n]
            self._direct_filled += n
            self._spill += data[n:]
        else:
            self._inbuf += data

    def receive_buffer(self) -> memoryview | None:
        """Where the shell may read the rest of a large write payload directly, with no
        copy (then call received_into); None when there is none to read that way."""
        if self._direct is None:
            need = self.wanted()
            if need < DIRECT_PAYLOAD_BYTES:
                return None
            have = len(self._inbuf)
            self._direct = bytearray(have + need)
            self._direct[:have] = self._inbuf
            self._direct_filled = have
            self._inbuf = bytearray()
        return memoryview(self._direct)[self._direct_filled :]

    def received_into(self, n: int) -> None:
        """n bytes were read into receive_buffer(); 0 means the client closed its side."""
        if not n:
            self._eof = True
        assert self._direct is not None
        self._direct_filled += n

    def _buffered(self) -> int:
        return self._direct_filled if self._direct is not None else len(self._inbuf)

    def data_to_send(self) -> bytes:
        out = bytes(self._outbuf)
        self._outbuf.clear()
        return out

    def _take(self, n: int, skip: int = 0) -> bytes | None:
        """Remove skip + n bytes from the input and return the last n (one copy)."""
        if len(self._inbuf) < skip + n:
            return None
        with memoryview(self._inbuf) as view:
            out = bytes(view[skip : skip + n])
        del self._inbuf[: skip + n]  # deleting from the front of a bytearray is O(1)
        return out

    def _take_payload(self, n: int, skip: int) -> bytes | bytearray | None:
        """_take for a write payload: when it is all that is buffered (the shell reads
        no further than `wanted()`), hand over the buffer itself instead of a copy,
        so a 64 MiB write costs 64 MiB, not twice that."""
        if len(self._inbuf) != skip + n:
            return self._take(n, skip)
        out = self._inbuf
        self._inbuf = bytearray()
        del out[:skip]
        return out

    def wanted(self) -> int:
        """Bytes still missing of a write payload whose header has arrived (0 if none):
        the shell reads no more than this, so the payload arrives alone."""
        if self._direct is not None:
            return len(self._direct) - self._direct_filled
        if self.phase is not Phase.TRANSMISSION or len(self._inbuf) < _REQUEST.size:
            return 0
        _magic, _flags, command, _cookie, _offset, length = _REQUEST.unpack_from(self._inbuf)
        if command != c.CMD_WRITE or length > c.MAX_PAYLOAD_BYTES:
            return 0
        return max(0, _REQUEST.size + int(length) - len(self._inbuf))

    def next_event(self) -> Event:
        if self.phase is Phase.CLOSED:
            return Closed("session closed")
        try:
            event = self._next_event()
        except RemoteProtocolError:
            self.phase = Phase.CLOSED
            raise
        if isinstance(event, NeedData) and self._eof:
            self.phase = Phase.CLOSED
            pending = self._buffered()
            return Closed(
                "client closed the connection" + (f" mid-message ({pending} bytes)" if pending else ""),
                clean=not pending,
            )
        if isinstance(event, Closed):
            self.phase = Phase.CLOSED
        return event

    def _next_event(self) -> Event:
        while True:
            if self.phase is Phase.GREETING:
                raw = self._take(4)
                if raw is None:
                    return NEED_DATA
                (client_flags,) = struct.unpack(">I", raw)
                if client_flags & ~(c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES):
                    raise RemoteProtocolError(f"unknown client flags {client_flags:#x}")
                self.neg.no_zeroes = bool(client_flags & c.FLAG_C_NO_ZEROES)
                self._fixed = bool(client_flags & c.FLAG_C_FIXED_NEWSTYLE)
                self.phase = Phase.OPTIONS
                continue
            if self.phase is Phase.OPTIONS:
                event = self._next_option()
                if event is None:
                    continue  # an option was answered; look for the next
                return event
            if self.phase is Phase.TRANSMISSION:
                return self._next_request()
            return Closed("session closed")

    # ----- option haggling --------------------------------------------------------

    def _next_option(self) -> Event | None:
        if len(self._inbuf) < _OPTION_HEADER.size:
            return NEED_DATA
        magic, option, length = _OPTION_HEADER.unpack_from(self._inbuf)
        if magic != c.IHAVEOPT:
            raise RemoteProtocolError(f"bad option magic {magic:#x}")
        if length > c.MAX_OPTION_BYTES:
            raise RemoteProtocolError(f"option {option} carries {length} bytes (limit {c.MAX_OPTION_BYTES})")
        if len(self._inbuf) < _OPTION_HEADER.size + length:
            return NEED_DATA
        raw = bytes(self._inbuf[: _OPTION_HEADER.size + length])
        del self._inbuf[: _OPTION_HEADER.size]
        data = self._take(length) or b""
        try:
            event = self._handle_option(option, data)
            self.options_handled += 1
            return event
        except ExportRouted as routed:
            # Nothing was answered for this option (lookups come before any reply):
            # it goes back to the head of the input, for the process that serves it.
            self._inbuf[0:0] = raw
            return Route(routed.target, routed.name)

    # ----- handing a connection to another process (serve --workers) ---------------

    def handoff_state(self) -> dict[str, object]:
        """What another process needs to go on with this connection in the option
        phase: what was negotiated and the bytes received but not yet handled (the
        option a Route left at their head first). JSON-serialisable."""
        if self.phase is not Phase.OPTIONS or self._direct is not None:
            raise LocalProtocolError("only a connection in the option phase can be handed over")
        return {
            "structured": self.neg.structured,
            "no_zeroes": self.neg.no_zeroes,
            "contexts": {str(k): v for k, v in self.neg.contexts.items()},
            "contexts_export": self.neg.contexts_export,
            "fixed": self._fixed,
            "next_context_id": self._next_context_id,
            "tls_active": self.tls_active,
            "input": self._inbuf.hex(),
            "options_handled": self.options_handled,
        }

    @classmethod
    def resume(
        cls, catalog: ExportCatalog, state: dict[str, object], *, tls_required: bool, tls_available: bool
    ) -> ServerConnection:
        """A connection handed over by another process (handoff_state), in the option
        phase: no greeting is sent again. A malformed state is a RemoteProtocolError."""
        conn = cls(catalog, tls_required=tls_required, tls_available=tls_available)
        conn._outbuf.clear()  # the greeting went out from the process that accepted it
        try:
            contexts = state["contexts"]
            assert isinstance(contexts, dict)
            conn.neg = _Negotiated(
                structured=bool(state["structured"]),
                no_zeroes=bool(state["no_zeroes"]),
                contexts={int(k): str(v) for k, v in contexts.items()},
                contexts_export=None if state["contexts_export"] is None else str(state["contexts_export"]),
            )
            conn._fixed = bool(state["fixed"])
            next_id = state["next_context_id"]
            assert isinstance(next_id, int)
            conn._next_context_id = next_id
            conn.tls_active = bool(state["tls_active"])
            conn._inbuf = bytearray.fromhex(str(state["input"]))
            handled = state.get("options_handled", 0)
            assert isinstance(handled, int) and handled >= 0
            conn.options_handled = handled
        except (KeyError, AssertionError, ValueError, TypeError) as exc:
            raise RemoteProtocolError(f"malformed hand-over state: {exc!r}") from None
        conn.phase = Phase.OPTIONS
        return conn

    def refuse_routed(self, message: str) -> Closed | None:
        """The process a Route named did not take the connection: answer the option
        left at the head of the input with why (REP_ERR_UNKNOWN, the spec's "not
        available"), or end the session for EXPORT_NAME, which has no error reply."""
        _magic, option, length = _OPTION_HEADER.unpack_from(self._inbuf)
        del self._inbuf[: _OPTION_HEADER.size + length]
        if option == c.OPT_EXPORT_NAME:
            self.phase = Phase.CLOSED
            return Closed(f"export not available: {message}", clean=False)
        self._error(option, c.REP_ERR_UNKNOWN, message)
        return None

    def _reply(self, option: int, reply: int, payload: bytes = b"") -> None:
        self._outbuf += _OPTION_REPLY.pack(c.OPTION_REPLY_MAGIC, option, reply, len(payload)) + payload

    def _error(self, option: int, reply: int, message: str) -> None:
        self._reply(option, reply, message.encode()[: c.MAX_STRING_BYTES])

    def _handle_option(self, option: int, data: bytes) -> Event | None:
        if option == c.OPT_ABORT:
            self._reply(option, c.REP_ACK)
            return Closed("client aborted the negotiation")
        if self.tls_required and not self.tls_active:
            if option == c.OPT_EXPORT_NAME:
                return Closed("client chose an export before starting TLS", clean=False)
            if option != c.OPT_STARTTLS:
                self._error(option, c.REP_ERR_TLS_REQD, "this server requires TLS: use STARTTLS")
                return None
        if option == c.OPT_EXPORT_NAME:
            return self._export_name(data)
        if not self._fixed:
            raise RemoteProtocolError("client did not set FIXED_NEWSTYLE and sent an option other than EXPORT_NAME")
        handler = {
            c.OPT_LIST: self._opt_list,
            c.OPT_STARTTLS: self._opt_starttls,
            c.OPT_INFO: self._opt_info_go,
            c.OPT_GO: self._opt_info_go,
            c.OPT_STRUCTURED_REPLY: self._opt_structured,
            c.OPT_LIST_META_CONTEXT: self._opt_meta_context,
            c.OPT_SET_META_CONTEXT: self._opt_meta_context,
        }.get(option)
        if handler is None:
            self._error(option, c.REP_ERR_UNSUP, f"option {option} is not supported")
            return None
        return handler(option, data)

    def _opt_list(self, option: int, data: bytes) -> Event | None:
        if data:
            self._error(option, c.REP_ERR_INVALID, "LIST takes no data")
            return None
        try:
            exports = self.catalog.list_names()
        except ExportRefused as exc:
            self._error(option, c.REP_ERR_POLICY, str(exc))
            return None
        # Every reply into one buffer, joined once: the shell sends it in one go (a
        # few sends of the socket's size), however many exports there are.
        parts: list[bytes] = []
        pack = _LIST_REPLY.pack
        for name, description in exports:
            raw, text = name.encode(), description.encode()
            parts += (pack(c.OPTION_REPLY_MAGIC, option, c.REP_SERVER, 4 + len(raw) + len(text), len(raw)), raw, text)
        self._outbuf += b"".join(parts)
        self._reply(option, c.REP_ACK)
        return None

    def _opt_starttls(self, option: int, data: bytes) -> Event | None:
        if data:
            self._error(option, c.REP_ERR_INVALID, "STARTTLS takes no data")
            return None
        if not self.tls_available:
            self._error(option, c.REP_ERR_POLICY, "TLS is not configured on this server")
            return None
        if self.tls_active:
            self._error(option, c.REP_ERR_INVALID, "TLS is already active")
            return None
        self._reply(option, c.REP_ACK)
        self.tls_active = True
        self.neg = _Negotiated(no_zeroes=self.neg.no_zeroes)  # nothing negotiated before TLS survives
        if self._inbuf:
            raise RemoteProtocolError("client sent plaintext after STARTTLS")
        return StartTLS()

    def _opt_structured(self, option: int, data: bytes) -> Event | None:
        if data:
            self._error(option, c.REP_ERR_INVALID, "STRUCTURED_REPLY takes no data")
        elif self.neg.structured:
            self._error(option, c.REP_ERR_INVALID, "structured replies are already negotiated")
        else:
            self.neg.structured = True
            self._reply(option, c.REP_ACK)
        return None

    @staticmethod
    def _parse_name(data: bytes, pos: int) -> tuple[str, int]:
        if len(data) < pos + 4:
            raise ValueError("truncated length")
        (n,) = struct.unpack_from(">I", data, pos)
        pos += 4
        if n > c.MAX_STRING_BYTES or len(data) < pos + n:
            raise ValueError("string longer than its option")
        return data[pos : pos + n].decode("utf-8"), pos + n

    def _opt_info_go(self, option: int, data: bytes) -> Event | None:
        try:
            name, pos = self._parse_name(data, 0)
            if len(data) < pos + 2:
                raise ValueError("missing information request count")
            (count,) = struct.unpack_from(">H", data, pos)
            pos += 2
            if len(data) != pos + 2 * count:
                raise ValueError("information request list does not match its count")
            requests = set(struct.unpack_from(f">{count}H", data, pos))
        except (ValueError, UnicodeDecodeError) as exc:
            self._error(option, c.REP_ERR_INVALID, f"malformed {'GO' if option == c.OPT_GO else 'INFO'}: {exc}")
            return None
        export = self._lookup(option, name)
        if export is None:
            return None
        flags = self._transmission_flags(export)
        self._reply(option, c.REP_INFO, struct.pack(">HQH", c.INFO_EXPORT, export.size_bytes, flags))
        if c.INFO_NAME in requests:
            self._reply(option, c.REP_INFO, struct.pack(">H", c.INFO_NAME) + export.name.encode())
        if c.INFO_DESCRIPTION in requests and export.description:
            self._reply(option, c.REP_INFO, struct.pack(">H", c.INFO_DESCRIPTION) + export.description.encode())
        # Block sizes are always sent: they are the defaults' superset and harmless to clients.
        self._reply(
            option,
            c.REP_INFO,
            struct.pack(">HIII", c.INFO_BLOCK_SIZE, export.min_block, export.preferred_block, export.max_payload),
        )
        self._reply(option, c.REP_ACK)
        if option == c.OPT_INFO:
            return None
        return self._enter_transmission(export)

    def _lookup(self, option: int, name: str) -> ExportInfo | None:
        """The export an option names, or None with the error reply sent: POLICY for a
        client refused everything, UNKNOWN for a name that does not exist or is hidden
        from this client (the same reply, so names cannot be probed)."""
        try:
            export = self.catalog.lookup(name)
        except ExportRefused as exc:
            self._error(option, c.REP_ERR_POLICY, str(exc))
            return None
        except ExportElsewhere as exc:
            self._error(option, c.REP_ERR_UNKNOWN, str(exc))
            return None
        if export is None:
            self._error(option, c.REP_ERR_UNKNOWN, f"no export named '{shown(name)}'")
        return export

    def _export_name(self, data: bytes) -> Event:
        try:
            name = data.decode("utf-8")
        except UnicodeDecodeError:
            return Closed("export name is not UTF-8", clean=False)
        try:
            export = self.catalog.lookup(name)
        except ExportRefused as exc:
            return Closed(f"refused export '{shown(name)}': {exc}", clean=False)
        except ExportElsewhere as exc:
            return Closed(f"export '{shown(name)}' is not available here: {exc}", clean=False)
        if export is None:
            return Closed(f"client asked for unknown export '{shown(name)}'", clean=False)
        self._outbuf += struct.pack(">QH", export.size_bytes, self._transmission_flags(export))
        if not self.neg.no_zeroes:
            self._outbuf += bytes(124)
        return self._enter_transmission(export)

    def _enter_transmission(self, export: ExportInfo) -> Event:
        self.export = export
        self.phase = Phase.TRANSMISSION
        contexts = self.neg.contexts if self.neg.contexts_export == export.name else {}
        self.neg.contexts = contexts
        return Transmission(export, self.neg.structured, dict(contexts))

    def _opt_meta_context(self, option: int, data: bytes) -> Event | None:
        setting = option == c.OPT_SET_META_CONTEXT
        if setting:
            self.neg.contexts, self.neg.contexts_export = {}, None  # replaced even on failure
        if not self.neg.structured:
            self._error(option, c.REP_ERR_INVALID, "negotiate structured replies first")
            return None
        try:
            name, pos = self._parse_name(data, 0)
            if len(data) < pos + 4:
                raise ValueError("missing query count")
            (count,) = struct.unpack_from(">I", data, pos)
            pos += 4
            queries = []
            for _ in range(count):
                query, pos = self._parse_name(data, pos)
                queries.append(query)
            if pos != len(data):
                raise ValueError("trailing bytes after the queries")
        except (ValueError, UnicodeDecodeError) as exc:
            self._error(option, c.REP_ERR_INVALID, f"malformed meta context request: {exc}")
            return None
        export = self._lookup(option, name)
        if export is None:
            return None
        matched = _selected(export, queries, listing=not setting)
        for ctx in matched:
            ctx_id = 0
            if setting:
                ctx_id = self._next_context_id
                self._next_context_id += 1
                self.neg.contexts[ctx_id] = ctx
            self._reply(option, c.REP_META_CONTEXT, struct.pack(">I", ctx_id) + ctx.encode())
        if setting:
            self.neg.contexts_export = export.name
        self._reply(option, c.REP_ACK)
        return None

    def _transmission_flags(self, export: ExportInfo) -> int:
        flags = c.FLAG_HAS_FLAGS | c.FLAG_SEND_FLUSH | c.FLAG_SEND_FUA | c.FLAG_CAN_MULTI_CONN | c.FLAG_SEND_CACHE
        if self.neg.structured:  # the spec: DF only where structured replies were negotiated
            flags |= c.FLAG_SEND_DF
        if export.read_only:
            flags |= c.FLAG_READ_ONLY
        else:
            flags |= c.FLAG_SEND_TRIM | c.FLAG_SEND_WRITE_ZEROES | c.FLAG_SEND_FAST_ZERO
        return flags

    # ----- transmission -----------------------------------------------------------

    def _next_request(self) -> Event:
        if self._direct is not None:
            if self._direct_filled < len(self._direct):
                return NEED_DATA
            # The payload is complete: it becomes the whole input, so _take_payload
            # hands the buffer over; whatever came after it is the input next.
            self._inbuf, self._direct = self._direct, None
            spill, self._spill = self._spill, bytearray()
            event = self._next_request()
            self._inbuf += spill
            return event
        if len(self._inbuf) < _REQUEST.size:
            return NEED_DATA
        magic, flags, command, cookie, offset, length = _REQUEST.unpack_from(self._inbuf)
        if magic != c.REQUEST_MAGIC:
            raise RemoteProtocolError(f"bad request magic {magic:#x}")
        payload = None
        if command == c.CMD_WRITE:
            if length > c.MAX_PAYLOAD_BYTES:
                raise RemoteProtocolError(f"write payload of {length} bytes exceeds {c.MAX_PAYLOAD_BYTES}")
            payload = self._take_payload(length, skip=_REQUEST.size)
            if payload is None:
                if self._payload_announced:
                    return NEED_DATA
                self._payload_announced = True
                return PayloadPending(length)
            self._payload_announced = False
        else:
            del self._inbuf[: _REQUEST.size]
        if command == c.CMD_DISC:
            return Closed("client disconnected")
        return Request(cookie, command, flags, offset, length, payload)

    def check_request(self, req: Request) -> tuple[int, str] | None:
        """The NBD error for a request that must not run, or None. Validation happens here once."""
        export = self.export
        if export is None:
            raise LocalProtocolError("check_request before transmission")
        allowed = _ALLOWED_FLAGS.get(req.command)
        if allowed is None:
            return c.EINVAL, f"unknown command {req.command}"
        if req.flags & ~allowed:
            return c.EINVAL, f"flags {req.flags:#x} are not valid for command {req.command}"
        if req.flags & c.CMD_FLAG_DF and not self.neg.structured:
            return c.EINVAL, "DF needs structured replies"
        writes = req.command in (c.CMD_WRITE, c.CMD_TRIM, c.CMD_WRITE_ZEROES)
        if writes and export.read_only:
            return c.EPERM, "export is read-only"
        if req.command == c.CMD_FLUSH:
            if req.offset or req.length:
                return c.EINVAL, "flush takes no range"
            return None
        if req.offset + req.length > export.size_bytes:
            code = c.ENOSPC if req.command in (c.CMD_WRITE, c.CMD_WRITE_ZEROES) else c.EINVAL
            return code, f"range {req.offset}+{req.length} is beyond the export's {export.size_bytes} bytes"
        if req.command == c.CMD_READ and req.length > export.max_payload:
            return (c.EOVERFLOW if self.neg.structured else c.EINVAL), f"read of {req.length} bytes is too large"
        if req.command == c.CMD_BLOCK_STATUS and not self.neg.contexts:
            return c.EINVAL, "no metadata context was negotiated"
        if req.command == c.CMD_BLOCK_STATUS and not req.length:
            # A reply must carry at least one descriptor, and none describes zero bytes.
            return c.EINVAL, "block status of zero bytes"
        return None

    # ----- replies ----------------------------------------------------------------

    def simple_reply(self, cookie: int, error: int = 0, data: bytes = b"") -> bytes:
        return _SIMPLE_REPLY.pack(c.SIMPLE_REPLY_MAGIC, error, cookie) + data

    def error_reply(self, cookie: int, error: int, message: str = "") -> bytes:
        if not self.neg.structured:
            return self.simple_reply(cookie, error)
        text = message.encode()[: c.MAX_STRING_BYTES]
        payload = struct.pack(">IH", error, len(text)) + text
        return (
            _CHUNK.pack(c.STRUCTURED_REPLY_MAGIC, c.REPLY_FLAG_DONE, c.REPLY_TYPE_ERROR, cookie, len(payload)) + payload
        )

    def read_reply(self, cookie: int, pieces: list[tuple[int, int, bytes | None]]) -> list[bytes]:
        """Reply to a READ; pieces are (offset, length, data or None for zeros), in order.

        With structured replies, zero pieces travel as OFFSET_HOLE chunks: no zero
        bytes on the wire. Returns buffers to write back to back.
        """
        if not self.neg.structured:
            out = [self.simple_reply(cookie)]
            out.extend(data if data is not None else bytes(length) for _off, length, data in pieces)
            return out
        out = []
        for i, (offset, length, data) in enumerate(pieces):
            done = c.REPLY_FLAG_DONE if i == len(pieces) - 1 else 0
            if data is None:
                out.append(
                    _CHUNK.pack(c.STRUCTURED_REPLY_MAGIC, done, c.REPLY_TYPE_OFFSET_HOLE, cookie, 12)
                    + struct.pack(">QI", offset, length)
                )
            else:
                out.append(
                    _DATA_CHUNK.pack(
                        c.STRUCTURED_REPLY_MAGIC, done, c.REPLY_TYPE_OFFSET_DATA, cookie, 8 + len(data), offset
                    )
                )
                out.append(data)
        if not pieces:
            out.append(_CHUNK.pack(c.STRUCTURED_REPLY_MAGIC, c.REPLY_FLAG_DONE, c.REPLY_TYPE_NONE, cookie, 0))
        return out

    def block_status_reply(self, cookie: int, per_context: list[tuple[int, list[tuple[int, int]]]]) -> bytes:
        """One BLOCK_STATUS chunk per context: (context id, [(length, flags), ...])."""
        out = bytearray()
        for i, (ctx_id, extents) in enumerate(per_context):
            done = c.REPLY_FLAG_DONE if i == len(per_context) - 1 else 0
            body = struct.pack(">I", ctx_id) + b"".join(struct.pack(">II", n, f) for n, f in extents)
            out += _CHUNK.pack(c.STRUCTURED_REPLY_MAGIC, done, c.REPLY_TYPE_BLOCK_STATUS, cookie, len(body)) + body
        return bytes(out)


def _selected(export: ExportInfo, queries: list[str], *, listing: bool) -> list[str]:
    """The contexts the queries select, each once, in the order asked. No queries lists
    everything enumerated (and sets nothing); a namespace query ("thinblock:") lists
    that namespace's enumerated contexts; any other query is a context's exact name."""
    if not queries:
        return list(export.meta_contexts) if listing else []
    selected: dict[str, None] = {}
    for query in queries:
        if listing and query.endswith(":") and query.count(":") == 1:
            selected.update((ctx, None) for ctx in export.meta_contexts if ctx.startswith(query))
        elif export.offers_context(query):
            selected[query] = None
    return list(selected)
