"""A data store in RADOS objects of a fixed size, named `<prefix>.<objno:016x>`
like rbd's `rbd_data.<id>.<objno>` (store/base.py's contract).

- Space never written has no object; reads of a missing object, or past the end
  of a short one, are zeros.
- punch frees bytes in the cluster: an object it covers whole is removed, a tail
  is truncated, anything else is zeroed (WriteOp.zero).
- RADOS has no way to reserve space for an object, so this store does not
  (`reserves_space` is False): zero frees the bytes as punch does (the range
  reads zero, which is all a ZEROED block needs), and preallocate does nothing.
  Writing zeros instead would store them in the cluster, with no promise that a
  later write finds room there either. The pool's own accounting is what sets
  provisioned space aside (docs/ceph.md, "Space and PROVISION on RADOS").
- A request of several pieces keeps them all in flight (librados aio, at most
  IN_FLIGHT operations); a request of one piece is one synchronous call, on one
  of the NBD server's `queue_depth` worker threads. Either way one connection's
  queue depth reaches the cluster.
"""

from __future__ import annotations

import errno
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from thinblock.bindings import RADOS_POOLS, require
from thinblock.ceph.cluster import Cluster, as_oserror, errno_error, probe_zero_order, rados_errno, write_op_zero
from thinblock.store.base import OPTIONAL_VERBS, DataStore, Support

rados = require("rados", feature=RADOS_POOLS)

DEFAULT_OBJECT_SIZE = 4 << 20
IN_FLIGHT = 64


def _truncate(op: Any, at: int) -> None:
    op.truncate(at)


def _padded(data: bytes, n: int) -> bytes:
    """What n bytes of an object read as: what it holds, then zeros past its end."""
    return data if len(data) >= n else data + bytes(n - len(data))


