"""The shell around the NBD protocol core: sockets, TLS and threads.

Each connection has a reader thread that feeds bytes to a `ServerConnection`
and acts on its events, and a writer thread for replies the socket cannot take
at once. Small requests run on the reader thread, others in a shared pool of
worker threads; the core lets requests on different blocks run in parallel
(volume.py), so many are in flight per connection and replies go out as they
complete, sent by the thread that finished them when the socket takes them
without blocking. Blocking sockets, not asyncio: the hot path (recv_into,
sendmsg, pread, pwrite) runs without the GIL and without copying each byte
through stream buffers, which made the asyncio version 3-5x slower. Errno
values are mapped to NBD errors here, once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import queue
import select
import socket
import ssl
import struct
import termios
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Protocol

from thinblock.core.delta import changed_ranges
from thinblock.core.pool import Pool
from thinblock.core.registry import STAGING_PREFIX
from thinblock.core.volume import Volume
from thinblock.errors import OpError, ThinblockError
from thinblock.frontends.export import Export, errno_of
from thinblock.frontends.nbd import constants as c
from thinblock.frontends.nbd.authz import Authz, GrantedCatalog
from thinblock.frontends.nbd.limits import Admission, AdmissionLimits, Refusal, Slot, certificate_identity
from thinblock.frontends.nbd.protocol import (
    BASE_ALLOCATION,
    Closed,
    ExportElsewhere,
    ExportInfo,
    ExportRefused,
    NeedData,
    PayloadPending,
    RemoteProtocolError,
    Request,
    Route,
    ServerConnection,
    StartTLS,
    Transmission,
)
from thinblock.frontends.nbd.status import StatusQueue, bounded_status
from thinblock.iovec import IOV_MAX, write_all
from thinblock.listen import LISTEN_BACKLOG, accept_loop, bind_tcp, bind_unix, remove_socket
from thinblock.logtext import shown
from thinblock.meta.base import VolumeRow
from thinblock.privacy import PRIVATE_FILE
from thinblock.runtime import release_runtime_dir
from thinblock.stats import ServerStats

log = logging.getLogger("thinblock.nbd")

MAX_IN_FLIGHT = 64
READ_CHUNK_BYTES = 256 << 10
SMALL_PAYLOAD_BYTES = 16 << 10  # a write payload shorter than this is read along with what follows it
WORKERS = 4
QUICK_REQUEST_BYTES = 128 << 10
BATCH_REPLIES = 32  # inline replies sent in one sendmsg at most
BATCH_BYTES = 1 << 20
# Bytes in flight (write payloads being received or run, read replies being built or
# sent), bounded three ways. A connection holds at most CONNECTION_BUDGET_BYTES (one
# request of the largest size always fits); all connections together hold at most
# SERVER_BUDGET_BYTES, of which requests over LARGE_REQUEST_BYTES may take only
# LARGE_BUDGET_BYTES, so small requests of well-behaved clients always find room.
# A connection over budget is simply not read from until its replies drain.
CONNECTION_BUDGET_BYTES = c.MAX_PAYLOAD_BYTES
SERVER_BUDGET_BYTES = 256 << 20
LARGE_BUDGET_BYTES = 192 << 20
LARGE_REQUEST_BYTES = 1 << 20

# thinblock:changed:SNAPSHOT - bit 0 set: the range differs from the snapshot.
CHANGED_PREFIX = "thinblock:changed:"
STATE_CHANGED = 1
# thinblock:guaranteed - bit 0 set: a write to the range never fails with ENOSPC
# (the "other context" base:allocation's HOLE rule defers to; see docs/allocation.md).
GUARANTEED = "thinblock:guaranteed"
STATE_GUARANTEED = 1

_ERRNO_TO_NBD = {
    errno.EPERM: c.EPERM,
    errno.EROFS: c.EPERM,
    errno.EIO: c.EIO,
    errno.ENOMEM: c.ENOMEM,
    errno.EINVAL: c.EINVAL,
    errno.ENOSPC: c.ENOSPC,
    errno.EDQUOT: c.ENOSPC,
    errno.EFBIG: c.ENOSPC,
    errno.EOVERFLOW: c.EOVERFLOW,
    errno.ENOTSUP: c.ENOTSUP,
    errno.EOPNOTSUPP: c.ENOTSUP,
    errno.ESHUTDOWN: c.ESHUTDOWN,
}


# The errno each NBD error stands for (they share Linux's numbers; named here once).
_NBD_TO_ERRNO = {
    c.EPERM: errno.EPERM,
    c.EIO: errno.EIO,
    c.ENOMEM: errno.ENOMEM,
    c.EINVAL: errno.EINVAL,
    c.ENOSPC: errno.ENOSPC,
    c.EOVERFLOW: errno.EOVERFLOW,
    c.ENOTSUP: errno.ENOTSUP,
    c.ESHUTDOWN: errno.ESHUTDOWN,
}

# The request kinds the export handle counts (export.py), by NBD command.
_KIND = {
    c.CMD_READ: "read",
    c.CMD_WRITE: "write",
    c.CMD_FLUSH: "flush",
    c.CMD_TRIM: "trim",
    c.CMD_CACHE: "cache",
    c.CMD_WRITE_ZEROES: "zero",
    c.CMD_BLOCK_STATUS: "block_status",
}


def nbd_error(exc: BaseException) -> int:
    """The NBD error value for a failed request (export.errno_of says which errno)."""
    return _ERRNO_TO_NBD.get(errno_of(exc), c.EIO)


class PoolCatalog:
    """Every volume of the pool is an export, looked up live (new volumes appear at once).

    Nothing here costs more than O(1) per export it answers for: a listing copies the
    registry under the pool lock (a C-speed copy, so I/O is held up for a moment even
    at 100,000 exports) and builds names and descriptions after it; the metadata
    contexts, which name every snapshot of the pool, are built only for the
    META_CONTEXT option that asks for them."""

    def __init__(self, pool: Pool, *, read_only: bool) -> None:
        self.pool = pool
        self.read_only = read_only

    def info(self, vol: Volume) -> ExportInfo:
        return ExportInfo(
            name=vol.name,
            size_bytes=vol.size_bytes,
            read_only=self.read_only or vol.readonly,
            description=describe(self.pool, vol),
            min_block=1,
            preferred_block=min(self.pool.block_size, 1 << 16),
            max_payload=c.MAX_PAYLOAD_BYTES,
            contexts=lambda: self.meta_contexts(vol),
            offers=self.offers,
        )

    def meta_contexts(self, vol: Volume) -> tuple[str, ...]:
        """What an export lists: base:allocation, thinblock:guaranteed, and
        thinblock:changed: against each snapshot taken of it. Not every snapshot of the
        pool: nbdinfo --list lists each export's contexts, which would make it
        quadratic. Any snapshot can still be selected by name (offers)."""
        snapshots = [
            v.name
            for v in self.pool.volumes.dependents(vol.row.id, self.pool.lock)
            if v.row.kind == "snapshot" and not v.name.startswith(STAGING_PREFIX)
        ]
        return (BASE_ALLOCATION, GUARANTEED, *(CHANGED_PREFIX + name for name in snapshots))

    def offers(self, context: str) -> bool:
        """Whether any export may select this context: the two of its own, or
        thinblock:changed: against any snapshot of the pool."""
        if context in (BASE_ALLOCATION, GUARANTEED):
            return True
        if not context.startswith(CHANGED_PREFIX):
            return False
        with self.pool.lock:
            snapshot = self.pool.visible_volume(context.removeprefix(CHANGED_PREFIX))
            return snapshot is not None and snapshot.row.kind == "snapshot"

    def list_names(self) -> list[tuple[str, str]]:
        """(name, description) of every export, sorted by name."""
        with self.pool.lock:
            entries = list(self.pool.volumes.items())
        # Built outside the lock: a description read after a concurrent rename of a
        # snapshot's origin names its new name, which is as true as the old.
        entries.sort(key=itemgetter(0))
        return [
            (name, describe(self.pool, v))
            for name, v in entries
            if not name.startswith(STAGING_PREFIX) and self.pool.serves(v)
        ]

    def lookup(self, name: str) -> ExportInfo | None:
        vol = self.volume(name)
        return None if vol is None else self.info(vol)

    def context_owners(self, context: str) -> tuple[str, ...] | None:
        """The exports whose use lets a client use this context (authz.py): for
        thinblock:changed:SNAP, SNAP itself and the volume or snapshot it was taken
        of; None for the contexts that only describe the export they are used on."""
        if not context.startswith(CHANGED_PREFIX):
            return None
        name = context.removeprefix(CHANGED_PREFIX)
        with self.pool.lock:
            snapshot = self.pool.visible_volume(name)
            origin = self.pool.volume_by_id(snapshot.row.origin_id) if snapshot is not None else None
            return (name, origin.name) if origin is not None else (name,)

    def volume(self, name: str) -> Volume | None:
        """The volume behind an export name; "" is the default export when the pool has one volume."""
        with self.pool.lock:
            if name == "":
                volumes = [v for v in self.pool.visible().values() if v.row.kind == "volume" and self.pool.serves(v)]
                return volumes[0] if len(volumes) == 1 else None
            vol = self.pool.visible_volume(name)
        if vol is None:
            return self.unknown(name)
        if not self.pool.serves(vol):
            return self.elsewhere(vol)
        return vol

    def elsewhere(self, vol: Volume) -> Volume:
        """vol exists and this process does not serve it: say who does (ExportElsewhere),
        or serve it after all (workers.py's catalog claims a volume nobody holds)."""
        raise ExportElsewhere(self.pool.served_elsewhere(vol))

    def unknown(self, name: str) -> Volume | None:
        """No such export here (workers.py's catalog looks further)."""
        return None


def describe(pool: Pool, vol: Volume) -> str:
    """An export's description: a snapshot says of which volume and when it was taken
    (its origin found by id, O(1)); no description names any other export."""
    origin = pool.volume_by_id(vol.row.origin_id) if vol.row.kind == "snapshot" else None
    return describe_row(vol.row, origin.name if origin else None)


def describe_row(row: VolumeRow, origin: str | None) -> str:
    """describe() of a row (origin: the name of the volume a snapshot was taken of, None
    when removed), for exports known from the store only (workers.py)."""
    if row.kind != "snapshot":
        return f"thinblock volume {row.name}"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(row.created)) if row.created else "at an unknown time"
    return f"thinblock snapshot {row.name} of {origin or 'a removed volume'}, taken {when}"


