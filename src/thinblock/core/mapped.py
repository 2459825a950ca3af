"""The mapped entries of many mapping pages as numpy arrays: what check, dump and delta
walk, in O(mapped) with no Python object per entry.

Pages are decoded by core/mapping.py (the one codec, `mapped_pairs`: only a page's
mapped slots); this module gathers them, a batch of pages at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from thinblock.core.mapping import DBLOCK_SHIFT, PINNED, STATE_MASK, BlockState

# Pages decoded per numpy call: large enough that the per-call cost vanishes, small
# enough (16 MiB of entries) that sparse pages are dropped soon after decoding.
BATCH_PAGES = 4096


class Mapped(NamedTuple):
    """The nonzero entries of a sequence of pages, in page then slot order."""

    page: NDArray[np.intp]  # position of the entry's page in the sequence
    slot: NDArray[np.intp]
    entry: NDArray[np.uint64]

    @property
    def state(self) -> NDArray[np.uint64]:
        return self.entry & np.uint64(STATE_MASK)

    @property
    def dblock(self) -> NDArray[np.intp]:
        return (self.entry >> np.uint64(DBLOCK_SHIFT)).astype(np.intp)

    @property
    def pinned(self) -> NDArray[np.bool_]:
        pinned: NDArray[np.bool_] = (self.entry & np.uint64(PINNED)) != 0
        return pinned

    def valid(self) -> NDArray[np.bool_]:
        """Which entries are ones thinblock writes (mapping.entry_valid of each)."""
        state = self.state
        valid: NDArray[np.bool_] = (state == BlockState.ZEROED) | (state == BlockState.DATA)
        return valid

    def take(self, which: NDArray[np.bool_] | NDArray[np.intp]) -> Mapped:
        return Mapped(self.page[which], self.slot[which], self.entry[which])


def mapped_entries(pages: Iterable[tuple[array[int], array[int]]]) -> Mapped:
    """The mapped entries of pages given as core/mapping.py's mapped_pairs (slots, entries)
    of each: a sparse page costs its mapped entries, not PAGE_ENTRIES."""
    parts: list[Mapped] = []
    slots: list[bytes] = []
    entries: list[bytes] = []
    lengths: list[int] = []
    done = 0

    def flush() -> None:
        nonlocal done
        counts = np.array(lengths, dtype=np.intp)
        page = np.repeat(np.arange(done, done + len(lengths), dtype=np.intp), counts)
        slot = np.frombuffer(b"".join(slots), dtype=np.uint16).astype(np.intp)
        parts.append(Mapped(page, slot, np.frombuffer(b"".join(entries), dtype=np.uint64)))
        done += len(lengths)
        slots.clear()
        entries.clear()
        lengths.clear()

    for page_slots, page_entries in pages:
        slots.append(page_slots.tobytes())
        entries.append(page_entries.tobytes())
        lengths.append(len(page_entries))
        if len(lengths) == BATCH_PAGES:
            flush()
    if lengths:
        flush()
    if not parts:
        return Mapped(np.zeros(0, np.intp), np.zeros(0, np.intp), np.zeros(0, np.uint64))
    if len(parts) == 1:
        return parts[0]
    return Mapped(
        np.concatenate([p.page for p in parts]),
        np.concatenate([p.slot for p in parts]),
        np.concatenate([p.entry for p in parts]),
    )


def positions(sorted_ids: NDArray[np.int64], ids: NDArray[np.int64]) -> tuple[NDArray[np.intp], NDArray[np.bool_]]:
    """Where each of ids is in sorted_ids, and whether it is there at all."""
    if not len(sorted_ids):
        return np.zeros(len(ids), np.intp), np.zeros(len(ids), np.bool_)
    where = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return where.astype(np.intp), sorted_ids[where] == ids
