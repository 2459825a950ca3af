"""Mapping entries and mapping pages: how a vblock points at a dblock.

A page maps PAGE_ENTRIES consecutive vblocks. Each entry is one uint64:
    dblock << 3 | PINNED(4) | state(0..2)
so the entry 0 is UNMAPPED, and a page of zeros maps nothing. Pages are
reference counted (a snapshot shares them); a dblock's refcount is the number
of distinct pages that point at it.
"""

from __future__ import annotations

import enum
from array import array

from thinblock.errors import CorruptionError

PAGE_ENTRIES = 512

STATE_MASK = 0b11
PINNED = 0b100
DBLOCK_SHIFT = 3


class BlockState(enum.IntEnum):
    """The three states of the block contract (docs/architecture.md)."""

    UNMAPPED = 0
    ZEROED = 1
    DATA = 2


def make_entry(dblock: int, state: int, pinned: bool | int = False) -> int:
    """The entry for a block in `state` on `dblock` (UNMAPPED is always 0)."""
    if state == BlockState.UNMAPPED:
        return 0
    return (dblock << DBLOCK_SHIFT) | (PINNED if pinned else 0) | state


def entry_state(entry: int) -> int:
    """The entry's BlockState, as an int (compare with BlockState members)."""
    return entry & STATE_MASK


def entry_dblock(entry: int) -> int:
    return entry >> DBLOCK_SHIFT


def entry_pinned(entry: int) -> bool:
    return bool(entry & PINNED)


def with_state(entry: int, state: int) -> int:
    """The same dblock and pin in another mapped state."""
    return (entry & ~STATE_MASK) | state


def entry_valid(entry: int) -> bool:
    """Whether an entry is one thinblock ever writes."""
    if entry == 0:
        return True
    return (entry & STATE_MASK) in (BlockState.ZEROED, BlockState.DATA)


class Page:
    """One mapping page: an id, a refcount (how many root tables hold it) and entries."""

    __slots__ = ("entries", "page_id", "refcount")

    def __init__(self, page_id: int, refcount: int, entries: array[int] | None = None) -> None:
        self.page_id = page_id
        self.refcount = refcount
        self.entries = entries if entries is not None else array("Q", bytes(8 * PAGE_ENTRIES))

    def is_empty(self) -> bool:
        return not any(self.entries)

    def to_blob(self) -> bytes:
        return self.entries.tobytes()

    @classmethod
    def from_blob(cls, page_id: int, refcount: int, blob: bytes) -> Page:
        entries = array("Q")
        if len(blob) != 8 * PAGE_ENTRIES:
            raise CorruptionError(f"mapping page {page_id} is {len(blob)} bytes, expected {8 * PAGE_ENTRIES}")
        entries.frombytes(blob)
        if len(entries) != PAGE_ENTRIES:
            raise CorruptionError(f"mapping page {page_id} has {len(entries)} entries, expected {PAGE_ENTRIES}")
        return cls(page_id, refcount, entries)