def execute(conn: ServerConnection, vol: Export, req: Request) -> list[bytes]:
    """Run one validated request against the volume; the reply as buffers. Runs in a worker thread."""
    fua = bool(req.flags & c.CMD_FLAG_FUA)
    cmd = req.command
    if cmd == c.CMD_READ:
        if req.flags & c.CMD_FLAG_DF or not conn.neg.structured:
            return conn.read_reply(req.cookie, [(req.offset, req.length, vol.read(req.offset, req.length))])
        return conn.read_reply(req.cookie, vol.read_sparse(req.offset, req.length))
    if cmd == c.CMD_WRITE:
        assert req.payload is not None
        vol.write(req.offset, req.payload, fua=fua)
    elif cmd == c.CMD_FLUSH:
        vol.flush()
    elif cmd == c.CMD_TRIM:
        vol.trim(req.offset, req.length, fua=fua)
    elif cmd == c.CMD_WRITE_ZEROES:
        vol.write_zeroes(
            req.offset,
            req.length,
            no_hole=bool(req.flags & c.CMD_FLAG_NO_HOLE),
            fast=bool(req.flags & c.CMD_FLAG_FAST_ZERO),
            fua=fua,
        )
    elif cmd == c.CMD_CACHE:
        vol.cache(req.offset, req.length)
    elif cmd == c.CMD_BLOCK_STATUS:
        # Bounded and paced (status.py): the reply may cover less than was asked.
        replies = vol.counted(
            "block_status",
            req.length,
            lambda: bounded_status(
                lambda name, offset, length: context_extents(vol, name, offset, length),
                conn.neg.contexts,
                status_volumes(vol, conn.neg.contexts.values()),
                req.offset,
                req.length,
                req_one=bool(req.flags & c.CMD_FLAG_REQ_ONE),
            ),
        )
        return [conn.block_status_reply(req.cookie, replies)]
    return [conn.simple_reply(req.cookie)]


def bind_compared(export: Export, contexts: Iterable[str]) -> None:
    """Bind each thinblock:changed:SNAP context to the snapshot that has that name now,
    as the client enters transmission, for the connection's life (Export.compared)."""
    pool = export.pool
    with pool.lock:
        for name in contexts:
            if name.startswith(CHANGED_PREFIX):
                snapshot = pool.volumes.get(name.removeprefix(CHANGED_PREFIX))
                ok = snapshot is not None and snapshot.row.kind == "snapshot"
                export.compared[name] = snapshot if ok else None


def compared_snapshot(export: Export, context: str) -> Volume | None:
    """The snapshot a thinblock:changed: context was bound to, unless it is gone."""
    snapshot = export.compared.get(context)
    return None if snapshot is None or snapshot.removed else snapshot


def status_volumes(export: Export, contexts: Iterable[str]) -> list[Volume]:
    """The volumes a block status walk reads: the export's, and each snapshot that a
    thinblock:changed: context compares it with (status.slice_ends bounds the walk by
    the pages of all of them)."""
    vols = [export.volume]
    for name in contexts:
        if name.startswith(CHANGED_PREFIX):
            snapshot = compared_snapshot(export, name)
            if snapshot is not None:
                vols.append(snapshot)
    return vols


