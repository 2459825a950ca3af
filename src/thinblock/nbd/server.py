"""The asyncio shell around the NBD protocol core: sockets, TLS, threads.

Each connection is one asyncio task that feeds bytes to a `ServerConnection`
and acts on its events. Requests run in worker threads (the pool's lock keeps
the block contract atomic per request), so many can be in flight per
connection, replies go out as they complete, and a slow client only ever
waits on its own socket. Errno values are mapped to NBD errors here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from thinblock.errors import OpError
from thinblock.mapping import BlockState
from thinblock.nbd import constants as c
from thinblock.nbd.protocol import (
    BASE_ALLOCATION,
    Closed,
    ExportInfo,
    NeedData,
    RemoteProtocolError,
    Request,
    ServerConnection,
    StartTLS,
    Transmission,
)
from thinblock.pool import Pool
from thinblock.volume import Volume

log = logging.getLogger("thinblock.nbd")

MAX_IN_FLIGHT = 64
READ_CHUNK_BYTES = 256 << 10

_STATE_FLAGS = {
    BlockState.UNMAPPED: c.STATE_HOLE | c.STATE_ZERO,
    BlockState.ZEROED: c.STATE_ZERO,
    BlockState.DATA: 0,
}

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


def nbd_error(exc: OSError) -> int:
    """The NBD error value for an OS error (EIO for anything unexpected)."""
    return _ERRNO_TO_NBD.get(exc.errno or errno.EIO, c.EIO)


class PoolCatalog:
    """Every volume of the pool is an export, looked up live (new volumes appear at once)."""

    def __init__(self, pool: Pool, *, read_only: bool) -> None:
        self.pool = pool
        self.read_only = read_only

    def info(self, vol: Volume) -> ExportInfo:
        return ExportInfo(
            name=vol.name,
            size_bytes=vol.size_bytes,
            read_only=self.read_only or vol.readonly,
            description=f"thinblock volume {vol.name}",
            min_block=1,
            preferred_block=min(self.pool.block_size, 1 << 16),
            max_payload=c.MAX_PAYLOAD_BYTES,
            meta_contexts=(BASE_ALLOCATION,),
        )

    def list_exports(self) -> list[ExportInfo]:
        with self.pool.lock:
            return [self.info(v) for _, v in sorted(self.pool.volumes.items())]

    def lookup(self, name: str) -> ExportInfo | None:
        vol = self.volume(name)
        return None if vol is None else self.info(vol)

    def volume(self, name: str) -> Volume | None:
        """The volume behind an export name; "" is the default export when the pool has one volume."""
        with self.pool.lock:
            if name == "" and len(self.pool.volumes) == 1:
                return next(iter(self.pool.volumes.values()))
            return self.pool.volumes.get(name)


def execute(conn: ServerConnection, vol: Volume, req: Request) -> list[bytes]:
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
        pass  # the data store is a local file: the page cache already serves this
    elif cmd == c.CMD_BLOCK_STATUS:
        runs = vol.block_status(req.offset, req.length)
        extents = [(n, _STATE_FLAGS[state]) for n, state in runs]
        if req.flags & c.CMD_FLAG_REQ_ONE:
            extents = extents[:1]
        return [conn.block_status_reply(req.cookie, [(ctx_id, extents) for ctx_id in conn.neg.contexts])]
    return [conn.simple_reply(req.cookie)]


@dataclass
class TLSConfig:
    cert: str
    key: str
    ca: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca:
            ctx.load_verify_locations(self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


class NBDServer:
    """Serves every volume of an open pool over NBD."""

    def __init__(self, pool: Pool, *, read_only: bool = False, tls: TLSConfig | None = None) -> None:
        self.pool = pool
        self.catalog = PoolCatalog(pool, read_only=read_only)
        self.ssl_context = tls.context() if tls else None
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="thinblock-nbd")
        self.servers: list[asyncio.Server] = []
        self.sessions: set[asyncio.Task[None]] = set()
        self._next_id = 0

    async def listen_unix(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.servers.append(await asyncio.start_unix_server(self._accept, path=path))

    async def listen_tcp(self, host: str, port: int) -> int:
        server = await asyncio.start_server(self._accept, host=host, port=port, reuse_address=True)
        self.servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting, let in-flight requests finish, end every session."""
        for server in self.servers:
            server.close()
        for server in self.servers:
            await server.wait_closed()
        for task in list(self.sessions):
            task.cancel()
        if self.sessions:
            await asyncio.gather(*self.sessions, return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.sessions.add(task)
        self._next_id += 1
        try:
            await Session(self, reader, writer, self._next_id).run()
        finally:
            self.sessions.discard(task)


class Session:
    """One client connection."""

    def __init__(self, server: NBDServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sid: int) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.name = f"#{sid} {peer[0]}:{peer[1]}" if isinstance(peer, tuple) else f"#{sid} unix"
        self.conn = ServerConnection(
            server.catalog, tls_required=server.ssl_context is not None, tls_available=server.ssl_context is not None
        )
        self.volume: Volume | None = None
        self.in_flight: set[asyncio.Task[None]] = set()
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def run(self) -> None:
        log.info("%s: connected", self.name)
        self.writer.write(self.conn.data_to_send())  # the greeting
        reason = "server shutting down"
        try:
            reason = await self._loop()
        except RemoteProtocolError as exc:
            reason = f"protocol error: {exc}"
            log.warning("%s: %s", self.name, reason)
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
            reason = f"connection lost: {exc}"
        except asyncio.CancelledError:
            pass
        finally:
            if self.in_flight:
                await asyncio.gather(*self.in_flight, return_exceptions=True)
            with contextlib.suppress(Exception):
                self.writer.close()
                await asyncio.wait_for(self.writer.wait_closed(), 5)
            log.info("%s: closed (%s)", self.name, reason)

    async def _flush_output(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.writer.write(out)
            await self.writer.drain()

    async def _loop(self) -> str:
        while True:
            event = self.conn.next_event()
            await self._flush_output()  # option replies the core wrote while producing the event
            if isinstance(event, NeedData):
                self.conn.receive_data(await self.reader.read(READ_CHUNK_BYTES))
            elif isinstance(event, StartTLS):
                assert self.server.ssl_context is not None
                await self.writer.start_tls(self.server.ssl_context)
                log.info("%s: TLS started", self.name)
            elif isinstance(event, Transmission):
                self.volume = self.server.catalog.volume(event.export.name)
                log.info(
                    "%s: export %r (%s bytes%s%s)",
                    self.name,
                    event.export.name,
                    event.export.size_bytes,
                    ", structured replies" if event.structured else "",
                    f", contexts {sorted(event.contexts.values())}" if event.contexts else "",
                )
            elif isinstance(event, Request):
                await self.slots.acquire()
                task = asyncio.create_task(self._handle(event))
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
            elif isinstance(event, Closed):
                return event.reason

    async def _handle(self, req: Request) -> None:
        try:
            bufs = await self._reply(req)
            self.writer.writelines(bufs)  # one call: chunks of one reply are never interleaved
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            pass  # the session is ending; run() reports why
        finally:
            self.slots.release()

    async def _reply(self, req: Request) -> list[bytes]:
        conn = self.conn
        problem = conn.check_request(req)
        if problem is not None:
            return [conn.error_reply(req.cookie, *problem)]
        vol = self.volume
        if vol is None or vol.removed:
            return [conn.error_reply(req.cookie, c.EIO, "the volume behind this export was removed")]
        run: Callable[[], list[bytes]] = lambda: execute(conn, vol, req)  # noqa: E731
        try:
            return await asyncio.get_running_loop().run_in_executor(self.server.executor, run)
        except OpError as exc:
            return [conn.error_reply(req.cookie, nbd_error(exc), exc.strerror or "")]
        except OSError as exc:
            log.error("%s: I/O error on %s: %s", self.name, vol.name, exc)
            return [conn.error_reply(req.cookie, nbd_error(exc), str(exc))]
        except Exception:
            log.exception("%s: request %d failed", self.name, req.command)
            return [conn.error_reply(req.cookie, c.EIO, "internal error")]


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
