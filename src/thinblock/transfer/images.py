"""Disk images outside the pool, read and written only where they hold data.

Sources: a raw file or block device (SEEK_DATA/SEEK_HOLE say where data is), an
NBD export (base:allocation block status says it; a qcow2 image, once
transfer/qcow2.py has checked it, is served by a qemu-nbd that libnbd starts and
stops), or a stream read front to back.
Sinks: a raw file (holes stay holes), an NBD export (zeros sent as WRITE_ZEROES),
or a stream (every byte, in order).

Several requests are always in flight: sinks are written from many threads at
once (files with pwrite; NBD through one connection with many commands on the
wire, as a server may take one client only), and NBD sources are read ahead
the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from thinblock.bindings import NBD_URIS, require
from thinblock.errors import OutputClosed, ThinblockError
from thinblock.sizes import format_exact
from thinblock.store.file import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, fallocate
from thinblock.zeros import zero_bytes

QCOW2_MAGIC = b"QFI\xfb"
NBD_URI_SCHEMES = ("nbd://", "nbds://", "nbd+unix://", "nbds+unix://", "nbd+vsock://")
_STATE_ZERO = 2  # NBD base:allocation: the range reads zeros
_STATUS_STEP = 1 << 30


def is_nbd_uri(text: str) -> bool:
    return text.startswith(NBD_URI_SCHEMES)


class RandomSource(Protocol):
    size_bytes: int
    name: str

    def extents(self) -> Iterator[tuple[int, int, bool]]:
        """(offset, length, data) covering the image; data False where it reads zeros."""
        ...

    def stream(self, pieces: Iterator[tuple[int, int]]) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of each (offset, length) piece, in order, reads overlapping."""
        ...

    def close(self) -> None: ...


class RandomSink(Protocol):
    name: str

    def write(self, offset: int, data: bytes) -> None: ...

    def zero(self, offset: int, length: int) -> None:
        """Make [offset, +length) read zeros (the sink may not start out zero)."""
        ...

    def finish(self) -> None:
        """Everything written is durable."""
        ...

    def close(self) -> None: ...


# ----- files ------------------------------------------------------------------------