def context_extents(export: Export, context: str, offset: int, length: int) -> list[tuple[int, int]]:
    """(length, flags) extents of one metadata context over [offset, offset+length)."""
    if context == BASE_ALLOCATION:
        return [
            (n, (c.STATE_HOLE if hole else 0) | (c.STATE_ZERO if zero else 0))
            for n, hole, zero in export.allocation(offset, length)
        ]
    if context == GUARANTEED:
        return [(n, STATE_GUARANTEED if sure else 0) for n, sure in export.guaranteed(offset, length)]
    vol = export.volume
    snapshot = compared_snapshot(export, context)
    if snapshot is None:
        # The snapshot was removed since negotiation (even if another took its name
        # since): everything counts as changed, so a backup client copies too much
        # rather than too little.
        return [(length, STATE_CHANGED)]
    extents: list[tuple[int, int]] = []
    pos = offset
    for start, n in changed_ranges(snapshot, vol, offset, length):
        if start > pos:
            extents.append((start - pos, 0))
        extents.append((n, STATE_CHANGED))
        pos = start + n
    if pos < offset + length:
        extents.append((offset + length - pos, 0))
    return extents


def _quick(req: Request, inline: bool) -> bool:
    """Small data requests run on the connection's reader thread; big ones, flushes and
    FUA writes (which wait for the disk) go to the worker pool, so the reader keeps
    reading and their replies may overtake or follow others. On a store that wants
    many operations in flight (inline False: RADOS) every request goes to the pool."""
    if not inline or req.flags & c.CMD_FLAG_FUA or req.command == c.CMD_FLUSH:
        return False
    return req.command in (c.CMD_READ, c.CMD_WRITE) and req.length <= QUICK_REQUEST_BYTES