class _Batch:
    """Up to IN_FLIGHT librados aio operations; `wait` returns once all finished and
    raises the first failure as an OSError."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._cond = threading.Condition()
        self._pending = 0
        self._error = 0  # the first failure's errno
        self._keep: list[Any] = []

    def done(self, code: int, ok: tuple[int, ...] = ()) -> None:
        with self._cond:
            if code < 0 and -code not in ok and not self._error:
                self._error = -code
            self._pending -= 1
            self._cond.notify_all()

    def start(self, issue: Callable[[], Any]) -> None:
        with self._cond:
            while self._pending >= IN_FLIGHT:
                self._cond.wait()
            self._pending += 1
        try:
            self._keep.append(issue())
        except rados.Error as exc:
            self.done(-rados_errno(exc))
        except BaseException:
            self.done(-errno.EIO)  # nothing was issued: never leave the batch waiting for it
            raise

    def wait(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait()
        self._keep.clear()
        if self._error:
            raise errno_error(self._error, self.what)


class RadosStore(DataStore):
    def __init__(
        self,
        cluster: Cluster,
        ceph_pool: str,
        prefix: str,
        size_bytes: int,
        *,
        object_size: int = DEFAULT_OBJECT_SIZE,
        readonly: bool = False,
    ) -> None:
        self.cluster = cluster
        self.io = cluster.ioctx(ceph_pool)
        self.prefix = prefix
        self.object_size = object_size
        self.readonly = readonly
        self._size = size_bytes
        self._behind: set[Any] = set()  # write_behind completions still in flight
        self._behind_error = 0
        self._behind_lock = threading.Lock()

    def object_name(self, objno: int) -> str:
        return f"{self.prefix}.{objno:016x}"

    @property
    def size_bytes(self) -> int:
        return self._size

    def _pieces(self, offset: int, length: int) -> list[tuple[int, int, int]]:
        """(object number, offset within it, length) covering the range."""
        out = []
        end = offset + length
        while offset < end:
            objno, within = divmod(offset, self.object_size)
            n = min(self.object_size - within, end - offset)
            out.append((objno, within, n))
            offset += n
        return out

    def _writable(self) -> None:
        if self.readonly:
            raise OSError(errno.EROFS, "the RADOS data store is open read-only")

    def _only_piece(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, int, int] | None:
        """The single object piece a one-range request covers, if it covers one."""
        if len(ranges) != 1:
            return None
        pieces = self._pieces(*ranges[0])
        return pieces[0] if len(pieces) == 1 else None

    # ----- reads -----------------------------------------------------------------

    def pread(self, offset: int, length: int) -> bytes:
        return self.read_many([(offset, length)])[0]

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        only = self._only_piece(ranges)
        if only is not None:
            return [self._read_one(*only)]
        batch = _Batch("RADOS read")
        pieces: list[list[bytes]] = []
        for offset, length in ranges:
            slots: list[bytes] = []
            pieces.append(slots)
            for objno, within, n in self._pieces(offset, length):
                slots.append(b"")
                batch.start(self._reader(batch, slots, len(slots) - 1, objno, within, n))
        batch.wait()
        return [b"".join(slots) for slots in pieces]

    def _read_one(self, objno: int, within: int, n: int) -> bytes:
        """One piece, synchronously: the calling thread waits with the GIL released,
        which costs a third of the CPU of an aio round trip through a callback (the
        NBD server's worker threads give the concurrency)."""
        try:
            got = self.io.read(self.object_name(objno), n, within)
        except rados.ObjectNotFound:
            return bytes(n)  # never written: reads zero
        except rados.Error as exc:
            raise as_oserror(exc, "RADOS read") from None
        return _padded(got, n)

    def _reader(self, batch: _Batch, slots: list[bytes], i: int, objno: int, within: int, n: int) -> Callable[[], Any]:
        def finished(completion: Any, data: bytes | None) -> None:
            code = completion.get_return_value()
            slots[i] = _padded(data or b"", n) if code >= 0 or code == -errno.ENOENT else b""
            batch.done(code, ok=(errno.ENOENT,))  # no object: never written, reads zero

        return lambda: self.io.aio_read(self.object_name(objno), n, within, oncomplete=finished)

    # ----- writes ----------------------------------------------------------------

    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        self.write_many([(offset, buffers)])

    def write_many(self, writes: Sequence[tuple[int, Sequence[bytes | memoryview]]]) -> None:
        self._writable()
        ranges = [(offset, sum(len(b) for b in buffers)) for offset, buffers in writes]
        if any(offset + length > self._size for offset, length in ranges):  # before any I/O
            raise OSError(errno.ENOSPC, "write beyond the end of the RADOS data store")
        only = self._only_piece(ranges)
        if only is not None:
            objno, within, _ = only
            try:  # one piece, synchronously (see _read_one)
                self.io.write(self.object_name(objno), b"".join(writes[0][1]), within)
            except rados.Error as exc:
                raise as_oserror(exc, "RADOS write") from None
            return
        batch = _Batch("RADOS write")
        for offset, buffers in writes:
            data = b"".join(buffers)
            pos = 0
            for objno, within, n in self._pieces(offset, len(data)):
                chunk = data[pos : pos + n]
                pos += n
                batch.start(self._writer(batch, objno, within, chunk))
        batch.wait()

    def _writer(self, batch: _Batch, objno: int, within: int, chunk: bytes) -> Callable[[], Any]:
        def finished(completion: Any) -> None:
            batch.done(completion.get_return_value())

        return lambda: self.io.aio_write(self.object_name(objno), chunk, within, oncomplete=finished)

    def write_behind(self, offset: int, data: bytes) -> None:
        """aio writes nobody waits for here: flush (aio_flush) waits for them, and
        raises the first one's failure."""
        self._writable()
        pos = 0
        for objno, within, n in self._pieces(offset, len(data)):
            chunk = data[pos : pos + n]
            pos += n
            try:
                completion = self.io.aio_write(self.object_name(objno), chunk, within, oncomplete=self._behind_done)
            except rados.Error as exc:
                raise as_oserror(exc, "RADOS write") from None
            with self._behind_lock:
                self._behind.add(completion)

    def _behind_done(self, completion: Any) -> None:
        code = completion.get_return_value()
        with self._behind_lock:
            self._behind.discard(completion)
            if code < 0 and not self._behind_error:
                self._behind_error = -code

    def _operate(self, batch: _Batch, objno: int, build: Callable[[Any], None], ok: tuple[int, ...] = ()) -> None:
        """One WriteOp on one object, in flight in batch."""

        def issue() -> Any:
            op = self.io.create_write_op()
            try:
                build(op)
                return self.io.operate_aio_write_op(
                    op, self.object_name(objno), oncomplete=lambda c: batch.done(c.get_return_value(), ok)
                )
            finally:
                self.io.release_write_op(op)

        batch.start(issue)

    def _remove(self, batch: _Batch, objno: int) -> None:
        def finished(completion: Any) -> None:
            batch.done(completion.get_return_value(), (errno.ENOENT,))  # never written: nothing to free

        batch.start(lambda: self.io.aio_remove(self.object_name(objno), oncomplete=finished))

    def punch(self, offset: int, length: int) -> None:
        self._writable()
        pieces = self._pieces(offset, length)
        if any(within + n < self.object_size for _, within, n in pieces):  # some need a WriteOp.zero
            probe_zero_order(self.cluster, self.io)
        batch = _Batch("RADOS punch")
        for objno, within, n in pieces:
            if n == self.object_size:
                self._remove(batch, objno)
            elif within + n == self.object_size:
                self._operate(batch, objno, functools.partial(_truncate, at=within))
            else:
                self._operate(batch, objno, functools.partial(write_op_zero, self.cluster, offset=within, length=n))
        batch.wait()

    def zero(self, offset: int, length: int) -> None:
        self.punch(offset, length)  # nothing to keep: RADOS holds no reservation

    def preallocate(self, offset: int, length: int) -> None:
        self._writable()  # nothing to reserve in RADOS; the pool's accounting sets it aside

    def flush(self) -> None:
        # Each write was acknowledged once durable on the OSDs; wait for any still in flight.
        try:
            self.io.aio_flush()
        except rados.Error as exc:
            raise as_oserror(exc, "RADOS flush") from None
        with self._behind_lock:
            failed, self._behind_error = self._behind_error, 0
        if failed:
            raise errno_error(failed, "RADOS write")

    def grow(self, new_size_bytes: int) -> None:
        self._size = max(self._size, new_size_bytes)  # objects appear as they are written

    def capabilities(self) -> dict[str, Support]:
        return dict.fromkeys(OPTIONAL_VERBS, Support.NATIVE)

    @property
    def queue_depth(self) -> int:
        return IN_FLIGHT

    @property
    def reserves_space(self) -> bool:
        return False

    def close(self) -> None:
        pass  # the connection is the process's, shared with the metadata store