class FileSource:
    """A raw image in a file or on a block device, read with pread."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            self.size_bytes = st.st_size
            self.seekable = True
        elif stat.S_ISBLK(st.st_mode):
            self.size_bytes = os.lseek(fd, 0, os.SEEK_END)
            self.seekable = False  # devices give no holes: every byte is read
        else:
            raise ThinblockError(f"{name} is neither a regular file nor a block device")

    def extents(self) -> Iterator[tuple[int, int, bool]]:
        size, pos = self.size_bytes, 0
        if not self.seekable:
            if size:
                yield 0, size, True
            return
        while pos < size:
            try:
                data = os.lseek(self.fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but a hole up to the end
                    yield pos, size - pos, False
                    return
                if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no SEEK_DATA here: all data
                    yield pos, size - pos, True
                    return
                raise
            if data > pos:
                yield pos, data - pos, False
            hole = min(os.lseek(self.fd, data, os.SEEK_HOLE), size)
            yield data, hole - data, True
            pos = hole

    def stream(self, pieces: Iterator[tuple[int, int]]) -> Iterator[tuple[int, bytes]]:
        """The bytes of each (offset, length) piece, in order."""
        for offset, n in pieces:
            yield offset, self.read(offset, n)

    def read(self, offset: int, length: int) -> bytes:
        got = os.pread(self.fd, length, offset)
        if len(got) < length:
            got += bytes(length - len(got))  # a file shrunk under us reads zeros past its end
        return got

    def close(self) -> None:
        os.close(self.fd)


class FileSink:
    """A raw image file: made the right size first, so what is never written is a hole.
    A block device (or a file that already holds data) gets its zeros written out."""

    def __init__(self, fd: int, name: str, size_bytes: int, *, fresh: bool) -> None:
        self.fd, self.name = fd, name
        st = os.fstat(fd)
        self.regular = stat.S_ISREG(st.st_mode)
        if self.regular:
            os.ftruncate(fd, 0 if fresh else min(st.st_size, size_bytes))
            os.ftruncate(fd, size_bytes)
            self.clean = fresh  # a new (or emptied) file reads zeros everywhere
        elif stat.S_ISBLK(st.st_mode):
            have = os.lseek(fd, 0, os.SEEK_END)
            if have < size_bytes:
                raise ThinblockError(f"{name} holds {have} bytes, less than the {size_bytes} to export")
            self.clean = False
        else:
            raise ThinblockError(f"{name} is neither a regular file nor a block device")

    def write(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def zero(self, offset: int, length: int) -> None:
        if self.clean:
            return
        if self.regular:
            try:
                fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
                return
            except OSError:
                pass
        end = offset + length
        while offset < end:
            n = min(end - offset, 1 << 20)
            self.write(offset, zero_bytes(n))
            offset += n

    def finish(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _until_ready(poller: select.poll, check: Callable[[], None]) -> None:
    """Wait until the stream can be read or written, calling check every second."""
    while not poller.poll(1000):
        check()


class StreamReader:
    """A stream read front to back (a pipe, standard input), in chunks. check, when
    given, is called after each read and every second while the reader waits for
    the writer: it raises to give up (the command that asked for the job went away,
    or a signal stopped it: cli/signals.py)."""

    def __init__(self, fd: int, name: str, check: Callable[[], None] | None = None) -> None:
        self.fd, self.name = fd, name
        self.check = check

    def read(self, n: int) -> bytes:
        """Up to n bytes; fewer only at the end of the stream."""
        parts: list[bytes] = []
        left = n
        poller = select.poll()
        poller.register(self.fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while left:
            if self.check is not None:
                _until_ready(poller, self.check)
            got = os.read(self.fd, left)
            if self.check is not None:
                self.check()
            if not got:
                break
            parts.append(got)
            left -= len(got)
        return b"".join(parts)

    def close(self) -> None:
        os.close(self.fd)


class StreamWriter:
    """A stream written front to back (a pipe, standard output, a file). check, as
    for StreamReader: after each write, and every second while the reader stalls."""

    def __init__(self, fd: int, name: str, check: Callable[[], None] | None = None) -> None:
        self.fd, self.name = fd, name
        self.check = check
        self.poller: select.poll | None = None
        if check is not None:
            self.poller = select.poll()
            self.poller.register(fd, select.POLLOUT | select.POLLERR)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                if self.poller is not None and self.check is not None:
                    _until_ready(self.poller, self.check)
                # A signal ends a blocked write early with what it wrote (PEP 475
                # retries only one that wrote nothing): the check after it then stops.
                view = view[os.write(self.fd, view) :]
                if self.check is not None:
                    self.check()
        except BrokenPipeError:
            raise OutputClosed(f"the reader of {self.name} went away") from None

    def zeros(self, length: int) -> None:
        while length:
            n = min(length, 1 << 20)
            self.write(zero_bytes(n))
            length -= n

    def finish(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EROFS):  # a pipe or a terminal: nothing to sync
                raise

    def close(self) -> None:
        os.close(self.fd)


# ----- NBD --------------------------------------------------------------------------

NBD_IN_FLIGHT = 16  # commands on the wire at once, on one connection


def nbd_connector(uri: str) -> Any:
    """How to connect a libnbd handle to a URI, within NBD_CONNECT_TIMEOUT_S (a qcow2
    image is served by a qemu-nbd that transfer/qcow2.py starts, on the image it has checked)."""
    return lambda h: _connect_within(h, uri, NBD_CONNECT_TIMEOUT_S)


NBD_CONNECT_TIMEOUT_S = 5.0  # a URI's server has this long to connect and finish the handshake


def _connect_within(h: Any, uri: str, timeout_s: float) -> None:
    """connect_uri, given up after timeout_s: something that accepts the connection
    but never speaks NBD (a pool's control socket, a wrong port) would otherwise
    keep a blocking connect waiting for its greeting for as long as it stays open."""
    h.aio_connect_uri(uri)
    deadline = time.monotonic() + timeout_s
    while h.aio_is_connecting():
        left = deadline - time.monotonic()
        if left <= 0:
            raise ThinblockError(
                f"cannot open NBD export {uri}: no NBD handshake within {timeout_s:g} s (is an NBD server there?)"
            )
        h.poll(max(1, int(left * 1000)))


class _Nbd:
    """One libnbd connection driven asynchronously: many commands in flight on it.
    One connection, because a server may take one client only (qemu-nbd's default)."""

    def __init__(self, name: str, connect: Any, *, write: bool, feature: str = NBD_URIS) -> None:
        nbd = require("nbd", feature=feature)
        self.name = name
        self.nbd = nbd
        self.lock = threading.Lock()
        self.h = nbd.NBD()
        self.h.add_meta_context("base:allocation")
        try:
            connect(self.h)
        except nbd.Error as exc:
            raise ThinblockError(f"cannot open NBD export {name}: {exc.string}") from None
        except BaseException:
            self.close()  # a connection that never finished its handshake goes now
            raise
        if write and self.h.is_read_only():
            raise ThinblockError(f"NBD export {name} is read-only")
        self.flight: list[tuple[int, Any, Any]] = []  # (cookie, buffer, what it is for)
        # The server's own account of a failure, when we started it (qemu-nbd for
        # qcow2), as a whole clause: libnbd alone can only say that the connection went.
        self.explain: Callable[[], str] | None = None

    def error(self, what: str, exc: Any) -> OSError:
        said = self.explain() if self.explain is not None else ""
        if said:
            return OSError(exc.errno or errno.EIO, said)
        return OSError(exc.errno or errno.EIO, f"NBD {what} on {self.name} failed: {exc.string}")

    def reap(self, below: int) -> list[Any]:
        """Poll until fewer than `below` commands are in flight; the finished ones' tags,
        in the order they were started (call with the lock held)."""
        done: list[Any] = []
        while len(self.flight) >= below:
            try:
                if not any(self.h.aio_command_completed(c) for c, _, _ in self.flight[:1]):
                    self.h.poll(-1)
                    continue
            except self.nbd.Error as exc:
                raise self.error("request", exc) from None
            done.append(self.flight.pop(0)[2])
        return done

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.h.shutdown()
        self.h = None


class NbdSource:
    """An NBD export, read where base:allocation says it holds data."""

    def __init__(self, name: str, connect: Any, *, feature: str = NBD_URIS) -> None:
        self.name = name
        self.conn = _Nbd(name, connect, write=False, feature=feature)
        self.size_bytes = int(self.conn.h.get_size())

    def extents(self) -> Iterator[tuple[int, int, bool]]:
        return self.status(0, self.size_bytes)

    def status(self, pos: int, size: int) -> Iterator[tuple[int, int, bool]]:
        """(offset, length, data) covering [pos, size), from base:allocation."""
        h = self.conn.h
        if not h.can_meta_context("base:allocation"):
            if size > pos:
                yield pos, size - pos, True
            return
        while pos < size:
            found: list[tuple[int, bool]] = []
            try:
                h.block_status(min(size - pos, _STATUS_STEP), pos, _collector(found))
            except self.conn.nbd.Error as exc:
                raise self.conn.error("block status", exc) from None
            if not found:
                raise OSError(errno.EIO, f"NBD block status on {self.name} returned nothing at {pos}")
            for length, data in found:
                length = min(length, size - pos)
                if length <= 0:
                    break
                yield pos, length, data
                pos += length

    def stream(self, pieces: Iterator[tuple[int, int]]) -> Iterator[tuple[int, bytes]]:
        """The bytes of each (offset, length) piece, in order, NBD_IN_FLIGHT reads at
        once (one caller at a time: the job's reading loop)."""
        conn = self.conn
        for offset, n in pieces:
            for done_offset, buf in conn.reap(NBD_IN_FLIGHT):
                yield done_offset, bytes(buf.to_bytearray())
            buf = conn.nbd.Buffer(n)
            try:
                cookie = conn.h.aio_pread(buf, offset)
            except conn.nbd.Error as exc:
                raise conn.error("read", exc) from None
            conn.flight.append((cookie, buf, (offset, buf)))
        for done_offset, buf in conn.reap(1):
            yield done_offset, bytes(buf.to_bytearray())

    def close(self) -> None:
        self.conn.close()


def _collector(found: list[tuple[int, bool]]) -> Any:
    """A block_status callback appending (length, data) for base:allocation."""

    def take(context: str, offset: int, entries: list[int], err: Any) -> int:
        if context == "base:allocation":
            for i in range(0, len(entries) - 1, 2):
                found.append((entries[i], not entries[i + 1] & _STATE_ZERO))
        return 0

    return take


class NbdSink:
    """An NBD export, written NBD_IN_FLIGHT requests at a time on one connection,
    zeros sent as WRITE_ZEROES (a thin target keeps them free)."""

    def __init__(self, name: str, connect: Any, size_bytes: int) -> None:
        self.name = name
        self.conn = _Nbd(name, connect, write=True)
        have = int(self.conn.h.get_size())
        if have < size_bytes:
            self.conn.close()
            raise ThinblockError(
                f"NBD export {name} is {format_exact(have)}, smaller than the {format_exact(size_bytes)} to export"
            )
        self.can_zero = bool(self.conn.h.can_zero())

    def _submit(self, what: str, start: Any) -> None:
        conn = self.conn
        with conn.lock:
            conn.reap(NBD_IN_FLIGHT)
            try:
                cookie, buf = start(conn)
            except conn.nbd.Error as exc:
                raise conn.error(what, exc) from None
            conn.flight.append((cookie, buf, None))

    def write(self, offset: int, data: bytes) -> None:
        def start(conn: _Nbd) -> tuple[int, Any]:
            buf = conn.nbd.Buffer.from_bytearray(bytearray(data))
            return conn.h.aio_pwrite(buf, offset), buf

        self._submit("write", start)

    def zero(self, offset: int, length: int) -> None:
        end = offset + length
        while offset < end:
            n = min(end - offset, 1 << 30 if self.can_zero else 1 << 20)
            if self.can_zero:
                self._submit("write zeroes", lambda conn, o=offset, k=n: (conn.h.aio_zero(k, o), None))
            else:
                self.write(offset, zero_bytes(n))
            offset += n

    def finish(self) -> None:
        conn = self.conn
        with conn.lock:
            conn.reap(1)
            try:
                conn.h.flush()
            except conn.nbd.Error as exc:
                raise conn.error("flush", exc) from None

    def close(self) -> None:
        self.conn.close()
