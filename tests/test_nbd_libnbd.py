"""Protocol corners through libnbd's Python binding (Debian's python3-libnbd)."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, connect, served_pool, thinblock
from thinblock import BlockState, Pool

MiB = 1 << 20
BS = 64 << 10


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    # 8M = 128 blocks: easy to fill
    with served_pool(tmp_path, "8M", {"disk": "64M", "other": "64M"}, check=False) as server:
        yield server


def extents(h: nbd.NBD, length: int, offset: int, flags: int = 0) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []

    def cb(metacontext: str, off: int, entries: list[int], err: int) -> int:
        assert metacontext == "base:allocation"
        out.extend(zip(entries[0::2], entries[1::2], strict=True))
        return 0

    h.block_status(length, offset, cb, flags)
    return out


def test_flags_and_structured_replies(served: Server) -> None:
    h = connect(served)
    assert h.can_meta_context("base:allocation")
    for can in (
        h.can_flush,
        h.can_fua,
        h.can_trim,
        h.can_zero,
        h.can_fast_zero,
        h.can_multi_conn,
        h.can_cache,
        h.can_df,
    ):
        assert can(), can.__name__
    assert not h.is_read_only()
    assert h.get_structured_replies_negotiated()
    # An empty volume reads as hole chunks: no zero bytes on the wire.
    chunks: list[tuple[int, int, int]] = []

    def chunk(buf: bytes, off: int, status: int, err: int) -> int:
        chunks.append((off, len(buf), status))
        return 0

    data = h.pread_structured(4 * MiB, 0, chunk)
    assert data == bytes(4 * MiB)
    assert chunks == [(0, 4 * MiB, nbd.READ_HOLE)]
    h.pwrite(b"x" * 100, BS + 10)
    chunks.clear()
    h.pread_structured(3 * BS, 0, chunk)
    assert [c[2] for c in chunks] == [nbd.READ_HOLE, nbd.READ_DATA, nbd.READ_HOLE]
    h.shutdown()


def test_block_status_states_and_req_one(served: Server) -> None:
    h = connect(served)
    h.pwrite(b"d" * BS, 0)
    h.zero(BS, BS, nbd.CMD_FLAG_NO_HOLE)
    assert extents(h, 4 * BS, 0) == [(BS, 0), (BS, 2), (2 * BS, 3)]
    assert extents(h, 4 * BS, 0, nbd.CMD_FLAG_REQ_ONE) == [(BS, 0)]
    assert extents(h, BS // 2, BS + 100, nbd.CMD_FLAG_REQ_ONE) == [(BS // 2, 2)]
    h.shutdown()


def test_fast_zero_failure_changes_nothing(served: Server) -> None:
    h = connect(served)
    data = os.urandom(3 * BS)
    h.pwrite(data, 0)
    with pytest.raises(nbd.Error) as info:
        h.zero(BS, BS // 2, nbd.CMD_FLAG_FAST_ZERO)
    assert info.value.errnum == errno.ENOTSUP
    assert h.pread(3 * BS, 0) == data
    h.zero(2 * BS, 0, nbd.CMD_FLAG_FAST_ZERO)  # whole blocks: metadata, allowed
    assert h.pread(3 * BS, 0) == bytes(2 * BS) + data[2 * BS :]
    h.shutdown()


def test_out_of_range_and_bad_flags(served: Server) -> None:
    h = connect(served, strict=False)
    size = h.get_size()
    with pytest.raises(nbd.Error) as info:
        h.pread(2 * BS, size - BS)
    assert info.value.errnum == errno.EINVAL
    with pytest.raises(nbd.Error) as info:
        h.pwrite(b"x" * 10, size - 5)
    assert info.value.errnum == errno.ENOSPC
    with pytest.raises(nbd.Error) as info:
        h.trim(BS, size)
    assert info.value.errnum == errno.EINVAL
    with pytest.raises(nbd.Error) as info:
        h.zero(BS, 0, nbd.CMD_FLAG_DF)  # DF is not a zero flag
    assert info.value.errnum == errno.EINVAL
    with pytest.raises(nbd.Error) as info:  # a reply needs one descriptor, and none has length 0
        h.block_status(0, 0, lambda *_: 0)
    assert info.value.errnum == errno.EINVAL
    assert h.pread(10, 0) == bytes(10)  # the connection still works
    h.shutdown()


def test_enospc_is_a_reply_and_allocated_ranges_still_write(served: Server) -> None:
    h = connect(served)
    pool_bytes = 8 * MiB
    h.pwrite(b"a" * (pool_bytes - BS), 0)
    with pytest.raises(nbd.Error) as info:
        h.pwrite(b"b" * (2 * BS), pool_bytes)
    assert info.value.errnum == errno.ENOSPC
    # Everything block status reports without HOLE takes writes on a full pool.
    assert all(flags & 1 == 0 for _n, flags in extents(h, pool_bytes - BS, 0))
    h.pwrite(b"c" * (pool_bytes - BS), 0, nbd.CMD_FLAG_FUA)
    other = connect(served, "other")
    other.pwrite(b"o" * BS, 0)  # the last free block
    with pytest.raises(nbd.Error):
        other.pwrite(b"o", BS)
    assert other.pread(BS, 0) == b"o" * BS
    h.trim(pool_bytes // 2, 0)
    h.flush()
    other.pwrite(b"p" * BS, BS)  # trimmed space serves another volume
    h.shutdown()
    other.shutdown()


def test_many_in_flight_requests(served: Server) -> None:
    h = connect(served)
    payloads = {i: os.urandom(BS) for i in range(64)}
    cookies = [h.aio_pwrite(payloads[i], i * BS) for i in range(64)]
    while h.aio_in_flight() > 0:
        h.poll(-1)
    bufs = {i: nbd.Buffer(BS) for i in range(64)}
    cookies = [h.aio_pread(bufs[i], i * BS) for i in range(64)]
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for c in cookies:
        assert h.aio_command_completed(c)
    assert all(bufs[i].to_bytearray() == payloads[i] for i in range(64))
    h.shutdown()


def test_flush_on_another_connection_makes_writes_durable(served: Server) -> None:
    writer, flusher = connect(served), connect(served)
    writer.pwrite(b"w" * (3 * BS), 5 * BS)
    writer.zero(BS, 9 * BS, nbd.CMD_FLAG_NO_HOLE)
    flusher.flush()  # CAN_MULTI_CONN: covers the other connection's completed writes
    served.proc.send_signal(signal.SIGKILL)  # no chance to commit anything more
    served.proc.wait()
    with Pool.open(served.pool) as pool:
        vol = pool.volume("disk")
        assert vol.read(5 * BS, 3 * BS) == b"w" * (3 * BS)
        assert vol.block_status(9 * BS, BS) == [(BS, BlockState.ZEROED)]


def test_read_only_server(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "8M")
    thinblock("volume", "create", pool, "disk", "--size", "8M")
    server = Server(pool, "--read-only")
    try:
        h = connect(server, strict=False)
        assert h.is_read_only()
        for call in (lambda: h.pwrite(b"x", 0), lambda: h.trim(BS, 0), lambda: h.zero(BS, 0)):
            with pytest.raises(nbd.Error) as info:
                call()
            assert info.value.errnum == errno.EPERM
        assert h.pread(BS, 0) == bytes(BS)
        h.shutdown()
    finally:
        server.stop()
