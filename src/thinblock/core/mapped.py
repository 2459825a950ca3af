"""The mapped entries of many mapping pages as numpy arrays: what check, dump and delta
walk, in O(mapped) with no Python object per entry.

Pages are decoded by core/mapping.py (the one codec); this module only gathers the
nonzero entries of the decoded pages, a batch of pages at a time so that a pool of
sparse pages (one mapped entry in each) never holds all of them decoded at once.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from thinblock.core.mapping import DBLOCK_SHIFT, PAGE_ENTRIES, PINNED, STATE_MASK, BlockState

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


def mapped_entries(pages: Iterable[array[int]]) -> Mapped:
    """The nonzero entries of decoded pages (arrays of PAGE_ENTRIES uint64 each)."""
    parts: list[Mapped] = []
    batch: list[array[int]] = []
    done = 0

    def flush() -> None:
        nonlocal done
        flat = np.frombuffer(b"".join(batch), dtype=np.uint64)
        at = np.flatnonzero(flat)
        parts.append(Mapped(at // PAGE_ENTRIES + done, at % PAGE_ENTRIES, flat[at]))
        done += len(batch)
        batch.clear()

    for entries in pages:
        batch.append(entries)
        if len(batch) == BATCH_PAGES:
            flush()
    if batch:
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
