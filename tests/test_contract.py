"""The block contract's corners, run against every backend (conftest.BACKENDS)."""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

import pytest

from tests.conftest import rados_objects, raw_store
from thinblock import BlockState, NoSpaceError, NotSupportedError, Pool, RangeError
from thinblock.backends import locate
from thinblock.store.file import FileStore
from thinblock.store.memory import MemoryStore
from thinblock.store.owned import RADOS_TAIL_OFFSET
from thinblock.store.rados import RadosStore
from thinblock.tools.check import check_metadata

BS = 64 << 10
U, Z, D = BlockState.UNMAPPED, BlockState.ZEROED, BlockState.DATA


def store_of(pool: Pool) -> FileStore | MemoryStore | RadosStore:
    inner = raw_store(pool)
    assert isinstance(inner, FileStore | MemoryStore | RadosStore)
    return inner


def is_device(pool: Pool) -> bool:
    store = store_of(pool)
    return isinstance(store, FileStore) and store.is_block_device


def allocated_bytes(pool: Pool) -> int:
    """Space the layer below really holds for the pool's blocks (sparse file, loop
    backing file, memory, RADOS objects), not for the owner tail past them
    (store/owned.py), whose birth table grows as blocks get owners."""
    store = store_of(pool)
    if isinstance(store, MemoryStore):
        return store.allocated_bytes(pool.size_bytes)
    if isinstance(store, RadosStore):  # the test pools have one block per object
        tail = RADOS_TAIL_OFFSET // pool.block_size
        names = [o for o in rados_objects(store.prefix + ".") if int(o.rsplit(".", 1)[1], 16) < tail]
        return sum(store.io.stat(name)[0] for name in names)
    path = store.path
    if path.startswith("/dev/"):
        path = Path(f"/sys/block/{os.path.basename(path)}/loop/backing_file").read_text().strip()
    return data_extent_bytes(path, pool.size_bytes)


FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_HEAD = struct.Struct("=QQIIII")  # start, length, flags, mapped, count, reserved
_FIEMAP_EXTENT = struct.Struct("=QQQ16xI12x")  # logical, physical, length, flags
_FIEMAP_LAST = 0x1
_FIEMAP_BATCH = 256


def data_extent_bytes(path: str, end: int) -> int:
    """Bytes of a file's allocated extents (written or preallocated, FIEMAP) below end."""
    total, pos = 0, 0
    with open(path, "rb") as f:
        while pos < end:
            buf = bytearray(_FIEMAP_HEAD.pack(pos, end - pos, 0, 0, _FIEMAP_BATCH, 0))
            buf += bytes(_FIEMAP_EXTENT.size * _FIEMAP_BATCH)
            fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
            mapped = _FIEMAP_HEAD.unpack_from(buf)[3]
            if not mapped:
                break
            for i in range(mapped):
                logical, _physical, length, flags = _FIEMAP_EXTENT.unpack_from(
                    buf, _FIEMAP_HEAD.size + i * _FIEMAP_EXTENT.size
                )
                total += max(0, min(logical + length, end) - max(logical, pos))
                pos = logical + length
                if flags & _FIEMAP_LAST:
                    return total
    return total


def check_ok(pool: Pool) -> None:
    pool.commit()
    meta = locate(pool.path).open_meta(readonly=True)
    try:
        assert check_metadata(meta) == []
    finally:
        meta.close()