@dataclass
class TLSConfig:
    cert: str
    key: str
    ca: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cipher_policy(ctx)
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca:
            ctx.load_verify_locations(self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


# TLS 1.2 suites with forward secrecy (ephemeral ECDH or DH) and an AEAD cipher
# (AES-GCM, ChaCha20-Poly1305) only: no static-RSA key exchange, no CBC, no SHA-1
# MACs. TLS 1.3 suites are all of that kind and are left to OpenSSL's defaults.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:!aNULL:!eNULL:!PSK:!SRP:!DSS:!SHA1"


def cipher_policy(ctx: ssl.SSLContext) -> None:
    """TLS 1.2 or newer, forward-secret AEAD suites only, no compression or renegotiation."""
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION


PAYLOAD_POLL_S = 1.0  # how often a reader in a write's payload looks whether it stalls others
TLS_RECORD_BYTES = 16 << 10  # the most plaintext one TLS record carries: the smallest piece a TLS reply goes in


class _PayloadStalled(Exception):
    """A client stalled (a write's payload, or reading its replies) while other clients
    waited for memory (Limits.payload_idle_s)."""


class ByteBudget:
    """A count of bytes in flight with a ceiling; acquire blocks while it is reached.

    A request larger than the whole budget still runs when nothing else holds any
    (it can never fit otherwise)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        # The fast path takes the plain lock (C); the condition is used only to wait.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._waiting = 0

    def acquire(self, n_bytes: int, stopping: threading.Event) -> bool:
        """Take n_bytes; False if the server stops while waiting."""
        with self._mutex:
            while self.used_bytes and self.used_bytes + n_bytes > self.limit_bytes:
                if stopping.is_set():
                    return False
                self._waiting += 1
                self._cond.wait(0.5)
                self._waiting -= 1
            self.used_bytes += n_bytes
            return True

    @property
    def waited_for(self) -> bool:
        """Whether some acquire() is waiting for bytes to be released."""
        return self._waiting > 0

    def try_acquire(self, n_bytes: int) -> bool:
        """Take n_bytes if that needs no wait."""
        with self._mutex:
            if self.used_bytes and self.used_bytes + n_bytes > self.limit_bytes:
                return False
            self.used_bytes += n_bytes
            return True

    def release(self, n_bytes: int) -> None:
        with self._mutex:
            self.used_bytes -= n_bytes
            if self._waiting:
                self._cond.notify_all()


def request_cost(req: Request) -> int:
    """The bytes a request holds while in flight: its payload or its reply's data."""
    if req.command in (c.CMD_READ, c.CMD_WRITE):
        return req.length
    return 0


@dataclass(frozen=True)
class Handed:
    """A connection another process of the same server accepted and negotiated in
    part, then handed here (serve --workers, workers.py): its protocol state, who
    the client is, and, when it came over TLS, the client's certificate (that
    process keeps the TLS session and relays its bytes)."""

    state: dict[str, Any]
    peer: str  # as the log names it: "127.0.0.1:50412" or "unix"
    address: str | None  # the client's address, for the per-address limits
    tls: bool
    peercert: dict[str, Any] | None
    via: str  # the process that handed it over
    hops: int = 1  # hand-overs of its pending option, unanswered (next_hops, MAX_HOPS)


def next_hops(earlier: Handed | None, state: dict[str, Any]) -> int:
    """The hops of a connection handed on (state: its handoff_state now): the hand-overs
    of one option no worker answered, so the bound (MAX_HOPS) stops two workers passing
    it back and forth, not a client asking about many exports (nbdinfo --list asks each
    in turn). Stuck: no option was answered since it came handed here."""
    if earlier is None:
        return 1
    stuck = state.get("options_handled") == earlier.state.get("options_handled")
    return earlier.hops + 1 if stuck else 1


class Router(Protocol):
    """Where a Route event's connection goes (workers.py): send raises OSError or
    ThinblockError, with why, only when nothing was sent (the connection is still the
    caller's); once sent, the connection is the target's alone."""

    def send(self, target: str, sock: socket.socket, handed: Handed) -> None: ...


class _Refusing:
    """The catalog a connection past the cap sees: every export refused, with why."""

    def __init__(self, message: str) -> None:
        self.message = message

    def list_names(self) -> list[tuple[str, str]]:
        raise ExportRefused(self.message)

    def lookup(self, name: str) -> ExportInfo | None:
        raise ExportRefused(self.message)


REFUSERS = 16  # connections past the cap told why at once; more are just closed
REFUSE_S = 2.0


@dataclass(frozen=True)
class Limits:
    """What one client may hold: a connection slot, and time to negotiate (the slot
    rules are limits.py's)."""

    max_connections: int = 256
    handshake_s: float = 30.0  # from connect to the first request, TLS included
    idle_s: float = 10.0  # silence allowed between two negotiation messages
    # Silence allowed in the middle of a write's payload while other clients wait for
    # memory: what was reserved for the payload may be what they wait for, so a sender
    # that stopped half-way is then disconnected rather than allowed to hold it forever.
    # While nobody waits it may stay silent (a frozen client: a paused container).
    payload_idle_s: float = 20.0
    max_negotiating_per_address: int = AdmissionLimits.max_negotiating_per_address
    max_connections_per_address: int = AdmissionLimits.max_connections_per_address
    max_connections_per_identity: int = AdmissionLimits.max_connections_per_identity

    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(
            self.max_connections,
            self.max_negotiating_per_address,
            self.max_connections_per_address,
            self.max_connections_per_identity,
        )


class NBDServer:
    """Serves every volume of an open pool over NBD."""

    def __init__(
        self,
        pool: Pool,
        *,
        read_only: bool = False,
        tls: TLSConfig | None = None,
        authz: Authz | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.pool = pool
        self.catalog = PoolCatalog(pool, read_only=read_only)
        self.ssl_context = tls.context() if tls else None
        self.authz = authz
        self.limits = limits or Limits()
        self.admission = Admission(self.limits.admission())
        self._refusing = 0  # connections past the cap being told why
        self._refused_logged = 0.0  # when a refusal was last logged
        depth = pool.store.queue_depth
        self.inline_small = depth <= 1
        self.executor = ThreadPoolExecutor(
            max_workers=max(WORKERS, min(depth, MAX_IN_FLIGHT)), thread_name_prefix="thinblock-nbd-worker"
        )
        # Block status walks, every client's, one at a time, paced, in turn (status.py).
        self.status_queue = StatusQueue()
        self.listeners: list[socket.socket] = []
        self.shared_listeners: list[socket.socket] = []  # accepted on by sibling workers too
        self.unix_paths: list[tuple[str, int]] = []
        self.threads: list[threading.Thread] = []
        self.sessions: set[Session] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._next_id = 0
        self.budget = ByteBudget(SERVER_BUDGET_BYTES)
        self.large_budget = ByteBudget(LARGE_BUDGET_BYTES)
        self.stats = ServerStats()  # connections admitted and refused (metrics)
        self.router: Router | None = None  # serve --workers: hands connections to siblings

    def memory_wanted(self) -> bool:
        """Whether a client's request waits for the server's memory budgets."""
        return self.budget.waited_for or self.large_budget.waited_for

    def listen_unix(self, path: str, *, mode: int = PRIVATE_FILE, gid: int | None = None) -> None:
        """Listen at path (mode 0600 unless shared with a group), replacing a dead
        server's socket there; anything else there is refused (listen.bind_unix)."""
        sock = bind_unix(path, mode=mode, gid=gid)
        path = os.path.abspath(path)  # removed at the end even after a FUSE thread's chdir("/")
        self.unix_paths.append((path, os.stat(path).st_ino))
        self._listen(sock)

    def listen_socket(self, sock: socket.socket, *, shared: bool = False) -> None:
        """Serve a socket already listening (socket activation); it is closed at the
        end but, being the service manager's, its path is never removed. shared: other
        processes accept on it too (serve --workers), so it is never shut down, which
        would stop them all: its accepts wake every ACCEPT_POLL_S to see the stop."""
        if shared:
            sock.settimeout(ACCEPT_POLL_S)
            self.shared_listeners.append(sock)
        self._listen(sock)

    def listen_tcp(self, host: str, port: int) -> int:
        sock = bind_tcp(host, port)
        self._listen(sock)
        return int(sock.getsockname()[1])

    def _listen(self, sock: socket.socket) -> None:
        sock.listen(LISTEN_BACKLOG)
        self.listeners.append(sock)
        thread = threading.Thread(target=self._accept_loop, args=(sock,), name="thinblock-nbd-accept", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        accept_loop(listener, self.stopping, self._take_safely, log, "the NBD listener")

    def _take_safely(self, sock: socket.socket) -> None:
        """_take, such that a bug met by one connection never ends the accept loop."""
        try:
            self._take(sock)
        except Exception:
            log.exception("dropped a new connection: internal error")
            with contextlib.suppress(OSError):
                sock.close()

    def _take(self, sock: socket.socket) -> None:
        """A new connection: a session, or past a limit (limits.py) a refusal."""
        try:
            address = sock.getpeername()[0] if sock.family != socket.AF_UNIX else None
            session = Session(self, sock, self._next_sid())
        except OSError:  # gone before it was looked at
            sock.close()
            return
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        refused = self._admit(session, address)
        if refused is not None:
            if time.monotonic() - self._refused_logged > 5:
                self._refused_logged = time.monotonic()
                log.warning("refused a connection from %s: %s", address or "the unix socket", refused)
            self._refuse(sock, refused)

    def adopt(self, sock: socket.socket, handed: Handed) -> str | None:
        """A connection handed over by a sibling process (serve --workers): admitted
        under this server's limits and served from the option it was handed at. None
        when taken, else why not (the caller answers that option with it: workers.py)."""
        if self.stopping.is_set():
            return "the server is stopping"
        try:
            session = Session(self, sock, self._next_sid(), handed)
        except RemoteProtocolError as exc:
            return str(exc)
        refused = self._admit(session, handed.address)
        return None if refused is None else str(refused)

    def _next_sid(self) -> int:
        with self.lock:
            self._next_id += 1
            return self._next_id

    def _admit(self, session: Session, address: str | None) -> Refusal | None:
        """A session under the admission rules (limits.py): registered and started, or
        the refusal (counted), with nothing started."""
        admitted = self.admission.admit(address, session)
        if isinstance(admitted, str):
            self.stats.refuse(admitted.limit)
            return admitted
        session.slot = admitted
        self.stats.accept()
        with self.lock:
            self.sessions.add(session)
        session.start()
        return None

    def _refuse(self, sock: socket.socket, message: str) -> None:
        """Tell a client past the connection cap why (NBD_REP_ERR_POLICY on its options),
        on a thread of its own with a short deadline; past REFUSERS such threads at
        once, the connection is just closed."""
        with self.lock:
            if self._refusing >= REFUSERS:
                sock.close()
                return
            self._refusing += 1
        threading.Thread(
            target=self._refuse_run, args=(sock, message), name="thinblock-nbd-refuse", daemon=True
        ).start()

    def _refuse_run(self, sock: socket.socket, message: str) -> None:
        conn = ServerConnection(_Refusing(message))
        deadline = time.monotonic() + REFUSE_S
        try:
            sock.sendall(conn.data_to_send())
            while time.monotonic() < deadline:
                event = conn.next_event()
                out = conn.data_to_send()
                if out:
                    sock.sendall(out)
                if isinstance(event, Closed | Transmission | StartTLS):
                    break
                if isinstance(event, NeedData):
                    sock.settimeout(max(0.01, deadline - time.monotonic()))
                    data = sock.recv(4096)
                    if not data:
                        break
                    conn.receive_data(data)
        except (OSError, RemoteProtocolError):
            pass
        finally:
            sock.close()
            with self.lock:
                self._refusing -= 1

    def reload_authz(self) -> bool:
        """Read the --tls-authz file again (SIGHUP): new connections and options use the
        new rules, and connections that lost their grant are ended. A file that does
        not load changes nothing (one log line). True if the new rules are in force."""
        if self.authz is None:
            log.warning("SIGHUP: there is no --tls-authz file to reload")
            return False
        try:
            authz = Authz.load(self.authz.path)
        except ThinblockError as exc:
            log.error("reloading --tls-authz failed, the previous rules stay in force: %s", exc)
            return False
        with self.lock:
            self.authz = authz
            sessions = list(self.sessions)
        for session in sessions:
            session.regrant(authz)
        log.info("reloaded --tls-authz %s: %d rule(s)", authz.path, len(authz.rules))
        return True

    def hang_up_volume(self, vol: Volume) -> int:
        """End the sessions using vol and the snapshots taken of it (through snapshots of
        snapshots), letting their in-flight requests finish: a handover (`serve
        --volume --takeover`). How many."""
        with self.lock:
            sessions = [
                s
                for s in self.sessions
                if s.export is not None and self.pool.base_volume_id(s.export.volume) == vol.row.id
            ]
        for session in sessions:
            session.handed_over = True
            session.hang_up()
        for session in sessions:
            session.join(timeout=10)
            if session.reader.is_alive():
                session.hang_up(both=True)
                session.join()
        return len(sessions)

    def close(self) -> None:
        """Stop accepting, let in-flight requests finish, end every session."""
        self.stopping.set()
        self.pool.cancel_waits()  # writes held by the wait policy fail now
        for listener in self.listeners:
            if listener not in self.shared_listeners:
                with contextlib.suppress(OSError):
                    listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for thread in self.threads:
            thread.join()
        for path, inode in self.unix_paths:
            remove_socket(path, inode)
            release_runtime_dir(os.path.dirname(path))  # a rados: pool's, when nothing else is in it
        with self.lock:
            sessions = list(self.sessions)
        for session in sessions:
            session.hang_up()
        for session in sessions:
            session.join(timeout=10)
            if session.reader.is_alive():
                session.hang_up(both=True)  # a client that reads no replies must not hold up the stop
                session.join()
        self.executor.shutdown(wait=True)
        self.status_queue.shutdown()


class Session:
    """One client connection: a reader thread, a writer thread, work in the shared pool.

    Workers never block on the socket: a reply goes out at once only if the
    socket takes it whole without waiting, else it is queued for the writer, so a
    client that stops reading stalls only its own writer and, through the
    in-flight limit, its own reader.
    """

    def __init__(self, server: NBDServer, sock: socket.socket, sid: int, handed: Handed | None = None) -> None:
        self.server = server
        self.sock: socket.socket = sock
        self.handed = handed
        tls = server.ssl_context is not None
        if handed is None:
            self.peer = peer_name(sock)
            self.name = f"#{sid} {self.peer}"
            self.conn = ServerConnection(server.catalog, tls_required=tls, tls_available=tls)
        else:
            self.peer = handed.peer
            self.name = f"#{sid} {handed.peer} (handed over by {handed.via})"
            self.conn = ServerConnection.resume(server.catalog, handed.state, tls_required=tls, tls_available=tls)
        self.export: Export | None = None
        self.handed_over = False  # hung up for a handover (hang_up_volume): the log says so
        self.slots = ByteBudget(MAX_IN_FLIGHT)  # requests in flight, one unit each
        self.budget = ByteBudget(CONNECTION_BUDGET_BYTES)
        self.reserved = 0  # bytes taken for a write payload announced and not yet a Request
        self.replies: queue.SimpleQueue[tuple[list[bytes], list[int]] | None] = queue.SimpleQueue()
        self.batch: list[bytes] = []  # replies of inline requests, sent together
        self.batch_costs: list[int] = []
        self.batch_bytes = 0
        self.reader = threading.Thread(target=self._run, name=f"thinblock-nbd-{sid}", daemon=True)
        self.writer: threading.Thread | None = None
        self.pending = 0  # requests taken and not yet finished
        self._pending_mutex = threading.Lock()
        self.pending_done = threading.Condition(self._pending_mutex)
        self.draining = False
        self.send_lock = threading.Lock()
        self.queued = 0  # replies handed to the writer thread and not yet sent
        self.inline_sends = True  # until TLS starts: an SSL socket is written by the writer only
        self.lost_grant: str | None = None  # why a reloaded --tls-authz ended this connection
        self.peer_gone = False  # the client closed or the connection broke: queued walks are skipped
        self.slot: Slot | None = None  # its place under the admission rules (limits.py)

    # ----- what the admission rules ask of an occupant (limits.Occupant) ------------

    def readable(self) -> bool:
        """The client sent bytes not yet read (or closed): it is not silent."""
        fd = self.sock.fileno()
        if fd < 0:  # closed already: its slot is about to be released
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return False

    def displace(self) -> None:
        """A newcomer takes this silent connection's slot: hang up (the reader then ends)."""
        self.hang_up(both=True)

    def _first_byte(self) -> bool:
        """Wait for the client's first byte, leaving it unread (a peek), then tell the
        admission rules it spoke; False if it was displaced first or closed."""
        try:
            if not self.sock.recv(1, socket.MSG_PEEK):
                return False
        except OSError:
            if self.slot is not None and self.slot.displaced:
                return False
            raise
        return self.slot is None or self.server.admission.heard(self.slot)

    def _claim_identity(self, cert: dict[str, Any] | None) -> None:
        """Count this TLS connection against its certificate; past the per-certificate
        limit its options are refused with the reason (NBD_REP_ERR_POLICY)."""
        identity = certificate_identity(cert)
        if identity is None or self.slot is None:
            return
        problem = self.server.admission.claim_identity(self.slot, identity)
        if problem is not None:
            self.server.stats.refuse(problem.limit)
            log.warning("%s: refused: %s", self.name, problem)
            self.conn.catalog = _Refusing(problem)

    def start(self) -> None:
        self.reader.start()

    def join(self, timeout: float | None = None) -> None:
        self.reader.join(timeout)

    def hang_up(self, *, both: bool = False) -> None:
        # socket.socket.shutdown, not SSLSocket.shutdown: that one drops the TLS state at
        # once, and the replies still going out would then leave in plaintext.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR if both else socket.SHUT_RD)

    def _run(self) -> None:
        log.info("%s: connected", self.name)
        reason = "server shutting down"
        limits = self.server.limits
        self.deadline = time.monotonic() + limits.handshake_s
        try:
            self.sock.settimeout(limits.idle_s)  # until transmission: no client holds a slot forever
            if self.handed is not None:  # greeted and heard by the process that accepted it
                reason = self._resume(self.handed)
            else:
                self._send([self.conn.data_to_send()])  # the greeting
                if self._first_byte():
                    reason = self._loop()
                else:
                    displaced = self.slot is not None and self.slot.displaced
                    reason = "displaced by a newer connection: it had sent nothing" if displaced else "client closed"
        except RemoteProtocolError as exc:
            reason = f"protocol error: {exc}"
            log.warning("%s: %s", self.name, reason)
        except TimeoutError:
            reason = f"negotiation timed out ({limits.idle_s:g} s of silence or {limits.handshake_s:g} s in all)"
            log.warning("%s: %s", self.name, reason)
        except _PayloadStalled as exc:
            reason = f"{exc}: closed to free the memory it held"
            log.warning("%s: %s", self.name, reason)
        except (OSError, ssl.SSLError) as exc:
            self.peer_gone = True
            reason = f"connection lost: {exc}"
        finally:
            with self.pending_done:
                self.draining = True
                while self.pending:
                    self.pending_done.wait()
            self._flush_batch()  # replies still batched go out (or, on a broken socket, are dropped)
            if self.writer is not None:
                self.replies.put(None)
                self.writer.join()
            if self.reserved:  # the client left in the middle of a write payload
                self._give_budget(self.reserved)
                self.reserved = 0
            if self.slot is not None:  # before the socket closes: nobody polls a closed one
                self.server.admission.release(self.slot)
            with contextlib.suppress(OSError):
                self.sock.close()
            with self.server.lock:
                self.server.sessions.discard(self)
            if self.export is not None:
                self.export.close()
            if self.lost_grant is not None:
                reason = f"grant withdrawn: {self.lost_grant}"
            elif self.handed_over:
                reason = "its volume was handed over to another server (serve --takeover)"
            log.info("%s: closed (%s)", self.name, reason)

    def _loop(self) -> str:
        buf = bytearray(READ_CHUNK_BYTES)
        view = memoryview(buf)
        conn = self.conn
        while True:
            event = conn.next_event()
            out = conn.data_to_send()  # option replies written while producing the event
            if out:
                self._send([out])
            if isinstance(event, NeedData):
                if self.export is None and self.writer is None:  # still negotiating: bounded
                    remaining = self.deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    self.sock.settimeout(min(self.server.limits.idle_s, remaining))
                self._flush_batch()  # before waiting for the client: its replies go out now
                target = conn.receive_buffer()  # a large write payload: straight into its buffer
                if target is not None:
                    with target:  # released before the buffer is handed on (and trimmed)
                        n = self._recv_into(target)
                    self.peer_gone = not n
                    conn.received_into(n)
                    continue
                # A large write payload's tail is read alone, so it is not copied; a small
                # one is read with whatever follows it (pipelined requests: one recv, not
                # one per payload, and their replies go out together).
                wanted = conn.wanted()
                n = self._recv_into(view[:wanted] if SMALL_PAYLOAD_BYTES <= wanted < len(view) else view)
                self.peer_gone = not n
                conn.receive_data(view[:n])
            elif isinstance(event, PayloadPending):
                # Reserve memory for the payload before reading it: over budget, this
                # connection is not read from (its client waits), others go on.
                if not self._take_budget(event.length):
                    return "server shutting down"
                self.reserved = event.length
            elif isinstance(event, Request):
                cost = request_cost(event)
                quick = _quick(event, self.server.inline_small)
                if self.reserved:
                    assert cost == self.reserved
                    self.reserved = 0
                else:
                    if not quick:
                        self._flush_batch()  # the budget may have to wait for those replies
                    if not self._take_budget(cost):
                        return "server shutting down"
                if not self.slots.try_acquire(1):
                    self._flush_batch()
                    if not self.slots.acquire(1, self.server.stopping):
                        self._give_budget(cost)
                        return "server shutting down"
                with self._pending_mutex:
                    self.pending += 1
                if quick:
                    self._work(event, cost, inline=True)  # no thread handoff for small requests
                else:
                    self._flush_batch()
                    if event.command == c.CMD_BLOCK_STATUS:  # the one paced status thread
                        self.server.status_queue.submit(self, functools.partial(self._work, event, cost))
                    else:
                        self.server.executor.submit(self._work, event, cost)
            elif isinstance(event, Route):
                if (ended := self._route(event)) is not None:
                    return ended
            elif isinstance(event, StartTLS):
                assert self.server.ssl_context is not None
                self.sock = self.server.ssl_context.wrap_socket(self.sock, server_side=True)
                self.inline_sends = False
                assert isinstance(self.sock, ssl.SSLSocket)
                log.info("%s: TLS started (%s, %s)", self.name, self.sock.version(), (self.sock.cipher() or ("?",))[0])
                self._authorise(self._peercert())
                self._claim_identity(self._peercert())
            elif isinstance(event, Transmission):
                self.sock.settimeout(None)  # requests may be far apart; replies must not time out
                if self.slot is not None:
                    self.server.admission.serving(self.slot)
                vol = self.server.catalog.volume(event.export.name)
                if vol is not None:
                    self.export = Export(
                        self.server.pool, vol, read_only=event.export.read_only, holder=f"NBD connection {self.name}"
                    )
                    bind_compared(self.export, event.contexts.values())
                self.writer = threading.Thread(target=self._write_loop, name=f"{self.reader.name}-w", daemon=True)
                self.writer.start()
                self._check_grant()
                log.info(
                    "%s: export '%s' (%s bytes%s%s)",
                    self.name,
                    shown(event.export.name),
                    event.export.size_bytes,
                    ", structured replies" if event.structured else "",
                    f", contexts {', '.join(shown(n) for n in sorted(event.contexts.values()))}"
                    if event.contexts
                    else "",
                )
            elif isinstance(event, Closed):
                return event.reason

    def _resume(self, handed: Handed) -> str:
        """Serve a connection handed over by a sibling from where it was left: under
        that client's TLS certificate, when it came over TLS (the sibling relays it)."""
        if self.slot is not None and not self.server.admission.heard(self.slot):
            return "displaced by a newer connection"
        if handed.tls:
            self._authorise(handed.peercert)
            self._claim_identity(handed.peercert)
        return self._loop()

    def _route(self, event: Route) -> str | None:
        """Hand this connection to the sibling serving the export its next option names
        (serve --workers): the socket itself, or over TLS, whose session cannot move
        between processes, one end of a socket pair whose bytes this session then
        relays until either side closes. The reason the session ends here, or None
        when nothing could be sent and the option was answered here with why."""
        router = self.server.router
        # A connection that came here already relayed keeps its client's TLS identity:
        # it goes on as the socket pair it is, still relayed by the worker holding TLS.
        earlier = self.handed
        relayed_here = isinstance(self.sock, ssl.SSLSocket)
        state = self.conn.handoff_state()
        handed = Handed(
            state=state,
            peer=self.peer,
            address=self.slot.address if self.slot is not None else None,
            tls=relayed_here or (earlier is not None and earlier.tls),
            peercert=earlier.peercert if earlier is not None and earlier.tls else self._peercert(),
            via=f"worker pid {os.getpid()}",
            hops=next_hops(earlier, state),
        )
        near: socket.socket | None = None
        try:
            if router is None:
                raise ThinblockError("this server hands no connections over")
            if handed.hops > MAX_HOPS:
                raise ThinblockError(f"this option was handed over {handed.hops - 1} times already, unanswered")
            if relayed_here:
                near, far = socket.socketpair()
                try:
                    router.send(event.target, far, handed)
                finally:
                    far.close()
            else:
                router.send(event.target, self.sock, handed)
        except (OSError, ThinblockError) as exc:
            if near is not None:
                near.close()
            why = (
                f"export '{shown(event.export_name)}' is served by worker {event.target}, which did not take it: {exc}"
            )
            log.warning("%s: %s", self.name, why)
            closed = self.conn.refuse_routed(why)
            return closed.reason if closed is not None else None
        if near is None:
            return f"handed over to worker {event.target} (export '{shown(event.export_name)}')"
        if self.slot is not None:
            self.server.admission.serving(self.slot)
        log.info("%s: export '%s' is served by worker %s: relaying its TLS", self.name, event.export_name, event.target)
        relay(self.sock, near)
        return f"relayed to worker {event.target} until it ended (export '{shown(event.export_name)}')"

    def _peercert(self) -> dict[str, Any] | None:
        return self.sock.getpeercert() if isinstance(self.sock, ssl.SSLSocket) else None

    def _recv_into(self, buf: memoryview) -> int:
        """recv_into, except that in a write's payload the wait for its bytes looks every
        PAYLOAD_POLL_S: silent for payload_idle_s while other clients wait for memory,
        the sender is cut off (_PayloadStalled); otherwise it may go on waiting. (A poll,
        not a socket timeout: that would also bound the workers' sends on the socket.)"""
        if self.reserved:  # memory is held for a write's payload, announced and not complete
            self._stalled_unless(select.POLLIN, "its write's payload")
        return self.sock.recv_into(buf)

    def _stalled_unless(self, event: int, what: str) -> None:
        """Wait until the socket is ready for event; raise _PayloadStalled if it stays
        silent for payload_idle_s while other clients wait for memory."""
        sock = self.sock
        if event == select.POLLIN and isinstance(sock, ssl.SSLSocket) and sock.pending():
            return  # decrypted bytes are waiting already
        poller = select.poll()
        poller.register(sock.fileno(), event)
        since = time.monotonic()
        limit = self.server.limits.payload_idle_s
        while not poller.poll(PAYLOAD_POLL_S * 1000):
            if time.monotonic() - since >= limit and self.server.memory_wanted():
                raise _PayloadStalled(f"{what} stalled ({limit:g} s while other clients waited for memory)")

    def _authorise(self, cert: dict[str, Any] | None) -> None:
        """Under --tls-authz, the client's view of the exports is its certificate's grant
        (under the server lock, so a reload in between is never missed)."""
        with self.server.lock:
            if self.server.authz is None:
                return
            who, grant = self.server.authz.client(cert)
            self.conn.catalog = GrantedCatalog(
                self.server.catalog, who, grant, self.name, refused=lambda: self.server.stats.refuse("authz")
            )
        if who.problem:
            log.warning("%s: client certificate %s %s", self.name, who.shown, who.problem)

    def regrant(self, authz: Authz) -> None:
        """A reloaded authorisation list: the client's grant is looked up again, and a
        connection in transmission whose export, access or contexts it no longer
        covers is ended (its requests in flight are answered first; _run)."""
        catalog = self.conn.catalog
        if not isinstance(catalog, GrantedCatalog):
            return  # TLS not started yet: _authorise will use the new list
        catalog.regrant(authz.grant(catalog.who))
        self._check_grant()

    def _check_grant(self) -> None:
        """End a connection in transmission that its current grant no longer covers.
        Run by a reload after it swapped the grant, and by the reader after it entered
        transmission, so a GO that raced a reload is caught by one or the other."""
        catalog = self.conn.catalog
        export = self.conn.export
        if not isinstance(catalog, GrantedCatalog) or export is None:
            return  # still negotiating: the next option sees the current grant
        why = catalog.lost(export, list(self.conn.neg.contexts.values()))
        if why is not None and self.lost_grant is None:
            self.lost_grant = why
            log.warning("%s: closing: client certificate %s: %s", self.name, catalog.who.shown, why)
            self.hang_up()

    def _context_refused(self) -> str | None:
        """A negotiated context this client may no longer use (its snapshot was replaced
        by another of the same name, or the grant changed), or None."""
        catalog = self.conn.catalog
        if isinstance(catalog, GrantedCatalog):
            for context in self.conn.neg.contexts.values():
                if not catalog.allows_context(context):
                    return context
        return None

    def _take_budget(self, cost: int) -> bool:
        """The connection's share, then the server's (and its large-request share)."""
        stopping = self.server.stopping
        if not self.budget.acquire(cost, stopping):
            return False
        if cost > LARGE_REQUEST_BYTES and not self.server.large_budget.acquire(cost, stopping):
            self.budget.release(cost)
            return False
        if not self.server.budget.acquire(cost, stopping):
            self._give_budget(cost, server=False)
            return False
        return True

    def _give_budget(self, cost: int, *, server: bool = True) -> None:
        self._give_back([cost], server=server)

    def _give_back(self, costs: list[int], *, server: bool = True) -> None:
        """What requests held goes back to each budget _take_budget took it from, in
        one release per budget however many requests."""
        total = sum(costs)
        if server:
            self.server.budget.release(total)
        if large := sum(cost for cost in costs if cost > LARGE_REQUEST_BYTES):
            self.server.large_budget.release(large)
        self.budget.release(total)

    def _work(self, req: Request, cost: int, *, inline: bool = False) -> None:
        """Run a request; inline (on the reader thread), its reply joins the batch that
        goes out in one send when the reader next waits for the client."""
        try:
            reply = self._reply(req)
            req.payload = None  # the write's bytes are done with; the reply holds the read's
            if inline:
                self.batch += reply
                self.batch_costs.append(cost)
                self.batch_bytes += sum(map(len, reply))
                if len(self.batch_costs) >= BATCH_REPLIES or self.batch_bytes >= BATCH_BYTES:
                    self._flush_batch()
            else:
                self._out(reply, [cost])
        except BaseException:
            self._give_budget(cost)
            self.slots.release(1)
            raise
        finally:
            with self._pending_mutex:
                self.pending -= 1
                if self.draining and not self.pending:
                    self.pending_done.notify_all()

    def _flush_batch(self) -> None:
        if self.batch_costs:
            bufs, costs = self.batch, self.batch_costs
            self.batch, self.batch_costs, self.batch_bytes = [], [], 0
            self._out(bufs, costs)

    def _done(self, costs: list[int]) -> None:
        """The replies of a batch are out: what they held goes back at once."""
        self._give_back(costs)
        self.slots.release(len(costs))

    def _out(self, bufs: list[bytes], costs: list[int]) -> None:
        """Send a reply at once if the socket takes it whole without blocking and nothing
        is queued before it (no thread handoff: the common case); else queue it, or
        what is left of it, for the writer thread. A reply's bytes never interleave
        with another's: while anything is queued, everything queues behind it."""
        with self.send_lock:
            if not self.queued and self.inline_sends:
                total = sum(map(len, bufs))  # replies are bytes: len counts bytes
                try:
                    sent = self.sock.sendmsg(bufs, [], socket.MSG_DONTWAIT) if len(bufs) <= IOV_MAX else 0
                except BlockingIOError:
                    sent = 0
                except OSError:
                    sent = total  # the connection is gone; the reader sees it and winds down
                if sent >= total:
                    self._done(costs)
                    return
                bufs = _remainder([memoryview(b).cast("B") for b in bufs if len(b)], sent)
            self.queued += 1
        self.replies.put((bufs, costs))

    def _write_loop(self) -> None:
        broken = False
        while (item := self.replies.get()) is not None:
            bufs, costs = item
            if not broken:
                try:
                    self._send(bufs)
                except OSError:
                    broken = True  # keep draining so the reader is never stuck on its slots
                    self.hang_up()
            del bufs, item
            with self.send_lock:
                self.queued -= 1
            self._done(costs)

    def _send(self, bufs: list[bytes]) -> None:
        sock = self.sock
        writer = self.writer is not None and threading.current_thread() is self.writer
        if isinstance(sock, ssl.SSLSocket):
            data = memoryview(b"".join(bufs))
            if not writer:
                sock.sendall(data)
                return
            # An SSL socket cannot take MSG_DONTWAIT (and its reader is blocked in it):
            # the writer sends only what the send buffer has room for now, and waits for
            # room in between, so a client that reads nothing stalls in the poll, where
            # it can be cut off, not in a send. (POLLOUT means at least a third of the
            # buffer is free; half of what is free fits with the records' overhead.)
            fd = sock.fileno()
            room = select.poll()  # one poller for the reply: a look costs one syscall
            room.register(fd, select.POLLOUT)
            buffer_bytes = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            at = 0
            while at < len(data):
                if not room.poll(0):
                    self._wait_for_room()
                queued = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
                piece = max(TLS_RECORD_BYTES, (buffer_bytes - queued) // 2)
                sock.sendall(data[at : at + piece])
                at += piece
            return
        if not writer:
            write_all(sock.sendmsg, bufs)  # negotiation: bounded by its own timeouts
            return
        write_all(self._send_some, bufs)

    def _wait_for_room(self) -> None:
        try:
            self._stalled_unless(select.POLLOUT, "reading its replies")
        except _PayloadStalled as exc:
            log.warning("%s: closing: %s", self.name, exc)
            raise OSError(errno.ETIMEDOUT, str(exc)) from None

    def _send_some(self, views: list[memoryview]) -> int:
        """The writer's sendmsg: a client that reads none of its replies for payload_idle_s
        while other clients wait for memory is cut off, since its replies hold that memory."""
        while True:
            try:
                return self.sock.sendmsg(views, [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            self._wait_for_room()

    def _reply(self, req: Request) -> list[bytes]:
        conn = self.conn
        problem = conn.check_request(req)
        export = self.export
        if problem is not None:
            if export is not None and req.command in _KIND:
                export.refused(_KIND[req.command], _NBD_TO_ERRNO.get(problem[0], errno.EIO))
            return [conn.error_reply(req.cookie, *problem)]
        if export is None or export.gone:
            return [conn.error_reply(req.cookie, c.EIO, "the volume behind this export was removed")]
        if req.command == c.CMD_BLOCK_STATUS and (context := self._context_refused()) is not None:
            return [conn.error_reply(req.cookie, c.EPERM, f"metadata context {context} is no longer granted")]
        if req.command == c.CMD_BLOCK_STATUS and self.peer_gone:
            # Nobody reads the answer: the walk would only hold up other clients' turns.
            return [conn.error_reply(req.cookie, c.ESHUTDOWN, "the client has gone")]
        try:
            return execute(conn, export, req)
        except OpError as exc:
            return [conn.error_reply(req.cookie, nbd_error(exc), exc.strerror or "")]
        except OSError as exc:
            log.error("%s: I/O error on %s: %s", self.name, shown(export.name), exc)
            return [conn.error_reply(req.cookie, nbd_error(exc), str(exc))]
        except Exception:
            log.exception("%s: request %d failed", self.name, req.command)
            return [conn.error_reply(req.cookie, c.EIO, "internal error")]


def peer_name(sock: socket.socket) -> str:
    """A client as the log names it: "127.0.0.1:50412", or "unix"."""
    peer = sock.getpeername() if sock.family != socket.AF_UNIX else None
    return f"{peer[0]}:{peer[1]}" if peer else "unix"


RELAY_CHUNK_BYTES = 256 << 10
MAX_HOPS = 16  # hand-overs of one option that no worker answers (a loop between workers)
ACCEPT_POLL_S = 0.5  # how soon a worker's accept on a shared listener sees the stop


def relay(client: socket.socket, sibling: socket.socket) -> None:
    """Copy bytes both ways between a TLS client and the sibling process serving it
    until either side closes; then both are shut, so the other side ends too. Each
    direction holds one chunk at most: a side that does not read stalls the copy
    towards it, and through it, its peer's sends."""
    client.settimeout(None)

    def back() -> None:  # the sibling's replies, to the client
        _copy(sibling, client)
        with contextlib.suppress(OSError):
            socket.socket.shutdown(client, socket.SHUT_RDWR)

    thread = threading.Thread(target=back, name=f"{threading.current_thread().name}-relay", daemon=True)
    thread.start()
    _copy(client, sibling)
    with contextlib.suppress(OSError):
        sibling.shutdown(socket.SHUT_WR)  # the sibling ends the session, its last replies still come back
    thread.join()
    sibling.close()


def _copy(source: socket.socket, dest: socket.socket) -> None:
    """Bytes from source to dest until source closes or either breaks."""
    with contextlib.suppress(OSError):
        while data := source.recv(RELAY_CHUNK_BYTES):
            dest.sendall(data)


def _remainder(views: list[memoryview], sent: int) -> list[bytes]:
    """What of a vectored send is left after `sent` bytes went out."""
    out: list[bytes] = []
    for view in views:
        if sent >= len(view):
            sent -= len(view)
            continue
        out.append(bytes(view[sent:]))
        sent = 0
    return out


def export_uris(names: list[str], *, socket_path: str | None, tcp: tuple[str, int] | None, tls: bool) -> list[str]:
    """NBD URIs (the nbd URI specification's forms) for each export."""
    uris = []
    for name in names:
        if socket_path:
            uris.append(f"nbd{'s' if tls else ''}+unix:///{name}?socket={socket_path}")
        if tcp:
            host = f"[{tcp[0]}]" if ":" in tcp[0] else tcp[0]
            uris.append(f"nbd{'s' if tls else ''}://{host}:{tcp[1]}/{name}")
    return uris


def parse_listen(text: str) -> tuple[str, int]:
    """`PORT`, `HOST:PORT` or `[V6]:PORT`; the host defaults to 127.0.0.1."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"invalid --listen {text!r}: use [HOST:]PORT")
    return host, int(port)
