"""Reads over every layout a page's part can have, against a bytearray of what was written.

Volume._sparse_plan answers a page's part in one piece when it is all zeros or
all DATA on consecutive dblocks (Volume._uniform_run), and walks it block by
block otherwise; these layouts sit on both sides of that line: a copied block
in a contiguous run, a pinned block among unpinned ones, ZEROED beside
UNMAPPED, DATA beside ZEROED, reads across a page boundary and unaligned ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from thinblock import Pool
from thinblock.core.mapping import PAGE_ENTRIES
from thinblock.core.snapshot import create_snapshot

BS = 4096
PAGE_BYTES = PAGE_ENTRIES * BS  # 2 MiB
SIZE = 3 * PAGE_BYTES


def pattern(offset: int, length: int, salt: int) -> bytes:
    """Bytes that differ at every 4-byte word and from layout to layout."""
    words = range(offset // 4, (offset + length) // 4)
    return b"".join(((w * 2654435761 + salt) & 0xFFFFFFFF).to_bytes(4, "little") for w in words)


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    return Pool.create(str(tmp_path / "pool"), 4 * SIZE, block_size=BS)


def layout(pool: Pool, name: str) -> bytearray:
    """Write `name`'s layout into volume "v"; return the bytes it must read."""
    vol = pool.create_volume("v", SIZE)
    model = bytearray(SIZE)

    def write(offset: int, length: int, salt: int) -> None:
        data = pattern(offset, length, salt)
        vol.write(offset, data)
        model[offset : offset + length] = data

    if name == "contiguous":
        write(0, SIZE, 1)
    elif name == "one block copied":  # a snapshot shares the run; one block gets a new dblock
        write(0, SIZE, 1)
        create_snapshot(pool, "v", "snap")
        write(PAGE_BYTES + 7 * BS, BS, 2)
    elif name == "dblocks out of order":  # each block DATA, but the run is not one extent
        for vblock in reversed(range(2 * PAGE_ENTRIES)):
            write(vblock * BS, BS, 3)
    elif name == "pinned among unpinned":  # same dblocks, one entry has the pin bit
        write(0, SIZE, 1)
        vol.provision(PAGE_BYTES + 3 * BS, BS)
    elif name == "zeroed and unmapped":  # reads zeros throughout: provisioned beside holes
        vol.provision(PAGE_BYTES // 2, PAGE_BYTES)
    elif name == "data after zeroed":
        vol.provision(0, PAGE_BYTES)
        write(PAGE_BYTES // 2, 5 * BS, 4)
    elif name == "data then hole":  # a page whose first half is DATA and second half unmapped
        write(0, PAGE_BYTES // 2, 5)
        write(PAGE_BYTES + PAGE_BYTES // 2, PAGE_BYTES // 2, 6)
    else:
        raise AssertionError(name)
    pool.commit()
    return model


LAYOUTS = [
    "contiguous",
    "one block copied",
    "dblocks out of order",
    "pinned among unpinned",
    "zeroed and unmapped",
    "data after zeroed",
    "data then hole",
]
# (offset, length): whole pages, a page boundary in the middle, unaligned both ends, one block.
RANGES = [
    (0, SIZE),
    (0, PAGE_BYTES),
    (PAGE_BYTES - 5 * BS, 10 * BS),
    (PAGE_BYTES + 3 * BS + 100, 9 * BS - 200),
    (PAGE_BYTES // 2 - 1, 2 * BS + 2),
    (PAGE_BYTES + 7 * BS, BS),
]


@pytest.mark.parametrize("name", LAYOUTS)
def test_reads_match_what_was_written(pool: Pool, name: str) -> None:
    model = layout(pool, name)
    vol = pool.volume("v")
    for offset, length in RANGES:
        assert vol.read(offset, length) == bytes(model[offset : offset + length]), (name, offset, length)
        pieces = vol.read_sparse(offset, length)
        assert sum(n for _, n, _ in pieces) == length
        for off, n, data in pieces:
            expect = bytes(model[off : off + n])
            assert (data if data is not None else bytes(n)) == expect, (name, off, n)
            if data is None:  # a hole in read_sparse must really read zeros
                assert expect == bytes(n)
    for offset in range(0, SIZE, 1 << 20):  # sequential 1 MiB reads, as bench_scale's stream
        assert vol.read(offset, 1 << 20) == bytes(model[offset : offset + (1 << 20)])
    pool.close()


def test_a_contiguous_run_is_one_piece_and_zeros_one_hole(pool: Pool) -> None:
    """The read of a page's contiguous DATA is one extent below; a provisioned stretch one hole."""
    vol = pool.create_volume("v", SIZE)
    vol.write(0, pattern(0, PAGE_BYTES, 1))
    vol.provision(PAGE_BYTES, PAGE_BYTES)
    pool.commit()
    assert [(off, n) for off, n, _ in vol.read_sparse(0, PAGE_BYTES)] == [(0, PAGE_BYTES)]
    assert vol.read_sparse(PAGE_BYTES, SIZE - PAGE_BYTES) == [(PAGE_BYTES, SIZE - PAGE_BYTES, None)]
    pool.close()