def test_zero_write_to_unmapped_is_free(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    before = allocated_bytes(pool)
    vol.write(0, bytes(4 << 20))
    pool.commit()
    assert vol.block_status(0, 4 << 20) == [(4 << 20, U)]
    assert pool.status()["used_bytes"] == 0
    assert allocated_bytes(pool) == before


def test_detect_zeroes_off_writes_zeros(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30, detect_zeroes="off")
    vol.write(0, bytes(BS))
    assert vol.block_status(0, BS) == [(BS, D)]


def test_partial_write_allocates_one_block_reading_zero_elsewhere(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 20)
    vol.write(BS + 100, b"abc")
    assert vol.read(BS, BS) == bytes(100) + b"abc" + bytes(BS - 103)
    assert vol.block_status(0, 3 * BS) == [(BS, U), (BS, D), (BS, U)]
    assert pool.status()["used_bytes"] == BS


def test_no_stale_bytes_after_zeroing_then_partial_write(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 20)
    vol.write(0, b"\xff" * BS)
    vol.write_zeroes(0, BS, no_hole=True)  # DATA -> ZEROED keeps the dblock (and its old bytes)
    assert vol.block_status(0, BS) == [(BS, Z)]
    vol.write(10, b"x")
    assert vol.read(0, BS) == bytes(10) + b"x" + bytes(BS - 11)


def test_no_stale_bytes_after_zero_payload_then_partial_write(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 20)
    vol.write(0, b"\xee" * BS)
    vol.write(0, bytes(BS))  # detect_zeroes=on: DATA -> ZEROED on the same dblock
    assert vol.block_status(0, BS) == [(BS, Z)]
    vol.write(100, b"y")
    assert vol.read(0, BS) == bytes(100) + b"y" + bytes(BS - 101)


def test_freed_blocks_wait_for_a_durable_punch(pool: Pool) -> None:
    """A freed block is reused only after the commit that freed it and a data sync."""
    vol = pool.create_volume("v", 1 << 30)
    vol.write(0, b"A" * BS)
    pool.commit()
    first = vol._entry(0) >> 3
    vol.trim(0, BS)
    pool.commit()  # the punch happens after this commit, and is not durable yet
    assert first in pool.accounts.space.unsynced_free
    vol.write(BS, b"B" * BS)
    assert vol._entry(1) >> 3 != first
    pool.commit()  # data sync: now it may be reused
    assert first not in pool.accounts.space.unsynced_free and pool.accounts.space.busy[first] == 0


def test_zero_payload_over_data(pool: Pool) -> None:
    on = pool.create_volume("on", 1 << 20)
    unmap = pool.create_volume("unmap", 1 << 20, detect_zeroes="unmap")
    for vol in (on, unmap):
        vol.write(0, b"\x01" * 2 * BS)
        vol.provision(BS, BS)
        vol.write(0, bytes(2 * BS))
        vol.write(2 * BS, b"\x01" * 10)
        vol.write(2 * BS, bytes(10))  # partial zero write over DATA: zeroed in place
    assert on.block_status(0, 3 * BS) == [(2 * BS, Z), (BS, D)]
    # unmap releases the block, never one that was provisioned
    assert unmap.block_status(0, 3 * BS) == [(BS, U), (BS, Z), (BS, D)]
    assert unmap.read(0, 3 * BS) == bytes(3 * BS)


def test_trim_returns_space_to_pool_and_layer_below(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    vol.write(0, os.urandom(8 * BS))
    pool.commit()
    full = allocated_bytes(pool)
    vol.trim(BS // 2, 7 * BS)  # partial first and last blocks are zeroed in place
    assert vol.block_status(0, 8 * BS) == [(BS, D), (6 * BS, U), (BS, D)]
    assert vol.read(BS // 2, 7 * BS) == bytes(7 * BS)
    pool.commit()
    assert pool.status()["used_bytes"] == 2 * BS
    if store_of(pool).capabilities()["punch"].value == "native":
        assert allocated_bytes(pool) <= full - 6 * BS
    check_ok(pool)


def test_freed_block_not_reused_before_commit(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    vol.write(0, b"A" * BS)
    pool.commit()
    first = vol._entry(0) >> 3
    vol.trim(0, BS)
    vol.write(BS, b"B" * BS)
    assert vol._entry(1) >> 3 != first, "a block freed in the open transaction was reused"
    # The committed metadata still maps the old data, and the data store still holds it.
    assert store_of(pool).pread(first * BS, 4) == b"AAAA"
    pool.commit()


def test_write_zeroes_modes(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    vol.write(0, os.urandom(4 * BS))
    vol.write_zeroes(0, 2 * BS)
    vol.write_zeroes(2 * BS, 2 * BS, no_hole=True)
    vol.write_zeroes(8 * BS, 2 * BS, no_hole=True)
    assert vol.block_status(0, 10 * BS) == [(2 * BS, U), (2 * BS, Z), (4 * BS, U), (2 * BS, Z)]
    assert vol.read(0, 10 * BS) == bytes(10 * BS)
    assert pool.volume_info(vol)["provisioned_bytes"] == pool.status()["provisioned_bytes"] == 4 * BS


def test_fast_zero_fails_without_change(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    data = os.urandom(3 * BS)
    vol.write(0, data)
    with pytest.raises(NotSupportedError) as info:
        vol.write_zeroes(BS // 2, 2 * BS, fast=True)
    assert info.value.errno == errno.ENOTSUP
    assert vol.read(0, 3 * BS) == data
    vol.write_zeroes(0, 2 * BS, fast=True)  # whole blocks: metadata only, allowed
    assert vol.block_status(0, 3 * BS) == [(2 * BS, U), (BS, D)]


def test_provision_reserves_and_is_all_or_nothing(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 40)
    total = pool.status()["size_bytes"]
    before = allocated_bytes(pool)
    vol.provision(0, total // 2)
    assert vol.block_status(0, total // 2) == [(total // 2, Z)]
    store = store_of(pool)
    if store.capabilities()["preallocate"].value == "native" and store.reserves_space and not is_device(pool):
        assert allocated_bytes(pool) >= before + total // 2
    used = pool.status()["used_bytes"]
    with pytest.raises(NoSpaceError):
        vol.provision(total, total)  # more than is free: nothing may change
    assert pool.status()["used_bytes"] == used
    assert vol.block_status(total, total) == [(total, U)]
    with pytest.raises(NoSpaceError):
        vol.provision(0, 1 << 40)  # a huge range is refused at once
    vol.write(0, b"still works")
    check_ok(pool)


def test_enospc_is_a_result_and_growth_cures_it(pool: Pool) -> None:
    a = pool.create_volume("a", 1 << 30)
    b = pool.create_volume("b", 1 << 30)
    n = pool.status()["size_bytes"] // BS
    a.write(0, b"\x07" * (n - 1) * BS)
    with pytest.raises(NoSpaceError) as info:
        b.write(0, b"\x08" * 2 * BS)
    assert info.value.errno == errno.ENOSPC
    assert b.block_status(0, 2 * BS) == [(2 * BS, U)]
    # Writes into allocated space still succeed on a full pool.
    a.write(0, b"\x09" * BS)
    b.write(0, b"\x08" * BS)  # the last free block
    with pytest.raises(NoSpaceError):
        b.write(BS, b"\x08")
    pool.grow(pool.size_bytes + 4 * BS)
    b.write(BS, b"\x08" * BS)
    assert b.read(0, 2 * BS) == b"\x08" * 2 * BS
    check_ok(pool)


def test_space_freed_in_open_transaction_serves_a_full_pool(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    n = pool.status()["size_bytes"] // BS
    vol.write(0, b"\x01" * n * BS)
    vol.trim(0, BS)
    vol.write(n * BS, b"\x02" * BS)  # needs the block freed above: a commit makes it usable
    assert vol.read(n * BS, BS) == b"\x02" * BS


def test_range_errors_change_nothing(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 20)
    for call in (
        lambda: vol.write((1 << 20) - 1, b"ab"),
        lambda: vol.read(1 << 20, 1),
        lambda: vol.trim(-1, 10),
        lambda: vol.provision(0, (1 << 20) + 1),
        lambda: vol.block_status(0, (1 << 20) + 1),
    ):
        with pytest.raises(RangeError):
            call()
    assert pool.status()["used_bytes"] == 0


def test_petabyte_volume_is_cheap(pool: Pool) -> None:
    size = 1 << 50
    vol = pool.create_volume("huge", size)
    vol.write(size - 4096, b"end")
    vol.write(0, b"start")
    assert vol.read(size - 4096, 3) == b"end"
    status = vol.block_status(0, size)
    assert status[0] == (BS, D) and status[-1] == (BS, D) and len(status) == 3
    vol.trim(0, size)
    assert vol.block_status(0, size) == [(size, U)]
    pool.resize_volume("huge", size // 2, allow_shrink=True)
    check_ok(pool)


def test_resize_shrink_then_grow_reads_zero(pool: Pool) -> None:
    vol = pool.create_volume("v", 4 * BS)
    vol.write(0, b"\x05" * 4 * BS)
    pool.resize_volume("v", BS + 512, allow_shrink=True)
    assert pool.status()["used_bytes"] == 2 * BS
    pool.resize_volume("v", 4 * BS)
    assert vol.read(0, 4 * BS) == b"\x05" * (BS + 512) + bytes(3 * BS - 512)
    check_ok(pool)


def test_remove_volume_frees_and_punches(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    vol.write(0, os.urandom(16 * BS))
    pool.commit()
    full = allocated_bytes(pool)
    pool.remove_volume("v")
    assert pool.status()["used_bytes"] == 0
    if store_of(pool).capabilities()["punch"].value == "native":
        assert allocated_bytes(pool) <= full - 16 * BS
    check_ok(pool)


def test_reopen_keeps_everything(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 30)
    data = os.urandom(3 * BS + 7)
    vol.write(12345, data)
    vol.provision(10 * BS, BS)
    path = pool.path
    status = pool.status()
    pool.close()
    again = Pool.open(path)
    try:
        assert {**again.status(), "host_free_bytes": 0} == {**status, "host_free_bytes": 0}
        assert again.volume("v").read(12345, len(data)) == data
        assert again.volume("v").block_status(10 * BS, BS) == [(BS, Z)]
    finally:
        again.close()
    pool.close()  # idempotent


def test_data_store_contract(pool: Pool) -> None:
    """The data-store verbs themselves, through the emulation filter."""
    store = pool.store
    store.pwritev(0, [b"ab", memoryview(b"cd"), b"\xff" * (BS - 4)])
    assert store.pread(0, 4) == b"abcd"
    store.punch(0, BS)
    assert store.pread(0, BS) == bytes(BS)
    store.pwritev(BS, [b"\xee" * BS])
    store.zero(BS, BS)
    assert store.pread(BS, BS) == bytes(BS)
    store.preallocate(2 * BS, BS)
    store.flush()
    support = store.capabilities()
    assert set(support) == {"punch", "zero", "preallocate"}


def _crash(pool: Pool) -> None:
    """Abandon a pool as SIGKILL would: no commit, no clean flag (the page cache survives)."""
    pool.committer.closed.set()
    if pool.committer._thread is not None:
        pool.committer._thread.join()
    pool.meta.close()
    pool.store.close()
    pool._ownership.release()


def test_recovery_restores_zero_rules_after_a_crash(pool: Pool) -> None:
    vol = pool.create_volume("v", 1 << 20)
    vol.provision(0, 2 * BS)  # two ZEROED blocks, committed below
    pool.commit()
    vol.write(10, b"\x15" * 100)  # ZEROED -> DATA, never committed
    vol.write(2 * BS + 10, b"\x16" * 100)  # a fresh block, never committed
    _crash(pool)
    again = Pool.open(pool.path)
    try:
        vol = again.volume("v")
        assert vol.block_status(0, 3 * BS) == [(2 * BS, Z), (BS, U)]
        assert vol.read(0, 3 * BS) == bytes(3 * BS)
        vol.write(BS // 2, b"x")  # partial writes into the recovered blocks show no old bytes
        vol.write(2 * BS + BS // 2, b"y")
        assert vol.read(0, BS) == bytes(BS // 2) + b"x" + bytes(BS // 2 - 1)
        assert vol.read(2 * BS, BS) == bytes(BS // 2) + b"y" + bytes(BS // 2 - 1)
    finally:
        again.close()
