"""The allocator's busy map built at open (spacemap.busy_map) against its definition:
a block is busy when its refcount is nonzero, whichever of the count's bytes holds it."""

from __future__ import annotations

from array import array
from pathlib import Path

from thinblock import Pool
from thinblock.core.snapshot import create_snapshot
from thinblock.core.spacemap import REFCOUNT_PAGE_ENTRIES, SpaceMap, busy_map


def test_busy_map_is_nonzero_refcounts() -> None:
    counts = array("I", [0, 1, 255, 256, 65536, 1 << 24, 0xFFFFFFFF, 0, 0x01000001, 2] * 300)
    assert busy_map(counts) == bytearray(1 if c else 0 for c in counts)
    assert busy_map(array("I")) == bytearray()


def test_space_map_from_pages_counts_every_referenced_block() -> None:
    n = 3 * REFCOUNT_PAGE_ENTRIES + 5  # the last page is partial
    page1 = array("I", bytes(4 * REFCOUNT_PAGE_ENTRIES))
    page1[0], page1[7], page1[1023] = 256, 1 << 16, 1 << 24
    page3 = array("I", bytes(4 * REFCOUNT_PAGE_ENTRIES))
    page3[4] = 3
    space = SpaceMap(n, {1: page1.tobytes(), 3: page3.tobytes()})
    busy = [d for d in range(n) if space.busy[d]]
    assert busy == [1024, 1031, 2047, 3 * 1024 + 4]
    assert space.used_blocks == 4
    assert space.allocate(2) == [0, 1]  # the allocator starts at the first free block


def test_a_reopened_pool_counts_what_it_used(tmp_path: Path) -> None:
    pool = Pool.create(str(tmp_path / "pool"), 8 << 20, block_size=4096)
    vol = pool.create_volume("v", 4 << 20)
    vol.write(0, b"\x01" * (1 << 20))
    create_snapshot(pool, "v", "s")
    vol.write(4096, b"\x02" * 4096)  # copied: one more block
    used = pool.accounts.space.used_blocks
    pool.close()
    pool = Pool.open(str(tmp_path / "pool"))
    try:
        assert pool.accounts.space.used_blocks == used == 257
        assert pool.accounts.space.busy.count(1) == used
    finally:
        pool.close()
